"""Callbacks with TRL's names, plus the metrics log and report writer every posttrain trainer uses.

- ``MetricsLoggerCallback`` appends each log to ``output_dir/metrics.jsonl`` and saves the run's config once.
- ``ReportCallback`` writes PNG plots and ``report/index.html`` when training ends (``posttrain.report``).
- ``RichProgressCallback`` shows a progress bar with live metrics on a terminal, plain lines otherwise.
- ``LogCompletionsCallback`` samples completions for eval prompts every ``freq`` steps into a table.
- ``BEMACallback`` keeps a bias-corrected EMA of the weights (BEMA) and saves it to ``output_dir/bema``.
- ``WeaveCallback`` logs eval completions (and scores) to W&B Weave.
``SyncRefModelCallback`` (TR-DPO reference mixing) lives with the reference-policy code and is re-exported here.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from typing import Any

from transformers import TrainerCallback

from posttrain.report.writer import CONFIG_FILE, METRICS_FILE

logger = logging.getLogger(__name__)


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
            logger.warning("could not write the training report: %s", err)


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


def _generate_completions(trainer, prompts: list, generation_config=None) -> list[str]:
    """Greedy (or ``generation_config``) completions of ``prompts`` (chat templates applied) by the trainer's model."""
    import torch
    from transformers import GenerationConfig

    from posttrain.data_utils import maybe_apply_chat_template

    tok = trainer.processing_class
    tok = getattr(tok, "tokenizer", tok)
    model = trainer.accelerator.unwrap_model(trainer.model)
    texts = [maybe_apply_chat_template({"prompt": p}, tok)["prompt"] for p in prompts]
    config = generation_config or GenerationConfig(max_new_tokens=64, do_sample=False)
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
        return _generate_completions(self.trainer, self.prompts, self.generation_config)

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


class BEMACallback(TrainerCallback):
    r"""BEMA (Bias-Corrected Exponential Moving Average, https://huggingface.co/papers/2508.00180) of the trained
    weights, kept in a separate model on ``device`` and saved to ``output_dir/bema`` when training ends (TRL's
    ``trl.BEMACallback``).

    ``θ'_t = α_t·(θ_t − θ_0) + EMA_t`` with ``EMA_t = (1 − β_t)·EMA_{t−1} + β_t·θ_t``, ``β_t = (ρ + γ·t)^{−κ}``
    (floored at ``min_ema_multiplier``) and ``α_t = (ρ + γ·t)^{−η}``; θ_0 is the snapshot at step ``update_after``
    (the initial weights when it is 0). The math is :mod:`posttrain.core.averaging`. Only trainable parameters are
    averaged; the others are copied once.

    Args:
        update_freq: Update the BEMA weights every this many steps (φ).
        ema_power: κ, the power of the EMA decay factor; 0 disables the EMA.
        bias_power: η, the power of the bias-correction scale; large values approximate no correction, 0 pins α at 1.
        lag: ρ, the initial offset of the schedules (a virtual starting age).
        update_after: τ, burn-in steps before BEMA starts.
        multiplier: γ, the step multiplier of the schedules.
        min_ema_multiplier: Floor of the EMA decay factor β_t.
        device: Device of the BEMA buffers and model (usually not the training device, to save its memory).

    Example::

        from posttrain import BEMACallback
        trainer = SFTTrainer(..., callbacks=[BEMACallback()])
    """

    def __init__(
        self,
        update_freq: int = 400,
        ema_power: float = 0.5,
        bias_power: float = 0.2,
        lag: int = 10,
        update_after: int = 0,
        multiplier: float = 1.0,
        min_ema_multiplier: float = 0.0,
        device: str = "cpu",
    ):
        if update_freq < 1:
            raise ValueError(f"update_freq must be >= 1, got {update_freq}.")
        if lag + multiplier * max(update_after, 0) <= 0:
            raise ValueError(f"lag + multiplier * step must stay > 0 (got lag={lag}, multiplier={multiplier}).")
        self.update_freq = update_freq
        self.ema_power = ema_power
        self.bias_power = bias_power
        self.lag = lag
        self.update_after = update_after
        self.multiplier = multiplier
        self.min_ema_multiplier = min_ema_multiplier
        self.device = device
        self.param_names: list[str] = []
        self.thetat_params: list[Any] = []  # the live trainable parameters θ_t
        self.theta0_params: list[Any] = []  # θ_0 buffers (on device)
        self.ema_params: list[Any] = []  # EMA buffers (on device)
        self.running_model = None  # the BEMA weights, as a model
        self._running_params: list[Any] = []  # running_model's parameters matching thetat_params

    @staticmethod
    def _unwrap_model(model: Any) -> Any:
        """The module inside DDP / DeepSpeed / FSDP wrappers."""
        for attr in ("module", "_fsdp_wrapped_module"):
            while hasattr(model, attr) and not hasattr(model, "config"):
                model = getattr(model, attr)
        return model

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        import copy

        import torch

        model = self._unwrap_model(model)
        with torch.no_grad():
            self.running_model = copy.deepcopy(model).to(self.device)
        self.running_model.requires_grad_(False)
        running = dict(self.running_model.named_parameters())
        self.param_names, self.thetat_params, self.theta0_params, self.ema_params = [], [], [], []
        self._running_params = []
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            self.param_names.append(name)
            self.thetat_params.append(param)
            theta0 = param.detach().clone().to(self.device)
            self.theta0_params.append(theta0)
            self.ema_params.append(theta0.clone())
            self._running_params.append(running[name])

    def _ema_beta(self, step: int) -> float:
        from posttrain.core.averaging import bema_ema_beta

        return bema_ema_beta(
            step,
            lag=self.lag,
            multiplier=self.multiplier,
            ema_power=self.ema_power,
            min_ema_multiplier=self.min_ema_multiplier,
        )

    def _bema_alpha(self, step: int) -> float:
        from posttrain.core.averaging import bema_alpha

        return bema_alpha(step, lag=self.lag, multiplier=self.multiplier, bias_power=self.bias_power)

    def _update_bema_weights(self, step: int) -> None:
        from posttrain.core.averaging import bema_update_

        bema_update_(
            self.thetat_params,
            self.theta0_params,
            self.ema_params,
            self._running_params,
            beta=self._ema_beta(step),
            alpha=self._bema_alpha(step),
        )

    def on_step_end(self, args, state, control, model=None, **kwargs):
        import torch

        step = state.global_step
        if step < self.update_after:
            return
        with torch.no_grad():
            if step == self.update_after:  # snapshot θ_0 and the EMA at the first BEMA step
                for live, theta0, ema in zip(self.thetat_params, self.theta0_params, self.ema_params, strict=True):
                    theta0.copy_(live.detach())
                    ema.copy_(live.detach())
            elif (step - self.update_after) % self.update_freq == 0:
                self._update_bema_weights(step)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero and self.running_model is not None:
            self.running_model.save_pretrained(os.path.join(args.output_dir, "bema"))


class WeaveCallback(TrainerCallback):
    """At each evaluation, generate completions for the eval prompts and log them to W&B Weave (TRL's callback).

    Tracing mode (``scorers=None``) logs each prompt and completion; evaluation mode also scores each completion
    with every ``scorer(prompt, completion) -> float`` and logs the per-scorer means as the summary. Predictions
    go through Weave's ``EvaluationLogger``; when ``weave`` is not installed the callback logs a warning once and
    does nothing (``pip install weave``).

    Args:
        trainer: The trainer; its ``eval_dataset`` must have a ``prompt`` column.
        project_name: Weave project; default: the current Weave client's, else the active wandb run's
            ``entity/project``; an error when there is none.
        scorers: ``{name: scorer}``; None: tracing mode.
        generation_config: A ``transformers.GenerationConfig``; default: greedy, 64 new tokens.
        num_prompts: Use the first ``num_prompts`` eval rows (default: all).
        dataset_name: Dataset name recorded in Weave.
        model_name: Model name recorded in Weave (default: the model's ``_name_or_path``).
    """

    def __init__(
        self,
        trainer,
        project_name: str | None = None,
        scorers: dict | None = None,
        generation_config=None,
        num_prompts: int | None = None,
        dataset_name: str = "eval_dataset",
        model_name: str | None = None,
    ):
        self.trainer = trainer
        self.project_name = project_name
        self.scorers = dict(scorers or {})
        self.generation_config = generation_config
        self.dataset_name = dataset_name
        self.model_name = model_name
        dataset = trainer.eval_dataset
        if dataset is None:
            raise ValueError("WeaveCallback needs an evaluation dataset: pass eval_dataset= to the trainer.")
        if "prompt" not in getattr(dataset, "column_names", []):
            raise ValueError(
                f"WeaveCallback needs a 'prompt' column in eval_dataset; it has {list(dataset.column_names)}."
            )
        if num_prompts is not None:
            dataset = dataset.select(range(min(num_prompts, len(dataset))))
        self.prompts = list(dataset["prompt"])
        self._weave = None
        self._warned = False
        self._last_step = -1

    @property
    def is_evaluation_mode(self) -> bool:
        """True when scorers are given (predictions are scored), False in tracing mode."""
        return bool(self.scorers)

    def _init_weave(self):
        if self._weave is not None:
            return self._weave
        try:
            import weave
        except ImportError:
            if not self._warned:
                logger.warning("WeaveCallback: weave is not installed (`pip install weave`); nothing is logged.")
                self._warned = True
            return None
        client = None
        get_client = getattr(weave, "get_client", None)
        if callable(get_client):
            client = get_client()
        if client is None:
            if self.project_name is None:
                try:
                    import wandb

                    if wandb.run is not None:
                        self.project_name = f"{wandb.run.entity}/{wandb.run.project}"
                except ImportError:
                    pass
            if self.project_name is None:
                raise ValueError(
                    "WeaveCallback found no Weave client and no project: call weave.init('project'), pass "
                    "project_name=, or start a wandb run."
                )
            weave.init(self.project_name)
        if self.model_name is None:
            config = getattr(self.trainer.model, "config", None)
            self.model_name = getattr(config, "_name_or_path", None) or "unknown_model"
        self._weave = weave
        return weave

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._init_weave()

    def on_evaluate(self, args, state, control, **kwargs):
        if state.global_step == self._last_step:
            return
        self._last_step = state.global_step
        weave = self._init_weave() if state.is_world_process_zero else None
        completions = _generate_completions(self.trainer, self.prompts, self.generation_config)
        if weave is None:
            return
        eval_logger = weave.EvaluationLogger(
            model=self.model_name,
            dataset=self.dataset_name,
            eval_attributes={
                "training_step": state.global_step,
                "model_name": self.model_name,
                "generation_config": self.generation_config.to_dict() if self.generation_config else None,
            },
        )
        scores: dict[str, list[float]] = {name: [] for name in self.scorers}
        for prompt, completion in zip(self.prompts, completions):
            prediction = eval_logger.log_prediction(inputs={"prompt": prompt}, output=completion)
            for name, scorer in self.scorers.items():
                try:
                    score = scorer(prompt, completion)
                except Exception as err:  # one failing scorer must not stop the evaluation
                    logger.warning("WeaveCallback: scorer %r failed on a completion: %s", name, err)
                    continue
                prediction.log_score(scorer=name, score=score)
                scores[name].append(float(score))
            prediction.finish()
        summary = {"training_step": state.global_step, "num_predictions": len(completions)}
        summary.update({f"{name}_mean": sum(v) / len(v) for name, v in scores.items() if v})
        eval_logger.log_summary(summary)


def __getattr__(name: str):
    if name == "SyncRefModelCallback":
        from posttrain.models.reference import SyncRefModelCallback

        return SyncRefModelCallback
    raise AttributeError(name)
