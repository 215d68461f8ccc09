"""Per-token policy-gradient objectives for GRPO-family losses, and their importance weights.

Each objective maps (log-probs under π_θ, log-probs under π_old, advantages, mask) to a per-token loss
``(B, T)`` (or ``(B, 1)`` for a purely sequence-level loss) plus a dict of per-token indicator tensors for metrics.
How the per-token loss is reduced to a scalar is a separate choice (``posttrain.core.aggregation``); TRL's
``loss_type`` strings are pairs of the two (``posttrain.core.presets``).

Notation: ℓ_t = logp_t − old_t, w the importance weight (token: exp ℓ_t; sequence/GSPO: exp of the masked mean of
ℓ), A the advantage broadcast to the weight's shape, sg = stop-gradient.

* ``clip``  (PPO/GRPO, DAPO's asymmetric ε, INTELLECT-2's δ):  L = −min(min(w, δ)·A, clip(w, 1−ε_low, 1+ε_high)·A)
* ``cispo`` (MiniMax-M1):  L = −sg(min(w, ε_high))·A·logp — ``epsilon_high`` is an absolute cap here (recommended 5)
* ``sapo``  (Qwen, arXiv 2511.20347):  L = −(4/τ)·σ(τ(w − 1))·A, τ = τ_pos if A > 0 else τ_neg
* ``vespo`` (arXiv 2602.10693):  L = −sg(φ(W))·A·logp with the gamma kernel φ(W) = e^λ W^k e^{−λW} of the
  *sequence* ratio W = exp Σ_t m·ℓ_t, (k, λ) = (k_pos, λ_pos) if A ≥ 0 else (k_neg, λ_neg).

Advantages may be ``(B,)``, ``(B, 1)`` or ``(B, T)``. Extra keyword arguments are accepted and ignored.

Each registered objective declares what a trainer needs to know about it (:class:`ObjectiveProperties`, read with
:func:`objective_properties`): the config fields it reads, keyed by its keyword arguments, whether it folds the
rollout importance-sampling ratio into its weights (VESPO) instead of having the loss multiplied by it, and the
metrics its stats give (:class:`ObjectiveMetric`: ``cispo_clip_ratio``, ``vespo/phi_seq_mean``), which the trainer
logs without knowing the objective (:func:`objective_metric_values`). Its
hyper-parameters that are not shared with other losses are declared here too, as :class:`ObjectiveArguments`
(TRL's field names, defaults and help), which ``GRPOConfig`` inherits. Adding an objective with a new
hyper-parameter is then one function, one field and one preset row (``presets.py``); the trainer does not change.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from posttrain.core.masking import masked_batch_mean, masked_sum
from posttrain.registry import Registry

__all__ = [
    "POLICY_OBJECTIVES",
    "ObjectiveArguments",
    "ObjectiveMetric",
    "ObjectiveProperties",
    "cispo_objective",
    "clip_objective",
    "declare_objective",
    "gmpo_objective",
    "importance_weights",
    "objective_metric_values",
    "objective_properties",
    "sapo_objective",
    "vespo_gamma_weights",
    "vespo_objective",
]

ObjectiveFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_OBJECTIVES: Registry[ObjectiveFn] = Registry("policy objective")

ImportanceLevel = Literal["token", "sequence", "sequence_sum"]


@dataclass
class ObjectiveArguments:
    """The objectives' own hyper-parameters as config fields (TRL's ``GRPOConfig`` names and defaults).

    ``GRPOConfig`` inherits these; the options shared with other trainers (``epsilon``, ``epsilon_high``,
    ``importance_sampling_level``) stay on the configs. Each objective says which fields it reads in its
    :class:`ObjectiveProperties`.
    """

    delta: float | None = field(
        default=None, metadata={"help": "INTELLECT-2 two-sided clipping: cap the unclipped ratio at δ (> 1 + ε)."}
    )
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "SAPO τ for non-positive advantages."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "SAPO τ for positive advantages."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "VESPO k for non-negative advantages."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "VESPO λ for non-negative advantages."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "VESPO k for negative advantages."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "VESPO λ for negative advantages."})


@dataclass(frozen=True)
class ObjectiveMetric:
    """A metric an objective's stats give: this process's value, which the trainer averages over processes.

    Attributes:
        stat: The key of the objective's stats dict it is computed from.
        reduce: ``"masked_mean"`` — the mean over valid tokens (``masking.masked_batch_mean``: one value per
            sequence when the stat is ``(B, 1)``); ``"mean"`` — the plain mean of every entry (a per-sequence
            ``(B, 1)`` value such as VESPO's φ).
    """

    stat: str
    reduce: Literal["masked_mean", "mean"] = "masked_mean"

    def __post_init__(self) -> None:
        if self.reduce not in ("masked_mean", "mean"):
            raise ValueError(f"ObjectiveMetric.reduce must be 'masked_mean' or 'mean', got {self.reduce!r}.")

    def local_value(self, stats: Mapping[str, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        """0-d value of this process's micro-batch: ``stats[stat]`` reduced under the ``(B, T)`` loss ``mask``."""
        value = stats[self.stat]
        return masked_batch_mean(value, mask) if self.reduce == "masked_mean" else value.mean()


@dataclass(frozen=True)
class ObjectiveProperties:
    """What a trainer needs to know about an objective besides its formula.

    Attributes:
        config_fields: ``{keyword argument: config field}`` — the hyper-parameters the objective reads and the config
            field that supplies each (``epsilon_low`` ← ``epsilon``). The trainer passes exactly these.
        folds_sampling_ratio: The objective takes the rollout importance-sampling ratio as
            ``importance_sampling_ratio`` (token level, ``(B, T)``) and folds it into its weights; the trainer then
            passes it and does not multiply the loss by it (VESPO).
        metrics: ``{metric name: ObjectiveMetric}`` — what the trainer logs from the objective's stats besides the
            shared ``clip_ratio/*`` (TRL's names, e.g. ``cispo_clip_ratio``).
    """

    config_fields: Mapping[str, str] = field(default_factory=dict)
    folds_sampling_ratio: bool = False
    metrics: Mapping[str, ObjectiveMetric] = field(default_factory=dict)


def declare_objective(
    *,
    config_fields: Mapping[str, str],
    folds_sampling_ratio: bool = False,
    metrics: Mapping[str, ObjectiveMetric] | None = None,
) -> Callable[[ObjectiveFn], ObjectiveFn]:
    """Decorator attaching :class:`ObjectiveProperties` to an objective function (see :func:`objective_properties`)."""

    def mark(fn: ObjectiveFn) -> ObjectiveFn:
        fn.objective_properties = ObjectiveProperties(  # type: ignore[attr-defined]
            dict(config_fields), folds_sampling_ratio, dict(metrics or {})
        )
        return fn

    return mark


def objective_properties(objective: Any) -> ObjectiveProperties:
    """The declared properties of ``objective``; an undeclared callable reads every registered objective's config
    fields (passed as keyword arguments it may ignore), does not fold the sampling ratio, and gets every registered
    objective's metrics whose stat it returns (:func:`objective_metric_values`)."""
    declared = getattr(objective, "objective_properties", None)
    if isinstance(declared, ObjectiveProperties):
        return declared
    fields: dict[str, str] = {}
    metrics: dict[str, ObjectiveMetric] = {}
    for _, fn in POLICY_OBJECTIVES.items():
        other = getattr(fn, "objective_properties", None)
        if isinstance(other, ObjectiveProperties):
            fields.update(other.config_fields)
            metrics.update(other.metrics)
    return ObjectiveProperties(fields, metrics=metrics)


def objective_metric_values(
    properties: ObjectiveProperties, stats: Mapping[str, torch.Tensor], mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """This process's 0-d value of each metric ``properties`` declares whose stat is in ``stats`` (the objective's
    second return value), reduced under the ``(B, T)`` loss ``mask``; the trainer averages each over processes."""
    return {
        name: metric.local_value(stats, mask) for name, metric in properties.metrics.items() if metric.stat in stats
    }


_IS_LEVEL_AND_CLIP = {"importance_sampling_level": "importance_sampling_level", "epsilon_low": "epsilon",
                      "epsilon_high": "epsilon_high"}  # fmt: skip


def importance_weights(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor, level: ImportanceLevel = "token"
) -> torch.Tensor:
    """Importance weight π_θ/π_old per token or per sequence.

    * ``"token"``: w_t = exp(logp_t − old_t), shape ``(B, T)``.
    * ``"sequence"`` (GSPO, Zheng et al. 2025): w_i = exp(Σ_t m (logp − old) / max(Σ_t m, 1)), shape ``(B, 1)`` —
      the geometric mean of the token ratios, so long sequences are not penalised.
    * ``"sequence_sum"`` (RLOO's sequence-level PPO ratio): w_i = exp(Σ_t m (logp − old)), shape ``(B, 1)``.

    Args:
        logp: ``(B, T)`` log-probs under the current policy (carries the gradient).
        old_logp: ``(B, T)`` log-probs under the sampling-time policy.
        mask: ``(B, T)`` completion mask.
        level: ``"token"``, ``"sequence"`` or ``"sequence_sum"``.
    """
    log_ratio = logp - old_logp
    if level == "token":
        return torch.exp(log_ratio)
    if level == "sequence":
        length = mask.sum(dim=-1, keepdim=True).to(logp.dtype).clamp(min=1.0)
        return torch.exp(masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1) / length)
    if level == "sequence_sum":
        return torch.exp(masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1))
    raise ValueError(
        f"Unknown importance_sampling_level {level!r}. Valid values: 'token', 'sequence' (GSPO), 'sequence_sum'."
    )


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _advantages_2d(advantages: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1); (B, 1) and (B, T) pass through (subclasses such as MiniLLM give per-token advantages)."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    if advantages.dim() != 2 or advantages.shape[0] != logp.shape[0] or advantages.shape[1] not in (1, logp.shape[1]):
        raise ValueError(
            f"advantages must have shape (B,), (B, 1) or (B, T) with (B, T) = {tuple(logp.shape)}, "
            f"got {tuple(advantages.shape)}."
        )
    return advantages.to(logp.dtype)


@POLICY_OBJECTIVES.register("clip")
@declare_objective(config_fields={**_IS_LEVEL_AND_CLIP, "delta": "delta"})
def clip_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    importance_sampling_level: ImportanceLevel = "token",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = 0.2,
    delta: float | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate (PPO; GRPO/DAPO/Dr. GRPO/BNPO/LUSPO/GSPO share it).

    L = −min(w₁·A, w₂·A), w₂ = clip(w, 1 − ε_low, 1 + ε_high), w₁ = min(w, δ) if ``delta`` else w
    (INTELLECT-2's two-sided clip: also bounds the ratio when A < 0).

    Args:
        logp, old_logp, mask: ``(B, T)``.
        advantages: ``(B,)``, ``(B, 1)`` or ``(B, T)``.
        importance_sampling_level: see :func:`importance_weights`.
        epsilon_low: ε_low (TRL ``epsilon``).
        epsilon_high: ε_high (DAPO's clip-higher, 0.28 in the paper); None = ``epsilon_low``.
        delta: optional upper cap δ on the unclipped ratio (> 1 + ε_high).

    Returns:
        ``(per_token_loss, stats)``: loss of shape broadcast(w, A) — ``(B, T)`` for token level, ``(B, 1)`` for
        sequence level with per-sequence advantages. ``stats`` holds float indicators (same shape) for the metrics:
        ``is_low_clipped`` (w < 1 − ε_low and A < 0), ``is_high_clipped`` (w > 1 + ε_high and A > 0) and
        ``is_region_clipped`` (either); reduce them with ``masking.masked_batch_mean``.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    adv = _advantages_2d(advantages, logp)
    coef_1 = importance_weights(logp, old_logp, mask, importance_sampling_level)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    capped = coef_1 if delta is None else torch.clamp(coef_1, max=delta)
    per_token_loss = -torch.min(capped * adv, coef_2 * adv)
    with torch.no_grad():
        is_low = (coef_1 < 1 - epsilon_low) & (adv < 0)
        is_high = (coef_1 > 1 + epsilon_high) & (adv > 0)
        stats = {
            "is_low_clipped": is_low.float(),
            "is_high_clipped": is_high.float(),
            "is_region_clipped": (is_low | is_high).float(),
        }
    return per_token_loss, stats


@POLICY_OBJECTIVES.register("cispo")
@declare_objective(config_fields=_IS_LEVEL_AND_CLIP, metrics={"cispo_clip_ratio": ObjectiveMetric("cispo_clip")})
def cispo_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    importance_sampling_level: ImportanceLevel = "token",
    epsilon_low: float = 0.2,
    epsilon_high: float | None = 0.2,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update, and keep every token's gradient.

    L = −sg(min(w, ε_high)) · A · logp. ``epsilon_high`` is the absolute cap on w (ScaleRL recommends 5.0; TRL
    falls back to ``epsilon`` when it is None, which caps at 0.2 — ``presets.validate_grpo_loss_config`` warns).

    Returns:
        ``(per_token_loss (B, T), {"cispo_clip": float indicator of w > ε_high and A > 0})``.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    adv = _advantages_2d(advantages, logp)
    coef_1 = importance_weights(logp, old_logp, mask, importance_sampling_level)
    clamped = torch.clamp(coef_1, max=epsilon_high).detach()
    per_token_loss = -clamped * adv * logp
    with torch.no_grad():
        stats = {"cispo_clip": ((coef_1 > epsilon_high) & (adv > 0)).float()}
    return per_token_loss, stats


@POLICY_OBJECTIVES.register("sapo")
@declare_objective(
    config_fields={
        "importance_sampling_level": "importance_sampling_level",
        "sapo_temperature_pos": "sapo_temperature_pos",
        "sapo_temperature_neg": "sapo_temperature_neg",
    }
)
def sapo_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    importance_sampling_level: ImportanceLevel = "token",
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (Qwen, arXiv 2511.20347): a smooth, temperature-controlled gate instead of hard clipping.

    f(w) = σ(τ(w − 1)) · 4/τ with τ = τ_pos if A > 0 else τ_neg;  L = −f(w) · A. At w = 1 the gradient equals the
    unclipped surrogate's (f'(1) = 1); far from 1 it decays smoothly. τ_neg > τ_pos damps negative updates faster.

    Returns:
        ``(per_token_loss, {})`` with loss shape broadcast(w, A).
    """
    adv = _advantages_2d(advantages, logp)
    coef_1 = importance_weights(logp, old_logp, mask, importance_sampling_level)
    tau = torch.where(adv > 0, _scalar(sapo_temperature_pos, coef_1), _scalar(sapo_temperature_neg, coef_1))
    gate = torch.sigmoid(tau * (coef_1 - 1)) * 4 / tau
    return -gate * adv, {}


def vespo_gamma_weights(
    advantages: torch.Tensor,
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    *,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
    rollout_log_ratio: torch.Tensor | None = None,
) -> torch.Tensor:
    """VESPO's detached gamma kernel φ of the sequence-level importance ratio (arXiv 2602.10693, §3.4).

    s = Σ_t m·clamp(ℓ_t, −20, 20) (+ Σ_t m·clamp(rollout_log_ratio_t, log 1e-8, 20) when the sampler's log-probs
    differ from π_old's), clamped to [log 1e-8, 20]; then, in log space,
    log φ = λ + k·s − λ·e^s, i.e. φ(W) = e^λ W^k e^{−λW} with φ(1) = 1; (k, λ) = pos if A ≥ 0 else neg.

    Args:
        advantages: ``(B, 1)`` (or ``(B, T)``).
        log_ratio: ``(B, T)`` logp − old_logp.
        mask: ``(B, T)``.
        k_pos, lambda_pos, k_neg, lambda_neg: kernel parameters (c1, c2 in the paper).
        rollout_log_ratio: optional ``(B, T)`` log of the token-level rollout IS ratio π_old/π_sampler (after
            truncation/masking; −inf for masked tokens is fine).

    Returns:
        ``(B, 1)`` φ, detached, NaN/inf mapped to 0.
    """
    lower = math.log(1e-8)
    seq_log_ratio = masked_sum(torch.clamp(log_ratio, -20.0, 20.0), mask, dim=-1).unsqueeze(-1)
    if rollout_log_ratio is not None:
        seq_log_ratio = seq_log_ratio + masked_sum(
            torch.clamp(rollout_log_ratio, lower, 20.0), mask, dim=-1
        ).unsqueeze(-1)
    log_w = torch.clamp(seq_log_ratio, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, _scalar(k_pos, log_w), _scalar(k_neg, log_w))
    lam = torch.where(nonneg, _scalar(lambda_pos, log_w), _scalar(lambda_neg, log_w))
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
    return torch.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0).detach()


@POLICY_OBJECTIVES.register("vespo")
@declare_objective(
    config_fields={name: name for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")},
    folds_sampling_ratio=True,
    metrics={"vespo/phi_seq_mean": ObjectiveMetric("phi_seq", reduce="mean")},
)
def vespo_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    rollout_log_ratio: torch.Tensor | None = None,
    importance_sampling_ratio: torch.Tensor | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """VESPO (arXiv 2602.10693): REINFORCE on the sequence, reweighted by a detached gamma kernel φ(W).

    L = −φ(W) · A · logp, φ from :func:`vespo_gamma_weights`. The sequence ratio W is always the *sum* of token
    log-ratios, so ``importance_sampling_level`` is ignored (TRL warns when it is "sequence"). The rollout IS
    correction enters φ instead of multiplying the loss: pass either ``rollout_log_ratio`` (log ρ_t) or TRL's
    token-level ``importance_sampling_ratio`` (ρ_t, ``(B, T)``), and do not multiply the loss by ρ afterwards.

    Returns:
        ``(per_token_loss (B, T), {"phi_seq": (B, 1) φ})``.
    """
    adv = _advantages_2d(advantages, logp)
    if importance_sampling_ratio is not None:
        if rollout_log_ratio is not None:
            raise ValueError("Pass either rollout_log_ratio or importance_sampling_ratio to vespo, not both.")
        if importance_sampling_ratio.shape[-1] == 1 and logp.shape[-1] != 1:
            raise ValueError(
                "VESPO needs a token-level rollout importance ratio (B, T): set vllm_importance_sampling_mode to "
                "'token_truncate' or 'token_mask'."
            )
        rollout_log_ratio = torch.log(importance_sampling_ratio)
    phi = vespo_gamma_weights(
        adv,
        logp - old_logp,
        mask,
        k_pos=vespo_k_pos,
        lambda_pos=vespo_lambda_pos,
        k_neg=vespo_k_neg,
        lambda_neg=vespo_lambda_neg,
        rollout_log_ratio=rollout_log_ratio,
    )
    per_token_loss = -phi * adv * logp
    return per_token_loss, {"phi_seq": phi}


@POLICY_OBJECTIVES.register("gmpo")
@declare_objective(config_fields={"epsilon_low": "epsilon", "epsilon_high": "epsilon_high"})
def gmpo_objective(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    epsilon_low: float = 0.4,
    epsilon_high: float | None = None,
    **_,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (Geometric-Mean Policy Optimization, arXiv 2507.20673): maximise the geometric mean of the token ratios.

    ℓ_t = logp_t − old_t is clipped in *log* space, one-sidedly by the advantage's sign (PPO's min trick):
    ℓ̃_t = min(ℓ_t, clamp(ℓ_t, −ε_low, ε_high)) if A > 0 else max(ℓ_t, clamp(ℓ_t, −ε_low, ε_high)); then
    L_i = −exp(Σ_t m ℓ̃_t / max(Σ_t m, 1)) · A_i, one value per sequence (the 1/|o_i| exponent is the geometric
    mean). The ratio clip range is (e^−ε_low, e^ε_high); the paper uses ε = 0.4. ``mask`` is the set of tokens in
    the geometric mean (completion mask, times a top-entropy mask when one is used).

    Args:
        logp, old_logp, mask: ``(B, T)``.
        advantages: ``(B,)`` or ``(B, 1)``.
        epsilon_low: ε_low in log space (TRL ``epsilon``).
        epsilon_high: ε_high in log space; None = ``epsilon_low``.

    Returns:
        ``(per_sequence_loss (B, 1), stats)``: ``stats`` holds ``(B, T)`` float indicators ``is_low_clipped``
        (ℓ < −ε_low and A < 0), ``is_high_clipped`` (ℓ > ε_high and A > 0) and ``is_region_clipped``. Reduce the
        loss with ``seq_mean_token_mean`` (a ``(B, 1)`` loss counts once per sequence there), so a ``(B, T)`` KL
        term added to it is averaged per sequence, as in TRL.
    """
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    adv = _advantages_2d(advantages, logp)
    if adv.shape[1] != 1:
        raise ValueError("gmpo needs one advantage per sequence, (B,) or (B, 1).")
    log_ratio = logp - old_logp  # (B, T)
    clamped = torch.clamp(log_ratio, min=-epsilon_low, max=epsilon_high)
    clipped = torch.where(adv > 0, torch.minimum(log_ratio, clamped), torch.maximum(log_ratio, clamped))
    length = mask.sum(dim=-1, keepdim=True).to(logp.dtype).clamp(min=1.0)
    coef = torch.exp(masked_sum(clipped, mask, dim=-1).unsqueeze(-1) / length)  # (B, 1) geometric mean ratio
    per_sequence_loss = -coef * adv
    with torch.no_grad():
        is_low = (log_ratio < -epsilon_low) & (adv < 0)
        is_high = (log_ratio > epsilon_high) & (adv > 0)
        stats = {
            "is_low_clipped": is_low.float(),
            "is_high_clipped": is_high.float(),
            "is_region_clipped": (is_low | is_high).float(),
        }
    return per_sequence_loss, stats
