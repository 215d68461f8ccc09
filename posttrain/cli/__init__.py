"""The ``posttrain`` command line and TRL's script-level helpers.

``TrlParser``, ``ModelConfig``, ``ScriptArguments``, ``GRPOScriptArguments``, ``get_peft_config``,
``get_quantization_config`` and ``get_kbit_device_map`` are importable from here (lazily, so ``posttrain --help``
stays free of torch/transformers imports). ``from posttrain.cli import main`` is the command's entry function, as
``trl.cli.main`` is TRL's (the module of the same name stays importable: ``python -m posttrain.cli.main``,
``from posttrain.cli.main import COMMANDS``).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any


class _CliPackage(types.ModuleType):
    """Keeps the package attribute ``main`` the entry function when the import system binds the ``main`` submodule
    to it (it does so whenever ``posttrain.cli.main`` is first imported, by any route)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "main" and isinstance(value, types.ModuleType) and hasattr(value, "main"):
            value = value.main
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _CliPackage

_LAZY = {
    "TrlParser": "posttrain.cli.parser",
    "ConfigError": "posttrain.cli.parser",
    "ModelConfig": "posttrain.cli.configs",
    "ScriptArguments": "posttrain.cli.configs",
    "GRPOScriptArguments": "posttrain.cli.configs",
    "RLOOScriptArguments": "posttrain.cli.configs",
    "DistillationScriptArguments": "posttrain.cli.configs",
    "get_peft_config": "posttrain.cli.configs",
    "get_quantization_config": "posttrain.cli.configs",
    "get_kbit_device_map": "posttrain.cli.configs",
}

__all__ = ["main", *_LAZY]


def __getattr__(name: str) -> Any:
    if name == "main":
        function = importlib.import_module("posttrain.cli.main").main
        globals()["main"] = function
        return function
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain.cli' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
