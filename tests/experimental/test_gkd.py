"""GKDTrainer / GKDConfig: TRL's defaults, the seed document's example (messages data) on the tiny models, the
loss equals the generalized JSD of the full logits, and (slow) the student moves toward the teacher."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from distill_helpers import mean_reverse_kl, pairs
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.core.distill import generalized_jsd_loss
from posttrain.experimental.gkd import GKDConfig, GKDTrainer


def test_trl_defaults(tmp_path):
    args = GKDConfig(output_dir=str(tmp_path), report_to="none")
    assert (args.temperature, args.lmbda, args.beta, args.max_new_tokens) == (0.9, 0.5, 0.5, 128)
    assert args.seq_kd is False and args.disable_dropout is True and args.teacher_model_name_or_path is None
    assert args.max_completion_length == 128 and args.top_p == 1.0 and args.learning_rate == 2e-5
    assert GKDConfig(output_dir=str(tmp_path), report_to="none", max_new_tokens=7).max_completion_length == 7
    with pytest.raises(ValueError, match="lmbda"):
        GKDConfig(output_dir=str(tmp_path), report_to="none", lmbda=1.5)
    with pytest.raises(ValueError, match="beta"):
        GKDConfig(output_dir=str(tmp_path), report_to="none", beta=-0.1)


def test_seed_doc_example_runs(tiny_model_path, abc_teacher_path, tmp_path):
    """The GKD page's example after s/trl/posttrain/, with the tiny models and a short run."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    teacher_model = AutoModelForCausalLM.from_pretrained(abc_teacher_path)
    n = 8
    train_dataset = Dataset.from_dict(
        {"messages": [[{"role": "user", "content": "Hi, how are you?"},
                       {"role": "assistant", "content": "I'm great thanks"}]] * n}  # fmt: skip
    )
    eval_dataset = Dataset.from_dict(
        {"messages": [[{"role": "user", "content": "What colour is the sky?"},
                       {"role": "assistant", "content": "The sky is blue"}]] * n}  # fmt: skip
    )
    training_args = fast_config(
        GKDConfig, tmp_path, per_device_train_batch_size=1, max_new_tokens=8, max_steps=2, eval_strategy="steps",
        eval_steps=2, per_device_eval_batch_size=2,
    )  # fmt: skip
    trainer = GKDTrainer(
        model=model,
        teacher_model=teacher_model,
        args=training_args,
        processing_class=tokenizer,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
    )
    before = {k: v.clone() for k, v in model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in model.named_parameters())
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert logs["distillation_loss"] >= 0 and "eval_loss" in logs and "entropy" in logs


def test_loss_is_the_generalized_jsd_of_the_full_logits(tiny_model_path, abc_teacher_path, tmp_path):
    args = fast_config(GKDConfig, tmp_path, per_device_train_batch_size=2, max_new_tokens=6, max_steps=1)
    trainer = GKDTrainer(tiny_model_path, abc_teacher_path, args=args, train_dataset=pairs())
    tok = trainer.processing_class
    prompt = tok(["Q1:"], return_tensors="pt").input_ids
    completion = tok(["abca"], return_tensors="pt").input_ids
    batch = {
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
        "completion_mask": torch.ones_like(completion), "completion_lengths": torch.tensor([completion.shape[1]]),
        "num_items_in_batch": torch.tensor(completion.shape[1]),
    }  # fmt: skip
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, batch)
    ids = torch.cat([prompt, completion], 1)
    c = completion.shape[1]
    student_logits = trainer.model(ids).logits[:, -c - 1 : -1]
    teacher_logits = trainer.teacher_model(ids).logits[:, -c - 1 : -1]
    vocab = trainer.vocab_rows
    # temperature 1: TRL's GKD samples at `temperature` (0.9) but its JSD loss uses the raw logits
    expected = generalized_jsd_loss(student_logits[..., :vocab], teacher_logits[..., :vocab], beta=0.5)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_student_moves_toward_the_teacher(tiny_model_path, abc_teacher_path, tmp_path):
    args = fast_config(
        GKDConfig, tmp_path, per_device_train_batch_size=4, max_new_tokens=8, max_steps=30, learning_rate=3e-3,
        lmbda=0.5, beta=0.5, logging_steps=10, seed=0,
    )  # fmt: skip
    trainer = GKDTrainer(tiny_model_path, abc_teacher_path, args=args, train_dataset=pairs(16))
    start = mean_reverse_kl(trainer.model, trainer.teacher_model, trainer.processing_class)
    trainer.train()
    end = mean_reverse_kl(trainer.model.eval(), trainer.teacher_model, trainer.processing_class)
    assert end < 0.75 * start, (start, end)
