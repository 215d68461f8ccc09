"""Which curves each trainer's report shows, and how they are drawn (matplotlib, Agg backend)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable

# Panels per trainer: (title, y-label, [metric keys or prefixes ending in "/*"])
PANELS: dict[str, list[tuple[str, str, list[str]]]] = {
    "grpo": [
        ("Reward", "mean reward", ["reward", "eval_reward"]),
        ("Reward per function", "mean reward", ["rewards/*/mean"]),
        ("Reward spread", "value", ["reward_std", "frac_reward_zero_std"]),
        ("KL to reference", "KL (nats/token)", ["kl"]),
        ("Entropy", "nats/token", ["entropy"]),
        (
            "Completion length",
            "tokens",
            [
                "completions/mean_length",
                "completions/min_length",
                "completions/max_length",
                "completions/mean_terminated_length",
            ],
        ),
        ("Clipped completions", "fraction", ["completions/clipped_ratio"]),
        ("Clip ratios", "fraction", ["clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"]),
        ("Loss", "loss", ["loss"]),
    ],
    "sft": [
        ("Loss", "loss", ["loss", "eval_loss"]),
        ("Token accuracy", "mean token accuracy", ["mean_token_accuracy", "eval_mean_token_accuracy"]),
        ("Entropy", "nats/token", ["entropy"]),
        ("Learning rate", "learning rate", ["learning_rate"]),
    ],
    "dpo": [
        ("Loss", "loss", ["loss", "eval_loss"]),
        ("Reward margin", "β·log-ratio margin", ["rewards/margins"]),
        ("Preference accuracy", "fraction chosen > rejected", ["rewards/accuracies"]),
        ("Implicit rewards", "β·log-ratio", ["rewards/chosen", "rewards/rejected"]),
        ("Log-probs", "sum log-prob", ["logps/chosen", "logps/rejected"]),
    ],
    "kto": [
        ("Loss", "loss", ["loss"]),
        ("Implicit rewards", "β·log-ratio", ["rewards/chosen", "rewards/rejected", "rewards/margins"]),
        ("KL estimate", "KL", ["kl"]),
    ],
    "reward": [
        ("Loss", "loss", ["loss", "eval_loss"]),
        ("Accuracy", "fraction chosen > rejected", ["accuracy", "eval_accuracy"]),
        ("Margin", "r(chosen) − r(rejected)", ["margin"]),
        ("Rewards", "reward", ["min_reward", "mean_reward", "max_reward"]),
    ],
}
PANELS["rloo"] = PANELS["grpo"]
PANELS["distillation"] = [("Loss", "divergence", ["loss", "eval_loss"])] + PANELS["grpo"][4:7]
GENERIC = [("Loss", "loss", ["loss", "eval_loss"]), ("Learning rate", "learning rate", ["learning_rate"])]


def guess_trainer(keys: Iterable[str]) -> str:
    keys = set(keys)
    if "frac_reward_zero_std" in keys or "reward_std" in keys:
        return "grpo"
    if "rewards/margins" in keys and "rewards/accuracies" in keys:
        return "dpo"
    if "rewards/margins" in keys:
        return "kto"
    if "accuracy" in keys and "margin" in keys:
        return "reward"
    if "mean_token_accuracy" in keys:
        return "sft"
    return "generic"


def _expand(patterns: list[str], keys: list[str]) -> list[str]:
    out = []
    for pattern in patterns:
        if "*" in pattern:
            head, tail = pattern.split("*", 1)
            out += sorted(k for k in keys if k.startswith(head) and k.endswith(tail) and k != head + tail)
        elif pattern in keys:
            out.append(pattern)
    return out


def series(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for rec in records:
        value = rec.get(key)
        if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
            xs.append(rec.get("step", len(xs)))
            ys.append(float(value))
    return xs, ys


def plot_panels(records: list[dict], trainer: str, out_dir: str) -> list[tuple[str, str]]:
    """Draw one PNG per panel that has data; returns (title, path) pairs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({k for rec in records for k in rec})
    panels = PANELS.get(trainer, GENERIC)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for i, (title, ylabel, patterns) in enumerate(panels):
        metric_keys = [k for k in _expand(patterns, keys) if series(records, k)[0]]
        if not metric_keys:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=110)
        for key in metric_keys:
            xs, ys = series(records, key)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, linewidth=1.5, label=key)
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
        fig.tight_layout()
        path = os.path.join(out_dir, f"{i:02d}_{title.lower().replace(' ', '_')}.png")
        fig.savefig(path)
        plt.close(fig)
        written.append((title, path))
    return written
