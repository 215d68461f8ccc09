"""AsyncGRPO over two generation servers (``vllm_server_base_urls``): at ``max_staleness=0`` it equals synchronous
server-mode GRPO over the same two servers bitwise, and a server stopped mid-run is dropped (weight pushes and
generation) while training finishes on the other with the same parameters."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward
from transformers import TrainerCallback

from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

pytestmark = pytest.mark.usefixtures("no_leaked_children")

COMMON = dict(
    report_to="none", logging_steps=1, gradient_checkpointing=False, write_report=False, disable_tqdm=True,
    per_device_train_batch_size=4, num_generations=2, max_completion_length=6, learning_rate=5e-2, seed=7,
    temperature=0.9, lr_scheduler_type="constant", use_vllm=True, vllm_mode="server", save_strategy="no",
    max_steps=3, request_timeout=60.0,
)  # fmt: skip


def _dataset() -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])


def _engine(path):
    return PosttrainEngine.from_pretrained(path, device="cpu")


class _StopAfterStep(TrainerCallback):
    def __init__(self, step, server):
        self.step, self.server = step, server

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.server.stop()


@pytest.mark.slow
def test_async_grpo_two_servers_equals_sync_and_survives_a_stopped_server(tiny_model_path, tmp_path):
    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from posttrain.generation.server_pool import ServerPoolBackend
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    with serve_in_thread(_engine(tiny_model_path)) as u0, serve_in_thread(_engine(tiny_model_path)) as u1:
        sync = GRPOTrainer(tiny_model_path, varied_reward,
                           GRPOConfig(**COMMON, output_dir=str(tmp_path / "sync"), vllm_server_base_urls=[u0, u1]),
                           train_dataset=_dataset())  # fmt: skip
        sync.train()
        full = AsyncGRPOTrainer(tiny_model_path, varied_reward,
                                AsyncGRPOConfig(**COMMON, output_dir=str(tmp_path / "async"), max_staleness=0,
                                                vllm_server_base_urls=[u0, u1]),
                                train_dataset=_dataset())  # fmt: skip
        assert isinstance(full._inner_backend(), ServerPoolBackend)
        full.train()
    assert [r["staleness"] for r in full.async_rollout.trained_rounds] == [0, 0, 0]
    expected = {n: p.detach().clone() for n, p in sync.model.named_parameters()}
    for name, value in full.model.named_parameters():
        assert torch.equal(value, expected[name]), name

    second = serve_in_thread(_engine(tiny_model_path), graceful_timeout=5)
    with serve_in_thread(_engine(tiny_model_path)) as v0, second as v1:
        dropped = AsyncGRPOTrainer(tiny_model_path, varied_reward,
                                   AsyncGRPOConfig(**COMMON, output_dir=str(tmp_path / "drop"), max_staleness=0,
                                                   vllm_server_base_urls=[v0, v1]),
                                   train_dataset=_dataset(), callbacks=[_StopAfterStep(1, second)])  # fmt: skip
        with pytest.warns(RuntimeWarning, match=rf"Generation server 1 at {v1} failed during the weight push"):
            dropped.train()
        assert dropped.state.global_step == 3 and not second.running
        assert dropped.async_rollout.push_client is None  # closed at the end of train
    assert [r["round"] for r in dropped.async_rollout.trained_rounds] == [0, 1, 2]
    for name, value in dropped.model.named_parameters():
        assert torch.equal(value, expected[name]), name
