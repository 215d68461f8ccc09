"""IWOPDTrainer / IWOPDConfig: TRL's defaults and checks, the IW-OPD loss equals the hand-assembled
−w·a·log π_θ from both models' logits, the "jsd" objective's sparse top-1 support, a served teacher gives the same
loss as the local one, the seed example, and (slow) the student moves toward the teacher."""

from __future__ import annotations

import pytest
import torch
from distill_helpers import iw_opd_batch, perturbed_copy, prompts, sampled_reverse_kl
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.core.distill import iw_opd_loss, sparse_support_divergence
from posttrain.experimental.iw_opd import IWOPDConfig, IWOPDTrainer


def _config(tmp_path, **overrides):
    values = dict(per_device_train_batch_size=2, max_completion_length=6, max_steps=1, learning_rate=1e-3)
    return fast_config(IWOPDConfig, tmp_path, **{**values, **overrides})


def _log_probs(model, batch, vocab, temperature=1.0):
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    c = batch["completion_ids"].shape[1]
    logits = model(ids).logits[:, -c - 1 : -1, :vocab]
    return torch.log_softmax(logits.float() / temperature, -1)


def test_trl_defaults_and_checks(tmp_path):
    args = IWOPDConfig(output_dir=str(tmp_path), report_to="none")
    assert (args.distillation_objective, args.iw_opd_gamma, args.iw_opd_epsilon) == ("iw_opd", 0.5, 1e-8)
    assert (args.lmbda, args.beta, args.temperature, args.loss_top_k, args.loss_add_tail) == (1.0, 1.0, 1.0, 1, True)
    assert args.reverse_kl_top_1_mode == "sampled" and args.use_teacher_server is False
    assert args.max_completion_length == 512 and args.learning_rate == 1e-6
    with pytest.raises(ValueError, match="requires lmbda=1.0"):
        IWOPDConfig(output_dir=str(tmp_path), report_to="none", lmbda=0.5)
    with pytest.raises(ValueError, match="distillation_objective"):
        IWOPDConfig(output_dir=str(tmp_path), report_to="none", distillation_objective="kl")
    with pytest.raises(ValueError, match="teacher_model_server_url"):
        IWOPDConfig(output_dir=str(tmp_path), report_to="none", use_teacher_server=True)
    with pytest.raises(ValueError, match="loss_top_k must be 1"):
        IWOPDConfig(output_dir=str(tmp_path), report_to="none", use_teacher_server=True,
                    teacher_model_server_url="http://x", loss_top_k=4)  # fmt: skip


def test_iw_opd_loss_matches_the_logits(tiny_model_path, abc_teacher_path, tmp_path):
    trainer = IWOPDTrainer(tiny_model_path, abc_teacher_path, args=_config(tmp_path, iw_opd_gamma=0.7),
                           train_dataset=prompts())  # fmt: skip
    batch = iw_opd_batch(trainer.processing_class)
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, batch)
    tokens = batch["completion_ids"][..., None]
    s = _log_probs(trainer.model, batch, trainer.vocab_rows).gather(-1, tokens).squeeze(-1)
    with torch.no_grad():
        t = _log_probs(trainer.teacher_model, batch, trainer.vocab_rows).gather(-1, tokens).squeeze(-1)
    per_token, _, weights = iw_opd_loss(s, t, batch["completion_mask"], gamma=0.7)
    expected = per_token.sum() / batch["completion_mask"].sum()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    assert weights[0, 0].item() == pytest.approx(1.7)  # nothing accumulated before the first token
    assert loss.requires_grad


def test_jsd_objective_sparse_top1_and_full(tiny_model_path, abc_teacher_path, tmp_path):
    args = _config(tmp_path, distillation_objective="jsd", beta=0.5)
    trainer = IWOPDTrainer(tiny_model_path, abc_teacher_path, args=args, train_dataset=prompts())
    batch = iw_opd_batch(trainer.processing_class)
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, batch)
    mask = batch["completion_mask"].bool()
    s = _log_probs(trainer.model, batch, trainer.vocab_rows)[mask]
    with torch.no_grad():
        t = _log_probs(trainer.teacher_model, batch, trainer.vocab_rows)[mask]
    support = torch.stack([t.argmax(-1), batch["completion_ids"][mask]], -1)  # teacher top-1, sampled token
    keep = torch.stack([torch.ones_like(support[:, 0], dtype=torch.bool), support[:, 1] != support[:, 0]], -1)
    ref = sparse_support_divergence(s.gather(-1, support), t.gather(-1, support), keep, beta=0.5).mean()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    trainer.args.loss_top_k = 0  # the full vocabulary: the distillation trainer's exact JSD
    full = trainer._compute_loss(trainer.model, batch)
    assert full.item() != pytest.approx(loss.item())


def test_served_teacher_gives_the_local_loss(tiny_model_path, abc_teacher_path, tmp_path):
    pytest.importorskip("fastapi")
    from posttrain.serving.app import serve_in_thread
    from posttrain.serving.engine import PosttrainEngine

    local = IWOPDTrainer(tiny_model_path, abc_teacher_path, args=_config(tmp_path / "a"), train_dataset=prompts())
    batch = iw_opd_batch(local.processing_class)
    local.model.train()
    expected = local._compute_loss(local.model, batch)
    engine = PosttrainEngine.from_pretrained(abc_teacher_path, device="cpu")
    with serve_in_thread(engine) as url:
        args = _config(tmp_path / "b", use_teacher_server=True, teacher_model_server_url=url)
        served = IWOPDTrainer(tiny_model_path, args=args, train_dataset=prompts())
        assert served.teacher_model is None
        served.model.train()
        got = served._compute_loss(served.model, batch)
        served.served_teacher.close()
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_seed_doc_example_runs(tiny_model_path, abc_teacher_path, tmp_path):
    """The IW-OPD page's example after s/trl/posttrain/ (tiny models, prompt data, two steps)."""
    training_args = fast_config(
        IWOPDConfig, tmp_path, distillation_objective="iw_opd", iw_opd_gamma=0.5, per_device_train_batch_size=2,
        max_completion_length=6, max_steps=2, learning_rate=1e-3,
    )  # fmt: skip
    trainer = IWOPDTrainer(
        model=tiny_model_path, teacher_model=abc_teacher_path, train_dataset=prompts(), args=training_args
    )
    trainer.train()
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    for name in ("iw_opd/mean_advantage", "iw_opd/mean_weight", "iw_opd/min_weight", "iw_opd/max_weight"):
        assert name in logs
    assert 1.0 <= logs["iw_opd/min_weight"] <= logs["iw_opd/max_weight"] <= 1.5


@pytest.mark.slow
def test_student_moves_toward_the_teacher(abc_teacher_path, tmp_path):
    """The on-policy reverse KL (on the student's own samples) falls for a student that starts near the teacher."""
    student = perturbed_copy(abc_teacher_path, str(tmp_path / "student"))
    args = _config(tmp_path, per_device_train_batch_size=4, max_completion_length=8, max_steps=30,
                   learning_rate=1e-3, logging_steps=10)  # fmt: skip
    trainer = IWOPDTrainer(student, abc_teacher_path, args=args, train_dataset=prompts(16))
    start = sampled_reverse_kl(trainer.model, trainer.teacher_model, trainer.processing_class)
    trainer.train()
    end = sampled_reverse_kl(trainer.model, trainer.teacher_model, trainer.processing_class)
    assert end < 0.5 * start, (start, end)
