"""DataCollatorForVisionLanguageModeling on the offline tiny LLaVA processor: labels masking (padding, image tokens,
prompt), padding and truncation, row formats, and the errors for rows it cannot collate."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from posttrain.data.vision_collators import DataCollatorForVisionLanguageModeling
from posttrain.models.tiny import build_tiny_vlm

IMAGE_ID = 266  # "<image>" in the tiny VLM tokenizer
PAD_ID = 259
N_IMAGE_TOKENS = 4  # (16 / 8)² patches per image


@pytest.fixture(scope="module")
def processor():
    return build_tiny_vlm()[1]


def image(color=(255, 0, 0), size=(20, 30)) -> Image.Image:
    return Image.new("RGB", size, color)


def lm_row(question: str, answer: str, images=None, column="images") -> dict:
    row = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    row[column] = [image()] if images is None else images
    return row


def pc_row(question: str, answer: str) -> dict:
    return {
        "images": [image()],
        "prompt": [{"role": "user", "content": question}],
        "completion": [{"role": "assistant", "content": answer}],
    }


def decode_labels(processor, labels: torch.Tensor) -> str:
    return processor.tokenizer.decode([t for t in labels.tolist() if t != -100])


def test_language_modeling_labels_mask_padding_and_image_tokens(processor):
    batch = DataCollatorForVisionLanguageModeling(processor)([lm_row("hi", "yo"), lm_row("hello there", "ok")])
    assert set(batch) == {"input_ids", "attention_mask", "labels", "pixel_values"}
    assert batch["pixel_values"].shape == (2, 3, 16, 16)
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    assert ids.shape == mask.shape == labels.shape
    # each row holds its image's tokens; they and the padding are never trained on
    assert ((ids == IMAGE_ID).sum(1) == N_IMAGE_TOKENS).all()
    assert (labels[ids == IMAGE_ID] == -100).all()
    assert (labels[mask == 0] == -100).all() and (ids[mask == 0] == PAD_ID).all()
    keep = (mask == 1) & (ids != IMAGE_ID)
    assert torch.equal(labels[keep], ids[keep])
    # right padding: the shorter row ends in padding
    assert mask[0, -1] == 0 and mask[1].all()
    text = processor.tokenizer.decode(ids[0][mask[0] == 1])
    assert (
        text
        == "<|im_start|>user\n" + "<image>" * N_IMAGE_TOKENS + "hi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )


def test_single_image_column_and_input_not_mutated(processor):
    row = lm_row("hi", "yo", images=image(), column="image")
    before = repr(row["messages"])
    batch = DataCollatorForVisionLanguageModeling(processor)([row])
    assert (batch["input_ids"] == IMAGE_ID).sum() == N_IMAGE_TOKENS
    assert repr(row["messages"]) == before


def test_two_images_in_one_row(processor):
    row = lm_row("compare", "same", images=[image(), image((0, 0, 255))])
    batch = DataCollatorForVisionLanguageModeling(processor)([row])
    assert batch["pixel_values"].shape[0] == 2
    assert (batch["input_ids"] == IMAGE_ID).sum() == 2 * N_IMAGE_TOKENS


def test_text_only_rows_in_a_vision_batch(processor):
    batch = DataCollatorForVisionLanguageModeling(processor)([lm_row("hi", "yo"), lm_row("no image", "ok", images=[])])
    assert batch["pixel_values"].shape[0] == 1
    assert (batch["input_ids"][1] == IMAGE_ID).sum() == 0
    no_images = DataCollatorForVisionLanguageModeling(processor)([lm_row("a", "b", images=[])])
    assert "pixel_values" not in no_images


@pytest.mark.parametrize("completion_only_loss", [True, False])
def test_prompt_completion(processor, completion_only_loss):
    collator = DataCollatorForVisionLanguageModeling(processor, completion_only_loss=completion_only_loss)
    batch = collator([pc_row("hi", "yo"), pc_row("hello", "yes sir")])
    ids, labels = batch["input_ids"], batch["labels"]
    # prompt and completion are joined without padding between them (padding only at the end)
    full = processor.tokenizer.decode(ids[1][batch["attention_mask"][1] == 1])
    assert full.endswith("<|im_start|>assistant\nyes sir<|im_end|>\n")
    assert (labels[ids == IMAGE_ID] == -100).all()
    if completion_only_loss:
        assert decode_labels(processor, labels[0]) == "yo<|im_end|>\n"
        assert decode_labels(processor, labels[1]) == "yes sir<|im_end|>\n"
    else:
        assert decode_labels(processor, labels[1]).startswith("<|im_start|>user\nhello")


def test_completion_only_loss_on_language_modeling_rows_raises_as_trl(processor):
    with pytest.raises(ValueError, match=r"^The `completion_only_loss` argument is not supported for language mod"):
        DataCollatorForVisionLanguageModeling(processor, completion_only_loss=True)([lm_row("hi", "yo")])
    batch = DataCollatorForVisionLanguageModeling(processor)([lm_row("hi", "yo")])
    assert decode_labels(processor, batch["labels"][0]).startswith("<|im_start|>user\nhi")


# the tiny VLM's template with {% generation %} around the assistant turns
GENERATION_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['role'] == 'assistant' %}"
    "{% generation %}{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for block in "
    "message['content'] %}{% if block['type'] == 'text' %}{{ block['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>{% endgeneration %}\n{% else %}{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for block in message['content'] %}{% if block['type'] == 'image' %}<image>{% elif block['type'] == 'text' %}"
    "{{ block['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endif %}{% endfor %}"
)


def test_assistant_only_loss_and_chat_template(processor):
    """TRL's fields (in TRL's order): labels only on the assistant turns, rendered with the given template."""
    collator = DataCollatorForVisionLanguageModeling(
        processor, None, False, None, "text", True, GENERATION_TEMPLATE
    )  # positional, as TRL's dataclass
    assert collator.assistant_only_loss and collator.chat_template == GENERATION_TEMPLATE
    batch = collator([lm_row("What?", "Red."), lm_row("Color of this long one?", "Blue sky.")])
    assert decode_labels(processor, batch["labels"][0]) == "Red.<|im_end|>"
    assert decode_labels(processor, batch["labels"][1]) == "Blue sky.<|im_end|>"
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()
    truncated = DataCollatorForVisionLanguageModeling(
        processor, max_length=30, assistant_only_loss=True, chat_template=GENERATION_TEMPLATE
    )([lm_row("What?", "Red.")])
    assert decode_labels(processor, truncated["labels"][0]) == "Re"  # the assistant tokens inside max_length
    with pytest.raises(ValueError, match=r"^The `assistant_only_loss` argument is only supported for conversational"):
        DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True)([pc_row("hi", "yo")])
    with pytest.raises(ValueError, match=r"needs a chat template with `\{% generation %\}`"):
        DataCollatorForVisionLanguageModeling(processor, assistant_only_loss=True)([lm_row("hi", "yo")])


def test_vision_preference_fields_in_trl_order(processor):
    from posttrain.data.vision_collators import DataCollatorForVisionPreference

    collator = DataCollatorForVisionPreference(processor, 64, 8)  # TRL: (processor, max_length, pad_to_multiple_of)
    assert (collator.max_length, collator.pad_to_multiple_of, collator.max_prompt_length) == (64, 8, None)


def test_standard_text_rows(processor):
    rows = [{"images": [image()], "text": "<image>A red square."}, {"images": [image()], "caption": "<image>Red."}]
    batch = DataCollatorForVisionLanguageModeling(processor)(rows[:1])
    assert processor.tokenizer.decode(batch["labels"][0][batch["labels"][0] != -100]) == "A red square."
    batch = DataCollatorForVisionLanguageModeling(processor, dataset_text_field="caption")(rows[1:])
    assert (batch["input_ids"] == IMAGE_ID).sum() == N_IMAGE_TOKENS


def test_pad_to_multiple_of(processor):
    batch = DataCollatorForVisionLanguageModeling(processor, pad_to_multiple_of=16)([lm_row("hi", "yo")])
    length = batch["input_ids"].shape[1]
    assert length % 16 == 0
    assert batch["labels"].shape[1] == batch["attention_mask"].shape[1] == length
    assert batch["input_ids"][0, -1] == PAD_ID and batch["labels"][0, -1] == -100


def test_truncation_keeps_images(processor):
    full = DataCollatorForVisionLanguageModeling(processor)([lm_row("hi", "a long answer")])
    cut = DataCollatorForVisionLanguageModeling(processor, max_length=14)([lm_row("hi", "a long answer")])
    assert full["input_ids"].shape[1] > 14 and cut["input_ids"].shape[1] == 14
    assert torch.equal(cut["input_ids"][0], full["input_ids"][0, :14])
    assert (cut["input_ids"] == IMAGE_ID).sum() == N_IMAGE_TOKENS


def test_truncation_through_image_tokens_raises(processor):
    collator = DataCollatorForVisionLanguageModeling(processor, max_length=8)
    with pytest.raises(
        ValueError, match=r"Row 1: truncating to max_length=8 would cut .*Raise max_length to at least"
    ):
        collator([lm_row("", "x", images=[]), lm_row("hi", "yo")])


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, r"Row 0 has no 'images' or 'image' column"),
        ({"image": None, "messages": [{"role": "user", "content": "hi"}]}, r"Row 0: column 'image' is None"),
        ({"images": image(), "messages": [{"role": "user", "content": "hi"}]}, r"Row 0: column 'images' must be a"),
        ({"images": [image()], "question": "hi"}, r"Row 0 has no text .*'messages', 'prompt' \+ 'completion'"),
        ({"images": [image()], "messages": []}, r"Row 0: column 'messages' is empty"),
        ({"images": [image()], "text": "no placeholder"}, r"processor failed on rows 0-0"),
    ],
)
def test_bad_rows_raise(processor, row, match):
    with pytest.raises(ValueError, match=match):
        DataCollatorForVisionLanguageModeling(processor)([row])


def test_mixed_formats_and_options_raise(processor):
    with pytest.raises(ValueError, match=r"mixes row formats .*rows 0 and 1"):
        DataCollatorForVisionLanguageModeling(processor)([lm_row("a", "b"), pc_row("a", "b")])
    with pytest.raises(ValueError, match="return_tensors='np'"):
        DataCollatorForVisionLanguageModeling(processor, return_tensors="np")
    with pytest.raises(ValueError, match="Cannot collate an empty batch"):
        DataCollatorForVisionLanguageModeling(processor)([])


def test_batch_runs_through_the_tiny_vlm():
    model, processor = build_tiny_vlm()
    batch = DataCollatorForVisionLanguageModeling(processor)([lm_row("hi", "yo"), lm_row("what is it", "red")])
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
    assert out.logits.shape[:2] == batch["input_ids"].shape
    assert torch.isfinite(out.logits).all()


# -- DataCollatorForVisionPreference -------------------------------------------------------------------------------


def pref_row(question: str, chosen: str, rejected: str) -> dict:
    return {
        "images": [image()],
        "prompt": [{"role": "user", "content": question}],
        "chosen": [{"role": "assistant", "content": chosen}],
        "rejected": [{"role": "assistant", "content": rejected}],
    }


def test_preference_batch_stacks_chosen_then_rejected(processor):
    from posttrain.data.vision_collators import DataCollatorForVisionPreference

    rows = [pref_row("Color?", "red", "blue, I think"), pref_row("What is it?", "a square", "no")]
    batch = DataCollatorForVisionPreference(processor)(rows)
    assert set(batch) == {"input_ids", "attention_mask", "completion_mask", "pixel_values"}
    assert batch["input_ids"].shape[0] == 4 and batch["pixel_values"].shape[0] == 4  # images repeated per half
    assert torch.equal(batch["pixel_values"][:2], batch["pixel_values"][2:])
    tok = processor.tokenizer
    completions = [tok.decode(batch["input_ids"][i][batch["completion_mask"][i].bool()]) for i in range(4)]
    assert completions == ["red<|im_end|>\n", "a square<|im_end|>\n", "blue, I think<|im_end|>\n", "no<|im_end|>\n"]
    assert ((batch["input_ids"] == IMAGE_ID).sum(dim=1) == N_IMAGE_TOKENS).all()
    assert not batch["completion_mask"][batch["input_ids"] == IMAGE_ID].any()
    assert (batch["input_ids"][batch["attention_mask"] == 0] == PAD_ID).all()
    assert (batch["completion_mask"] <= batch["attention_mask"]).all()


def test_preference_implicit_prompt_and_single_image_column(processor):
    from posttrain.data.vision_collators import DataCollatorForVisionPreference

    user = {"role": "user", "content": "Color?"}
    implicit = {
        "image": image(),
        "chosen": [user, {"role": "assistant", "content": "red"}],
        "rejected": [user, {"role": "assistant", "content": "blue"}],
    }
    explicit = pref_row("Color?", "red", "blue")
    a = DataCollatorForVisionPreference(processor)([implicit])
    b = DataCollatorForVisionPreference(processor)([explicit])
    for key in ("input_ids", "attention_mask", "completion_mask"):
        assert torch.equal(a[key], b[key])


def test_preference_standard_rows_get_eos_and_truncation_limits(processor):
    from posttrain.data.vision_collators import DataCollatorForVisionPreference

    row = {"images": [image()], "prompt": "<image>Color? ", "chosen": "red and more", "rejected": "blue"}
    batch = DataCollatorForVisionPreference(processor, pad_to_multiple_of=8)([row])
    assert batch["input_ids"].shape[1] % 8 == 0
    rejected = batch["input_ids"][1][batch["completion_mask"][1].bool()]
    assert processor.tokenizer.decode(rejected) == "blue" + processor.tokenizer.eos_token
    capped = DataCollatorForVisionPreference(processor, max_completion_length=3)([row])
    assert capped["completion_mask"].sum(dim=1).tolist() == [3, 3]
    prompt_len = int((batch["attention_mask"][0] - batch["completion_mask"][0]).sum())
    short = DataCollatorForVisionPreference(processor, max_length=prompt_len + 2)([row])
    assert int(short["completion_mask"][0].sum()) == 2 and short["input_ids"].shape[1] == prompt_len + 2


def test_preference_truncation_never_cuts_image_tokens(processor):
    from posttrain.data.vision_collators import DataCollatorForVisionPreference

    row = pref_row("Color?", "red", "blue")
    with pytest.raises(ValueError, match=r"Row 0: truncating to max_length=3 would cut .* image tokens"):
        DataCollatorForVisionPreference(processor, max_length=3)([row])
    with pytest.raises(ValueError, match=r"Row 0: truncating the prompt to max_prompt_length=2 .*image tokens"):
        DataCollatorForVisionPreference(processor, max_prompt_length=2)([row])


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"prompt": [{"role": "user", "content": "x"}], "chosen": [], "rejected": []}, r"Row 1 has no 'images'"),
        ({**pref_row("q", "a", "b"), "rejected": None}, r"Row 1: column 'rejected' is missing or None"),
        ({**pref_row("q", "a", "b"), "rejected": "b"}, r"Row 1: 'prompt' and 'rejected' must both be strings"),
    ],
)
def test_preference_errors_name_row_and_column(processor, row, needle):
    from posttrain.data.vision_collators import DataCollatorForVisionPreference

    with pytest.raises(ValueError, match=needle):
        DataCollatorForVisionPreference(processor)([pref_row("ok", "a", "b"), row])


def test_preference_batch_runs_through_the_model():
    from posttrain.data.vision_collators import DataCollatorForVisionPreference

    model, processor = build_tiny_vlm()
    batch = DataCollatorForVisionPreference(processor)([pref_row("hi", "yo", "no"), pref_row("Color?", "red", "x")])
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k != "completion_mask"})
    assert out.logits.shape[:2] == batch["input_ids"].shape


# -- DataCollatorForVisionUnpairedPreference -----------------------------------------------------------------------


def unpaired_row(question: str, completion: str, label: bool, color=(255, 0, 0)) -> dict:
    return {
        "images": [image(color)],
        "prompt": [{"role": "user", "content": question}],
        "completion": [{"role": "assistant", "content": completion}],
        "label": label,
    }


def test_unpaired_batch_has_the_text_collator_keys_plus_images(processor):
    from posttrain.data.vision_collators import DataCollatorForVisionUnpairedPreference

    rows = [unpaired_row("Color?", "red", True), unpaired_row("What is it?", "a big square", False, (0, 0, 255))]
    batch = DataCollatorForVisionUnpairedPreference(processor)(rows)
    per_token = {"input_ids", "attention_mask", "completion_mask"}
    assert set(batch) == per_token | {f"KL_{k}" for k in per_token} | {"label", "pixel_values"}
    assert batch["label"].tolist() == [True, False] and batch["label"].dtype == torch.bool
    assert batch["pixel_values"].shape[0] == 2  # one set of images, shared by the rows and their KL rows
    tok = processor.tokenizer

    def pieces(prefix: str, i: int) -> tuple[str, str]:
        ids, mask = batch[f"{prefix}input_ids"][i], batch[f"{prefix}completion_mask"][i].bool()
        prompt = ids[batch[f"{prefix}attention_mask"][i].bool() & ~mask]
        return tok.decode(prompt), tok.decode(ids[mask])

    assert [pieces("", i)[1] for i in range(2)] == ["red<|im_end|>\n", "a big square<|im_end|>\n"]
    # KL rows: each prompt (with its image tokens) followed by the previous row's completion
    assert [pieces("KL_", i)[1] for i in range(2)] == ["a big square<|im_end|>\n", "red<|im_end|>\n"]
    assert [pieces("KL_", i)[0] for i in range(2)] == [pieces("", i)[0] for i in range(2)]
    for prefix in ("", "KL_"):
        ids = batch[f"{prefix}input_ids"]
        assert ((ids == IMAGE_ID).sum(dim=1) == N_IMAGE_TOKENS).all()
        assert not batch[f"{prefix}completion_mask"][ids == IMAGE_ID].any()
        assert (ids[batch[f"{prefix}attention_mask"] == 0] == PAD_ID).all()


def test_unpaired_without_kl_standard_rows_and_limits(processor):
    from posttrain.data.vision_collators import DataCollatorForVisionUnpairedPreference

    row = {"image": image(), "prompt": "<image>Color? ", "completion": "red and more", "label": 0}
    batch = DataCollatorForVisionUnpairedPreference(processor, calculate_kl=False, pad_to_multiple_of=8)([row])
    assert not any(k.startswith("KL_") for k in batch) and batch["label"].tolist() == [False]
    assert batch["input_ids"].shape[1] % 8 == 0
    completion = batch["input_ids"][0][batch["completion_mask"][0].bool()]
    assert processor.tokenizer.decode(completion) == "red and more" + processor.tokenizer.eos_token  # EOS appended
    prompt_len = int((batch["attention_mask"][0] - batch["completion_mask"][0]).sum())
    short = DataCollatorForVisionUnpairedPreference(processor, max_length=prompt_len + 2)([row, row])
    assert short["completion_mask"].sum(dim=1).tolist() == [2, 2]
    assert short["KL_completion_mask"].sum(dim=1).tolist() == [2, 2]
    with pytest.raises(ValueError, match=r"Row 0: truncating to max_length=3 would cut .* image tokens"):
        DataCollatorForVisionUnpairedPreference(processor, max_length=3)([row])
    with pytest.raises(ValueError, match=r"Row 0: its prompt .* fills max_length"):
        DataCollatorForVisionUnpairedPreference(processor, max_length=prompt_len)([row])


def test_unpaired_passes_precomputed_reference_logps(processor):
    from posttrain.data.vision_collators import DataCollatorForVisionUnpairedPreference

    rows = [{**unpaired_row("q", "a", True), "ref_logps": -1.5, "ref_KL_logps": -2.0}] * 2
    batch = DataCollatorForVisionUnpairedPreference(processor)(rows)
    assert batch["ref_logps"].tolist() == [-1.5, -1.5] and batch["ref_KL_logps"].tolist() == [-2.0, -2.0]


@pytest.mark.parametrize(
    ("row", "needle"),
    [
        ({"prompt": [{"role": "user", "content": "x"}], "completion": [], "label": True}, r"Row 1 has no 'images'"),
        ({**unpaired_row("q", "a", True), "label": None}, r"Row 1: column 'label' must be a bool"),
        ({**unpaired_row("q", "a", True), "completion": None}, r"Row 1: column 'completion' is missing or empty"),
        ({**unpaired_row("q", "a", True), "completion": "a"}, r"Row 1: 'prompt' and 'completion' must both be"),
    ],
)
def test_unpaired_errors_name_row_and_column(processor, row, needle):
    from posttrain.data.vision_collators import DataCollatorForVisionUnpairedPreference

    with pytest.raises(ValueError, match=needle):
        DataCollatorForVisionUnpairedPreference(processor)([unpaired_row("ok", "a", True), row])


def test_unpaired_batch_runs_through_the_model():
    from posttrain.data.vision_collators import DataCollatorForVisionUnpairedPreference

    model, processor = build_tiny_vlm()
    batch = DataCollatorForVisionUnpairedPreference(processor)(
        [unpaired_row("hi", "yo", True), unpaired_row("C?", "x", 0)]
    )
    images = {k: v for k, v in batch.items() if k == "pixel_values"}
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **images)
        kl = model(input_ids=batch["KL_input_ids"], attention_mask=batch["KL_attention_mask"], **images)
    assert out.logits.shape[:2] == batch["input_ids"].shape and kl.logits.shape[:2] == batch["KL_input_ids"].shape
