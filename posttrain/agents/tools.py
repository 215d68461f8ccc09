"""Tools for agent training: JSON schemas from Python functions, executing model-made calls, tool messages.

A tool is a plain Python function (``def`` or ``async def``) with type hints on every argument and a Google-style
docstring (a description, and an ``Args:`` entry per argument); ``transformers.utils.get_json_schema`` turns it into
the JSON schema the chat template renders. Bound methods work too (environment tools are an instance's methods).

Executing calls (:func:`execute_tool_calls`): every call of one loop iteration, over all rollouts, is run here —
synchronous tools one after another on the caller's thread while the ``async`` ones run concurrently on the shared
background event loop (the one async reward functions use). A call never raises into the training loop: an unknown
tool name, malformed arguments (see ``tool_calls``), wrong keyword arguments or an exception inside the tool become
the tool message ``{'error': '...'}`` (TRL's ``str({"error": str(e)})``) and count as a failure. Results are
turned into message content with ``str(result)``; a list of text content blocks is joined into one string. The one
exception is :class:`EnvironmentUnavailableError`: the environment *behind* a tool is gone (a remote environment
server died or stopped answering), which is not the model's mistake, so it is re-raised and stops the step instead
of being shown to the model as a tool error it would learn from.

Security: the tool *code* is the user's, but the *arguments* are chosen by the model being trained and must be
treated as untrusted input — exploration finds every path a tool leaves open (shell strings, file paths, ``eval``,
network addresses). Validate arguments inside tools, keep side effects inside a per-rollout environment, and run
model-written code only through :func:`python_tool` (``posttrain.rewards.sandbox.run_python``: separate process,
time/memory/output limits, no network, temporary directory, whole process group killed).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.agents.tool_calls import ToolCall


class ToolResultError(ValueError):
    """A tool returned content this setup cannot feed back to the model (e.g. an image to a text-only model)."""


class EnvironmentUnavailableError(ConnectionError):
    """The environment behind a tool cannot be reached (its server died, refused or timed out).

    Raise it from a tool (or an environment's ``reset``/``get_reward``) for infrastructure failures: the tool loop
    re-raises it rather than feeding ``{'error': ...}`` back to the model, so training stops with this message
    instead of learning from an episode the environment never ran. The message should name the endpoint and the fix.
    """


@dataclass
class Tool:
    """A callable the model may call, with its JSON schema.

    Attributes:
        name: The name the model calls it by (the schema's ``function.name``).
        function: The callable (sync or ``async``).
        schema: ``{"type": "function", "function": {"name", "description", "parameters", ...}}``.
        is_async: Whether calling it returns a coroutine.
    """

    name: str
    function: Callable[..., Any]
    schema: dict[str, Any]
    is_async: bool


def _is_async(function: Any) -> bool:
    # Callable objects with an ``async def __call__`` count too.
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(type(function).__call__)


def as_tool(function: Callable[..., Any] | Tool, name: str | None = None) -> Tool:
    """Wrap ``function`` as a :class:`Tool`, its schema from ``transformers.utils.get_json_schema``.

    Args:
        function: A function or bound method with type hints and a Google-style docstring (or a ``Tool``).
        name: Expose it under this name instead of ``function.__name__``.

    Raises:
        ValueError: The function has no docstring, an argument without a type hint or without an ``Args:`` entry;
            the message names the tool and the fix.
    """
    if isinstance(function, Tool):
        return function
    if not callable(function):
        raise TypeError(f"A tool must be a callable (function or method), got {type(function).__name__}.")
    from transformers.utils import get_json_schema

    label = name or getattr(function, "__name__", type(function).__name__)
    try:
        schema = get_json_schema(function)
    except Exception as err:
        raise ValueError(
            f"Tool {label!r} cannot be turned into a JSON schema: {err} Tools need a type hint on every argument "
            "and a Google-style docstring: a one-line description, then an 'Args:' section with one "
            "'name: description' line per argument."
        ) from err
    if name is not None:
        schema = {**schema, "function": {**schema["function"], "name": name}}
    return Tool(schema["function"]["name"], function, schema, _is_async(function))


def build_tools(tools: Iterable[Callable[..., Any] | Tool] | None) -> dict[str, Tool]:
    """``{name: Tool}`` for a list of functions (``None`` → empty); two tools with one name is an error."""
    out: dict[str, Tool] = {}
    for item in tools or ():
        tool = as_tool(item)
        if tool.name in out:
            raise ValueError(
                f"Two tools are named {tool.name!r}; tool names must be unique. Rename one of the functions (or "
                "wrap it with posttrain.agents.as_tool(function, name=...))."
            )
        out[tool.name] = tool
    return out


def tool_schemas(tools: Mapping[str, Tool]) -> list[dict[str, Any]]:
    """The JSON schemas, in order, as passed to ``apply_chat_template(tools=...)``."""
    return [tool.schema for tool in tools.values()]


@dataclass
class ToolOutcome:
    """What one call produced: the ``tool`` message to append and whether the call failed."""

    message: dict[str, Any]
    failed: bool


def _error_message(name: str, error: str) -> ToolOutcome:
    # TRL's format: the tool turn holds str({"error": ...}).
    return ToolOutcome({"role": "tool", "name": name or "unknown", "content": str({"error": error})}, True)


_IMAGE_BLOCK_TYPES = ("image", "image_url", "image_pil", "input_image")


def tool_content(result: Any, tool_name: str, *, supports_images: bool = False) -> str | list[dict[str, Any]]:
    """Message content for a tool's return value.

    ``str`` stays as is; a list of content blocks (``{"type": "text", "text": ...}``, ``{"type": "image", ...}``)
    is kept as blocks when ``supports_images`` and joined into one string when it holds only text; anything else
    becomes ``str(result)``.

    Raises:
        ToolResultError: Image blocks while ``supports_images`` is False.
    """
    if isinstance(result, str):
        return result
    is_blocks = isinstance(result, list) and bool(result) and all(isinstance(b, dict) and "type" in b for b in result)
    if not is_blocks:
        return str(result)
    if supports_images:
        return [dict(block) for block in result]
    images = [b["type"] for b in result if b["type"] in _IMAGE_BLOCK_TYPES]
    if images:
        raise ToolResultError(
            f"Tool {tool_name!r} returned image content ({images[0]!r} block), but this model and generation "
            "backend take text only: the tool loop feeds tool results back as text tokens. Return text (e.g. a "
            "description of the image), or train a vision-language model with a generation backend that accepts "
            "images."
        )
    return "".join(str(b.get("text", "")) for b in result)


def _bind_error(function: Callable[..., Any], arguments: dict[str, Any]) -> str | None:
    """Why ``function(**arguments)`` would fail to bind, or ``None``."""
    try:
        inspect.signature(function).bind(**arguments)
    except TypeError as err:
        return f"Invalid arguments {sorted(arguments)}: {err}."
    except ValueError:  # builtins without a signature: let the call itself report
        return None
    return None


async def _run_async(function: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    return await function(**arguments)


def execute_tool_calls(
    calls_per_rollout: Sequence[Sequence[ToolCall]],
    tools_per_rollout: Sequence[Mapping[str, Tool]],
    *,
    supports_images: bool = False,
) -> list[list[ToolOutcome]]:
    """Run the calls of one loop iteration for every rollout; outcomes come back in call order per rollout.

    Async tools of all rollouts run concurrently on the shared background event loop while the sync tools run in
    order on this thread. Unknown tools, malformed calls, arguments that do not fit the signature and exceptions
    raised by a tool become error messages (``failed=True``); they never raise here. Only content the model cannot
    be shown (:class:`ToolResultError`) and an unreachable environment (:class:`EnvironmentUnavailableError`) raise,
    because those are setup or infrastructure problems, not the model's mistake.

    Args:
        calls_per_rollout: For each rollout, the calls parsed from its latest assistant turn.
        tools_per_rollout: For each rollout, the tools it may call (an environment's methods are per rollout).
        supports_images: Keep image content blocks in tool messages (else they raise :class:`ToolResultError`).
    """
    from posttrain.rewards.scoring import submit_coroutine

    outcomes: list[list[ToolOutcome | None]] = [[None] * len(calls) for calls in calls_per_rollout]
    sync_jobs, async_jobs = [], []
    for i, (calls, tools) in enumerate(zip(calls_per_rollout, tools_per_rollout)):
        for j, call in enumerate(calls):
            if call.error is not None:
                outcomes[i][j] = _error_message(call.name, call.error)
                continue
            tool = tools.get(call.name)
            if tool is None:
                available = ", ".join(tools) or "none"
                outcomes[i][j] = _error_message(
                    call.name, f"Tool {call.name!r} not found. Available tools: {available}."
                )
                continue
            problem = _bind_error(tool.function, call.arguments or {})
            if problem is not None:
                outcomes[i][j] = _error_message(call.name, problem)
                continue
            (async_jobs if tool.is_async else sync_jobs).append((i, j, tool, call.arguments or {}))

    async def gather_async() -> list[Any]:
        return await asyncio.gather(*(_run_async(t.function, a) for _, _, t, a in async_jobs), return_exceptions=True)

    pending = submit_coroutine(gather_async()) if async_jobs else None
    results: list[tuple[int, int, Tool, Any]] = []
    try:
        for i, j, tool, arguments in sync_jobs:
            try:
                results.append((i, j, tool, tool.function(**arguments)))
            except EnvironmentUnavailableError:
                raise
            except Exception as err:  # the model's call failed: tell it, keep training
                results.append((i, j, tool, err))
    finally:
        async_results = pending.result() if pending is not None else []
    results.extend((i, j, tool, value) for (i, j, tool, _), value in zip(async_jobs, async_results))
    for i, j, tool, value in results:
        if isinstance(value, EnvironmentUnavailableError):
            raise value
        if isinstance(value, BaseException):
            outcomes[i][j] = _error_message(tool.name, str(value) or type(value).__name__)
            continue
        content = tool_content(value, tool.name, supports_images=supports_images)
        outcomes[i][j] = ToolOutcome({"role": "tool", "name": tool.name, "content": content}, False)
    return [[o for o in row if o is not None] for row in outcomes]


def python_tool(
    *,
    name: str = "python",
    timeout: float = 5.0,
    memory_mb: int = 512,
    max_output_chars: int = 2000,
    isolation: str = "auto",
) -> Callable[[str], Any]:
    """A tool that runs model-written Python in posttrain's sandbox and returns what it printed.

    Each call runs ``code`` in a fresh interpreter via ``posttrain.rewards.sandbox.run_python`` (separate process,
    wall-clock ``timeout``, ``memory_mb`` memory limit, bubblewrap namespaces without network, seccomp, temporary
    working directory). The call is ``async`` (the sandbox runs in a worker thread), so the calls of many rollouts
    overlap. The result is the program's stdout; on failure the status and the end of stderr are appended.

    Args:
        name: Tool name the model calls.
        timeout: Seconds per call.
        memory_mb: Memory limit per call.
        max_output_chars: Longest result returned to the model (the end is cut, with a marker).
        isolation: ``run_python``'s isolation (``"auto"``, ``"strict"``, or the weak opt-in ``"basic"``).

    Returns:
        An ``async`` function ``(code: str) -> str`` with a docstring and type hints, usable in ``tools=[...]``.
    """
    from posttrain.rewards.sandbox import run_python

    async def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it prints.

        Args:
            code: The complete Python program to run; use print() to show results.
        """
        result = await asyncio.to_thread(run_python, code, timeout=timeout, memory_mb=memory_mb, isolation=isolation)
        text = result.stdout
        if not result.ok:
            text += f"\n[{result.status}] {result.stderr[-max_output_chars // 2 :]}"
        if len(text) > max_output_chars:
            text = text[:max_output_chars] + "\n[output truncated]"
        return text

    python.__name__ = python.__qualname__ = name
    return python
