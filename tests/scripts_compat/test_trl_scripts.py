"""TRL 1.16's own training scripts, run unmodified apart from ``trl`` -> ``posttrain`` in their imports.

Two sources (see script_sources.py): ``trl/scripts/*.py`` from the TRL 1.16.0 release (what ``trl sft`` etc. run), and
``examples/scripts/*.py`` from the newest TRL commit available here. Each test runs one script in a subprocess on a
tiny local model and a tiny local dataset in the script's format, for 2 optimizer steps, and checks it exits 0 having
saved a model. Scripts that cannot run offline on a CPU, or whose trainer is not part of TRL 1.16, are listed in
``NOT_RUN`` with the reason; a test checks that every script of both sources is either run or listed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import script_harness as h

# A 2-step run: tiny batches, short sequences, no checkpoints, no trackers.
BUDGET = [
    "--max_steps", "2",
    "--per_device_train_batch_size", "2",
    "--gradient_accumulation_steps", "1",
    "--logging_steps", "1",
    "--save_strategy", "no",
    "--report_to", "none",
    "--seed", "0",
]
GENERATION_BUDGET = ["--num_generations", "2", "--max_completion_length", "8"]

# (source, path) -> (dataset format, extra arguments); "{model}" and "{reward_model}" are filled in per run.
RUN: dict[tuple[str, str], tuple[str, list[str]]] = {
    # ---- trl/scripts (TRL 1.16.0 release) ----
    ("trl-scripts", "trl/scripts/sft.py"): ("messages", ["--max_length", "64"]),
    ("trl-scripts", "trl/scripts/dpo.py"): ("preference", ["--max_length", "64"]),
    ("trl-scripts", "trl/scripts/kto.py"): ("unpaired", ["--max_length", "64"]),
    ("trl-scripts", "trl/scripts/reward.py"): ("preference", ["--max_length", "64"]),
    ("trl-scripts", "trl/scripts/grpo.py"): (
        "prompts", [*GENERATION_BUDGET, "--reward_funcs", "accuracy_reward", "think_format_reward"]),
    ("trl-scripts", "trl/scripts/rloo.py"): (
        "prompts", [*GENERATION_BUDGET, "--reward_funcs", "accuracy_reward", "think_format_reward"]),
    ("trl-scripts", "trl/scripts/distillation.py"): (
        "prompts", ["--teacher_model_name_or_path", "{model}", "--max_completion_length", "8",
                    "--max_length", "64"]),
    # ---- examples/scripts (TRL snapshot) ----
    ("trl-examples", "examples/scripts/sft_nemotron_3.py"): ("messages", ["--max_length", "64"]),
    ("trl-examples", "examples/scripts/kto.py"): ("unpaired", ["--max_length", "64"]),
    ("trl-examples", "examples/scripts/cpo.py"): ("preference", ["--max_length", "64"]),
    ("trl-examples", "examples/scripts/orpo.py"): ("preference", ["--max_length", "64"]),
    ("trl-examples", "examples/scripts/tpo.py"): ("triple", ["--max_length", "64"]),
    ("trl-examples", "examples/scripts/reward_modeling.py"): ("preference", ["--max_length", "64"]),
    # online_dpo.py passes its model kwargs, dtype included, to AutoTokenizer.from_pretrained; with the default
    # dtype "float32" that is a torch.dtype, which transformers 5 cannot write into tokenizer_config.json when the
    # trainer saves the tokenizer (as under TRL 1.16: no trainer code runs in between). `--dtype auto` keeps it a
    # string.
    ("trl-examples", "examples/scripts/online_dpo.py"): (
        "prompts", ["--reward_model_path", "{reward_model}", "--max_new_tokens", "8", "--max_length", "64",
                    "--dtype", "auto"]),
    ("trl-examples", "examples/scripts/gkd.py"): (
        "messages", ["--teacher_model_name_or_path", "{model}", "--max_new_tokens", "8", "--max_length", "64"]),
    ("trl-examples", "examples/scripts/gold.py"): (
        "messages", ["--teacher_model_name_or_path", "{model}", "--max_completion_length", "8",
                     "--max_length", "64"]),
    ("trl-examples", "examples/scripts/distillation.py"): (
        "prompts", ["--teacher_model_name_or_path", "{model}", "--max_completion_length", "8",
                    "--max_length", "64"]),
    ("trl-examples", "examples/scripts/grpo_continuous_batching.py"): (
        "gsm8k", [*GENERATION_BUDGET]),
    ("trl-examples", "examples/scripts/sdft.py"): ("golden", [*GENERATION_BUDGET]),
    ("trl-examples", "examples/scripts/sdpo.py"): ("gsm8k", [*GENERATION_BUDGET]),
}

# Scripts of the two sources that are not run, and why. Each reason is a fact about the script, not about posttrain.
NOT_RUN: dict[tuple[str, str], str] = {
    ("trl-scripts", "trl/scripts/__init__.py"): "package marker, not a script",
    ("trl-scripts", "trl/scripts/_hf_argparser.py"): "module (TRL's argument-parser internals), not a script",
    ("trl-scripts", "trl/scripts/utils.py"): "module (TrlParser and helpers), not a script",
    ("trl-scripts", "trl/scripts/vllm_serve.py"): "starts a vLLM server: needs vLLM and a GPU",
    ("trl-examples", "examples/scripts/dpo.py"): "stub pointing at trl/scripts/dpo.py (run above)",
    ("trl-examples", "examples/scripts/sft.py"): "stub pointing at trl/scripts/sft.py (run above)",
    ("trl-examples", "examples/scripts/rloo.py"): "hard-codes the hub dataset AI-MO/NuminaMath-TIR, the hub model "
    "Qwen/Qwen3-0.6B and vLLM colocate generation; takes no command-line arguments",
    ("trl-examples", "examples/scripts/gspo.py"): "hard-codes the hub dataset AI-MO/NuminaMath-TIR",
    ("trl-examples", "examples/scripts/async_grpo.py"): "hard-codes the hub dataset openai/gsm8k and model "
    "Qwen/Qwen3-0.6B, 200 steps and trackio; needs a generation server; takes no command-line arguments",
    ("trl-examples", "examples/scripts/grpo_agent.py"): "hard-codes the hub datasets qgallouedec/biogrid(_qa)",
    ("trl-examples", "examples/scripts/grpo_2048.py"): "plays 2048 through an OpenEnv server (network service)",
    ("trl-examples", "examples/scripts/sft_gemma3.py"): "hard-codes the hub dataset open-r1/codeforces-cots and "
    "the hub model google/gemma-3-*",
    ("trl-examples", "examples/scripts/sft_tiny_aya_tool_calling.py"): "hard-codes a hub dataset and the hub model "
    "CohereLabs/tiny-aya; pushes to the hub",
    ("trl-examples", "examples/scripts/sft_gpt_oss.py"): "loads an MXFP4-quantized gpt-oss checkpoint "
    "(Mxfp4Config(dequantize=True)); a tiny model has no MXFP4 weights",
    ("trl-examples", "examples/scripts/sft_diffusion_gemma.py"): "trains a diffusion Gemma checkpoint (hub model, "
    "model-specific heads)",
    ("trl-examples", "examples/scripts/sft_vlm.py"): "vision-language: loads a hub VLM processor and an image dataset",
    ("trl-examples", "examples/scripts/sft_vlm_gemma3.py"): "vision-language: hub Gemma 3 VLM and image dataset",
    ("trl-examples", "examples/scripts/dpo_vlm.py"): "vision-language: hub VLM processor and image dataset",
    ("trl-examples", "examples/scripts/grpo_vlm.py"): "vision-language: hard-codes the hub dataset "
    "lmms-lab/multimodal-open-r1-8k-verified",
    ("trl-examples", "examples/scripts/gspo_vlm.py"): "vision-language: hard-codes the hub dataset "
    "lmms-lab/multimodal-open-r1-8k-verified",
    ("trl-examples", "examples/scripts/rloo_vlm.py"): "vision-language: hard-codes the hub dataset "
    "lmms-lab/multimodal-open-r1-8k-verified",
    ("trl-examples", "examples/scripts/online_dpo_vlm.py"): "vision-language: hard-codes the hub dataset "
    "lmms-lab/multimodal-open-r1-8k-verified",
    ("trl-examples", "examples/scripts/mpo_vlm.py"): "vision-language: hub VLM and image preference dataset",
    # Trainers TRL 1.16 no longer ships (absent from trl/experimental in the 1.16.0 release):
    ("trl-examples", "examples/scripts/bco.py"): "BCO was removed from TRL before 1.16 (also loads the hub model "
    "bert-base-uncased)",
    ("trl-examples", "examples/scripts/nash_md.py"): "Nash-MD was removed from TRL before 1.16",
    ("trl-examples", "examples/scripts/xpo.py"): "XPO was removed from TRL before 1.16",
    ("trl-examples", "examples/scripts/prm.py"): "PRM was removed from TRL before 1.16",
    ("trl-examples", "examples/scripts/ssd.py"): "SSD was removed from TRL before 1.16",
    ("trl-examples", "examples/scripts/ssd_eval.py"): "evaluation companion of ssd.py (removed trainer)",
}


def _gsm8k_rows(n: int) -> list[dict]:
    return [{"question": f"What is {i}+1?", "answer": f"{i} plus one #### {i + 1}"} for i in range(n)]


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory) -> Path:
    # grpo_continuous_batching.py loads `dataset_config or "main"` (gsm8k's config name).
    rows = _gsm8k_rows(12)
    return Path(
        h.write_dataset(tmp_path_factory.mktemp("gsm8k"), {"train": rows[:8], "test": rows[8:]}, config_name="main")
    )


def _params():
    for (source, path), (fmt, extra) in RUN.items():
        yield pytest.param(source, path, fmt, extra, id=f"{source}:{Path(path).name}")


@pytest.mark.parametrize("source,path,fmt,extra", list(_params()))
def test_script_runs(source, path, fmt, extra, tmp_path, tiny_model_path, tiny_reward_model_path, datasets_dir,
                     gsm8k_dir):
    root = h.require_source(source)
    script = h.copy_rewritten(root / path, tmp_path / "script" / Path(path).name)
    dataset = gsm8k_dir if fmt == "gsm8k" else datasets_dir / fmt
    assert dataset.is_dir(), f"no tiny dataset {fmt!r}"
    output_dir = tmp_path / "out"
    args = [
        "--model_name_or_path", tiny_model_path,
        "--dataset_name", str(dataset),
        "--output_dir", str(output_dir),
        *BUDGET,
        *(a.format(model=tiny_model_path, reward_model=tiny_reward_model_path) for a in extra),
    ]
    h.run_script(script, args, cwd=tmp_path)
    h.assert_saved_model(output_dir)


@pytest.mark.parametrize("source,subdir", [("trl-scripts", "trl/scripts"), ("trl-examples", "examples/scripts")])
def test_every_script_is_run_or_listed(source, subdir):
    root = h.require_source(source)
    scripts = {(source, f"{subdir}/{p.name}") for p in (root / subdir).glob("*.py")}
    accounted = set(RUN) | set(NOT_RUN) | {("trl-scripts", "trl/scripts/env.py")}
    assert scripts - accounted == set(), "scripts neither run nor listed in NOT_RUN"
    assert {k for k in accounted if k[0] == source} - scripts == set(), "listed scripts missing from the source"
    assert not set(RUN) & set(NOT_RUN)


def test_env_script_prints_the_environment(tmp_path):
    """``trl env``'s script: prints the platform and library versions (optional backends through import_utils)."""
    root = h.require_source("trl-scripts")
    script = h.copy_rewritten(root / "trl/scripts/env.py", tmp_path / "env.py")
    proc = h.run_script(script, [], cwd=tmp_path, timeout=120)
    for line in ("- TRL version: ", "- PyTorch version: ", "- DeepSpeed version: ", "- vLLM version: "):
        assert line in proc.stdout, proc.stdout
