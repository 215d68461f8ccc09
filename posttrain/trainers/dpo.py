"""DPOConfig and DPOTrainer: offline preference optimisation with TRL's API, fields, defaults and metric names.

Pipeline (features.md §B4/§C1):

1. Data: preference rows (explicit or implicit prompt, standard or conversational, per-row ``tools`` /
   ``chat_template_kwargs``) are tokenized into ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``
   (:func:`posttrain.data.tokenization.tokenize_preference`; EOS appended to standard completions). Rows whose
   prompt alone fills ``max_length`` are dropped; the rest are truncated per sequence in the collator.
2. One forward pass scores chosen and rejected together: the collator stacks ``[prompt+chosen; prompt+rejected]``
   into ``(2B, L)``. Token log-probs come from :func:`posttrain.trainers._forward.forward_token_stats` — the chunked
   path, never ``(2B, L, V)`` logits — and are summed over completion tokens (or LD-DPO weighted).
3. The reference log-probs come from :mod:`posttrain.trainers._reference` (explicit ``ref_model``, PEFT adapters
   disabled, frozen copy, precomputed columns, or a TR-DPO-synced copy).
4. :func:`posttrain.core.preference.dpo_loss` combines the requested ``loss_type`` list with ``loss_weights``.

The batch loss is a mean over the micro-batch's pairs and ``Trainer`` divides it by the number of accumulation
steps, so ``per_device_train_batch_size=1`` × GA 4 equals 4 × GA 1 for every per-pair loss (``aot``/``aot_unpaired``
sort over the batch and ``sft`` is a token mean over the batch, so for those the micro-batch *is* the batch, as in
TRL).

Metrics (TRL's names): ``rewards/chosen``, ``rewards/rejected``, ``rewards/accuracies``, ``rewards/margins``,
``logps/chosen``, ``logps/rejected``, ``logits/chosen``, ``logits/rejected`` (mean logit over completion tokens,
computed as ``h · mean_v(W)`` — no vocabulary-sized tensor), ``entropy``, ``num_tokens``, ``mean_token_accuracy``
(chosen tokens), ``aux_loss`` (MoE).

This module also holds the pieces KTO and the reward trainer reuse: :func:`coerce_config`,
:func:`score_completions`, and the metric gathering helpers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

from posttrain.core.preference import (
    F_DIVERGENCES,
    DPOLossInputs,
    dpo_loss,
    ld_weighted_logps,
    validate_dpo_loss_config,
    wpo_pair_weight,
    wpo_sequence_weight,
)
from posttrain.models.loading import disable_dropout_in_model, model_name, resolve_model, resolve_processing_class
from posttrain.reliability.validation import check_single_split
from posttrain.trainers._forward import TokenStats, forward_token_stats, unwrap_model
from posttrain.trainers._reference import (
    SyncRefModelCallback,
    create_reference_policy,
    precompute_reference_columns,
)
from posttrain.trainers.base import BaseConfig, BaseTrainer

__all__ = [
    "CompletionScores",
    "DPOConfig",
    "DPOTrainer",
    "coerce_config",
    "score_completions",
]


# ---------------------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DPOConfig(BaseConfig):
    """Configuration for :class:`DPOTrainer` (TRL's ``DPOConfig`` fields and defaults).

    Only DPO-specific fields are listed; everything else is ``transformers.TrainingArguments`` with TRL's overrides
    (``logging_steps=10``, ``gradient_checkpointing=True``, ``bf16`` automatic, ``learning_rate=1e-6``).
    """

    learning_rate: float = field(default=1e-6, metadata={"help": "Initial AdamW learning rate."})

    # model / data
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the policy and reference."})
    dataset_num_proc: int | None = field(default=None, metadata={"help": "Processes used to tokenize the dataset."})
    max_length: int | None = field(
        default=1024,
        metadata={
            "help": "Maximum length of prompt+completion per sequence; longer sequences are truncated in the collator "
            "and rows whose prompt alone reaches it are dropped (keep_start). None: no limit."
        },
    )
    truncation_mode: str = field(
        default="keep_start",
        metadata={
            "help": "'keep_start' keeps the first max_length tokens; 'keep_end' (deprecated) keeps the last ones.",
            "choices": ["keep_start", "keep_end"],
        },
    )
    padding_free: bool = field(
        default=False,
        metadata={"help": "Not supported for DPO yet (as in TRL): a warning is issued and padding is used."},
    )
    pad_to_multiple_of: int | None = field(
        default=None, metadata={"help": "Pad each batch to a multiple of this length."}
    )
    pad_token: str | None = field(
        default=None, metadata={"help": "Deprecated: set the tokenizer's pad token before building the trainer."}
    )
    activation_offloading: bool = field(
        default=False, metadata={"help": "Keep activations saved for backward in CPU memory (save_on_cpu)."}
    )

    # reference
    precompute_ref_log_probs: bool = field(
        default=False,
        metadata={
            "help": "Compute the reference log-probs of the whole dataset in one pass before training, then free the "
            "reference (no reference forward during training). Not for IterableDataset."
        },
    )
    precompute_ref_batch_size: int | None = field(
        default=None,
        metadata={"help": "Batch size of the precompute pass; None: the per-device train / eval batch size."},
    )
    sync_ref_model: bool = field(
        default=False,
        metadata={"help": "TR-DPO: mix the policy into the reference every ref_model_sync_steps steps."},
    )
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TR-DPO α: ref ← α·policy + (1−α)·ref."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TR-DPO: steps between reference syncs."})

    # loss
    loss_type: list[str] = field(
        default_factory=lambda: ["sigmoid"],
        metadata={
            "help": "DPO loss type, or a list of them combined with loss_weights: sigmoid, hinge, ipo, exo_pair, "
            "nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, discopop, sft, "
            "sigmoid_norm."
        },
    )
    loss_weights: list[float] | None = field(
        default=None, metadata={"help": "One weight per loss type (default 1.0 each)."}
    )
    beta: float = field(default=0.1, metadata={"help": "β: strength of the deviation from the reference (τ for IPO)."})
    label_smoothing: float = field(
        default=0.0,
        metadata={"help": "Label-flip probability for robust (in [0, 0.5)), ε for exo_pair (> 0), smoothing for aot."},
    )
    f_divergence_type: str = field(
        default="reverse_kl",
        metadata={
            "help": "f-divergence of the implicit reward: reverse_kl (DPO), forward_kl, js_divergence, "
            "alpha_divergence.",
            "choices": ["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"],
        },
    )
    f_alpha_divergence_coef: float = field(default=0.5, metadata={"help": "α of alpha_divergence."})
    ld_alpha: float | None = field(
        default=None,
        metadata={
            "help": "LD-DPO: weight of the completion tokens beyond the shorter completion's length (None: off)."
        },
    )
    use_weighting: bool = field(
        default=False, metadata={"help": "WPO: weight each pair by its (detached) probability under the policy."}
    )
    discopop_tau: float = field(default=0.05, metadata={"help": "τ of the discopop loss."})

    def __post_init__(self):
        if isinstance(self.loss_type, str):
            self.loss_type = [self.loss_type]
        self.loss_type = list(self.loss_type)
        if self.truncation_mode not in ("keep_start", "keep_end"):
            raise ValueError(f"truncation_mode must be 'keep_start' or 'keep_end', got {self.truncation_mode!r}.")
        if self.truncation_mode == "keep_end":
            warnings.warn(
                "truncation_mode='keep_end' is deprecated (as in TRL) and will be removed; use 'keep_start'.",
                FutureWarning,
                stacklevel=3,
            )
        if self.padding_free:
            warnings.warn(
                "padding_free=True is not supported by DPOTrainer yet (TRL disables it too); batches are padded.",
                UserWarning,
                stacklevel=3,
            )
            self.padding_free = False
        F_DIVERGENCES.get(self.f_divergence_type)  # unknown names: ValueError listing the valid ones
        validate_dpo_loss_config(
            self.loss_type, self.loss_weights, label_smoothing=self.label_smoothing, use_weighting=self.use_weighting
        )
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha must lie in [0, 1] (or be None), got {self.ld_alpha}.")
        if self.sync_ref_model and self.precompute_ref_log_probs:
            raise ValueError(
                "sync_ref_model=True cannot be combined with precompute_ref_log_probs=True: a synced reference changes "
                "during training. Set one of them to False."
            )
        if self.precompute_ref_batch_size is not None and self.precompute_ref_batch_size < 1:
            raise ValueError(f"precompute_ref_batch_size must be >= 1, got {self.precompute_ref_batch_size}.")
        super().__post_init__()


# ---------------------------------------------------------------------------------------------------------------
# Pieces shared with KTOTrainer and RewardTrainer
# ---------------------------------------------------------------------------------------------------------------


def coerce_config(args: Any, config_cls: type, model: Any, suffix: str) -> Any:
    """The trainer's config: ``args`` itself, a plain ``TrainingArguments`` converted to ``config_cls`` (its values
    kept, the method's own fields at their defaults), or a default ``config_cls(output_dir=f"{model_name}-{suffix}")``
    when ``args`` is None (TRL's default output directory)."""
    if args is None:
        return config_cls(output_dir=f"{model_name(model)}-{suffix}")
    if isinstance(args, config_cls):
        return args
    if isinstance(args, TrainingArguments):
        values = args.to_dict()
        names = {f.name for f in dataclasses.fields(config_cls) if f.init}
        kwargs = {k: v for k, v in values.items() if k in names and not k.startswith("_")}
        if "hub_token" in names:  # to_dict() redacts it
            kwargs["hub_token"] = getattr(args, "hub_token", None)
        return config_cls(**kwargs)
    raise TypeError(f"args must be a {config_cls.__name__} or TrainingArguments, got {type(args).__name__}.")


@dataclass
class CompletionScores:
    """Per-token results of one scored forward pass, all ``(B, T)`` aligned with ``input_ids`` (position t holds
    the quantity for ``input_ids[:, t]`` predicted from ``< t``; unscored positions hold 0).

    Attributes:
        logps: float32 log-probs, differentiable.
        mask: bool, the scored completion positions.
        entropy: detached entropies, or None.
        correct: bool top-1 hits, or None.
        mean_logits: detached mean over the vocabulary of the logits that predict each token, or None.
        wpo_log_normalizer: detached ``logsumexp(2z) − 2·logsumexp(z)`` per token (WPO), or None.
        aux_loss: MoE load-balancing loss reported by the model, or None.
    """

    logps: torch.Tensor
    mask: torch.Tensor
    entropy: torch.Tensor | None = None
    correct: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    wpo_log_normalizer: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None

    def sequence_sums(self) -> torch.Tensor:
        """Σ_t logp over the scored positions of each row → ``(B,)``."""
        return (self.logps * self.mask).sum(dim=-1)


def _head_linear(head: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if isinstance(head, torch.nn.Linear) and type(head).forward is torch.nn.Linear.forward:
        return head.weight, head.bias
    return None


@dataclass
class _HeadStats:
    mean: torch.Tensor | None = None  # (N,) mean logit per position
    norm: torch.Tensor | None = None  # (N,) WPO log-normaliser per position
    top1: torch.Tensor | None = None  # (N,) argmax token per position (-1 where not requested)


@torch.no_grad()
def _head_stats(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    *,
    mean_logits: bool,
    wpo: bool,
    argmax_mask: torch.Tensor | None,
    chunk_size: int,
) -> _HeadStats:
    """Mean logit, WPO normaliser and top-1 token of the head's logits at each row of ``hidden`` (N, H), a chunk of
    rows at a time (never (N, V) logits).

    For a plain linear head the mean logit is exact and cheap: mean_v(h·W_v + b_v) = h·mean_v(W) + mean_v(b), so no
    logits are needed for it. WPO needs every position's full distribution; the top-1 token is computed only where
    ``argmax_mask`` (N,) is True (e.g. DPO's chosen rows), inside the same pass when WPO runs anyway. Heads that are
    not a plain ``nn.Linear`` (a PEFT wrapper on ``lm_head``) are applied as modules.
    """
    linear = _head_linear(head)
    out = _HeadStats()
    if mean_logits and linear is not None:
        weight, bias = linear
        out.mean = hidden.float() @ weight.float().mean(dim=0)
        if bias is not None:
            out.mean = out.mean + bias.float().mean()
    all_rows = wpo or (mean_logits and linear is None)
    if not all_rows and argmax_mask is None:
        return out
    n = hidden.shape[0]
    rows = torch.arange(n, device=hidden.device) if all_rows else argmax_mask.nonzero().squeeze(-1)
    if all_rows and mean_logits and linear is None:
        out.mean = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    if wpo:
        out.norm = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    if argmax_mask is not None:
        out.top1 = torch.full((n,), -1, dtype=torch.long, device=hidden.device)
    w32 = None if linear is None else linear[0].float()
    b32 = None if linear is None or linear[1] is None else linear[1].float()
    for start in range(0, rows.numel(), chunk_size):
        idx = rows[start : start + chunk_size]
        h = hidden[idx]
        if w32 is None:
            z = head(h).float()
        else:
            z = h.float() @ w32.T if b32 is None else torch.addmm(b32, h.float(), w32.T)
        if mean_logits and linear is None:
            out.mean[idx] = z.mean(dim=-1)
        if wpo:
            out.norm[idx] = torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1)
        if argmax_mask is not None:
            keep = argmax_mask[idx]
            out.top1[idx[keep]] = z[keep].argmax(dim=-1)
    return out


def _place(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scatter per-position values (N,) into a zero (B, T) float32 tensor at the True positions of ``mask``."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_scatter(mask, values.float())


def score_completions(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    compute_entropy: bool = False,
    compute_accuracy: bool = False,
    compute_mean_logits: bool = False,
    compute_wpo: bool = False,
    accuracy_rows: torch.Tensor | None = None,
    chunk_size: int = 1024,
) -> CompletionScores:
    """Per-token log-probs of the completion tokens of right-padded ``(B, T)`` sequences, plus optional statistics.

    The log-probs, entropy and top-1 hits come from :func:`posttrain.trainers._forward.forward_token_stats` (chunked
    path, no ``(B, T, V)`` logits). The mean logits and WPO normalisers need the last hidden states, which a forward
    pre-hook on the LM head captures (detached) on the way; they are computed from the scored positions only.

    Args:
        model: Causal LM (plain, PEFT or accelerator-wrapped).
        input_ids: ``(B, T)`` prompt+completion ids.
        attention_mask: ``(B, T)`` padding mask.
        completion_mask: ``(B, T)`` 1 on completion tokens.
        compute_entropy: Also return entropies (detached).
        compute_accuracy: Also return top-1 hits at every scored position.
        compute_mean_logits: Also return the mean logit per scored token (``logits/*`` metrics).
        compute_wpo: Also return the WPO log-normaliser per scored token.
        accuracy_rows: ``(B,)`` bool: return top-1 hits for these rows only (e.g. DPO's chosen half), computed in
            the statistics pass over the captured hidden states — half the LM-head work of ``compute_accuracy``.
        chunk_size: Tokens per chunk of the LM-head computations.
    """
    captured: dict[str, torch.Tensor] = {}
    handle = None
    head = None
    if compute_mean_logits or compute_wpo or accuracy_rows is not None:
        head = unwrap_model(model).get_output_embeddings()
        if head is not None:

            def capture(module, args, kwargs):
                hidden = args[0] if args else kwargs.get("input")
                captured.setdefault("hidden", hidden.detach())

            handle = head.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        stats: TokenStats = forward_token_stats(
            model,
            input_ids,
            attention_mask,
            labels_mask=completion_mask,
            compute_entropy=compute_entropy,
            compute_accuracy=compute_accuracy,
            chunk_size=chunk_size,
        )
    finally:
        if handle is not None:
            handle.remove()
    scores = CompletionScores(
        logps=stats.logps, mask=stats.mask, entropy=stats.entropy, correct=stats.correct, aux_loss=stats.aux_loss
    )
    hidden = captured.get("hidden")
    if head is not None and hidden is not None and hidden.dim() == 3 and hidden.shape[1] >= input_ids.shape[1]:
        hidden = hidden[:, -input_ids.shape[1] :]
        sel = stats.mask[:, 1:]  # position t-1 predicts token t
        argmax_mask = None
        if accuracy_rows is not None:
            argmax_mask = accuracy_rows.to(sel.device).unsqueeze(1).expand_as(sel)[sel]
        head_stats = _head_stats(
            hidden[:, :-1][sel],
            head,
            mean_logits=compute_mean_logits,
            wpo=compute_wpo,
            argmax_mask=argmax_mask,
            chunk_size=chunk_size,
        )
        pad = torch.nn.functional.pad
        if head_stats.mean is not None:
            scores.mean_logits = pad(_place(head_stats.mean, sel), (1, 0))
        if head_stats.norm is not None:
            scores.wpo_log_normalizer = pad(_place(head_stats.norm, sel), (1, 0))
        if head_stats.top1 is not None:
            hits = (head_stats.top1 == input_ids[:, 1:][sel]).float()
            scores.correct = pad(_place(hits, sel), (1, 0)).bool()
    if (compute_wpo and scores.wpo_log_normalizer is None) or (accuracy_rows is not None and scores.correct is None):
        raise RuntimeError(
            "WPO weights and row-restricted accuracy need the LM head's input hidden states, but the model's output "
            "embeddings were not called with them; this model is not supported for them."
        )
    return scores


def gather_mean(accelerator: Any, values: torch.Tensor) -> float:
    """Mean of ``values`` over every process (NaN when there are none)."""
    values = accelerator.gather_for_metrics(values.detach().float().reshape(-1))
    return values.mean().item() if values.numel() else float("nan")


def gather_masked_mean(accelerator: Any, values: torch.Tensor, mask: torch.Tensor) -> float:
    """Σ values·mask / Σ mask over every process (NaN when the mask is empty everywhere)."""
    mask = mask.float()
    totals = torch.stack([(values.detach().float() * mask).sum(), mask.sum()])
    totals = accelerator.gather(totals.unsqueeze(0)).sum(dim=0)
    return (totals[0] / totals[1]).item() if totals[1] > 0 else float("nan")


def activation_offloading_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Keep tensors saved for backward in (pinned, on GPU) CPU memory when ``enabled``."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available())


def resolve_pad_token(processing_class: Any, pad_token: str | None) -> int:
    """The pad id for collators; the deprecated config ``pad_token`` overrides the tokenizer's (with a warning)."""
    tok = getattr(processing_class, "tokenizer", processing_class)
    if pad_token is not None:
        warnings.warn(
            "The `pad_token` config field is deprecated (as in TRL); set `tokenizer.pad_token` instead.",
            FutureWarning,
            stacklevel=3,
        )
        pad_id = tok.convert_tokens_to_ids(pad_token)
        if pad_id is None or pad_id == getattr(tok, "unk_token_id", object()):
            raise ValueError(
                f"pad_token {pad_token!r} is not in the tokenizer's vocabulary; choose an existing token."
            )
        return pad_id
    return tok.pad_token_id


def is_iterable_dataset(dataset: Any) -> bool:
    import datasets

    return isinstance(dataset, datasets.IterableDataset)


def map_dataset(dataset: Any, fn: Callable, args: Any, desc: str, **kwargs) -> Any:
    """``dataset.map`` with ``dataset_num_proc`` and a progress description (not for IterableDataset)."""
    if not is_iterable_dataset(dataset):
        kwargs.update(num_proc=getattr(args, "dataset_num_proc", None), desc=desc)
    return dataset.map(fn, **kwargs)


def tokenize_dataset(dataset: Any, tokenize_fn: Callable, tokenizer: Any, args: Any, name: str, *, add_eos: bool):
    """Tokenize every row with ``tokenize_fn(row, tokenizer, add_eos=..., row_index=i)`` (data errors name the row);
    per-row ``tools`` / ``chat_template_kwargs`` columns are read by the tokenize functions."""
    from posttrain.data.tokenization import map_with_row_index

    kwargs = {} if is_iterable_dataset(dataset) else {"num_proc": args.dataset_num_proc, "desc": f"Tokenizing {name}"}
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    return map_with_row_index(dataset, tokenize_fn, fn_kwargs={"tokenizer": tok, "add_eos": add_eos}, **kwargs)


def filter_dataset(dataset: Any, fn: Callable, args: Any, desc: str) -> Any:
    kwargs = (
        {} if is_iterable_dataset(dataset) else {"num_proc": getattr(args, "dataset_num_proc", None), "desc": desc}
    )
    return dataset.filter(fn, **kwargs)


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


class _PromptFits:
    """Picklable filter: keep rows whose prompt leaves room for at least one completion token."""

    def __init__(self, max_length: int):
        self.max_length = max_length

    def __call__(self, row: Mapping[str, Any]) -> bool:
        from posttrain.data.tokenization import prompt_overflows

        return not prompt_overflows(len(row["prompt_ids"]), self.max_length)


class DPOTrainer(BaseTrainer):
    """Trainer for Direct Preference Optimization (https://huggingface.co/papers/2305.18290) and its variants.

    Args:
        model: Hub id / local path (loaded with ``args.model_init_kwargs``, float32 by default), a
            ``PreTrainedModel`` or a ``PeftModel``.
        ref_model: Reference policy: a model, a hub id / path, or None (PEFT: the base model with adapters disabled;
            otherwise a frozen copy of ``model``; with ``precompute_ref_log_probs`` no copy at all).
        args: ``DPOConfig``; a plain ``TrainingArguments`` is converted; None → ``DPOConfig(f"{model_name}-DPO")``.
        data_collator: Defaults to ``DataCollatorForPreference`` (per-sequence truncation to ``max_length``).
        train_dataset: Preference dataset (``prompt``/``chosen``/``rejected`` or implicit prompt), or pre-tokenized
            ``prompt_ids``/``chosen_ids``/``rejected_ids``.
        eval_dataset: Same format, or a dict of them.
        processing_class: Tokenizer; None loads it from the model's path.
        compute_metrics: Receives ``EvalPrediction`` whose predictions are the per-pair ``(rewards/chosen,
            rewards/rejected)`` and labels are zeros (index of the chosen column).
        callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics: As ``transformers.Trainer``.
        peft_config: A ``peft.PeftConfig`` to wrap ``model`` with.
    """

    _tag_names = ["trl", "dpo"]
    loss_is_scaled_for_ga = False  # the loss is a mean over pairs; Trainer divides by the accumulation steps
    _signature_columns_extra = ("prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps")

    def __init__(
        self,
        model: str | torch.nn.Module,
        ref_model: str | torch.nn.Module | None = None,
        args: DPOConfig | TrainingArguments | None = None,
        data_collator: Callable | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Callable | None = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        optimizer_cls_and_kwargs: tuple | None = None,
        preprocess_logits_for_metrics: Callable | None = None,
        peft_config: Any = None,
    ):
        args = coerce_config(args, DPOConfig, model, "DPO")
        model_id = model if isinstance(model, str) else None
        processing_class = resolve_processing_class(model, processing_class)
        policy = resolve_model(model, args, peft_config=peft_config)
        if args.disable_dropout:
            disable_dropout_in_model(policy)
        self.reference = create_reference_policy(
            policy,
            ref_model,
            precompute=args.precompute_ref_log_probs,
            sync_ref_model=args.sync_ref_model,
            adapter_created_by_trainer=peft_config is not None,
            reload_from=model_id,
            model_init_kwargs=args.model_init_kwargs,
        )
        if self.reference.model is not None and args.disable_dropout:
            disable_dropout_in_model(self.reference.model)
        enable_router_aux_loss(policy)
        configure_iterable_dataset(args, train_dataset)

        self.pad_token_id = resolve_pad_token(processing_class, args.pad_token)
        if data_collator is None:
            from posttrain.data.collators import DataCollatorForPreference

            data_collator = DataCollatorForPreference(
                pad_token_id=self.pad_token_id,
                pad_to_multiple_of=args.pad_to_multiple_of,
                max_length=args.max_length,
                truncation_mode=args.truncation_mode,
            )
        if args.precompute_ref_log_probs and any(
            is_iterable_dataset(d) for d in _datasets(train_dataset) + _datasets(eval_dataset)
        ):
            raise ValueError(
                "precompute_ref_log_probs=True is not supported with an IterableDataset (train or eval): the "
                "reference log-probs are stored as dataset columns. Use a map-style Dataset or set it to False."
            )
        check_single_split(train_dataset, "train_dataset")
        train_dataset = self._prepare_any(train_dataset, processing_class, args, "train")
        eval_dataset = self._prepare_any(eval_dataset, processing_class, args, "eval")

        super().__init__(
            model=policy,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        self.model_accepts_loss_kwargs = False
        self._total_train_tokens = 0
        self.reference.prepare(self.accelerator)
        if args.sync_ref_model:
            self.add_callback(SyncRefModelCallback(ref_model=self.reference.model, accelerator=self.accelerator))
        if args.precompute_ref_log_probs:
            self._precompute_reference()

    # -- data ----------------------------------------------------------------------------------------------------
    def _prepare_any(self, dataset: Any, processing_class: Any, args: DPOConfig, name: str) -> Any:
        if isinstance(dataset, dict):
            return {k: self._prepare_dataset(v, processing_class, args, f"{name}/{k}") for k, v in dataset.items()}
        return self._prepare_dataset(dataset, processing_class, args, name)

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: DPOConfig, name: str) -> Any:
        """Validate the format, tokenize (extracting implicit prompts) and drop rows whose prompt fills max_length."""
        if dataset is None:
            return None
        from posttrain.data.formats import PREFERENCE, TOKENIZED_PREFERENCE, validate_format
        from posttrain.data.tokenization import tokenize_preference

        fmt = validate_format(dataset, [PREFERENCE, TOKENIZED_PREFERENCE], trainer="DPOTrainer")
        if fmt.type == PREFERENCE:
            dataset = tokenize_dataset(
                dataset, tokenize_preference, processing_class, args, f"{name} dataset", add_eos=not fmt.conversational
            )
        elif fmt.implicit_prompt:
            dataset = map_dataset(dataset, _add_empty_prompt, args, f"Adding empty prompt_ids to {name} dataset")
        if args.max_length is not None and args.truncation_mode == "keep_start":
            dataset = filter_dataset(dataset, _PromptFits(args.max_length), args, f"Dropping long prompts ({name})")
        return dataset

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(self._signature_columns_extra)

    # -- reference -----------------------------------------------------------------------------------------------
    def _sequence_logps(self, scores: CompletionScores) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) per-pair log-probs from a ``(2B, T)`` scored batch: sums, or LD-DPO weighted."""
        half = scores.logps.shape[0] // 2
        if self.args.ld_alpha is None:
            sums = scores.sequence_sums()
            return sums[:half], sums[half:]
        m = scores.mask
        return ld_weighted_logps(
            scores.logps[:half], m[:half], scores.logps[half:], m[half:], float(self.args.ld_alpha)
        )

    def _reference_logps(self, model: torch.nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        if "ref_chosen_logps" in inputs and "ref_rejected_logps" in inputs:
            return inputs["ref_chosen_logps"].float(), inputs["ref_rejected_logps"].float()
        if not self.reference.needs_forward:
            raise ValueError(
                "The batch has no ref_chosen_logps / ref_rejected_logps columns but the reference model was freed "
                "after precomputation. Do not pass datasets without the precomputed columns to this trainer."
            )
        with torch.no_grad(), self.reference.activate(model) as ref_model:
            scores = score_completions(
                ref_model, inputs["input_ids"], inputs["attention_mask"], inputs["completion_mask"]
            )
        chosen, rejected = self._sequence_logps(scores)
        return chosen.detach(), rejected.detach()

    def _precompute_reference(self) -> None:
        """Add ``ref_chosen_logps`` / ``ref_rejected_logps`` columns to the datasets, then free the reference."""

        def compute(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
            chosen, rejected = self._reference_logps(self.model, batch)
            return {"ref_chosen_logps": chosen, "ref_rejected_logps": rejected}

        precompute_reference_columns(
            self, compute, input_columns=self._signature_columns_extra[:3], marker_column="ref_chosen_logps"
        )

    # -- loss ----------------------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if model.training else "eval"
        args = self.args
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        completion_mask = inputs["completion_mask"]
        half = input_ids.shape[0] // 2
        # Reference first: its no-grad activations are freed before the policy's autograd graph is built.
        ref_chosen, ref_rejected = self._reference_logps(model, inputs)
        with activation_offloading_context(args.activation_offloading):
            scores = score_completions(
                model,
                input_ids,
                attention_mask,
                completion_mask,
                compute_entropy=True,
                compute_mean_logits=True,
                compute_wpo=args.use_weighting,
                accuracy_rows=torch.arange(input_ids.shape[0], device=input_ids.device) < half,
            )
        chosen_logps, rejected_logps = self._sequence_logps(scores)
        lengths = scores.mask.sum(dim=-1).float()
        chosen_nll = None
        if "sft" in args.loss_type:
            chosen_mask = scores.mask[:half]
            chosen_nll = -(scores.logps[:half] * chosen_mask).sum() / chosen_mask.sum().clamp(min=1)
        weights = None
        if args.use_weighting:
            seq_w = wpo_sequence_weight(scores.logps.detach(), scores.wpo_log_normalizer, scores.mask)
            weights = wpo_pair_weight(seq_w[:half], seq_w[half:])
        loss, out = dpo_loss(
            DPOLossInputs(
                chosen_logps=chosen_logps,
                rejected_logps=rejected_logps,
                ref_chosen_logps=ref_chosen.to(chosen_logps.dtype),
                ref_rejected_logps=ref_rejected.to(rejected_logps.dtype),
                chosen_lengths=lengths[:half],
                rejected_lengths=lengths[half:],
                chosen_nll=chosen_nll,
            ),
            args.loss_type,
            args.loss_weights,
            beta=args.beta,
            label_smoothing=args.label_smoothing,
            f_divergence_type=args.f_divergence_type,
            f_alpha_divergence_coef=args.f_alpha_divergence_coef,
            discopop_tau=args.discopop_tau,
            weights=weights,
        )
        aux_coef = _router_aux_loss_coef(model)
        if scores.aux_loss is not None and aux_coef:
            loss = loss + aux_coef * scores.aux_loss
            self._metrics[mode]["aux_loss"].append(gather_mean(self.accelerator, scores.aux_loss))
        self._log_dpo_metrics(mode, inputs, scores, chosen_logps, rejected_logps, out)
        if return_outputs:
            return loss, {"chosen_rewards": out["chosen_rewards"], "rejected_rewards": out["rejected_rewards"]}
        return loss

    def _log_dpo_metrics(self, mode, inputs, scores, chosen_logps, rejected_logps, out) -> None:
        acc = self.accelerator
        half = scores.logps.shape[0] // 2
        metrics = self._metrics[mode]
        if mode == "train":
            self._total_train_tokens += int(acc.gather(inputs["attention_mask"].sum().reshape(1)).sum().item())
            metrics["num_tokens"] = [float(self._total_train_tokens)]
        mask = scores.mask
        metrics["entropy"].append(gather_masked_mean(acc, scores.entropy, mask))
        metrics["mean_token_accuracy"].append(gather_masked_mean(acc, scores.correct.float()[:half], mask[:half]))
        if scores.mean_logits is not None:
            metrics["logits/chosen"].append(gather_masked_mean(acc, scores.mean_logits[:half], mask[:half]))
            metrics["logits/rejected"].append(gather_masked_mean(acc, scores.mean_logits[half:], mask[half:]))
        chosen_r, rejected_r = out["chosen_rewards"], out["rejected_rewards"]
        metrics["rewards/chosen"].append(gather_mean(acc, chosen_r))
        metrics["rewards/rejected"].append(gather_mean(acc, rejected_r))
        metrics["rewards/accuracies"].append(gather_mean(acc, (chosen_r > rejected_r).float()))
        metrics["rewards/margins"].append(gather_mean(acc, chosen_r - rejected_r))
        metrics["logps/chosen"].append(gather_mean(acc, chosen_logps))
        metrics["logps/rejected"].append(gather_mean(acc, rejected_logps))

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, out = self.compute_loss(model, inputs, return_outputs=True)
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        logits = torch.stack([out["chosen_rewards"], out["rejected_rewards"]], dim=1)
        labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
        return loss, logits, labels


def _datasets(dataset: Any) -> list[Any]:
    if dataset is None:
        return []
    return list(dataset.values()) if isinstance(dataset, dict) else [dataset]


def _add_empty_prompt(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"prompt_ids": []}


def enable_router_aux_loss(model: torch.nn.Module) -> bool:
    """Turn on a MoE model's router logits when its ``router_aux_loss_coef`` is nonzero (TRL), so the forward
    returns the load-balancing ``aux_loss`` that the trainer adds as ``coef · aux_loss``. Dense models: no-op."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None or not hasattr(config, "output_router_logits"):
        return False
    if not getattr(config, "router_aux_loss_coef", 0.0):
        return False
    config.output_router_logits = True
    return True


def configure_iterable_dataset(args: Any, train_dataset: Any) -> None:
    """A streaming train set cannot be dispatched from the main process as a whole batch of columns: switch
    ``accelerator_config.dispatch_batches`` off (with a warning), as TRL does. ``max_steps`` is required by Trainer."""
    if train_dataset is None or not is_iterable_dataset(train_dataset):
        return
    if getattr(args.accelerator_config, "dispatch_batches", None) is not False:
        warnings.warn(
            "The train dataset is an IterableDataset: setting accelerator_config.dispatch_batches=False so each "
            "process reads its own batches.",
            UserWarning,
            stacklevel=3,
        )
        args.accelerator_config.dispatch_batches = False


def _router_aux_loss_coef(model: torch.nn.Module) -> float:
    """``router_aux_loss_coef`` of a MoE model that outputs router logits, else 0 (dense models: no aux loss)."""
    config = getattr(unwrap_model(model), "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
