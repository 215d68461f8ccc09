"""2 processes (torchrun, gloo on CPU) ≡ 1 process with the same global batch, for every experimental trainer that
trains data-parallel.

One torchrun launch runs every scenario of ``experimental_mp_script.py`` (imports dominate the cost); the 1-process
reference runs in this process with twice the per-device batch. Compared per logged step: the loss and every
metric both runs log (timings excepted), and the final trainable parameters.

Tolerances: both layouts do the same float32 arithmetic except for the order of reductions (a sum over 4 rows vs.
two sums over 2 rows then an all-reduce, and gloo's own summation order), which moves results by a few ulps of the
summed values: ~1e-7 relative per reduction, growing to ~1e-6 through the few chained reductions of a step and
the SGD update (lr 0.5). ``rtol=1e-4, atol=1e-5`` sits two orders above that and far below what a real divergence
gives (a per-process instead of a global normaliser moves these losses and metrics by 1e-2 and more). Parameters
get ``atol=1e-5``: after 2 SGD steps a per-process normalisation moves them by ~1e-3.

What the scenarios guard (each failed before its fix): per-process NLL / step-label normalisers (CPO, ORPO, TPO,
PRM); PPO under DDP (the value head outside the DDP forward, local advantage whitening, local token means, an
unseeded value head); per-process token-mean metrics (GKD, IW-OPD, SDPO, SDFT); replay-buffer counts averaged
instead of summed; A2PO's V* estimation repeated on every process; GOLD's ULD with one process holding no alignable
row (``gold_uneven``: a hang in a collective, and the row mean taken per process); mean-logit / entropy / token
accuracy metrics counting the rows accelerate repeats to even out a short last batch (``cpo_epoch``). GKD with
gradient accumulation 2 (``gkd_ga2``), its epoch ending in a step of one micro-batch (``gkd_ga2_epoch``), guards
the per-micro-batch dataloader whose optimizer-step rows each process generates at once.

The async trainers (``async_grpo``, ``async_distillation``) run one training process by design: their configs must
refuse a multi-process launch with an error saying so (checked inside the launch).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from experimental_mp_script import run_all
from multiprocess_harness import launch_two_processes, single_thread

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = (
    "cpo",
    "orpo",
    "tpo",
    "bema",
    "prm",
    "gkd",
    "gkd_ga2",
    "gkd_ga2_epoch",
    "gold",
    "gold_uneven",
    "iw_opd",
    "online_dpo",
    "gmpo",
    "a2po",
    "replay",
    "ppo",
    "sdpo",
    "sdft",
    "cpo_epoch",
    "online_dpo_epoch",
)
# What differs by design: wall-clock timings, and the replay buffer's draws after step 2 (each process samples its
# own buffer with its own seed, as TRL's does) — from then on only the buffer's counts are comparable.
VOLATILE = ("timing/", "step_time", "train_")
REPLAY_COUNTS = ("replay_buffer/size", "replay_buffer/replaced_groups")
# Online DPO's first step scores with the policy equal to its reference: every margin is float noise around 0
# (~1e-7, from the reference forward's batch shape), so the fraction of positive margins is not comparable there.
NOISE = {("online_dpo", 1, "rewards/accuracies"), ("online_dpo_epoch", 1, "rewards/accuracies")}
# With gradient accumulation a step's token-mean metrics are the mean of its micro-steps' token means, and which rows
# share a micro-step depends on the layout (each process shuffles its share of the round with its own seed): only the
# loss, the gradient and the parameters are layout-free there.
PER_MICRO_STEP = {"gkd_ga2": ("distillation_loss", "entropy"), "gkd_ga2_epoch": ("distillation_loss", "entropy")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_path, abc_teacher_path, merged_teacher_path):
    paths = {"model": tiny_model_path, "abc": abc_teacher_path, "merged": merged_teacher_path}
    two = tmp_path_factory.mktemp("two-proc")
    script = os.path.join(HERE, "experimental_mp_script.py")
    args = [paths["model"], paths["abc"], paths["merged"], str(two), "2", ",".join(("single_process", *KINDS))]
    launch_two_processes(script, args, timeout=300)
    one = tmp_path_factory.mktemp("one-proc")
    with single_thread():
        run_all(paths, str(one), per_device=4, kinds=KINDS)
    return one, two


def _load(folder, kind):
    log = json.load(open(folder / f"{kind}.json"))
    return log, torch.load(folder / f"{kind}_params.pt", weights_only=True)


def _comparable(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if isinstance(v, (int, float)) and not k.startswith(VOLATILE)}


def _assert_logs_match(kind: str, logs1: list, logs2: list) -> None:
    for step, (entry1, entry2) in enumerate(zip(logs1, logs2), start=1):
        one, two = _comparable(entry1), _comparable(entry2)
        assert one.keys() == two.keys(), f"{kind} step {step}: {sorted(one.keys() ^ two.keys())}"
        for name, value in one.items():
            if (kind, step, name) in NOISE or name in PER_MICRO_STEP.get(kind, ()):
                continue
            assert two[name] == pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True), f"{kind} step {step}: {name}"


@pytest.mark.invariance
@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("replay", "cpo_epoch", "online_dpo_epoch")])
def test_two_processes_match_one_process(runs, kind):
    one, two = runs
    (log1, params1), (log2, params2) = _load(one, kind), _load(two, kind)
    assert log1["num_processes"] == 1 and log2["num_processes"] == 2
    assert len(log1["logs"]) == len(log2["logs"]) == 2
    _assert_logs_match(kind, log1["logs"], log2["logs"])
    assert params1.keys() == params2.keys()
    for name, value in params1.items():
        torch.testing.assert_close(params2[name], value, rtol=1e-4, atol=1e-5, msg=f"{kind}: {name}")


def test_online_dpo_trains_its_short_last_round_on_two_processes(runs):
    """6 prompts, 4 per round: the last round's 2 prompts are 4 rows on process 0; accelerate evens process 1's empty
    batch with repeated rows (trained on, as by transformers.Trainer), so both runs take 2 steps and agree on step 1."""
    one, two = runs
    logs1, logs2 = _load(one, "online_dpo_epoch")[0]["logs"], _load(two, "online_dpo_epoch")[0]["logs"]
    assert len(logs1) == len(logs2) == 2
    _assert_logs_match("online_dpo_epoch", logs1[:1], logs2[:1])
    assert all(math.isfinite(entry["loss"]) for entry in logs1 + logs2)


@pytest.mark.invariance
def test_replay_buffer_counts_are_summed_over_processes(runs):
    """Steps 1-2 fill the buffers (identical training); steps 3-4 replace every group: each process holds half the
    buffer and replaces half the groups, so the logged counts must be the sums, equal to the 1-process ones."""
    one, two = runs
    logs1, logs2 = _load(one, "replay")[0]["logs"], _load(two, "replay")[0]["logs"]
    assert len(logs1) == len(logs2) == 4
    _assert_logs_match("replay", logs1[:2], logs2[:2])
    assert [e["replay_buffer/replaced_groups"] for e in logs1] == [0, 0, 2, 2]
    for entry1, entry2 in zip(logs1, logs2):
        assert {k: entry2[k] for k in REPLAY_COUNTS} == {k: entry1[k] for k in REPLAY_COUNTS}


def test_a_short_last_batch_keeps_its_metrics_to_the_real_rows(runs):
    """One CPO epoch of 10 rows: 4 + 4 + 2. On 2 processes × 2 rows accelerate evens out the last batch by repeating
    2 rows on process 1; they are trained on (as by transformers.Trainer), so the last step's loss, gradient and
    NLL differ from the 1-process run, but every per-row metric (rewards, log-probs, mean logits) must leave them
    out and equal the 1-process value."""
    one, two = runs
    logs1, logs2 = _load(one, "cpo_epoch")[0]["logs"], _load(two, "cpo_epoch")[0]["logs"]
    assert len(logs1) == len(logs2) == 3
    _assert_logs_match("cpo_epoch", logs1[:2], logs2[:2])
    trained_on_repeats = ("loss", "grad_norm", "nll_loss")
    last1 = {k: v for k, v in logs1[2].items() if k not in trained_on_repeats}
    _assert_logs_match("cpo_epoch last", [last1], [{k: v for k, v in logs2[2].items() if k in last1}])
    assert {"logits/chosen", "logps/chosen", "rewards/accuracies"} <= last1.keys()


def test_a2po_stage_one_is_sharded_and_shared(runs):
    """V* estimation: each process samples its own half of the prompts (not all of them), then both hold the whole
    table, equal to the 1-process one."""
    one, two = runs
    reference = json.load(open(one / "a2po_stage1_0.json"))
    ranks = [json.load(open(two / f"a2po_stage1_{r}.json")) for r in (0, 1)]
    assert len(reference["values"]) == 8 and len(reference["sampled"]) == 8 * 4
    halves = [set(r["sampled"]) for r in ranks]
    assert len(ranks[0]["sampled"]) == len(ranks[1]["sampled"]) == 4 * 4
    assert not halves[0] & halves[1] and halves[0] | halves[1] == set(reference["sampled"])
    for rank in ranks:
        assert rank["values"].keys() == reference["values"].keys()
        for key, value in reference["values"].items():
            assert rank["values"][key] == pytest.approx(value, rel=1e-6)


def test_async_configs_build_under_two_processes(runs):
    """The async trainers train with several processes now (one rollout worker on rank 0; their 2-process runs are
    tests/experimental/test_async_multiprocess.py): their configs build under a 2-process launch."""
    _, two = runs
    errors = json.load(open(two / "single_process.json"))
    assert errors == {"AsyncGRPOConfig": None, "AsyncDistillationConfig": None}
