"""``POST /v1/chat/completions`` over 127.0.0.1: an OpenAI-client agent loop with a tool round-trip, token ids and
log-probs that equal ``/v1/completions`` on the rendered prompt, stop strings, and 400s that name the field."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from agent_helpers import ScriptedLM, call, last_user, tool_responses  # noqa: E402

from posttrain.models.tiny import build_tiny_tokenizer  # noqa: E402
from posttrain.serving.app import serve_in_thread  # noqa: E402
from posttrain.serving.engine import PosttrainEngine  # noqa: E402

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },  # fmt: skip
    },
}


def script(context: str) -> str:
    """Call ``add`` on the user's two numbers, then answer with the tool's result."""
    results = tool_responses(context)
    if results:
        return f"The answer is {results[-1]}"
    a, b = last_user(context).split("+")
    return call("add", json.dumps({"a": int(a), "b": int(b)}))


@pytest.fixture(scope="module")
def scripted_url(tiny_causal_lm):
    tokenizer = build_tiny_tokenizer()
    engine = PosttrainEngine(ScriptedLM(tiny_causal_lm, tokenizer, script), tokenizer, model_name="scripted")
    with serve_in_thread(engine) as url:
        yield url, tokenizer


@pytest.fixture(scope="module")
def real_url(tiny_model_path):
    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu", served_model_name="tiny")
    with serve_in_thread(engine, max_request_bytes=64 * 1024) as url:
        yield url, engine


def test_openai_client_tool_round_trip(scripted_url):
    """A two-turn agent loop with the ``openai`` client: a parsed tool call, the tool's answer sent back as a tool
    message (rendered by the chat template), then a final answer; token ids and log-probs come with every call."""
    openai = pytest.importorskip("openai")
    url, tokenizer = scripted_url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "2+3"}]

    first = client.chat.completions.create(model="scripted", messages=messages, tools=[ADD_TOOL], seed=0,
                                           max_completion_tokens=64)  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
    call0 = choice.message.tool_calls[0]
    assert json.loads(call0.function.arguments) == {"a": 2, "b": 3} and call0.id.startswith("call_")
    assert not choice.message.content
    extra = first.model_extra
    assert tokenizer.decode(extra["prompt_token_ids"], skip_special_tokens=False).endswith(
        "<|im_start|>user\n2+3<|im_end|>\n<|im_start|>assistant\n"
    )
    assert '"name": "add"' in tokenizer.decode(extra["prompt_token_ids"])  # the tool schema was rendered
    token_ids = choice.model_extra["token_ids"]
    assert tokenizer.decode(token_ids, skip_special_tokens=False) == call("add", '{"a": 2, "b": 3}') + "<|im_end|>"
    assert len(choice.model_extra["token_logprobs"]) == len(token_ids)
    assert extra["version"] == 0 and first.usage.completion_tokens == len(token_ids)

    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call0.id, "content": str(2 + 3)})
    second = client.chat.completions.create(model="scripted", messages=messages, tools=[ADD_TOOL], seed=0,
                                            max_completion_tokens=64)  # fmt: skip
    final = second.choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert final.message.content == "The answer is 5"
    prompt = tokenizer.decode(second.model_extra["prompt_token_ids"], skip_special_tokens=False)
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>'
        in prompt
    )
    assert prompt.endswith("<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_stop_strings_end_the_completion(scripted_url):
    url, tokenizer = scripted_url
    body = {"messages": [{"role": "user", "content": "1+1"}], "tools": [ADD_TOOL], "stop": ["arguments"],
            "max_tokens": 64}  # fmt: skip
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"] == '<tool_call>{"name": "add", "'
    text = tokenizer.decode(choice["token_ids"])
    assert text.endswith("arguments") and len(choice["token_logprobs"]) == len(choice["token_ids"])
    assert choice["stop_reason"] == "arguments"


def test_tool_choice_none_leaves_calls_unparsed(scripted_url):
    url, _ = scripted_url
    body = {"messages": [{"role": "user", "content": "1+1"}], "tools": [ADD_TOOL], "tool_choice": "none"}
    with httpx.Client(timeout=60) as http:
        choice = http.post(f"{url}/v1/chat/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"] == call("add", '{"a": 1, "b": 1}')


def test_tokens_and_logprobs_equal_completions_on_the_rendered_prompt(real_url):
    """Same seed, same rendered prompt: ``/v1/chat/completions`` samples exactly what ``/v1/completions`` does."""
    from posttrain.data.chat_templates import render_chat

    url, engine = real_url
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    chat_body = {"messages": messages, "n": 3, "seed": 11, "temperature": 0.9, "top_p": 0.95, "max_tokens": 12,
                 "logprobs": True, "top_logprobs": 2}  # fmt: skip
    with httpx.Client(timeout=60) as http:
        chat = http.post(f"{url}/v1/chat/completions", json=chat_body).json()
        ids = render_chat(engine.tokenizer, [messages[0], {"role": "user", "content": "hi"}], tokenize=True,
                          add_generation_prompt=True)["input_ids"]  # fmt: skip
        assert chat["prompt_token_ids"] == ids
        comp = http.post(f"{url}/v1/completions", json={"prompt": ids, "n": 3, "seed": 11, "temperature": 0.9,
                                                         "top_p": 0.95, "max_tokens": 12, "logprobs": 2}).json()  # fmt: skip
    assert [c["token_ids"] for c in chat["choices"]] == [c["token_ids"] for c in comp["choices"]]
    assert [c["token_logprobs"] for c in chat["choices"]] == [c["logprobs"]["token_logprobs"] for c in comp["choices"]]
    assert [c["finish_reason"] for c in chat["choices"]] == [c["finish_reason"] for c in comp["choices"]]
    for c_chat, c_comp in zip(chat["choices"], comp["choices"]):
        content = c_chat["logprobs"]["content"]
        assert [e["logprob"] for e in content] == c_comp["logprobs"]["token_logprobs"]
        for entry, top in zip(content, c_comp["logprobs"]["top_logprobs"]):
            assert len(entry["top_logprobs"]) == 2
            expected = sorted(top.values(), reverse=True)[:2]
            assert [t["logprob"] for t in entry["top_logprobs"]] == expected
    assert chat["usage"]["prompt_tokens"] == len(ids) and chat["object"] == "chat.completion"


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content",
        ),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools[0].function.parameters",
        ),
        ({"tools": "add"}, "tools"),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"max_tokens": 4000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x" * 3000}], "max_tokens": None}, "messages"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"stream": True}, "stream"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"temperature": -1}, "temperature"),
        ({"bogus_field": 1}, "bogus_field"),
        ({"model": "other"}, "model"),
    ],
)
def test_bad_requests_get_400_naming_the_field(real_url, patch, param):
    url, _ = real_url
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **patch}
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{url}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param.split(".")[0].split("[")[0] in error["message"]


def test_oversized_body_is_refused_before_parsing(real_url):
    url, _ = real_url
    with httpx.Client(timeout=60) as http:
        r = http.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 70_000}]})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body"


def test_capture_mode_records_every_call_of_a_rollout(scripted_url):
    """Calls under a rollout id (base URL, header or body field) are recorded with the prompt ids, completion ids,
    log-probs and weight version they were served with; GET shows them, DELETE collects and forgets them."""
    openai = pytest.importorskip("openai")
    url, _ = scripted_url
    agent = openai.OpenAI(base_url=f"{url}/rollouts/ep-1/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "4+5"}]
    answers = []
    for _ in range(2):  # the agent's own loop: call, run the tool, answer
        out = agent.chat.completions.create(model="scripted", messages=messages, tools=[ADD_TOOL], n=2, seed=3)
        answers.append(out)
        message = out.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for c in message.tool_calls or []:
            args = json.loads(c.function.arguments)
            messages.append({"role": "tool", "tool_call_id": c.id, "content": str(args["a"] + args["b"])})
    assert answers[-1].choices[0].message.content == "The answer is 9"
    plain = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    plain.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "1+2"}])  # not captured
    by_header = plain.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "1+2"}],
                                              extra_headers={"X-Rollout-Id": "ep-2"})  # fmt: skip
    plain.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "2+2"}],
                                  extra_body={"rollout_id": "ep-2"})  # fmt: skip
    assert by_header.model_extra["rollout_id"] == "ep-2" and by_header.model_extra["capture_index"] == 0

    with httpx.Client(timeout=60) as http:
        got = http.get(f"{url}/v1/rollouts/ep-1").json()
        assert [c["index"] for c in got["calls"]] == [0, 1]
        for call_, out in zip(got["calls"], answers):
            assert call_["id"] == out.id and call_["version"] == out.model_extra["version"] == 0
            assert call_["prompt_token_ids"] == out.model_extra["prompt_token_ids"]
            assert [c["token_ids"] for c in call_["completions"]] == [c.model_extra["token_ids"] for c in out.choices]
            assert [c["logprobs"] for c in call_["completions"]] == [
                c.model_extra["token_logprobs"] for c in out.choices
            ]
        assert got["calls"][0]["completions"][0]["finish_reason"] == "tool_calls"
        assert len(http.get(f"{url}/v1/rollouts/ep-2").json()["calls"]) == 2
        collected = http.delete(f"{url}/v1/rollouts/ep-1")
        assert collected.status_code == 200 and collected.json()["calls"] == got["calls"]
        gone = http.get(f"{url}/v1/rollouts/ep-1")
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "rollout_id"
        clash = http.post(f"{url}/rollouts/a/v1/chat/completions", headers={"X-Rollout-Id": "b"},
                          json={"messages": [{"role": "user", "content": "1+1"}]})  # fmt: skip
        assert clash.status_code == 400 and clash.json()["error"]["param"] == "rollout_id"
        bad = http.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "1+1"}],
                                                             "rollout_id": "has space"})  # fmt: skip
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "rollout_id"


def test_capture_store_is_bounded():
    from posttrain.serving.capture import CaptureStore

    store = CaptureStore(max_rollouts=2)
    for rid in ("a", "b", "c"):
        assert store.record(rid, {"prompt_token_ids": [1]}) == 0
    assert store.record("c", {"prompt_token_ids": [2]}) == 1
    assert store.get("a") is None and len(store) == 2
    assert [c["prompt_token_ids"] for c in store.get("c", pop=True)] == [[1], [2]]
    assert store.get("c") is None and store.get("b") is not None
