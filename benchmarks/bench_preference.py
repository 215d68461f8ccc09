"""Step time and peak memory of the preference trainers: DPO (frozen reference copy vs PEFT adapters-disabled
reference vs precomputed reference log-probs), KTO and the reward trainer, on the tiny model and on the tiny model
with Qwen's 151 936-row vocabulary.

Each run executes in its own subprocess, because peak RSS (``resource.getrusage(...).ru_maxrss``) only ever grows
within a process. A run builds the trainer, trains ``--steps`` optimizer steps and reports the median step time after
the first (warm-up) step, the RSS before training, the peak RSS of the whole run, the trainer's reference kind and
the number of parameters held by a second model copy. One JSON line per run; compare ratios, not absolute times, on
shared machines.

    .venv/bin/python benchmarks/bench_preference.py [--steps 6] [--batch-size 4] [--models tiny big_vocab]
        [--runs dpo_full dpo_peft dpo_precompute kto reward]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

RUNS = ["dpo_full", "dpo_peft", "dpo_precompute", "kto", "reward"]
MODELS = {"tiny": None, "big_vocab": "BIG"}


def _rss_mb() -> float:
    """Current resident set size in MiB (Linux /proc; falls back to the peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return _peak_rss_mb()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is in KiB on Linux


def _dataset(kind: str, n: int):
    from datasets import Dataset

    topics = ["the sea", "a mountain", "the city at night", "an old library", "a quiet forest", "the desert"]
    prompts = [f"Write two sentences about {topics[i % len(topics)]}, number {i}." for i in range(n)]
    chosen = [" It is calm and wide; the light moves slowly over it, and everything feels patient." for _ in prompts]
    rejected = [" idk." if i % 2 else " It is a place. It is a place." for i in range(n)]
    if kind == "kto":
        return Dataset.from_dict(
            {"prompt": prompts * 2, "completion": chosen + rejected, "label": [True] * n + [False] * n}
        )
    return Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def run_one(name: str, model_kind: str, steps: int, batch_size: int) -> dict:
    import torch
    import transformers
    from transformers import TrainerCallback

    from posttrain.models.tiny import BIG_VOCAB_SIZE, save_tiny_model

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    vocab = BIG_VOCAB_SIZE if MODELS[model_kind] == "BIG" else None
    workdir = tempfile.mkdtemp(prefix="bench-pref-")
    task = "sequence-classification" if name == "reward" else "causal-lm"
    path = save_tiny_model(os.path.join(workdir, "model"), task=task, vocab_size=vocab)
    common = dict(
        output_dir=os.path.join(workdir, "out"),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        report_to="none",
        save_strategy="no",
        logging_steps=steps,
        gradient_checkpointing=False,
        write_report=False,
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    n = steps * batch_size
    kwargs = {}
    if name.startswith("dpo"):
        from posttrain.trainers.dpo import DPOConfig, DPOTrainer

        trainer_cls, args = DPOTrainer, DPOConfig(precompute_ref_log_probs=name == "dpo_precompute", **common)
        if name == "dpo_peft":
            from peft import LoraConfig

            kwargs["peft_config"] = LoraConfig(
                r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
            )
        data = _dataset("dpo", n)
    elif name == "kto":
        from posttrain.trainers.kto import KTOConfig, KTOTrainer

        trainer_cls, args, data = KTOTrainer, KTOConfig(**common), _dataset("kto", n)
    else:
        from posttrain.trainers.reward import RewardConfig, RewardTrainer

        trainer_cls, args, data = RewardTrainer, RewardConfig(**common), _dataset("reward", n)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._start)

    timer = StepTimer()
    rss_start = _rss_mb()
    trainer = trainer_cls(path, args=args, train_dataset=data, callbacks=[timer], **kwargs)
    rss_before_train = _rss_mb()
    trainer.train()
    reference = getattr(trainer, "reference", None)
    copy_params = sum(p.numel() for p in reference.model.parameters()) if reference and reference.model else 0
    timed = timer.times[1:] or timer.times
    return {
        "bench": "preference",
        "run": name,
        "model": model_kind,
        "vocab_size": trainer.model.config.vocab_size,
        "batch_size": batch_size,
        "steps": steps,
        "step_time_s": round(statistics.median(timed), 4),
        "reference": reference.kind if reference else None,
        "reference_copy_params": copy_params,
        "rss_start_mb": round(rss_start, 1),
        "rss_before_train_mb": round(rss_before_train, 1),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "torch_threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--runs", nargs="+", default=RUNS, choices=RUNS)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads in each run")
    parser.add_argument("--child", nargs=2, metavar=("RUN", "MODEL"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        if opts.threads:
            import torch

            torch.set_num_threads(opts.threads)
        print(json.dumps(run_one(opts.child[0], opts.child[1], opts.steps, opts.batch_size)), flush=True)
        return
    for model_kind in opts.models:
        for name in opts.runs:
            cmd = [sys.executable, __file__, "--child", name, model_kind, "--steps", str(opts.steps)]
            cmd += ["--batch-size", str(opts.batch_size)]
            if opts.threads:
                cmd += ["--threads", str(opts.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "POSTTRAIN_NO_REPORT": "1"})
            lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
            if out.returncode != 0 or not lines:
                error = (out.stderr.strip().splitlines() or ["no output"])[-1]
                print(
                    json.dumps({"bench": "preference", "run": name, "model": model_kind, "error": error}), flush=True
                )
            else:
                print(lines[-1], flush=True)


if __name__ == "__main__":
    main()
