"""``GOLDTrainer``: General Online Logit Distillation — GKD's on-/off-policy scheduling with Universal Logit
Distillation for a teacher whose tokenizer differs from the student's (TRL's ``trl.experimental.gold``).

Without ``use_uld_loss`` this is :class:`~posttrain.trainers.distillation.DistillationTrainer` (shared vocabulary,
generalized JSD). With it, each completion (student samples, dataset completions) is decoded to text and
re-tokenized by the teacher's tokenizer after the decoded prompt; both models score their own tokens; the two
tokenizations are aligned by byte offsets of the completion text (``core.uld.align_by_byte_offsets``), split tokens'
probabilities merged (``merge_group_probs``), and the loss is the sorted-probability L1 (``uld_sorted_l1``) or the
hybrid matched/unmatched loss (``hybrid_uld_loss``), averaged over the micro-batch's completions. Both models' logits
are computed from their last hidden states a chunk of aligned groups at a time (``chunked_uld_loss``), never for the
whole micro-batch.

Metrics: ``loss``, ``distillation_loss`` (the ULD term), ``entropy``, ``completions/*``; with the hybrid loss
``uld/matched_loss`` and ``uld/unmatched_loss``.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.core.distill import chunked_token_map
from posttrain.core.uld import GroupPlan, align_by_byte_offsets, chunked_uld_loss, group_plan, vocabulary_mapping
from posttrain.distributed import sum_over_processes
from posttrain.experimental.gold.gold_config import GOLDConfig
from posttrain.models.completion_scoring import completion_inputs
from posttrain.models.distillation_scoring import forward_logits_fn
from posttrain.models.loading import load_processing_class
from posttrain.models.vocabulary import model_vocab_size
from posttrain.trainers.distillation import DistillationLoss, DistillationTrainer, FullVocabularyDivergence


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


class ULDLoss:
    """GOLD's loss strategy (a :class:`~posttrain.trainers.distillation.DistillationLoss`): with ``use_uld_loss`` the
    ULD loss below, else the shared-vocabulary generalized JSD of ``DistillationTrainer``."""

    def __init__(self) -> None:
        self.full_vocabulary = FullVocabularyDivergence()

    def __call__(self, trainer: GOLDTrainer, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        """ULD averaged over the completions of the micro-batch on every process, from both models' last hidden states a chunk of aligned
        groups at a time (``core.uld.chunked_uld_loss``): no ``(B, T, V)`` logits of either model are built."""
        args = trainer.args
        if not args.use_uld_loss:
            return self.full_vocabulary(trainer, model, inputs)
        mode = trainer._mode()
        input_ids, attention_mask, position_ids, _ = completion_inputs(inputs)
        outputs, student_logits_fn = forward_logits_fn(model, input_ids, attention_mask, position_ids)
        aux_loss = getattr(outputs, "aux_loss", None)
        rows = trainer._uld_rows(inputs)
        # Means over every process's kept rows (and completion tokens): each process contributes its sums scaled by
        # P / global count, which DDP's gradient average and the metrics' mean over processes turn into global
        # means. Every process joins every collective below, with or without rows of its own (no hang).
        processes = trainer.accelerator.num_processes
        local_counts = torch.tensor([float(len(rows)), float(inputs["completion_mask"].sum())])
        total_rows, total_tokens = sum_over_processes(trainer.accelerator, local_counts).tolist()
        row_share = processes / total_rows if total_rows else 0.0
        chunk = trainer._uld_chunk_size(model)
        token_share = processes / max(total_tokens, 1.0)
        ce = trainer._uld_crossentropy(inputs, student_logits_fn, input_ids.shape[1], token_share, chunk)
        if not rows:
            zero = 0.0 * sum(p.sum() for p in model.parameters() if p.requires_grad)
            nothing = torch.zeros((), device=trainer.accelerator.device)
            trainer._record_uld_metrics(mode, total_rows, nothing, nothing, nothing, nothing)
            return trainer._finish_loss(zero + args.uld_crossentropy_weight * ce, aux_loss)

        # the teacher scores its own tokenization of every kept row (one right-padded batch)
        sequences = [t_prompt + t_ids for _, _, _, t_prompt, t_ids, _ in rows]
        width = max(map(len, sequences))
        pad = trainer.teacher_tokenizer.pad_token_id if trainer.teacher_tokenizer.pad_token_id is not None else 0
        t_input = torch.full((len(rows), width), pad, dtype=torch.long)
        t_mask = torch.zeros_like(t_input)
        for j, seq in enumerate(sequences):
            t_input[j, : len(seq)] = torch.tensor(seq)
            t_mask[j, : len(seq)] = 1
        device = trainer.accelerator.device
        with torch.no_grad():
            _, teacher_logits_fn = forward_logits_fn(trainer.teacher_model, t_input.to(device), t_mask.to(device))

        # Which positions of each side every aligned group merges (flat indices into the two models' outputs).
        # "observed" reads the logits at the completion tokens' own positions, "bayesian" one earlier (TRL's slicing).
        shift = 1 if args.uld_token_merge_strategy == "bayesian" else 0
        s_len, width_p = input_ids.shape[1], inputs["prompt_ids"].shape[1]
        s_plans, t_plans, weights, entropy_positions, entropy_rows = [], [], [], [], []
        for j, (i, ids, s_offsets, t_prompt, t_ids, t_offsets) in enumerate(rows):
            s_offset = i * s_len + width_p - shift
            t_offset = j * width + len(t_prompt) - shift
            if args.use_extended_uld:
                s_groups, t_groups = align_by_byte_offsets(s_offsets, t_offsets)
                paired = [(a, b) for a, b in zip(s_groups, t_groups) if a and b]
            else:
                paired = [([k], [k]) for k in range(min(len(ids), len(t_ids)))]
            strategy = args.uld_token_merge_strategy
            s_plans.append(group_plan([a for a, _ in paired], ids, strategy, s_offset))
            t_plans.append(group_plan([b for _, b in paired], t_ids, strategy, t_offset))
            weights += [row_share / len(paired)] * len(paired)
            entropy_positions += range(s_offset, s_offset + len(ids))
            entropy_rows += [j] * len(ids)
        distillation, matched, unmatched = chunked_uld_loss(
            student_logits_fn,
            teacher_logits_fn,
            GroupPlan.concat(s_plans).to(device),
            GroupPlan.concat(t_plans).to(device),
            torch.tensor(weights, dtype=torch.float32, device=device),
            student_temperature=args.uld_student_temperature,
            teacher_temperature=args.uld_teacher_temperature,
            mapping=trainer._mapping,
            beta=args.beta,
            matched_weight=args.uld_hybrid_matched_weight,
            unmatched_weight=args.uld_hybrid_unmatched_weight,
            chunk_size=chunk,
        )
        loss = args.uld_distillation_weight * distillation
        positions = torch.tensor(entropy_positions, dtype=torch.long, device=device)
        with torch.no_grad():  # the student's entropy over each kept completion's ULD positions, mean over rows
            (entropy,) = chunked_token_map(
                lambda r: student_logits_fn(positions[r]), positions.numel(),
                lambda lp, r: ((-(lp.exp() * lp).sum(-1)),), temperature=args.uld_student_temperature,
                chunk_size=chunk, device=device,
            )  # fmt: skip
            per_row = torch.zeros(len(rows), device=device).index_add_(
                0, torch.tensor(entropy_rows, device=device), entropy.float()
            )
            counts = torch.bincount(torch.tensor(entropy_rows, device=device), minlength=len(rows))
            entropy_share = (per_row / counts.clamp(min=1)).sum() * row_share
        loss = loss + args.uld_crossentropy_weight * ce
        loss = trainer._finish_loss(loss, aux_loss)  # mean per micro-batch, / GA
        trainer._record_uld_metrics(mode, total_rows, distillation.detach(), entropy_share, matched, unmatched)
        return loss


class GOLDTrainer(DistillationTrainer):
    """TRL's ``GOLDTrainer(model, teacher_model, args, ...)``; see :class:`DistillationTrainer` for the arguments.

    With ``args.use_uld_loss`` the teacher may use any tokenizer (``args.teacher_tokenizer_name_or_path``, or the
    one saved with the teacher). The loss is the :class:`ULDLoss` strategy.
    """

    config_class = GOLDConfig
    shuffles_generation_batch = False  # TRL's GOLD splits its generation batch unshuffled
    _trainer_name = "GOLD"
    _tag_names = ["posttrain", "gold", "distillation"]
    dataset_truncation = "keep_end"  # TRL's ChatML collator: a dataset row keeps its last max_length tokens
    teacher_tokenizer: Any = None
    loss_strategy: DistillationLoss = ULDLoss()

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
    def _uld_rows(self, inputs: Any) -> list[tuple]:
        """Per completion with loss tokens: (row, student ids, their byte offsets, teacher prompt ids, teacher ids,
        their byte offsets) — the completion text re-tokenized by the teacher after the decoded prompt."""
        args = self.args
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        teacher_tok = self.teacher_tokenizer
        eos_ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
        rows = []
        for i in range(inputs["completion_ids"].shape[0]):
            length = int(inputs["completion_lengths"][i])
            if not bool(inputs["completion_mask"][i].any()) or length == 0:
                continue
            ids = inputs["completion_ids"][i, :length].tolist()
            if args.uld_skip_student_eos and ids and ids[-1] in eos_ids:
                ids = ids[:-1]
            text = tok.decode(ids, skip_special_tokens=False)
            prompt = inputs["prompt_ids"][i][inputs["prompt_mask"][i].bool()].tolist()
            prompt_text = tok.decode(prompt, skip_special_tokens=False)
            # As TRL's build_teacher_inputs_from_texts: the teacher's own special tokens (e.g. its BOS) around the
            # prompt, less a trailing EOS so the completion extends it.
            t_prompt = list(teacher_tok(prompt_text, add_special_tokens=True)["input_ids"])
            if t_prompt and teacher_tok.eos_token_id is not None and t_prompt[-1] == teacher_tok.eos_token_id:
                t_prompt = t_prompt[:-1]
            enc = teacher_tok(text, add_special_tokens=False, return_offsets_mapping=True)
            t_ids, t_offsets = list(enc["input_ids"]), _char_to_byte_offsets(text, list(enc["offset_mapping"]))
            if not args.uld_skip_teacher_eos and teacher_tok.eos_token_id is not None:
                end = len(text.encode("utf-8"))
                t_ids.append(teacher_tok.eos_token_id)
                t_offsets.append((end, end))
            if not ids or not t_ids or not t_prompt:
                continue
            rows.append((i, ids, token_byte_offsets(tok, ids), t_prompt, t_ids, t_offsets))
        return rows

    def _uld_chunk_size(self, model: torch.nn.Module) -> int:
        """Positions per chunk: ``loss_chunk_size``, else about 2**24 logits per chunk of the wider of the two heads
        (ULD reads whole heads, not the shared vocabulary), between 16 and 1024 positions."""
        if self.loss_chunk_size is not None:
            return int(self.loss_chunk_size)
        width = max(model_vocab_size(model), model_vocab_size(self.teacher_model))
        return min(1024, max(16, 2**24 // width))

    def _uld_crossentropy(
        self, inputs: Any, student_logits_fn: Any, s_len: int, token_share: float, chunk: int
    ) -> torch.Tensor:
        """This process's share (``token_share`` = P / global tokens) of the student's cross-entropy on the
        completion tokens (0 when ``uld_crossentropy_weight`` is 0)."""
        device = self.accelerator.device
        if self.args.uld_crossentropy_weight <= 0:
            return torch.zeros((), device=device)
        mask = inputs["completion_mask"].bool()
        b_idx, t_idx = mask.nonzero(as_tuple=True)
        predictors = b_idx * s_len + inputs["prompt_ids"].shape[1] - 1 + t_idx
        targets = inputs["completion_ids"][mask]
        (token_logps,) = chunked_token_map(
            lambda r: student_logits_fn(predictors[r]), predictors.numel(),
            lambda lp, r: (lp.gather(-1, targets[r][:, None]).squeeze(-1),),
            chunk_size=chunk, device=device,
        )  # fmt: skip
        return -token_logps.sum() * token_share

    def _record_uld_metrics(self, mode: str, total_rows: float, *shares: torch.Tensor) -> None:
        """``distillation_loss``, ``entropy`` (and with a hybrid mapping ``uld/matched_loss`` /
        ``uld/unmatched_loss``) from each process's share of the mean over every process's rows; NaN (and no
        collective, on every process alike) when no process kept a row."""
        names = ["distillation_loss", "entropy"] + (
            ["uld/matched_loss", "uld/unmatched_loss"] if self._mapping is not None else []
        )
        for name, share in zip(names, shares):
            value = self._gather_mean(share) if total_rows else float("nan")
            self.record_metric(name, value, mode=mode)
