"""SamplingConfig (TRL field names, overrides, validation), Completions and EOS truncation."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from posttrain.generation import Completions, GenerationBackend, SamplingConfig, truncate_at_eos
from posttrain.generation.group_sampler import GroupSampler
from posttrain.generation.rollout_func import RolloutFuncBackend
from posttrain.generation.transformers_backend import TransformersBackend


def test_from_args_reads_trl_field_names(tokenizer):
    args = SimpleNamespace(
        max_completion_length=64, temperature=0.7, top_p=0.9, top_k=None, min_p=0.05, repetition_penalty=1.1,
        generation_kwargs={"temperature": 0.5}, cache_implementation="static",
    )  # fmt: skip
    s = SamplingConfig.from_args(args, tokenizer)
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (64, 0.7, 0.9, 0, 0.05)
    assert s.repetition_penalty == 1.1 and s.do_sample and s.cache_implementation == "static"
    assert s.eos_token_ids == [258] and s.pad_token_id == 259
    assert s.generation_kwargs == {"temperature": 0.5}
    assert s.resolved().temperature == 0.5 and s.resolved().generation_kwargs is None


def test_from_args_defaults_are_trls(tokenizer):
    s = SamplingConfig.from_args(SimpleNamespace(), tokenizer)
    assert (s.max_new_tokens, s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (
        512, 1.0, 1.0, 0, None, 1.0,
    )  # fmt: skip
    assert s.generation_kwargs is None and s.cache_implementation is None


def test_from_args_pad_falls_back_to_eos():
    tok = SimpleNamespace(eos_token_id=2, pad_token_id=None)
    s = SamplingConfig.from_args(SimpleNamespace(max_completion_length=4), SimpleNamespace(tokenizer=tok))
    assert s.pad_token_id == 2 and s.eos_token_ids == [2]
    with pytest.raises(ValueError, match="pad_token_id nor an eos_token_id"):
        SamplingConfig.from_args(SimpleNamespace(), SimpleNamespace(eos_token_id=None, pad_token_id=None))


def test_resolved_applies_field_overrides_and_keeps_the_rest():
    s = SamplingConfig(
        8, eos_token_ids=1, pad_token_id=0,
        generation_kwargs={"max_tokens": 3, "eos_token_id": [4, 5], "do_sample": False, "typical_p": 0.9},
    )  # fmt: skip
    r = s.resolved()
    assert (r.max_new_tokens, r.eos_token_ids, r.do_sample) == (3, [4, 5], False)
    assert r.generation_kwargs == {"typical_p": 0.9}
    assert s.max_new_tokens == 8 and s.eos_token_ids == [1]  # the original is untouched


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature must be > 0.*do_sample=False"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"eos_token_ids": []}, "eos_token_ids is empty"),
    ],
)
def test_validation_names_the_option(kwargs, match):
    base = {"max_new_tokens": 4, "eos_token_ids": [1], "pad_token_id": 0}
    with pytest.raises(ValueError, match=match):
        SamplingConfig(**{**base, **kwargs}).resolved()


def test_greedy_allows_zero_temperature():
    SamplingConfig(4, temperature=0.0, do_sample=False, eos_token_ids=[1], pad_token_id=0).resolved()


def test_completions_checks_row_counts():
    c = Completions([[1, 2], [3]], [[-0.1, -0.2], [-0.3]], [True, False], [[9], [9]], extra={"x": ["a", "b"]})
    assert len(c) == 2 and c.num_tokens == 3
    with pytest.raises(ValueError, match="Completions.finished has 1 rows"):
        Completions([[1], [2]], None, [True], [[9], [9]])
    with pytest.raises(ValueError, match="Completions.x has 3 rows"):
        Completions([[1], [2]], None, [True, True], [[9], [9]], extra={"x": [1, 2, 3]})


def test_truncate_at_eos():
    assert truncate_at_eos([5, 6, 2, 7, 2], [2]) == ([5, 6, 2], True)
    assert truncate_at_eos([5, 3, 6], {2, 3}) == ([5, 3], True)
    assert truncate_at_eos([5, 6], [2]) == ([5, 6], False)


def test_backends_implement_the_protocol():
    for cls in (GroupSampler, TransformersBackend, RolloutFuncBackend):
        assert issubclass(cls, GenerationBackend)


def test_importing_the_package_is_cheap():
    code = "import sys, posttrain.generation; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
