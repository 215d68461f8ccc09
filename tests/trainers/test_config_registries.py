"""Registry-backed config fields: their help and CLI choices come from the registry, and a typo fails when the
config is built (before any model loads), naming the valid values."""

from __future__ import annotations

import dataclasses

import pytest

from posttrain.core.preference import DPO_LOSSES, F_DIVERGENCES, KTO_LOSSES
from posttrain.core.presets import GRPO_LOSS_TYPES
from posttrain.trainers.dpo import DPOConfig
from posttrain.trainers.grpo import GRPOConfig
from posttrain.trainers.kto import KTOConfig
from posttrain.trainers.online import GENERATION_BACKENDS
from posttrain.trainers.rloo import RLOOConfig
from posttrain.trainers.sft import SFT_LOSSES, SFTConfig

CASES = [
    (GRPOConfig, "loss_type", list(GRPO_LOSS_TYPES)),
    (DPOConfig, "loss_type", list(DPO_LOSSES)),
    (DPOConfig, "f_divergence_type", list(F_DIVERGENCES)),
    (KTOConfig, "loss_type", list(KTO_LOSSES)),
    (SFTConfig, "loss_type", list(SFT_LOSSES)),
    (GRPOConfig, "generation_backend", list(GENERATION_BACKENDS)),
    (RLOOConfig, "generation_backend", list(GENERATION_BACKENDS)),
]
IDS = [f"{config.__name__}.{name}" for config, name, _ in CASES]


@pytest.mark.parametrize(("config", "name", "valid"), CASES, ids=IDS)
def test_help_and_choices_come_from_the_registry(config, name, valid):
    metadata = {f.name: f for f in dataclasses.fields(config)}[name].metadata
    assert metadata["choices"] == valid
    assert all(value in metadata["help"] for value in valid)


@pytest.mark.parametrize(("config", "name", "valid"), CASES, ids=IDS)
def test_a_typo_fails_when_the_config_is_built(tmp_path, config, name, valid):
    with pytest.raises(ValueError, match=valid[-1]):
        config(output_dir=str(tmp_path), **{name: "not_a_" + name})
