"""AsyncGRPO with a LoRA student and adapter-only sync (``vllm_sync_adapter_only``): every push (the start's and the
background uploads) sends only the adapter, the server serves base + adapter, and the post-sync probe confirms the
server generates with the trainer's weights. Loopback server in a thread; the rollout worker is a spawned process
that must not outlive the test."""

from __future__ import annotations

import pytest
from datasets import Dataset
from reward_helpers import varied_reward

from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

pytestmark = pytest.mark.usefixtures("no_leaked_children")


@pytest.mark.slow
def test_async_grpo_lora_adapter_only_sync(tiny_model_path, tmp_path):
    from peft import LoraConfig

    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    full_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    applied = []
    load_adapter = engine.load_adapter

    def counted(config, tensors):
        applied.append(len(tensors))
        return load_adapter(config, tensors)

    engine.load_adapter = counted
    with serve_in_thread(engine) as url:
        args = AsyncGRPOConfig(
            output_dir=str(tmp_path), vllm_server_base_url=url, save_strategy="no", max_steps=2, report_to="none",
            logging_steps=1, gradient_checkpointing=False, write_report=False, disable_tqdm=True,
            per_device_train_batch_size=4, num_generations=2, max_completion_length=4, learning_rate=5e-2, seed=7,
            lr_scheduler_type="constant", use_vllm=True, vllm_mode="server", max_staleness=0,
            vllm_sync_adapter_only=True, vllm_weight_sync_probe=True, vllm_weight_sync_probe_atol=1e-3,
        )  # fmt: skip
        trainer = AsyncGRPOTrainer(tiny_model_path, varied_reward, args,
                                   train_dataset=Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)]),
                                   peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))  # fmt: skip
        trainer.train()
    assert trainer.state.global_step == 2
    assert len(applied) >= 2 and set(applied) == {8}  # the start's push and >= 1 after a step: 2 layers x q, v x A, B
    assert engine.adapter_config is not None and engine.adapter_config["r"] == 4
    logged = [e["perf/weight_sync_bytes"] for e in trainer.state.log_history if "perf/weight_sync_bytes" in e]
    assert logged and all(0 < b * 20 < full_bytes for b in logged), (logged, full_bytes)


def test_async_distillation_lora_student_adapter_only_push(tiny_model_path, tmp_path):
    """An AsyncDistillation LoRA student with ``vllm_sync_adapter_only``: the push (the shared async worker's
    ``push_weights``) sends the adapter alone, and the server samples with the student's log-probs (base + adapter),
    not the base's."""
    import torch
    from distill_helpers import prompts
    from peft import LoraConfig
    from trainer_helpers import fast_config

    from posttrain.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer
    from posttrain.generation.client import GenerationClient

    engine = PosttrainEngine.from_pretrained(tiny_model_path, device="cpu")
    with serve_in_thread(engine) as url:
        args = fast_config(AsyncDistillationConfig, tmp_path, per_device_train_batch_size=4, max_completion_length=6,
                           learning_rate=5e-2, seed=7, vllm_server_base_url=url, max_steps=1,
                           teacher_server_urls={"default": "http://127.0.0.1:1"}, vllm_sync_adapter_only=True)  # fmt: skip
        trainer = AsyncDistillationTrainer(tiny_model_path, args, train_dataset=prompts(),
                                           peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))  # fmt: skip
        model = trainer.model
        with torch.no_grad():  # a non-zero adapter (lora_B starts at zero)
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
        with GenerationClient(url) as client:
            trainer.async_rollout.push_client = client
            trainer.async_rollout.push_weights(wait=True)
            prompt = trainer.processing_class("Q3:").input_ids
            choice = client.completions([prompt], max_tokens=6, seed=0).choices[0][0]
        trainer.async_rollout.close()
    assert engine.adapter_config is not None and engine.adapter_config["r"] == 4
    assert any("lora_A" in n for n, _ in engine.model.named_parameters())  # served as base + adapter
    ids = torch.tensor([prompt + choice.token_ids])
    n = len(choice.token_ids)
    with torch.no_grad():
        student = torch.log_softmax(model(ids).logits[0, -n - 1 : -1].float(), -1)
        with model.disable_adapter():
            base = torch.log_softmax(model(ids).logits[0, -n - 1 : -1].float(), -1)
    mine = student.gather(-1, ids[0, -n:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(choice.logprobs), mine, rtol=0, atol=1e-4)
    assert not torch.allclose(torch.tensor(choice.logprobs), base.gather(-1, ids[0, -n:, None]).squeeze(-1), atol=1e-2)
