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


@pytest.mark.slow
def test_two_processes_replay_the_servers_routing_on_both_ranks(moe_path, tmp_path):
    """2 training processes (torchrun, gloo): the rank-0 worker asks the server for every rank's shard with its
    routing, the round channel carries it to rank 1 with the other per-row tensors, and both ranks replay it: at
    ``max_staleness=0`` the ratio (gathered over both ranks) is 1 on every token; without replay it is not."""
    import os

    from multiprocess_harness import launch_two_processes

    pytest.importorskip("fastapi")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "async_mp_routing_script.py")
    with serve_in_thread(PosttrainEngine.from_pretrained(moe_path, device="cpu")) as url:
        launch_two_processes(script, [moe_path, url, str(tmp_path), "replay,plain"], timeout=900)
    import json

    for rank in (0, 1):
        replay = json.loads((tmp_path / f"replay_{rank}.json").read_text())
        plain = json.loads((tmp_path / f"plain_{rank}.json").read_text())
        assert replay["num_processes"] == 2
        assert [(r["round"], r["staleness"]) for r in replay["rounds"]] == [(0, 0), (1, 0)]
        prompt, completion = replay["routing_shapes"]  # (4 rows, tokens, 2 layers, top-2) on this rank's shard
        assert prompt[0] == completion[0] == 4 and prompt[2:] == completion[2:] == [2, 2]
        assert replay["replay_calls"] >= 2 and plain["replay_calls"] == 0 and plain["routing_shapes"] == []
        assert len(replay["local_gaps"]) == 2 and max(replay["local_gaps"]) < 1e-4  # this rank's own tokens
        steps = [e for e in replay["logs"] if "sampling/raw_importance_sampling_ratio/min" in e]
        assert len(steps) == 2
        for entry in steps:
            assert entry["sampling/raw_importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-4)
            assert entry["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)
        mismatch = max(max(e["sampling/raw_importance_sampling_ratio/max"] - 1.0,
                           1.0 - e["sampling/raw_importance_sampling_ratio/min"])
                       for e in plain["logs"] if "sampling/raw_importance_sampling_ratio/min" in e)  # fmt: skip
        assert mismatch > 1e-3


def _lookup(city: str) -> str:
    """Look a city up.

    Args:
        city: The city.
    """
    return city


@pytest.mark.parametrize("trainer_name", ["AsyncGRPO", "GRPO"])
@pytest.mark.parametrize("option", ["agent_rollout_func", "rollout_func", "tools"])
def test_keep_routing_with_agents_or_rollout_func_is_refused(moe_path, tmp_path, trainer_name, option):
    """Captured agent rows (``agent_rollout_func``), any ``rollout_func`` and tool loops carry no sampler routing (a
    row joins several calls plus tool-output tokens): ``keep_routing`` refuses them at construction, naming the
    option, for AsyncGRPO and for server-mode GRPO alike (no server is contacted)."""
    from posttrain.agents.capture import agent_rollout_func
    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    config, trainer = (AsyncGRPOConfig, AsyncGRPOTrainer) if trainer_name == "AsyncGRPO" else (GRPOConfig, GRPOTrainer)
    args = config(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, use_vllm=True, vllm_mode="server", keep_routing=True,
                  vllm_server_base_url="http://127.0.0.1:9")  # fmt: skip
    extra = {
        "agent_rollout_func": {"rollout_func": agent_rollout_func(["true"], "http://127.0.0.1:9")},
        "rollout_func": {"rollout_func": lambda prompts, trainer: {}},
        "tools": {"tools": [_lookup]},
    }[option]
    used = "tools / environment_factory" if option == "tools" else r"rollout_func \(agent_rollout_func included\)"
    with pytest.raises(ValueError, match=rf"keep_routing=True cannot be combined with {used}.*carry none"):
        trainer(moe_path, varied_reward, args, train_dataset=Dataset.from_list([{"prompt": "Q:"}] * 4), **extra)
