"""AsyncGRPO's post-sync probe (``vllm_weight_sync_probe``): the trainer computes the log-probs of a fixed probe
sequence when it snapshots its weights, the uploader has the server score it after the push, and a server that
answered 200 but kept its old weights stops training with ``WeightSyncError``. Loopback server in a thread; the
rollout worker is a spawned process that must not outlive the test."""

from __future__ import annotations

import pytest
from datasets import Dataset
from reward_helpers import varied_reward

from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

pytestmark = pytest.mark.usefixtures("no_leaked_children")


def _args(path, url, **overrides):
    from posttrain.experimental.async_grpo import AsyncGRPOConfig

    values = dict(
        output_dir=str(path), vllm_server_base_url=url, save_strategy="no", max_steps=2, report_to="none",
        logging_steps=1, gradient_checkpointing=False, write_report=False, disable_tqdm=True,
        per_device_train_batch_size=4, num_generations=2, max_completion_length=4, learning_rate=5e-2, seed=7,
        lr_scheduler_type="constant", use_vllm=True, vllm_mode="server", max_staleness=0,
        vllm_weight_sync_probe=True,
    )  # fmt: skip
    return AsyncGRPOConfig(**{**values, **overrides})


def _dataset() -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])


def _counting(engine):
    calls = []
    score = engine.score_sequences

    def counted(*args, **kwargs):
        calls.append(args[0])
        return score(*args, **kwargs)

    engine.score_sequences = counted
    return calls


@pytest.mark.slow
def test_probe_passes_on_an_honest_server(tiny_model_path, tmp_path):
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer
    from posttrain.generation.weights import probe_sequence

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    scored = _counting(engine)
    with serve_in_thread(engine) as url:
        trainer = AsyncGRPOTrainer(tiny_model_path, varied_reward, _args(tmp_path, url), train_dataset=_dataset())
        trainer.train()
    assert trainer.state.global_step == 2
    probes = [s for s in scored if s == [probe_sequence(engine.model.config.vocab_size)]]
    assert len(probes) >= 2  # the start's push and at least one after an optimizer step


@pytest.mark.slow
def test_probe_stops_training_when_the_server_drops_pushes(tiny_model_path, tmp_path):
    from posttrain.experimental.async_grpo import AsyncGRPOTrainer
    from posttrain.generation.client import WeightSyncError

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    engine.load_weights = lambda tensors: len(tensors)  # answers 200 with the digest, keeps its old weights
    with serve_in_thread(engine) as url:
        trainer = AsyncGRPOTrainer(tiny_model_path, varied_reward, _args(tmp_path, url, max_steps=4),
                                   train_dataset=_dataset())  # fmt: skip
        with pytest.raises(WeightSyncError, match="not generating with the pushed weights"):
            trainer.train()
    assert trainer.async_rollout.worker is None and 1 <= trainer.state.global_step < 4
