"""OpenEnv test helpers: environment servers as subprocesses on 127.0.0.1, and ``environment_factory`` classes.

Import only after ``pytest.importorskip("openenv.core")``. The servers are ``examples/openenv/envs.py`` (built with
openenv-core's ``Environment`` / ``create_app``); the classes wrap its ``EnvClient`` subclasses in
``OpenEnvSession``. The classes live at module level and take the server URL as an argument, so that
``functools.partial(GuessToolEnv, url)`` is a picklable factory (AsyncGRPO's rollout worker gets a copy).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from agent_helpers import call, last_user, tool_responses
from server_process import ServerProcess

from posttrain.agents.openenv import OpenEnvSession

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "openenv"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from envs import EchoAction, EchoClient, GuessAction, GuessClient, secret_for  # noqa: E402

__all__ = [
    "EchoToolEnv",
    "GuessAction",
    "GuessClient",
    "GuessToolEnv",
    "Server",
    "bisect_script",
    "echo_script",
    "secret_for",
]


class Server(ServerProcess):
    """An OpenEnv environment server (``examples/openenv/envs.py``) as a subprocess on 127.0.0.1, on a free port."""

    def __init__(self, env: str, max_sessions: int = 64, port: int = 0):
        cmd = [sys.executable, str(EXAMPLES / "envs.py"), env, "--port", str(port), "--max-sessions", str(max_sessions)]
        super().__init__(cmd, f"OpenEnv {env}")


class EchoToolEnv:
    """TRL's ``grpo_echo`` pattern: the environment echoes, the reward is the observation's."""

    def __init__(self, url: str):
        self.session = OpenEnvSession(EchoClient(base_url=url), timeout_s=20)

    def reset(self, **row) -> None:
        self.session.reset()

    def echo(self, message: str) -> str:
        """Echo the message back from the environment.

        Args:
            message: The message to echo.
        """
        return self.session.step(EchoAction(message=message)).observation.echoed_message


class GuessToolEnv:
    """A game (``grpo_wordle`` / ``grpo_catch`` pattern): reset returns the first observation, reward from the env."""

    def __init__(self, url: str, timeout_s: float = 20):
        self.session = OpenEnvSession(GuessClient(base_url=url), timeout_s=timeout_s, retry_delay_s=0.1)

    def reset(self, seed: int = 0, **row) -> str:
        return " " + self.session.reset(seed=seed).observation.feedback

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: Your guess.
        """
        return self.session.step(GuessAction(number=number)).observation.feedback

    def get_reward(self) -> float:
        return self.session.total_reward


def echo_script(context: str) -> str:
    """Echo the quoted word of "Echo '<word>'" once, then stop."""
    if tool_responses(context):
        return "Done."
    word = re.search(r"Echo '(\w+)'", last_user(context)).group(1)
    return call("echo", f'{{"message": "{word}"}}')


def bisect_script(context: str) -> str:
    """Binary search on 'higher'/'lower' for even games ("Game <n>."); odd games guess once and stop."""
    game = int(re.search(r"Game (\d+)", last_user(context)).group(1))
    responses = tool_responses(context)
    if responses and (responses[-1] == "correct" or game % 2 == 1):
        return "Done."
    low, high = 1, 8
    turn = context.rsplit("<|im_start|>user\n", 1)[-1]
    for guessed, answer in zip(re.findall(r'"number": (\d+)', turn), responses):
        if answer == "higher":
            low = int(guessed) + 1
        elif answer == "lower":
            high = int(guessed) - 1
    return call("guess", f'{{"number": {(low + high) // 2}}}')
