"""Chat-template utilities (posttrain.data.chat_templates, re-exported by posttrain.chat_template_utils)."""

import warnings

import pytest

from posttrain.chat_template_utils import (
    clone_chat_template,
    detect_chat_template_family,
    get_training_chat_template,
    has_generation_markers,
    is_chat_template_prefix_preserving,
    is_chat_template_stop_token_trained,
    supports_tool_calling,
)
from posttrain.data.chat_templates import (
    TEMPLATES_DIR,
    apply_chat_template_path,
    render_chat,
    resolve_template_kwargs,
    resolve_tools,
    validate_assistant_only_loss_template,
)
from posttrain.data.formats import DataFormatError
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

CHATML_TRAINING = (TEMPLATES_DIR / "chatml_training.jinja").read_text()
NO_MARKERS = CHATML_TRAINING.replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
# Qwen2.5-style: ChatML plus a default system prompt when none is given; no tools, no generation markers
QWEN_LIKE = (
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA_LIKE = (
    "{%- for m in messages %}{{- '[' + m.role + '] ' + m.content + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '[assistant] ' }}{%- endif %}"
)
# only the last message gets a marker: appending a message re-renders the previous one
NOT_PREFIX_PRESERVING = (
    "{%- for m in messages %}{% generation %}{{- m.content }}{% if loop.last %}<|im_end|>{% endif %}"
    "{% endgeneration %}{%- endfor %}"
)
EOT_OUTSIDE_MASK = CHATML_TRAINING.replace(
    "{{- '<|im_end|>' }}\n{%- endgeneration %}", "{%- endgeneration %}\n{{- '<|im_end|>' }}"
)


def test_template_variants_differ_from_the_original():
    assert len({CHATML_TRAINING, NO_MARKERS, EOT_OUTSIDE_MASK}) == 3


def with_template(template):
    tok = build_tiny_tokenizer()
    tok.chat_template = template
    return tok


def test_has_generation_markers():
    assert has_generation_markers(CHATML_TRAINING)
    assert has_generation_markers("{% generation %}x{% endgeneration %}")
    assert has_generation_markers("{%-generation-%}x{%- endgeneration -%}")
    assert not has_generation_markers(NO_MARKERS)
    assert not has_generation_markers("")


def test_capability_probes_on_the_bundled_template(tok):
    assert supports_tool_calling(tok)
    assert is_chat_template_prefix_preserving(tok)
    assert is_chat_template_stop_token_trained(tok)
    assert detect_chat_template_family(tok) == "chatml"
    assert get_training_chat_template(tok) is None  # already fit for training


def test_capability_probes_on_other_templates():
    assert not supports_tool_calling(with_template(QWEN_LIKE))
    assert not supports_tool_calling(with_template("{{ raise_exception('no') }}"))
    assert not is_chat_template_prefix_preserving(with_template(NOT_PREFIX_PRESERVING))
    assert is_chat_template_prefix_preserving(with_template(QWEN_LIKE))
    assert not is_chat_template_stop_token_trained(with_template(EOT_OUTSIDE_MASK))
    assert not is_chat_template_stop_token_trained(with_template(NO_MARKERS))
    # a template that cannot render the probe is not one that trains the stop token (TRL), not an error
    assert not is_chat_template_stop_token_trained(with_template("{{ raise_exception('no') }}"))
    assert not is_chat_template_stop_token_trained(with_template("{% if %}"))
    assert detect_chat_template_family(with_template(QWEN_LIKE)) == "chatml"
    assert detect_chat_template_family(with_template(LLAMA_LIKE)) is None


def test_get_training_chat_template_swaps_known_family():
    tok = with_template(NO_MARKERS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # identical rendering everywhere: no warning
        template = get_training_chat_template(tok)
    assert template == CHATML_TRAINING and has_generation_markers(template)
    tok.chat_template = template
    assert get_training_chat_template(tok) is None


def test_get_training_chat_template_warns_about_rendering_differences():
    with pytest.warns(UserWarning, match="without a system message"):
        assert get_training_chat_template(with_template(QWEN_LIKE)) == CHATML_TRAINING
    with pytest.warns(FutureWarning, match="deprecated"), pytest.warns(UserWarning):
        get_training_chat_template(None, tokenizer=with_template(QWEN_LIKE))


def test_get_training_chat_template_unknown_family_names_the_problem():
    with pytest.raises(
        ValueError, match=r"no `\{% generation %\}` markers.*known family \(chatml, llama3_1, .*\).*chat_template_path"
    ):
        get_training_chat_template(with_template(LLAMA_LIKE))
    with pytest.raises(ValueError, match="no chat template"):
        get_training_chat_template(with_template(None))


def test_validate_assistant_only_loss_template():
    validate_assistant_only_loss_template(build_tiny_tokenizer())
    with pytest.raises(ValueError, match="get_training_chat_template"):
        validate_assistant_only_loss_template(with_template(NO_MARKERS))
    with pytest.raises(ValueError, match="chat_template_path"):
        validate_assistant_only_loss_template(with_template(LLAMA_LIKE))
    with pytest.warns(UserWarning, match="end-of-turn token is not inside"):
        validate_assistant_only_loss_template(with_template(EOT_OUTSIDE_MASK))


def test_bundled_template_masks_include_end_of_turn_and_tool_calls(tok):
    messages = [
        {"role": "user", "content": "Lights on ☀"},
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "lights", "arguments": {"on": True}}}],
        },
        {"role": "tool", "name": "lights", "content": "done"},
        {"role": "assistant", "content": "Voilà"},
    ]
    out = render_chat(tok, messages, tokenize=True, return_assistant_tokens_mask=True)
    trained = tok.decode([i for i, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    assert trained == '<tool_call>{"name": "lights", "arguments": {"on": true}}</tool_call><|im_end|>Voilà<|im_end|>'


def test_render_chat_drops_none_fields_and_resolves_tools(tok):
    # Arrow fills absent keys with None; the template must see them as undefined
    messages = [{"role": "user", "content": "Hi", "tool_calls": None, "name": None}]
    assert (
        render_chat(tok, messages, add_generation_prompt=True)
        == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert resolve_tools('[{"type": "function", "function": {"name": "f"}}]') == [
        {"type": "function", "function": {"name": "f"}}
    ]
    assert resolve_tools("") is None and resolve_tools([]) is None and resolve_tools(None) is None
    with pytest.raises(DataFormatError, match=r"Row 4, column 'tools': .*not valid JSON"):
        resolve_tools("[{", row=4)
    with pytest.raises(DataFormatError, match="list of tool JSON schemas"):
        resolve_tools(3)
    assert resolve_template_kwargs({"a": 1, "b": 2}, {"b": 3, "c": None}) == {"a": 1, "b": 3}
    assert resolve_template_kwargs(None, '{"enable_thinking": false}') == {"enable_thinking": False}
    with pytest.raises(DataFormatError, match="chat_template_kwargs"):
        resolve_template_kwargs(None, [1], row=2)


def test_clone_chat_template(tmp_path):
    source = build_tiny_tokenizer()
    source.add_special_tokens({"additional_special_tokens": ["<|turn_end|>"]})
    source.eos_token = "<|turn_end|>"
    source.chat_template = LLAMA_LIKE
    source.save_pretrained(tmp_path / "source")

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(tokenizer=tokenizer)
    assert model.get_input_embeddings().weight.shape[0] == 320
    model, tokenizer, added = clone_chat_template(model, tokenizer, str(tmp_path / "source"), resize_to_multiple_of=64)
    assert tokenizer.chat_template == LLAMA_LIKE
    assert tokenizer.eos_token == "<|turn_end|>"
    turn_end = tokenizer.convert_tokens_to_ids("<|turn_end|>")
    assert model.config.eos_token_id == turn_end == model.generation_config.eos_token_id
    rows = model.get_input_embeddings().weight.shape[0]
    assert rows % 64 == 0 and rows == len(tokenizer) == 320
    assert added[0] == turn_end == 266 and len(added) == 320 - 266  # the new token, then <extra_id_N> fillers
    assert tokenizer.convert_ids_to_tokens(added[-1]) == f"<extra_id_{len(added) - 2}>"


def test_apply_chat_template_path(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(LLAMA_LIKE)
    tokenizer = build_tiny_tokenizer()
    _, tokenizer, added = apply_chat_template_path(None, tokenizer, path)
    assert tokenizer.chat_template == LLAMA_LIKE and added == []
