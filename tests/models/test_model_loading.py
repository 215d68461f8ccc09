import pytest
import torch

from posttrain.models.loading import (
    ModelNotFoundError,
    create_model_from_path,
    disable_dropout_in_model,
    load_processing_class,
    model_name,
    resolve_dtype,
)
from posttrain.models.peft_utils import add_reference_adapter, create_reference_model, prepare_peft_model, use_adapter


def test_default_dtype_is_float32_and_strings_resolve(tiny_model_path):
    model = create_model_from_path(tiny_model_path)
    assert next(model.parameters()).dtype == torch.float32
    model = create_model_from_path(tiny_model_path, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="Invalid dtype 'float8'"):
        resolve_dtype("float8")


def test_sequence_classification_has_one_label(tiny_model_path):
    model = create_model_from_path(tiny_model_path, task="sequence-classification")
    assert model.config.num_labels == 1


def test_missing_model_gives_one_paragraph_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="save_tiny_model"):
        create_model_from_path(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="Could not load model 'someone/not-a-model'"):
        load_processing_class("someone/not-a-model")


def test_processing_class_padding_side(tiny_model_path):
    tok = load_processing_class(tiny_model_path, padding_side="left")
    assert tok.padding_side == "left" and tok.pad_token == "<|pad|>"
    assert model_name(tiny_model_path) == tiny_model_path.rstrip("/").split("/")[-1]


def test_disable_dropout():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    disable_dropout_in_model(model)
    assert model[1].p == 0.0


def test_peft_reference_is_base_model_with_adapters_disabled(tiny_model_path):
    from peft import LoraConfig

    base = create_model_from_path(tiny_model_path)
    ids = torch.tensor([[1, 2, 3, 4]])
    base_logits = base(ids).logits.detach()
    model = prepare_peft_model(
        create_model_from_path(tiny_model_path),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    assert not torch.allclose(model(ids).logits, base_logits)
    with use_adapter(model, None):
        assert torch.allclose(model(ids).logits, base_logits, atol=1e-6)
    name = add_reference_adapter(model)
    adapted = model(ids).logits.detach()
    with use_adapter(model, name):
        assert torch.allclose(model(ids).logits, adapted, atol=1e-6)
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".ref." in n)
    with pytest.raises(ValueError, match="PeftModel together with a peft_config"):
        prepare_peft_model(model, LoraConfig(r=2))
    with pytest.raises(TypeError, match="peft.PeftConfig"):
        prepare_peft_model(base, {"r": 2})


def test_create_reference_model_is_frozen_copy(tiny_model_path):
    model = create_model_from_path(tiny_model_path)
    ref = create_reference_model(model)
    assert not ref.training and all(not p.requires_grad for p in ref.parameters())
    assert ref.model.embed_tokens.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def test_resolve_model_and_processing_class(tiny_model_path):
    from peft import LoraConfig, PeftModel

    from posttrain.models.loading import resolve_model, resolve_processing_class

    class Args:
        model_init_kwargs = {"dtype": "float32"}
        gradient_checkpointing = False

    model = resolve_model(tiny_model_path, Args(), peft_config=LoraConfig(r=2, target_modules=["q_proj"]))
    assert isinstance(model, PeftModel)
    with pytest.warns(UserWarning, match="model_init_kwargs is ignored"):
        resolve_model(create_model_from_path(tiny_model_path), Args())
    tok = resolve_processing_class(tiny_model_path, padding_side="left")
    assert tok.padding_side == "left"
    tok = resolve_processing_class(model, None)
    assert tok.eos_token == "<|im_end|>"


def test_vision_language_model_loads_with_its_own_class(tmp_path):
    """A saved LLaVA-style model loads as its image-text-to-text class (AutoModelForCausalLM cannot take it)."""
    from posttrain.models.tiny import save_tiny_vlm

    path = save_tiny_vlm(tmp_path / "vlm")
    model = create_model_from_path(str(path))
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert next(model.parameters()).dtype == torch.float32
