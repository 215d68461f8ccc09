"""The ``vllm_server`` backend against ``posttrain serve`` over loopback: sampling equals in-process sampling,
weight sync (full and PEFT-merged) is bitwise, GRPO in server mode equals in-process GRPO, a dead server is a clear
error."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward
from transformers import AutoModelForCausalLM

from posttrain.generation.base import SamplingConfig
from posttrain.generation.client import ServerUnavailableError
from posttrain.generation.group_sampler import GroupSampler
from posttrain.generation.registry import get_backend
from posttrain.generation.vllm_server import VLLMServerBackend, request_seed
from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

EOS, PAD = 258, 259
PROMPTS = [list(b"hello there"), list(b"a"), list(b"the quick brown fox")]
SAMPLING = SamplingConfig(6, temperature=0.9, top_k=50, eos_token_ids=[EOS], pad_token_id=PAD)


def _seeded(model, seed, k):
    return GroupSampler(model, generator=torch.Generator().manual_seed(request_seed(seed, 0, k)))


@pytest.mark.parametrize("protocol", [None, "trl"])
def test_generate_equals_in_process_sampler(server_url, engine, protocol):
    backend = VLLMServerBackend(base_url=server_url, protocol=protocol, seed=11)
    assert backend.protocol == (protocol or "posttrain")
    for k in range(2):
        remote = backend.generate(PROMPTS, SAMPLING, 3)
        local = _seeded(engine.model, 11, k).generate(PROMPTS, SAMPLING, 3)
        assert remote.completion_ids == local.completion_ids and remote.finished == local.finished
        assert remote.logprobs == local.logprobs and remote.prompt_ids == local.prompt_ids
        # top_k=50 truncates: the server returns the kept mass too (TRL 1.17's correction works in server mode)
        assert local.log_kept_mass is not None and remote.log_kept_mass == local.log_kept_mass
    greedy = backend.generate(PROMPTS[:1], SamplingConfig(5, do_sample=False, eos_token_ids=[EOS], pad_token_id=PAD), 2)
    assert greedy.completion_ids[0] == greedy.completion_ids[1]


def test_set_request_index_seeds_the_next_request_as_the_kth(server_url, engine):
    """The async worker numbers its requests by round: the k-th request's seed, then the counter continues."""
    backend = VLLMServerBackend(base_url=server_url, seed=11)
    backend.set_request_index(5)
    assert backend.request_index == 5
    remote = backend.generate(PROMPTS, SAMPLING, 2)
    local = _seeded(engine.model, 11, 5).generate(PROMPTS, SAMPLING, 2)
    assert remote.completion_ids == local.completion_ids and remote.logprobs == local.logprobs
    assert backend.state_dict() == {"requests": 6} and backend.request_index == 6
    with pytest.raises(ValueError, match="k must be >= 0"):
        backend.set_request_index(-1)


def test_registry_builds_it_from_trl_config_fields(server_url):
    from types import SimpleNamespace

    host, port = server_url.removeprefix("http://").split(":")
    args = SimpleNamespace(vllm_server_base_url=None, vllm_server_host=host, vllm_server_port=int(port),
                           vllm_server_timeout=5.0, seed=3)  # fmt: skip
    backend = get_backend("vllm_server", None, None, args=args)
    assert isinstance(backend, VLLMServerBackend) and backend.base_url == server_url and backend.seed == 3


def test_sync_weights_full_and_peft_merged(tiny_model_path):
    from peft import LoraConfig, get_peft_model

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with serve_in_thread(engine) as url:
        backend = VLLMServerBackend(base_url=url, chunk_bytes=32 * 1024)
        backend.sync_weights(policy)
        assert backend.version == 1
        served = dict(engine.model.named_parameters())
        assert all(torch.equal(served[n], p) for n, p in policy.named_parameters())
        # PEFT: the server gets W + BA under the base names; the trainer's adapters are unmerged afterwards.
        peft = get_peft_model(policy, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        q_name = "model.layers.0.self_attn.q_proj.weight"
        base_q = peft.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().clone()
        backend.sync_weights(peft)
        assert backend.version == 2
        layer = peft.base_model.model.model.layers[0].self_attn.q_proj
        expected = base_q + layer.get_delta_weight("default")
        assert torch.equal(served[q_name], expected) and torch.equal(layer.base_layer.weight, base_q)
        # Same values as TRL's merge_adapter() (up to rounding), and the frozen base weights are untouched.
        peft.merge_adapter()
        torch.testing.assert_close(served[q_name], layer.base_layer.weight, atol=1e-6, rtol=0)
        peft.unmerge_adapter()
        assert not layer.merged
        with torch.no_grad():
            layer.base_layer.weight.copy_(base_q)
        remote = backend.generate(PROMPTS, SAMPLING, 2)
        assert remote.logprobs is not None and backend.version == 2
        backend.sync_weights(peft, version=10)  # e.g. the trainer's global_step
        assert backend.version == 10 and backend.client.health()["version"] == 10
        # DoRA takes TRL's merge -> push -> unmerge path.
        dora = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                              LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))  # fmt: skip
        with torch.no_grad():
            for n, p in dora.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.1)
        backend.sync_weights(dora)
        dora_q = dora.base_model.model.model.layers[0].self_attn.q_proj
        assert not dora_q.merged
        dora.merge_adapter()
        torch.testing.assert_close(served[q_name], dora_q.base_layer.weight, atol=1e-6, rtol=0)


def _grpo_args(tmp_path, **overrides):
    from posttrain.trainers.grpo import GRPOConfig

    values = dict(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", logging_steps=1,
        gradient_checkpointing=False, write_report=False, disable_tqdm=True, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=6, max_steps=2, learning_rate=5e-2, seed=7,
        temperature=0.9,
    )  # fmt: skip
    values.update(overrides)
    return GRPOConfig(**values)


def _dataset():
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])


class _SeededInProcess:
    """The in-process run's sampler: GroupSampler re-seeded per call exactly as the server backend seeds requests."""

    def __init__(self, sampler, seed):
        self.sampler, self.seed, self.calls = sampler, seed, 0

    def generate(self, prompt_ids, sampling, num_generations=1):
        self.sampler.generator = torch.Generator().manual_seed(request_seed(self.seed, 0, self.calls))
        self.calls += 1
        return self.sampler.generate(prompt_ids, sampling, num_generations)

    def sync_weights(self, model):
        pass


@pytest.mark.slow
def test_grpo_server_mode_equals_in_process(tiny_model_path, tmp_path):
    """GRPO with use_vllm=True, vllm_mode='server' against posttrain serve reaches the in-process parameters.

    Both runs sample the same tokens (seeded per request) from the same weights (pushed before every generation),
    and both apply the importance-sampling correction to the sampler's log-probs (deferred to the loss, as server
    mode does), so they must agree to rounding.
    """
    from posttrain.trainers.grpo import GRPOTrainer

    local = GRPOTrainer(tiny_model_path, varied_reward, _grpo_args(tmp_path / "a", rollout_importance_sampling=True,
                                                                   steps_per_generation=1),
                        train_dataset=_dataset())  # fmt: skip
    local.pipeline.backend = _SeededInProcess(local.backend, seed=7)
    local.pipeline.settings.defer_importance_sampling = True  # as server mode: the ratio from the loss's forward
    local.train()

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    with serve_in_thread(engine) as url:
        remote = GRPOTrainer(tiny_model_path, varied_reward, _grpo_args(tmp_path / "b", use_vllm=True,
                                                                        vllm_mode="server", vllm_server_base_url=url,
                                                                        steps_per_generation=1),
                             train_dataset=_dataset())  # fmt: skip
        assert isinstance(remote.backend, VLLMServerBackend)
        remote.train()
        assert remote.backend.version == 2  # pushed before each of the two generations
        served = dict(engine.model.named_parameters())
    local_params = dict(local.model.named_parameters())
    changed = 0
    for name, value in remote.model.named_parameters():
        assert torch.equal(value, local_params[name]), name  # same tokens, same log-probs: bitwise
        changed += not torch.equal(value, served[name])
    assert changed > 0  # the last optimizer step came after the last push
    logs = {k: v for entry in remote.state.log_history for k, v in entry.items()}
    assert "sampling/importance_sampling_ratio/mean" in logs


@pytest.mark.slow
@pytest.mark.invariance
def test_grpo_server_mode_resume_equals_uninterrupted(server_url, tiny_model_path, tmp_path):
    """A server-mode run stopped at step 1 and resumed sends the same request seeds as the uninterrupted run (the
    backend's request counter is in posttrain's resume state), so it reaches the same parameters bitwise."""
    import torch as _torch

    from posttrain.trainers.grpo import GRPOTrainer

    server = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=server_url, steps_per_generation=1,
                  max_steps=3, lr_scheduler_type="constant")  # fmt: skip
    full = GRPOTrainer(tiny_model_path, varied_reward, _grpo_args(tmp_path / "full", **server),
                       train_dataset=_dataset())  # fmt: skip
    full.train()
    assert full.backend.state_dict() == {"requests": 3}

    out = tmp_path / "resumed"
    first = GRPOTrainer(tiny_model_path, varied_reward,
                        _grpo_args(out, **{**server, "max_steps": 1}, save_strategy="steps", save_steps=1),
                        train_dataset=_dataset())  # fmt: skip
    first.train()
    saved = _torch.load(out / "checkpoint-1" / "posttrain_state_0.pt", weights_only=True)
    assert saved["generation_backend"] == {"requests": 1}
    resumed = GRPOTrainer(tiny_model_path, varied_reward, _grpo_args(out, **server), train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert resumed.backend.state_dict() == {"requests": 3}
    expected = dict(full.model.named_parameters())
    for name, value in resumed.model.named_parameters():
        assert _torch.equal(value, expected[name]), name


def test_server_killed_mid_run_is_a_clear_error(tiny_model_path, tmp_path):
    """The server stops after the first optimizer step: the next push fails with an error naming the server."""
    from transformers import TrainerCallback

    from posttrain.trainers.grpo import GRPOTrainer

    served = serve_in_thread(PosttrainEngine.from_pretrained(tiny_model_path, device="cpu"), graceful_timeout=5)
    with served as url:

        class StopServer(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                served.stop()

        trainer = GRPOTrainer(tiny_model_path, varied_reward,
                              _grpo_args(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
                                         steps_per_generation=1), train_dataset=_dataset(),
                              callbacks=[StopServer()])  # fmt: skip
        with pytest.raises(ServerUnavailableError, match=r"not reachable.*posttrain serve"):
            trainer.train()
        assert trainer.state.global_step == 1 and not served.running


def test_rloo_server_mode_trains(server_url, tiny_model_path, tmp_path):
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    args = RLOOConfig(output_dir=str(tmp_path), report_to="none", save_strategy="no", write_report=False,
                      disable_tqdm=True, gradient_checkpointing=False, per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=4, max_steps=1, learning_rate=5e-2, use_vllm=True,
                      vllm_mode="server", vllm_server_base_url=server_url)  # fmt: skip
    trainer = RLOOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_no_server_at_startup_fails_after_timeout(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ServerUnavailableError, match="did not become ready within 0.5 s"):
        VLLMServerBackend(base_url=f"http://127.0.0.1:{port}", timeout=0.5)


@pytest.mark.parametrize("knobs", [dict(top_p=0.8), dict(top_k=5), dict(min_p=0.1, temperature=0.3)])
def test_sampling_mask_from_the_server_equals_in_process(server_url, engine, knobs):
    """keep_sampling_mask over the wire: the server's per-token kept support (ids, thresholds) equals the in-process
    sampler's, on /v1/completions (the backend) and on TRL's /generate/; it is only sent when asked."""
    backend = VLLMServerBackend(base_url=server_url, seed=11)
    sampling = SamplingConfig(6, eos_token_ids=[EOS], pad_token_id=PAD, return_sampling_mask=True,
                              **{"temperature": 0.9, **knobs})  # fmt: skip
    remote = backend.generate(PROMPTS, sampling, 3)
    local = _seeded(engine.model, 11, 0).generate(PROMPTS, sampling, 3)
    assert remote.completion_ids == local.completion_ids and remote.logprobs == local.logprobs
    assert local.sampling_mask is not None and remote.sampling_mask == local.sampling_mask
    assert all(len(m) == len(ids) for m, ids in zip(remote.sampling_mask, remote.completion_ids))
    entries = [e for row in remote.sampling_mask for e in row]
    assert all(e is None or isinstance(e, float) or (isinstance(e, list) and len(e) <= 16) for e in entries)
    plain = backend.generate(PROMPTS, SamplingConfig(6, eos_token_ids=[EOS], pad_token_id=PAD, **knobs), 3)
    assert plain.sampling_mask is None and plain.log_kept_mass is not None
    payload = {"prompts": PROMPTS, "n": 2, "max_tokens": 6, "temperature": 0.9, **knobs,
               "generation_kwargs": {"seed": 5}, "return_sampling_mask": True}  # fmt: skip
    data = backend.client.request("POST", "/generate/", json=payload).json()
    local = GroupSampler(engine.model, generator=torch.Generator().manual_seed(5)).generate(
        PROMPTS, SamplingConfig(6, eos_token_ids=list(engine.eos_token_ids), pad_token_id=PAD, return_sampling_mask=True,
                                **{"temperature": 0.9, **knobs}), 2,
    )  # fmt: skip
    assert data["completion_ids"] == local.completion_ids and data["sampling_mask"] == local.sampling_mask


@pytest.mark.slow
def test_grpo_server_mode_with_sampling_mask_equals_in_process(tiny_model_path, tmp_path):
    """keep_sampling_mask in server mode: the support comes back from ``posttrain serve`` and the run reaches the
    in-process run's parameters bitwise (same tokens, same supports, same masked log-probs)."""
    from posttrain.trainers.grpo import GRPOTrainer

    common = dict(steps_per_generation=1, keep_sampling_mask=True, top_p=0.8)
    local = GRPOTrainer(tiny_model_path, varied_reward, _grpo_args(tmp_path / "a", rollout_importance_sampling=True,
                                                                   **common),
                        train_dataset=_dataset())  # fmt: skip
    local.pipeline.backend = _SeededInProcess(local.backend, seed=7)
    local.pipeline.settings.defer_importance_sampling = True
    local.train()
    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    with serve_in_thread(engine) as url:
        remote = GRPOTrainer(tiny_model_path, varied_reward, _grpo_args(tmp_path / "b", use_vllm=True,
                                                                        vllm_mode="server", vllm_server_base_url=url,
                                                                        **common),
                             train_dataset=_dataset())  # fmt: skip
        remote.train()
    local_params = dict(local.model.named_parameters())
    for name, value in remote.model.named_parameters():
        assert torch.equal(value, local_params[name]), name
    logs = {k: v for entry in remote.state.log_history for k, v in entry.items()}
    local_logs = {k: v for entry in local.state.log_history for k, v in entry.items()}
    assert logs["sampling_mask/frac_full_softmax"] == 0.0
    for key in ("sampling_mask/frac_ids", "sampling/raw_importance_sampling_ratio/mean"):
        assert logs[key] == local_logs[key], key
    assert logs["sampling/raw_importance_sampling_ratio/min"] == pytest.approx(1.0, abs=1e-4)
