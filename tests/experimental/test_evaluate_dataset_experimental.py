"""``evaluate(eval_dataset=raw)`` on the experimental pairwise trainers (CPO, ORPO) and PRM prepares the dataset as
their constructors do (issue 35, item 3): the metrics equal those of the same rows given to the constructor."""

from __future__ import annotations

import pytest
import torch
from experimental_helpers import pairs
from test_prm import stepwise
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.experimental.cpo import CPOConfig, CPOTrainer
from posttrain.experimental.orpo import ORPOConfig, ORPOTrainer
from posttrain.experimental.prm import PRMConfig, PRMTrainer

CASES = {
    "cpo": (CPOConfig, CPOTrainer, pairs),
    "orpo": (ORPOConfig, ORPOTrainer, pairs),
    "prm": (PRMConfig, PRMTrainer, stepwise),
}
TIMING = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")


def _metrics(kind, tmp_path, model_path, raw, at_init):
    config_class, trainer_class, data = CASES[kind]
    args = fast_config(
        config_class, tmp_path, max_steps=1, per_device_train_batch_size=2, per_device_eval_batch_size=2
    )
    torch.manual_seed(0)  # PRM's token-classification head is newly initialised from the global RNG
    trainer = trainer_class(model_path, args=args, train_dataset=data(), eval_dataset=raw if at_init else None)
    metrics = trainer.evaluate() if at_init else trainer.evaluate(eval_dataset=raw)
    return {k: v for k, v in metrics.items() if not k.endswith(TIMING)}


@pytest.mark.parametrize("form", ["plain", "dict", "stream"])
@pytest.mark.parametrize("kind", list(CASES))
def test_evaluate_prepares_its_dataset_as_the_constructor(kind, form, tiny_model_path, tmp_path):
    rows = CASES[kind][2](3)
    raw = {"plain": rows, "dict": {"a": rows, "b": rows.select([0])}, "stream": rows.to_iterable_dataset()}[form]
    expected = _metrics(kind, tmp_path / "init", tiny_model_path, raw, at_init=True)
    got = _metrics(kind, tmp_path / "evaluate", tiny_model_path, raw, at_init=False)
    assert ("eval_a_loss" in got) if form == "dict" else ("eval_loss" in got)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
