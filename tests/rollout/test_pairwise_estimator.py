"""PairwisePreferenceEstimator (Online DPO's ranking) against hand-computed pairs."""

from __future__ import annotations

import torch

from posttrain.rollout.estimators import PairwisePreferenceEstimator


def _run(estimator, rewards, finished):
    batch = {"finished": torch.tensor(finished)}
    return estimator(torch.tensor(rewards).unsqueeze(1), torch.tensor([1.0]), 2, batch=batch, gather=lambda t: t)


def test_chosen_by_score_ties_to_the_first_and_missing_eos_penalty():
    rewards = [1.0, 2.0, 3.0, 3.0, 5.0, 4.0]
    result = _run(PairwisePreferenceEstimator(), rewards, [True] * 6)
    assert result.advantages.tolist() == [-1, 1, 1, -1, 1, -1]  # pair 2 ties: the first completion is chosen
    assert result.metrics["objective/scores"] == 3.0 and result.metrics["val/contain_eos_token"] == 1.0
    assert abs(result.metrics["objective/scores_margin"] - 2 / 3) < 1e-6  # margins 1, 0, 1
    # completion 4 (score 5) has no EOS: 5 − 2 = 3 < 4, so the pair flips
    penalised = _run(PairwisePreferenceEstimator(missing_eos_penalty=2.0), rewards, [True] * 4 + [False, True])
    assert penalised.advantages.tolist() == [-1, 1, 1, -1, -1, 1]
    assert penalised.rewards.tolist() == [1.0, 2.0, 3.0, 3.0, 3.0, 4.0]
    assert abs(penalised.metrics["val/contain_eos_token"] - 5 / 6) < 1e-6
    assert abs(penalised.metrics["objective/scores_margin"] - 2 / 3) < 1e-6  # margins 1, 0, 1
