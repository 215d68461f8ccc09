"""The examples/ recipes of the experimental trainers run offline on the tiny model through
``python -m posttrain.experimental.run`` (flags shorten the run and redirect the output), and the notice."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from trainer_helpers import quiet_single_thread  # noqa: F401

from posttrain.experimental.run import METHODS, main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
def test_recipe_runs(method, tmp_path, tiny_model_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)  # the recipes name their data relative to the repository root
    monkeypatch.setenv("POSTTRAIN_NO_REPORT", "1")
    out = tmp_path / "out"
    argv = [method, "--config", f"examples/{method}.yaml", "--model_name_or_path", tiny_model_path,
            "--max_steps", "1", "--output_dir", str(out)]  # fmt: skip
    with contextlib.ExitStack() as stack:
        if method == "server_distillation":  # the teacher behind `posttrain serve` over loopback
            from posttrain.serving.app import serve_in_thread
            from posttrain.serving.engine import PosttrainEngine

            url = stack.enter_context(serve_in_thread(PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")))
            argv += ["--teacher_model_server_url", url]
        elif method == "async_distillation":  # the student's and the teacher's `posttrain serve` over loopback
            from posttrain.serving.app import serve_in_thread
            from posttrain.serving.engine import PosttrainEngine

            student, teacher = (stack.enter_context(serve_in_thread(PosttrainEngine.from_pretrained(
                tiny_model_path, device="cpu"))) for _ in range(2))  # fmt: skip
            argv += ["--vllm_server_base_url", student, "--teacher_server_urls", json.dumps({"default": teacher})]
        elif method in ("gkd", "gold", "iw_opd"):
            argv += ["--teacher_model_name_or_path", tiny_model_path]
        code = main(argv)
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "training finished after 1 steps" in captured.out
    assert (out / "model.safetensors").exists()
    recipe = yaml.safe_load((REPO / "examples" / f"{method}.yaml").read_text())
    run_config = json.loads((out / "run_config.json").read_text())
    assert run_config["learning_rate"] == pytest.approx(recipe["learning_rate"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("loss" in r for r in records)


def test_unknown_method_and_option(capsys):
    assert main(["simpo"]) == 2
    assert "choose one of: " + ", ".join(METHODS) in capsys.readouterr().err
    assert main(["cpo", "--no_such_option", "1"]) == 2
    assert "no_such_option" in capsys.readouterr().err


def _import_warns(env: dict[str, str]) -> str:
    code = "import warnings; warnings.simplefilter('always'); import posttrain.experimental"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stderr


def test_experimental_notice_and_silencing():
    env = {k: v for k, v in os.environ.items() if k != "TRL_EXPERIMENTAL_SILENCE"}
    env["PYTHONPATH"] = str(REPO)
    notice = _import_warns(env)
    assert "TRLExperimentalWarning" in notice and "TRL_EXPERIMENTAL_SILENCE=1" in notice
    assert "TRLExperimentalWarning" not in _import_warns({**env, "TRL_EXPERIMENTAL_SILENCE": "1"})
