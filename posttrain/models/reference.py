"""The reference policy π_ref shared by DPO, KTO, GRPO and RLOO, and TR-DPO's reference sync callback.

A trainer asks :func:`create_reference_policy` for a :class:`ReferencePolicy` and later runs its reference forward
passes inside ``with reference.activate(policy) as ref_model:``. Where the weights come from is decided once, in
this order (TRL's rules, features.md §B4 and §I):

1. ``ref_model`` given (a module or a hub id / path) → that model, frozen (``kind="model"``).
2. The policy is a PEFT model → no second copy of the weights:
   - the adapter was created by the trainer (``peft_config``) → the base model with adapters disabled
     (``kind="adapters_disabled"``);
   - the user passed an already-adapted ``PeftModel`` → a frozen copy of its active adapter, named ``"ref"``, is
     activated for reference passes (``kind="adapter"``), so the reference is the adapter the user started from.
     LoRA with ``target_parameters`` cannot host a second adapter (peft#3340): adapters are disabled instead, with a
     warning.
3. ``precompute`` (reference log-probs computed once before training) → the policy itself, before its first update,
   *is* the reference (``kind="initial_policy"``): no copy is made at all. TRL loads a fresh copy here; the values are
   identical and the memory is not needed. After the pass the trainer calls :meth:`ReferencePolicy.release`.
4. Otherwise → a frozen copy of the policy (``kind="model"``): loaded again from ``reload_from`` when the policy was
   given as a hub id / path (TRL loads a fresh copy, which also works for quantized models), else a deep copy.

``required=False`` (GRPO/RLOO with β = 0) gives ``kind="none"`` and loads nothing.

:class:`SyncRefModelCallback` implements TR-DPO (https://huggingface.co/papers/2404.09656): every
``args.ref_model_sync_steps`` optimizer steps, ``ref ← α·θ + (1 − α)·ref`` with α = ``args.ref_model_mixup_alpha``.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from transformers import TrainerCallback

from posttrain.models.peft_utils import add_reference_adapter, is_peft_model, use_adapter
from posttrain.models.unwrap import unwrap_parallel

__all__ = [
    "ReferencePolicy",
    "SyncRefModelCallback",
    "create_reference_policy",
    "precompute_columns",
    "precompute_reference_columns",
    "sync_target_model",
]

ReferenceKind = Literal["model", "adapters_disabled", "adapter", "initial_policy", "precomputed", "none"]

SAME_MODEL_ERROR = (
    "`model` and `ref_model` cannot be the same object. If you want `ref_model` to be the same as `model`, you must "
    "make a copy of it, or pass `ref_model=None` (with PEFT the reference is then the base model with adapters "
    "disabled; otherwise a frozen copy is made)."
)


def _freeze(module: torch.nn.Module) -> torch.nn.Module:
    for param in module.parameters():
        param.requires_grad_(False)
    return module.eval()


def _has_target_parameters(model: torch.nn.Module) -> bool:
    config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", "default"))
    return bool(getattr(config, "target_parameters", None))


class ReferencePolicy:
    """Where π_ref comes from, and a context manager that makes it callable.

    Args:
        kind: ``"model"`` (a separate frozen module), ``"adapters_disabled"`` (the PEFT policy with adapters off),
            ``"adapter"`` (the PEFT policy with the frozen ``adapter_name`` active), ``"initial_policy"`` (the policy
            itself, valid only before its first update — used to precompute log-probs), ``"precomputed"`` (log-probs
            are in the dataset; no module) or ``"none"`` (no reference).
        model: The frozen module for ``kind="model"``.
        adapter_name: The adapter to activate for ``kind="adapter"``.
    """

    def __init__(self, kind: ReferenceKind, model: torch.nn.Module | None = None, adapter_name: str | None = None):
        if kind == "model" and model is None:
            raise ValueError("ReferencePolicy(kind='model') needs the reference module.")
        self.kind: ReferenceKind = kind
        self.model = model
        self.adapter_name = adapter_name

    def __repr__(self) -> str:
        return f"ReferencePolicy(kind={self.kind!r})"

    @property
    def needs_forward(self) -> bool:
        """Whether reference log-probs must be computed by a forward pass (False when precomputed or absent)."""
        return self.kind not in ("precomputed", "none")

    @property
    def holds_copy(self) -> bool:
        """Whether a second set of model weights is kept in memory."""
        return self.model is not None

    @contextlib.contextmanager
    def activate(self, policy: torch.nn.Module | None = None) -> Iterator[torch.nn.Module]:
        """Yield the module to run for reference log-probs.

        For adapter-based kinds the policy itself is yielded with its adapters switched for the duration of the
        block; the policy's train/eval mode is left alone (TRL), so disable dropout for deterministic references.
        Run the forward under ``torch.no_grad()`` — this context does not do it, so one ``no_grad`` can cover a
        policy and a reference pass together when the caller wants that.

        Args:
            policy: The (possibly accelerator-wrapped) policy; required for every kind but ``"model"``.
        """
        if self.kind == "model":
            yield self.model
            return
        if self.kind in ("precomputed", "none"):
            raise RuntimeError(
                f"The reference policy is {self.kind!r}: there is no reference model to run. Read the precomputed "
                "reference log-probs from the batch instead."
            )
        if policy is None:
            raise ValueError(f"ReferencePolicy(kind={self.kind!r}).activate() needs the policy model.")
        inner = unwrap_parallel(policy)
        if self.kind == "adapters_disabled":
            with use_adapter(inner, None):
                yield policy
        elif self.kind == "adapter":
            with use_adapter(inner, self.adapter_name):
                yield policy
        else:  # initial_policy: the untouched policy, in eval mode so the values do not depend on dropout
            was_training = inner.training
            inner.eval()
            try:
                yield policy
            finally:
                inner.train(was_training)

    def prepare(self, accelerator: Any) -> None:
        """Place a separate reference module for inference (device, DeepSpeed/FSDP engine) with ``accelerator``."""
        if self.model is None:
            return
        if getattr(accelerator, "is_deepspeed_enabled", False) or getattr(accelerator, "is_fsdp2", False):
            self.model = accelerator.prepare_model(self.model, evaluation_mode=True)
        else:
            self.model = self.model.to(accelerator.device)

    def release(self) -> None:
        """Forget the reference module after its log-probs were precomputed (``kind`` becomes ``"precomputed"``)."""
        self.model = None
        self.adapter_name = None
        self.kind = "precomputed"


def create_reference_policy(
    model: torch.nn.Module,
    ref_model: torch.nn.Module | str | None = None,
    *,
    required: bool = True,
    precompute: bool = False,
    sync_ref_model: bool = False,
    adapter_created_by_trainer: bool = False,
    reload_from: str | None = None,
    model_init_kwargs: dict[str, Any] | None = None,
) -> ReferencePolicy:
    """Decide how the trainer gets π_ref (see the module docstring for the order of the rules).

    Args:
        model: The policy (already resolved, possibly PEFT-wrapped).
        ref_model: Explicit reference: a module or a hub id / local path; must not be ``model`` itself.
        required: False when no reference is needed at all (β = 0) → ``kind="none"``.
        precompute: Reference log-probs are computed once before training (``precompute_ref_log_probs``).
        sync_ref_model: TR-DPO sync is requested; needs a separate reference module (not PEFT adapters, not
            precomputed values).
        adapter_created_by_trainer: The trainer wrapped ``model`` with ``peft_config`` itself (so the base model is
            the starting point and the reference); False when the user passed a ``PeftModel``.
        reload_from: Hub id / path the policy was loaded from; a frozen copy is then loaded again from it.
        model_init_kwargs: ``from_pretrained`` kwargs for ``reload_from`` or a string ``ref_model``.

    Raises:
        ValueError: ``ref_model is model``; ``sync_ref_model`` with ``precompute``; ``sync_ref_model`` with a PEFT
            policy and no ``ref_model``.
    """
    if ref_model is not None and ref_model is model:
        raise ValueError(SAME_MODEL_ERROR)
    if not required:
        return ReferencePolicy("none")
    if sync_ref_model and precompute:
        raise ValueError(
            "sync_ref_model=True cannot be combined with precompute_ref_log_probs=True: a synced reference changes "
            "during training, so its log-probs cannot be computed in advance. Set one of them to False."
        )
    if ref_model is not None:
        if isinstance(ref_model, str):
            from posttrain.models.loading import create_model_from_path

            ref_model = create_model_from_path(ref_model, **(model_init_kwargs or {}))
        if is_peft_model(ref_model):
            raise ValueError(
                "ref_model is a PeftModel; pass a plain model (merge its adapter with `merge_and_unload()`), or pass "
                "ref_model=None to use the policy's base model as the reference."
            )
        return ReferencePolicy("model", model=_freeze(ref_model))
    if is_peft_model(model):
        if sync_ref_model:
            raise ValueError(
                "sync_ref_model=True is not supported with a PEFT model and no ref_model: the reference is the "
                "policy's base model (adapters disabled), which cannot be mixed towards the policy without changing "
                "the policy too. Pass an explicit ref_model, or set sync_ref_model=False."
            )
        if adapter_created_by_trainer:
            return ReferencePolicy("adapters_disabled")
        if _has_target_parameters(model):
            warnings.warn(
                "The PeftModel uses LoRA `target_parameters`, which cannot host a second ('ref') adapter; the "
                "reference policy is the base model with adapters disabled instead of your starting adapter.",
                UserWarning,
                stacklevel=3,
            )
            return ReferencePolicy("adapters_disabled")
        return ReferencePolicy("adapter", adapter_name=add_reference_adapter(model, "ref"))
    if precompute:
        return ReferencePolicy("initial_policy")
    if reload_from is not None:
        from posttrain.models.loading import create_model_from_path

        copy_ = create_model_from_path(reload_from, **(model_init_kwargs or {}))
        if type(copy_) is not type(model):
            # e.g. a causal-LM head loaded where the policy was built differently: fall back to an exact copy
            copy_ = copy.deepcopy(model)
        return ReferencePolicy("model", model=_freeze(copy_))
    return ReferencePolicy("model", model=_freeze(copy.deepcopy(model)))


# ---------------------------------------------------------------------------------------------------------------
# Precomputed reference log-probs
# ---------------------------------------------------------------------------------------------------------------


def precompute_columns(
    dataset: Any,
    *,
    collate_fn: Callable[[list[dict[str, Any]]], dict[str, Any]],
    batch_size: int,
    compute_fn: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
    prepare_fn: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, list[float]]:
    """One in-order pass over ``dataset``: collate ``batch_size`` rows, call ``compute_fn`` under ``no_grad``.

    ``compute_fn`` returns per-row tensors ``(b,)`` keyed by column name; the result maps each name to one float
    per dataset row, in dataset order, ready for ``dataset.add_column``. Each process computes every row (the pass
    is a small fraction of training, and it keeps the result identical on every rank without a gather).

    Args:
        dataset: A map-style dataset (``datasets.Dataset`` or a list of dicts).
        collate_fn: The trainer's data collator.
        batch_size: Rows per forward pass (``precompute_ref_batch_size``).
        compute_fn: ``batch -> {column: (b,) tensor}``.
        prepare_fn: Moves a collated batch to the device (e.g. ``trainer._prepare_inputs``).
    """
    if batch_size < 1:
        raise ValueError(f"precompute_ref_batch_size must be a positive int, got {batch_size}.")
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False, collate_fn=collate_fn)
    columns: dict[str, list[float]] = defaultdict(list)
    with torch.no_grad():
        for batch in loader:
            if prepare_fn is not None:
                batch = prepare_fn(batch)
            for name, values in compute_fn(batch).items():
                columns[name].extend(values.detach().float().cpu().reshape(-1).tolist())
    return dict(columns)


def add_reference_columns(
    trainer: Any,
    dataset: Any,
    compute_fn: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
    *,
    input_columns: tuple[str, ...],
    marker_column: str,
    batch_size: int,
) -> Any:
    """``dataset`` with the precomputed reference columns of ``compute_fn`` added (unchanged when it is None or
    already has ``marker_column``): the ``input_columns`` it has are collated with ``trainer.data_collator`` in
    batches of ``batch_size`` and scored under the trainer's autocast."""
    if dataset is None or marker_column in dataset.column_names:
        return dataset

    def compute(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        with trainer.compute_loss_context_manager(), trainer.accelerator.autocast():
            return compute_fn(batch)

    values = precompute_columns(
        dataset.select_columns([c for c in input_columns if c in dataset.column_names]),
        collate_fn=trainer.data_collator,
        batch_size=batch_size,
        compute_fn=compute,
        prepare_fn=trainer._prepare_inputs,
    )
    for column, column_values in values.items():
        dataset = dataset.add_column(column, column_values)
    return dataset


def precompute_reference_columns(
    trainer: Any,
    compute_fn: Callable[[dict[str, Any]], dict[str, torch.Tensor]],
    *,
    input_columns: tuple[str, ...],
    marker_column: str,
) -> None:
    """Add precomputed reference columns to a trainer's train and eval datasets, then free its reference.

    For each map-style dataset that lacks ``marker_column``, the ``input_columns`` it has are collated with
    ``trainer.data_collator`` in batches of ``args.precompute_ref_batch_size`` (default: the per-device train /
    eval batch size) and ``compute_fn(batch)`` (run under the trainer's autocast) gives the new columns. Afterwards
    ``trainer.reference.release()`` drops the reference module, so training holds no second copy of the weights.
    """
    args = trainer.args

    def add(dataset: Any, batch_size: int) -> Any:
        return add_reference_columns(
            trainer, dataset, compute_fn, input_columns=input_columns, marker_column=marker_column,
            batch_size=batch_size,
        )  # fmt: skip

    trainer.train_dataset = add(
        trainer.train_dataset, args.precompute_ref_batch_size or args.per_device_train_batch_size
    )
    eval_batch_size = args.precompute_ref_batch_size or args.per_device_eval_batch_size
    if isinstance(trainer.eval_dataset, dict):
        trainer.eval_dataset = {k: add(v, eval_batch_size) for k, v in trainer.eval_dataset.items()}
    else:
        trainer.eval_dataset = add(trainer.eval_dataset, eval_batch_size)
    trainer.reference.release()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------------
# TR-DPO reference sync
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def sync_target_model(model: torch.nn.Module, target_model: torch.nn.Module, alpha: float) -> None:
    """In place: target ← α·model + (1 − α)·target, parameter by parameter (names must match).

    Under DeepSpeed ZeRO-3 both models' shards are gathered first and the update is done on rank 0's full copy,
    then re-partitioned.
    """
    model, target_model = unwrap_parallel(model), unwrap_parallel(target_model)
    source_params = dict(model.named_parameters())
    target_params = dict(target_model.named_parameters())
    missing = sorted(set(target_params) - set(source_params))
    if missing:
        raise ValueError(
            f"Cannot sync the reference model: the policy has no parameters named {missing[:3]}. The reference must "
            "have the policy's architecture (a PEFT policy cannot be synced into a plain reference)."
        )
    gather = _zero3_gather(list(source_params.values()) + list(target_params.values()))
    with gather:
        for name, target in target_params.items():
            target.data.mul_(1.0 - alpha).add_(source_params[name].data.to(target.dtype), alpha=alpha)


def _zero3_gather(params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager:
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    import deepspeed  # only reachable when the parameters are ZeRO-3 partitioned, i.e. deepspeed is installed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


class SyncRefModelCallback(TrainerCallback):
    """TR-DPO: every ``args.ref_model_sync_steps`` optimizer steps, ``ref ← α·θ + (1 − α)·ref``.

    α = ``args.ref_model_mixup_alpha`` (TRL default 0.6, sync every 512 steps). Paper:
    https://huggingface.co/papers/2404.09656. Added automatically by DPO/KTO/GRPO/RLOO when ``sync_ref_model=True``.

    Args:
        ref_model: The reference module to update in place.
        accelerator: Unused on a single process; kept for TRL's signature ``SyncRefModelCallback(ref_model,
            accelerator)``.
    """

    def __init__(self, ref_model: torch.nn.Module, accelerator: Any = None):
        self.ref_model = ref_model
        self.accelerator = accelerator

    def on_step_end(self, args, state, control, model=None, **kwargs):
        steps = getattr(args, "ref_model_sync_steps", 512)
        if model is not None and steps and state.global_step % steps == 0:
            sync_target_model(model, self.ref_model, getattr(args, "ref_model_mixup_alpha", 0.6))
        return control
