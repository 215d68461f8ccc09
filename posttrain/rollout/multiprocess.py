"""Multi-process training for the async trainers (AsyncGRPO, AsyncDistillation): one rollout worker feeds every rank.

Under accelerate / torchrun with ``N`` training processes (DDP; FSDP2 where noted):

- **One rollout worker, on rank 0.** Why not one per rank or one per node: a round's weight version, its staleness,
  the decision to drop it and the resume position (``next_round``) must be one value for every rank — DDP ranks
  all-reduce their gradients every step, so a round dropped on one rank and trained on another would mix rounds, and
  ranks deciding on their own can disagree (a push lands between their two checks). One producer makes it one
  decision, taken on rank 0 and sent with the round. The worker mostly waits on HTTP (the servers generate) and
  scores rewards, so one process per run does not bound the throughput of the servers it drives; workers per node
  would each need that agreement protocol plus a cross-node reward gather for group-relative advantages. Rank 0 is
  also the one rank that pushes weights (it holds the full weights under DDP), so the server version the worker's
  admission reads and the pushes that move it are on one machine.
- **Virtual ranks in the worker** (:class:`RankShards`). The worker produces each round as ``N`` shards, shard ``r``
  being exactly what rank ``r`` of the synchronous server-mode trainer produces: the same rows (the ``r``-th
  contiguous ``1/N`` of the round, as accelerate hands out the ``RepeatSampler`` batch), one request seeded with
  ``request_seed(seed, r, round)`` (``seed_rank`` of the backend), padded to its own lengths, rewards and advantages
  over the whole round (a group split across ranks is normalised whole), metrics over all shards. The shards run as
  ``N`` threads, each with its own backend and its own pipeline, whose "accelerator" (:class:`VirtualRankAccelerator`)
  gathers over the threads; ``posttrain serve`` runs a seeded request alone, so concurrent requests do not change
  each other's tokens. Hence ``max_staleness=0`` with ``N`` processes is the synchronous ``N``-process run bitwise.
- **Distribution** (:class:`RoundChannel`, :class:`RankRounds`). At the first micro-step of each optimizer step every
  rank asks for the next round. Rank 0 takes rounds from the worker's queue (dropping stale ones, as with one
  process) and scatters shard ``r`` to rank ``r`` over a gloo group of its own (pickled CPU objects, whatever backend
  trains), with the round index, its version and staleness, the drop counter and the shard's metrics, so every rank
  keeps the same ``rollout_state.json``. While rank 0 waits for the worker it sends a keep-alive every
  ``KEEPALIVE_S``; a failure on rank 0 (worker error, stale heartbeat, failed push) is sent to the other ranks, which
  raise ``RolloutWorkerError`` with its text. A rank that hears nothing from rank 0 for the group's timeout
  (``max(request_timeout, weight_sync_timeout) + vllm_server_timeout + 60`` s: rank 0 sends nothing only while it
  pushes the starting weights and spawns the worker) raises naming the round it waited for.
- **Weights** (:func:`weight_gather_mode`). After the optimizer step rank 0 snapshots and pushes (the verified push
  and probe of one process). DDP, and DeepSpeed ZeRO-1/2, keep the full weights on every rank: rank 0 alone
  snapshots. FSDP2 shards parameters as DTensors that ``policy_weights`` gathers with ``full_tensor()`` — a
  collective — so every rank walks the snapshot and rank 0 keeps the bytes (not run here: no GPU). FSDP1 and ZeRO-3
  have no such gather in the push and are refused at construction, naming the option.
- **Resume**: ``rollout_state.json`` is the same on every rank; RNG states and the micro-batch buffer are per
  process (HF's ``rng_state_{i}.pth``, posttrain's ``posttrain_state_{i}.pt``), as in synchronous training.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from posttrain.rollout.errors import RolloutWorkerError

__all__ = [
    "KEEPALIVE_S",
    "RankRounds",
    "RankShards",
    "RoundChannel",
    "VirtualRankAccelerator",
    "VirtualRankGroup",
    "weight_gather_mode",
]

KEEPALIVE_S = 2.0  # rank 0 tells the others it is still waiting for the worker at least this often


# ----------------------------------------------------------------------------------------------------------------
# Which distributed modes can push
# ----------------------------------------------------------------------------------------------------------------


def weight_gather_mode(accelerator: Any, trainer_name: str) -> str:
    """How a weight push reads the full weights under ``accelerator``'s distributed mode.

    Returns ``"single"`` (one process), ``"rank0"`` (every rank holds the full weights — DDP on CPU or GPUs,
    DeepSpeed ZeRO-1/2 —, rank 0 alone snapshots) or ``"collective"`` (FSDP2: parameters are DTensors gathered with
    ``full_tensor()``, every rank takes part). Raises ``ValueError`` naming the option for FSDP1 and ZeRO-3, whose
    sharded parameters the push cannot gather, and for any other mode.
    """
    if int(getattr(accelerator, "num_processes", 1)) <= 1:
        return "single"
    kind = getattr(accelerator, "distributed_type", None)
    name = str(getattr(kind, "value", kind)).upper()
    if name.startswith("MULTI_"):
        return "rank0"
    if name == "DEEPSPEED":
        plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
        stage = getattr(plugin, "zero_stage", None)
        if stage == 3:
            raise ValueError(
                f"{trainer_name} with {accelerator.num_processes} processes pushes its weights from rank 0, which "
                "cannot gather DeepSpeed ZeRO-3 partitioned parameters: set zero_stage to 1 or 2 in the DeepSpeed "
                "config (or use FSDP2: fsdp_version 2)."
            )
        return "rank0"
    if name == "FSDP":
        if getattr(accelerator, "is_fsdp2", False):
            return "collective"
        raise ValueError(
            f"{trainer_name} with {accelerator.num_processes} processes gathers FSDP-sharded weights for its push "
            "with DTensor.full_tensor(), which FSDP1's flat parameters do not have: set fsdp_version: 2 in the "
            "accelerate config (or use DDP)."
        )
    raise ValueError(
        f"{trainer_name} with {accelerator.num_processes} processes supports DDP (multi-CPU / multi-GPU), DeepSpeed "
        f"ZeRO-1/2 and FSDP2; the accelerate distributed_type is {name}. Launch with `accelerate launch` (DDP) or "
        "`torchrun` instead."
    )


# ----------------------------------------------------------------------------------------------------------------
# Worker side: N virtual ranks in threads
# ----------------------------------------------------------------------------------------------------------------


class VirtualRankGroup:
    """``size`` threads exchanging values in lock-step (an all-gather through a barrier).

    A thread that fails calls :meth:`abort`; the others, waiting or arriving at the barrier, then raise
    ``RuntimeError`` instead of waiting forever. No timeout of its own: each thread's waits are bounded by its
    peers' server requests (``request_timeout``)."""

    def __init__(self, size: int):
        self.size = size
        self._barrier = threading.Barrier(size)
        self._slots: list[Any] = [None] * size

    def all_gather(self, rank: int, value: Any) -> list[Any]:
        """Every thread's ``value``, in rank order (each thread must call it, in the same order)."""
        self._slots[rank] = value
        self._wait()
        out = list(self._slots)
        self._wait()  # nobody overwrites a slot before every thread read them
        return out

    def _wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise RuntimeError("another virtual rank of the rollout worker failed") from None

    def abort(self) -> None:
        self._barrier.abort()


class VirtualRankAccelerator:
    """What a rollout pipeline reads of an accelerator (``num_processes``, ``process_index``, ``device``,
    ``gather``), for virtual rank ``process_index`` of a :class:`VirtualRankGroup`; ``gather_python_objects`` is the
    list gather ``posttrain.distributed.gather_objects`` uses. ``group`` is set per round."""

    device = torch.device("cpu")

    def __init__(self, process_index: int, num_processes: int):
        self.process_index = process_index
        self.num_processes = num_processes
        self.group: VirtualRankGroup | None = None

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` of every virtual rank concatenated along dim 0 (a 0-d tensor counts as one row, as accelerate's
        ``gather``)."""
        tensor = tensor.detach().to("cpu")
        if tensor.ndim == 0:
            tensor = tensor.reshape(1)
        return torch.cat(self.group.all_gather(self.process_index, tensor), dim=0)

    def gather_python_objects(self, values: list) -> list:
        return [value for part in self.group.all_gather(self.process_index, list(values)) for value in part]


class RankShards:
    """The worker's round producer for ``num_processes`` training ranks (see the module docstring).

    Args:
        spec: The worker spec (``make_producer(backend, accelerator)``, ``num_processes``).
        make_backend: Builds one generation backend (called once per virtual rank).
        beat: Called on every metric a shard records (the worker's heartbeat).

    ``__call__(rows, record)`` returns ``(shards, None)``: per rank ``{"batch", "table", "metrics"}``; ``record``
    (the round's own metrics) is not used — each shard carries its rank's metrics. ``version`` is the oldest weight
    version the shards' requests were served with (a push may land between them when ``max_staleness > 0``).
    """

    def __init__(self, spec: Any, make_backend: Callable[[], Any], beat: Callable[[], None]):
        self.size = int(spec.num_processes)
        self.beat = beat
        self.backends, self.accelerators, self.producers = [], [], []
        for rank in range(self.size):
            backend = make_backend()
            backend.seed_rank = rank  # rank r's requests carry request_seed(seed, r, k), as the synchronous trainer's
            accelerator = VirtualRankAccelerator(rank, self.size)
            self.backends.append(backend)
            self.accelerators.append(accelerator)
            self.producers.append(spec.make_producer(backend, accelerator=accelerator))

    @property
    def version(self) -> int:
        return min(int(backend.version or 0) for backend in self.backends)

    def set_request_index(self, k: int) -> None:
        for backend in self.backends:
            backend.set_request_index(k)

    def __call__(self, rows: list, record: Callable[[str, float], None]) -> tuple[list[dict[str, Any]], None]:
        if len(rows) % self.size:
            raise ValueError(f"A round of {len(rows)} rows cannot be split over {self.size} processes.")
        share = len(rows) // self.size
        group = VirtualRankGroup(self.size)
        for accelerator in self.accelerators:
            accelerator.group = group
        shards: list[Any] = [None] * self.size
        errors: list[BaseException | None] = [None] * self.size

        def work(rank: int) -> None:
            metrics: list[tuple[str, float]] = []

            def sink(name: str, value: float) -> None:
                self.beat()
                metrics.append((name, float(value)))

            try:
                batch, table = self.producers[rank](rows[rank * share : (rank + 1) * share], sink)
                shards[rank] = {"batch": batch, "table": table, "metrics": metrics}
            except BaseException as err:  # re-raised below, after every thread stopped
                errors[rank] = err
                group.abort()

        threads = [
            threading.Thread(target=work, args=(rank,), name=f"posttrain-rollout-rank-{rank}", daemon=True)
            for rank in range(self.size)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        failed = [(rank, err) for rank, err in enumerate(errors) if err is not None]
        if failed:
            # the first failure that is not just a peer seeing the abort
            rank, err = next(((r, e) for r, e in failed if "another virtual rank" not in str(e)), failed[0])
            err.add_note(f"(in the rollout worker's share of the round for training rank {rank})")
            raise err
        return shards, None


# ----------------------------------------------------------------------------------------------------------------
# Trainer side: rank 0 sends each rank its shard
# ----------------------------------------------------------------------------------------------------------------


class RoundChannel:
    """Rank 0 → every rank messages over a gloo group of its own, each receive bounded by ``timeout_s``.

    Messages: ``("round", item)``, ``("error", text)`` and ``("wait",)`` (a keep-alive the receivers skip). Created on
    every rank at the same point (``new_group`` is collective)."""

    def __init__(self, trainer_name: str, timeout_s: float):
        import torch.distributed as dist

        self.trainer_name = trainer_name
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.timeout_s = float(timeout_s)
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
        self._last_send = time.monotonic()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def send(self, messages: list[Any]) -> None:
        """Rank 0: message ``messages[r]`` to rank ``r`` (its own included)."""
        import torch.distributed as dist

        out: list[Any] = [None]
        self._collective(lambda: dist.scatter_object_list(out, messages, src=0, group=self.group), "send a round")
        self._last_send = time.monotonic()

    def send_all(self, message: Any) -> None:
        self.send([message] * self.size)

    def keepalive(self) -> None:
        """Rank 0, while it waits for the worker: a ``("wait",)`` at most every ``KEEPALIVE_S``."""
        if time.monotonic() - self._last_send >= KEEPALIVE_S:
            self.send_all(("wait",))

    def receive(self, what: str) -> Any:
        """Ranks > 0: the next message that is not a keep-alive; ``what`` names it in the timeout error."""
        import torch.distributed as dist

        out: list[Any] = [None]
        while True:
            self._collective(lambda: dist.scatter_object_list(out, None, src=0, group=self.group), f"receive {what}")
            if out[0][0] != "wait":
                return out[0]

    def barrier(self, what: str) -> None:
        import torch.distributed as dist

        self._collective(lambda: dist.barrier(group=self.group), what)

    def _collective(self, call: Callable[[], Any], what: str) -> None:
        start = time.monotonic()
        try:
            call()
        except RuntimeError as err:  # gloo: a timeout, or a peer that closed its connection (it died)
            raise RolloutWorkerError(
                f"{self.trainer_name}: rank {self.rank} of {self.size} waited {time.monotonic() - start:.1f} s to "
                f"{what} (rank 0 runs the rollout worker and sends every rank its share of each round) and gave up: "
                f"another rank died or made no progress within {self.timeout_s:g} s (max(request_timeout, "
                f"weight_sync_timeout) + vllm_server_timeout + 60). Look for the first failing rank's error above. "
                f"({err})"
            ) from err


class RankRounds:
    """The multi-process half of :class:`~posttrain.rollout.async_worker.AsyncRollout` (one per rank): the channel,
    the weight gather mode, and the round exchange of :meth:`next_item`.

    Args:
        trainer: The trainer (``accelerator``, ``args``).
        trainer_name: Names the trainer in errors.
    """

    def __init__(self, trainer: Any, trainer_name: str):
        args = trainer.args
        self.gather_mode = weight_gather_mode(trainer.accelerator, trainer_name)
        # rank 0 sends nothing only while it pushes the starting weights (bounded by the push timeout) and spawns the
        # worker; everywhere else it sends a keep-alive at least every KEEPALIVE_S
        push = max(float(args.request_timeout), float(getattr(args, "weight_sync_timeout", None) or 0.0))
        timeout = push + float(getattr(args, "vllm_server_timeout", 240.0)) + 60.0
        self.channel = RoundChannel(trainer_name, timeout)
        self.started = False  # the first round was asked for (rank 0 connected, pushed and spawned the worker)
        self.queued_rows = 0.0  # rank 0's queue size (rows) when it sent the last round

    @classmethod
    def for_trainer(cls, trainer: Any, trainer_name: str) -> RankRounds | None:
        """None with one process; else the rank's ``RankRounds`` (refusing modes the push cannot gather)."""
        if int(getattr(getattr(trainer, "accelerator", None), "num_processes", 1)) <= 1:
            return None
        return cls(trainer, trainer_name)

    @property
    def is_main(self) -> bool:
        return self.channel.is_main

    def next_item(self, rollout: Any, step: int) -> dict[str, Any]:
        """This rank's share of the next fresh round: rank 0 takes it (with ``rollout.take_fresh_round``) and sends
        every rank its shard; the others receive theirs. Errors on rank 0 reach every rank."""
        first = not self.started
        self.started = True
        if not self.is_main:
            if first:  # rank 0 pushes the starting weights now (FSDP2: gathered with every rank)
                rollout.follow_push()
            kind, payload = self.channel.receive(f"round {rollout.next_round} (step {step})")
            if kind == "error":
                raise RolloutWorkerError(f"Rank 0 failed to produce round {rollout.next_round}: {payload}")
            return payload
        try:
            item, staleness = rollout.take_fresh_round(step)
        except BaseException as err:
            self.channel.send_all(("error", f"{type(err).__name__}: {err}"))
            raise
        shards = item["batch"]
        if not isinstance(shards, list) or len(shards) != self.channel.size:
            raise RolloutWorkerError(
                f"The rollout worker sent round {item['round']} as {type(shards).__name__}, not {self.channel.size} "
                "shards (one per process)."
            )
        queued = rollout.queued_rows()
        messages = []
        for shard in shards:
            share = {key: value for key, value in item.items() if key != "batch"}
            share.update(batch=shard["batch"], table=shard["table"], metrics=[*shard["metrics"], *item["metrics"]],
                         staleness=staleness, dropped_stale_total=rollout.dropped_stale_total, queued_rows=queued)  # fmt: skip
            messages.append(("round", share))
        self.channel.send(messages)
        return messages[0][1]
