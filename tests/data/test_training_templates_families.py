"""Training chat templates for the Qwen3 and Llama 3.1/3.2 families: detection, identical rendering, masks,
prefix preservation, and assistant-only SFT tokenization on offline tokenizers that carry the real templates."""

import warnings

import pytest

from posttrain.chat_template_utils import (
    CHAT_TEMPLATE_FAMILIES,
    detect_chat_template_family,
    get_training_chat_template,
    has_generation_markers,
    is_chat_template_prefix_preserving,
    is_chat_template_stop_token_trained,
    supports_tool_calling,
)
from posttrain.data.chat_templates import TEMPLATES_DIR, validate_assistant_only_loss_template
from posttrain.data.tokenization import build_labels, tokenize_lm, tokenize_prompt_completion
from posttrain.models.tiny import build_tiny_tokenizer

FAMILIES = ["qwen3", "llama3_1", "llama3_2"]
LLAMA_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
# Llama 3.2 stamps today's date into the system block unless told otherwise; fixed here so renders are stable.
FIXED_DATE = {"date_string": "26 Jul 2024"}

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
ADD_CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}

SYSTEM = {"role": "system", "content": "Be brief."}
USER_1 = {"role": "user", "content": "Wie spät ist es? ☀"}
ASSISTANT_1 = {"role": "assistant", "content": "Grüß dich — 你好!"}
USER_2 = {"role": "user", "content": "Add 2 and 3."}
CALL_TURN = {"role": "assistant", "content": "", "tool_calls": [ADD_CALL]}
TOOL_RESULT = {"role": "tool", "name": "add", "content": "5"}
FINAL = {"role": "assistant", "content": "It is 5."}
CONVERSATION = [SYSTEM, USER_1, ASSISTANT_1, USER_2, CALL_TURN, TOOL_RESULT, FINAL]

# What the model writes in each assistant turn of CONVERSATION: exactly the masked spans.
EXPECTED_SPANS = {
    "qwen3": [
        "<think>\n\n</think>\n\nGrüß dich — 你好!<|im_end|>",
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nIt is 5.<|im_end|>",
    ],
    "llama3_1": [
        "Grüß dich — 你好!<|eot_id|>",
        '{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>',
        "It is 5.<|eot_id|>",
    ],
}
EXPECTED_SPANS["llama3_2"] = EXPECTED_SPANS["llama3_1"]


def family_tokenizer(name: str, template: str = "original"):
    """The tiny byte-level tokenizer with the family's special tokens (one token each) and chat template."""
    tok = build_tiny_tokenizer()  # already has <|im_start|>, <|im_end|>, <|endoftext|>, <think>, <tool_call>...
    if name.startswith("llama"):
        tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
        tok.bos_token = "<|begin_of_text|>"
        tok.eos_token = "<|eot_id|>"
    family = CHAT_TEMPLATE_FAMILIES.get(name)
    tok.chat_template = family.original_templates()[0] if template == "original" else family.training_template()
    return tok


def render(tok, messages, template=None, **kwargs):
    if "<|start_header_id|>" in (template or tok.chat_template):
        kwargs = {**FIXED_DATE, **kwargs}
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)


def masked_spans(tok, messages, **kwargs):
    """The decoded contiguous runs of tokens that ``return_assistant_tokens_mask`` marks."""
    out = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, **kwargs
    )
    spans, run = [], []
    for token_id, mask in zip(out["input_ids"], out["assistant_masks"]):
        if mask:
            run.append(token_id)
        elif run:
            spans.append(tok.decode(run))
            run = []
    if run:
        spans.append(tok.decode(run))
    return spans


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param


def test_special_tokens_are_single_tokens(family):
    tok = family_tokenizer(family)
    for token in ["<|im_start|>", "<|im_end|>", "<think>"] if family == "qwen3" else LLAMA_SPECIALS:
        assert len(tok.encode(token, add_special_tokens=False)) == 1, token


def test_bundled_files_originals_and_training(family):
    spec = CHAT_TEMPLATE_FAMILIES.get(family)
    originals = spec.original_templates()
    training = spec.training_template()
    assert originals and all(not has_generation_markers(t) for t in originals)
    assert has_generation_markers(training) and training not in originals
    assert (TEMPLATES_DIR / f"{family}_training.jinja").read_text() == training
    assert training.startswith("{#- posttrain training version")  # the header comment says what changed


def test_detection_by_identity(family):
    spec = CHAT_TEMPLATE_FAMILIES.get(family)
    tok = family_tokenizer(family)
    for template in [*spec.original_templates(), spec.training_template(), spec.original_templates()[0] + "\n\n"]:
        assert detect_chat_template_family(tok, template) == family


def test_detection_by_rendering(family):
    # a locally edited copy (not string-equal to any bundled file) is still recognised by how it renders
    tok = family_tokenizer(family)
    tok.chat_template = "{#- my fork #}" + tok.chat_template
    assert detect_chat_template_family(tok) == family
    # the families do not claim each other's templates, nor plain ChatML
    for other in FAMILIES:
        if other != family:
            assert detect_chat_template_family(tok, family_tokenizer(other).chat_template) == other
    assert detect_chat_template_family(build_tiny_tokenizer()) == "chatml"


def test_get_training_chat_template_swaps_in_the_patched_template(family):
    tok = family_tokenizer(family)
    expected = CHAT_TEMPLATE_FAMILIES.get(family).training_template()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert get_training_chat_template(tok) == expected
    messages = [str(w.message) for w in caught]
    if family == "qwen3":  # the one intended difference is reported
        assert len(messages) == 1 and "before the last user message" in messages[0]
    else:
        assert messages == []
    tok.chat_template = expected
    assert get_training_chat_template(tok) is None  # already fit for training


def test_original_qwen3_earlier_revision_is_recognised():
    tok = family_tokenizer("qwen3")
    tok.chat_template = CHAT_TEMPLATE_FAMILIES.get("qwen3").original_templates()[1]
    with pytest.warns(UserWarning, match="kept with their <think> block"):
        assert get_training_chat_template(tok) == CHAT_TEMPLATE_FAMILIES.get("qwen3").training_template()


REASONING_CALL_TURN = {**CALL_TURN, "reasoning_content": "I should add."}
SAME_EVERYWHERE = {
    "single_turn": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], {}),
    "system": ([SYSTEM, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], {}),
    "generation_prompt": ([SYSTEM, {"role": "user", "content": "Hi"}], {"add_generation_prompt": True}),
    "non_ascii": (
        [{"role": "user", "content": "Ünïcödé ☀ 你好 🚀"}, {"role": "assistant", "content": "Ça va — très bien 😀"}],
        {},
    ),
    "tool_call_then_result": (
        [USER_2, REASONING_CALL_TURN, TOOL_RESULT],
        {"tools": [ADD_TOOL], "add_generation_prompt": True},
    ),
    "tool_round_trip": ([SYSTEM, USER_2, REASONING_CALL_TURN, TOOL_RESULT, FINAL], {"tools": [ADD_TOOL]}),
    "whitespace_content": (
        [{"role": "user", "content": "  Hi\n"}, {"role": "assistant", "content": "\nHello \n"}],
        {},
    ),
}


@pytest.mark.parametrize("case", sorted(SAME_EVERYWHERE))
def test_patched_renders_like_the_original(family, case):
    messages, kwargs = SAME_EVERYWHERE[case]
    tok = family_tokenizer(family)
    training = get_training_chat_template_quiet(tok)
    assert render(tok, messages, training, **kwargs) == render(tok, messages, **kwargs)


def get_training_chat_template_quiet(tok):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return get_training_chat_template(tok)


@pytest.mark.parametrize(
    ("messages", "kwargs"),
    [
        (CONVERSATION[:2], {"add_generation_prompt": True, "enable_thinking": False}),
        ([USER_2, {"role": "assistant", "content": "5", "reasoning_content": "2+3=5"}], {}),
        ([USER_2, {"role": "assistant", "content": "<think>\n2+3=5\n</think>\n\n5"}], {}),
        ([USER_2, {"role": "assistant", "content": "no opening tag</think>5"}], {}),
    ],
)
def test_qwen3_thinking_renders_like_the_original(messages, kwargs):
    tok = family_tokenizer("qwen3")
    training = get_training_chat_template_quiet(tok)
    assert render(tok, messages, training, **kwargs) == render(tok, messages, **kwargs)


@pytest.mark.parametrize("llama", ["llama3_1", "llama3_2"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {"tools": [ADD_TOOL]},
        {"tools": [ADD_TOOL], "tools_in_user_message": False},
        {"tools": [ADD_TOOL], "date_string": "01 Jan 2025"},
    ],
)
def test_llama_multi_turn_tools_render_like_the_original(llama, kwargs):
    tok = family_tokenizer(llama)
    training = get_training_chat_template(tok)
    assert render(tok, CONVERSATION, training, **kwargs) == render(tok, CONVERSATION, **kwargs)


def test_llama3_1_builtin_tool_call_renders_like_the_original_and_is_masked():
    tok = family_tokenizer("llama3_1")
    training = get_training_chat_template(tok)
    search = {"type": "function", "function": {"name": "brave_search", "arguments": {"query": "weather Paris"}}}
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "tool_calls": [search]},
        {"role": "ipython", "content": "Sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]
    kwargs = {"builtin_tools": ["brave_search"]}
    assert render(tok, messages, training, **kwargs) == render(tok, messages, **kwargs)
    tok.chat_template = training
    assert masked_spans(tok, messages, **kwargs, **FIXED_DATE) == [
        '<|python_tag|>brave_search.call(query="weather Paris")<|eom_id|>',
        "Sunny.<|eot_id|>",
    ]


def test_every_assistant_turn_renders_as_the_original_renders_a_final_turn(family):
    # Qwen3's original drops the <think> block of assistant turns before the last user message; the training
    # template renders every assistant turn the way the original renders it as the last message, and appending
    # messages never changes what came before.
    tok = family_tokenizer(family)
    training = get_training_chat_template_quiet(tok)
    full = render(tok, CONVERSATION, training, tools=[ADD_TOOL])
    for end, message in enumerate(CONVERSATION, start=1):
        if message["role"] != "assistant":
            continue
        turn = {}
        for name, template in (("original", None), ("training", training)):
            before = render(tok, CONVERSATION[: end - 1], template, tools=[ADD_TOOL], add_generation_prompt=True)
            upto = render(tok, CONVERSATION[:end], template, tools=[ADD_TOOL])
            assert upto.startswith(before)
            turn[name] = upto[len(before) :]
            if name == "training":
                assert full.startswith(upto)
        assert turn["training"] == turn["original"]
    if family == "qwen3":  # the one place the original differs: earlier turns lose their think block
        assert render(tok, CONVERSATION, tools=[ADD_TOOL]) != full
    else:
        assert render(tok, CONVERSATION, tools=[ADD_TOOL]) == full


def test_assistant_masks_cover_exactly_the_assistant_output(family):
    tok = family_tokenizer(family, template="training")
    spans = masked_spans(tok, CONVERSATION, tools=[ADD_TOOL], **(FIXED_DATE if "llama" in family else {}))
    assert spans == EXPECTED_SPANS[family]


def test_capability_probes(family):
    original = family_tokenizer(family)
    patched = family_tokenizer(family, template="training")
    assert supports_tool_calling(original) and supports_tool_calling(patched)
    assert is_chat_template_prefix_preserving(patched)
    assert is_chat_template_stop_token_trained(patched)
    # Qwen3's original re-renders earlier turns when messages are appended; Llama's already preserves prefixes
    assert is_chat_template_prefix_preserving(original) == (family != "qwen3")
    assert not is_chat_template_stop_token_trained(original)  # no markers, no mask
    with pytest.raises(ValueError, match=rf"known {family!r} family.*get_training_chat_template"):
        validate_assistant_only_loss_template(original)
    validate_assistant_only_loss_template(patched)


def test_sft_assistant_only_tokenization_end_to_end(family):
    tok = family_tokenizer(family)
    tok.chat_template = get_training_chat_template_quiet(tok)
    kwargs = FIXED_DATE if "llama" in family else None
    row = {"messages": CONVERSATION, "tools": [ADD_TOOL]}
    out = tokenize_lm(row, tok, assistant_only_loss=True, chat_template_kwargs=kwargs, row_index=0)
    assert tok.decode(out["input_ids"]) == render(tok, CONVERSATION, tools=[ADD_TOOL])
    labels = build_labels(out["input_ids"], assistant_masks=out["assistant_masks"])
    trained = [t for t in labels if t != -100]
    assert tok.decode(trained) == "".join(EXPECTED_SPANS[family])

    # prompt-completion rows: the prompt (with generation prompt) is a token prefix of prompt + completion
    pc = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:], "tools": [ADD_TOOL]}
    out = tokenize_prompt_completion(pc, tok, assistant_only_loss=True, chat_template_kwargs=kwargs, row_index=0)
    labels = build_labels(out["input_ids"], out["completion_mask"], out["assistant_masks"])
    assert tok.decode([t for t in labels if t != -100]) == "".join(EXPECTED_SPANS[family][1:])
