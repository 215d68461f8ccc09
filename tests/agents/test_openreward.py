"""GRPO with OpenReward (Open Reward Standard) environments: a real ORS server on 127.0.0.1, the real SDK client.

The server is ``examples/openreward/echo_env.py``, built with the ``openreward`` package's own server API
(``openreward.environments.Server`` over ``Environment`` / ``@tool``), run as a subprocess; the client side is
``posttrain.experimental.openreward.OpenRewardSpec`` over the SDK's async client (HTTP + SSE). Rollouts come from
the scripted tiny policy (see ``agent_helpers``); the task list, prompts, tool calls and rewards all travel over
the protocol.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pickle
import re
import sys
import time

import pytest
from agent_helpers import last_user, scripted_sampler, tool_responses
from openreward_helpers import OPENREWARD_MISSING, OrsServer, peek_then_echo

from posttrain import GRPOConfig, GRPOTrainer
from posttrain.agents.tools import EnvironmentUnavailableError

HAVE_OPENREWARD = importlib.util.find_spec("openreward") is not None
needs_openreward = pytest.mark.skipif(not HAVE_OPENREWARD, reason=OPENREWARD_MISSING)

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


@pytest.fixture(scope="module")
def ors_server():
    if not HAVE_OPENREWARD:
        pytest.skip(OPENREWARD_MISSING)
    server = OrsServer()
    yield server
    server.stop()
    assert server.process.returncode is not None  # no server left behind


@pytest.fixture()
def own_ors_server():
    """A server this test alone uses (it gets killed or paused)."""
    if not HAVE_OPENREWARD:
        pytest.skip(OPENREWARD_MISSING)
    server = OrsServer()
    yield server
    server.stop()
    assert server.process.returncode is not None


def _config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=256,
        max_steps=2, learning_rate=1e-2, report_to="none", gradient_checkpointing=False, save_strategy="no",
        logging_steps=1, disable_tqdm=True, write_report=False, shuffle_dataset=False,
    )  # fmt: skip
    values.update(overrides)
    return GRPOConfig(**values)


def _use_script(trainer, script):
    sampler, _, scripted = scripted_sampler(script, tokenizer=trainer.processing_class)
    trainer.backend.inner = sampler
    return scripted


@needs_openreward
def test_grpo_trains_on_tasks_tools_and_rewards_from_the_server(ors_server, tiny_model_path, tmp_path):
    from posttrain.experimental.openreward import OpenRewardSpec

    spec = OpenRewardSpec(ors_server.url, timeout_s=30)
    data = spec.train_dataset
    # Tasks listed from the server: one row per task, task specs folded in as columns.
    assert data["task_index"] == [0, 1, 2, 3] and data["target"] == ["hello", "world", "reward", "standard"]
    assert data["prompt"][0] == [{"role": "user", "content": ""}] and data["difficulty"][2] == "hard"
    seen = {}

    def server_reward(environments, **kwargs):  # a custom reward next to the spec's, reading the env state
        seen.setdefault("rewards", []).append([env.rewards for env in environments])
        return [float(env.finished) for env in environments]

    trainer = GRPOTrainer(
        tiny_model_path, [spec.reward_funcs, server_reward], _config(tmp_path), train_dataset=data,
        environment_factory=spec.environment_factory,
    )  # fmt: skip
    assert trainer.reward_func_names == ["_outcome_only_reward_func", "server_reward"]
    scripted = _use_script(trainer, peek_then_echo)
    trainer.train()
    assert trainer.state.global_step == 2
    # peek carries no reward (None); echo's reward is the server's: 1.0 for the short targets, 0.0 for "nope".
    assert seen["rewards"] == [[[None, 1.0]] * 4, [[None, 0.0]] * 4]
    first, second = trainer.state.log_history[0], trainer.state.log_history[1]
    assert (
        first["rewards/_outcome_only_reward_func/mean"] == 1.0
        and second["rewards/_outcome_only_reward_func/mean"] == 0.0
    )
    assert first["rewards/server_reward/mean"] == 1.0 and second["rewards/server_reward/mean"] == 0.0
    assert first["tools/call_frequency"] == 2.0 and first["tools/failure_frequency"] == 0.0
    # The reset prompt reached the user message; tool outputs came back from the server.
    by_target = {re.search(r"Echo '(\w+)'", last_user(c)).group(1): tool_responses(c) for c in scripted.contexts}
    assert by_target["hello"] == ["5", "match"] and by_target["standard"] == ["8", "no match"]
    assert all(last_user(c).startswith("Echo '") for c in scripted.contexts)


@needs_openreward
def test_server_killed_mid_rollout_stops_training_naming_the_url(own_ors_server, tiny_model_path, tmp_path):
    from posttrain.experimental.openreward import OpenRewardSpec

    spec = OpenRewardSpec(own_ors_server.url, num_tasks=2, timeout_s=10)

    def script(context):
        if tool_responses(context):
            own_ors_server.kill()  # after the first tool output, before the second call reaches the server
        return peek_then_echo(context)

    trainer = GRPOTrainer(
        tiny_model_path, spec.reward_funcs, _config(tmp_path, max_steps=1), train_dataset=spec.train_dataset,
        environment_factory=spec.environment_factory,
    )  # fmt: skip
    _use_script(trainer, script)
    start = time.monotonic()
    with pytest.raises(EnvironmentUnavailableError, match=rf"ORS server at {re.escape(own_ors_server.url)} .*'echo'"):
        trainer.train()
    assert time.monotonic() - start < 10 + 30  # one bounded call (timeout_s=10), not the SDK's open-ended retries
    assert trainer.state.global_step == 0


@needs_openreward
def test_spec_selection_bounds_refusals_and_pickling(own_ors_server):
    from transformers.utils import get_json_schema

    from posttrain.experimental.openreward import OpenRewardSpec

    url = own_ors_server.url
    with pytest.raises(ValueError, match="num_tasks or indices, not both"):
        OpenRewardSpec(url, num_tasks=1, indices=[0])
    with pytest.raises(ValueError, match="indices must be a non-empty list"):
        OpenRewardSpec(url, indices=[-1])
    assert OpenRewardSpec(url, indices=[3, 1]).train_dataset["target"] == ["standard", "world"]
    # A request the server rejects is a configuration error that says what to check, not an outage.
    with pytest.raises(RuntimeError, match=r"rejected get_task\('train', 99\) with HTTP 400 .*task index") as rejected:
        _ = OpenRewardSpec(url, indices=[99]).train_dataset
    assert not isinstance(rejected.value, EnvironmentUnavailableError)
    assert OpenRewardSpec(url, num_tasks=10).train_dataset.num_rows == 4  # capped by the server's count
    held_out = OpenRewardSpec(url, split="test", include_metadata=False).train_dataset
    assert held_out.column_names == ["prompt", "task_index"] and held_out.num_rows == 2

    spec = OpenRewardSpec(url, timeout_s=2, discover_task_tools=False)
    env = spec.environment_factory()
    # One method per server tool, its schema the server's (parameter description from the tool's docstring).
    echo = get_json_schema(env.echo)["function"]
    assert echo["parameters"] == {
        "type": "object", "properties": {"text": {"type": "string", "description": "The string to echo back."}},
        "required": ["text"],
    }  # fmt: skip
    assert str(inspect.signature(env.peek)) == "() -> str"
    with pytest.raises(RuntimeError, match="before reset"):
        env.echo(text="hello")
    with pytest.raises(ValueError, match="task_index must be an integer >= 0"):
        env.reset(task_index=-1)
    assert env.reset(task_index=0) == "Echo 'hello' to win."
    assert env.echo(text="hello") == "match" and env.finished and env.reward == 1.0
    # Errors the environment reports reach the model as the tool output, as TRL does (reward None).
    assert env.echo(text="hello").startswith("Error: episode_finished") and env.rewards == [1.0, None]
    assert env.reward == 1.0  # the last reward that was not None
    # A copy (what AsyncGRPO's worker receives) keeps the tools, drops the session and opens its own on reset.
    copy = pickle.loads(pickle.dumps(env))
    assert copy._session is None and callable(copy.echo)
    assert pickle.loads(pickle.dumps(type(env))) is type(env)  # the per-tool-set class itself (AsyncGRPO's worker)
    assert pickle.loads(pickle.dumps(spec.environment_factory))().reset(task_index=1) == "Echo 'world' to win."
    assert copy.reset(task_index=2) == "Echo 'reward' to win." and copy.reward == 0.0 and copy.rewards == []
    # A server that stops answering: each call is bounded by timeout_s.
    own_ors_server.pause()
    start = time.monotonic()
    with pytest.raises(
        EnvironmentUnavailableError, match=rf"{re.escape(url)} .*tool call 'echo': no answer within 2s"
    ):
        copy.echo(text="reward")
    assert time.monotonic() - start < 2 + 5
    own_ors_server.resume()
    own_ors_server.kill()
    with pytest.raises(EnvironmentUnavailableError, match=rf"{re.escape(url)} .*during reset"):
        copy.reset(task_index=0)


def test_without_the_package_the_error_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "openreward", None)  # import openreward -> ImportError
    from posttrain.experimental.openreward import OpenRewardSpec

    with pytest.raises(ImportError, match=r'pip install "posttrain\[openreward\]"'):
        OpenRewardSpec("http://127.0.0.1:1")
