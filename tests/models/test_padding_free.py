"""Padding-free forwards (posttrain/models/padding_free.py): the flat layout by hand, equality with the padded forward
in values and gradients (SFT-style labels, DPO-style shared prompts, gradient checkpointing), when it is not used,
and the SFT / DPO trainers giving the padded run's losses, metrics and weights."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

import posttrain.models.forward as forward
import posttrain.models.padding_free as padding_free
from posttrain.models.forward import forward_token_stats
from posttrain.models.padding_free import padding_free_layout
from posttrain.models.preference_scoring import score_preference_completions
from posttrain.models.tiny import build_tiny_model
from posttrain.models.tree_attention import TreeAttentionMask


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _sdpa_model(arch: str = "qwen2"):
    torch.manual_seed(0)
    model = build_tiny_model(arch)
    model.config._attn_implementation = "sdpa"
    return model


def _right_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    return ids, mask


def test_layout_by_hand(monkeypatch):
    monkeypatch.setattr(padding_free, "MAX_COST_RATIO", 1e9)  # tiny rows: force the flat layout
    ids, mask = _right_padded([[11, 12, 13], [21], [31, 32]])
    layout = padding_free_layout(_sdpa_model(), ids, mask)
    assert layout is not None and not layout.shared
    assert layout.input_ids.tolist() == [[11, 12, 13, 21, 31, 32]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 0, 0, 1]]
    assert layout.first.tolist() == [[True, False, False, True, True, False]]
    assert layout.index.tolist() == [[0, 1, 2], [3, 0, 0], [4, 5, 0]]
    assert isinstance(layout.attention_mask, TreeAttentionMask)
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(layout.attention_mask.as_subclass(torch.Tensor)[0, 0], expected)
    values = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    assert layout.to_rows(values).tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]]
    assert layout.flatten(ids).tolist() == layout.input_ids.tolist()


def test_shared_prompt_layout_by_hand(monkeypatch):
    """Chosen [p1 p2 p3 | c1 c2] and rejected [p1 p2 p3 | r1]: the rejected segment is [p3-copy, r1] at positions
    2, 3 and sees p1, p2 of the chosen row."""
    monkeypatch.setattr(padding_free, "MAX_COST_RATIO", 1e9)
    ids, mask = _right_padded([[1, 2, 3, 7, 8], [1, 2, 3, 9]])
    scored = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, 0]], dtype=torch.bool)
    layout = padding_free_layout(_sdpa_model(), ids, mask, share_prompts=scored)
    assert layout is not None and layout.shared
    assert layout.input_ids.tolist() == [[1, 2, 3, 7, 8, 3, 9]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 2, 3]]
    assert layout.first.tolist() == [[True, False, False, False, False, True, False]]
    assert layout.index.tolist() == [[0, 1, 2, 3, 4], [0, 1, 5, 6, 0]]
    dense = layout.attention_mask.as_subclass(torch.Tensor)[0, 0]
    assert dense[5].tolist() == [True, True, False, False, False, True, False]
    assert dense[6].tolist() == [True, True, False, False, False, True, True]
    assert layout.scored(scored).tolist() == [[False, False, False, True, True, False, True]]
    with pytest.raises(ValueError, match="shared prompts"):
        layout.flatten(ids)


def test_layout_reused_only_for_the_same_unmodified_tensors(monkeypatch):
    """DPO scores a batch with the reference, then the policy: the second call reuses the layout; a new tensor or
    an in-place write builds a new one."""
    monkeypatch.setattr(padding_free, "MAX_COST_RATIO", 1e9)
    model = _sdpa_model()
    ids, mask = _right_padded([[11, 12, 13], [21], [31, 32]])
    first = padding_free_layout(model, ids, mask)
    assert padding_free_layout(model, ids, mask) is first
    other = padding_free_layout(model, ids.clone(), mask)
    assert other is not first and torch.equal(other.input_ids, first.input_ids)
    ids[1, 0] = 22  # in place: the cached flat ids would be stale
    assert padding_free_layout(model, ids, mask).input_ids.tolist() == [[11, 12, 13, 22, 31, 32]]
    with torch.inference_mode():
        frozen_ids, frozen_mask = ids.clone(), mask.clone()
    assert padding_free_layout(model, frozen_ids, frozen_mask) is not padding_free_layout(model, frozen_ids, frozen_mask)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _both_ways(monkeypatch, run):
    """``run()`` with padding-free disabled, then enabled (asserting it was used)."""
    calls = []
    original = forward._padding_free_token_stats

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(forward, "padding_free_layout", lambda *a, **k: None)
    padded = run()
    monkeypatch.setattr(forward, "padding_free_layout", padding_free_layout)
    monkeypatch.setattr(forward, "_padding_free_token_stats", spy)
    flat = run()
    assert calls, "the padding-free path was not taken"
    return padded, flat


@pytest.mark.invariance
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_labels_equal_padded_forward(monkeypatch, arch, checkpointing):
    """SFT-style rows of very different lengths (labels with an ignored prefix): log-probs, masks, entropies,
    top-1 hits and parameter gradients of the padded forward."""
    model = _sdpa_model(arch)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    g = torch.Generator().manual_seed(3)
    lengths = [60, 6, 38, 5, 41, 7, 8, 59]
    ids = torch.randint(2, 256, (len(lengths), 60), generator=g)
    mask = (torch.arange(60).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    positions = (mask.cumsum(1) - 1).clamp(min=0)  # the SFT collator's position_ids

    def run():
        stats = forward_token_stats(
            model, ids, mask, labels=labels, position_ids=positions, compute_entropy=True, compute_accuracy=True,
            length_buckets=True,
        )  # fmt: skip
        ((stats.logps * stats.mask).sum() / stats.mask.sum()).backward()
        return stats, _grads(model)

    (padded, g0), (flat, g1) = _both_ways(monkeypatch, run)
    assert flat.padding_free is not None and padded.padding_free is None
    assert torch.equal(flat.mask, padded.mask) and torch.equal(flat.correct, padded.correct)
    torch.testing.assert_close(flat.logps, padded.logps, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(flat.entropy, padded.entropy, atol=1e-5, rtol=1e-5)
    assert g0.keys() == g1.keys()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.invariance
def test_shared_prompts_equal_padded_preference_scores(monkeypatch):
    """DPO-style rows (chosen half, rejected half, same prompts): every statistic of the padded scoring, and the
    gradients of a weighted sum of the sequence log-probs."""
    model = _sdpa_model()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 250, (n,), generator=g).tolist() for n in (9, 4, 12, 20)]
    chosen = [torch.randint(5, 250, (n,), generator=g).tolist() for n in (30, 5, 17, 44)]
    rejected = [torch.randint(5, 250, (n,), generator=g).tolist() for n in (3, 22, 17, 8)]
    rows = [p + c for p, c in zip(prompts, chosen)] + [p + r for p, r in zip(prompts, rejected)]
    ids, mask = _right_padded(rows)
    completion = mask.clone()
    for i, p in enumerate(prompts * 2):
        completion[i, : len(p)] = 0
    half = torch.arange(len(rows)) < len(prompts)

    def run():
        scores = score_preference_completions(
            model, ids, mask, completion, compute_entropy=True, compute_mean_logits=True, compute_wpo=True,
            accuracy_rows=half,
        )  # fmt: skip
        (scores.sequence_sums() * torch.arange(1.0, len(rows) + 1)).sum().backward()
        return scores, _grads(model)

    (padded, g0), (flat, g1) = _both_ways(monkeypatch, run)
    assert torch.equal(flat.mask, padded.mask) and torch.equal(flat.correct, padded.correct)
    for name in ("logps", "entropy", "mean_logits", "wpo_log_normalizer"):
        torch.testing.assert_close(getattr(flat, name), getattr(padded, name), atol=1e-5, rtol=1e-5, msg=name)
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], atol=1e-5, rtol=1e-4, msg=name)


def test_not_used_where_it_cannot_equal_or_gain(monkeypatch):
    ids, mask = _right_padded([[5] * 60, [6] * 3, [7] * 50, [8] * 2])
    model = _sdpa_model()
    assert padding_free_layout(model, ids, mask) is not None
    assert padding_free_layout(model, ids[:1], mask[:1]) is None  # one row: no padding between rows
    assert padding_free_layout(model, ids, mask.flip(1)) is None  # left padding
    assert padding_free_layout(model, ids, None) is None
    assert padding_free_layout(model, ids.to("meta"), mask.to("meta")) is None  # accelerators: not measured yet
    eager = _sdpa_model()
    eager.config._attn_implementation = "eager"  # would run the N x N mask densely
    assert padding_free_layout(eager, ids, mask) is None
    eager.config._attn_implementation = "sdpa"
    eager.config.output_router_logits = True  # an MoE router loss is a statistic of the whole call
    assert padding_free_layout(eager, ids, mask) is None
    windowed = _sdpa_model()
    windowed.config.layer_types = ["sliding_attention"] * len(windowed.config.layer_types)
    windowed.config.sliding_window = 59  # a 60-token row would lose its window in the flat row's mask
    assert padding_free_layout(windowed, ids, mask) is None
    windowed.config.sliding_window = 60
    assert padding_free_layout(windowed, ids.clone(), mask.clone()) is not None
    windowed.config.layer_types = ["chunked_attention"] * len(windowed.config.layer_types)
    assert padding_free_layout(windowed, ids.clone(), mask.clone()) is None
    full = torch.ones_like(mask)
    assert padding_free_layout(model, torch.full_like(ids, 5)[:, :8], full[:, :8]) is None  # nothing to save
    monkeypatch.setattr(padding_free, "MAX_FLAT_TOKENS", 64)  # the dense N x N mask stays bounded
    assert padding_free_layout(model, ids.clone(), mask.clone()) is None


# ----------------------------------------------------------------------------------------------------------------
# Trainers: the padded run's losses, metrics and weights
# ----------------------------------------------------------------------------------------------------------------


def _train_both_ways(monkeypatch, make_trainer):
    """Train with padding-free disabled, then enabled (asserting the flat forward ran)."""
    runs, calls = [], []

    def spy(*args, **kwargs):
        layout = padding_free_layout(*args, **kwargs)
        calls.append(layout is not None)
        return layout

    for enabled in (False, True):
        monkeypatch.setattr(forward, "padding_free_layout", spy if enabled else lambda *a, **k: None)
        trainer = make_trainer(enabled)
        trainer.train()
        runs.append(trainer)
    assert any(calls), "the padding-free path was not taken"
    return runs


def _metric_rows(trainer, keys):
    return [[row[k] for k in keys] for row in trainer.state.log_history if "loss" in row]


@pytest.mark.invariance
@pytest.mark.parametrize("checkpointing", [False, True])
def test_sft_trainer_equals_padded(monkeypatch, tmp_path, tiny_model_path, checkpointing):
    """Unpacked SFT, conversations of varied length, 7 rows in batches of 4 (an uneven last batch), SGD: loss,
    entropy, mean_token_accuracy, num_tokens and weights of the padded run."""
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    texts = [("x" * n) + " ok" for n in (3, 40, 7, 25, 60, 2, 33)]
    data = Dataset.from_dict({"text": texts})

    def make(enabled):
        args = SFTConfig(
            output_dir=str(tmp_path / str(enabled)), report_to="none", save_strategy="no", logging_steps=1,
            num_train_epochs=1, per_device_train_batch_size=4, optim="sgd", learning_rate=0.5, disable_tqdm=True,
            gradient_checkpointing=checkpointing, train_sampling_strategy="sequential", write_report=False,
            dataloader_pin_memory=False, seed=0,
        )  # fmt: skip
        return SFTTrainer(tiny_model_path, args=args, train_dataset=data)

    padded, flat = _train_both_ways(monkeypatch, make)
    keys = ["loss", "entropy", "mean_token_accuracy", "num_tokens"]
    rows_p, rows_f = _metric_rows(padded, keys), _metric_rows(flat, keys)
    assert len(rows_p) == 2  # batches of 4 and 3
    torch.testing.assert_close(torch.tensor(rows_f), torch.tensor(rows_p), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(flat.model.named_parameters(), padded.model.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.invariance
def test_dpo_trainer_equals_padded(monkeypatch, tmp_path, tiny_model_path):
    """DPO with a reference copy, pairs sharing their prompts: loss, every logged metric and weights of the padded
    run (SGD, two steps)."""
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    rows = []
    for i in range(8):
        prompt = "Q" * (3 + 5 * i) + "?"
        rows.append({"prompt": prompt, "chosen": " yes" * (1 + i % 3), "rejected": " no" * (4 - i % 4)})
    data = Dataset.from_list(rows)

    def make(enabled):
        args = DPOConfig(
            output_dir=str(tmp_path / str(enabled)), report_to="none", save_strategy="no", logging_steps=1,
            max_steps=2, per_device_train_batch_size=4, optim="sgd", learning_rate=0.5, disable_tqdm=True,
            gradient_checkpointing=False, train_sampling_strategy="sequential", dataloader_pin_memory=False,
            seed=0,
        )  # fmt: skip
        return DPOTrainer(tiny_model_path, args=args, train_dataset=data)

    padded, flat = _train_both_ways(monkeypatch, make)
    keys = sorted(k for k in padded.state.log_history[0] if k not in ("epoch", "learning_rate"))
    assert {"loss", "rewards/margins", "logps/chosen", "logits/rejected", "entropy", "num_tokens"} <= set(keys)
    rows_p, rows_f = _metric_rows(padded, keys), _metric_rows(flat, keys)
    torch.testing.assert_close(torch.tensor(rows_f), torch.tensor(rows_p), atol=1e-5, rtol=1e-4)
    for (name, p), q in zip(flat.model.named_parameters(), padded.model.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.invariance
def test_sft_gradient_accumulation_equals_larger_batch_padding_free(monkeypatch, tmp_path, tiny_model_path):
    """Under the flat forward (forced for these short rows), 2 × GA 2 ≡ 4 × GA 1: the loss is normalised by the
    accumulated label-token count either way."""
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    monkeypatch.setattr(padding_free, "MAX_COST_RATIO", 1e9)
    data = Dataset.from_dict({"text": [("y" * n) + " ok" for n in (3, 40, 7, 25, 60, 2, 33, 12)]})
    runs = []
    for batch, accumulation in ((4, 1), (2, 2)):
        args = SFTConfig(
            output_dir=str(tmp_path / str(batch)), report_to="none", save_strategy="no", logging_steps=1,
            max_steps=2, per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation, optim="sgd",
            learning_rate=0.5, disable_tqdm=True, gradient_checkpointing=False, train_sampling_strategy="sequential",
            write_report=False, dataloader_pin_memory=False, seed=0,
        )  # fmt: skip
        trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=data)
        trainer.train()
        runs.append(trainer)
    keys = ["loss", "num_tokens"]
    torch.testing.assert_close(
        torch.tensor(_metric_rows(runs[1], keys)), torch.tensor(_metric_rows(runs[0], keys)), atol=1e-5, rtol=1e-5
    )
    for (name, p), q in zip(runs[1].model.named_parameters(), runs[0].model.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=name)
