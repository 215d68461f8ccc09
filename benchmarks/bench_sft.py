"""SFT throughput and memory: packing on/off × chunked vs full-logits loss, on the tiny model and on the tiny model
with Qwen2.5's 151 936-row vocabulary.

Each run executes in a fresh subprocess (peak RSS only ever grows within a process). A run builds ``SFTTrainer`` on a
dataset of varied-length texts, trains ``--steps`` optimizer steps and reports tokens/s (growth of the ``num_tokens``
metric over the steps after the warm-up step), the median step time, the peak RSS of the run
(``resource.getrusage``) and the RSS growth from just before the trainer was built. One JSON line per run; on a
shared machine compare ratios between runs, not absolute numbers (every record carries the load average).

    .venv/bin/python benchmarks/bench_sft.py [--steps 6] [--batch-size 4] [--max-length 512]
        [--models tiny bigvocab] [--packing off on] [--loss-types chunked_nll nll] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402  (the repository root must be importable first)
    StepRecorder,
    current_rss_bytes,
    emit,
    ensure_model,
    env_setup,
    load_average,
    parse_record,
    peak_rss_bytes,
    versions,
)

MODELS = ("tiny", "bigvocab")
WORDS = [
    "the",
    "a",
    "sky",
    "is",
    "blue",
    "grass",
    "green",
    "snow",
    "white",
    "river",
    "runs",
    "to",
    "sea",
    "under",
    "old",
    "bridge",
    "near",
    "quiet",
    "town",
    "at",
    "night",
]


def _texts(n: int, seed: int = 0) -> list[str]:
    """``n`` texts of 10–120 words (≈ 50–600 byte tokens): a length spread that gives padding something to waste."""
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 120))) + "." for _ in range(n)]


def run_one(model: str, packing: bool, loss_type: str, steps: int, batch_size: int, max_length: int) -> dict:
    from datasets import Dataset

    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    path = ensure_model(model)
    workdir = tempfile.mkdtemp(prefix="bench-sft-")
    args = SFTConfig(
        output_dir=os.path.join(workdir, "out"),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        packing=packing,
        max_length=max_length,
        loss_type=loss_type,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        write_report=False,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    data = Dataset.from_dict({"text": _texts(steps * batch_size * (4 if packing else 1))})
    recorder = StepRecorder()
    rss_start = current_rss_bytes()
    trainer = SFTTrainer(path, args=args, train_dataset=data, callbacks=[recorder.callback()])
    trainer.train()
    import torch

    return {
        "bench": "sft",
        "model": model,
        "vocab_size": trainer.model.config.vocab_size,
        "packing": packing,
        "padding_free": trainer.padding_free,
        "loss_type": loss_type,
        "batch_size": batch_size,
        "max_length": max_length,
        "steps": steps,
        **recorder.summary(warmup=1),
        "peak_rss_mb": round(peak_rss_bytes() / 2**20, 1),
        "rss_growth_mb": round((peak_rss_bytes() - rss_start) / 2**20, 1),
        "torch_threads": torch.get_num_threads(),
        "load_average": load_average(),
        "versions": versions("posttrain"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--packing", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument(
        "--loss-types", nargs="+", default=["chunked_nll", "nll"], choices=["chunked_nll", "nll", "dft"]
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (1 = stable on shared CPUs)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        env_setup(opts.threads)
        spec = json.loads(opts.child)
        emit(run_one(spec["model"], spec["packing"], spec["loss_type"], opts.steps, opts.batch_size, opts.max_length))
        return
    for model in opts.models:
        ensure_model(model)  # build once, outside the measured runs
        for packing in opts.packing:
            for loss_type in opts.loss_types:
                spec = {"model": model, "packing": packing == "on", "loss_type": loss_type}
                cmd = [sys.executable, __file__, "--child", json.dumps(spec), "--steps", str(opts.steps)]
                cmd += ["--batch-size", str(opts.batch_size), "--max-length", str(opts.max_length)]
                cmd += ["--threads", str(opts.threads)]
                out = subprocess.run(
                    cmd, capture_output=True, text=True, env={**os.environ, "POSTTRAIN_NO_REPORT": "1"}
                )
                try:
                    emit(parse_record(out.stdout))
                except ValueError:
                    error = (out.stderr.strip().splitlines() or ["no output"])[-1]
                    emit({"bench": "sft", **spec, "error": error})


if __name__ == "__main__":
    main()
