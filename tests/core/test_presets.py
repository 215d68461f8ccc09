"""posttrain.core.presets: loss_type table, resolution, and TRL's configuration warnings."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.aggregation import AGGREGATIONS
from posttrain.core.policy_objectives import POLICY_OBJECTIVES, objective_properties
from posttrain.core.presets import (
    GRPO_LOSS_PRESETS,
    RLOO_LOSS_PRESET,
    needs_grad_accum_division,
    preset_name,
    resolve_grpo_loss,
    validate_grpo_loss_config,
)

TRL_PRESETS = {
    "grpo": ("clip", "seq_mean_token_mean"),
    "bnpo": ("clip", "token_mean_local"),
    "dr_grpo": ("clip", "constant_norm"),
    "dapo": ("clip", "token_mean_global"),
    "cispo": ("cispo", "token_mean_global"),
    "sapo": ("sapo", "seq_mean_token_mean"),
    "luspo": ("clip", "length_weighted"),
    "vespo": ("vespo", "token_mean_global"),
}


def test_preset_table_is_trls():
    """Every TRL loss type is a preset with TRL's pair (posttrain may add more)."""
    for loss_type, pair in TRL_PRESETS.items():
        assert GRPO_LOSS_PRESETS[loss_type] == pair, loss_type


def test_resolve_every_loss_type():
    for loss_type, (objective, aggregation) in GRPO_LOSS_PRESETS.items():
        assert resolve_grpo_loss(loss_type) == (POLICY_OBJECTIVES.get(objective), AGGREGATIONS.get(aggregation))


def test_resolve_custom_pair_and_errors():
    def my_agg(loss, mask, **_):
        return loss.sum()

    objective, aggregation = resolve_grpo_loss(("sapo", my_agg))
    assert objective is POLICY_OBJECTIVES.get("sapo") and aggregation is my_agg
    with pytest.raises(ValueError, match="Valid loss types: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo"):
        resolve_grpo_loss("ppo")
    with pytest.raises(ValueError, match="Valid names"):
        resolve_grpo_loss(("clip", "nope"))
    with pytest.raises(ValueError, match="pair"):
        resolve_grpo_loss(3)


def test_needs_grad_accum_division():
    assert [lt for lt in TRL_PRESETS if not needs_grad_accum_division(lt)] == ["dapo", "cispo", "vespo"]
    assert needs_grad_accum_division(("clip", "token_mean_global")) is False  # a pair: its aggregation decides
    assert needs_grad_accum_division(("clip", lambda loss, mask, **_: loss.sum())) is True


def test_custom_pair_is_checked_as_its_preset():
    """A pair equal to a preset (by name or by function) gets that preset's checks; other pairs the generic ones."""
    assert preset_name("grpo") == "grpo"
    assert preset_name(("vespo", "token_mean_global")) == "vespo"
    assert preset_name((POLICY_OBJECTIVES.get("clip"), AGGREGATIONS.get("length_weighted"))) == "luspo"
    assert preset_name(("sapo", "token_mean_global")) is None
    assert validate_grpo_loss_config(("clip", "length_weighted"), "token") == validate_grpo_loss_config("luspo", "token")
    with pytest.raises(ValueError, match="'token_truncate' or 'token_mask'"):  # folds the ratio: needs token level
        validate_grpo_loss_config(("vespo", "seq_mean_token_mean"), vllm_importance_sampling_mode="sequence_mask")


def test_objective_properties():
    """VESPO alone folds the sampling ratio into its weights; each objective reads its own hyper-parameters; an
    undeclared callable reads all of them (so it may pick any) and folds nothing."""
    props = {name: objective_properties(POLICY_OBJECTIVES.get(name)) for name in ("clip", "cispo", "sapo", "vespo")}
    assert [name for name, p in props.items() if p.folds_sampling_ratio] == ["vespo"]
    assert props["clip"].config_fields["epsilon_low"] == "epsilon" and "delta" in props["clip"].config_fields
    assert "delta" not in props["cispo"].config_fields and "vespo_k_pos" not in props["sapo"].config_fields
    custom = objective_properties(lambda *args, **kwargs: None)
    assert not custom.folds_sampling_ratio
    assert {"epsilon_low", "delta", "sapo_temperature_pos", "vespo_k_neg"} <= set(custom.config_fields)


def test_dapo_end_to_end_hand_computed():
    """dapo on w = 1 (on-policy), A = [1, −1], m = [[1, 1], [1, 0]]: L = −A per token = [[−1, −1], [1, ·]];
    Σ L·m = −1, normalised by 3 tokens over 1 process -> −1/3."""
    objective, aggregation = resolve_grpo_loss("dapo")
    logp = torch.zeros(2, 2, requires_grad=True)
    mask = torch.tensor([[1, 1], [1, 0]])
    per_token, _ = objective(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, epsilon_low=0.2)
    loss = aggregation(per_token, mask, num_items_in_batch=3, num_processes=1, max_completion_length=8)
    assert loss.item() == pytest.approx(-1 / 3)


def test_rloo_preset_hand_computed():
    """RLOO: ratio exp(Σ m (logp − old)) per sequence, clip, mean over sequences. On-policy, A = [2, −1]:
    L = [−2, 1] -> mean −0.5."""
    objective = POLICY_OBJECTIVES.get(RLOO_LOSS_PRESET["objective"])
    aggregation = AGGREGATIONS.get(RLOO_LOSS_PRESET["aggregation"])
    logp = torch.zeros(2, 3, requires_grad=True)
    mask = torch.ones(2, 3)
    per_seq, _ = objective(
        logp,
        logp.detach(),
        torch.tensor([2.0, -1.0]),
        mask,
        importance_sampling_level=RLOO_LOSS_PRESET["importance_sampling_level"],
    )
    assert per_seq.shape == (2, 1)
    assert aggregation(per_seq, mask).item() == pytest.approx(-0.5)


def test_validate_defaults_are_silent():
    assert validate_grpo_loss_config("dapo") == []
    assert validate_grpo_loss_config("grpo", "sequence") == []
    assert validate_grpo_loss_config("luspo", "sequence") == []
    assert validate_grpo_loss_config("cispo", epsilon_high=5.0) == []


def test_validate_warnings():
    (luspo,) = validate_grpo_loss_config("luspo", "token")
    assert "importance_sampling_level='sequence'" in luspo
    (vespo,) = validate_grpo_loss_config("vespo", "sequence")
    assert "importance_sampling_level='token'" in vespo
    for loss_type in ["bnpo", "dr_grpo", "dapo"]:
        (gspo,) = validate_grpo_loss_config(loss_type, "sequence")
        assert "loss_type='grpo'" in gspo
    cispo = validate_grpo_loss_config("cispo", "sequence", epsilon=0.2, epsilon_high=None)
    assert len(cispo) == 2
    assert "epsilon=0.2" in cispo[1] and "epsilon_high=5.0" in cispo[1]


def test_validate_errors():
    with pytest.raises(ValueError, match="Valid loss types"):
        validate_grpo_loss_config("ppo")
    with pytest.raises(ValueError, match="importance_sampling_level 'tokens'"):
        validate_grpo_loss_config("grpo", "tokens")
    with pytest.raises(ValueError, match="'token_truncate' or 'token_mask'"):
        validate_grpo_loss_config("vespo", vllm_importance_sampling_mode="sequence_mask")
    assert validate_grpo_loss_config("vespo", vllm_importance_sampling_mode="token_mask") == []


def test_stable_loss_types_are_trls_and_experimental_presets_register_on_their_own(monkeypatch):
    """``GRPO_LOSS_TYPES`` (what the stable GRPOConfig offers) is TRL's list; an experimental package adds its preset
    with ``register_grpo_loss_preset`` (idempotent; a clash or an unknown registry name is an error)."""
    from posttrain.core import presets

    assert list(presets.GRPO_LOSS_TYPES) == list(TRL_PRESETS)
    monkeypatch.setattr(presets, "GRPO_LOSS_PRESETS", dict(presets.GRPO_LOSS_PRESETS))
    presets.register_grpo_loss_preset("my_sapo", "sapo", "token_mean_global")
    presets.register_grpo_loss_preset("my_sapo", "sapo", "token_mean_global")  # a re-import: no-op
    pair = (POLICY_OBJECTIVES.get("sapo"), AGGREGATIONS.get("token_mean_global"))
    assert presets.resolve_grpo_loss("my_sapo") == pair
    assert not presets.needs_grad_accum_division("my_sapo") and "my_sapo" not in presets.GRPO_LOSS_TYPES
    with pytest.raises(ValueError, match="already the preset"):
        presets.register_grpo_loss_preset("my_sapo", "clip", "token_mean_global")
    with pytest.raises(ValueError, match="Unknown policy objective 'nope'"):
        presets.register_grpo_loss_preset("other", "nope", "token_mean_global")
    assert "other" not in presets.GRPO_LOSS_PRESETS
