"""Partial rollouts for the async rollout worker (AsyncGRPO ``partial_rollout_max_tokens``).

Whole-round streaming waits, every round, for the round's longest completion: with long-tailed completion lengths
the server decodes a shrinking batch of a few long rows while the trainer waits. With partial rollouts the worker
instead generates in *passes*: each pass asks the server for at most ``max_tokens`` new tokens for every row still
in flight (one request, ``n=1`` per row: a new group's G rows share their prompt, which the group sampler prefills
once; a continued row's prompt is its prompt plus its partial completion). After a pass,

- groups whose G completions all ended (EOS or ``max_completion_length``) are *finished* and wait in a ready list;
  as soon as it holds a round's worth (``groups_per_round``), the round is emitted and trains at once;
- unfinished groups are *cut*: their completions continue in the next pass, which runs after the trainer's next
  weight push has reached the server (admission, as for whole rounds) — so one completion can be sampled by several
  weight versions;
- new groups (the next ones in GRPO's prompt order) top the in-flight pool back up to ``groups_per_round``.

Token-level provenance: every completion token carries the version of the weights that sampled it (the server
reports its version with each answer) and its sampling log-prob under that version. The round's batch carries
``token_versions`` (``(B, C)``, -1 on padding) next to ``sampling_per_token_logps``, so the trainer's
importance-sampling correction is per token against the sampler of the version that produced the token, and its
staleness rule is per token (the round's *oldest* token decides; the round's ``version`` is that oldest version).

Staleness policy (per token, nothing older than ``max_staleness`` versions is trained on): round ``r`` is trained
at step ``<= r``, so a group whose oldest token has version ``v`` may go into round ``r`` only if ``r - v <=
max_staleness``. The worker therefore (1) emits the oldest ready groups first, (2) *completes* in the current pass
(no cut: the pass's token limit is raised to what such rows still need) any in-flight group that might otherwise miss
that bound, and (3) *regenerates* from scratch (discards the partial completions of) a group that can no longer meet
it — counted in ``rollout/partial_regenerated_groups_total``. The trainer still checks every round's oldest token and
drops a round that is too stale (``sample/dropped_stale_total``), so the bound holds whatever the timing.

Resume: the trainer saves the ordinals of the groups it consumed; a resumed worker restarts at the first group not
consumed and skips the consumed ones after it. Completions in flight when the run stopped are regenerated from the
restored weights (their partial tokens, sampled by weights that no longer exist on the server, are not saved).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PartialGroup", "PartialRolloutSpec", "PartialScheduler", "ReplayBackend", "partial_loop"]


@dataclass
class PartialRolloutSpec:
    """What the worker needs for partial rollouts (pickled into the child with the worker spec).

    Args:
        max_tokens: New tokens per row per pass (the cut budget; ``partial_rollout_max_tokens``).
        max_staleness: The trainer's ``max_staleness`` (versions a token may lag when trained).
        max_completion_length: A completion ends at this many tokens (as in whole rounds).
        start_group: First group ordinal (position in the prompt order, in groups) not consumed by the trainer.
        skip_groups: Ordinals after ``start_group`` already consumed (resume).
    """

    max_tokens: int
    max_staleness: int
    max_completion_length: int
    start_group: int = 0
    skip_groups: list[int] = field(default_factory=list)


@dataclass
class PartialGroup:
    """One group of G completions in flight: per row its tokens, sampling log-probs (and log kept mass) and the
    weight version of each token. ``done[j]``: row ``j`` ended (EOS or the length limit); ``eos[j]``: with EOS."""

    ordinal: int
    rows: list[dict[str, Any]]
    prompt_ids: list[int]
    ids: list[list[int]]
    logps: list[list[float]]
    kept: list[list[float]] | None
    versions: list[list[int]]
    done: list[bool]
    eos: list[bool]

    @classmethod
    def new(cls, ordinal: int, rows: list[dict[str, Any]], prompt_ids: list[int]) -> PartialGroup:
        g = len(rows)
        return cls(ordinal, rows, list(prompt_ids), [[] for _ in range(g)], [[] for _ in range(g)],
                   [[] for _ in range(g)], [[] for _ in range(g)], [False] * g, [False] * g)  # fmt: skip

    def reset(self) -> None:
        """Discard the partial completions (regenerate the group from scratch)."""
        fresh = PartialGroup.new(self.ordinal, self.rows, self.prompt_ids)
        self.__dict__.update(fresh.__dict__)

    @property
    def finished(self) -> bool:
        return all(self.done)

    @property
    def oldest_version(self) -> int | None:
        """The version of the group's oldest token; None before its first token."""
        versions = [v for row in self.versions for v in row]
        return min(versions) if versions else None

    @property
    def continued_rows(self) -> int:
        """Rows sampled by more than one weight version."""
        return sum(len(set(row)) > 1 for row in self.versions)


class ReplayBackend:
    """A generation backend that returns completions already generated (the finished groups of a partial round),
    so the round goes through the trainer's usual pipeline (decode, rewards, advantages, metrics) unchanged."""

    def __init__(self) -> None:
        self.pending: Any = None  # the Completions the next generate() returns
        self.version: int = 0

    def sync_weights(self, model: Any) -> None:
        """No-op: the worker has no weights."""

    def generate(self, prompt_ids: list[list[int]], sampling: Any, num_generations: int = 1, **_: Any) -> Any:
        completions, self.pending = self.pending, None
        if completions is None:
            raise RuntimeError("ReplayBackend.generate called without pending completions.")
        rows = [list(p) for p in prompt_ids for _ in range(num_generations)]
        if rows != completions.prompt_ids:
            raise RuntimeError(
                "Partial rollouts: the pipeline rendered other prompt ids than the worker generated from (a prompt "
                "whose rendering is not deterministic?)."
            )
        return completions


class PartialScheduler:
    """The in-flight pool, the ready list and the passes (see the module docstring). Backend-agnostic: ``generate``
    is ``backend.generate`` of a server backend (returns ``Completions`` and sets ``backend.version``).

    Args:
        spec: The partial-rollout settings.
        group_rows: ``group_rows(k)`` -> the G dataset rows of group ordinal ``k`` (prompt order).
        prompt_ids: ``prompt_ids(rows)`` -> the rendered prompt ids of a group's rows (one list; as the pipeline
            renders them).
        groups_per_round: Groups per emitted round (``prompts_per_round``).
        sampling: The trainer's ``SamplingConfig`` (``max_new_tokens`` is replaced per pass).
    """

    def __init__(
        self,
        spec: PartialRolloutSpec,
        group_rows: Callable[[int], list[dict[str, Any]]],
        prompt_ids: Callable[[list[dict[str, Any]]], list[int]],
        groups_per_round: int,
        sampling: Any,
    ):
        if spec.max_tokens < 1:
            raise ValueError(f"partial_rollout_max_tokens must be >= 1, got {spec.max_tokens}.")
        self.spec = spec
        self.group_rows = group_rows
        self.prompt_ids = prompt_ids
        self.groups_per_round = groups_per_round
        self.sampling = sampling
        self.next_ordinal = spec.start_group
        self.skip = set(spec.skip_groups)
        self.pool: list[PartialGroup] = []  # in flight (unfinished)
        self.ready: list[PartialGroup] = []  # finished, not yet emitted
        self.passes = 0  # passes run (seeds the requests)
        self.regenerated_total = 0
        self.passes_since_round = 0
        self.generated_tokens = 0

    # -- pool --------------------------------------------------------------------------------------------------
    def _new_group(self) -> PartialGroup:
        while self.next_ordinal in self.skip:
            self.skip.discard(self.next_ordinal)
            self.next_ordinal += 1
        k, self.next_ordinal = self.next_ordinal, self.next_ordinal + 1
        rows = self.group_rows(k)
        return PartialGroup.new(k, rows, self.prompt_ids(rows))

    def _too_old(self, group: PartialGroup, round_index: int) -> bool:
        oldest = group.oldest_version
        return oldest is not None and round_index - oldest > self.spec.max_staleness

    def take_round(self, round_index: int) -> list[PartialGroup] | None:
        """The groups of round ``round_index`` (oldest first), or None while fewer than a round's worth are ready.
        Ready groups already too old for this round are regenerated (back into the pool)."""
        for group in [g for g in self.ready if self._too_old(g, round_index)]:
            self.ready.remove(group)
            group.reset()
            self.pool.append(group)
            self.regenerated_total += 1
        if len(self.ready) < self.groups_per_round:
            return None
        self.ready.sort(key=lambda g: (g.oldest_version, g.ordinal))
        taken, self.ready = self.ready[: self.groups_per_round], self.ready[self.groups_per_round :]
        return taken

    # -- one pass ----------------------------------------------------------------------------------------------
    def run_pass(self, generate: Callable[..., Any], version_of: Callable[[], int], round_index: int) -> None:
        """Top the pool up, regenerate hopeless groups, and generate one pass for every unfinished row.

        ``round_index``: the next round to emit. A group is *due* (completed in this pass, not cut) when it has
        tokens and, carried once more, might land in a round more than ``max_staleness`` after its oldest token:
        at most ``(ready + pool) // groups_per_round`` rounds can be emitted before the next pass."""
        for group in self.pool:
            if self._too_old(group, round_index):
                group.reset()
                self.regenerated_total += 1
        while len(self.pool) < self.groups_per_round:
            self.pool.append(self._new_group())
        horizon = round_index + (len(self.ready) + len(self.pool)) // self.groups_per_round
        limit_max = self.spec.max_completion_length
        requests: list[tuple[PartialGroup, int]] = []
        prompts: list[list[int]] = []
        budget = self.spec.max_tokens
        for group in self.pool:
            oldest = group.oldest_version
            due = oldest is not None and horizon - oldest >= self.spec.max_staleness
            for j in range(len(group.rows)):
                if group.done[j]:
                    continue
                remaining = limit_max - len(group.ids[j])
                if due:
                    budget = max(budget, remaining)
                requests.append((group, j))
                prompts.append(group.prompt_ids + group.ids[j])
        max_new = max(1, min(budget, max(limit_max - len(g.ids[j]) for g, j in requests)))
        sampling = dataclasses.replace(self.sampling, max_new_tokens=max_new)
        completions = generate(prompts, sampling, 1)
        version = int(version_of())
        self.passes += 1
        self.passes_since_round += 1
        for index, (group, j) in enumerate(requests):
            remaining = limit_max - len(group.ids[j])
            ids = list(completions.completion_ids[index][:remaining])
            self.generated_tokens += len(ids)
            group.ids[j].extend(ids)
            group.versions[j].extend([version] * len(ids))
            if completions.logprobs is not None:
                group.logps[j].extend(completions.logprobs[index][: len(ids)])
            if completions.log_kept_mass is not None and group.kept is not None:
                group.kept[j].extend(completions.log_kept_mass[index][: len(ids)])
            else:
                group.kept = None
            ended = bool(completions.finished[index]) and len(ids) == len(completions.completion_ids[index])
            group.eos[j] = ended
            # ended with EOS, reached the length limit, or the server gave fewer tokens than asked (its context)
            group.done[j] = ended or len(group.ids[j]) >= limit_max or len(ids) < min(max_new, remaining)
        for group in [g for g in self.pool if g.finished]:
            self.pool.remove(group)
            self.ready.append(group)

    # -- a round's completions ---------------------------------------------------------------------------------
    @staticmethod
    def completions(groups: list[PartialGroup]) -> tuple[Any, list[dict[str, Any]], list[list[int]]]:
        """``(Completions, rows, per-row token versions)`` of finished groups, rows ``[k0 g0, k0 g1, ...]``."""
        from posttrain.generation.base import Completions

        rows = [row for g in groups for row in g.rows]
        ids = [list(r) for g in groups for r in g.ids]
        has_logps = all(len(lp) == len(r) for g in groups for lp, r in zip(g.logps, g.ids))
        logps = [list(lp) for g in groups for lp in g.logps] if has_logps else None
        kept = [list(k) for g in groups for k in g.kept] if all(g.kept is not None for g in groups) else None
        prompts = [list(g.prompt_ids) for g in groups for _ in g.rows]
        finished = [e for g in groups for e in g.eos]
        versions = [list(v) for g in groups for v in g.versions]
        return Completions(ids, logps, finished, prompts, log_kept_mass=kept), rows, versions


def partial_loop(
    spec: Any,
    source: Any,
    backend: Any,
    produce: Callable,
    replay: ReplayBackend,
    admit: Callable[[int], bool],
    emit: Callable[[dict[str, Any]], float],
    beat: Callable[[], None],
) -> None:
    """The worker's main loop with partial rollouts (``run_worker`` calls it instead of the whole-round loop).

    ``admit(r)`` blocks until round ``r`` may be generated (False: stop); ``emit(item)`` queues a round and returns
    the seconds it blocked; ``beat()`` stamps the heartbeat."""
    import torch

    partial: PartialRolloutSpec = spec.partial
    scheduler = PartialScheduler(
        partial, source.group_rows, spec.partial_prompt_ids, spec.prompts_per_round, spec.sampling
    )
    backpressure = 0.0
    r = spec.start_round
    backend.set_request_index(r * 1_000_003)  # passes are seeded apart from whole rounds and across resumes
    while spec.max_rounds is None or r < spec.max_rounds:
        start, cpu, tokens0 = time.perf_counter(), time.process_time(), scheduler.generated_tokens
        while (groups := scheduler.take_round(r)) is None:
            if not admit(r):
                return
            scheduler.run_pass(backend.generate, lambda: backend.version or 0, r)
            beat()
        completions, rows, versions = scheduler.completions(groups)
        replay.pending, replay.version = completions, int(backend.version or 0)
        metrics: list[tuple[str, float]] = []

        def record(name: str, value: float, sink: list = metrics) -> None:
            beat()
            sink.append((name, float(value)))

        batch, table = produce(rows, record)
        width = batch["completion_ids"].shape[1]
        token_versions = torch.full((len(versions), width), -1, dtype=torch.long)  # (B, C); -1 on padding
        for i, row in enumerate(versions):
            token_versions[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        batch["token_versions"] = token_versions
        oldest = min(v for row in versions for v in row) if any(versions) else int(backend.version or 0)
        continued = sum(g.continued_rows for g in groups) / max(1, len(rows))
        metrics += [
            ("rollout/duration_s", time.perf_counter() - start), ("rollout/cpu_s", time.process_time() - cpu),
            ("rollout/backpressure_s", backpressure), ("rollout/partial_passes", float(scheduler.passes_since_round)),
            ("rollout/partial_inflight_groups", float(len(scheduler.pool))),
            ("rollout/partial_ready_groups", float(len(scheduler.ready))),
            ("rollout/partial_continued_frac", continued),
            ("rollout/partial_regenerated_groups_total", float(scheduler.regenerated_total)),
            ("rollout/partial_generated_tokens", float(scheduler.generated_tokens - tokens0)),
        ]  # fmt: skip
        scheduler.passes_since_round = 0
        item = {"round": r, "version": int(oldest), "batch": batch, "metrics": metrics, "table": table,
                "put_time": time.time(), "groups": [g.ordinal for g in groups]}  # fmt: skip
        backpressure = emit(item)
        r += 1
