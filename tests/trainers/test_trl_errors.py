"""Where TRL 1.16 raises, posttrain raises the same exception type with TRL's phrase first, then its own fix
(issue 35, item 7): users and TRL's tests match on ``str(e)``. Warnings TRL logs through ``logging`` go through
``logging`` here too, so handlers and ``caplog`` see them."""

from __future__ import annotations

import logging
import re

import pytest
from datasets import Dataset
from reward_helpers import varied_reward as _reward
from test_epoch_remainder import CASES
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain import GRPOConfig, GRPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer


def _start(phrase: str) -> str:
    """A regex matching messages that begin with ``phrase``."""
    return "^" + re.escape(phrase)


@pytest.mark.parametrize("kind", ["sft", "dpo", "kto", "reward", "grpo", "rloo"])
def test_missing_train_dataset(kind, tiny_model_path, tiny_reward_model_path, tmp_path):
    config_class, trainer_class, data, extra = CASES[kind]
    kwargs = {"reward_funcs": _reward} if kind in ("grpo", "rloo") else {}
    model = tiny_reward_model_path if kind == "reward" else tiny_model_path
    phrase = "`train_dataset` is required"
    if kind == "grpo":
        phrase += " unless an `environment_factory` is provided"
    with pytest.raises(ValueError, match=_start(phrase)):
        trainer_class(model, args=fast_config(config_class, tmp_path, **extra), train_dataset=None,
                      eval_dataset=data(), **kwargs)  # fmt: skip


def test_reward_model_with_several_labels(tmp_path):
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from posttrain.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=2, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    model = AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(
        ValueError, match=_start("The model has `num_labels=2`, but reward models require `num_labels=1`")
    ):
        RewardTrainer(model, args=fast_config(RewardConfig, tmp_path), train_dataset=CASES["reward"][2](),
                      processing_class=tok)  # fmt: skip


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_streaming_without_max_steps(kind, tiny_model_path, tmp_path):
    config_class, trainer_class, data, extra = CASES[kind]
    kwargs = {"reward_funcs": _reward} if kind == "grpo" else {}
    phrase = "args.max_steps must be set to a positive value if dataloader does not have a length, was -1"
    with pytest.raises(ValueError, match=_start(phrase)):
        trainer_class(tiny_model_path, args=fast_config(config_class, tmp_path, **extra),
                      train_dataset=data().to_iterable_dataset(), **kwargs)  # fmt: skip


def test_sft_with_transform(tiny_model_path, tmp_path):
    text = Dataset.from_dict({"text": ["hello there", "general kenobi"]})
    phrase = "SFTTrainer cannot prepare a dataset that uses `Dataset.with_transform()`"
    with pytest.raises(ValueError, match=_start(phrase)):
        SFTTrainer(
            tiny_model_path, args=fast_config(SFTConfig, tmp_path), train_dataset=text.with_transform(lambda b: b)
        )
    # as TRL: with skip_prepare_dataset nothing is prepared, so a transform returning ready rows is accepted
    ready = Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[1, 2, 3]]}).with_transform(lambda b: b)
    args = fast_config(SFTConfig, tmp_path, dataset_kwargs={"skip_prepare_dataset": True})
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=ready)
    assert trainer.train_dataset.format["type"] == "custom"


def test_sft_padding_free_without_packing_with_max_length(tiny_model_path, tmp_path):
    text = Dataset.from_dict({"text": ["hello there", "general kenobi"]})
    phrase = "When `padding_free=True` without packing, `max_length` is not enforced."
    with pytest.raises(ValueError, match=_start(phrase)):
        SFTTrainer(tiny_model_path, args=fast_config(SFTConfig, tmp_path, padding_free=True), train_dataset=text)


@pytest.mark.parametrize("kind", ["sft", "dpo", "grpo"])
def test_liger_with_a_peft_adapter_on_lm_head(kind, tiny_model_path, tmp_path):
    from peft import LoraConfig

    config_class, trainer_class, data, extra = CASES[kind]
    kwargs = {"reward_funcs": _reward} if kind == "grpo" else {}
    peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"])
    args = fast_config(config_class, tmp_path, use_liger_kernel=True, **extra)
    with pytest.raises(ValueError, match=_start("Applying a PEFT adapter to `lm_head` is not supported")):
        trainer_class(tiny_model_path, args=args, train_dataset=data(), peft_config=peft_config, **kwargs)
    # without Liger posttrain trains such an adapter through the logits (a deliberate superset of TRL)
    args = fast_config(config_class, tmp_path, **extra)
    peft_config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "lm_head"])
    trainer_class(tiny_model_path, args=args, train_dataset=data(), peft_config=peft_config, **kwargs)


@pytest.mark.parametrize("loss_type", ["bnpo", "dr_grpo", "dapo"])
def test_sequence_level_is_with_a_token_summed_loss_is_logged(loss_type, tiny_model_path, tmp_path, caplog):
    args = fast_config(GRPOConfig, tmp_path, num_generations=2, max_completion_length=4, loss_type=loss_type,
                       importance_sampling_level="sequence")  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        GRPOTrainer(tiny_model_path, reward_funcs=_reward, args=args, train_dataset=CASES["grpo"][2]())
    messages = [r.getMessage() for r in caplog.records]
    phrase = (
        f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums per-token contributions"
    )
    assert any(m.startswith(phrase) for m in messages), messages


def test_all_rewards_none_is_logged(tiny_model_path, tmp_path, caplog):
    def never(completions, **kwargs):
        return [None] * len(completions)

    args = fast_config(GRPOConfig, tmp_path, num_generations=2, max_completion_length=4, max_steps=1,
                       per_device_train_batch_size=2)  # fmt: skip
    trainer = GRPOTrainer(tiny_model_path, reward_funcs=[_reward, never], args=args,
                          train_dataset=CASES["grpo"][2]())  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        trainer.train()
    assert not any("returned None" in r.getMessage() for r in caplog.records)  # one function always scores
    trainer = GRPOTrainer(tiny_model_path, reward_funcs=never, args=args, train_dataset=CASES["grpo"][2]())
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        trainer.train()
    assert any(r.getMessage().startswith("All reward functions returned None for the following kwargs:")
               for r in caplog.records)  # fmt: skip
