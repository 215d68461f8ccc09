"""Tools: schemas from functions, executing calls (sync, concurrent async, every failure mode), python_tool."""

from __future__ import annotations

import asyncio

import pytest
from agent_helpers import add, explode

from posttrain.agents.tool_calls import ToolCall
from posttrain.agents.tools import (
    EnvironmentUnavailableError,
    ToolResultError,
    as_tool,
    build_tools,
    execute_tool_calls,
    python_tool,
    tool_content,
    tool_schemas,
)


async def async_mul(a: int, b: int) -> int:
    """Multiply two integers, asynchronously.

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0)
    return a * b


def test_schema_from_function_async_function_and_bound_method():
    tool = as_tool(add)
    assert tool.name == "add" and not tool.is_async
    assert tool.schema["function"]["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "The first integer.",
    }
    assert as_tool(async_mul).is_async

    class Counter:
        def increment(self, step: int) -> int:
            """Increment the counter.

            Args:
                step: Value to add.
            """
            return step

    bound = as_tool(Counter().increment)
    assert bound.name == "increment" and list(bound.schema["function"]["parameters"]["properties"]) == ["step"]
    renamed = as_tool(add, name="plus")
    assert renamed.name == "plus" and renamed.schema["function"]["name"] == "plus"
    assert tool_schemas(build_tools([add, async_mul])) == [as_tool(add).schema, as_tool(async_mul).schema]


def test_schema_errors_name_the_tool_and_the_fix():
    def no_doc(x: int) -> int:
        return x

    def no_hint(x):
        """Doc.

        Args:
            x: thing
        """

    with pytest.raises(ValueError, match="Tool 'no_doc' cannot be turned into a JSON schema.*Google-style docstring"):
        as_tool(no_doc)
    with pytest.raises(ValueError, match="Tool 'no_hint'"):
        as_tool(no_hint)
    with pytest.raises(ValueError, match="Two tools are named 'add'"):
        build_tools([add, add])
    with pytest.raises(TypeError, match="must be a callable"):
        as_tool(3)


def _messages(outcomes):
    return [[(o.message["name"], o.message["content"], o.failed) for o in row] for row in outcomes]


def test_execute_sync_async_and_failures_per_rollout():
    tools = build_tools([add, async_mul, explode])
    calls = [
        [ToolCall("add", {"a": 2, "b": 3}, ""), ToolCall("async_mul", {"a": 2, "b": 3}, "")],
        [ToolCall("explode", {"reason": "x"}, ""), ToolCall("search", {"q": "x"}, "")],
        [ToolCall("add", {"a": 1, "c": 2}, ""), ToolCall("add", None, "{bad", "The tool call is not valid JSON.")],
        [],
    ]
    out = _messages(execute_tool_calls(calls, [tools] * 4))
    assert out[0] == [("add", "5", False), ("async_mul", "6", False)]
    assert out[1][0] == ("explode", str({"error": "boom: x"}), True)
    assert out[1][1][0] == "search" and out[1][1][2]
    assert "Tool 'search' not found. Available tools: add, async_mul, explode." in out[1][1][1]
    assert out[2][0][2] and "Invalid arguments ['a', 'c']" in out[2][0][1]
    assert out[2][1] == ("add", str({"error": "The tool call is not valid JSON."}), True)
    assert out[3] == []


def test_async_tools_of_all_rollouts_run_concurrently():
    # Each call waits until both have started: run one after the other, the first would time out.
    started: list[str] = []
    both = asyncio.Event()

    async def rendezvous(who: str) -> str:
        """Wait for the other caller.

        Args:
            who: Caller name.
        """
        started.append(who)
        if len(started) == 2:
            both.set()
        await asyncio.wait_for(both.wait(), timeout=5)
        return f"{who} met"

    tools = build_tools([rendezvous])
    calls = [[ToolCall("rendezvous", {"who": "a"}, "")], [ToolCall("rendezvous", {"who": "b"}, "")]]
    assert _messages(execute_tool_calls(calls, [tools, tools])) == [
        [("rendezvous", "a met", False)],
        [("rendezvous", "b met", False)],
    ]


def test_async_tool_exception_is_an_error_message():
    async def fail(x: int) -> int:
        """Fails.

        Args:
            x: Anything.
        """
        raise ValueError("negative")

    out = _messages(execute_tool_calls([[ToolCall("fail", {"x": 1}, "")]], [build_tools([fail])]))
    assert out == [[("fail", str({"error": "negative"}), True)]]


@pytest.mark.parametrize("is_async", [False, True])
def test_unavailable_environment_is_raised_not_shown_to_the_model(is_async):
    """A dead environment server is not the model's mistake: the step stops with the error (sync and async tools)."""

    def gone(x: int) -> int:
        """Needs the server.

        Args:
            x: Anything.
        """
        raise EnvironmentUnavailableError("server at ws://127.0.0.1:1/ws is unavailable")

    async def gone_async(x: int) -> int:
        """Needs the server.

        Args:
            x: Anything.
        """
        return gone(x)

    tool = gone_async if is_async else gone
    calls = [[ToolCall(tool.__name__, {"x": 1}, ""), ToolCall("add", {"a": 1, "b": 2}, "")]]
    with pytest.raises(EnvironmentUnavailableError, match="ws://127.0.0.1:1/ws"):
        execute_tool_calls(calls, [build_tools([tool, add])])


def test_tool_content_conversions():
    assert tool_content("x", "t") == "x"
    assert tool_content({"a": 1}, "t") == "{'a': 1}"
    assert tool_content(7, "t") == "7"
    blocks = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert tool_content(blocks, "t") == "ab"
    image = [{"type": "image", "image": object()}, {"type": "text", "text": "a cat"}]
    assert tool_content(image, "t", supports_images=True) == image
    with pytest.raises(ToolResultError, match="Tool 'shot' returned image content"):
        tool_content(image, "shot")
    assert tool_content([1, 2], "t") == "[1, 2]"


def test_image_result_raises_a_clear_error_during_execution():
    def shot() -> list:
        """Take a screenshot."""
        return [{"type": "image", "image": "pixels"}]

    with pytest.raises(ToolResultError, match="take text only"):
        execute_tool_calls([[ToolCall("shot", {}, "")]], [build_tools([shot])])


def test_python_tool_runs_model_code_in_the_sandbox(sandbox_lock):
    tool = as_tool(python_tool(timeout=10))
    assert tool.name == "python" and tool.is_async
    assert tool.schema["function"]["parameters"]["required"] == ["code"]
    calls = [[ToolCall("python", {"code": "print(6 * 7)"}, "")], [ToolCall("python", {"code": "1/0"}, "")]]
    out = execute_tool_calls(calls, [{"python": tool}] * 2)
    assert out[0][0].message["content"].strip() == "42" and not out[0][0].failed
    # A failing program is the tool's normal answer (status + stderr), not a tool failure.
    assert "[error]" in out[1][0].message["content"] and "ZeroDivisionError" in out[1][0].message["content"]
