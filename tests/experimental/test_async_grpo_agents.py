"""AsyncGRPOTrainer with TRL's ``tools=`` and ``environment_factory``: the tool loop runs in the rollout worker.

The server (``posttrain serve`` in a thread) holds a scripted policy (``tests/agents/agent_helpers.ScriptedLM``: the
real tiny model with each assistant turn forced to a script), so every rollout really calls its tool; the tool runs
in the worker process, its result is sent back to the server as the next prompt tokens (seen here in the scripted
model's contexts) and reaches the reward functions and environments through the completion.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from async_grpo_helpers import CounterEnv, add, tool_result_reward
from datasets import Dataset
from reward_helpers import varied_reward

from posttrain.generation.weights import load_into, weight_specs
from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

_AGENTS = str(Path(__file__).resolve().parents[1] / "agents")
if _AGENTS not in sys.path:
    sys.path.insert(0, _AGENTS)

from agent_helpers import ScriptedLM, call, last_user, tool_responses  # noqa: E402

pytestmark = [pytest.mark.usefixtures("no_leaked_children"), pytest.mark.slow]


class _ScriptedEngine(PosttrainEngine):
    """The engine over a ScriptedLM; weight pushes (the trainer's names) are checked against and land in the wrapped
    tiny model."""

    def weight_specs(self):
        return weight_specs(self.model.model)

    def load_weights(self, tensors):
        return load_into(self.model.model, tensors)


def _script(context: str) -> str:
    """'a+b' → call add (wrongly for odd a, so the reward varies); 'bump' → call the environment's tool; then
    answer with the tool's result."""
    question, responses = last_user(context), tool_responses(context)
    if responses:
        return f"It is {responses[-1]}."
    if "counter" in question:
        return call("bump", '{"by": 4}')
    a, b = (int(x) for x in question.split("+"))
    return call("add", f'{{"a": {a}, "b": {b if a % 2 == 0 else b + 1}}}')


def _serve(tiny_model_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    scripted = ScriptedLM(AutoModelForCausalLM.from_pretrained(tiny_model_path), tokenizer, _script)
    return scripted, serve_in_thread(_ScriptedEngine(scripted, tokenizer))


def _args(path, url, **overrides):
    from posttrain.experimental.async_grpo import AsyncGRPOConfig

    values = dict(
        output_dir=str(path), report_to="none", logging_steps=1, gradient_checkpointing=False, write_report=False,
        disable_tqdm=True, save_strategy="no", per_device_train_batch_size=4, num_generations=2,
        max_completion_length=96, learning_rate=1e-2, seed=7, max_steps=2, vllm_server_base_url=url,
        max_staleness=1,
    )  # fmt: skip
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def _logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def test_tools_are_called_in_the_worker_and_their_results_enter_the_completion(tiny_model_path, tmp_path):
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    rows = [{"prompt": [{"role": "user", "content": f"{a}+3"}], "a": a, "b": 3} for a in (2, 3, 4, 5)]
    scripted, server = _serve(tiny_model_path)
    with server as url:
        trainer = AsyncGRPOTrainer(tiny_model_path, [tool_result_reward, varied_reward], _args(tmp_path, url),
                                   train_dataset=Dataset.from_list(rows), tools=[add])  # fmt: skip
        trainer.train()
    assert len(trainer.async_rollout.trained_rounds) == 2
    assert _logged(trainer, "tools/call_frequency") == [1.0, 1.0]  # every rollout made one call
    assert _logged(trainer, "tools/failure_frequency") == [0.0, 0.0]
    # the worker's tool results went back to the server: the second turns were generated after them
    results = sorted({r for c in scripted.contexts for r in tool_responses(c)})
    assert results == ["5", "7", "9"]  # 2+3 and 4+3; 3+4 and 5+4 (the wrong calls for odd a)
    assert all(re.search(r"<tools>.*\"add\"", c, flags=re.DOTALL) for c in scripted.contexts)  # schema rendered
    # the reward functions saw the tool messages in the completions: only the even-a rows called add correctly
    assert _logged(trainer, "rewards/tool_result_reward/mean") == [0.5, 0.5]


def test_environment_factory_one_environment_per_rollout(tiny_model_path, tmp_path):
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    rows = [{"prompt": [{"role": "user", "content": "Use the counter."}], "start": s} for s in (1, 2, 3, 4)]
    scripted, server = _serve(tiny_model_path)
    with server as url:
        trainer = AsyncGRPOTrainer(tiny_model_path, varied_reward, _args(tmp_path, url),
                                   train_dataset=Dataset.from_list(rows), environment_factory=CounterEnv)  # fmt: skip
        trainer.train()
    assert _logged(trainer, "tools/call_frequency") == [1.0, 1.0]
    # reset(**row) ran per rollout (its observation is in the prompt) and each rollout's bump reached its own counter
    assert {c.split("The counter starts at ")[1][0] for c in scripted.contexts} == {"1", "2", "3", "4"}
    assert sorted({r for c in scripted.contexts for r in tool_responses(c)}) == ["5", "6", "7", "8"]
    # get_reward: one call on a freshly reset instance per rollout, in every round (instances are reused, reset)
    assert _logged(trainer, "rewards/CounterEnv/mean") == [1.0, 1.0]
