"""Moving the trainer's weights to a generation server: which tensors, under which names, in which bytes.

Transport choice (CPU-portable path): **safetensors bytes in the body of an HTTP POST**. It needs nothing but the
HTTP stack the server already runs (no process group to rendezvous, no port besides the server's, works across
machines and through proxies), safetensors is a zero-copy, pickle-free format (a malicious body cannot run code on
the server, unlike ``torch.save``), it keeps dtypes and shapes exactly (so a push is *bitwise*: the server's
parameters equal the trainer's), and any language can produce it. The cost is a copy through host memory and the
network, which for a 0.5B-parameter model is ~1-2 GB per push: fine on CPU and for small models, slow for large
ones, where the GPU paths (NCCL broadcast through vLLM's weight-transfer engine or TRL's communicator, see
``posttrain.generation.vllm_server``) are the ones to use. Large pushes are split into chunks of at most
``chunk_bytes`` (several requests of one update); the server applies an update only when its last chunk arrives, so
generation never sees half-updated weights.

Verification (transport-independent): each chunk's bytes have a SHA-256 ``chunk_digest``; the update's digest is the
SHA-256 of its chunk digests in order (``update_digest``), so an update can be checked chunk by chunk as it streams
and as a whole at the end. ``check_tensors`` is what the server checks before an update can be applied: known names,
equal shapes, an allowed dtype (``ALLOWED_CASTS``) and finite values; a failed check names the tensor and applies
nothing.

Names are the plain transformers checkpoint names (``model.layers.0.self_attn.q_proj.weight``), which is what both
the posttrain server's model and vLLM's ``load_weights`` expect. A PEFT policy is pushed as its merged weights under the base-model names
(``policy_weights``), or, with adapter-only sync (``vllm_sync_adapter_only=True``, posttrain server), as its LoRA
tensors alone (``adapter_weights``: MBs instead of the whole model), the LoRA config riding in the safetensors header;
the server wraps its own base with that config once and loads the adapter tensors on every push.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import re
from collections.abc import Iterator
from typing import Any

import torch

DEFAULT_CHUNK_BYTES = 512 * 1024 * 1024

# The floating dtypes a trainer holds its weights in; any of them may be pushed onto any of them (the server casts to
# the parameter's dtype, e.g. a float32 trainer onto a bfloat16 server). Everything else must match exactly: float64
# (a stray ``.double()``) and integer/bool tensors are refused onto floating weights instead of being silently cast.
ALLOWED_CASTS: frozenset = frozenset({torch.float16, torch.bfloat16, torch.float32})

_FINITE_CHECK_ELEMENTS = 1 << 24  # elements per slice in check_tensors' NaN/Inf scan (bounds its scratch memory)


class WeightUpdateError(ValueError):
    """A weight update the server refuses; ``tensor`` names the offending tensor (``None``: the update as a whole)."""

    def __init__(self, message: str, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


def chunk_digest(data: bytes) -> str:
    """The hex SHA-256 of one chunk's bytes (what the client sends as ``chunk_digest`` and the server recomputes)."""
    return hashlib.sha256(data).hexdigest()


def update_digest(chunk_digests: list[str]) -> str:
    """The digest of a whole update: the hex SHA-256 of its chunks' hex digests joined in order."""
    return hashlib.sha256("".join(chunk_digests).encode()).hexdigest()


def weight_specs(model: torch.nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{name: (shape, dtype)}`` of every parameter (tied aliases included) and buffer a push may write."""
    specs = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters(remove_duplicate=False)}
    specs.update({n: (tuple(b.shape), b.dtype) for n, b in model.named_buffers()})
    return specs


def _cast_refusal(name: str, source: torch.dtype, target: torch.dtype | None) -> str | None:
    if source == target or (source in ALLOWED_CASTS and (target is None or target in ALLOWED_CASTS)):
        return None
    onto = f"the served model's {str(target).removeprefix('torch.')}" if target is not None else "floating weights"
    return (
        f"Weight {name!r} is {str(source).removeprefix('torch.')}, which is not cast onto {onto}: a push may convert "
        "between float16, bfloat16 and float32 only (float64 and integer tensors are refused so that a stray "
        ".double() or .long() cannot replace the weights). Convert it to the model's dtype before pushing."
    )


def _count_non_finite(tensor: torch.Tensor) -> int:
    flat = tensor.reshape(-1)
    bad = 0
    for start in range(0, flat.numel(), _FINITE_CHECK_ELEMENTS):
        part = flat[start : start + _FINITE_CHECK_ELEMENTS]
        bad += int(part.numel() - torch.isfinite(part).sum().item())
    return bad


def check_tensors(
    tensors: dict[str, torch.Tensor], specs: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None
) -> None:
    """Refuse (``WeightUpdateError`` naming the tensor) what a weight update must not apply.

    With ``specs`` (``weight_specs(model)``): every name must exist and every shape must match. Always: the dtype
    must be one of ``ALLOWED_CASTS`` or equal the target's (without ``specs``: one of ``ALLOWED_CASTS``), and a
    floating tensor must hold no NaN or Inf (one would make every later generation fail).
    """
    for name, tensor in tensors.items():
        target_dtype = None
        if specs is not None:
            if name not in specs:
                close = difflib.get_close_matches(name, list(specs), n=3)
                raise WeightUpdateError(
                    f"Unknown weight name {name!r}: the served model has no such parameter"
                    + (f" (similar: {close})." if close else "."),
                    name,
                )
            shape, target_dtype = specs[name]
            if tuple(shape) != tuple(tensor.shape):
                raise WeightUpdateError(
                    f"Weight {name!r} has shape {list(tensor.shape)} but the served model's is {list(shape)}.", name
                )
        refusal = _cast_refusal(name, tensor.dtype, target_dtype)
        if refusal is not None:
            raise WeightUpdateError(refusal, name)
        if tensor.is_floating_point() or tensor.is_complex():
            bad = _count_non_finite(tensor)
            if bad:
                raise WeightUpdateError(
                    f"Weight {name!r} has {bad} NaN/Inf value(s) of {tensor.numel()}; the update is refused and the "
                    "previous weights keep serving (check the trainer for a diverged step).",
                    name,
                )


def clean_param_name(name: str, active_adapters: tuple[str, ...] = ("default",)) -> str | None:
    """A PEFT / DDP parameter name as the base checkpoint spells it; ``None`` for adapter-only parameters.

    Drops ``module.`` (DDP) and ``base_model.model.`` prefixes and ``.base_layer``, maps
    ``modules_to_save.<active adapter>.`` to the module itself, and skips ``lora_*`` tensors, ``original_module``
    and the ``modules_to_save`` copies of inactive adapters.
    """
    name = name.removeprefix("module.").removeprefix("base_model.model.")
    if "lora_" in name or "original_module" in name:
        return None
    match = re.search(r"modules_to_save\.([^.]+)\.", name)
    if match:
        if match.group(1) not in active_adapters:
            return None
        name = name.replace(match.group(0), "")
    return name.replace(".base_layer", "")


def _is_peft(model: Any) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter") and hasattr(model, "peft_config")


def _active_adapters(model: Any) -> tuple[str, ...]:
    active = getattr(model, "active_adapters", None) or getattr(model, "active_adapter", "default")
    if callable(active):
        active = active()
    return (active,) if isinstance(active, str) else tuple(active)


def _lora_deltas(model: Any, active: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
    """``{base weight's parameter name: ΔW}`` for plain LoRA layers; ``None`` where only merging is safe (DoRA,
    already-merged layers, layer types without ``get_delta_weight``)."""
    deltas: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        if not hasattr(module, "lora_A") or not hasattr(module, "base_layer"):
            continue
        if getattr(module, "merged_adapters", None) or not hasattr(module, "get_delta_weight"):
            return None
        names = [a for a in active if a in module.lora_A or a in getattr(module, "lora_embedding_A", {})]
        if any(getattr(module, "use_dora", {}).get(a, False) for a in names):
            return None
        if names and not isinstance(getattr(module.base_layer, "weight", None), torch.Tensor):
            return None
        if names:
            deltas[f"{module_name}.base_layer.weight"] = sum(module.get_delta_weight(a) for a in names)
    return deltas


@contextlib.contextmanager
def policy_weights(model: torch.nn.Module) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """Yield an iterator of ``(checkpoint name, tensor)`` for the model's current (merged, for PEFT) weights.

    A PEFT model is pushed as its merged weights, as TRL does (``merge_adapter`` → push → ``unmerge_adapter``). For
    plain LoRA layers the merged weight ``W + ΔW`` is computed into a new tensor instead, which gives the same
    values without the round trip through the frozen base weights (merging and unmerging in place would move them
    by rounding every push); DoRA and other adapter types take TRL's merge/unmerge path. Tied parameters appear
    once (``named_parameters`` deduplicates them). DTensor (FSDP2) parameters are gathered with ``full_tensor()``.
    """
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module  # DDP
    peft = _is_peft(model)
    active = _active_adapters(model) if peft else ()
    deltas = _lora_deltas(model, active) if peft else {}
    merge = peft and deltas is None
    if merge:
        model.merge_adapter()
    try:

        def items() -> Iterator[tuple[str, torch.Tensor]]:
            for name, param in model.named_parameters():
                clean = clean_param_name(name, active) if peft else name.removeprefix("module.")
                if clean is None:
                    continue
                if hasattr(param, "ds_id"):
                    raise ValueError(
                        "Pushing DeepSpeed ZeRO-3 partitioned parameters to a generation server is not supported; "
                        "use ZeRO-1/2, FSDP2 or a single process with vllm_mode='server'."
                    )
                tensor = param.detach()
                if hasattr(tensor, "full_tensor"):  # torch.distributed.tensor.DTensor (FSDP2)
                    tensor = tensor.full_tensor()
                if deltas and name in deltas:
                    tensor = tensor + deltas[name].to(tensor.dtype)
                yield clean, tensor

        with torch.no_grad():
            yield items()
    finally:
        if merge:
            model.unmerge_adapter()


def serialize_chunks(
    tensors: Iterator[tuple[str, torch.Tensor]] | dict[str, torch.Tensor],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    metadata: dict[str, str] | None = None,
) -> Iterator[bytes]:
    """safetensors payloads of at most ~``chunk_bytes`` each (a single larger tensor gets a chunk of its own); every
    chunk carries ``metadata`` in its header (an adapter-only push's format and LoRA config)."""
    from safetensors.torch import save

    if isinstance(tensors, dict):
        tensors = iter(tensors.items())
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield save(chunk, metadata=metadata)
            chunk, size = {}, 0
        # safetensors wants contiguous CPU tensors that share no storage with another entry.
        chunk[name] = tensor.detach().to("cpu").contiguous().clone()
        size += nbytes
    if chunk:
        yield save(chunk, metadata=metadata)


@contextlib.contextmanager
def push_payload(
    model: torch.nn.Module, chunk_bytes: int = DEFAULT_CHUNK_BYTES, adapter_only: bool = False
) -> Iterator[Iterator[bytes]]:
    """The safetensors chunks of one weight push: the merged policy (``policy_weights``) or, with ``adapter_only``,
    the LoRA adapter with its config in every chunk's header (``adapter_weights``)."""
    if adapter_only:
        with adapter_weights(model) as (metadata, items):
            yield serialize_chunks(items, chunk_bytes, metadata)
    else:
        with policy_weights(model) as items:
            yield serialize_chunks(items, chunk_bytes)


def deserialize(data: bytes) -> dict[str, torch.Tensor]:
    """Tensors from a safetensors payload; ``ValueError`` when the bytes are not one."""
    from safetensors.torch import load

    try:
        return load(data)
    except Exception as err:  # safetensors raises its own SafetensorError (and others for truncated headers)
        raise ValueError(f"The request body is not a valid safetensors payload: {err}") from err


def load_into(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> int:
    """Copy ``tensors`` into the model's parameters/buffers of the same name; returns how many were loaded.

    Everything is checked first (``check_tensors``: names, shapes, allowed dtypes, finite values; a
    ``WeightUpdateError`` names the first offender), so a refused update copies nothing. Values are cast to the
    parameter's dtype within ``ALLOWED_CASTS``; a partial update (a subset of the names) is allowed.
    """
    targets = dict(model.named_parameters(remove_duplicate=False))  # tied aliases (lm_head.weight) accepted too
    targets.update(dict(model.named_buffers()))
    check_tensors(tensors, {n: (tuple(t.shape), t.dtype) for n, t in targets.items()})
    with torch.no_grad():
        for name, tensor in tensors.items():
            target = targets[name]
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
    return len(tensors)


# -- the post-sync probe ----------------------------------------------------------------------------------------------
PROBE_PROMPT_LENGTH = 8
PROBE_TOKENS = 4
PROBE_SEED = 20_240_601


def probe_prompt(vocab_size: int) -> list[int]:
    """The fixed prompt of the post-sync probe: ``PROBE_PROMPT_LENGTH`` ids spread over the vocabulary."""
    return [(17 + 7_919 * i) % int(vocab_size) for i in range(PROBE_PROMPT_LENGTH)]


def probe_sequence(vocab_size: int) -> list[int]:
    """A fixed probe sequence (``probe_prompt`` and ``PROBE_TOKENS`` fixed continuation ids) for servers that score
    given tokens (``/get_sequence_logprobs/``), where the trainer's side is computed when the weights are
    snapshotted (the async trainers upload in the background while training moves on)."""
    return probe_prompt(vocab_size) + [(101 + 3_571 * i) % int(vocab_size) for i in range(PROBE_TOKENS)]


@torch.no_grad()
def probe_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """The trainer's log-probs of ``tokens`` following ``prompt`` (one full forward, eval mode, float32
    log-softmax): what a server holding the same weights reports for them at temperature 1 with no filtering."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module  # DDP
    if not tokens:
        return []
    device = next(model.parameters()).device
    training = model.training
    model.eval()
    try:
        ids = torch.tensor([list(prompt) + list(tokens)], dtype=torch.long, device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    finally:
        model.train(training)
    targets = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1).tolist()


# -- adapter-only pushes (LoRA) ---------------------------------------------------------------------------------------
ADAPTER_FORMAT = "posttrain.lora_adapter.v1"

# LoraConfig fields the server sets itself: the adapter is for inference (no dropout), its initial values are replaced
# by the push (plain initialisation; PiSSA/OLoRA-style initialisations that rewrite the base are refused at the
# trainer), ``modules_to_save`` copies are pushed as full base weights instead, and the rest names the trainer's files.
_SERVER_SET_LORA_FIELDS = frozenset({
    "peft_type", "task_type", "modules_to_save", "base_model_name_or_path", "revision", "inference_mode",
    "runtime_config", "init_lora_weights", "lora_dropout", "auto_mapping",
})  # fmt: skip


def adapter_wire_name(name: str, adapter: str) -> str | None:
    """The name a LoRA tensor is pushed under: the parameter's name without DDP/PEFT prefixes and without the
    adapter-name segment (``model.layers.0.self_attn.q_proj.lora_A.weight``), as PEFT saves adapters; ``None`` for a
    tensor that is not a LoRA tensor of ``adapter``."""
    name = name.removeprefix("module.").removeprefix("base_model.model.")
    wire, found = re.subn(rf"(lora_[A-Za-z_]+)\.{re.escape(adapter)}(\.|$)", r"\1\2", name)
    return wire if found else None


def _jsonable(value: Any) -> Any:
    import enum

    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, set | frozenset):
        return sorted(_jsonable(v) for v in value)
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    return value if value is None or isinstance(value, str | int | float | bool) else str(value)


def adapter_config_dict(model: Any) -> tuple[str, dict[str, Any]]:
    """``(active adapter name, its LoRA config as JSON-able dict)`` of a PEFT model that adapter-only sync can push;
    ``ValueError`` naming the reason when it cannot (not PEFT, several active adapters, not LoRA, an initialisation
    that rewrites the base weights)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module  # DDP
    if not _is_peft(model):
        raise ValueError(
            "vllm_sync_adapter_only=True needs a PEFT (LoRA) policy: pass peft_config=LoraConfig(...) to the trainer, "
            "or set vllm_sync_adapter_only=False to push the full weights."
        )
    active = _active_adapters(model)
    if len(active) != 1:
        raise ValueError(
            f"vllm_sync_adapter_only=True pushes one adapter, but {len(active)} are active ({list(active)}); activate "
            "one (model.set_adapter(name)) or set vllm_sync_adapter_only=False to push the merged weights."
        )
    config = model.peft_config[active[0]]
    peft_type = _jsonable(getattr(config, "peft_type", None))
    if peft_type != "LORA":
        raise ValueError(
            f"vllm_sync_adapter_only=True supports LoRA adapters only, but the active adapter is {peft_type}; set "
            "vllm_sync_adapter_only=False to push the merged weights."
        )
    init = getattr(config, "init_lora_weights", True)
    if not (isinstance(init, bool) or init == "gaussian"):
        raise ValueError(
            f"vllm_sync_adapter_only=True cannot push an adapter initialised with init_lora_weights={init!r}: that "
            "initialisation rewrites the base weights in the trainer, so the server's base differs. Set "
            "vllm_sync_adapter_only=False (merged pushes) or use init_lora_weights=True."
        )
    data = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    return active[0], {k: _jsonable(v) for k, v in data.items() if k not in _SERVER_SET_LORA_FIELDS}


@contextlib.contextmanager
def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[dict[str, str], Iterator[tuple[str, torch.Tensor]]]]:
    """Yield ``(payload metadata, iterator of (name, tensor))`` for an adapter-only push of a PEFT LoRA policy.

    The tensors are the active adapter's LoRA tensors under ``adapter_wire_name`` names plus the active
    ``modules_to_save`` copies under the base checkpoint names (they replace whole modules, so they go as full
    weights); the frozen base is not sent. The metadata (``format`` = ``ADAPTER_FORMAT``, ``adapter_config`` = the
    LoRA config as JSON) travels inside every safetensors chunk, so the update's digests cover it. A trainable
    parameter that is neither (an unfrozen base weight) would be lost, so it makes this raise ``ValueError``.
    """
    import json

    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module  # DDP
    adapter, config = adapter_config_dict(model)
    metadata = {"format": ADAPTER_FORMAT, "adapter_config": json.dumps(config, sort_keys=True)}

    def items() -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in model.named_parameters():
            if "lora_" in name:
                wire = adapter_wire_name(name, adapter)
            elif re.search(rf"modules_to_save\.{re.escape(adapter)}\.", name):
                wire = clean_param_name(name, (adapter,))
            else:
                if param.requires_grad and "original_module" not in name and "modules_to_save" not in name:
                    raise ValueError(
                        f"vllm_sync_adapter_only=True would not push the trainable base parameter {name!r} (only the "
                        "LoRA tensors and modules_to_save are sent). Freeze it, list its module in the LoraConfig's "
                        "modules_to_save, or set vllm_sync_adapter_only=False."
                    )
                continue
            if wire is None:
                continue
            if hasattr(param, "ds_id"):
                raise ValueError(
                    "Pushing DeepSpeed ZeRO-3 partitioned parameters to a generation server is not supported; "
                    "use ZeRO-1/2, FSDP2 or a single process with vllm_mode='server'."
                )
            tensor = param.detach()
            if hasattr(tensor, "full_tensor"):  # DTensor (FSDP2)
                tensor = tensor.full_tensor()
            yield wire, tensor

    with torch.no_grad():
        yield metadata, items()


def payload_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors payload's header (``{}`` when it has none or is not one)."""
    import json

    if len(data) < 8:
        return {}
    size = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + size])
    except ValueError:
        return {}
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    return dict(meta) if isinstance(meta, dict) else {}


def payload_adapter_config(data: bytes) -> dict[str, Any] | None:
    """The LoRA config of an adapter-only payload (``adapter_weights``); ``None`` for a full-weights payload."""
    import json

    meta = payload_metadata(data)
    if meta.get("format") != ADAPTER_FORMAT:
        return None
    try:
        config = json.loads(meta.get("adapter_config", ""))
    except ValueError as err:
        raise WeightUpdateError(f"The adapter payload's adapter_config is not JSON: {err}") from err
    if not isinstance(config, dict) or "r" not in config or "target_modules" not in config:
        raise WeightUpdateError(
            "The adapter payload's adapter_config must be a LoRA config with r and target_modules."
        )
    return config


def server_lora_kwargs(config: dict[str, Any]) -> dict[str, Any]:
    """``LoraConfig`` keyword arguments for the server's copy of a pushed adapter: the trainer's fields this PEFT
    version knows (``_SERVER_SET_LORA_FIELDS`` excluded), inference mode, no dropout, plain initialisation."""
    import dataclasses

    from peft import LoraConfig

    known = {f.name for f in dataclasses.fields(LoraConfig)}
    kwargs = {k: v for k, v in config.items() if k in known and k not in _SERVER_SET_LORA_FIELDS}
    return {**kwargs, "lora_dropout": 0.0, "init_lora_weights": True, "inference_mode": True}
