"""AsyncGRPOTrainer with ``environment_factory`` over a real OpenEnv server (openenv-core) on 127.0.0.1.

The environment classes (``tests/agents/openenv_helpers``) hold ``OpenEnvSession`` handles; the factory (a
``functools.partial`` of a module-level class) and its pooled instances are pickled into the rollout worker process,
whose sessions open their own WebSocket connections there. The policy server is ``posttrain serve`` in a thread over
the scripted tiny model (as in ``test_async_grpo_agents``), so every rollout really plays the game.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import pytest

pytest.importorskip("openenv.core", reason='openenv-core is not installed (pip install "posttrain[openenv]")')
pytest.importorskip("fastapi")

_AGENTS = str(Path(__file__).resolve().parents[1] / "agents")
if _AGENTS not in sys.path:
    sys.path.insert(0, _AGENTS)

from agent_helpers import ScriptedLM, tool_responses  # noqa: E402
from datasets import Dataset  # noqa: E402
from openenv_helpers import GuessToolEnv, Server, bisect_script, secret_for  # noqa: E402

from posttrain.generation.weights import load_into, weight_specs  # noqa: E402
from posttrain.serving.app import serve_in_thread  # noqa: E402
from posttrain.serving.engine import PosttrainEngine  # noqa: E402

pytestmark = [pytest.mark.usefixtures("no_leaked_children"), pytest.mark.slow]


class _ScriptedEngine(PosttrainEngine):
    """The engine over a ScriptedLM: weight updates (the trainer's names) are checked against and land in the
    wrapped tiny model."""

    def weight_specs(self):
        return weight_specs(self.model.model)

    def load_weights(self, tensors):
        return load_into(self.model.model, tensors)


@pytest.fixture()
def guess_server():
    server = Server("guess")
    yield server
    server.stop()
    assert server.process.returncode is not None


def test_async_grpo_plays_an_openenv_game_in_the_worker(guess_server, tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    scripted = ScriptedLM(AutoModelForCausalLM.from_pretrained(tiny_model_path), tokenizer, bisect_script)
    games = [2, 4, 5, 7]  # even games bisect to the secret (reward 1), odd ones guess 4 once
    rows = [{"prompt": [{"role": "user", "content": f"Game {g}."}], "seed": g} for g in games]
    with serve_in_thread(_ScriptedEngine(scripted, tokenizer)) as url:
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path), report_to="none", logging_steps=1, gradient_checkpointing=False,
            write_report=False, disable_tqdm=True, save_strategy="no", per_device_train_batch_size=4,
            num_generations=2, max_completion_length=512, learning_rate=1e-2, seed=7, max_steps=2,
            vllm_server_base_url=url, max_staleness=1,
        )  # fmt: skip
        trainer = AsyncGRPOTrainer(
            tiny_model_path, None, args, train_dataset=Dataset.from_list(rows),
            environment_factory=partial(GuessToolEnv, guess_server.url),
        )  # fmt: skip
        trainer.train()
    means = [e["rewards/GuessToolEnv/mean"] for e in trainer.state.log_history if "rewards/GuessToolEnv/mean" in e]
    assert len(means) == 2
    # Each round holds 2 games x 2 generations; all four games over the two rounds, each game's reward from the server.
    expected = {g: 1.0 if g % 2 == 0 else float(secret_for(g) == 4) for g in games}
    assert sum(means) * 2 == pytest.approx(sum(expected.values()))
    assert any(tool_responses(c) and tool_responses(c)[-1] == "correct" for c in scripted.contexts)
    assert [e["tools/failure_frequency"] for e in trainer.state.log_history if "tools/failure_frequency" in e] == [
        0,
        0,
    ]


def test_async_grpo_server_killed_mid_rollout_fails_naming_the_url(guess_server, tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from posttrain.rollout.async_worker import RolloutWorkerError

    def script(context):
        guess_server.kill()  # runs in the policy server: the environment server dies before the first step
        return bisect_script(context)

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    scripted = ScriptedLM(AutoModelForCausalLM.from_pretrained(tiny_model_path), tokenizer, script)
    rows = [{"prompt": [{"role": "user", "content": f"Game {g}."}], "seed": g} for g in (2, 4)]
    with serve_in_thread(_ScriptedEngine(scripted, tokenizer)) as url:
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path), report_to="none", logging_steps=1, gradient_checkpointing=False,
            write_report=False, disable_tqdm=True, save_strategy="no", per_device_train_batch_size=4,
            num_generations=2, max_completion_length=256, learning_rate=1e-2, seed=7, max_steps=1,
            vllm_server_base_url=url, max_staleness=1,
        )  # fmt: skip
        trainer = AsyncGRPOTrainer(
            tiny_model_path, None, args, train_dataset=Dataset.from_list(rows),
            environment_factory=partial(GuessToolEnv, guess_server.url, timeout_s=10),
        )  # fmt: skip
        start = time.monotonic()
        pattern = rf"EnvironmentUnavailableError: OpenEnv server at ws://127\.0\.0\.1:{guess_server.port}/ws .*step"
        with pytest.raises(RolloutWorkerError, match=pattern):
            trainer.train()
        assert time.monotonic() - start < 120
    assert trainer.state.global_step == 0
