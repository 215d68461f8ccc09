"""prepare_multimodal_messages / prepare_multimodal_messages_vllm (posttrain.data.multimodal): TRL's semantics."""

import copy

import pytest
from PIL import Image

from posttrain.data_utils import prepare_multimodal_messages, prepare_multimodal_messages_vllm


def _text(text):
    return {"type": "text", "text": text}


@pytest.fixture
def images():
    return [Image.new("RGB", (4, 4), color) for color in ("red", "green", "blue")]


def test_string_contents_become_text_blocks_and_one_image_goes_before_the_user_text(images):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What color is it?"},
        {"role": "assistant", "content": "Red."},
    ]
    out = prepare_multimodal_messages(messages, images[:1])
    assert out == [
        {"role": "system", "content": [_text("Be brief.")]},
        {"role": "user", "content": [{"type": "image", "image": images[0]}, _text("What color is it?")]},
        {"role": "assistant", "content": [_text("Red.")]},
    ]
    assert out[1]["content"][0]["image"] is images[0]  # the image object itself, not a copy


def test_multiple_images_go_in_order_before_the_first_user_text_only(images):
    messages = [
        {"role": "user", "content": "Compare them."},
        {"role": "assistant", "content": "The first is red."},
        {"role": "user", "content": "And the others?"},
    ]
    out = prepare_multimodal_messages(messages, images)
    first = out[0]["content"]
    assert [block["type"] for block in first] == ["image", "image", "image", "text"]
    assert [block["image"] for block in first[:3]] == images
    assert out[2]["content"] == [_text("And the others?")]


def test_no_images_only_structures_text():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert prepare_multimodal_messages(messages) == prepare_multimodal_messages(messages, [])
    assert prepare_multimodal_messages(messages) == [
        {"role": "user", "content": [_text("Hi")]},
        {"role": "assistant", "content": [_text("Hello")]},
    ]


def test_tool_turns_and_tool_calls():
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    messages = [
        {"role": "user", "content": "Add 1 and 2."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "name": "add", "content": "3"},
        {"role": "assistant", "content": "It is 3."},
    ]
    out = prepare_multimodal_messages(messages, ["img"])
    assert out[0]["content"] == [{"type": "image", "image": "img"}, _text("Add 1 and 2.")]
    assert out[1] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert out[1]["tool_calls"] is not messages[1]["tool_calls"]  # copied, so callers may edit the result freely
    assert out[2] == {"role": "tool", "name": "add", "content": [_text("3")]}
    assert out[3]["content"] == [_text("It is 3.")]


def test_structured_contents_only_get_their_placeholders_filled(images):
    messages = [
        {"role": "system", "content": [_text("Be brief.")]},
        {"role": "user", "content": [{"type": "image"}, _text("Describe."), {"type": "image"}]},
        {"role": "assistant", "content": [_text("Two squares.")]},
    ]
    out = prepare_multimodal_messages(messages, images[:2])
    assert out[1]["content"] == [
        {"type": "image", "image": images[0]},
        _text("Describe."),
        {"type": "image", "image": images[1]},
    ]
    assert out[0] == messages[0] and out[2] == messages[2]


def test_filled_placeholders_are_kept_and_arrow_none_counts_as_unfilled(images):
    # datasets stores content blocks as Arrow structs: every block carries every key, missing ones as None
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": images[0], "text": None},
                {"type": "image", "image": None, "text": None},
                {"type": "text", "image": None, "text": "Same color?"},
            ],
        }
    ]
    out = prepare_multimodal_messages(messages, [images[1]])
    assert [block["image"] for block in out[0]["content"][:2]] == [images[0], images[1]]
    assert prepare_multimodal_messages(out) == out  # all filled: nothing to do without images


def test_mixed_string_and_structured_user_turns(images):
    # placeholders go into the first user message whose content is a string, here the second user turn
    messages = [
        {"role": "user", "content": [_text("Hello.")]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Look at this."},
    ]
    out = prepare_multimodal_messages(messages, images[:1])
    assert out[0]["content"] == [_text("Hello.")]
    assert out[2]["content"] == [{"type": "image", "image": images[0]}, _text("Look at this.")]


def test_input_is_never_mutated(images):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "image"}, _text("And this?")]},
    ]
    before = copy.deepcopy(messages)
    out = prepare_multimodal_messages(messages, images[1:2])
    assert messages == before
    assert out[1]["content"] is not messages[1]["content"]
    vllm = prepare_multimodal_messages_vllm(out)
    assert out[1]["content"][0] == {"type": "image", "image": images[1]}
    assert vllm[1]["content"][0] == {"type": "image_pil", "image_pil": images[1]}


def test_count_mismatch_names_both_counts(images):
    with pytest.raises(ValueError, match=r"Got 2 image\(s\) but the messages have 1 image placeholder\(s\)"):
        prepare_multimodal_messages([{"role": "user", "content": [{"type": "image"}, _text("x")]}], images[:2])
    with pytest.raises(ValueError, match=r"Got 0 image\(s\) but the messages have 1 image placeholder"):
        prepare_multimodal_messages([{"role": "user", "content": [{"type": "image"}]}])
    # no user message with string content: nothing is inserted, so the images have no place to go
    with pytest.raises(ValueError, match=r"Got 1 image\(s\) but the messages have 0"):
        prepare_multimodal_messages([{"role": "assistant", "content": "x"}], images[:1])
    # placeholders inserted for the images come on top of unfilled ones already in the messages
    mixed = [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "image"}]}]
    with pytest.raises(ValueError, match=r"Got 1 image\(s\) but the messages have 2"):
        prepare_multimodal_messages(mixed, images[:1])


def test_invalid_messages_and_images():
    with pytest.raises(ValueError, match=r"messages\[1\] has invalid role 'human'; expected one of system, user"):
        prepare_multimodal_messages([{"role": "user", "content": "a"}, {"role": "human", "content": "b"}])
    with pytest.raises(ValueError, match=r"messages\[0\] \(role 'user'\) has no 'content' key"):
        prepare_multimodal_messages([{"role": "user"}])
    with pytest.raises(TypeError, match=r"messages\[0\] must be a dict"):
        prepare_multimodal_messages(["hello"])
    with pytest.raises(TypeError, match=r"wrap a single image as \[image\]"):
        prepare_multimodal_messages([{"role": "user", "content": "a"}], Image.new("RGB", (1, 1)))


def test_vllm_variant_renames_image_blocks_only(images):
    messages = prepare_multimodal_messages(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "Describe both."}], images[:2]
    )
    out = prepare_multimodal_messages_vllm(messages)
    assert out == [
        {"role": "system", "content": [_text("s")]},
        {
            "role": "user",
            "content": [
                {"type": "image_pil", "image_pil": images[0]},
                {"type": "image_pil", "image_pil": images[1]},
                _text("Describe both."),
            ],
        },
    ]
    assert messages[1]["content"][0] == {"type": "image", "image": images[0]}  # input untouched
    plain = [{"role": "user", "content": "no blocks"}, {"role": "assistant", "content": None}]
    assert prepare_multimodal_messages_vllm(plain) == plain


def test_vllm_variant_rejects_unfilled_placeholders():
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\] is an image placeholder without an image"):
        prepare_multimodal_messages_vllm([{"role": "user", "content": [_text("x"), {"type": "image"}]}])
