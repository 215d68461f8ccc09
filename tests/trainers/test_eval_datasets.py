"""``eval_dataset`` for every trainer — one dataset, a dict of named datasets, a streaming ``IterableDataset`` —
and ``trainer.evaluate()`` returning TRL's metric names (issue 18, item 2)."""

from __future__ import annotations

import math

import pytest
from datasets import Dataset
from reward_helpers import varied_reward as _reward
from test_epoch_remainder import CASES
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

# Metric names TRL's evaluate() returns for each trainer (besides eval_loss), prefixed "eval_"
EXPECTED = {
    "sft": ["entropy", "mean_token_accuracy"],
    "dpo": ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"],
    "kto": ["rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "kl"],
    "reward": ["accuracy", "margin", "min_reward", "mean_reward", "max_reward"],
    "grpo": ["reward", "reward_std", "rewards/varied_reward/mean", "completions/mean_length"],
    "rloo": ["reward", "reward_std", "rewards/varied_reward/mean", "completions/mean_length"],
    "distillation": ["completions/mean_length"],
}  # fmt: skip


def _trainer(kind, tmp_path, model_path, reward_model_path, eval_dataset, **overrides):
    config_class, trainer_class, data, extra = CASES[kind]
    values = dict(per_device_train_batch_size=4, per_device_eval_batch_size=4, max_steps=1, **extra)
    args = fast_config(config_class, tmp_path, **{**values, **overrides})
    kwargs = {"reward_funcs": _reward} if kind in ("grpo", "rloo") else {}
    if kind == "distillation":
        kwargs["teacher_model"] = model_path
    model = reward_model_path if kind == "reward" else model_path
    return trainer_class(model, args=args, train_dataset=data(), eval_dataset=eval_dataset, **kwargs)


def _eval_rows(kind):
    rows = CASES[kind][2]()
    return rows.select(range(4))


@pytest.mark.parametrize("form", ["plain", "dict", "stream"])
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_evaluate_returns_trl_metric_names(kind, form, tiny_model_path, tiny_reward_model_path, tmp_path):
    rows = _eval_rows(kind)
    eval_dataset = {"plain": rows, "dict": {"a": rows, "b": rows}, "stream": rows.to_iterable_dataset()}[form]
    trainer = _trainer(kind, tmp_path, tiny_model_path, tiny_reward_model_path, eval_dataset)
    metrics = trainer.evaluate()
    # a dict of eval sets: HF prefixes its own metrics per set (eval_a_loss); the trainer's metrics keep TRL's
    # plain eval_ prefix (TRL's log() adds "eval_" whatever the set)
    names = ["eval_a_loss", "eval_b_loss"] if form == "dict" else ["eval_loss"]
    names += [f"eval_{name}" for name in EXPECTED[kind]]
    for name in names:
        assert name in metrics, (name, sorted(metrics))
        assert math.isfinite(metrics[name]), name


def test_streaming_eval_during_training_groups_prompts(tiny_model_path, tmp_path):
    """GRPO evaluates a stream with ``num_generations_eval`` completions per prompt, during training too."""
    rows = Dataset.from_list([{"prompt": f"E{i}:"} for i in range(4)])
    trainer = _trainer(
        "grpo", tmp_path, tiny_model_path, None, rows.to_iterable_dataset(),
        eval_strategy="steps", eval_steps=1, num_generations_eval=4,
    )  # fmt: skip
    seen = []
    generate = trainer._generate_and_score

    def spy(inputs, mode):
        if mode == "eval":
            seen.append([row["prompt"] for row in inputs])
        return generate(inputs, mode)

    trainer._generate_and_score = spy
    trainer.train()
    assert any("eval_reward" in entry for entry in trainer.state.log_history)
    assert seen == [["E0:"] * 4, ["E1:"] * 4, ["E2:"] * 4, ["E3:"] * 4]


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_streaming_eval_leaves_the_train_dataloader_workers(kind, tiny_model_path, tmp_path):
    eval_dataset = _eval_rows(kind).to_iterable_dataset()
    trainer = _trainer(kind, tmp_path, tiny_model_path, None, eval_dataset, dataloader_num_workers=2)
    assert trainer.args.dataloader_num_workers == 2
    assert trainer.get_train_dataloader().num_workers == 2
    assert trainer.get_eval_dataloader().num_workers == (0 if kind == "grpo" else 2)
