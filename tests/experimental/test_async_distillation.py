"""AsyncDistillationTrainer over loopback: the student's and the teacher's ``posttrain serve`` in threads, the rollout
worker a spawned process (the shared ``posttrain.rollout.async_worker``, also AsyncGRPO's).

Every test checks that no child process is left (the trainer joins its worker in ``train``'s ``finally``)."""

from __future__ import annotations

import json
import queue
import re

import pytest
import torch
from datasets import Dataset
from distill_helpers import prompts, sampled_reverse_kl, served_loss_batch
from trainer_helpers import fast_config

from posttrain.core.distill import sparse_support_divergence

pytestmark = pytest.mark.usefixtures("no_leaked_children")

pytest.importorskip("fastapi")

COMMON = dict(per_device_train_batch_size=4, max_completion_length=6, learning_rate=5e-2, seed=7, temperature=0.9,
              teacher_temperature=0.9, lr_scheduler_type="constant")  # fmt: skip


def _api():
    """The package, imported in each test (not at collection): test_async_grpo re-imports posttrain.experimental
    for its notice test, and the worker spec pickles by reference to the class ``sys.modules`` holds."""
    import posttrain.experimental.async_distillation as api
    import posttrain.experimental.async_distillation.rollout_worker as worker

    api.worker = worker
    return api


@pytest.fixture(scope="module")
def teacher_url(abc_teacher_path):
    from posttrain.serving.app import serve_in_thread
    from posttrain.serving.engine import PosttrainEngine

    with serve_in_thread(PosttrainEngine.from_pretrained(abc_teacher_path, device="cpu")) as url:
        yield url


@pytest.fixture()
def student_url(tiny_model_path):
    """The student's server (a fresh engine per test: each run pushes its own weights and versions)."""
    from posttrain.serving.app import serve_in_thread
    from posttrain.serving.engine import PosttrainEngine

    with serve_in_thread(PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")) as url:
        yield url


def _args(path, student, teacher=None, **overrides):
    values = dict(COMMON, vllm_server_base_url=student, max_steps=3)
    if teacher is not None:
        values["teacher_server_urls"] = {"default": teacher}
    return fast_config(_api().AsyncDistillationConfig, path, **{**values, **overrides})


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _local_log_probs(model, batch, vocab, temperature):
    rows = []
    for i in range(batch["prompt_ids"].shape[0]):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        n = int(batch["completion_lengths"][i])
        ids = torch.cat([prompt, batch["completion_ids"][i, :n]])[None]
        rows.append(torch.log_softmax(model(ids).logits[0, -n - 1 : -1, :vocab].float() / temperature, -1))
    return torch.cat(rows)


# -- config ------------------------------------------------------------------------------------------------------


def test_config_has_trls_defaults_and_checks(tmp_path):
    args = _api().AsyncDistillationConfig(output_dir=str(tmp_path), report_to="none")
    assert (args.max_staleness, args.weight_sync_steps, args.max_inflight_tasks) == (4, 1, -1)
    assert args.queue_maxsize == 1024
    assert args.teacher_server_urls == {"default": "http://localhost:8001"}
    assert (args.teacher_top_k, args.teacher_temperature, args.add_tail_bucket, args.beta) == (8, 1.0, True, 0.0)
    assert (args.learning_rate, args.logging_steps, args.max_completion_length) == (1e-6, 1, 2048)
    assert args.dtype == "float32"
    assert (args.request_timeout, args.weight_sync_timeout, args.heartbeat_stale_after_s) == (600, 1800, 300.0)
    assert (args.temperature, args.top_p, args.top_k, args.min_p, args.repetition_penalty) == (1.0, 1.0, 0, None, 1.0)
    assert args.vllm_server_base_url == "http://localhost:8000" and args.use_vllm and args.vllm_mode == "server"
    assert args.ignore_data_skip and args.num_completions_to_print is None and args.log_completions_steps == 100
    assert (args.loss_top_k, args.loss_add_tail) == (8, True)  # the served loss's names
    parsed = _api().AsyncDistillationConfig(output_dir=str(tmp_path), report_to="none",
                                     teacher_server_urls='{"math": "http://m:1", "code": "http://c:2"}')  # fmt: skip
    assert parsed.teacher_server_urls == {"math": "http://m:1", "code": "http://c:2"}
    for bad, match in [(dict(lmbda=0.5), "lmbda=1.0"), (dict(use_vllm=False), "vllm_mode='server'"),
                       (dict(max_staleness=0, weight_sync_steps=2), "weight_sync_steps - 1"),
                       (dict(beta=1.5), "beta"), (dict(teacher_top_k=0), "teacher_top_k"),
                       (dict(teacher_server_urls={}), "at least one"),
                       (dict(heartbeat_stale_after_s=0), "heartbeat_stale_after_s"),
                       (dict(weight_sync_timeout=0), "weight_sync_timeout"),
                       (dict(max_tool_calling_iterations=2), "does not run tools")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            _api().AsyncDistillationConfig(output_dir=str(tmp_path), report_to="none", **bad)


def test_several_teachers_need_a_teacher_id_column(tiny_model_path, tmp_path):
    urls = {"math": "http://127.0.0.1:1", "code": "http://127.0.0.1:2"}
    args = fast_config(_api().AsyncDistillationConfig, tmp_path, teacher_server_urls=urls)
    with pytest.raises(ValueError, match="teacher_id"):
        _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts())
    rows = Dataset.from_list([{"prompt": "Q1:", "teacher_id": "math"}, {"prompt": "Q2:", "teacher_id": "poetry"}])
    with pytest.raises(ValueError, match="'poetry'"):
        _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=rows)


# -- teacher scores as row tensors (no servers) ------------------------------------------------------------------


class _FakeTeacher:
    """A teacher whose top-2 are tokens (offset, offset + 1) and whose log-prob of token t is -t/10 - offset."""

    def __init__(self, offset):
        self.offset, self.calls = offset, 0

    def score(self, inputs, top_k, temperature):
        self.calls += 1
        tokens = inputs["completion_ids"][inputs["completion_mask"].bool()]
        n = tokens.shape[0]
        ids = torch.tensor([self.offset, self.offset + 1]).expand(n, top_k)
        return {"topk_token_ids": ids, "topk_logprobs": -ids.float() / 10 - self.offset,
                "actual_logprobs": -tokens.float() / 10 - self.offset}  # fmt: skip


def test_teacher_scores_route_rows_and_add_the_sampled_token():
    """Each row is scored by its own teacher (MOPD); the support is the teacher's top-k then the sampled token,
    masked when it is among the top-k (TRL's candidate set); the flat layout survives the buffer's column trim."""
    batch = {
        "prompt_ids": torch.tensor([[5, 6], [7, 8], [9, 9]]), "prompt_mask": torch.ones(3, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[1, 4, 0], [2, 3, 0], [1, 1, 1]]),
        "completion_mask": torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]]),
        "completion_lengths": torch.tensor([2, 2, 3]),
    }  # fmt: skip
    teachers = {"a": _FakeTeacher(1), "b": _FakeTeacher(3)}
    rows = _api().worker.row_teacher_ids([{"teacher_id": t} for t in "aba"], list(teachers))
    out = _api().worker.score_with_teachers(batch, rows, teachers, top_k=2, temperature=1.0)
    assert teachers["a"].calls == teachers["b"].calls == 1 and out["teacher_index"].tolist() == [0, 1, 0]
    assert out["teacher_topk_token_ids"].shape == (3, 3, 3)
    # row 0 (teacher a: top {1, 2}): token 1 is in the top-k (masked), token 4 is added
    assert out["teacher_topk_token_ids"][0, :2].tolist() == [[1, 2, 1], [1, 2, 4]]
    lp = out["teacher_topk_logprobs"]
    assert lp[0, 0, 2] == float("-inf") and lp[0, 1, 2].item() == pytest.approx(-1.4)
    # row 1 (teacher b: top {3, 4}): token 3 in the top-k, token 2 added with b's log-prob
    assert out["teacher_topk_token_ids"][1, :2, 2].tolist() == [2, 3] and lp[1, 0, 2].item() == pytest.approx(-3.2)
    assert lp[1, 1, 2] == float("-inf") and out["teacher_actual_logprobs"][1, 1].item() == pytest.approx(-3.3)
    assert torch.isinf(lp[0, 2]).all()  # off the loss mask
    trimmed = {**batch, **out, "completion_mask": batch["completion_mask"][:2, :2]}  # the buffer trims columns
    trimmed.update({k: v[:2] for k, v in out.items()})
    flat = _api().worker.flat_teacher_scores(trimmed)
    assert flat["topk_token_ids"].shape == (4, 3) and flat["actual_logprobs"].tolist() == pytest.approx(
        [-1.1, -1.4, -3.2, -3.3]
    )
    with pytest.raises(ValueError, match="teacher_id"):
        _api().worker.row_teacher_ids([{"prompt": "Q"}], ["a", "b"])


# -- the loss on a fixed batch -------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_served_loss_on_a_fixed_batch(tiny_model_path, abc_teacher_path, student_url, teacher_url, tmp_path, beta):
    """The served loss (teacher scores carried by the batch, as the worker queues them) at teacher_temperature,
    not the sampling temperature: β > 0 equals ServerDistillationTrainer's loss on the same batch (same support
    {teacher top-1, sampled token}); β = 0 equals, by hand, forward KL on the teacher's top-k ∪ {sampled token} with
    the tail bucket (TRL's async support, which always holds the realized token)."""
    from transformers import AutoModelForCausalLM

    from posttrain.experimental._distill_support import ServedTeacher
    from posttrain.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    args = _args(tmp_path / "a", student_url, teacher_url, beta=beta, teacher_top_k=2, temperature=0.6,
                 teacher_temperature=1.3)  # fmt: skip
    trainer = _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts())
    batch = served_loss_batch(trainer.processing_class)
    served = ServedTeacher(teacher_url, trainer.vocab_rows)
    scored = {**batch, **_api().worker.score_with_teachers(batch, ["default"] * 2, {"default": served}, 2, 1.3)}
    served.close()
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, scored)
    assert args.temperature == 0.6  # restored after the loss
    if beta > 0:
        sync_args = fast_config(ServerDistillationConfig, tmp_path / "s", beta=beta, loss_top_k=1, temperature=1.3,
                                teacher_model_server_url=teacher_url)  # fmt: skip
        sync = ServerDistillationTrainer(tiny_model_path, args=sync_args, train_dataset=prompts())
        sync.model.train()
        expected = sync._compute_loss(sync.model, batch)
        sync.served_teacher.close()
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
    else:
        teacher = AutoModelForCausalLM.from_pretrained(abc_teacher_path)
        s = _local_log_probs(trainer.model, batch, trainer.vocab_rows, 1.3)
        with torch.no_grad():
            t = _local_log_probs(teacher, batch, trainer.vocab_rows, 1.3)
        tokens = batch["completion_ids"][batch["completion_mask"].bool()]
        support = torch.cat([t.topk(2, -1).indices, tokens[:, None]], -1)
        keep = torch.ones_like(support, dtype=torch.bool)
        keep[:, 2] = (support[:, :2] != tokens[:, None]).all(-1)
        assert not keep[:, 2].all()  # some sampled tokens are outside the teacher's top-2, some inside
        expected = sparse_support_divergence(s.gather(-1, support), t.gather(-1, support), keep, beta=0.0).mean()
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    logs = trainer._metrics["train"]
    assert logs["jsd"] == logs["distillation_loss"] and logs["teacher_entropy"][0] >= 0
    loss.backward()
    trainer.model.eval()  # evaluation batches carry no teacher scores: the trainer asks the teacher server itself
    with torch.no_grad():
        torch.testing.assert_close(trainer._compute_loss(trainer.model, batch),
                                   trainer._compute_loss(trainer.model, scored), rtol=1e-6, atol=1e-7)  # fmt: skip
    trainer.served_teacher.close()


def test_local_teacher_loss_equals_distillation_trainer(tiny_model_path, abc_teacher_path, student_url, tmp_path):
    """With a local teacher the loss is DistillationTrainer's exact full-vocabulary JSD at teacher_temperature."""
    from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer

    args = _args(tmp_path / "a", student_url, beta=0.5, temperature=0.6, teacher_temperature=1.3)
    trainer = _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts(),
                                              teacher_model=abc_teacher_path)  # fmt: skip
    sync = DistillationTrainer(tiny_model_path, abc_teacher_path, fast_config(DistillationConfig, tmp_path / "s",
                               beta=0.5, temperature=1.3), train_dataset=prompts())  # fmt: skip
    batch = served_loss_batch(trainer.processing_class)
    trainer.model.train()
    sync.model.train()
    assert torch.equal(trainer._compute_loss(trainer.model, batch), sync._compute_loss(sync.model, batch))


# -- token budget, weight-sync timeout, PEFT push ---------------------------------------------------------------


def _budget_grads(model_path, out, student_url, teacher_path, batch, **overrides):
    """The gradient of one training micro-step on ``batch`` (a round of 2 rows; ``teacher_path`` None: the served
    teacher of ``overrides``, scores in the batch), and the trainer."""
    args = _args(out, student_url, per_device_train_batch_size=2, beta=0.5, **overrides)
    trainer = _api().AsyncDistillationTrainer(model_path, args, train_dataset=prompts(), teacher_model=teacher_path)
    trainer.async_rollout.queue = queue.Queue()  # no worker: the round is ``batch``
    trainer.async_rollout.next_trainable_round = lambda: trainer._score_with_current_policy(
        dict(batch), trainer._record("train")
    )
    trainer.training_step(trainer.model, [])
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}, trainer


def test_token_budget_packs_forwards_and_drops_oversize(tiny_model_path, abc_teacher_path, student_url, teacher_url,
                                                        tmp_path):  # fmt: skip
    """token_budget: rows of 7 and 6 real tokens under a budget of 7 run as two forwards whose gradients add up to
    the unbudgeted micro-batch's (local and served teacher); under a budget of 6 the 7-token row is dropped
    (counted, and the gradient is that of the batch without it); None takes the student server's max_model_len."""
    from posttrain.generation.client import GenerationClient
    from posttrain.models.tiny import build_tiny_tokenizer

    batch = served_loss_batch(build_tiny_tokenizer())
    batch["completion_mask"] = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    batch["completion_lengths"] = torch.tensor([4, 2])
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    assert (batch["prompt_mask"].sum(1) + batch["completion_lengths"]).tolist() == [7, 6]

    def grads(name, batch, budget):
        return _budget_grads(tiny_model_path, tmp_path / name, student_url, abc_teacher_path, batch,
                             token_budget=budget)  # fmt: skip

    full, _ = grads("full", batch, 0)
    packed, trainer = grads("packed", batch, 7)
    assert trainer._metrics["train"]["batch/packs_per_micro_batch"] == [2.0]
    assert full.keys() == packed.keys() and len(full) > 0
    for name in full:
        torch.testing.assert_close(packed[name], full[name], rtol=1e-5, atol=1e-7)
    without = {**batch, "completion_mask": batch["completion_mask"] * torch.tensor([[0], [1]])}
    without["num_items_in_batch"] = without["completion_mask"].sum()
    expected, _ = grads("without", without, 0)
    dropped, trainer = grads("dropped", batch, 6)
    assert trainer.dropped_oversize_total == 1 and trainer._metrics["train"]["batch/dropped_oversize_total"] == [1.0]
    assert not all(torch.allclose(dropped[n], full[n]) for n in full)
    for name in expected:
        torch.testing.assert_close(dropped[name], expected[name], rtol=1e-5, atol=1e-7)
    from posttrain.experimental._distill_support import ServedTeacher

    served = ServedTeacher(teacher_url, trainer.vocab_rows)
    scored = {**batch, **_api().worker.score_with_teachers(batch, ["default"] * 2, {"default": served}, 2, 0.9)}
    served.close()
    teacher = dict(teacher_server_urls={"default": teacher_url}, teacher_top_k=2)
    full = _budget_grads(tiny_model_path, tmp_path / "sf", student_url, None, scored, token_budget=0, **teacher)[0]
    packed = _budget_grads(tiny_model_path, tmp_path / "sp", student_url, None, scored, token_budget=7, **teacher)[0]
    for name in full:
        torch.testing.assert_close(packed[name], full[name], rtol=1e-5, atol=1e-7)
    auto = _api().AsyncDistillationTrainer(tiny_model_path, _args(tmp_path / "auto", student_url),
                                           train_dataset=prompts(), teacher_model=abc_teacher_path)  # fmt: skip
    card = GenerationClient(student_url).request("GET", "/v1/models").json()["data"][0]
    assert card["max_model_len"] and auto._resolve_token_budget() == card["max_model_len"]


@pytest.fixture()
def slow_push_url(tiny_model_path):
    """A student `posttrain serve` whose weight loads hang (up to 60 s, released at teardown): a stuck transfer."""
    import threading

    from posttrain.serving.app import serve_in_thread
    from posttrain.serving.engine import PosttrainEngine

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    load, release = engine.load_weights, threading.Event()

    def stuck_load(*args, **kwargs):
        release.wait(60.0)
        return load(*args, **kwargs)

    engine.load_weights = stuck_load
    with serve_in_thread(engine) as url:
        yield url
        release.set()


def test_weight_sync_timeout_raises_naming_the_option(tiny_model_path, slow_push_url, tmp_path):
    """The first push (before the worker starts) does not land within weight_sync_timeout=1: train() raises a
    TimeoutError naming the option (seconds, not the server's 60 s hang), and no worker was started."""
    import time

    args = _args(tmp_path, slow_push_url, "http://127.0.0.1:1", weight_sync_timeout=1)
    trainer = _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts())
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match="weight_sync_timeout=1 s"):
        trainer.train()
    assert time.perf_counter() - start < 30 and trainer.async_rollout.worker is None


def test_peft_student_is_pushed_merged(tiny_model_path, student_url, tmp_path):
    """A LoRA student (the seed document's LoRA example): a push sends the merged weights (GRPO's server-mode
    ``policy_weights``), so the server samples from the merged model — its sampling log-probs are the merged
    model's, not the base's — while the trainer's adapter stays unmerged."""
    import copy

    import peft

    from posttrain.generation.client import GenerationClient

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    trainer = _api().AsyncDistillationTrainer(tiny_model_path, _args(tmp_path, student_url, "http://127.0.0.1:1"),
                                              train_dataset=prompts(), peft_config=lora)  # fmt: skip
    model = trainer.model
    with torch.no_grad():  # a non-zero adapter (lora_B starts at zero)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora" not in n}
    client = GenerationClient(student_url)
    trainer.async_rollout.push_client = client
    trainer.async_rollout.push_weights(wait=True)
    prompt = trainer.processing_class("Q3:").input_ids
    choice = client.completions([prompt], max_tokens=6, seed=0).choices[0][0]
    ids = torch.tensor([prompt + choice.token_ids])
    n = len(choice.token_ids)

    def logprobs(net):
        with torch.no_grad():
            lp = torch.log_softmax(net(ids).logits[0, -n - 1 : -1].float(), -1)
        return lp.gather(-1, ids[0, -n:, None]).squeeze(-1)

    merged = copy.deepcopy(model).merge_and_unload()
    torch.testing.assert_close(torch.tensor(choice.logprobs), logprobs(merged), rtol=1e-4, atol=1e-4)
    with model.disable_adapter():
        assert not torch.allclose(torch.tensor(choice.logprobs), logprobs(model), atol=1e-2)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if "lora" not in n)
    assert trainer.backend.version == 0 and any("lora_B" in n for n, _ in model.named_parameters())


class _SilentWorker:
    """A rollout worker process that is alive and never answers (until stopped)."""

    exitcode = None

    def __init__(self, stop):
        self.stop, self.terminated = stop, False

    def is_alive(self):
        return not (self.stop.is_set() or self.terminated)

    def terminate(self):
        self.terminated = True

    kill = terminate

    def join(self, timeout=None):
        pass


def test_stale_heartbeat_raises_naming_the_option(tiny_model_path, student_url, tmp_path):
    """A live worker whose heartbeat is older than heartbeat_stale_after_s: the trainer's wait for a round raises
    RolloutWorkerError naming the option and stops the worker; a worker that has not beaten yet (starting) gets
    vllm_server_timeout more."""
    import multiprocessing
    import time

    args = _args(tmp_path, student_url, "http://127.0.0.1:1", heartbeat_stale_after_s=0.5)
    trainer = _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts())
    context = multiprocessing.get_context("spawn")
    rollout = trainer.async_rollout
    rollout.stop, rollout.queue, rollout.heartbeat = context.Event(), context.Queue(), context.Value("d", 0.0)
    rollout.worker = worker = _SilentWorker(rollout.stop)
    rollout.worker_started = time.time() - 1.0  # starting for 1 s: within 0.5 s + vllm_server_timeout
    rollout.check_heartbeat()
    rollout.heartbeat.value = time.time()
    with pytest.raises(_api().RolloutWorkerError, match=r"heartbeat_stale_after_s=0\.5") as raised:
        rollout.get_item()
    # the age it reports is past the limit; how far past depends on the scheduler, so no upper bound
    assert float(re.search(r"no progress for (\d+\.\d) s", str(raised.value)).group(1)) >= 0.5, raised.value
    assert worker.terminated and rollout.worker is None


@pytest.mark.slow
def test_worker_hung_on_a_silent_teacher_is_detected(tiny_model_path, student_url, tmp_path):
    """End to end over loopback: the teacher server accepts connections and never answers (request_timeout 600 s);
    the worker's heartbeat goes stale after its generation, so train() raises RolloutWorkerError naming
    heartbeat_stale_after_s within seconds, and the hung worker is terminated (no leaked process)."""
    import socket
    import time

    with socket.create_server(("127.0.0.1", 0)) as silent:  # listens, never accepts: requests hang
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        args = _args(tmp_path, student_url, url, heartbeat_stale_after_s=2)
        trainer = _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts())
        start = time.perf_counter()
        with pytest.raises(_api().RolloutWorkerError, match="heartbeat_stale_after_s=2"):
            trainer.train()
    assert time.perf_counter() - start < 120 and trainer.async_rollout.worker is None
    assert trainer.state.global_step == 0


# -- end to end ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_seed_doc_lora_example_runs(tiny_model_path, student_url, teacher_url, tmp_path):
    """The Async Distillation page's quick start with its LoRA variant, after s/trl/posttrain/, on the tiny model
    with conversational prompts (DeepMath's layout) and the two servers on loopback: it trains the adapter only,
    pushes merged weights every step, and the server ends on the final step's version."""
    import peft
    from peft import LoraConfig

    from posttrain.experimental.async_distillation import AsyncDistillationTrainer

    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}]} for i in range(8)])
    trainer = AsyncDistillationTrainer(
        model=tiny_model_path,
        train_dataset=dataset,
        peft_config=LoraConfig(r=32, lora_alpha=64, target_modules="all-linear"),
        args=_args(tmp_path, student_url, teacher_url, max_steps=2),
    )
    assert isinstance(trainer.model, peft.PeftModel)
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainer.train()
    assert all(torch.equal(p, frozen[n]) for n, p in trainer.model.named_parameters() if not p.requires_grad)
    assert trainer.state.global_step == 2 and trainer.backend.version == 2
    assert all(e["jsd"] >= 0 for e in trainer.state.log_history if "jsd" in e)


@pytest.mark.slow
def test_max_staleness_0_equals_sync_distillation_and_resume(tiny_model_path, abc_teacher_path, student_url, tmp_path):
    """max_staleness=0 (local teacher): the worker generates round r only from weight version r, so the run is
    DistillationTrainer in server mode (same prompts, request seeds, buffer shuffle, loss): parameters agree
    bitwise. Resumed from that run's step-1 checkpoint (rollout_state.json: next round 1, weights version 1), a run
    restarts the worker at round 1 and reaches the same parameters."""
    from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer

    values = {k: v for k, v in COMMON.items() if k != "teacher_temperature"}
    sync_args = fast_config(DistillationConfig, tmp_path / "sync", **values, use_vllm=True, vllm_mode="server",
                            vllm_server_base_url=student_url, max_steps=2, beta=0.5)  # fmt: skip
    sync = DistillationTrainer(tiny_model_path, abc_teacher_path, sync_args, train_dataset=prompts())
    sync.train()
    expected = _params(sync)

    out = tmp_path / "full"
    args = _args(out, student_url, max_staleness=0, max_steps=2, beta=0.5, save_strategy="steps", save_steps=1)
    full = _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts(),
                                           teacher_model=abc_teacher_path)  # fmt: skip
    full.train()
    assert [(r["round"], r["staleness"]) for r in full.async_rollout.trained_rounds] == [(0, 0), (1, 0)]
    for name, value in full.model.named_parameters():
        assert torch.equal(value, expected[name]), name
    logs = {k: v for entry in full.state.log_history for k, v in entry.items()}
    for key in ("jsd", "entropy", "sample/staleness_max", "sample/dropped_stale_total", "perf/rollout_wait_s",
                "perf/weight_sync_s", "completions/mean_length"):  # fmt: skip
        assert key in logs, key

    state = json.loads((out / "checkpoint-1" / "rollout_state.json").read_text())
    assert state == {"next_round": 1, "weight_version": 1, "dropped_stale_total": 0, "dropped_oversize_total": 0}
    args = _args(tmp_path / "resumed", student_url, max_staleness=0, max_steps=2, beta=0.5)
    resumed = _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts(),
                                              teacher_model=abc_teacher_path)  # fmt: skip
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert [r["round"] for r in resumed.async_rollout.trained_rounds] == [1]
    for name, value in resumed.model.named_parameters():
        assert torch.equal(value, expected[name]), name


@pytest.mark.slow
def test_max_staleness_0_served_teacher_matches_server_distillation(tiny_model_path, student_url, teacher_url,
                                                                      tmp_path):  # fmt: skip
    """Served teacher, β > 0: the same run as synchronous ServerDistillationTrainer in server mode. Bitwise here,
    but checked to 1e-5 only: the worker scores a whole round per teacher request, the synchronous trainer each
    micro-batch, so the teacher's padded forward sees other batch shapes (not bit-stable across BLAS builds)."""
    from posttrain.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    values = {k: v for k, v in COMMON.items() if k != "teacher_temperature"}
    sync_args = fast_config(ServerDistillationConfig, tmp_path / "sync", **values, use_vllm=True, vllm_mode="server",
                            vllm_server_base_url=student_url, max_steps=2, beta=0.5, loss_top_k=1,
                            teacher_model_server_url=teacher_url, gradient_accumulation_steps=2)  # fmt: skip
    sync = ServerDistillationTrainer(tiny_model_path, args=sync_args, train_dataset=prompts(16))
    sync.train()
    args = _args(tmp_path / "async", student_url, teacher_url, max_staleness=0, max_steps=2, beta=0.5,
                 teacher_top_k=1, gradient_accumulation_steps=2)  # fmt: skip
    trainer = _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts(16))
    trainer.train()
    expected = _params(sync)
    for name, value in trainer.model.named_parameters():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    sync_loss = [e["loss"] for e in sync.state.log_history if "loss" in e]
    async_loss = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert async_loss == pytest.approx(sync_loss, rel=1e-5)


@pytest.mark.slow
def test_staleness_k_never_trains_on_older_samples(tiny_model_path, student_url, teacher_url, tmp_path):
    """k=1 with the worker allowed 3 rounds ahead: rounds older than 1 version are dropped and counted, never
    trained on (checked from the logged versions); every consumed round is either trained or dropped. Two teachers
    (MOPD; the same server under two names): each row goes to its `teacher_id`'s, per-teacher metrics are logged."""
    rows = Dataset.from_list([{"prompt": f"Q{i}:", "teacher_id": "math" if i % 4 else "code"} for i in range(16)])
    args = _args(tmp_path, student_url, max_staleness=1, max_inflight_tasks=3 * 4, max_steps=4,
                 teacher_server_urls={"math": teacher_url, "code": teacher_url})  # fmt: skip
    trainer = _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=rows)
    trainer.train()
    rounds = trainer.async_rollout.trained_rounds
    assert len(rounds) == 4 and [r["step"] for r in rounds] == [0, 1, 2, 3]
    assert all(0 <= r["step"] - r["version"] <= 1 for r in rounds), rounds
    logged = [(e["step"], e["sample/version"], e["sample/staleness_max"]) for e in trainer.state.log_history
              if "sample/staleness_max" in e]  # fmt: skip
    assert len(logged) == 4 and all(step - 1 - version <= 1 and stale <= 1 for step, version, stale in logged)
    dropped_rounds = trainer.async_rollout.dropped_stale_total // 4
    assert trainer.async_rollout.next_round == rounds[-1]["round"] + 1 == len(rounds) + dropped_rounds
    logs = [e for e in trainer.state.log_history if "teacher_token_frac/math" in e]
    assert len(logs) == 4 and all(e["teacher_token_frac/math"] + e["teacher_token_frac/code"] == 1 for e in logs)
    assert sum(e["teacher_token_frac/code"] for e in logs) > 0 and "teacher_score_s/code" in logs[0]
    both = [e for e in logs if 0 < e["teacher_token_frac/code"] < 1]  # a step with tokens of each teacher
    assert both and all(min(e["teacher_jsd/math"], e["teacher_jsd/code"]) <= e["jsd"] + 1e-5 for e in both)
    assert all(max(e["teacher_jsd/math"], e["teacher_jsd/code"]) >= e["jsd"] - 1e-5 for e in both)
    assert all("teacher_entropy/math" in e for e in logs)
    for e in logs:  # rounds of 4 prompt-only samples of at most 6 completion tokens
        assert e["batch/samples_per_step"] == 4 and 0 < e["sample/trained_tokens_mean"] <= 6
        assert e["batch/trained_tokens_per_step"] == 4 * e["sample/trained_tokens_mean"]
        assert e["sample/forwarded_tokens_max"] > e["sample/trained_tokens_mean"] and "sample/rollout_queue_size" in e


@pytest.mark.slow
def test_worker_error_is_raised_in_the_trainer(tiny_model_path, student_url, tmp_path):
    """The worker cannot reach its teacher: the trainer raises RolloutWorkerError with the worker's exception and
    traceback, and joins the worker."""
    trainer = _api().AsyncDistillationTrainer(tiny_model_path, _args(tmp_path, student_url, "http://127.0.0.1:1"),
                                       train_dataset=prompts())  # fmt: skip
    with pytest.raises(_api().RolloutWorkerError, match="(?s)ServerUnavailableError.*Worker traceback"):
        trainer.train()
    assert trainer.async_rollout.worker is None and trainer.state.global_step == 0


@pytest.mark.slow
def test_student_moves_toward_the_served_teacher(tiny_model_path, abc_teacher_path, student_url, teacher_url,
                                                 tmp_path):  # fmt: skip
    """A few dozen asynchronous steps (staleness up to 2) against the served teacher: the on-policy divergence the
    trainer logs falls, and so does the sampled reverse KL of fresh student samples to the teacher."""
    from transformers import AutoModelForCausalLM

    args = _args(tmp_path, student_url, teacher_url, max_steps=30, learning_rate=3e-3, max_completion_length=8,
                 max_staleness=2, beta=0.0, teacher_top_k=8, temperature=1.0, teacher_temperature=1.0)  # fmt: skip
    trainer = _api().AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts(16))
    teacher = AutoModelForCausalLM.from_pretrained(abc_teacher_path)
    start = sampled_reverse_kl(trainer.model, teacher, trainer.processing_class)
    trainer.train()
    end = sampled_reverse_kl(trainer.model, teacher, trainer.processing_class)
    jsd = [e["jsd"] for e in trainer.state.log_history if "jsd" in e]
    assert len(jsd) == 30 and sum(jsd[-5:]) < 0.5 * sum(jsd[:5]), jsd
    assert end < 0.7 * start, (start, end)
    assert max(r["staleness"] for r in trainer.async_rollout.trained_rounds) <= 2
