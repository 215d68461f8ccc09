"""AsyncGRPOTrainer with an OpenReward (ORS) environment: the spec's factory is pickled into the rollout worker,
whose environments open their own ORS sessions on a real server on 127.0.0.1 (``examples/openreward/echo_env.py``).
The policy server is ``posttrain serve`` in a thread over the scripted tiny model, as in ``test_async_grpo_openenv``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_AGENTS = str(Path(__file__).resolve().parents[1] / "agents")
if _AGENTS not in sys.path:
    sys.path.insert(0, _AGENTS)

from openreward_helpers import OPENREWARD_MISSING  # noqa: E402

pytest.importorskip("openreward", reason=OPENREWARD_MISSING)
pytest.importorskip("fastapi")

from agent_helpers import ScriptedLM, tool_responses  # noqa: E402
from openreward_helpers import OrsServer, peek_then_echo  # noqa: E402

from posttrain.generation.weights import load_into, weight_specs  # noqa: E402
from posttrain.serving.app import serve_in_thread  # noqa: E402
from posttrain.serving.engine import PosttrainEngine  # noqa: E402

pytestmark = [pytest.mark.usefixtures("no_leaked_children"), pytest.mark.slow]
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


class _ScriptedEngine(PosttrainEngine):
    def weight_specs(self):
        return weight_specs(self.model.model)

    def load_weights(self, tensors):
        return load_into(self.model.model, tensors)


@pytest.fixture()
def ors_server():
    server = OrsServer()
    yield server
    server.stop()
    assert server.process.returncode is not None


def test_async_grpo_trains_on_an_ors_environment_in_the_worker(ors_server, tiny_model_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from posttrain.experimental.openreward import OpenRewardSpec

    spec = OpenRewardSpec(ors_server.url, timeout_s=30)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    scripted = ScriptedLM(AutoModelForCausalLM.from_pretrained(tiny_model_path), tokenizer, peek_then_echo)
    with serve_in_thread(_ScriptedEngine(scripted, tokenizer)) as url:
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path), report_to="none", logging_steps=1, gradient_checkpointing=False,
            write_report=False, disable_tqdm=True, save_strategy="no", per_device_train_batch_size=4,
            num_generations=2, max_completion_length=256, learning_rate=1e-2, seed=7, max_steps=2,
            vllm_server_base_url=url, max_staleness=1,
        )  # fmt: skip
        trainer = AsyncGRPOTrainer(
            tiny_model_path, spec.reward_funcs, args, train_dataset=spec.train_dataset,
            environment_factory=spec.environment_factory,
        )  # fmt: skip
        trainer.train()
    key = "rewards/_outcome_only_reward_func/mean"
    means = [e[key] for e in trainer.state.log_history if key in e]
    # Two rounds of 2 tasks x 2 generations over the 4 tasks: "hello"/"world" earn 1.0 from the server, the longer
    # targets 0.0 (the script echoes a wrong word), whatever order the worker drew them in.
    assert len(means) == 2 and sum(means) * 2 == pytest.approx(2.0)
    assert any(tool_responses(c) == ["5", "match"] for c in scripted.contexts)
