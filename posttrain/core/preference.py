"""Preference objectives as pure tensor math: the DPO loss family, KTO, and the Bradley–Terry reward-model loss.

What lives here:

- ``f_divergence_scores`` — the f-DPO score g(u) of a policy/reference log-ratio u (Wang et al., 2023,
  https://huggingface.co/papers/2309.16240).
- ``DPO_LOSSES`` — one registered function per TRL ``DPOConfig.loss_type`` string, all with the same signature
  ``fn(batch: DPOLossInputs, *, beta, label_smoothing, f_divergence_type, f_alpha_divergence_coef, discopop_tau)``
  returning a per-pair loss ``(B,)``. ``dpo_loss`` combines several of them with ``loss_weights`` (MPO, RPO).
- WPO weights (``wpo_token_log_normalizer``, ``wpo_sequence_weight``, ``wpo_pair_weight``) and LD-DPO length
  desensitisation (``ld_weighted_logps``).
- ``kto_loss`` / ``kto_kl_estimate`` / ``kto_weight_range_warning`` (KTO, https://huggingface.co/papers/2402.01306).
- ``bradley_terry_loss`` (reward modelling, with TRL's ``margin`` column and ``center_rewards_coefficient``).

Everything takes per-sequence tensors that the trainer has already reduced over tokens (summed completion
log-probs), except the WPO / LD-DPO helpers, which take per-token tensors and a mask so that the trainer can feed
them from chunked log-prob computations without ever holding ``(B, T, V)`` logits.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from posttrain.registry import Registry

__all__ = [
    "DPO_LOSSES",
    "F_DIVERGENCES",
    "KTO_LOSSES",
    "DPOLossInputs",
    "bradley_terry_loss",
    "dpo_loss",
    "f_divergence_scores",
    "kto_kl_estimate",
    "kto_loss",
    "kto_weight_range_warning",
    "ld_weighted_logps",
    "validate_dpo_loss_config",
    "wpo_pair_weight",
    "wpo_sequence_weight",
    "wpo_token_log_normalizer",
]

# ---------------------------------------------------------------------------------------------------------------
# f-divergence scores
# ---------------------------------------------------------------------------------------------------------------

F_DIVERGENCES: Registry[Callable[..., torch.Tensor]] = Registry("f_divergence_type")


@F_DIVERGENCES.register("reverse_kl")
def _reverse_kl_score(u: torch.Tensor, alpha: float) -> torch.Tensor:
    # f(t) = t log t  ->  f'(t) = log t + 1; the constant cancels in s_c - s_r, leaving plain DPO.
    return u


@F_DIVERGENCES.register("forward_kl")
def _forward_kl_score(u: torch.Tensor, alpha: float) -> torch.Tensor:
    # f(t) = -log t  ->  f'(t) = -1/t = -exp(-u).
    return -torch.exp(-u)


@F_DIVERGENCES.register("js_divergence")
def _js_score(u: torch.Tensor, alpha: float) -> torch.Tensor:
    # f'(t) = log(2t / (1 + t)) = log 2 + log sigmoid(u); the log 2 cancels in the difference.
    return F.logsigmoid(u)


@F_DIVERGENCES.register("alpha_divergence")
def _alpha_score(u: torch.Tensor, alpha: float) -> torch.Tensor:
    # f'(t) = (t^(alpha-1) - 1) / (alpha - 1); the -1/(alpha-1) constant cancels. alpha -> 1 is reverse KL.
    if abs(alpha - 1.0) < 1e-6:
        return u
    # Clamp the exponent so exp() stays finite once cast back to the input dtype (fp16 overflows above ~11.09).
    clamp_max = 11.0 if u.dtype == torch.float16 else 80.0
    exponent = ((alpha - 1.0) * u.to(torch.promote_types(u.dtype, torch.float32))).clamp(max=clamp_max)
    return (torch.exp(exponent) / (alpha - 1.0)).to(u.dtype)


def f_divergence_scores(
    logratios: torch.Tensor, f_divergence_type: str = "reverse_kl", alpha: float = 0.5
) -> torch.Tensor:
    """f-DPO score ``s = g(u)`` of policy/reference log-ratios ``u = log π(y|x) − log π_ref(y|x)``.

    g is the derivative f′ of the divergence's generator evaluated at t = e^u, with additive constants dropped
    (they cancel in ``s_c − s_r``):

    - ``"reverse_kl"``: g(u) = u (standard DPO)
    - ``"forward_kl"``: g(u) = −e^{−u}
    - ``"js_divergence"``: g(u) = log σ(u)
    - ``"alpha_divergence"``: g(u) = e^{(α−1)u} / (α−1), exponent clamped at 80 (11 in fp16); |α−1| < 1e-6 falls
      back to reverse KL.

    Paper: "Beyond Reverse KL" (f-DPO), https://huggingface.co/papers/2309.16240.

    Args:
        logratios: Log-ratios ``u``, any shape (typically ``(B,)``).
        f_divergence_type: One of ``F_DIVERGENCES.names()``.
        alpha: α of the alpha-divergence (``DPOConfig.f_alpha_divergence_coef``).

    Returns:
        Scores with the shape and dtype of ``logratios``.
    """
    return F_DIVERGENCES.get(f_divergence_type)(logratios, alpha)


# ---------------------------------------------------------------------------------------------------------------
# DPO loss family
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class DPOLossInputs:
    """Per-pair quantities every DPO loss reads. All tensors have shape ``(B,)``.

    Args:
        chosen_logps: Policy log-prob of the chosen completion, summed over its tokens (π_c).
        rejected_logps: Policy log-prob of the rejected completion (π_r).
        ref_chosen_logps: Reference log-prob of the chosen completion (ρ_c).
        ref_rejected_logps: Reference log-prob of the rejected completion (ρ_r).
        chosen_lengths: Number of chosen completion tokens (float); needed by ``ipo`` and ``sigmoid_norm``.
        rejected_lengths: Number of rejected completion tokens (float); needed by ``ipo`` and ``sigmoid_norm``.
        chosen_nll: Token-mean negative log-likelihood of the chosen completion, ``(B,)`` or a scalar that is
            broadcast to every pair; needed by ``sft``. TRL uses the token mean over all chosen tokens of the batch
            (one scalar), so pass that scalar to match it exactly.
    """

    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    ref_chosen_logps: torch.Tensor
    ref_rejected_logps: torch.Tensor
    chosen_lengths: torch.Tensor | None = None
    rejected_lengths: torch.Tensor | None = None
    chosen_nll: torch.Tensor | None = None

    @property
    def chosen_logratios(self) -> torch.Tensor:
        """u_c = π_c − ρ_c, shape ``(B,)``."""
        return self.chosen_logps - self.ref_chosen_logps

    @property
    def rejected_logratios(self) -> torch.Tensor:
        """u_r = π_r − ρ_r, shape ``(B,)``."""
        return self.rejected_logps - self.ref_rejected_logps

    def lengths(self, loss_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(len_c, len_r) clamped to ≥ 1, or a ValueError naming the missing field and the loss that needs it."""
        if self.chosen_lengths is None or self.rejected_lengths is None:
            raise ValueError(
                f"DPO loss_type {loss_type!r} normalises by completion length: pass `chosen_lengths` and "
                "`rejected_lengths` (number of completion tokens per pair) in DPOLossInputs."
            )
        return self.chosen_lengths.clamp(min=1.0), self.rejected_lengths.clamp(min=1.0)


DPO_LOSSES: Registry[Callable[..., torch.Tensor]] = Registry("DPO loss_type")


def _scores(batch: DPOLossInputs, f_divergence_type: str, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        f_divergence_scores(batch.chosen_logratios, f_divergence_type, alpha),
        f_divergence_scores(batch.rejected_logratios, f_divergence_type, alpha),
    )


def _smoothed_logistic(z: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    # Conservative (label-smoothed) logistic loss: -(1-ε) log σ(z) - ε log σ(-z).
    return -(1.0 - label_smoothing) * F.logsigmoid(z) - label_smoothing * F.logsigmoid(-z)


@DPO_LOSSES.register("sigmoid")
def sigmoid(
    batch: DPOLossInputs,
    *,
    beta: float,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """DPO: −log σ(βΔ), Δ = s_c − s_r. https://huggingface.co/papers/2305.18290"""
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    return -F.logsigmoid(beta * (s_c - s_r))


@DPO_LOSSES.register("hinge")
def hinge(
    batch: DPOLossInputs,
    *,
    beta: float,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """SLiC / RSO hinge: max(0, 1 − βΔ) (β is the reciprocal margin). https://huggingface.co/papers/2309.06657"""
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    return torch.relu(1.0 - beta * (s_c - s_r))


@DPO_LOSSES.register("ipo")
def ipo(
    batch: DPOLossInputs,
    *,
    beta: float,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """IPO: (s_c/len_c − s_r/len_r − 1/(2β))², β playing τ. https://huggingface.co/papers/2310.12036

    The length normalisation is TRL's (agreed with the IPO authors): summed log-ratios would make the squared loss
    grow with completion length.
    """
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    len_c, len_r = batch.lengths("ipo")
    return (s_c / len_c - s_r / len_r - 1.0 / (2.0 * beta)) ** 2


@DPO_LOSSES.register("exo_pair")
def exo_pair(
    batch: DPOLossInputs,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """EXO (pairwise, Eq. 16): KL([σ(βΔ), σ(−βΔ)] ‖ [1−ε, ε]), ε = ``label_smoothing`` > 0.

    = σ(βΔ)(log σ(βΔ) − log(1−ε)) + σ(−βΔ)(log σ(−βΔ) − log ε). https://huggingface.co/papers/2402.00856
    """
    if not label_smoothing > 0.0:
        raise ValueError(_EXO_SMOOTHING_ERROR)
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    z = beta * (s_c - s_r)
    return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-label_smoothing)) + torch.sigmoid(-z) * (
        F.logsigmoid(-z) - math.log(label_smoothing)
    )


@DPO_LOSSES.register("nca_pair")
def nca_pair(
    batch: DPOLossInputs,
    *,
    beta: float,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """NCA: −log σ(βs_c) − ½ log σ(−βs_c) − ½ log σ(−βs_r). https://huggingface.co/papers/2402.05369"""
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    r_c, r_r = beta * s_c, beta * s_r
    return -F.logsigmoid(r_c) - 0.5 * F.logsigmoid(-r_c) - 0.5 * F.logsigmoid(-r_r)


@DPO_LOSSES.register("robust")
def robust(
    batch: DPOLossInputs,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """Robust DPO: [−(1−ε) log σ(βΔ) + ε log σ(−βΔ)] / (1 − 2ε), ε = label-flip probability ∈ [0, 0.5).

    Unbiased estimate of the clean DPO loss under flips with probability ε. https://huggingface.co/papers/2403.00409
    """
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    z = beta * (s_c - s_r)
    eps = label_smoothing
    return (-(1.0 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1.0 - 2.0 * eps)


@DPO_LOSSES.register("bco_pair")
def bco_pair(
    batch: DPOLossInputs,
    *,
    beta: float,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """BCO (pairwise): −log σ(βs_c) − log σ(−βs_r). https://huggingface.co/papers/2404.04656"""
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    return -F.logsigmoid(beta * s_c) - F.logsigmoid(-beta * s_r)


@DPO_LOSSES.register("sppo_hard")
def sppo_hard(
    batch: DPOLossInputs,
    *,
    beta: float,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """SPPO with hard labels (winner P=1, loser P=0): (s_c − 1/(2β))² + (s_r + 1/(2β))².

    https://huggingface.co/papers/2405.00675
    """
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    return (s_c - 0.5 / beta) ** 2 + (s_r + 0.5 / beta) ** 2


@DPO_LOSSES.register("aot")
def aot(batch: DPOLossInputs, *, beta: float, label_smoothing: float = 0.0, **_) -> torch.Tensor:
    """AOT (paired): d = sort(π_c − π_r) − sort(ρ_c − ρ_r) over the batch; −(1−ε) log σ(βd) − ε log σ(−βd).

    Sorting matches quantiles of the policy and reference margin distributions (stochastic dominance via optimal
    transport in 1-D), so element i of the result belongs to quantile i, not to pair i; f-divergences do not apply.
    https://huggingface.co/papers/2406.05882
    """
    margins, _ = torch.sort(batch.chosen_logps - batch.rejected_logps, dim=0)
    ref_margins, _ = torch.sort(batch.ref_chosen_logps - batch.ref_rejected_logps, dim=0)
    return _smoothed_logistic(beta * (margins - ref_margins), label_smoothing)


@DPO_LOSSES.register("aot_unpaired")
def aot_unpaired(batch: DPOLossInputs, *, beta: float, label_smoothing: float = 0.0, **_) -> torch.Tensor:
    """AOT (unpaired): d = sort(u_c) − sort(u_r) over the batch; −(1−ε) log σ(βd) − ε log σ(−βd).

    https://huggingface.co/papers/2406.05882
    """
    u_c, _ = torch.sort(batch.chosen_logratios, dim=0)
    u_r, _ = torch.sort(batch.rejected_logratios, dim=0)
    return _smoothed_logistic(beta * (u_c - u_r), label_smoothing)


@DPO_LOSSES.register("apo_zero")
def apo_zero(batch: DPOLossInputs, *, beta: float, **_) -> torch.Tensor:
    """APO-zero (Eq. 7): (1 − σ(βu_c)) + σ(βu_r) — raise chosen, lower rejected.

    https://huggingface.co/papers/2408.06266
    """
    return (1.0 - torch.sigmoid(beta * batch.chosen_logratios)) + torch.sigmoid(beta * batch.rejected_logratios)


@DPO_LOSSES.register("apo_down")
def apo_down(
    batch: DPOLossInputs,
    *,
    beta: float,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """APO-down (Eq. 8): σ(βu_c) + (1 − σ(βΔ)) — lower both, the rejected more.

    https://huggingface.co/papers/2408.06266
    """
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    return torch.sigmoid(beta * batch.chosen_logratios) + (1.0 - torch.sigmoid(beta * (s_c - s_r)))


@DPO_LOSSES.register("discopop")
def discopop(
    batch: DPOLossInputs,
    *,
    beta: float,
    discopop_tau: float = 0.05,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """DiscoPOP (log-ratio modulated loss, Eq. 5): z = βΔ, m = σ(z/τ); (1 − m)·(−log σ(z)) + m·e^{−z}.

    Blends the logistic loss (z ≪ 0) with the exponential loss (z ≫ 0). https://huggingface.co/papers/2406.08414
    """
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    z = beta * (s_c - s_r)
    m = torch.sigmoid(z / discopop_tau)
    return (1.0 - m) * (-F.logsigmoid(z)) + m * torch.exp(-z)


@DPO_LOSSES.register("sft")
def sft(batch: DPOLossInputs, **_) -> torch.Tensor:
    """SFT / NLL term on the chosen completion (RPO, MPO): ``chosen_nll`` broadcast to ``(B,)``."""
    if batch.chosen_nll is None:
        raise ValueError(
            "DPO loss_type 'sft' needs `chosen_nll` in DPOLossInputs (token-mean NLL of the chosen completions)."
        )
    return batch.chosen_nll.expand_as(batch.chosen_logps)


@DPO_LOSSES.register("sigmoid_norm")
def sigmoid_norm(
    batch: DPOLossInputs,
    *,
    beta: float,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    **_,
) -> torch.Tensor:
    """Length-normalised DPO (SimPO's "DPO w/ LN", Tülu 3): −log σ(β(s_c/len_c − s_r/len_r)).

    https://huggingface.co/papers/2405.14734, https://huggingface.co/papers/2411.15124
    """
    s_c, s_r = _scores(batch, f_divergence_type, f_alpha_divergence_coef)
    len_c, len_r = batch.lengths("sigmoid_norm")
    return -F.logsigmoid(beta * (s_c / len_c - s_r / len_r))


_EXO_SMOOTHING_ERROR = (
    "DPO loss_type 'exo_pair' requires `label_smoothing` > 0 (it is the ε of the target distribution [1-ε, ε]); "
    "a recommended value is 1e-3."
)
_SORTING_LOSSES = ("aot", "aot_unpaired")


def _loss_name(loss_type: str | Callable[..., torch.Tensor]) -> str:
    return loss_type if isinstance(loss_type, str) else getattr(loss_type, "__name__", repr(loss_type))


def validate_dpo_loss_config(
    loss_types: str | Callable[..., torch.Tensor] | Sequence[str | Callable[..., torch.Tensor]],
    loss_weights: Sequence[float] | None = None,
    *,
    label_smoothing: float = 0.0,
    use_weighting: bool = False,
) -> tuple[list[Callable[..., torch.Tensor]], list[float]]:
    """Resolve ``loss_type`` / ``loss_weights`` and check the combinations TRL rejects, before any training step.

    Raises ``ValueError`` for unknown names, a ``loss_weights`` length that differs from the number of loss types,
    ``exo_pair`` with ``label_smoothing == 0``, and WPO weighting with ``aot``/``aot_unpaired`` (their per-element
    losses belong to sorted quantiles, not to pairs). Warns when ``robust`` gets ``label_smoothing`` outside
    [0, 0.5).

    Returns:
        (loss functions, weights) — weights default to 1.0 each.
    """
    if isinstance(loss_types, str) or callable(loss_types):
        loss_types = [loss_types]
    loss_types = list(loss_types)
    if not loss_types:
        raise ValueError("`loss_type` is empty: give at least one DPO loss type, e.g. 'sigmoid'.")
    fns = [DPO_LOSSES.get(name) for name in loss_types]
    if loss_weights is None:
        weights = [1.0] * len(fns)
    else:
        weights = [float(w) for w in loss_weights]
        if len(weights) != len(fns):
            raise ValueError(
                f"Length of `loss_weights` ({len(weights)}) must match the number of loss types in `loss_type` "
                f"({len(fns)}): give one weight per loss type, in the same order."
            )
    names = [_loss_name(t) for t in loss_types]
    if "exo_pair" in names and not label_smoothing > 0.0:
        raise ValueError(_EXO_SMOOTHING_ERROR)
    if use_weighting and any(n in _SORTING_LOSSES for n in names):
        raise ValueError(
            "`use_weighting=True` (WPO) is not supported with loss_type 'aot' or 'aot_unpaired': their losses are "
            "computed on sorted quantiles, so per-pair weights no longer line up. Set `use_weighting=False`."
        )
    if "robust" in names and not (0.0 <= label_smoothing < 0.5):
        warnings.warn(
            f"`label_smoothing` should lie in [0.0, 0.5) for the 'robust' DPO loss (it is the label-flip "
            f"probability); you used {label_smoothing}.",
            UserWarning,
            stacklevel=2,
        )
    return fns, weights


def dpo_loss(
    inputs: DPOLossInputs,
    loss_types: str | Callable[..., torch.Tensor] | Sequence[str | Callable[..., torch.Tensor]] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = 0.5,
    discopop_tau: float = 0.05,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum of DPO losses: L = Σ_k w_k · mean_i(weights_i · loss_k,i).

    Args:
        inputs: Per-pair log-probs (and lengths / NLL when the loss types need them), all ``(B,)``.
        loss_types: A ``DPOConfig.loss_type`` name, a callable with the ``DPO_LOSSES`` signature, or a list.
        loss_weights: One weight per loss type (``DPOConfig.loss_weights``); default 1.0 each.
        beta: β (τ for IPO).
        label_smoothing: ε for ``robust``, ``exo_pair``, ``aot``, ``aot_unpaired``.
        f_divergence_type: f-DPO divergence, see ``f_divergence_scores``.
        f_alpha_divergence_coef: α for ``"alpha_divergence"``.
        discopop_tau: τ for ``discopop``.
        weights: Optional per-pair weights ``(B,)`` multiplied into every loss (WPO, see ``wpo_pair_weight``).

    Returns:
        ``(loss, metrics)``: a scalar loss and ``{"chosen_rewards": β·(π_c − ρ_c), "rejected_rewards":
        β·(π_r − ρ_r)}``, both ``(B,)`` and detached (TRL's ``rewards/*`` metrics).
    """
    fns, ws = validate_dpo_loss_config(
        loss_types, loss_weights, label_smoothing=label_smoothing, use_weighting=weights is not None
    )
    hyper = {
        "beta": beta,
        "label_smoothing": label_smoothing,
        "f_divergence_type": f_divergence_type,
        "f_alpha_divergence_coef": f_alpha_divergence_coef,
        "discopop_tau": discopop_tau,
    }
    total = inputs.chosen_logps.new_zeros(())
    for fn, w in zip(fns, ws):
        per_pair = fn(inputs, **hyper)
        if weights is not None:
            per_pair = per_pair * weights
        total = total + w * per_pair.mean()
    metrics = {
        "chosen_rewards": (beta * inputs.chosen_logratios).detach(),
        "rejected_rewards": (beta * inputs.rejected_logratios).detach(),
    }
    return total, metrics


# ---------------------------------------------------------------------------------------------------------------
# WPO and LD-DPO (per-token inputs)
# ---------------------------------------------------------------------------------------------------------------


def wpo_token_log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """Per-token WPO normaliser log Σ_v p_v² = logsumexp(2z) − 2·logsumexp(z) from logits ``z`` of shape (..., V).

    Computed in float32 under ``no_grad``; returns shape ``(...)``. Call it per chunk of tokens when logits are
    produced chunk by chunk, and feed the result to ``wpo_sequence_weight``.
    """
    with torch.no_grad():
        z = logits.float()
        return torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1)


def wpo_sequence_weight(
    token_logps: torch.Tensor, token_log_normalizer: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """WPO per-sequence weight w(x, y) = exp( mean_t [log p_t − log Σ_v p_{t,v}²] ) over the completion tokens.

    Eq. 2 of WPO (https://huggingface.co/papers/2406.11827): the log-prob of each sampled token is renormalised by
    the distribution's collision probability Σ_v p_v², so that off-policy pairs (which the current policy is
    unlikely to sample) get small weights. Detached: the weight scales the loss, it is not optimised.

    Args:
        token_logps: Log-probs of the completion tokens, ``(B, T)``.
        token_log_normalizer: ``logsumexp(2z_t) − 2·logsumexp(z_t)`` per token, ``(B, T)``
            (see ``wpo_token_log_normalizer``).
        mask: 1 for completion tokens, 0 elsewhere, ``(B, T)``.

    Returns:
        Weights ``(B,)``; a sequence with no completion tokens gets exp(0) = 1.
    """
    with torch.no_grad():
        m = mask.to(torch.float32)
        adjusted = (token_logps.float() - token_log_normalizer.float()) * m
        return torch.exp(adjusted.sum(dim=-1) / m.sum(dim=-1).clamp(min=1.0))


def wpo_pair_weight(chosen_weight: torch.Tensor, rejected_weight: torch.Tensor) -> torch.Tensor:
    """WPO per-pair weight w(x, y_c)·w(x, y_r), unclamped as in TRL 1.16 (it exceeds 1 when the sampled tokens are
    more likely than the distribution's collision probability, e.g. the mode of a peaked one; older TRL releases
    clamped it at 1). Shapes ``(B,)``; detached. Pass the result as ``dpo_loss(..., weights=...)``."""
    return (chosen_weight * rejected_weight).detach()


def ld_weighted_logps(
    token_logps_chosen: torch.Tensor,
    mask_chosen: torch.Tensor,
    token_logps_rejected: torch.Tensor,
    mask_rejected: torch.Tensor,
    ld_alpha: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LD-DPO sequence log-probs: Σ over the first l_p completion tokens + α · Σ over the rest.

    l_p = min(len_c, len_r) is the shared ("public") length of the pair, so only the longer completion has a tail;
    α < 1 down-weights it and removes DPO's reward for verbosity. α = 1 is plain summation.
    Paper: https://huggingface.co/papers/2409.06411. Apply it to policy and reference log-probs alike.

    Completion tokens are counted through the mask (cumulative sum), so masks may start with prompt or padding
    zeros and chosen/rejected may have different ``T``.

    Args:
        token_logps_chosen: ``(B, Tc)`` per-token log-probs of the chosen sequences.
        mask_chosen: ``(B, Tc)`` completion mask of the chosen sequences.
        token_logps_rejected: ``(B, Tr)``.
        mask_rejected: ``(B, Tr)``.
        ld_alpha: α ∈ [0, 1], ``DPOConfig.ld_alpha``.

    Returns:
        ``(chosen_logps, rejected_logps)``, each ``(B,)``.
    """
    m_c = mask_chosen.to(token_logps_chosen.dtype)
    m_r = mask_rejected.to(token_logps_rejected.dtype)
    public = torch.minimum(m_c.sum(dim=-1), m_r.sum(dim=-1)).unsqueeze(-1)  # (B, 1)

    def weighted(token_logps: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        position = torch.cumsum(m, dim=-1)  # 1-based index of each completion token
        front = m * (position <= public).to(m.dtype)
        rear = m - front
        return (token_logps * front).sum(dim=-1) + ld_alpha * (token_logps * rear).sum(dim=-1)

    return weighted(token_logps_chosen, m_c), weighted(token_logps_rejected, m_r)


# ---------------------------------------------------------------------------------------------------------------
# KTO
# ---------------------------------------------------------------------------------------------------------------

KTO_LOSSES: Registry[Callable[..., tuple[torch.Tensor, torch.Tensor]]] = Registry("KTO loss_type")


@KTO_LOSSES.register("kto")
def _kto(u_d: torch.Tensor, u_u: torch.Tensor, kl: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    return 1.0 - torch.sigmoid(beta * (u_d - kl)), 1.0 - torch.sigmoid(beta * (kl - u_u))


@KTO_LOSSES.register("apo_zero_unpaired")
def _apo_zero_unpaired(
    u_d: torch.Tensor, u_u: torch.Tensor, kl: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return 1.0 - torch.sigmoid(beta * u_d), torch.sigmoid(beta * u_u)


def kto_kl_estimate(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor, clamp: bool = True) -> torch.Tensor:
    """KTO reference point z = max(0, mean_i(π(y'_i|x_i) − π_ref(y'_i|x_i))), detached.

    ``kl_logps`` / ``ref_kl_logps`` ``(B,)`` are log-probs of mismatched (prompt, completion) pairs (completions
    rotated by one within the batch). In multi-process training, TRL averages the *unclamped* per-process means
    across processes and clamps afterwards: compute with ``clamp=False``, gather-mean, then ``.clamp(min=0)``.
    """
    z = (kl_logps - ref_kl_logps).mean().detach()
    return z.clamp(min=0.0) if clamp else z


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    labels: torch.Tensor,
    kl: torch.Tensor | float,
    *,
    beta: float = 0.1,
    loss_type: str = "kto",
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KTO loss over an unpaired batch (https://huggingface.co/papers/2402.01306).

    With u = π − ρ (summed completion log-probs) and reference point z = ``kl``:

    - ``"kto"``: desirable L = 1 − σ(β(u − z)); undesirable L = 1 − σ(β(z − u)).
    - ``"apo_zero_unpaired"``: desirable L = 1 − σ(βu); undesirable L = σ(βu) (``kl`` ignored).

    loss = nanmean(concat(w_d · L_desirable, w_u · L_undesirable)) — a mean over all examples of the batch, so a
    batch with only one class still gives a finite loss (and an empty batch gives NaN).

    Args:
        policy_logps: ``(B,)`` policy log-probs of the completions.
        ref_logps: ``(B,)`` reference log-probs.
        labels: ``(B,)`` bool, True for desirable completions.
        kl: Scalar reference point (from ``kto_kl_estimate``; already clamped and detached).
        beta: β.
        loss_type: ``"kto"`` or ``"apo_zero_unpaired"``.
        desirable_weight: w_d (``KTOConfig.desirable_weight``).
        undesirable_weight: w_u.

    Returns:
        ``(loss, chosen_rewards, rejected_rewards)`` with rewards β·u (detached) of the desirable ``(n_d,)`` and
        undesirable ``(n_u,)`` examples, in batch order.
    """
    labels = labels.to(torch.bool)
    if labels.shape != policy_logps.shape:
        raise ValueError(
            f"KTO `labels` must have one bool per completion: got shape {tuple(labels.shape)} for "
            f"{tuple(policy_logps.shape)} log-probs."
        )
    fn = KTO_LOSSES.get(loss_type)
    u = policy_logps - ref_logps
    u_d, u_u = u[labels], u[~labels]
    kl_t = torch.as_tensor(kl, dtype=u.dtype, device=u.device)
    loss_d, loss_u = fn(u_d, u_u, kl_t, beta)
    loss = torch.cat([desirable_weight * loss_d, undesirable_weight * loss_u]).nanmean()
    return loss, (beta * u_d).detach(), (beta * u_u).detach()


def kto_weight_range_warning(
    n_desirable: int, n_undesirable: int, desirable_weight: float = 1.0, undesirable_weight: float = 1.0
) -> str | None:
    """Warning text when class counts differ and neither class weight is in KTO's recommended range, else None.

    Eq. 8 of the KTO paper recommends λ_D·n_D / (λ_U·n_U) ∈ [1, 4/3]; solved for one weight with the other fixed:
    desirable_weight ∈ [n_u·w_u/n_d, 1.33·n_u·w_u/n_d] or undesirable_weight ∈ [n_d·w_d/(1.33·n_u), n_d·w_d/n_u]
    (bounds rounded to 2 decimals). Being inside either range is enough.
    """
    if n_desirable == n_undesirable or n_desirable == 0 or n_undesirable == 0:
        return None
    des_ratio = n_undesirable * undesirable_weight / n_desirable
    und_ratio = n_desirable * desirable_weight / n_undesirable
    des_lo, des_hi = round(des_ratio, 2), round(des_ratio * 1.33, 2)
    und_lo, und_hi = round(und_ratio / 1.33, 2), round(und_ratio, 2)
    if des_lo <= desirable_weight <= des_hi or und_lo <= undesirable_weight <= und_hi:
        return None
    return (
        f"You have different amounts of desirable/positive ({n_desirable}) and undesirable/negative "
        f"({n_undesirable}) examples but the weights on the desirable and undesirable losses don't seem to be in an "
        f"ideal range. Based on your data, we recommend EITHER desirable_weight in [{des_lo}, {des_hi}] or "
        f"undesirable_weight in [{und_lo}, {und_hi}] (but NOT BOTH). See the KTO documentation on how to set these "
        "weights."
    )


# ---------------------------------------------------------------------------------------------------------------
# Reward modelling
# ---------------------------------------------------------------------------------------------------------------


def bradley_terry_loss(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    margin: torch.Tensor | None = None,
    center_rewards_coefficient: float | None = None,
) -> torch.Tensor:
    """Bradley–Terry pairwise loss: −mean log σ(r_c − r_r − m) + η·mean((r_c + r_r)²).

    m is the dataset's ``margin`` column (0 when absent), as in Llama 2 (https://huggingface.co/papers/2307.09288);
    η = ``center_rewards_coefficient`` (None = off) pushes rewards towards zero mean
    (https://huggingface.co/papers/2312.09244).

    Args:
        chosen_rewards: ``(B,)`` reward-model scores of the chosen sequences.
        rejected_rewards: ``(B,)`` scores of the rejected sequences.
        margin: Optional ``(B,)`` required reward gap.
        center_rewards_coefficient: Optional η.

    Returns:
        Scalar loss.
    """
    logits = chosen_rewards - rejected_rewards
    if margin is not None:
        logits = logits - margin.to(logits.dtype)
    loss = -F.logsigmoid(logits).mean()
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * torch.mean((chosen_rewards + rejected_rewards) ** 2)
    return loss
