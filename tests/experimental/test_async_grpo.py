"""AsyncGRPOTrainer over loopback: a ``posttrain serve`` server in a thread, the rollout worker a spawned process.

Every test stops its server and checks that no child process is left (the trainer joins its worker in ``train``'s
``finally``)."""

from __future__ import annotations

import json
import os
import threading
import warnings

import pytest
import torch
from async_grpo_helpers import failing_reward
from datasets import Dataset
from reward_helpers import varied_reward

from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

pytestmark = pytest.mark.usefixtures("no_leaked_children")


def _dataset(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(n)])


COMMON = dict(
    report_to="none", logging_steps=1, gradient_checkpointing=False, write_report=False, disable_tqdm=True,
    per_device_train_batch_size=4, num_generations=2, max_completion_length=6, learning_rate=5e-2, seed=7,
    temperature=0.9, lr_scheduler_type="constant", use_vllm=True, vllm_mode="server",
)  # fmt: skip


def _async_args(path, url, **overrides):
    from posttrain.experimental.async_grpo import AsyncGRPOConfig

    values = dict(COMMON, output_dir=str(path), vllm_server_base_url=url, save_strategy="no", max_steps=3)
    values.update(overrides)
    return AsyncGRPOConfig(**values)


@pytest.fixture()
def engine(tiny_model_path):
    return PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")


@pytest.fixture()
def server(engine):
    with serve_in_thread(engine) as url:
        yield url


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_import_path_config_defaults_and_notice():
    import importlib
    import sys

    # Fresh imports for the notice; the original module objects are put back afterwards, so classes other test
    # modules imported at collection stay the ones `sys.modules` holds (pickling by reference needs that).
    saved = {m: sys.modules.pop(m) for m in [m for m in sys.modules if m.startswith("posttrain.experimental")]}
    env = os.environ.pop("TRL_EXPERIMENTAL_SILENCE", None)
    try:
        with pytest.warns(UserWarning, match="TRL_EXPERIMENTAL_SILENCE"):
            importlib.import_module("posttrain.experimental.async_grpo")
    finally:
        if env is not None:
            os.environ["TRL_EXPERIMENTAL_SILENCE"] = env
        for name in [m for m in sys.modules if m.startswith("posttrain.experimental")]:
            del sys.modules[name]
        sys.modules.update(saved)
    from posttrain.experimental.async_grpo import AsyncGRPOConfig

    args = AsyncGRPOConfig(output_dir="/tmp/unused", report_to="none")
    assert (args.max_staleness, args.weight_sync_steps, args.max_inflight_tasks) == (4, 1, -1)
    assert args.queue_maxsize == 1024
    assert (args.max_completion_length, args.logging_steps, args.request_timeout) == (2048, 1, 600)
    assert str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)) == "constant"
    assert args.vllm_server_base_url == "http://localhost:8000" and args.use_vllm and args.vllm_mode == "server"
    with pytest.raises(ValueError, match="weight_sync_steps - 1"):
        AsyncGRPOConfig(output_dir="/tmp/unused", report_to="none", max_staleness=0, weight_sync_steps=2)
    with pytest.raises(ValueError, match="vllm_mode='server'"):
        AsyncGRPOConfig(output_dir="/tmp/unused", report_to="none", use_vllm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.reload(importlib.import_module("posttrain.experimental"))  # silenced: no warning


@pytest.mark.slow
def test_max_staleness_0_equals_sync_grpo_and_resume_equals_uninterrupted(tiny_model_path, server, tmp_path):
    """max_staleness=0: the worker generates round r only from weight version r, so the run is synchronous GRPO
    in server mode (same prompts, request seeds, buffer shuffle, π_old, IS ratio): parameters agree bitwise. A run
    stopped after step 1 and resumed reaches the same parameters (weights pushed, worker restarted at round 1)."""
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    sync_args = GRPOConfig(**dict(COMMON, output_dir=str(tmp_path / "sync"), vllm_server_base_url=server,
                                  save_strategy="no", max_steps=2))  # fmt: skip
    sync = GRPOTrainer(tiny_model_path, varied_reward, sync_args, train_dataset=_dataset())
    sync.train()

    full = AsyncGRPOTrainer(tiny_model_path, varied_reward,
                            _async_args(tmp_path / "full", server, max_staleness=0, max_steps=2),
                            train_dataset=_dataset())  # fmt: skip
    full.train()
    assert [r["staleness"] for r in full.async_rollout.trained_rounds] == [0, 0]
    assert [r["round"] for r in full.async_rollout.trained_rounds] == [0, 1]
    expected = _params(sync)
    for name, value in full.model.named_parameters():
        assert torch.equal(value, expected[name]), name
    logs = {k: v for entry in full.state.log_history for k, v in entry.items()}
    for key in ("sampling/importance_sampling_ratio/mean", "sample/staleness_max", "sample/dropped_stale_total",
                "perf/rollout_wait_s", "reward"):  # fmt: skip
        assert key in logs, key

    out = tmp_path / "resumed"
    first = AsyncGRPOTrainer(tiny_model_path, varied_reward,
                             _async_args(out, server, max_staleness=0, max_steps=1, save_strategy="steps",
                                         save_steps=1), train_dataset=_dataset())  # fmt: skip
    first.train()
    state = json.loads((out / "checkpoint-1" / "rollout_state.json").read_text())
    assert state == {"next_round": 1, "weight_version": 1, "dropped_stale_total": 0}
    resumed = AsyncGRPOTrainer(tiny_model_path, varied_reward,
                               _async_args(out, server, max_staleness=0, save_strategy="no", max_steps=2),
                               train_dataset=_dataset())  # fmt: skip
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert [r["round"] for r in resumed.async_rollout.trained_rounds] == [1]
    for name, value in resumed.model.named_parameters():
        assert torch.equal(value, expected[name]), name


@pytest.mark.slow
def test_staleness_k_never_trains_on_older_samples(tiny_model_path, server, tmp_path):
    """k=1 with the worker allowed 3 rounds ahead: rounds older than 1 version are dropped and counted, never
    trained on (checked from the logged versions); every consumed round is either trained or dropped."""
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    args = _async_args(tmp_path, server, max_staleness=1, max_inflight_tasks=3 * 4, max_steps=4)
    trainer = AsyncGRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset(16))
    trainer.train()
    rounds = trainer.async_rollout.trained_rounds
    assert len(rounds) == 4 and [r["step"] for r in rounds] == [0, 1, 2, 3]
    assert all(0 <= r["step"] - r["version"] <= 1 for r in rounds), rounds
    logged = [e["sample/staleness_max"] for e in trainer.state.log_history if "sample/staleness_max" in e]
    assert len(logged) == 4 and max(logged) <= 1
    dropped_rounds = trainer.async_rollout.dropped_stale_total // args.generation_batch_size
    assert trainer.async_rollout.next_round == rounds[-1]["round"] + 1 == len(rounds) + dropped_rounds


@pytest.mark.slow
def test_server_killed_mid_run_is_a_clear_error_and_no_leak(tiny_model_path, tmp_path):
    """The server stops after the first optimizer step: the trainer raises an error naming the server (from its
    weight push or from the worker), and the worker process is joined."""
    from transformers import TrainerCallback

    from posttrain.experimental.async_grpo import AsyncGRPOTrainer, RolloutWorkerError
    from posttrain.generation.client import ServerUnavailableError

    served = serve_in_thread(PosttrainEngine.from_pretrained(tiny_model_path, device="cpu"), graceful_timeout=5)
    with served as url:

        class StopServer(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                served.stop()

        trainer = AsyncGRPOTrainer(tiny_model_path, varied_reward, _async_args(tmp_path, url, max_staleness=1),
                                   train_dataset=_dataset(), callbacks=[StopServer()])  # fmt: skip
        with pytest.raises((ServerUnavailableError, RolloutWorkerError), match="not reachable"):
            trainer.train()
        assert trainer.state.global_step in (1, 2) and trainer.async_rollout.worker is None  # the push fails on its thread


@pytest.mark.slow
def test_worker_error_is_raised_in_the_trainer(tiny_model_path, server, tmp_path):
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer, RolloutWorkerError

    trainer = AsyncGRPOTrainer(tiny_model_path, failing_reward, _async_args(tmp_path, server),
                               train_dataset=_dataset())  # fmt: skip
    with pytest.raises(RolloutWorkerError, match="ValueError: reward exploded on purpose"):
        trainer.train()
    assert trainer.async_rollout.worker is None


def test_unpicklable_reward_is_a_type_error(tiny_model_path, server, tmp_path):
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(tiny_model_path, lambda completions, **kw: [0.0] * len(completions),
                               _async_args(tmp_path, server), train_dataset=_dataset())  # fmt: skip
    with pytest.raises(TypeError, match="picklable"):
        trainer.train()


class _QueueOnly:
    """Just what ``AsyncRollout.next_trainable_round`` reads of its trainer: a step, the staleness bound, a metric
    sink; the worker's messages come from ``items``."""

    def __init__(self, items, step, max_staleness):
        from types import SimpleNamespace

        from posttrain.rollout.async_worker import AsyncRollout

        self.items, self.metrics = list(items), {}
        self.state, self.args = SimpleNamespace(global_step=step), SimpleNamespace(max_staleness=max_staleness)
        self.backend = SimpleNamespace(base_url="http://127.0.0.1:1")
        self._inner_backend = lambda: self.backend
        self._pending_completions = None
        self.add_callback = lambda callback: None
        self.rollout = AsyncRollout(self, make_spec=None, score=lambda batch, record: batch)
        self.rollout.get_item = self._get_item

    def _get_item(self):
        import pickle

        return ("round", pickle.dumps(self.items.pop(0)))

    def _record(self, mode):
        return self.metrics.__setitem__


def _round(index, version, rows=4):
    return {"round": index, "version": version, "batch": {"completion_ids": torch.zeros(rows, 2, dtype=torch.long)},
            "metrics": [("reward", 1.0)], "table": None, "put_time": 0.0}  # fmt: skip


def test_rounds_older_than_max_staleness_are_dropped_and_counted():
    from posttrain.experimental.async_grpo import RolloutWorkerError

    fake = _QueueOnly([_round(0, 0), _round(1, 1), _round(2, 2), _round(3, 3)], step=3, max_staleness=1)
    rollout = fake.rollout
    rollout.next_trainable_round()
    assert rollout.trained_rounds == [{"step": 3, "round": 2, "version": 2, "staleness": 1}]
    assert rollout.dropped_stale_total == 8 and fake.metrics["sample/dropped_stale_total"] == 8.0
    assert fake.metrics["sample/staleness_max"] == 1.0 and fake.metrics["reward"] == 1.0 and rollout.next_round == 3
    ahead = _QueueOnly([_round(0, 5)], step=3, max_staleness=1)
    with pytest.raises(RolloutWorkerError, match="ahead of the trainer"):
        ahead.rollout.next_trainable_round()


def test_weight_uploader_mailbox_latest_wins_and_never_blocks_the_offer():
    """While version 1 is uploading, versions 2 and 3 are offered without waiting; 3 replaces 2 in the one-slot
    mailbox, so the server gets 1 then 3. wait() returns once 3 is on the server; an upload error is raised by the
    next call, and the thread stops."""
    from posttrain.rollout.async_worker import WeightUploader

    release, started, uploaded = threading.Event(), threading.Event(), []

    def upload(chunks, version):
        started.set()
        assert release.wait(10)
        uploaded.append((chunks, version))
        return version

    uploader = WeightUploader(upload)
    uploader.offer([b"v1"], 1)
    assert started.wait(10)
    for version in (2, 3):
        uploader.offer([f"v{version}".encode()], version)  # returns although the upload of 1 is blocked
    assert uploaded == [] and uploader.superseded == 1
    with pytest.raises(TimeoutError, match="did not finish"):
        uploader.wait(timeout=0.05)
    release.set()
    uploader.wait(timeout=10)
    assert uploaded == [([b"v1"], 1), ([b"v3"], 3)] and uploader.server_version == 3
    uploader.close()
    assert not uploader._thread.is_alive()

    def broken(chunks, version):
        raise ConnectionError("server gone")

    failing = WeightUploader(broken)
    failing.offer([b"x"], 1)
    with pytest.raises(ConnectionError, match="server gone"):
        failing.wait(timeout=10)
    with pytest.raises(RuntimeError, match="closed"):
        failing.offer([b"y"], 2)
    failing.close()
    assert not failing._thread.is_alive()
