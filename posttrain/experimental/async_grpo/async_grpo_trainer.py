"""``AsyncGRPOTrainer``: GRPO with generation decoupled from training (TRL's experimental ``AsyncGRPOTrainer``).

Two sides, overlapping in time:

- **rollout worker** (a spawned CPU process, ``rollout_worker.py``): pulls the next round of prompts (the
  ``RepeatSampler`` order GRPO uses), generates it on the server, scores rewards, computes group-relative
  advantages with the shared ``RolloutPipeline`` and puts the finished round, tagged with the server's weight
  ``version``, into a bounded queue (``queue_maxsize`` samples);
- **trainer** (this process): at the first micro-step of each optimizer step takes the next round from the queue,
  drops it when ``global_step - version > max_staleness`` (counted in ``sample/dropped_stale_total``), computes
  π_old (and π_ref when β ≠ 0) under its *current* weights, applies the importance-sampling correction of ``core/``
  (``vllm_importance_sampling_*``: π_old against the server's sampling log-probs), and trains with GRPO's loss. After
  every ``weight_sync_steps`` optimizer steps it pushes its weights to the server with ``version = global_step``.

Because π_old is the trainer's current policy, the clipped ratio π_θ/π_old is exactly on-policy within a step and the
staleness of a sample (plus any sampler/trainer mismatch) is carried by the truncated/masked IS ratio
π_old/π_sampler — a decoupled-PPO form. Deliberate difference from TRL, whose async trainer uses vLLM's log-probs
directly as π_old inside the clip.

``max_staleness=0`` is synchronous GRPO: the worker may only generate round ``r`` from weight version ``r``, so it
waits for each push, and a run equals ``GRPOTrainer(use_vllm=True, vllm_mode="server")`` on the same server with the
same seeds (same prompts, request seeds, buffer shuffle; tested to the last bit).

Resume (``rollout_state.json`` in each checkpoint): the *trained* position ``next_round`` (first round not yet
consumed; rounds dropped as stale count as consumed), the weight version and the dropped counter. Model, optimizer,
scheduler, RNG states and the micro-batch buffer's shuffle RNG are HF/posttrain's usual resume state. On resume
the trainer pushes its checkpoint weights (``version = global_step``) and starts a fresh worker at ``next_round``;
rounds that were in flight or queued when the run stopped are lost and regenerated (from the restored weights,
with the same request seeds). Not supported: multi-process training, tools / environments / ``rollout_func``,
streaming datasets, ``num_iterations > 1``.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue as queue_module
import threading
import time
from typing import Any

import torch
from transformers import TrainerCallback

from posttrain.experimental.async_grpo.async_grpo_config import AsyncGRPOConfig
from posttrain.experimental.async_grpo.rollout_worker import RolloutWorkerSpec, run_worker
from posttrain.rollout.buffer import RolloutBatch, batch_size_of
from posttrain.rollout.pipeline import RolloutSettings
from posttrain.trainers.grpo import GRPOTrainer

ROLLOUT_STATE = "rollout_state.json"
_QUEUE_POLL_S = 0.2


class RolloutWorkerError(RuntimeError):
    """The rollout worker process failed (its exception type, message and traceback are in the message)."""


class _WeightSyncCallback(TrainerCallback):
    """Push the weights after every ``weight_sync_steps`` optimizer steps (on_step_end runs after optimizer.step)."""

    def __init__(self, trainer: AsyncGRPOTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.weight_sync_steps == 0:
            self.trainer._push_weights()


class AsyncGRPOTrainer(GRPOTrainer):
    """GRPO with a rollout worker streaming generation rounds from a server (see the module docstring).

    The constructor is ``GRPOTrainer``'s; ``tools``, ``environment_factory`` and ``rollout_func`` are refused.
    Reward functions (and their closures) must be picklable: the worker process receives them pickled.
    """

    config_class = AsyncGRPOConfig
    _trainer_name = "AsyncGRPO"
    _tag_names = ["posttrain", "async-grpo"]

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, *a, **kwargs):
        for name in ("tools", "environment_factory", "rollout_func"):
            if kwargs.get(name) is not None:
                raise ValueError(f"AsyncGRPOTrainer does not support {name} in posttrain; use GRPOTrainer.")
        if isinstance(train_dataset, torch.utils.data.IterableDataset):
            raise ValueError("AsyncGRPOTrainer needs a map-style train_dataset (the worker indexes prompts).")
        super().__init__(model, reward_funcs, args, train_dataset, *a, **kwargs)
        self._worker: Any = None
        self._queue: Any = None
        self._stop: Any = None
        self._next_round = 0  # first round not yet consumed (the trained position; saved in rollout_state.json)
        self.dropped_stale_total = 0
        self.trained_rounds: list[dict[str, int]] = []  # {"step", "round", "version", "staleness"} per trained round
        self._push_thread: threading.Thread | None = None
        self._push_error: BaseException | None = None
        self._push_client: Any = None
        self.add_callback(_WeightSyncCallback(self))

    # -- worker lifecycle --------------------------------------------------------------------------------------
    def _worker_settings(self) -> RolloutSettings:
        """The pipeline settings for the worker: no policy there, so no π_old / π_ref / IS (done here on consume)."""
        settings = self._rollout_settings()
        settings.compute_old_logps = settings.compute_ref_logps = False
        settings.importance_sampling = None
        return settings

    def _worker_spec(self) -> RolloutWorkerSpec:
        args = self.args
        estimator = self.pipeline.estimator
        if estimator.needs_old_logps or estimator.needs_ref_logps:
            raise ValueError(f"{type(estimator).__name__} needs log-probs, which the rollout worker cannot compute.")
        rows = args.generation_batch_size
        inflight = args.max_inflight_tasks
        if inflight is None or inflight < 0:
            inflight = args.max_staleness * args.per_device_train_batch_size * args.gradient_accumulation_steps
        spec = RolloutWorkerSpec(
            dataset=self.train_dataset, tokenizer=self.processing_class, scorer=self.scorer, estimator=estimator,
            sampling=self.sampling, settings=self._worker_settings(), base_url=self.backend.base_url,
            num_generations=self.num_generations, prompts_per_round=self._prompts_per_round(),
            shuffle=bool(args.shuffle_dataset), seed=int(args.seed), start_round=self._next_round,
            ahead=max(0, inflight // rows), request_timeout=float(args.request_timeout),
            server_timeout=float(args.vllm_server_timeout), seed_requests=bool(args.seed_requests),
        )  # fmt: skip
        try:
            pickle.dumps(spec)
        except Exception as err:
            raise TypeError(
                "AsyncGRPOTrainer runs rollouts in a separate process, so reward functions, their processing "
                "classes and the dataset must be picklable: use module-level functions, functools.partial or "
                f"callable class instances, not lambdas or closures ({type(err).__name__}: {err})."
            ) from err
        return spec

    def _start_worker(self) -> None:
        """Push the current weights (version = global_step) and wait, then spawn the worker at ``self._next_round``."""
        from posttrain.serving.client import GenerationClient

        if self.backend.protocol != "posttrain":
            raise ValueError(
                f"AsyncGRPO needs a `posttrain serve` / `posttrain vllm-serve` server; {self.backend.base_url} speaks "
                f"the {self.backend.protocol!r} protocol."
            )
        self._push_client = GenerationClient(self.backend.base_url, request_timeout=float(self.args.request_timeout))
        self._push_weights(wait=True)  # the server must hold this step's weights before the worker reads its version
        spec = self._worker_spec()
        context = multiprocessing.get_context("spawn")
        rounds = max(1, self.args.queue_maxsize // self.args.generation_batch_size)
        self._queue = context.Queue(maxsize=rounds)
        self._stop = context.Event()
        self._worker = context.Process(
            target=run_worker, args=(spec, self._queue, self._stop, os.getpid()), name="posttrain-rollout-worker",
            daemon=True,
        )  # fmt: skip
        self._worker.start()

    def _stop_worker(self) -> None:
        """Stop, join (terminate, then kill if needed) and release the worker and its queue. Idempotent."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        self._stop.set()
        deadline = time.monotonic() + 10.0
        while worker.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue_module.Empty, OSError, ValueError):  # drain: a put() must not block
                self._queue.get(timeout=0.05)
        if worker.is_alive():
            worker.terminate()
            worker.join(timeout=5)
        if worker.is_alive():
            worker.kill()
        worker.join(timeout=5)
        self._queue.cancel_join_thread()
        self._queue.close()
        self._queue = None

    def train(self, *args, **kwargs):
        try:
            result = super().train(*args, **kwargs)
            self._join_push()  # the last push has landed (or its error is raised)
            return result
        finally:
            self._stop_worker()
            if self._push_thread is not None:
                self._push_thread.join(timeout=60)
            self._push_thread, self._push_error = None, None

    # -- weights -----------------------------------------------------------------------------------------------
    def _push_weights(self, wait: bool = False) -> None:
        """Snapshot the weights now (safetensors bytes) and upload them on a thread with ``version = global_step``.

        The server applies a weight load between generation requests, so a synchronous push would block training
        until the round being generated finishes; the upload thread lets the next step start at once. Pushes stay
        in order (each waits for the previous one) and an upload error is raised at the next push or queue read.
        """
        from posttrain.serving.weights import policy_weights, serialize_chunks

        self._join_push()
        start = time.perf_counter()
        step = self.state.global_step
        with policy_weights(self.accelerator.unwrap_model(self.model)) as items:
            chunks = list(serialize_chunks(items, self.backend.chunk_bytes))
        self.record_metric("perf/weight_sync_s", time.perf_counter() - start, mode="train")
        self._push_thread = threading.Thread(
            target=self._upload, args=(chunks, step), name="posttrain-weight-push", daemon=True
        )
        self._push_thread.start()
        self._last_synced_step = step
        if wait:
            self._join_push()

    def _upload(self, chunks: list[bytes], version: int) -> None:
        try:
            self.backend.version = self._push_client.load_weights(chunks, version=version)
        except BaseException as err:  # raised in the training thread by _join_push
            self._push_error = err

    def _join_push(self, check_only: bool = False) -> None:
        """Wait for the upload in flight (or, ``check_only``, just look whether it failed) and raise its error."""
        thread = self._push_thread
        if thread is not None and not check_only:
            thread.join()
        if thread is not None and not thread.is_alive():
            self._push_thread = None
        error, self._push_error = self._push_error, None
        if error is not None:
            raise error

    # -- data path ---------------------------------------------------------------------------------------------
    def _prepare_inputs(self, inputs: list[dict[str, Any]]) -> RolloutBatch:
        # The HF dataloader's rows only pace the epochs/steps; the data comes from the worker's rounds.
        if self._mode() == "eval":
            self._last_synced_step = self.state.global_step  # evaluate on the server's current weights, no push
            return super()._prepare_inputs(inputs)
        if self.buffer.needs_generation():
            self.buffer.fill(self._next_trainable_round())
        return self.buffer.next()

    def _get_item(self) -> tuple:
        """The next message from the worker; raises ``RolloutWorkerError`` if it failed or died."""
        if self._worker is None:
            self._start_worker()
        while True:
            try:
                message = self._queue.get(timeout=_QUEUE_POLL_S)
            except queue_module.Empty:
                self._join_push(check_only=True)
                if not self._worker.is_alive():
                    code = self._worker.exitcode
                    self._stop_worker()
                    raise RolloutWorkerError(f"The rollout worker exited unexpectedly (exit code {code}).") from None
                continue
            if message[0] == "error":
                _, kind, text, trace = message
                self._stop_worker()
                raise RolloutWorkerError(f"The rollout worker failed: {kind}: {text}\n\nWorker traceback:\n{trace}")
            if message[0] == "done":
                self._stop_worker()
                raise RolloutWorkerError(f"The rollout worker ran out of rounds at round {message[1]}.")
            return message

    def _next_trainable_round(self) -> RolloutBatch:
        """Take rounds from the queue, dropping stale ones, and prepare the first fresh one for the loss."""
        wait_start = time.perf_counter()
        step = self.state.global_step
        while True:
            item = pickle.loads(self._get_item()[1])
            staleness = step - item["version"]
            if staleness < 0:
                raise RolloutWorkerError(
                    f"A round was generated with weight version {item['version']}, ahead of the trainer's step "
                    f"{step}: is another trainer pushing weights to {self.backend.base_url}?"
                )
            self._next_round = item["round"] + 1
            if staleness <= self.args.max_staleness:
                break
            self.dropped_stale_total += batch_size_of(item["batch"])
        record = self._record("train")
        record("perf/rollout_wait_s", time.perf_counter() - wait_start)
        record("sample/time_in_queue_s", max(0.0, time.time() - item["put_time"]))
        record("sample/staleness_mean", float(staleness))  # one version per round: mean = max
        record("sample/staleness_max", float(staleness))
        record("sample/version", float(item["version"]))
        record("sample/dropped_stale_total", float(self.dropped_stale_total))
        for name, value in item["metrics"]:
            record(name, value)
        self.trained_rounds.append(
            {"step": step, "round": item["round"], "version": item["version"], "staleness": staleness}
        )
        if item["table"] is not None:
            self._pending_completions = item["table"]
        return self._score_with_current_policy(item["batch"], record)

    def _score_with_current_policy(self, batch: RolloutBatch, record) -> RolloutBatch:
        """π_old (and π_ref) under the weights trained now, then the IS correction against the sampler (core/)."""
        pipeline, device = self.pipeline, self.accelerator.device
        settings = pipeline.settings
        importance = settings.importance_sampling if "sampling_per_token_logps" in batch else None
        if settings.compute_old_logps or importance is not None:
            batch["old_per_token_logps"] = pipeline._logps_in_chunks(self._policy_logps_no_grad, batch, device).cpu()
        if settings.compute_ref_logps and pipeline.ref_logps is not None:
            batch["ref_per_token_logps"] = pipeline._logps_in_chunks(pipeline.ref_logps, batch, device).cpu()
        if importance is not None:
            pipeline.importance_sampling(batch, importance, record)
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    # -- checkpoints -------------------------------------------------------------------------------------------
    def _extra_checkpoint_state(self) -> dict[str, Any]:
        state = {
            "next_round": self._next_round,
            "weight_version": int(self._last_synced_step or 0),
            "dropped_stale_total": self.dropped_stale_total,
        }
        return {**super()._extra_checkpoint_state(), ROLLOUT_STATE: state}

    def _load_extra_checkpoint_state(self, states: dict[str, Any]) -> None:
        super()._load_extra_checkpoint_state(states)
        if ROLLOUT_STATE in states:
            self._next_round = int(states[ROLLOUT_STATE]["next_round"])
            self.dropped_stale_total = int(states[ROLLOUT_STATE]["dropped_stale_total"])
