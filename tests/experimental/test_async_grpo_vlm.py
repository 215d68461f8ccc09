"""AsyncGRPOTrainer on image rows (TRL's VLM format: ``prompt`` + ``image`` / ``images``) against ``posttrain serve``
with a tiny LLaVA: the rollout worker renders the prompts with the processor and sends each prompt's images to the
server in vLLM's multimodal prompt format; the trainer's log-prob forwards get the rows' vision inputs."""

from __future__ import annotations

import pytest
import torch
from async_grpo_helpers import distinct_chars_reward
from datasets import Dataset
from PIL import Image

from posttrain.models.tiny import save_tiny_vlm
from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

pytestmark = pytest.mark.usefixtures("no_leaked_children")

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def _image(rgb, size=(20, 24)) -> Image.Image:
    image = Image.new("RGB", size, rgb)
    image.putpixel((3, 5), (7, 200, 90))
    return image


def _dataset() -> Dataset:
    rows = [
        {"prompt": [{"role": "user", "content": "What colour is this?"}], "images": [_image(RED)]},
        {"prompt": [{"role": "user", "content": "Two?"}], "images": [_image(GREEN, (40, 10)), _image(BLUE, (9, 33))]},
        {"prompt": [{"role": "user", "content": "No picture here."}], "images": []},
        {"prompt": [{"role": "user", "content": "And this?"}], "images": [_image(BLUE)]},
    ]
    return Dataset.from_list(rows)


COMMON = dict(
    report_to="none", save_strategy="no", logging_steps=1, gradient_checkpointing=False, write_report=False,
    disable_tqdm=True, max_steps=2, per_device_train_batch_size=4, num_generations=2, max_completion_length=6,
    learning_rate=5e-2, seed=7, temperature=0.9, lr_scheduler_type="constant", dataloader_pin_memory=False,
    use_vllm=True, vllm_mode="server", vllm_server_timeout=60,
)  # fmt: skip


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.mark.slow
def test_max_staleness_0_with_images_equals_sync_server_grpo(vlm_path, tmp_path):
    """max_staleness=0 on image rows is synchronous server-mode VLM GRPO to the last bit (same rounds, request seeds,
    images, pushed weights); the IS ratio is 1 on-policy (the server samples with the trainer's weights and rebuilds
    the same vision inputs); the vision tower trains (the images reached the loss's forward)."""
    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    engine = PosttrainEngine.from_pretrained(vlm_path, device="cpu")
    initial = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with serve_in_thread(engine) as url:
        sync = GRPOTrainer(vlm_path, distinct_chars_reward,
                           GRPOConfig(**COMMON, output_dir=str(tmp_path / "sync"), vllm_server_base_url=url),
                           train_dataset=_dataset())  # fmt: skip
        sync.train()
        trainer = AsyncGRPOTrainer(vlm_path, distinct_chars_reward,
                                   AsyncGRPOConfig(**COMMON, output_dir=str(tmp_path / "async"),
                                                   vllm_server_base_url=url, max_staleness=0),
                                   train_dataset=_dataset())  # fmt: skip
        trainer.train()
    assert [(r["round"], r["staleness"]) for r in trainer.async_rollout.trained_rounds] == [(0, 0), (1, 0)]
    expected = dict(sync.model.named_parameters())
    moved = 0
    for name, value in trainer.model.named_parameters():
        assert torch.equal(value, expected[name]), name
        moved += "vision_tower" in name and not torch.equal(value, initial[name])
    assert moved > 0
    # On-policy the per-token ratio π_trainer / π_server is 1 up to the image token's probability mass: the sampler
    # never samples the image token (TRL's suppress_tokens), so its log-probs are renormalised without it (a few
    # 1e-3 on this random tiny model) and the ratio sits just below 1, never above it (beyond float noise).
    ratios = [log for log in trainer.state.log_history if "sampling/raw_importance_sampling_ratio/min" in log]
    assert len(ratios) == 2, trainer.state.log_history
    for log in ratios:
        assert log["sampling/raw_importance_sampling_ratio/min"] > 0.99, log
        assert log["sampling/raw_importance_sampling_ratio/max"] < 1 + 1e-5, log


def test_partial_rollouts_with_images_are_refused(vlm_path, tmp_path):
    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    with serve_in_thread(PosttrainEngine.from_pretrained(vlm_path, device="cpu")) as url:
        args = AsyncGRPOConfig(**COMMON, output_dir=str(tmp_path), vllm_server_base_url=url,
                               partial_rollout_max_tokens=2)  # fmt: skip
        with pytest.raises(ValueError, match="partial_rollout_max_tokens cannot be combined with image rows"):
            AsyncGRPOTrainer(vlm_path, distinct_chars_reward, args, train_dataset=_dataset())
