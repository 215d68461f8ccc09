"""DistillationTrainer step time and peak memory on the tiny and the big-vocabulary (151 936 rows) models.

Student: the harness's ``tiny`` / ``bigvocab`` model. Teacher: the same architecture, twice as wide (hidden 128), with
the same vocabulary, built once into the benchmark cache. Each run trains ``warmup + steps`` optimizer steps on
short arithmetic prompts (8 completions per step, up to 32 new tokens, TRL defaults otherwise: β = 1,
gradient checkpointing on) in a fresh process, and prints one JSON line.

Matrix: ``--models`` × ``--lmbdas`` (1.0 = every completion sampled from the student; 0.0 = dataset completions, no
generation) × ``--loss-paths``: ``chunked`` (posttrain's default: hidden states + LM head in chunks of tokens, no
``(B, T, V)`` logits) or ``full`` (both models' full-vocabulary logits at the completion positions, the fallback
path, forced here to show what the chunked path saves). The fields that answer the question are ``median_step_s``,
``generation_share`` and ``peak_rss_mib``.

Usage::

    .venv/bin/python benchmarks/bench_distillation.py [--steps 5] [--warmup 1] [--models tiny,bigvocab]
                                                      [--lmbdas 1.0,0.0] [--loss-paths chunked,full]

Compare ratios between runs (same machine, same moment), not absolute times.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # run as a script: make the `benchmarks` package importable
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import common  # noqa: E402

TEACHER_SPEC = {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "seed": 1}
BATCH = dict(per_device_train_batch_size=8, max_completion_length=32, temperature=1.0)


def ensure_teacher(model: str, cache_dir: str | None = None) -> str:
    """Build (once) the teacher for student ``model``: its vocabulary, twice its width; return the directory."""
    cache = Path(cache_dir or common.DEFAULT_CACHE_DIR)
    target = cache / f"{model}-distill-teacher-v{common.MODEL_CACHE_VERSION}"
    if (target / "config.json").is_file():
        return str(target)
    from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

    cache.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    spec = {k: v for k, v in common.MODEL_SPECS[model].items() if k == "vocab_size"}
    net = build_tiny_model("qwen2", tokenizer=tokenizer, **spec, **TEACHER_SPEC)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=cache))
    net.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, target)
    except OSError:  # another process won the race
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def build_dataset(n: int = 64):
    """Arithmetic prompts with reference answers (used as the dataset completions when lmbda < 1)."""
    from datasets import Dataset

    rows = []
    for i in range(n):
        a, b = 3 + 7 * i % 50, 11 + 5 * i % 40
        rows.append({"prompt": f"Question {i}: what is {a} + {b}? Answer:", "completion": f" {a} + {b} = {a + b}."})
    return Dataset.from_list(rows)


def force_full_logits() -> None:
    """Make every model take the full-logits fallback path (for the comparison only)."""
    from posttrain.models import distillation_scoring

    distillation_scoring.resolve_lm_head = lambda model: "the benchmark forces the full-logits path"


def run_one(model: str, lmbda: float, loss_path: str, steps: int, warmup: int, threads: int) -> dict:
    """One timed run (call in a fresh process so peak RSS is this run's)."""
    student_path = common.ensure_model(model, "causal-lm")
    teacher_path = ensure_teacher(model)
    common.env_setup(threads)
    from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer

    if loss_path == "full":
        force_full_logits()
    dataset = build_dataset()
    with tempfile.TemporaryDirectory(prefix="bench-distill-") as out:
        args = DistillationConfig(
            output_dir=out,
            max_steps=warmup + steps,
            lmbda=lmbda,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            bf16=False,
            seed=0,
            disable_tqdm=True,
            **BATCH,
        )
        gc.collect()
        baseline = common.current_rss_bytes()
        load = common.load_average()
        trainer = DistillationTrainer(student_path, teacher_path, args=args, train_dataset=dataset)
        timer = common.PhaseTimer()
        recorder = common.StepRecorder(phases=timer)
        trainer.add_callback(recorder.callback())
        timer.wrap(trainer.rollout, "run", "generation")
        timer.wrap(trainer, "compute_loss", "loss_forward")
        start = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - start
        peak = common.peak_rss_bytes()
    return {
        "impl": "posttrain",
        "config": "distillation",
        "trainer": "distillation",
        "model": model,
        "lmbda": lmbda,
        "loss_path": loss_path,
        "steps": len(recorder.step_seconds) - warmup,
        "warmup": warmup,
        "threads": threads,
        **recorder.summary(warmup),
        "peak_rss_mib": round((peak - baseline) / 2**20, 1),
        "baseline_rss_mib": round(baseline / 2**20, 1),
        "train_wall_s": round(wall, 3),
        "load_avg_1m": load,
        "versions": common.versions("posttrain"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="tiny,bigvocab")
    parser.add_argument("--lmbdas", default="1.0,0.0")
    parser.add_argument("--loss-paths", default="chunked,full")
    parser.add_argument("--single", nargs=3, metavar=("MODEL", "LMBDA", "LOSS_PATH"), help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.single:
        model, lmbda, loss_path = opts.single
        common.emit(run_one(model, float(lmbda), loss_path, opts.steps, opts.warmup, opts.threads))
        return
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    for model in opts.models.split(","):
        # Build the models in a child so the build never counts in a measured run's memory.
        build = f"from benchmarks import common; from benchmarks.bench_distillation import ensure_teacher; common.ensure_model({model!r}, 'causal-lm'); ensure_teacher({model!r})"  # noqa: E501
        subprocess.run([sys.executable, "-c", build], cwd=REPO_ROOT, env=env, check=True)
        for lmbda in opts.lmbdas.split(","):
            for loss_path in opts.loss_paths.split(","):
                cmd = [sys.executable, __file__, "--single", model, lmbda, loss_path, "--steps", str(opts.steps),
                       "--warmup", str(opts.warmup), "--threads", str(opts.threads)]  # fmt: skip
                done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    tail = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
                    print(json.dumps({"config": "distillation", "model": model, "lmbda": float(lmbda),
                                      "loss_path": loss_path, "error": tail[0]}), flush=True)  # fmt: skip
                    continue
                print(json.dumps(common.parse_record(done.stdout)), flush=True)


if __name__ == "__main__":
    main()
