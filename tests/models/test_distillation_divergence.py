"""``models.distillation_scoring.token_divergence``: the chunked hidden-state path equals the plain logits path over
the compared head rows, and the moved helpers keep their older ``rollout.distillation`` import path."""

from __future__ import annotations

import pytest
import torch

from posttrain.core.distill import generalized_jsd_loss
from posttrain.models.distillation_scoring import DistillationScores, token_divergence


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_hidden_and_logits_paths_agree_on_the_first_vocab_rows(beta):
    gen = torch.Generator().manual_seed(0)
    n, h, v, rows = 7, 5, 12, 10  # heads with 2 padding rows beyond the compared ones
    s_hidden, t_hidden = torch.randn(n, h, generator=gen), torch.randn(n, h, generator=gen)
    s_weight, t_weight = torch.randn(v, h, generator=gen), torch.randn(v, h, generator=gen)
    tokens = torch.randint(0, rows, (n,), generator=gen)
    student = DistillationScores(tokens, hidden=s_hidden, weight=s_weight)
    teacher = DistillationScores(tokens, hidden=t_hidden, weight=t_weight)
    chunked, entropy = token_divergence(student, teacher, vocab_rows=rows, beta=beta, temperature=0.7, chunk_size=3)

    s_logits, t_logits = s_hidden @ s_weight[:rows].T, t_hidden @ t_weight[:rows].T
    plain, plain_entropy = token_divergence(
        DistillationScores(tokens, logits=s_logits), DistillationScores(tokens, logits=t_logits),
        vocab_rows=rows, beta=beta, temperature=0.7,
    )  # fmt: skip
    expected = generalized_jsd_loss(s_logits, t_logits, beta=beta, temperature=0.7, reduction="none")
    assert chunked.shape == entropy.shape == (n,)
    torch.testing.assert_close(chunked, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(plain, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(entropy, plain_entropy, rtol=1e-5, atol=1e-6)


def test_moved_helpers_keep_their_older_import_path():
    from posttrain.models import distillation_scoring, vocabulary
    from posttrain.rollout import distillation

    assert distillation.token_divergence is distillation_scoring.token_divergence
    assert distillation.check_shared_vocabulary is vocabulary.check_shared_vocabulary
    assert distillation.model_vocab_size is vocabulary.model_vocab_size
