"""Experimental trainers and helpers, under TRL's ``trl.experimental`` module names.

``from trl.experimental.cpo import CPOConfig, CPOTrainer`` becomes ``from posttrain.experimental.cpo import ...``.
Submodules: ``cpo`` (CPO, SimPO, AlphaPO), ``orpo``, ``tpo``, ``prm`` (process reward models),
``bema_for_ref_model`` (BEMACallback and the DPO trainer whose reference tracks BEMA weights),
``merge_model_callback`` (mergekit, optional extra) and ``utils`` (TRL's experimental collators); online trainers on
the shared rollout: ``gmpo``, ``grpo_with_replay_buffer``, ``online_dpo``, ``a2po``, ``ppo``, ``sdpo``, ``async_grpo``
(generation through ``posttrain serve`` in a separate rollout worker); the distillation family: ``gkd``, ``gold``
(cross-tokenizer ULD), ``iw_opd``, ``server_distillation`` (teacher behind a server), ``async_distillation``
(AsyncGRPO's rollout worker with teacher servers) and ``sdft`` (self-distillation: the student, given privileged
context, is its own teacher). ``distillation`` and ``kto`` are the deprecated paths of trainers TRL promoted to its
stable API (building them warns ``FutureWarning`` and names the stable import).

Anything here may change or be removed in any release without deprecation, as in TRL; importing this package warns
``TRLExperimentalWarning`` once, unless the environment variable ``TRL_EXPERIMENTAL_SILENCE`` is set (TRL's switch).
"""

from __future__ import annotations

import os
import warnings

__all__ = ["TRLExperimentalWarning"]


class TRLExperimentalWarning(UserWarning):
    """Warning for using the ``posttrain.experimental`` submodule (TRL's name, so filters written for TRL apply)."""


if not os.environ.get("TRL_EXPERIMENTAL_SILENCE"):
    warnings.warn(
        "You are importing from 'posttrain.experimental'. APIs here are unstable and may change or be removed "
        "without notice. Silence this warning by setting environment variable TRL_EXPERIMENTAL_SILENCE=1.",
        TRLExperimentalWarning,
        stacklevel=2,
    )
