"""GRPOTrainer end to end on the offline tiny models: every loss type, reference/KL, PEFT, μ > 1, reward sources,
rollout_func, batch × gradient-accumulation invariance, learning, eval, logging, resume, config errors."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward
from trainer_helpers import (  # noqa: F401
    assert_same_params,
    fast_config,
    quiet_single_thread,
    train_and_snapshot,
    trainable_params,
)

from posttrain.core.policy_objectives import POLICY_OBJECTIVES, objective_properties
from posttrain.core.presets import GRPO_LOSS_TYPES
from posttrain.trainers.grpo import ENTROPY_CTRL_STATE, GRPOConfig, GRPOTrainer

EOS = 258


def _dataset(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:", "solution": str(i)} for i in range(n)])


def _config(tmp_path, **overrides) -> GRPOConfig:
    values = dict(
        per_device_train_batch_size=4, num_generations=2, max_completion_length=8, max_steps=1, learning_rate=1e-2
    )
    return fast_config(GRPOConfig, tmp_path, **{**values, **overrides})


def _trainable(trainer) -> dict[str, torch.Tensor]:
    return trainable_params(trainer.model)


def _changed(trainer, before) -> int:
    return sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)


def _logs(trainer) -> dict:
    merged = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    return merged


@pytest.mark.parametrize("loss_type", list(GRPO_LOSS_TYPES))
def test_each_loss_type_trains(tiny_model_path, tmp_path, loss_type):
    extra = {"importance_sampling_level": "sequence"} if loss_type == "luspo" else {}
    trainer = GRPOTrainer(
        tiny_model_path, varied_reward, _config(tmp_path, loss_type=loss_type, **extra), train_dataset=_dataset()
    )
    before = _trainable(trainer)
    trainer.train()
    assert _changed(trainer, before) > 0
    logs = _logs(trainer)
    for key in ("loss", "reward", "reward_std", "frac_reward_zero_std", "entropy", "num_tokens", "step_time",
                "completions/mean_length", "completions/clipped_ratio", "rewards/varied_reward/mean"):  # fmt: skip
        assert key in logs, key
    if loss_type in ("grpo", "dapo", "dr_grpo", "bnpo", "luspo"):
        assert "clip_ratio/region_mean" in logs and "clip_ratio/low_min" in logs
    if loss_type == "cispo":
        assert "cispo_clip_ratio" in logs
    if loss_type == "vespo":
        assert "vespo/phi_seq_mean" in logs


def test_default_gradient_checkpointing_and_beta_zero_load_no_reference(tiny_model_path, tmp_path):
    args = _config(tmp_path)
    args.gradient_checkpointing = True
    trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    assert trainer.reference.kind == "none" and trainer.reference.model is None
    before = _trainable(trainer)
    trainer.train()
    assert _changed(trainer, before) > 0
    assert "kl" not in _logs(trainer)


def test_beta_uses_a_frozen_reference_and_logs_kl(tiny_model_path, tmp_path):
    trainer = GRPOTrainer(
        tiny_model_path, varied_reward, _config(tmp_path, beta=0.1, max_steps=2), train_dataset=_dataset()
    )
    assert trainer.reference.kind == "model"
    ref_before = {n: p.clone() for n, p in trainer.reference.model.named_parameters()}
    trainer.train()
    kls = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert len(kls) == 2 and kls[0] == pytest.approx(0.0, abs=1e-6) and kls[1] > 0  # policy moved from π_ref
    assert all(torch.equal(p, ref_before[n]) for n, p in trainer.reference.model.named_parameters())


def test_peft_reference_is_the_base_model_with_adapters_disabled(tiny_model_path, tmp_path):
    from peft import LoraConfig

    trainer = GRPOTrainer(
        tiny_model_path,
        varied_reward,
        _config(tmp_path, beta=0.1, max_steps=2),
        train_dataset=_dataset(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    assert trainer.reference.kind == "adapters_disabled" and trainer.reference.model is None
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    before = _trainable(trainer)
    assert before and all("lora_" in n for n in before)
    trainer.train()
    assert _changed(trainer, before) > 0
    assert all(torch.equal(p, base_before[n]) for n, p in trainer.model.named_parameters() if "lora_" not in n)
    assert [h["kl"] for h in trainer.state.log_history if "kl" in h][-1] > 0
    trainer.save_model(str(tmp_path / "adapter"))
    assert os.path.isfile(tmp_path / "adapter" / "adapter_config.json")


def test_num_iterations_two_generates_once_and_uses_old_logps(tiny_model_path, tmp_path):
    trainer = GRPOTrainer(
        tiny_model_path, varied_reward, _config(tmp_path, num_iterations=2, max_steps=2), train_dataset=_dataset()
    )
    calls = []
    generate = trainer.backend.generate
    trainer.backend.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    trainer.train()
    assert len(calls) == 1  # one generation serves steps_per_generation × num_iterations = 2 micro-steps
    batch = trainer.buffer.micro_batches[0]
    assert batch["old_per_token_logps"].shape == batch["completion_ids"].shape
    # The second pass is off-policy: the clipped ratio is no longer identically 1.
    assert trainer.state.log_history[1]["loss"] != 0.0


def test_reward_sources_sync_async_model_and_none(tiny_model_path, tiny_reward_model_path, tmp_path):
    seen = {}

    def sync_reward(completions, solution, trainer_state, **kwargs):
        seen["solution"], seen["step"] = list(solution), trainer_state.global_step
        return [float(len(c)) for c in completions]

    async def async_reward(completions, **kwargs):
        await asyncio.sleep(0)
        return [1.0 if "a" in c else 0.0 for c in completions]

    def sometimes_none(completion_ids, **kwargs):
        return [None if i % 2 else 1.0 for i in range(len(completion_ids))]

    trainer = GRPOTrainer(
        tiny_model_path,
        [sync_reward, async_reward, tiny_reward_model_path, sometimes_none],
        _config(tmp_path, reward_weights=[1.0, 0.5, 0.1, 2.0], multi_objective_aggregation="normalize_then_sum"),
        train_dataset=_dataset(),
    )
    rm_name = os.path.basename(tiny_reward_model_path.rstrip("/"))
    assert trainer.reward_func_names == ["sync_reward", "async_reward", rm_name, "sometimes_none"]
    before = _trainable(trainer)
    trainer.train()
    assert _changed(trainer, before) > 0
    logs = _logs(trainer)
    for name in trainer.reward_func_names:
        assert f"rewards/{name}/mean" in logs
    assert logs["rewards/sometimes_none/mean"] == 1.0 and logs["rewards/sometimes_none/std"] == 0.0
    assert len(seen["solution"]) == 4 and seen["step"] == 0


def test_reward_funcs_by_registry_name(tiny_model_path, tmp_path):
    trainer = GRPOTrainer(tiny_model_path, "think_format_reward", _config(tmp_path), train_dataset=_dataset())
    assert trainer.reward_func_names == ["think_format_reward"]


def _fixed_rollout(prompts, trainer):
    """Deterministic completions that depend on the prompt and on the position in its group."""
    out = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "tag": []}
    for i, prompt in enumerate(prompts):
        ids = list(prompt.encode())
        body = [97 + (ids[-2] + i) % 5, 98 + i % 3, 99 + (i * 7) % 4][: 1 + (ids[-2] + i) % 3]
        completion = body + ([EOS] if i % 2 == 0 else [])
        out["prompt_ids"].append(ids)
        out["completion_ids"].append(completion)
        out["logprobs"].append([-1.0] * len(completion))
        out["tag"].append(f"t{i}")
    return out


def test_rollout_func_with_fixed_completions(tiny_model_path, tmp_path):
    tags = []

    def reward(completion_ids, tag, **kwargs):
        tags.extend(tag)
        return [float(len(ids) + (ids[0] % 3)) for ids in completion_ids]

    args = _config(tmp_path, mask_truncated_completions=True)
    trainer = GRPOTrainer(tiny_model_path, reward, args, train_dataset=_dataset(), rollout_func=_fixed_rollout)
    before = _trainable(trainer)
    trainer.train()
    assert _changed(trainer, before) > 0
    assert tags == ["t0", "t1", "t2", "t3"]
    assert _logs(trainer)["completions/clipped_ratio"] == 0.5
    batch = trainer.buffer.micro_batches[0]
    ended = batch["completion_ids"].eq(EOS).any(dim=1)
    assert torch.equal(batch["completion_mask"].sum(dim=1) > 0, ended)  # truncated completions are masked out


@pytest.mark.invariance
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_batch_times_grad_accum_invariance(tiny_model_path, tmp_path, loss_type):
    """Same generation batch (4 completions, 2 prompts), split as 4×1, 2×2 or 1×4: identical SGD update."""

    def reward(completion_ids, **kwargs):
        return [float(len(ids) + ids[0] % 3) for ids in completion_ids]

    results = []
    for b, ga in [(4, 1), (2, 2), (1, 4)]:
        args = _config(
            tmp_path / f"{b}x{ga}",
            per_device_train_batch_size=b,
            gradient_accumulation_steps=ga,
            loss_type=loss_type,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,
            lr_scheduler_type="constant",
        )
        trainer = GRPOTrainer(tiny_model_path, reward, args, train_dataset=_dataset(), rollout_func=_fixed_rollout)
        results.append(train_and_snapshot(trainer))
    assert_same_params(results)


def test_learns_a_cheap_reward(tiny_model_path, tmp_path):
    """reward = fraction of completion tokens equal to the byte "a": it rises from ~0 within a few dozen steps."""

    def fraction_of_a(completion_ids, **kwargs):
        return [sum(t == 97 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    args = _config(
        tmp_path,
        per_device_train_batch_size=32,
        num_generations=16,
        max_completion_length=4,
        max_steps=20,
        learning_rate=2e-2,
        seed=0,
    )
    trainer = GRPOTrainer(
        tiny_model_path, fraction_of_a, args, train_dataset=Dataset.from_list([{"prompt": "a:"}] * 8)
    )
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert len(rewards) == 20
    assert rewards[0] < 0.05  # a random tiny model samples "a" about once in 300 tokens
    assert sum(rewards[-5:]) / 5 > 0.5


def test_evaluate_with_num_generations_eval(tiny_model_path, tmp_path):
    args = _config(tmp_path, num_generations_eval=4, per_device_eval_batch_size=4, do_eval=True, eval_strategy="no")
    trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset(), eval_dataset=_dataset(2))
    seen = []
    generate = trainer.backend.generate
    trainer.backend.generate = lambda ids, sampling, n=1: seen.append((len(ids), n)) or generate(ids, sampling, n)
    metrics = trainer.evaluate()
    assert seen == [(1, 4), (1, 4)]  # two eval batches, each one prompt × num_generations_eval
    logged = trainer.state.log_history[-1]
    assert "eval_loss" in metrics and "eval_reward" in logged and "eval_entropy" in logged


def test_log_completions_writes_parquet(tiny_model_path, tmp_path, capsys):
    import pandas as pd

    def reward(completions, log_extra, log_metric, **kwargs):
        log_extra("length", [len(c) for c in completions])
        log_metric("my_metric", 3.0)
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(tiny_model_path, reward, _config(tmp_path, log_completions=True), train_dataset=_dataset())
    trainer.train()
    frame = pd.read_parquet(tmp_path / "completions" / "completions_00001.parquet")
    assert list(frame.columns) == ["step", "prompt", "completion", "reward", "length", "advantage"]
    assert len(frame) == 4 and (frame["step"] == 1).all()
    assert _logs(trainer)["my_metric"] == 3.0
    assert "Question" in capsys.readouterr().out  # the rich table was printed


def test_iterable_dataset_with_conversational_prompts(tiny_model_path, tmp_path):
    seen = []

    def reward(prompts, completions, **kwargs):
        seen.append((prompts[0], completions[0]))
        return varied_reward(**kwargs)

    rows = [{"prompt": [{"role": "user", "content": f"Question {i}?"}]} for i in range(8)]
    stream = Dataset.from_list(rows).to_iterable_dataset()
    trainer = GRPOTrainer(tiny_model_path, reward, _config(tmp_path, max_steps=2), train_dataset=stream)
    trainer.train()
    assert trainer.state.global_step == 2
    prompt, completion = seen[0]
    assert prompt[0]["role"] == "user" and completion[0]["role"] == "assistant"


def test_options_run_together(tiny_model_path, tmp_path):
    """IS correction on the posttrain sampler, off-policy mask, top-entropy tokens, bias-corrected KL, TR-DPO sync,
    entropy bonus, truncation masking, δ and ε_high, the transformers backend."""
    args = _config(
        tmp_path,
        max_steps=2,
        beta=0.05,
        use_bias_correction_kl=True,
        sync_ref_model=True,
        ref_model_sync_steps=1,
        rollout_importance_sampling=True,
        vllm_importance_sampling_mode="token_truncate",
        off_policy_mask_threshold=0.5,
        top_entropy_quantile=0.5,
        entropy_coef=0.01,
        epsilon_high=0.28,
        delta=2.0,
        generation_backend="transformers",
    )
    trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    ref_before = {n: p.clone() for n, p in trainer.reference.model.named_parameters()}
    before = _trainable(trainer)
    trainer.train()
    assert _changed(trainer, before) > 0
    assert any(not torch.equal(p, ref_before[n]) for n, p in trainer.reference.model.named_parameters())
    logs = _logs(trainer)
    for key in ("sampling/importance_sampling_ratio/mean", "sampling/sampling_logp_difference/max", "kl",
                "policy_loss", "entropy_coef"):  # fmt: skip
        assert key in logs, key
    assert logs["entropy_coef"] == 0.01


def test_adaptive_entropy_state_is_checkpointed_and_restored(tiny_model_path, tmp_path):
    args = _config(
        tmp_path,
        max_steps=2,
        use_adaptive_entropy=True,
        entropy_coef=0.1,
        entropy_coef_delta=0.05,
        entropy_target=100.0,  # always above the entropy: the coefficient grows every optimizer step
        save_strategy="steps",
        save_steps=1,
    )
    trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    trainer.train()
    assert trainer.entropy_ctrl.coef == pytest.approx(0.2)
    with open(tmp_path / "checkpoint-1" / ENTROPY_CTRL_STATE) as f:
        assert json.load(f)["entropy_coef"] == pytest.approx(0.15)
    resumed = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert resumed.entropy_ctrl.coef == pytest.approx(0.2)
    assert resumed.state.global_step == 2


@pytest.mark.invariance
def test_resume_mid_round_replays_the_buffer(tiny_model_path, tmp_path):
    """steps_per_generation = 2 × GA: a checkpoint after step 1 falls mid-round; the resumed run reuses the buffered
    completions and ends with the uninterrupted run's parameters."""
    args = _config(tmp_path / "full", per_device_train_batch_size=2, steps_per_generation=2, max_steps=2,
                   save_strategy="steps", save_steps=1, seed=3)  # fmt: skip
    full = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    full.train()
    expected = _trainable(full)

    resumed = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    calls = []
    generate = resumed.backend.generate
    resumed.backend.generate = lambda *a, **k: calls.append(1) or generate(*a, **k)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    assert calls == []  # the second half of the round came from the checkpointed buffer
    for name, value in expected.items():
        torch.testing.assert_close(dict(resumed.model.named_parameters())[name].detach(), value)


def test_config_and_constructor_errors(tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match=r"generation_batch_size \(6\) must be divisible by num_generations \(4\)"):
        _config(tmp_path, per_device_train_batch_size=6, num_generations=4)
    with pytest.raises(ValueError, match="can not be both configured"):
        _config(tmp_path, generation_batch_size=8, steps_per_generation=2)
    with pytest.raises(ValueError, match="GRPO requires at least 2 generations per prompt"):
        _config(tmp_path, num_generations=1)
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        _config(tmp_path, auto_find_batch_size=True)
    with pytest.raises(ValueError, match="generation_backend"):
        _config(tmp_path, generation_backend="vllm")
    with pytest.raises(ValueError, match="log_completions_hub_repo requires log_completions"):
        _config(tmp_path, log_completions_hub_repo="me/completions")
    assert _config(tmp_path, scale_rewards=False).scale_rewards == "none"
    with pytest.raises(
        ValueError, match=r"Number of reward weights \(1\) must match number of reward functions \(2\)"
    ):
        GRPOTrainer(tiny_model_path, [varied_reward, varied_reward], _config(tmp_path, reward_weights=[1.0]),
                    train_dataset=_dataset())  # fmt: skip
    with pytest.raises(ValueError, match="No reward source provided"):
        GRPOTrainer(tiny_model_path, None, _config(tmp_path), train_dataset=_dataset())
    with pytest.raises(ValueError, match="Tool .len. cannot be turned into a JSON schema"):
        GRPOTrainer(tiny_model_path, varied_reward, _config(tmp_path), train_dataset=_dataset(), tools=[len])
    with pytest.raises(ValueError, match="one generation round needs"):
        GRPOTrainer(tiny_model_path, varied_reward, _config(tmp_path, per_device_train_batch_size=8),
                    train_dataset=_dataset(2))  # fmt: skip
    with pytest.raises((ImportError, RuntimeError), match="CUDA GPU|vLLM"):
        GRPOTrainer(tiny_model_path, varied_reward, _config(tmp_path, use_vllm=True), train_dataset=_dataset())


def test_cast_lm_head_to_fp32(tiny_model_path, tiny_llama_path, tmp_path):
    args = _config(tmp_path, cast_lm_head_to_fp32=True)
    trainer = GRPOTrainer(tiny_llama_path, varied_reward, args, train_dataset=_dataset())
    assert trainer.model.lm_head.weight.dtype == torch.float32
    before = _trainable(trainer)
    trainer.train()
    assert _changed(trainer, before) > 0
    # qwen2 ties its embeddings: accepted as TRL does; the shared weight is float32, the embedding output keeps the
    # model's dtype (issue 18, item 8)
    args = _config(tmp_path, cast_lm_head_to_fp32=True, model_init_kwargs={"dtype": "bfloat16"})
    tied = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    inner = tied.model
    assert inner.get_input_embeddings().weight is inner.lm_head.weight
    assert inner.lm_head.weight.dtype == torch.float32
    ids = torch.tensor([[1, 2, 3]])
    assert inner.get_input_embeddings()(ids).dtype == torch.bfloat16
    assert inner(ids).logits.dtype == torch.float32
    before = _trainable(tied)
    tied.train()
    assert _changed(tied, before) > 0


def test_default_args_and_save_model(tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = GRPOTrainer(tiny_model_path, varied_reward, train_dataset=_dataset(8))
    assert trainer.args.output_dir.endswith(f"{os.path.basename(tiny_model_path.rstrip('/'))}-GRPO")
    assert trainer.args.learning_rate == 1e-6 and trainer.args.loss_type == "dapo"
    assert trainer.args.max_completion_length == 512 and trainer.args.num_generations == 8
    assert trainer.processing_class.padding_side == "left"
    trainer.save_model(str(tmp_path / "saved"))
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    saved = trainer.model.state_dict()
    assert reloaded.keys() == saved.keys() and all(torch.equal(reloaded[k], saved[k].cpu()) for k in saved)


def test_entropy_controller_updates_and_applies():
    from posttrain.trainers.grpo import EntropyController

    ctrl = EntropyController(coef=0.1, adaptive=True, coef_min=0.05, coef_max=0.2, delta=0.1, target=1.0)
    assert ctrl.effective_coef() == 0.0  # nothing measured yet
    ctrl.accumulate(3.0, 4.0)
    assert ctrl.window() == (3.0, 4.0)
    ctrl.update(0.75)  # below target: grow (capped at coef_max) and apply
    assert ctrl.coef == pytest.approx(0.2) and ctrl.effective_coef() == pytest.approx(0.2)
    assert ctrl.window() == (0.0, 0.0)
    ctrl.update(2.0)  # above target: shrink (floored at coef_min) and stop applying
    assert ctrl.coef == pytest.approx(0.1) and ctrl.effective_coef() == 0.0
    ctrl.update(float("nan"))  # no valid token this step: unchanged
    assert ctrl.coef == pytest.approx(0.1)
    restored = EntropyController(adaptive=True)
    restored.load_state_dict(ctrl.state_dict())
    assert restored.coef == pytest.approx(0.1) and restored.last_entropy == 2.0
    assert EntropyController(coef=0.3).effective_coef() == 0.3  # static coefficient: always applied


def test_command_line_parsing_of_dict_and_bool_fields(tmp_path):
    from transformers import HfArgumentParser

    (args,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--generation_kwargs",
            '{"do_sample": false}',
            "--scale_rewards",
            "false",
            "--reward_weights",
            "1",
            "2",
            "--report_to",
            "none",
        ]  # fmt: skip
    )
    assert args.generation_kwargs == {"do_sample": False} and args.scale_rewards == "none"
    assert args.reward_weights == [1.0, 2.0]
    assert args.use_bias_correction_kl is True  # TRL's default (seeds 001/003)
    (off,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--no_use_bias_correction_kl", "--report_to", "none"]
    )
    assert off.use_bias_correction_kl is False


def test_bias_corrected_kl_is_the_default_and_changes_the_gradient(tiny_model_path, tmp_path):
    """On-policy the importance ratio is 1 in value but not in gradient: the KL term's gradient gains kl·∇logπ."""
    assert GRPOConfig(output_dir=str(tmp_path)).use_bias_correction_kl is True
    grads = {}
    for corrected in (True, False):
        torch.manual_seed(0)
        args = _config(tmp_path, beta=0.5, learning_rate=0.0, max_grad_norm=None)
        if not corrected:
            args.use_bias_correction_kl = False
        trainer = GRPOTrainer(tiny_model_path, reward_funcs=varied_reward, args=args, train_dataset=_dataset())
        inputs = trainer._prepare_inputs([{"prompt": f"Question {i}:"} for i in range(2) for _ in range(2)])
        with torch.no_grad():  # a reference that differs from the policy, so the KL and its gradient are non-zero
            inputs["ref_per_token_logps"] = inputs["ref_per_token_logps"] - 0.3
        trainer.model.train()
        trainer.model.zero_grad()
        trainer._compute_loss(trainer.model, inputs).backward()
        grads[corrected] = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
    assert not torch.allclose(grads[True], grads[False], atol=1e-6)


@pytest.mark.invariance
def test_entropy_bonus_stays_chunked_with_the_full_logits_gradient(tiny_model_path, tmp_path, monkeypatch):
    """With an entropy bonus the loss forward stays on the chunked path, and (zero advantages, β = 0: the bonus is the
    whole loss) its gradient equals the one from full-vocabulary logits."""
    import posttrain.models.forward as forward

    trainer = GRPOTrainer(
        tiny_model_path, varied_reward, _config(tmp_path, entropy_coef=0.5, temperature=0.7), train_dataset=_dataset()
    )
    model = trainer.model.train()
    generator = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(0, 256, (4, 5), generator=generator),
        "prompt_mask": torch.tensor([[0, 0, 1, 1, 1]] * 2 + [[1] * 5] * 2),
        "completion_ids": torch.randint(0, 256, (4, 6), generator=generator),
        "completion_lengths": torch.tensor([6, 3, 5, 1]),
        "advantages": torch.zeros(4),
    }
    batch["completion_mask"] = (torch.arange(6).unsqueeze(0) < batch["completion_lengths"].unsqueeze(1)).long()
    batch["num_items_in_batch"] = batch["completion_mask"].sum()

    def bonus_grads() -> tuple[dict[str, torch.Tensor], bool]:
        model.zero_grad()
        trainer._compute_loss(model, batch).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return grads, trainer._token_stats(model, batch, compute_entropy=True, entropy_requires_grad=True).chunked

    chunked, on_chunked_path = bonus_grads()
    monkeypatch.setattr(forward, "_resolve_head", lambda inner: "forced full logits (test)")
    full, on_full_path = bonus_grads()
    assert on_chunked_path and not on_full_path
    assert chunked.keys() == full.keys() and any(g.abs().sum() > 0 for g in full.values())
    for name, grad in full.items():
        torch.testing.assert_close(chunked[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _hand_batch(advantages: torch.Tensor) -> dict:
    """A rollout micro-batch of 4 rows: random 5-token prompts, random completions of lengths 6, 3, 5, 1."""
    generator = torch.Generator().manual_seed(0)
    batch = {
        "prompt_ids": torch.randint(0, 256, (4, 5), generator=generator),
        "prompt_mask": torch.ones(4, 5, dtype=torch.long),
        "completion_ids": torch.randint(0, 256, (4, 6), generator=generator),
        "completion_lengths": torch.tensor([6, 3, 5, 1]),
        "advantages": advantages,
    }
    batch["completion_mask"] = (torch.arange(6).unsqueeze(0) < batch["completion_lengths"].unsqueeze(1)).long()
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    return batch


@pytest.mark.parametrize("loss_type", sorted(GRPO_LOSS_TYPES))
def test_entropy_bonus_is_a_plain_token_mean_for_every_loss_type(tiny_model_path, tmp_path, loss_type):
    """Zero advantages, β = 0: the loss is the bonus alone, −c · (token mean of H over the micro-batch) / GA for every
    ``loss_type`` (TRL 1.16: "always the mean per-token entropy regardless of loss_type") — not grpo's per-sequence
    mean over rows of unequal length, nor dapo's global token mean over the optimizer step."""
    trainer = GRPOTrainer(
        tiny_model_path, varied_reward,
        _config(tmp_path, entropy_coef=0.5, loss_type=loss_type, gradient_accumulation_steps=2),
        train_dataset=_dataset(),
    )  # fmt: skip
    model = trainer.model.train()
    batch = _hand_batch(advantages=torch.zeros(4))
    mask = batch["completion_mask"].float()
    batch["num_items_in_batch"] = mask.sum() * 3  # the other micro-batches of the step hold more tokens
    with torch.no_grad():
        loss = trainer._compute_loss(model, batch)
        entropies = trainer._token_stats(model, batch, compute_entropy=True).entropy
    assert trainer._grad_accum_divisor() == 2
    expected = -0.5 * (entropies * mask).sum() / mask.sum() / 2
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("loss_type", sorted(GRPO_LOSS_TYPES))
def test_entropy_bonus_on_hand_built_entropies(tiny_model_path, tmp_path, loss_type):
    """Hand-built entropies (row i holds the value i + 1, rows of 6, 3, 5, 1 tokens): the bonus after the GA divisor
    is −c · 31/15 / GA for every loss type; the loss type's aggregation would give grpo 2.5 (a per-sequence mean),
    dapo 31/45 (the step's token count) ... The logged `policy_loss` is not divided by GA (TRL)."""
    trainer = GRPOTrainer(
        tiny_model_path, varied_reward,
        _config(tmp_path, entropy_coef=0.5, loss_type=loss_type, gradient_accumulation_steps=2),
        train_dataset=_dataset(),
    )  # fmt: skip
    trainer.model.train()
    batch = _hand_batch(advantages=torch.zeros(4))
    mask = batch["completion_mask"].float()
    batch["num_items_in_batch"] = mask.sum() * 3
    entropies = torch.arange(1.0, 5.0).unsqueeze(1).expand(4, 6).clone()
    trainer._metrics["train"].clear()
    bonus = trainer._add_entropy_bonus(torch.tensor(0.25), entropies, mask, batch)
    loss = trainer._finish_loss(bonus, None, divide_by_grad_accum=trainer.divide_by_grad_accum)
    policy = 0.25 / 2 if trainer.divide_by_grad_accum else 0.25  # the policy term given, through the GA divisor
    torch.testing.assert_close(loss, torch.tensor(policy - 0.5 * 31 / 15 / 2))
    # `policy_loss` is the policy term as aggregated, before the GA divisor (TRL's `loss.detach()`)
    assert trainer._metrics["train"]["policy_loss"] == [pytest.approx(0.25)]


@pytest.mark.invariance
def test_custom_pair_behaves_as_its_preset(tiny_model_path, tmp_path):
    """loss_type=("vespo", "token_mean_global") is "vespo": the sampling IS ratio goes into VESPO's kernel (not onto
    the loss), the same hyper-parameters are read, the same GA rule applies — same loss on the same batch."""
    trainer = GRPOTrainer(
        tiny_model_path, varied_reward, _config(tmp_path, loss_type="vespo", vespo_k_pos=1.5), train_dataset=_dataset()
    )
    model = trainer.model.train()
    batch = _hand_batch(advantages=torch.tensor([1.0, -0.5, 0.25, -1.0]))
    batch["importance_sampling_ratio"] = 0.5 + torch.rand(4, 6, generator=torch.Generator().manual_seed(1))
    mask = batch["completion_mask"]
    with torch.no_grad():
        batch["old_per_token_logps"] = trainer._token_stats(model, batch).logps - 0.1 * mask
        losses = {}
        for loss_type in ("vespo", ("vespo", "token_mean_global"), ("clip", "token_mean_global")):
            trainer.args.loss_type = loss_type
            trainer._setup_loss()
            losses[str(loss_type)] = trainer._compute_loss(model, batch)
    torch.testing.assert_close(losses["('vespo', 'token_mean_global')"], losses["vespo"])
    assert not torch.allclose(losses["('clip', 'token_mean_global')"], losses["vespo"])  # the batch tells them apart


def test_objectives_read_existing_config_fields():
    """Every config field an objective declares is a GRPOConfig field (a typo there would fail only at the first step)."""
    names = {f.name for f in dataclasses.fields(GRPOConfig)}
    for objective_name in POLICY_OBJECTIVES:
        fields = objective_properties(POLICY_OBJECTIVES.get(objective_name)).config_fields
        assert fields and set(fields.values()) <= names, objective_name


def test_loss_type_typo_fails_in_the_config(tmp_path):
    with pytest.raises(ValueError, match="Valid loss types: .*dapo"):
        GRPOConfig(output_dir=str(tmp_path), loss_type="dapoo")


@pytest.mark.invariance
def test_shared_prompt_forward_trains_like_the_plain_forward(tiny_model_path, tmp_path, monkeypatch):
    """shared_prompt_forward (on by default) changes how the policy/reference forwards run, not the update."""
    import posttrain.models.completion_scoring as online

    taken = []
    original = online.shared_prompt_token_stats

    def spy(*args, **kwargs):
        stats = original(*args, **kwargs)
        taken.append(stats is not None)
        return stats

    monkeypatch.setattr(online, "shared_prompt_token_stats", spy)
    system = "You are a careful assistant. Answer the question that follows in a few words only. "
    dataset = Dataset.from_list([{"prompt": f"{system}Question {i}:", "solution": str(i)} for i in range(8)])
    results = []
    for share in (False, True):
        args = _config(
            tmp_path / str(share),
            shared_prompt_forward=share,
            num_generations=4,
            per_device_train_batch_size=8,
            beta=0.04,
            num_iterations=2,
            max_steps=2,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,
        )
        trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=dataset, rollout_func=_fixed_rollout)
        results.append(train_and_snapshot(trainer))
    assert taken and all(taken), "the shared layout must be used for policy, old and reference log-probs"
    assert_same_params(results, atol=2e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_clip_ratio_min_and_max_reduce_over_sequences(tiny_model_path, tmp_path, level):
    """TRL: *_mean over every token (sequence-level: every sequence), low_min / high_max over the per-sequence
    fractions — not the same value as the mean (issue 18, item 6)."""
    trainer = GRPOTrainer(tiny_model_path, reward_funcs=varied_reward, args=_config(tmp_path), train_dataset=_dataset())
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]])
    if level == "token":
        high = torch.tensor([[1.0, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0]])
        low = torch.tensor([[0.0, 0, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
        expected = {"low_mean": 4 / 10, "low_min": 0.0, "high_mean": 5 / 10, "high_max": 1.0, "region_mean": 8 / 10}
    else:
        high = torch.tensor([[1.0], [0.0], [0.0], [1.0]])
        low = torch.tensor([[0.0], [1.0], [0.0], [0.0]])
        expected = {"low_mean": 0.25, "low_min": 0.0, "high_mean": 0.5, "high_max": 1.0, "region_mean": 0.75}
    stats = {"is_low_clipped": low, "is_high_clipped": high, "is_region_clipped": torch.maximum(low, high)}
    trainer._metrics["train"].clear()
    trainer._record_policy_metrics(torch.ones(4, 4), mask, stats, "train")
    for name, value in expected.items():
        assert trainer._metrics["train"][f"clip_ratio/{name}"] == [pytest.approx(value)], name


def test_generation_kwargs_the_sampler_lacks_fall_back_to_transformers(tiny_model_path, tmp_path, caplog):
    """num_beams / length_penalty are model.generate options: generate with the transformers backend, say so in an
    info log, and train (issue 18, item 8)."""
    import logging

    from posttrain.generation.transformers_backend import TransformersBackend

    args = _config(tmp_path, generation_kwargs={"num_beams": 2, "length_penalty": 1.0}, max_completion_length=4)
    with caplog.at_level(logging.INFO):
        trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    assert isinstance(trainer.backend, TransformersBackend)
    assert "num_beams" in caplog.text and "transformers" in caplog.text
    trainer.train()
    assert math.isfinite(_logs(trainer)["loss"])


def test_reward_model_tokenizer_whose_pad_token_is_not_in_its_vocabulary(tiny_model_path, tmp_path):
    """TRL's different-reward-model recipe sets pad_token to a string the tiny tokenizer lacks (pad_token_id None):
    the reward tokenizer then pads with EOS, as TRL (was: '<' not supported between NoneType and int)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.models.tiny import save_tiny_model

    rm_path = save_tiny_model(tmp_path / "rm-llama", arch="llama", task="sequence-classification")
    reward_model = AutoModelForSequenceClassification.from_pretrained(rm_path)
    reward_tokenizer = AutoTokenizer.from_pretrained(rm_path)
    reward_tokenizer.pad_token = "<|finetune_right_pad_id|>"
    assert reward_tokenizer.pad_token_id is None
    trainer = GRPOTrainer(
        tiny_model_path, reward_model, _config(tmp_path), train_dataset=_dataset(),
        reward_processing_classes=reward_tokenizer,
    )  # fmt: skip
    trainer.train()
    assert reward_model.config.pad_token_id == reward_tokenizer.eos_token_id
    assert math.isfinite(_logs(trainer)["reward"])


@pytest.mark.slow
def test_off_policy_mask_measures_drift_from_the_rollout_funcs_logprobs(tiny_model_path, tmp_path):
    """TRL's off-policy sequence mask compares the policy with the generator's own log-probs whenever the generator
    returned them (a rollout_func's "logprobs", vLLM), not only under importance-sampling correction. The fixed
    completions claim log-prob −1 per token while the tiny model gives them ≈ −5.7, so every negative-advantage
    sequence is far off-policy and dropped; without generator log-probs π_old = π_θ and nothing is dropped."""

    def no_logprobs(prompts, trainer):
        return {**_fixed_rollout(prompts, trainer), "logprobs": None}

    def first_loss(rollout, **overrides):
        args = _config(tmp_path / str(len(overrides)) / rollout.__name__, **overrides)
        trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset(), rollout_func=rollout)
        trainer.train()
        return trainer.state.log_history[0]["loss"]

    plain = first_loss(no_logprobs)
    assert first_loss(no_logprobs, off_policy_mask_threshold=1.0) == pytest.approx(plain, abs=1e-7)
    assert first_loss(_fixed_rollout, off_policy_mask_threshold=1.0) != pytest.approx(plain, abs=1e-4)


def test_generation_batch_shuffle_draws_from_the_global_rng(tiny_model_path, tmp_path):
    """TRL shuffles the generation batch with ``torch.randperm`` on the global RNG before splitting it over the
    accumulation steps. The permutation decides which rows share a micro-batch (hence kl, clip_ratio/* and bnpo's
    loss with gradient_accumulation_steps=2) and the draw moves the RNG every later sample comes from: posttrain's
    dedicated generator made both differ from TRL's (issue 35 item 8b/8c)."""
    args = _config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    torch.manual_seed(123)
    trainer.buffer.fill({"completion_ids": torch.arange(8)[:, None], "num_items_in_batch": torch.tensor(8)})
    after_fill = torch.rand(3)
    torch.manual_seed(123)
    permutation = torch.randperm(8)
    served = torch.cat([mb["completion_ids"][:, 0] for mb in trainer.buffer.micro_batches])
    assert torch.equal(served, permutation)
    assert torch.equal(after_fill, torch.rand(3))  # the shuffle consumed the global RNG as TRL's does


@pytest.mark.parametrize(("grad_accum", "steps_per_generation", "expected"), [(1, 2, 3 / 5), (2, 2, 3 / 10)])
def test_global_token_mean_divides_by_one_optimizer_steps_share(
    tiny_model_path, tmp_path, grad_accum, steps_per_generation, expected
):
    """dapo/cispo/vespo: ``num_items_in_batch`` counts the whole generation batch; when it spans more optimizer steps
    than one (steps_per_generation > gradient_accumulation_steps), one step's loss divides by its share,
    ``num_items_in_batch · GA / steps_per_generation`` (TRL). posttrain halved the loss and gradient of
    grpo/steps_per_generation_2."""
    args = _config(
        tmp_path, per_device_train_batch_size=2, loss_type="dapo", gradient_accumulation_steps=grad_accum,
        steps_per_generation=steps_per_generation,
    )  # fmt: skip
    trainer = GRPOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
    trainer.model.train()
    per_token, mask = torch.ones(2, 4), torch.tensor([[1.0, 1, 0, 0], [1, 0, 0, 0]])
    loss = trainer._aggregate(per_token, mask, {"num_items_in_batch": torch.tensor(10.0)})
    assert loss.item() == pytest.approx(expected)
    trainer.model.eval()  # evaluation neither splits nor accumulates its batch
    assert trainer._aggregate(per_token, mask, {"num_items_in_batch": torch.tensor(10.0)}).item() == pytest.approx(0.3)
