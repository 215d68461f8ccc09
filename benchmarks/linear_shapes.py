"""Single-thread fp32 forward + backward GFLOP/s of one benchmark model's linear-layer shapes.

The ceiling the sweep's "fraction of matmul peak" can reach: ``machine_peak.py`` times square matrices, but a step
multiplies (tokens × hidden) activations by the model's own weight shapes, some of them skinny (grouped-query k/v
projections) or wide (the LM head). Each shape is timed as ``linear`` forward + backward (three matmuls, 6·t·in·out
FLOP) on ``--tokens`` rows (the LM head on ``--head-chunk`` rows, as a chunked head does), best of ``--repeats`` by
the thread's CPU time, and forward only (``--tokens 16 --head-chunk 16``: a decode step of 16 rows). Prints one JSON line with each shape's GFLOP/s and the per-token-weighted whole-model rate,
with and without recomputing the layers' forward (gradient checkpointing: + 2 FLOP per layer parameter per token).

    python benchmarks/linear_shapes.py --model qwen05b
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _fwd_bwd(x, w) -> None:
    """``linear(x, w)`` forward and backward: x (rows, in), w (out, in); three matmuls."""
    import torch

    y = torch.nn.functional.linear(x, w)  # (rows, out)
    y.backward(torch.ones_like(y))
    x.grad = w.grad = None


def _fwd(x, w) -> None:
    """``linear(x, w)`` forward only, without autograd (a decode step's matmul): one matmul."""
    import torch

    with torch.no_grad():
        torch.nn.functional.linear(x, w)


def _best(fn, x, w, repeats: int) -> float:
    """Best thread-CPU seconds of ``fn(x, w)`` over ``repeats`` calls after one warm-up call."""
    fn(x, w)
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        fn(x, w)
        best = min(best, time.thread_time() - start)
    return best


def measure(model: str, tokens: int = 2048, head_chunk: int = 512, repeats: int = 3) -> dict[str, Any]:
    """GFLOP/s of each linear shape of ``model`` and the whole model's matmul-only rate (6·P per trained token)."""
    import torch

    from benchmarks.sweep import model_shape

    torch.set_num_threads(1)
    torch.manual_seed(0)
    s = model_shape(model)
    h, inter, vocab = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    kv = s["num_kv_heads"] * h // s["num_heads"]
    # name: (in, out, rows, matrices of this shape per layer; 0 = the LM head)
    shapes = {
        f"q/o {h}x{h}": (h, h, tokens, 2),
        f"k/v {h}x{kv}": (h, kv, tokens, 2),
        f"gate/up {h}x{inter}": (h, inter, tokens, 2),
        f"down {inter}x{h}": (inter, h, tokens, 1),
        f"lm head {h}x{vocab} ({head_chunk}-row chunk)": (h, vocab, head_chunk, 0),
    }
    rates: dict[str, float] = {}
    fwd_rates: dict[str, float] = {}  # forward only, no autograd
    layer_s = head_s = 0.0  # seconds per token of forward + backward
    fwd_s = 0.0  # seconds per token of forward only (layers + head)
    for name, (n_in, n_out, rows, per_layer) in shapes.items():
        x = torch.randn(rows, n_in, requires_grad=True)  # (rows, in)
        w = (torch.randn(n_out, n_in) * 0.02).requires_grad_()  # (out, in)

        best = _best(_fwd_bwd, x, w, repeats)
        rates[name] = round(6 * rows * n_in * n_out / best / 1e9, 1)
        fwd_best = _best(_fwd, x, w, repeats)
        fwd_rates[name] = round(2 * rows * n_in * n_out / fwd_best / 1e9, 1)
        fwd_s += (per_layer * s["num_layers"] if per_layer else 1) * fwd_best / rows
        if per_layer:
            layer_s += per_layer * best / rows
        else:
            head_s += best / rows
    layers = s["num_layers"]
    layer_params = (2 * h * h + 2 * h * kv + 3 * h * inter) * layers
    model_flop = 6 * (layer_params + vocab * h)  # per trained token
    plain_s = layers * layer_s + head_s
    recompute_s = layers * layer_s / 3  # the layers' forward again: one of their three matmuls per weight
    return {
        "model": model,
        "tokens": tokens,
        "fwd_bwd_gflops": rates,
        "fwd_only_gflops": fwd_rates,
        "model_gflops_no_recompute": round(model_flop / plain_s / 1e9, 1),
        "model_gflops_with_recompute": round(model_flop / (plain_s + recompute_s) / 1e9, 1),
        "model_gflops_forward_only": round(model_flop / 3 / fwd_s / 1e9, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen05b")
    parser.add_argument("--tokens", type=int, default=2048, help="rows per matmul (an SFT micro-batch: 4 x 512)")
    parser.add_argument("--head-chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.model, args.tokens, args.head_chunk, args.repeats)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
