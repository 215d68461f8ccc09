"""GOLDTrainer / GOLDConfig with two tiny models whose tokenizers differ (byte-level vs. BPE merges, different ids):
TRL's defaults and checks, the ULD loss equals a hand assembly of both models' probabilities (alignment "ab|ca" vs.
"a b|c a", observed merge, sorted L1), the hybrid loss and its metrics, the seed document's examples, the
shared-vocabulary JSD path, and (slow) the extended and positional ULD distances fall."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from distill_helpers import pairs, perturbed_copy
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.experimental.gold import GOLDConfig, GOLDTrainer


def _config(tmp_path, **overrides):
    values = dict(per_device_train_batch_size=2, max_completion_length=6, max_steps=1, learning_rate=1e-3,
                  use_uld_loss=True)  # fmt: skip
    return fast_config(GOLDConfig, tmp_path, **{**values, **overrides})


def _batch(tokenizer, completion: str = "abca"):
    prompt = torch.tensor([tokenizer("Q1:").input_ids])
    ids = torch.tensor([tokenizer(completion).input_ids + [tokenizer.eos_token_id]])
    return {
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": ids,
        "completion_mask": torch.ones_like(ids), "completion_lengths": torch.tensor([ids.shape[1]]),
        "num_items_in_batch": torch.tensor(ids.shape[1]),
    }  # fmt: skip


def test_trl_defaults_and_checks(tmp_path):
    args = GOLDConfig(output_dir=str(tmp_path), report_to="none")
    assert (args.learning_rate, args.temperature, args.top_p, args.top_k) == (1e-7, 0.9, 0.95, 0)
    assert (args.lmbda, args.beta, args.max_completion_length, args.use_uld_loss) == (0.5, 0.5, 128, False)
    assert (args.uld_token_merge_strategy, args.use_extended_uld, args.uld_use_hybrid_loss) == ("observed", True, False)
    assert (args.uld_crossentropy_weight, args.uld_distillation_weight) == (0.0, 1.0)
    assert args.uld_skip_student_eos and args.uld_skip_teacher_eos and args.teacher_tokenizer_name_or_path is None
    with pytest.raises(ValueError, match="both be None"):
        GOLDConfig(output_dir=str(tmp_path), report_to="none", uld_hybrid_matched_weight=0.5)
    with pytest.raises(ValueError, match="uld_token_merge_strategy"):
        GOLDConfig(output_dir=str(tmp_path), report_to="none", uld_token_merge_strategy="greedy")


def test_uld_loss_by_hand(tiny_model_path, merged_teacher_path, tmp_path):
    trainer = GOLDTrainer(tiny_model_path, merged_teacher_path, args=_config(tmp_path), train_dataset=pairs())
    tok, ttok = trainer.processing_class, trainer.teacher_tokenizer
    assert ttok.convert_ids_to_tokens(ttok("abca").input_ids) == ["ab", "ca"] and len(tok("abca").input_ids) == 4
    batch = _batch(tok)
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, batch)
    # student: "Q1:" + a b c a (EOS skipped); logits at the answer positions ("observed" slicing)
    s_ids = tok("abca").input_ids
    ids = torch.cat([batch["prompt_ids"], torch.tensor([s_ids])], 1)
    p = batch["prompt_ids"].shape[1]
    s_probs = F.softmax(trainer.model(ids).logits[0, p : p + 4].float(), -1)
    # teacher: "Q1:" + "ab" "ca"
    t_prompt, t_ids = ttok("Q1:").input_ids, ttok("abca").input_ids
    with torch.no_grad():
        t_logits = trainer.teacher_model(torch.tensor([t_prompt + t_ids])).logits[0, len(t_prompt) : len(t_prompt) + 2]
    t_probs = F.softmax(t_logits.float(), -1)
    # groups: student [0,1] | [2,3], teacher [0] | [1]; observed merge: first row × p(actual later token)
    merged = torch.stack([s_probs[0] * s_probs[1, s_ids[1]], s_probs[2] * s_probs[3, s_ids[3]]])
    s_sorted = merged.sort(-1, descending=True).values
    t_sorted = t_probs.sort(-1, descending=True).values
    width = max(s_sorted.shape[1], t_sorted.shape[1])
    s_sorted, t_sorted = F.pad(s_sorted, (0, width - s_sorted.shape[1])), F.pad(t_sorted, (0, width - t_sorted.shape[1]))
    expected = (s_sorted - t_sorted).abs().sum() / 2
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert loss.requires_grad


def test_hybrid_loss_and_metrics(tiny_model_path, merged_teacher_path, tmp_path):
    args = _config(tmp_path, uld_use_hybrid_loss=True, uld_crossentropy_weight=0.1, max_steps=2, lmbda=0.5)
    trainer = GOLDTrainer(tiny_model_path, merged_teacher_path, args=args, train_dataset=pairs())
    teacher_ids, student_ids = trainer._mapping
    assert len(teacher_ids) == 260  # the 256 bytes + 4 specials share strings; the merges do not
    assert trainer.teacher_tokenizer.convert_ids_to_tokens(int(teacher_ids[10])) == trainer.processing_class.convert_ids_to_tokens(int(student_ids[10]))  # noqa: E501
    trainer.train()
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert "uld/matched_loss" in logs and "uld/unmatched_loss" in logs and logs["distillation_loss"] > 0


def test_seed_doc_example_runs(tiny_model_path, merged_teacher_path, tmp_path):
    """The GOLD page's explicit example after s/trl/posttrain/: tiny student and other-tokenizer teacher, messages."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    teacher_model = AutoModelForCausalLM.from_pretrained(merged_teacher_path)
    train_dataset = Dataset.from_list(
        [{"messages": [{"role": "user", "content": "What color is the sky?"},
                       {"role": "assistant", "content": "It is blue."}]}] * 4  # fmt: skip
    )
    training_args = fast_config(
        GOLDConfig, tmp_path, per_device_train_batch_size=1, teacher_model_name_or_path=merged_teacher_path,
        teacher_tokenizer_name_or_path=merged_teacher_path, use_uld_loss=True, uld_use_hybrid_loss=True,
        max_completion_length=8, max_steps=2,
    )  # fmt: skip
    trainer = GOLDTrainer(model=model, teacher_model=teacher_model, args=training_args, processing_class=tokenizer,
                          train_dataset=train_dataset)  # fmt: skip
    trainer.train()
    assert trainer.state.global_step == 2
    # the quick-start form: both models as paths
    quick = GOLDTrainer(model=tiny_model_path, teacher_model=merged_teacher_path, train_dataset=train_dataset,
                        args=fast_config(GOLDConfig, tmp_path / "q", use_uld_loss=True, max_steps=1,
                                         per_device_train_batch_size=1, max_completion_length=4,
                                         teacher_tokenizer_name_or_path=merged_teacher_path))  # fmt: skip
    quick.train()


def test_without_uld_a_different_vocabulary_is_refused(tiny_model_path, merged_teacher_path, tmp_path):
    with pytest.raises(ValueError):
        GOLDTrainer(tiny_model_path, merged_teacher_path, args=_config(tmp_path, use_uld_loss=False),
                    train_dataset=pairs())  # fmt: skip


def _loss_before_and_after_training(trainer, batch) -> tuple[float, float]:
    """The eval-mode ULD loss on ``batch`` before and after ``trainer.train()``."""
    losses = []
    for run in (None, trainer.train):
        if run is not None:
            run()
        trainer.model.eval()
        with torch.no_grad():
            losses.append(trainer._compute_loss(trainer.model, batch).item())
    return losses[0], losses[1]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["observed", "bayesian"])
def test_extended_uld_distance_falls(abc_teacher_path, merged_teacher_path, tmp_path, strategy):
    """TRL's default extended ULD (byte-offset alignment, merged split tokens) falls to near 0 in 30 steps for a
    student that starts near a model of the task (a perturbed copy of the byte-level "abc" teacher). From a random
    student it barely moves — in TRL too (same values and the same 30-step trajectory on the same inputs): a group
    of k student tokens is merged into p(base) · Π p(later tokens) ≈ V^-(k-1) mass, and the sorted L1 against the
    teacher's unit-mass row then pulls that mass down rather than up."""
    student = perturbed_copy(abc_teacher_path, str(tmp_path / "student"), scale=0.1)
    # lr 3e-3: at 1e-2 Adam overshoots on some builds into a saturated student (loss 1, gradient 0)
    args = _config(tmp_path, per_device_train_batch_size=4, max_completion_length=8, max_steps=30,
                   learning_rate=3e-3, lmbda=0.0, logging_steps=10, uld_token_merge_strategy=strategy)  # fmt: skip
    assert args.use_extended_uld
    trainer = GOLDTrainer(student, merged_teacher_path, args=args, train_dataset=pairs(16))
    start, end = _loss_before_and_after_training(trainer, _batch(trainer.processing_class, "abcabc"))
    assert start > 0.4 and end < 0.1 * start, (start, end)


@pytest.mark.slow
def test_uld_distance_falls(tiny_model_path, merged_teacher_path, tmp_path):
    """The ULD paper's positional loss (use_extended_uld=False) falls from ~2 to near 0 in 30 steps from a random
    student (see the extended test above for why the extended loss needs a non-uniform start)."""
    args = _config(tmp_path, per_device_train_batch_size=4, max_completion_length=8, max_steps=30,
                   learning_rate=1e-2, lmbda=0.0, logging_steps=10, use_extended_uld=False)  # fmt: skip
    trainer = GOLDTrainer(tiny_model_path, merged_teacher_path, args=args, train_dataset=pairs(16))
    start, end = _loss_before_and_after_training(trainer, _batch(trainer.processing_class, "abcabc"))
    assert start > 1.0 and end < 0.1 * start, (start, end)
