"""OpenReward (Open Reward Standard) environments inside an ``environment_factory``: tasks, tools and rewards served.

`ORS <https://openrewardstandard.io>`_ is an HTTP + Server-Sent-Events protocol: an environment server lists its
splits, tasks and tools; a client opens a *session* on one task, reads its prompt and calls tools, and every tool
output carries its own ``reward`` (``None`` for no reward) and ``finished`` flag. The ``openreward`` package
(``pip install "posttrain[openreward]"``) is the official client (and server) SDK; this module drives its async client
on posttrain's shared event loop. The user-facing entry point is
:class:`posttrain.experimental.openreward.OpenRewardSpec` (TRL's ``trl.experimental.openreward.OpenRewardSpec``
API): ``spec.train_dataset``, ``spec.environment_factory`` and ``spec.reward_funcs`` plug into ``GRPOTrainer``.

- **Tasks listed from the server**: one dataset row per task (``prompt`` an empty user message, ``task_index``, and
  the task spec's fields as metadata columns); each rollout's ``reset(task_index=...)`` opens an ORS session on that
  task and returns its prompt text, which the trainer appends to the user message.
- **Tool calls forwarded**: one Python method per server tool (name, signature and docstring from the tool's JSON
  schema), so posttrain renders the same tool schemas the server declared; a call runs the tool in the session.
- **Rewards as TRL uses them**: each tool output's reward is recorded (``rewards``, ``None`` kept as ``None``); the
  rollout's ``reward`` is the last one that is not ``None`` (0.0 when none came), the outcome-only rule of TRL's
  ``reward_funcs``. ``finished``, ``metadata`` and ``last_output`` are kept for custom reward functions.
- **Bounded, clear errors.** Every request is bounded by ``timeout_s``. A server that is unreachable, dies
  mid-rollout or does not answer in time raises :class:`~posttrain.agents.tools.EnvironmentUnavailableError` naming
  the URL; the tool loop re-raises it, so training stops instead of hanging or learning from an episode that never
  ran. Errors the *environment* reports about a call (unknown tool, invalid input, a tool that raised, a call after
  the episode finished) reach the model as the tool's output (``"Error: ..."``), as TRL does.
- **Pickling** keeps the configuration and drops live sessions (each process opens its own on ``reset``), so the
  factory can travel to AsyncGRPO's rollout worker.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copyreg
import inspect
import json
import keyword
import os
import re
import textwrap
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.agents.tools import EnvironmentUnavailableError

INSTALL_HINT = 'OpenReward support needs the openreward package: pip install "posttrain[openreward]".'

_JSON_TO_PY: dict[str, type] = {"string": str, "integer": int, "number": float, "boolean": bool, "array": list}
_JSON_TO_PY["object"] = dict
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def import_openreward() -> Any:
    """The ``openreward`` module, or an ImportError saying how to install it."""
    try:
        import openreward
    except ImportError as err:
        raise ImportError(INSTALL_HINT) from err
    return openreward


def _describe(err: BaseException) -> str:
    text = str(err)
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _outage_types() -> tuple[type[BaseException], ...]:
    """Exceptions meaning "the server cannot be reached" (not "the environment refused this call")."""
    types: list[type[BaseException]] = [OSError, asyncio.TimeoutError, TimeoutError, EOFError]
    with contextlib.suppress(ImportError):
        import aiohttp

        types.append(aiohttp.ClientError)
    with contextlib.suppress(ImportError):
        from openreward.api.errors import SessionTerminatedError, TransportError

        types += [TransportError, SessionTerminatedError]
    return tuple(types)


def _refusal_types() -> tuple[type[BaseException], ...]:
    """Errors the environment reports about one tool call: the model's to see."""
    from openreward.api.errors import ToolCallError, ToolFailed

    return (ToolCallError, ToolFailed)


def _client_error_status(err: BaseException) -> int | None:
    """The HTTP status of an SDK ``HTTPStatusError`` in 400..499 (a request the server rejected), else None."""
    status = getattr(err, "status", None) or getattr(err, "status_code", None)
    return status if isinstance(status, int) and 400 <= status < 500 else None


class OpenRewardClient:
    """A picklable, time-bounded handle on one ORS environment (the SDK's async client on posttrain's shared loop).

    Args:
        target: A URL of an ORS server (``"http://127.0.0.1:8000"``; one host serves everything) or an openreward.ai
            catalog name (``"Eigent/SETA"``; the SDK's platform hosts and ``OPENREWARD_API_KEY``).
        env_name: The environment's name on the server; for a URL, None means the server's default environment.
        api_key: Overrides ``OPENREWARD_API_KEY`` (catalog names only).
        timeout_s: Bound, in seconds, on each request (the SDK's own retries included). Must be positive.
    """

    def __init__(self, target: str, *, env_name: str | None = None, api_key: str | None = None, timeout_s: float = 60):
        if not isinstance(target, str) or not target:
            raise ValueError(f"target must be an ORS server URL or an openreward.ai environment name, got {target!r}.")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}.")
        import_openreward()
        self.target = target
        self.is_url = "://" in target
        self.env_name = env_name
        self.api_key = api_key
        self.timeout_s = float(timeout_s)
        self._env: Any = None  # the SDK's AsyncEnvironment, built on the shared loop on first use

    @property
    def url(self) -> str:
        """Where requests go (the URL, or the catalog name for platform environments)."""
        return self.target

    async def _environment(self) -> Any:
        if self._env is None:
            openreward = import_openreward()
            if self.is_url:
                # A self-hosted server is one host: its API and its sessions share the URL (no api./sessions. hosts).
                api = openreward.AsyncEnvironmentsAPI(
                    base_url=self.target, api_key=self.api_key or "", api_base_url=None
                )
                self._env = api.get(self.env_name or "env")  # the server redirects unknown names to its default
            else:
                os.environ.setdefault("OPENREWARD_DISABLE_UPDATE_CHECK", "1")
                api = openreward.AsyncOpenReward(api_key=self.api_key).environments
                self._env = api.get(self.target)
            _register_for_close(api)
        return self._env

    def run(self, make_coro: Callable[[Any], Any], what: str) -> Any:
        """Run ``make_coro(environment)`` on the shared loop, bounded by ``timeout_s``; outages become
        :class:`EnvironmentUnavailableError` naming the URL, rejected requests a RuntimeError saying so."""
        from posttrain.rewards.scoring import submit_coroutine

        async def bounded() -> Any:
            return await asyncio.wait_for(make_coro(await self._environment()), self.timeout_s)

        future = submit_coroutine(bounded())
        try:
            return future.result(timeout=self.timeout_s + 5.0)
        except _outage_types() as err:
            future.cancel()
            status = _client_error_status(err)
            if status is not None:
                raise RuntimeError(
                    f"ORS server at {self.url} rejected {what} with HTTP {status} ({err}). Check the environment name "
                    f"(env_name={self.env_name!r}), split and task index."
                ) from err
            reason = f"no answer within {self.timeout_s:g}s" if isinstance(err, TimeoutError) else _describe(err)
            raise EnvironmentUnavailableError(
                f"ORS server at {self.url} is unavailable during {what}: {reason}. Check that the environment server "
                "is running and reachable; the episode in progress (if any) is lost."
            ) from err

    # Stateless calls (no session).
    def list_tools(self) -> list[dict[str, Any]]:
        """The environment's shared tools as ``{"name", "description", "input_schema"}`` dicts."""
        return [_tool_dict(t) for t in self.run(lambda env: env.list_tools(), "list_tools")]

    def num_tasks(self, split: str) -> int:
        return int(self.run(lambda env: env.num_tasks(split), f"num_tasks({split!r})"))

    def list_tasks(self, split: str) -> list[dict[str, Any]]:
        return [_task_spec(t) for t in self.run(lambda env: env.list_tasks(split), f"list_tasks({split!r})")]

    def get_task(self, split: str, index: int) -> dict[str, Any]:
        return _task_spec(self.run(lambda env: env.get_task(split, index), f"get_task({split!r}, {index})"))

    def session_tools(self, split: str, index: int, secrets: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """The tools of one task's session (shared and task-specific), from a short-lived session."""

        async def probe(env: Any) -> list[Any]:
            async with env.session(split=split, index=index, secrets=secrets) as session:
                return await session.list_tools()

        return [_tool_dict(t) for t in self.run(probe, f"session tool discovery (task {index})")]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_env"] = None  # aiohttp sessions belong to this process's event loop
        return state

    def __repr__(self) -> str:
        return f"OpenRewardClient({self.target!r}, env_name={self.env_name!r}, timeout_s={self.timeout_s:g})"


_OPEN_APIS: list[Any] = []
_LIVE_SESSIONS: weakref.WeakSet[Any] = weakref.WeakSet()


def _forget_sessions(sessions: list[Any]) -> None:
    """Stop the SDK's keep-alive ping tasks of sessions whose server is gone (on the shared loop, bounded)."""
    from posttrain.rewards.scoring import submit_coroutine

    async def stop() -> None:
        for session in sessions:
            _LIVE_SESSIONS.discard(session)
            task, session._ping_task = getattr(session, "_ping_task", None), None
            if task is not None:
                task.cancel()

    with contextlib.suppress(Exception):
        submit_coroutine(stop()).result(timeout=2.0)


def _register_for_close(api: Any) -> None:
    """Close the SDK's HTTP sessions (on the shared loop, bounded) when the process exits."""
    if not _OPEN_APIS:
        atexit.register(_close_apis)
    _OPEN_APIS.append(api)


def _close_apis() -> None:
    from posttrain.rewards.scoring import submit_coroutine

    sessions = list(_LIVE_SESSIONS)
    if sessions:  # end the sessions still open (pooled environments keep theirs until the next reset), concurrently

        async def close_all() -> None:
            await asyncio.gather(*(asyncio.wait_for(s.__aexit__(None, None, None), 2.0) for s in sessions),
                                 return_exceptions=True)  # fmt: skip

        with contextlib.suppress(Exception):
            submit_coroutine(close_all()).result(timeout=3.0)
        _forget_sessions(sessions)
    while _OPEN_APIS:
        api = _OPEN_APIS.pop()
        with contextlib.suppress(Exception):
            submit_coroutine(asyncio.wait_for(api.aclose(), 2.0)).result(timeout=3.0)


def _tool_dict(spec: Any) -> dict[str, Any]:
    if isinstance(spec, Mapping):
        return {"name": spec["name"], "description": spec.get("description"), "input_schema": spec.get("input_schema")}
    return {"name": spec.name, "description": spec.description, "input_schema": spec.input_schema}


def _task_spec(task: Any) -> dict[str, Any]:
    spec = task if isinstance(task, Mapping) else getattr(task, "task_spec", None)
    return dict(spec) if isinstance(spec, Mapping) else {"task_spec": spec}


def _text_of(blocks: Any) -> str:
    """The text blocks of a prompt / tool output, joined by newlines (images and other blocks skipped)."""
    parts = []
    for block in blocks or []:
        kind = block.get("type") if isinstance(block, Mapping) else getattr(block, "type", None)
        text = block.get("text") if isinstance(block, Mapping) else getattr(block, "text", None)
        if kind == "text" and text:
            parts.append(str(text))
    return "\n".join(parts)


class OpenRewardEnvironment:
    """One rollout's ORS session: ``reset`` opens it on a task, each tool method calls the server's tool.

    Built by :class:`OpenRewardSpec.environment_factory` (a subclass per tool set carries the tool methods); the
    trainer pools instances and calls ``reset`` before each rollout.

    Attributes:
        reward: The last reward that was not ``None`` in this episode (0.0 when none came).
        rewards: Every tool output's reward in call order (``None`` where the output had none or the call failed).
        metadata: Every tool output's ``metadata`` dict (``None`` where absent).
        finished: Whether a tool output ended the episode (``finished: true``).
        last_output: The text of the last tool output.
    """

    def __init__(self, client: OpenRewardClient, *, split: str = "train", secrets: Mapping[str, str] | None = None):
        self._client = client
        self._split = split
        self._secrets = dict(secrets) if secrets else None
        self._session: Any = None
        self._clear()

    def _clear(self) -> None:
        self.reward: float = 0.0
        self.rewards: list[float | None] = []
        self.metadata: list[dict[str, Any] | None] = []
        self.finished = False
        self.last_output = ""

    def reset(self, task_index: int = 0, task_spec: Mapping[str, Any] | None = None, **row: Any) -> str:
        """Close the previous session, open one on task ``task_index`` of the split (or on ``task_spec``), return
        its prompt text."""
        self._close()
        self._clear()
        if task_spec is None and (isinstance(task_index, bool) or not isinstance(task_index, int) or task_index < 0):
            raise ValueError(
                f"task_index must be an integer >= 0 (the dataset's task_index column), got {task_index!r}."
            )

        async def open_session(env: Any) -> tuple[Any, str]:
            if task_spec is not None:
                from openreward.api.environments.client import Task

                task = Task(server_name=env.server, environment_name=env.name, task_spec=dict(task_spec),
                            namespace=env.namespace)  # fmt: skip
                session = env.session(task=task, secrets=self._secrets)
            else:
                session = env.session(split=self._split, index=task_index, secrets=self._secrets)
            await session.__aenter__()
            try:
                return session, _text_of(await session.get_prompt())
            except BaseException:
                with contextlib.suppress(Exception):
                    await session.__aexit__(None, None, None)
                raise

        self._session, prompt = self._client.run(open_session, f"reset (task {task_index})")
        _LIVE_SESSIONS.add(self._session)
        return prompt

    def _call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """Run one server tool in this rollout's session; record its reward; return its text."""
        session = self._session
        if session is None:
            raise RuntimeError(f"{type(self).__name__}.{name} called before reset(): reset opens the ORS session.")
        try:
            output = self._client.run(lambda env: session.call_tool(name, arguments), f"tool call {name!r}")
        except EnvironmentUnavailableError:
            self._session = None  # the episode is lost; stop the SDK's keep-alive pings to the dead server
            _forget_sessions([session])
            raise
        except _refusal_types() as err:
            self.rewards.append(None)
            self.metadata.append(None)
            self.last_output = f"Error: {err}"
            return self.last_output
        reward = None if output.reward is None else float(output.reward)
        self.rewards.append(reward)
        if reward is not None:
            self.reward = reward
        self.metadata.append(output.metadata if isinstance(output.metadata, dict) else None)
        self.finished = bool(output.finished)
        self.last_output = _text_of(output.blocks) or "(no output)"
        return self.last_output

    def _close(self) -> None:
        """End the open session on the server (bounded, best effort: the server also reaps idle sessions)."""
        session, self._session = self._session, None
        if session is None:
            return
        _LIVE_SESSIONS.discard(session)
        try:
            self._client.run(lambda env: session.__aexit__(None, None, None), "session close")
        except Exception:  # noqa: BLE001 - the server may be gone; at least stop the pings
            _forget_sessions([session])

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_session"] = None  # a live session belongs to this process's event loop
        return state

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The class is built per tool set (see tool_class): rebuild it from the tool specs in the other process.
        return (_rebuild_environment, (self._tool_specs, self.__getstate__()))


_CLASSES: dict[str, type[OpenRewardEnvironment]] = {}


class _ToolClassMeta(type):
    """Metaclass of the per-tool-set subclasses: pickled as "the class for these tool specs" (see below)."""


def _reduce_tool_class(cls: type) -> Any:
    return (tool_class, (cls._tool_specs,))


# A class made at run time cannot be pickled by reference (its name is not importable); AsyncGRPO's worker receives the
# environment classes (pooled instances, reward columns), so pickle them as a rebuild from their tool specs.
copyreg.pickle(_ToolClassMeta, _reduce_tool_class)


def tool_class(tool_specs: list[dict[str, Any]]) -> type[OpenRewardEnvironment]:
    """The :class:`OpenRewardEnvironment` subclass with one method per tool spec (cached per tool set)."""
    key = json.dumps(tool_specs, sort_keys=True, default=str)
    if key not in _CLASSES:
        namespace: dict[str, Any] = {"_tool_specs": tool_specs, "__module__": __name__}
        for spec in tool_specs:
            method = _tool_method(spec)
            if method is not None:
                namespace[spec["name"]] = method
        _CLASSES[key] = _ToolClassMeta("OpenRewardEnvironment", (OpenRewardEnvironment,), namespace)
    return _CLASSES[key]


def _rebuild_environment(tool_specs: list[dict[str, Any]], state: dict[str, Any]) -> OpenRewardEnvironment:
    env = tool_class(tool_specs).__new__(tool_class(tool_specs))
    env.__dict__.update(state)
    return env


def _split_docstring(description: str) -> tuple[str, dict[str, str]]:
    """A tool description's summary and the ``name: text`` lines of its ``Args:`` section."""
    text = textwrap.dedent(description).strip()
    parts = re.split(r"\n\s*(?:Args|Arguments|Parameters):\s*\n", text, maxsplit=1)
    head, args = parts[0], (parts[1] if len(parts) > 1 else "")
    documented = {}
    for line in (textwrap.dedent(args) if args else "").splitlines():
        match = re.match(r"^\s*([A-Za-z_]\w*)\s*(?:\([^)]*\))?\s*:\s*(.+)$", line)
        if match:
            documented[match.group(1)] = match.group(2).strip()
    summary = " ".join(textwrap.dedent(head).split()) if head else text
    return summary, documented


def _py_type(schema: Mapping[str, Any]) -> type:
    kind = schema.get("type")
    if isinstance(kind, str) and kind in _JSON_TO_PY:
        return _JSON_TO_PY[kind]
    for option in list(schema.get("anyOf") or []) + list(schema.get("oneOf") or []):
        if isinstance(option, Mapping) and option.get("type") in _JSON_TO_PY:
            return _JSON_TO_PY[option["type"]]
    default = schema.get("default")
    return type(default) if isinstance(default, (bool, int, float, str, list, dict)) else str


def _tool_method(spec: Mapping[str, Any]) -> Callable[..., str] | None:
    """A method ``name(self, **arguments) -> str`` whose signature, annotations and Google-style docstring come from
    the tool's JSON schema, so ``transformers.utils.get_json_schema`` gives the model the server's tool schema.

    Server text is never executed: the signature is an ``inspect.Signature``, not generated source. Tools whose name
    or parameter names are not Python identifiers are skipped (the model could not call them by keyword).
    """
    name = spec.get("name")
    if not isinstance(name, str) or not _IDENTIFIER.match(name) or keyword.iskeyword(name) or name.startswith("_"):
        return None
    if name in ("reset", "get_reward"):
        return None  # reserved by the environment_factory contract
    schema = spec.get("input_schema") or {}
    properties: Mapping[str, Any] = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    summary, documented = _split_docstring(spec.get("description") or f"Call the {name} tool.")
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    arg_lines = []
    ordered = [p for p in properties if p in required] + [p for p in properties if p not in required]
    for pname in ordered:
        pschema = properties[pname] if isinstance(properties[pname], Mapping) else {}
        if not _IDENTIFIER.match(pname) or keyword.iskeyword(pname):
            return None
        annotation = _py_type(pschema)
        default = inspect.Parameter.empty if pname in required else pschema.get("default")
        params.append(inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
        annotations[pname] = annotation
        text = pschema.get("description") or documented.get(pname) or pschema.get("title") or pname
        arg_lines.append(f"    {pname}: {' '.join(str(text).split())}")

    def method(self: OpenRewardEnvironment, **arguments: Any) -> str:
        return self._call_tool(name, arguments)

    method.__name__ = method.__qualname__ = name
    method.__doc__ = summary + ("\n\nArgs:\n" + "\n".join(arg_lines) if arg_lines else "")
    method.__signature__ = inspect.Signature(params, return_annotation=str)  # type: ignore[attr-defined]
    method.__annotations__ = {**annotations, "return": str}
    return method


class OpenRewardFactory:
    """A picklable ``environment_factory``: each call returns a fresh environment for one rollout slot."""

    def __init__(self, client: OpenRewardClient, tool_specs: list[dict[str, Any]], split: str,
                 secrets: Mapping[str, str] | None):  # fmt: skip
        self.client, self.tool_specs, self.split, self.secrets = client, tool_specs, split, secrets
        self.__name__ = "OpenRewardEnvironment"

    def __call__(self) -> OpenRewardEnvironment:
        return tool_class(self.tool_specs)(self.client, split=self.split, secrets=self.secrets)

    def __repr__(self) -> str:
        return f"OpenRewardFactory({self.client.target!r}, tools={[t['name'] for t in self.tool_specs]})"


def outcome_reward(environments: list[Any] | None = None, **kwargs: Any) -> list[float]:
    """Outcome-only reward: each rollout's last reward that was not ``None`` (0.0 when none came)."""
    if environments is None:
        raise ValueError("outcome_reward needs environments=: use it with GRPOTrainer(environment_factory=...).")
    return [float(env.reward) for env in environments]


outcome_reward.__name__ = "_outcome_only_reward_func"  # TRL's metric name: rewards/_outcome_only_reward_func/mean
