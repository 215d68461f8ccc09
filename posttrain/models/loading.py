"""Load models and processing classes from hub ids, local paths or objects, with TRL's defaults.

``create_model_from_path`` follows TRL: the architecture comes from ``config.architectures[0]``, ``dtype`` defaults
to float32 (strings "bfloat16" | "float16" | "float32" | "auto" accepted), and ``device_map`` is left to the caller
(on a CPU-only machine no device map is needed). A model that cannot be found offline gets a one-paragraph error
instead of a network traceback.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from posttrain import legacy


class ModelNotFoundError(OSError):
    """Raised when a model id/path cannot be resolved (e.g. a hub id while offline)."""


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "auto": "auto"}


def resolve_dtype(dtype: Any) -> Any:
    """Map TRL's dtype strings to torch dtypes; ``None`` means float32 (TRL's default)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise ValueError(
        f"Invalid dtype {dtype!r} in model_init_kwargs. Use one of 'bfloat16', 'float16', 'float32', 'auto' or a "
        "torch.dtype."
    )


def _not_found(model_id: str, err: Exception) -> ModelNotFoundError:
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
    hint = (
        "HF_HUB_OFFLINE is set, so only local paths and models already in the cache can be loaded."
        if offline
        else "If this is a hub id, check the spelling and your network access; if it is a local folder, check the path."
    )
    return ModelNotFoundError(
        f"Could not load model {model_id!r}: it is neither a local folder with a config.json nor a model that could "
        f"be fetched. {hint} Offline, build a tiny local model with "
        f"`posttrain.models.tiny.save_tiny_model(path)` and pass its path. (Cause: {type(err).__name__}: "
        f"{str(err).splitlines()[0] if str(err) else ''})"
    )


def load_config(model_id: str, **kwargs):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError) as err:
        raise _not_found(model_id, err) from err


def create_model_from_path(model_id: str, *, task: str = "causal-lm", **model_init_kwargs):
    """Instantiate a model from a hub id or local path with TRL's loading rules.

    Args:
        model_id: Hub id or local folder.
        task: ``"causal-lm"`` (architecture from the config) or ``"sequence-classification"`` (``num_labels=1``
            unless given).
        **model_init_kwargs: Forwarded to ``from_pretrained``; ``dtype`` defaults to float32.
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = legacy.model_init_kwargs(model_init_kwargs)  # transformers 4's `torch_dtype` → `dtype`
    kwargs["dtype"] = resolve_dtype(kwargs.get("dtype"))
    trust = kwargs.get("trust_remote_code", False)
    config = load_config(model_id, trust_remote_code=trust, revision=kwargs.get("revision"))
    try:
        if task == "sequence-classification":
            kwargs.setdefault("num_labels", 1)
            return AutoModelForSequenceClassification.from_pretrained(model_id, **kwargs)
        architectures = getattr(config, "architectures", None) or []
        arch_cls = getattr(transformers, architectures[0], None) if architectures else None
        if arch_cls is not None and ("ForCausalLM" in architectures[0] or _is_image_text_to_text(config)):
            return arch_cls.from_pretrained(model_id, **kwargs)
        if _is_image_text_to_text(config):  # a vision-language model (LLaVA, Qwen2.5-VL, ...)
            from transformers import AutoModelForImageTextToText

            return AutoModelForImageTextToText.from_pretrained(model_id, **kwargs)
        return AutoModelForCausalLM.from_pretrained(model_id, **kwargs)
    except OSError as err:
        raise _not_found(model_id, err) from err


def _is_image_text_to_text(config: Any) -> bool:
    """Whether transformers maps this config to an image-text-to-text model (and not to a causal LM)."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES,
    )

    model_type = getattr(config, "model_type", None)
    return (
        model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
        and model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )


def load_processor(model: Any) -> Any:
    """The multimodal processor saved with ``model`` (a path/id, or a model's ``name_or_path``)."""
    from transformers import AutoProcessor

    import posttrain.models.image_only_processors  # noqa: F401  (AutoProcessor finds posttrain's image-only ones)

    source = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
    if not source:
        raise ValueError(
            "The train dataset has images but processing_class is None and the model has no `name_or_path` to load "
            "a processor from; pass processing_class=AutoProcessor.from_pretrained(...)."
        )
    try:
        return AutoProcessor.from_pretrained(source)
    except OSError as err:
        raise _not_found(source, err) from err


def load_processing_class(
    model_id: str, *, padding_side: str | None = None, truncation_side: str | None = None, **kwargs
):
    """Load the tokenizer for ``model_id``; a missing pad token falls back to EOS (as TRL)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_id, **kwargs)
    except (OSError, ValueError) as err:
        raise _not_found(model_id, err) from err
    if padding_side is not None:
        tokenizer.padding_side = padding_side
    if truncation_side is not None:
        tokenizer.truncation_side = truncation_side
    ensure_pad_token(tokenizer)
    return tokenizer


def ensure_pad_token(tokenizer) -> None:
    """Use EOS as the pad token when the tokenizer has none; error if it has neither."""
    tok = getattr(tokenizer, "tokenizer", tokenizer)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ValueError(
                "The tokenizer has neither a pad token nor an EOS token. Set `tokenizer.pad_token = ...` before "
                "passing it as processing_class."
            )
        tok.pad_token = tok.eos_token


def model_name(model: Any) -> str:
    """Short name of a model for default output dirs and metric names (last path component)."""
    if isinstance(model, str):
        return model.rstrip("/").split("/")[-1]
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
    return str(name).rstrip("/").split("/")[-1]


def disable_dropout_in_model(model: torch.nn.Module) -> None:
    """Set every dropout probability to 0 (TRL's ``disable_dropout``)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0


def resolve_model(
    model: Any, args: Any = None, *, task: str = "causal-lm", peft_config: Any = None, quantization_config: Any = None
):
    """The trainer's model from a hub id / path / object, wrapped with ``peft_config`` when given.

    Strings are loaded with ``args.model_init_kwargs`` (float32 by default) and ``args.trust_remote_code``; a
    ``quantization_config`` is merged into them (error if also present there). Objects are used as they are
    (``model_init_kwargs`` then has no effect and a warning says so).
    """
    import warnings

    from posttrain.models.peft_utils import prepare_peft_model

    init_kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    if isinstance(model, str):
        if quantization_config is not None:
            if "quantization_config" in init_kwargs:
                raise ValueError(
                    "quantization_config was given both to the trainer and in args.model_init_kwargs; keep one."
                )
            init_kwargs["quantization_config"] = quantization_config
        if getattr(args, "trust_remote_code", False):
            init_kwargs.setdefault("trust_remote_code", True)
        model = create_model_from_path(model, task=task, **init_kwargs)
    else:
        if init_kwargs:
            warnings.warn(
                "args.model_init_kwargs is ignored because the model is already instantiated; pass a model id or "
                "path to use it.",
                stacklevel=3,
            )
        if quantization_config is not None:
            warnings.warn("quantization_config is ignored because the model is already instantiated.", stacklevel=3)
    if peft_config is not None:
        model = prepare_peft_model(
            model, peft_config, gradient_checkpointing=bool(getattr(args, "gradient_checkpointing", False))
        )
    return model


def resolve_processing_class(
    model: Any,
    processing_class: Any = None,
    *,
    padding_side: str | None = None,
    truncation_side: str | None = None,
    trust_remote_code: bool = False,
):
    """The tokenizer given, or the one saved with ``model`` (pad token falls back to EOS)."""
    if processing_class is None:
        source = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", None)
        if not source:
            raise ValueError(
                "processing_class is None and the model has no `name_or_path` to load a tokenizer from; pass "
                "processing_class=AutoTokenizer.from_pretrained(...)."
            )
        kwargs = {"trust_remote_code": True} if trust_remote_code else {}
        return load_processing_class(source, padding_side=padding_side, truncation_side=truncation_side, **kwargs)
    tok = getattr(processing_class, "tokenizer", processing_class)
    if padding_side is not None:
        tok.padding_side = padding_side
    if truncation_side is not None:
        tok.truncation_side = truncation_side
    ensure_pad_token(tok)
    return processing_class


def resolve_router_aux_loss_coef(args: Any, model: Any) -> float:
    """Resolve ``args.router_aux_loss_coef`` for ``model`` in place (TRL's rule) and return it.

    ``None`` (the default) takes the architecture's own coefficient, ``model.config.router_aux_loss_coef`` (0.0 for
    a dense model, whose config declares none); an explicit value is kept, with a warning when the model is not a
    Mixture-of-Experts model (it then has no load-balancing loss to weight).
    """
    import warnings

    inner = getattr(model, "module", model)  # DDP / DeepSpeed wrappers
    inner = getattr(inner, "base_model", inner) if hasattr(inner, "peft_config") else inner
    config = getattr(inner, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    coef = getattr(args, "router_aux_loss_coef", None)
    if coef is None:
        coef = float(getattr(text_config, "router_aux_loss_coef", 0.0) or 0.0)
        args.router_aux_loss_coef = coef
    elif coef != 0.0 and not hasattr(text_config, "output_router_logits"):
        warnings.warn(
            f"router_aux_loss_coef={coef} has no effect: {type(inner).__name__} is not a Mixture-of-Experts model "
            "(its config has no output_router_logits). Leave it at None to use the model's own value.",
            stacklevel=3,
        )
    return coef
