"""The sparse-support / sampled-token distillation losses (IW-OPD, local top-k JSD, teacher-server top-k) are chunked
over loss tokens: for several chunk sizes (uneven last chunk, a masked position) the loss and its gradients equal the
naive full-vocabulary computation, and no tensor with more than ``chunk`` rows of full-vocabulary logits is ever
allocated (forward, recompute and backward), where the naive path allocates one with every loss token."""

from __future__ import annotations

import pytest
import torch
from distill_helpers import LogitsTracker, prompts
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.core.distill import chunked_token_map, iw_opd_loss
from posttrain.experimental._distill_support import local_sparse_divergence, server_sparse_divergence
from posttrain.experimental.iw_opd import IWOPDConfig, IWOPDTrainer


def _batch(tokenizer):
    prompt = torch.tensor([tokenizer("Q1:").input_ids, tokenizer("Q2:").input_ids])
    completion = torch.tensor([tokenizer("abca").input_ids, tokenizer("xyzw").input_ids])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]])  # an ignored position inside the second row
    return {
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
        "completion_mask": mask, "completion_lengths": torch.tensor([4, 4]), "num_items_in_batch": mask.sum(),
    }  # fmt: skip


def _full_log_probs(model, batch, vocab, temperature):
    """Naive: the model's (B, C, V) logits at the completion positions, log-softmaxed, at the loss tokens."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    c = batch["completion_ids"].shape[1]
    logits = model(ids).logits[:, -c - 1 : -1, :vocab]
    return torch.log_softmax(logits.float() / temperature, -1)[batch["completion_mask"].bool()]


class _FakeServer:
    """A teacher "server" answering from the local teacher's full log-probs (no HTTP): top-k and actual-token."""

    def __init__(self, teacher_lp, tokens):
        self.teacher_lp, self.tokens = teacher_lp, tokens

    def score(self, inputs, top_k, temperature):
        top = self.teacher_lp.topk(max(top_k, 1), dim=-1)
        actual = self.teacher_lp.gather(-1, self.tokens[:, None]).squeeze(-1)
        return {"actual_logprobs": actual, "topk_logprobs": top.values, "topk_token_ids": top.indices}


def _naive(trainer, batch, case):
    args, mask = trainer.args, batch["completion_mask"].bool()
    s = _full_log_probs(trainer.model, batch, trainer.vocab_rows, args.temperature)
    with torch.no_grad():
        t = _full_log_probs(trainer.teacher_model, batch, trainer.vocab_rows, args.temperature)
    tokens = batch["completion_ids"][mask]
    if case["distillation_objective"] == "iw_opd":
        rows = lambda v: v.new_zeros(mask.shape).masked_scatter(mask, v)  # noqa: E731
        sa, ta = s.gather(-1, tokens[:, None]).squeeze(-1), t.gather(-1, tokens[:, None]).squeeze(-1)
        per_token = iw_opd_loss(rows(sa), rows(ta), mask, gamma=args.iw_opd_gamma)[0][mask]
    elif case.get("server"):
        per_token = server_sparse_divergence(
            s, tokens, _FakeServer(t, tokens).score(None, args.loss_top_k, 1.0), beta=args.beta,
            add_tail=args.loss_add_tail,
        )  # fmt: skip
    else:
        per_token = local_sparse_divergence(
            s, t, tokens, beta=args.beta, top_k=args.loss_top_k, add_tail=args.loss_add_tail,
            reverse_top_1_mode=args.reverse_kl_top_1_mode,
        )  # fmt: skip
    return per_token.sum() / mask.sum()


CASES = [
    dict(distillation_objective="iw_opd", iw_opd_gamma=0.7),
    dict(distillation_objective="jsd", beta=0.0, loss_top_k=3),
    dict(distillation_objective="jsd", beta=0.5, loss_top_k=1),
    dict(distillation_objective="jsd", beta=0.5, loss_top_k=2, loss_add_tail=False),
    dict(distillation_objective="jsd", beta=1.0, loss_top_k=1, reverse_kl_top_1_mode="argmax"),
    dict(distillation_objective="jsd", beta=0.0, loss_top_k=3, server=True),
    dict(distillation_objective="jsd", beta=0.5, loss_top_k=1, server=True),
]


@pytest.fixture(scope="module")
def trainer(tiny_model_path, abc_teacher_path, tmp_path_factory):
    args = fast_config(IWOPDConfig, tmp_path_factory.mktemp("chunked"), per_device_train_batch_size=2,
                       max_completion_length=6, max_steps=1, temperature=0.8)  # fmt: skip
    trainer = IWOPDTrainer(tiny_model_path, abc_teacher_path, args=args, train_dataset=prompts())
    trainer.model.train()
    return trainer


def _grads(model, loss):
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True, materialize_grads=True)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_chunked_equals_naive_values_and_gradients(trainer, case, monkeypatch):
    for key, value in case.items():
        if key != "server":
            monkeypatch.setattr(trainer.args, key, value)
    batch = _batch(trainer.processing_class)
    if case.get("server"):
        with torch.no_grad():
            t = _full_log_probs(trainer.teacher_model, batch, trainer.vocab_rows, trainer.args.temperature)
        fake = _FakeServer(t, batch["completion_ids"][batch["completion_mask"].bool()])
        monkeypatch.setattr(trainer, "_uses_teacher_server", lambda args: True)
        monkeypatch.setattr(trainer, "served_teacher", fake)
    expected = _naive(trainer, batch, case)
    expected_grads = _grads(trainer.model, expected)
    for chunk in (1, 3, 4, 100):  # 7 loss tokens: uneven last chunks, one chunk
        monkeypatch.setattr(trainer, "loss_chunk_size", chunk)
        loss = trainer._compute_loss(trainer.model, batch)
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        for got, want in zip(_grads(trainer.model, loss), expected_grads):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)  # float32 sums in another order


@pytest.mark.parametrize("case", [CASES[0], CASES[2]], ids=["iw_opd", "jsd-top1"])
def test_no_full_batch_logits_in_forward_or_backward(trainer, case, monkeypatch):
    for key, value in case.items():
        monkeypatch.setattr(trainer.args, key, value)
    batch = _batch(trainer.processing_class)
    monkeypatch.setattr(trainer, "loss_chunk_size", 2)
    with LogitsTracker(trainer.vocab_rows) as tracker:
        trainer._compute_loss(trainer.model, batch).backward()
    trainer.model.zero_grad()
    # 7 loss tokens in the micro-batch; the largest (rows, V) block holds one chunk (naive: all 7 rows)
    assert tracker.rows == 2, tracker.rows
    print(f"largest logits block: {tracker.rows} rows x {trainer.vocab_rows} = {tracker.bytes} bytes")


def test_chunked_token_map_empty_and_detached_outputs():
    hidden = torch.randn(5, 4, requires_grad=True)
    weight = torch.randn(11, 4, requires_grad=True)
    fn = lambda lp, rows: (lp[:, 0], (-(lp.exp() * lp).sum(-1)).detach())  # noqa: E731
    first, entropy = chunked_token_map(lambda rows: hidden[rows] @ weight.T, 5, fn, chunk_size=2, temperature=2.0)
    ref = torch.log_softmax(hidden @ weight.T / 2.0, -1)
    torch.testing.assert_close(first, ref[:, 0])
    assert not entropy.requires_grad and first.requires_grad
    g = torch.autograd.grad(first.sum(), (hidden, weight))
    g_ref = torch.autograd.grad(ref[:, 0].sum(), (hidden, weight))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)
    empty, _ = chunked_token_map(lambda rows: hidden[rows] @ weight.T, 0, fn, chunk_size=2)
    assert empty.shape == (0,)
