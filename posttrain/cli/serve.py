"""``posttrain serve`` and ``posttrain vllm-serve``: start the generation server (``posttrain.serving``).

``posttrain serve --model PATH_OR_ID [--host 127.0.0.1] [--port 8000] [--backend posttrain|vllm]`` serves the
model with posttrain's group sampler (``posttrain``, CPU or GPU) or vLLM's engine (``vllm``, GPU, ``pip install
posttrain[vllm]``). ``posttrain vllm-serve`` takes TRL's ``trl vllm-serve`` flags (``--model``,
``--tensor_parallel_size``, ``--gpu_memory_utilization``, ``--host`` 0.0.0.0, ...) and starts the same server with
the vLLM engine where vLLM and a GPU are available (``--backend auto``; otherwise the posttrain engine, said in the
log). Both accept ``--config recipe.yaml`` and dashed spellings; both shut down gracefully on SIGTERM / Ctrl-C.
``--data_parallel_size N`` starts N replicas of the engine on consecutive ports (``posttrain.cli.serve_replicas``).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from dataclasses import dataclass, field

logger = logging.getLogger("posttrain.serve")


@dataclass
class _EngineOptions:
    backend: str = field(
        default="posttrain",
        metadata={"help": "Generation engine: 'posttrain' (group sampler, any device) or 'vllm' (vLLM, GPU)."},
    )
    dtype: str = field(default="auto", metadata={"help": "Model dtype: auto, float32, bfloat16, float16."})
    revision: str | None = field(default=None, metadata={"help": "Model revision (hub branch, tag or commit)."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the hub."})
    seed: int = field(default=0, metadata={"help": "Seed of the engine's RNG (requests without a seed)."})
    max_queue_size: int = field(
        default=64, metadata={"help": "Requests admitted (running or waiting) before answering 429 (backpressure)."}
    )
    max_request_bytes: int | None = field(
        default=16 * 1024 * 1024,
        metadata={"help": "Largest request body in bytes (413 above it, before parsing); weight pushes are exempt."},
    )
    served_model_name: str | None = field(default=None, metadata={"help": "Model name reported (default: --model)."})
    log_level: str = field(default="info", metadata={"help": "uvicorn log level (critical ... trace)."})
    graceful_timeout: float = field(
        default=30.0, metadata={"help": "Seconds in-flight requests may take to finish after SIGTERM."}
    )
    # posttrain engine
    device: str = field(default="auto", metadata={"help": "posttrain engine: cpu, cuda, cuda:1 or auto."})
    max_batch_tokens: int | None = field(
        default=None, metadata={"help": "posttrain engine: KV budget per batch (rows × (prompt + max_tokens))."}
    )
    # vLLM engine
    tensor_parallel_size: int = field(default=1, metadata={"help": "vLLM engine: tensor parallel workers."})
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "vLLM engine: GPU memory fraction."})
    max_model_len: int | None = field(default=None, metadata={"help": "vLLM engine: context window."})
    enable_prefix_caching: bool | None = field(default=None, metadata={"help": "vLLM engine: prefix caching."})
    enforce_eager: bool = field(default=False, metadata={"help": "vLLM engine: no CUDA graphs."})
    kv_cache_dtype: str = field(default="auto", metadata={"help": "vLLM engine: KV cache dtype."})
    vllm_model_impl: str = field(default="vllm", metadata={"help": "vLLM engine: 'vllm' or 'transformers'."})


@dataclass
class ServeArguments(_EngineOptions):
    """``posttrain serve`` options."""

    model: str | None = field(default=None, metadata={"help": "Model path or hub id (required)."})
    host: str = field(default="127.0.0.1", metadata={"help": "Address to bind."})
    port: int = field(default=8000, metadata={"help": "Port to bind."})
    data_parallel_size: int = field(
        default=1,
        metadata={"help": "Engine replicas on this machine, one process each on ports port..port+N-1 (seeds "
                  "seed..seed+N-1); train against all of them with vllm_server_base_urls."},
    )

    def __post_init__(self):
        if self.data_parallel_size < 1:
            raise ValueError(f"--data_parallel_size must be >= 1, got {self.data_parallel_size}.")
        if self.data_parallel_size > 1 and self.port == 0:
            raise ValueError(
                "--port 0 cannot be combined with --data_parallel_size > 1: replicas listen on consecutive ports "
                "port, port+1, ...; give a fixed --port."
            )
        if not self.model:
            raise ValueError("--model is required: the path or hub id of the model to serve.")
        if self.backend not in ("posttrain", "vllm", "auto"):
            raise ValueError(f"--backend must be 'posttrain', 'vllm' or 'auto', got {self.backend!r}.")


@dataclass
class VLLMServeArguments(ServeArguments):
    """``posttrain vllm-serve``: TRL's ``trl vllm-serve`` flags and defaults (host 0.0.0.0, backend auto)."""

    host: str = field(default="0.0.0.0", metadata={"help": "Address to bind (TRL's default: all interfaces)."})
    backend: str = field(
        default="auto",
        metadata={"help": "'auto' (vLLM when installed and a GPU is visible, else posttrain), 'vllm', 'posttrain'."},
    )
    distributed_executor_backend: str | None = field(default=None, metadata={"help": "vLLM executor (e.g. ray)."})


def _vllm_usable() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def build_engine(args: ServeArguments):
    """The engine ``args`` ask for (``auto`` resolved)."""
    backend = args.backend
    if backend == "auto":
        backend = "vllm" if _vllm_usable() else "posttrain"
        if backend == "posttrain":
            logger.warning("vLLM or a CUDA GPU is not available: serving with the posttrain engine (group sampler).")
    if backend == "vllm":
        from posttrain.serving.vllm_engine import VLLMEngine

        return VLLMEngine(
            args.model, revision=args.revision, tensor_parallel_size=args.tensor_parallel_size,
            gpu_memory_utilization=args.gpu_memory_utilization, dtype=args.dtype, max_model_len=args.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching, enforce_eager=args.enforce_eager,
            kv_cache_dtype=args.kv_cache_dtype, trust_remote_code=args.trust_remote_code,
            model_impl=args.vllm_model_impl, seed=args.seed, served_model_name=args.served_model_name,
            distributed_executor_backend=getattr(args, "distributed_executor_backend", None),
        )  # fmt: skip
    from posttrain.serving.engine import PosttrainEngine

    return PosttrainEngine.from_pretrained(
        args.model, dtype=args.dtype, device=args.device, seed=args.seed, revision=args.revision,
        trust_remote_code=args.trust_remote_code, max_batch_tokens=args.max_batch_tokens,
        served_model_name=args.served_model_name,
    )  # fmt: skip


def _main(verb: str, argv: list[str], args_class: type) -> int:
    from posttrain.cli.parser import TrlParser
    from posttrain.cli.run import guarded, pop_debug_flag

    debug, argv = pop_debug_flag(argv)
    doc = sys.modules[__name__].__doc__ or ""
    parser = TrlParser(args_class, prog=f"posttrain {verb}", description=doc.split("\n\n")[0])

    def work() -> int:
        try:
            import fastapi  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as err:
            raise ImportError(f"posttrain {verb} needs {err.name}: pip install posttrain[serve].") from err
        (args,) = parser.parse_args_and_config(argv)
        logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
        if args.data_parallel_size > 1:
            from posttrain.cli.serve_replicas import run_replicas

            return run_replicas(verb, argv, args)
        from posttrain.serving.app import run_server

        engine = build_engine(args)
        print(f"posttrain {verb}: serving {engine.model_name!r} with the {engine.name} engine on "
              f"http://{args.host}:{args.port} (Ctrl-C or SIGTERM to stop)", file=sys.stderr, flush=True)  # fmt: skip
        run_server(engine, args.host, args.port, log_level=args.log_level, max_queue_size=args.max_queue_size,
                   graceful_timeout=args.graceful_timeout, max_request_bytes=args.max_request_bytes)  # fmt: skip
        return 0

    return guarded(f"posttrain {verb}", work, debug=debug)


def serve_cli(argv: list[str]) -> int:
    return _main("serve", argv, ServeArguments)


def vllm_serve_cli(argv: list[str]) -> int:
    return _main("vllm-serve", argv, VLLMServeArguments)
