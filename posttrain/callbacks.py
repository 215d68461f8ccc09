"""Callbacks with TRL's names, plus the metrics log and report writer every posttrain trainer uses.

- ``MetricsLoggerCallback`` appends each log to ``output_dir/metrics.jsonl`` and saves the run's config once.
- ``ReportCallback`` writes PNG plots and ``report/index.html`` when training ends (``posttrain.report``).
- ``RichProgressCallback`` shows a progress bar with live metrics on a terminal, plain lines otherwise.
- ``LogCompletionsCallback`` samples completions for eval prompts every ``freq`` steps into a table.
``SyncRefModelCallback`` (TR-DPO reference mixing) lives with the reference-policy code and is re-exported here.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

from transformers import TrainerCallback

from posttrain.report.writer import CONFIG_FILE, METRICS_FILE


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


class MetricsLoggerCallback(TrainerCallback):
    """Append every ``on_log`` record to ``output_dir/metrics.jsonl`` (main process only)."""

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        os.makedirs(args.output_dir, exist_ok=True)
        try:
            config = args.to_dict()
        except Exception:  # pragma: no cover - exotic fields
            config = {k: str(v) for k, v in vars(args).items()}
        config["_trainer"] = type(kwargs.get("model")).__name__ if kwargs.get("model") is not None else None
        path = os.path.join(args.output_dir, CONFIG_FILE)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(config, f, indent=2, default=str)
        os.replace(tmp, path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        record = {"step": state.global_step, "epoch": state.epoch, "time": time.time()}
        record.update({k: _clean(v) for k, v in logs.items() if isinstance(v, (int, float, str, bool)) or v is None})
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, METRICS_FILE), "a") as f:
            f.write(json.dumps(record) + "\n")


class ReportCallback(TrainerCallback):
    """Write the HTML report and plots into ``output_dir/report`` at the end of training."""

    def __init__(self, trainer_name: str | None = None):
        self.trainer_name = trainer_name

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        from posttrain.report import write_report

        try:
            write_report(args.output_dir, trainer=self.trainer_name)
        except Exception as err:  # a report must never fail a finished training run
            print(f"[posttrain] could not write the training report: {err}", file=sys.stderr)


class RichProgressCallback(TrainerCallback):
    """A rich progress bar with the latest metrics; plain log lines when stdout is not a terminal."""

    KEYS = (
        "loss",
        "reward",
        "reward_std",
        "kl",
        "entropy",
        "mean_token_accuracy",
        "rewards/accuracies",
        "accuracy",
        "completions/mean_length",
        "eval_loss",
        "eval_reward",
    )

    def __init__(self, force_plain: bool | None = None):
        self.plain = (not sys.stdout.isatty()) if force_plain is None else force_plain
        self._progress = None
        self._task = None
        self._last: dict[str, float] = {}

    def _summary(self) -> str:
        return "  ".join(f"{k}={v:.4g}" for k, v in self._last.items() if isinstance(v, (int, float)))

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self.plain:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
        )
        self._progress.start()
        self._task = self._progress.add_task("train", total=state.max_steps, metrics="")

    def on_step_end(self, args, state, control, **kwargs):
        if self._progress is not None:
            self._progress.update(self._task, completed=state.global_step, metrics=self._summary())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        fresh = {k: v for k, v in logs.items() if k in self.KEYS and isinstance(v, (int, float))}
        if not fresh:  # e.g. the end-of-training summary (train_runtime, ...): nothing new to show
            return
        self._last.update(fresh)
        if self.plain:
            print(f"[step {state.global_step}/{state.max_steps}] {self._summary()}", flush=True)
        elif self._progress is not None:
            self._progress.update(self._task, metrics=self._summary())

    def on_train_end(self, args, state, control, **kwargs):
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


class LogCompletionsCallback(TrainerCallback):
    """Every ``freq`` steps, generate completions for ``num_prompts`` eval prompts and log them as a table.

    The table (step, prompt, completion) is appended to ``output_dir/completions_log.jsonl`` and, when the run
    reports to wandb, logged there too.

    Args:
        trainer: The trainer (its ``eval_dataset`` must have a ``prompt`` column).
        generation_config: A ``transformers.GenerationConfig``; default: greedy, 64 new tokens.
        num_prompts: How many eval prompts to use (default: all).
        freq: Steps between logs (default: ``args.eval_steps``, else ``args.logging_steps``).
    """

    def __init__(self, trainer, generation_config=None, num_prompts: int | None = None, freq: int | None = None):
        self.trainer = trainer
        self.generation_config = generation_config
        self.freq = freq
        dataset = trainer.eval_dataset
        if dataset is None or "prompt" not in dataset.column_names:
            raise ValueError("LogCompletionsCallback needs trainer.eval_dataset with a 'prompt' column.")
        if num_prompts is not None:
            dataset = dataset.select(range(min(num_prompts, len(dataset))))
        self.prompts = list(dataset["prompt"])
        self.table: list[dict] = []
        self._last_step = -1

    def _generate(self) -> list[str]:
        import torch
        from transformers import GenerationConfig

        from posttrain.data_utils import maybe_apply_chat_template

        tok = self.trainer.processing_class
        tok = getattr(tok, "tokenizer", tok)
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        texts = [maybe_apply_chat_template({"prompt": p}, tok)["prompt"] for p in self.prompts]
        config = self.generation_config or GenerationConfig(max_new_tokens=64, do_sample=False)
        side = tok.padding_side
        tok.padding_side = "left"
        try:
            batch = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        finally:
            tok.padding_side = side
        was_training = model.training
        model.eval()
        with torch.inference_mode():
            out = model.generate(**batch, generation_config=config, pad_token_id=tok.pad_token_id)
        if was_training:
            model.train()
        return tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)

    def on_step_end(self, args, state, control, **kwargs):
        freq = self.freq or args.eval_steps or args.logging_steps
        freq = int(freq) if freq and freq >= 1 else 1
        if state.global_step % freq != 0 or state.global_step == self._last_step:
            return
        self._last_step = state.global_step
        completions = self._generate()
        if not state.is_world_process_zero:
            return
        rows = [
            {"step": state.global_step, "prompt": str(p), "completion": c} for p, c in zip(self.prompts, completions)
        ]
        self.table.extend(rows)
        with open(os.path.join(args.output_dir, "completions_log.jsonl"), "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        if "wandb" in (args.report_to or []):
            try:
                import wandb

                if wandb.run is not None:
                    wandb.log(
                        {
                            "completions": wandb.Table(
                                columns=list(rows[0]), data=[list(r.values()) for r in self.table]
                            )
                        }
                    )
            except ImportError:
                pass


def __getattr__(name: str):
    if name == "SyncRefModelCallback":
        from posttrain.models.reference import SyncRefModelCallback

        return SyncRefModelCallback
    raise AttributeError(name)
