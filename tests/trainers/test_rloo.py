"""RLOOTrainer end to end on the offline tiny models: defaults, KL folded into the reward, leave-one-out advantages,
PEFT, reward sources, invariance, learning and config errors."""

from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward
from trainer_helpers import (  # noqa: F401
    assert_same_params,
    fast_config,
    quiet_single_thread,
    train_and_snapshot,
    trainable_params,
)

from posttrain.rollout.estimators import LeaveOneOutEstimator
from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

EOS = 258


def _dataset(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(n)])


def _config(tmp_path, **overrides) -> RLOOConfig:
    values = dict(per_device_train_batch_size=4, max_completion_length=8, max_steps=1, learning_rate=1e-2)
    return fast_config(RLOOConfig, tmp_path, **{**values, **overrides})


def _trainable(trainer) -> dict[str, torch.Tensor]:
    return trainable_params(trainer.model)


def _changed(trainer, before) -> int:
    return sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)


def test_defaults_match_trl(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = RLOOConfig(output_dir=str(tmp_path))
    assert (args.num_generations, args.beta, args.learning_rate) == (2, 0.05, 1e-6)
    assert args.normalize_advantages is False and args.reward_clip_range is None
    assert not hasattr(args, "loss_type") and not hasattr(args, "scale_rewards")
    trainer = RLOOTrainer(tiny_model_path, varied_reward, train_dataset=_dataset())
    assert trainer.args.output_dir.endswith("-RLOO")


def test_trains_with_kl_in_the_reward(tiny_model_path, tmp_path):
    trainer = RLOOTrainer(tiny_model_path, varied_reward, _config(tmp_path, max_steps=2), train_dataset=_dataset())
    assert isinstance(trainer.pipeline.estimator, LeaveOneOutEstimator)
    assert trainer.reference.kind == "model"
    before = _trainable(trainer)
    trainer.train()
    assert _changed(trainer, before) > 0
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6) and history[1]["kl"] != 0.0
    for key in ("loss", "reward", "reward_std", "frac_reward_zero_std", "entropy", "clip_ratio/region_mean",
                "completions/mean_length", "rewards/varied_reward/mean", "num_tokens"):  # fmt: skip
        assert key in history[-1], key
    batch = trainer.buffer.micro_batches[0]
    assert "old_per_token_logps" in batch and "ref_per_token_logps" in batch  # π_old always recomputed


def test_normalize_advantages_and_reward_clip_range(tiny_model_path, tmp_path):
    args = _config(tmp_path, beta=0.0, normalize_advantages=True, reward_clip_range=(0.0, 3.0), num_generations=4)
    trainer = RLOOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    assert trainer.reference.kind == "none"
    before = _trainable(trainer)
    trainer.train()
    assert _changed(trainer, before) > 0
    advantages = trainer.buffer.micro_batches[0]["advantages"]
    assert advantages.mean().abs() < 1e-5  # batch-normalised


def test_moe_router_aux_loss_is_added_and_logged(tmp_path, tiny_tokenizer):
    """A tiny Qwen2-MoE policy with router logits: RLOO's loss includes router_aux_loss_coef · aux_loss (TRL's RLOO).

    β = 0 and one on-policy step: ρ_i = 1 and the leave-one-out advantages of a group sum to 0, so the policy term is
    0 and the logged loss is the aux term alone (without it the loss would be ~0 and no aux_loss would be logged)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, output_router_logits=True, pad_token_id=259, eos_token_id=EOS,
        bos_token_id=None,
    )  # fmt: skip
    model = Qwen2MoeForCausalLM(config)
    args = _config(tmp_path, beta=0.0, num_generations=4, router_aux_loss_coef=0.1)
    trainer = RLOOTrainer(model, varied_reward, args, train_dataset=_dataset(4), processing_class=tiny_tokenizer)
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["aux_loss"] > 0
    assert logged["loss"] == pytest.approx(0.1 * logged["aux_loss"], abs=1e-5)


def test_peft_and_reward_model(tiny_model_path, tiny_reward_model_path, tmp_path):
    from peft import LoraConfig

    trainer = RLOOTrainer(
        tiny_model_path,
        [varied_reward, tiny_reward_model_path],
        _config(tmp_path),
        train_dataset=_dataset(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.reference.kind == "adapters_disabled"
    before = _trainable(trainer)
    trainer.train()
    assert _changed(trainer, before) > 0
    logs = trainer.state.log_history[0]
    assert f"rewards/{os.path.basename(tiny_reward_model_path.rstrip('/'))}/mean" in logs


@pytest.mark.invariance
def test_batch_times_grad_accum_invariance(tiny_model_path, tmp_path):
    """RLOO's sequence-mean loss is divided by GA: 4×1 ≡ 2×2 ≡ 1×4 (SGD). The whole generation batch is sampled in
    one call from the same seed, so every split trains on the same completions."""
    results = []
    for b, ga in [(4, 1), (2, 2), (1, 4)]:
        args = _config(
            tmp_path / f"{b}x{ga}",
            per_device_train_batch_size=b,
            gradient_accumulation_steps=ga,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,
            seed=1,
        )
        trainer = RLOOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
        results.append(train_and_snapshot(trainer))
    assert_same_params(results)


def test_learns_a_cheap_reward(tiny_model_path, tmp_path):
    def fraction_of_a(completion_ids, **kwargs):
        return [sum(t == 97 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    args = _config(
        tmp_path,
        per_device_train_batch_size=32,
        num_generations=16,
        max_completion_length=4,
        max_steps=20,
        learning_rate=2e-2,
        beta=0.0,
        seed=0,
    )
    trainer = RLOOTrainer(
        tiny_model_path, fraction_of_a, args, train_dataset=Dataset.from_list([{"prompt": "a:"}] * 8)
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert rewards[0] < 0.05 and sum(rewards[-5:]) / 5 > 0.5


def test_errors(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="RLOO requires at least 2 generations per prompt"):
        _config(tmp_path, num_generations=1)
    with pytest.raises(ValueError, match="reward_clip_range must be a pair"):
        _config(tmp_path, reward_clip_range=(1.0, -1.0))
    with pytest.raises(TypeError):
        RLOOTrainer(tiny_model_path, varied_reward, _config(tmp_path), train_dataset=_dataset(), rollout_func=len)


def test_reward_clip_range_from_the_command_line(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(RLOOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--reward_clip_range=-1,1", "--report_to", "none"]
    )
    assert args.reward_clip_range == (-1.0, 1.0)
