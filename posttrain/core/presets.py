"""TRL's GRPO ``loss_type`` strings as presets over two orthogonal axes: objective × aggregation.

``GRPO_LOSS_PRESETS[loss_type] = (objective, aggregation)`` names an entry of
``policy_objectives.POLICY_OBJECTIVES`` and one of ``aggregation.AGGREGATIONS``. Adding a loss type is one row here
(plus a function if either axis is new). The rows here are TRL 1.16's loss types, the ones the stable ``GRPOConfig``
offers (:data:`GRPO_LOSS_TYPES`); an experimental trainer adds its own with :func:`register_grpo_loss_preset` when
its package is imported (``posttrain.experimental.gmpo`` registers ``"gmpo"``), so the stable config never lists it.
``validate_grpo_loss_config`` reproduces TRL's warnings for combinations that work but are probably not what the user
meant, and raises for the ones that cannot work.

A custom pair behaves as the preset it equals (``("vespo", "token_mean_global")`` is ``"vespo"``): what the trainer
does differently per loss comes from the functions' declared properties (``objective_properties``, an
aggregation's ``normalised_over_step``), and the checks look the pair's preset up (:func:`preset_name`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from posttrain.core.aggregation import AGGREGATIONS
from posttrain.core.policy_objectives import POLICY_OBJECTIVES, objective_properties

__all__ = [
    "GRPO_LOSS_PRESETS",
    "GRPO_LOSS_TYPES",
    "RLOO_LOSS_PRESET",
    "needs_grad_accum_division",
    "preset_name",
    "register_grpo_loss_preset",
    "resolve_grpo_loss",
    "validate_grpo_loss_config",
]

GRPO_LOSS_PRESETS: dict[str, tuple[str, str]] = {
    "grpo": ("clip", "seq_mean_token_mean"),
    "bnpo": ("clip", "token_mean_local"),
    "dr_grpo": ("clip", "constant_norm"),
    "dapo": ("clip", "token_mean_global"),
    "cispo": ("cispo", "token_mean_global"),
    "sapo": ("sapo", "seq_mean_token_mean"),
    "luspo": ("clip", "length_weighted"),
    "vespo": ("vespo", "token_mean_global"),
}

# The loss types of the stable GRPOConfig (its help and CLI choices): TRL 1.16's, fixed before any experimental
# package registers its own preset.
GRPO_LOSS_TYPES: tuple[str, ...] = tuple(GRPO_LOSS_PRESETS)

# RLOO: sequence-level PPO clip on the summed log-ratio, averaged over sequences (HF Trainer then divides by GA).
RLOO_LOSS_PRESET: dict[str, str] = {
    "objective": "clip",
    "aggregation": "sequence_mean",
    "importance_sampling_level": "sequence_sum",
}

_SEQUENCE_LEVEL_DISCOURAGED = ("bnpo", "dr_grpo", "dapo", "cispo")


def register_grpo_loss_preset(name: str, objective: str, aggregation: str) -> None:
    """Add the loss type ``name`` = ``(objective, aggregation)`` (registry names) to :data:`GRPO_LOSS_PRESETS`.

    For experimental trainers: their package calls this on import, so ``loss_type=name`` resolves (in their config,
    and in any ``GRPOConfig`` once the package is imported) while the stable ``GRPOConfig`` does not offer it.
    Registering the same pair again is a no-op (re-imports); another pair under an existing name is an error.

    Raises:
        ValueError: ``name`` is already a preset with a different pair, or ``objective`` / ``aggregation`` is not
            registered (the message lists the registered names).
    """
    POLICY_OBJECTIVES.get(objective)  # unknown names fail here, listing the registered ones
    AGGREGATIONS.get(aggregation)
    existing = GRPO_LOSS_PRESETS.get(name)
    if existing is not None and existing != (objective, aggregation):
        raise ValueError(
            f"loss_type {name!r} is already the preset {existing}; choose another name for "
            f"({objective!r}, {aggregation!r})."
        )
    GRPO_LOSS_PRESETS[name] = (objective, aggregation)


def resolve_grpo_loss(
    loss_type: str | Sequence[str | Callable],
) -> tuple[Callable, Callable]:
    """Return ``(objective_fn, aggregation_fn)`` for a TRL ``loss_type``.

    Args:
        loss_type: one of ``GRPO_LOSS_PRESETS`` (``"grpo"``, ``"bnpo"``, ``"dr_grpo"``, ``"dapo"``, ``"cispo"``,
            ``"sapo"``, ``"luspo"``, ``"vespo"``), or a pair ``(objective, aggregation)`` of registry names or
            callables for a custom combination.

    Raises:
        ValueError: unknown loss type (the message lists the valid ones).
    """
    if isinstance(loss_type, str):
        if loss_type not in GRPO_LOSS_PRESETS:
            raise ValueError(
                f"Unknown loss_type {loss_type!r}. Valid loss types: {', '.join(GRPO_LOSS_PRESETS)} "
                "(or a pair (objective, aggregation)). An experimental trainer's loss type is registered when its "
                "package is imported (e.g. posttrain.experimental.gmpo for 'gmpo')."
            )
        objective, aggregation = GRPO_LOSS_PRESETS[loss_type]
    elif isinstance(loss_type, (tuple, list)) and len(loss_type) == 2:
        objective, aggregation = loss_type
    else:
        raise ValueError(
            f"loss_type must be one of {', '.join(GRPO_LOSS_PRESETS)} or a pair (objective, aggregation), "
            f"got {loss_type!r}."
        )
    return POLICY_OBJECTIVES.get(objective), AGGREGATIONS.get(aggregation)


def needs_grad_accum_division(loss_type: str | Sequence[str | Callable]) -> bool:
    """Whether the trainer divides the aggregated loss by the gradient-accumulation steps (TRL semantics).

    False for an aggregation already normalised over the optimizer step (``normalised_over_step``: the global token
    mean of ``dapo``/``cispo``/``vespo``), True for the others (and for a custom aggregation that does not say so).
    """
    _, aggregation = resolve_grpo_loss(loss_type)
    return not getattr(aggregation, "normalised_over_step", False)


def preset_name(loss_type: str | Sequence[str | Callable]) -> str | None:
    """The preset ``loss_type`` is or equals: the name itself, or the preset whose ``(objective, aggregation)``
    resolves to the same two functions; None for a combination no preset has."""
    pair = resolve_grpo_loss(loss_type)
    if isinstance(loss_type, str):
        return loss_type
    return next((name for name in GRPO_LOSS_PRESETS if resolve_grpo_loss(name) == pair), None)


def validate_grpo_loss_config(
    loss_type: str | Sequence[str | Callable],
    importance_sampling_level: str = "token",
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    vllm_importance_sampling_mode: str | None = None,
) -> list[str]:
    """Check a GRPO loss configuration; return warning messages (TRL logs these), raise on impossible ones.

    Warnings (as TRL): ``luspo`` without sequence-level importance sampling; ``vespo`` with sequence-level
    importance sampling (it builds its own sequence ratio); sequence-level importance sampling with ``bnpo``,
    ``dr_grpo``, ``dapo`` or ``cispo`` (GSPO normalises per sequence: ``loss_type="grpo"``); ``cispo`` with
    ``epsilon_high=None`` (the weight cap silently becomes ``epsilon``).

    Args:
        loss_type: TRL loss type, or a pair ``(objective, aggregation)`` (checked as the preset it equals).
        importance_sampling_level: ``"token"`` or ``"sequence"``.
        epsilon: lower clip ε (used in the cispo message).
        epsilon_high: upper clip ε_high (None = ``epsilon``).
        vllm_importance_sampling_mode: the rollout IS mode when the correction is active, else None.

    Raises:
        ValueError: unknown ``loss_type`` or ``importance_sampling_level``; an objective that folds the sampling
            ratio (``vespo``) with a sequence-level rollout IS mode (VESPO folds a token-level ratio into its kernel).
    """
    objective, _ = resolve_grpo_loss(loss_type)
    name = preset_name(loss_type)
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(
            f"Unknown importance_sampling_level {importance_sampling_level!r}. Valid values: 'token', 'sequence'."
        )
    folds_ratio = objective_properties(objective).folds_sampling_ratio
    if folds_ratio and vllm_importance_sampling_mode not in (None, "token_truncate", "token_mask"):
        raise ValueError(
            f"loss_type={name or loss_type!r} needs a token-level importance-sampling correction (its objective "
            "folds the ratio into its weights), got "
            f"vllm_importance_sampling_mode={vllm_importance_sampling_mode!r}: set it to 'token_truncate' or "
            "'token_mask' (or disable vllm_importance_sampling_correction)."
        )
    warnings: list[str] = []
    loss_type = name  # a custom pair is checked as the preset it equals (no preset: no preset-specific warning)
    if loss_type == "luspo" and importance_sampling_level != "sequence":
        warnings.append(
            "loss_type='luspo' scales a sequence-level (GSPO) loss by sequence length; the LUSPO paper uses "
            "importance_sampling_level='sequence'. Set importance_sampling_level='sequence' to reproduce it."
        )
    if loss_type == "vespo" and importance_sampling_level == "sequence":
        warnings.append(
            "loss_type='vespo' computes its own sequence-level importance weight; importance_sampling_level="
            "'sequence' has no effect on it. Use importance_sampling_level='token' (the default)."
        )
    if importance_sampling_level == "sequence" and loss_type in _SEQUENCE_LEVEL_DISCOURAGED:
        warnings.append(
            f"When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums per-token "
            "contributions, which weights each sequence by its completion length instead of optimizing the "
            "per-sequence objective (GSPO). To reproduce the GSPO paper's setup, set loss_type='grpo'."
        )
    if loss_type == "cispo" and epsilon_high is None:
        warnings.append(
            f"loss_type='cispo' caps the importance weight at epsilon_high, which is None and so falls back to "
            f"epsilon={epsilon}. CISPO/ScaleRL use a cap well above 1: set epsilon_high=5.0."
        )
    return warnings
