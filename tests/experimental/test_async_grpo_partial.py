"""AsyncGRPO partial rollouts, rollout_func and streaming datasets over loopback (a ``posttrain serve`` server in a
thread, the rollout worker a spawned process).

Long-tailed completion lengths come from a wide stop set (``generation_kwargs={"eos_token_id": [...]}``: ~40 of the
tiny byte vocabulary's ids end a completion), so groups finish after very different numbers of passes."""

from __future__ import annotations

import json

import pytest
import torch
from async_partial_helpers import length_reward, server_rollout_func, step_seen_reward
from datasets import Dataset
from transformers import TrainerCallback

from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

pytestmark = pytest.mark.usefixtures("no_leaked_children")

STOP_IDS = list(range(97, 123)) + list(range(48, 62))  # a-z and 0-9 (+ a few): about 15% of samples stop

COMMON = dict(
    report_to="none", logging_steps=1, gradient_checkpointing=False, write_report=False, disable_tqdm=True,
    per_device_train_batch_size=4, num_generations=2, max_completion_length=12, learning_rate=5e-2, seed=7,
    temperature=0.9, lr_scheduler_type="constant", use_vllm=True, vllm_mode="server",
    generation_kwargs={"eos_token_id": STOP_IDS},
)  # fmt: skip


def _dataset(n: int = 16) -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(n)])


def _args(path, url, **overrides):
    from posttrain.experimental.async_grpo import AsyncGRPOConfig

    values = dict(COMMON, output_dir=str(path), vllm_server_base_url=url, save_strategy="no", max_steps=4)
    values.update(overrides)
    return AsyncGRPOConfig(**values)


@pytest.fixture()
def server(tiny_model_path):
    with serve_in_thread(PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")) as url:
        yield url


class _WeightsPerVersion(TrainerCallback):
    """The policy's weights as pushed with each version (version = global_step after the optimizer step)."""

    def __init__(self, model):
        self.weights = {0: {k: v.detach().clone() for k, v in model.state_dict().items()}}

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _capture_batches(trainer) -> list[dict]:
    """Wrap the consume-time scoring so each trained round's batch (as the loss gets it) is kept."""
    batches: list[dict] = []
    score = trainer.async_rollout.score

    def capture(batch, record):
        batches.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
        return score(batch, record)

    trainer.async_rollout.score = capture
    return batches


def _sampler_logps(model, weights, prompt, completion, temperature):
    """Log-probs of ``completion`` after ``prompt`` under ``weights`` at ``temperature`` (the server's sampling
    distribution: no top-k / top-p here)."""
    model.load_state_dict(weights)
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)


@pytest.mark.slow
def test_partial_rollouts_per_token_versions_staleness_and_is(tiny_model_path, server, tmp_path):
    """max_inflight_tasks=1 (the worker never runs ahead of the weights): passes for round r run under version r,
    so a group cut before round r was emitted continues under version r + 1 — mixed versions. Asserted from the
    logged per-token versions: no trained token is older than max_staleness versions; some completion has tokens of
    two versions; every token's sampling log-prob is the one of the weights of *its* version (the IS correction's
    per-token denominator); the version-lag metrics are logged."""
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    args = _args(tmp_path / "partial", server, partial_rollout_max_tokens=3, max_staleness=2, max_inflight_tasks=1,
                 max_steps=5)  # fmt: skip
    trainer = AsyncGRPOTrainer(tiny_model_path, length_reward, args, train_dataset=_dataset())
    versions_cb = _WeightsPerVersion(trainer.model)
    trainer.add_callback(versions_cb)
    batches = _capture_batches(trainer)
    trainer.train()

    rounds = trainer.async_rollout.trained_rounds
    assert len(rounds) == len(batches) == 5
    mixed = 0
    for entry in rounds:
        step = entry["step"]
        for row in entry["token_versions"]:
            assert row and all(0 <= step - v <= args.max_staleness for v in row), (step, row)
            mixed += len(set(row)) > 1
        assert entry["lag_max"] <= args.max_staleness
    assert mixed > 0, "no completion was continued under newer weights"
    # per-token provenance of the sampling log-probs (the IS ratio's denominator), checked on the continued rows
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path).eval()
    checked = 0
    for entry, batch in zip(rounds, batches):
        for i, versions in enumerate(entry["token_versions"]):
            if len(set(versions)) == 1:
                continue
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
            completion = batch["completion_ids"][i][: len(versions)].tolist()
            sampled = batch["sampling_per_token_logps"][i][: len(versions)]
            for version in set(versions):
                expected = _sampler_logps(model, versions_cb.weights[version], prompt, completion, args.temperature)
                at = torch.tensor([v == version for v in versions])
                torch.testing.assert_close(sampled[at], expected[at], atol=2e-4, rtol=0)
            checked += 1
    assert checked == mixed
    logs = {k for entry in trainer.state.log_history for k in entry}
    for key in ("sample/staleness_mean", "sample/staleness_max", "sample/version_lag_frac/0",
                "sample/version_lag_frac/1", "sample/version_lag_frac/2", "rollout/partial_continued_frac",
                "rollout/partial_passes", "rollout/partial_regenerated_groups_total", "sample/dropped_stale_total"):  # fmt: skip
        assert key in logs, key
    for entry in trainer.state.log_history:
        if "sample/staleness_max" in entry:
            assert entry["sample/staleness_max"] <= args.max_staleness
            fracs = [entry[f"sample/version_lag_frac/{k}"] for k in range(args.max_staleness + 1)]
            assert sum(fracs) == pytest.approx(1.0)


@pytest.mark.slow
def test_cut_round_trains_finished_groups_at_once(tiny_model_path, server, tmp_path):
    """The first round trains while groups cut in its passes are still in flight (logged by the worker): its finished
    groups did not wait for them; every token of round 0 was sampled by version 0."""
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    args = _args(tmp_path / "cut", server, partial_rollout_max_tokens=2, max_staleness=3, max_inflight_tasks=1,
                 max_steps=3)  # fmt: skip
    trainer = AsyncGRPOTrainer(tiny_model_path, length_reward, args, train_dataset=_dataset())
    batches = _capture_batches(trainer)
    trainer.train()
    first = trainer.async_rollout.trained_rounds[0]
    # all of round 0's tokens were sampled by version 0, yet the worker's in-flight pool was not empty when it was
    # emitted (logged): the round was cut and its finished groups trained at once
    assert {v for row in first["token_versions"] for v in row} == {0}
    logs = [e for e in trainer.state.log_history if "rollout/partial_inflight_groups" in e]
    assert logs[0]["rollout/partial_inflight_groups"] >= 1
    assert len(batches) == 3


@pytest.mark.slow
def test_partial_resume_regenerates_in_flight_groups(tiny_model_path, server, tmp_path):
    """A checkpoint stores which groups were consumed; the resumed worker skips them and regenerates the ones that
    were in flight from the restored weights (partial completions are not saved): across both runs every group is
    trained at most once, and the resumed run starts at the first group the stopped run had not consumed."""
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    out = tmp_path / "resume"
    kwargs = dict(partial_rollout_max_tokens=2, max_staleness=2, max_inflight_tasks=1)
    first = AsyncGRPOTrainer(tiny_model_path, length_reward,
                             _args(out, server, max_steps=2, save_strategy="steps", save_steps=2, **kwargs),
                             train_dataset=_dataset())  # fmt: skip
    batches = _capture_batches(first)
    first.train()
    assert len(batches) == 2
    state = json.loads((out / "checkpoint-2" / "rollout_state.json").read_text())
    trained_first = [g for e in first.async_rollout.trained_rounds for g in e["groups"]]
    next_group = state["partial_next_group"]
    assert next_group == min(set(range(max(trained_first) + 2)) - set(trained_first))
    assert state["partial_consumed_groups"] == sorted(g for g in trained_first if g > next_group)

    resumed = AsyncGRPOTrainer(tiny_model_path, length_reward, _args(out, server, max_steps=4, **kwargs),
                               train_dataset=_dataset())  # fmt: skip
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    trained_second = [g for e in resumed.async_rollout.trained_rounds for g in e["groups"]]
    assert len(resumed.async_rollout.trained_rounds) == 2
    assert not set(trained_first) & set(trained_second)
    assert len(set(trained_second)) == len(trained_second)
    # groups were in flight (cut, partially generated) when the run stopped ...
    inflight = [e["rollout/partial_inflight_groups"] for e in first.state.log_history if "rollout/partial_passes" in e]
    assert inflight[-1] >= 1
    # ... the resumed run starts at the first group not consumed, and none of its tokens predates the checkpoint's
    # weights (version 2): partial completions are regenerated, not restored
    assert next_group in trained_second
    assert all(v >= 2 for e in resumed.async_rollout.trained_rounds for row in e["token_versions"] for v in row)


def test_partial_rollout_config_errors(tmp_path):
    from posttrain.experimental.async_grpo import AsyncGRPOConfig

    base = dict(output_dir=str(tmp_path), report_to="none", max_completion_length=16)
    with pytest.raises(ValueError, match="no completion would ever be cut"):
        AsyncGRPOConfig(**base, partial_rollout_max_tokens=16)
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        AsyncGRPOConfig(**base, partial_rollout_max_tokens=4, max_staleness=0)
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="positive integer"):
            AsyncGRPOConfig(**base, partial_rollout_max_tokens=bad)
    assert AsyncGRPOConfig(**base).partial_rollout_max_tokens is None
    assert AsyncGRPOConfig(**base, partial_rollout_max_tokens=4).partial_rollout_max_tokens == 4


def test_partial_rollouts_refuse_rollout_func_and_tools(tiny_model_path, server, tmp_path):
    from async_grpo_helpers import add

    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    args = _args(tmp_path, server, partial_rollout_max_tokens=3)
    with pytest.raises(ValueError, match="partial_rollout_max_tokens cannot be combined with rollout_func"):
        AsyncGRPOTrainer(tiny_model_path, step_seen_reward, args, train_dataset=_dataset(),
                         rollout_func=server_rollout_func)  # fmt: skip
    with pytest.raises(ValueError, match="cannot be combined with tools"):
        AsyncGRPOTrainer(tiny_model_path, length_reward, args, train_dataset=_dataset(), tools=[add])


@pytest.mark.slow
def test_rollout_func_runs_in_the_worker(tiny_model_path, server, tmp_path):
    """A rollout_func generates each round in the worker through the server backend (WorkerTrainerView): its extra
    column reaches the reward function, the rounds carry the server's version, and training moves the weights."""
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(tiny_model_path, step_seen_reward, _args(tmp_path, server, max_steps=3),
                               train_dataset=_dataset(), rollout_func=server_rollout_func)  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    rounds = trainer.async_rollout.trained_rounds
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert all(0 <= r["staleness"] <= trainer.args.max_staleness for r in rounds)
    rewards = [
        e["rewards/step_seen_reward/mean"] for e in trainer.state.log_history if "rewards/step_seen_reward/mean" in e
    ]
    assert len(rewards) == 3
    # the reward is the step the function saw (+ a small length term): the round's version, give or take the one
    # optimizer step that can complete while the function runs (the worker reads global_step after its generate;
    # the weight push of step v lands before the trainer's global_step reads v) — on a loaded machine both happen
    for r, reward in zip(rounds, rewards):
        assert abs(int(reward) - r["version"]) <= 1, (reward, r)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


@pytest.mark.slow
def test_streaming_dataset_trains_and_resumes(tiny_model_path, server, tmp_path):
    """An IterableDataset: the worker reads rounds from the stream in order; a run resumed from step 1 re-reads the
    stream, skips round 0 and trains rounds 1 and 2 (the same prompts as an uninterrupted run)."""
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    stream = _dataset(12).to_iterable_dataset()

    full = AsyncGRPOTrainer(tiny_model_path, length_reward,
                            _args(tmp_path / "full", server, max_steps=3, log_completions=True, max_staleness=0),
                            train_dataset=stream)  # fmt: skip
    full.train()
    assert [r["round"] for r in full.async_rollout.trained_rounds] == [0, 1, 2]

    out = tmp_path / "resumed"
    first = AsyncGRPOTrainer(tiny_model_path, length_reward,
                             _args(out, server, max_steps=1, save_strategy="steps", save_steps=1, max_staleness=0),
                             train_dataset=stream)  # fmt: skip
    first.train()
    resumed = AsyncGRPOTrainer(tiny_model_path, length_reward, _args(out, server, max_steps=3, max_staleness=0),
                               train_dataset=stream)  # fmt: skip
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert [r["round"] for r in resumed.async_rollout.trained_rounds] == [1, 2]
    # max_staleness=0 and the same request seeds: the resumed run ends at the uninterrupted run's parameters
    for (name, value), (_, expected) in zip(resumed.model.named_parameters(), full.model.named_parameters()):
        torch.testing.assert_close(value, expected, atol=0, rtol=0, msg=name)


@pytest.mark.slow
def test_partial_rollouts_on_a_streaming_dataset(tiny_model_path, server, tmp_path):
    """Partial rollouts pick groups from a stream in order (regenerated groups keep their rows): every trained group
    is a distinct ordinal and its rows are the stream's prompts of that ordinal."""
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    rows = [{"prompt": f"Question {i}:"} for i in range(12)]
    stream = Dataset.from_list(rows).to_iterable_dataset()
    args = _args(tmp_path, server, partial_rollout_max_tokens=3, max_staleness=2, max_inflight_tasks=1, max_steps=3,
                 shuffle_dataset=False, log_completions=True)  # fmt: skip
    trainer = AsyncGRPOTrainer(tiny_model_path, length_reward, args, train_dataset=stream)
    batches = _capture_batches(trainer)
    trainer.train()
    groups = [g for e in trainer.async_rollout.trained_rounds for g in e["groups"]]
    assert len(groups) == len(set(groups)) == 6
    tokenizer = trainer.processing_class
    for entry, batch in zip(trainer.async_rollout.trained_rounds, batches):
        for position, ordinal in enumerate(entry["groups"]):
            for row in (2 * position, 2 * position + 1):  # G = 2 rows per group
                prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
                assert tokenizer.decode(prompt) == rows[ordinal]["prompt"]



def test_several_processes_refuse_partial_rollouts_rollout_func_and_streams():
    """The worker's per-rank shards are built from whole rounds of a map-style dataset: with several training
    processes these three options are refused, naming the option (2-process runs: test_async_multiprocess.py)."""
    from types import SimpleNamespace

    from posttrain.experimental.async_grpo.async_grpo_trainer import check_several_processes

    plain, partial = SimpleNamespace(partial_rollout_max_tokens=None), SimpleNamespace(partial_rollout_max_tokens=3)
    check_several_processes(2, plain, None, _dataset())  # whole rounds of a map-style dataset: fine
    check_several_processes(1, partial, server_rollout_func, _dataset().to_iterable_dataset())  # one process: fine
    cases = [
        ((partial, None, _dataset()), "partial_rollout_max_tokens"),
        ((plain, server_rollout_func, _dataset()), "rollout_func"),
        ((plain, None, _dataset().to_iterable_dataset()), "a streaming train_dataset"),
    ]
    for arguments, option in cases:
        with pytest.raises(ValueError, match=f"AsyncGRPO with 2 training processes does not support {option}"):
            check_several_processes(2, *arguments)
    with pytest.raises(ValueError, match="does not support image rows"):
        check_several_processes(2, plain, None, _dataset(), images=True)
