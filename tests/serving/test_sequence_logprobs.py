"""``POST /get_sequence_logprobs/`` (teacher scoring for server distillation) over loopback: values equal the served
model's own log-softmax at temperature T, top-k sorted, actual tokens gathered; bad requests are 400s naming the
field."""

from __future__ import annotations

import pytest
import torch

from posttrain.generation.client import ServerRequestError


def test_matches_the_model_log_softmax(client, engine):
    sequences = [[5, 6, 7, 8, 9], [11, 12, 13]]
    prompt_lengths = [2, 1]
    out = client.get_sequence_logprobs(sequences, prompt_lengths, top_logprobs=3, temperature=0.7)
    assert {"logprobs", "logprob_token_ids", "actual_logprobs", "version"} <= set(out)
    for ids, p, top, top_ids, actual in zip(
        sequences, prompt_lengths, out["logprobs"], out["logprob_token_ids"], out["actual_logprobs"]
    ):
        with torch.no_grad():
            logits = engine.model(torch.tensor([ids])).logits[0].float()
        ref = torch.log_softmax(logits[p - 1 : len(ids) - 1] / 0.7, -1)
        assert len(top) == len(ids) - p and all(len(row) == 3 for row in top)
        expected = ref.topk(3, -1)
        torch.testing.assert_close(torch.tensor(top), expected.values, rtol=1e-5, atol=1e-5)
        assert torch.tensor(top_ids).tolist() == expected.indices.tolist()
        gathered = ref.gather(-1, torch.tensor(ids[p:])[:, None])
        torch.testing.assert_close(torch.tensor(actual), gathered, rtol=1e-5, atol=1e-5)


def test_bad_requests_name_the_field(client):
    with pytest.raises(ServerRequestError) as err:
        client.get_sequence_logprobs([[1, 2]], [3])
    assert err.value.param == "prompt_lengths"
    with pytest.raises(ServerRequestError) as err:
        client.get_sequence_logprobs([[1, 10**7]], [1])
    assert err.value.param == "sequences"
