"""AsyncGRPOTrainer on captured agent rollouts: ``agent_rollout_func`` is AsyncGRPO's ``rollout_func``, so the rollout
worker runs the agent program (plain httpx against ``/v1/chat/completions`` under a rollout id, one calculator tool
turn), collects the server's capture and turns it into training rows (loss mask over the model's own tokens only);
the trainer consumes them. On-policy (``max_staleness=0``) the captured sampling log-probs are the trainer's own
forward on the same ids (importance-sampling ratio 1 to float tolerance)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from async_grpo_helpers import calculator_agent
from datasets import Dataset

from posttrain.agents.capture import agent_reward_func, agent_rollout_func
from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

_AGENTS = str(Path(__file__).resolve().parents[1] / "agents")
if _AGENTS not in sys.path:
    sys.path.insert(0, _AGENTS)

from test_capture_training import ascii_model_path  # noqa: E402, F401  (the fixture: a tiny model that samples ASCII)

pytestmark = [pytest.mark.usefixtures("no_leaked_children"), pytest.mark.slow]


def test_async_grpo_trains_on_captured_agent_rows(ascii_model_path, tmp_path, monkeypatch):  # noqa: F811
    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    token_log = tmp_path / "sampled.jsonl"
    monkeypatch.setenv("POSTTRAIN_TEST_TOKEN_LOG", str(token_log))  # inherited by the spawned worker
    rounds: list[dict] = []

    class Checked(AsyncGRPOTrainer):
        """Checks each consumed round against the trainer's own forward under the weights it trains with now."""

        def _score_with_current_policy(self, batch, record):
            with torch.no_grad():
                own = self._policy_logps_no_grad(batch)  # (B, C)
            mask = batch["completion_mask"].bool()  # (B, C): the loss mask (tool_mask included)
            model_tokens = [ids[m].tolist() for ids, m in zip(batch["completion_ids"], mask)]
            context = [ids[~m & (torch.arange(mask.shape[1]) < n)].tolist()
                       for ids, m, n in zip(batch["completion_ids"], mask, batch["completion_lengths"])]  # fmt: skip
            rounds.append({"diff": float((own - batch["sampling_per_token_logps"])[mask].abs().max()),
                           "model_tokens": model_tokens, "context": context, "step": self.state.global_step,
                           "context_logps_zero": bool((batch["sampling_per_token_logps"][~mask] == 0).all())})  # fmt: skip
            return super()._score_with_current_policy(batch, record)

    engine = PosttrainEngine.from_pretrained(ascii_model_path, device="cpu", served_model_name="tiny")
    with serve_in_thread(engine) as url:
        args = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", max_steps=2,
                               per_device_train_batch_size=4, num_generations=2, max_completion_length=256,
                               learning_rate=5e-2, temperature=1.0, logging_steps=1, save_strategy="no", seed=0,
                               disable_tqdm=True, write_report=False, gradient_checkpointing=False,
                               vllm_server_base_url=url, max_staleness=0)  # fmt: skip
        data = Dataset.from_list([{"prompt": f"{a}+{b}"} for a, b in [(12, 30), (7, 5), (40, 2), (9, 9)]])
        rollout = agent_rollout_func(calculator_agent, timeout=120, max_workers=4)  # the trainer pushes the weights
        trainer = Checked(ascii_model_path, agent_reward_func, args, train_dataset=data, rollout_func=rollout)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()

    assert [(r["round"], r["staleness"]) for r in trainer.async_rollout.trained_rounds] == [(0, 0), (1, 0)]
    assert [r["step"] for r in rounds] == [0, 1]
    # the agents' own record of what the server sampled for them; the worker may already have started round 2's
    # agents (admitted once version 2 was pushed) before training stopped, so it can hold more than the 8 trained
    sampled = [json.loads(line)["sampled"] for line in token_log.read_text().splitlines()]
    trained = [t for r in rounds for t in r["model_tokens"]]
    assert len(trained) == 8 and len(sampled) >= 8  # 2 rounds × 4 agent runs
    assert all(t in sampled for t in trained)  # each row's loss mask covers exactly one agent's sampled tokens
    for r in rounds:
        assert r["diff"] < 1e-4, r  # captured log-probs = the trainer's forward: IS ratio 1 to float tolerance
        assert r["context_logps_zero"]
        assert all("<tool_response>" in engine.tokenizer.decode(c) for c in r["context"])  # tool output: context
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert logs["sampling/raw_importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-4)
    assert logs["sampling/raw_importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    assert 0.0 <= logs["reward"] <= 1.0
