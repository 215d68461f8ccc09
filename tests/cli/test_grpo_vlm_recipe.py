"""examples/grpo_vlm.py with examples/grpo_vlm.yaml: the seed's VLM GRPO quick start (LoRA on q_proj/v_proj, the
quick start's learning rate, completion logging) runs offline on the tiny LLaVA and the generated image set."""

from __future__ import annotations

import importlib.util
import json

import yaml


def _load_recipe(repo_root):
    spec = importlib.util.spec_from_file_location("grpo_vlm_recipe", repo_root / "examples" / "grpo_vlm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_grpo_vlm_recipe_runs_two_steps(repo_root, monkeypatch, tmp_path, read_metrics):
    from posttrain import GRPOConfig, ModelConfig, ScriptArguments, TrlParser
    from posttrain.models.tiny import save_tiny_vlm

    monkeypatch.chdir(repo_root)
    model = save_tiny_vlm(tmp_path / "llava")
    out = tmp_path / "out"
    recipe = _load_recipe(repo_root)
    parser = TrlParser((ScriptArguments, GRPOConfig, ModelConfig))
    script_args, training_args, model_args = parser.parse_args_and_config(
        ["--config", "examples/grpo_vlm.yaml", "--model_name_or_path", model, "--max_steps", "2",
         "--output_dir", str(out)]
    )  # fmt: skip
    config = yaml.safe_load((repo_root / "examples" / "grpo_vlm.yaml").read_text())
    assert training_args.learning_rate == config["learning_rate"] == 1e-5  # the quick start's
    assert model_args.use_peft and training_args.log_completions
    trainer = recipe.main(script_args, training_args, model_args)
    # the data set is TRL's vision format and every row has an image
    row = trainer.train_dataset[0]
    assert row["image"] is not None and row["prompt"][1]["content"][0]["type"] == "image"
    losses = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2]
    assert any("rewards/accuracy_reward/mean" in r for r in read_metrics(out))
    adapter = json.loads((out / "adapter_config.json").read_text())
    assert set(adapter["target_modules"]) == {"q_proj", "v_proj"}
