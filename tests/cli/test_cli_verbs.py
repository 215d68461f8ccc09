"""Every training verb end-to-end on the offline tiny models: the examples/ recipes, flags, mixtures, rewards."""

from __future__ import annotations

import dataclasses
import importlib
import json
from types import SimpleNamespace

import pytest
import yaml

TRAINING_VERBS = ["sft", "dpo", "kto", "reward", "grpo", "rloo"]


def _has_module(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as err:
        if err.name == name:
            return False
        raise
    return True


@pytest.mark.parametrize("verb", TRAINING_VERBS)
def test_example_recipe_runs_with_flag_overrides(
    verb, run_cli, repo_root, monkeypatch, tmp_path, tiny_model_path, tiny_reward_model_path, read_metrics
):
    """examples/<verb>.yaml unchanged apart from the model path; flags shorten the run and redirect the output."""
    monkeypatch.chdir(repo_root)  # the recipes name their data relative to the repository root
    model = tiny_reward_model_path if verb == "reward" else tiny_model_path
    out = tmp_path / "out"
    extra = {"dpo": ["--ignore_bias_buffers", "true"]}.get(verb, [])
    code, stdout, stderr = run_cli(
        verb, "--config", f"examples/{verb}.yaml", "--model_name_or_path", model, "--max_steps", "1",
        "--output_dir", out, *extra,
    )  # fmt: skip
    assert code == 0, stderr
    assert f"[posttrain {verb}] process 1/1" in stdout
    assert "training finished after 1 steps" in stdout
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    assert any("loss" in record for record in read_metrics(out))
    recipe = yaml.safe_load((repo_root / "examples" / f"{verb}.yaml").read_text())
    run_config = json.loads((out / "run_config.json").read_text())
    assert run_config["learning_rate"] == pytest.approx(recipe["learning_rate"])  # from the recipe
    assert run_config["max_steps"] == 1 and run_config["output_dir"] == str(out)  # flags win


def test_distillation_verb(run_cli, repo_root, monkeypatch, tmp_path, tiny_model_path):
    monkeypatch.chdir(repo_root)
    args = ["distillation", "--config", "examples/distillation.yaml", "--model_name_or_path", tiny_model_path]
    args += ["--teacher_model_name_or_path", tiny_model_path, "--max_steps", "1", "--output_dir", tmp_path / "out"]
    code, stdout, stderr = run_cli(*args)
    if _has_module("posttrain.trainers.distillation"):
        assert code == 0, stderr
        assert "training finished after 1 steps" in stdout
    else:  # the verb exists before its trainer does: one line saying so
        assert code == 1
        assert "posttrain.trainers.distillation" in stderr and len(stderr.strip().splitlines()) == 1


def test_sft_with_flags_only_lora_and_report(run_cli, tmp_path, tiny_model_path, sft_jsonl, read_metrics):
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(
        "sft", "--model_name_or_path", tiny_model_path, "--dataset_name", sft_jsonl, "--output_dir", out,
        "--max_steps", "2", "--per_device_train_batch_size", "2", "--logging_steps", "1", "--learning_rate", "1e-3",
        "--save_strategy", "no", "--report_to", "none", "--gradient_checkpointing", "false",
        "--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj",
    )  # fmt: skip
    assert code == 0, stderr
    assert "training finished after 2 steps" in stdout
    adapter = json.loads((out / "adapter_config.json").read_text())  # ModelConfig's LoRA options reached the trainer
    assert adapter["r"] == 4 and set(adapter["target_modules"]) == {"q_proj", "v_proj"}
    assert "[step 2/2]" in stdout  # RichProgressCallback's plain lines (stdout is not a terminal here)
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2]
    code, stdout, stderr = run_cli("report", out)
    assert code == 0, stderr
    assert stdout.strip().endswith("index.html") and (out / "report" / "index.html").exists()


def test_sft_on_a_dataset_mixture(run_cli, tmp_path, tiny_model_path, sft_jsonl, write_jsonl):
    other = write_jsonl(tmp_path / "text.jsonl", [{"text": f"line {i}"} for i in range(6)])
    sft_as_text = write_jsonl(tmp_path / "more.jsonl", [{"text": f"more {i}"} for i in range(6)])
    recipe = tmp_path / "mixture.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model_name_or_path": tiny_model_path,
                "datasets": [{"path": other, "fraction": 0.5}, {"path": sft_as_text, "fraction": 0.5}],
                "test_split_size": 0.25,
                "eval_strategy": "steps",
                "eval_steps": 1,
                "max_steps": 1,
                "report_to": "none",
                "save_strategy": "no",
                "output_dir": str(tmp_path / "out"),
            }
        )
    )
    code, stdout, stderr = run_cli("sft", "--config", recipe)
    assert code == 0, stderr
    assert "training finished after 1 steps" in stdout


def test_grpo_dotted_reward_and_reward_model(
    run_cli, tmp_path, monkeypatch, tiny_model_path, tiny_reward_model_path, prompts_jsonl, read_metrics
):
    """--reward_funcs takes registry names and dotted paths from the working directory; the reward model is first."""
    (tmp_path / "my_rewards.py").write_text(
        "def length_reward(completions, **kwargs):\n    return [float(len(str(c))) for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    code, _, stderr = run_cli(
        "grpo", "--model_name_or_path", tiny_model_path, "--dataset_name", prompts_jsonl,
        "--reward_funcs", "my_rewards.length_reward", "think_format_reward",
        "--reward_model_name_or_path", tiny_reward_model_path, "--num_generations", "2",
        "--per_device_train_batch_size", "2", "--max_completion_length", "4", "--max_steps", "1",
        "--logging_steps", "1", "--output_dir", out, "--report_to", "none", "--save_strategy", "no",
        "--gradient_checkpointing", "false",
    )  # fmt: skip
    assert code == 0, stderr
    keys = {k for record in read_metrics(out) for k in record}
    assert "rewards/length_reward/mean" in keys and "rewards/think_format_reward/mean" in keys
    model_keys = [k for k in keys if k.startswith("rewards/") and k.endswith("/mean")]
    assert len(model_keys) == 3  # the reward model got its own column too


@pytest.mark.parametrize("verb", [*TRAINING_VERBS, "distillation"])
def test_help_lists_every_option_with_default(verb):
    from posttrain.cli.run import TrainerUnavailableError, make_verb_parser

    if verb == "distillation" and not _has_module("posttrain.trainers.distillation"):
        with pytest.raises(TrainerUnavailableError, match="posttrain.trainers.distillation"):
            make_verb_parser(verb)
        return
    parser = make_verb_parser(verb)
    text = parser.format_help()
    for dtype in parser.dataclass_types:
        for f in dataclasses.fields(dtype):
            if f.init:
                assert f"--{f.name}" in text, f"{dtype.__name__}.{f.name} missing from --help"
    # every option has a help text and shows its default
    for action in parser._actions:
        if action.option_strings and action.dest not in ("help",):
            assert action.help and action.help.strip(), action.dest
    assert text.count("(default:") >= len(parser.field_names()) - 5
    assert "--accelerate_config" in text and "--num_processes" in text


def test_verb_help_through_the_entry_point(run_cli):
    code, stdout, _ = run_cli("grpo", "--help")
    assert code == 0
    assert "--reward_funcs" in stdout and "--num_generations" in stdout and "launch options:" in stdout


def test_yaml_and_flags_give_the_same_configs(tmp_path):
    """For every verb, a recipe and the equivalent flags parse to equal dataclasses."""
    from posttrain.cli.run import make_verb_parser

    for verb in TRAINING_VERBS:
        values = {"model_name_or_path": "m", "dataset_name": "d.jsonl", "max_steps": 3, "learning_rate": 0.5}
        values["gradient_checkpointing"] = False
        if verb in ("grpo", "rloo"):
            values.update(reward_funcs=["accuracy_reward", "think_format_reward"], num_generations=2)
        recipe = tmp_path / f"{verb}.yaml"
        recipe.write_text(yaml.safe_dump(values))
        flags = []
        for key, value in values.items():
            flags += [f"--{key}", *(map(str, value) if isinstance(value, list) else [str(value)])]
        from_yaml = make_verb_parser(verb).parse_namespace_and_config(["--config", str(recipe)])
        from_flags = make_verb_parser(verb).parse_namespace_and_config(flags)
        assert from_yaml == from_flags, verb


def test_load_datasets_rules(tmp_path, write_jsonl, caplog):
    from posttrain.cli.configs import ScriptArguments
    from posttrain.cli.parser import ConfigError
    from posttrain.data.loading import DatasetMixtureConfig
    from posttrain.scripts._common import load_datasets

    a = write_jsonl(tmp_path / "a.jsonl", [{"text": str(i)} for i in range(4)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": str(i)} for i in range(6)])
    no_eval, with_eval = SimpleNamespace(eval_strategy="no"), SimpleNamespace(eval_strategy="steps")

    with pytest.raises(ConfigError, match="No dataset given"):
        load_datasets(ScriptArguments(), no_eval, DatasetMixtureConfig())
    train, evaluation = load_datasets(ScriptArguments(dataset_name=a), no_eval)
    assert len(train) == 4 and evaluation is None
    with pytest.raises(ConfigError, match="no split 'test'.*test_split_size"):
        load_datasets(ScriptArguments(dataset_name=a), with_eval)
    mixture = DatasetMixtureConfig(datasets=[{"path": a}, {"path": b}], test_split_size=2)
    with caplog.at_level("WARNING", logger="posttrain.scripts"):
        train, evaluation = load_datasets(ScriptArguments(dataset_name=a), with_eval, mixture)
    assert len(train) == 8 and len(evaluation) == 2  # the mixture wins over dataset_name
    assert "ignoring dataset_name" in caplog.text
