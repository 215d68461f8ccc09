"""IW-OPD's behaviour log-prob is the sampler's, as TRL's (vLLM ``rollout_logprobs``): the rollout records the
student sampler's per-token log-probs, and the advantage a_t = log π_T(y_t) − log π_rollout(y_t) and the prefix
weights are computed from them — by hand here for a stale sampler, and end to end with a top-k-truncated sampler,
where they differ from the current student's; without them the current log-probs are used."""

from __future__ import annotations

import math

import pytest
import torch
from distill_helpers import iw_opd_batch, prompts
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.experimental.iw_opd import IWOPDConfig, IWOPDTrainer


def _config(tmp_path, **overrides):
    values = dict(per_device_train_batch_size=2, max_completion_length=4, max_steps=1, learning_rate=1e-3)
    return fast_config(IWOPDConfig, tmp_path, **{**values, **overrides})


def _token_log_probs(model, batch, vocab, temperature=1.0):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    c = batch["completion_ids"].shape[1]
    logits = model(ids, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0)).logits
    lp = torch.log_softmax(logits[:, -c - 1 : -1, :vocab].float() / temperature, -1)
    return lp.gather(-1, batch["completion_ids"][..., None]).squeeze(-1)


def _hand_iw_opd(student, teacher, behaviour, mask, gamma):
    """Σ_t −w_t·a_t·log π_θ(y_t) / tokens with plain loops: a = teacher − behaviour, w_t = 1 + γ(1 − c_t / Σ|a|)."""
    total, count = 0.0, 0
    for b in range(student.shape[0]):
        cols = [t for t in range(student.shape[1]) if mask[b, t]]
        a = [float(teacher[b, t] - behaviour[b, t]) for t in cols]
        denom = max(sum(abs(x) for x in a), 1e-8)
        prefix = 0.0
        for k, t in enumerate(cols):
            w = 1.0 + gamma * (1.0 - prefix / denom)
            total += -w * a[k] * float(student[b, t])
            prefix += abs(a[k])
            count += 1
    return total / count


def test_stale_sampler_log_probs_are_the_behaviour_policy(tiny_model_path, abc_teacher_path, tmp_path):
    """A rollout sampled by older weights (e.g. vllm_sync_frequency > 1): its recorded log-probs, not the current
    student's, give the advantages and weights."""
    trainer = IWOPDTrainer(tiny_model_path, abc_teacher_path, args=_config(tmp_path, iw_opd_gamma=0.5),
                           train_dataset=prompts())  # fmt: skip
    trainer.model.train()
    batch = iw_opd_batch(trainer.processing_class)
    student = _token_log_probs(trainer.model, batch, trainer.vocab_rows)
    with torch.no_grad():
        teacher = _token_log_probs(trainer.teacher_model, batch, trainer.vocab_rows)
    stale = student.detach() + torch.tensor([[0.5, -1.0, 2.0, 0.3], [-0.7, 0.1, 1.5, 9.0]])  # 9.0: a padded slot
    mask = batch["completion_mask"].bool()
    current = trainer._compute_loss(trainer.model, batch)
    got = trainer._compute_loss(trainer.model, {**batch, "sampling_per_token_logps": stale})
    expected = _hand_iw_opd(student.detach(), teacher, stale, mask, 0.5)
    assert got.item() == pytest.approx(expected, rel=1e-5)
    assert current.item() == pytest.approx(_hand_iw_opd(student.detach(), teacher, student.detach(), mask, 0.5), rel=1e-5)
    assert abs(got.item() - current.item()) > 0.1
    # gradient: −w·a·∇log π_θ with the stale advantages
    (grad,) = torch.autograd.grad(got, trainer.model.lm_head.weight)
    (grad_current,) = torch.autograd.grad(current, trainer.model.lm_head.weight)
    assert not torch.allclose(grad, grad_current)


def test_rollout_records_the_samplers_processed_log_probs(tiny_model_path, abc_teacher_path, tmp_path):
    """With top-k sampling the sampler's log-probs are those of the renormalised top-k distribution (TRL/vLLM's
    processed log-probs): higher than the student's full-vocabulary ones, and the loss uses them."""
    args = _config(tmp_path, top_k=3, temperature=0.8, iw_opd_gamma=0.7)
    trainer = IWOPDTrainer(tiny_model_path, abc_teacher_path, args=args, train_dataset=prompts())
    rows = [{"prompt": f"Q{i}:"} for i in range(2)]
    torch.manual_seed(0)
    batch = trainer._generate_and_score(rows, "train")
    assert "sampling_per_token_logps" in batch
    mask = batch["completion_mask"].bool()
    sampled = batch["sampling_per_token_logps"]
    trainer.model.train()
    student = _token_log_probs(trainer.model, batch, trainer.vocab_rows, 0.8)
    # the top-3 renormalisation: log p_k − log Σ_{top 3} p  (≥ log p_k)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    c = batch["completion_ids"].shape[1]
    with torch.no_grad():
        logits = trainer.model(ids, attention_mask=attention, position_ids=(attention.cumsum(1) - 1).clamp(min=0))
        lp = torch.log_softmax(logits.logits[:, -c - 1 : -1].float() / 0.8, -1)
        top3 = lp.topk(3, -1).values.logsumexp(-1)
    torch.testing.assert_close(sampled[mask], (student.detach() - top3)[mask], rtol=1e-4, atol=1e-4)
    assert (sampled[mask] > student.detach()[mask] + 1e-3).all()
    with torch.no_grad():
        teacher = _token_log_probs(trainer.teacher_model, batch, trainer.vocab_rows, 0.8)
    loss = trainer._compute_loss(trainer.model, batch)
    expected = _hand_iw_opd(student.detach(), teacher, sampled, mask, 0.7) * mask.sum().item()
    expected /= float(batch["num_items_in_batch"])
    assert loss.item() == pytest.approx(expected, rel=1e-4)
    assert not math.isclose(
        loss.item(), _hand_iw_opd(student.detach(), teacher, student.detach(), mask, 0.7), rel_tol=1e-3
    )
