"""``trainer.evaluate(eval_dataset=raw)`` prepares the dataset it is given exactly as the constructor prepares
``eval_dataset`` (issue 35, item 3): a ``Dataset``, a dict of them, a ``DatasetDict``, an ``IterableDataset`` and a
dict of streams, for every trainer — the metrics equal those of the same rows given to the constructor."""

from __future__ import annotations

import math
import re

import pytest
from datasets import DatasetDict, IterableDatasetDict
from reward_helpers import varied_reward as _reward
from test_epoch_remainder import CASES
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

KINDS = ["sft", "dpo", "kto", "reward", "grpo", "rloo"]
FORMS = ["plain", "dict", "datasetdict", "stream", "stream_dict"]
TIMING = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")


def _build(kind, tmp_path, model_path, reward_model_path, eval_dataset=None):
    config_class, trainer_class, data, extra = CASES[kind]
    args = fast_config(config_class, tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                       max_steps=1, **extra)  # fmt: skip
    kwargs = {"reward_funcs": _reward} if kind in ("grpo", "rloo") else {}
    model = reward_model_path if kind == "reward" else model_path
    return trainer_class(model, args=args, train_dataset=data(), eval_dataset=eval_dataset, **kwargs)


def _raw(kind, form):
    rows = CASES[kind][2]().select(range(4))
    other = CASES[kind][2]().select(range(1, 5))
    return {
        "plain": rows,
        "dict": {"a": rows, "b": other},
        "datasetdict": DatasetDict({"a": rows, "b": other}),
        "stream": rows.to_iterable_dataset(),
        "stream_dict": IterableDatasetDict({"a": rows.to_iterable_dataset(), "b": other.to_iterable_dataset()}),
    }[form]


def _comparable(metrics):
    """The metrics without wall-clock ones (HF's runtime and throughput, the online trainers' timing/*)."""
    return {k: v for k, v in metrics.items() if not k.endswith(TIMING) and "timing/" not in k}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("kind", KINDS)
def test_evaluate_prepares_its_dataset_as_the_constructor(kind, form, tiny_model_path, tiny_reward_model_path,
                                                          tmp_path):  # fmt: skip
    raw = _raw(kind, form)
    given_at_init = _build(kind, tmp_path / "init", tiny_model_path, tiny_reward_model_path, eval_dataset=raw)
    expected = _comparable(given_at_init.evaluate())
    given_to_evaluate = _build(kind, tmp_path / "evaluate", tiny_model_path, tiny_reward_model_path)
    got = _comparable(given_to_evaluate.evaluate(eval_dataset=raw))
    assert sorted(got) == sorted(expected)
    loss_names = ["eval_a_loss", "eval_b_loss"] if "dict" in form else ["eval_loss"]
    for name in loss_names:  # HF's per-split prefixes for a dict, as transformers
        assert name in got, sorted(got)
    for name, value in expected.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-6) or (math.isnan(got[name]) and math.isnan(value))


@pytest.mark.parametrize("kind", ["sft", "dpo", "kto", "reward"])
def test_evaluate_caches_the_prepared_dataset(kind, tiny_model_path, tiny_reward_model_path, tmp_path, monkeypatch):
    raw = _raw(kind, "plain")
    trainer = _build(kind, tmp_path, tiny_model_path, tiny_reward_model_path, eval_dataset=_raw(kind, "plain"))
    calls = []
    original = trainer._prepare_dataset

    def counting(dataset, *args, **kwargs):
        calls.append(dataset)
        return original(dataset, *args, **kwargs)

    monkeypatch.setattr(trainer, "_prepare_dataset", counting)
    first = trainer.evaluate(eval_dataset=raw)
    second = trainer.evaluate(eval_dataset=raw)
    assert len(calls) == 1 and calls[0] is raw  # prepared once, then served from the cache
    assert _comparable(first) == _comparable(second)
    trainer.evaluate(eval_dataset=trainer.eval_dataset)  # the constructor's prepared set is not prepared again
    trainer.evaluate(eval_dataset={"x": trainer.eval_dataset})
    assert len(calls) == 1


def test_evaluate_refuses_what_the_constructor_refuses(tiny_model_path, tmp_path):
    trainer = _build("dpo", tmp_path, tiny_model_path, None)
    with pytest.raises(ValueError, match=r"eval_dataset\['a'\] has 0 rows"):
        trainer.evaluate(eval_dataset={"a": _raw("dpo", "plain").select([])})
    with pytest.raises(TypeError, match="eval_dataset"):
        trainer.evaluate(eval_dataset=[{"prompt": "Q", "chosen": " a", "rejected": " b"}])


def _build_precompute(kind, tmp_path, model_path, eval_dataset=None, **overrides):
    config_class, trainer_class, data, extra = CASES[kind]
    args = fast_config(config_class, tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                       max_steps=1, precompute_ref_log_probs=True, **{**extra, **overrides})  # fmt: skip
    return trainer_class(model_path, args=args, train_dataset=data(), eval_dataset=eval_dataset)


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_evaluate_precomputes_the_reference_columns(kind, tiny_model_path, tmp_path):
    """With ``precompute_ref_log_probs`` the new set gets its reference columns as the constructor's sets do."""
    raw = _raw(kind, "plain")
    expected = _comparable(_build_precompute(kind, tmp_path / "init", tiny_model_path, eval_dataset=raw).evaluate())
    trainer = _build_precompute(kind, tmp_path / "evaluate", tiny_model_path)
    got = _comparable(trainer.evaluate(eval_dataset=raw))
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    marker = "ref_chosen_logps" if kind == "dpo" else "ref_logps"
    assert marker in trainer._prepared_eval_datasets[id(raw)][1].column_names
    assert not trainer.reference.needs_forward  # released again: no reference copy is kept


def test_evaluate_after_training_needs_the_reference(tiny_model_path, tmp_path):
    """Full fine-tuning: the policy was the reference only before training (TRL raises the same way)."""
    trainer = _build_precompute("dpo", tmp_path, tiny_model_path)
    trainer.train()
    phrase = "Cannot compute reference log-probs for a dataset passed to `evaluate()`"
    with pytest.raises(ValueError, match="^" + re.escape(phrase)):
        trainer.evaluate(eval_dataset=_raw("dpo", "plain"))


def test_evaluate_after_training_with_a_peft_reference(tiny_model_path, tmp_path):
    """A LoRA policy's reference is the policy with its adapters off: still there after training."""
    from peft import LoraConfig

    config_class, trainer_class, data, extra = CASES["dpo"]
    args = fast_config(config_class, tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                       max_steps=1, precompute_ref_log_probs=True, learning_rate=1e-2)  # fmt: skip
    trainer = trainer_class(tiny_model_path, args=args, train_dataset=data(), eval_dataset=_raw("dpo", "plain"),
                            peft_config=LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    at_init = trainer.eval_dataset["ref_chosen_logps"]
    trainer.train()
    raw = _raw("dpo", "plain")  # the same rows, a new object
    metrics = trainer.evaluate(eval_dataset=raw)
    assert math.isfinite(metrics["eval_loss"])
    # the reference is the base model: the trained adapter does not change its log-probs
    assert trainer._prepared_eval_datasets[id(raw)][1]["ref_chosen_logps"] == pytest.approx(at_init, abs=1e-5)
    assert not trainer.reference.needs_forward


def test_the_cache_of_prepared_datasets_is_bounded(tiny_model_path, tmp_path, monkeypatch):
    import posttrain.trainers.base as base

    monkeypatch.setattr(base, "MAX_CACHED_EVAL_DATASETS", 2)
    trainer = _build("sft", tmp_path, tiny_model_path, None)
    trainer._prepare_eval_dataset = lambda dataset, name: dataset  # only the bookkeeping is under test
    raws = [_raw("sft", "plain") for _ in range(3)]
    for raw in raws:
        trainer._prepared_eval_split(raw, "eval")
    assert [entry[0] for entry in trainer._prepared_eval_datasets.values()] == raws[1:]
