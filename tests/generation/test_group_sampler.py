"""GroupSampler: same tokens as model.generate when greedy, same distribution when sampling, processed log-probs,
finished rows dropped, EOS truncation, prompt deduplication and batching."""

from __future__ import annotations

import pytest
import torch
from generation_helpers import EOS, PAD, chi2_pvalue, hand_logprobs, hf_generate, make_model

from posttrain.generation import GroupSampler, SamplingConfig
from posttrain.generation.group_sampler import sample_categorical


@pytest.mark.invariance
@pytest.mark.parametrize("arch", ["llama", "qwen"])
@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_matches_generate_token_for_token(request, prompts, greedy, arch, g, penalty):
    model = request.getfixturevalue(arch)
    sampling = SamplingConfig(24, do_sample=False, repetition_penalty=penalty, eos_token_ids=[EOS], pad_token_id=PAD)
    out = GroupSampler(model).generate(prompts, sampling, num_generations=g)
    expected = hf_generate(model, prompts, g, do_sample=False, max_new_tokens=24, repetition_penalty=penalty)
    assert out.completion_ids == expected
    assert out.prompt_ids == [p for p in prompts for _ in range(g)]
    if arch == "llama":  # the case is informative: some rows end early with EOS, others run to the limit
        assert any(out.finished) and not all(out.finished)
        assert len({len(c) for c in out.completion_ids}) > 2


def test_finished_rows_are_dropped_from_the_decode_batch(llama, prompts, greedy):
    sampler = GroupSampler(llama)
    out = sampler.generate(prompts, greedy, num_generations=2)
    sizes = sampler.last_stats["decode_batch_sizes"]
    assert sampler.last_stats["prefill_rows"] == len(prompts)  # one prefill per prompt, not per generation
    assert sizes[0] <= 2 * len(prompts) and sizes[-1] < sizes[0]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    # A completion of L tokens takes part in exactly L - 1 decode forwards (its first token comes from prefill).
    assert sum(sizes) == sum(len(c) - 1 for c in out.completion_ids)


def test_eos_truncation_multiple_eos_ids_and_max_new_tokens(llama, prompts):
    eos_ids = [EOS, ord("e")]
    sampling = SamplingConfig(12, temperature=1.0, eos_token_ids=eos_ids, pad_token_id=PAD)
    out = GroupSampler(llama).generate(prompts, sampling, num_generations=4)
    assert len(out) == 4 * len(prompts)
    for ids, done, lps in zip(out.completion_ids, out.finished, out.logprobs):
        assert 1 <= len(ids) <= 12 and len(lps) == len(ids)
        assert not any(t in eos_ids for t in ids[:-1])  # nothing after the first EOS
        assert done == (ids[-1] in eos_ids)
        if not done:
            assert len(ids) == 12
    assert any(out.finished) and not all(out.finished)


def test_sampling_distribution_matches_generate_and_formula(tokenizer):
    """Two sampled tokens, temperature 0.7 and top-k 20: both samplers fit the exact distributions (chi-square)."""
    model = make_model(tokenizer, "llama", sharpen=4.0)
    prompt = list(b"Once upon a")
    knobs = dict(temperature=0.7, top_k=20)
    n = 4000
    torch.manual_seed(1)
    out = GroupSampler(model).generate([prompt], SamplingConfig(2, **knobs, eos_token_ids=[EOS], pad_token_id=PAD), n)
    ours = out.completion_ids
    torch.manual_seed(2)
    theirs = hf_generate(model, [prompt], n, do_sample=True, max_new_tokens=2, **knobs)

    with torch.no_grad():
        first = hand_logprobs(model(torch.tensor([prompt])).logits[0, -1], prompt, **knobs).exp()  # (V,)
        support = first.nonzero().squeeze(1)  # the 20 possible first tokens
        # (20, V): the second token's distribution after each possible first token
        next_logits = model(torch.tensor([prompt + [t] for t in support.tolist()])).logits[:, -1]
        seconds = torch.stack([hand_logprobs(row, [], **knobs).exp() for row in next_logits])
    vocab = first.numel()
    # Second-token marginal; index `vocab` = "no second token" (the first one was EOS).
    second = torch.zeros(vocab + 1, dtype=torch.float64)
    for t, p2 in zip(support.tolist(), seconds):
        if t == EOS:
            second[vocab] += first[t]
        else:
            second[:vocab] += first[t] * p2
    assert support.numel() == 20 and abs(second.sum().item() - 1) < 1e-9

    for samples in (ours, theirs):
        c1 = torch.bincount(torch.tensor([s[0] for s in samples]), minlength=vocab)
        second_tokens = [s[1] if len(s) > 1 and s[0] != EOS else vocab for s in samples]
        c2 = torch.bincount(torch.tensor(second_tokens), minlength=vocab + 1)
        assert chi2_pvalue(c1, first) > 1e-3
        assert chi2_pvalue(c2, second) > 1e-3
    # A wrong temperature is detected by the same test (it has power).
    c1 = torch.bincount(torch.tensor([s[0] for s in ours]), minlength=vocab)
    hot = hand_logprobs(model(torch.tensor([prompt])).logits[0, -1].detach(), prompt, temperature=1.0, top_k=20).exp()
    assert chi2_pvalue(c1, hot) < 1e-3

    # Returned log-probs are those of the processed distribution.
    lp1 = torch.tensor([lp[0] for lp in out.logprobs])
    assert torch.allclose(lp1, first.log()[torch.tensor([s[0] for s in ours])].float(), atol=1e-5)
    index = {t: i for i, t in enumerate(support.tolist())}
    two = [(i, s) for i, s in enumerate(ours) if len(s) == 2]
    lp2 = torch.tensor([out.logprobs[i][1] for i, _ in two])
    want2 = torch.stack([seconds[index[s[0]], s[1]].log() for _, s in two]).float()
    assert torch.allclose(lp2, want2, atol=1e-5)


def test_logprobs_with_penalty_top_p_min_p_match_a_plain_forward(llama, prompts):
    knobs = dict(temperature=0.8, top_p=0.9, min_p=0.05, penalty=1.2)
    sampling = SamplingConfig(
        6, temperature=0.8, top_p=0.9, min_p=0.05, repetition_penalty=1.2, eos_token_ids=[EOS], pad_token_id=PAD
    )
    out = GroupSampler(llama).generate(prompts[:3], sampling, num_generations=4)
    for prompt, ids, lps in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        with torch.no_grad():
            logits = llama(torch.tensor([prompt + ids])).logits[0]  # (P + T, V), unpadded
        for t, (token, lp) in enumerate(zip(ids, lps)):
            want = hand_logprobs(logits[len(prompt) + t - 1], prompt + ids[:t], **knobs)[token]
            assert torch.isfinite(want) and abs(want.item() - lp) < 1e-4


def test_duplicate_prompts_are_prefilled_once(llama, prompts, greedy):
    sampler = GroupSampler(llama)
    dup = [prompts[0], prompts[1], prompts[0]]
    out = sampler.generate(dup, greedy, num_generations=2)
    assert sampler.last_stats["prefill_rows"] == 2
    ref = GroupSampler(llama).generate(prompts[:2], greedy, num_generations=2)
    assert out.completion_ids == ref.completion_ids + ref.completion_ids[:2]
    assert out.prompt_ids == [dup[0]] * 2 + [dup[1]] * 2 + [dup[0]] * 2


def test_max_batch_tokens_splits_batches_without_changing_results(llama, prompts, greedy):
    whole = GroupSampler(llama).generate(prompts, greedy, num_generations=2)
    sampler = GroupSampler(llama, max_batch_tokens=2 * (25 + 24))  # room for one long prompt's group
    split = sampler.generate(prompts, greedy, num_generations=2)
    assert sampler.last_stats["num_batches"] > 2
    assert split.completion_ids == whole.completion_ids and split.finished == whole.finished
    flat = [x for row in split.logprobs for x in row]
    assert flat == pytest.approx([x for row in whole.logprobs for x in row], abs=1e-5)


def test_seeded_generator_reproduces_and_training_mode_is_restored(tokenizer, prompts):
    model = make_model(tokenizer, "qwen2").train()
    sampling = SamplingConfig(5, temperature=1.0, eos_token_ids=[EOS], pad_token_id=PAD)
    runs = []
    for _ in range(2):
        sampler = GroupSampler(model, generator=torch.Generator().manual_seed(7))
        runs.append(sampler.generate(prompts, sampling, num_generations=3))
    assert runs[0].completion_ids == runs[1].completion_ids
    assert model.training  # restored after sampling in eval mode
    other = GroupSampler(model, generator=torch.Generator().manual_seed(8)).generate(prompts, sampling, 3)
    assert other.completion_ids != runs[0].completion_ids


def test_generation_kwargs_override_fields_and_unknown_keys_are_rejected(llama, prompts):
    sampling = SamplingConfig(
        24, eos_token_ids=[EOS], pad_token_id=PAD, generation_kwargs={"max_new_tokens": 3, "do_sample": False}
    )
    out = GroupSampler(llama, return_logprobs=False).generate(prompts, sampling, num_generations=2)
    assert out.logprobs is None and all(len(c) <= 3 for c in out.completion_ids)
    bad = SamplingConfig(4, eos_token_ids=[EOS], pad_token_id=PAD, generation_kwargs={"num_beams": 2})
    with pytest.raises(ValueError, match=r"num_beams.*'transformers' generation backend"):
        GroupSampler(llama).generate(prompts, bad)


def test_bad_inputs(llama, greedy):
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        GroupSampler(llama).generate([[1, 2], []], greedy)
    with pytest.raises(ValueError, match="num_generations"):
        GroupSampler(llama).generate([[1, 2]], greedy, num_generations=0)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        GroupSampler(llama, max_batch_tokens=0)
    empty = GroupSampler(llama).generate([], greedy, num_generations=4)
    assert len(empty) == 0 and empty.logprobs == []


def test_peft_wrapped_model(tokenizer, prompts, greedy):
    from peft import LoraConfig, get_peft_model

    base = make_model(tokenizer, "llama", eos_bias=1.0)
    expected = GroupSampler(base).generate(prompts[:3], greedy, num_generations=2).completion_ids
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))  # B = 0: same model
    assert GroupSampler(peft_model).generate(prompts[:3], greedy, num_generations=2).completion_ids == expected


def test_sample_categorical_is_exact_and_skips_zero_probability_tokens():
    probs = torch.zeros(3, 50)
    probs[:, 0] = 0.0  # leading and trailing zeros, gaps in between
    probs[:, [3, 7, 8, 20, 41]] = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    probs[2] = 0
    probs[2, 49] = 1.0  # all mass on the last token
    draws = torch.stack([sample_categorical(probs, torch.Generator().manual_seed(i)) for i in range(3000)])  # (N, 3)
    assert (draws[:, 2] == 49).all()
    counts = torch.bincount(draws[:, :2].flatten(), minlength=50)
    assert chi2_pvalue(counts, probs[0]) > 1e-3


def test_sample_categorical_chunking_does_not_change_draws():
    probs = torch.softmax(torch.randn(10, 30), -1)
    a = sample_categorical(probs, torch.Generator().manual_seed(3), rows_per_chunk=3)
    b = sample_categorical(probs, torch.Generator().manual_seed(3), rows_per_chunk=64)
    assert torch.equal(a, b)


def test_boolean_4d_decode_mask_gives_the_2d_masks_tokens_and_logprobs(request, prompts, monkeypatch):
    """The preallocated boolean SDPA mask changes no token and no log-prob against the model-built 4-D mask."""
    import posttrain.generation.group_sampler as gs

    sampling = SamplingConfig(16, temperature=1.0, repetition_penalty=1.2, eos_token_ids=[EOS], pad_token_id=PAD)
    for arch in ("llama", "qwen"):
        model = request.getfixturevalue(arch)
        assert gs._takes_boolean_4d_mask(model)  # the sdpa tiny models take the fast path
        fast = GroupSampler(model, generator=torch.Generator().manual_seed(5)).generate(prompts, sampling, 3)
        monkeypatch.setattr(gs, "_takes_boolean_4d_mask", lambda model: False)
        plain = GroupSampler(model, generator=torch.Generator().manual_seed(5)).generate(prompts, sampling, 3)
        monkeypatch.undo()
        assert fast.completion_ids == plain.completion_ids and fast.finished == plain.finished
        torch.testing.assert_close(
            [torch.tensor(x) for x in fast.logprobs], [torch.tensor(x) for x in plain.logprobs], rtol=0, atol=1e-5
        )
        assert len({len(c) for c in fast.completion_ids}) > 2  # rows were dropped along the way


def test_eager_attention_and_prompt_learning_keep_the_2d_mask(tokenizer):
    from types import SimpleNamespace

    import posttrain.generation.group_sampler as gs

    model = make_model(tokenizer, "llama")
    prompt_learning = SimpleNamespace(config=model.config, active_peft_config=SimpleNamespace(is_prompt_learning=True))
    assert gs._takes_boolean_4d_mask(model) and not gs._takes_boolean_4d_mask(prompt_learning)
    model.config._attn_implementation = "eager"
    assert not gs._takes_boolean_4d_mask(model)


def test_large_vocabulary_two_level_sampling_gives_the_one_level_tokens(tokenizer, prompts, monkeypatch):
    """V > 4096: the sampler's two-level draw equals the full-vocabulary inverse CDF for the same uniforms."""
    import posttrain.generation.group_sampler as gs
    from posttrain.core.categorical import inverse_cdf
    from posttrain.models.tiny import build_tiny_model

    model = build_tiny_model("qwen2", tokenizer=tokenizer, vocab_size=8192).eval()
    sampling = SamplingConfig(12, temperature=1.0, eos_token_ids=[EOS], pad_token_id=PAD)
    two = GroupSampler(model, generator=torch.Generator().manual_seed(2)).generate(prompts[:3], sampling, 4)
    monkeypatch.setattr(gs, "inverse_cdf_two_level", lambda probs, u: inverse_cdf(probs, u))
    one = GroupSampler(model, generator=torch.Generator().manual_seed(2)).generate(prompts[:3], sampling, 4)
    assert two.completion_ids == one.completion_ids and two.logprobs == one.logprobs
    assert len({t for c in two.completion_ids for t in c}) > 20  # the draws spread over the vocabulary


def test_logsumexp_rows_is_torch_logsumexp_bit_for_bit():
    """The decode step's log-sum-exp with a reused scratch buffer returns torch.logsumexp's exact bits, including
    rows with −inf entries and an all −inf row (−inf, not NaN)."""
    from posttrain.generation.group_sampler import logsumexp_rows

    torch.manual_seed(0)
    for scale in (0.1, 3.0, 40.0):
        x = torch.randn(9, 5000) * scale
        x[1, :100] = float("-inf")
        x[2] = float("-inf")
        scratch = torch.empty_like(x)
        got = logsumexp_rows(x, scratch)
        want = torch.logsumexp(x, dim=-1)
        assert torch.equal(got, want)
        assert got[2].item() == float("-inf")


@pytest.mark.parametrize("knobs", [dict(top_p=0.8), dict(top_k=5), dict(min_p=0.1)])
def test_log_kept_mass_puts_processed_logprobs_on_the_full_softmax_scale(llama, prompts, knobs):
    """Truncated sampling records log S per token: processed log-prob + log S = log softmax(logits / T) of a plain
    forward (what the trainer computes), while the processed log-prob alone is higher by −log S > 0 somewhere."""
    sampling = SamplingConfig(6, temperature=0.9, eos_token_ids=[EOS], pad_token_id=PAD, **knobs)
    out = GroupSampler(llama).generate(prompts[:3], sampling, num_generations=3)
    assert out.log_kept_mass is not None
    gaps = []
    for prompt, ids, lps, kept in zip(out.prompt_ids, out.completion_ids, out.logprobs, out.log_kept_mass):
        assert len(kept) == len(ids)
        with torch.no_grad():
            logits = llama(torch.tensor([prompt + ids])).logits[0]
        full = torch.log_softmax(logits[len(prompt) - 1 : -1].double() / 0.9, -1)  # (T, V)
        for t, (token, lp, log_s) in enumerate(zip(ids, lps, kept)):
            assert log_s <= 0.0
            assert abs(lp + log_s - full[t, token].item()) < 1e-4
            gaps.append(lp - full[t, token].item())
    assert max(gaps) > 0.01  # the uncorrected processed log-prob is measurably off the full softmax


def test_no_truncation_records_no_kept_mass(llama, prompts, greedy):
    sampling = SamplingConfig(4, temperature=0.7, eos_token_ids=[EOS], pad_token_id=PAD)
    assert GroupSampler(llama).generate(prompts[:2], sampling, num_generations=2).log_kept_mass is None
    assert GroupSampler(llama).generate(prompts[:2], greedy, num_generations=2).log_kept_mass is None


@pytest.mark.parametrize("knobs", [dict(top_p=0.8), dict(top_k=5), dict(min_p=0.1), dict(top_p=0.995)])
def test_sampling_mask_replays_the_processed_distribution(llama, prompts, knobs):
    """``return_sampling_mask``: per token its kept support; the masked log-softmax of a plain forward over it equals
    the sampler's processed log-prob (no kept-mass correction needed), and the sampled token is always kept."""
    sampling = SamplingConfig(
        6, temperature=0.9, eos_token_ids=[EOS], pad_token_id=PAD, return_sampling_mask=True, **knobs
    )
    out = GroupSampler(llama).generate(prompts[:3], sampling, num_generations=3)
    assert out.sampling_mask is not None and out.log_kept_mass is not None
    forms = set()
    for prompt, ids, lps, entries in zip(out.prompt_ids, out.completion_ids, out.logprobs, out.sampling_mask):
        assert len(entries) == len(ids)
        with torch.no_grad():
            logits = llama(torch.tensor([prompt + ids])).logits[0]
        z = logits[len(prompt) - 1 : -1].double() / 0.9  # (T, V)
        for t, (token, lp, entry) in enumerate(zip(ids, lps, entries)):
            if isinstance(entry, list):
                forms.add("ids")
                assert token in entry and len(entry) <= (knobs.get("top_k") or 16)
                keep = torch.zeros_like(z[t], dtype=torch.bool)
                keep[entry] = True
            else:
                forms.add("threshold" if entry is not None else "unknown")
                keep = z[t] >= (entry if entry is not None else float("-inf"))
                assert keep[token]
            masked = torch.log_softmax(z[t].masked_fill(~keep, float("-inf")), -1)
            assert abs(lp - masked[token].item()) < 1e-4
    if "top_k" in knobs:
        assert forms == {"ids"}
    if knobs.get("top_p") == 0.995:
        assert "threshold" in forms  # a near-flat tiny model keeps more than 16 tokens


def test_no_sampling_mask_unless_asked_or_truncated(llama, prompts):
    plain = SamplingConfig(4, temperature=0.7, top_k=5, eos_token_ids=[EOS], pad_token_id=PAD)
    assert GroupSampler(llama).generate(prompts[:2], plain, num_generations=2).sampling_mask is None
    untruncated = SamplingConfig(4, temperature=0.7, eos_token_ids=[EOS], pad_token_id=PAD, return_sampling_mask=True)
    assert GroupSampler(llama).generate(prompts[:2], untruncated, num_generations=2).sampling_mask is None


@pytest.mark.parametrize("knobs", [dict(top_k=5), dict(top_k=4, top_p=0.9), dict(top_k=16, min_p=0.05)])
def test_sampling_mask_top_k_path_samples_what_the_warpers_sample(llama, prompts, knobs):
    """With a top-k ≤ 16 cut the decode loop truncates and names the kept ids with one topk (issue 40's cost work):
    the same tokens and log-probs as with the mask off (the transformers warpers), and ids-form supports that hold
    the sampled token and at most k ids."""
    outs = []
    for keep in (False, True):
        sampling = SamplingConfig(
            6, temperature=0.9, eos_token_ids=[EOS], pad_token_id=PAD, return_sampling_mask=keep, **knobs
        )
        outs.append(GroupSampler(llama, generator=torch.Generator().manual_seed(3)).generate(prompts[:3], sampling, 2))
    off, on = outs
    assert on.completion_ids == off.completion_ids and on.logprobs == off.logprobs
    assert on.log_kept_mass == off.log_kept_mass
    for ids, entries in zip(on.completion_ids, on.sampling_mask):
        for token, entry in zip(ids, entries):
            assert isinstance(entry, list) and token in entry and len(entry) <= knobs["top_k"]


@pytest.mark.parametrize("knobs", [dict(top_k=5), dict(top_p=0.995)])
def test_sampling_mask_is_recorded_without_sampling_logprobs(llama, prompts, knobs):
    """A trainer that applies no importance sampling builds its sampler without log-probs; ``keep_sampling_mask``
    must still get each token's kept support (it used to be recorded only next to the log-probs)."""
    outs = []
    for return_logprobs in (True, False):
        sampling = SamplingConfig(
            5, temperature=0.9, eos_token_ids=[EOS], pad_token_id=PAD, return_sampling_mask=True, **knobs
        )
        sampler = GroupSampler(llama, return_logprobs=return_logprobs, generator=torch.Generator().manual_seed(5))
        outs.append(sampler.generate(prompts[:2], sampling, 2))
    with_lps, without = outs
    assert without.logprobs is None and without.log_kept_mass is None
    assert without.completion_ids == with_lps.completion_ids
    assert without.sampling_mask == with_lps.sampling_mask and all(without.sampling_mask)
