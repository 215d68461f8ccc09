"""``--num_processes 2``: two worker processes (torchrun + gloo on CPU) that both train and finish.

Run as real subprocesses of ``python -m posttrain.cli.main``; each worker prints
``[posttrain <verb>] process R/2 (MULTI_CPU, ...)`` at the start and ``training finished`` at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml


def _run(args: list[str], cwd, tmp_path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "POSTTRAIN_NO_REPORT": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # a private HF_HOME hides any user-level default accelerate config
        "HF_HOME": str(tmp_path / "hf_home"),
    }
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli.main", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _assert_both_ranks_trained(result: subprocess.CompletedProcess, verb: str) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "launching 2 processes on 1 machine(s) with torchrun" in result.stderr
    for rank in (1, 2):
        assert f"[posttrain {verb}] process {rank}/2 (MULTI_CPU" in result.stdout
    assert result.stdout.count("training finished after 1 steps") == 2


@pytest.mark.slow
def test_sft_two_processes_with_flags(tmp_path, tiny_model_path, sft_jsonl):
    out = tmp_path / "out"
    result = _run(
        ["sft", "--model_name_or_path", tiny_model_path, "--dataset_name", sft_jsonl, "--output_dir", out,
         "--max_steps", "1", "--per_device_train_batch_size", "2", "--logging_steps", "1",
         "--save_strategy", "no", "--report_to", "none", "--gradient_checkpointing", "false",
         "--num_processes", "2", "--cpu"],
        cwd=tmp_path,
        tmp_path=tmp_path,
    )  # fmt: skip
    _assert_both_ranks_trained(result, "sft")
    assert (out / "model.safetensors").exists()


@pytest.mark.slow
def test_grpo_two_processes_from_a_recipe(tmp_path, repo_root, tiny_model_path, read_metrics):
    """The examples/grpo.yaml recipe with the launch option in the YAML itself (`num_processes: 2`)."""
    recipe = yaml.safe_load((repo_root / "examples" / "grpo.yaml").read_text())
    out = tmp_path / "out"
    recipe.update(
        model_name_or_path=tiny_model_path,
        output_dir=str(out),
        max_steps=1,
        max_completion_length=8,
        num_processes=2,
        cpu=True,
    )
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = _run(["grpo", "--config", path], cwd=repo_root, tmp_path=tmp_path)
    _assert_both_ranks_trained(result, "grpo")
    records = read_metrics(out)
    assert any("reward" in r for r in records)  # rank 0 logged the gathered rewards
