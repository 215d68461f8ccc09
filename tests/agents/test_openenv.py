"""GRPO with ``environment_factory`` over real OpenEnv clients and servers (openenv-core), on 127.0.0.1.

The servers are ``examples/openenv/envs.py`` (built with openenv-core's ``Environment`` / ``create_app``) run as
subprocesses; the clients are ``openenv.core.EnvClient`` subclasses speaking its WebSocket session protocol, wrapped
in ``posttrain.agents.openenv.OpenEnvSession``. Rollouts come from the scripted tiny policy (see ``agent_helpers``);
everything between the policy and the environment server — tool loop, sessions, rewards, loss — is real.
"""

from __future__ import annotations

import pickle
import re
import time
from functools import partial

import pytest

pytest.importorskip("openenv.core", reason='openenv-core is not installed (pip install "posttrain[openenv]")')

from agent_helpers import last_user, scripted_sampler, tool_responses  # noqa: E402
from datasets import Dataset  # noqa: E402
from openenv_helpers import (  # noqa: E402
    EchoToolEnv,
    GuessAction,
    GuessClient,
    GuessToolEnv,
    Server,
    bisect_script,
    echo_script,
    secret_for,
)

from posttrain import GRPOConfig, GRPOTrainer  # noqa: E402
from posttrain.agents.openenv import OpenEnvSession  # noqa: E402
from posttrain.agents.tools import EnvironmentUnavailableError  # noqa: E402


@pytest.fixture(scope="module")
def echo_server():
    server = Server("echo")
    yield server
    server.stop()
    assert server.process.returncode is not None


@pytest.fixture(scope="module")
def guess_server():
    server = Server("guess")
    yield server
    server.stop()


@pytest.fixture()
def own_guess_server():
    """A guess server this test alone uses (it gets killed or paused)."""
    server = Server("guess")
    yield server
    server.stop()
    assert server.process.returncode is not None


def _config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, max_completion_length=256,
        max_steps=1, learning_rate=1e-2, report_to="none", gradient_checkpointing=False, save_strategy="no",
        logging_steps=1, disable_tqdm=True, write_report=False, shuffle_dataset=False,
    )  # fmt: skip
    values.update(overrides)
    return GRPOConfig(**values)


def _use_script(trainer, script):
    sampler, _, scripted = scripted_sampler(script, tokenizer=trainer.processing_class)
    trainer.backend.inner = sampler
    return scripted


def test_grpo_echo_rewards_come_from_the_server(echo_server, tiny_model_path, tmp_path):
    seen = {}

    def reward_from_env(environments, **kwargs):
        seen["rewards"] = [env.session.reward for env in environments]
        return seen["rewards"]

    words = ["hi", "openenv"]
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"Echo '{w}'"}]} for w in words])
    trainer = GRPOTrainer(
        tiny_model_path, reward_from_env, _config(tmp_path), train_dataset=data,
        environment_factory=partial(EchoToolEnv, echo_server.url),
    )  # fmt: skip
    scripted = _use_script(trainer, echo_script)
    trainer.train()
    # The server computed 0.1 x len(message) for each echoed word; the tool output is the server's echo.
    assert sorted(seen["rewards"]) == pytest.approx(sorted(0.1 * len(w) for w in words for _ in range(2)))
    assert {r for c in scripted.contexts for r in tool_responses(c)} == set(words)
    logs = trainer.state.log_history[0]
    assert logs["rewards/reward_from_env/mean"] == pytest.approx(0.1 * sum(map(len, words)) / 2)
    assert logs["tools/call_frequency"] == 1.0 and logs["tools/failure_frequency"] == 0.0


def test_grpo_multi_env_game_rewards_from_the_server(echo_server, guess_server, tiny_model_path, tmp_path):
    """TRL's ``grpo_multi_env`` pattern: a dict of OpenEnv-backed factories routed by the ``environment`` column."""
    games = [2, 5]  # game 2 bisects to the secret (reward 1); game 5 guesses 4 once and stops
    rows = [{"prompt": [{"role": "user", "content": f"Game {g}."}], "environment": "guess", "seed": g} for g in games]
    rows.append({"prompt": [{"role": "user", "content": "Echo 'abc'"}], "environment": "echo", "seed": 0})
    trainer = GRPOTrainer(
        tiny_model_path, None, _config(tmp_path, per_device_train_batch_size=6, max_completion_length=512),
        train_dataset=Dataset.from_list(rows),
        environment_factory={"guess": partial(GuessToolEnv, guess_server.url), "echo": partial(EchoToolEnv, echo_server.url)},
    )  # fmt: skip
    assert trainer.reward_func_names == ["GuessToolEnv"]

    def script(context):
        return echo_script(context) if "Echo '" in last_user(context) else bisect_script(context)

    scripted = _use_script(trainer, script)
    trainer.train()
    expected = {2: 1.0, 5: float(secret_for(5) == 4)}
    logs = trainer.state.log_history[0]
    assert logs["rewards/GuessToolEnv/mean"] == pytest.approx(sum(expected.values()) / 2)
    # The reset observation reached the prompt and the server's feedback came back as tool output.
    game2 = [c for c in scripted.contexts if "Game 2." in last_user(c)]
    assert all(last_user(c).endswith("You have 4 guesses.") for c in game2)
    assert max((tool_responses(c) for c in game2), key=len)[-1] == "correct"
    assert logs["tools/failure_frequency"] == 0.0


def test_server_killed_mid_rollout_stops_training_naming_the_url(own_guess_server, tiny_model_path, tmp_path):
    def script(context):
        if not tool_responses(context):
            own_guess_server.kill()  # after every reset, before the first step reaches the server
        return bisect_script(context)

    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "Game 2."}], "seed": 2}])
    trainer = GRPOTrainer(
        tiny_model_path, None, _config(tmp_path, per_device_train_batch_size=2),
        train_dataset=data, environment_factory=partial(GuessToolEnv, own_guess_server.url, timeout_s=10),
    )  # fmt: skip
    _use_script(trainer, script)
    start = time.monotonic()
    with pytest.raises(EnvironmentUnavailableError, match=rf"ws://127\.0\.0\.1:{own_guess_server.port}/ws .* step"):
        trainer.train()
    assert time.monotonic() - start < 60  # closed connection: immediate, not the 10 s timeout per call
    assert trainer.state.global_step == 0


def test_session_bounds_reset_retry_and_pickling(own_guess_server):
    url = own_guess_server.url
    session = OpenEnvSession(GuessClient(base_url=url), timeout_s=2, reset_retries=1, retry_delay_s=0)
    assert OpenEnvSession(GuessClient(base_url=url).sync()).client.__class__ is GuessClient  # sync wrapper unwrapped
    with pytest.raises(TypeError, match=r"needs an openenv.core.EnvClient .* got str"):
        OpenEnvSession(url)
    with pytest.raises(RuntimeError, match="step before reset"):
        session.step(GuessAction(number=1))
    assert session.reset(seed=3).observation.guesses_left == 4
    secret = secret_for(3)
    # A copy (what AsyncGRPO's worker receives) drops the connection and opens its own on reset.
    copy = pickle.loads(pickle.dumps(session))
    assert copy.client._ws is None and session.client._ws is not None
    assert copy.reset(seed=3).observation.guesses_left == 4
    assert copy.step(GuessAction(number=secret)).reward == 1.0 and copy.done and copy.total_reward == 1.0
    # An error the server reports (a move after the game ended) is the model's to see, as TRL does: not an outage.
    with pytest.raises(RuntimeError, match="The game is over") as refused:
        copy.step(GuessAction(number=secret))
    assert not isinstance(refused.value, EnvironmentUnavailableError)
    assert copy.reset(seed=3).observation.guesses_left == 4  # the connection survived
    copy.close()
    # A server that stops answering: each call is bounded by timeout_s.
    own_guess_server.pause()
    start = time.monotonic()
    with pytest.raises(EnvironmentUnavailableError, match=rf"{re.escape(session.url)} .*step: no answer within 2s"):
        session.step(GuessAction(number=secret))
    assert time.monotonic() - start < 2 + 5
    with pytest.raises(EnvironmentUnavailableError, match="connection of this episode was lost"):
        session.step(GuessAction(number=secret))  # never silently steps a fresh, un-reset session
    own_guess_server.resume()
    assert session.reset(seed=3).observation.guesses_left == 4  # reset reconnects
    session.close()
    # A dead server: reset retries (reset_retries=1), then names the URL.
    own_guess_server.kill()
    with pytest.raises(EnvironmentUnavailableError, match=rf"{re.escape(session.url)} .*reset: ConnectionError"):
        session.reset(seed=3)


def test_a_server_with_too_few_sessions_says_how_many_are_needed():
    server = Server("guess", max_sessions=1)
    try:
        first = OpenEnvSession(GuessClient(base_url=server.url), timeout_s=20)
        second = OpenEnvSession(GuessClient(base_url=server.url), timeout_s=20)
        assert first.reset(seed=1).observation.guesses_left == 4
        start = time.monotonic()
        # the CAPACITY_REACHED answer, or (when the server's close overtakes it on a loaded machine) the normal close
        with pytest.raises(EnvironmentUnavailableError, match=r"refused a new session.*max_concurrent_envs >= the"):
            second.reset(seed=1)
        assert time.monotonic() - start < 20  # refused at once, not retried
        first.close()
    finally:
        server.stop()


def test_reset_retries_over_a_stale_connection_to_a_restarted_server(own_guess_server):
    """The documented retry: a server restarted between episodes is reached again by the next reset."""
    retrying = OpenEnvSession(GuessClient(base_url=own_guess_server.url), timeout_s=20, retry_delay_s=0)
    strict = OpenEnvSession(GuessClient(base_url=own_guess_server.url), timeout_s=20, reset_retries=0)
    assert retrying.reset(seed=1).observation.guesses_left == 4 and strict.reset(seed=1).done is False
    own_guess_server.kill()
    restarted = Server("guess", port=own_guess_server.port)
    try:
        assert retrying.reset(seed=6).observation.guesses_left == 4  # stale connection fails, the retry reconnects
        assert retrying.step(GuessAction(number=secret_for(6))).reward == 1.0
        with pytest.raises(EnvironmentUnavailableError, match=rf"{re.escape(strict.url)} .*during reset"):
            strict.reset(seed=6)  # reset_retries=0: the stale connection is reported
        assert strict.reset(seed=6).observation.guesses_left == 4  # and the next reset reconnects
        retrying.close()
        strict.close()
    finally:
        restarted.stop()
