"""Versions and devices, ready to paste into a bug report (``posttrain env``; the HTML report's environment table)."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git_sha() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def accelerate_config_summary() -> str:
    """The default accelerate config file as indented ``- key: value`` lines, or ``"not found"``."""
    try:
        from accelerate.commands.config import default_config_file, load_config_from_file
    except ImportError:
        return "not found"
    if not os.path.isfile(default_config_file):
        return "not found"
    try:
        config = load_config_from_file(default_config_file).to_dict()
    except Exception as err:  # a broken config file must not break a bug report
        return f"unreadable ({default_config_file}: {err})"
    return "".join(f"\n  - {key}: {value}" for key, value in config.items())


def collect_env() -> dict[str, str]:
    """Key → value lines describing this installation."""
    import torch

    from posttrain._version import __version__

    if torch.cuda.is_available():
        devices = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    elif getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        devices = "MPS"
    else:
        devices = "cpu"
    sha = _git_sha()
    info = {
        "Platform": platform.platform(),
        "Python version": platform.python_version(),
        "posttrain version": __version__ + (f"+{sha}" if sha else ""),
        "PyTorch version": torch.__version__,
        "Accelerator(s)": devices,
        "CPU threads": str(torch.get_num_threads()),
    }
    for label, dist in [
        ("Transformers", "transformers"),
        ("Accelerate", "accelerate"),
        ("Datasets", "datasets"),
        ("HF Hub", "huggingface-hub"),
        ("PEFT", "peft"),
        ("Tokenizers", "tokenizers"),
        ("Safetensors", "safetensors"),
        ("math-verify", "math-verify"),
        ("bitsandbytes", "bitsandbytes"),
        ("DeepSpeed", "deepspeed"),
        ("vLLM", "vllm"),
    ]:
        info[f"{label} version"] = _version(dist)
        if dist == "accelerate":
            info["Accelerate config"] = accelerate_config_summary()
    return info


def print_env() -> None:
    print("\nCopy-paste the following information when reporting an issue:\n")
    for key, value in collect_env().items():
        print(f"- {key}: {value}")
    print()
