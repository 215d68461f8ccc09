"""Exit codes and one-paragraph error messages; ``env``, ``report`` and the top-level command."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _one_paragraph(stderr: str, prog: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith(prog)]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_unknown_option_exits_2_with_the_closest_name(run_cli):
    code, _, err = run_cli("sft", "--model_name_or_path", "m", "--learnig_rate", "1e-5")
    assert code == 2
    line = _one_paragraph(err, "posttrain sft: error:")
    assert "'learnig_rate'" in line and "did you mean 'learning_rate'" in line


def test_bad_value_exits_2(run_cli):
    code, _, err = run_cli("dpo", "--max_steps", "ten")
    assert code == 2
    assert "invalid int value: 'ten'" in _one_paragraph(err, "posttrain dpo: error:")


def test_unreadable_yaml_exits_2(run_cli, tmp_path):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model_name_or_path: [unclosed\n")
    code, _, err = run_cli("kto", "--config", recipe)
    assert code == 2
    assert "is not valid YAML" in _one_paragraph(err, "posttrain kto: error:")


def test_unknown_reward_name_lists_the_valid_ones(run_cli, tiny_model_path, prompts_jsonl):
    code, _, err = run_cli(
        "grpo", "--model_name_or_path", tiny_model_path, "--dataset_name", prompts_jsonl, "--reward_funcs", "acuracy"
    )
    assert code == 1
    line = _one_paragraph(err, "posttrain grpo: error:")
    assert "Unknown reward function 'acuracy'" in line and "accuracy_reward" in line


def test_grpo_without_any_reward(run_cli, tiny_model_path, prompts_jsonl):
    code, _, err = run_cli("rloo", "--model_name_or_path", tiny_model_path, "--dataset_name", prompts_jsonl)
    assert code == 2
    assert "needs at least one reward" in _one_paragraph(err, "posttrain rloo: error:")


def test_missing_dataset_offline(run_cli, tiny_model_path):
    code, _, err = run_cli("sft", "--model_name_or_path", tiny_model_path, "--dataset_name", "someone/not-cached")
    assert code == 1
    line = _one_paragraph(err, "posttrain sft: error:")
    assert "Could not load dataset 'someone/not-cached'" in line and "DatasetNotFoundError" in line


def test_missing_model_offline(run_cli, sft_jsonl, tmp_path):
    args = ["--model_name_or_path", "someone/not-a-model", "--dataset_name", sft_jsonl, "--output_dir", tmp_path]
    code, _, err = run_cli("sft", *args)
    assert code == 1
    line = _one_paragraph(err, "posttrain sft: error:")
    assert "Could not load model 'someone/not-a-model'" in line and "ModelNotFoundError" in line


def test_missing_model_fails_before_launching_workers(run_cli, sft_jsonl, tmp_path):
    args = ["--model_name_or_path", str(tmp_path / "nope"), "--dataset_name", sft_jsonl, "--num_processes", "2"]
    code, _, err = run_cli("sft", *args)
    assert code == 1
    assert "launching" not in err
    assert "Could not load model" in _one_paragraph(err, "posttrain sft: error:")


def test_missing_dataset_fails_before_launching_workers(run_cli, tiny_model_path, tmp_path):
    args = ["--model_name_or_path", tiny_model_path, "--dataset_name", str(tmp_path / "none.jsonl")]
    code, _, err = run_cli("sft", *args, "--num_processes", "2")
    assert code == 1
    assert "launching" not in err and "Could not load dataset" in err


def test_debug_prints_the_traceback(run_cli):
    code, _, err = run_cli("sft", "--debug", "--no_such_option", "1")
    assert code == 2
    assert "Traceback (most recent call last)" in err and "ConfigError" in err


def test_debug_with_a_value_is_the_training_option():
    from posttrain.cli.run import pop_debug_flag

    assert pop_debug_flag(["--debug", "underflow_overflow", "--x", "1"]) == (
        False,
        ["--debug", "underflow_overflow", "--x", "1"],
    )
    assert pop_debug_flag(["--x", "1", "--debug"]) == (True, ["--x", "1"])


def test_verb_whose_trainer_module_is_missing(run_cli, monkeypatch):
    monkeypatch.setitem(sys.modules, "posttrain.trainers.distillation", None)  # import now fails
    code, _, err = run_cli("distillation", "--model_name_or_path", "m")
    assert code == 1
    line = _one_paragraph(err, "posttrain distillation: error:")
    assert "needs the module posttrain.trainers.distillation" in line


def test_unexpected_errors_say_where_they_came_from():
    from posttrain.cli.run import format_error

    try:
        raise RuntimeError("boom")
    except RuntimeError as err:
        text = format_error("posttrain sft", err)
    assert text.startswith("posttrain sft: error: boom (RuntimeError). Raised at ")
    assert "test_cli_errors.py" in text and text.endswith("--debug for the full traceback.")


def test_env_reports_versions_and_accelerate_config(run_cli):
    code, out, _ = run_cli("env")
    assert code == 0
    for key in ("Python version", "PyTorch version", "Transformers version", "Accelerate version", "PEFT version"):
        assert f"- {key}: " in out
    assert "- Accelerate config: not found" in out  # the fixture hides any user default config
    assert "- vLLM version: " in out


def test_env_shows_the_default_accelerate_config(run_cli, monkeypatch, tmp_path):
    import accelerate.commands.config as accelerate_config

    config = tmp_path / "default_config.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nnum_processes: 4\n")
    monkeypatch.setattr(accelerate_config, "default_config_file", str(config))
    code, out, _ = run_cli("env")
    assert code == 0
    assert "- Accelerate config: \n  - compute_environment: LOCAL_MACHINE" in out and "  - num_processes: 4" in out


def test_report_on_a_missing_directory(run_cli, tmp_path):
    code, _, err = run_cli("report", tmp_path / "nope")
    assert code == 1
    assert "is not a directory" in _one_paragraph(err, "posttrain report: error:")


def test_top_level_help_lists_verbs_without_importing_torch():
    code = (
        "import sys, io, contextlib\n"
        "from posttrain.cli.main import main\n"
        "buf = io.StringIO()\n"
        "with contextlib.redirect_stdout(buf):\n"
        "    main([])\n"
        "assert 'torch' not in sys.modules, 'posttrain --help imported torch'\n"
        "print(buf.getvalue())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for verb in ("sft", "dpo", "kto", "reward", "grpo", "rloo", "distillation", "env", "report"):
        assert f"    {verb}" in out.stdout


@pytest.mark.parametrize("argv", [["--version"], ["nonsense"]])
def test_top_level_version_and_unknown_command(run_cli, argv):
    code, out, err = run_cli(*argv)
    if argv == ["--version"]:
        assert code == 0 and out.startswith("posttrain ")
    else:
        assert code == 2 and "invalid choice: 'nonsense'" in err


def test_script_entry_point_runs_in_process_and_ignores_launch_options(capsys, tmp_path, sft_jsonl):
    """``python -m posttrain.scripts.sft`` never launches workers; launch options only draw a warning."""
    from posttrain.cli.run import run_script

    args = ["--model_name_or_path", str(tmp_path / "nope"), "--dataset_name", sft_jsonl, "--num_processes", "2"]
    code = run_script("sft", args + ["--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 1
    assert "launch options --num_processes have no effect" in err
    assert "posttrain.scripts.sft: error: Could not load model" in err and "launching" not in err
