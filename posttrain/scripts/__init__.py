"""TRL-layout training scripts, one module per verb: ``python -m posttrain.scripts.<verb> [options]``.

Each module has ``make_parser(subparsers=None, prog=...)`` (TRL's signature) and ``main(script_args, training_args,
model_args, dataset_args=None)``; ``posttrain <verb>`` parses with the same parser and runs ``main`` here or in
launched worker processes.
``TrlParser``, ``ScriptArguments``, ``DatasetMixtureConfig``, ``get_dataset`` and ``init_zero_verbose`` are importable
from here, as from ``trl.scripts`` (lazily: ``python -m posttrain.scripts.<verb>`` imports nothing extra).
"""

from __future__ import annotations

import importlib
from typing import Any

_NAMES = ("DatasetMixtureConfig", "ScriptArguments", "TrlParser", "get_dataset", "init_zero_verbose")
__all__ = list(_NAMES)


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module 'posttrain.scripts' has no attribute {name!r}")
    return getattr(importlib.import_module("posttrain.scripts.utils"), name)
