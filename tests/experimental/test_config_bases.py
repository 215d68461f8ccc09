"""The explicit config bases of the experimental trainer families: the reference-free pairwise configs (CPO, ORPO,
TPO) and the async configs (AsyncGRPO, AsyncDistillation) declare what their trainer base reads, so a config that
lacks a field fails at once naming it, and their shared fields have one default and one help."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from posttrain.experimental._async_config import ASYNC_ROLLOUT_FIELDS, AsyncRolloutConfig
from posttrain.experimental._pairwise import ReferenceFreePairwiseTrainer
from posttrain.experimental._pairwise_config import PAIRWISE_FIELDS, ReferenceFreePairwiseConfig, pairwise_field
from posttrain.experimental.async_distillation import AsyncDistillationConfig
from posttrain.experimental.async_grpo import AsyncGRPOConfig
from posttrain.experimental.cpo import CPOConfig
from posttrain.experimental.orpo import ORPOConfig
from posttrain.experimental.tpo import TPOConfig
from posttrain.trainers.base import BaseConfig

PAIRWISE_CONFIGS = (CPOConfig, ORPOConfig, TPOConfig)
ASYNC_CONFIGS = (AsyncGRPOConfig, AsyncDistillationConfig)


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def test_a_pairwise_trainer_refuses_a_config_outside_the_base_when_defined():
    """The pairwise trainer base reads disable_dropout & co.: a trainer wired to a config without them is refused
    when the class is defined, naming the base to derive from (it used to fail with an AttributeError in __init__)."""

    @dataclass
    class PlainConfig(BaseConfig):
        max_length: int | None = 16

    with pytest.raises(TypeError, match=r"_config_class is 'PlainConfig'.*ReferenceFreePairwiseConfig"):

        class NewPairwiseTrainer(ReferenceFreePairwiseTrainer):
            _config_class = PlainConfig


def test_a_pairwise_config_must_declare_the_fields_the_trainer_reads(tmp_path):
    @dataclass
    class Incomplete(ReferenceFreePairwiseConfig):
        learning_rate: float = pairwise_field("learning_rate")
        max_length: int | None = pairwise_field("max_length")
        beta: float = pairwise_field("beta")
        trust_remote_code: bool = pairwise_field("trust_remote_code")
        dataset_num_proc: int | None = pairwise_field("dataset_num_proc")

    with pytest.raises(
        TypeError, match=r"does not declare \['disable_dropout'\].*pairwise_field\(\"disable_dropout\"\)"
    ):
        Incomplete(output_dir=str(tmp_path), report_to="none")

    @dataclass
    class Complete(Incomplete):
        disable_dropout: bool = pairwise_field("disable_dropout")

    config = Complete(output_dir=str(tmp_path), report_to="none", max_length=8)
    assert config.disable_dropout is True
    with pytest.raises(ValueError, match="max_length must be >= 1"):  # the shared checks run for every subclass
        Complete(output_dir=str(tmp_path), report_to="none", max_length=0)


@pytest.mark.parametrize("name", ["disable_dropout", "trust_remote_code", "dataset_num_proc"])
def test_pairwise_shared_fields_have_one_default_and_help(name):
    default, help_text = PAIRWISE_FIELDS[name]
    for config in PAIRWISE_CONFIGS:
        assert issubclass(config, ReferenceFreePairwiseConfig)
        declared = _fields(config)[name]
        assert (declared.default, declared.metadata["help"]) == (default, help_text), config.__name__


def test_pairwise_configs_keep_their_own_defaults_where_trl_differs():
    assert [c().learning_rate for c in PAIRWISE_CONFIGS] == [1e-6, 1e-6, 5e-7]
    assert [c().beta for c in PAIRWISE_CONFIGS] == [0.1, 0.1, 0.01]
    assert "truncation_mode" in _fields(TPOConfig)["max_length"].metadata["help"]


@pytest.mark.parametrize("name", sorted(ASYNC_ROLLOUT_FIELDS))
def test_async_configs_share_one_default_and_help(name):
    """The five pipeline fields of AsyncGRPOConfig and AsyncDistillationConfig had drifted help texts."""
    default, help_text = ASYNC_ROLLOUT_FIELDS[name]
    for config in ASYNC_CONFIGS:
        assert issubclass(config, AsyncRolloutConfig)
        declared = _fields(config)[name]
        assert (declared.default, declared.metadata["help"]) == (default, help_text), config.__name__


def test_an_async_config_must_declare_the_fields_the_rollout_reads():
    @dataclass
    class NoStaleness(AsyncRolloutConfig, BaseConfig):
        _trainer_name = "Toy"
        request_timeout: int = 600

    config = NoStaleness.__new__(NoStaleness)  # the check needs no constructed TrainingArguments state
    with pytest.raises(TypeError, match=r"NoStaleness does not declare \['max_inflight_tasks', 'max_staleness'"):
        config.check_async_rollout()
