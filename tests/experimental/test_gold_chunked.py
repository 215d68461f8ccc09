"""GOLD's ULD loss is computed from both models' hidden states a chunk of aligned groups at a time: for every mode
(extended observed / bayesian, positional, hybrid with a cross-entropy term) and chunk sizes 1 / 3 / 100 the loss
and its gradients equal the naive assembly from the two models' full (B, T, V) logits, and the largest block of
full-vocabulary logits allocated (forward, recompute, backward) holds at most a chunk of rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from distill_helpers import LogitsTracker, pairs
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.core.uld import align_by_byte_offsets, hybrid_uld_loss, merge_group_probs, uld_sorted_l1
from posttrain.experimental.gold import GOLDConfig, GOLDTrainer
from posttrain.models.vocabulary import model_vocab_size


def _batch(tokenizer):
    prompts = [tokenizer("Q1:").input_ids, tokenizer("Q22:").input_ids]
    width = max(map(len, prompts))
    prompt = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
    completions = [tokenizer("abcab").input_ids + [tokenizer.eos_token_id], tokenizer("cabc").input_ids]
    c = max(map(len, completions))
    ids = torch.tensor([x + [tokenizer.pad_token_id] * (c - len(x)) for x in completions])
    lengths = torch.tensor([len(x) for x in completions])
    mask = (torch.arange(c)[None] < lengths[:, None]).long()
    return {
        "prompt_ids": prompt, "prompt_mask": (prompt != tokenizer.pad_token_id).long(), "completion_ids": ids,
        "completion_mask": mask, "completion_lengths": lengths, "num_items_in_batch": mask.sum(),
    }  # fmt: skip


def _naive(trainer, batch):
    """The pre-chunking computation: both models' full logits, merged per row, mean over rows (+ CE)."""
    args = trainer.args
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    position_ids = (attention.cumsum(1) - 1).clamp(min=0)
    logits = trainer.model(input_ids=ids, attention_mask=attention, position_ids=position_ids).logits
    width_p, shift = batch["prompt_ids"].shape[1], int(args.uld_token_merge_strategy == "bayesian")
    losses = []
    for i, s_ids, s_offsets, t_prompt, t_ids, t_offsets in trainer._uld_rows(batch):
        with torch.no_grad():
            t_logits = trainer.teacher_model(torch.tensor([t_prompt + t_ids])).logits[0]
        s_probs = F.softmax(logits[i, width_p - shift : width_p - shift + len(s_ids)].float(), -1)
        t_probs = F.softmax(t_logits[len(t_prompt) - shift : len(t_prompt) - shift + len(t_ids)].float(), -1)
        if args.use_extended_uld:
            sg, tg = align_by_byte_offsets(s_offsets, t_offsets)
            paired = [(a, b) for a, b in zip(sg, tg) if a and b]
            s_al = merge_group_probs(s_probs, [a for a, _ in paired], s_ids, args.uld_token_merge_strategy)
            t_al = merge_group_probs(t_probs, [b for _, b in paired], t_ids, args.uld_token_merge_strategy)
        else:
            n = min(len(s_ids), len(t_ids))
            s_al, t_al = s_probs[:n], t_probs[:n]
        if trainer._mapping is not None:
            losses.append(hybrid_uld_loss(s_al, t_al, *trainer._mapping, beta=args.beta)[0])
        else:
            losses.append(uld_sorted_l1(s_al, t_al))
    loss = torch.stack(losses).mean()
    if args.uld_crossentropy_weight > 0:
        mask = batch["completion_mask"].bool()
        c = batch["completion_ids"].shape[1]
        ce = F.cross_entropy(logits[:, width_p - 1 : width_p - 1 + c][mask].float(), batch["completion_ids"][mask])
        loss = loss + args.uld_crossentropy_weight * ce
    return loss


def _grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)


MODES = [
    dict(),
    dict(uld_token_merge_strategy="bayesian"),
    dict(use_extended_uld=False),
    dict(uld_use_hybrid_loss=True, uld_crossentropy_weight=0.3),
]


@pytest.mark.parametrize("mode", MODES, ids=["observed", "bayesian", "positional", "hybrid-ce"])
def test_chunked_uld_equals_the_full_logits_version(tiny_model_path, merged_teacher_path, tmp_path, mode):
    args = fast_config(GOLDConfig, tmp_path, per_device_train_batch_size=2, max_completion_length=6, max_steps=1,
                       use_uld_loss=True, **mode)  # fmt: skip
    trainer = GOLDTrainer(tiny_model_path, merged_teacher_path, args=args, train_dataset=pairs())
    trainer.model.train()
    batch = _batch(trainer.processing_class)
    expected = _naive(trainer, batch)
    expected_grads = _grads(trainer.model, expected)
    for chunk in (1, 3, 100):
        trainer.loss_chunk_size = chunk
        loss = trainer._compute_loss(trainer.model, batch)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for got, want in zip(_grads(trainer.model, loss), expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)


def test_no_full_batch_logits(tiny_model_path, merged_teacher_path, tmp_path):
    """The largest full-vocabulary block (either model's head) holds one chunk, not the micro-batch's B × T rows."""
    args = fast_config(GOLDConfig, tmp_path, per_device_train_batch_size=2, max_completion_length=6, max_steps=1,
                       use_uld_loss=True, uld_token_merge_strategy="bayesian", uld_crossentropy_weight=0.1)  # fmt: skip
    trainer = GOLDTrainer(tiny_model_path, merged_teacher_path, args=args, train_dataset=pairs())
    trainer.model.train()
    batch = _batch(trainer.processing_class)
    trainer.loss_chunk_size = 3
    vocabs = (model_vocab_size(trainer.model), model_vocab_size(trainer.teacher_model))
    with LogitsTracker(*vocabs) as tracker:
        trainer._compute_loss(trainer.model, batch).backward()
    assert 0 < tracker.rows <= 3, tracker.rows
    print(f"GOLD largest logits block: {tracker.rows} rows, {tracker.bytes} bytes (vocabularies {vocabs})")


def test_teacher_prompt_gets_the_teachers_special_tokens(tiny_model_path, merged_teacher_path, tmp_path):
    """As TRL's ``build_teacher_inputs_from_texts``: the decoded prompt is re-tokenized *with* the teacher's special
    tokens (a BOS-adding teacher gets its BOS), less a trailing EOS; the completion without them."""
    from tokenizers.processors import TemplateProcessing

    args = fast_config(GOLDConfig, tmp_path, per_device_train_batch_size=2, max_completion_length=6, max_steps=1,
                       use_uld_loss=True)  # fmt: skip
    trainer = GOLDTrainer(tiny_model_path, merged_teacher_path, args=args, train_dataset=pairs())
    ttok = trainer.teacher_tokenizer
    bos = ttok.convert_tokens_to_ids("<|endoftext|>")
    ttok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A <|im_end|>", special_tokens=[("<|endoftext|>", bos), ("<|im_end|>", ttok.eos_token_id)]
    )
    batch = _batch(trainer.processing_class)
    rows = trainer._uld_rows(batch)
    plain = ttok("Q1:", add_special_tokens=False).input_ids
    assert rows[0][3] == [bos, *plain]  # BOS kept, the trailing EOS the template added removed
    assert rows[0][4] == ttok("abcab", add_special_tokens=False).input_ids  # the completion: no specials
    loss = trainer._compute_loss(trainer.model, batch)  # the teacher scores [BOS, prompt, completion]
    assert torch.isfinite(loss)


def test_chunk_size_follows_the_wider_full_head(tiny_model_path, merged_teacher_path, tmp_path, monkeypatch):
    """ULD reads both models' whole heads, so the default chunk holds ~2**24 logits of the wider one."""
    args = fast_config(GOLDConfig, tmp_path, per_device_train_batch_size=2, max_steps=1, use_uld_loss=True)
    trainer = GOLDTrainer(tiny_model_path, merged_teacher_path, args=args, train_dataset=pairs())
    assert trainer._uld_chunk_size(trainer.model) == 1024  # 320-row heads
    monkeypatch.setattr(trainer.teacher_model.config, "vocab_size", 151_936)
    assert trainer._uld_chunk_size(trainer.model) == 2**24 // 151_936 == 110
    trainer.loss_chunk_size = 7
    assert trainer._uld_chunk_size(trainer.model) == 7
