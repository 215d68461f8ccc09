"""What every posttrain trainer shares: TRL's config defaults, metric accumulation, model resolution, atomic saves.

``BaseConfig`` overrides ``transformers.TrainingArguments`` defaults the way TRL's configs do (``logging_steps=10``,
``gradient_checkpointing=True``, ``bf16`` resolved automatically). One deliberate difference: TRL resolves
``bf16=None`` to ``True`` everywhere; posttrain resolves it to ``True`` only where the accelerator supports bf16
(a CUDA GPU with bf16), so the first run on a laptop CPU trains in float32 instead of slow emulated bf16.

``BaseTrainer`` accumulates per-step metrics in ``self._metrics[mode]`` and averages them (ignoring NaN) at each
``log()``, with ``eval_`` prefixes in evaluation, and writes saved models atomically.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Trainer, TrainingArguments


def _bf16_supported() -> bool:
    return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())


@dataclass
class BaseConfig(TrainingArguments):
    """TrainingArguments with TRL's shared overrides. Subclasses set their own ``learning_rate`` default."""

    logging_steps: float = field(
        default=10,
        metadata={"help": "Log every X update steps (int), or a ratio of total training steps if in [0, 1)."},
    )
    gradient_checkpointing: bool = field(
        default=True,
        metadata={"help": "Recompute activations in backward to save memory at the cost of a slower step."},
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Train in bfloat16 mixed precision. None: on where the accelerator supports bf16 (CUDA with "
            "bf16), off on CPU."
        },
    )
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for `from_pretrained` when `model` is a string (JSON string allowed)."},
    )

    write_report: bool | None = field(
        default=None,
        metadata={
            "help": "posttrain only: write PNG plots and report/index.html into output_dir when training ends. None: "
            "on, unless the environment variable POSTTRAIN_NO_REPORT=1 is set."
        },
    )

    def __post_init__(self):
        if self.write_report is None:
            self.write_report = os.environ.get("POSTTRAIN_NO_REPORT", "0") in ("0", "", "false", "False")
        if self.bf16 is None:
            self.bf16 = (not self.fp16) and _bf16_supported()
        if isinstance(self.model_init_kwargs, str):
            import json

            try:
                self.model_init_kwargs = json.loads(self.model_init_kwargs)
            except json.JSONDecodeError as err:
                raise ValueError(
                    f"model_init_kwargs must be a dict or a JSON object string, got {self.model_init_kwargs!r}."
                ) from err
        super().__post_init__()


def nanmean_or_none(values: list[float]) -> float | None:
    """Average of the finite values (NaN ignored); None when nothing finite remains."""
    finite = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(finite) / len(finite) if finite else None


class BaseTrainer(Trainer):
    """``transformers.Trainer`` plus metric accumulation and atomic saving shared by all posttrain trainers."""

    _tag_names: list[str] = ["posttrain"]

    def __init__(self, *args, **kwargs):
        self._metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        super().__init__(*args, **kwargs)
        from posttrain.callbacks import MetricsLoggerCallback, ReportCallback

        self.add_callback(MetricsLoggerCallback())
        if getattr(self.args, "write_report", False):
            self.add_callback(ReportCallback(trainer_name=self._report_name()))

    def _report_name(self) -> str | None:
        """Which report panels fit this trainer (``"sft"``, ``"grpo"``...); None lets the report guess."""
        tags = [t for t in self._tag_names if t != "posttrain"]
        return tags[0] if tags else None

    # -- metrics -------------------------------------------------------------------------------------------------
    def _mode(self) -> str:
        return "train" if self.model is not None and self.model.training else "eval"

    def record_metric(self, name: str, value: float | torch.Tensor, mode: str | None = None) -> None:
        """Add one value of ``name`` to the current logging window."""
        if isinstance(value, torch.Tensor):
            value = value.detach().float().mean().item() if value.numel() else float("nan")
        self._metrics[mode or self._mode()][name].append(float(value))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = self._mode()
        averaged = {name: nanmean_or_none(vals) for name, vals in self._metrics[mode].items()}
        if mode == "eval":
            averaged = {f"eval_{k}": v for k, v in averaged.items()}
        logs = {**logs, **averaged}
        self._metrics[mode].clear()
        super().log(logs, start_time)

    # -- saving --------------------------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Write the model and tokenizer to a temporary folder, then move each file into place.

        A crash mid-save leaves either the previous file or the complete new one, never a half-written file.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return super()._save(output_dir, state_dict)
        os.makedirs(output_dir, exist_ok=True)
        tmp_dir = tempfile.mkdtemp(prefix=".tmp-save-", dir=output_dir)
        try:
            super()._save(tmp_dir, state_dict)
            for name in os.listdir(tmp_dir):
                src, dst = os.path.join(tmp_dir, name), os.path.join(output_dir, name)
                if os.path.isdir(src):
                    if os.path.isdir(dst):
                        shutil.rmtree(dst)
                    os.replace(src, dst)
                else:
                    os.replace(src, dst)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
