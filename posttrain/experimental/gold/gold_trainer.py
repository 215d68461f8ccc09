"""``GOLDTrainer``: General Online Logit Distillation — GKD's on-/off-policy scheduling with Universal Logit
Distillation for a teacher whose tokenizer differs from the student's (TRL's ``trl.experimental.gold``).

Without ``use_uld_loss`` this is :class:`~posttrain.trainers.distillation.DistillationTrainer` (shared vocabulary,
generalized JSD). With it, each completion (student samples, dataset completions) is decoded to text and
re-tokenized by the teacher's tokenizer after the decoded prompt; both models score their own tokens; the two
tokenizations are aligned by byte offsets of the completion text (``core.uld.align_by_byte_offsets``), split tokens'
probabilities merged (``merge_group_probs``), and the loss is the sorted-probability L1 (``uld_sorted_l1``) or the
hybrid matched/unmatched loss (``hybrid_uld_loss``), averaged over the micro-batch's completions.

Metrics: ``loss``, ``distillation_loss`` (the ULD term), ``entropy``, ``completions/*``; with the hybrid loss
``uld/matched_loss`` and ``uld/unmatched_loss``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from posttrain.core.uld import (
    align_by_byte_offsets,
    hybrid_uld_loss,
    merge_group_probs,
    uld_sorted_l1,
    vocabulary_mapping,
)
from posttrain.experimental.gold.gold_config import GOLDConfig
from posttrain.models.completion_scoring import completion_inputs
from posttrain.models.loading import load_processing_class
from posttrain.rollout.distillation import model_vocab_size
from posttrain.trainers.distillation import DistillationTrainer


def token_byte_offsets(tokenizer: Any, ids: list[int]) -> list[tuple[int, int]]:
    """UTF-8 byte ``(start, end)`` of each token in ``decode(ids)``, by incremental decoding."""
    offsets, previous = [], 0
    for j in range(len(ids)):
        end = len(tokenizer.decode(ids[: j + 1], skip_special_tokens=False).encode("utf-8"))
        offsets.append((previous, max(end, previous)))
        previous = max(end, previous)
    return offsets


def _char_to_byte_offsets(text: str, offsets: list[tuple[int, int]]) -> list[tuple[int, int]]:
    cumulative = [0]
    for ch in text:
        cumulative.append(cumulative[-1] + len(ch.encode("utf-8")))
    return [(cumulative[a], cumulative[b]) for a, b in offsets]


class GOLDTrainer(DistillationTrainer):
    """TRL's ``GOLDTrainer(model, teacher_model, args, ...)``; see :class:`DistillationTrainer` for the arguments.

    With ``args.use_uld_loss`` the teacher may use any tokenizer (``args.teacher_tokenizer_name_or_path``, or the
    one saved with the teacher).
    """

    config_class = GOLDConfig
    _trainer_name = "GOLD"
    _tag_names = ["posttrain", "gold", "distillation"]
    teacher_tokenizer: Any = None

    def _check_vocabulary(self, tokenizer: Any, teacher_tokenizer: Any, model: Any, teacher: Any) -> int:
        args = self.args if getattr(self, "args", None) is not None else None
        if args is None or not args.use_uld_loss:
            return DistillationTrainer._check_vocabulary(tokenizer, teacher_tokenizer, model, teacher)
        if args.teacher_tokenizer_name_or_path is not None:
            teacher_tokenizer = load_processing_class(args.teacher_tokenizer_name_or_path)
        if teacher_tokenizer is None:
            raise ValueError(
                "use_uld_loss=True needs the teacher's tokenizer: set teacher_tokenizer_name_or_path, or pass a "
                "teacher saved with its tokenizer."
            )
        self.teacher_tokenizer = getattr(teacher_tokenizer, "tokenizer", teacher_tokenizer)
        student_tok = getattr(tokenizer, "tokenizer", tokenizer)
        self._student_rows = min(len(student_tok), model_vocab_size(model))
        self._teacher_rows = min(len(self.teacher_tokenizer), model_vocab_size(teacher))
        self._mapping = None
        if args.uld_use_hybrid_loss:
            teacher_ids, student_ids = vocabulary_mapping(student_tok.get_vocab(), self.teacher_tokenizer.get_vocab())
            keep = (teacher_ids < self._teacher_rows) & (student_ids < self._student_rows)
            self._mapping = (teacher_ids[keep], student_ids[keep])
        return self._student_rows

    def __init__(self, model: Any, teacher_model: Any = None, args: GOLDConfig | None = None, **kwargs: Any):
        # _check_vocabulary runs inside the base constructor and needs the (resolved) config first.
        self.args = self.resolve_args(args, model, self.config_class, self._trainer_name)
        super().__init__(model, teacher_model, self.args, **kwargs)

    # -- the ULD loss ------------------------------------------------------------------------------------------------
    def _compute_loss(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        args = self.args
        if not args.use_uld_loss:
            return super()._compute_loss(model, inputs)
        mode = self._mode()
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        teacher_tok = self.teacher_tokenizer
        eos_ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        input_ids, attention_mask, position_ids, _ = completion_inputs(inputs)
        outputs = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
        logits = outputs.logits  # the full head: sampled ids may fall in its padding rows
        width_p = inputs["prompt_ids"].shape[1]
        bayesian = args.uld_token_merge_strategy == "bayesian"

        rows = []
        for i in range(input_ids.shape[0]):
            length = int(inputs["completion_lengths"][i])
            if not bool(inputs["completion_mask"][i].any()) or length == 0:
                continue
            ids = inputs["completion_ids"][i, :length].tolist()
            if args.uld_skip_student_eos and ids and ids[-1] in eos_ids:
                ids = ids[:-1]
            text = tok.decode(ids, skip_special_tokens=False)
            prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
            prompt_text = tok.decode(prompt, skip_special_tokens=False)
            t_prompt = teacher_tok(prompt_text, add_special_tokens=False)["input_ids"]
            enc = teacher_tok(text, add_special_tokens=False, return_offsets_mapping=True)
            t_ids, t_offsets = list(enc["input_ids"]), _char_to_byte_offsets(text, list(enc["offset_mapping"]))
            if not args.uld_skip_teacher_eos and teacher_tok.eos_token_id is not None:
                end = len(text.encode("utf-8"))
                t_ids.append(teacher_tok.eos_token_id)
                t_offsets.append((end, end))
            if not ids or not t_ids or not t_prompt:
                continue
            rows.append((i, ids, token_byte_offsets(tok, ids), t_prompt, t_ids, t_offsets))
        if not rows:
            zero = logits.sum() * 0.0
            self.record_metric("distillation_loss", float("nan"), mode=mode)
            return self._finish_loss(zero, getattr(outputs, "aux_loss", None))

        # the teacher scores its own tokenization of every kept row (one right-padded batch)
        sequences = [t_prompt + t_ids for _, _, _, t_prompt, t_ids, _ in rows]
        width = max(map(len, sequences))
        pad = teacher_tok.pad_token_id if teacher_tok.pad_token_id is not None else 0
        t_input = torch.full((len(rows), width), pad, dtype=torch.long)
        t_mask = torch.zeros_like(t_input)
        for j, seq in enumerate(sequences):
            t_input[j, : len(seq)] = torch.tensor(seq)
            t_mask[j, : len(seq)] = 1
        device = self.accelerator.device
        with torch.no_grad():
            t_logits = self.teacher_model(input_ids=t_input.to(device), attention_mask=t_mask.to(device)).logits

        losses, matched_parts, unmatched_parts, entropies = [], [], [], []
        for j, (i, ids, s_offsets, t_prompt, t_ids, t_offsets) in enumerate(rows):
            s_start, t_start = width_p, len(t_prompt)
            shift = 1 if bayesian else 0
            s_logits = logits[i, s_start - shift : s_start - shift + len(ids)]
            tt_logits = t_logits[j, t_start - shift : t_start - shift + len(t_ids)]
            s_probs = F.softmax(s_logits.float() / args.uld_student_temperature, dim=-1)
            t_probs = F.softmax(tt_logits.float() / args.uld_teacher_temperature, dim=-1)
            with torch.no_grad():
                entropies.append(-(s_probs * torch.log(s_probs.clamp_min(1e-30))).sum(-1).mean())
            if args.use_extended_uld:
                s_groups, t_groups = align_by_byte_offsets(s_offsets, t_offsets)
                paired = [(a, b) for a, b in zip(s_groups, t_groups) if a and b]
                strategy = args.uld_token_merge_strategy
                s_aligned = merge_group_probs(s_probs, [a for a, _ in paired], ids, strategy)
                t_aligned = merge_group_probs(t_probs, [b for _, b in paired], t_ids, strategy)
            else:
                n = min(len(ids), len(t_ids))
                s_aligned, t_aligned = s_probs[:n], t_probs[:n]
            if self._mapping is not None:
                loss_i, matched, unmatched = hybrid_uld_loss(
                    s_aligned, t_aligned, *self._mapping, beta=args.beta,
                    matched_weight=args.uld_hybrid_matched_weight, unmatched_weight=args.uld_hybrid_unmatched_weight,
                )  # fmt: skip
                matched_parts.append(matched.detach())
                unmatched_parts.append(unmatched.detach())
            else:
                loss_i = uld_sorted_l1(s_aligned, t_aligned)
            losses.append(loss_i)
        distillation = torch.stack(losses).mean()
        loss = args.uld_distillation_weight * distillation
        if args.uld_crossentropy_weight > 0:
            width_c = inputs["completion_ids"].shape[1]
            predicted = logits[:, width_p - 1 : width_p - 1 + width_c]
            mask = inputs["completion_mask"].bool()
            ce = F.cross_entropy(predicted[mask].float(), inputs["completion_ids"][mask])
            loss = loss + args.uld_crossentropy_weight * ce
        loss = self._finish_loss(loss, getattr(outputs, "aux_loss", None))  # mean per micro-batch, / GA
        self.record_metric("distillation_loss", self._gather_mean(distillation.detach()), mode=mode)
        self.record_metric("entropy", self._gather_mean(torch.stack(entropies).mean()), mode=mode)
        if matched_parts:
            self.record_metric("uld/matched_loss", self._gather_mean(torch.stack(matched_parts).mean()), mode=mode)
            self.record_metric("uld/unmatched_loss", self._gather_mean(torch.stack(unmatched_parts).mean()), mode=mode)
        return loss
