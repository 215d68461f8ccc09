"""open-r1's and alignment-handbook's entry points, run with their own YAML recipes against posttrain.

The entry point and its package (``open_r1`` / ``alignment``) get the same ``trl`` -> ``posttrain`` import rewrite as
TRL's scripts, nothing else. Each recipe is loaded and changed in three ways only, all listed in ``override``:

* paths: the model becomes a tiny local model; every dataset (``dataset_name`` or each ``dataset_mixture`` entry)
  becomes a local dataset with the recipe's config and split names and the columns it selects; ``output_dir`` a
  temporary directory;
* budget: 2 steps, batches of 2, sequences of at most 64 tokens, 2 generations of 8 tokens, one data process, no
  checkpoints, no trackers, no hub pushes;
* hardware this CPU-only run cannot honour: bf16 mixed precision, FlashAttention, 4-bit loading, paged 8-bit
  optimizers, Liger kernels and vLLM are turned off.

Every other key — including the ones TRL 1.x or transformers 5 renamed (``torch_dtype``, ``max_seq_length``,
``max_prompt_length``, ``warmup_ratio``, ``overwrite_output_dir``, ...) — is passed through as written.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import script_harness as h
import yaml

# (source, entry point script, the package directory it imports, recipe glob)
ENTRY_POINTS = {
    "alignment-handbook:sft": ("alignment-handbook", "scripts/sft.py", "src/alignment", "recipes/*/sft/*.yaml"),
    "alignment-handbook:dpo": ("alignment-handbook", "scripts/dpo.py", "src/alignment", "recipes/*/dpo/*.yaml"),
    "alignment-handbook:orpo": ("alignment-handbook", "scripts/orpo.py", "src/alignment", "recipes/*/orpo/*.yaml"),
    "open-r1:sft": ("open-r1", "src/open_r1/sft.py", "src/open_r1", "recipes/*/sft/*.yaml"),
    "open-r1:grpo": ("open-r1", "src/open_r1/grpo.py", "src/open_r1", "recipes/*/grpo/*.yaml"),
}

# Third-party modules an entry point imports (its project's own dependencies, not posttrain's). open-r1's rewards
# module imports its code-execution clients: its guard `transformers.utils.import_utils._is_package_available("e2b")`
# returns a (bool, version) tuple under transformers 5, which is always true, so e2b and morphcloud are imported even
# when no recipe uses them.
REQUIRES = {
    "open-r1:grpo": ["e2b_code_interpreter", "morphcloud", "async_lru", "aiohttp", "aiofiles", "dotenv", "requests",
                     "math_verify", "latex2sympy2_extended"],
}

# What makes them importable (checked: open-r1's three runnable GRPO recipes pass with these installed).
INSTALL_HINT = {
    "open-r1:grpo": "pip install e2b-code-interpreter morphcloud==0.1.67 async-lru aiofiles python-dotenv "
                    "latex2sympy2_extended math-verify (morphcloud pinned as open-r1 pins it: newer ones lack "
                    "morphcloud.sandbox)",
}

# The recipes of the pinned commits (see script_sources.py), per entry point.
RECIPES = {
    "alignment-handbook:sft": [
        "constitutional-ai/sft/config_anthropic.yaml",
        "constitutional-ai/sft/config_grok.yaml",
        "smollm/sft/config.yaml",
        "smollm2/sft/config.yaml",
        "smollm2/sft/config_smol.yaml",
        "smollm3/sft/mid.yaml",
        "smollm3/sft/sft.yaml",
        "starchat2-15b/sft/config_v0.1.yaml",
        "zephyr-7b-beta/sft/config_full.yaml",
        "zephyr-7b-beta/sft/config_qlora.yaml",
        "zephyr-7b-gemma/sft/config_full.yaml",
    ],
    "alignment-handbook:dpo": [
        "constitutional-ai/dpo/config_anthropic.yaml",
        "pref_align_scan/dpo/config_openhermes.yaml",
        "pref_align_scan/dpo/config_zephyr.yaml",
        "smollm2/dpo/config.yaml",
        "smollm2/dpo/config_smol.yaml",
        "smollm3/dpo/apo.yaml",
        "starchat2-15b/dpo/config_v0.1.yaml",
        "zephyr-7b-beta/dpo/config_full.yaml",
        "zephyr-7b-beta/dpo/config_qlora.yaml",
        "zephyr-7b-gemma/dpo/config_full.yaml",
    ],
    "alignment-handbook:orpo": ["zephyr-141b-A35b/orpo/config_full.yaml"],
    "open-r1:sft": [
        "OlympicCoder-32B/sft/config_v00.00.yaml",
        "OlympicCoder-7B/sft/config_v00.00.yaml",
        "OpenR1-Distill-7B/sft/config_distill.yaml",
    ],
    "open-r1:grpo": [
        "DeepSeek-R1-Distill-Qwen-1.5B/grpo/config_demo.yaml",
        "Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml",
        "Qwen2.5-1.5B-Instruct/grpo/config_demo_code.yaml",
        "Qwen2.5-1.5B-Instruct/grpo/config_demo_code_ioi.yaml",
        "Qwen2.5-Coder-7B-Instruct/grpo/config_codeforces.yaml",
    ],
}

# Recipes that are not run, and why (a fact about the recipe, not about posttrain).
NOT_RUN = {
    ("alignment-handbook:dpo", "pref_align_scan/dpo/config_openhermes.yaml"): "sets `hub_model_revision`, a field "
    "alignment-handbook's DPOConfig no longer has (its own parser rejects it, under TRL as here)",
    ("alignment-handbook:dpo", "pref_align_scan/dpo/config_zephyr.yaml"): "sets `hub_model_revision`, a field "
    "alignment-handbook's DPOConfig no longer has (its own parser rejects it, under TRL as here)",
    ("alignment-handbook:dpo", "zephyr-7b-beta/dpo/config_qlora.yaml"): "uses `dataset_mixer` / `dataset_splits`, "
    "alignment-handbook's own pre-0.4 keys that its ScriptArguments replaced with `dataset_mixture`",
    ("open-r1:grpo", "Qwen2.5-1.5B-Instruct/grpo/config_demo_code.yaml"): "its `code` reward runs the completions "
    "in an E2B cloud sandbox (network service and API key)",
    ("open-r1:grpo", "Qwen2.5-1.5B-Instruct/grpo/config_demo_code_ioi.yaml"): "its `ioi_code` reward scores "
    "completions on a Piston/Morph execution server (network service)",
    ("open-r1:grpo", "Qwen2.5-Coder-7B-Instruct/grpo/config_codeforces.yaml"): "its `cf_code` reward scores "
    "completions on a Piston/Morph execution server (network service)",
}

# One recipe per entry point runs by default; the others are marked slow.
DEFAULT = {
    "alignment-handbook:sft": "zephyr-7b-beta/sft/config_full.yaml",
    "alignment-handbook:dpo": "zephyr-7b-beta/dpo/config_full.yaml",
    "alignment-handbook:orpo": "zephyr-141b-A35b/orpo/config_full.yaml",
    "open-r1:sft": "OpenR1-Distill-7B/sft/config_distill.yaml",
    "open-r1:grpo": "Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml",
}

# Budget: set when the recipe has the key (the value keeps the recipe's key name, renamed or not).
BUDGET_IF_PRESENT = {
    "per_device_train_batch_size": 2,
    "per_device_eval_batch_size": 2,
    "gradient_accumulation_steps": 1,
    "max_length": 64,
    "max_seq_length": 64,
    "max_prompt_length": 32,
    "max_completion_length": 8,
    "num_generations": 2,
    "eval_steps": 1,
    "logging_steps": 1,
    "dataset_num_proc": None,
}
BUDGET_ALWAYS = {
    "max_steps": 2,
    "save_strategy": "no",
    "report_to": "none",
    "push_to_hub": False,
}
# Hardware a CPU-only run cannot honour.
HARDWARE_IF_PRESENT = {
    "bf16": False,
    "attn_implementation": None,
    "load_in_4bit": False,
    "load_in_8bit": False,
    "use_liger_kernel": False,
    "use_liger": False,
    "use_vllm": False,
}
CPU_OPTIMIZERS = {"paged_adamw_8bit": "adamw_torch", "adamw_bnb_8bit": "adamw_torch", "adamw_torch_fused": "adamw_torch"}


def _rows_for_columns(columns: list[str] | None, n: int) -> list[dict]:
    cols = set(columns or ["messages"])
    # smoltalk2's per-row chat-template options (SmolLM3's `enable_thinking`); the tiny ChatML template ignores them.
    extra = {"chat_template_kwargs": {"enable_thinking": False}} if "chat_template_kwargs" in cols else {}
    cols.discard("chat_template_kwargs")
    if cols <= {"messages"}:
        rows = h.messages_rows(n)
    elif cols <= {"chosen", "rejected"}:
        rows = h.implicit_preference_rows(n)
    elif cols <= {"prompt", "chosen", "rejected"}:
        rows = h.preference_rows(n)
    elif cols <= {"problem", "solution", "messages"}:
        rows = h.problem_rows(n)
    else:
        raise AssertionError(f"no tiny dataset for columns {sorted(cols)}")
    return [{**row, **extra} for row in rows]


def override(recipe: dict, *, model: str, output_dir: str, data_root: Path, kind: str) -> dict:
    """The recipe with its paths, budget and CPU-incompatible hardware switches replaced (see module docstring);
    writes the local datasets it points at under ``data_root``."""
    config = dict(recipe)
    config["model_name_or_path"] = model
    config["output_dir"] = output_dir
    for key, value in BUDGET_IF_PRESENT.items():
        if key in config:
            config[key] = value
    config.update(BUDGET_ALWAYS)
    for key, value in HARDWARE_IF_PRESENT.items():
        if key in config:
            config[key] = value
    if config.get("optim") in CPU_OPTIMIZERS:
        config["optim"] = CPU_OPTIMIZERS[config["optim"]]
    # Every dataset of the recipe becomes a local directory with the same config and split names.
    splits: dict[tuple[str, str | None], dict[str, list[dict]]] = {}
    if config.get("dataset_mixture"):
        mixture = dict(config["dataset_mixture"])
        entries = []
        for entry in mixture["datasets"]:
            entry = dict(entry)
            key = (entry["id"], entry.get("config"))
            splits.setdefault(key, {})[entry.get("split", "train")] = _rows_for_columns(entry.get("columns"), 12)
            entry["id"] = str(data_root / f"mix{list(splits).index(key)}")
            entries.append(entry)
        mixture["datasets"] = entries
        if isinstance(mixture.get("test_split_size"), int) and mixture["test_split_size"] > 1:
            mixture["test_split_size"] = 4
        config["dataset_mixture"] = mixture
        for index, ((_, cfg), split_rows) in enumerate(splits.items()):
            h.write_dataset(data_root / f"mix{index}", split_rows, config_name=cfg)
    else:
        columns = ["problem", "solution", "messages"] if kind == "grpo" else None
        rows = h.implicit_preference_rows(12) if kind in ("dpo", "orpo") else _rows_for_columns(columns, 12)
        train = config.get("dataset_train_split", "train")
        test = config.get("dataset_test_split", "test")
        config["dataset_name"] = h.write_dataset(
            data_root / "data", {train: rows[:8], test: rows[8:]}, config_name=config.get("dataset_config")
        )
    return config


def _params():
    for entry, recipes in RECIPES.items():
        for recipe in recipes:
            if (entry, recipe) in NOT_RUN:
                continue
            marks = [] if DEFAULT[entry] == recipe else [pytest.mark.slow]
            yield pytest.param(entry, recipe, id=f"{entry}:{recipe}", marks=marks)


@pytest.mark.parametrize("entry,recipe", list(_params()))
def test_recipe_runs(entry, recipe, tmp_path, tiny_model_path):
    source, script_path, package, _ = ENTRY_POINTS[entry]
    root = h.require_source(source)
    missing = [m for m in REQUIRES.get(entry, []) if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{entry} imports {', '.join(missing)} ({source}'s own dependencies), not installed here; "
                    f"{INSTALL_HINT.get(entry, '')}")
    work = tmp_path / "work"
    src = work / "src"
    h.copy_rewritten(root / package, src / Path(package).name)
    script = h.copy_rewritten(root / script_path, work / Path(script_path).name)
    config = override(
        yaml.safe_load((root / "recipes" / recipe).read_text()),
        model=tiny_model_path,
        output_dir=str(tmp_path / "out"),
        data_root=tmp_path / "datasets",
        kind=entry.split(":")[1],
    )
    config_path = work / "recipe.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    h.run_script(script, ["--config", str(config_path)], cwd=work, extra_pythonpath=[str(src)])
    h.assert_saved_model(tmp_path / "out")


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_recipe_is_run_or_listed(entry):
    source, _, _, pattern = ENTRY_POINTS[entry]
    root = h.require_source(source)
    found = {str(p.relative_to(root / "recipes")) for p in root.glob(pattern)}
    assert found == set(RECIPES[entry])
    assert {r for e, r in NOT_RUN if e == entry} <= found
