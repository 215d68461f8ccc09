"""Asynchronous rollouts: a spawned worker process streams generation rounds from a server while the trainer trains.

Shared by the experimental async trainers (``async_grpo``, ``async_distillation``); what differs between them is
only what one round *is* (the worker's :meth:`AsyncWorkerSpec.make_producer`) and what the trainer does with a round
when it consumes it (the ``score`` callback of :class:`AsyncRollout`).

Worker side (:func:`run_worker`, in a ``spawn`` child process, CPU only): round ``r`` is chunk ``r`` of the
trainer's ``RepeatSampler`` order (:class:`RoundSource`: the same prompts in the same order as the synchronous
trainer); it is generated through the ``vllm_server`` backend against ``posttrain serve`` and put, tagged with the
weight ``version`` the server reported, into a bounded queue. Admission: round ``r`` is only sent when ``r -
server_version <= ahead``, so nothing is generated that would already be too stale when the trainer reaches it.
Request seeds follow the round index (``request_seed(seed, 0, r)``), so a round has the same tokens whenever it is
generated from the same weights (resume, ``max_staleness=0``). Everything in the spec is pickled into the child;
rounds cross the process boundary as ``pickle`` bytes; errors go back as ``("error", type, message, traceback)``;
the worker exits when the trainer sets ``stop`` or dies. Heartbeat: the worker stamps a shared clock whenever it makes
progress (a server answer, an admission poll, a queued round); with ``heartbeat_stale_after_s`` in the trainer's config
the trainer raises when the stamp gets older than that while it waits for a round (a worker hung on a server that
accepts requests but never answers), allowing a starting worker (spawn, imports) ``vllm_server_timeout`` more.

Why a round, not a single group, is the unit streamed: the round is exactly what one optimizer step trains on, and
generating it in one request lets the server batch all its groups in one decode loop (one prefill per prompt, one
decode forward for every live row; per-group requests would halve the decode batch of a 2-prompt round on CPU) and
keeps its request seed, prompt order and weight version one value per step: ``max_staleness=0`` then reproduces
synchronous server-mode GRPO bitwise and resume regenerates exactly the rounds in flight. The group sampler finishes a
round's groups in one decode loop anyway, so a finer unit would not reach the trainer sooner from this server.
Partial rollouts (AsyncGRPO ``partial_rollout_max_tokens``, ``spec.partial``) replace this loop with
``posttrain.rollout.partial.partial_loop``: passes of a token budget, finished groups emitted as rounds at once,
cut completions continued under newer weights, per-token weight versions in the batch (``token_versions``); the
trainer then judges staleness by a round's oldest token and logs the token-level lag distribution.

Trainer side (:class:`AsyncRollout`, a component the synchronous trainer owns and delegates to): at the first
micro-step of each optimizer step it takes the next round from the queue, drops it when ``global_step - version >
max_staleness`` (``sample/dropped_stale_total``), and fills the usual ``RolloutBuffer`` with it. After every
``weight_sync_steps`` optimizer steps it snapshots its weights and hands them, with ``version = global_step``, to a
background uploader through a one-slot mailbox (:class:`WeightUploader`: the latest snapshot wins, an older one not yet
sent is dropped), so the optimizer step never waits for an HTTP upload; evaluation, checkpoints and the end of
training wait for the upload in flight. Staleness is always measured from the version the server reports with each
round, so a dropped snapshot only means the server skips that version. Resume state (``rollout_state.json`` in each
checkpoint): ``next_round`` (first round not yet consumed; dropped rounds count as consumed), ``weight_version``, ``dropped_stale_total``; on resume the checkpoint weights are
pushed and a fresh worker starts at ``next_round`` (rounds in flight when the run stopped are regenerated). With
``weight_sync_timeout`` in the trainer's config a push that has not landed within that many seconds raises
``TimeoutError`` naming the option (pushes otherwise use ``request_timeout`` per request). With
``vllm_weight_sync_probe`` the trainer also computes the log-probs of a fixed probe sequence when it snapshots, and
the uploader, once the push landed, has the server score the same sequence (``/get_sequence_logprobs/``) and raises
``WeightSyncError`` when they differ by more than ``vllm_weight_sync_probe_atol``. With ``vllm_sync_adapter_only`` a
LoRA policy's snapshot is its adapter alone (``push_payload``); ``perf/weight_sync_bytes`` logs each snapshot's size.

Several training processes (``AsyncRollout.ranks``, ``posttrain.rollout.multiprocess``): the worker runs on rank 0 and
produces each round as one shard per rank (each rank's share as the synchronous trainer's, rewards and advantages over
the whole round); rank 0 takes rounds from the queue, decides staleness and drops, and sends every rank its shard;
rank 0 pushes the weights (FSDP2 ranks take part in the gather).
"""

from __future__ import annotations

import abc
import contextlib
import multiprocessing
import os
import pickle
import queue as queue_module
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainerCallback

from posttrain.rollout.errors import RolloutWorkerError
from posttrain.rollout.multiprocess import RankRounds

ROLLOUT_STATE = "rollout_state.json"
POLL_MIN_S, POLL_MAX_S = 0.005, 0.2
_QUEUE_POLL_S = 0.2

# (rows of the round, metric sink) -> (batch on CPU, completions table or None)
Producer = Callable[[list, Callable[[str, float], None]], tuple[Any, Any]]


def check_async_rollout_options(config: Any, trainer_name: str, model_hint: str = "MODEL") -> None:
    """The checks every async trainer's config shares: generation on a server only, a staleness bound the weight
    sync can meet, one pass over each sample. Sets ``ignore_data_skip`` (the worker resumes
    the prompt order itself, from ``rollout_state.json``)."""
    if not config.use_vllm or config.vllm_mode != "server":
        raise ValueError(
            f"{trainer_name} generates on a server only: keep use_vllm=True and vllm_mode='server' and start "
            f"`posttrain serve --model {model_hint}` (or `vllm serve`)."
        )
    if config.max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {config.max_staleness}.")
    if config.weight_sync_steps < 1:
        raise ValueError(f"weight_sync_steps must be >= 1, got {config.weight_sync_steps}.")
    if config.max_staleness < config.weight_sync_steps - 1:
        raise ValueError(
            f"max_staleness={config.max_staleness} < weight_sync_steps - 1 = {config.weight_sync_steps - 1}: the "
            "server's weights lag the trainer by up to weight_sync_steps - 1 versions, so every sample would be "
            "dropped. Raise max_staleness or lower weight_sync_steps."
        )
    if config.num_iterations != 1:
        raise ValueError(f"{trainer_name} trains each sample once: num_iterations must be 1.")
    urls = getattr(config, "vllm_server_base_urls", None)
    if urls is not None and len(urls) > 1 and trainer_name != "AsyncGRPO":
        raise ValueError(
            f"{trainer_name} generates on one server in this release: vllm_server_base_urls lists {len(urls)}. Set "
            "vllm_server_base_url to one of them (several servers work with AsyncGRPO and GRPO/RLOO in server mode)."
        )
    config.ignore_data_skip = True


# ----------------------------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class AsyncWorkerSpec(abc.ABC):
    """What every rollout worker needs (pickled into the child): the prompt order, the server, admission.

    Subclasses add what their rounds need and implement :meth:`make_producer`.
    """

    dataset: Any
    tokenizer: Any
    sampling: Any
    base_url: str
    num_generations: int
    prompts_per_round: int
    shuffle: bool
    seed: int
    start_round: int
    ahead: int
    request_timeout: float
    server_timeout: float
    seed_requests: bool = True
    max_rounds: int | None = None
    client_kwargs: dict[str, Any] = field(default_factory=dict)
    base_urls: list[str] | None = None  # several servers (vllm_server_base_urls): a ServerPoolBackend
    partial: Any = None  # partial rollouts (posttrain.rollout.partial.PartialRolloutSpec); None: whole rounds
    num_processes: int = 1  # training processes: each round is produced as one shard per rank (rollout.multiprocess)

    @abc.abstractmethod
    def make_producer(self, backend: Any, accelerator: Any = None) -> Producer:
        """Build (in the child) the function turning a round's rows into its batch, generating with ``backend``;
        ``accelerator`` gathers over the training ranks' shards of a round (None: one process)."""

    def partial_prompt_ids(self, rows: list[dict[str, Any]]) -> list[int]:
        """The prompt ids a group's rows are generated from (partial rollouts render before generating)."""
        raise TypeError(f"{type(self).__name__} does not support partial rollouts.")


class RoundSource:
    """Rows of round ``r``: chunk ``r`` of ``RepeatSampler``'s order (the same prompts, in the same order, as the
    synchronous trainer; epoch ``e`` is shuffled with ``seed + e``)."""

    def __init__(self, dataset: Any, num_generations: int, prompts_per_round: int, shuffle: bool, seed: int):
        from posttrain.rollout.sampler import RepeatSampler

        self.dataset = dataset
        self.num_generations = num_generations
        self.sampler = RepeatSampler(
            dataset, mini_repeat_count=num_generations, batch_size=prompts_per_round, shuffle=shuffle, seed=seed
        )
        self.rows_per_round = num_generations * prompts_per_round
        self.rounds_per_epoch = len(dataset) // prompts_per_round
        if self.rounds_per_epoch < 1:
            raise ValueError(f"The dataset has {len(dataset)} prompts; one round needs {prompts_per_round}.")
        self._epoch: int | None = None
        self._order: list[int] = []

    def rows(self, round_index: int) -> list[dict[str, Any]]:
        epoch, k = divmod(round_index, self.rounds_per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._order, self._epoch = list(self.sampler), epoch
        indices = self._order[k * self.rows_per_round : (k + 1) * self.rows_per_round]
        return [self.dataset[int(i)] for i in indices]

    def group_rows(self, ordinal: int) -> list[dict[str, Any]]:
        """The G rows of group ``ordinal`` (group ``k`` of the prompt order; partial rollouts pick groups)."""
        round_index, position = divmod(ordinal, self.rows_per_round // self.num_generations)
        rows = self.rows(round_index)
        g = self.num_generations
        return rows[position * g : (position + 1) * g]


class StreamRoundSource(RoundSource):
    """Rows of round ``r`` from a streaming (``IterableDataset``) train dataset: ``RepeatIterableDataset``'s
    grouping (``prompts_per_round`` rows read, each repeated G times; shuffled with the stream's own buffered
    shuffle, epoch ``e`` seeded ``seed + e``), read in order. Rounds must be asked for in increasing order; on
    resume the stream is re-read from its start and the rounds already consumed are skipped. An exhausted stream
    starts its next epoch (the trainer's ``max_steps`` ends the run)."""

    def __init__(self, dataset: Any, num_generations: int, prompts_per_round: int, shuffle: bool, seed: int):
        from posttrain.rollout.sampler import RepeatIterableDataset

        self.dataset = dataset
        self.num_generations = num_generations
        self.rows_per_round = num_generations * prompts_per_round
        self.stream = RepeatIterableDataset(
            dataset, mini_repeat_count=num_generations, batch_size=prompts_per_round, shuffle=shuffle, seed=seed
        )
        self._epoch = 0
        self._iter: Any = None
        self._next = 0  # index of the next round the stream yields
        self._cache: tuple[int, list[dict[str, Any]]] | None = None

    def _read_round(self) -> list[dict[str, Any]]:
        for _ in range(2):  # the rest of this epoch, then (exhausted) one fresh epoch
            if self._iter is None:
                self.stream.set_epoch(self._epoch)
                self._iter = iter(self.stream)
            rows = []
            for row in self._iter:  # the stream yields whole rounds only (RepeatIterableDataset drops a short one)
                rows.append(row)
                if len(rows) == self.rows_per_round:
                    return rows
            self._iter, self._epoch = None, self._epoch + 1
        raise ValueError(
            f"The streaming train_dataset yields fewer than {self.rows_per_round // self.num_generations} prompts "
            "per epoch; one round needs that many."
        )

    def rows(self, round_index: int) -> list[dict[str, Any]]:
        if self._cache is not None and self._cache[0] == round_index:
            return self._cache[1]
        if round_index < self._next:
            raise ValueError(f"A streaming dataset is read in order: round {round_index} was already read.")
        while self._next <= round_index:
            rows = self._read_round()
            self._next += 1
        self._cache = (round_index, rows)
        return rows


def _beat(heartbeat: Any) -> None:
    """Stamp the shared heartbeat clock (wall-clock seconds) the trainer watches; ``None``: no heartbeat."""
    if heartbeat is not None:
        heartbeat.value = time.time()


def _put(out: Any, payload: Any, stop: Any, parent: int, heartbeat: Any = None) -> float:
    """Put with backpressure; returns the seconds spent blocked on a full queue (or exits when stopping)."""
    start = time.perf_counter()
    while not stop.is_set() and os.getppid() == parent:
        _beat(heartbeat)  # blocked on a full queue is waiting on the trainer, not hung
        try:
            out.put(payload, timeout=0.2)
            return time.perf_counter() - start
        except queue_module.Full:
            continue
    raise SystemExit(0)


def _server_version(backend: Any) -> int:
    """The weight version the server reports now (several servers: the oldest of them)."""
    if hasattr(backend, "health_version"):
        return backend.health_version()
    return int(backend.client.health().get("version") or 0)


def run_worker(spec: AsyncWorkerSpec, out: Any, stop: Any, parent: int, heartbeat: Any = None) -> None:
    """Process entry point: generate rounds ``spec.start_round, ...`` until ``stop`` is set (see the module doc).
    ``heartbeat``: a shared ``multiprocessing.Value("d")`` stamped on progress (None: none)."""
    try:
        _loop(spec, out, stop, parent, heartbeat)
    except SystemExit:
        pass
    except BaseException as err:  # reported to the trainer, which raises it
        with contextlib.suppress(Exception):
            out.put(("error", type(err).__name__, str(err), traceback.format_exc()), timeout=5)


def _loop(spec: AsyncWorkerSpec, out: Any, stop: Any, parent: int, heartbeat: Any = None) -> None:
    import torch

    from posttrain.generation.vllm_server import VLLMServerBackend

    torch.set_num_threads(1)  # the worker mostly waits on HTTP; leave the cores to server and trainer
    streaming = isinstance(spec.dataset, torch.utils.data.IterableDataset) or not hasattr(spec.dataset, "__len__")
    source_class = StreamRoundSource if streaming else RoundSource
    source = source_class(spec.dataset, spec.num_generations, spec.prompts_per_round, spec.shuffle, spec.seed)
    options = dict(
        tokenizer=spec.tokenizer, protocol="posttrain", timeout=spec.server_timeout, seed=spec.seed,
        seed_requests=spec.seed_requests, client_kwargs={"request_timeout": spec.request_timeout, **spec.client_kwargs},
    )  # fmt: skip

    def make_backend() -> Any:
        if spec.base_urls is not None and len(spec.base_urls) > 1:
            from posttrain.generation.server_pool import ServerPoolBackend

            return ServerPoolBackend(base_urls=spec.base_urls, **options)
        return VLLMServerBackend(base_url=spec.base_url, **options)

    if spec.num_processes > 1:  # one shard per training rank, each rank's share as the synchronous trainer's
        from posttrain.rollout.multiprocess import RankShards

        produce: Any = RankShards(spec, make_backend, lambda: _beat(heartbeat))
        backend, requests = produce.backends[0], produce
    else:
        backend = make_backend()
        requests = backend

    def admit(r: int) -> bool:
        """Admission: wait until round ``r`` is at most ``ahead`` rounds ahead of the server's weights (False: stop)."""
        wait = POLL_MIN_S
        while not stop.is_set():
            if os.getppid() != parent:
                return False
            version = _server_version(backend)
            _beat(heartbeat)
            if r - version <= spec.ahead:
                return True
            time.sleep(wait)
            wait = min(2 * wait, POLL_MAX_S)  # back off: each poll costs the server a request
        return False

    if spec.partial is not None:
        from posttrain.rollout.partial import ReplayBackend, partial_loop

        replay = ReplayBackend()
        _beat(heartbeat)  # started
        partial_loop(
            spec, source, backend, spec.make_producer(replay), replay, admit,
            emit=lambda item: _put(out, ("round", pickle.dumps(item)), stop, parent, heartbeat),
            beat=lambda: _beat(heartbeat),
        )  # fmt: skip
        return
    if spec.num_processes <= 1:
        produce = spec.make_producer(backend)
    _beat(heartbeat)  # started
    backpressure = 0.0
    r = spec.start_round
    while spec.max_rounds is None or r < spec.max_rounds:
        if not admit(r):
            return
        requests.set_request_index(r)  # seed of round r: the same tokens whenever generated from the same weights
        metrics: list[tuple[str, float]] = []

        def record(name: str, value: float, sink: list = metrics) -> None:  # producers record after each server answer
            _beat(heartbeat)
            sink.append((name, float(value)))

        start, cpu = time.perf_counter(), time.process_time()
        batch, table = produce(source.rows(r), record)
        metrics.append(("rollout/duration_s", time.perf_counter() - start))
        metrics.append(("rollout/cpu_s", time.process_time() - cpu))
        metrics.append(("rollout/backpressure_s", backpressure))
        version = produce.version if spec.num_processes > 1 else int(backend.version or 0)
        item = {"round": r, "version": version, "batch": batch, "metrics": metrics,
                "table": table, "put_time": time.time()}  # fmt: skip
        backpressure = _put(out, ("round", pickle.dumps(item)), stop, parent, heartbeat)
        r += 1
    _put(out, ("done", r), stop, parent, heartbeat)


# ----------------------------------------------------------------------------------------------------------------
# Trainer side
# ----------------------------------------------------------------------------------------------------------------


class WeightUploader:
    """A background thread uploading weight snapshots to the server, fed through a one-slot mailbox.

    :meth:`offer` puts ``(chunks, version)`` in the slot and returns at once; a snapshot still waiting there is
    replaced (latest wins: the server only ever needs the newest weights), one already being uploaded finishes
    first, so versions reach the server in increasing order. :meth:`wait` blocks until the slot is empty and no
    upload is running. An upload error is kept and raised by the next :meth:`offer`, :meth:`wait` or
    :meth:`check`; the thread stops at the first error.

    Args:
        upload: ``upload(chunks, version) -> server version`` (e.g. ``GenerationClient.load_weights``).
    """

    def __init__(self, upload: Callable[[list[bytes], int], Any]):
        self._upload = upload
        self._cond = threading.Condition()
        self._slot: tuple[list[bytes], int] | None = None
        self._busy = False
        self._closed = False
        self._error: BaseException | None = None
        self.server_version: int | None = None  # what the server reported after the last finished upload
        self.superseded = 0  # snapshots replaced in the slot before they were sent
        self.upload_seconds = 0.0  # how long the last finished (or failed) upload took
        self._thread = threading.Thread(target=self._run, name="posttrain-weight-upload", daemon=True)
        self._thread.start()

    def offer(self, chunks: list[bytes], version: int) -> None:
        """Hand over a snapshot without waiting (replacing one not yet sent)."""
        with self._cond:
            self._raise_error()
            if self._closed:
                raise RuntimeError("The weight uploader is closed.")
            self.superseded += self._slot is not None
            self._slot = (chunks, int(version))
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> None:
        """Block until every offered snapshot is uploaded (or superseded); raise an upload error."""
        with self._cond:
            done = self._cond.wait_for(lambda: self._error is not None or not (self._busy or self._slot), timeout)
            self._raise_error()
            if not done:
                raise TimeoutError(f"The weight upload did not finish within {timeout} s.")

    def check(self) -> None:
        """Raise an upload error, if one happened, without waiting."""
        with self._cond:
            self._raise_error()

    def close(self, timeout: float = 60.0) -> None:
        """Stop the thread after the upload in flight (a snapshot still in the slot is dropped). Idempotent."""
        with self._cond:
            self._closed, self._slot = True, None
            self._cond.notify_all()
        self._thread.join(timeout)

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            self._closed = True
            raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._slot is not None)
                if self._closed:
                    return
                (chunks, version), self._slot = self._slot, None
                self._busy = True
            start = time.perf_counter()
            try:
                reported = self._upload(chunks, version)
            except BaseException as err:  # raised in the training thread by offer / wait / check
                with self._cond:
                    self._error, self._busy, self._slot = err, False, None
                    self.upload_seconds = time.perf_counter() - start
                    self._cond.notify_all()
                return
            with self._cond:
                self.server_version, self._busy = reported, False
                self.upload_seconds = time.perf_counter() - start
                self._cond.notify_all()


class _WeightSyncCallback(TrainerCallback):
    """Push the weights after every ``weight_sync_steps`` optimizer steps (on_step_end runs after optimizer.step)."""

    def __init__(self, rollout: AsyncRollout):
        self.rollout = rollout

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.weight_sync_steps == 0:
            self.rollout.push_weights()


class AsyncRollout:
    """The trainer side of the async trainers (see the module docstring): a component the trainer owns and delegates
    to, over an ``OnlineTrainerBase`` trainer whose ``backend`` is the ``vllm_server`` backend of a ``posttrain
    serve`` server (possibly wrapped in the tool-calling loop: the server backend is ``trainer._inner_backend()``).

    Why a component, not a base class: the async trainers are a synchronous trainer (GRPO, distillation) whose data
    source is a worker process; keeping that source in one object leaves each trainer's class chain (and its one
    ``_compute_loss``) the synchronous trainer's, and names exactly the hooks the trainer wires to it:

    - ``__init__``: ``self.async_rollout = AsyncRollout(self, make_spec=..., score=...)``, at the end of the
      trainer's constructor (it registers the weight-sync callback);
    - ``train``: ``self.async_rollout.run(super().train, ...)`` (joins the last push, stops the worker);
    - ``evaluate`` / ``_save_checkpoint``: ``self.async_rollout.join_push()`` first;
    - ``_prepare_inputs``: ``self.async_rollout.prepare_inputs(inputs, super()._prepare_inputs)``;
    - ``_load_rng_state``: ``self.async_rollout.load_rng_state(checkpoint, super()._load_rng_state)``;
    - ``_extra_checkpoint_state`` / ``_load_extra_checkpoint_state``: ``checkpoint_state`` / ``load_checkpoint_state``.

    Args:
        trainer: The trainer (read: ``args``, ``state``, ``accelerator``, ``model``, ``buffer``, ``_inner_backend()``,
            ``_record``, ``record_metric``, ``_mode()``; written: ``_last_synced_step``, ``_pending_completions``).
        make_spec: Builds the pickled spec of the trainer's round producer (with :meth:`spec_fields`).
        score: What a consumed round needs under the weights trained now, ``score(batch, record) -> batch`` on the
            trainer's device; None: just move it there (:meth:`to_device`).
        trainer_name: Names the trainer in errors (``AsyncGRPO``, ``AsyncDistillation``).
        picklable_hint: Appended to the "must be picklable" error: what the user passed that the worker receives.
    """

    def __init__(
        self,
        trainer: Any,
        make_spec: Callable[[], AsyncWorkerSpec],
        score: Callable[[Any, Callable[[str, float], None]], Any] | None = None,
        trainer_name: str = "Async",
        picklable_hint: str = "the dataset and processing class",
    ):
        self.trainer = trainer
        self.make_spec = make_spec
        self.score = score if score is not None else self.to_device
        self.trainer_name = trainer_name
        self.picklable_hint = picklable_hint
        self.worker: Any = None
        self.queue: Any = None
        self.stop: Any = None
        self.next_round = 0  # first round not yet consumed (the trained position; saved in rollout_state.json)
        self.dropped_stale_total = 0
        self.trained_rounds: list[dict[str, Any]] = []  # {"step", "round", "version", "staleness"} per trained round
        # partial rollouts: group ordinals consumed (trained or dropped) above the first one not consumed yet
        self.partial_next_group: int | None = None  # None: whole rounds (no group bookkeeping)
        self.partial_consumed: set[int] = set()
        self.uploader: WeightUploader | None = None
        self.push_client: Any = None
        self._probe_lock = threading.Lock()
        self._probe_expected: dict[int, tuple[list[int], list[float]]] = {}  # version -> (sequence, log-probs)
        self.heartbeat: Any = None  # the worker's shared heartbeat clock
        self.worker_started = 0.0  # time.time() of the spawn (a starting worker has not beaten yet)
        self._rng_restore: tuple[Callable[[Any], None], Any] | None = None  # see load_rng_state
        trainer.add_callback(_WeightSyncCallback(self))
        # several training processes: the worker runs on rank 0, which sends each rank its shard of every round
        self.ranks = RankRounds.for_trainer(trainer, trainer_name)

    @property
    def args(self) -> Any:
        return self.trainer.args

    def _server(self) -> Any:
        return self.trainer._inner_backend()

    def load_rng_state(self, checkpoint: str | None, restore: Callable[[Any], None]) -> None:
        """The trainer's ``_load_rng_state``: HF's ``restore``, and again before the resumed run's first training
        micro-step.

        With ``ignore_data_skip`` (set by :func:`check_async_rollout_options`) HF restores the checkpoint's RNG
        state *before* it creates the epoch's dataloader iterator, which draws its base seed from the global torch
        RNG; the generation-batch shuffle (TRL's: the global RNG) would then see another state than the
        uninterrupted run. Restored again at the first micro-step, it sees the same one (HF does likewise when it
        skips batches: ``rng_to_sync``). Not when the checkpoint ends an epoch (``state.epoch`` integral): the
        uninterrupted run then also created the next epoch's iterator (one draw) before its next shuffle, so HF's
        restore alone already matches it."""
        restore(checkpoint)
        if self._checkpoint_ends_an_epoch():
            return
        self._rng_restore = (restore, checkpoint)

    def _checkpoint_ends_an_epoch(self) -> bool:
        """Whether the checkpoint being resumed ends an epoch of a map-style dataset. A streaming dataset has no
        epochs of known length (HF counts ``state.epoch`` against ``max_steps`` there, so a 1-step run's checkpoint
        reads 1.0 though a longer run is mid-stream at that step): never an epoch end."""
        from datasets import IterableDataset

        if isinstance(getattr(self.trainer, "train_dataset", None), IterableDataset):
            return False
        epoch = getattr(self.trainer.state, "epoch", None)
        return epoch is not None and float(epoch).is_integer()

    # -- worker lifecycle --------------------------------------------------------------------------------------
    def num_processes(self) -> int:
        """Training processes (accelerate's ``num_processes``; 1 for a trainer without an accelerator)."""
        return int(getattr(getattr(self.trainer, "accelerator", None), "num_processes", 1))

    def round_rows(self) -> int:
        """Rows (completions) per round: one optimizer step's worth, over every training process."""
        return self.args.per_device_train_batch_size * self.args.steps_per_generation * self.num_processes()

    def spec_fields(self) -> dict[str, Any]:
        """The :class:`AsyncWorkerSpec` fields every worker shares, from the trainer's config and sampler."""
        args, trainer = self.args, self.trainer
        rows = self.round_rows()
        inflight = args.max_inflight_tasks
        if inflight is None or inflight < 0:
            inflight = args.max_staleness * rows  # max_staleness rounds
        return dict(
            dataset=trainer.train_dataset, tokenizer=trainer.processing_class, sampling=trainer.sampling,
            base_url=self._server().base_url, base_urls=getattr(self._server(), "base_urls", None),
            num_generations=trainer.num_generations,
            prompts_per_round=trainer._prompts_per_round(), shuffle=bool(args.shuffle_dataset), seed=int(args.seed),
            start_round=self.next_round, ahead=max(0, inflight // rows), request_timeout=float(args.request_timeout),
            server_timeout=float(args.vllm_server_timeout), seed_requests=bool(args.seed_requests),
            client_kwargs={"health_check_interval": getattr(args, "vllm_server_health_check_interval", 10.0)},
            num_processes=self.num_processes(),
        )  # fmt: skip

    def checked_spec(self) -> AsyncWorkerSpec:
        spec = self.make_spec()
        try:
            pickle.dumps(spec)
        except Exception as err:
            raise TypeError(
                f"{type(self.trainer).__name__} runs rollouts in a separate process, so {self.picklable_hint} must be "
                "picklable: use module-level functions, functools.partial or callable class instances, not lambdas "
                f"or closures ({type(err).__name__}: {err})."
            ) from err
        return spec

    def start_worker(self) -> None:
        """Push the current weights (version = global_step) and wait, then spawn the worker at ``next_round``."""
        from posttrain.generation.client import GenerationClient

        server = self._server()
        if server.protocol != "posttrain":
            raise ValueError(
                f"{self.trainer_name} needs a `posttrain serve` / `posttrain vllm-serve` server; "
                f"{server.base_url} speaks the {server.protocol!r} protocol."
            )
        if self.push_client is None:
            sync_timeout = getattr(self.args, "weight_sync_timeout", None)
            push_timeout = float(sync_timeout if sync_timeout is not None else self.args.request_timeout)
            clients = [
                GenerationClient(
                    url,
                    request_timeout=push_timeout,
                    health_check_interval=getattr(self.args, "vllm_server_health_check_interval", 10.0),
                    timeout_hint="weight_sync_timeout" if sync_timeout is not None else "request_timeout",
                )  # fmt: skip
                for url in getattr(server, "base_urls", None) or [server.base_url]
            ]
            if len(clients) > 1:
                from posttrain.generation.server_pool import PushFanout

                self.push_client = PushFanout(clients)
            else:
                self.push_client = clients[0]
        self.push_weights(wait=True)  # the server must hold this step's weights before the worker reads its version
        spec = self.checked_spec()
        context = multiprocessing.get_context("spawn")
        rounds = max(1, self.args.queue_maxsize // self.round_rows())
        self.queue = context.Queue(maxsize=rounds)
        self.stop = context.Event()
        self.heartbeat = context.Value("d", 0.0)
        self.worker = context.Process(
            target=run_worker, args=(spec, self.queue, self.stop, os.getpid(), self.heartbeat),
            name="posttrain-rollout-worker", daemon=True,
        )  # fmt: skip
        self.worker_started = time.time()
        self.worker.start()

    def check_heartbeat(self) -> None:
        """Raise ``RolloutWorkerError`` when the worker's heartbeat is older than ``heartbeat_stale_after_s`` (a
        starting worker, not yet beating, gets ``vllm_server_timeout`` more for spawn and imports)."""
        stale_after = getattr(self.args, "heartbeat_stale_after_s", None)
        if stale_after is None or self.heartbeat is None:
            return
        last = self.heartbeat.value
        if last:
            age, limit = time.time() - last, float(stale_after)
        else:
            age, limit = time.time() - self.worker_started, float(stale_after) + float(self.args.vllm_server_timeout)
        if age > limit:
            self.worker.terminate()  # hung: it would not see the stop event
            self.stop_worker()
            raise RolloutWorkerError(
                f"The rollout worker made no progress for {age:.1f} s (heartbeat_stale_after_s={stale_after:g}): it "
                "is hung, e.g. on a generation or teacher server that accepts requests but never answers. Check the "
                "servers, or raise heartbeat_stale_after_s if one round legitimately takes longer."
            )

    def stop_worker(self) -> None:
        """Stop, join (terminate, then kill if needed) and release the worker and its queue. Idempotent."""
        worker, self.worker = self.worker, None
        if worker is None:
            return
        self.stop.set()
        deadline = time.monotonic() + 10.0
        while worker.is_alive() and time.monotonic() < deadline:
            with contextlib.suppress(queue_module.Empty, OSError, ValueError):  # drain: a put() must not block
                self.queue.get(timeout=0.05)
        if worker.is_alive():
            worker.terminate()
            worker.join(timeout=5)
        if worker.is_alive():
            worker.kill()
        worker.join(timeout=5)
        self.queue.cancel_join_thread()
        self.queue.close()
        self.queue = None

    def run(self, train: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``train(*args, **kwargs)`` (the trainer's synchronous ``train``), then wait for the last push; always
        stop the worker and release the uploader and the push client."""
        try:
            result = train(*args, **kwargs)
            self.join_push()  # the last push has landed (or its error is raised)
            return result
        finally:
            self.close()

    def close(self) -> None:
        """Stop the worker, the uploader thread and the push client. Idempotent."""
        self.stop_worker()
        uploader, self.uploader = self.uploader, None
        if uploader is not None:
            uploader.close()
        if self.push_client is not None:
            self.push_client.close()
            self.push_client = None

    # -- weights -----------------------------------------------------------------------------------------------
    def push_weights(self, wait: bool = False) -> None:
        """Snapshot the weights now (safetensors bytes) and hand them to the uploader with ``version = global_step``.

        The server applies a weight load between generation requests, so a synchronous push would block training
        until the round being generated finishes; the uploader's one-slot mailbox lets the next step start at
        once (a snapshot not yet sent when a newer one arrives is dropped, counted in
        ``perf/weight_pushes_superseded_total``). ``wait`` blocks until it is on the server.
        """
        from posttrain.generation.weights import push_payload

        if self.ranks is not None and not self.ranks.is_main:  # rank 0 pushes (see follow_push)
            if self.ranks.started:
                self.follow_push()
            return
        if self.push_client is None:  # not connected yet: the worker's start pushes these weights
            return
        if self.uploader is None:
            self.uploader = WeightUploader(self._upload_and_probe)
        trainer = self.trainer
        start = time.perf_counter()
        step = trainer.state.global_step
        model = trainer.accelerator.unwrap_model(trainer.model)
        server = self._server()
        adapter_only = server.use_adapter_sync(model) if hasattr(server, "use_adapter_sync") else False
        with push_payload(model, server.chunk_bytes, adapter_only=adapter_only) as payload:
            chunks = list(payload)
        self._expect_probe(step)
        self.uploader.offer(chunks, step)
        trainer._last_synced_step = step
        trainer.record_metric("perf/weight_sync_s", time.perf_counter() - start, mode="train")
        trainer.record_metric("perf/weight_sync_bytes", float(sum(len(c) for c in chunks)), mode="train")
        trainer.record_metric("perf/weight_pushes_superseded_total", float(self.uploader.superseded), mode="train")
        if wait:
            self._join_upload()

    def follow_push(self) -> None:
        """A rank > 0 at a weight push: with FSDP2-sharded weights, take part in the gather rank 0's snapshot runs
        (``full_tensor()`` per parameter, then the probe's forward) and drop the bytes; with the full weights on every
        rank (DDP) there is nothing to do but note the step."""
        trainer = self.trainer
        step = trainer.state.global_step
        if self.ranks.gather_mode == "collective":
            from posttrain.generation.weights import push_payload

            model = trainer.accelerator.unwrap_model(trainer.model)
            server = self._server()
            adapter_only = server.use_adapter_sync(model) if hasattr(server, "use_adapter_sync") else False
            with push_payload(model, server.chunk_bytes, adapter_only=adapter_only) as payload:
                for _ in payload:
                    pass
            self._expect_probe(step)
        trainer._last_synced_step = step

    def _expect_probe(self, version: int) -> None:
        """With ``vllm_weight_sync_probe``: the trainer's log-probs of the fixed probe sequence under the weights
        being snapshotted, kept for the upload of ``version`` (the trainer moves on before it lands)."""
        if not getattr(self.args, "vllm_weight_sync_probe", False):
            return
        from posttrain.generation.weights import PROBE_PROMPT_LENGTH, probe_logprobs, probe_sequence

        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        sequence = probe_sequence(int(model.config.vocab_size))
        expected = probe_logprobs(model, sequence[:PROBE_PROMPT_LENGTH], sequence[PROBE_PROMPT_LENGTH:])
        with self._probe_lock:
            self._probe_expected = {v: e for v, e in self._probe_expected.items() if v > version - 8}
            self._probe_expected[int(version)] = (sequence, expected)

    def _upload_and_probe(self, chunks: list[bytes], version: int) -> int:
        """The uploader's job: push ``chunks`` as ``version`` (digests and version checked by the client), then, with
        ``vllm_weight_sync_probe``, have the server score the probe sequence and compare (``WeightSyncError``)."""
        from posttrain.generation.vllm_server import check_probe
        from posttrain.generation.weights import PROBE_PROMPT_LENGTH

        server_version = self.push_client.load_weights(chunks, version)
        with self._probe_lock:
            probe = self._probe_expected.pop(int(version), None)
        if probe is not None:
            sequence, expected = probe
            scored = self.push_client.get_sequence_logprobs([sequence], [PROBE_PROMPT_LENGTH], 0, 1.0)
            server = [row[0] for row in scored["actual_logprobs"][0]]
            check_probe(server, expected, float(getattr(self.args, "vllm_weight_sync_probe_atol", 0.02)),
                        prompt=sequence[:PROBE_PROMPT_LENGTH], tokens=sequence[PROBE_PROMPT_LENGTH:],
                        where=self.push_client.base_url, version=server_version)  # fmt: skip
        return server_version

    def join_push(self, check_only: bool = False) -> None:
        """Wait for the upload in flight (or, ``check_only``, just look whether one failed) and raise its error; past
        ``weight_sync_timeout`` (when the config has one; it counts the upload, not the snapshot) raise
        ``TimeoutError`` naming it. Several processes (every rank calls it, but ``check_only``): the other ranks
        wait until rank 0's push landed, so what follows (evaluation) sees the pushed weights on the server."""
        self._join_upload(check_only)
        if not check_only and self.ranks is not None and self.ranks.started:
            self.ranks.channel.barrier("wait for rank 0's weight push to land on the server")

    def _join_upload(self, check_only: bool = False) -> None:
        uploader = self.uploader
        if uploader is None:
            return
        if check_only:
            uploader.check()
            return
        sync_timeout = getattr(self.args, "weight_sync_timeout", None)
        try:
            uploader.wait(timeout=None if sync_timeout is None else float(sync_timeout))
        except BaseException as err:
            late = isinstance(err, TimeoutError) or uploader.upload_seconds >= float(sync_timeout or "inf")
            if sync_timeout is None or not late:
                raise
            raise TimeoutError(
                f"The weight push to {self._server().base_url} did not complete within weight_sync_timeout="
                f"{sync_timeout:g} s. Check that the server is up and not stuck, or raise weight_sync_timeout for "
                "a large model or a slow link."
            ) from err
        if uploader.server_version is not None:
            self._server().version = uploader.server_version

    # -- data path ---------------------------------------------------------------------------------------------
    def prepare_inputs(self, inputs: list[dict[str, Any]], synchronous: Callable[[Any], Any]) -> Any:
        """The trainer's ``_prepare_inputs``: training micro-batches come from the worker's rounds (the HF
        dataloader's rows only pace the epochs/steps); evaluation batches are generated by ``synchronous`` (the
        synchronous trainer's ``_prepare_inputs``) on the server's current weights, without a push."""
        trainer = self.trainer
        if trainer._mode() == "eval":
            trainer._last_synced_step = trainer.state.global_step
            return synchronous(inputs)
        if self._rng_restore is not None:  # see load_rng_state
            restore, checkpoint = self._rng_restore
            self._rng_restore = None
            restore(checkpoint)
        if trainer.buffer.needs_generation():
            trainer.buffer.fill(self.next_trainable_round())
        return trainer.buffer.next()

    def get_item(self) -> tuple:
        """The next message from the worker; raises ``RolloutWorkerError`` if it failed or died."""
        if self.worker is None:
            self.start_worker()
        while True:
            try:
                message = self.queue.get(timeout=_QUEUE_POLL_S)
            except queue_module.Empty:
                if self.ranks is not None:
                    self.ranks.channel.keepalive()  # the other ranks wait for this round: tell them rank 0 is alive
                self.join_push(check_only=True)
                if not self.worker.is_alive():
                    code = self.worker.exitcode
                    self.stop_worker()
                    raise RolloutWorkerError(f"The rollout worker exited unexpectedly (exit code {code}).") from None
                self.check_heartbeat()
                continue
            if message[0] == "error":
                _, kind, text, trace = message
                self.stop_worker()
                raise RolloutWorkerError(f"The rollout worker failed: {kind}: {text}\n\nWorker traceback:\n{trace}")
            if message[0] == "done":
                self.stop_worker()
                raise RolloutWorkerError(f"The rollout worker ran out of rounds at round {message[1]}.")
            return message

    def take_fresh_round(self, step: int) -> tuple[dict[str, Any], int]:
        """Take rounds from the queue, dropping (and counting) the stale ones; the first fresh one and its staleness."""
        from posttrain.rollout.buffer import batch_size_of

        while True:
            item = pickle.loads(self.get_item()[1])
            # partial rollouts: per-token versions; the round's "version" is its oldest token's (per-token rule)
            batch = item["batch"]  # a dict; several processes: a list of one shard per rank (no partial rollouts)
            token_versions = batch.pop("token_versions", None) if isinstance(batch, dict) else None
            item["token_versions"] = token_versions
            staleness = step - item["version"]
            if staleness < 0 or (token_versions is not None and int(token_versions.max()) > step):
                raise RolloutWorkerError(
                    f"A round was generated with weight version {item['version']}, ahead of the trainer's step "
                    f"{step}: is another trainer pushing weights to {self._server().base_url}?"
                )
            self.next_round = item["round"] + 1
            if item.get("groups") is not None:
                self._consume_groups(item["groups"])
            if staleness <= self.args.max_staleness:
                return item, staleness
            batch = item["batch"]  # several processes: one shard per rank
            shards = [shard["batch"] for shard in batch] if isinstance(batch, list) else [batch]
            self.dropped_stale_total += sum(batch_size_of(shard) for shard in shards)

    def queued_rows(self) -> float:
        """Rows waiting in the worker's queue (rank 0; other ranks: rank 0's count when it sent the last round)."""
        if self.queue is None:
            return float(self.ranks.queued_rows if self.ranks is not None else 0)
        try:
            return float(self.queue.qsize() * self.round_rows())
        except (NotImplementedError, OSError, ValueError):  # qsize is not available everywhere (macOS)
            return float("nan")

    def next_trainable_round(self) -> Any:
        """Take rounds from the queue, dropping stale ones, and prepare the first fresh one for the loss (several
        processes: rank 0 decides and sends each rank its shard, ``posttrain.rollout.multiprocess``)."""
        trainer = self.trainer
        wait_start = time.perf_counter()
        step = trainer.state.global_step
        if self.ranks is not None:
            item = self.ranks.next_item(self, step)
            staleness = item["staleness"]
            self.next_round, self.dropped_stale_total = item["round"] + 1, item["dropped_stale_total"]
            self.ranks.queued_rows = item["queued_rows"]
        else:
            item, staleness = self.take_fresh_round(step)
        record = trainer._record("train")
        record("perf/rollout_wait_s", time.perf_counter() - wait_start)
        record("sample/time_in_queue_s", max(0.0, time.time() - item["put_time"]))
        entry: dict[str, Any] = {"step": step, "round": item["round"], "version": item["version"],
                                 "staleness": staleness}  # fmt: skip
        token_versions = item.get("token_versions")
        if token_versions is None:
            record("sample/staleness_mean", float(staleness))  # one version per round: mean = max
            record("sample/staleness_max", float(staleness))
        else:
            self._record_version_lags(record, item["batch"], token_versions, step, entry)
            entry["groups"] = list(item.get("groups") or [])
        record("sample/version", float(item["version"]))
        record("sample/dropped_stale_total", float(self.dropped_stale_total))
        for name, value in item["metrics"]:
            record(name, value)
        self.trained_rounds.append(entry)
        if item["table"] is not None:
            trainer._pending_completions = item["table"]
        return self.score(item["batch"], record)

    def _record_version_lags(self, record: Callable[[str, float], None], batch: Any, token_versions: Any, step: int,
                             entry: dict[str, Any]) -> None:  # fmt: skip
        """Partial rollouts: the round's token-level version-lag distribution (``core.staleness``): mean / max lag
        over every sampled completion token and ``sample/version_lag_frac/<k>``, the fraction of tokens ``k``
        versions old (k = 0 .. max_staleness). ``entry`` (``trained_rounds``) keeps the per-token versions."""
        import torch

        from posttrain.core.staleness import version_lag_stats

        width = token_versions.shape[1]
        valid = torch.arange(width).unsqueeze(0) < batch["completion_lengths"].cpu().unsqueeze(1)  # (B, C)
        stats = version_lag_stats(token_versions, valid, step)
        record("sample/staleness_mean", stats["mean"])
        record("sample/staleness_max", float(stats["max"]))
        for lag in range(self.args.max_staleness + 1):
            record(f"sample/version_lag_frac/{lag}", stats["frac"].get(lag, 0.0))
        entry["token_versions"] = [
            row[: int(n)] for row, n in zip(token_versions.tolist(), batch["completion_lengths"])
        ]
        entry["lag_max"], entry["lag_mean"] = stats["max"], stats["mean"]

    def _consume_groups(self, ordinals: list[int]) -> None:
        """Partial rollouts: mark group ordinals consumed; advance the first-not-consumed mark (resume state)."""
        if self.partial_next_group is None:
            self.partial_next_group = 0
        self.partial_consumed.update(int(k) for k in ordinals)
        while self.partial_next_group in self.partial_consumed:
            self.partial_consumed.discard(self.partial_next_group)
            self.partial_next_group += 1

    def to_device(self, batch: Any, record: Callable[[str, float], None] | None = None) -> Any:
        """A round that needs nothing more under the current weights: its tensors moved to the trainer's device."""
        import torch

        device = self.trainer.accelerator.device
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    # -- checkpoints -------------------------------------------------------------------------------------------
    def checkpoint_state(self, states: dict[str, Any]) -> dict[str, Any]:
        """``states`` (the trainer's other resume files) plus ``rollout_state.json``."""
        state = {
            "next_round": self.next_round,
            "weight_version": int(self.trainer._last_synced_step or 0),
            "dropped_stale_total": self.dropped_stale_total,
        }
        if self.partial_next_group is not None:  # partial rollouts: which groups are consumed (the rest regenerate)
            state["partial_next_group"] = self.partial_next_group
            state["partial_consumed_groups"] = sorted(self.partial_consumed)
        return {**states, ROLLOUT_STATE: state}

    def load_checkpoint_state(self, states: dict[str, Any]) -> None:
        if ROLLOUT_STATE in states:
            self.next_round = int(states[ROLLOUT_STATE]["next_round"])
            self.dropped_stale_total = int(states[ROLLOUT_STATE]["dropped_stale_total"])
            if "partial_next_group" in states[ROLLOUT_STATE]:
                self.partial_next_group = int(states[ROLLOUT_STATE]["partial_next_group"])
                self.partial_consumed = {int(k) for k in states[ROLLOUT_STATE]["partial_consumed_groups"]}
