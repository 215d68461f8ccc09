"""GPU verification of posttrain's CUDA paths in one time-boxed run: ``python -m benchmarks.gpu.run --out DIR``.

Sections (each in its own child process with its own time box, so a hang, a crash or a CUDA OOM in one is recorded
with its traceback tail and the run goes on; a child process also gives each training run a clean peak-memory
counter):

- ``env``: device, versions, which optional libraries are importable.
- ``gpu_tests``: the suite's ``gpu``-marked tests that don't need vLLM (``pytest -m gpu`` on the files that have them).
- ``numerics``: chunked and vocabulary-tiled log-probs/entropy ≡ naive (values and gradients), block attention ≡
  dense masked SDPA, bf16 vs fp32 SFT/DPO/GRPO losses on the same batch — each against a stated tolerance.
- ``train_{sft,dpo,grpo}``: posttrain's trainers on a Qwen2.5-0.5B-shaped model (config only, random weights,
  vocabulary 151 936), bf16, a few steps: step time, tokens/s, peak CUDA memory.
- ``trl_{sft,dpo,grpo}``: the same runs with TRL 1.16, only when ``trl`` and ``datasets`` are importable (carried
  wheels, see README.md); otherwise recorded as skipped with the reason.
- ``not_run``: what cannot run on one lent GPU (vLLM, NCCL weight transfer, multi-GPU), listed as such.

``--dry-run`` (or no CUDA) runs every section on a tiny model on CPU in about a minute, skipping CUDA-only checks
with reasons; ``tests/benchmarks/test_gpu_script.py`` does so. ``--hide datasets,trl`` makes those modules
unimportable in the sections, to prove on a CPU machine what the GPU machine does without the carried wheels.

This module imports only the standard library at module level: the orchestrator must survive anything a section does.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = REPO_ROOT / "tests"
TAIL_CHARS = 3000

# Share of the budget per section (the GPU run). TRL sections only run when TRL is importable; their share is then
# taken from the whole, so a run with TRL is as time-boxed as one without.
BUDGET_SHARES: dict[str, float] = {
    "env": 0.04,
    "gpu_tests": 0.11,
    "numerics": 0.14,
    "train_sft": 0.12,
    "train_dpo": 0.12,
    "train_grpo": 0.20,
    "trl_sft": 0.07,
    "trl_dpo": 0.07,
    "trl_grpo": 0.13,
}
SECTIONS = list(BUDGET_SHARES)
MIN_SECTION_S = 10.0  # a section with less time left than this is skipped ("budget exhausted")

# Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), built locally with random weights.
QWEN25_05B = {
    "hidden_size": 896,
    "num_layers": 24,
    "num_heads": 14,
    "num_kv_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151_936,
    "max_position_embeddings": 32_768,
    "tie_word_embeddings": True,
}
TINY: dict[str, Any] = {}

NOT_RUN = [
    {
        "what": "vLLM generation (use_vllm=True, colocate and server modes) and tests/serving/test_vllm_gpu.py",
        "why": "the vllm wheel (hundreds of MiB, plus its pinned torch) is far above the 64 MiB carry limit; "
        "the machine has no network",
    },
    {
        "what": "NCCL weight transfer to a vLLM server (generation/weights.py NCCL path)",
        "why": "needs a vLLM server process and a second GPU or process group with NCCL; one lent GPU, no vLLM",
    },
    {
        "what": "multi-GPU training (DDP, FSDP, DeepSpeed ZeRO) and distributed metric reduction on NCCL",
        "why": "one GPU is lent; the multi-process paths are tested on CPU with gloo only",
    },
]


# ----------------------------------------------------------------------------------------------------------------
# helpers shared by the sections
# ----------------------------------------------------------------------------------------------------------------


def _tail(text: str, n: int = TAIL_CHARS) -> str:
    return text[-n:]


def _hide_modules(names: list[str]) -> None:
    """Make ``names`` unimportable in this process (``import x`` raises ImportError, ``find_spec`` returns None)."""
    for name in names:
        sys.modules[name] = None  # type: ignore[assignment]


def _available(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _rel_err(a, b) -> float:
    """max |a − b| / max(max |b|, 1e-12), in float64 (a relative error robust to a few near-zero entries)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def _check(name: str, measured: float, tol: float, **extra: Any) -> dict[str, Any]:
    return {"name": name, "measured": measured, "tolerance": tol, "passed": bool(measured <= tol), **extra}


def _soft(checks: list[dict[str, Any]], name: str, fn) -> None:
    """Run one check group; an exception becomes an ``error`` entry with its traceback tail, the next group runs."""
    try:
        checks.extend(fn())
    except Exception:  # noqa: BLE001 - fail soft by design: the report records it
        checks.append({"name": name, "passed": False, "error": _tail(traceback.format_exc())})


def _device(dry_run: bool):
    import torch

    return torch.device("cuda" if torch.cuda.is_available() and not dry_run else "cpu")


def _model_dir(cache_dir: Path, spec: dict[str, Any], tag: str) -> str:
    """Build (once) and save the model of ``spec`` with the byte-level tokenizer; returns its path."""
    path = cache_dir / f"model-{tag}"
    if (path / "config.json").exists():
        return str(path)
    import torch

    from posttrain.models.tiny import save_tiny_model

    tmp = cache_dir / f".model-{tag}.partial"
    # random init of 0.5B parameters takes seconds on a GPU and much longer on the CPU; the weights are saved either way
    try:
        with torch.device("cuda" if spec and torch.cuda.is_available() else "cpu"):
            save_tiny_model(tmp, arch="qwen2", **spec)
    except Exception:  # noqa: BLE001 - building on the GPU is only a speed-up: fall back to the CPU
        save_tiny_model(tmp, arch="qwen2", **spec)
    tmp.rename(path)
    return str(path)


# ----------------------------------------------------------------------------------------------------------------
# sections (each runs in a child process and returns a JSON-able dict)
# ----------------------------------------------------------------------------------------------------------------


def section_env(opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
        "dry_run": opts.dry_run,
        "modules": {m: _available(m) for m in ("datasets", "trl", "vllm", "peft", "accelerate", "liger_kernel")},
    }
    names = (
        "transformers",
        "accelerate",
        "peft",
        "safetensors",
        "datasets",
        "trl",
        "pyarrow",
        "pandas",
        "dill",
        "multiprocess",
        "fsspec",
        "huggingface_hub",
        "pytest",
        "posttrain",
    )
    for name in names:
        try:
            info.setdefault("versions", {})[name] = __import__(name).__version__
        except Exception as exc:  # noqa: BLE001 - absent or broken: record why
            info.setdefault("versions", {})[name] = f"not importable: {type(exc).__name__}: {exc}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            total_memory_gib=round(props.total_memory / 2**30, 1),
            bf16_supported=torch.cuda.is_bf16_supported(),
        )
    return {"status": "ok", **info}


def section_gpu_tests(opts: argparse.Namespace) -> dict[str, Any]:
    """``pytest -m gpu`` on the test files that carry the ``gpu`` mark, minus those that need vLLM."""
    import xml.etree.ElementTree as ET

    files, excluded = [], []
    for path in sorted(TESTS_DIR.rglob("test_*.py")):
        text = path.read_text(errors="replace")
        if "mark.gpu" not in text:
            continue
        rel = str(path.relative_to(REPO_ROOT))
        if "vllm" in text.lower():
            excluded.append({"file": rel, "why": "needs vLLM (not on the machine)"})
        else:
            files.append(rel)
    if not files:
        return {"status": "ok", "files": [], "excluded": excluded, "tests": [], "note": "no gpu-marked test files"}
    if not _available("pytest"):
        return {
            "status": "skipped",
            "files": files,
            "excluded": excluded,
            "reason": "pytest not importable here (the GPU image has it): carry a pytest wheel and pass --wheels",
        }
    junit = Path(opts.out) / "gpu_tests.junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rA",
        f"--junitxml={junit}",
        *files,
    ]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=max(opts.time_left - 5, 5))
    tests = []
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                    message = _tail(child.get("message") or child.text or "", 800)
            tests.append(
                {
                    "test": f"{case.get('classname')}::{case.get('name')}",
                    "outcome": outcome,
                    "seconds": float(case.get("time") or 0.0),
                    "message": message,
                }
            )
    failed = [t for t in tests if t["outcome"] in ("failed", "error")]
    # exit 5 = every selected test deselected/none collected: not an error of the script
    status = "ok" if proc.returncode in (0, 5) and not failed else "failed"
    return {
        "status": status,
        "returncode": proc.returncode,
        "files": files,
        "excluded": excluded,
        "tests": tests,
        "counts": {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")},
        "output_tail": _tail(proc.stdout + proc.stderr, 1500),
    }


def _logprob_checks(device, dry: bool) -> list[dict[str, Any]]:
    import torch

    from posttrain.core.logprobs import chunked_logprobs_from_hidden

    cuda = device.type == "cuda"
    n, h, v = (2048, 896, 151_936) if cuda else (96, 32, 1000)
    results = []
    for dtype in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
        g = torch.Generator(device="cpu").manual_seed(0)
        hidden0 = (torch.randn(n, h, generator=g) * 0.5).to(device=device, dtype=dtype)
        weight0 = (torch.randn(v, h, generator=g) * 0.05).to(device=device, dtype=dtype)
        labels = torch.randint(0, v, (n,), generator=g).to(device)
        labels[::7] = -100  # ignored positions (prompt / padding)

        def run(fn, hidden0=hidden0, weight0=weight0):
            hidden, weight = hidden0.clone().requires_grad_(), weight0.clone().requires_grad_()
            logps, entropy = fn(hidden, weight)
            (logps.sum() + 0.1 * entropy.sum()).backward()
            return logps.detach(), entropy.detach(), hidden.grad, weight.grad

        def naive(hidden, weight, labels=labels):
            logits = hidden.float() @ weight.float().T
            logp_all = torch.log_softmax(logits, dim=-1)
            valid = labels != -100
            logps = logp_all.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * valid
            return logps, -(logp_all.exp() * logp_all).sum(-1)

        ref = run(naive)
        variants = {
            "chunked": {"chunk_size": 256 if cuda else 16},
            "vocab_tiled": {"chunk_size": 1024 if cuda else 32, "vocab_chunk_size": 16_384 if cuda else 128},
        }
        # the kernels compute in float32 whatever the input dtype; gradients come back in the input dtype
        grad_tol = 1e-4 if dtype == torch.float32 else 2e-2
        for name, kwargs in variants.items():
            out = run(
                lambda hd, w, kw=kwargs, lb=labels: chunked_logprobs_from_hidden(
                    hd, w, lb, compute_entropy=True, entropy_requires_grad=True, **kw
                )
            )
            tag = f"logprobs/{name}/{str(dtype).removeprefix('torch.')}"
            shape = {"n": n, "hidden": h, "vocab": v, **kwargs}
            results += [
                _check(f"{tag}/logps", _rel_err(out[0], ref[0]), 1e-4, shape=shape),
                _check(f"{tag}/entropy", _rel_err(out[1], ref[1]), 1e-4, shape=shape),
                _check(f"{tag}/grad_hidden", _rel_err(out[2], ref[2]), grad_tol, shape=shape),
                _check(f"{tag}/grad_weight", _rel_err(out[3], ref[3]), grad_tol, shape=shape),
            ]
        del ref
        if cuda:
            torch.cuda.empty_cache()
    return results


def _tree(packs: int, length: int, prompt: int, branch: int, chunk: int):
    """Packs of [prompt | G branches | padding]: the dense mask (N, 1, L, L) and the blocks that cover it."""
    import torch

    mask = torch.zeros(packs, 1, length, length, dtype=torch.bool)
    blocks, queried = [], torch.zeros(packs, length, dtype=torch.bool)
    for n in range(packs):
        p = prompt - 3 * n  # packs differ a little
        for i in range(p):
            mask[n, 0, i, : i + 1] = True
        blocks.append((n, list(range(p)), list(range(p))))
        start = p
        while start + branch <= length - 2:
            a, b = start, start + branch
            for i in range(a, b):
                mask[n, 0, i, :p] = True
                mask[n, 0, i, a : i + 1] = True
            for first in range(a, b, chunk):
                last = min(first + chunk, b)
                blocks.append((n, list(range(first, last)), [*range(p), *range(a, last)]))
            start = b
        queried[n, :start] = True
        for pad in range(start, length):
            mask[n, 0, pad, pad] = True
    return mask, blocks, queried


def _block_attention_checks(device, dry: bool) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from posttrain.core.block_attention import BlockIndex, block_attention

    cuda = device.type == "cuda"
    packs, length, prompt, branch, chunk = (4, 1536, 256, 160, 64) if cuda else (2, 64, 12, 10, 4)
    heads, kv_heads, dim = (14, 2, 64) if cuda else (4, 2, 8)
    mask, blocks, queried = _tree(packs, length, prompt, branch, chunk)
    mask, queried = mask.to(device), queried.to(device)
    index = BlockIndex.from_mask(mask, blocks)
    results = []
    for dtype in (torch.float32, torch.bfloat16) if cuda else (torch.float32,):
        g = torch.Generator(device="cpu").manual_seed(1)
        base = [
            torch.randn(packs, hh, length, dim, generator=g).to(device=device, dtype=dtype)
            for hh in (heads, kv_heads, kv_heads)
        ]
        weights = torch.randn(packs, heads, length, dim, generator=g).to(device=device, dtype=dtype)
        sel = queried[:, None, :, None]

        def run(fn, base=base, weights=weights, sel=sel):
            q, k, v = (t.clone().requires_grad_() for t in base)
            out = fn(q, k, v)
            ((out * weights).float() * sel).sum().backward()
            return out.detach() * sel, q.grad, k.grad, v.grad

        dense = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True))
        blocked = run(lambda q, k, v: block_attention(q, k, v, index, enable_gqa=True))
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        tag = f"block_attention/{str(dtype).removeprefix('torch.')}"
        shape = {"packs": packs, "length": length, "blocks": len(blocks), "heads": heads, "kv_heads": kv_heads}
        for i, part in enumerate(("out", "grad_q", "grad_k", "grad_v")):
            results.append(_check(f"{tag}/{part}", _rel_err(blocked[i], dense[i]), tol, shape=shape))
    return results


def _loss_precision_checks(device, dry: bool, cache_dir: Path) -> list[dict[str, Any]]:
    """SFT (token-mean NLL), DPO (sigmoid) and GRPO (clipped surrogate, token mean) losses of one batch, computed
    with posttrain's kernels from an fp32 model and from its bf16 autocast forward: |bf16 − fp32| / |fp32|."""
    import torch

    from posttrain.core.logprobs import chunked_logprobs_from_hidden
    from posttrain.core.policy_objectives import clip_objective
    from posttrain.core.preference import DPOLossInputs, sigmoid
    from posttrain.models.tiny import build_tiny_model

    cuda = device.type == "cuda"
    spec = {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 151_936}
    model = build_tiny_model("qwen2", **(spec if cuda else {})).to(device).eval()
    vocab = model.config.vocab_size
    g = torch.Generator(device="cpu").manual_seed(2)
    batch, length = (8, 256) if cuda else (4, 24)
    input_ids = torch.randint(0, vocab, (batch, length), generator=g).to(device)
    labels = input_ids[:, 1:].clone()
    labels[:, : length // 4] = -100  # the prompt
    mask = (labels != -100).float()
    old_noise = (torch.randn(batch, length - 1, generator=g) * 0.05).to(device)
    # advantages of one sign, so the GRPO loss is not a near-zero difference (a relative error needs a scale)
    advantages = torch.linspace(0.2, 1.0, batch, device=device)
    half = batch // 2

    def losses(autocast: bool) -> dict[str, torch.Tensor]:
        ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
        with ctx, torch.no_grad():
            hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]
            logp, _ = chunked_logprobs_from_hidden(hidden, model.lm_head.weight, labels, chunk_size=128)
        sft = -(logp * mask).sum() / mask.sum()
        seq = (logp * mask).sum(-1)
        ref = ref_seq_fp32  # a fixed reference (the fp32 policy, shifted): the margin depends on this forward's logps
        dpo = sigmoid(DPOLossInputs(seq[:half], seq[half:], ref[:half] + 0.5, ref[half:] - 0.5), beta=0.1).mean()
        per_token, _ = clip_objective(logp, logp_fp32_old, advantages, mask)
        grpo = (per_token * mask).sum() / mask.sum()
        return {"sft": sft, "dpo": dpo, "grpo": grpo}

    with torch.no_grad():
        hidden = model.model(input_ids=input_ids).last_hidden_state[:, :-1]
        logp_fp32 = chunked_logprobs_from_hidden(hidden, model.lm_head.weight, labels)[0]
    logp_fp32_old = logp_fp32 + old_noise
    ref_seq_fp32 = (logp_fp32 * mask).sum(-1)
    fp32, bf16 = losses(False), losses(True)
    tol = 2e-2
    return [
        _check(
            f"loss_bf16_vs_fp32/{k}",
            abs(float(bf16[k]) - float(fp32[k])) / max(abs(float(fp32[k])), 1e-6),
            tol,
            fp32=float(fp32[k]),
            bf16=float(bf16[k]),
            batch=[batch, length],
            vocab=vocab,
        )
        for k in fp32
    ]


def section_numerics(opts: argparse.Namespace) -> dict[str, Any]:
    import torch

    device = _device(opts.dry_run)
    torch.manual_seed(0)
    checks: list[dict[str, Any]] = []
    _soft(checks, "logprobs", lambda: _logprob_checks(device, opts.dry_run))
    _soft(checks, "block_attention", lambda: _block_attention_checks(device, opts.dry_run))
    _soft(checks, "loss_bf16_vs_fp32", lambda: _loss_precision_checks(device, opts.dry_run, Path(opts.cache_dir)))
    skipped = []
    if device.type != "cuda":
        skipped.append(
            "bf16 variants of the kernel checks and the bf16-vs-fp32 losses ran on CPU in autocast, not "
            "on CUDA: the CUDA numerics need a GPU (" + ("--dry-run" if opts.dry_run else "no CUDA") + ")"
        )
    failed = [c["name"] for c in checks if not c["passed"]]
    return {
        "status": "ok" if not failed else "failed",
        "device": str(device),
        "checks": checks,
        "failed": failed,
        "skipped": skipped,
    }


def _workload(kind: str, cuda: bool) -> tuple[dict[str, Any], Any, list]:
    """Config fields (TRL's names, shared by both libraries), the training rows and the reward functions."""
    import random

    rng = random.Random(0)
    words = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from"]

    def text(n_words: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n_words))

    common = {
        "logging_steps": 1,
        "report_to": "none",
        "save_strategy": "no",
        "seed": 0,
        "bf16": cuda,
        "dataloader_num_workers": 0,
        "max_steps": 6 if cuda else 2,
        "learning_rate": 1e-5,
    }
    if kind == "sft":
        rows = [{"text": text(rng.randint(20, 400 if cuda else 60))} for _ in range(400 if cuda else 16)]
        fields = {
            **common,
            "packing": True,
            "max_length": 2048 if cuda else 128,
            "per_device_train_batch_size": 4 if cuda else 2,
        }
        return fields, rows, []
    if kind == "dpo":
        rows = [
            {
                "prompt": text(rng.randint(10, 60)),
                "chosen": text(rng.randint(20, 150 if cuda else 20)),
                "rejected": text(rng.randint(20, 150 if cuda else 20)),
            }
            for _ in range(128 if cuda else 8)
        ]
        fields = {
            **common,
            "max_length": 1024 if cuda else 128,
            "per_device_train_batch_size": 8 if cuda else 2,
            "beta": 0.1,
        }
        return fields, rows, []
    if kind == "grpo":
        rows = [{"prompt": text(rng.randint(10, 40))} for _ in range(64 if cuda else 8)]

        def length_reward(completions, **_):
            return [len(c) / 100.0 for c in completions]

        fields = {
            **common,
            "max_steps": 3 if cuda else 1,
            "num_generations": 8,
            "per_device_train_batch_size": 16,
            "max_completion_length": 256 if cuda else 8,
            "temperature": 1.0,
        }
        return fields, rows, [length_reward]
    raise ValueError(f"unknown workload {kind!r}")


def section_train(opts: argparse.Namespace, kind: str, lib_name: str) -> dict[str, Any]:
    """Train ``kind`` for a few steps with ``lib_name`` (posttrain or trl) and measure step time, tokens/s, memory."""
    missing = [m for m in (("datasets", "trl") if lib_name == "trl" else ("datasets",)) if not _available(m)]
    if missing:
        return {
            "status": "skipped",
            "reason": f"{', '.join(missing)} not importable here: carry the wheels of "
            "benchmarks/gpu/fetch_wheels.sh and pass --wheels (README.md)",
            "missing": missing,
        }
    import importlib

    import datasets
    import torch
    from transformers import TrainerCallback

    lib = importlib.import_module(lib_name)
    device = _device(opts.dry_run)
    cuda = device.type == "cuda"
    spec, tag = (QWEN25_05B, "qwen2.5-0.5b-shape") if cuda else (TINY, "tiny")
    model_path = _model_dir(Path(opts.cache_dir), spec, tag)
    fields, rows, rewards = _workload(kind, cuda)
    if not cuda:
        fields["use_cpu"] = True
    config_cls = getattr(lib, {"sft": "SFTConfig", "dpo": "DPOConfig", "grpo": "GRPOConfig"}[kind])
    trainer_cls = getattr(lib, {"sft": "SFTTrainer", "dpo": "DPOTrainer", "grpo": "GRPOTrainer"}[kind])
    args = config_cls(output_dir=str(Path(opts.cache_dir) / f"run-{lib_name}-{kind}"), **fields)
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            ends.append(time.perf_counter())

    extra = {"reward_funcs": rewards} if kind == "grpo" else {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer = trainer_cls(
        model=model_path, args=args, train_dataset=datasets.Dataset.from_list(rows), callbacks=[StepClock()], **extra
    )
    built = time.perf_counter()
    trainer.train()
    history = trainer.state.log_history
    tokens = [h["num_tokens"] for h in history if "num_tokens" in h]
    losses = [h["loss"] for h in history if "loss" in h]
    steps = [b - a for a, b in zip([built, *ends[:-1]], ends, strict=True)]
    timed = steps[1:] or steps  # the first step warms up kernels and allocator
    tokens_timed = (tokens[-1] - tokens[0]) if len(tokens) > 1 else (tokens[0] if tokens else None)
    seconds_timed = sum(steps[1:]) if len(tokens) > 1 else sum(steps)
    result = {
        "status": "ok",
        "library": lib_name,
        "version": lib.__version__,
        "device": str(device),
        "model": {
            "tag": tag,
            **({"spec": spec} if spec else {}),
            "parameters": sum(p.numel() for p in trainer.model.parameters()),
        },
        "config": {k: v for k, v in fields.items() if k not in ("report_to", "save_strategy", "logging_steps")},
        "build_s": round(built - start, 3),
        "steps": len(steps),
        "step_s": [round(s, 4) for s in steps],
        "median_step_s": round(statistics.median(timed), 4) if timed else None,
        "tokens_per_s": round(tokens_timed / seconds_timed, 1) if tokens_timed and seconds_timed else None,
        "num_tokens": tokens[-1] if tokens else None,
        "final_loss": losses[-1] if losses else None,
    }
    if cuda:
        result["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        result["peak_cuda_reserved_mib"] = round(torch.cuda.max_memory_reserved() / 2**20, 1)
    else:
        result["peak_cuda_mib"] = None
        result["skipped"] = ["peak CUDA memory and bf16: CPU dry run (fp32, tiny model)"]
    if kind == "grpo":
        lengths = [h["completions/mean_length"] for h in history if "completions/mean_length" in h]
        result["completions_mean_length"] = statistics.mean(lengths) if lengths else None
    return result


def run_section(name: str, opts: argparse.Namespace) -> dict[str, Any]:
    if name == "env":
        return section_env(opts)
    if name == "gpu_tests":
        return section_gpu_tests(opts)
    if name == "numerics":
        return section_numerics(opts)
    match = re.fullmatch(r"(train|trl)_(sft|dpo|grpo)", name)
    if match:
        return section_train(opts, match.group(2), "posttrain" if match.group(1) == "train" else "trl")
    raise ValueError(f"unknown section {name!r}; choose from {SECTIONS}")


# ----------------------------------------------------------------------------------------------------------------
# orchestrator
# ----------------------------------------------------------------------------------------------------------------


def _install_wheels(wheels: Path, site: Path) -> dict[str, Any]:
    """``pip install --no-deps --no-index --target site`` every carried wheel (no network on the GPU machine)."""
    found = sorted(str(p) for p in wheels.glob("*.whl"))
    if not found:
        return {"status": "failed", "reason": f"no *.whl in {wheels}"}
    if (site / ".installed").exists() and (site / ".installed").read_text() == "\n".join(found):
        return {"status": "ok", "wheels": [Path(p).name for p in found], "note": "already installed"}
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-index",
        "--upgrade",
        "--target",
        str(site),
        *found,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0:
        (site / ".installed").write_text("\n".join(found))
    return {
        "status": "ok" if proc.returncode == 0 else "failed",
        "wheels": [Path(p).name for p in found],
        "output_tail": _tail(proc.stdout + proc.stderr, 1500),
    }


def _child_env(opts: argparse.Namespace, site: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO_ROOT), *([str(site)] if site else []), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "WANDB_DISABLED": "true",
        "POSTTRAIN_NO_REPORT": "1",
        "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
        "TQDM_DISABLE": "1",
    }.items():
        env.setdefault(key, value)
    if opts.dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is a CPU run even on a GPU machine
    return env


def _spawn(name: str, opts: argparse.Namespace, timeout: float, env: dict[str, str]) -> dict[str, Any]:
    """Run one section in a child process (its own process group, killed whole on timeout)."""
    out = Path(opts.out)
    result_file = out / "sections" / f"{name}.json"
    result_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.gpu.run",
        "--section",
        name,
        "--out",
        str(out),
        "--cache-dir",
        str(opts.cache_dir),
        "--time-left",
        str(timeout),
    ]
    if opts.dry_run:
        cmd.append("--dry-run")
    if opts.hide:
        cmd += ["--hide", opts.hide]
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        timed_out = True
    seconds = round(time.perf_counter() - start, 2)
    if result_file.exists():
        result = json.loads(result_file.read_text())
    elif timed_out:
        result = {
            "status": "timeout",
            "reason": f"ran past its {timeout:.0f} s time box",
            "output_tail": _tail(output),
        }
    else:
        result = {"status": "error", "returncode": proc.returncode, "output_tail": _tail(output)}
    result.setdefault("log_tail", _tail(output, 1500))
    return {"seconds": seconds, "time_box_s": round(timeout, 1), **result}


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def render_markdown(report: dict[str, Any]) -> str:
    """The human-readable report: one table per section kind, failures with their traceback tails."""
    env = report["sections"].get("env", {})
    lines = [
        "# posttrain GPU verification report",
        "",
        f"- device: **{report['device']}**; dry run: {report['dry_run']}; budget {report['budget_s']} s, "
        f"used {report['elapsed_s']} s",
        f"- versions: {json.dumps(env.get('versions', {}))}",
        f"- wheels: {json.dumps(report.get('wheels'))}",
        "",
        "## Sections",
        "",
        "| section | status | seconds | time box (s) | note |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, sec in report["sections"].items():
        note = sec.get("reason") or (", ".join(sec.get("failed", [])) if sec.get("failed") else "")
        lines.append(
            f"| {name} | {sec.get('status')} | {_fmt(sec.get('seconds'))} | {_fmt(sec.get('time_box_s'))} | {note} |"
        )
    tests = report["sections"].get("gpu_tests", {})
    if tests.get("tests") is not None:
        lines += [
            "",
            "## gpu-marked tests",
            "",
            f"files: {tests.get('files')}; excluded: {tests.get('excluded')}",
            "",
            "| test | outcome | s | message |",
            "| --- | --- | --- | --- |",
        ]
        for t in tests.get("tests", []):
            message = t["message"].replace("\n", " ").replace("|", "/")[:160]
            lines.append(f"| {t['test']} | {t['outcome']} | {t['seconds']:.2f} | {message} |")
    numerics = report["sections"].get("numerics", {})
    if numerics.get("checks"):
        lines += [
            "",
            "## Numerics (relative error max|a−b|/max|ref| against the stated tolerance)",
            "",
            "| check | measured | tolerance | passed |",
            "| --- | --- | --- | --- |",
        ]
        for c in numerics["checks"]:
            lines.append(f"| {c['name']} | {_fmt(c.get('measured'))} | {_fmt(c.get('tolerance'))} | {c['passed']} |")
        for reason in numerics.get("skipped", []):
            lines.append(f"\nskipped: {reason}")
    train = {k: v for k, v in report["sections"].items() if k.startswith(("train_", "trl_"))}
    if train:
        lines += [
            "",
            "## Training (a few steps; the first step is not timed)",
            "",
            "| section | library | model | median step (s) | tokens/s | peak CUDA (MiB) | final loss | status |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for name, sec in train.items():
            model = (sec.get("model") or {}).get("tag")
            lines.append(
                f"| {name} | {sec.get('library', '—')} | {_fmt(model)} | {_fmt(sec.get('median_step_s'))} | "
                f"{_fmt(sec.get('tokens_per_s'))} | {_fmt(sec.get('peak_cuda_mib'))} | "
                f"{_fmt(sec.get('final_loss'))} | {sec.get('status')} |"
            )
    lines += ["", "## Not run here", ""]
    lines += [f"- {item['what']}: {item['why']}" for item in report["not_run"]]
    errors = {k: v for k, v in report["sections"].items() if v.get("status") in ("error", "timeout", "failed")}
    for name, sec in errors.items():
        tail = sec.get("output_tail") or sec.get("error") or ""
        bad = [c for c in sec.get("checks", []) if c.get("error")]
        tail = tail or "\n".join(c["error"] for c in bad)
        if tail:
            lines += ["", f"### {name}: {sec.get('status')}", "", "```", tail.strip()[-TAIL_CHARS:], "```"]
    return "\n".join(lines) + "\n"


def orchestrate(opts: argparse.Namespace) -> dict[str, Any]:
    out = Path(opts.out)
    (out / "sections").mkdir(parents=True, exist_ok=True)
    Path(opts.cache_dir).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    site = None
    wheels_info: dict[str, Any] | None = None
    if opts.wheels:
        site = Path(opts.site)
        site.mkdir(parents=True, exist_ok=True)
        wheels_info = _install_wheels(Path(opts.wheels), site)
        sys.path.insert(0, str(site))
    hidden = [m for m in (opts.hide or "").split(",") if m]
    _hide_modules(hidden)
    env = _child_env(opts, site if wheels_info and wheels_info["status"] == "ok" else None)
    have_trl = _available("trl") and _available("datasets")
    selected = opts.sections.split(",") if opts.sections else SECTIONS
    unknown = sorted(set(selected) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"--sections: unknown {unknown}; choose from {SECTIONS}")
    sections: dict[str, Any] = {}
    for name in SECTIONS:
        if name not in selected:
            continue
        if name.startswith("trl_") and not have_trl:
            why = [m for m in ("trl", "datasets") if not _available(m)]
            sections[name] = {
                "status": "skipped",
                "reason": f"{', '.join(why)} not importable"
                + (" (hidden by --hide)" if set(why) & set(hidden) else "")
                + ": TRL side-by-side needs the carried wheels (benchmarks/gpu/fetch_wheels.sh, "
                "--wheels); posttrain-only run",
            }
            continue
        left = opts.budget_s - (time.perf_counter() - start)
        box = min(left, opts.budget_s * BUDGET_SHARES[name] * (1.0 if have_trl else 1.0 / 0.73))
        if box < MIN_SECTION_S:
            sections[name] = {"status": "skipped", "reason": f"budget exhausted ({left:.0f} s left)"}
            continue
        print(f"[gpu-verify] {name} (time box {box:.0f} s)", flush=True)
        sections[name] = _spawn(name, opts, box, env)
        print(f"[gpu-verify] {name}: {sections[name].get('status')} in {sections[name]['seconds']} s", flush=True)
    report = {
        "device": sections.get("env", {}).get("device_name") or ("cpu (dry run)" if opts.dry_run else "cpu"),
        "dry_run": opts.dry_run,
        "budget_s": opts.budget_s,
        "elapsed_s": round(time.perf_counter() - start, 1),
        "hidden_modules": hidden,
        "wheels": wheels_info,
        "sections": sections,
        "not_run": NOT_RUN,
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "report.md").write_text(render_markdown(report))
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for report.json, report.md and per-section JSON")
    p.add_argument("--dry-run", action="store_true", help="tiny model on CPU (also the behaviour without CUDA)")
    p.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of all sections (default 540)")
    p.add_argument("--sections", default=None, help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--wheels", default=None, help="folder of carried wheels (fetch_wheels.sh) to install first")
    p.add_argument(
        "--site",
        default=str(Path(tempfile.gettempdir()) / "posttrain-gpu-site"),
        help="where --wheels are installed (added to the sections' PYTHONPATH)",
    )
    p.add_argument(
        "--cache-dir",
        default=str(Path(tempfile.gettempdir()) / "posttrain-gpu-cache"),
        help="built models and trainer output dirs (kept out of --out: the model is ~2 GiB)",
    )
    p.add_argument("--hide", default="", help="comma-separated modules made unimportable (simulate their absence)")
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)  # internal: run one section in-process
    p.add_argument("--time-left", type=float, default=600.0, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    if opts.section:
        _hide_modules([m for m in opts.hide.split(",") if m])
        try:
            result = run_section(opts.section, opts)
        except Exception:  # noqa: BLE001 - fail soft: the orchestrator reports it and runs the next section
            result = {"status": "error", "error": _tail(traceback.format_exc())}
        (Path(opts.out) / "sections" / f"{opts.section}.json").write_text(json.dumps(result, indent=1, default=str))
        return 0
    if not opts.dry_run:
        try:
            import torch

            opts.dry_run = not torch.cuda.is_available()
            if opts.dry_run:
                print("[gpu-verify] no CUDA device: running the CPU dry run", flush=True)
        except ImportError:
            opts.dry_run = True
    report = orchestrate(opts)
    bad = [k for k, v in report["sections"].items() if v.get("status") in ("error", "timeout", "failed")]
    print(f"[gpu-verify] report: {Path(opts.out) / 'report.md'}; sections not ok: {bad or 'none'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
