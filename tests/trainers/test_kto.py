"""KTOTrainer end to end on the offline tiny model: both loss types, paired → unpaired data, KL pairs from rotated
completions, the batch-size rule, the class-weight warning, PEFT, and precomputed ≡ live reference."""

from __future__ import annotations

import math
import os

import pytest
from datasets import Dataset

# quiet_single_thread: an autouse fixture, active in this module once imported
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.trainers.kto import BATCH_SIZE_ERROR, KTOConfig, KTOTrainer

METRICS = [
    "kl",
    "entropy",
    "num_tokens",
    "logits/chosen",
    "logits/rejected",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
]


def _unpaired(n: int = 8) -> Dataset:
    prompts = ["The sky is", "Grass is", "Snow is", "Coal is"]
    good, bad = [" blue.", " green.", " white.", " black."], [" red.", " pink.", " hot.", " soft."]
    rows = []
    for i in range(n):
        j = (i // 2) % 4
        rows.append({"prompt": prompts[j], "completion": good[j] if i % 2 == 0 else bad[j], "label": i % 2 == 0})
    return Dataset.from_list(rows)


def _paired(n: int = 4) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": ["The sky is", "Grass is"] * (n // 2),
            "chosen": [" blue.", " green."] * (n // 2),
            "rejected": [" red.", " pink."] * (n // 2),
        }
    )


def _config(tmp_path, **kw) -> KTOConfig:
    return fast_config(
        KTOConfig, tmp_path, **{"max_steps": 2, "per_device_train_batch_size": 4, "learning_rate": 1e-3, **kw}
    )


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_loss_types_train(tmp_path, tiny_model_path, loss_type):
    trainer = KTOTrainer(tiny_model_path, args=_config(tmp_path, loss_type=loss_type), train_dataset=_unpaired())
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    first = trainer.state.log_history[0]
    assert all(name in first for name in METRICS), sorted(set(METRICS) - set(first))
    # Step 1: policy = reference, so u = 0 and z = 0 → each loss is 1 − σ(0) = 0.5 (apo: 1 − σ(0) and σ(0)).
    assert first["loss"] == pytest.approx(0.5, abs=1e-5)
    assert first["kl"] == 0.0
    assert ("KL_completion_ids" in trainer.train_dataset.column_names) == (loss_type == "kto")


def test_kl_term_becomes_positive_after_updates(tmp_path, tiny_model_path):
    trainer = KTOTrainer(
        tiny_model_path, args=_config(tmp_path, max_steps=6, learning_rate=1e-2), train_dataset=_unpaired(16)
    )
    trainer.train()
    kls = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert kls[0] == 0.0 and all(k >= 0 for k in kls) and max(kls) > 0


def test_config_defaults_and_validation(tmp_path, tiny_model_path):
    config = KTOConfig(output_dir=str(tmp_path))
    assert config.train_sampling_strategy == "sequential"
    assert (config.learning_rate, config.beta, config.loss_type, config.max_length) == (1e-6, 0.1, "kto", 1024)
    assert (config.desirable_weight, config.undesirable_weight) == (1.0, 1.0)
    with pytest.raises(ValueError, match="Unknown KTO loss_type"):
        KTOConfig(output_dir=str(tmp_path), loss_type="sigmoid")
    with pytest.raises(ValueError, match="precompute_ref_log_probs"):
        KTOConfig(output_dir=str(tmp_path), sync_ref_model=True, precompute_ref_log_probs=True)


def test_batch_size_one_is_rejected_only_with_kl(tmp_path, tiny_model_path):
    with pytest.raises(ValueError) as err:
        KTOTrainer(tiny_model_path, args=_config(tmp_path, per_device_train_batch_size=1), train_dataset=_unpaired())
    assert str(err.value) == BATCH_SIZE_ERROR
    assert "Actual (not effective) batch size must be > 1" in BATCH_SIZE_ERROR
    args = _config(tmp_path, per_device_train_batch_size=1, loss_type="apo_zero_unpaired", max_steps=1)
    KTOTrainer(tiny_model_path, args=args, train_dataset=_unpaired()).train()


def test_paired_data_is_unpaired_and_kl_pairs_are_rotated_per_block(tmp_path, tiny_model_path, tiny_tokenizer):
    trainer = KTOTrainer(
        tiny_model_path, args=_config(tmp_path, per_device_train_batch_size=3), train_dataset=_paired(4)
    )
    data = trainer.train_dataset
    assert len(data) == 8 and sum(data["label"]) == 4
    completions, kl = data["completion_ids"], data["KL_completion_ids"]
    for start in range(0, len(data), 3):  # blocks of per_device_train_batch_size rows
        block, kl_block = completions[start : start + 3], kl[start : start + 3]
        assert kl_block == block[-1:] + block[:-1]
    assert tiny_tokenizer.decode(completions[0]).endswith("<|im_end|>")  # EOS appended to standard data
    trainer.train()


def test_conversational_and_implicit_prompt_data(tmp_path, tiny_model_path, tiny_tokenizer):
    user = [{"role": "user", "content": "Sky colour?"}]
    rows = [
        {"prompt": user, "completion": [{"role": "assistant", "content": c}], "label": lab}
        for c, lab in [("Blue.", True), ("Red.", False)] * 2
    ]
    trainer = KTOTrainer(tiny_model_path, args=_config(tmp_path, max_steps=1), train_dataset=Dataset.from_list(rows))
    assert tiny_tokenizer.decode(trainer.train_dataset[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")
    trainer.train()
    implicit = Dataset.from_dict({"chosen": ["The sky is blue."] * 2, "rejected": ["The sky is red."] * 2})
    trainer = KTOTrainer(tiny_model_path, args=_config(tmp_path, max_steps=1), train_dataset=implicit)
    assert tiny_tokenizer.decode(trainer.train_dataset[0]["prompt_ids"]) == "The sky is"


def test_imbalanced_weights_warn(tmp_path, tiny_model_path):
    data = Dataset.from_dict({"prompt": ["a"] * 8, "completion": [" b"] * 8, "label": [True] * 2 + [False] * 6})
    with pytest.warns(UserWarning, match="desirable_weight in \\[3.0, 3.99\\]"):
        KTOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=data)
    with warnings_as_errors():
        KTOTrainer(tiny_model_path, args=_config(tmp_path, desirable_weight=3.0), train_dataset=data)


class warnings_as_errors:
    """Fail if a 'desirable/undesirable weights' warning is raised inside the block."""

    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        self.records = self._ctx.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        assert not [r for r in self.records if "ideal range" in str(r.message)]


def test_class_weights_change_the_loss(tmp_path, tiny_model_path):
    """With only undesirable rows at step 1 (u = z = 0): loss = w_u · 0.5."""
    data = Dataset.from_dict({"prompt": ["a", "b"] * 2, "completion": [" x", " y"] * 2, "label": [False] * 4})
    args = _config(tmp_path, max_steps=1, undesirable_weight=0.3)
    trainer = KTOTrainer(tiny_model_path, args=args, train_dataset=data)
    trainer.train()
    assert trainer.state.log_history[0]["loss"] == pytest.approx(0.15, abs=1e-6)


@pytest.mark.invariance
def test_precomputed_reference_equals_live_reference(tmp_path, tiny_model_path):
    live = KTOTrainer(tiny_model_path, args=_config(tmp_path / "live", max_steps=2), train_dataset=_unpaired())
    live.train()
    pre = KTOTrainer(
        tiny_model_path,
        args=_config(tmp_path / "pre", max_steps=2, precompute_ref_log_probs=True),
        train_dataset=_unpaired(),
    )
    assert pre.reference.kind == "precomputed"
    assert {"ref_logps", "ref_KL_logps"} <= set(pre.train_dataset.column_names)
    pre.train()
    for step in (0, 1):
        for key in ("loss", "kl", "rewards/rejected", "logps/rejected"):
            assert pre.state.log_history[step][key] == pytest.approx(live.state.log_history[step][key], abs=1e-5)


def test_peft_and_save(tmp_path, tiny_model_path):
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = KTOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=_unpaired(), peft_config=config)
    assert trainer.reference.kind == "adapters_disabled" and trainer.reference.model is None
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    trainer.save_model()
    assert os.path.exists(tmp_path / "adapter_config.json")


def test_default_output_dir_and_eval(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = KTOTrainer(tiny_model_path, train_dataset=_unpaired(), eval_dataset=_unpaired(4))
    assert trainer.args.output_dir == f"{os.path.basename(tiny_model_path)}-KTO"
    trainer.args.report_to = []
    trainer.evaluate()
    assert "eval_kl" in trainer.state.log_history[-1] and "eval_rewards/chosen" in trainer.state.log_history[-1]


def test_rows_keep_their_order_for_sequential_batches(tmp_path, tiny_model_path):
    """TRL trains KTO on consecutive rows (sequential sampler, no shuffle): unpaired paired data keeps all
    desirable rows of a chunk first, and an unpaired dataset keeps the user's order (the batches, their KL
    rotation and so the whole trajectory depend on it)."""
    trainer = KTOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=_paired(4))
    assert trainer.train_dataset["label"] == [True] * 4 + [False] * 4
    data = _unpaired(8)
    trainer = KTOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=data)
    assert trainer.train_dataset["label"] == data["label"]
    first = [trainer.processing_class.decode(ids) for ids in trainer.train_dataset["completion_ids"][:4]]
    assert [c.removesuffix("<|im_end|>") for c in first] == data["completion"][:4]


def test_a_class_absent_from_the_batch_is_not_logged(tmp_path, tiny_model_path):
    """Batches with desirable rows only log no rejected metrics and no margin (TRL leaves the keys out), rather
    than NaN/None."""
    rows = [{"prompt": "The sky is", "completion": c, "label": True} for c in [" blue.", " grey.", " clear.", " big."]]
    rows += [{"prompt": "Coal is", "completion": c, "label": False} for c in [" white.", " soft.", " wet.", " pink."]]
    trainer = KTOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=Dataset.from_list(rows))
    trainer.train()
    first, second = trainer.state.log_history[0], trainer.state.log_history[1]
    for key in ("logits/rejected", "rewards/rejected", "logps/rejected", "rewards/margins"):
        assert key not in first, key
    for key in ("logits/chosen", "rewards/chosen", "logps/chosen"):
        assert math.isfinite(first[key]), (key, first[key])  # logged (a KeyError otherwise) and finite
    for key in ("logits/chosen", "rewards/chosen", "logps/chosen", "rewards/margins"):
        assert key not in second, key
    assert math.isfinite(second["logps/rejected"]), second["logps/rejected"]
