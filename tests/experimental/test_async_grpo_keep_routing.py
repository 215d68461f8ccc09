"""AsyncGRPO with ``keep_routing`` over loopback: the rollout worker asks ``posttrain serve`` for the MoE routing
(``return_routing``), the round carries it, and the trainer's π_old / loss forwards replay it. At
``max_staleness=0`` every round is sampled from the weights it trains with, so the importance ratio is 1 on every
token with the routing replayed, and not without it (near-tied routers). No child process is left behind."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward

from posttrain.models.tiny import build_tiny_moe_model, build_tiny_tokenizer
from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

pytestmark = pytest.mark.usefixtures("no_leaked_children")


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-async")
    tokenizer = build_tiny_tokenizer()
    build_tiny_moe_model("qwen3_moe", num_experts=8, router_spread=1e-7, tokenizer=tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _train(path: str, out, url: str, keep_routing: bool):
    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    args = AsyncGRPOConfig(
        output_dir=str(out), report_to="none", save_strategy="no", logging_steps=1, gradient_checkpointing=False,
        write_report=False, disable_tqdm=True, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=10, max_steps=2, learning_rate=1e-3, seed=7, lr_scheduler_type="constant",
        use_vllm=True, vllm_mode="server", vllm_server_base_url=url, max_staleness=0,
        rollout_importance_sampling=True, vllm_importance_sampling_mode="token_truncate", keep_routing=keep_routing,
    )  # fmt: skip
    torch.manual_seed(0)
    trainer = AsyncGRPOTrainer(path, varied_reward, args,
                               train_dataset=Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(16)]))  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    steps = [e for e in trainer.state.log_history if "sampling/raw_importance_sampling_ratio/min" in e]
    changed = any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    return trainer, steps, changed


@pytest.mark.slow
def test_async_grpo_replays_the_servers_routing_at_max_staleness_0(moe_path, tmp_path):
    with serve_in_thread(PosttrainEngine.from_pretrained(moe_path, device="cpu")) as url:
        trainer, steps, changed = _train(moe_path, tmp_path / "replay", url, keep_routing=True)
        _, plain_steps, _ = _train(moe_path, tmp_path / "plain", url, keep_routing=False)
    assert changed and trainer.state.global_step == 2
    assert [r["staleness"] for r in trainer.async_rollout.trained_rounds] == [0, 0]
    assert len(steps) == 2  # both steps were scored against the server's log-probs
    for entry in steps:
        assert entry["sampling/raw_importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-4)
        assert entry["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)
    mismatch = max(max(e["sampling/raw_importance_sampling_ratio/max"] - 1.0,
                       1.0 - e["sampling/raw_importance_sampling_ratio/min"]) for e in plain_steps)  # fmt: skip
    assert mismatch > 1e-3


def test_keep_routing_with_partial_rollouts_is_refused():
    from posttrain.experimental.async_grpo import AsyncGRPOConfig

    with pytest.raises(ValueError, match="keep_routing=True cannot be combined with partial_rollout_max_tokens"):
        AsyncGRPOConfig(output_dir="/tmp/unused", report_to="none", keep_routing=True, max_staleness=1,
                        max_completion_length=8, partial_rollout_max_tokens=4)  # fmt: skip
