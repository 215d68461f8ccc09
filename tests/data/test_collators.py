"""Collators and pad (posttrain.data.collators), incl. padding-free ≡ padded loss on the tiny model."""

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.data.collators import (
    DataCollatorForLanguageModeling,
    DataCollatorForPreference,
    DataCollatorForRewardPreference,
    DataCollatorForUnpairedPreference,
    block_diagonal_causal_mask,
    pad,
)
from posttrain.data.packing import pack_dataset
from posttrain.models.tiny import build_tiny_model

PAD = 259
SETTINGS = settings(max_examples=30, deadline=None)
sequences = st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=10), min_size=1, max_size=5)


# ---------------------------------------------------------------------------------------------------- pad


def test_pad_right_left_and_multiple():
    a, b = torch.tensor([1, 2, 3]), torch.tensor([4, 5])
    assert pad([a, b]).tolist() == [[1, 2, 3], [4, 5, 0]]
    assert pad([a, b], padding_value=9, padding_side="left").tolist() == [[1, 2, 3], [9, 4, 5]]
    assert pad([a, b], pad_to_multiple_of=4).tolist() == [[1, 2, 3, 0], [4, 5, 0, 0]]
    two_d = pad([torch.ones(2, 3), torch.ones(1, 2)], padding_value=-1.0)
    assert two_d.shape == (2, 2, 3) and two_d[1].tolist() == [[1, 1, -1], [-1, -1, -1]]
    with pytest.raises(ValueError, match="at least one"):
        pad([])
    with pytest.raises(ValueError, match="padding_side"):
        pad([a], padding_side="middle")


def test_block_diagonal_causal_mask():
    mask = block_diagonal_causal_mask(torch.tensor([[0, 0, 1, 1, 1, -1]]))
    assert mask.shape == (1, 1, 6, 6) and mask.dtype == torch.bool
    expected = [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert mask[0, 0].int().tolist() == expected
    additive = block_diagonal_causal_mask(torch.tensor([[0, 1]]), dtype=torch.float32)
    assert additive[0, 0].tolist() == [[0.0, torch.finfo(torch.float32).min], [torch.finfo(torch.float32).min, 0.0]]


# ------------------------------------------------------------------------------------ language modeling

# The options posttrain's SFT trainer sets (its defaults reproduce TRL's output, tested against TRL itself in
# tests/compat/test_trl_collator_fixture.py): masks folded into labels, position ids, block-diagonal masks.
TRAINER_OPTIONS = dict(completion_only_loss=True, assistant_only_loss=True, return_position_ids=True,
                       block_diagonal_mask=True)  # fmt: skip


def LM(*args, **kwargs):
    return DataCollatorForLanguageModeling(*args, **{**TRAINER_OPTIONS, **kwargs})


def test_lm_collator_defaults_are_trls():
    """Without posttrain's options, masks are ignored and packed rows get a plain 2-D mask (TRL's output)."""
    ex = [{"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1], "assistant_masks": [0, 0, 1], "seq_lengths": [1, 2]}]
    out = DataCollatorForLanguageModeling(PAD)(ex)
    assert list(out) == ["input_ids", "labels", "attention_mask"]
    assert out["labels"].tolist() == [[1, 2, 3]] and out["attention_mask"].tolist() == [[1, 1, 1]]
    free = DataCollatorForLanguageModeling(PAD, padding_free=True)(ex + ex)
    assert free["cu_seq_lens_q"].tolist() == [0, 1, 3, 4, 6] and free["max_length_q"] == 2
    assert free["seq_idx"].tolist() == [[0, 1, 1, 2, 3, 3]] and "attention_mask" not in free
    assert DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths([[1, 2]])[0].tolist() == [0, 0, 1]
    with pytest.raises(ValueError, match="return_tensors='pt'"):
        DataCollatorForLanguageModeling(PAD)(ex, return_tensors="np")


@SETTINGS
@given(sequences, st.data())
def test_lm_collator_padded(seqs, data):
    masks = [data.draw(st.lists(st.integers(0, 1), min_size=len(s), max_size=len(s))) for s in seqs]
    examples = [{"input_ids": s, "completion_mask": m} for s, m in zip(seqs, masks)]
    out = LM(PAD, pad_to_multiple_of=4)(examples)
    length = max(map(len, seqs))
    assert out["input_ids"].shape == (len(seqs), -(-length // 4) * 4)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        n = len(s)
        assert out["input_ids"][i, :n].tolist() == s and set(out["input_ids"][i, n:].tolist()) <= {PAD}
        assert out["attention_mask"][i].tolist() == [1] * n + [0] * (out["input_ids"].shape[1] - n)
        assert out["labels"][i, :n].tolist() == [t if k else -100 for t, k in zip(s, m)]
        assert set(out["labels"][i, n:].tolist()) <= {-100}
        assert out["position_ids"][i, :n].tolist() == list(range(n))
    # completion_only_loss=False ignores completion_mask
    plain = LM(PAD, completion_only_loss=False)(examples)
    assert all(plain["labels"][i, : len(s)].tolist() == s for i, s in enumerate(seqs))


@SETTINGS
@given(sequences)
def test_lm_collator_padding_free(seqs):
    out = LM(PAD, padding_free=True)([{"input_ids": s} for s in seqs])
    total = sum(map(len, seqs))
    assert out["input_ids"].shape == (1, total)
    assert out["input_ids"][0].tolist() == [t for s in seqs for t in s]
    starts = [sum(map(len, seqs[:i])) for i in range(len(seqs))]
    positions = out["position_ids"][0].tolist()
    assert [i for i, p in enumerate(positions) if p == 0] == starts
    labels = out["labels"][0].tolist()
    assert [i for i, t in enumerate(labels) if t == -100] == starts  # first token of every sequence
    mask = out["attention_mask"]
    assert mask.shape == (1, 1, total, total)
    seg = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor([len(s) for s in seqs]))
    expected = (seg[:, None] == seg[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], expected)


def test_lm_collator_labels_column_assistant_masks_and_flash_mode():
    ex = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "completion_mask": [0, 0, 0]}]
    assert LM(PAD)(ex)["labels"].tolist() == [[-100, 2, 3]]  # labels kept as given
    ex = [{"input_ids": [1, 2, 3, 4], "assistant_masks": [0, 1, 1, 0]}]
    assert LM(PAD)(ex)["labels"].tolist() == [[-100, 2, 3, -100]]
    out = LM(PAD, padding_free=True, block_diagonal_mask=False)(ex + ex)
    assert "attention_mask" not in out and out["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]
    out = LM(PAD, return_position_ids=False)(ex)
    assert "position_ids" not in out
    with pytest.raises(ValueError, match="seq_lengths sum to 3"):
        LM(PAD)([{"input_ids": [1, 2], "seq_lengths": [3]}])


def test_lm_collator_packed_rows_padded():
    ex = [{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]}, {"input_ids": [6, 7], "seq_lengths": [2]}]
    out = LM(PAD)(ex)
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 0, 0, 0]]
    assert out["labels"].tolist() == [[-100, 2, -100, 4, 5], [-100, 7, -100, -100, -100]]
    mask = out["attention_mask"]
    assert mask.shape == (2, 1, 5, 5)
    assert mask[0, 0, 3].tolist() == [False, False, True, True, False]  # token 4 sees only its own document
    assert mask[1, 0, 4].tolist() == [False, False, True, True, True]  # padding attends to padding only


# --------------------------------------------------------------------------- padding-free ≡ padded on a model


def token_losses(model, batch):
    kwargs = {k: v for k, v in batch.items() if k in ("attention_mask", "position_ids")}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], **kwargs).logits.float()
    labels = batch["labels"][:, 1:]
    losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return losses[labels != -100]  # row-major order = the padding-free order


def lm_examples():
    g = torch.Generator().manual_seed(0)
    lengths, examples = [5, 11, 3, 8], []
    for n in lengths:
        ids = torch.randint(0, 256, (n,), generator=g).tolist()
        examples.append({"input_ids": ids, "completion_mask": [0] * (n // 2) + [1] * (n - n // 2)})
    return examples


@pytest.mark.parametrize(
    "attn, mask_kwargs",
    [("sdpa", {}), ("eager", {"mask_dtype": torch.float32}), ("sdpa", {"block_diagonal_mask": False})],
)
@pytest.mark.invariance
def test_padding_free_loss_equals_padded_loss(attn, mask_kwargs):
    model = build_tiny_model("qwen2").eval()
    model.set_attn_implementation(attn)
    examples = lm_examples()
    padded = token_losses(model, LM(PAD)(examples))
    free = LM(PAD, padding_free=True, **mask_kwargs)(examples)
    if "attention_mask" not in free:
        # position_ids alone separate sequences only when transformers builds no KV cache
        kwargs = {"position_ids": free["position_ids"], "use_cache": False}
        with torch.no_grad():
            logits = model(input_ids=free["input_ids"], **kwargs).logits.float()
        labels = free["labels"][:, 1:]
        losses = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels, reduction="none")[labels != -100]
    else:
        losses = token_losses(model, free)
    assert losses.shape == padded.shape and padded.numel() > 0
    torch.testing.assert_close(losses, padded, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(losses.mean(), padded.mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.invariance
def test_packed_dataset_loss_equals_padded_loss():
    model = build_tiny_model("llama").eval()
    examples = [{"input_ids": ex["input_ids"], "labels": ex["input_ids"]} for ex in lm_examples()]
    packed = pack_dataset(Dataset.from_list(examples), 16, "bfd")
    rows = [packed[i] for i in range(len(packed))]
    free = token_losses(model, LM(PAD, padding_free=True)(rows))
    padded_rows = token_losses(model, LM(PAD)(rows))
    # unpacked reference, in the packed documents' order
    docs = []
    for row in rows:
        start = 0
        for n in row["seq_lengths"]:
            docs.append({"input_ids": row["input_ids"][start : start + n]})
            start += n
    reference = token_losses(model, LM(PAD)(docs))
    torch.testing.assert_close(free, reference, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(padded_rows, reference, rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------------------------- preference collators


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(1, 6), st.integers(1, 6)), min_size=1, max_size=4))
def test_preference_collator(sizes):
    examples = [
        {
            "prompt_ids": [1] * p,
            "chosen_ids": [2] * c,
            "rejected_ids": [3] * r,
            "ref_chosen_logps": -1.0 * i,
            "ref_rejected_logps": -2.0,
        }
        for i, (p, c, r) in enumerate(sizes)
    ]
    out = DataCollatorForPreference(PAD)(examples)
    b = len(sizes)
    assert out["input_ids"].shape[0] == 2 * b
    for i, (p, c, r) in enumerate(sizes):
        for row, key, n in ((i, 2, c), (b + i, 3, r)):
            assert out["input_ids"][row, : p + n].tolist() == [1] * p + [key] * n
            assert out["attention_mask"][row].sum() == p + n
            assert out["completion_mask"][row].tolist()[: p + n] == [0] * p + [1] * n
            assert out["completion_mask"][row].sum() == n
    assert out["ref_chosen_logps"].tolist() == [-1.0 * i for i in range(b)]
    assert out["ref_rejected_logps"].shape == (b,)


def test_preference_collator_truncation_and_multiple():
    ex = [{"prompt_ids": [1, 1, 1], "chosen_ids": [2, 2, 2], "rejected_ids": [3]}]
    out = DataCollatorForPreference(PAD, max_length=4, pad_to_multiple_of=8)(ex)
    assert out["input_ids"].tolist() == [[1, 1, 1, 2] + [PAD] * 4, [1, 1, 1, 3] + [PAD] * 4]
    assert out["completion_mask"].tolist() == [[0, 0, 0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0]]
    keep_end = DataCollatorForPreference(PAD, max_length=4, truncation_mode="keep_end")(ex)
    assert keep_end["input_ids"][0].tolist() == [1, 2, 2, 2]


def test_unpaired_collator_with_kl():
    ex = [
        {
            "prompt_ids": [1],
            "completion_ids": [2, 2],
            "label": True,
            "KL_completion_ids": [3],
            "ref_logps": -1.0,
            "ref_KL_logps": -3.0,
        },
        {
            "prompt_ids": [1, 1],
            "completion_ids": [3],
            "label": False,
            "KL_completion_ids": [2, 2],
            "ref_logps": -2.0,
            "ref_KL_logps": -4.0,
        },
    ]
    out = DataCollatorForUnpairedPreference(PAD)(ex)
    assert out["input_ids"].tolist() == [[1, 2, 2], [1, 1, 3]]
    assert out["completion_mask"].tolist() == [[0, 1, 1], [0, 0, 1]]
    assert out["label"].tolist() == [True, False] and out["label"].dtype == torch.bool
    assert out["KL_input_ids"].tolist() == [[1, 3, PAD, PAD], [1, 1, 2, 2]]
    assert out["KL_attention_mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert out["KL_completion_mask"].tolist() == [[0, 1, 0, 0], [0, 0, 1, 1]]
    assert out["ref_logps"].tolist() == [-1.0, -2.0] and out["ref_KL_logps"].tolist() == [-3.0, -4.0]
    no_kl = DataCollatorForUnpairedPreference(PAD)([{k: v for k, v in e.items() if "KL" not in k} for e in ex])
    assert not any(k.startswith("KL_") for k in no_kl)


def test_reward_collator():
    ex = [
        {"chosen_ids": [1, 2, 3], "rejected_ids": [4], "margin": 0.5},
        {"chosen_ids": [5], "rejected_ids": [6, 7], "margin": 1},
    ]
    out = DataCollatorForRewardPreference(PAD)(ex)
    assert out["input_ids"].tolist() == [[1, 2, 3], [5, PAD, PAD], [4, PAD, PAD], [6, 7, PAD]]
    assert out["attention_mask"].sum(1).tolist() == [3, 1, 1, 2]
    assert out["margin"].tolist() == [0.5, 1.0]
    assert "margin" not in DataCollatorForRewardPreference(PAD)([{"chosen_ids": [1], "rejected_ids": [2]}])
