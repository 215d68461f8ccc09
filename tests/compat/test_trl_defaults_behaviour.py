"""What TRL 1.16's new defaults and parameters do in posttrain: pad_to_multiple_of="auto", router_aux_loss_coef=None
(the model's own value), quantization_config= on every trainer, trust_remote_code, distillation's tools."""

from __future__ import annotations

import pytest
from datasets import Dataset

TINY = dict(report_to="none", max_steps=1, per_device_train_batch_size=2, gradient_checkpointing=False)
PAIRS = Dataset.from_dict({"prompt": ["q1 ", "q2 "], "chosen": ["yes", "sure"], "rejected": ["no", "nope"]})


def test_pad_to_multiple_of_auto_and_strings(tmp_path):
    import posttrain
    from posttrain.trainers.base import resolve_pad_to_multiple_of

    for cls in (posttrain.SFTConfig, posttrain.DPOConfig, posttrain.RewardConfig, posttrain.KTOConfig):
        assert cls(output_dir=str(tmp_path), report_to="none").pad_to_multiple_of is None  # "auto" off Neuron
    assert posttrain.GRPOConfig(output_dir=str(tmp_path), report_to="none").pad_to_multiple_of is None
    assert (
        posttrain.SFTConfig(output_dir=str(tmp_path), report_to="none", pad_to_multiple_of="64").pad_to_multiple_of
        == 64
    )
    assert resolve_pad_to_multiple_of("none") is None and resolve_pad_to_multiple_of(8) == 8
    with pytest.raises(ValueError, match="pad_to_multiple_of"):
        resolve_pad_to_multiple_of("0")


def _tiny_moe(tokenizer):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, router_aux_loss_coef=0.02,
    )  # fmt: skip
    return Qwen2MoeForCausalLM(config)


def test_router_aux_loss_coef_none_is_the_models_and_a_value_overrides_it(tmp_path, tiny_tokenizer):
    import posttrain

    default = posttrain.DPOTrainer(
        _tiny_moe(tiny_tokenizer),
        args=posttrain.DPOConfig(output_dir=str(tmp_path / "a"), **TINY),
        train_dataset=PAIRS,
        processing_class=tiny_tokenizer,
    )
    assert default.args.router_aux_loss_coef == pytest.approx(0.02)
    model = _tiny_moe(tiny_tokenizer)
    trainer = posttrain.DPOTrainer(
        model,
        args=posttrain.DPOConfig(output_dir=str(tmp_path / "b"), router_aux_loss_coef=0.5, logging_steps=1, **TINY),
        train_dataset=PAIRS,
        processing_class=tiny_tokenizer,
    )
    assert model.config.output_router_logits is True
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["loss"] == pytest.approx(0.693147 + 0.5 * logged["aux_loss"], abs=1e-5)


def test_router_aux_loss_coef_on_a_dense_model_warns(tmp_path, tiny_model_path):
    import posttrain

    with pytest.warns(UserWarning, match="router_aux_loss_coef=0.1 has no effect.*not a Mixture-of-Experts"):
        posttrain.SFTTrainer(
            tiny_model_path,
            args=posttrain.SFTConfig(output_dir=str(tmp_path), router_aux_loss_coef=0.1, **TINY),
            train_dataset=Dataset.from_dict({"text": ["a b c", "d e f"]}),
        )


@pytest.mark.parametrize("trainer", ["dpo", "kto", "reward"])
def test_quantization_config_and_trust_remote_code_reach_the_loader(trainer, tmp_path, tiny_model_path, monkeypatch):
    import posttrain
    import posttrain.models.loading as loading

    seen = {}
    real = loading.create_model_from_path

    def spy(model_id, **kwargs):
        seen.setdefault("kwargs", dict(kwargs))
        kwargs.pop("quantization_config", None)
        kwargs.pop("trust_remote_code", None)
        return real(model_id, **kwargs)

    monkeypatch.setattr(loading, "create_model_from_path", spy)
    marker = object()
    common = dict(output_dir=str(tmp_path), trust_remote_code=True, **TINY)
    if trainer == "dpo":
        posttrain.DPOTrainer(
            tiny_model_path, args=posttrain.DPOConfig(**common), train_dataset=PAIRS, quantization_config=marker
        )
    elif trainer == "kto":
        rows = Dataset.from_dict({"prompt": ["a", "b"], "completion": ["c", "d"], "label": [True, False]})
        posttrain.KTOTrainer(
            tiny_model_path, args=posttrain.KTOConfig(**common), train_dataset=rows, quantization_config=marker
        )
    else:
        posttrain.RewardTrainer(
            tiny_model_path, args=posttrain.RewardConfig(**common), train_dataset=PAIRS, quantization_config=marker
        )
    assert seen["kwargs"]["quantization_config"] is marker
    assert seen["kwargs"]["trust_remote_code"] is True
