"""ServerDistillationTrainer against `posttrain serve` over loopback: TRL's config checks, the served sparse loss
equals the same loss from a local teacher (β = 0 top-k forward KL, β > 0 top-1 support) and by hand, and (slow)
the student moves toward the served teacher."""

from __future__ import annotations

import pytest
import torch
from distill_helpers import mean_reverse_kl, pairs, prompts, served_loss_batch
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.core.distill import sparse_support_divergence
from posttrain.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

pytest.importorskip("fastapi")


@pytest.fixture(scope="module")
def teacher_url(abc_teacher_path):
    from posttrain.serving.app import serve_in_thread
    from posttrain.serving.engine import PosttrainEngine

    with serve_in_thread(PosttrainEngine.from_pretrained(abc_teacher_path, device="cpu")) as url:
        yield url


def _config(tmp_path, url, **overrides):
    values = dict(per_device_train_batch_size=2, max_completion_length=6, max_steps=1, learning_rate=1e-3,
                  teacher_model_server_url=url)  # fmt: skip
    return fast_config(ServerDistillationConfig, tmp_path, **{**values, **overrides})




def _local_log_probs(model, batch, vocab):
    """Each row scored alone without padding: the reference the served (unpadded) sequences must match."""
    rows = []
    for i in range(batch["prompt_ids"].shape[0]):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        n = int(batch["completion_lengths"][i])
        ids = torch.cat([prompt, batch["completion_ids"][i, :n]])[None]
        rows.append(torch.log_softmax(model(ids).logits[0, -n - 1 : -1, :vocab].float(), -1))
    return torch.cat(rows)


def test_trl_checks(tmp_path):
    with pytest.raises(ValueError, match="teacher_model_server_url must be set"):
        ServerDistillationConfig(output_dir=str(tmp_path), report_to="none")
    url = "http://127.0.0.1:1"
    args = ServerDistillationConfig(output_dir=str(tmp_path), report_to="none", teacher_model_server_url=url)
    assert (args.loss_top_k, args.loss_add_tail, args.reverse_kl_top_1_mode, args.beta) == (1, True, "sampled", 1.0)
    with pytest.raises(ValueError, match="loss_top_k must be 1"):
        ServerDistillationConfig(output_dir=str(tmp_path), report_to="none", teacher_model_server_url=url, loss_top_k=3)
    with pytest.raises(ValueError, match="loss_top_k must be positive"):
        ServerDistillationConfig(output_dir=str(tmp_path), report_to="none", teacher_model_server_url=url, beta=0.0,
                                 loss_top_k=0)  # fmt: skip
    with pytest.raises(ValueError, match="argmax"):
        ServerDistillationConfig(output_dir=str(tmp_path), report_to="none", teacher_model_server_url=url,
                                 reverse_kl_top_1_mode="argmax")  # fmt: skip


@pytest.mark.parametrize("beta, top_k", [(0.0, 3), (0.5, 1), (1.0, 1)])
def test_served_loss_by_hand(tiny_model_path, abc_teacher_path, teacher_url, tmp_path, beta, top_k):
    from transformers import AutoModelForCausalLM

    trainer = ServerDistillationTrainer(
        tiny_model_path, args=_config(tmp_path, teacher_url, beta=beta, loss_top_k=top_k), train_dataset=prompts()
    )
    assert trainer.teacher_model is None
    batch = served_loss_batch(trainer.processing_class)
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, batch)
    teacher = AutoModelForCausalLM.from_pretrained(abc_teacher_path)
    s = _local_log_probs(trainer.model, batch, trainer.vocab_rows)
    with torch.no_grad():
        t = _local_log_probs(teacher, batch, trainer.vocab_rows)
    tokens = batch["completion_ids"][batch["completion_mask"].bool()]
    if beta == 0:
        support = t.topk(top_k, -1).indices
    elif beta == 1:
        support = tokens[:, None]
    else:
        support = torch.stack([t.argmax(-1), tokens], -1)
    keep = torch.ones_like(support, dtype=torch.bool)
    if support.shape[1] == 2:
        keep[:, 1] = support[:, 1] != support[:, 0]
    expected = sparse_support_divergence(s.gather(-1, support), t.gather(-1, support), keep, beta=beta).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    loss.backward()
    trainer.served_teacher.close()


def test_trains_end_to_end(tiny_model_path, teacher_url, tmp_path):
    trainer = ServerDistillationTrainer(
        model=tiny_model_path, args=_config(tmp_path, teacher_url, max_steps=2, lmbda=0.5), train_dataset=pairs()
    )
    before = {k: v.clone() for k, v in trainer.model.named_parameters()}
    trainer.train()
    assert any(not torch.equal(before[k], v) for k, v in trainer.model.named_parameters())
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert logs["distillation_loss"] >= 0 and "entropy" in logs


def test_refuses_a_local_teacher(tiny_model_path, teacher_url, tmp_path):
    with pytest.raises(ValueError, match="served"):
        ServerDistillationTrainer(tiny_model_path, tiny_model_path, args=_config(tmp_path, teacher_url),
                                  train_dataset=prompts())  # fmt: skip


@pytest.mark.slow
def test_student_moves_toward_the_served_teacher(tiny_model_path, abc_teacher_path, teacher_url, tmp_path):
    from transformers import AutoModelForCausalLM

    args = _config(tmp_path, teacher_url, per_device_train_batch_size=4, max_completion_length=8, max_steps=30,
                   learning_rate=3e-3, beta=0.0, loss_top_k=8, lmbda=0.0, logging_steps=10)  # fmt: skip
    trainer = ServerDistillationTrainer(tiny_model_path, args=args, train_dataset=pairs(16))
    teacher = AutoModelForCausalLM.from_pretrained(abc_teacher_path)
    start = mean_reverse_kl(trainer.model, teacher, trainer.processing_class)
    trainer.train()
    end = mean_reverse_kl(trainer.model.eval(), teacher, trainer.processing_class)
    assert end < 0.75 * start, (start, end)
