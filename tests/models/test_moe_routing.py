"""MoE routing replay (``keep_routing``): the gate-weight math by hand, and on tiny Qwen2-MoE / Qwen3-MoE / Mixtral
models with near-tied routers, the on-policy log-probs of the training forward equal the sampler's with the
routing replayed and differ without it, the replayed forward uses exactly the recorded experts, gradient
checkpointing (both implementations) gives the same gradients, the router still learns and the aux loss stays
finite."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.core.routing import decode_routing, encode_routing, routing_storage_dtype, routing_weights
from posttrain.generation.base import SamplingConfig
from posttrain.generation.group_sampler import GroupSampler
from posttrain.models.completion_scoring import (
    choose_shared_prompt_layout,
    completion_inputs,
    completion_token_stats,
)
from posttrain.models.moe_routing import find_routers, replay_routing, routing_for_rows
from posttrain.models.tiny import MOE_ARCHS, build_tiny_model, build_tiny_moe_model, build_tiny_tokenizer
from posttrain.rollout.pipeline import collate_completions

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# -- the math ------------------------------------------------------------------------------------------------------
def test_routing_weights_by_hand():
    # softmax of log(1..4) is (1, 2, 3, 4) / 10; experts (3, 1) → (0.4, 0.2), renormalised (2/3, 1/3)
    logits = torch.log(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    experts = torch.tensor([[3, 1]])
    torch.testing.assert_close(routing_weights(logits, experts, normalize=False), torch.tensor([[0.4, 0.2]]))
    torch.testing.assert_close(routing_weights(logits, experts, normalize=True), torch.tensor([[2 / 3, 1 / 3]]))
    # gradient of w_0 = p_3 w.r.t. z: p_3 (δ_3j − p_j) = 0.4 · (−0.1, −0.2, −0.3, 0.6)
    z = logits.clone().requires_grad_(True)
    routing_weights(z, experts, normalize=False)[0, 0].backward()
    torch.testing.assert_close(z.grad, 0.4 * torch.tensor([[-0.1, -0.2, -0.3, 0.6]]))
    # the router's own top-k: the same numbers as transformers' routers compute (topk values of the softmax)
    z = torch.randn(5, 8)
    values, own = torch.topk(torch.softmax(z, -1), 2, dim=-1)
    assert torch.equal(routing_weights(z, own, normalize=False), values)


def test_routing_storage_round_trip():
    assert routing_storage_dtype(8) == torch.uint8
    assert routing_storage_dtype(255) == torch.uint8
    assert routing_storage_dtype(256) == torch.int16
    experts = torch.tensor([[0, 254], [7, 3]])
    stored = encode_routing(experts, 255)
    assert stored.dtype == torch.uint8 and stored.tolist() == [[1, 255], [8, 4]]
    assert torch.equal(decode_routing(stored), experts)
    assert decode_routing(torch.zeros(1, 2, dtype=torch.uint8)).tolist() == [[-1, -1]]


# -- tiny MoE models -----------------------------------------------------------------------------------------------
def _sample(model, max_new_tokens=16):
    """On-policy rollout batch from the group sampler with routing recorded (temperature 1, no truncation: the
    sampler's log-probs are the full softmax's, so the on-policy ratio is exp(trainer − sampler))."""
    sampler = GroupSampler(model, record_routing=True, generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(max_new_tokens=max_new_tokens, temperature=1.0, eos_token_ids=[2], pad_token_id=0)
    completions = sampler.generate(PROMPTS, sampling, num_generations=4)
    return completions, collate_completions(completions, pad_token_id=0)


def _without_routing(batch):
    return {k: v for k, v in batch.items() if "routing" not in k}


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_replay_makes_the_on_policy_ratio_one(arch):
    model = build_tiny_moe_model(arch, num_experts=8, router_spread=1e-7).eval()
    completions, batch = _sample(model)
    layers, top_k = len(find_routers(model)), 2
    for row, prompt, completion in zip(completions.routing, completions.prompt_ids, completions.completion_ids):
        assert row.shape == (len(prompt) + len(completion), layers, top_k) and row.dtype == torch.uint8
        assert (row[: len(prompt) + len(completion) - 1] > 0).all()  # every fed token has a record
        assert (row[-1] == 0).all()  # the last completion token is never fed back
    mask = batch["completion_mask"].bool()
    sampled = batch["sampling_per_token_logps"]
    with torch.no_grad():
        replayed = completion_token_stats(model, batch).logps
        plain = completion_token_stats(model, _without_routing(batch)).logps
    log_ratio_replayed = (replayed - sampled)[mask]
    log_ratio_plain = (plain - sampled)[mask]
    # with replay: ratio 1 to float tolerance on every token
    assert log_ratio_replayed.abs().max() < 1e-5
    # without: the training forward routes some tokens to other experts than the sampler did
    assert log_ratio_plain.abs().max() > 1e-3
    assert (log_ratio_plain.abs() > 1e-4).float().mean() > 0.01


def test_recording_across_sampler_batches_and_merged_prompts():
    """Rows land in the right place when the sampler splits prompts into several batches (max_batch_tokens) and
    prefills identical prompts once."""
    model = build_tiny_moe_model("qwen3_moe", num_experts=8, router_spread=1e-7).eval()
    sampler = GroupSampler(model, record_routing=True, max_batch_tokens=80, generator=torch.Generator().manual_seed(2))
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, eos_token_ids=[2], pad_token_id=0)
    prompts = [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]]
    completions = sampler.generate(prompts, sampling, num_generations=2)
    assert sampler.last_stats["num_batches"] > 1
    batch = collate_completions(completions, pad_token_id=0)
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        replayed = completion_token_stats(model, batch).logps
    assert (replayed - batch["sampling_per_token_logps"])[mask].abs().max() < 1e-5


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_replay_in_the_shared_prompt_layout(arch):
    """The packed layout (each prompt encoded once) replays each token's record too: its tokens are mapped back to
    their plain rows' positions."""
    model = build_tiny_moe_model(arch, num_experts=8, router_spread=1e-7).eval()
    sampler = GroupSampler(model, record_routing=True, generator=torch.Generator().manual_seed(1))
    sampling = SamplingConfig(max_new_tokens=10, temperature=1.0, eos_token_ids=[2], pad_token_id=0)
    prompts = [list(range(5, 29)), list(range(40, 58))]  # long prompts: sharing them clearly saves work
    batch = collate_completions(sampler.generate(prompts, sampling, num_generations=4), pad_token_id=0)
    assert choose_shared_prompt_layout(model, batch) is not None
    mask = batch["completion_mask"].bool()
    with torch.no_grad():
        shared = completion_token_stats(model, batch, share_prompts=True).logps
        plain = completion_token_stats(model, _without_routing(batch), share_prompts=True).logps
    sampled = batch["sampling_per_token_logps"]
    assert (shared - sampled)[mask].abs().max() < 1e-5
    assert (plain - sampled)[mask].abs().max() > 1e-3


def _recorded_and_used(model, batch, replay: bool):
    """(recorded experts (N, L, k), experts each router used in the training forward (N, L, k))."""
    routing = routing_for_rows(batch)
    input_ids, attention_mask, position_ids, _ = completion_inputs(batch)
    used: dict[int, torch.Tensor] = {}
    routers = find_routers(model)

    def run():
        # registered after replay_routing's hooks: sees the output they replaced
        handles = [
            r.register_forward_hook(lambda m, a, out, i=i: used.__setitem__(i, out[2].clone()))
            for i, r in enumerate(routers)
        ]
        try:
            with torch.no_grad():
                model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        finally:
            for handle in handles:
                handle.remove()

    if replay:
        with replay_routing(model, routing):
            run()
    else:
        run()
    return decode_routing(routing.flatten(0, 1)), torch.stack([used[i] for i in range(len(routers))], dim=1)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_replayed_forward_routes_by_the_record(arch):
    model = build_tiny_moe_model(arch, num_experts=8, router_spread=1e-7).eval()
    _, batch = _sample(model)
    recorded, used = _recorded_and_used(model, batch, replay=True)
    known = recorded[..., 0] >= 0  # (N, L)
    assert known.sum() > 100
    assert torch.equal(used[known], recorded[known])
    recorded, own = _recorded_and_used(model, batch, replay=False)
    assert not torch.equal(own[known], recorded[known])  # the record matters: own routing differs somewhere


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_recompute_replays_the_routing(use_reentrant):
    model = build_tiny_moe_model("qwen3_moe", num_experts=8, router_spread=1e-7)
    model.eval()
    _, batch = _sample(model)
    mask = batch["completion_mask"].float()
    model.train()

    def gradients(checkpointing: bool, replay: bool = True) -> dict[str, torch.Tensor]:
        model.zero_grad()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        else:
            model.gradient_checkpointing_disable()
        logps = completion_token_stats(model, batch if replay else _without_routing(batch)).logps
        (logps * mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = gradients(checkpointing=False)
    checkpointed = gradients(checkpointing=True)
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, atol=1e-6, rtol=1e-5)
    # the router learns through the recomputed weights of the replayed experts
    router_grads = [g for n, g in plain.items() if n.endswith("gate.weight")]
    assert router_grads and all(g.abs().sum() > 0 for g in router_grads)
    # and replay changes the gradient (it is not a no-op on this model)
    own = gradients(checkpointing=False, replay=False)
    assert any(not torch.allclose(own[n], plain[n], atol=1e-6) for n in plain)
    model.gradient_checkpointing_disable()


def test_aux_loss_stays_defined_under_replay():
    model = build_tiny_moe_model("mixtral", num_experts=8, router_spread=1e-7, output_router_logits=True).eval()
    _, batch = _sample(model)
    with torch.no_grad():
        stats = completion_token_stats(model, batch)
    assert stats.aux_loss is not None and math.isfinite(float(stats.aux_loss)) and float(stats.aux_loss) > 0


def test_qwen2_moe_weights_are_not_renormalised():
    """Qwen2-MoE (norm_topk_prob=False) mixes with the raw softmax probabilities: replay keeps that form, so a record
    equal to the router's own choice reproduces the plain forward bit for bit."""
    model = build_tiny_moe_model("qwen2_moe", num_experts=8).eval()
    _, batch = _sample(model, max_new_tokens=6)
    input_ids, attention_mask, position_ids, _ = completion_inputs(batch)
    routers = find_routers(model)
    captured: dict[int, torch.Tensor] = {}
    handles = [
        r.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out[2].clone()))
        for i, r in enumerate(routers)
    ]
    with torch.no_grad():
        plain = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    for handle in handles:
        handle.remove()
    own = torch.stack([captured[i] for i in range(len(routers))], dim=1)  # (N, L, k)
    routing = encode_routing(own, 8).view(*input_ids.shape, *own.shape[1:])
    with torch.no_grad(), replay_routing(model, routing):
        replayed = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    assert torch.equal(replayed, plain)


def test_dense_model_is_a_clear_error():
    with pytest.raises(ValueError, match="keep_routing=True.*no MoE router"):
        GroupSampler(build_tiny_model("qwen2"), record_routing=True)
    dense = build_tiny_model("qwen2")
    with pytest.raises(ValueError, match="keep_routing=True.*no MoE router"), replay_routing(dense, torch.zeros(1, 2, 2, 2)):
        pass


def test_misaligned_routing_is_a_clear_error():
    model = build_tiny_moe_model("qwen3_moe").eval()
    routing = torch.ones(1, 3, 2, 2, dtype=torch.uint8)  # 3 tokens recorded, 4 run
    with pytest.raises(ValueError, match="recorded routing covers 3 tokens"), replay_routing(model, routing):
        model(input_ids=torch.tensor([[5, 6, 7, 8]]))


def test_tiny_moe_builders():
    tokenizer = build_tiny_tokenizer()
    for arch in MOE_ARCHS:
        model = build_tiny_moe_model(arch, num_experts=4, num_experts_per_tok=2, tokenizer=tokenizer)
        routers = find_routers(model)
        assert len(routers) == 2 and all(r.top_k == 2 for r in routers)
        assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape[-1] >= len(tokenizer)
    tied = build_tiny_moe_model("mixtral", router_spread=1e-7)
    weight = find_routers(tied)[0].weight
    assert (weight - weight[0]).abs().max() < 1e-5
    with pytest.raises(ValueError, match="Unknown tiny MoE model"):
        build_tiny_moe_model("dbrx")  # type: ignore[arg-type]


def test_multimodal_rope_prompts_are_a_clear_error():
    """Such prompts are sampled by model.generate (no routing recorded): an error rather than a silent no-replay."""
    sampler = GroupSampler(build_tiny_moe_model("qwen3_moe"), record_routing=True)
    sampling = SamplingConfig(max_new_tokens=2, eos_token_ids=[2], pad_token_id=0)
    with pytest.raises(ValueError, match="keep_routing=True.*multimodal-RoPE"):
        sampler.generate([[5, 6]], sampling, vision_inputs=[{"image_grid_thw": torch.ones(1, 3, dtype=torch.long)}])


@pytest.mark.parametrize("num_experts", [8, 300, 40000])
def test_routing_wire_round_trip(num_experts):
    """``return_routing``'s wire form: the stored dtype (uint8 up to 255 experts, then int16 / int32) and its bytes
    survive base64 exactly; uint8 costs layers × top_k bytes per token."""
    import base64

    from posttrain.models.moe_routing import routing_from_wire, routing_to_wire

    experts = torch.tensor([[[0, num_experts - 1], [3, 1]], [[2, 5], [num_experts - 2, 0]], [[1, 0], [4, 7]]])
    stored = encode_routing(experts, num_experts)  # (T=3, L=2, k=2)
    stored[2] = 0  # a token without a record
    wire = routing_to_wire(stored)
    assert wire["shape"] == [3, 2, 2] and wire["dtype"] == str(stored.dtype).removeprefix("torch.")
    assert len(base64.b64decode(wire["data"])) == 3 * 2 * 2 * stored.element_size()
    back = routing_from_wire(wire)
    assert back.dtype == stored.dtype and torch.equal(back, stored)
    assert torch.equal(decode_routing(back)[:2], experts[:2]) and bool((decode_routing(back)[2] == -1).all())


def test_malformed_routing_wire_is_a_clear_error():
    from posttrain.models.moe_routing import routing_from_wire, routing_to_wire

    wire = routing_to_wire(torch.ones((2, 3, 2), dtype=torch.uint8))
    with pytest.raises(ValueError, match="12 uint8 values for shape \\[2, 3, 3\\]"):
        routing_from_wire({**wire, "shape": [2, 3, 3]})
    with pytest.raises(ValueError, match="routing is malformed"):
        routing_from_wire({**wire, "dtype": "float32"})
    with pytest.raises(ValueError, match="routing is malformed"):
        routing_from_wire({**wire, "data": "not base64!"})
    with pytest.raises(TypeError, match="cannot send routing of dtype torch.int64"):
        routing_to_wire(torch.ones((1, 1, 1), dtype=torch.int64))
