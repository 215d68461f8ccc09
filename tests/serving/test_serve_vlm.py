"""Vision-language prompts on the generation server: ``posttrain serve`` takes vLLM's multimodal token prompts
(``{"prompt_token_ids", "multi_modal_data": {"image": [data URL, ...]}}``) on ``/v1/completions``, rebuilds the
vision inputs with the served processor and samples exactly as the in-process group sampler; GRPO and RLOO in
server mode send each prompt's images; bad multimodal requests are 400s naming the field."""

from __future__ import annotations

import base64

import pytest
import torch
from datasets import Dataset
from PIL import Image

from posttrain.data.vision_prompts import encode_vision_prompts
from posttrain.generation.base import SamplingConfig
from posttrain.generation.group_sampler import GroupSampler
from posttrain.generation.images import decode_image, encode_image, multimodal_prompt
from posttrain.generation.vllm_server import VLLMServerBackend, request_seed
from posttrain.models.tiny import build_tiny_vlm, save_tiny_vlm
from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def _image(rgb, size=(20, 24)) -> Image.Image:
    image = Image.new("RGB", size, rgb)
    image.putpixel((3, 5), (7, 200, 90))  # not a flat colour: resizing and cropping matter
    return image


def _rows() -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": "What colour is this?"}], "images": [_image(RED)]},
        {"prompt": [{"role": "user", "content": "Two?"}], "images": [_image(GREEN, (40, 10)), _image(BLUE, (9, 33))]},
        {"prompt": [{"role": "user", "content": "No picture here."}], "images": []},
        {"prompt": [{"role": "user", "content": "And this?"}], "images": [_image(BLUE)]},
    ]


@pytest.fixture(scope="module")
def vlm_path(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="module")
def vlm_engine(vlm_path):
    return PosttrainEngine.from_pretrained(vlm_path, device="cpu", served_model_name="tiny-vlm")


@pytest.fixture(scope="module")
def vlm_url(vlm_engine):
    with serve_in_thread(vlm_engine) as url:
        yield url


def _sampling(processor) -> SamplingConfig:
    tok = processor.tokenizer
    return SamplingConfig(6, temperature=0.9, top_k=50, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)


def test_image_round_trip_is_lossless():
    image = _image(GREEN, (9, 33))
    back = decode_image(encode_image(image))
    assert back.size == image.size and back.tobytes() == image.tobytes()
    assert multimodal_prompt([1, 2], None) == {"prompt_token_ids": [1, 2]}
    with pytest.raises(ValueError, match="not valid base64"):
        decode_image("data:image/png;base64,@@@")
    with pytest.raises(ValueError, match="not an image"):
        decode_image(base64.b64encode(b"hello").decode())


def test_seeded_image_request_equals_in_process_group_sampler(vlm_url, vlm_engine):
    """The README's equality, with images: a seeded server request returns the tokens and log-probs of the
    in-process group sampler given the trainer's own vision inputs for the same prompts and images."""
    _, processor = build_tiny_vlm()
    rows = _rows()
    _, _, prompt_ids, vision = encode_vision_prompts(rows, processor)
    assert vision[0] and not vision[2]  # an image prompt and a text prompt
    sampling = _sampling(processor)
    backend = VLLMServerBackend(base_url=vlm_url, seed=5)
    for k in range(2):
        remote = backend.generate(prompt_ids, sampling, 3, images=[r["images"] or None for r in rows])
        generator = torch.Generator().manual_seed(request_seed(5, 0, k))
        local = GroupSampler(vlm_engine.model, generator=generator).generate(prompt_ids, sampling, 3, vision_inputs=vision)
        assert remote.completion_ids == local.completion_ids and remote.finished == local.finished
        assert remote.logprobs == local.logprobs
    # the images matter: the same ids with other images sample other tokens
    other = [[_image(GREEN)], [_image(RED), _image(RED)], None, [_image(RED)]]
    backend.set_request_index(0)
    assert backend.generate(prompt_ids, sampling, 3, images=other).logprobs != remote.logprobs


def test_bad_multimodal_requests_are_400_naming_the_field(vlm_url, server_url):
    import httpx

    _, processor = build_tiny_vlm()
    _, _, prompt_ids, _ = encode_vision_prompts(_rows()[:1], processor)
    good = multimodal_prompt(prompt_ids[0], [_image(RED)])
    cases = [
        (vlm_url, {**good, "multi_modal_data": {"image": ["data:image/png;base64,AAAA"]}}, "image[0] cannot be decoded"),
        (vlm_url, {**good, "multi_modal_data": {"image": ["%%%"]}}, "not valid base64"),
        (vlm_url, {**good, "multi_modal_data": {"audio": ["x"]}}, "images only"),
        (vlm_url, {"prompt_token_ids": list(b"hello"), "multi_modal_data": {"image": good["multi_modal_data"]["image"]}},
         "no image token"),
        (vlm_url, {"prompt_token_ids": prompt_ids[0]}, "but no images"),
        (server_url, {"prompt_token_ids": list(b"hello"), "multi_modal_data": good["multi_modal_data"]}, "text-only"),
    ]  # fmt: skip
    for url, prompt, message in cases:
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": [prompt], "max_tokens": 2}, timeout=60)
        assert resp.status_code == 400, (message, resp.text)
        error = resp.json()["error"]
        assert error["param"] == "multi_modal_data" and message in error["message"], error


def test_image_requests_respect_max_request_bytes(vlm_engine):
    import httpx

    _, processor = build_tiny_vlm()
    _, _, prompt_ids, _ = encode_vision_prompts(_rows()[:1], processor)
    pixels = torch.randint(0, 256, (256, 256, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    noisy = Image.frombytes("RGB", (256, 256), pixels.numpy().tobytes())  # ~200 kB of PNG: above the bound
    body = {"prompt": [multimodal_prompt(prompt_ids[0], [noisy])], "max_tokens": 2}
    with serve_in_thread(vlm_engine, max_request_bytes=64 * 1024) as url:
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 413
        small = {"prompt": [multimodal_prompt(prompt_ids[0], [_image(RED)])], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=small, timeout=60).status_code == 200


@pytest.mark.parametrize("trainer_name", ["grpo", "rloo"])
def test_server_mode_trains_on_mixed_image_rows_and_pushes_weights(vlm_path, tmp_path, trainer_name):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    config_cls, trainer_cls = (GRPOConfig, GRPOTrainer) if trainer_name == "grpo" else (RLOOConfig, RLOOTrainer)
    seen = []

    def reward(prompts, completions, images, **kwargs):
        seen.append([len(i) for i in images])
        return [float(len(c[0]["content"])) for c in completions]

    engine = PosttrainEngine.from_pretrained(vlm_path, device="cpu")
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    with serve_in_thread(engine) as url:
        args = config_cls(
            output_dir=str(tmp_path), report_to="none", save_strategy="no", logging_steps=1,
            gradient_checkpointing=False, write_report=False, disable_tqdm=True, max_steps=2,
            per_device_train_batch_size=8, num_generations=2, max_completion_length=6, learning_rate=1e-2, seed=0,
            dataloader_pin_memory=False, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
            vllm_server_timeout=30,
        )  # fmt: skip
        trainer = trainer_cls(vlm_path, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(_rows()))
        trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    assert sorted(seen[0]) == [0, 0, 1, 1, 1, 1, 2, 2]
    # the second step's weights were pushed to the server: its model now equals the trained policy's first update
    changed = [k for k, v in engine.model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and any("vision_tower" in k or "multi_modal_projector" in k for k in changed)


class _SeededInProcess:
    """The in-process sampler re-seeded per call exactly as the server backend seeds its requests."""

    def __init__(self, sampler, seed):
        self.sampler, self.seed, self.calls = sampler, seed, 0

    def generate(self, prompt_ids, sampling, num_generations=1, vision_inputs=None):
        self.sampler.generator = torch.Generator().manual_seed(request_seed(self.seed, 0, self.calls))
        self.calls += 1
        return self.sampler.generate(prompt_ids, sampling, num_generations, vision_inputs=vision_inputs)

    def sync_weights(self, model):
        pass


def test_grpo_server_mode_with_images_equals_in_process(vlm_path, tmp_path):
    """GRPO on image rows against ``posttrain serve`` reaches the in-process parameters bitwise: the server rebuilds
    the very vision inputs the trainer uses, samples the same tokens (seeded per request) from the same pushed
    weights, and both runs apply the deferred importance-sampling correction to the sampler's log-probs."""
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    def reward(completions, **kwargs):
        return [float(len(set(c[0]["content"]))) for c in completions]

    def args(out, **overrides):
        return GRPOConfig(
            output_dir=str(out), report_to="none", save_strategy="no", logging_steps=1, gradient_checkpointing=False,
            write_report=False, disable_tqdm=True, max_steps=2, per_device_train_batch_size=8, num_generations=2,
            max_completion_length=6, learning_rate=5e-2, seed=7, temperature=0.9, steps_per_generation=1,
            dataloader_pin_memory=False, **overrides,
        )  # fmt: skip

    local = GRPOTrainer(vlm_path, reward, args(tmp_path / "a", rollout_importance_sampling=True),
                        train_dataset=Dataset.from_list(_rows()))  # fmt: skip
    local.pipeline.backend = _SeededInProcess(local.backend, seed=7)
    local.pipeline.settings.defer_importance_sampling = True  # as server mode: the ratio from the loss's forward
    local.train()

    engine = PosttrainEngine.from_pretrained(vlm_path, device="cpu")
    with serve_in_thread(engine) as url:
        remote = GRPOTrainer(vlm_path, reward, args(tmp_path / "b", use_vllm=True, vllm_mode="server",
                                                    vllm_server_base_url=url),
                             train_dataset=Dataset.from_list(_rows()))  # fmt: skip
        assert isinstance(remote.backend, VLLMServerBackend)
        remote.train()
        assert remote.backend.version == 2  # pushed before each of the two generations
    local_params = dict(local.model.named_parameters())
    moved = 0
    for name, value in remote.model.named_parameters():
        assert torch.equal(value, local_params[name]), name
        moved += "vision_tower" in name and not torch.equal(value, engine.model.state_dict()[name])
    assert moved > 0  # the images reached the loss: the vision tower trained after the last push


def test_multimodal_rope_model_served_greedy_equals_in_process(tmp_path, monkeypatch):
    """A Qwen2-VL (flattened patches, ``image_grid_thw``, per-token ``mm_token_type_ids``) served with an image-only
    processor: the server rebuilds all three from the image and the ids, so its greedy completion equals in-process
    sampling with the trainer-side vision inputs."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "trainers"))
    from test_grpo_vlm import _image as plain_image
    from test_grpo_vlm import _tiny_qwen2_vl

    model, tok, prompt, vision, processor = _tiny_qwen2_vl()  # ImageOnlyQwen2VLProcessor: no torchvision
    engine = PosttrainEngine(model, processor, "tiny-qwen2-vl")
    rebuilt = engine.vision_inputs(prompt, [plain_image(RED)])
    assert set(rebuilt) == set(vision) and all(torch.equal(rebuilt[k], vision[k]) for k in vision)
    sampling = SamplingConfig(5, do_sample=False, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    local = GroupSampler(model, tok).generate([prompt], sampling, 2, vision_inputs=[vision])
    with serve_in_thread(engine) as url:
        backend = VLLMServerBackend(base_url=url, seed=0)
        remote = backend.generate([prompt], sampling, 2, images=[[plain_image(RED)]])
    assert remote.completion_ids == local.completion_ids and remote.finished == local.finished
