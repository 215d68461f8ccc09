"""Resuming from a damaged checkpoint names the checkpoint and the file, and points at the previous checkpoint."""

from __future__ import annotations

import os
import shutil

import pytest
from reliability_toy import make_toy

from posttrain.reliability.checkpointing import CorruptCheckpointError, file_problem


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory, tiny_model_path):
    out = tmp_path_factory.mktemp("run")
    make_toy(out, tiny_model_path, max_steps=2, save_strategy="steps", save_steps=1).train()
    assert {"checkpoint-1", "checkpoint-2"} <= set(os.listdir(out))
    return out


def _truncate(path, keep: float = 0.5) -> None:
    data = open(path, "rb").read()
    open(path, "wb").write(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    "name", ["optimizer.pt", "model.safetensors", "rng_state.pth", "posttrain_state_0.pt", "trainer_state.json"]
)
def test_resume_from_damaged_file_names_it_and_the_previous_checkpoint(
    tmp_path, tiny_model_path, two_checkpoints, name
):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    _truncate(run / "checkpoint-2" / name)
    trainer = make_toy(run, tiny_model_path, max_steps=3, save_strategy="no")
    with pytest.raises(CorruptCheckpointError) as info:
        trainer.train(resume_from_checkpoint=True)
    message = str(info.value)
    assert "checkpoint-2" in message and name in message
    assert "resume_from_checkpoint=" in message and str(run / "checkpoint-1") in message


def test_no_earlier_checkpoint_says_start_from_scratch(tmp_path, tiny_model_path, two_checkpoints):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    shutil.rmtree(run / "checkpoint-2")
    _truncate(run / "checkpoint-1" / "optimizer.pt")
    trainer = make_toy(run, tiny_model_path, max_steps=3, save_strategy="no")
    with pytest.raises(CorruptCheckpointError, match="no earlier complete checkpoint.*resume_from_checkpoint=None"):
        trainer.train(resume_from_checkpoint=str(run / "checkpoint-1"))


def test_intact_checkpoint_resumes(tmp_path, tiny_model_path, two_checkpoints):
    run = tmp_path / "run"
    shutil.copytree(two_checkpoints, run)
    for name in os.listdir(run / "checkpoint-2"):
        assert file_problem(str(run / "checkpoint-2" / name)) is None, name
    trainer = make_toy(run, tiny_model_path, max_steps=3, save_strategy="no")
    trainer.train(resume_from_checkpoint=True)
    assert trainer.state.global_step == 3


def test_file_problem_kinds(tmp_path):
    empty = tmp_path / "optimizer.pt"
    empty.write_bytes(b"")
    assert "empty" in file_problem(str(empty))
    not_zip = tmp_path / "scheduler.pt"
    not_zip.write_bytes(b"garbage bytes")
    assert "torch.save" in file_problem(str(not_zip))
    bad_json = tmp_path / "trainer_state.json"
    bad_json.write_text('{"global_step": ')
    assert "cannot be read" in file_problem(str(bad_json))
