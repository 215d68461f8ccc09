"""DistillationTrainer on the offline tiny models: the loss equals the full-logits generalized JSD (β = 0, 0.5, 1;
chunked and fallback heads), on-/off-policy mixing (lmbda), seq_kd, PEFT students, vocabulary checks, metrics,
evaluation, completion logging, config defaults and errors — and a student that measurably moves toward a teacher
trained to answer "abcabc..."."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from datasets import Dataset
from trainer_helpers import fast_config, quiet_single_thread, save_abc_teacher, trainable_params  # noqa: F401

from posttrain.core.distill import generalized_jsd_loss
from posttrain.generation.base import Completions, SamplingConfig
from posttrain.models.completion_scoring import completion_inputs
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer
from posttrain.models.vocabulary import check_shared_vocabulary
from posttrain.rollout.distillation import DistillationRollout
from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer

EOS = 258


@pytest.fixture(scope="module")
def teacher_path(tmp_path_factory) -> str:
    """A tiny Qwen2 that answers "abcabc..." after any "Q<n>:" prompt (see ``save_abc_teacher``)."""
    return save_abc_teacher(build_tiny_tokenizer(), str(tmp_path_factory.mktemp("abc-teacher")), seed=1)


def _prompts(n: int = 8, prefix: str = "Q") -> Dataset:
    return Dataset.from_list([{"prompt": f"{prefix}{i}:"} for i in range(n)])


def _pairs(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Q{i}:", "completion": "abcabc"} for i in range(n)])


def _config(tmp_path, **overrides) -> DistillationConfig:
    values = dict(per_device_train_batch_size=2, max_completion_length=6, max_steps=1, learning_rate=1e-3)
    return fast_config(DistillationConfig, tmp_path, **{**values, **overrides})


def _logs(trainer) -> dict:
    merged = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    return merged


def _trainable(trainer) -> dict[str, torch.Tensor]:
    return trainable_params(trainer.model)


def _changed(trainer, before) -> int:
    return sum(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if n in before)


def _capture_rounds(trainer) -> list[dict]:
    """Record every batch the rollout builds (one per generation round)."""
    rounds = []
    run = trainer.rollout.run

    def spy(*args, **kwargs):
        batch = run(*args, **kwargs)
        rounds.append(batch)
        return batch

    trainer.rollout.run = spy
    return rounds


def _count_calls(backend) -> list[int]:
    calls = []
    generate = backend.generate

    def spy(prompt_ids, sampling, num_generations=1):
        calls.append(len(prompt_ids) * num_generations)
        return generate(prompt_ids, sampling, num_generations)

    backend.generate = spy
    return calls


def _fixed_batch(tokenizer) -> dict:
    """Two left-padded prompts with right-padded completions; the second completion is one token shorter."""
    prompts = [tokenizer("Q1:").input_ids, tokenizer("Q22:").input_ids]
    completions = [tokenizer("abca").input_ids + [EOS], tokenizer("xyz").input_ids + [EOS]]
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[259] * (width_p - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts])
    completion_ids = torch.tensor([c + [259] * (width_c - len(c)) for c in completions])
    lengths = torch.tensor([len(c) for c in completions])
    mask = (torch.arange(width_c)[None] < lengths[:, None]).long()
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": mask,
        "completion_lengths": lengths,
        "num_items_in_batch": mask.sum(),
    }


def _reference_divergence(student, teacher, batch, beta, temperature) -> torch.Tensor:
    """The generalized JSD from both models' full logits (the unchunked definition)."""
    input_ids, attention_mask, position_ids, _ = completion_inputs(batch)
    width = batch["completion_ids"].shape[1]
    s = student(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    with torch.no_grad():
        t = teacher(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    s, t = s[:, -width - 1 : -1], t[:, -width - 1 : -1]
    return generalized_jsd_loss(s, t, batch["completion_mask"], beta=beta, temperature=temperature)


# ---------------------------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.invariance
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_loss_and_gradients_equal_the_full_logits_jsd_then_train(tiny_model_path, teacher_path, tmp_path, beta):
    trainer = DistillationTrainer(
        tiny_model_path, teacher_path, args=_config(tmp_path, beta=beta, temperature=0.7), train_dataset=_prompts()
    )
    batch = _fixed_batch(trainer.processing_class)
    model = trainer.model
    model.train()
    loss = trainer._compute_loss(model, batch)  # train mode: Σ / num_items_in_batch (= the token mean here)
    grads = torch.autograd.grad(loss, [model.lm_head.weight, model.model.layers[0].self_attn.q_proj.weight])
    reference = _reference_divergence(model, trainer.teacher_model, batch, beta, 0.7)
    ref_grads = torch.autograd.grad(reference, [model.lm_head.weight, model.model.layers[0].self_attn.q_proj.weight])
    assert reference.item() > 1e-3
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-7)

    before = _trainable(trainer)
    trainer.train()
    assert _changed(trainer, before) > 0
    logs = _logs(trainer)
    assert torch.isfinite(torch.tensor(logs["loss"])) and logs["distillation_loss"] >= 0


@pytest.mark.invariance
def test_fallback_head_lora_on_lm_head_matches_full_logits(tiny_model_path, teacher_path, tmp_path, caplog):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
    trainer = DistillationTrainer(
        tiny_model_path, teacher_path, args=_config(tmp_path, beta=0.5), train_dataset=_prompts(),
        peft_config=peft_config,
    )  # fmt: skip
    batch = _fixed_batch(trainer.processing_class)
    trainer.model.train()
    with caplog.at_level(logging.WARNING):
        loss = trainer._compute_loss(trainer.model, batch)
    assert "full-vocabulary logits" in caplog.text  # the LoRA head cannot be read as a plain weight
    torch.testing.assert_close(
        loss, _reference_divergence(trainer.model, trainer.teacher_model, batch, 0.5, 1.0), rtol=1e-5, atol=1e-6
    )


def test_gradient_accumulation_normalises_by_the_step_tokens(tiny_model_path, teacher_path, tmp_path):
    """Loss per micro-batch = Σ divergence / tokens of the whole optimizer step: the step's losses sum to its mean."""
    trainer = DistillationTrainer(
        tiny_model_path, teacher_path, args=_config(tmp_path, gradient_accumulation_steps=2), train_dataset=_prompts()
    )
    batch = _fixed_batch(trainer.processing_class)
    trainer.model.train()
    whole = trainer._compute_loss(trainer.model, batch).item()
    halves = []
    for i in (0, 1):
        part = {k: (v[i : i + 1] if v.dim() else v) for k, v in batch.items()}  # num_items stays the total
        halves.append(trainer._compute_loss(trainer.model, part).item())
    assert sum(halves) == pytest.approx(whole, rel=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Learning
# ---------------------------------------------------------------------------------------------------------------


def test_student_moves_toward_an_abc_teacher_on_held_out_prompts(tiny_model_path, teacher_path, tmp_path):
    trainer = DistillationTrainer(
        tiny_model_path,
        teacher_path,
        args=_config(
            tmp_path, per_device_train_batch_size=8, max_completion_length=8, max_steps=15, learning_rate=5e-3,
            beta=0.5, logging_steps=5,
        ),
        train_dataset=_prompts(32),
    )  # fmt: skip
    tokenizer = trainer.processing_class
    held_out = [f"P{i}:" for i in range(4)]
    prompt_ids = [tokenizer(p).input_ids for p in held_out]
    completion = tokenizer("abcabcab").input_ids
    batch = {
        "prompt_ids": torch.tensor(prompt_ids),
        "prompt_mask": torch.ones(len(held_out), len(prompt_ids[0]), dtype=torch.long),
        "completion_ids": torch.tensor([completion] * len(held_out)),
        "completion_mask": torch.ones(len(held_out), len(completion), dtype=torch.long),
        "completion_lengths": torch.full((len(held_out),), len(completion)),
    }

    def held_out_divergence() -> float:
        with torch.no_grad():
            return _reference_divergence(trainer.model, trainer.teacher_model, batch, 0.5, 1.0).item()

    before = held_out_divergence()
    trainer.train()
    after = held_out_divergence()
    assert after < 0.8 * before, (before, after)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------------------------------------------------------
# Sources: lmbda, seq_kd, prompt-only data
# ---------------------------------------------------------------------------------------------------------------


def test_lmbda_zero_trains_on_dataset_completions_without_generating(tiny_model_path, teacher_path, tmp_path):
    trainer = DistillationTrainer(
        tiny_model_path,
        teacher_path,
        args=_config(tmp_path, lmbda=0.0, max_steps=2, max_completion_length=8),
        train_dataset=_pairs(),
    )
    rounds = _capture_rounds(trainer)
    calls = _count_calls(trainer.backend)
    before = _trainable(trainer)
    trainer.train()
    assert calls == [] and len(rounds) == 2
    assert all(source == "dataset" for batch in rounds for source in batch["sources"])
    expected = list(b"abcabc") + [EOS]  # the completion's bytes + EOS, nothing after it
    for ids, length in zip(rounds[0]["completion_ids"].tolist(), rounds[0]["completion_lengths"].tolist()):
        assert ids[:length] == expected
    assert _changed(trainer, before) > 0
    assert "completions/mean_length" not in _logs(trainer)  # nothing was sampled


def test_lmbda_one_samples_every_slice_from_the_student(tiny_model_path, teacher_path, tmp_path):
    args = _config(tmp_path, lmbda=1.0, max_steps=2, gradient_accumulation_steps=2)
    trainer = DistillationTrainer(tiny_model_path, teacher_path, args=args, train_dataset=_pairs())
    rounds = _capture_rounds(trainer)
    calls = _count_calls(trainer.backend)
    trainer.train()
    assert calls == [4, 4]  # one generation per optimizer step: b × GA rows
    assert all(source == "student" for batch in rounds for source in batch["sources"])
    logs = _logs(trainer)
    for key in ("loss", "distillation_loss", "entropy", "num_tokens", "step_time", "completions/mean_length",
                "completions/clipped_ratio", "completions/mean_terminated_length"):  # fmt: skip
        assert key in logs, key
    assert 0 < logs["entropy"] <= torch.log(torch.tensor(320.0)).item() + 1e-4


def test_intermediate_lmbda_mixes_whole_slices(tiny_model_path, teacher_path, tmp_path):
    args = _config(tmp_path, lmbda=0.5, max_steps=4, gradient_accumulation_steps=2)
    trainer = DistillationTrainer(tiny_model_path, teacher_path, args=args, train_dataset=_pairs())
    rounds = _capture_rounds(trainer)
    trainer.train()
    slices = [batch["sources"][i : i + 2] for batch in rounds for i in (0, 2)]  # b = 2 rows per slice
    assert all(len(set(slice_)) == 1 for slice_ in slices), slices  # one source per slice
    assert {slice_[0] for slice_ in slices} == {"student", "dataset"}
    # The draws are seeded and identical on every process: a second run takes the same path.
    again = DistillationTrainer(tiny_model_path, teacher_path, args=args, train_dataset=_pairs())
    rounds_again = _capture_rounds(again)
    again.train()
    assert [b["sources"] for b in rounds_again] == [b["sources"] for b in rounds]
    assert "distillation_rollout" in trainer.resume_state_dict()


def test_seq_kd_uses_teacher_samples_for_off_policy_slices(tiny_model_path, teacher_path, tmp_path):
    args = _config(tmp_path, lmbda=0.0, seq_kd=True, max_completion_length=8, temperature=0.3)
    trainer = DistillationTrainer(tiny_model_path, teacher_path, args=args, train_dataset=_pairs())
    rounds = _capture_rounds(trainer)
    student_calls = _count_calls(trainer.backend)
    teacher_calls = _count_calls(trainer.rollout.teacher_backend)
    trainer.train()
    assert student_calls == [] and teacher_calls == [2]
    assert rounds[0]["sources"] == ["teacher", "teacher"]
    texts = trainer.processing_class.batch_decode(rounds[0]["completion_ids"], skip_special_tokens=True)
    assert all(text and set(text) <= set("abc") for text in texts), texts  # the abc teacher wrote them


def test_prompt_only_data_is_always_on_policy(tiny_model_path, teacher_path, tmp_path):
    with pytest.warns(UserWarning, match="every batch is on-policy"):
        trainer = DistillationTrainer(
            tiny_model_path, teacher_path, args=_config(tmp_path, lmbda=0.0), train_dataset=_prompts()
        )
    rounds = _capture_rounds(trainer)
    trainer.train()
    assert rounds[0]["sources"] == ["student", "student"]


def test_iterable_dataset_streams_prompts(tiny_model_path, teacher_path, tmp_path):
    args = _config(tmp_path, max_steps=2, gradient_accumulation_steps=2)
    trainer = DistillationTrainer(
        tiny_model_path, teacher_path, args=args, train_dataset=_pairs().to_iterable_dataset()
    )
    calls = _count_calls(trainer.backend)
    trainer.train()
    assert calls == [4, 4] and trainer.state.global_step == 2


def test_all_tokens_masked_gives_a_zero_loss(tiny_model_path, teacher_path, tmp_path):
    args = _config(tmp_path, max_completion_length=2, mask_truncated_completions=True, temperature=0.3)
    trainer = DistillationTrainer(tiny_model_path, teacher_path, args=args, train_dataset=_prompts())
    trainer.train()  # no completion ends with EOS within 2 tokens: every row is masked out
    logs = _logs(trainer)
    assert logs["loss"] == 0.0 and logs["completions/clipped_ratio"] == 1.0


def test_conversational_completions_end_at_eos(tiny_model_path, teacher_path, tmp_path):
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Say abc {i}"}],
            "completion": [{"role": "assistant", "content": "abc"}],
        }
        for i in range(4)
    ]
    args = _config(tmp_path, lmbda=0.0, max_completion_length=16)
    trainer = DistillationTrainer(tiny_model_path, teacher_path, args=args, train_dataset=Dataset.from_list(rows))
    rounds = _capture_rounds(trainer)
    trainer.train()
    batch = rounds[0]
    for ids, length in zip(batch["completion_ids"].tolist(), batch["completion_lengths"].tolist()):
        assert ids[length - 1] == EOS and trainer.processing_class.decode(ids[: length - 1]) == "abc"
    prompt = trainer.processing_class.decode(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()])
    assert prompt.endswith("<|im_start|>assistant\n")
    # GKD's "messages" rows: the last assistant turn is the completion — the same tokens.
    messages = Dataset.from_list([{"messages": row["prompt"] + row["completion"]} for row in rows])
    trainer = DistillationTrainer(tiny_model_path, teacher_path, args=args, train_dataset=messages)
    rounds_messages = _capture_rounds(trainer)
    trainer.train()
    assert rounds_messages[0]["completion_ids"].tolist() == batch["completion_ids"].tolist()
    assert rounds_messages[0]["sources"] == ["dataset", "dataset"]


# ---------------------------------------------------------------------------------------------------------------
# Models: PEFT student, teacher loading, vocabulary
# ---------------------------------------------------------------------------------------------------------------


def test_peft_student_trains_only_the_adapter_with_default_checkpointing(tiny_model_path, teacher_path, tmp_path):
    from peft import LoraConfig

    args = _config(tmp_path, gradient_checkpointing=True)
    trainer = DistillationTrainer(
        tiny_model_path, teacher_path, args=args, train_dataset=_prompts(),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )  # fmt: skip
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    lora_b = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    params = dict(trainer.model.named_parameters())
    assert all(torch.equal(base[n], params[n]) for n in base)
    assert any(not torch.equal(lora_b[n], params[n]) for n in lora_b)


def test_teacher_from_config_is_frozen_and_evaluate_reports_the_divergence(tiny_model_path, teacher_path, tmp_path):
    args = _config(tmp_path, teacher_model_name_or_path=teacher_path, per_device_eval_batch_size=2)
    trainer = DistillationTrainer(tiny_model_path, args=args, train_dataset=_prompts(), eval_dataset=_prompts(2, "E"))
    assert not trainer.teacher_model.training
    assert not any(p.requires_grad for p in trainer.teacher_model.parameters())
    metrics = trainer.evaluate()
    logged = trainer.state.log_history[-1]
    assert metrics["eval_loss"] > 0 and "eval_entropy" in logged and "eval_completions/mean_length" in logged


def test_vocabulary_checks(tiny_model_path, teacher_path, tmp_path, caplog):
    # A teacher with another tokenizer.
    other = build_tiny_tokenizer()
    other.add_tokens(["<extra_token>"])
    other_path = str(tmp_path / "other")
    model = build_tiny_model("qwen2", tokenizer=other, vocab_size=320)
    model.save_pretrained(other_path)
    other.save_pretrained(other_path)
    with pytest.raises(ValueError, match="tokenizer does not match"):
        DistillationTrainer(tiny_model_path, other_path, args=_config(tmp_path / "a"), train_dataset=_prompts())
    # A teacher whose head is smaller than the tokenizer.
    small = build_tiny_model("qwen2")
    small.resize_token_embeddings(200)
    with pytest.raises(ValueError, match="vocab_size 320 but the teacher has vocab_size 200"):
        DistillationTrainer(tiny_model_path, small, args=_config(tmp_path / "b"), train_dataset=_prompts())
    # A padded teacher head (384 rows): both cover the tokenizer, the first 320 rows are compared.
    padded = build_tiny_model("qwen2", vocab_size=384, seed=3)
    with caplog.at_level(logging.WARNING):
        trainer = DistillationTrainer(tiny_model_path, padded, args=_config(tmp_path / "c"), train_dataset=_prompts())
    assert trainer.vocab_rows == 320
    trainer.train()
    assert torch.isfinite(torch.tensor(_logs(trainer)["loss"]))
    tok = build_tiny_tokenizer()
    assert check_shared_vocabulary(tok, tok, 320, 320) == 320


def test_constructor_and_config_errors(tiny_model_path, teacher_path, tmp_path):
    with pytest.raises(ValueError, match="needs a teacher"):
        DistillationTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=_prompts())
    teacher = build_tiny_model("qwen2")
    with pytest.raises(ValueError, match="already instantiated"):
        DistillationTrainer(
            tiny_model_path, teacher, args=_config(tmp_path, teacher_model_init_kwargs={"dtype": "float32"}),
            train_dataset=_prompts(),
        )  # fmt: skip
    with pytest.raises(ValueError, match="data_collator"):
        DistillationTrainer(
            tiny_model_path, teacher, args=_config(tmp_path), train_dataset=_prompts(), data_collator=lambda x: x
        )
    with pytest.raises(ValueError, match="student model itself"):
        DistillationTrainer(teacher, teacher, args=_config(tmp_path), train_dataset=_prompts())
    with pytest.raises(ValueError, match="needs generation_batch_size"):
        DistillationTrainer(tiny_model_path, teacher, args=_config(tmp_path), train_dataset=_prompts(1))

    bad = [
        (dict(lmbda=1.5), "lmbda must be in"),
        (dict(beta=-0.1), "beta must be in"),
        (dict(max_completion_length=1024), "must be smaller than max_length"),
        (dict(generation_batch_size=3), "generation_batch_size \\* num_generations must equal"),
        (dict(steps_per_generation=2), "steps_per_generation=2"),
        (dict(epsilon_high=0.28), "GRPO/RLOO option"),
        (dict(generation_backend="vllm"), "Unknown generation_backend"),
    ]
    for overrides, message in bad:
        with pytest.raises(ValueError, match=message):
            _config(tmp_path, **overrides)


def test_config_defaults_are_trls(tmp_path):
    args = DistillationConfig(output_dir=str(tmp_path), report_to="none")
    assert args.learning_rate == 1e-6 and args.temperature == 1.0 and args.beta == 1.0 and args.lmbda == 1.0
    assert args.top_p == 1.0 and args.top_k == 0 and args.num_generations == 1 and not args.disable_dropout
    assert args.max_completion_length == 512 and args.max_length == 1024 and args.max_prompt_length == 512
    assert args.generation_batch_size == 8 and args.steps_per_generation == 1  # b × GA / G unique prompts
    assert (
        args.vllm_server_host == "0.0.0.0"
        and args.vllm_server_port == 8000
        and args.vllm_sync_frequency == 1
        and args.log_completions_steps == 100
    )
    assert args.seq_kd is False and args.gradient_checkpointing and args.logging_steps == 10
    parsed = DistillationConfig(
        output_dir=str(tmp_path), report_to="none", teacher_model_init_kwargs='{"dtype": "float32"}'
    )
    assert parsed.teacher_model_init_kwargs == {"dtype": "float32"}
    with pytest.warns(UserWarning, match="Consider lmbda=1.0"):
        DistillationConfig(output_dir=str(tmp_path), report_to="none", num_generations=2, lmbda=0.5)


def test_log_completions_every_log_completions_steps(tiny_model_path, teacher_path, tmp_path, capsys):
    args = _config(tmp_path, log_completions=True, log_completions_steps=2, max_steps=2, lmbda=0.0)
    trainer = DistillationTrainer(tiny_model_path, teacher_path, args=args, train_dataset=_pairs())
    trainer.train()
    files = sorted(os.listdir(tmp_path / "completions"))
    assert files == ["completions_00002.parquet"]  # step 1 is not a multiple of 2
    import pandas as pd

    frame = pd.read_parquet(tmp_path / "completions" / files[0])
    assert set(frame.columns) >= {"step", "prompt", "completion", "source"}
    assert set(frame["source"]) == {"dataset"} and frame["completion"].iloc[0] == "abcabc"


# ---------------------------------------------------------------------------------------------------------------
# The round builder on its own
# ---------------------------------------------------------------------------------------------------------------


class _EchoBackend:
    """Returns "ab" + EOS for every row; records the prompts and G it was called with."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, sampling, num_generations=1):
        self.calls.append((prompt_ids, num_generations))
        rows = [list(p) for p in prompt_ids for _ in range(num_generations)]
        return Completions([[97, 98, EOS] for _ in rows], None, [True] * len(rows), rows)

    def sync_weights(self, model):
        pass


def test_rollout_groups_prompts_truncates_and_counts_tokens():
    tokenizer = build_tiny_tokenizer(padding_side="left")
    tokenizer.truncation_side = "left"
    sampling = SamplingConfig(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=259)
    backend = _EchoBackend()
    rollout = DistillationRollout(
        tokenizer=tokenizer, student_backend=backend, sampling=sampling, num_generations=2, max_prompt_length=3
    )
    recorded = {}
    rows = [{"prompt": "long prompt A"}] * 2 + [{"prompt": "long prompt B"}] * 2
    batch = rollout.run(rows, num_slices=2, record=lambda name, value: recorded.__setitem__(name, value))
    ((prompts, g),) = backend.calls
    assert g == 2 and prompts == [list(b"t A"), list(b"t B")]  # one call per group, prompts cut on the left
    assert batch["completion_ids"].tolist() == [[97, 98, EOS]] * 4
    assert int(batch["num_items_in_batch"]) == 12
    assert recorded["num_tokens"] == 4 * 3 + 12 and recorded["completions/clipped_ratio"] == 0.0
    with pytest.raises(ValueError, match="equal slices"):
        rollout.run(rows[:3], num_slices=2)


def test_rollout_slices_a_short_round_by_slice_size():
    # GKD's epoch end: a round of 3 rows in micro-batches of 2 is 2 slices (2 rows and 1), one draw of λ each
    tokenizer = build_tiny_tokenizer(padding_side="left")
    sampling = SamplingConfig(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=259)
    rollout = DistillationRollout(tokenizer=tokenizer, student_backend=_EchoBackend(), sampling=sampling, lmbda=0.5)
    drawn = []
    draw = rollout.draw_on_policy

    def spy(num_slices, mode="train"):
        drawn.append(num_slices)
        return [True, False][:num_slices]

    rollout.draw_on_policy = spy
    rows = [{"prompt": f"p{i}", "completion": "abc"} for i in range(3)]
    _, sources, _ = rollout.prepare_rows(rows, 4, "train", slice_size=2)
    assert drawn == [2] and sources == ["student", "student", "dataset"]
    rollout.draw_on_policy = draw
    with pytest.raises(ValueError, match="positive"):
        rollout.prepare_rows(rows, 4, "train", slice_size=0)


@pytest.mark.parametrize(
    "rule, max_length, expect_prompt, expect_completion, ended",
    [
        ("completion_budget", None, 4, 3, False),  # prompt to max_prompt_length, completion to max_completion_length
        ("keep_end", 12, 12 - 8, 8, True),  # GKD/GOLD: the last 12 tokens, the prompt's oldest dropped first
        ("keep_end", 5, 0, 5, True),  # ... then the completion's start
        ("fill", 10, 4, 6, False),  # IW-OPD: prompt to max_prompt_length, completion to the rest of max_length
    ],
)
def test_dataset_rows_are_cut_by_each_trainers_rule(rule, max_length, expect_prompt, expect_completion, ended):
    tokenizer = build_tiny_tokenizer(padding_side="left")
    tokenizer.truncation_side = "left"
    sampling = SamplingConfig(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=259)
    rollout = DistillationRollout(
        tokenizer=tokenizer, student_backend=_EchoBackend(), sampling=sampling, lmbda=0.0, max_prompt_length=4,
        max_completion_length=3, dataset_truncation=rule, max_length=max_length,
    )  # fmt: skip
    row = {"prompt": "a long prompt", "completion": "abcdefg"}  # 13 prompt bytes, 7 completion bytes + EOS
    prompt, completion, finished = rollout._dataset_completion(row, 0)
    assert (len(prompt), len(completion), finished) == (expect_prompt, expect_completion, ended)
    full = list(b"a long prompt") + list(b"abcdefg") + [EOS]
    assert prompt + completion == full[len(full) - len(prompt) - len(completion) :] or rule != "keep_end"
    assert completion[0] in b"abcdefg" and prompt == list(b"a long prompt")[13 - len(prompt) :]
    with pytest.raises(ValueError, match="needs max_length"):
        DistillationRollout(tokenizer=tokenizer, student_backend=None, sampling=sampling, dataset_truncation="fill")


def test_rollout_draws_are_reproducible_from_the_state():
    sampling = SamplingConfig(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=259)
    rollout = DistillationRollout(
        tokenizer=build_tiny_tokenizer(), student_backend=_EchoBackend(), sampling=sampling, lmbda=0.5, seed=3
    )
    state = rollout.state_dict()
    first = [rollout.draw_on_policy(8) for _ in range(3)]
    rollout.load_state_dict(state)
    assert [rollout.draw_on_policy(8) for _ in range(3)] == first
    assert {x for draw in first for x in draw} == {True, False}
    assert rollout.draw_on_policy(4, mode="eval") == [True] * 4


def test_rollout_stages_are_timed():
    """run() is a sequence of named stages, each recorded as timing/<stage> (seconds), the whole as timing/rollout;
    stages with nothing to do (no sampled rows, no dataset rows, no completions table) record nothing."""
    from posttrain.rollout.distillation import STAGES

    sampling = SamplingConfig(max_new_tokens=4, eos_token_ids=[EOS], pad_token_id=259)
    tokenizer = build_tiny_tokenizer()

    def timed_run(rows, **kwargs):
        rollout = DistillationRollout(tokenizer=tokenizer, student_backend=_EchoBackend(), sampling=sampling, **kwargs)
        metrics = {}
        rollout.run(rows, num_slices=2, record=metrics.__setitem__)
        timed = {name.removeprefix("timing/") for name in metrics if name.startswith("timing/")}
        assert all(metrics[f"timing/{name}"] >= 0.0 for name in timed)
        assert metrics["timing/rollout"] >= sum(metrics[f"timing/{name}"] for name in STAGES if name in timed)
        return timed

    on_policy = timed_run([{"prompt": "p"}] * 4)
    assert on_policy == {*STAGES, "rollout"} - {"dataset_completions", "completions_table"}
    off_policy = timed_run([{"prompt": "p", "completion": " c"}] * 4, lmbda=0.0, keep_completions=True)
    assert off_policy == {*STAGES, "rollout"} - {"generate"}


@pytest.mark.invariance
def test_shared_prompt_layout_gives_the_same_loss_and_gradients(tiny_model_path, teacher_path, tmp_path):
    """Long shared prompts, 4 completions each: the shared-prompt layout is used and changes nothing."""
    from posttrain.models.completion_scoring import choose_shared_prompt_layout

    trainer = DistillationTrainer(
        tiny_model_path, teacher_path, args=_config(tmp_path, beta=0.5), train_dataset=_prompts()
    )
    g = torch.Generator().manual_seed(0)
    system = torch.randint(3, 250, (40,), generator=g).tolist()
    prompts = [system + [65 + i] * (3 + i) for i in range(2) for _ in range(4)]
    lengths = torch.tensor([5, 1, 7, 3, 6, 2, 7, 4])
    width_p = max(map(len, prompts))
    batch = {
        "prompt_ids": torch.tensor([[259] * (width_p - len(p)) + p for p in prompts]),
        "prompt_mask": torch.tensor([[0] * (width_p - len(p)) + [1] * len(p) for p in prompts]),
        "completion_ids": torch.randint(3, 250, (8, 7), generator=g),
        "completion_lengths": lengths,
    }
    batch["completion_mask"] = (torch.arange(7)[None] < lengths[:, None]).long()
    batch["completion_mask"][2, 1] = 0  # a masked token inside a completion (e.g. a tool result)
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    model = trainer.model
    model.train()
    assert choose_shared_prompt_layout(model, batch) is not None
    results = []
    for share in (True, False):
        trainer.args.shared_prompt_forward = share
        loss = trainer._compute_loss(model, batch)
        results.append((loss.detach(), torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
