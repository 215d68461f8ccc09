"""Run third-party TRL training scripts against posttrain: import rewrite, tiny local data, one subprocess per run.

A script is copied into a temporary directory with one mechanical change — its ``trl`` imports become ``posttrain``
imports (``from trl.x import y`` -> ``from posttrain.x import y``, ``import trl`` -> ``import posttrain as trl``) — and
run as ``python script.py ARGS`` with this checkout first on ``PYTHONPATH``, offline, on the CPU. Everything else in
the script stays as written; a failure is posttrain's to explain.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from script_sources import FETCH_HINT, SOURCES, source_dir

REPO_ROOT = Path(__file__).resolve().parents[2]

_FROM_TRL = re.compile(r"^(\s*)from trl(\.[\w.]+)? import ", re.MULTILINE)
_IMPORT_TRL = re.compile(r"^(\s*)import trl\s*$", re.MULTILINE)
_OTHER_TRL_IMPORT = re.compile(r"^\s*(import trl\b|from trl\b)", re.MULTILINE)


def rewrite_trl_imports(text: str) -> str:
    """Replace the ``trl`` imports of a script with ``posttrain`` imports; nothing else changes.

    Raises on an import form the rewrite does not handle (``import trl.x``, ``import trl as t``), so a new form in a
    fetched script is noticed rather than left importing a ``trl`` that may not exist here.
    """
    text = _FROM_TRL.sub(lambda m: f"{m.group(1)}from posttrain{m.group(2) or ''} import ", text)
    text = _IMPORT_TRL.sub(lambda m: f"{m.group(1)}import posttrain as trl", text)
    leftover = _OTHER_TRL_IMPORT.findall(text)
    if leftover:
        raise AssertionError(f"unhandled trl import form(s): {leftover}")
    return text


def require_source(name: str) -> Path:
    """The fetched tree of ``SOURCES[name]``; skips the test (naming the fetch command) when it is absent."""
    path = source_dir(name)
    if path is None:
        pytest.skip(f"{SOURCES[name].origin} not fetched; run {FETCH_HINT}")
    return path


def copy_rewritten(src: Path, dest: Path) -> Path:
    """Copy a file or a package directory to ``dest``, rewriting the trl imports of every ``.py`` file."""
    if src.is_dir():
        for path in sorted(src.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                copy_rewritten(path, dest / path.relative_to(src))
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if src.suffix == ".py":
        dest.write_text(rewrite_trl_imports(src.read_text()))
    else:
        shutil.copyfile(src, dest)
    return dest


def script_env(cache_dir: Path, extra_pythonpath: list[str] | None = None) -> dict[str, str]:
    """The environment of a script run: offline, CPU-only, single-threaded, no trackers, and a private datasets
    cache (``datasets`` keys local JSON builds by file name and content fingerprint; a shared cache could hand one
    run another's build)."""
    env = dict(os.environ)
    paths = [str(REPO_ROOT), *(extra_pythonpath or [])]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_DISABLED="true",
        WANDB_MODE="disabled",
        TRL_EXPERIMENTAL_SILENCE="1",
        POSTTRAIN_NO_REPORT="1",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONWARNINGS="ignore::FutureWarning",
        HF_DATASETS_CACHE=str(cache_dir),
    )
    return env


def run_script(
    script: Path,
    args: list[str],
    cwd: Path,
    timeout: float = 240,
    extra_pythonpath: list[str] | None = None,
) -> subprocess.CompletedProcess:
    """Run ``python script ARGS`` in ``cwd``; fail the test with the output's tail when it exits non-zero."""
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        cwd=cwd,
        env=script_env(Path(cwd) / ".datasets-cache", extra_pythonpath),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        tail = (proc.stdout[-3000:] + "\n--- stderr ---\n" + proc.stderr[-6000:]).strip()
        pytest.fail(f"{script.name} {' '.join(map(str, args))}\nexited {proc.returncode}:\n{tail}", pytrace=False)
    return proc


def assert_saved_model(output_dir: Path) -> None:
    """The run ended by saving a model (full weights or a PEFT adapter) into ``output_dir``."""
    names = {p.name for p in Path(output_dir).iterdir()} if Path(output_dir).is_dir() else set()
    assert names & {"model.safetensors", "adapter_model.safetensors", "pytorch_model.bin"}, (
        f"no saved model in {output_dir}: {sorted(names)}"
    )


def write_dataset(directory: Path, splits: dict[str, list[dict]], config_name: str | None = None) -> str:
    """Write ``splits`` as JSON-lines files that ``datasets.load_dataset(directory)`` loads as a ``DatasetDict``.

    Split names other than train/test/validation (``train_sft``, ``test_prefs``, ...) are declared in a dataset card,
    as on the Hub, so ``load_dataset(directory, "default", split="train_sft")`` works as it does for the original.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        with open(directory / f"{split}.jsonl", "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    lines = ["---", "configs:", f"- config_name: {config_name or 'default'}", "  data_files:"]
    for split in splits:
        lines += [f"  - split: {split}", f"    path: {split}.jsonl"]
    lines += ["---", ""]
    (directory / "README.md").write_text("\n".join(lines))
    return str(directory)


# ---------------------------------------------------------------------------------------------------------------
# Tiny datasets in TRL's formats. Numbers keep every row distinct and short (the tiny tokenizer is byte-level).
# ---------------------------------------------------------------------------------------------------------------


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def messages_rows(n: int) -> list[dict]:
    return [
        {"messages": [{"role": "user", "content": f"What is {i}+{i}?"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(n)
    ]


def preference_rows(n: int) -> list[dict]:
    """Conversational preference (prompt / chosen / rejected)."""
    return [
        {"prompt": _user(f"What is {i}+1?"), "chosen": _assistant(str(i + 1)), "rejected": _assistant(str(i + 7))}
        for i in range(n)
    ]


def implicit_preference_rows(n: int) -> list[dict]:
    """Conversational preference with the prompt inside chosen/rejected (UltraFeedback-binarized style)."""
    return [
        {
            "chosen": _user(f"What is {i}+1?") + _assistant(str(i + 1)),
            "rejected": _user(f"What is {i}+1?") + _assistant(str(i + 7)),
        }
        for i in range(n)
    ]


def unpaired_preference_rows(n: int) -> list[dict]:
    return [
        {"prompt": _user(f"What is {i}+1?"), "completion": _assistant(str(i + 1 if i % 2 == 0 else i + 5)),
         "label": i % 2 == 0}
        for i in range(n)
    ]


def triple_preference_rows(n: int) -> list[dict]:
    """TPO's format: a gold reference plus chosen and rejected (standard strings; TRL's tpo.py wraps them)."""
    return [
        {"prompt": f"What is {i}+1?", "reference": f"{i + 1}.", "chosen": str(i + 1), "rejected": str(i + 7)}
        for i in range(n)
    ]


def prompt_rows(n: int) -> list[dict]:
    """Conversational prompts with a ``solution`` column (for ``accuracy_reward``)."""
    return [{"prompt": _user(f"What is {i}+1?"), "solution": f"${i + 1}$"} for i in range(n)]


def stepwise_rows(n: int) -> list[dict]:
    return [
        {"prompt": f"What is {i}+1?", "completions": [f"{i} plus one", f"is {i + 1}"], "labels": [True, i % 2 == 0]}
        for i in range(n)
    ]


def problem_rows(n: int) -> list[dict]:
    """open-r1's math format: a ``problem`` column used as the prompt, a LaTeX ``solution``, chat ``messages``."""
    return [
        {
            "problem": f"What is {i}+1?",
            "solution": f"${i + 1}$",
            "messages": [{"role": "user", "content": f"What is {i}+1?"}, {"role": "assistant", "content": str(i + 1)}],
        }
        for i in range(n)
    ]


def golden_response_rows(n: int) -> list[dict]:
    """Self-distillation (SDFT) format: a prompt and a demonstration that becomes the teacher's privileged context."""
    return [{"prompt": _user(f"What is {i}+1?"), "golden_response": f"{i} plus one is {i + 1}."} for i in range(n)]
