"""Reference policy resolution (copy / PEFT adapters disabled / "ref" adapter / initial policy / none), the
PEFT reference ≡ base model invariance, precomputed columns, and TR-DPO's sync callback."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerControl, TrainerState

from posttrain.models.reference import (
    SAME_MODEL_ERROR,
    ReferencePolicy,
    SyncRefModelCallback,
    create_reference_policy,
    precompute_columns,
    sync_target_model,
)
from posttrain.models.tiny import build_tiny_model


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny matmuls on a shared 2-core machine are ~20x faster single-threaded.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _lora(**kw):
    from peft import LoraConfig

    # init_lora_weights=False: B is random, so the adapter changes the outputs from the start.
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **kw)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


IDS = torch.tensor([[72, 101, 108, 108, 111, 258]])


def test_explicit_ref_model_is_frozen_and_used():
    policy, ref = build_tiny_model(seed=0), build_tiny_model(seed=1)
    reference = create_reference_policy(policy, ref)
    assert reference.kind == "model" and reference.model is ref and reference.holds_copy
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    with reference.activate(policy) as module:
        assert module is ref


def test_ref_model_same_object_is_rejected():
    policy = build_tiny_model()
    with pytest.raises(ValueError, match="cannot be the same object") as err:
        create_reference_policy(policy, policy)
    assert str(err.value) == SAME_MODEL_ERROR


def test_frozen_copy_by_default_and_loaded_again_from_a_path(tiny_model_path):
    from posttrain.models.loading import create_model_from_path

    policy = build_tiny_model()
    reference = create_reference_policy(policy)
    assert reference.kind == "model" and reference.model is not policy
    torch.testing.assert_close(_logits(reference.model, IDS), _logits(policy, IDS))
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)  # training the policy must not move the copy
    assert not torch.equal(next(policy.parameters()), next(reference.model.parameters()))

    loaded = create_model_from_path(tiny_model_path)
    reloaded = create_reference_policy(loaded, reload_from=tiny_model_path)
    assert reloaded.model is not loaded
    torch.testing.assert_close(_logits(reloaded.model, IDS), _logits(loaded, IDS))
    by_path = create_reference_policy(policy, tiny_model_path)
    torch.testing.assert_close(_logits(by_path.model, IDS), _logits(loaded, IDS))


@pytest.mark.invariance
def test_peft_reference_equals_base_model_without_adapters():
    """Invariance: adapters disabled on the trained PEFT policy gives exactly the base model, with no copy."""
    from peft import get_peft_model

    base = build_tiny_model()
    expected = _logits(base, IDS)
    policy = get_peft_model(base, _lora())
    assert not torch.allclose(_logits(policy, IDS), expected)  # the adapter matters
    reference = create_reference_policy(policy, adapter_created_by_trainer=True)
    assert reference.kind == "adapters_disabled" and not reference.holds_copy
    with reference.activate(policy) as module:
        assert module is policy
        torch.testing.assert_close(_logits(module, IDS), expected)
    assert not torch.allclose(_logits(policy, IDS), expected)  # adapters are back on afterwards


def test_user_peft_model_gets_frozen_ref_adapter():
    from peft import get_peft_model

    policy = get_peft_model(build_tiny_model(), _lora())
    start = _logits(policy, IDS)
    reference = create_reference_policy(policy, adapter_created_by_trainer=False)
    assert reference.kind == "adapter" and reference.adapter_name == "ref" and "ref" in policy.peft_config
    assert not any(p.requires_grad for n, p in policy.named_parameters() if ".ref." in n)
    with torch.no_grad():  # "train" the default adapter
        for name, param in policy.named_parameters():
            if ".default." in name:
                param.add_(0.5)
    assert not torch.allclose(_logits(policy, IDS), start)
    with reference.activate(policy):
        torch.testing.assert_close(_logits(policy, IDS), start)
    assert policy.active_adapter == "default"


def test_sync_ref_model_rejects_peft_and_precompute():
    from peft import get_peft_model

    policy = get_peft_model(build_tiny_model(), _lora())
    with pytest.raises(ValueError, match="sync_ref_model=True is not supported with a PEFT model"):
        create_reference_policy(policy, sync_ref_model=True, adapter_created_by_trainer=True)
    with pytest.raises(ValueError, match="cannot be combined with precompute_ref_log_probs"):
        create_reference_policy(build_tiny_model(), sync_ref_model=True, precompute=True)


def test_initial_policy_for_precompute_then_release():
    policy = build_tiny_model()
    policy.train()
    reference = create_reference_policy(policy, precompute=True)
    assert reference.kind == "initial_policy" and not reference.holds_copy and reference.needs_forward
    with reference.activate(policy) as module:
        assert module is policy and not policy.training  # values must not depend on dropout
    assert policy.training
    reference.release()
    assert reference.kind == "precomputed" and not reference.needs_forward
    with pytest.raises(RuntimeError, match="precomputed"), reference.activate(policy):
        pass


def test_no_reference_when_not_required():
    reference = create_reference_policy(build_tiny_model(), required=False)
    assert reference.kind == "none" and not reference.needs_forward and reference.model is None
    with pytest.raises(ValueError, match="needs the reference module"):
        ReferencePolicy("model")


def test_precompute_columns_keeps_dataset_order():
    rows = [{"x": float(i)} for i in range(7)]

    def collate(features):
        return {"x": torch.tensor([f["x"] for f in features])}

    seen_grad = []

    def compute(batch):
        seen_grad.append(torch.is_grad_enabled())
        return {"double": batch["x"] * 2, "neg": -batch["x"]}

    out = precompute_columns(rows, collate_fn=collate, batch_size=3, compute_fn=compute)
    assert out == {"double": [2.0 * i for i in range(7)], "neg": [-float(i) for i in range(7)]}
    assert seen_grad == [False, False, False]
    with pytest.raises(ValueError, match="precompute_ref_batch_size"):
        precompute_columns(rows, collate_fn=collate, batch_size=0, compute_fn=compute)


def test_sync_target_model_mixes_parameters():
    """ref ← α·θ + (1−α)·ref; with θ = 1 and ref = 3 everywhere and α = 0.25: 0.25·1 + 0.75·3 = 2.5."""
    policy, ref = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    torch.nn.init.constant_(policy.weight, 1.0), torch.nn.init.constant_(policy.bias, 1.0)
    torch.nn.init.constant_(ref.weight, 3.0), torch.nn.init.constant_(ref.bias, 3.0)
    sync_target_model(policy, ref, alpha=0.25)
    assert torch.all(ref.weight == 2.5) and torch.all(ref.bias == 2.5)
    assert torch.all(policy.weight == 1.0)
    with pytest.raises(ValueError, match="no parameters named"):
        sync_target_model(torch.nn.Linear(3, 2), torch.nn.Sequential(torch.nn.Linear(3, 2)), 0.5)


def test_sync_callback_fires_every_n_steps():
    from types import SimpleNamespace

    policy, ref = torch.nn.Linear(2, 1, bias=False), torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.constant_(policy.weight, 1.0)
    torch.nn.init.constant_(ref.weight, 0.0)
    callback = SyncRefModelCallback(ref_model=ref)
    args = SimpleNamespace(ref_model_sync_steps=2, ref_model_mixup_alpha=0.5)
    state, control = TrainerState(), TrainerControl()
    state.global_step = 1
    callback.on_step_end(args, state, control, model=policy)
    assert torch.all(ref.weight == 0.0)
    state.global_step = 2
    callback.on_step_end(args, state, control, model=policy)
    assert torch.all(ref.weight == 0.5)
