"""The configuration base of the reference-free pairwise trainers (CPO, ORPO, TPO).

:class:`ReferenceFreePairwiseConfig` is the explicit base of ``CPOConfig``, ``ORPOConfig`` and ``TPOConfig``: it names
the fields :class:`~posttrain.experimental._pairwise.ReferenceFreePairwiseTrainer` reads (``REQUIRED_FIELDS``), refuses
at construction a subclass that does not declare one of them (naming it and the fix, instead of an ``AttributeError``
deep in the trainer), and runs the option checks the three share (:func:`check_common_options`).

The fields themselves are declared by each config with :func:`pairwise_field`, which holds the one default and help
of each shared field. They are not dataclass fields of the base because a base's fields come first in every
subclass, which would reorder each config's fields (TRL's order, as ``HfArgumentParser`` lists them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from posttrain.trainers.base import BaseConfig

__all__ = ["PAIRWISE_FIELDS", "ReferenceFreePairwiseConfig", "check_common_options", "pairwise_field"]

# name -> (default, help) of the fields ReferenceFreePairwiseTrainer reads; a config may change the default or
# the help where TRL's differs (TPO's learning rate and max_length help, each trainer's β).
PAIRWISE_FIELDS: dict[str, tuple[Any, str]] = {
    "learning_rate": (1e-6, "The initial learning rate for AdamW."),
    "max_length": (
        1024,
        "Maximum length of the sequences (prompt + completion) in the batch; longer sequences are truncated (their "
        "end is cut) and rows whose prompt alone reaches it are dropped. None: no limit.",
    ),
    "beta": (0.1, "β: the temperature of the preference loss."),
    "disable_dropout": (True, "Whether to disable dropout in the model."),
    "trust_remote_code": (False, "Whether to allow loading models that ship custom Python code from the Hub."),
    "dataset_num_proc": (None, "Number of processes to use for processing the dataset."),
}

_UNSET: Any = object()


def pairwise_field(name: str, default: Any = _UNSET, help: str | None = None, **metadata: Any) -> Any:
    """The dataclass field ``name`` of :data:`PAIRWISE_FIELDS` (its default and help unless given here)."""
    shared_default, shared_help = PAIRWISE_FIELDS[name]
    value = shared_default if default is _UNSET else default
    return field(default=value, metadata={"help": shared_help if help is None else help, **metadata})


def check_common_options(config: Any) -> None:
    """Checks shared by CPOConfig / ORPOConfig / TPOConfig: TRL options this implementation does not have."""
    if getattr(config, "is_encoder_decoder", None):
        raise ValueError(
            "is_encoder_decoder=True is not supported by posttrain's experimental pairwise trainers (decoder-only "
            "causal LMs only). Leave it None/False."
        )
    if getattr(config, "generate_during_eval", False):
        raise ValueError(
            "generate_during_eval=True (logging generations to W&B/Comet during evaluation) is not supported here; "
            "set it to False and use posttrain.LogCompletionsCallback-style callbacks instead."
        )
    if getattr(config, "max_length", None) is not None and config.max_length < 1:
        raise ValueError(f"max_length must be >= 1 (or None), got {config.max_length}.")
    if getattr(config, "max_completion_length", None) is not None and config.max_completion_length < 1:
        raise ValueError(f"max_completion_length must be >= 1 (or None), got {config.max_completion_length}.")


@dataclass
class ReferenceFreePairwiseConfig(BaseConfig):
    """Base of the reference-free pairwise configs (see the module docstring).

    A subclass declares every name of ``REQUIRED_FIELDS`` as a dataclass field (``pairwise_field(name)`` gives the
    shared default and help); its ``__post_init__`` runs its own checks, then this one's.
    """

    REQUIRED_FIELDS: ClassVar[tuple[str, ...]] = tuple(PAIRWISE_FIELDS)

    def __post_init__(self):
        declared = {f.name for f in dataclasses.fields(self)}
        missing = [name for name in self.REQUIRED_FIELDS if name not in declared]
        if missing:
            fix = ", ".join(f'{name}: ... = pairwise_field("{name}")' for name in missing)
            raise TypeError(
                f"{type(self).__name__} does not declare {missing}, which ReferenceFreePairwiseTrainer reads. Declare "
                f"them in the dataclass ({fix}; pairwise_field is in posttrain.experimental._pairwise_config)."
            )
        check_common_options(self)
        super().__post_init__()
