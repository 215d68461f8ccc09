"""``posttrain.models.unwrap_model_for_generation`` (TRL's ``trl.models`` name; TRL's sdft.py example imports it)."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM


def test_yields_the_unwrapped_model_without_checkpointing_and_restores_it(tiny_model_path):
    from posttrain.models import unwrap_model_for_generation

    accelerator = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    wrapped = accelerator.prepare(model)
    with unwrap_model_for_generation(wrapped, accelerator) as unwrapped:
        assert unwrapped is accelerator.unwrap_model(wrapped)
        assert not unwrapped.is_gradient_checkpointing
        out = unwrapped.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False)
        assert out.shape == (1, 5)
    assert model.is_gradient_checkpointing


def test_checkpointing_comes_back_when_the_block_raises(tiny_model_path):
    from posttrain.models import unwrap_model_for_generation

    accelerator = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    model.gradient_checkpointing_enable()
    with pytest.raises(RuntimeError, match="boom"), unwrap_model_for_generation(model, accelerator):
        raise RuntimeError("boom")
    assert model.is_gradient_checkpointing


def test_a_model_without_checkpointing_is_left_alone(tiny_model_path):
    from posttrain.models import unwrap_model_for_generation

    accelerator = Accelerator(cpu=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with unwrap_model_for_generation(model, accelerator, gather_deepspeed3_params=False,
                                     generation_kwargs={"temperature": 0.5}) as unwrapped:
        assert unwrapped is model
    assert not model.is_gradient_checkpointing
