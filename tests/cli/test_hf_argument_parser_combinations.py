"""TRL's example scripts build ``transformers.HfArgumentParser((ScriptArguments, XConfig, ModelConfig))`` — a plain
argparse parser, which refuses an option declared twice. Every posttrain config (stable and experimental) must
build that parser with ``ModelConfig``, print ``--help`` and parse a minimal command line (issue 35, item 1)."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import warnings

import pytest
import transformers

import posttrain
from posttrain.cli.configs import GRPOScriptArguments, ModelConfig, ScriptArguments

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the experimental package's import warning
    import posttrain.experimental as experimental


def _all_configs() -> dict[str, type]:
    from posttrain.trainers.base import BaseConfig

    found = {
        name: getattr(posttrain, name)
        for name in posttrain.__all__
        if name.endswith("Config") and name not in ("ModelConfig", "DatasetConfig", "DatasetMixtureConfig")
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for info in pkgutil.iter_modules(experimental.__path__):
            if not info.ispkg:
                continue
            module = importlib.import_module(f"{experimental.__name__}.{info.name}")
            for obj in vars(module).values():
                if isinstance(obj, type) and dataclasses.is_dataclass(obj) and issubclass(obj, BaseConfig):
                    found.setdefault(f"experimental.{info.name}.{obj.__name__}", obj)
    return dict(sorted(found.items()))


CONFIGS = _all_configs()
# Options a config needs on a minimal command line (besides --output_dir).
REQUIRED = {"ServerDistillationConfig": ["--teacher_model_server_url", "http://localhost:8000"]}
# Fields TRL 1.16 itself declares on both ModelConfig and the config: its own HfArgumentParser fails there too (no
# TRL script parses them together); posttrain's TrlParser merges them into one option.
SHARED_IN_TRL = {"AsyncDistillationConfig": {"dtype"}}


def _fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.init}


def test_every_config_is_found():
    names = {cls.__name__ for cls in CONFIGS.values()}
    for expected in ("SFTConfig", "DPOConfig", "KTOConfig", "RewardConfig", "GRPOConfig", "RLOOConfig",
                     "DistillationConfig", "AsyncGRPOConfig", "OnlineDPOConfig", "CPOConfig", "ORPOConfig",
                     "TPOConfig", "PRMConfig", "GKDConfig", "PPOConfig"):  # fmt: skip
        assert expected in names


def test_model_config_has_trl_1_16_fields_only():
    assert [f.name for f in dataclasses.fields(ModelConfig)] == [
        "model_name_or_path", "model_revision", "dtype", "attn_implementation", "use_peft", "lora_r", "lora_alpha",
        "lora_dropout", "lora_target_modules", "lora_target_parameters", "lora_modules_to_save", "lora_task_type",
        "use_rslora", "use_dora", "load_in_8bit", "load_in_4bit", "bnb_4bit_quant_type", "use_bnb_nested_quant",
        "bnb_4bit_quant_storage",
    ]  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_field_shared_with_model_config_or_script_arguments(name):
    cls = CONFIGS[name]
    shared = _fields(cls) & (_fields(ModelConfig) | _fields(GRPOScriptArguments))
    assert shared == SHARED_IN_TRL.get(cls.__name__, set()), f"{name} shares {sorted(shared)}"


@pytest.mark.parametrize("name", [n for n, c in CONFIGS.items() if c.__name__ not in SHARED_IN_TRL])
def test_hf_argument_parser_builds_helps_and_parses(name, tmp_path, capsys):
    cls = CONFIGS[name]
    script = GRPOScriptArguments if cls.__name__ in ("GRPOConfig", "RLOOConfig") else ScriptArguments
    parser = transformers.HfArgumentParser((script, cls, ModelConfig))
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args_into_dataclasses(["--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--output_dir" in help_text and "--model_name_or_path" in help_text
    argv = ["--output_dir", str(tmp_path), "--report_to", "none", *REQUIRED.get(cls.__name__, [])]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. configs' own deprecation notes
        script_args, training_args, model_args = parser.parse_args_into_dataclasses(argv)
    assert isinstance(training_args, cls) and training_args.output_dir == str(tmp_path)
    assert isinstance(model_args, ModelConfig) and isinstance(script_args, script)
    if "trust_remote_code" in _fields(cls):  # the option is the trainer config's (TRL 1.16), not ModelConfig's
        _, training_args, _ = parser.parse_args_into_dataclasses([*argv, "--trust_remote_code", "true"])
        assert training_args.trust_remote_code is True
