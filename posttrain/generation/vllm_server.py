"""The ``vllm_server`` generation backend: GRPO/RLOO with ``use_vllm=True, vllm_mode="server"``.

The trainer is an HTTP client of a generation server at ``vllm_server_base_url`` (or
``http://{vllm_server_host}:{vllm_server_port}``), waiting up to ``vllm_server_timeout`` seconds for it at start-up.
After that every request (a generation, each weight-push request) is bounded by the config's ``request_timeout``
(default 600 s, retries of 429/503 and reset connections included) and watched by a ``/health`` probe every
``vllm_server_health_check_interval`` seconds (default 10) while in flight, so a server that stops mid-run ends the
step with a ``ServerTimeoutError`` naming the server, the request and the wait (``GenerationClient``).
Three kinds of server are recognised from their ``/health`` answer (or forced with ``protocol=``):

- ``"posttrain"`` — ``posttrain serve`` / ``posttrain vllm-serve`` (either engine). Generation: ``/v1/completions``
  with token-id prompts, ``n = num_generations``, processed sampling log-probs; prompts with images (GRPO/RLOO on a
  vision-language model) as vLLM's multimodal token prompts (``multi_modal_data``, PNG data URLs). Weights: safetensors over HTTP
  (``/v1/load_weights``, CPU-portable, bitwise); the version the server reports is kept in ``self.version``.
  ``keep_routing`` (``SamplingConfig.return_routing``): each request asks ``return_routing`` and the server's group
  sampler returns a MoE model's routing, rebuilt here into ``Completions.routing`` exactly as in-process
  (``check_routing_support`` refuses the other protocols and ``posttrain serve --backend vllm``).
- ``"vllm"`` — a real ``vllm serve`` started as the TRL docs say (``VLLM_SERVER_DEV_MODE=1 vllm serve <model>
  --weight-transfer-config '{"backend":"nccl"}' --logprobs-mode processed_logprobs --max-logprobs -1``).
  Generation: ``/v1/completions`` (``return_token_ids``); weights: vLLM's NCCL weight-transfer engine
  (``/init_weight_transfer_engine``, then per push ``/pause``, ``/start_weight_update``, ``/update_weights`` while
  the trainer broadcasts, ``/finish_weight_update``, ``/resume``). Needs vLLM >= 0.22 and a CUDA device in the
  trainer. **Not verified on hardware in this release.**
- ``"trl"`` — TRL's ``trl vllm-serve``. Generation: ``/generate/``; weights: TRL's communicator
  (``/init_communicator/``, then ``/update_named_param/`` + a PyNccl broadcast per parameter,
  ``/reset_prefix_cache/``). Needs vLLM and CUDA in the trainer. **Not verified on hardware in this release.**

Weights are pushed by ``sync_weights``, which the trainer calls before generating whenever ``global_step`` changed
(so after every optimizer step that changed the policy, once, before its weights are needed; TRL's schedule). PEFT
policies are pushed merged (``merge_adapter`` → push → ``unmerge_adapter``), or, with ``vllm_sync_adapter_only=True``
against a posttrain server, as their LoRA adapter alone (``posttrain.generation.weights.adapter_weights``; the
server applies it to its base with PEFT); ``last_sync_bytes`` holds the size of the last push. In multi-process training every rank
takes part in gathering (FSDP2 ``full_tensor``), rank 0 sends, and all ranks wait for it before generating.

Post-sync probe (``vllm_weight_sync_probe``, off by default): after each push the server samples a few tokens from
a fixed prompt and the trainer computes their log-probs; a difference above ``vllm_weight_sync_probe_atol`` raises
``WeightSyncError`` — a server that silently kept its old weights is caught at the push, whatever the transport.

Sampling seeds: unless ``generation_kwargs`` gives a ``seed``, each request carries ``request_seed(seed, rank,
k)`` for the k-th request of this process, so a server-mode run is reproducible (the posttrain engine samples a
seeded request exactly as ``GroupSampler`` with ``torch.Generator().manual_seed(that seed)`` in-process). TRL sends
no seed (vLLM's own RNG decides). The request counter ``k`` is the backend's resume state (``state_dict``): the
trainer saves it in ``posttrain_state_{process}.pt``, so a resumed run sends the same seeds as the uninterrupted one.
A caller that numbers its requests itself (the async rollout worker: one request per round, seeded by the round)
sets the counter with :meth:`VLLMServerBackend.set_request_index` before each request.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from posttrain.generation.base import Completions, SamplingConfig, truncate_at_eos

logger = logging.getLogger(__name__)

PROTOCOLS = ("posttrain", "vllm", "trl")


def request_seed(seed: int, rank: int, k: int) -> int:
    """The seed of the ``k``-th generation request of process ``rank`` in a run seeded with ``seed`` (< 2**31)."""
    return (int(seed) * 1_000_003 + int(rank) * 7_919 + int(k) * 104_729 + 12_345) % (2**31 - 1)


def check_probe(
    server: list[float] | None, trainer: list[float], atol: float, *, prompt: list[int], tokens: list[int], where: str,
    version: Any,
) -> dict[str, Any]:
    """Compare the post-sync probe's log-probs (server's vs trainer's, same tokens); ``WeightSyncError`` naming both
    lists when they differ by more than ``atol`` (or the server gave none). Returns the comparison."""
    from posttrain.generation.client import WeightSyncError

    if server is None or len(server) != len(tokens):
        raise WeightSyncError(
            f"Weight-sync probe: the server at {where} returned no log-probs for the {len(tokens)} probe tokens; "
            "serve with log-probs enabled (vLLM: --logprobs-mode processed_logprobs) or turn vllm_weight_sync_probe "
            "off."
        )
    worst = max((abs(a - b) for a, b in zip(server, trainer)), default=0.0)
    if not worst <= atol:  # NaN fails too
        raise WeightSyncError(
            f"Weight-sync probe failed after pushing weights (version {version}) to {where}: the log-probs of probe "
            f"tokens {tokens} after prompt {prompt} are {[round(x, 5) for x in server]} on the server but "
            f"{[round(x, 5) for x in trainer]} in the trainer (largest difference {worst:.4g} > "
            f"vllm_weight_sync_probe_atol={atol:g}). The server is not generating with the pushed weights: it never "
            "got them (a sleeping or restarted engine, a broken weight-transfer group) or serves another model or "
            "dtype. Check the server's log; raise vllm_weight_sync_probe_atol only if the gap is a precision "
            "difference (bf16 server)."
        )
    report = {"tokens": tokens, "server": server, "trainer": trainer, "max_abs_diff": worst}
    logger.debug("Weight-sync probe passed: %s", report)
    return report


def _dist() -> tuple[int, bool]:
    """(rank, distributed?) of this process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), True
    return 0, False


class VLLMServerBackend:
    """Generate through a generation server and keep its weights in sync (see the module docstring).

    Args:
        model: The policy (unused until ``sync_weights``; kept for the registry's constructor).
        tokenizer: The policy's tokenizer.
        args: A GRPO/RLOO config (``vllm_server_*``, ``vllm_group_port``, ``vllm_structured_outputs_regex``,
            ``seed``). Keywords below override it.
        base_url: Server URL.
        protocol: ``"posttrain"``, ``"vllm"`` or ``"trl"``; ``None`` = detect.
        timeout: Seconds to wait for the server to come up.
        chunk_bytes: Most bytes per weight-push request (posttrain protocol).
        client_kwargs: Extra ``GenerationClient`` arguments (retries, timeouts); by default ``request_timeout`` and
            ``health_check_interval`` come from ``args.request_timeout`` / ``args.vllm_server_health_check_interval``.
        seed_requests: Send each request a seed (reproducible runs). Unseeded requests can share an engine call with
            other clients' requests on ``posttrain serve``; seeded ones cannot.
        weight_sync_probe: After each push, check that the server serves the pushed weights (``probe``); default:
            the config's ``vllm_weight_sync_probe`` (off).
        weight_sync_probe_atol: The probe's tolerance; default: ``vllm_weight_sync_probe_atol`` (0.02).
        adapter_only: Push only a PEFT policy's LoRA adapter (``use_adapter_sync``); default: the config's
            ``vllm_sync_adapter_only`` (off).
    """

    def __init__(
        self,
        model: Any = None,
        tokenizer: Any = None,
        args: Any = None,
        *,
        base_url: str | None = None,
        protocol: str | None = None,
        timeout: float | None = None,
        seed: int | None = None,
        chunk_bytes: int | None = None,
        client_kwargs: dict[str, Any] | None = None,
        seed_requests: bool = True,
        weight_sync_probe: bool | None = None,
        weight_sync_probe_atol: float | None = None,
        adapter_only: bool | None = None,
    ):
        try:
            from posttrain.generation.client import GenerationClient
        except ImportError as err:
            raise ImportError(
                "vllm_mode='server' needs httpx: pip install posttrain[serve]."
            ) from err
        from posttrain.generation.weights import DEFAULT_CHUNK_BYTES

        if base_url is None:
            base_url = getattr(args, "vllm_server_base_url", None)
        if base_url is None:
            host = getattr(args, "vllm_server_host", "0.0.0.0")
            base_url = f"http://{host}:{getattr(args, 'vllm_server_port', 8000)}"
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.seed = int(seed if seed is not None else getattr(args, "seed", 0))
        self.seed_requests = seed_requests
        self.group_port = int(getattr(args, "vllm_group_port", 51216))
        self.regex = getattr(args, "vllm_structured_outputs_regex", None)
        self.chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
        if adapter_only is None:
            adapter_only = getattr(args, "vllm_sync_adapter_only", False)
        self.adapter_only = bool(adapter_only)
        self._adapter_fallback_warned = False
        self.last_sync_bytes = 0  # bytes of the last weight push (``perf/weight_sync_bytes``)
        if weight_sync_probe is None:
            weight_sync_probe = getattr(args, "vllm_weight_sync_probe", False)
        if weight_sync_probe_atol is None:
            weight_sync_probe_atol = getattr(args, "vllm_weight_sync_probe_atol", 0.02)
        self.weight_sync_probe, self.weight_sync_probe_atol = bool(weight_sync_probe), float(weight_sync_probe_atol)
        if not self.weight_sync_probe_atol >= 0:
            raise ValueError(f"vllm_weight_sync_probe_atol must be >= 0, got {weight_sync_probe_atol}.")
        bounds: dict[str, Any] = {}
        if args is not None and hasattr(args, "request_timeout"):
            bounds["request_timeout"] = args.request_timeout
        if args is not None and hasattr(args, "vllm_server_health_check_interval"):
            bounds["health_check_interval"] = args.vllm_server_health_check_interval
        self.client = GenerationClient(self.base_url, **{**bounds, **(client_kwargs or {})})
        wait = float(timeout if timeout is not None else getattr(args, "vllm_server_timeout", 240.0))
        info = self.client.wait_until_ready(timeout=wait)
        self.protocol = protocol or self._detect(info)
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}.")
        self.version: int | None = info.get("version") if self.protocol == "posttrain" else 0
        self.model_name = info.get("model")
        self.engine = info.get("backend") if self.protocol == "posttrain" else self.protocol  # posttrain serve's engine
        if self.protocol == "vllm":
            self.model_name = self.client.request("GET", "/v1/models").json()["data"][0]["id"]
        self._requests = 0
        # the rank in request_seed(seed, rank, k): this process's (None), or the training rank a multi-process async
        # rollout worker generates a share for (posttrain.rollout.multiprocess)
        self.seed_rank: int | None = None
        self._nccl: Any = None  # the weight-transfer group (vllm / trl protocols)
        logger.info("Generation server at %s (%s protocol, weight version %s).", self.base_url, self.protocol,
                    self.version)  # fmt: skip

    # -- resume state -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """What a resumed run needs to send the same request seeds: the number of requests sent so far."""
        return {"requests": int(self._requests)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._requests = int(state["requests"])

    @property
    def request_index(self) -> int:
        """``k`` of the next request: it is seeded with ``request_seed(seed, rank, k)`` (requests sent so far)."""
        return self._requests

    def set_request_index(self, k: int) -> None:
        """Make the next request the ``k``-th, so it carries ``request_seed(seed, rank, k)`` (the counter then
        continues from ``k + 1``). The async rollout worker sets ``k`` to the round index, so a round has the same
        seed, hence the same tokens from the same weights, whenever it is generated (resume, regenerated rounds)."""
        if int(k) < 0:
            raise ValueError(f"set_request_index: k must be >= 0, got {k}.")
        self._requests = int(k)

    def _detect(self, info: dict[str, Any]) -> str:
        if info.get("server") == "posttrain":
            return "posttrain"
        try:
            self.client.request("GET", "/v1/models")
            return "vllm"
        except Exception:
            return "trl"

    # -- generation ---------------------------------------------------------------------------------------------
    # The rollout pipeline hands this backend each prompt's raw images (not the trainer's processed vision inputs):
    # the server rebuilds those with its own processor, as vLLM does.
    accepts_images = True

    def generate(
        self,
        prompt_ids: list[list[int]],
        sampling: SamplingConfig,
        num_generations: int = 1,
        images: list[list[Any] | None] | None = None,
        vision_inputs: list[dict[str, Any]] | None = None,
    ) -> Completions:
        """``num_generations`` completions per prompt from the server, rows ``[p0 g0, p0 g1, ..., p1 g0, ...]``.

        ``images`` (per prompt, its images or None) are sent in vLLM's multimodal token-prompt format
        (``multi_modal_data``; ``posttrain serve`` and ``vllm serve``); ``prompt_ids`` then hold the processor's
        expanded image tokens. ``vision_inputs`` (the trainer's processed tensors) are not sent: the server
        rebuilds them from the images."""
        if images is not None and any(images) and self.protocol == "trl":
            raise ValueError(
                "Prompts with images cannot be sent to a `trl vllm-serve` server by posttrain: serve the model with "
                "`posttrain serve` (or `vllm serve`), which take vLLM's multimodal token prompts."
            )
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
        rows = [list(p) for p in prompt_ids for _ in range(num_generations)]
        if not prompt_ids:
            return Completions([], [], [], [])
        s = sampling.resolved()
        extra = dict(s.generation_kwargs or {})
        seed = extra.pop("seed", None)
        if seed is None and self.seed_requests:
            seed = request_seed(self.seed, _dist()[0] if self.seed_rank is None else self.seed_rank, self._requests)
        self._requests += 1
        fields = dict(
            n=num_generations,
            max_tokens=s.max_new_tokens,
            temperature=s.temperature if s.do_sample else 0.0,
            top_p=s.top_p if s.do_sample else 1.0,
            top_k=(s.top_k or 0) if s.do_sample else 0,
            min_p=(s.min_p or 0.0) if s.do_sample else 0.0,
            repetition_penalty=s.repetition_penalty,
        )
        if s.return_sampling_mask and self.protocol == "posttrain":
            extra["return_sampling_mask"] = True  # keep_sampling_mask: posttrain servers describe the kept support
        if s.return_routing:
            self.check_routing_support()
            extra["return_routing"] = True  # keep_routing: the server's group sampler records the MoE routing
        if self.protocol == "trl":
            ids, lps, kept = self._generate_trl(prompt_ids, fields, seed, extra)
            supports = [None] * len(ids)
            wires: list = [None] * len(ids)
        else:
            ids, lps, kept, supports, wires = self._generate_openai(
                prompt_ids, fields, seed, extra, s.eos_token_ids, images
            )
        eos = set(s.eos_token_ids)
        out_ids, out_lps, out_kept, out_support, finished = [], [], [], [], []
        routing: list[Any] | None = [] if s.return_routing else None
        for row, row_ids, row_lps, row_kept, row_support, wire in zip(rows, ids, lps, kept, supports, wires):
            cut, done = truncate_at_eos(row_ids, eos)
            out_ids.append(cut)
            finished.append(done)
            out_lps.append(None if row_lps is None else list(row_lps[: len(cut)]))
            out_kept.append(None if row_kept is None else list(row_kept[: len(cut)]))
            out_support.append(None if row_support is None else list(row_support[: len(cut)]))
            if routing is not None:
                routing.append(self._row_routing(wire, len(row), len(row_ids), len(cut)))
        logprobs = None if any(lp is None for lp in out_lps) else out_lps
        # a posttrain server's kept mass under truncated sampling (vLLM reports none: the ratio stays uncorrected)
        log_kept_mass = None if logprobs is None or any(k is None for k in out_kept) else out_kept
        # its kept support, when asked (a row without one, e.g. vLLM's, is the full softmax for the trainer)
        sampling_mask = out_support if log_kept_mass is not None and any(r is not None for r in out_support) else None
        return Completions(
            out_ids, logprobs, finished, rows, log_kept_mass=log_kept_mass, sampling_mask=sampling_mask, routing=routing
        )

    def check_routing_support(self) -> None:
        """``keep_routing`` needs a ``posttrain serve`` server running the posttrain engine (its group sampler
        records the MoE routing): ``ValueError`` naming the fix for a vLLM or ``trl vllm-serve`` server, or
        ``posttrain serve --backend vllm``."""
        if self.protocol != "posttrain" or self.engine == "vllm":
            what = f"a {self.protocol} server" if self.protocol != "posttrain" else "`posttrain serve --backend vllm`"
            raise ValueError(
                f"keep_routing=True: the generation server at {self.base_url} is {what}, whose MoE routing posttrain "
                "does not read (vLLM's `--enable-return-routed-experts` output is not supported yet). Serve the "
                "model with `posttrain serve --backend posttrain` (its group sampler records the routing), generate "
                "in-process (use_vllm=False), or set keep_routing=False."
            )

    @staticmethod
    def _row_routing(wire: Any, prompt_len: int, sent: int, kept: int) -> Any:
        """One row's ``(prompt + kept completion tokens, L, k)`` routing from the server's ``(prompt wire,
        completion wire)``: the completion part cut where ``truncate_at_eos`` cut the ids (``kept`` of ``sent``)."""
        import torch

        from posttrain.models.moe_routing import routing_from_wire

        if wire is None or wire[0] is None or wire[1] is None:
            raise RuntimeError(
                "keep_routing=True: the posttrain server returned no routing for a completion; it predates "
                "return_routing: upgrade the server to this posttrain version."
            )
        prompt, completion = routing_from_wire(wire[0]), routing_from_wire(wire[1])
        if prompt.shape[0] != prompt_len or completion.shape[0] != sent or prompt.shape[1:] != completion.shape[1:]:
            raise RuntimeError(
                f"keep_routing: the server's routing covers {prompt.shape[0]} prompt + {completion.shape[0]} completion "
                f"tokens {tuple(completion.shape[1:])}, but the row has {prompt_len} prompt + {sent} completion tokens."
            )
        return torch.cat([prompt, completion[:kept]])

    def _generate_openai(self, prompt_ids, fields, seed, extra, eos_ids, images=None) -> tuple[list, ...]:
        if self.protocol == "vllm" and fields["top_k"] == 0:
            fields["top_k"] = -1  # "all tokens" in every vLLM version
        if self.regex is not None:
            extra.setdefault("structured_outputs", {"regex": self.regex})
        result = self.client.completions(
            prompt_ids, **fields, stop_token_ids=list(eos_ids), logprobs=True, seed=seed,
            model=self.model_name if self.protocol == "vllm" else None, extra=extra, images=images,
        )  # fmt: skip
        if self.protocol == "posttrain":
            self.version = result.version
        choices = [c for group in result.choices for c in group]
        return (
            [c.token_ids for c in choices],
            [c.logprobs for c in choices],
            [c.log_kept_mass for c in choices],
            [c.sampling_mask for c in choices],
            [(c.prompt_routing, c.routing) for c in choices],
        )

    def _generate_trl(self, prompt_ids, fields, seed, extra) -> tuple[list, list, list]:
        payload = {
            "prompts": [list(p) for p in prompt_ids],
            **fields,
            "logprobs": 0,
            "structured_outputs_regex": self.regex,
            "generation_kwargs": {**({"seed": seed} if seed is not None else {}), **extra},
        }
        data = self.client.request("POST", "/generate/", json=payload).json()
        lps = data.get("logprobs")
        flat_lps = [None] * len(data["completion_ids"]) if lps is None else [[t[0] for t in row] for row in lps]
        kept = data.get("log_kept_mass") or [None] * len(data["completion_ids"])  # posttrain servers only
        return data["completion_ids"], flat_lps, kept

    # -- weights ------------------------------------------------------------------------------------------------
    def use_adapter_sync(self, model: Any) -> bool:
        """Whether this push sends only the LoRA adapter: ``adapter_only`` is on, the policy is a PEFT LoRA model
        (``ValueError`` naming the fix when it is not), and the server is a posttrain one. vLLM and ``trl
        vllm-serve`` load LoRA adapters from files on the server's disk (``/v1/load_lora_adapter``), which a
        trainer on another machine cannot write, so against them adapter-only sync falls back to the merged push
        with a one-time warning."""
        from posttrain.generation.weights import adapter_config_dict

        if not self.adapter_only:
            return False
        adapter_config_dict(model)  # raises when the policy cannot be pushed adapter-only
        if self.protocol != "posttrain":
            if not self._adapter_fallback_warned:
                logger.warning(
                    "vllm_sync_adapter_only=True: the %s server at %s does not take adapter-only pushes over the "
                    "network; pushing the merged weights instead (serve with `posttrain serve` for adapter-only "
                    "sync).", self.protocol, self.base_url,
                )  # fmt: skip
                self._adapter_fallback_warned = True
            return False
        return True

    def sync_weights(self, model: Any, version: int | None = None) -> None:
        """Push the policy's current weights to the server (rank 0 sends; every rank waits for it).

        ``version`` sets the weight version the server reports from now on (posttrain protocol; default: its
        previous version + 1), e.g. the trainer's ``global_step`` for staleness bookkeeping.
        """
        from posttrain.generation.weights import policy_weights, push_payload

        rank, distributed = _dist()
        if self.protocol == "posttrain":
            with push_payload(model, self.chunk_bytes, adapter_only=self.use_adapter_sync(model)) as chunks:
                counted = self._counted(chunks)
                if rank == 0:
                    self.version = self.client.load_weights(counted, version=version)
                else:
                    for _ in counted:  # take part in any gathering collectives
                        pass
        else:
            self.use_adapter_sync(model)  # checks the policy and warns about the fallback
            with policy_weights(model) as items:
                tensors = list(items)
                self.last_sync_bytes = sum(t.numel() * t.element_size() for _, t in tensors)
                if rank == 0:
                    (self._push_vllm if self.protocol == "vllm" else self._push_trl)(tensors)
                    self.version = version if version is not None else (self.version or 0) + 1
        if self.weight_sync_probe:
            self.probe(model)
        if distributed:
            import torch.distributed as dist

            dist.barrier()

    def _counted(self, chunks: Any) -> Any:
        """Yield ``chunks`` while adding their sizes up into ``last_sync_bytes``."""
        self.last_sync_bytes = 0
        for chunk in chunks:
            self.last_sync_bytes += len(chunk)
            yield chunk

    def probe(self, model: Any) -> dict[str, Any]:
        """Check that the server serves ``model``'s weights: sample ``PROBE_TOKENS`` tokens from a fixed prompt on the
        server (seeded, temperature 1, no filtering, EOS ignored where the protocol allows) and compare the log-probs
        it reports with the trainer's for the same tokens (``probe_logprobs``).

        Raises ``WeightSyncError`` naming both lists and the largest difference when it exceeds
        ``weight_sync_probe_atol``: the symptom of a server that never got (or dropped) the pushed weights, e.g. a
        sleeping vLLM engine or a broken NCCL group. Transport-independent: it checks what the server generates with,
        whichever path pushed the weights. Every rank runs the forward (FSDP); rank 0 talks to the server. Returns
        ``{"tokens", "server", "trainer", "max_abs_diff"}``.
        """
        import torch

        from posttrain.generation.weights import PROBE_SEED, PROBE_TOKENS, probe_logprobs, probe_prompt

        rank, distributed = _dist()
        inner = model
        while hasattr(inner, "module") and isinstance(inner.module, torch.nn.Module):
            inner = inner.module
        prompt = probe_prompt(int(inner.config.vocab_size))
        found: list[Any] = [None, None]
        if rank == 0:
            fields = dict(n=1, max_tokens=PROBE_TOKENS, temperature=1.0, top_p=1.0, min_p=0.0, repetition_penalty=1.0)
            if self.protocol == "trl":
                payload = {"prompts": [prompt], **fields, "top_k": 0, "logprobs": 0,
                           "generation_kwargs": {"seed": PROBE_SEED}}  # fmt: skip
                data = self.client.request("POST", "/generate/", json=payload).json()
                lps = data.get("logprobs")
                found = [list(data["completion_ids"][0]), None if lps is None else [row[0] for row in lps[0]]]
            else:
                result = self.client.completions(
                    [prompt], **fields, top_k=-1 if self.protocol == "vllm" else 0, logprobs=True, seed=PROBE_SEED,
                    model=self.model_name if self.protocol == "vllm" else None, extra={"ignore_eos": True},
                )  # fmt: skip
                found = [result.choices[0][0].token_ids, result.choices[0][0].logprobs]
        if distributed:
            import torch.distributed as dist

            dist.broadcast_object_list(found, src=0)
        tokens, server = found
        trainer = probe_logprobs(model, prompt, tokens)
        return check_probe(server, trainer, self.weight_sync_probe_atol, prompt=prompt, tokens=tokens,
                           where=f"{self.base_url} ({self.protocol} protocol)", version=self.version)  # fmt: skip

    def _push_vllm(self, tensors: list[tuple[str, Any]]) -> None:
        """vLLM's NCCL weight-transfer engine (``vllm serve --weight-transfer-config '{"backend":"nccl"}'``)."""
        import torch
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

        device = torch.device("cuda", torch.cuda.current_device())
        if self._nccl is None:
            from vllm.utils.network_utils import get_ip, get_open_port

            world_size = int(self.client.request("GET", "/get_world_size").json()["world_size"]) + 1
            init_info = {"master_address": get_ip(), "master_port": get_open_port(), "rank_offset": 1,
                         "world_size": world_size}  # fmt: skip
            server_side = self._in_thread("POST", "/init_weight_transfer_engine", json={"init_info": init_info})
            self._nccl = NCCLWeightTransferEngine.trainer_init(
                {k: init_info[k] for k in ("master_address", "master_port", "world_size")}
            )
            self._join(server_side)
        update_info = {
            "names": [n for n, _ in tensors],
            "dtype_names": [str(t.dtype).split(".")[-1] for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
            "packed": True,
        }
        self.client.request("POST", "/pause", params={"mode": "keep"})
        try:
            self.client.request("POST", "/start_weight_update", json={"is_checkpoint_format": True})
            receiving = self._in_thread("POST", "/update_weights", json={"update_info": update_info})
            NCCLWeightTransferEngine.trainer_send_weights(
                iterator=((n, t.to(device)) for n, t in tensors),
                trainer_args=NCCLTrainerSendWeightsArgs(group=self._nccl, packed=True),
            )
            self._join(receiving)
            self.client.request("POST", "/finish_weight_update")
        finally:
            self.client.request("POST", "/resume")

    def _push_trl(self, tensors: list[tuple[str, Any]]) -> None:
        """TRL's ``trl vllm-serve`` communicator: metadata over HTTP, each tensor by a PyNccl broadcast."""
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
        if self._nccl is None:
            from urllib.parse import urlparse

            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
            from vllm.distributed.utils import StatelessProcessGroup

            world_size = int(self.client.request("GET", "/get_world_size/").json()["world_size"]) + 1
            self.client.request("POST", "/init_communicator/", json={
                "host": "0.0.0.0", "port": self.group_port, "world_size": world_size,
                "client_device_uuid": str(torch.cuda.get_device_properties(device).uuid),
            })  # fmt: skip
            host = urlparse(self.base_url).hostname
            group = StatelessProcessGroup.create(host=host, port=self.group_port, rank=world_size - 1,
                                                 world_size=world_size)  # fmt: skip
            self._nccl = (PyNcclCommunicator(group, device=device), world_size - 1)
        communicator, rank = self._nccl
        for name, tensor in tensors:
            tensor = tensor.to(device)
            self.client.request("POST", "/update_named_param/", json={
                "name": name, "dtype": str(tensor.dtype), "shape": list(tensor.shape)})  # fmt: skip
            communicator.broadcast(tensor, src=rank)
            communicator.group.barrier()
        self.client.request("POST", "/reset_prefix_cache/")

    def _in_thread(self, method: str, path: str, **kwargs: Any) -> tuple[threading.Thread, list]:
        """Send a request that blocks server-side until the trainer's collective runs (on a thread)."""
        errors: list = []

        def send() -> None:
            try:
                self.client.request(method, path, **kwargs)
            except Exception as err:  # re-raised by _join
                errors.append(err)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        return thread, errors

    def _join(self, handle: tuple[threading.Thread, list]) -> None:
        """Wait for a request sent by ``_in_thread`` (bounded: its own request is bounded by ``request_timeout``, the
        join by that plus a margin, so a stuck collective ends in ``ServerTimeoutError``, not a hang)."""
        from posttrain.generation.client import ServerTimeoutError

        thread, errors = handle
        limit = self.client.request_timeout
        thread.join(None if limit is None else limit + 30.0)
        if thread.is_alive():
            raise ServerTimeoutError(
                f"The generation server at {self.base_url} did not finish its side of the weight transfer within "
                f"request_timeout={limit:g} s (+30 s). Check the server's log (NCCL errors, a stopped process) or "
                "raise request_timeout."
            )
        if errors:
            raise errors[0]

    def close(self) -> None:
        if self._nccl is not None and self.protocol == "trl":
            try:
                self.client.request("POST", "/close_communicator/")
            except Exception:  # the server may already be gone at exit
                logger.debug("close_communicator failed", exc_info=True)
        self.client.close()
