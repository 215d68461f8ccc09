"""An epoch whose last batch is short: Online DPO, A2PO and GKD train on it, as TRL's versions do (their plain
Trainer dataloader keeps it; 7 prompts at batch 2 are 4 steps, the last with 1 prompt), unless
``dataloader_drop_last``; the RepeatSampler trainers (GRPO, RLOO, distillation, GOLD, IW-OPD, SDPO, SDFT) drop it.
With gradient accumulation, GKD's last optimizer step has fewer micro-batches, the last one short, as TRL's."""

from __future__ import annotations

import math

import pytest
from datasets import Dataset
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.experimental.a2po import A2POConfig, A2POTrainer
from posttrain.experimental.gkd import GKDConfig, GKDTrainer
from posttrain.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from posttrain.rollout.buffer import batch_size_of

N = 7


def _reward(completion_ids, **kwargs):
    return [float(sum(ids) % 5) for ids in completion_ids]


def _prompts(n=N):
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(n)])


def _conversations(n=N):
    return Dataset.from_list(
        [{"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": "abc" * (1 + i % 2)}]}
         for i in range(n)]
    )  # fmt: skip


def _trainer(kind, model, tmp_path, dataset=None, **extra):
    common = {**dict(per_device_train_batch_size=2, num_train_epochs=1, max_steps=-1, learning_rate=1e-3), **extra}
    if kind == "online_dpo":
        args = fast_config(OnlineDPOConfig, tmp_path, max_new_tokens=4, **common)
        return OnlineDPOTrainer(model, reward_funcs=_reward, args=args, train_dataset=dataset or _prompts())
    if kind == "a2po":
        args = fast_config(A2POConfig, tmp_path, max_completion_length=4, num_value_samples=2,
                           filter_all_incorrect=False, **common)  # fmt: skip
        return A2POTrainer(model, _reward, args, train_dataset=dataset or _prompts())
    args = fast_config(GKDConfig, tmp_path, max_new_tokens=4, **common)
    return GKDTrainer(model, model, args=args, train_dataset=dataset or _conversations())


def _round_rows(trainer):
    """Spy on the rollout: rows of each training round."""
    seen = []
    generate = trainer._generate_and_score

    def spy(rows, mode):
        if mode == "train":
            seen.append(len(rows))
        return generate(rows, mode)

    trainer._generate_and_score = spy
    return seen


@pytest.mark.parametrize("kind", ["online_dpo", "a2po", "gkd"])
def test_the_short_last_batch_is_trained(kind, tiny_model_path, tmp_path):
    trainer = _trainer(kind, tiny_model_path, tmp_path)
    rounds = _round_rows(trainer)
    trainer.train()
    per_prompt = 2 if kind == "online_dpo" else 1  # Online DPO's rows are each prompt twice
    assert trainer.state.global_step == trainer.state.max_steps == math.ceil(N / 2) == 4
    assert rounds == [2 * per_prompt] * 3 + [1 * per_prompt]
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 4 and all(math.isfinite(entry["loss"]) for entry in logs)
    assert trainer.state.epoch == 1


@pytest.mark.parametrize("kind", ["online_dpo", "gkd"])
def test_dataloader_drop_last_drops_it(kind, tiny_model_path, tmp_path):
    trainer = _trainer(kind, tiny_model_path, tmp_path, dataloader_drop_last=True)
    trainer.train()
    assert trainer.state.global_step == trainer.state.max_steps == 3


def test_a_stream_keeps_its_short_last_batch_too(tiny_model_path, tmp_path):
    stream = _prompts().to_iterable_dataset()
    trainer = _trainer("online_dpo", tiny_model_path, tmp_path, dataset=stream, max_steps=10)
    rounds = _round_rows(trainer)
    trainer.train()
    assert rounds[:4] == [4, 4, 4, 2]  # the stream's first pass: 3 full rounds and the short one


def _served(trainer):
    """Spy on the loss: per micro-step, the rows served, HF's micro-batch count of the optimizer step and whether
    the optimizer steps after it."""
    served = []
    compute = trainer._compute_loss

    def spy(model, inputs):
        sync = trainer.accelerator.sync_gradients
        served.append((batch_size_of(inputs), trainer.current_gradient_accumulation_steps, sync))
        return compute(model, inputs)

    trainer._compute_loss = spy
    return served


@pytest.mark.parametrize(
    ("n", "accumulation", "rounds", "served"),
    [
        # TRL: ceil(n / 2) dataloader batches of 2, the last one short, grouped into optimizer steps of
        # gradient_accumulation_steps batches, the last step with fewer
        (7, 2, [4, 3], [(2, 2, False), (2, 2, True), (2, 2, False), (1, 2, True)]),
        (7, 3, [6, 1], [(2, 3, False), (2, 3, False), (2, 3, True), (1, 1, True)]),
        (5, 4, [5], [(2, 3, False), (2, 3, False), (1, 3, True)]),
    ],
)
def test_gkd_trains_a_short_last_window_with_gradient_accumulation(
    n, accumulation, rounds, served, tiny_model_path, tmp_path
):
    # GKD generates once per optimizer step (a round is its gradient_accumulation_steps micro-batches); the epoch's
    # short last round is cut into micro-batches of per_device_train_batch_size rows, the last one shorter
    trainer = _trainer("gkd", tiny_model_path, tmp_path, _conversations(n), gradient_accumulation_steps=accumulation)
    seen_rounds = _round_rows(trainer)
    seen = _served(trainer)
    trainer.train()
    assert trainer.state.global_step == trainer.state.max_steps == len(rounds)
    assert seen_rounds == rounds
    assert seen == served
    assert trainer.state.epoch == 1
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == len(rounds) and all(math.isfinite(entry["loss"]) for entry in logs)


def test_gkd_dataloader_drop_last_with_gradient_accumulation_drops_the_short_batch_only(tiny_model_path, tmp_path):
    # TRL's dataloader drops the last batch of 1 row: 3 batches of 2, steps of 2 + 2 and 2 rows
    trainer = _trainer("gkd", tiny_model_path, tmp_path, gradient_accumulation_steps=2, dataloader_drop_last=True)
    rounds = _round_rows(trainer)
    trainer.train()
    assert trainer.state.global_step == trainer.state.max_steps == 2 and rounds == [4, 2]


def test_gkd_stream_trains_its_short_last_window(tiny_model_path, tmp_path):
    stream = _conversations().to_iterable_dataset()
    trainer = _trainer("gkd", tiny_model_path, tmp_path, dataset=stream, max_steps=3, gradient_accumulation_steps=2)
    rounds = _round_rows(trainer)
    trainer.train()
    assert trainer.state.global_step == 3 and rounds == [4, 3, 4]  # the stream's first pass: 4 rows, then 3


def test_gkd_with_replays_drops_a_short_round(tiny_model_path, tmp_path):
    # num_iterations (not a field of TRL's GKD) replays each round over the next optimizer step: a short round's
    # replays would straddle optimizer steps, so 9 rows at 2 × 2 are 2 rounds, each trained twice
    trainer = _trainer("gkd", tiny_model_path, tmp_path, _conversations(9), gradient_accumulation_steps=2,
                       num_iterations=2)  # fmt: skip
    rounds = _round_rows(trainer)
    seen = _served(trainer)
    trainer.train()
    assert trainer.state.global_step == trainer.state.max_steps == 4
    assert rounds == [4, 4] and [rows for rows, _, _ in seen] == [2] * 8


def test_gkd_short_window_loss_is_its_token_mean(tiny_model_path, abc_teacher_path, tmp_path):
    # The model stays put (learning rate 0), so each step's loss is its window's: TRL's Σ JSD / completion tokens of
    # the window (num_items_in_batch; no division by the micro-batch count). The short last window (rows 4-6, in
    # micro-batches of 2 and 1 rows) therefore equals one micro-batch of the same 3 rows; a per-micro-batch mean, a
    # division by gradient_accumulation_steps or a full window's token count would not (the rows differ in length).
    data = _conversations(7)
    common = dict(lmbda=0.0, learning_rate=0.0, shuffle_dataset=False, max_new_tokens=4, num_train_epochs=1)

    def losses(dataset, path, **batching):
        args = fast_config(GKDConfig, tmp_path / path, **common, **batching)
        trainer = GKDTrainer(tiny_model_path, abc_teacher_path, args=args, train_dataset=dataset)
        trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    accumulated = losses(data, "ga2", per_device_train_batch_size=2, gradient_accumulation_steps=2)
    whole = losses(data.select(range(4, 7)), "whole", per_device_train_batch_size=3, gradient_accumulation_steps=1)
    assert len(accumulated) == 2 and len(whole) == 1 and whole[0] > 0
    assert accumulated[1] == pytest.approx(whole[0], rel=1e-5)
    first = losses(data.select(range(4)), "first", per_device_train_batch_size=4, gradient_accumulation_steps=1)
    assert accumulated[0] == pytest.approx(first[0], rel=1e-5)


@pytest.mark.parametrize("checkpoint", [1, 2, 3])
def test_gkd_resumes_around_a_short_window(checkpoint, tiny_model_path, abc_teacher_path, tmp_path):
    # 7 rows at 2 × 2 over 2 epochs: steps of 4, 3, 4, 3 rows. Resumed after the first window (mid-epoch), after the
    # short one (at the epoch boundary) or mid second epoch, the run logs the uninterrupted run's losses.
    args = dict(lmbda=0.0, learning_rate=1e-2, max_new_tokens=4, num_train_epochs=2, per_device_train_batch_size=2,
                gradient_accumulation_steps=2, save_strategy="steps", save_steps=1)  # fmt: skip

    def run(resume=None):
        trainer = GKDTrainer(tiny_model_path, abc_teacher_path, args=fast_config(GKDConfig, tmp_path, **args),
                             train_dataset=_conversations())  # fmt: skip
        seen = _round_rows(trainer)
        trainer.train(resume_from_checkpoint=resume)
        losses = {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}
        return trainer.state.global_step, seen, losses

    steps, rounds, full = run()
    assert steps == 4 and rounds == [4, 3, 4, 3]
    steps, rounds, resumed = run(str(tmp_path / f"checkpoint-{checkpoint}"))
    assert steps == 4 and rounds == [4, 3, 4, 3][checkpoint:]  # only the steps after the checkpoint are run
    assert sorted(resumed) == [1, 2, 3, 4]  # the checkpoint's log history, then the resumed steps
    for step in range(checkpoint + 1, 5):
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), step
