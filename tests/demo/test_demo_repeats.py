"""A seeded run of the demo's GRPO stage repeats bit for bit, on an idle machine and beside a busy process.

The demo's GRPO stage (``posttrain/demo/recipes/grpo.yaml``: 8 prompts x 8 completions, the shared-prompt scoring
forward with block attention) used to drift in the last bits of the key/value gradients from one run to the next:
the block-attention gather's backward added a shared prompt's gradient rows with parallel atomic adds, in an order
set by thread timing. This test runs the stage shortened to two steps, twice from the same SFT model, the second time
beside a busy-looping process, with the default (multi-threaded) torch thread count, and compares the saved weights.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from posttrain.demo.run import MODEL_SIZE, RECIPES, _write_jsonl
from posttrain.demo.tasks import make_datasets
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

SFT_STEPS = 150  # enough for some of the first GRPO steps' groups to score unequally (a non-zero gradient)


def _posttrain(verb: str, *args: str, threads: int, timeout: float) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", verb, *args, "--write_report", "false"],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _grpo(prep: Path, out: Path) -> dict[str, torch.Tensor]:
    _posttrain(
        "grpo",
        *("--config", str(RECIPES / "grpo.yaml"), "--model_name_or_path", str(prep / "sft")),
        *("--dataset_name", str(prep / "rl.jsonl"), "--output_dir", str(out), "--seed", "0", "--max_steps", "2"),
        # at least two torch threads (the default on a 2-core machine): one thread adds in a fixed order anyway
        threads=max(2, os.cpu_count() or 1),
        timeout=900,
    )
    return load_file(str(out / "model.safetensors"))


def test_demo_grpo_stage_repeats_bit_for_bit_idle_and_under_load(tmp_path):
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model("qwen2", tokenizer=tokenizer, seed=0, **MODEL_SIZE["full"])
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    sft_rows, rl_rows, _ = make_datasets(seed=0, n_sft=SFT_STEPS * 32, eval_size=40)
    _write_jsonl(tmp_path / "sft.jsonl", sft_rows)
    _write_jsonl(tmp_path / "rl.jsonl", rl_rows)
    _posttrain(
        "sft",
        *("--config", str(RECIPES / "sft.yaml"), "--model_name_or_path", str(tmp_path / "base")),
        *("--dataset_name", str(tmp_path / "sft.jsonl"), "--output_dir", str(tmp_path / "sft"), "--seed", "0"),
        *("--max_steps", str(SFT_STEPS)),
        threads=1,  # only the starting point of the runs compared: one thread is fastest on a busy machine
        timeout=900,
    )
    sft = load_file(str(tmp_path / "sft" / "model.safetensors"))

    idle = _grpo(tmp_path, tmp_path / "idle")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaded = _grpo(tmp_path, tmp_path / "loaded")
    finally:
        busy.kill()
        busy.wait(timeout=30)

    assert any(not torch.equal(idle[name], sft[name]) for name in sft), "GRPO made no update: the test checks nothing"
    differing = [name for name in idle if not torch.equal(idle[name], loaded[name])]
    assert not differing, f"weights differ between the idle and the loaded run: {differing[:5]}"
