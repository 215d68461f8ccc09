"""The AsyncGRPO rollout worker: a spawned CPU process that streams scored generation rounds into a bounded queue.

One *round* is one optimizer step's worth of rows (``generation_batch_size`` = ``per_device_train_batch_size ×
gradient_accumulation_steps`` completions, whole groups of ``num_generations``), taken from the same
``RepeatSampler`` order as ``GRPOTrainer`` (round ``r`` is chunk ``r`` of the shuffled prompts, epoch ``e`` seeded
``seed + e``). For each round the worker runs the shared ``RolloutPipeline`` (render prompts → generate through the
``vllm_server`` backend → decode → score rewards → group-relative advantages → metrics) with no policy in this
process: π_old, π_ref and the importance-sampling ratio are computed by the trainer when it consumes the round,
under the weights it trains with. The round is tagged with the weight ``version`` the server reported for it.

Admission: round ``r`` is sent only when ``r - server_version <= ahead`` (``ahead = max_inflight_tasks //
generation_batch_size``), so by default (``max_inflight_tasks = max_staleness × batch``) nothing is generated that
would already be too stale when the trainer reaches it. Request seeds follow the round index (``request_seed(seed,
0, r)``), so a round has the same tokens whenever it is generated from the same weights (resume, ``max_staleness=0``).

Everything in ``RolloutWorkerSpec`` is pickled into the child (reward functions must be picklable, as in TRL). Rounds
cross the process boundary as ``pickle`` bytes (tensors by value; no shared-memory file descriptors to leak). Errors
go back as ``("error", type, message, traceback)``; the worker exits when the trainer sets ``stop`` or dies.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue as queue_module
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

POLL_MIN_S, POLL_MAX_S = 0.005, 0.2


@dataclass
class RolloutWorkerSpec:
    """What the worker process needs (pickled): data, tokenizer, scorer, estimator, sampling, server."""

    dataset: Any
    tokenizer: Any
    scorer: Any
    estimator: Any
    sampling: Any
    settings: Any
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


class RoundSource:
    """Rows of round ``r``: chunk ``r`` of ``RepeatSampler``'s order (the same prompts, in the same order, as GRPO)."""

    def __init__(self, dataset: Any, num_generations: int, prompts_per_round: int, shuffle: bool, seed: int):
        from posttrain.rollout.sampler import RepeatSampler

        self.dataset = dataset
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


def _put(out: Any, payload: Any, stop: Any, parent: int) -> float:
    """Put with backpressure; returns the seconds spent blocked on a full queue (or exits when stopping)."""
    start = time.perf_counter()
    while not stop.is_set() and os.getppid() == parent:
        try:
            out.put(payload, timeout=0.2)
            return time.perf_counter() - start
        except queue_module.Full:
            continue
    raise SystemExit(0)


def run_worker(spec: RolloutWorkerSpec, out: Any, stop: Any, parent: int) -> None:
    """Process entry point: generate rounds ``spec.start_round, ...`` until ``stop`` is set (see the module doc)."""
    try:
        _loop(spec, out, stop, parent)
    except SystemExit:
        pass
    except BaseException as err:  # reported to the trainer, which raises it
        with contextlib.suppress(Exception):
            out.put(("error", type(err).__name__, str(err), traceback.format_exc()), timeout=5)


def _loop(spec: RolloutWorkerSpec, out: Any, stop: Any, parent: int) -> None:
    import torch

    from posttrain.generation.vllm_server import VLLMServerBackend
    from posttrain.rollout.pipeline import RolloutPipeline

    torch.set_num_threads(1)  # the worker waits on HTTP and scores rewards; leave the cores to server and trainer
    source = RoundSource(spec.dataset, spec.num_generations, spec.prompts_per_round, spec.shuffle, spec.seed)
    backend = VLLMServerBackend(
        tokenizer=spec.tokenizer, base_url=spec.base_url, protocol="posttrain", timeout=spec.server_timeout,
        seed=spec.seed, seed_requests=spec.seed_requests,
        client_kwargs={"request_timeout": spec.request_timeout, **spec.client_kwargs},
    )  # fmt: skip
    pipeline = RolloutPipeline(
        tokenizer=spec.tokenizer, backend=backend, scorer=spec.scorer, sampling=spec.sampling,
        settings=spec.settings, estimator=spec.estimator, policy_logps=_no_policy,
    )  # fmt: skip
    backpressure = 0.0
    r = spec.start_round
    while spec.max_rounds is None or r < spec.max_rounds:
        wait = POLL_MIN_S
        while not stop.is_set():  # admission: do not run further ahead of the weights than `ahead` rounds
            if os.getppid() != parent:
                return
            version = int(backend.client.health().get("version") or 0)
            if r - version <= spec.ahead:
                break
            time.sleep(wait)
            wait = min(2 * wait, POLL_MAX_S)  # back off: each poll costs the server a request
        if stop.is_set():
            return
        backend._requests = r  # request seed of round r: the same tokens whenever generated from the same weights
        metrics: list[tuple[str, float]] = []
        start, cpu = time.perf_counter(), time.process_time()
        batch = pipeline.run(
            source.rows(r),
            trainer_state=SimpleNamespace(global_step=backend.version),
            record_metric=lambda name, value, sink=metrics: sink.append((name, float(value))),
        )
        metrics.append(("rollout/duration_s", time.perf_counter() - start))
        metrics.append(("rollout/cpu_s", time.process_time() - cpu))
        metrics.append(("rollout/backpressure_s", backpressure))
        item = {"round": r, "version": int(backend.version or 0), "batch": batch, "metrics": metrics,
                "table": pipeline.last_completions, "put_time": time.time()}  # fmt: skip
        backpressure = _put(out, ("round", pickle.dumps(item)), stop, parent)
        r += 1
    _put(out, ("done", r), stop, parent)


def _no_policy(batch: Any) -> Any:
    raise RuntimeError("The rollout worker has no policy: π_old / π_ref are computed by the trainer.")
