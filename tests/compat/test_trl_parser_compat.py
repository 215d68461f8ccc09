"""``TrlParser`` and dataset-mixture YAML behave as TRL 1.16's (each expectation below was checked by running the same
calls under TRL 1.16): remaining strings, ``env:`` blocks, subparsers with config defaults and overrides, and the
errors TRL raises (same type, TRL's phrase first, then posttrain's fix)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import pytest

from posttrain import DatasetMixtureConfig, TrlParser
from posttrain.data.loading import DatasetConfig


@dataclass
class Args:
    arg1: int
    arg2: str = "default"


@dataclass
class Other:
    other: float = 1.0


@pytest.fixture
def recipe(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / f"recipe{len(list(tmp_path.iterdir()))}.yaml"
        path.write_text(text)
        return str(path)

    return write


def subcommands(*names: str, parent: tuple = ()) -> TrlParser:
    parser = TrlParser(list(parent))
    subparsers = parser.add_subparsers(dest="command", parser_class=TrlParser)
    for name in names:
        subparsers.add_parser(name, dataclass_types=[Args])
    return parser


def test_config_values_are_defaults_and_flags_override(recipe):
    path = recipe("arg1: 5\narg2: from_yaml\n")
    assert TrlParser([Args]).parse_args_and_config(["--config", path]) == (Args(5, "from_yaml"),)
    assert TrlParser([Args]).parse_args_and_config(["--arg1", "3", "--config", path]) == (Args(3, "from_yaml"),)


def test_env_block_sets_environment(recipe, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_H8_VAR1", raising=False)
    monkeypatch.delenv("POSTTRAIN_H8_VAR2", raising=False)
    path = recipe("env:\n  POSTTRAIN_H8_VAR1: value1\n  POSTTRAIN_H8_VAR2: 3\narg1: 2\n")
    assert TrlParser([Args]).parse_args_and_config(["--arg2", "x", "--config", path]) == (Args(2, "x"),)
    assert os.environ["POSTTRAIN_H8_VAR1"] == "value1" and os.environ["POSTTRAIN_H8_VAR2"] == "3"
    with pytest.raises(ValueError, match=r"^`env` field should be a dict in the YAML file\. In .*write `env:`"):
        TrlParser([Args]).parse_args_and_config(["--config", recipe("env: not_a_dict\narg1: 1\n")])


def test_remaining_strings_in_trl_format(recipe):
    parser = TrlParser([Args])
    assert parser.parse_args_and_config(["--arg1", "2", "--arg2", "v", "rest"], return_remaining_strings=True) == (
        Args(2, "v"),
        ["rest"],
    )
    path = recipe("in_config: abc\nswitch: true\nitems: [1, 2]\nnum: 3\n")
    argv = ["--arg1", "2", "--in_args", "def", "--config", path]
    # YAML keys first, as `--key str(value)` (TRL's spelling: True, [1, 2]), then the command line's strings
    assert TrlParser([Args]).parse_args_and_config(list(argv), return_remaining_strings=True) == (
        Args(2),
        ["--in_config", "abc", "--switch", "True", "--items", "[1, 2]", "--num", "3", "--in_args", "def"],
    )
    assert TrlParser([Args]).parse_args_and_config(
        list(argv), return_remaining_strings=True, separate_remaining_strings=True
    ) == (Args(2), ["--in_config", "abc", "--switch", "True", "--items", "[1, 2]", "--num", "3"], ["--in_args", "def"])
    assert TrlParser([Args]).parse_args_and_config(
        ["--arg1", "1", "--x", "y"], return_remaining_strings=True, separate_remaining_strings=True
    ) == (Args(1), [], ["--x", "y"])


def test_unknown_strings_raise_trls_errors(recipe):
    path = recipe("arg1: 1\nnope: 2\n")
    with pytest.raises(ValueError, match=r"^Unknown arguments from config file: \['--nope', '2'\]\. Please remove"):
        TrlParser([Args]).parse_args_and_config(["--config", path])
    assert TrlParser([Args]).parse_args_and_config(["--config", path], fail_with_unknown_args=False) == (Args(1),)
    # unknown command-line strings raise whatever fail_with_unknown_args says (it is about the config file only)
    for fail in (True, False):
        with pytest.raises(
            ValueError, match=r"^Some specified arguments are not used by the HfArgumentParser: \['--nope', '2'\]"
        ):
            TrlParser([Args]).parse_args_and_config(["--arg1", "1", "--nope", "2"], fail_with_unknown_args=fail)


def test_set_defaults_with_config_returns_unclaimed_keys_in_trl_format():
    parser = TrlParser([Args])
    assert parser.set_defaults_with_config(arg1=42, unknown=1, flag=True) == ["--unknown", "1", "--flag", "True"]
    assert parser.parse_args_and_config([]) == (Args(42),)


def test_subparsers_take_config_defaults_and_overrides(recipe):
    path = recipe("arg1: 2\narg2: config_value\n")
    (ns,) = subcommands("sub").parse_args_and_config(["sub", "--config", path])
    assert ns == argparse.Namespace(command="sub", arg1=2, arg2="config_value")
    (ns,) = subcommands("sub").parse_args_and_config(["sub", "--arg1", "3", "--config", path])
    assert (ns.arg1, ns.arg2) == (3, "config_value")
    for name in ("s0", "s1"):
        (ns,) = subcommands("s0", "s1").parse_args_and_config([name, "--config", path])
        assert (ns.command, ns.arg1, ns.arg2) == (name, 2, "config_value")
    # the parent's own dataclasses come first, then the namespace of the subcommand's values
    out = subcommands("sub", parent=(Other,)).parse_args_and_config(
        ["--other", "3", "sub", "--config", recipe("arg1: 2\nother: 4\n")]
    )
    assert out == (Other(3.0), argparse.Namespace(command="sub", arg1=2, arg2="default"))
    ns, remaining = subcommands("sub").parse_args_and_config(
        ["sub", "--arg1", "1", "--zz", "q"], return_remaining_strings=True
    )
    assert ns.arg1 == 1 and remaining == ["--zz", "q"]


def test_subparsers_unknown_config_key(recipe):
    path = recipe("arg1: 2\nthis_arg_does_not_exist: config_value\n")
    with pytest.raises(ValueError, match=r"^Unknown arguments from config file: \['--this_arg_does_not_exist'"):
        subcommands("sub").parse_args_and_config(["sub", "--arg1", "3", "--config", path])
    (ns,) = subcommands("sub").parse_args_and_config(
        ["sub", "--arg1", "3", "--config", path], fail_with_unknown_args=False
    )
    assert (ns.arg1, ns.arg2) == (3, "default")


def test_config_field_is_reserved():
    @dataclass
    class Bad:
        config: str

    with pytest.raises(ValueError, match=r"^Dataclass Bad has a field named 'config'\. This field is reserved"):
        TrlParser([Bad])


def test_yaml_must_be_a_mapping(recipe):
    with pytest.raises(ValueError, match=r"^Config file .* must contain a YAML mapping"):
        TrlParser([Args]).parse_args_and_config(["--config", recipe("- 1\n- 2\n")])


def test_dataset_mixture_yaml_parses_like_trl(recipe):
    """A mixture whose fractions are invalid still parses (TRL checks fractions in get_dataset, not before)."""
    path = recipe(
        "datasets:\n- path: a/b\n  name: x\n- path: c\n  columns:\n  - prompt\n  fraction: 0.5\nstreaming: true\n"
    )
    (mixture,) = TrlParser([DatasetMixtureConfig]).parse_args_and_config(["--config", path])
    assert mixture.streaming is True and len(mixture.datasets) == 2
    assert all(isinstance(d, DatasetConfig) for d in mixture.datasets)
    assert (mixture.datasets[0].path, mixture.datasets[0].name, mixture.datasets[0].columns) == ("a/b", "x", None)
    assert (mixture.datasets[1].columns, mixture.datasets[1].fraction) == (["prompt"], 0.5)


@pytest.mark.parametrize("verb", ["sft", "dpo", "kto", "reward", "grpo", "rloo", "distillation"])
def test_script_make_parser_takes_trls_subparsers_argument(verb, recipe):
    """TRL's ``make_parser(subparsers=None, prog=None)``: a script's parser joins a parent's subcommands, and the
    parent's --config defaults reach it."""
    import importlib

    script = importlib.import_module(f"posttrain.scripts.{verb}")
    assert isinstance(script.make_parser(prog=f"my {verb}"), TrlParser)
    parent = TrlParser()
    subparsers = parent.add_subparsers(dest="command", parser_class=TrlParser)
    assert isinstance(script.make_parser(subparsers), TrlParser)
    path = recipe("output_dir: from_yaml\nlearning_rate: 0.5\n")
    (ns,) = parent.parse_args_and_config(
        [verb, "--config", path, "--learning_rate", "0.25"], fail_with_unknown_args=False
    )
    assert (ns.command, ns.output_dir, ns.learning_rate) == (verb, "from_yaml", 0.25)
