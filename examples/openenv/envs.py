"""Two small OpenEnv environments built with openenv-core's own server API, and a command that serves them.

- ``echo``: the OpenEnv template's Echo environment — the observation echoes the message, reward ``0.1 × len``.
- ``guess``: a number-guessing game — ``reset(seed=...)`` draws a secret in ``[1, HIGH]``; each ``guess`` answers
  ``higher`` / ``lower`` / ``correct``; the episode ends on the right number (reward 1.0) or after ``MAX_GUESSES``
  (reward 0.0).

Each is an ``openenv.core.env_server.Environment`` with pydantic ``Action`` / ``Observation`` models, served by
``openenv.core.env_server.create_app`` (HTTP + the WebSocket session endpoint ``/ws`` that ``EnvClient`` speaks),
one environment instance per WebSocket session. Clients: :class:`EchoClient` and :class:`GuessClient`
(``openenv.core.EnvClient`` subclasses).

Serve one on 127.0.0.1 (``--port 0`` picks a free port; the bound port is printed as ``PORT <n>``):

    python examples/openenv/envs.py guess --port 8001
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
from typing import Any

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

HIGH = 8
MAX_GUESSES = 4


def secret_for(seed: int | None) -> int:
    """The guess game's secret for ``seed`` (what the server draws; tests use it to know the answer)."""
    return random.Random(seed).randint(1, HIGH)


# --- echo -------------------------------------------------------------------------------------------------------


class EchoAction(Action):
    message: str = Field(..., description="Message to echo back")


class EchoObservation(Observation):
    echoed_message: str = Field(default="", description="The echoed message")


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> EchoObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        return EchoObservation(echoed_message="Echo environment ready!", done=False, reward=0.0)

    def step(self, action: EchoAction, timeout_s: float | None = None, **kwargs: Any) -> EchoObservation:  # type: ignore[override]
        self._state.step_count += 1
        return EchoObservation(echoed_message=action.message, done=False, reward=0.1 * len(action.message))

    @property
    def state(self) -> State:
        return self._state


class EchoClient(EnvClient[EchoAction, EchoObservation, State]):
    def _step_payload(self, action: EchoAction) -> dict[str, Any]:
        return {"message": action.message}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[EchoObservation]:
        obs = payload.get("observation", {})
        observation = EchoObservation(
            echoed_message=obs.get("echoed_message", ""), done=payload.get("done", False), reward=payload.get("reward")
        )
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


# --- guess ------------------------------------------------------------------------------------------------------


class GuessAction(Action):
    number: int = Field(..., description="The guessed number")


class GuessObservation(Observation):
    feedback: str = Field(default="", description="'higher', 'lower', 'correct' or the game's instructions")
    guesses_left: int = Field(default=MAX_GUESSES)


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(step_count=0)
        self._secret = secret_for(None)
        self._done = False

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self._secret, self._done = secret_for(seed), False
        return GuessObservation(
            feedback=f"I picked a number between 1 and {HIGH}. You have {MAX_GUESSES} guesses.",
            guesses_left=MAX_GUESSES,
            done=False,
            reward=0.0,
        )

    def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:  # type: ignore[override]
        if self._done:
            raise ValueError("The game is over; reset to play again.")
        self._state.step_count += 1
        left = MAX_GUESSES - self._state.step_count
        if action.number == self._secret:
            self._done = True
            return GuessObservation(feedback="correct", guesses_left=left, done=True, reward=1.0)
        self._done = left <= 0
        feedback = "higher" if action.number < self._secret else "lower"
        return GuessObservation(feedback=feedback, guesses_left=left, done=self._done, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    def _step_payload(self, action: GuessAction) -> dict[str, Any]:
        return {"number": action.number}

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[GuessObservation]:
        obs = payload.get("observation", {})
        observation = GuessObservation(
            feedback=obs.get("feedback", ""),
            guesses_left=obs.get("guesses_left", 0),
            done=payload.get("done", False),
            reward=payload.get("reward"),
        )
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


ENVIRONMENTS = {
    "echo": (EchoEnvironment, EchoAction, EchoObservation),
    "guess": (GuessEnvironment, GuessAction, GuessObservation),
}


def build_app(name: str, max_sessions: int = 64) -> Any:
    """The FastAPI app serving environment ``name`` (one instance per WebSocket session, up to ``max_sessions``)."""
    env_cls, action_cls, observation_cls = ENVIRONMENTS[name]
    return create_app(env_cls, action_cls, observation_cls, env_name=name, max_concurrent_envs=max_sessions)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("env", choices=sorted(ENVIRONMENTS))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 = a free port (printed as 'PORT <n>')")
    parser.add_argument("--max-sessions", type=int, default=64)
    args = parser.parse_args(argv)

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)  # connections queue from now on, so the printed port is usable at once
    print(f"PORT {sock.getsockname()[1]}", flush=True)
    config = uvicorn.Config(build_app(args.env, args.max_sessions), log_level="warning")
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
