"""Routing replay for mixture-of-experts models (``keep_routing``): record the sampler's expert choices, replay
them in the training forward.

Why: a MoE model routes each token to its top-k experts by ``topk(softmax(router logits))``. The sampler (one token
at a time through a KV cache, a batch that shrinks as completions finish) and the training forward (whole
``[prompt | completion]`` rows, another batch) compute the router logits with different kernels and reduction
orders; where two experts are nearly tied, the two forwards pick different experts, and the trainer's π_old is
then not the policy that sampled, even on-policy (importance ratio ≠ 1). Importance sampling can only re-weight
that mismatch; replaying the routing removes it.

How (no transformers code is copied, nothing is patched at class level):

* **Routers.** transformers' MoE blocks (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE, Qwen3-Next, GPT-OSS, ...) call a
  router module (``*TopKRouter``) that returns ``(router_logits (N, E), weights (N, k), experts (N, k))`` for the
  block's ``N = B·T`` flattened tokens, and mix the chosen experts' outputs with ``weights``. :func:`find_routers`
  finds them (class name containing "Router", a ``top_k`` attribute), in module order: the ``l``-th router is
  routing layer ``l`` (dense layers of a partly sparse model have none).
* **Recording** (:class:`RoutingRecorder`): a forward hook on each router keeps the ``experts`` of its latest call;
  after each sampler forward, :meth:`RoutingRecorder.take` stacks them into ``(N, L, k)`` (``expert + 1`` in a
  compact integer type, :func:`posttrain.core.routing.encode_routing`). The group sampler records its prefill (every
  prompt token) and each decode step (the fed token), so every prompt token and every completion token except the
  last (never fed back: its routing cannot affect any scored log-prob) has a record.
* **Replay** (:func:`replay_routing`): inside the context a forward hook on each router replaces its output by
  ``(router_logits, routing_weights(router_logits, recorded experts), recorded experts)``: the recorded expert set,
  with gate weights recomputed from the *current* router logits over that set
  (:func:`posttrain.core.routing.routing_weights`: softmax probabilities of the recorded experts, renormalised
  when the router renormalises). So the router still gets gradients (through the weights of the experts the sampler
  used), and ``router_logits`` (read by transformers' ``output_router_logits`` recorder for the load-balancing aux
  loss) is untouched: the aux loss stays defined and is the usual one of the current router. Tokens without a
  record (stored 0: padding, a completion's last token) keep the router's own choice, bit for bit.
* **Gradient checkpointing.** The recompute of a checkpointed decoder layer runs in ``backward``, after the context
  has exited. Inside the context each decoder layer's ``_gradient_checkpointing_func`` (the instance attribute
  ``gradient_checkpointing_enable`` sets) is wrapped so that the function it checkpoints re-installs the replay
  hooks of that layer's routers when it is re-run: the recompute routes by the same record as the forward.

* **Over the wire** (``posttrain serve``, ``return_routing``): :func:`routing_to_wire` /
  :func:`routing_from_wire` carry a stored routing tensor as ``{"dtype", "shape", "data"}``, ``data`` the base64 of
  its little-endian bytes: ``L · k`` bytes per token for a model with at most 255 experts (4/3 of that in base64).

Whether a router renormalises its top-k weights (Mixtral, Qwen3-MoE by default: yes; Qwen2-MoE by default: no) is
read from its ``norm_topk_prob`` attribute when it has one and checked against its own output at its first call; a
router whose weights are neither form raises (routing replay would change its mixing).
"""

from __future__ import annotations

import base64
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch

from posttrain.core.routing import decode_routing, encode_routing, routing_storage_dtype, routing_weights

__all__ = [
    "RoutingRecorder",
    "SampledRouting",
    "collate_routing",
    "find_routers",
    "replay_routing",
    "require_routers",
    "routing_for_packs",
    "routing_for_rows",
    "routing_from_wire",
    "routing_to_wire",
]

# router module -> whether it renormalises its top-k weights (checked once against its own output)
_NORMALIZES: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def find_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE router modules of ``model`` in module (layer) order; ``[]`` for a dense model."""
    return [m for m in model.modules() if "router" in type(m).__name__.lower() and hasattr(m, "top_k")]


def require_routers(model: torch.nn.Module, field: str = "keep_routing") -> list[torch.nn.Module]:
    """:func:`find_routers`, raising a ``ValueError`` that names ``field`` when ``model`` has no MoE router."""
    routers = find_routers(model)
    if not routers:
        base = getattr(model, "module", model)
        raise ValueError(
            f"{field}=True replays the expert routing of a mixture-of-experts model, but "
            f"{type(base).__name__} has no MoE router (no module whose class is a '*Router' with a top_k, as in "
            "Qwen2-MoE, Qwen3-MoE or Mixtral). Set keep_routing=False for a dense model."
        )
    return routers


def _unpack(router: torch.nn.Module, output: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(router_logits (N, E), weights (N, k), experts (N, k))`` from a router's output, or a clear error."""
    if (
        not isinstance(output, tuple)
        or len(output) != 3
        or not all(isinstance(t, torch.Tensor) for t in output)
        or output[2].is_floating_point()
        or output[0].dim() != 2
        or output[1].shape != output[2].shape
    ):
        raise TypeError(
            f"keep_routing: {type(router).__name__} does not return (router_logits, weights, expert indices) as the "
            "Qwen2-MoE / Qwen3-MoE / Mixtral routers of transformers do; routing replay does not support it."
        )
    return output  # type: ignore[return-value]


def _normalizes(router: torch.nn.Module, logits: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> bool:
    """Whether ``router`` renormalises its top-k weights, checked against its own ``weights`` at its first call."""
    known = _NORMALIZES.get(router)
    if known is not None:
        return known
    first = bool(getattr(router, "norm_topk_prob", True))
    if experts.shape[0] == 0:
        return first
    with torch.no_grad():
        for normalize in (first, not first):
            mine = routing_weights(logits.detach(), experts, normalize, torch.float32)
            if torch.allclose(mine, weights.detach().float(), rtol=1e-4, atol=1e-6):
                _NORMALIZES[router] = normalize
                return normalize
    raise ValueError(
        f"keep_routing: the weights {type(router).__name__} returns are not the softmax probabilities of its chosen "
        "experts (renormalised or not), so routing replay cannot recompute them for the recorded experts."
    )


class RoutingRecorder:
    """Records each MoE router's top-k expert choice during the sampler's forwards.

    Use: ``with recorder.hooks(): ...`` around sampling; after each model forward, :meth:`take` returns that
    forward's routing ``(N, L, k)`` (``N = B·T`` tokens in the input's row-major order, ``L`` routers, ``k``
    experts per token), stored compactly (:func:`posttrain.core.routing.encode_routing`). A forward run twice
    (the lean decoder's one-time check) keeps its last run's choice.
    """

    def __init__(self, model: torch.nn.Module):
        self.routers = require_routers(model)
        self.num_experts = 1
        self._latest: dict[int, torch.Tensor] = {}

    @property
    def storage_dtype(self) -> torch.dtype:
        return routing_storage_dtype(self.num_experts)

    @contextmanager
    def hooks(self) -> Iterator[RoutingRecorder]:
        handles = [r.register_forward_hook(partial(self._hook, i)) for i, r in enumerate(self.routers)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self._latest = {}

    def _hook(self, ordinal: int, router: torch.nn.Module, args: Any, output: Any) -> None:
        logits, _, experts = _unpack(router, output)
        self.num_experts = max(self.num_experts, int(logits.shape[-1]))
        self._latest[ordinal] = experts.detach()

    def take(self) -> torch.Tensor:
        """The routing of the forward just run, ``(N, L, k)`` in :attr:`storage_dtype` (expert + 1), and reset."""
        if len(self._latest) != len(self.routers):
            raise RuntimeError(
                f"keep_routing: {len(self._latest)} of the model's {len(self.routers)} routers ran in the last forward."
            )
        stacked = torch.stack([self._latest[i] for i in range(len(self.routers))], dim=1)  # (N, L, k)
        self._latest = {}
        return encode_routing(stacked, self.num_experts)


class _ReplayPlan:
    """The routing one replayed forward uses: ``experts`` ``(N, L, k)`` int64, ``-1`` = the router's own choice."""

    def __init__(self, experts: torch.Tensor, routers: list[torch.nn.Module]):
        self.experts = experts
        self.routers = routers
        self.live = True  # inside the replay context (hooks installed model-wide)
        self.replayed: dict[int, torch.Tensor] = {}

    def hook(self, ordinal: int, router: torch.nn.Module, args: Any, output: Any) -> tuple[torch.Tensor, ...]:
        logits, weights, own = _unpack(router, output)
        recorded = self.experts[:, ordinal]  # (N, k)
        if recorded.shape[0] != logits.shape[0] or recorded.shape[1] != own.shape[1]:
            raise ValueError(
                f"keep_routing: the recorded routing covers {recorded.shape[0]} tokens × top-{recorded.shape[1]} "
                f"but router {ordinal} ({type(router).__name__}) routed {logits.shape[0]} tokens × top-{own.shape[1]}:"
                " the replayed forward must take exactly the [prompt | completion] rows the routing was laid out for."
            )
        normalize = _normalizes(router, logits, weights, own)
        known = recorded[:, :1] >= 0  # (N, 1): the token has a record
        chosen = torch.where(known, recorded, own)  # (N, k) int64
        return logits, routing_weights(logits, chosen, normalize, weights.dtype), chosen


def _checkpointing_layers(model: torch.nn.Module, routers: list[torch.nn.Module]) -> list[tuple[Any, list]]:
    """``[(layer, [(ordinal, router), ...])]`` for the gradient-checkpointed modules that hold routers."""
    ordinals = {id(r): i for i, r in enumerate(routers)}
    out = []
    for module in model.modules():
        if "_gradient_checkpointing_func" in vars(module) and getattr(module, "gradient_checkpointing", False):
            inner = [(ordinals[id(m)], m) for m in module.modules() if id(m) in ordinals]
            if inner:
                out.append((module, inner))
    return out


def _replaying_checkpoint(original: Any, plan: _ReplayPlan, layer_routers: list) -> Any:
    """``original`` (a layer's checkpoint function) whose checkpointed function replays ``plan`` when re-run in
    backward, after the replay context has exited."""

    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            if plan.live:
                return function(*a, **k)
            handles = [r.register_forward_hook(partial(plan.hook, i)) for i, r in layer_routers]
            try:
                return function(*a, **k)
            finally:
                for handle in handles:
                    handle.remove()

        return original(run, *args, **kwargs)

    return checkpoint


@contextmanager
def replay_routing(model: torch.nn.Module, routing: torch.Tensor) -> Iterator[_ReplayPlan]:
    """Route every forward of ``model`` inside the context by ``routing`` (and its checkpoint recompute too).

    Args:
        model: The MoE model (the policy or a separate reference model; wrappers are fine).
        routing: ``(B, T, L, k)`` recorded routing in the stored form (``expert + 1``, 0 = let the router choose),
            aligned with the ``(B, T)`` ``input_ids`` of each forward run inside the context.
    """
    routers = require_routers(model)
    if routing.dim() != 4 or routing.shape[2] != len(routers):
        raise ValueError(
            f"keep_routing: the routing has shape {tuple(routing.shape)}, expected (batch, tokens, {len(routers)} "
            "routers, top_k) for this model."
        )
    plan = _ReplayPlan(decode_routing(routing.flatten(0, 1)), routers)
    handles = [r.register_forward_hook(partial(plan.hook, i)) for i, r in enumerate(routers)]
    wrapped = []
    for layer, inner in _checkpointing_layers(model, routers):
        original = layer._gradient_checkpointing_func
        layer._gradient_checkpointing_func = _replaying_checkpoint(original, plan, inner)
        wrapped.append((layer, original))
    try:
        yield plan
    finally:
        plan.live = False
        for handle in handles:
            handle.remove()
        for layer, original in wrapped:
            layer._gradient_checkpointing_func = original


def routing_for_rows(batch: dict[str, Any]) -> torch.Tensor | None:
    """The ``(B, P + C, L, k)`` routing of a rollout micro-batch's ``[prompt | completion]`` rows (its
    ``prompt_routing`` and ``completion_routing``), or None when the batch carries none."""
    prompt, completion = batch.get("prompt_routing"), batch.get("completion_routing")
    if prompt is None or completion is None:
        return None
    return torch.cat([prompt, completion.to(prompt.device)], dim=1)


class SampledRouting:
    """The routing of one group-sampler batch, assembled per output row as ``[prompt | completion]`` tokens.

    The sampler calls :meth:`prefill` after its prefill forward over the ``(U, P)`` left-padded unique prompts
    (after :meth:`prefill_prefix` and over the prompts' rests when their shared prefix was prefilled once),
    :meth:`step` after each decode forward (which fed completion token ``step`` of the live rows), and
    :meth:`rows` at the end. A row's completion token that was never fed (its last) has no record (0).
    """

    def __init__(self, recorder: RoutingRecorder, prompt_lengths: list[int], source: list[int], max_new_tokens: int):
        self.recorder = recorder
        self.prompt_lengths = prompt_lengths  # (R0,) real prompt tokens of each batch row
        self.source = source  # (R0,) unique prefill row of each batch row
        self.max_new_tokens = max_new_tokens
        self.prefix: torch.Tensor | None = None  # (S, L, k) the shared prefix's routing, when prefilled once
        self.prompts: torch.Tensor | None = None  # (U, P, L, k)
        self.steps: torch.Tensor | None = None  # (max_new_tokens, R0, L, k)

    def prefill_prefix(self) -> None:
        """Record the forward of the prompts' shared prefix (batch 1, ``S`` tokens); :meth:`prefill` follows."""
        self.prefix = self.recorder.take()  # (S, L, k)

    def prefill(self, unique_rows: int, width: int, rest_lengths: list[int] | None = None) -> None:
        """Record the prefill forward over ``(U, width)`` left-padded rows. After :meth:`prefill_prefix`, those rows
        are each prompt's rest (``rest_lengths`` real tokens) and the prompts are laid out as the full left-padded
        prefill would have them: ``[padding | prefix | rest]``, ``(U, S + width)``."""
        taken = self.recorder.take()  # (U·width, L, k)
        taken = taken.view(unique_rows, width, *taken.shape[1:])
        if self.prefix is not None:
            if rest_lengths is None:
                raise ValueError("SampledRouting.prefill: rest_lengths is required after prefill_prefix.")
            s = self.prefix.shape[0]
            prompts = taken.new_zeros((unique_rows, s + width, *taken.shape[2:]))
            for u, r in enumerate(rest_lengths):
                prompts[u, width - r : s + width - r] = self.prefix
                prompts[u, s + width - r :] = taken[u, width - r :]
            taken = prompts
        self.prompts = taken

    def step(self, step: int, batch_rows: list[int]) -> None:
        """Record the decode forward of completion token ``step`` for the batch rows ``batch_rows`` (live ones)."""
        taken = self.recorder.take()  # (R, L, k)
        if self.steps is None:
            shape = (self.max_new_tokens, len(self.source), *taken.shape[1:])
            self.steps = torch.zeros(shape, dtype=taken.dtype, device=taken.device)
        self.steps[step, torch.as_tensor(batch_rows, device=taken.device)] = taken

    def rows(self, completion_lengths: list[int]) -> list[torch.Tensor]:
        """Per batch row, ``(prompt + completion tokens, L, k)`` on the CPU (one transfer per tensor)."""
        if self.prompts is None:
            raise RuntimeError("keep_routing: the sampler's prefill routing was not recorded.")
        prompts = self.prompts.cpu()
        steps = None if self.steps is None else self.steps.cpu()
        width = prompts.shape[1]
        out = []
        for i, (n, c) in enumerate(zip(self.prompt_lengths, completion_lengths)):
            prompt = prompts[self.source[i], width - n :]
            completion = torch.zeros((c, *prompts.shape[2:]), dtype=prompts.dtype)
            if steps is not None and c:
                completion[: min(c, steps.shape[0])] = steps[:c, i]
            out.append(torch.cat([prompt, completion]))
        return out


def collate_routing(
    rows: list[torch.Tensor], prompt_lengths: list[int], prompt_width: int, completion_width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(prompt_routing (B, P, L, k), completion_routing (B, C, L, k))`` from per-row ``[prompt | completion]``
    routing, laid out as the rollout batch's left-padded prompts and right-padded completions (padding: 0)."""
    shape = rows[0].shape[1:]
    dtype = rows[0].dtype
    prompt = torch.zeros((len(rows), prompt_width, *shape), dtype=dtype)
    completion = torch.zeros((len(rows), completion_width, *shape), dtype=dtype)
    for i, (row, n) in enumerate(zip(rows, prompt_lengths)):
        if n:
            prompt[i, prompt_width - n :] = row[:n]
        c = min(row.shape[0] - n, completion_width)
        completion[i, :c] = row[n : n + c]
    return prompt, completion


def routing_for_packs(
    routing: torch.Tensor, prompt_mask: torch.Tensor, token_row: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """The plain rows' routing ``(B, P + C, L, k)`` laid out on the shared-prompt packs ``(K, T)``.

    A pack token of plain row ``r`` at position ``p`` (counted from the row's first real token) sits in column
    ``pad_r + p`` of the plain row, ``pad_r`` its prompt's left padding (``prompt_mask`` ``(B, P)``); ``token_row``
    ``(K, T)`` names the row (``-1``: padding, which gets 0, "let the router choose"). A prompt token shared by
    several rows takes one of their records (the sampler prefilled each of them the same way).
    """
    pad = prompt_mask.shape[1] - prompt_mask.sum(dim=1)  # (B,)
    row = token_row.clamp(min=0)  # (K, T)
    column = (pad[row] + position_ids).clamp(max=routing.shape[1] - 1)  # (K, T)
    out = routing[row, column]  # (K, T, L, k)
    out[token_row < 0] = 0
    return out


# the stored routing dtypes that travel over the wire, by name (little-endian on the wire)
_WIRE_DTYPES = {"uint8": (torch.uint8, "|u1"), "int16": (torch.int16, "<i2"), "int32": (torch.int32, "<i4")}


def routing_to_wire(routing: torch.Tensor) -> dict[str, Any]:
    """A stored routing tensor (``(T, L, k)``, :func:`posttrain.core.routing.encode_routing`'s dtype) as JSON:
    ``{"dtype": "uint8" | "int16" | "int32", "shape": [T, L, k], "data": base64 of its little-endian bytes}``."""
    import numpy as np

    names = {dtype: (name, code) for name, (dtype, code) in _WIRE_DTYPES.items()}
    if routing.dtype not in names:
        raise TypeError(f"keep_routing: cannot send routing of dtype {routing.dtype}; expected uint8, int16 or int32.")
    name, code = names[routing.dtype]
    raw = np.ascontiguousarray(routing.detach().cpu().numpy()).astype(code, copy=False).tobytes()
    return {"dtype": name, "shape": [int(d) for d in routing.shape], "data": base64.b64encode(raw).decode("ascii")}


def routing_from_wire(wire: dict[str, Any]) -> torch.Tensor:
    """Inverse of :func:`routing_to_wire` (a CPU tensor); ``ValueError`` naming what is malformed."""
    import numpy as np

    try:
        dtype, code = _WIRE_DTYPES[wire["dtype"]]
        shape = tuple(int(d) for d in wire["shape"])
        raw = base64.b64decode(wire["data"], validate=True)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(
            f"keep_routing: the server's routing is malformed ({err!r}); expected {{'dtype': 'uint8' | 'int16' | "
            "'int32', 'shape': [tokens, layers, top_k], 'data': base64}."
        ) from err
    count = int(np.prod(shape)) if shape else 1
    array = np.frombuffer(raw, dtype=code)
    if len(shape) != 3 or array.size != count:
        raise ValueError(
            f"keep_routing: the server's routing has {array.size} {wire['dtype']} values for shape {list(shape)}; "
            "expected [tokens, layers, top_k] and one value per entry."
        )
    return torch.from_numpy(array.astype(array.dtype.newbyteorder("="), copy=True)).to(dtype).view(shape)
