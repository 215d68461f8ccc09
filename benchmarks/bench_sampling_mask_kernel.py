"""The threshold-form sampling mask's cost in the LM-head kernel alone (issue 40): ``chunked_logprobs_from_hidden``
forward + backward (entropy on) over ``--tokens`` positions and a 151 936-row head, without and with a threshold
mask that keeps ``--kept-frac`` of each row's vocabulary, alternated in one process; process CPU time, one thread.

    .venv/bin/python benchmarks/bench_sampling_mask_kernel.py --hidden 64 --kept-frac 0.7 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from posttrain.core.logprobs import chunked_logprobs_from_hidden
from posttrain.models.forward import auto_chunk_sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--kept-frac", type=float, default=0.7, help="share of the vocabulary above the threshold")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after one warm-up round")
    parser.add_argument("--vocab-chunk", type=int, default=None, help="head rows per block (default: automatic)")
    opts = parser.parse_args()
    if not 0.0 < opts.kept_frac <= 1.0:
        raise SystemExit(f"--kept-frac must be in (0, 1], got {opts.kept_frac}.")
    torch.set_num_threads(1)
    chunk, block = auto_chunk_sizes(opts.vocab)
    block = opts.vocab_chunk or block
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(opts.tokens, opts.hidden, generator=g) * 0.5
    weight = (torch.randn(opts.vocab, opts.hidden, generator=g) * 0.5).requires_grad_()
    with torch.no_grad():
        z = hidden @ weight.T  # (N, V)
        dropped = max(1, int(opts.vocab * (1.0 - opts.kept_frac)))
        threshold = z.kthvalue(dropped, dim=-1).values - 1e-3  # keeps ≈ kept_frac of each row
        labels = z.argmax(-1)
    del z
    mask = (torch.full((opts.tokens, 16), -1, dtype=torch.int32), threshold)

    def run(with_mask: bool) -> float:
        h = hidden.clone().requires_grad_()
        weight.grad = None
        start = time.process_time()
        logp, _ = chunked_logprobs_from_hidden(
            h, weight, labels, chunk_size=chunk, vocab_chunk_size=block, compute_entropy=True,
            sampling_mask=mask if with_mask else None,
        )  # fmt: skip
        logp.sum().backward()
        return time.process_time() - start

    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(opts.rounds + 1):
        for with_mask in (False, True) if r % 2 else (True, False):
            t = run(with_mask)
            if r:
                times[with_mask].append(t)
    off, on = statistics.median(times[False]), statistics.median(times[True])
    print(json.dumps({"bench": "sampling_mask_kernel", **vars(opts), "chunk": chunk, "block": block,
                      "cpu_s_off": round(off, 4), "cpu_s_on": round(on, 4), "ratio": round(on / off, 4)}))  # fmt: skip


if __name__ == "__main__":
    main()
