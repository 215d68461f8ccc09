"""The option checks SDFT and SDPO share: the self-distillation loss, the teacher and the served teacher.

One function so the two configs refuse the same bad values with the same messages (TRL's conditions); each config
adds its own checks (SDFT's teacher-prompt template, SDPO's distillation weight and re-prompt templates)."""

from __future__ import annotations

from typing import Any

from posttrain.core.self_distillation import DISTILLATION_MODES
from posttrain.models.teacher_sync import TEACHER_MODEL_KINDS

__all__ = ["check_self_distillation_options"]


def check_self_distillation_options(config: Any) -> None:
    """Raise a ``ValueError`` naming the option and the fix for a contradictory self-distillation setting."""
    mode, alpha = config.distillation_mode, config.distillation_alpha
    if mode not in DISTILLATION_MODES:
        raise ValueError(
            f"distillation_mode must be one of: {', '.join(repr(m) for m in DISTILLATION_MODES)}, got {mode!r}."
        )
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(
            f"distillation_alpha must be in [0, 1] (0 = forward KL, 1 = reverse KL, 0.5 = JSD), got {alpha}."
        )
    if mode == "sampled_token" and alpha != 1.0:
        raise ValueError(
            "`distillation_mode='sampled_token'` only supports reverse KL, so it requires `distillation_alpha=1.0`, "
            f"got {alpha}. Use distillation_mode='topk_logits' or 'full_logits' for another divergence."
        )
    if mode == "topk_logits" and (config.distillation_topk is None or config.distillation_topk < 1):
        raise ValueError(
            "`distillation_mode='topk_logits'` requires `distillation_topk` to be a positive integer, got "
            f"{config.distillation_topk}."
        )
    if config.distillation_is_clip is not None and not config.distillation_is_clip > 0:
        raise ValueError(
            f"distillation_is_clip must be > 0 (or None to disable clipping), got {config.distillation_is_clip}."
        )
    if config.teacher_model_kind not in TEACHER_MODEL_KINDS:
        raise ValueError(
            f"teacher_model_kind must be one of {', '.join(repr(k) for k in TEACHER_MODEL_KINDS)}, got "
            f"{config.teacher_model_kind!r}."
        )
    if not 0.0 <= config.teacher_update_rate <= 1.0:
        raise ValueError(f"teacher_update_rate must be in [0, 1], got {config.teacher_update_rate}.")
    if config.teacher_sync_steps < 1:
        raise ValueError(f"teacher_sync_steps must be >= 1, got {config.teacher_sync_steps}.")
    if config.use_teacher_server:
        _check_teacher_server(config)


def _check_teacher_server(config: Any) -> None:
    """TRL's conditions for ``use_teacher_server`` (the live teacher's log-probs come from the generation server)."""
    if not (config.use_vllm and config.vllm_mode == "server"):
        raise ValueError(
            "`use_teacher_server=True` requires `use_vllm=True` and `vllm_mode='server'`: teacher logprobs are "
            "served by the same server used for generation (`posttrain serve` or `trl vllm-serve`)."
        )
    if config.teacher_model_kind != "live":
        raise ValueError(
            "`use_teacher_server=True` only supports `teacher_model_kind='live'` (the generation server holds the "
            f"current student weights), got {config.teacher_model_kind!r}."
        )
    weight = getattr(config, "distillation_weight", 1.0)
    if weight != 1.0:
        raise ValueError(
            "`use_teacher_server=True` only supports pure self-distillation with `distillation_weight=1.0`, got "
            f"{weight}. A convex blend with the policy loss needs the full-vocabulary logits, which the server "
            "does not return."
        )
    if config.distillation_mode not in ("sampled_token", "topk_logits"):
        raise ValueError(
            "`use_teacher_server=True` only supports `distillation_mode` in {'sampled_token', 'topk_logits'}, got "
            f"{config.distillation_mode!r}. The server returns the teacher's top-k logprobs, not the full "
            "vocabulary, so `full_logits` is unavailable. Note `topk_logits` distills over the teacher's own "
            "top-k support (the server cannot score the student's top-k indices)."
        )
