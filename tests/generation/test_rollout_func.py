"""RolloutFuncBackend: TRL's rollout_func(prompts, trainer) contract, validation and extra fields."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from posttrain.generation import SamplingConfig
from posttrain.generation.rollout_func import RolloutFuncBackend

pytestmark = pytest.mark.filterwarnings("ignore:rollout_func is experimental")


def fake_rollout(prompts, trainer):
    """Echo rollouts: two turns separated by an EOS, the second one an environment turn."""
    trainer.calls.append(list(prompts))
    n = len(prompts)
    return {
        "prompt_ids": [[ord(c) for c in str(p)[:3]] for p in prompts],
        "completion_ids": [[65, 258, 66, 67, 258][: 5 - (i % 2)] for i in range(n)],
        "logprobs": [[-0.5] * (5 - (i % 2)) for i in range(n)],
        "env_mask": [[1, 1, 0, 0, 1][: 5 - (i % 2)] for i in range(n)],
        "difficulty": [f"d{i}" for i in range(n)],
    }


@pytest.fixture()
def trainer(tokenizer):
    return SimpleNamespace(calls=[], processing_class=tokenizer)


def test_generate_from_prompts_passes_raw_prompts_and_collects_fields(trainer):
    backend = RolloutFuncBackend(fake_rollout, trainer)
    prompts = [[{"role": "user", "content": "hi"}], "plain text"]
    out = backend.generate_from_prompts(prompts, num_generations=2)
    assert trainer.calls == [[prompts[0], prompts[0], prompts[1], prompts[1]]]  # raw, repeated G times, in order
    assert out.completion_ids[0] == [65, 258, 66, 67, 258]  # not cut at the first EOS: multi-turn
    assert out.finished == [True, False, True, False]  # last token is EOS or not
    assert out.logprobs[1] == [-0.5] * 4
    assert out.extra == {
        "env_mask": [[1, 1, 0, 0, 1], [1, 1, 0, 0], [1, 1, 0, 0, 1], [1, 1, 0, 0]],
        "difficulty": ["d0", "d1", "d2", "d3"],
    }
    assert out.prompt_ids[2] == [ord(c) for c in "pla"]


def test_generate_decodes_prompt_ids_for_text_functions(trainer, tokenizer):
    backend = RolloutFuncBackend(fake_rollout, trainer)
    ids = tokenizer("<|im_start|>user\nhey")["input_ids"]
    sampling = SamplingConfig(8, eos_token_ids=[67], pad_token_id=259)
    out = backend.generate([ids], sampling, num_generations=1)
    assert trainer.calls == [["<|im_start|>user\nhey"]]
    assert out.finished == [False]  # the sampling config's EOS ids (67) are used, not the tokenizer's


def test_missing_required_keys_are_named(trainer):
    backend = RolloutFuncBackend(lambda prompts, t: {"completion_ids": [[1]] * len(prompts)}, trainer)
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['prompt_ids', 'logprobs'\]"):
        backend.generate_from_prompts(["x"])


def test_bad_shapes_and_types(trainer):
    def rows_mismatch(prompts, t):
        return {"prompt_ids": [[1]], "completion_ids": [[1], [2]], "logprobs": [[0.0], [0.0]]}

    with pytest.raises(ValueError, match="'prompt_ids' with 1 rows; expected .* one entry per prompt \\(2\\)"):
        RolloutFuncBackend(rows_mismatch, trainer).generate_from_prompts(["a", "b"])

    def short_logprobs(prompts, t):
        return {"prompt_ids": [[1]], "completion_ids": [[1, 2]], "logprobs": [[0.0]]}

    with pytest.raises(ValueError, match=r"logprobs\[0\] with 1 values but completion_ids\[0\] has 2"):
        RolloutFuncBackend(short_logprobs, trainer).generate_from_prompts(["a"])

    def bad_env_mask(prompts, t):
        return {"prompt_ids": [[1]], "completion_ids": [[1, 2]], "logprobs": [[0.0, 0.0]], "env_mask": [[1]]}

    with pytest.raises(ValueError, match=r"env_mask\[0\]"):
        RolloutFuncBackend(bad_env_mask, trainer).generate_from_prompts(["a"])

    with pytest.raises(TypeError, match="must return a dict"):
        RolloutFuncBackend(lambda p, t: [1, 2], trainer).generate_from_prompts(["a"])
    with pytest.raises(TypeError, match="must be callable"):
        RolloutFuncBackend("not a function", trainer)


def test_tensors_and_none_logprobs_are_accepted(trainer):
    def tensor_rollout(prompts, t):
        return {"prompt_ids": torch.tensor([[1, 2]]), "completion_ids": torch.tensor([[3, 258]]), "logprobs": None}

    out = RolloutFuncBackend(tensor_rollout, trainer).generate_from_prompts(["a"])
    assert out.prompt_ids == [[1, 2]] and out.completion_ids == [[3, 258]] and out.finished == [True]
    assert out.logprobs is None


def test_experimental_warning(trainer, monkeypatch):
    import posttrain.generation.rollout_func as module

    monkeypatch.setattr(module, "_warned", False)
    monkeypatch.delenv("TRL_EXPERIMENTAL_SILENCE", raising=False)
    with pytest.warns(UserWarning, match="experimental"):
        RolloutFuncBackend(fake_rollout, trainer).generate_from_prompts(["a"])
