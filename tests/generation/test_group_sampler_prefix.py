"""GroupSampler's shared-prefix prefill: when a batch's distinct prompts share ≥ ``SHARED_PREFIX_MIN_TOKENS`` leading
tokens (a system prompt), the prefix is prefilled once and each prompt's rest after it. It must give the full
prefill's logits, greedy tokens, sampled tokens and log-probs (repetition penalty, truncation, kept mass, sampling
mask, 2-D and boolean 4-D decode masks, batch splitting, MoE routing records), and be taken only when it applies."""

from __future__ import annotations

import pytest
import torch
from generation_helpers import EOS, PAD, hand_logprobs, hf_generate, make_model

import posttrain.generation.group_sampler as gs
from posttrain.generation import GroupSampler, SamplingConfig
from posttrain.generation.transformers_backend import left_pad

SYSTEM = list(b"<|system|>You are a careful assistant. Think step by step, then answer briefly.\n<|user|>")


@pytest.fixture()
def shared() -> list[list[int]]:
    """Prompts sharing the ``SYSTEM`` prefix (88 tokens) with rests of 1-28 tokens, all starting with "H": the
    common part is ``SYSTEM`` + "H", but the prompt ``SYSTEM`` + "H" must keep its last token for its logits, so
    the shared prefix is ``SYSTEM``."""
    assert len(SYSTEM) >= gs.SHARED_PREFIX_MIN_TOKENS
    return [SYSTEM + list(b"Hi"), SYSTEM + list(b"H"), SYSTEM + list(b"How far is the capital of France?"),
            SYSTEM + list(b"Hzz top"), SYSTEM + list(b"Hmm: 2+2?")]


def _full_prefill(monkeypatch, run):
    """``run()`` with the shared-prefix prefill off (the threshold out of reach): the reference path."""
    with monkeypatch.context() as m:
        m.setattr(gs, "SHARED_PREFIX_MIN_TOKENS", 10**9)
        return run()


def _close(a: list[list[float]], b: list[list[float]], atol: float = 1e-5) -> None:
    assert [len(x) for x in a] == [len(x) for x in b]
    torch.testing.assert_close([torch.tensor(x) for x in a], [torch.tensor(x) for x in b], rtol=0, atol=atol)


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_shared_prefill_gives_the_full_prefills_logits_and_next_step(request, shared, arch):
    """The prefill's last-token logits and one decode step's logits after it equal the full left-padded prefill's
    (1e-5), and the cache layout's mask counts each prompt's real tokens (the next token's position)."""
    model = request.getfixturevalue(arch)
    prefix = gs._shared_prefix_length(shared)
    assert prefix == len(SYSTEM)  # one short of the common part: SYSTEM + "H" keeps its last token
    cache_kw = gs._cache_kwarg(model)
    lengths = torch.tensor([len(p) for p in shared])
    step = torch.tensor([[7], [8], [9], [10], [11]])  # (U, 1) one fed token per row
    with torch.inference_mode():
        from transformers import DynamicCache

        ids, mask = left_pad(shared, PAD)
        full_cache = DynamicCache(config=model.config)
        full = gs._forward_last(model, ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), full_cache, cache_kw)
        full_next = gs._forward_last(
            model, step, torch.cat([mask, torch.ones_like(step)], 1), lengths[:, None], full_cache, cache_kw
        )
        cache = DynamicCache(config=model.config)
        logits, layout = gs._prefill_shared_prefix(model, shared, prefix, PAD, cache, cache_kw)
        nxt = gs._forward_last(
            model, step, torch.cat([layout, torch.ones_like(step)], 1), layout.sum(-1)[:, None], cache, cache_kw
        )
    assert layout.shape == (len(shared), max(lengths).item()) and torch.equal(layout.sum(-1), lengths)
    assert (layout[:, :prefix] == 1).all()
    torch.testing.assert_close(logits, full, rtol=0, atol=1e-5)
    torch.testing.assert_close(nxt, full_next, rtol=0, atol=1e-5)
    assert not torch.allclose(logits[0], logits[2])  # the rests matter


@pytest.mark.parametrize("arch", ["llama", "qwen"])
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_tokens_equal_the_full_prefill_and_generate(request, shared, monkeypatch, arch, g, penalty):
    model = request.getfixturevalue(arch)
    sampling = SamplingConfig(20, do_sample=False, repetition_penalty=penalty, eos_token_ids=[EOS], pad_token_id=PAD)
    sampler = GroupSampler(model)
    out = sampler.generate(shared, sampling, num_generations=g)
    assert sampler.last_stats["shared_prefix_tokens"] == len(SYSTEM)
    rest_width = max(map(len, shared)) - len(SYSTEM)
    assert sampler.last_stats["prefill_tokens"] == len(SYSTEM) + len(shared) * rest_width
    full = _full_prefill(monkeypatch, lambda: GroupSampler(model).generate(shared, sampling, num_generations=g))
    assert out.completion_ids == full.completion_ids and out.finished == full.finished
    _close(out.logprobs, full.logprobs)
    expected = hf_generate(model, shared, g, do_sample=False, max_new_tokens=20, repetition_penalty=penalty)
    assert out.completion_ids == expected
    if arch == "llama":  # the case is informative: rows end at different steps (they are dropped from the batch)
        assert len({len(c) for c in out.completion_ids}) > 1


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_sampled_tokens_logprobs_kept_mass_and_masks_equal_the_full_prefill(request, shared, monkeypatch, arch):
    """Seeded sampling (penalty, temperature, top-p, min-p; kept mass and sampling mask recorded): the same tokens
    (no draw of these seeds sits within float noise of a CDF boundary) and log-probs within 1e-5."""
    model = request.getfixturevalue(arch)
    sampling = SamplingConfig(
        16, temperature=0.8, top_p=0.9, min_p=0.02, repetition_penalty=1.2, eos_token_ids=[EOS], pad_token_id=PAD,
        return_sampling_mask=True,
    )

    def run():
        sampler = GroupSampler(model, generator=torch.Generator().manual_seed(11), top_logprobs=3)
        return sampler, sampler.generate(shared, sampling, num_generations=4)

    sampler, out = run()
    assert sampler.last_stats["shared_prefix_tokens"] > 0
    reference, full = _full_prefill(monkeypatch, run)
    assert reference.last_stats["shared_prefix_tokens"] == 0
    assert out.completion_ids == full.completion_ids and out.finished == full.finished
    _close(out.logprobs, full.logprobs)
    _close(out.log_kept_mass, full.log_kept_mass)
    for mine, theirs in zip(out.sampling_mask, full.sampling_mask):  # kept ids, or a float threshold, per token
        assert len(mine) == len(theirs)
        for a, b in zip(mine, theirs):
            assert type(a) is type(b) and (a == b if not isinstance(a, float) else abs(a - b) < 1e-4)
    for mine, theirs in zip(sampler.last_top_logprobs, reference.last_top_logprobs):
        assert [[t for t, _ in s] for s in mine] == [[t for t, _ in s] for s in theirs]
    assert len({tuple(c) for c in out.completion_ids}) > len(shared)  # the G samples of a prompt differ


def test_repetition_penalty_sees_exactly_the_prompt_tokens(tokenizer, shared):
    """The penalised log-probs equal a plain unpadded forward's with the penalty over prompt + earlier completion
    tokens. The pad token is made likely, so penalising it (pads in the history) would move every log-prob."""
    model = make_model(tokenizer, "llama", eos_bias=1.0)
    bias = torch.zeros(model.config.vocab_size)
    bias[PAD] = 3.0
    model.lm_head.register_forward_hook(lambda module, args, out: out + bias)
    knobs = dict(temperature=0.9, penalty=1.5)
    sampling = SamplingConfig(8, temperature=0.9, repetition_penalty=1.5, eos_token_ids=[EOS], pad_token_id=PAD)
    sampler = GroupSampler(model, generator=torch.Generator().manual_seed(3))
    out = sampler.generate(shared, sampling, num_generations=2)
    assert sampler.last_stats["shared_prefix_tokens"] > 0
    power = 0.0
    for prompt, ids, lps in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0]  # (P + T, V), unpadded
        for t, (token, lp) in enumerate(zip(ids, lps)):
            row = logits[len(prompt) + t - 1]
            want = hand_logprobs(row, prompt + ids[:t], **knobs)[token]
            assert abs(want.item() - lp) < 1e-4
            with_pad = hand_logprobs(row, prompt + ids[:t] + [PAD], **knobs)[token]
            power = max(power, abs(with_pad.item() - lp))
    assert power > 1e-2  # a history with pad tokens in it would have been caught


def test_taken_only_from_the_threshold_on(llama, greedy, monkeypatch):
    """A prefix of exactly SHARED_PREFIX_MIN_TOKENS is shared; one token shorter, the batch is prefilled as before
    (all padded prompt tokens, same results bit for bit as with the path switched off)."""
    n = gs.SHARED_PREFIX_MIN_TOKENS
    base = list(range(60, 60 + n))
    at = [base + [5, 6, 7], base + [8]]
    below = [base[:-1] + [5, 6, 7], base[:-1] + [9, 8]]
    sampler = GroupSampler(llama)
    sampler.generate(at, greedy, 2)
    assert sampler.last_stats["shared_prefix_tokens"] == n
    assert sampler.last_stats["prefill_tokens"] == n + 2 * 3
    out = sampler.generate(below, greedy, 2)
    assert sampler.last_stats["shared_prefix_tokens"] == 0
    assert sampler.last_stats["prefill_tokens"] == 2 * (n + 2)
    off = _full_prefill(monkeypatch, lambda: GroupSampler(llama).generate(below, greedy, 2))
    assert out.completion_ids == off.completion_ids and out.logprobs == off.logprobs  # bitwise: same path


def test_not_taken_for_one_distinct_prompt_or_windowed_attention(llama, shared, greedy, tokenizer):
    sampler = GroupSampler(llama)
    sampler.generate([shared[2], shared[2], shared[2]], greedy, 2)  # merged into one prefill row
    assert sampler.last_stats["prefill_rows"] == 1 and sampler.last_stats["shared_prefix_tokens"] == 0
    sampler.generate([shared[2]], greedy, 3)
    assert sampler.last_stats["shared_prefix_tokens"] == 0

    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    assert gs._may_share_prefix(llama)
    prompt_learning = SimpleNamespace(config=llama.config, active_peft_config=SimpleNamespace(is_prompt_learning=True))
    assert not gs._may_share_prefix(prompt_learning)
    config = Qwen2Config(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, use_sliding_window=True, sliding_window=16, max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    windowed = Qwen2ForCausalLM(config).eval()
    assert not gs._may_share_prefix(windowed)  # padding inside the window would shrink it
    sampler = GroupSampler(windowed)
    out = sampler.generate(shared, greedy, 2)
    assert sampler.last_stats["shared_prefix_tokens"] == 0
    assert out.completion_ids == hf_generate(windowed, shared, 2, do_sample=False, max_new_tokens=24)


def test_not_taken_with_vision_inputs():
    """Prompts with vision inputs keep the full prefill (the model splices image features into each prompt)."""
    from posttrain.models.tiny import build_tiny_vlm

    model, processor = build_tiny_vlm()
    prompts = [SYSTEM + list(b"Colour?"), SYSTEM + list(b"Shape of it?")]
    sampling = SamplingConfig(
        4, eos_token_ids=[processor.tokenizer.eos_token_id], pad_token_id=processor.tokenizer.pad_token_id
    )
    sampler = GroupSampler(model, processor, generator=torch.Generator().manual_seed(0))
    out = sampler.generate(prompts, sampling, num_generations=2, vision_inputs=[{}, {}])
    assert len(out) == 4 and sampler.last_stats["prefill_rows"] == 2
    assert sampler.last_stats["shared_prefix_tokens"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_2d_mask_eager_attention_and_batch_splitting_give_the_same_results(
    request, shared, monkeypatch, tokenizer, arch
):
    """The shared layout through the model-built 2-D mask path, through eager attention (float additive mask), and
    split into several batches (each batch shares its own prefix) samples what the full prefill samples."""
    model = request.getfixturevalue(arch)
    sampling = SamplingConfig(12, temperature=1.0, repetition_penalty=1.1, eos_token_ids=[EOS], pad_token_id=PAD)

    def run(target=model, **kwargs):
        sampler = GroupSampler(target, generator=torch.Generator().manual_seed(4), **kwargs)
        return sampler, sampler.generate(shared, sampling, 3)

    _, reference = _full_prefill(monkeypatch, run)
    with monkeypatch.context() as m:
        m.setattr(gs, "_takes_boolean_4d_mask", lambda model: False)
        sampler, two_d = run()
    assert sampler.last_stats["shared_prefix_tokens"] > 0
    assert two_d.completion_ids == reference.completion_ids
    _close(two_d.logprobs, reference.logprobs)
    # split batches draw from the generator batch by batch: compared with the full prefill split the same way
    budget = 3 * 2 * (len(SYSTEM) + 40)  # two prompts per batch
    _, split_reference = _full_prefill(monkeypatch, lambda: run(max_batch_tokens=budget))
    sampler, split = run(max_batch_tokens=budget)
    assert sampler.last_stats["num_batches"] == 3
    # batches ("Hi", "H"): SYSTEM (capped), ("How far...", "Hzz top"): SYSTEM + "H", ("Hmm: 2+2?"): one prompt, none
    assert sampler.last_stats["shared_prefix_tokens"] == len(SYSTEM) + len(SYSTEM) + 1
    assert split.completion_ids == split_reference.completion_ids
    _close(split.logprobs, split_reference.logprobs)

    eager = make_model(tokenizer, "llama" if arch == "llama" else "qwen2", eos_bias=1.0)
    eager.config._attn_implementation = "eager"
    _, eager_full = _full_prefill(monkeypatch, lambda: run(eager))
    sampler, eager_shared = run(eager)
    assert sampler.last_stats["shared_prefix_tokens"] > 0
    assert eager_shared.completion_ids == eager_full.completion_ids
    _close(eager_shared.logprobs, eager_full.logprobs)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_routing_is_recorded_in_the_full_prompt_layout(arch, monkeypatch):
    """With routing recording on, the shared prefill's records land on each row's ``[prompt | completion]`` tokens
    as the full prefill lays them out: replaying them in the training forward reproduces the sampler's log-probs
    (ratio 1) on near-tied routers, and every prompt token of a row has the full prefill's record."""
    from posttrain.models.completion_scoring import completion_token_stats
    from posttrain.models.tiny import build_tiny_moe_model
    from posttrain.rollout.pipeline import collate_completions

    model = build_tiny_moe_model(arch, num_experts=8, router_spread=1e-7).eval()
    system = list(range(5, 45))  # 40 shared tokens
    prompts = [system + [50, 51, 52], system + [60], system + [70, 71, 72, 73, 74, 75]]
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0, eos_token_ids=[2], pad_token_id=0)

    def run(target):
        sampler = GroupSampler(target, record_routing=True, generator=torch.Generator().manual_seed(0))
        return sampler, sampler.generate(prompts, sampling, num_generations=3)

    sampler, out = run(model)
    assert sampler.last_stats["shared_prefix_tokens"] == 40
    for row, prompt, completion in zip(out.routing, out.prompt_ids, out.completion_ids):
        assert row.shape[0] == len(prompt) + len(completion)
        assert (row[: len(prompt) + len(completion) - 1] > 0).all()  # every fed token has a record
    batch = collate_completions(out, pad_token_id=0)
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        replayed = completion_token_stats(model, batch).logps
    assert (replayed - batch["sampling_per_token_logps"])[mask].abs().max() < 1e-5

    # with a router that is not near-tied, the prompt tokens' records equal the full prefill's
    spread = build_tiny_moe_model(arch, num_experts=8).eval()
    _, mine = run(spread)
    _, full = _full_prefill(monkeypatch, lambda: run(spread))
    for a, b, prompt in zip(mine.routing, full.routing, mine.prompt_ids):
        assert torch.equal(a[: len(prompt)], b[: len(prompt)])
