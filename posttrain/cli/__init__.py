"""The ``posttrain`` command line and TRL's script-level helpers.

``TrlParser``, ``ModelConfig``, ``ScriptArguments``, ``GRPOScriptArguments``, ``get_peft_config``,
``get_quantization_config`` and ``get_kbit_device_map`` are importable from here (lazily, so ``posttrain --help``
stays free of torch/transformers imports).
"""

from __future__ import annotations

import importlib
from typing import Any

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

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'posttrain.cli' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
