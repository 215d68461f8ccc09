"""OpenEnv clients inside an ``environment_factory``: a synchronous, time-bounded, picklable session handle.

`OpenEnv <https://github.com/meta-pytorch/OpenEnv>`_ (``pip install "posttrain[openenv]"``, i.e. ``openenv-core``)
serves Gymnasium-style environments over a WebSocket session (``/ws``): one environment instance per connection on
the server; ``EnvClient.reset(**kwargs)`` / ``EnvClient.step(action)`` return a ``StepResult`` (observation, reward,
done). Since openenv-core 0.2 the client is ``async``. TRL's OpenEnv examples (``grpo_echo``, ``grpo_wordle``,
``grpo_catch``, ``grpo_multi_env``) wrap such a client in an ``environment_factory`` class: ``reset`` resets the
remote episode and returns the observation text, each tool method is one ``step``, and the reward is read from the
observations. :class:`OpenEnvSession` is the client handle to use in those classes::

    class GuessEnv:
        def __init__(self):
            self.session = OpenEnvSession(GuessClient(base_url=URL))

        def reset(self, seed=None, **row) -> str:
            return self.session.reset(seed=seed).observation.feedback

        def guess(self, number: int) -> str:
            \"\"\"Guess the number.

            Args:
                number: Your guess.
            \"\"\"
            return self.session.step(GuessAction(number=number)).observation.feedback

        def get_reward(self) -> float:
            return self.session.reward

What it adds over calling the client directly:

- **Synchronous calls on posttrain's shared event loop** (the one async tools and rewards use), so no thread per
  client and the client's WebSocket always lives on one loop — also in the AsyncGRPO rollout worker process.
- **Bounded time, clear errors.** Every call is bounded by ``timeout_s``. A server that is down, refuses, closes the
  connection (killed mid-rollout) or does not answer in time raises
  :class:`~posttrain.agents.tools.EnvironmentUnavailableError` naming the URL; the tool loop re-raises that error
  (it is not shown to the model as a tool error), so the training step stops with it instead of hanging or learning
  from an episode that never ran. Errors the server *reports* (``RuntimeError("Server error: ...")``, e.g. an
  invalid action) pass through unchanged and, from a tool, reach the model as TRL does.
- **Documented retry, reset only.** ``reset`` reconnects and retries up to ``reset_retries`` times (waiting
  ``retry_delay_s`` between tries): a reset starts a fresh episode, so repeating it is safe. ``step`` never retries:
  the server holds the episode in the connection's session, so after a lost connection the episode is gone and a
  retried step would act in a different one.
- **Capacity.** Each instance holds one server session for its lifetime (instances are pooled and reused), so the
  server must allow as many concurrent sessions as rollouts in a generation batch; a refused session
  (``CAPACITY_REACHED``) raises :class:`EnvironmentUnavailableError` saying so, without retrying.
- **Pickling** drops the live connection (the copy reconnects on its next ``reset``), so environment factories that
  hold a session can travel to AsyncGRPO's rollout worker.
- ``reward`` (last step's reward, 0.0 before any), ``total_reward``, ``done`` and ``last`` (the last ``StepResult``)
  for reward functions and ``get_reward``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import time
from typing import Any

from posttrain.agents.tools import EnvironmentUnavailableError

INSTALL_HINT = 'OpenEnv support needs openenv-core: pip install "posttrain[openenv]" (or pip install openenv-core).'


def _lost_connection_types() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "the server is unreachable" (not "the server refused the request")."""
    types: list[type[BaseException]] = [OSError, asyncio.TimeoutError, TimeoutError, EOFError]
    try:
        from websockets.exceptions import WebSocketException

        types.append(WebSocketException)
    except ImportError:  # pragma: no cover - websockets comes with openenv-core
        pass
    return tuple(types)  # ConnectionError (raised by EnvClient.connect) is an OSError


class OpenEnvSession:
    """One OpenEnv environment session (one WebSocket connection, one server-side environment instance).

    Args:
        client: An ``openenv.core.EnvClient`` (async; the environment's own client subclass or
            ``GenericEnvClient``), or its ``.sync()`` wrapper (unwrapped to the async client). Not connected yet is
            fine: the first ``reset`` connects.
        timeout_s: Bound, in seconds, on each call (connect + request + response). Must be positive.
        reset_retries: How many times ``reset`` reconnects and tries again after a lost connection (0 = never).
        retry_delay_s: Seconds between reset tries.
    """

    def __init__(self, client: Any, *, timeout_s: float = 30.0, reset_retries: int = 1, retry_delay_s: float = 0.5):
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
        if not isinstance(reset_retries, int) or reset_retries < 0:
            raise ValueError(f"reset_retries must be an integer >= 0, got {reset_retries!r}.")
        if retry_delay_s < 0:
            raise ValueError(f"retry_delay_s must be >= 0, got {retry_delay_s!r}.")
        async_client = getattr(client, "async_client", client)  # SyncEnvClient -> its EnvClient
        for name in ("reset", "step", "disconnect"):
            if not callable(getattr(async_client, name, None)):
                raise TypeError(
                    f"OpenEnvSession needs an openenv.core.EnvClient (with async reset/step/disconnect), got "
                    f"{type(client).__name__}. {INSTALL_HINT}"
                )
        self.client = async_client
        self.timeout_s = float(timeout_s)
        self.reset_retries = reset_retries
        self.retry_delay_s = float(retry_delay_s)
        self.last: Any = None
        self.rewards: list[float] = []
        self._episode = False  # a reset succeeded on the current connection

    @property
    def url(self) -> str:
        """The WebSocket endpoint (``ws://host:port/ws``)."""
        return str(getattr(self.client, "_ws_url", "<unknown OpenEnv URL>"))

    @property
    def reward(self) -> float:
        """The last step's reward (0.0 before any step or when the server sent none)."""
        return float(self.rewards[-1]) if self.rewards else 0.0

    @property
    def total_reward(self) -> float:
        """Sum of the rewards of this episode's steps."""
        return float(sum(self.rewards))

    @property
    def done(self) -> bool:
        """Whether the last result ended the episode."""
        return bool(self.last is not None and self.last.done)

    def _run(self, make_coro: Any, what: str) -> Any:
        from posttrain.rewards.scoring import submit_coroutine

        async def bounded() -> Any:
            return await asyncio.wait_for(make_coro(), self.timeout_s)

        future = submit_coroutine(bounded())
        try:
            # The coroutine is bounded on the loop; the extra margin only covers a loop that is itself stuck.
            return future.result(timeout=self.timeout_s + 5.0)
        except _lost_connection_types() as err:
            future.cancel()
            self._drop_connection()
            reason = f"no answer within {self.timeout_s:g}s" if isinstance(err, TimeoutError) else _describe(err)
            hint = ""
            if what == "reset" and type(err).__name__ == "ConnectionClosedOK":
                # A server at its session limit sends CAPACITY_REACHED and closes; on a loaded machine the close can
                # reach the client before that message does, leaving only the normal (1000) close.
                hint = (
                    " The server closed the session normally as it opened, which is what an OpenEnv server at its "
                    "session limit does: it may have refused a new session, so serve the environment with "
                    "max_concurrent_envs >= the rollouts per generation batch."
                )
            raise EnvironmentUnavailableError(
                f"OpenEnv server at {self.url} is unavailable during {what}: {reason}. Check that the environment "
                "server is running and reachable; the episode in progress (if any) is lost, and the next reset "
                f"reconnects.{hint}"
            ) from err

    def _drop_connection(self) -> None:
        """Forget the (broken) WebSocket so that the next call reconnects; closing it is best effort, bounded."""
        from posttrain.rewards.scoring import submit_coroutine

        self._episode = False
        ws = getattr(self.client, "_ws", None)
        if ws is None:
            return
        self.client._ws = None

        async def close() -> None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), 1.0)

        with contextlib.suppress(Exception):
            submit_coroutine(close()).result(timeout=2.0)

    def reset(self, **kwargs: Any) -> Any:
        """Start a new episode (``EnvClient.reset(**kwargs)``), reconnecting if needed; returns the ``StepResult``.

        Retries after a lost connection up to ``reset_retries`` times; raises
        :class:`EnvironmentUnavailableError` (naming the URL) when every try failed.
        """
        self.last, self.rewards, self._episode = None, [], False
        for attempt in range(self.reset_retries + 1):
            try:
                result = self._run(lambda: self.client.reset(**kwargs), "reset")
                break
            except EnvironmentUnavailableError:
                if attempt == self.reset_retries:
                    raise
                time.sleep(self.retry_delay_s)
            except RuntimeError as err:
                if "CAPACITY_REACHED" not in str(err):
                    raise
                self._drop_connection()  # the server closes a refused session; a retry would be refused again
                raise EnvironmentUnavailableError(
                    f"OpenEnv server at {self.url} refused a new session ({err}). posttrain opens one session per "
                    "rollout of a generation batch (each environment instance keeps its own, reused across "
                    "batches): serve the environment with max_concurrent_envs >= the rollouts per generation batch "
                    "(create_app(..., max_concurrent_envs=N), environment class with "
                    "SUPPORTS_CONCURRENT_SESSIONS = True), or lower the batch size."
                ) from err
        self.last, self._episode = result, True
        return result

    def step(self, action: Any) -> Any:
        """One action (``EnvClient.step(action)``); returns the ``StepResult``. Never retried (see the module)."""
        if not self._episode:
            if self.last is None and not self.rewards:
                raise RuntimeError(f"OpenEnvSession.step before reset ({self.url}): call reset() to start an episode.")
            raise EnvironmentUnavailableError(
                f"OpenEnv server at {self.url}: the connection of this episode was lost, so the server no longer "
                "holds it; reset to start a new episode."
            )
        result = self._run(lambda: self.client.step(action), "step")
        self.last = result
        self.rewards.append(float(result.reward) if result.reward is not None else 0.0)
        return result

    def state(self) -> Any:
        """The server's ``State`` of this session's environment."""
        return self._run(lambda: self.client.state(), "state")

    def close(self) -> None:
        """Close the connection (bounded); the server frees this session's environment."""
        from posttrain.rewards.scoring import submit_coroutine

        if getattr(self.client, "_ws", None) is None:
            return

        async def disconnect() -> None:
            await asyncio.wait_for(self.client.disconnect(), min(self.timeout_s, 5.0))

        self._episode = False
        try:
            submit_coroutine(disconnect()).result(timeout=min(self.timeout_s, 5.0) + 1.0)
        except Exception:
            self.client._ws = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        client = copy.copy(self.client)
        client.__dict__["_ws"] = None  # a live connection belongs to this process's event loop
        state["client"] = client
        state["_episode"] = False
        return state

    def __repr__(self) -> str:
        connected = getattr(self.client, "_ws", None) is not None
        return f"OpenEnvSession({self.url}, connected={connected}, timeout_s={self.timeout_s:g})"


def _describe(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__
