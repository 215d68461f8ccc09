"""The ``vllm_colocate`` generation backend: vLLM's ``LLM`` engine inside the trainer process (GPU only).

As TRL's colocate mode: one engine per training process, built from the policy's checkpoint with
``distributed_executor_backend="external_launcher"`` (it joins the trainer's process group instead of spawning
workers), ``gpu_memory_utilization = vllm_gpu_memory_utilization``, ``max_model_len = vllm_max_model_length``,
``max_num_seqs = per_device_train_batch_size × steps_per_generation``, ``max_num_batched_tokens=4096``,
``seed = rank``, ``model_impl = vllm_model_impl``, ``logprobs_mode="processed_logprobs"``. Each process generates its
own prompts. With ``vllm_enable_sleep_mode`` the engine sleeps (level 2: weights and KV cache released) between
rollouts and wakes its weights before a sync and its KV cache before generating. ``sync_weights`` loads the
trainer's (PEFT-merged) parameters straight into the engine's model (``load_weights``) and resets the prefix cache.

``vllm_tensor_parallel_size > 1`` is refused here (TRL all-gathers prompts within each tensor-parallel group;
that is not implemented). **Not verified on hardware in this release**; the tests marked ``gpu`` exercise it.
"""

from __future__ import annotations

import os
from typing import Any

from posttrain.generation.base import Completions, SamplingConfig, truncate_at_eos


def _policy_name_or_path(model: Any) -> str:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
    if not name:
        raise ValueError(
            "vllm_mode='colocate' builds vLLM from the policy's checkpoint, but the model has no name_or_path; "
            "pass the model as a path or hub id, or save it first."
        )
    return name


class VLLMColocateBackend:
    """vLLM in the trainer process (see the module docstring).

    Args:
        model: The policy (its ``name_or_path`` is loaded by vLLM; its dtype is used).
        tokenizer: The policy's tokenizer.
        args: A GRPO/RLOO config (``vllm_*`` fields, ``per_device_train_batch_size``, ``steps_per_generation``).
    """

    def __init__(self, model: Any, tokenizer: Any = None, args: Any = None):
        import torch
        from vllm import LLM

        tp = int(getattr(args, "vllm_tensor_parallel_size", 1))
        if tp != 1:
            raise ValueError(
                f"vllm_tensor_parallel_size={tp} is not supported with vllm_mode='colocate' in this release; use 1, "
                "or vllm_mode='server' with a tensor-parallel `vllm serve`."
            )
        # external_launcher needs a process group description even for a single process (TRL does the same).
        for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "localhost"),
                           ("MASTER_PORT", "12345")):  # fmt: skip
            os.environ.setdefault(key, value)
        rank = int(os.environ.get("RANK", "0"))
        self.tokenizer = tokenizer
        self.sleep_mode = bool(getattr(args, "vllm_enable_sleep_mode", False))
        dtype = next(model.parameters()).dtype
        self.llm = LLM(
            model=_policy_name_or_path(model),
            tensor_parallel_size=1,
            gpu_memory_utilization=float(getattr(args, "vllm_gpu_memory_utilization", 0.3)),
            max_model_len=getattr(args, "vllm_max_model_length", None),
            max_num_seqs=int(getattr(args, "per_device_train_batch_size", 8)) * int(getattr(args, "steps_per_generation", 1) or 1),
            max_num_batched_tokens=4096,
            distributed_executor_backend="external_launcher",
            seed=rank,
            dtype=str(dtype).removeprefix("torch.") if dtype != torch.float32 else "float32",
            enable_sleep_mode=self.sleep_mode,
            model_impl=getattr(args, "vllm_model_impl", "vllm"),
            logprobs_mode="processed_logprobs",
        )
        self.regex = getattr(args, "vllm_structured_outputs_regex", None)
        self.model = model
        self._weights_loaded = True
        if self.sleep_mode:
            self.llm.sleep(level=2)
            self._weights_loaded = False  # level 2 discards the weights: the next sync (or generate) reloads

    def _engine_model(self) -> Any:
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        return getattr(worker, "worker", worker).model_runner.model

    def sync_weights(self, model: Any) -> None:
        """Load the policy's current (PEFT-merged) weights into the engine."""
        from posttrain.generation.weights import policy_weights

        if self.sleep_mode:
            self.llm.wake_up(tags=["weights"])
        engine_model = self._engine_model()
        with policy_weights(model) as items:
            engine_model.load_weights(weights=list(items))
        self.llm.reset_prefix_cache()
        self._weights_loaded = True

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, num_generations: int = 1) -> Completions:
        from vllm import SamplingParams

        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
        rows = [list(p) for p in prompt_ids for _ in range(num_generations)]
        if not prompt_ids:
            return Completions([], [], [], [])
        s = sampling.resolved()
        kwargs: dict[str, Any] = dict(
            n=num_generations, max_tokens=s.max_new_tokens,
            temperature=s.temperature if s.do_sample else 0.0, top_p=s.top_p if s.do_sample else 1.0,
            top_k=(s.top_k or -1) if s.do_sample else -1, min_p=(s.min_p or 0.0) if s.do_sample else 0.0,
            repetition_penalty=s.repetition_penalty, stop_token_ids=list(s.eos_token_ids), logprobs=0,
        )  # fmt: skip
        if self.regex is not None:
            from vllm.sampling_params import StructuredOutputsParams

            kwargs["structured_outputs"] = StructuredOutputsParams(regex=self.regex)
        kwargs.update(s.generation_kwargs or {})
        if self.sleep_mode:
            if not self._weights_loaded:
                self.sync_weights(self.model)
            self.llm.wake_up(tags=["kv_cache"])
        try:
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], SamplingParams(**kwargs),
                                        use_tqdm=False)  # fmt: skip
        finally:
            if self.sleep_mode:
                self.llm.sleep(level=2)
                self._weights_loaded = False
        eos = set(s.eos_token_ids)
        ids_out, lps_out, finished = [], [], []
        for out in outputs:
            for c in out.outputs:
                ids, done = truncate_at_eos(list(c.token_ids), eos)
                ids_out.append(ids)
                finished.append(done)
                lps_out.append([float(step[t].logprob) for step, t in zip(c.logprobs or [], ids)])
        return Completions(ids_out, lps_out, finished, rows)
