"""Scoring completions with a list of reward functions and reward models: :class:`RewardScorer`.

The online-RL trainers (GRPO, RLOO) call ``RewardScorer.score`` once per generation batch and get an ``(N, K)``
float32 tensor, one column per reward function, ``NaN`` where a function returned ``None`` (the trainer then ignores
that function for that row with nan-aware sums; a row where *every* column is NaN is unscorable).

Calling convention (TRL's, keyword arguments only): ``prompts``, ``completions``, ``completion_ids``, every dataset
column except ``prompt``/``completion``/``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric``, and
``environments`` only when the trainer has environments.

- ``async def`` functions run concurrently (``asyncio.gather``) on one long-lived daemon event-loop thread, started
  before the sync functions run in order on the caller's thread, so slow I/O overlaps with local work.
- Reward models (sequence classifiers) score ``prompt + completion`` text — the chat template applied to the
  messages for conversational data, plain concatenation for standard data — right-padded, batched, under
  ``torch.inference_mode``; the reward is ``logits[:, 0]``.
- Every return value is validated. Wrong type or length, non-numbers, NaN/inf and exceptions raise a
  :class:`RewardFunctionError` naming the function, what it returned and the fix (``on_error="raise"``, default), or
  are recorded as ``None`` and counted in ``failure_counts`` (``on_error="none"``). A scalar is never broadcast.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import numbers
import os
import reprlib
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any, Literal

import torch

logger = logging.getLogger(__name__)

# Passed to every reward function, on top of the dataset columns.
STANDARD_REWARD_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
_RESERVED_COLUMNS = ("prompt", "completion", "completion_ids")


class RewardFunctionError(ValueError):
    """A reward function raised, or returned something other than one number (or ``None``) per completion."""


class _EventLoopThread:
    """A daemon thread running one asyncio event loop for the life of the process."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, name="posttrain-reward-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()


_loop_thread: _EventLoopThread | None = None
_loop_pid: int | None = None
_loop_lock = threading.Lock()


def submit_coroutine(coro: Coroutine) -> concurrent.futures.Future:
    """Schedule ``coro`` on the shared background event loop (started on first use) and return its future.

    Async reward functions (and async tools) share this loop, so their awaits overlap.
    """
    global _loop_thread, _loop_pid
    with _loop_lock:
        if _loop_thread is None or _loop_pid != os.getpid() or not _loop_thread.thread.is_alive():
            _loop_thread, _loop_pid = _EventLoopThread(), os.getpid()
        loop = _loop_thread.loop
    return asyncio.run_coroutine_threadsafe(coro, loop)


def _is_async(func: Any) -> bool:
    # Callable objects with an ``async def __call__`` count too.
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def _is_model(func: Any) -> bool:
    return isinstance(func, torch.nn.Module)


def reward_func_name(func: Any) -> str:
    """Metric name of a reward: ``__name__`` (also as a class attribute of callable instances), or the last part of
    a model's ``config._name_or_path``."""
    if _is_model(func):
        path = getattr(getattr(func, "config", None), "_name_or_path", "") or ""
        return path.rstrip("/").split("/")[-1] or type(func).__name__
    return getattr(func, "__name__", None) or type(func).__name__


_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlevel = 80, 80, 8, 8, 3


def _truncate(value: Any, limit: int = 300) -> str:
    text = _short.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class RewardScorer:
    """Score completions with reward functions and reward models; see the module docstring for the contract.

    Args:
        reward_funcs: Callables (sync or ``async def``, functions or callable objects) and/or sequence-classification
            models (``torch.nn.Module`` / ``PreTrainedModel`` with one label). Resolve names and dotted paths first
            with :func:`posttrain.rewards.resolve_reward_funcs`, and load model ids as models.
        reward_processing_classes: One tokenizer per entry of ``reward_funcs`` (``None`` entries for callables, or
            ``None`` overall); a model without one gets ``AutoTokenizer.from_pretrained(config._name_or_path)``.
            A tokenizer without a pad token pads with EOS; the model's ``config.pad_token_id`` is set from it.
        reward_weights: One weight per reward (default all 1.0), exposed as ``weights``.
        chat_template_kwargs: Extra arguments for ``apply_chat_template`` when a reward model scores
            conversational data (e.g. ``{"enable_thinking": False}``).
        on_error: ``"raise"`` (default) raises :class:`RewardFunctionError`; ``"none"`` records the failure as
            ``None`` for the affected rows and counts it in ``failure_counts``.

    Attributes:
        names: One metric name per reward (``rewards/{name}/mean``).
        weights: ``(K,)`` float32 tensor.
        failure_counts: Per name, how many row values were recorded as ``None`` because of a failure.
        unscorable_count: How many rows so far got ``None`` from every reward.
    """

    def __init__(
        self,
        reward_funcs: list | Any,
        reward_processing_classes: list | Any | None = None,
        reward_weights: list[float] | None = None,
        chat_template_kwargs: dict | None = None,
        on_error: Literal["raise", "none"] = "raise",
    ):
        if not isinstance(reward_funcs, (list, tuple)):
            reward_funcs = [reward_funcs]
        if not reward_funcs:
            raise ValueError("RewardScorer needs at least one reward function or reward model.")
        for func in reward_funcs:
            if isinstance(func, str):
                raise TypeError(
                    f"Reward function {func!r} is a string. Resolve names and dotted paths with "
                    "posttrain.rewards.resolve_reward_funcs, and load reward-model ids as models, before scoring."
                )
            if not (callable(func) or _is_model(func)):
                raise TypeError(f"Reward function {func!r:.100} is neither callable nor a torch.nn.Module.")
        if on_error not in ("raise", "none"):
            raise ValueError(f"on_error={on_error!r}; valid values: 'raise', 'none'.")
        self.reward_funcs = list(reward_funcs)
        self.on_error = on_error
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        k = len(self.reward_funcs)

        if reward_processing_classes is None:
            reward_processing_classes = [None] * k
        elif not isinstance(reward_processing_classes, (list, tuple)):
            reward_processing_classes = [reward_processing_classes]
        if len(reward_processing_classes) != k:
            raise ValueError(
                f"The number of reward processing classes ({len(reward_processing_classes)}) must match the number "
                f"of reward functions ({k}). Pass None for entries that are plain functions."
            )
        self.reward_processing_classes = [
            self._prepare_model(func, tok) if _is_model(func) else tok
            for func, tok in zip(self.reward_funcs, reward_processing_classes)
        ]

        if reward_weights is None:
            reward_weights = [1.0] * k
        if len(reward_weights) != k:
            raise ValueError(
                f"Number of reward weights ({len(reward_weights)}) must match number of reward functions ({k})"
            )
        self.weights = torch.tensor([float(w) for w in reward_weights], dtype=torch.float32)
        self.names = [reward_func_name(f) for f in self.reward_funcs]
        self._async = [not _is_model(f) and _is_async(f) for f in self.reward_funcs]
        self.failure_counts: dict[str, int] = {name: 0 for name in self.names}
        self.unscorable_count = 0
        self._warned_failure: set[int] = set()
        self._warned_unscorable = False

    @staticmethod
    def _prepare_model(model: torch.nn.Module, tokenizer: Any) -> Any:
        if tokenizer is None:
            from transformers import AutoTokenizer

            name = getattr(model.config, "_name_or_path", "")
            if not name:
                raise ValueError(
                    f"Reward model {type(model).__name__} has no config._name_or_path to load its tokenizer from; "
                    "pass it in reward_processing_classes."
                )
            tokenizer = AutoTokenizer.from_pretrained(name)
        if tokenizer.pad_token_id is None:  # no pad token, or one the vocabulary lacks (TRL checks the id too)
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id
        model.eval()  # dropout off: inference_mode alone does not disable it
        return tokenizer

    # ------------------------------------------------------------------------------------------------- scoring

    def score(
        self,
        *,
        prompts: list,
        completions: list,
        completion_ids: list[list[int]],
        columns: dict[str, list] | None = None,
        trainer_state: Any = None,
        log_extra: Callable[[str, list], None] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        environments: list | None = None,
    ) -> torch.Tensor:
        """Rewards of ``N`` completions from the ``K`` reward functions.

        Args:
            prompts: ``N`` prompts (``str`` or message lists), each repeated per generation.
            completions: ``N`` completions (``str`` or message lists).
            completion_ids: ``N`` unpadded token-id lists.
            columns: Other dataset columns (one value per completion), passed as keyword arguments.
            trainer_state: The ``TrainerState``, for curriculum-style rewards.
            log_extra: ``log_extra(column, values)`` adds a column to the completions table.
            log_metric: ``log_metric(name, value)`` logs a scalar.
            environments: One environment per completion; passed only when not ``None``.

        Returns:
            ``(N, K)`` float32 tensor on CPU; ``NaN`` where a function returned ``None`` (or failed with
            ``on_error="none"``).
        """
        n = len(completions)
        for what, values in (("prompts", prompts), ("completion_ids", completion_ids)):
            if len(values) != n:
                raise ValueError(f"{what} has {len(values)} entries but completions has {n}; they must match.")
        kwargs: dict[str, Any] = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
        kwargs.update({key: value for key, value in (columns or {}).items() if key not in _RESERVED_COLUMNS})
        kwargs.update(trainer_state=trainer_state, log_extra=log_extra, log_metric=log_metric)
        if environments is not None:
            kwargs["environments"] = environments

        rewards = torch.full((n, len(self.reward_funcs)), float("nan"), dtype=torch.float32)
        async_idx = [i for i, is_async in enumerate(self._async) if is_async]
        pending = submit_coroutine(self._gather(async_idx, kwargs)) if async_idx else None
        try:
            for i, func in enumerate(self.reward_funcs):
                if self._async[i]:
                    continue
                if _is_model(func):
                    rewards[:, i] = self._score_model(func, self.reward_processing_classes[i], prompts, completions)
                    continue
                try:
                    output = func(**kwargs)
                    if inspect.isawaitable(output):  # e.g. a sync wrapper around an async function
                        output = submit_coroutine(_await(output)).result()
                except Exception as e:
                    self._fail(i, n, f"raised {type(e).__name__}: {e}", _FIX_EXCEPTION, cause=e)
                    continue
                rewards[:, i] = self._validate(i, output, n)
        finally:
            outputs = pending.result() if pending is not None else []
        for i, output in zip(async_idx, outputs):
            if isinstance(output, BaseException):
                self._fail(i, n, f"raised {type(output).__name__}: {output}", _FIX_EXCEPTION, cause=output)
            else:
                rewards[:, i] = self._validate(i, output, n)

        unscorable = torch.isnan(rewards).all(dim=1)
        if unscorable.any():
            self._warn_unscorable(unscorable, kwargs, n)
        return rewards

    async def _gather(self, indices: list[int], kwargs: dict[str, Any]) -> list[Any]:
        return await asyncio.gather(*(_call(self.reward_funcs[i], kwargs) for i in indices), return_exceptions=True)

    def _score_model(self, model: torch.nn.Module, tokenizer: Any, prompts: list, completions: list) -> torch.Tensor:
        texts = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, str) and isinstance(completion, str):
                texts.append(prompt + completion)
                continue
            messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            messages += completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}]
            texts.append(tokenizer.apply_chat_template(messages, tokenize=False, **self.chat_template_kwargs))
        batch = tokenizer(texts, padding=True, padding_side="right", add_special_tokens=False, return_tensors="pt")
        device = next(model.parameters()).device
        with torch.inference_mode():
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        return logits[:, 0].float().cpu()

    # ------------------------------------------------------------------------------------------------ checking

    def _validate(self, i: int, output: Any, n: int) -> torch.Tensor:
        """One reward column from a function's output, or a failure (raise / NaN) with the reason."""
        column = torch.full((n,), float("nan"), dtype=torch.float32)
        if isinstance(output, torch.Tensor) or type(output).__module__ == "numpy":
            if getattr(output, "ndim", 0) != 1:
                shape = tuple(getattr(output, "shape", ()))
                self._fail(i, n, f"returned an array of shape {shape} ({_truncate(output)})", _FIX_SHAPE)
                return column
            output = output.tolist()
        if not isinstance(output, (list, tuple)):
            fix = _FIX_SCALAR if isinstance(output, numbers.Number) else _FIX_SHAPE
            self._fail(i, n, f"returned {type(output).__name__} {_truncate(output)}", fix)
            return column
        if len(output) != n:
            self._fail(i, n, f"returned {len(output)} values for {n} completions ({_truncate(output)})", _FIX_LENGTH)
            return column
        bad: list[tuple[int, Any]] = []
        for row, value in enumerate(output):
            if value is None:
                continue
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(value, numbers.Real):
                bad.append((row, value))
                continue
            value = float(value)
            if not math.isfinite(value):
                bad.append((row, value))
                continue
            column[row] = value
        if bad:
            shown = ", ".join(f"[{row}]={_truncate(v, 60)}" for row, v in bad[:5])
            more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
            self._fail(i, len(bad), f"returned non-numeric or non-finite values at {shown}{more}", _FIX_VALUE)
        return column

    def _fail(self, i: int, count: int, what: str, fix: str, cause: BaseException | None = None) -> None:
        name = self.names[i]
        message = f"Reward function {name!r} {what}; expected a list of one float (or None) per completion. {fix}"
        if self.on_error == "raise":
            raise RewardFunctionError(message) from cause
        self.failure_counts[name] += count
        if i not in self._warned_failure:  # once per function; later failures are only counted
            self._warned_failure.add(i)
            logger.warning("%s Recorded as None (on_error='none'); counted in failure_counts.", message)

    def _warn_unscorable(self, unscorable: torch.Tensor, kwargs: dict[str, Any], n: int) -> None:
        rows = unscorable.nonzero().flatten().tolist()
        self.unscorable_count += len(rows)
        if self._warned_unscorable:
            return
        self._warned_unscorable = True
        row = rows[0]
        row_kwargs = {
            key: value[row]
            for key, value in kwargs.items()
            if isinstance(value, (list, tuple)) and len(value) == n and key != "environments"
        }
        # through `logging`, as TRL (handlers and caplog see it), with TRL's phrase first
        logger.warning(
            "All reward functions returned None for the following kwargs:\n%s\nPlease ensure that at least one "
            "reward function returns a valid reward. (%d of %d completions in this batch; warned once, later ones are "
            "counted in unscorable_count. These rows get reward NaN and advantage 0.)",
            _truncate(row_kwargs, 1000),
            len(rows),
            n,
        )


async def _await(awaitable: Any) -> Any:
    return await awaitable


async def _call(func: Any, kwargs: dict[str, Any]) -> Any:
    # Calling inside the coroutine turns a bad-signature TypeError into a per-function result for gather.
    return await func(**kwargs)


_FIX_EXCEPTION = (
    "Fix the function, return None for completions it cannot score, or pass on_error='none' to record failures as "
    "None."
)
_FIX_SCALAR = "Never return a single number: return a list with one value per completion."
_FIX_SHAPE = "Return a list (or 1-D array) with one value per completion."
_FIX_LENGTH = "Return exactly one value per completion (len(completions)); use None for completions it cannot score."
_FIX_VALUE = "Return floats; use None instead of NaN/inf or other values to skip a completion."


def validate_reward_func_signature(
    func: Any, columns: Iterable[str] | None = None, *, environments: bool = False
) -> None:
    """Check at trainer init that a reward function can be called with the trainer's keyword arguments.

    Args:
        func: The reward function (models and uninspectable callables are skipped).
        columns: Dataset columns that will be passed (``prompt``/``completion``/``completion_ids`` excluded);
            ``None`` when unknown (then only the standard arguments are checked).
        environments: Whether ``environments`` will be passed.

    Raises:
        ValueError: the function lacks ``**kwargs`` and does not declare every argument it will receive, has
            positional-only parameters, or requires an argument that will not be passed (e.g. a missing column).
    """
    if _is_model(func):
        return
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return
    name = reward_func_name(func)
    cols = [c for c in (columns or ()) if c not in _RESERVED_COLUMNS]
    passed = [*STANDARD_REWARD_KWARGS, *cols, *(["environments"] if environments else [])]
    params = signature.parameters
    positional_only = [p.name for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_ONLY]
    if positional_only:
        raise ValueError(
            f"Reward function {name!r}{signature} has positional-only parameters {positional_only}, but reward "
            f"functions are called with keyword arguments only ({', '.join(passed)}). Remove the '/' marker."
        )
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        undeclared = [arg for arg in passed if arg not in params]
        if undeclared:
            raise ValueError(
                f"Reward function {name!r}{signature} does not accept **kwargs, but it will be called with the keyword "
                f"arguments {', '.join(passed)}; it does not declare {', '.join(undeclared)}. Add **kwargs to its "
                f"signature, e.g. def {name}(completions, **kwargs)."
            )
    if columns is not None:
        missing = [
            p.name
            for p in params.values()
            if p.default is inspect.Parameter.empty
            and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            and p.name not in passed
        ]
        if missing:
            raise ValueError(
                f"Reward function {name!r}{signature} requires {', '.join(repr(m) for m in missing)}, which will not "
                f"be passed: it receives {', '.join(passed)}. Add a dataset column named {missing[0]!r} or give the "
                "parameter a default."
            )
