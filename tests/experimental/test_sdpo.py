"""SDPOTrainer (posttrain.experimental.sdpo): TRL's config fields/defaults and errors, the successful-rollout
teacher-context builder on fixed groups, the combined loss on a fixed rollout against hand-computed numbers (and the
logit modes against a naive full-logits computation), end to end on the tiny model, the EMA teacher, the
diagnostics warnings, the seed's example, and (slow) learning a cheap verifiable reward."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from datasets import Dataset
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.experimental.sdpo import SDPOConfig, SDPOTrainer, SuccessfulRolloutTeacherContextBuilder
from posttrain.models.forward import TokenStats

# TRL 1.16's SDPOConfig(output_dir=...) values of the SDPO-specific and differing fields.
TRL_DEFAULTS = {
    "learning_rate": 5e-5,
    "disable_dropout": True,
    "max_prompt_length": 512,
    "max_completion_length": 256,
    "num_generations": 8,
    "loss_type": "dapo",
    "beta": 0.0,
    "epsilon": 0.2,
    "epsilon_high": 0.2,
    "importance_sampling_level": "token",
    "scale_rewards": "group",
    "use_teacher_server": False,
    "distillation_alpha": 1.0,
    "distillation_mode": "sampled_token",
    "distillation_topk": None,
    "distillation_is_clip": 2.0,
    "distillation_add_tail": False,
    "distillation_weight": 1.0,
    "teacher_model_kind": "ema",
    "teacher_update_rate": 0.05,
    "teacher_sync_steps": 1,
    "max_reprompt_len": 10240,
    "use_successful_as_teacher": True,
    "success_reward_threshold": 1.0,
    "dont_reprompt_on_self_success": True,
    "reprompt_template": "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n",
    "solution_template": "\nCorrect solution:\n\n{successful_previous_attempt}\n\n",
    "feedback_template": "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n",
    "include_environment_feedback": False,
    "environment_feedback_only_without_solution": False,
    "remove_thinking_from_demonstration": False,
    "diagnostics_warning_interval": 10,
    "diagnostics_flat_tolerance": 1e-8,
    "generation_batch_size": 8,
    "steps_per_generation": 1,
    "gradient_checkpointing": True,
    "logging_steps": 10,
    "remove_unused_columns": False,
}


def has_a(completion_ids, **kwargs):
    """1.0 when the completion contains the byte "a" (a verifiable, sparse success signal)."""
    return [1.0 if 97 in ids else 0.0 for ids in completion_ids]


def even_sum(completion_ids, **kwargs):
    """1.0 when the completion's token ids sum to an even number: about half the rollouts succeed."""
    return [1.0 if sum(ids) % 2 == 0 else 0.0 for ids in completion_ids]


def _config(tmp_path, **kw) -> SDPOConfig:
    values = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=6, max_steps=2,
                  learning_rate=1e-2, shuffle_dataset=False)  # fmt: skip
    return fast_config(SDPOConfig, tmp_path, **{**values, **kw})


# -- config ----------------------------------------------------------------------------------------------------


def test_config_has_trls_defaults(tmp_path):
    config = SDPOConfig(output_dir=str(tmp_path), report_to="none")
    for name, value in TRL_DEFAULTS.items():
        assert getattr(config, name) == value, name


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(distillation_weight=1.5), "distillation_weight"),
        (dict(distillation_weight=-0.1), "distillation_weight"),
        (dict(distillation_alpha=0.5), "sampled_token.*distillation_alpha=1.0"),
        (dict(distillation_mode="topk_logits"), "distillation_topk"),
        (dict(distillation_mode="kl"), "distillation_mode"),
        (dict(distillation_mode="full_logits", distillation_alpha=1.5), "distillation_alpha"),
        (dict(distillation_is_clip=0.0), "distillation_is_clip"),
        (dict(teacher_model_kind="frozen"), "teacher_model_kind"),
        (dict(teacher_update_rate=1.5), "teacher_update_rate"),
        (dict(teacher_sync_steps=0), "teacher_sync_steps"),
        (dict(max_reprompt_len=0), "max_reprompt_len"),
        (dict(diagnostics_warning_interval=-1), "diagnostics_warning_interval"),
        (dict(use_teacher_server=True), "requires `use_vllm=True` and `vllm_mode='server'`"),
        (dict(use_teacher_server=True, use_vllm=True, vllm_mode="server"), "teacher_model_kind='live'"),
        (dict(use_teacher_server=True, use_vllm=True, vllm_mode="server", teacher_model_kind="live",
              distillation_weight=0.5), "distillation_weight=1.0"),  # fmt: skip
        (dict(use_teacher_server=True, use_vllm=True, vllm_mode="server", teacher_model_kind="live",
              distillation_mode="full_logits"), "full_logits"),  # fmt: skip
        (dict(reprompt_template="{question}{solution}"), r"reprompt_template.*\{prompt\}"),
        (dict(solution_template="{demo}"), "solution_template"),
        (dict(feedback_template="{feedback"), "feedback_template"),
        (dict(loss_type="nope"), "loss_type"),
    ],
)
def test_config_errors(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        SDPOConfig(output_dir=str(tmp_path), report_to="none", **overrides)


def test_config_warns_on_ignored_options(tmp_path):
    with pytest.warns(UserWarning, match="distillation_topk"):
        SDPOConfig(output_dir=str(tmp_path), report_to="none", distillation_topk=5)
    with pytest.warns(UserWarning, match="beta=0.1 only enters the policy term"):
        SDPOConfig(output_dir=str(tmp_path), report_to="none", beta=0.1)
    config = SDPOConfig(
        output_dir=str(tmp_path), report_to="none", distillation_mode="topk_logits", distillation_topk=5,
        distillation_alpha=0.5,
    )  # fmt: skip
    assert config.distillation_topk == 5


# -- the teacher-context builder ----------------------------------------------------------------------------------


def _builder(tmp_path, **kw) -> SuccessfulRolloutTeacherContextBuilder:
    return SuccessfulRolloutTeacherContextBuilder(SDPOConfig(output_dir=str(tmp_path), report_to="none", **kw))


SOLUTION = "\nCorrect solution:\n\n{}\n\n"
TAIL = "\n\nCorrectly solve the original question.\n"


def test_builder_picks_first_other_success_of_the_group(tmp_path):
    # two groups of 3: group 0 has successes at rows 1 and 2, group 1 has none (one NaN = unscorable)
    prompts = ["P0"] * 3 + ["P1"] * 3
    rewards = torch.tensor([0.0, 1.0, 1.5, 0.9, float("nan"), 0.0])
    completions = ["c0", "c1", "c2", "c3", "c4", "c5"]
    out = _builder(tmp_path).build(prompts, rewards, completions, 3)
    assert out.self_distillation_mask.tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert out.demonstration_indices == [1, 2, 1, None, None, None]  # never itself (dont_reprompt_on_self_success)
    assert out.teacher_prompts == [
        "P0" + SOLUTION.format("c1") + TAIL,
        "P0" + SOLUTION.format("c2") + TAIL,
        "P0" + SOLUTION.format("c1") + TAIL,
        "P1",
        "P1",
        "P1",
    ]
    assert out.metrics == {
        "self_distillation/success_group_fraction": 0.5,
        "self_distillation/success_sample_fraction": 0.5,
        "self_distillation/feedback_available_fraction": 0.0,
        "self_distillation/feedback_used_fraction": 0.0,
        "self_distillation/reprompt_sample_fraction": 0.5,
    }


def test_builder_self_success_threshold_and_local_slice(tmp_path):
    prompts, completions = ["P"] * 2, ["<think>hm</think> x", "y"]
    rewards = torch.tensor([0.5, 0.2])
    builder = _builder(tmp_path, dont_reprompt_on_self_success=False, success_reward_threshold=0.5,
                       remove_thinking_from_demonstration=True)  # fmt: skip
    out = builder.build(prompts, rewards, completions, 2, local=slice(1, 2))
    # row 0 is a success; with self-reprompting allowed it demonstrates for both rows; only row 1 is local
    assert out.self_distillation_mask.tolist() == [1.0]
    assert out.demonstration_indices == [0]
    assert out.teacher_prompts == ["P" + SOLUTION.format("x") + TAIL]  # the <think> block is removed
    assert builder.last_metrics["self_distillation/reprompt_sample_fraction"] == 1.0
    off = _builder(tmp_path, use_successful_as_teacher=False).build(prompts, torch.tensor([1.0, 1.0]), completions, 2)
    assert off.self_distillation_mask.tolist() == [0.0, 0.0]
    assert off.metrics["self_distillation/success_group_fraction"] == 1.0  # counted regardless (TRL)


def test_builder_feedback_and_conversational_prompts(tmp_path):
    system = {"role": "system", "content": "Be brief."}
    prompt = [system, {"role": "user", "content": [{"type": "text", "text": "Add"}, {"type": "text", "text": "1+1"}]}]
    prompts = [prompt] * 2
    rewards = torch.tensor([1.0, 0.0])
    feedbacks = ["wrong: got 3", "   "]
    feedback = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{}\n\n"
    out = _builder(tmp_path, include_environment_feedback=True).build(
        prompts, rewards, ["2", "3"], 2, feedbacks=feedbacks
    )
    # row 0: its own success is not a demonstration, but it has feedback; row 1: demonstration, blank feedback
    assert out.self_distillation_mask.tolist() == [1.0, 1.0]
    assert out.teacher_prompts[0] == [system, {"role": "user", "content": "Add 1+1" + feedback.format("wrong: got 3") + TAIL}]
    assert out.teacher_prompts[1] == [system, {"role": "user", "content": "Add 1+1" + SOLUTION.format("2") + TAIL}]
    assert out.metrics["self_distillation/feedback_available_fraction"] == 0.5
    assert out.metrics["self_distillation/feedback_used_fraction"] == 0.5
    only = _builder(tmp_path, include_environment_feedback=True, environment_feedback_only_without_solution=True)
    both = only.build(prompts, rewards, ["2", "3"], 2, feedbacks=["f0", "f1"])
    assert both.teacher_prompts[1][-1]["content"] == "Add 1+1" + SOLUTION.format("2") + TAIL  # has a solution
    assert both.teacher_prompts[0][-1]["content"] == "Add 1+1" + feedback.format("f0") + TAIL
    with pytest.raises(ValueError, match="end with a user turn"):
        _builder(tmp_path).build([[{"role": "assistant", "content": "x"}]] * 2, rewards, ["a", "b"], 2)


def test_builder_warns_when_feedback_is_ignored(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="posttrain.experimental.sdpo.teacher_context"):
        out = _builder(tmp_path).build(["P", "P"], torch.tensor([0.0, 0.0]), ["a", "b"], 2, feedbacks=["f", None])
    assert out.self_distillation_mask.tolist() == [0.0, 0.0]
    assert "include_environment_feedback=False" in caplog.text


# -- the loss on a fixed rollout ----------------------------------------------------------------------------------


def _fixed_rollout() -> dict:
    """Two rows of two completion tokens (row 1 has one); row 0 has a teacher, row 1 not."""
    return {
        "prompt_ids": torch.tensor([[5, 6], [5, 6]]),
        "prompt_mask": torch.ones(2, 2, dtype=torch.long),
        "completion_ids": torch.tensor([[10, 11], [12, 0]]),
        "completion_mask": torch.tensor([[1, 1], [1, 0]]),
        "completion_lengths": torch.tensor([2, 1]),
        "advantages": torch.tensor([1.0, -1.0]),
        "old_per_token_logps": torch.tensor([[-1.1, -2.0], [-0.5, 0.0]]),
        "teacher_prompt_ids": torch.tensor([[0, 7, 7], [0, 5, 6]]),
        "teacher_prompt_mask": torch.tensor([[0, 1, 1], [0, 1, 1]]),
        "self_distillation_mask": torch.tensor([1.0, 0.0]),
        "num_items_in_batch": torch.tensor(3),
    }


def test_combined_loss_equals_hand_computed_values(tmp_path, tiny_model_path):
    """w = 0.25, loss_type "grpo", ε = 0.2, IS clip 1.5, with the student/teacher log-probs fixed:

    student s = [[-1, -2], [-0.5, ·]], π_old o = [[-1.1, -2], [-0.5, ·]] → ratios [[e^0.1, 1], [1, ·]]
    policy: row 0 (A=+1) −(e^0.1 + 1)/2 = −1.052585, row 1 (A=−1) +1 → mean −0.0262925
    teacher (row 0 only) t = [-0.5, -2.5]: sg(s − t)·s = [0.5, −1.0], × clipped ratio [e^0.1, 1] → [0.552585, −1]
    distillation: row 0 mean −0.2237075, row 1 (no teacher) 0 → mean −0.11185375
    loss = 0.75·(−0.0262925) + 0.25·(−0.11185375) = −0.0476828125
    """
    args = _config(tmp_path, num_generations=2, per_device_train_batch_size=2, loss_type="grpo",
                   distillation_weight=0.25, distillation_is_clip=1.5, teacher_model_kind="live")  # fmt: skip
    trainer = SDPOTrainer(tiny_model_path, has_a, args, train_dataset=Dataset.from_list([{"prompt": "Q:"}] * 2))
    student = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]], requires_grad=True)
    teacher_rows = []

    def fake_token_stats(model, batch, compute_entropy=False, entropy_requires_grad=False):
        if batch["prompt_ids"].tolist() == [[7, 7]]:  # the teacher pass: row 0's re-prompt only
            teacher_rows.append(batch["completion_ids"].tolist())
            return TokenStats(logps=torch.tensor([[-0.5, -2.5]]), mask=torch.ones(1, 2, dtype=torch.bool))
        return TokenStats(logps=student, mask=batch["completion_mask"].bool(), entropy=torch.zeros(2, 2))

    trainer._token_stats = fake_token_stats
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, _fixed_rollout())
    assert teacher_rows == [[[10, 11]]]
    assert loss.item() == pytest.approx(-0.0476828125, abs=1e-6)
    loss.backward()
    e = math.exp(0.1)
    # d/ds: policy −r·A/2/2·0.75 (unclipped tokens) + distillation (s − t)·ρ/2/2·0.25 (row 0 only)
    expected = torch.tensor([[-e * 0.1875 - 0.5 * e * 0.0625, -0.1875 + 0.5 * 0.0625], [0.375, 0.0]])
    torch.testing.assert_close(student.grad, expected, atol=1e-6, rtol=0)
    logs = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    assert logs["self_distillation/policy_loss"] == pytest.approx(-0.0262925, abs=1e-6)
    assert logs["self_distillation/distillation_loss"] == pytest.approx(-0.2237075, abs=1e-6)
    assert logs["sdpo/distillation_loss"] == logs["self_distillation/distillation_loss"]

    trainer.args.distillation_weight = 1.0  # pure distillation: the policy term is not computed
    trainer._metrics["train"].clear()
    assert trainer._compute_loss(trainer.model, _fixed_rollout()).item() == pytest.approx(-0.11185375, abs=1e-6)
    assert "self_distillation/policy_loss" not in trainer._metrics["train"]
    no_teacher = {**_fixed_rollout(), "self_distillation_mask": torch.zeros(2)}
    zero = trainer._compute_loss(trainer.model, no_teacher)
    assert zero.item() == 0.0 and zero.requires_grad  # still attached to the graph (zero gradients)


def _naive_completion_logits(model, prompt_ids, prompt_mask, completion_ids, lengths, temperature):
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    generated = (torch.arange(completion_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)).long()
    mask = torch.cat([prompt_mask, generated], dim=1)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
    return logits[:, prompt_ids.shape[1] - 1 : -1] / temperature  # (B, C, V) predicting the completion tokens


@pytest.mark.parametrize("mode", ["full_logits", "topk_logits"])
def test_logit_modes_match_a_naive_full_logits_computation(tmp_path, tiny_model_path, mode):
    """Student on [prompt | completion], teacher (the frozen initial copy) on [re-prompt | completion]: the per-token
    divergence at the loss tokens written out by hand (JSD α = 0.5 for full, reverse KL over the renormalised
    student top-3 for topk), averaged per row then over rows."""
    extra = dict(distillation_topk=3, distillation_alpha=1.0) if mode == "topk_logits" else dict(distillation_alpha=0.5)
    args = _config(tmp_path, num_generations=2, per_device_train_batch_size=2, distillation_mode=mode,
                   teacher_model_kind="base", temperature=0.7, distillation_is_clip=None, **extra)  # fmt: skip
    trainer = SDPOTrainer(tiny_model_path, has_a, args, train_dataset=Dataset.from_list([{"prompt": "Q:"}] * 2))
    # full: only row 1 has a teacher (row selection); topk: both, with a masked-out token (e.g. a tool result) in row 0
    sd = [0.0, 1.0] if mode == "full_logits" else [1.0, 1.0]
    batch = {**_fixed_rollout(), "self_distillation_mask": torch.tensor(sd)}
    batch["completion_mask"] = torch.tensor([[1, 0], [1, 0]] if mode == "topk_logits" else [[1, 1], [1, 0]])
    batch["teacher_prompt_ids"] = torch.tensor([[0, 7, 7], [8, 9, 10]])  # row 1 re-prompted too, unpadded
    batch["teacher_prompt_mask"] = torch.tensor([[0, 1, 1], [1, 1, 1]])
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, batch)
        s = _naive_completion_logits(trainer.model, batch["prompt_ids"], batch["prompt_mask"],
                                     batch["completion_ids"], batch["completion_lengths"], 0.7)  # fmt: skip
        t = _naive_completion_logits(trainer.teacher.model, batch["teacher_prompt_ids"], batch["teacher_prompt_mask"],
                                     batch["completion_ids"], batch["completion_lengths"], 0.7)  # fmt: skip
    ls, lt = s.log_softmax(-1), t.log_softmax(-1)
    if mode == "full_logits":
        p_s, p_t = ls.exp(), lt.exp()
        m = 0.5 * p_s + 0.5 * p_t
        per_token = 0.5 * (p_t * (lt - m.log())).sum(-1) + 0.5 * (p_s * (ls - m.log())).sum(-1)
    else:
        idx = s.topk(3, dim=-1).indices
        qs, qt = ls.gather(-1, idx), lt.gather(-1, idx)
        qs, qt = qs - qs.logsumexp(-1, keepdim=True), qt - qt.logsumexp(-1, keepdim=True)
        per_token = (qs.exp() * (qs - qt)).sum(-1)
    mask = batch["completion_mask"].float() * batch["self_distillation_mask"].unsqueeze(1)
    expected = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    assert expected.item() > 1e-4  # the re-prompt changes the teacher's distribution


# -- end to end --------------------------------------------------------------------------------------------------


def _dataset(n: int = 4, conversational: bool = False) -> Dataset:
    if conversational:
        return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Q{i}?"}]} for i in range(n)])
    return Dataset.from_list([{"prompt": f"Q{i}:", "privileged_context": f"hint {i}"} for i in range(n)])


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # TRL's defaults: pure sampled-token distillation, EMA teacher
        dict(distillation_weight=0.5, gradient_accumulation_steps=2, steps_per_generation=2, num_iterations=2,
             teacher_model_kind="live"),  # fmt: skip
        dict(distillation_mode="topk_logits", distillation_topk=4, distillation_alpha=0.5, distillation_weight=0.3,
             include_environment_feedback=True, teacher_model_kind="base", beta=0.05),  # fmt: skip
    ],
)
def test_trains_end_to_end(tmp_path, tiny_model_path, overrides):
    args = _config(tmp_path, seed=3, **overrides)
    conversational = overrides.get("teacher_model_kind") == "live"
    trainer = SDPOTrainer(tiny_model_path, even_sum, args, train_dataset=_dataset(conversational=conversational))
    served = []
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda rows: served.append(prepare(rows)) or served[-1]
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logs = {}
    for entry in trainer.state.log_history:
        logs.update(entry)
    for key in ("loss", "reward", "completions/mean_length", "self_distillation/reprompt_sample_fraction",
                "self_distillation/success_group_fraction", "self_distillation/reward_mean",
                "self_distillation/rewards/even_sum", "self_distillation/distillation_loss", "sdpo/distillation_loss",
                "timing/teacher_context"):  # fmt: skip
        assert key in logs, key
    assert ("self_distillation/policy_loss" in logs) == (args.distillation_weight < 1.0)
    assert ("kl" in logs) == (args.beta > 0)  # GRPO's KL term in the policy half
    batch = served[0]
    assert ("old_per_token_logps" in batch) == (args.num_iterations > 1)  # then the IS clipping applies
    assert batch["teacher_prompt_ids"].shape[0] == batch["self_distillation_mask"].shape[0] == 4
    if overrides.get("include_environment_feedback"):  # the hint makes every row a teacher row
        assert batch["self_distillation_mask"].tolist() == [1.0] * 4
        text = trainer.processing_class.decode(batch["teacher_prompt_ids"][0][batch["teacher_prompt_mask"][0].bool()])
        assert "feedback from your unsuccessful earlier attempt:\n\nhint" in text
    if conversational:
        text = trainer.processing_class.decode(batch["teacher_prompt_ids"][0][batch["teacher_prompt_mask"][0].bool()])
        assert text.startswith("<|im_start|>user\nQ") and text.endswith("<|im_start|>assistant\n")


def test_remove_unused_columns_keeps_privileged_context(tmp_path, tiny_model_path):
    args = _config(tmp_path, max_steps=1, remove_unused_columns=True, include_environment_feedback=True)
    dataset = _dataset().add_column("unused", ["x"] * 4)
    trainer = SDPOTrainer(tiny_model_path, even_sum, args, train_dataset=dataset)
    seen = []
    generate = trainer._generate_and_score
    trainer._generate_and_score = lambda rows, mode: seen.append(sorted(rows[0])) or generate(rows, mode)
    trainer.train()
    assert seen[0] == ["privileged_context", "prompt"]  # "unused" was removed, the feedback kept
    assert trainer.state.log_history[0]["self_distillation/feedback_used_fraction"] == 1.0


def test_ema_teacher_follows_the_student(tmp_path, tiny_model_path):
    args = _config(tmp_path, teacher_update_rate=0.5, teacher_sync_steps=1, include_environment_feedback=True)
    trainer = SDPOTrainer(tiny_model_path, even_sum, args, train_dataset=_dataset())
    initial = {n: p.detach().clone() for n, p in trainer.teacher.model.named_parameters()}
    trainer.train()
    student = dict(trainer.model.named_parameters())
    moved = [n for n, p in trainer.teacher.model.named_parameters() if not torch.equal(p, initial[n])]
    assert moved and not any(p.requires_grad for p in trainer.teacher.model.parameters())
    name = moved[0]
    assert not torch.equal(trainer.teacher.model.get_parameter(name), student[name])  # an average, not a copy
    assert trainer.teacher_model is trainer.teacher.model
    assert SuccessfulRolloutTeacherContextBuilder(trainer).args is trainer.args  # TRL's constructor takes the trainer


def test_trls_callback_events(tmp_path, tiny_model_path):
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.events = []

        def __getattr__(self, name):
            if not name.startswith("on_") or name in TrainerCallback.__dict__:
                raise AttributeError(name)
            return lambda **payload: self.events.append((name, sorted(payload)))

    recorder = Recorder()
    args = _config(tmp_path, max_steps=1, include_environment_feedback=True)
    SDPOTrainer(tiny_model_path, even_sum, args, train_dataset=_dataset(), callbacks=[recorder]).train()
    common = ["args", "control", "model", "processing_class", "state"]
    assert recorder.events == [
        ("on_generation_prompts_selected", sorted([*common, "generation_prompts", "generation_prompt_text"])),
        ("on_teacher_context_built", sorted([*common, "teacher_input_ids", "teacher_attention_mask",
                                             "completion_mask", "self_distillation_mask"])),
        ("on_self_distillation_batch_prepared", sorted([*common, "old_per_token_logps", "prompt_ids", "completion_ids",
                                                        "teacher_input_ids", "teacher_attention_mask",
                                                        "self_distillation_mask"])),
        ("on_generation_batch_built", sorted([*common, "generate_every", "steps_per_generation"])),
    ]  # fmt: skip


def test_ema_teacher_is_checkpointed_and_restored(tmp_path, tiny_model_path):
    args = _config(tmp_path, teacher_update_rate=0.5, include_environment_feedback=True, save_strategy="steps",
                   save_steps=2)  # fmt: skip
    trainer = SDPOTrainer(tiny_model_path, even_sum, args, train_dataset=_dataset())
    trainer.train()
    saved = {n: p.detach().clone() for n, p in trainer.teacher.model.named_parameters()}
    resumed = SDPOTrainer(tiny_model_path, even_sum, args, train_dataset=_dataset())
    assert any(not torch.equal(p, saved[n]) for n, p in resumed.teacher.model.named_parameters())  # a fresh copy
    resumed._load_resume_state(str(tmp_path / "checkpoint-2"))
    for name, param in resumed.teacher.model.named_parameters():
        assert torch.equal(param, saved[name]), name


def test_lora_student_gets_an_ema_teacher_adapter(tmp_path, tiny_model_path):
    import peft
    args = _config(tmp_path, include_environment_feedback=True)
    trainer = SDPOTrainer(tiny_model_path, even_sum, args, train_dataset=_dataset(),
                          peft_config=peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # fmt: skip
    assert trainer.teacher.model is None and trainer.teacher.uses_adapters
    trainer.train()
    teacher = {n: p for n, p in trainer.model.named_parameters() if ".teacher." in n}
    assert teacher and not any(p.requires_grad for p in teacher.values())
    assert any(p.abs().sum() > 0 for p in teacher.values())  # averaged toward the student's adapter
    assert math.isfinite(trainer.state.log_history[0]["self_distillation/distillation_loss"])


def test_diagnostics_warn_on_first_and_every_interval(tmp_path, tiny_model_path, caplog):
    def never(completion_ids, **kwargs):
        return [0.0] * len(completion_ids)

    args = _config(tmp_path, max_steps=3, diagnostics_warning_interval=2)
    trainer = SDPOTrainer(tiny_model_path, never, args, train_dataset=_dataset())
    with caplog.at_level(logging.WARNING, logger="posttrain.experimental.sdpo.sdpo_trainer"):
        trainer.train()
    inactive = [r.getMessage() for r in caplog.records if "self-distillation is inactive" in r.getMessage()]
    assert [m.rsplit(" ", 1)[-1] for m in inactive] == ["1.", "2."]  # steps 1 and 2 of 3 (interval 2)
    assert any("flat SDPO rewards" in r.getMessage() for r in caplog.records)
    assert any("did not find any successful rollouts" in r.getMessage() for r in caplog.records)
    assert all(h.get("loss", 0.0) == 0.0 for h in trainer.state.log_history)


def test_requires_rewards_and_dataset(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="reward_funcs"):
        SDPOTrainer(tiny_model_path, None, _config(tmp_path), train_dataset=_dataset())
    with pytest.raises(ValueError, match="train_dataset"):
        SDPOTrainer(tiny_model_path, has_a, _config(tmp_path))


def test_seed_example_runs(tmp_path, tiny_model_path):
    """The paper index's example (001, "Reinforcement Learning via Self-Distillation") with s/trl/posttrain/, on
    tiny local data; only the run-length fields are added."""
    from posttrain.experimental.sdpo import SDPOConfig, SDPOTrainer

    training_args = SDPOConfig(
        distillation_alpha=0.5,                # Jensen-Shannon divergence (recommended)
        distillation_mode="topk_logits",       # Explicitly select top-K logit distillation
        distillation_topk=100,                 # Required for top-K logit distillation
        distillation_is_clip=2.0,              # Importance sampling clipping
        distillation_weight=1.0,               # Convex weight: (1-w)*policy + w*distillation; 1.0 = pure distillation
        use_successful_as_teacher=True,        # Use successful rollouts as teacher
        teacher_model_kind="ema",              # Supported: "base", "live", "ema"
        teacher_update_rate=0.05,              # EMA update rate
        include_environment_feedback=True,     # required to use the dataset's privileged_context (defaults to False)
        output_dir=str(tmp_path), report_to="none", max_steps=1, per_device_train_batch_size=16,
        max_completion_length=8, logging_steps=1, gradient_checkpointing=False, disable_tqdm=True,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": ["1+1=", "2+2="], "privileged_context": ["It is 2.", ""]})
    trainer = SDPOTrainer(model=tiny_model_path, reward_funcs=has_a, args=training_args, train_dataset=dataset)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and logs["self_distillation/feedback_available_fraction"] == 0.5


@pytest.mark.slow
def test_reward_rises(tmp_path, tiny_model_path):
    """reward = fraction of completion tokens equal to "a"; successes (>= 0.5) teach the others through the re-prompted
    teacher, the GRPO half of the loss pushes toward them: the mean reward rises from ~0 within a few dozen steps."""

    def fraction_of_a(completion_ids, **kwargs):
        return [sum(t == 97 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    args = _config(tmp_path, per_device_train_batch_size=32, num_generations=16, max_completion_length=4,
                   max_steps=20, learning_rate=2e-2, seed=0, shuffle_dataset=True, distillation_weight=0.5,
                   success_reward_threshold=0.5, teacher_model_kind="live")  # fmt: skip
    trainer = SDPOTrainer(tiny_model_path, fraction_of_a, args, train_dataset=Dataset.from_list([{"prompt": "a:"}] * 8))
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    assert rewards[0] < 0.05
    assert sum(rewards[-5:]) / 5 > 0.5
    fractions = [h["self_distillation/reprompt_sample_fraction"] for h in trainer.state.log_history if "reward" in h]
    assert max(fractions) > 0.5  # the distillation term was active


# -- the live teacher behind the generation server (use_teacher_server) -------------------------------------------


def _served_config(tmp_path, url, **overrides):
    return _config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, use_teacher_server=True,
                   teacher_model_kind="live", **overrides)  # fmt: skip


@pytest.mark.parametrize("mode", ["sampled_token", "topk_logits"])
def test_served_teacher_loss_on_a_fixed_rollout(tmp_path, tiny_model_path, served_url, mode):
    """The served live teacher (the student's weights, synced to the server) on [re-prompt | completion]: sampled-token
    reverse KL, or the divergence on the teacher's own top-3 support, written out from naive full logits."""
    extra = dict(distillation_topk=3, distillation_alpha=0.5) if mode == "topk_logits" else {}
    args = _served_config(tmp_path, served_url, num_generations=2, per_device_train_batch_size=2, distillation_mode=mode,
                          distillation_is_clip=None, **extra)  # fmt: skip
    trainer = SDPOTrainer(tiny_model_path, has_a, args, train_dataset=Dataset.from_list([{"prompt": "Q:"}] * 2))
    trainer.model.train()
    batch = _fixed_rollout()
    loss = trainer._compute_loss(trainer.model, batch)
    with torch.no_grad():
        s = _naive_completion_logits(trainer.model, batch["prompt_ids"], batch["prompt_mask"],
                                     batch["completion_ids"], batch["completion_lengths"], 1.0).log_softmax(-1)
        t = _naive_completion_logits(trainer.model, batch["teacher_prompt_ids"][:, 1:],
                                     batch["teacher_prompt_mask"][:, 1:], batch["completion_ids"],
                                     batch["completion_lengths"], 1.0).log_softmax(-1)  # fmt: skip
    if mode == "sampled_token":
        ids = batch["completion_ids"].unsqueeze(-1)
        s_tok, t_tok = s.gather(-1, ids).squeeze(-1), t.gather(-1, ids).squeeze(-1)
        per_token = (s_tok - t_tok) * s_tok
    else:
        idx = t.topk(3, -1).indices
        qs, qt = s.gather(-1, idx), t.gather(-1, idx)
        qs, qt = qs - qs.logsumexp(-1, keepdim=True), qt - qt.logsumexp(-1, keepdim=True)
        m = (0.5 * qs.exp() + 0.5 * qt.exp()).log()
        per_token = 0.5 * (qt.exp() * (qt - m)).sum(-1) + 0.5 * (qs.exp() * (qs - m)).sum(-1)
    mask = batch["completion_mask"].float() * batch["self_distillation_mask"].unsqueeze(1)
    expected = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-3, abs=1e-5)
    assert trainer._metrics["train"]["self_distillation/server_logprob_abs_diff"][-1] >= 0
    trainer.served_teacher.close()


def test_served_teacher_end_to_end(tmp_path, tiny_model_path, served_url):
    args = _served_config(tmp_path, served_url, include_environment_feedback=True)
    trainer = SDPOTrainer(tiny_model_path, even_sum, args, train_dataset=_dataset())
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logs = {k for entry in trainer.state.log_history for k in entry}
    assert {"sdpo/distillation_loss", "self_distillation/server_logprob_abs_diff"} <= logs
    trainer.served_teacher.close()
