"""What the offline preference trainers (DPO, KTO, Reward) share: config fields, policy + reference setup, and
``PreferenceTrainer``, their common ``BaseTrainer`` subclass.

- :func:`shared_field`: the options the configs share (one default, one help text);
  :func:`check_reference_options` validates the reference ones.
- Completion scoring (per-token log-probs, entropy, top-1 hits, mean logits, WPO normalisers) lives with the models:
  :func:`posttrain.models.preference_scoring.score_preference_completions`.
- Metric reductions over processes live in :mod:`posttrain.distributed`; dataset helpers (``Dataset`` and
  ``IterableDataset``) in :mod:`posttrain.data.dataset_ops`.
- :func:`load_policy_and_reference`: the policy, its tokenizer and the reference policy (DPO, KTO).
- :class:`PreferenceTrainer`: signature columns, reference attachment, ``num_tokens``, the MoE ``aux_loss`` term
  and ``prediction_step``.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import field
from typing import Any

import torch

from posttrain.distributed import gather_mean
from posttrain.models.loading import (
    disable_dropout_in_model,
    resolve_model,
    resolve_processing_class,
    resolve_router_aux_loss_coef,
)
from posttrain.models.reference import ReferencePolicy, SyncRefModelCallback, create_reference_policy
from posttrain.models.unwrap import unwrap_base_model
from posttrain.trainers.base import PAD_TO_MULTIPLE_OF_HELP, BaseTrainer

__all__ = [
    "PreferenceTrainer",
    "activation_offloading_context",
    "check_reference_options",
    "enable_router_aux_loss",
    "load_policy_and_reference",
    "pair_predictions",
    "resolve_pad_token",
    "router_aux_loss_coef",
    "shared_field",
]

# ---------------------------------------------------------------------------------------------------------------
# Config fields
# ---------------------------------------------------------------------------------------------------------------

# name -> (default, help) of the options that mean the same in DPOConfig, KTOConfig and RewardConfig.
_SHARED_FIELDS: dict[str, tuple[Any, str]] = {
    "disable_dropout": (True, "Disable dropout in the policy and reference."),
    "trust_remote_code": (False, "Allow models and tokenizers with custom code from the hub (`model` as a string)."),
    "router_aux_loss_coef": (
        None,
        "Weight of the MoE router load-balancing loss (logged as `aux_loss`). None: the model's own "
        "`router_aux_loss_coef` (0 for dense models).",
    ),
    "dataset_num_proc": (None, "Processes used to tokenize the dataset."),
    "pad_to_multiple_of": ("auto", PAD_TO_MULTIPLE_OF_HELP),
    "pad_token": (None, "Deprecated: set the tokenizer's pad token before building the trainer."),
    "activation_offloading": (False, "Keep activations saved for backward in CPU memory (save_on_cpu)."),
    "precompute_ref_log_probs": (
        False,
        "Compute the reference log-probs of the whole dataset in one pass before training (stored as dataset "
        "columns), then free the reference: no reference forward during training. Not for IterableDataset.",
    ),
    "precompute_ref_batch_size": (
        None,
        "Batch size of the precompute pass; None: the per-device train / eval batch size.",
    ),
    "sync_ref_model": (False, "TR-DPO: mix the policy into the reference every ref_model_sync_steps steps."),
    "ref_model_mixup_alpha": (0.6, "TR-DPO α: ref ← α·policy + (1−α)·ref."),
    "ref_model_sync_steps": (512, "TR-DPO: steps between reference syncs."),
}


def shared_field(name: str) -> Any:
    """The dataclass field (default and ``help``) of an option the preference configs share, documented once::

    sync_ref_model: bool = shared_field("sync_ref_model")
    """
    default, help_text = _SHARED_FIELDS[name]
    return field(default=default, metadata={"help": help_text})


def check_reference_options(config: Any) -> None:
    """Config checks shared by DPOConfig and KTOConfig: a synced reference cannot be precomputed, and the precompute
    batch size must be positive."""
    if config.sync_ref_model and config.precompute_ref_log_probs:
        raise ValueError(
            "sync_ref_model=True cannot be combined with precompute_ref_log_probs=True: a synced reference changes "
            "during training. Set one of them to False."
        )
    if config.precompute_ref_batch_size is not None and config.precompute_ref_batch_size < 1:
        raise ValueError(f"precompute_ref_batch_size must be >= 1, got {config.precompute_ref_batch_size}.")


# ---------------------------------------------------------------------------------------------------------------
# Model setup
# ---------------------------------------------------------------------------------------------------------------


def load_policy_and_reference(
    model: str | torch.nn.Module,
    ref_model: str | torch.nn.Module | None,
    args: Any,
    processing_class: Any,
    peft_config: Any,
    quantization_config: Any = None,
) -> tuple[Any, torch.nn.Module, ReferencePolicy]:
    """``(processing_class, policy, reference)`` for a trainer that compares a policy with a reference (DPO, KTO).

    Loads the tokenizer (from the model's path when ``processing_class`` is None) and the policy (a string is
    loaded with ``quantization_config``; wrapped with ``peft_config``), builds the reference per ``args`` (:func:`posttrain.models.reference.create_reference_policy`:
    explicit, adapters disabled, frozen copy, precomputed or synced), disables dropout in both when
    ``args.disable_dropout``, and switches on a MoE policy's router logits (:func:`enable_router_aux_loss`).
    """
    model_id = model if isinstance(model, str) else None
    processing_class = resolve_processing_class(
        model, processing_class, trust_remote_code=getattr(args, "trust_remote_code", False)
    )
    policy = resolve_model(model, args, peft_config=peft_config, quantization_config=quantization_config)
    if args.disable_dropout:
        disable_dropout_in_model(policy)
    reference = create_reference_policy(
        policy,
        ref_model,
        precompute=args.precompute_ref_log_probs,
        sync_ref_model=args.sync_ref_model,
        adapter_created_by_trainer=peft_config is not None,
        reload_from=model_id,
        model_init_kwargs=args.model_init_kwargs,
    )
    if reference.model is not None and args.disable_dropout:
        disable_dropout_in_model(reference.model)
    enable_router_aux_loss(policy, resolve_router_aux_loss_coef(args, policy))
    return processing_class, policy, reference


def enable_router_aux_loss(model: torch.nn.Module, coef: float | None = None) -> bool:
    """Turn on a MoE model's router logits when the aux-loss coefficient (``coef``, default: the model's
    ``router_aux_loss_coef``) is nonzero (TRL), so the forward returns the load-balancing ``aux_loss`` that the
    trainer adds as ``coef · aux_loss``. Dense models: no-op."""
    config = getattr(unwrap_base_model(model), "config", None)
    if config is None or not hasattr(config, "output_router_logits"):
        return False
    if coef is None:
        coef = getattr(config, "router_aux_loss_coef", 0.0)
    if not coef:
        return False
    config.output_router_logits = True
    config.router_aux_loss_coef = coef
    return True


def router_aux_loss_coef(model: torch.nn.Module) -> float:
    """``router_aux_loss_coef`` of a MoE model that outputs router logits, else 0 (dense models: no aux loss)."""
    config = getattr(unwrap_base_model(model), "config", None)
    if config is None or not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


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


def pair_predictions(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation predictions for pairwise trainers: logits ``(B, 2)`` = ``[chosen, rejected]`` (detached) and labels
    ``(B,)`` of zeros, the index of the chosen column."""
    logits = torch.stack([chosen, rejected], dim=1).detach()
    labels = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return logits, labels


# ---------------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------------


class PreferenceTrainer(BaseTrainer):
    """``BaseTrainer`` plus what DPOTrainer, KTOTrainer and RewardTrainer share.

    Subclasses set ``_signature_columns_extra`` (the columns their collator reads) and implement
    ``compute_loss(..., return_outputs=True)`` returning ``(loss, outputs)``; pairwise trainers name the reward
    outputs in ``_pair_output_keys``, others override ``_eval_predictions``.
    Trainers with a reference policy set ``self.reference`` before ``super().__init__`` and call
    :meth:`_attach_reference` after it.
    """

    loss_is_scaled_for_ga = False  # the loss is a mean over the micro-batch; Trainer divides by the GA steps
    _signature_columns_extra: tuple[str, ...] = ()
    # compute_loss's output keys holding the per-pair chosen / rejected rewards (pairwise trainers)
    _pair_output_keys: tuple[str, str] = ("chosen_rewards", "rejected_rewards")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # The loss is a mean over the micro-batch, so Trainer itself divides it by the accumulation steps.
        self.model_accepts_loss_kwargs = False
        self._total_train_tokens = 0

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(self._signature_columns_extra)

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """TRL's ``trainer.ref_model``: the separate frozen reference module, or None (PEFT policy with adapters
        disabled, precomputed reference log-probs, or no reference)."""
        reference = getattr(self, "reference", None)
        return None if reference is None else reference.model

    def _attach_reference(self) -> None:
        """Place the reference on the accelerator, add the TR-DPO sync callback (``sync_ref_model``) and fill the
        precomputed reference columns (``precompute_ref_log_probs``, via the subclass's ``_precompute_reference``)."""
        self.reference.prepare(self.accelerator)
        config = getattr(unwrap_base_model(self.model), "config", None)
        # TRL's attribute: the policy returns router logits (a MoE model), so its load-balancing loss is added
        self.aux_loss_enabled = bool(getattr(config, "output_router_logits", False))
        if self.args.sync_ref_model:
            self.add_callback(SyncRefModelCallback(ref_model=self.reference.model, accelerator=self.accelerator))
        if self.args.precompute_ref_log_probs:
            # what the reference was, so that evaluate(eval_dataset=...) can precompute a new set's columns later
            self._reference_before_precompute = (self.reference.kind, self.reference.adapter_name)
            self._precompute_reference()

    def _prepare_eval_dataset(self, dataset: Any, name: str) -> Any:
        """The constructor's preparation; with ``precompute_ref_log_probs`` also the precomputed reference columns
        (as the constructor adds them), computed with the reference the trainer had (as TRL)."""
        prepared = super()._prepare_eval_dataset(dataset, name)
        if not getattr(self.args, "precompute_ref_log_probs", False) or prepared is None:
            return prepared
        from posttrain.data.dataset_ops import check_precompute_supported
        from posttrain.models.reference import add_reference_columns

        check_precompute_supported(self.args, None, prepared)
        compute, input_columns, marker = self._reference_columns()
        if marker in prepared.column_names:
            return prepared
        batch_size = self.args.precompute_ref_batch_size or self.args.per_device_eval_batch_size
        with self._reference_for_precompute():
            return add_reference_columns(
                self, prepared, compute, input_columns=input_columns, marker_column=marker, batch_size=batch_size
            )

    @contextlib.contextmanager
    def _reference_for_precompute(self):
        """The reference policy back for one more precompute pass, where it can be had after it was released:
        the policy with its adapters off or its reference adapter (PEFT), or the policy itself before the first
        training step. A separate reference module was freed (posttrain keeps no second copy of the weights)."""
        if self.reference.needs_forward:
            yield
            return
        kind, adapter_name = getattr(self, "_reference_before_precompute", ("precomputed", None))
        recoverable = kind in ("adapters_disabled", "adapter") or (
            kind == "initial_policy" and self.state.global_step == 0
        )
        if not recoverable:
            raise ValueError(
                "Cannot compute reference log-probs for a dataset passed to `evaluate()`: with "
                "precompute_ref_log_probs=True posttrain frees the reference once its log-probs are precomputed"
                + (
                    ", and after training has started the policy is no longer the reference"
                    if kind == "initial_policy"
                    else " (the separate ref_model)"
                )
                + ". Provide this dataset as `eval_dataset` at initialization, or set precompute_ref_log_probs=False."
            )
        released = self.reference
        self.reference = ReferencePolicy(kind, adapter_name=adapter_name)
        try:
            yield
        finally:
            self.reference = released

    def _count_train_tokens(self, inputs: dict[str, Any], mode: str) -> None:
        """TRL's ``num_tokens``: cumulative count of attended (non-pad) tokens over every process, training only."""
        if mode != "train":
            return
        acc = self.accelerator
        self._total_train_tokens += int(acc.gather(inputs["attention_mask"].sum().reshape(1)).sum().item())
        self.record_metric("num_tokens", float(self._total_train_tokens), mode, replace=True)

    def _add_router_aux_loss(
        self, loss: torch.Tensor, model: torch.nn.Module, aux_loss: torch.Tensor | None, mode: str
    ) -> torch.Tensor:
        """``loss + router_aux_loss_coef · aux_loss`` for a MoE model that returns its load-balancing loss (logged as
        ``aux_loss``, averaged over processes); ``loss`` unchanged for dense models. Configs without a
        ``router_aux_loss_coef`` field (the experimental CPO/ORPO/TPO) use the model's own."""
        coef = getattr(self.args, "router_aux_loss_coef", None)
        coef = router_aux_loss_coef(model) if coef is None else coef
        if aux_loss is None or not coef or not getattr(self, "aux_loss_enabled", True):
            return loss
        self.record_metric("aux_loss", gather_mean(self.accelerator, aux_loss), mode)
        return loss + coef * aux_loss

    def _eval_predictions(self, outputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(predictions, labels)`` for ``compute_metrics`` from ``compute_loss``'s outputs: by default the pair
        rewards named by ``_pair_output_keys`` stacked ``(B, 2)`` with zero labels (:func:`pair_predictions`)."""
        chosen_key, rejected_key = self._pair_output_keys
        return pair_predictions(outputs[chosen_key], outputs[rejected_key])

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True)
        loss = loss.detach()
        if prediction_loss_only:
            return loss, None, None
        return (loss, *self._eval_predictions(outputs))
