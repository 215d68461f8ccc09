"""TrlParser (YAML defaults, flag precedence, env block, unknown keys, bad values) and the script dataclasses."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

from posttrain.cli.configs import (
    GRPOScriptArguments,
    ModelConfig,
    ScriptArguments,
    get_peft_config,
    get_quantization_config,
)
from posttrain.cli.parser import ConfigError, TrlParser, docstring_field_help


@dataclass
class _Train:
    """Toy training options.

    Args:
        undocumented_rate: Rate documented only here.
        steps (`int`, *optional*, defaults to `3`):
            Steps documented TRL-style,
            over two lines.
    """

    learning_rate: float = field(default=1e-3, metadata={"help": "Step size."})
    max_steps: int = field(default=-1, metadata={"help": "Steps to train."})
    packing: bool = field(default=False, metadata={"help": "Pack sequences."})
    shuffle: bool = field(default=True, metadata={"help": "Shuffle (default on: also gets --no_shuffle)."})
    tags: list[str] | None = field(default=None, metadata={"help": "Free tags."})
    mode: str = field(default="a", metadata={"help": "A mode.", "choices": ["a", "b"]})
    trust_remote_code: bool = field(default=False, metadata={"help": "Shared with ModelConfig."})
    undocumented_rate: float = 0.5
    steps: int = 3

    def __post_init__(self):
        if self.learning_rate < 0:
            raise ValueError("learning_rate must be >= 0")


def _parser() -> TrlParser:
    return TrlParser((ScriptArguments, _Train, ModelConfig), prog="posttrain toy")


def _yaml(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_values_become_defaults_and_flags_override(tmp_path):
    recipe = _yaml(
        tmp_path,
        "dataset_name: data.jsonl\nlearning_rate: 2.0e-4\nmax_steps: 7\npacking: true\ntags: [x, y]\n"
        "model_name_or_path: m\nlora_target_modules: [all-linear]\n",
    )
    script, train, model = _parser().parse_args_and_config(["--config", recipe, "--max_steps", "2"])
    assert script.dataset_name == "data.jsonl"
    assert train.learning_rate == 2e-4 and train.max_steps == 2 and train.packing is True
    assert train.tags == ["x", "y"]
    assert model.model_name_or_path == "m"
    assert model.lora_target_modules == "all-linear"  # a one-item list collapses, as in TRL


def test_flags_only_equal_yaml_only(tmp_path):
    recipe = _yaml(tmp_path, "dataset_name: d.jsonl\nlearning_rate: 0.5\npacking: true\nmode: b\n")
    from_yaml = _parser().parse_args_and_config(["--config", recipe])
    from_flags = _parser().parse_args_and_config(
        ["--dataset_name", "d.jsonl", "--learning_rate", "0.5", "--packing", "--mode", "b"]
    )
    assert from_yaml == from_flags


def test_boolean_flag_forms():
    _, train, _ = _parser().parse_args_and_config(["--packing", "true", "--no_shuffle"])
    assert train.packing is True and train.shuffle is False
    _, train, _ = _parser().parse_args_and_config(["--packing=false", "--shuffle", "false"])
    assert train.packing is False and train.shuffle is False


def test_dashed_aliases_and_equals_form(tmp_path):
    recipe = _yaml(tmp_path, "max_steps: 4\n")
    _, train, _ = _parser().parse_args_and_config([f"--config={recipe}", "--learning-rate", "0.25"])
    assert train.max_steps == 4 and train.learning_rate == 0.25


def test_env_block_is_exported(tmp_path):
    recipe = _yaml(tmp_path, "env:\n  POSTTRAIN_TEST_VAR: hello\n  POSTTRAIN_TEST_NUM: 3\nmax_steps: 1\n")
    _parser().parse_args_and_config(["--config", recipe])
    assert os.environ["POSTTRAIN_TEST_VAR"] == "hello" and os.environ["POSTTRAIN_TEST_NUM"] == "3"


def test_env_block_must_be_a_mapping(tmp_path):
    recipe = _yaml(tmp_path, "env: [A, B]\n")
    with pytest.raises(ConfigError, match="env"):
        _parser().parse_args_and_config(["--config", recipe])


def test_unknown_flag_names_the_closest_valid_option():
    with pytest.raises(ConfigError) as info:
        _parser().parse_args_and_config(["--learnin_rate", "0.1"])
    message = str(info.value)
    assert "'learnin_rate'" in message and "did you mean 'learning_rate'" in message
    assert "valid options are:" in message and "max_steps" in message


def test_unknown_yaml_key_is_reported_with_its_source(tmp_path):
    recipe = _yaml(tmp_path, "max_stpes: 3\n")
    with pytest.raises(ConfigError) as info:
        _parser().parse_args_and_config(["--config", recipe])
    assert "'max_stpes' (from the config file)" in str(info.value)
    assert "did you mean 'max_steps'" in str(info.value)


def test_unknown_strings_are_returned_when_allowed(tmp_path):
    recipe = _yaml(tmp_path, "num_processes: 2\nmax_steps: 3\n")
    *_, remaining = _parser().parse_args_and_config(
        ["--config", recipe, "--main_process_port", "1234"],
        return_remaining_strings=True,
        fail_with_unknown_args=False,
    )
    # recipe keys first, then the command line (so a repeated command-line option wins)
    assert remaining == ["--num_processes", "2", "--main_process_port", "1234"]


def test_bad_flag_value_raises_config_error_not_system_exit():
    with pytest.raises(ConfigError, match="max_steps"):
        _parser().parse_args_and_config(["--max_steps", "many"])
    with pytest.raises(ConfigError, match="invalid choice"):
        _parser().parse_args_and_config(["--mode", "c"])


def test_bad_yaml_values_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="'max_steps'"):
        _parser().parse_args_and_config(["--config", _yaml(tmp_path, "max_steps: many\n")])
    with pytest.raises(ConfigError, match="choose one of: a, b"):
        _parser().parse_args_and_config(["--config", _yaml(tmp_path, "mode: c\n")])


def test_post_init_errors_become_config_errors():
    with pytest.raises(ConfigError, match="Invalid _Train options: learning_rate must be >= 0"):
        _parser().parse_args_and_config(["--learning_rate", "-1"])


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("a: [unclosed\n", "not valid YAML"),
        ("- just\n- a list\n", "must contain a YAML mapping"),
    ],
)
def test_unreadable_recipes(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        _parser().parse_args_and_config(["--config", _yaml(tmp_path, text)])


def test_missing_recipe_and_missing_path():
    with pytest.raises(ConfigError, match="does not exist"):
        _parser().parse_args_and_config(["--config", "/nonexistent/recipe.yaml"])
    with pytest.raises(ConfigError, match="needs the path"):
        _parser().parse_args_and_config(["--config"])


def test_shared_field_is_one_option_filling_every_dataclass():
    @dataclass
    class _Script:
        learning_rate: float = 0.5  # repeats _Train's field

    train, script = TrlParser((_Train, _Script)).parse_args_and_config(["--learning_rate", "0.25"])
    assert train.learning_rate == 0.25 and script.learning_rate == 0.25


def test_old_model_args_trust_remote_code_reads_the_trainer_config(monkeypatch):
    """ModelConfig has no trust_remote_code (TRL 1.16); old scripts reading model_args.trust_remote_code get the
    trainer config's value, with a FutureWarning naming where it lives now."""
    from posttrain import legacy

    monkeypatch.setattr(legacy, "_WARNED", set())
    _, train, model = _parser().parse_args_and_config(["--trust_remote_code", "true"])
    assert train.trust_remote_code is True and "trust_remote_code" not in vars(model)
    with pytest.warns(FutureWarning, match="training_args.trust_remote_code"):
        assert model.trust_remote_code is True


def test_field_named_config_is_refused():
    @dataclass
    class Bad:
        config: str = "x"

    with pytest.raises(ValueError, match="^Dataclass Bad has a field named .config.. This field is reserved"):
        TrlParser(Bad)


def test_help_shows_every_field_with_default_and_docstring_fallback():
    text = _parser().format_help()
    for name in ("dataset_name", "learning_rate", "max_steps", "packing", "undocumented_rate", "lora_r"):
        assert f"--{name}" in text
    assert "Rate documented only here." in text
    assert "Steps documented TRL-style, over two lines." in text
    assert "(default: 0.001)" in text  # learning_rate
    assert "_Train options:" in text and "ModelConfig options:" in text


def test_docstring_field_help_formats():
    docs = docstring_field_help(_Train)
    assert docs["undocumented_rate"] == "Rate documented only here."
    assert docs["steps"] == "Steps documented TRL-style, over two lines."


def test_percent_in_help_does_not_break_formatting():
    @dataclass
    class Pct:
        warmup: float = field(default=0.1, metadata={"help": "Warm up over 10% of the steps."})

    assert "10% of the steps" in TrlParser(Pct, prog="p").format_help()


# -- ModelConfig & friends ---------------------------------------------------------------------------------------
def test_model_config_defaults_match_trl():
    m = ModelConfig()
    assert (m.model_revision, m.dtype, m.lora_r, m.lora_alpha, m.lora_dropout) == ("main", "float32", 16, 32, 0.05)
    assert (m.lora_task_type, m.bnb_4bit_quant_type, m.use_peft) == ("CAUSAL_LM", "nf4", False)
    assert m.model_init_kwargs() == {"revision": "main", "trust_remote_code": False, "dtype": "float32"}
    s = ScriptArguments()
    assert (s.dataset_train_split, s.dataset_test_split, s.dataset_streaming) == ("train", "test", False)
    assert GRPOScriptArguments().reward_funcs is None


def test_model_config_rejects_4bit_and_8bit_together():
    with pytest.raises(ValueError, match="mutually exclusive"):
        ModelConfig(load_in_4bit=True, load_in_8bit=True)


def test_peft_and_quantization_configs():
    assert get_peft_config(ModelConfig()) is None
    assert get_quantization_config(ModelConfig()) is None
    lora = get_peft_config(
        ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_target_modules=["q_proj", "v_proj"], use_rslora=True)
    )
    assert lora.r == 4 and lora.lora_alpha == 8 and set(lora.target_modules) == {"q_proj", "v_proj"}
    assert lora.bias == "none" and lora.use_rslora is True and lora.task_type == "CAUSAL_LM"


def test_grpo_bias_corrected_kl_defaults_on_with_a_no_flag(tmp_path):
    """TRL's default use_bias_correction_kl=True; the CLI turns it off with --no_use_bias_correction_kl."""
    from posttrain.trainers.grpo import GRPOConfig

    parser = TrlParser((GRPOScriptArguments, GRPOConfig, ModelConfig), prog="posttrain grpo")
    assert "--no_use_bias_correction_kl" in parser.format_help()
    base = ["--output_dir", str(tmp_path), "--report_to", "none"]
    _, on, _ = parser.parse_args_and_config(base)
    _, off, _ = parser.parse_args_and_config([*base, "--no_use_bias_correction_kl"])
    assert on.use_bias_correction_kl is True and off.use_bias_correction_kl is False
