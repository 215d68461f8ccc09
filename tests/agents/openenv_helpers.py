"""OpenEnv test helpers: environment servers as subprocesses on 127.0.0.1, and ``environment_factory`` classes.

Import only after ``pytest.importorskip("openenv.core")``. The servers are ``examples/openenv/envs.py`` (built with
openenv-core's ``Environment`` / ``create_app``); the classes wrap its ``EnvClient`` subclasses in
``OpenEnvSession``. The classes live at module level and take the server URL as an argument, so that
``functools.partial(GuessToolEnv, url)`` is a picklable factory (AsyncGRPO's rollout worker gets a copy).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from agent_helpers import call, last_user, tool_responses

from posttrain.agents.openenv import OpenEnvSession

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "openenv"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from envs import EchoAction, EchoClient, GuessAction, GuessClient, secret_for  # noqa: E402

STARTUP_S = 120.0  # importing openenv-core + uvicorn on a loaded 2-core machine

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


class Server:
    """An OpenEnv environment server subprocess on 127.0.0.1 (a free port, read from its ``PORT <n>`` line)."""

    def __init__(self, env: str, max_sessions: int = 64, port: int = 0):
        self.process = subprocess.Popen(
            [sys.executable, str(EXAMPLES / "envs.py"), env, "--port", str(port), "--max-sessions", str(max_sessions)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        got: dict[str, str] = {}
        ready = threading.Event()

        def read() -> None:
            got["line"] = self.process.stdout.readline()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(STARTUP_S) or not got.get("line", "").startswith("PORT "):
            self.stop()
            raise RuntimeError(f"OpenEnv {env} server did not start: {got.get('line')!r} {self.process.stderr.read()}")
        self.port = int(got["line"].split()[1])
        self.url = f"http://127.0.0.1:{self.port}"

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.resume()  # in case a test paused it
            self.kill()
        for stream in (self.process.stdout, self.process.stderr):
            stream.close()


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
