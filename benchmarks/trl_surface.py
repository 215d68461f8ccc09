"""Dump Hugging Face TRL's stable public surface to JSON (run with benchmarks/.venv-trl's python).

    bash benchmarks/setup_trl.sh                                   # once: TRL 1.16 in benchmarks/.venv-trl
    benchmarks/.venv-trl/bin/python benchmarks/trl_surface.py      # writes tests/compat/trl_surface.json

The file records, for the TRL version installed:

- ``names``: module -> the public names users import from it (the package's lazy ``_import_structure`` /
  ``__all__``, the classes and functions a stable module defines, and a few documented deep imports);
- ``functions``: "module.name" -> its parameters (name, kind, default) for every public function recorded;
- ``configs``: config class -> field -> default (``default_factory`` evaluated; non-JSON values as ``repr``);
- ``cli``: verb -> ``--option`` -> default, from each script's ``make_parser()``;
- ``trainers``: trainer class -> its ``__init__`` parameters in order (name, kind, default).

``tests/compat/test_trl_surface.py`` compares posttrain against this file (no TRL needed in CI). Experimental
modules (``trl.experimental``) are not part of the stable surface and are not recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import math
import os
import sys
from pathlib import Path

# Modules whose own classes/functions are all public API (module -> names are taken from what it defines).
DEFINED_IN = [
    "trl.data_utils",
    "trl.chat_template_utils",
    "trl.trainer.callbacks",
    "trl.scripts.utils",
]
# Modules whose public names are their ``__all__`` / lazy import structure.
PACKAGES = ["trl", "trl.trainer", "trl.scripts", "trl.rewards", "trl.cli"]
# Names a package exports that are internal helpers (used by TRL's own trainers, absent from its docs): not recorded.
INTERNAL = {
    "trl.trainer": ["add_fused_lm_head", "ensure_master_addr_port"],
    "trl.scripts.utils": ["get_git_commit_hash"],
}
# Deep imports TRL's docs and users write: module -> names (the trainer modules re-export their collators).
DEEP_IMPORTS = {
    "trl.trainer.utils": [
        "selective_log_softmax",
        "entropy_from_logits",
        "pad",
        "flush_left",
        "disable_dropout_in_model",
        "get_peft_config",
        "get_quantization_config",
        "nanstd",
        "nanmin",
        "nanmax",
        "RepeatSampler",
        "remove_none_values",
    ],
    "trl.trainer.sft_trainer": [
        "SFTTrainer",
        "DataCollatorForLanguageModeling",
        "DataCollatorForVisionLanguageModeling",
    ],
    "trl.trainer.dpo_trainer": ["DPOTrainer", "DataCollatorForPreference", "DataCollatorForVisionPreference"],
    "trl.trainer.kto_trainer": [
        "KTOTrainer",
        "DataCollatorForUnpairedPreference",
        "DataCollatorForVisionUnpairedPreference",
    ],
    "trl.trainer.reward_trainer": ["RewardTrainer", "DataCollatorForPreference"],
    "trl.trainer.grpo_trainer": ["GRPOTrainer"],
    "trl.trainer.rloo_trainer": ["RLOOTrainer"],
    "trl.trainer.distillation_trainer": ["DistillationTrainer"],
    "trl.trainer.sft_config": ["SFTConfig"],
    "trl.trainer.dpo_config": ["DPOConfig"],
    "trl.trainer.kto_config": ["KTOConfig"],
    "trl.trainer.reward_config": ["RewardConfig"],
    "trl.trainer.grpo_config": ["GRPOConfig"],
    "trl.trainer.rloo_config": ["RLOOConfig"],
    "trl.trainer.distillation_config": ["DistillationConfig"],
    "trl.trainer.model_config": ["ModelConfig"],
    "trl.models": ["create_reference_model"],
    "trl.cli.main": ["main"],
}
CONFIGS = {
    "SFTConfig": "trl",
    "DPOConfig": "trl",
    "KTOConfig": "trl",
    "RewardConfig": "trl",
    "GRPOConfig": "trl",
    "RLOOConfig": "trl",
    "DistillationConfig": "trl",
    "ModelConfig": "trl",
    "ScriptArguments": "trl",
    "DatasetMixtureConfig": "trl",
    "DatasetConfig": "trl.scripts.utils",
}
TRAINERS = [
    "SFTTrainer",
    "DPOTrainer",
    "KTOTrainer",
    "RewardTrainer",
    "GRPOTrainer",
    "RLOOTrainer",
    "DistillationTrainer",
]
CLI_VERBS = ["sft", "dpo", "kto", "reward", "grpo", "rloo", "distillation"]


def jsonable(value):
    """A JSON value for a default: JSON types as they are, everything else as its repr."""
    if value is inspect.Parameter.empty or value is dataclasses.MISSING:
        return {"required": True}
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return {"repr": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        try:
            json.dumps(value)
            return value
        except TypeError:
            pass
    if hasattr(value, "value") and isinstance(value.value, str):  # enums (transformers' IntervalStrategy...)
        return value.value
    return {"repr": repr(value)}


def parameters(fn) -> list[dict]:
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        out.append({"name": p.name, "kind": p.kind.name, "default": jsonable(p.default)})
    return out


def config_fields(cls) -> dict:
    fields = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            fields[f.name] = jsonable(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            fields[f.name] = jsonable(f.default_factory())
        else:
            fields[f.name] = jsonable(dataclasses.MISSING)
    return fields


def cli_options(verb: str, package: str = "trl") -> dict:
    """``--option`` -> default of ``<package>.scripts.<verb>.make_parser()`` (also used for posttrain's scripts)."""
    module = importlib.import_module(f"{package}.scripts.{verb}")
    parser = module.make_parser(prog=f"{package} {verb}")
    options = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for opt in action.option_strings:
            if opt.startswith("--"):
                options[opt] = jsonable(action.default)
    return dict(sorted(options.items()))


def module_names(name: str) -> list[str]:
    module = importlib.import_module(name)
    if name in PACKAGES:
        structure = getattr(module, "_import_structure", None)
        if structure:
            return sorted({n for names in structure.values() for n in names})
        return sorted(n for n in getattr(module, "__all__", []) if not inspect.ismodule(getattr(module, n, None)))
    return sorted(
        n
        for n, v in vars(module).items()
        if not n.startswith("_")
        and (inspect.isfunction(v) or inspect.isclass(v))
        and getattr(v, "__module__", None) == name
    )


def main() -> None:
    import trl

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(__file__).resolve().parent.parent / "tests" / "compat" / "trl_surface.json"
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args()
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    names = {m: [n for n in module_names(m) if n not in INTERNAL.get(m, ())] for m in PACKAGES + DEFINED_IN}
    for module, wanted in DEEP_IMPORTS.items():
        mod = importlib.import_module(module)
        missing = [n for n in wanted if not hasattr(mod, n)]
        if missing:
            print(f"note: {module} has no {missing} in trl {trl.__version__}; not recorded", file=sys.stderr)
        names[module] = sorted(n for n in wanted if hasattr(mod, n))

    functions = {}
    for module, public in names.items():
        mod = importlib.import_module(module)
        for n in public:
            obj = getattr(mod, n)
            if inspect.isfunction(obj):
                key = f"{obj.__module__}.{obj.__name__}"
                functions.setdefault(key, parameters(obj))

    configs = {}
    for cls_name, module in CONFIGS.items():
        configs[cls_name] = config_fields(getattr(importlib.import_module(module), cls_name))
    trainers = {name: parameters(getattr(trl, name).__init__) for name in TRAINERS}
    cli = {verb: cli_options(verb) for verb in CLI_VERBS}

    import transformers

    surface = {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "generated_by": "benchmarks/trl_surface.py",
        "names": dict(sorted(names.items())),
        "functions": dict(sorted(functions.items())),
        "configs": configs,
        "trainers": trainers,
        "cli": cli,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(surface, indent=1, sort_keys=False) + "\n")
    counts = (
        sum(len(v) for v in names.values()),
        sum(len(v) for v in configs.values()),
        sum(len(v) for v in cli.values()),
        sum(len(v) for v in trainers.values()),
    )
    print(f"wrote {out}: trl {trl.__version__}; names {counts[0]}, config fields {counts[1]}, ", end="")
    print(f"CLI options {counts[2]}, trainer parameters {counts[3]}")


if __name__ == "__main__":
    main()
