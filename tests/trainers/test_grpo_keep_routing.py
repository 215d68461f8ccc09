"""GRPO's ``keep_routing`` on a tiny Qwen3-MoE whose routers are nearly tied on purpose: on-policy, the logged
rollout importance ratio is 1 on every token with the routing replayed, and measurably not without it; the
option fails clearly where it cannot work."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.models.tiny import build_tiny_moe_model, build_tiny_tokenizer
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer


@pytest.fixture(scope="module")
def near_tied_moe_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-qwen3-moe-tied"))
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_moe_model("qwen3_moe", num_experts=8, router_spread=1e-7, tokenizer=tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _logs(trainer) -> dict:
    merged = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    return merged


def _train(path: str, tmp_path, keep_routing: bool, **overrides) -> dict:
    args = fast_config(
        GRPOConfig, tmp_path, per_device_train_batch_size=8, num_generations=4, max_completion_length=12,
        max_steps=1, learning_rate=1e-3, rollout_importance_sampling=True,
        vllm_importance_sampling_mode="token_truncate", keep_routing=keep_routing, **overrides,
    )  # fmt: skip
    dataset = Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])
    torch.manual_seed(0)
    trainer = GRPOTrainer(path, varied_reward, args, train_dataset=dataset)
    trainer.train()
    return _logs(trainer)


def test_on_policy_ratio_is_one_with_routing_replayed(near_tied_moe_path, tmp_path):
    replayed = _train(near_tied_moe_path, tmp_path / "replay", keep_routing=True)
    for key in ("raw_importance_sampling_ratio/min", "raw_importance_sampling_ratio/max"):
        assert replayed[f"sampling/{key}"] == pytest.approx(1.0, abs=1e-4), key
    assert replayed["sampling/sampling_logp_difference/max"] < 1e-4
    plain = _train(near_tied_moe_path, tmp_path / "plain", keep_routing=False)
    mismatch = max(plain["sampling/raw_importance_sampling_ratio/max"] - 1.0,
                   1.0 - plain["sampling/raw_importance_sampling_ratio/min"])  # fmt: skip
    assert mismatch > 1e-3
    assert plain["sampling/sampling_logp_difference/max"] > 1e-3


def test_keep_routing_with_gradient_checkpointing_and_aux_loss(tmp_path):
    """The full step runs with the policy forward checkpointed and the router's aux loss on (it stays finite)."""
    path = str(tmp_path / "moe")
    tokenizer = build_tiny_tokenizer()
    build_tiny_moe_model("mixtral", router_spread=1e-7, output_router_logits=True, tokenizer=tokenizer).save_pretrained(
        path
    )
    tokenizer.save_pretrained(path)
    logs = _train(path, tmp_path / "run", keep_routing=True, gradient_checkpointing=True, beta=0.04)
    assert torch.isfinite(torch.tensor(logs["aux_loss"])) and logs["aux_loss"] > 0
    assert torch.isfinite(torch.tensor(logs["loss"]))


def test_keep_routing_errors(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="keep_routing=True.*no MoE router"):
        _train(tiny_model_path, tmp_path, keep_routing=True)
    with pytest.raises(ValueError, match="keep_routing=True records the MoE routing.*generation_backend='posttrain'"):
        GRPOConfig(output_dir=str(tmp_path), keep_routing=True, generation_backend="transformers", report_to="none")
    with pytest.raises(ValueError, match="keep_routing=True records the MoE routing"):
        GRPOConfig(output_dir=str(tmp_path), keep_routing=True, use_vllm=True, report_to="none")


def test_rloo_replays_the_routing_in_its_loss_forward(near_tied_moe_path, tmp_path, monkeypatch):
    """RLOO scores through the same path: its training forward runs under the replay (counted), on every row."""
    import posttrain.models.completion_scoring as scoring
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    replayed_rows = []
    original = scoring.replay_routing

    def counting(model, routing):
        replayed_rows.append(int(routing.shape[0]))
        return original(model, routing)

    monkeypatch.setattr(scoring, "replay_routing", counting)
    args = fast_config(
        RLOOConfig, tmp_path, per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
        max_steps=1, learning_rate=1e-3, keep_routing=True,
    )  # fmt: skip
    trainer = RLOOTrainer(
        near_tied_moe_path, varied_reward, args, train_dataset=Dataset.from_list([{"prompt": f"Q{i}:"} for i in range(8)])
    )
    trainer.train()
    assert replayed_rows  # the loss forward (plain rows or shared-prompt packs) replayed the sampler's routing
