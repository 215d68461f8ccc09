"""``VLLMEngine``: vLLM's offline ``LLM`` engine behind ``posttrain serve --backend vllm`` (GPU only).

Requests map onto one ``LLM.generate`` call with ``SamplingParams(n, max_tokens, temperature, top_p, top_k,
min_p, repetition_penalty, stop_token_ids, ignore_eos, logprobs=0, seed, structured_outputs, **extra)`` and
token-id prompts; the engine is built with ``logprobs_mode="processed_logprobs"`` so the returned log-probs are the
sampling distribution's, like the posttrain engine's. Weights load in every worker through
``posttrain.serving.vllm_worker.WeightSyncWorkerExtension`` (safetensors bytes, or TRL's NCCL communicator).

**Not verified on hardware in this release**: written against vLLM's documented ``LLM`` / ``SamplingParams`` /
``collective_rpc`` API (vLLM >= 0.11); the CPU test suite cannot run it. The tests marked ``gpu`` exercise it.
"""

from __future__ import annotations

from typing import Any

from posttrain.serving.engine import GeneratedSequence, GenerationRequest, RequestError

_EXTENSION = "posttrain.serving.vllm_worker.WeightSyncWorkerExtension"


class VLLMEngine:
    """vLLM's ``LLM`` with posttrain's worker extension (see the module docstring)."""

    name = "vllm"

    def __init__(
        self,
        model: str,
        *,
        revision: str | None = None,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        dtype: str = "auto",
        max_model_len: int | None = None,
        enable_prefix_caching: bool | None = None,
        enforce_eager: bool = False,
        kv_cache_dtype: str = "auto",
        trust_remote_code: bool = False,
        model_impl: str = "vllm",
        seed: int = 0,
        served_model_name: str | None = None,
        distributed_executor_backend: str | None = None,
    ):
        try:
            from vllm import LLM
        except ImportError as err:
            raise ImportError("--backend vllm needs vLLM: pip install posttrain[vllm] (on a CUDA machine).") from err
        kwargs: dict[str, Any] = dict(
            model=model, revision=revision, tensor_parallel_size=tensor_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization, dtype=dtype, max_model_len=max_model_len,
            enforce_eager=enforce_eager, kv_cache_dtype=kv_cache_dtype, trust_remote_code=trust_remote_code,
            model_impl=model_impl, seed=seed, logprobs_mode="processed_logprobs", max_logprobs=-1,
            worker_extension_cls=_EXTENSION,
        )  # fmt: skip
        if enable_prefix_caching is not None:
            kwargs["enable_prefix_caching"] = enable_prefix_caching
        if distributed_executor_backend is not None:
            kwargs["distributed_executor_backend"] = distributed_executor_backend
        self.llm = LLM(**kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.model_name = served_model_name or model
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.world_size = int(tensor_parallel_size)
        self.vocab_size = len(self.tokenizer)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def check(self, request: GenerationRequest) -> None:
        from vllm import SamplingParams

        if request.return_routing:
            raise RequestError(
                "return_routing",
                "return_routing=true (keep_routing) is recorded by the posttrain engine's group sampler; this server "
                "runs the vLLM engine, which returns no MoE routing. Start it with `posttrain serve --backend "
                "posttrain`, or train with keep_routing=False.",
            )
        known = set(getattr(SamplingParams, "__struct_fields__", ()) or ())
        unknown = sorted(k for k in request.extra if known and k not in known)
        if unknown:
            raise RequestError(unknown[0], f"Unknown vLLM SamplingParams field(s) {unknown}.")
        for i, ids in enumerate(request.prompts):
            if len(ids) + request.max_tokens > self.max_model_len:
                raise RequestError(
                    "max_tokens",
                    f"prompt[{i}] has {len(ids)} tokens and max_tokens is {request.max_tokens}: together more than "
                    f"max_model_len {self.max_model_len}.",
                )

    def _sampling_params(self, request: GenerationRequest) -> Any:
        from vllm import SamplingParams

        kwargs: dict[str, Any] = dict(
            n=request.n, max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p,
            top_k=request.top_k if request.top_k > 0 else -1, min_p=request.min_p,
            repetition_penalty=request.repetition_penalty, stop_token_ids=list(request.stop_token_ids) or None,
            ignore_eos=request.ignore_eos, logprobs=request.top_logprobs if request.logprobs else None, seed=request.seed,
        )  # fmt: skip
        if request.structured_outputs_regex is not None:
            try:
                from vllm.sampling_params import StructuredOutputsParams

                kwargs["structured_outputs"] = StructuredOutputsParams(regex=request.structured_outputs_regex)
            except ImportError:  # vLLM < 0.11
                from vllm.sampling_params import GuidedDecodingParams

                kwargs["guided_decoding"] = GuidedDecodingParams(regex=request.structured_outputs_regex)
        kwargs.update(request.extra)
        return SamplingParams(**kwargs)

    def generate(self, request: GenerationRequest) -> list[list[GeneratedSequence]]:
        prompts: list[dict[str, Any]] = [{"prompt_token_ids": list(p)} for p in request.prompts]
        for prompt, images in zip(prompts, request.images or []):
            if images:  # vLLM's multimodal token prompt (its processor places the image features)
                prompt["multi_modal_data"] = {"image": list(images)}
        outputs = self.llm.generate(prompts, self._sampling_params(request), use_tqdm=False)
        results = []
        for out in outputs:
            group = []
            for c in out.outputs:
                ids = list(c.token_ids)
                lps = tops = None
                if request.logprobs and c.logprobs is not None:
                    lps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)]
                    if request.top_logprobs:  # vLLM's step dicts: the sampled token and the top-N, with ranks
                        tops = [
                            sorted(((int(t), float(lp.logprob)) for t, lp in step.items()
                                    if lp.rank is not None and lp.rank <= request.top_logprobs),
                                   key=lambda x: -x[1])
                            for step in c.logprobs
                        ]  # fmt: skip
                reason = "length" if c.finish_reason == "length" else "stop"
                stop = c.stop_reason if isinstance(c.stop_reason, int) else None
                group.append(GeneratedSequence(ids, lps, reason, stop, tops))
            results.append(group)
        return results

    def load_weights(self, tensors: dict[str, Any]) -> int:
        from safetensors.torch import save

        data = save({n: t.contiguous() for n, t in tensors.items()})
        self.llm.collective_rpc("posttrain_load_safetensors", args=(data,))
        self.llm.reset_prefix_cache()
        return len(tensors)

    # TRL's NCCL protocol (/init_communicator/ ...), run in every worker.
    def init_communicator(self, host: str, port: int, world_size: int, client_device_uuid: str | None = None) -> None:
        self.llm.collective_rpc("init_communicator", args=(host, port, world_size, client_device_uuid))

    def update_named_param(self, name: str, dtype: str, shape: list[int]) -> None:
        self.llm.collective_rpc("update_named_param", args=(name, dtype, list(shape)))

    def close_communicator(self) -> None:
        self.llm.collective_rpc("close_communicator")

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        self.llm = None
