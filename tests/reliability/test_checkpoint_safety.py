"""Crash-safe checkpoints: staging + rename, discovery ignores tmp-*, rotation keeps the newest, SIGKILL mid-save."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from reliability_toy import make_toy

from posttrain.reliability import checkpointing
from posttrain.reliability.checkpointing import (
    get_last_checkpoint,
    resolve_resume_checkpoint,
    rotate_checkpoints,
)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _fake_checkpoint(folder, name, complete=True):
    path = folder / name
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"x")
    if complete:
        (path / "trainer_state.json").write_text("{}")
    return str(path)


def test_discovery_ignores_staging_and_incomplete_folders(tmp_path):
    _fake_checkpoint(tmp_path, "checkpoint-2")
    _fake_checkpoint(tmp_path, "checkpoint-10")
    _fake_checkpoint(tmp_path, "tmp-checkpoint-12", complete=True)  # staged but never published
    _fake_checkpoint(tmp_path, "checkpoint-11", complete=False)  # half-written by another tool
    (tmp_path / "checkpoint-99").write_text("a file, not a folder")
    assert get_last_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")  # numeric order, not lexical
    assert checkpointing.sorted_checkpoints(tmp_path) == [
        str(tmp_path / "checkpoint-2"),
        str(tmp_path / "checkpoint-10"),
    ]
    assert get_last_checkpoint(tmp_path / "missing") is None
    assert checkpointing.remove_stale_staging(tmp_path) == [str(tmp_path / "tmp-checkpoint-12")]


def test_rotation_never_deletes_newest_or_kept(tmp_path):
    paths = [_fake_checkpoint(tmp_path, f"checkpoint-{s}") for s in (1, 2, 3, 4)]
    deleted = rotate_checkpoints(tmp_path, save_total_limit=1, keep=(paths[1],))
    assert deleted == [paths[0], paths[2]]
    assert checkpointing.sorted_checkpoints(tmp_path) == [paths[1], paths[3]]
    assert rotate_checkpoints(tmp_path, save_total_limit=None) == []
    assert not [n for n in os.listdir(tmp_path) if n.startswith("tmp-")]


def test_publish_replaces_an_existing_checkpoint_whole(tmp_path):
    old = _fake_checkpoint(tmp_path, "checkpoint-3")
    (tmp_path / "checkpoint-3" / "stale.bin").write_bytes(b"old")
    staged = _fake_checkpoint(tmp_path, "tmp-checkpoint-3")
    checkpointing.publish_checkpoint(staged, old)
    assert sorted(os.listdir(old)) == ["model.safetensors", "trainer_state.json"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-3"]


def test_resume_argument_errors_name_the_fix(tmp_path):
    assert resolve_resume_checkpoint(None, str(tmp_path)) is None
    with pytest.raises(ValueError, match="holds no complete checkpoint-N folder"):
        resolve_resume_checkpoint(True, str(tmp_path))
    with pytest.raises(ValueError, match="is not a folder"):
        resolve_resume_checkpoint(str(tmp_path / "nope"), str(tmp_path))
    staged = _fake_checkpoint(tmp_path, "tmp-checkpoint-5")
    with pytest.raises(ValueError, match="unfinished staging folder"):
        resolve_resume_checkpoint(staged, str(tmp_path))
    partial = _fake_checkpoint(tmp_path, "checkpoint-5", complete=False)
    with pytest.raises(ValueError, match="has no trainer_state.json"):
        resolve_resume_checkpoint(partial, str(tmp_path))
    done = _fake_checkpoint(tmp_path, "checkpoint-4")
    assert resolve_resume_checkpoint(True, str(tmp_path)) == done


def test_training_checkpoints_are_complete_and_rotated(tmp_path, tiny_model_path):
    trainer = make_toy(tmp_path, tiny_model_path, max_steps=3, save_strategy="steps", save_steps=1, save_total_limit=2)
    trainer.train()
    names = sorted(os.listdir(tmp_path))
    assert [n for n in names if "checkpoint" in n] == ["checkpoint-2", "checkpoint-3"]
    files = set(os.listdir(tmp_path / "checkpoint-3"))
    for required in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"):
        assert required in files
    assert "posttrain_state_0.pt" in files
    state = json.load(open(tmp_path / "checkpoint-3" / "trainer_state.json"))
    assert state["global_step"] == 3


# The child trains with checkpoints every 2 steps and hangs while saving checkpoint-4, after the model is written but
# before the optimizer; the test SIGKILLs it there.
_CHILD = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, {here!r})
    from reliability_toy import ToyTrainer, make_toy

    class SlowSave(ToyTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            if self.state.global_step == 4:
                open(os.path.join({out!r}, "HANGING"), "w").write(output_dir)
                time.sleep(120)
            super()._save_optimizer_and_scheduler(output_dir)

    make_toy({out!r}, {model!r}, trainer_cls=SlowSave, max_steps=6, save_strategy="steps", save_steps=2).train()
    """
)


@pytest.mark.invariance
def test_sigkill_mid_checkpoint_keeps_previous_checkpoint_and_resume_matches(tmp_path, tiny_model_path):
    out = tmp_path / "run"
    out.mkdir()
    script = tmp_path / "child.py"
    script.write_text(_CHILD.format(here=HERE, out=str(out), model=tiny_model_path))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "POSTTRAIN_NO_REPORT": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while not (out / "HANGING").exists():
            if proc.poll() is not None:
                pytest.fail(f"child exited early: {proc.stderr.read().decode()[-3000:]}")
            if time.time() > deadline:
                pytest.fail("child never reached the checkpoint-4 save")
            time.sleep(0.2)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    # The interrupted save left only a staging folder; checkpoint-2 is the newest complete one.
    assert (out / "tmp-checkpoint-4" / "model.safetensors").exists()
    assert not (out / "tmp-checkpoint-4" / "optimizer.pt").exists()
    assert not (out / "checkpoint-4").exists()
    assert get_last_checkpoint(out) == str(out / "checkpoint-2")

    resumed = make_toy(out, tiny_model_path, max_steps=6, save_strategy="steps", save_steps=2)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    assert not [n for n in os.listdir(out) if n.startswith("tmp-")]
    assert get_last_checkpoint(out) == str(out / "checkpoint-6")

    reference = make_toy(tmp_path / "ref", tiny_model_path, max_steps=6)
    reference.train()
    for (name, a), b in zip(resumed.model.named_parameters(), reference.model.parameters()):
        assert torch.equal(a, b), name
