"""The self-distillation teacher kinds: base stays fixed, live is the student, EMA equals the hand-computed average
(plain copy and LoRA adapter), the sync callback's schedule, and the refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerControl, TrainerState

from posttrain.models.teacher_sync import (
    TEACHER_ADAPTER_NAME,
    SyncTeacherModelCallback,
    create_teacher,
    ema_update,
    is_pure_lora_training,
)
from posttrain.models.tiny import build_tiny_model


def _model(seed=0):
    return build_tiny_model(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, seed=seed)


def _perturb(model, value=0.5):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(value)


def _forward(module, ids):
    with torch.no_grad():
        return module(input_ids=ids).logits


IDS = torch.tensor([[1, 5, 9, 3]])


def test_base_teacher_is_a_frozen_copy_that_stays_fixed():
    student = _model()
    before = _forward(student, IDS)
    teacher = create_teacher(student, "base")
    assert teacher.holds_copy and teacher.model is not student
    assert not any(p.requires_grad for p in teacher.model.parameters())
    _perturb(student)
    teacher.update(student)  # a no-op for base
    with teacher.activate(student) as module:
        torch.testing.assert_close(_forward(module, IDS), before)
    assert not torch.allclose(_forward(student, IDS), before)


def test_live_teacher_is_the_student():
    student = _model()
    teacher = create_teacher(student, "live")
    assert not teacher.holds_copy
    with teacher.activate(student) as module:
        assert module is student
    _perturb(student)
    with teacher.activate(student) as module:
        torch.testing.assert_close(_forward(module, IDS), _forward(student, IDS))


def test_ema_update_equals_the_hand_computed_average():
    student = _model(seed=0)
    teacher = create_teacher(student, "ema", teacher_update_rate=0.25, teacher_sync_steps=2)
    t0 = {n: p.detach().clone() for n, p in teacher.model.named_parameters()}
    _perturb(student, 1.0)
    s1 = {n: p.detach().clone() for n, p in student.named_parameters()}
    teacher.update(student)
    for name, param in teacher.model.named_parameters():
        torch.testing.assert_close(param, 0.75 * t0[name] + 0.25 * s1[name])
    # A second update averages again: t2 = 0.75 t1 + 0.25 s.
    t1 = {n: p.detach().clone() for n, p in teacher.model.named_parameters()}
    teacher.update(student)
    for name, param in teacher.model.named_parameters():
        torch.testing.assert_close(param, 0.75 * t1[name] + 0.25 * s1[name])


def test_ema_rate_one_is_a_hard_resync():
    student, other = _model(0), _model(1)
    ema_update(other, student, 1.0)
    for a, b in zip(other.parameters(), student.parameters()):
        torch.testing.assert_close(a, b)


def test_callback_updates_every_sync_steps():
    student = _model()
    teacher = create_teacher(student, "ema", teacher_update_rate=0.5, teacher_sync_steps=2)
    callback = SyncTeacherModelCallback(teacher)
    first = next(teacher.model.parameters())
    start = first.detach().clone()
    _perturb(student, 1.0)
    state = TrainerState()
    state.global_step = 1
    callback.on_step_end(None, state, TrainerControl(), model=student)
    torch.testing.assert_close(first, start)  # step 1: not a sync step
    state.global_step = 2
    callback.on_step_end(None, state, TrainerControl(), model=student)
    torch.testing.assert_close(first, 0.5 * start + 0.5 * next(student.parameters()).detach())


def test_validation_errors():
    student = _model()
    with pytest.raises(ValueError, match="'base', 'live', 'ema'"):
        create_teacher(student, "frozen")
    with pytest.raises(ValueError, match="teacher_update_rate"):
        create_teacher(student, "ema", teacher_update_rate=1.5)
    with pytest.raises(ValueError, match="teacher_sync_steps"):
        create_teacher(student, "ema", teacher_sync_steps=0)


# -- PEFT students -------------------------------------------------------------------------------------------------


def _lora_student(**extra):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False, **extra)
    return get_peft_model(_model(), config)


def test_base_teacher_of_a_peft_student_disables_its_adapters():
    student = _lora_student()
    teacher = create_teacher(student, "base")
    assert not teacher.holds_copy
    with student.disable_adapter():
        base = _forward(student, IDS)
    with teacher.activate(student) as module:
        torch.testing.assert_close(_forward(module, IDS), base)
    assert not torch.allclose(_forward(student, IDS), base)  # the adapter is back on afterwards


def test_ema_teacher_of_a_lora_student_is_a_zero_started_adapter_averaged_toward_the_students():
    student = _lora_student()
    assert is_pure_lora_training(student)
    trainable = sorted(n for n, p in student.named_parameters() if p.requires_grad)
    teacher = create_teacher(student, "ema", teacher_update_rate=0.5)
    assert sorted(n for n, p in student.named_parameters() if p.requires_grad) == trainable  # still the student's
    with student.disable_adapter():
        base = _forward(student, IDS)
    with teacher.activate(student) as module:
        torch.testing.assert_close(_forward(module, IDS), base)  # zero adapter = the base model
    assert student.active_adapter == "default"
    params = dict(student.named_parameters())
    teacher.update(student)
    for name, param in params.items():
        if f".{TEACHER_ADAPTER_NAME}." in name:
            source = params[name.replace(f".{TEACHER_ADAPTER_NAME}.", ".default.")]
            torch.testing.assert_close(param, 0.5 * source.detach())  # 0.5·0 + 0.5·student
    with teacher.activate(student) as module:
        moved = _forward(module, IDS)
    assert not torch.allclose(moved, base)
    assert sorted(n for n, p in student.named_parameters() if p.requires_grad) == trainable


def test_ema_teacher_refuses_a_peft_student_that_is_not_pure_lora():
    student = _lora_student(modules_to_save=["lm_head"])
    assert not is_pure_lora_training(student)
    with pytest.raises(ValueError, match="non-pure-LoRA"):
        create_teacher(student, "ema")


def test_ema_state_round_trips_for_a_copy_and_an_adapter():
    student = _model()
    teacher = create_teacher(student, "ema", teacher_update_rate=0.5)
    _perturb(student, 1.0)
    teacher.update(student)
    state = teacher.state_dict(student)
    fresh = create_teacher(_model(), "ema")
    fresh.load_state_dict(state, student)
    for a, b in zip(fresh.model.parameters(), teacher.model.parameters()):
        torch.testing.assert_close(a, b)
    assert create_teacher(student, "base").state_dict(student) == {}  # rebuilt exactly on resume

    lora = _lora_student()
    adapter = create_teacher(lora, "ema", teacher_update_rate=0.5)
    adapter.update(lora)
    saved = adapter.state_dict(lora)
    assert saved and all(f".{TEACHER_ADAPTER_NAME}." in name for name in saved)
    other = _lora_student()
    other_teacher = create_teacher(other, "ema")
    other_teacher.load_state_dict(saved, other)
    params = dict(other.named_parameters())
    for name, value in saved.items():
        torch.testing.assert_close(params[name].detach(), value)
