"""The subclassing hooks TRL's documentation and examples use (issue 35, item 6): the DPO customization guide's
subclass (``self.beta``, ``self.ref_model``, the batch layout), TRL's config-copied attributes on each trainer,
GRPO/RLOO's ``self._logs`` (where ``log_extra`` values land) and the ``_generate(prompts)`` override that TRL's
rollout dispatch calls."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward as _reward
from test_epoch_remainder import CASES
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, KTOConfig, KTOTrainer, RLOOConfig, RLOOTrainer
from posttrain.trainer.utils import selective_log_softmax


class GuideDPOTrainer(DPOTrainer):
    """The subclass of TRL's DPO guide ("Change the training objective"), verbatim apart from the recording."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # In this example: the hinge loss from https://huggingface.co/papers/2309.06657
        input_ids, attention_mask = inputs["input_ids"], inputs["attention_mask"]
        shift_labels, shift_completion_mask = input_ids[:, 1:], inputs["completion_mask"][:, 1:]
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        with torch.no_grad():
            ref_logits = self.ref_model(input_ids=input_ids, attention_mask=attention_mask).logits

        # Sum the log-probs over the completion tokens, for the policy and for the reference model
        logps = (selective_log_softmax(logits[:, :-1], shift_labels) * shift_completion_mask).sum(dim=1)
        ref_logps = (selective_log_softmax(ref_logits[:, :-1], shift_labels) * shift_completion_mask).sum(dim=1)

        chosen_logps, rejected_logps = logps.chunk(2, dim=0)  # batch is [chosen, rejected]
        ref_chosen_logps, ref_rejected_logps = ref_logps.chunk(2, dim=0)
        delta = (chosen_logps - ref_chosen_logps) - (rejected_logps - ref_rejected_logps)
        self.seen = getattr(self, "seen", []) + [(self.beta, input_ids.shape[0])]
        return torch.relu(1 - self.beta * delta).mean()


def test_dpo_customization_guide_subclass(tiny_model_path, tmp_path):
    pairs = CASES["dpo"][2]()
    args = fast_config(DPOConfig, tmp_path, per_device_train_batch_size=2, max_steps=2, beta=0.25)
    trainer = GuideDPOTrainer(tiny_model_path, args=args, train_dataset=pairs)
    trainer.train()
    # self.beta is the config's; the batch holds the 2 chosen rows, then the 2 rejected ones
    assert trainer.seen == [(0.25, 4), (0.25, 4)]
    assert all("loss" in entry for entry in trainer.state.log_history[:2])
    # before any update the hinge loss is exactly 1 (policy == reference), as the guide's formula says
    fresh = GuideDPOTrainer(
        tiny_model_path, args=fast_config(DPOConfig, tmp_path / "b", beta=0.25), train_dataset=pairs
    )
    batch = fresh._prepare_inputs(fresh.data_collator([fresh.train_dataset[i] for i in range(2)]))
    fresh.model.eval()
    assert fresh.compute_loss(fresh.model, batch).item() == pytest.approx(1.0, abs=1e-5)


def test_dpo_attributes_read_and_write_the_config(tiny_model_path, tmp_path):
    args = fast_config(DPOConfig, tmp_path, beta=0.3, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5],
                       label_smoothing=0.1)  # fmt: skip
    trainer = DPOTrainer(tiny_model_path, args=args, train_dataset=CASES["dpo"][2]())
    assert (trainer.beta, trainer.label_smoothing, trainer.ld_alpha) == (0.3, 0.1, None)
    assert trainer.loss_types == ["sigmoid", "sft"] and trainer.loss_weights == [1.0, 0.5]
    assert trainer.precompute_ref_logps is False and trainer.use_weighting is False
    assert trainer.router_aux_loss_coef == 0.0  # a dense model: its config has no coefficient
    assert trainer.f_divergence_type == args.f_divergence_type
    trainer.beta = 0.7  # a subclass changing it changes what the loss reads
    assert trainer.args.beta == 0.7 and trainer.beta == 0.7
    assert trainer.processing_class is not None and trainer.accelerator is not None
    assert isinstance(trainer.ref_model, torch.nn.Module)


def test_kto_attributes(tiny_model_path, tmp_path):
    args = fast_config(KTOConfig, tmp_path, beta=0.2, desirable_weight=1.5, per_device_train_batch_size=2)
    trainer = KTOTrainer(tiny_model_path, args=args, train_dataset=CASES["kto"][2]())
    assert (trainer.beta, trainer.loss_type, trainer.desirable_weight, trainer.undesirable_weight) == (
        0.2, "kto", 1.5, 1.0,
    )  # fmt: skip
    assert trainer.calculate_KL is True and trainer.precompute_ref_logps is False
    with pytest.raises(AttributeError, match="args.loss_type"):
        trainer.calculate_KL = False  # derived: set loss_type instead


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_online_attributes(kind, tiny_model_path, tmp_path):
    config_class, trainer_class, data, extra = CASES[kind]
    args = fast_config(config_class, tmp_path, per_device_train_batch_size=4, max_steps=1, beta=0.04, epsilon=0.3,
                       reward_weights=[2.0], temperature=0.7, **extra)  # fmt: skip
    trainer = trainer_class(tiny_model_path, reward_funcs=_reward, args=args, train_dataset=data())
    assert (trainer.beta, trainer.epsilon_low, trainer.epsilon_high, trainer.temperature) == (0.04, 0.3, 0.3, 0.7)
    assert (trainer.num_generations, trainer.num_iterations, trainer.max_completion_length) == (2, 1, 4)
    assert torch.equal(trainer.reward_weights, torch.tensor([2.0]))
    assert trainer.eos_token_ids == [trainer.processing_class.eos_token_id]
    assert trainer.reward_funcs == [_reward] and trainer.chat_template_kwargs == {}
    assert isinstance(trainer.ref_model, torch.nn.Module)
    if kind == "grpo":
        assert (trainer.loss_type, trainer.importance_sampling_level, trainer.scale_rewards) == (
            args.loss_type, "token", "group",
        )  # fmt: skip
    else:
        assert trainer.normalize_advantages is args.normalize_advantages


def _logging_reward(completions, log_extra=None, **kwargs):
    log_extra("length", [len(c) for c in completions])
    return [float(len(c) % 3) for c in completions]


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_log_extra_values_land_in_self_logs(kind, tiny_model_path, tmp_path):
    config_class, trainer_class, data, extra = CASES[kind]
    args = fast_config(config_class, tmp_path, per_device_train_batch_size=4, max_steps=1, **extra)
    trainer = trainer_class(tiny_model_path, reward_funcs=_logging_reward, args=args, train_dataset=data())
    trainer.train()
    logs = trainer._logs
    n = args.generation_batch_size
    assert len(logs["prompt"]) == len(logs["completion"]) == len(logs["advantages"]) == n
    assert list(logs["rewards"]) == ["_logging_reward"] and len(logs["rewards"]["_logging_reward"]) == n
    completions = list(logs["completion"])
    assert list(logs["extra"]["length"]) == [len(c) for c in completions]
    assert list(logs["rewards"]["_logging_reward"]) == [float(len(c) % 3) for c in completions]
    assert all(isinstance(p, str) and p.startswith("Q") for p in logs["prompt"])


FIXED = [7, 8, 9]


class FixedGRPO(GRPOTrainer):
    def _generate(self, prompts):
        self.calls = getattr(self, "calls", 0) + 1
        prompt_ids = [self.processing_class(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completion_ids = [list(FIXED) for _ in prompts]
        completions = self.processing_class.batch_decode(completion_ids, skip_special_tokens=True)
        return prompt_ids, completion_ids, None, completions, None, {}, None, []


class FixedRLOO(RLOOTrainer):
    def _generate(self, prompts):
        self.calls = getattr(self, "calls", 0) + 1
        prompt_ids = [self.processing_class(p, add_special_tokens=False)["input_ids"] for p in prompts]
        completion_ids = [list(FIXED) for _ in prompts]
        return prompt_ids, completion_ids, self.processing_class.batch_decode(completion_ids)


class WrappingGRPO(GRPOTrainer):
    """A subclass that post-processes posttrain's own generation (``super()._generate``)."""

    def _generate(self, prompts):
        prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images = super()._generate(
            prompts
        )
        self.generated = [list(ids) for ids in completion_ids]
        extra = {**extra, "tag": ["wrapped"] * len(prompts)}
        return prompt_ids, completion_ids, tool_mask, completions, logprobs, extra, images, tool_images


@pytest.mark.parametrize("trainer_class", [FixedGRPO, FixedRLOO])
def test_generate_override_is_used_for_generation(trainer_class, tiny_model_path, tmp_path):
    seen = []

    def record(completion_ids, **kwargs):
        seen.extend(completion_ids)
        return [1.0] * len(completion_ids)

    config_class = GRPOConfig if trainer_class is FixedGRPO else RLOOConfig
    args = fast_config(config_class, tmp_path, per_device_train_batch_size=4, per_device_eval_batch_size=4,
                       max_steps=1, num_generations=2, max_completion_length=4)  # fmt: skip
    prompts = Dataset.from_list([{"prompt": f"Q{i}:"} for i in range(4)])
    trainer = trainer_class(tiny_model_path, reward_funcs=record, args=args, train_dataset=prompts,
                            eval_dataset=prompts)  # fmt: skip
    trainer.train()
    assert trainer.calls == 1 and seen and all(ids == FIXED for ids in seen)
    trainer.evaluate()
    assert trainer.calls == 3  # 8 eval rows in 2 batches of 4: one generation per batch
    assert list(trainer._logs["completion"])[0] == trainer.processing_class.decode(FIXED, skip_special_tokens=True)


def test_generate_override_can_wrap_posttrain_generation(tiny_model_path, tmp_path):
    tags = []

    def record(completion_ids, **kwargs):
        tags.extend(kwargs["tag"])
        return [float(len(ids)) for ids in completion_ids]

    args = fast_config(GRPOConfig, tmp_path, per_device_train_batch_size=4, max_steps=1, num_generations=2,
                       max_completion_length=4)  # fmt: skip
    trainer = WrappingGRPO(tiny_model_path, reward_funcs=record, args=args, train_dataset=CASES["grpo"][2]())
    trainer.train()
    assert tags == ["wrapped"] * 4  # extra_fields reach the reward functions as per-row kwargs
    assert len(trainer.generated) == 4 and all(1 <= len(ids) <= 4 for ids in trainer.generated)


def test_generate_override_with_a_wrong_return_is_named(tiny_model_path, tmp_path):
    class Broken(GRPOTrainer):
        def _generate(self, prompts):
            return [[1]] * len(prompts), [[2]] * len(prompts)

    args = fast_config(GRPOConfig, tmp_path, per_device_train_batch_size=4, max_steps=1, num_generations=2,
                       max_completion_length=4)  # fmt: skip
    trainer = Broken(tiny_model_path, reward_funcs=_reward, args=args, train_dataset=CASES["grpo"][2]())
    with pytest.raises(ValueError, match=r"Broken._generate must return TRL's tuple"):
        trainer.train()


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_default_generate_returns_trls_tuple(kind, tiny_model_path, tmp_path):
    config_class, trainer_class, data, extra = CASES[kind]
    args = fast_config(config_class, tmp_path, per_device_train_batch_size=4, max_steps=1, **extra)
    trainer = trainer_class(tiny_model_path, reward_funcs=_reward, args=args, train_dataset=data())
    prompts = ["Q0:", "Q0:", "Q1:", "Q1:"]  # as the sampler lays them out: each prompt once per completion
    output = trainer._generate(prompts)
    expected_length = 8 if kind == "grpo" else 3
    assert isinstance(output, tuple) and len(output) == expected_length
    prompt_ids, completion_ids = output[0], output[1]
    completions = output[3] if kind == "grpo" else output[2]
    tok = trainer.processing_class
    assert prompt_ids == [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    assert len(completion_ids) == 4 and all(1 <= len(ids) <= 4 for ids in completion_ids)
    assert completions == tok.batch_decode(completion_ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["dpo", "kto"])
def test_compute_ref_log_probs_equals_the_precomputed_columns(kind, tiny_model_path, tmp_path):
    config_class, trainer_class, data, extra = CASES[kind]
    rows = data().select(range(4))
    on_the_fly = trainer_class(tiny_model_path, args=fast_config(config_class, tmp_path / "a"), train_dataset=rows)
    batch = on_the_fly.data_collator([on_the_fly.train_dataset[i] for i in range(4)])
    first, second = on_the_fly.compute_ref_log_probs(on_the_fly.ref_model, batch)
    args = fast_config(config_class, tmp_path / "b", precompute_ref_log_probs=True, precompute_ref_batch_size=4)
    precomputed = trainer_class(tiny_model_path, args=args, train_dataset=rows).train_dataset
    columns = ("ref_chosen_logps", "ref_rejected_logps") if kind == "dpo" else ("ref_logps", "ref_KL_logps")
    assert first.tolist() == pytest.approx(precomputed[columns[0]], abs=1e-4)
    assert second.tolist() == pytest.approx(precomputed[columns[1]], abs=1e-4)
