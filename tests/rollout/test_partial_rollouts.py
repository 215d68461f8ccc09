"""Partial rollouts' scheduler (posttrain/rollout/partial.py) against a scripted server: cut rounds, finished groups
first, continued completions with per-token versions and log-probs, the per-token staleness bound."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from posttrain.generation.base import Completions, SamplingConfig
from posttrain.rollout.partial import PartialRolloutSpec, PartialScheduler, ReplayBackend

EOS = 0
TOKEN = 7


class ScriptedServer:
    """Row i's completion is ``target - 1`` tokens TOKEN then EOS, where target is the prompt's first id; every token
    sampled under version v has log-prob ``-(v + 1) / 10`` (so provenance is visible in the log-probs)."""

    def __init__(self):
        self.version = 0
        self.requests: list[tuple[int, list[list[int]]]] = []

    def generate(self, prompt_ids, sampling, num_generations=1):
        assert num_generations == 1
        self.requests.append((sampling.max_new_tokens, [list(p) for p in prompt_ids]))
        ids, lps, finished = [], [], []
        for prompt in prompt_ids:
            target, done = prompt[0], len(prompt) - 1  # prompt = [target] + tokens already generated
            left = target - done
            row = [TOKEN] * (left - 1) + [EOS]
            row = row[: sampling.max_new_tokens]
            ids.append(row)
            lps.append([-(self.version + 1) / 10] * len(row))
            finished.append(bool(row) and row[-1] == EOS)
        return Completions(ids, lps, finished, [list(p) for p in prompt_ids])


def _scheduler(targets, *, max_tokens=3, max_staleness=2, per_round=2, g=2, max_len=12):
    spec = PartialRolloutSpec(max_tokens=max_tokens, max_staleness=max_staleness, max_completion_length=max_len)
    group_rows = lambda k: [{"prompt": "x", "target": targets[k % len(targets)], "k": k}] * g  # noqa: E731
    sampling = SamplingConfig(max_new_tokens=max_len, eos_token_ids=[EOS], pad_token_id=EOS)
    return PartialScheduler(spec, group_rows, lambda rows: [rows[0]["target"]], per_round, sampling)


def _run(scheduler, server, rounds):
    """Emit ``rounds`` rounds; the trainer consumes each at once and pushes version r + 1 (version = step)."""
    out = []
    for r in range(rounds):
        passes = 0
        while (groups := scheduler.take_round(r)) is None:
            scheduler.run_pass(server.generate, lambda: server.version, r)
            passes += 1
        out.append((r, groups, passes, [g.ordinal for g in scheduler.pool]))
        server.version = r + 1
    return out


def test_cut_round_trains_finished_groups_first_and_continues_the_rest():
    server = ScriptedServer()
    # group 0 needs 9 tokens (3 passes of 3), every other group 2 tokens (one pass)
    rounds = _run(_scheduler([9, 2, 2, 2, 2, 2, 2, 2]), server, 4)
    r0, groups0, passes0, inflight0 = rounds[0]
    # round 0: the first pass cut group 0 at 3 tokens; the short groups 1 and 2 (2 passes) form the round while
    # group 0 is still in flight
    assert [g.ordinal for g in groups0] == [1, 2] and 0 in inflight0
    assert all(len(set(v)) == 1 for g in groups0 for v in g.versions)
    # every request asked for at most the budget (no group was due yet in the first passes)
    assert server.requests[0][0] == 3
    # group 0 comes back later, continued under newer weights: mixed versions, per-token log-probs of each version
    long = next(g for _, groups, _, _ in rounds for g in groups if g.ordinal == 0)
    for ids, versions, logps in zip(long.ids, long.versions, long.logps):
        assert len(ids) == len(versions) == len(logps) == 9 and ids[-1] == EOS
        assert len(set(versions)) > 1
        assert logps == [-(v + 1) / 10 for v in versions]
    # a continuation is generated from prompt + partial completion
    assert any(p[:4] == [9, TOKEN, TOKEN, TOKEN] and len(p) > 1 for _, prompts in server.requests for p in prompts)


@pytest.mark.parametrize("max_staleness", [1, 2, 3])
def test_no_group_holds_a_token_older_than_max_staleness(max_staleness):
    server = ScriptedServer()
    targets = [12, 2, 3, 11, 2, 2, 7, 2, 12, 2]  # long tail: 2..12 tokens
    rounds = _run(_scheduler(targets, max_staleness=max_staleness), server, 12)
    seen = set()
    for r, groups, _, _ in rounds:
        for group in groups:
            assert group.finished and group.ordinal not in seen
            seen.add(group.ordinal)
            assert r - group.oldest_version <= max_staleness  # trained at step r: lag per token <= max_staleness
    assert any(g.continued_rows for _, groups, _, _ in rounds for g in groups)


def test_regenerates_a_group_that_can_no_longer_meet_the_bound():
    scheduler = _scheduler([9, 2])
    server = ScriptedServer()
    scheduler.run_pass(server.generate, lambda: server.version, 0)  # group 0 cut at version 0
    assert scheduler.pool[0].oldest_version == 0
    server.version = 5
    scheduler.run_pass(server.generate, lambda: server.version, 5)  # round 5 - version 0 > max_staleness 2
    assert scheduler.regenerated_total == 1
    group = next(g for g in scheduler.pool + scheduler.ready if g.ordinal == 0)
    assert set(v for row in group.versions for v in row) == {5}


def test_completions_and_replay_backend():
    scheduler = _scheduler([2, 3])
    server = ScriptedServer()
    while (groups := scheduler.take_round(0)) is None:
        scheduler.run_pass(server.generate, lambda: server.version, 0)
    completions, rows, versions = PartialScheduler.completions(groups)
    assert len(completions) == len(rows) == len(versions) == 4
    assert completions.finished == [True] * 4
    replay = ReplayBackend()
    replay.pending = completions
    prompts = completions.prompt_ids[::2]
    assert replay.generate(prompts, None, 2) is completions
    with pytest.raises(RuntimeError, match="without pending"):
        replay.generate(prompts, None, 2)
    replay.pending = completions
    with pytest.raises(RuntimeError, match="other prompt ids"):
        replay.generate([[99], [98]], None, 2)


def test_resume_skips_consumed_groups():
    spec = PartialRolloutSpec(max_tokens=3, max_staleness=2, max_completion_length=12, start_group=2,
                              skip_groups=[3, 5])  # fmt: skip
    scheduler = PartialScheduler(spec, lambda k: [{"k": k}] * 2, lambda rows: [2], 2,
                                 SamplingConfig(max_new_tokens=12, eos_token_ids=[EOS], pad_token_id=EOS))  # fmt: skip
    assert [scheduler._new_group().ordinal for _ in range(3)] == [2, 4, 6]
    with pytest.raises(ValueError, match="partial_rollout_max_tokens"):
        PartialScheduler(SimpleNamespace(max_tokens=0), None, None, 1, None)
