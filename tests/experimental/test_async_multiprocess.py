"""AsyncGRPO and AsyncDistillation with 2 training processes (torchrun, gloo on CPU) against a ``posttrain serve``
server on 127.0.0.1 started here, next to their synchronous 2-process server-mode runs (``async_mp_script.py``).

One torchrun launch runs every scenario (imports dominate the cost). Checked: ``max_staleness=0`` equals synchronous
GRPO / distillation in server mode bitwise on both ranks (same prompts per rank, request seeds, padding, rewards
and group advantages over the whole round, buffer shuffle, IS correction); a resumed 2-process run equals the
uninterrupted one (GRPO mid-epoch, distillation at an epoch boundary); with ``max_staleness=1`` both ranks train the
same rounds at the same versions; the round channel's errors and bounded waits; unsupported distributed modes and
the worker's virtual ranks in-process.
"""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import pytest
import torch
from multiprocess_harness import launch_two_processes

pytestmark = pytest.mark.usefixtures("no_leaked_children")

HERE = os.path.dirname(os.path.abspath(__file__))
# The two-server runs first: synchronous GRPO over a pool pushes without explicit versions, so its servers must start
# at one version (the other runs push only to the first server).
KINDS = (
    "grpo_pool_sync,grpo_pool_async,grpo_sync,grpo_async,grpo_resume,grpo_stale,distill_sync,distill_async,"
    "distill_resume,channel"
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_path, abc_teacher_path):
    pytest.importorskip("fastapi")
    from posttrain.serving.app import serve_in_thread
    from posttrain.serving.engine import PosttrainEngine

    out = tmp_path_factory.mktemp("async-two-proc")
    engines = [PosttrainEngine.from_pretrained(tiny_model_path, device="cpu") for _ in range(2)]
    with serve_in_thread(engines[0]) as first, serve_in_thread(engines[1]) as second:
        urls = f"{first},{second}"
        launch_two_processes(
            os.path.join(HERE, "async_mp_script.py"), [tiny_model_path, abc_teacher_path, urls, str(out), KINDS],
            timeout=1200,
        )  # fmt: skip
    return out


def _params(out, kind, rank):
    return torch.load(out / f"{kind}_{rank}_params.pt", weights_only=True)


def _record(out, kind, rank):
    return json.loads((out / f"{kind}_{rank}.json").read_text())


def _assert_equal_params(actual, expected, what):
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{what}: {name}"


@pytest.mark.slow
@pytest.mark.invariance
@pytest.mark.parametrize("family", ["grpo", "distill"])
def test_max_staleness_0_equals_synchronous_two_process_run_bitwise(runs, family, tiny_model_path):
    from posttrain.models.loading import create_model_from_path

    expected = _params(runs, f"{family}_sync", 0)
    _assert_equal_params(_params(runs, f"{family}_sync", 1), expected, "sync rank 1")
    initial = create_model_from_path(tiny_model_path).state_dict()
    assert any(not torch.equal(initial[name], value) for name, value in expected.items() if name in initial)
    for rank in (0, 1):
        record = _record(runs, f"{family}_async", rank)
        assert record["num_processes"] == 2
        _assert_equal_params(_params(runs, f"{family}_async", rank), expected, f"{family} async rank {rank}")
        assert [(r["round"], r["version"], r["staleness"]) for r in record["rounds"]] == [(0, 0, 0), (1, 1, 0)]
        assert record["state"] == {"next_round": 2, "weight_version": 2, "dropped_stale_total": 0}
        sync_logs = [e for e in _record(runs, f"{family}_sync", rank)["logs"] if "loss" in e]
        async_logs = [e for e in record["logs"] if "loss" in e]
        assert [e["loss"] for e in async_logs] == [e["loss"] for e in sync_logs]
        assert all("sample/staleness_max" in e and "perf/rollout_wait_s" in e for e in async_logs)
    if family == "grpo":  # the IS correction ran on both sides (against the server's sampling log-probs)
        key = "sampling/importance_sampling_ratio/mean"
        assert [e[key] for e in async_logs] == [e[key] for e in sync_logs]


@pytest.mark.slow
@pytest.mark.invariance
@pytest.mark.parametrize("family", ["grpo", "distill"])
def test_two_process_resume_equals_uninterrupted(runs, family):
    """From the async run's checkpoint-1 (both ranks' RNG and buffer states, one rollout_state.json), a resumed run
    restarts the worker at round 1 and reaches the uninterrupted (= synchronous) parameters on both ranks. GRPO's
    checkpoint is mid-epoch, distillation's at an epoch boundary (one round per epoch)."""
    checkpoint = runs / f"{family}_async" / "checkpoint-1"
    for name in ("rng_state_0.pth", "rng_state_1.pth", "posttrain_state_0.pt", "posttrain_state_1.pt"):
        assert (checkpoint / name).is_file(), name
    state = json.loads((checkpoint / "rollout_state.json").read_text())
    assert {k: state[k] for k in ("next_round", "weight_version", "dropped_stale_total")} == {
        "next_round": 1, "weight_version": 1, "dropped_stale_total": 0}  # fmt: skip
    expected = _params(runs, f"{family}_sync", 0)
    for rank in (0, 1):
        record = _record(runs, f"{family}_resume", rank)
        assert [r["round"] for r in record["rounds"]] == [1]
        _assert_equal_params(_params(runs, f"{family}_resume", rank), expected, f"{family} resumed rank {rank}")


@pytest.mark.slow
@pytest.mark.invariance
def test_two_servers_max_staleness_0_equals_synchronous_two_process_run(runs):
    """vllm_server_base_urls with 2 servers: the worker's virtual ranks split their shares over the servers as the
    synchronous ranks do (one chunk per server, seeded from the rank's request seed), so the runs agree bitwise."""
    expected = _params(runs, "grpo_pool_sync", 0)
    # the round really was split over 2 servers: other tokens than the one-server run (module doc of server_pool)
    assert any(not torch.equal(value, _params(runs, "grpo_sync", 0)[name]) for name, value in expected.items())
    for rank in (0, 1):
        _assert_equal_params(_params(runs, "grpo_pool_async", rank), expected, f"two servers, rank {rank}")


@pytest.mark.slow
def test_staleness_decisions_are_shared_by_the_ranks(runs):
    ranks = [_record(runs, "grpo_stale", rank) for rank in (0, 1)]
    assert ranks[0]["rounds"] == ranks[1]["rounds"]
    assert [r["round"] for r in ranks[0]["rounds"]] == [0, 1, 2]
    assert all(0 <= r["staleness"] <= 1 for r in ranks[0]["rounds"])
    assert ranks[0]["state"] == ranks[1]["state"]
    _assert_equal_params(_params(runs, "grpo_stale", 1), _params(runs, "grpo_stale", 0), "DDP ranks")


@pytest.mark.slow
def test_round_channel_forwards_errors_and_bounds_waits(runs):
    record = _record(runs, "channel", 1)
    assert record["got"] == ["error", "boom on rank 0"]  # the keep-alive before it was skipped
    assert "rank 1 of 2 waited" in record["error"] and "receive round 6 (step 6)" in record["error"]
    assert "rank 0 runs the rollout worker" in record["error"]
    assert 4.5 <= record["waited_s"] < 60


# -- in-process --------------------------------------------------------------------------------------------------


def _accelerator(kind, processes=2, **extra):
    from accelerate.utils import DistributedType

    return SimpleNamespace(num_processes=processes, distributed_type=getattr(DistributedType, kind), **extra)


def test_weight_gather_mode_accepts_ddp_and_fsdp2_and_names_the_fix_otherwise():
    from posttrain.rollout.multiprocess import weight_gather_mode

    assert weight_gather_mode(_accelerator("NO", processes=1), "AsyncGRPO") == "single"
    assert weight_gather_mode(_accelerator("MULTI_CPU"), "AsyncGRPO") == "rank0"
    assert weight_gather_mode(_accelerator("MULTI_GPU"), "AsyncGRPO") == "rank0"
    assert weight_gather_mode(_accelerator("FSDP", is_fsdp2=True), "AsyncGRPO") == "collective"
    zero2 = _accelerator("DEEPSPEED", state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2)))
    assert weight_gather_mode(zero2, "AsyncGRPO") == "rank0"
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        weight_gather_mode(_accelerator("FSDP", is_fsdp2=False), "AsyncGRPO")
    zero3 = _accelerator("DEEPSPEED", state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3)))
    with pytest.raises(ValueError, match="AsyncDistillation .*zero_stage to 1 or 2"):
        weight_gather_mode(zero3, "AsyncDistillation")
    with pytest.raises(ValueError, match="distributed_type is XLA"):
        weight_gather_mode(_accelerator("XLA"), "AsyncGRPO")


def test_virtual_ranks_gather_like_processes_and_a_failure_releases_the_others():
    from posttrain.distributed import gather_objects, gather_rows
    from posttrain.rollout.multiprocess import VirtualRankAccelerator, VirtualRankGroup

    group = VirtualRankGroup(2)
    accelerators = [VirtualRankAccelerator(rank, 2) for rank in (0, 1)]
    results: dict[int, tuple] = {}
    for accelerator in accelerators:
        accelerator.group = group

    def work(rank):
        acc = accelerators[rank]
        rows = gather_rows(acc, torch.tensor([[rank, 10 + rank]]))  # (1, 2) per rank -> (2, 2)
        scalar = acc.gather(torch.tensor(float(rank)))  # 0-d: one row per rank
        results[rank] = (rows, scalar, gather_objects(acc, [f"r{rank}"]))

    threads = [threading.Thread(target=work, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for rank in (0, 1):
        rows, scalar, objects = results[rank]
        assert torch.equal(rows, torch.tensor([[0, 10], [1, 11]]))
        assert torch.equal(scalar, torch.tensor([0.0, 1.0])) and objects == ["r0", "r1"]

    group = VirtualRankGroup(2)
    errors: dict[int, str] = {}

    def waiter():
        try:
            group.all_gather(0, 1)
        except RuntimeError as err:
            errors[0] = str(err)

    thread = threading.Thread(target=waiter)
    thread.start()
    group.abort()  # what a failing virtual rank does
    thread.join(30)
    assert not thread.is_alive() and "another virtual rank" in errors[0]
