"""Script-level argument dataclasses with TRL's names: ``ModelConfig``, ``ScriptArguments``, GRPO/RLOO extras.

``get_peft_config`` and ``get_quantization_config`` turn a ``ModelConfig`` into peft/bitsandbytes configs exactly
as TRL's scripts do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from posttrain.legacy import LegacyKwargsMeta, LegacyModelConfigAttributes, legacy_trust_remote_code


@dataclass
class ModelConfig(LegacyModelConfigAttributes, metaclass=LegacyKwargsMeta):
    """Which model to train and how to load/adapt it (TRL 1.16's fields).

    ``trust_remote_code`` lives on the trainer configs (``SFTConfig.trust_remote_code`` ...), as in TRL 1.16, so
    ``HfArgumentParser((ScriptArguments, SFTConfig, ModelConfig))`` has no conflicting option. The old spellings
    ``ModelConfig(trust_remote_code=...)``, ``model_args.trust_remote_code`` and ``torch_dtype`` still work with a
    ``FutureWarning`` (:mod:`posttrain.legacy`).
    """

    model_name_or_path: str | None = field(default=None, metadata={"help": "Hub id or local path of the model."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of the model."})
    dtype: str | None = field(
        default="float32",
        metadata={"help": "Weights dtype.", "choices": ["auto", "bfloat16", "float16", "float32"]},
    )
    attn_implementation: str | None = field(
        default=None, metadata={"help": "Attention implementation: eager, sdpa, flash_attention_2, flex_attention..."}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter instead of all weights."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha."})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout."})
    lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Modules to adapt (e.g. q_proj v_proj, or all-linear)."}
    )
    lora_target_parameters: list[str] | None = field(default=None, metadata={"help": "Parameters to adapt."})
    lora_modules_to_save: list[str] | None = field(
        default=None, metadata={"help": "Modules trained fully and saved with the adapter (e.g. score)."}
    )
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "CAUSAL_LM, or SEQ_CLS for reward models."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA scaling alpha/sqrt(r)."})
    use_dora: bool = field(default=False, metadata={"help": "Weight-decomposed LoRA (DoRA)."})
    load_in_8bit: bool = field(default=False, metadata={"help": "Load the base model in 8 bit (bitsandbytes)."})
    load_in_4bit: bool = field(default=False, metadata={"help": "Load the base model in 4 bit (bitsandbytes)."})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit quantisation type: fp4 or nf4."})
    use_bnb_nested_quant: bool = field(default=False, metadata={"help": "Nested (double) quantisation."})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "Storage dtype of 4-bit weights."})

    def __post_init__(self):
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("load_in_8bit and load_in_4bit are mutually exclusive; choose one.")
        if isinstance(self.lora_target_modules, list) and len(self.lora_target_modules) == 1:
            self.lora_target_modules = self.lora_target_modules[0]

    def model_init_kwargs(self, trust_remote_code: bool = False) -> dict[str, Any]:
        """kwargs for ``from_pretrained`` as TRL's scripts build them.

        ``trust_remote_code`` is the trainer config's (``training_args.trust_remote_code``, as in TRL 1.16); a value
        given to ``ModelConfig(trust_remote_code=True)`` (deprecated) also turns it on.
        """
        kwargs: dict[str, Any] = {
            "revision": self.model_revision,
            "trust_remote_code": bool(trust_remote_code) or legacy_trust_remote_code(self),
            "dtype": self.dtype,
        }
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        quantization_config = get_quantization_config(self)
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
            device_map = get_kbit_device_map()
            if device_map is not None:
                kwargs["device_map"] = device_map
        return kwargs


def get_quantization_config(model_args: ModelConfig):
    """A bitsandbytes config for 4-/8-bit loading, or None."""
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    from transformers import BitsAndBytesConfig

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ImportError(
            "load_in_4bit/load_in_8bit need bitsandbytes and a CUDA GPU: `pip install bitsandbytes`."
        ) from err
    if model_args.load_in_4bit:
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_compute_dtype=model_args.dtype if model_args.dtype not in (None, "auto") else "float32",
            bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
            bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def get_kbit_device_map() -> dict[str, int] | None:
    """``device_map`` for 4-/8-bit models: the whole model on this process's GPU (TRL's helper); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    from accelerate import PartialState

    return {"": PartialState().local_process_index}


def get_peft_config(model_args: ModelConfig):
    """A ``peft.LoraConfig`` when ``use_peft`` is set, else None."""
    if not model_args.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        target_modules=model_args.lora_target_modules,
        target_parameters=model_args.lora_target_parameters,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        bias="none",
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        modules_to_save=model_args.lora_modules_to_save,
    )


@dataclass
class ScriptArguments:
    """Which dataset to train on (a hub name, a local file or folder)."""

    dataset_name: str | None = field(
        default=None,
        metadata={"help": "Hub dataset name, or a local file (json/jsonl/csv/parquet/arrow) or folder."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split used for training."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split used for evaluation."})
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset instead of downloading."})
    ignore_bias_buffers: bool = field(
        default=False, metadata={"help": "Ignore boolean bias buffers under DDP (some models need it)."}
    )


@dataclass
class GRPOScriptArguments(ScriptArguments):
    """Dataset arguments plus the reward sources for ``posttrain grpo`` / ``posttrain rloo``."""

    reward_funcs: list[str] | None = field(
        default=None,
        metadata={
            "help": "Reward functions: registry names (accuracy_reward, reasoning_accuracy_reward, "
            "think_format_reward, get_soft_overlong_punishment, ...) or dotted paths (my_rewards.my_func)."
        },
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A reward model (sequence classifier) id or path, scored first."}
    )


@dataclass
class RLOOScriptArguments(GRPOScriptArguments):
    """Dataset arguments plus the reward sources for ``posttrain rloo`` (same fields as GRPO's)."""


@dataclass
class DistillationScriptArguments(ScriptArguments):
    """Dataset arguments for ``posttrain distillation`` (the teacher is named in ``DistillationConfig``)."""
