"""The trainers' class structure (issue 34, item 5): composition, not mixin towers.

The rule, checked for every trainer class posttrain exports (``posttrain.__all__`` and the ``__all__`` of every
``posttrain.experimental.*`` package: the classes that subclass ``transformers.Trainer``):

- **depth**: at most 4 posttrain classes in the trainer's MRO, the trainer itself included (``transformers.Trainer``,
  ``object`` and other non-posttrain classes are not counted) — e.g. ``AsyncGRPOTrainer → GRPOTrainer →
  OnlineTrainerBase → BaseTrainer``;
- **one loss**: at most one posttrain class in the MRO defines ``_compute_loss``, not counting
  ``OnlineTrainerBase``'s, the generic contract that only raises ``TypeError`` naming the missing override.

What varies inside a family is composed, not inherited: the distillation trainers' loss is a strategy object
(``DistillationTrainer.loss_strategy``: the full-vocabulary divergence, the sparse / IW-OPD / served-teacher support,
GOLD's ULD, the async trainer's) behind ``DistillationTrainer._compute_loss``; the async trainers' worker and weight
pushes are an ``AsyncRollout`` component (``posttrain.rollout.async_worker``) the trainer delegates to; the
self-distillation term of SDFT and SDPO is a ``SelfDistillation`` component
(``posttrain.experimental._self_distillation``), and SDPO's ``(1 − w)·GRPO + w·self-distillation`` is a loss strategy
(``GRPOTrainer.loss_strategy``) behind ``GRPOTrainer._compute_loss``.

``EXCEPTIONS`` names the trainers that still break the rule, each with its reason; an entry that no longer breaks
it must be removed (``test_exceptions_are_still_needed``), so the list only shrinks.
"""

from __future__ import annotations

import importlib
import inspect
import os
import pkgutil

import pytest
import transformers

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import posttrain  # noqa: E402
import posttrain.experimental  # noqa: E402
from posttrain.trainers.online import OnlineTrainerBase  # noqa: E402

MAX_DEPTH = 4
GENERIC_LOSS = (OnlineTrainerBase,)  # defines _compute_loss only to raise "must define _compute_loss()"

EXCEPTIONS: dict[str, str] = {}


def exported_trainers() -> dict[str, type]:
    """``"module:Name" -> class`` for every ``transformers.Trainer`` subclass posttrain exports."""
    modules = [posttrain]
    for info in pkgutil.iter_modules(posttrain.experimental.__path__):
        if info.ispkg:
            modules.append(importlib.import_module(f"posttrain.experimental.{info.name}"))
    found = {}
    for module in modules:
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name)
            if inspect.isclass(obj) and issubclass(obj, transformers.Trainer):
                found[f"{module.__name__}:{name}"] = obj
    return found


def posttrain_mro(cls: type) -> list[type]:
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == "posttrain"]


def structure_problems(cls: type) -> list[str]:
    """What ``cls`` breaks of the rule (empty: nothing)."""
    chain = posttrain_mro(cls)
    problems = []
    if len(chain) > MAX_DEPTH:
        problems.append(f"{len(chain)} posttrain classes deep: {' → '.join(c.__name__ for c in chain)}")
    losses = [c for c in chain if "_compute_loss" in c.__dict__ and c not in GENERIC_LOSS]
    if len(losses) > 1:
        problems.append(f"_compute_loss defined by {len(losses)} classes: {', '.join(c.__name__ for c in losses)}")
    return problems


TRAINERS = exported_trainers()


def test_the_walk_finds_the_trainers():
    names = {cls.__name__ for cls in TRAINERS.values()}
    expected = {"SFTTrainer", "DPOTrainer", "GRPOTrainer", "DistillationTrainer", "AsyncGRPOTrainer",
                "AsyncDistillationTrainer", "IWOPDTrainer", "ServerDistillationTrainer", "GOLDTrainer", "GKDTrainer",
                "CPOTrainer", "ORPOTrainer", "TPOTrainer", "SDFTTrainer", "SDPOTrainer", "PPOTrainer"}  # fmt: skip
    assert expected <= names, expected - names


@pytest.mark.parametrize("key", sorted(TRAINERS))
def test_trainer_depth_and_one_compute_loss(key):
    cls = TRAINERS[key]
    if cls.__name__ in EXCEPTIONS:
        pytest.skip(EXCEPTIONS[cls.__name__])
    assert not structure_problems(cls), f"{key}: {structure_problems(cls)}"


def test_exceptions_are_still_needed():
    by_name = {cls.__name__: cls for cls in TRAINERS.values()}
    stale = [name for name in EXCEPTIONS if name not in by_name or not structure_problems(by_name[name])]
    assert not stale, f"remove these from EXCEPTIONS: {stale}"


def test_the_check_catches_a_mixin_tower():
    """The check itself: the old AsyncDistillationTrainer shape (two mixins over DistillationTrainer, each adding a
    _compute_loss) is reported on both counts."""
    from posttrain.trainers.distillation import DistillationTrainer

    class LossMixin:
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    class RolloutMixin:
        pass

    LossMixin.__module__ = RolloutMixin.__module__ = "posttrain.experimental.tower"

    class Tower(RolloutMixin, LossMixin, DistillationTrainer):
        __module__ = "posttrain.experimental.tower"

        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs)

    problems = structure_problems(Tower)
    assert len(problems) == 2
    assert problems[0].startswith("6 posttrain classes deep")
    assert "Tower, LossMixin, DistillationTrainer" in problems[1]


def test_online_rl_config_has_its_own_module_and_keeps_its_old_import_path():
    """OnlineRLConfig moved out of trainers/online.py (the trainer base, at the design's size cap) into
    trainers/online_config.py; ``from posttrain.trainers.online import OnlineRLConfig`` keeps working."""
    from posttrain.trainers import online, online_config
    from posttrain.trainers.grpo import GRPOConfig

    assert online.OnlineRLConfig is online_config.OnlineRLConfig
    assert online.GENERATION_BACKENDS is online_config.GENERATION_BACKENDS
    assert online_config.OnlineRLConfig.__module__ == "posttrain.trainers.online_config"
    assert issubclass(GRPOConfig, online_config.OnlineRLConfig)


def test_grpo_compute_loss_hands_the_micro_batch_to_a_loss_strategy():
    """``GRPOTrainer._compute_loss`` returns ``loss_strategy(trainer, model, inputs)`` when one is set (SDPO's
    ``SDPOLoss``: (1 − w)·GRPO + w·self-distillation), so a trainer adding a term to GRPO's loss composes it instead
    of overriding ``_compute_loss``; without one it is GRPO's own loss."""
    from types import SimpleNamespace

    from posttrain.experimental.sdpo.sdpo_trainer import SDPOLoss, SDPOTrainer
    from posttrain.trainers.grpo import GRPOTrainer

    assert GRPOTrainer.loss_strategy is None
    assert isinstance(SDPOTrainer.loss_strategy, SDPOLoss)
    calls = []
    host = SimpleNamespace(loss_strategy=lambda trainer, model, inputs: calls.append((trainer, model, inputs)) or 7.0)
    assert GRPOTrainer._compute_loss(host, "model", "inputs") == 7.0
    assert calls == [(host, "model", "inputs")]
    plain = SimpleNamespace(loss_strategy=None, _grpo_loss=lambda model, inputs: ("grpo", model, inputs))
    assert GRPOTrainer._compute_loss(plain, "model", "inputs") == ("grpo", "model", "inputs")
