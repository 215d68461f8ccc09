"""The numerics guard: a NaN/inf loss or gradient is caught at the optimizer step, reported, and stopped or skipped.

``NumericsGuard`` is driven by ``BaseTrainer``:

- ``observe_loss(loss, inputs, ...)`` after every micro-batch's backward: remembers the micro-batches of the current
  optimizer step and which of them gave a non-finite loss (no host sync: the check is a device tensor).
- ``check_step(grad_norm, ...)`` once per optimizer step, right before ``optimizer.step()``: the step is bad when any
  micro-batch loss on any process, or the total gradient norm (identical on every process after the gradient
  all-reduce), is non-finite. The decision is reduced over processes, so all processes stop or skip together.

``nan_policy="stop"`` raises ``NonFiniteError`` naming the step, the process, which micro-batch(es) had a bad loss,
the batch's keys and shapes, and the file the offending micro-batches were saved to. ``nan_policy="skip"`` drops
the step's gradients (``p.grad = None``: torch optimizers then leave those parameters and their moments untouched,
so the update is skipped exactly, weight decay included), counts it in ``numerics/skipped_steps`` and warns. The
learning-rate schedule still advances, so the run ends on its planned schedule.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

NAN_POLICIES = ("stop", "skip")
DUMP_DIR = "numerics"
MAX_DUMPS = 10

logger = logging.getLogger("posttrain.numerics")


class NonFiniteError(FloatingPointError):
    """Raised by ``nan_policy="stop"`` when a loss or gradient norm is NaN or infinite."""


def describe_batch(inputs: Any, max_items: int = 12) -> str:
    """A one-line summary of a batch: ``key: tensor(2, 37) int64`` for tensors, ``key: list[4]`` for lists."""
    if isinstance(inputs, dict) or hasattr(inputs, "items"):
        items = list(inputs.items())
    elif isinstance(inputs, (list, tuple)):
        return f"{type(inputs).__name__}[{len(inputs)}]" + (
            f" of {describe_batch(inputs[0])}" if inputs and isinstance(inputs[0], dict) else ""
        )
    else:
        return type(inputs).__name__
    parts = []
    for key, value in items[:max_items]:
        if isinstance(value, torch.Tensor):
            parts.append(f"{key}: tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}")
        elif isinstance(value, (list, tuple)):
            parts.append(f"{key}: {type(value).__name__}[{len(value)}]")
        else:
            parts.append(f"{key}: {type(value).__name__}")
    more = f", ... ({len(items) - max_items} more)" if len(items) > max_items else ""
    return "{" + ", ".join(parts) + more + "}"


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    if hasattr(value, "items"):  # dict-like batch classes (e.g. the rollout batch)
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


class NumericsGuard:
    """Per-trainer state of the numerics guard (see the module docstring).

    Args:
        policy: ``"stop"`` or ``"skip"``.
        dump_dir: Where offending micro-batches are saved (``<output_dir>/numerics``); None disables dumps.
        process_index: This process's rank (used in messages and dump file names).
    """

    def __init__(self, policy: str = "stop", dump_dir: str | None = None, process_index: int = 0):
        if policy not in NAN_POLICIES:
            raise ValueError(f"nan_policy={policy!r} is not valid; use one of {NAN_POLICIES}.")
        self.policy = policy
        self.dump_dir = dump_dir
        self.process_index = process_index
        self.skipped_steps = 0
        self.skipped_at: list[int] = []
        self._batches: list[Any] = []
        self._bad_loss: list[tuple[int, torch.Tensor]] = []
        self._num_dumps = 0

    # -- per micro-batch -----------------------------------------------------------------------------------------
    def observe_loss(self, loss: torch.Tensor, inputs: Any) -> None:
        """Remember this micro-batch and whether its (detached) loss is finite; no host synchronisation."""
        index = len(self._batches)
        self._batches.append(inputs)
        if isinstance(loss, torch.Tensor):
            self._bad_loss.append((index, ~torch.isfinite(loss.detach()).all()))
        elif not math.isfinite(float(loss)):
            self._bad_loss.append((index, torch.tensor(True)))

    def reset(self) -> None:
        """Forget the micro-batches of the step that just finished."""
        self._batches.clear()
        self._bad_loss.clear()

    # -- per optimizer step --------------------------------------------------------------------------------------
    def check_step(
        self,
        grad_norm: float | torch.Tensor | None,
        *,
        step: int,
        parameters: Callable[[], Iterable[torch.nn.Parameter]],
        reduce_any: Callable[[bool], bool] | None = None,
    ) -> bool:
        """Decide whether the optimizer step about to run is finite; stop or skip it if not.

        Args:
            grad_norm: The total gradient norm HF Trainer computed (pre-clipping); None if unavailable.
            step: The 1-based number of the optimizer step being taken (``state.global_step + 1``).
            parameters: Returns the model's parameters (only called when skipping).
            reduce_any: ``flag -> any(flag over processes)``; None in single-process runs.

        Returns:
            True when the step is fine, False when it was skipped. Raises ``NonFiniteError`` under ``"stop"``.
        """
        bad_micro = [i for i, flag in self._bad_loss if bool(flag)]
        norm_value = None
        if grad_norm is not None:
            norm_value = float(grad_norm.detach().float()) if isinstance(grad_norm, torch.Tensor) else float(grad_norm)
        local_bad = bool(bad_micro) or (norm_value is not None and not math.isfinite(norm_value))
        any_bad = reduce_any(local_bad) if reduce_any is not None else local_bad
        if not any_bad:
            self.reset()
            return True
        message = self._message(step, bad_micro, norm_value, local_bad)
        if self.policy == "stop":
            self.reset()
            raise NonFiniteError(message)
        for param in parameters():
            param.grad = None
        self.skipped_steps += 1
        self.skipped_at.append(step)
        logger.warning("%s Skipping this optimizer step (nan_policy='skip').", message)
        self.reset()
        return False

    def _message(self, step: int, bad_micro: list[int], norm_value: float | None, local_bad: bool) -> str:
        where = f"process {self.process_index}"
        if bad_micro:
            what = f"the loss of micro-batch(es) {bad_micro} (of {len(self._batches)}) is NaN/inf"
        elif norm_value is not None and not math.isfinite(norm_value):
            what = f"the gradient norm is {norm_value} (losses were finite)"
        else:
            what = "another process saw a NaN/inf loss or gradient (this process's values were finite)"
        lines = [f"Non-finite values at optimizer step {step} on {where}: {what}."]
        suspects = [self._batches[i] for i in bad_micro] or (list(self._batches) if local_bad else [])
        if suspects:
            lines.append(f"Batch: {describe_batch(suspects[0])}.")
            path = self._dump(step, suspects)
            if path:
                lines.append(f"The offending micro-batch(es) were saved to {path} (torch.load(path)).")
        if self.policy == "stop":
            lines.append(
                "Fix: check these rows and the learning rate / loss settings, or set nan_policy='skip' to skip "
                "such steps and count them in numerics/skipped_steps."
            )
        return " ".join(lines)

    def _dump(self, step: int, batches: list[Any]) -> str | None:
        if self.dump_dir is None or self._num_dumps >= MAX_DUMPS:
            return None
        try:
            os.makedirs(self.dump_dir, exist_ok=True)
            path = os.path.join(self.dump_dir, f"step-{step}-process-{self.process_index}.pt")
            torch.save([_to_cpu(b) for b in batches], path)
        except Exception as err:  # a report must not hide the numerics error itself
            logger.warning("Could not save the offending batch: %s", err)
            return None
        self._num_dumps += 1
        return path

    # -- checkpointing -------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"skipped_steps": self.skipped_steps, "skipped_at": list(self.skipped_at)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.skipped_at = list(state.get("skipped_at", []))
