"""Attribute a posttrain training run's peak memory to the stages of each step (generation, loss forward, backward,
optimizer step), to see where the peak over the fp32 Adam floor sits and whether it is live tensors or not.

A thread samples every ~0.5 ms: RSS (``/proc/self/statm``), its anonymous part (``/proc/self/status``) and the bytes
glibc's ``malloc`` has handed out and not got back (``mallinfo2``: ``uordblks + hblkhd``, all arenas; torch's CPU
tensors are ``malloc``-ed, so this is live tensors plus small C/Python allocations). It keeps the maximum per (step,
stage). RSS above live bytes is memory that is resident but not held by an allocation: freed heap blocks glibc keeps,
library pages, copy-on-write copies of memory-mapped weights. Linux + glibc only.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/memory_stages.py [--config grpo] [--model bigvocab] [--steps 2]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.__main__ import POSTTRAIN_PHASES, posttrain_trainer_classes, prepare_model  # noqa: E402
from benchmarks.workloads import get_workload  # noqa: E402

MIB = 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in [
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        ]
    ]


def _mallinfo2():
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class StageSampler:
    """Per-(step, stage) maxima of RSS, anonymous RSS and live ``malloc`` bytes, sampled on a thread (MiB)."""

    def __init__(self, interval_s: float = 0.0005):
        self.step, self.stage = 0, "build"
        self.peaks: dict[tuple[int, str], list[float]] = {}
        self.maxrss_growth: dict[tuple[int, str], float] = {}
        self._last_high = common.peak_rss_bytes() / MIB
        self._mallinfo = _mallinfo2()
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[float, float, float]:
        info = self._mallinfo()
        return common.current_rss_bytes() / MIB, _rss_anon_mib(), (info.uordblks + info.hblkhd) / MIB

    def _run(self) -> None:
        while not self._stop.is_set():
            values = self.sample()
            peak = self.peaks.setdefault((self.step, self.stage), [0.0, 0.0, 0.0])
            for i, v in enumerate(values):
                peak[i] = max(peak[i], v)
            time.sleep(self._interval)

    def __enter__(self) -> StageSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _close_stage(self) -> None:
        """Charge the growth of the kernel's RSS high-water mark (``ru_maxrss``) since the last boundary to the
        stage now ending: it sees spikes shorter than the sampling interval."""
        high = common.peak_rss_bytes() / MIB
        grown = self.maxrss_growth.setdefault((self.step, self.stage), 0.0)
        self.maxrss_growth[(self.step, self.stage)] = grown + max(0.0, high - self._last_high)
        self._last_high = max(self._last_high, high)

    def label(self, owner: Any, attr: str, stage: str) -> None:
        """Wrap ``owner.attr`` so its call is stage ``stage`` and the time after it ``<stage> done``."""
        func = getattr(owner, attr)

        @functools.wraps(func)
        def labelled(*args, **kwargs):
            self._close_stage()
            self.stage = stage
            try:
                return func(*args, **kwargs)
            finally:
                self._close_stage()
                self.stage = f"{stage} done"

        setattr(owner, attr, labelled)


def instrument(trainer_cls: type, sampler: StageSampler) -> None:
    """Count steps at ``training_step`` and label generation, loss forward, backward and the optimizer step."""
    original = trainer_cls.training_step

    def training_step(self, *args, **kwargs):
        sampler._close_stage()
        sampler.step += 1
        sampler.stage = "step start"
        if not getattr(self, "_stages_labelled", False):
            self._stages_labelled = True
            sampler.label(self.pipeline, "generate", "generation")
            sampler.label(self, "compute_loss", "loss forward")
            sampler.label(self.accelerator, "backward", "backward")
            sampler.label(self.optimizer, "step", "optimizer step")
        return original(self, *args, **kwargs)

    trainer_cls.training_step = training_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="grpo")
    parser.add_argument("--model", default="bigvocab")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    common.env_setup(1)
    workload = get_workload(args.config)
    classes = posttrain_trainer_classes()
    model_path = prepare_model(workload, args.model, None)
    with StageSampler() as sampler, tempfile.TemporaryDirectory() as out:
        instrument(classes[workload.trainer][1], sampler)
        record = common.execute(
            "posttrain", workload, model_path, trainer_classes=classes, phase_targets=POSTTRAIN_PHASES,
            steps=args.steps, warmup=args.warmup, model_name=args.model, output_dir=out,
        )  # fmt: skip
    loaded = record["model_loaded_rss_mib"]
    floor, params = record["adam_floor_mib"], record["model_param_mib"]
    ratio = (params + record["peak_rss_above_model_mib"]) / floor
    print(f"model loaded at {loaded} MiB RSS; params {params}, fp32 Adam floor {floor} MiB; peak ratio {ratio:.2f}")
    sampler._close_stage()
    print(
        "step | stage | peak RSS above loaded model | peak anonymous RSS | peak live malloc | ru_maxrss growth (MiB)"
    )
    for (step, stage), (rss, anon, live) in sampler.peaks.items():
        grown = sampler.maxrss_growth.get((step, stage), 0.0)
        print(f"{step} | {stage} | {rss - loaded:.1f} | {anon:.1f} | {live:.1f} | {grown:.1f}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
