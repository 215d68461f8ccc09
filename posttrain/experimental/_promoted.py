"""Old ``experimental`` import paths of trainers that TRL promoted to its stable API (TRL keeps them, deprecated).

``from trl.experimental.distillation import DistillationTrainer`` (how TRL's examples were written before the
promotion) still works in TRL 1.16, with a ``FutureWarning`` naming the stable import. posttrain mirrors each such
path with subclasses of its stable classes that warn the same way when a config or a trainer is built.
"""

from __future__ import annotations

import dataclasses
import warnings


def promoted(config_class: type, trainer_class: type, module: str) -> tuple[type, type]:
    """``(Config, Trainer)`` subclasses for ``posttrain.experimental.<module>`` that warn, on construction, that the
    path is deprecated and name ``from posttrain import <Name>`` as the replacement."""

    def message(name: str) -> str:
        return (
            f"`posttrain.experimental.{module}.{name}` (TRL's `trl.experimental.{module}`) is deprecated: "
            f"`{name}` is part of the stable API. Update your imports to `from posttrain import {name}`."
        )

    def config_post_init(self) -> None:
        warnings.warn(message(config_class.__name__), FutureWarning, stacklevel=3)
        config_class.__post_init__(self)

    def trainer_init(self, *args, **kwargs) -> None:
        warnings.warn(message(trainer_class.__name__), FutureWarning, stacklevel=2)
        trainer_class.__init__(self, *args, **kwargs)

    qualified = f"posttrain.experimental.{module}"
    config = dataclasses.dataclass(
        type(config_class.__name__, (config_class,), {"__post_init__": config_post_init, "__module__": qualified,
                                                      "__doc__": config_class.__doc__})
    )
    trainer = type(trainer_class.__name__, (trainer_class,), {"__init__": trainer_init, "__module__": qualified,
                                                              "__doc__": trainer_class.__doc__})
    return config, trainer
