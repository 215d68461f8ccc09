"""``keep_routing`` through ``posttrain serve`` over loopback: the server's group sampler records a MoE model's
routing (``return_routing``), the response carries it compactly (base64 ``uint8``, the prompt's part once per
prompt), the client rebuilds exactly the in-process sampler's routing, and GRPO in server mode replays it (on-policy
ratio 1 on every token; not 1 without it). A dense model, a vLLM-protocol server and colocate vLLM fail clearly."""

from __future__ import annotations

import base64

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward

from posttrain.generation.base import SamplingConfig
from posttrain.generation.client import ServerRequestError
from posttrain.generation.group_sampler import GroupSampler
from posttrain.generation.vllm_server import VLLMServerBackend, request_seed
from posttrain.models.tiny import build_tiny_moe_model, build_tiny_tokenizer
from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

PROMPTS = [list(b"hello there"), list(b"a"), list(b"the quick brown fox")]


def _save_moe(path, arch: str) -> str:
    tokenizer = build_tiny_tokenizer()
    build_tiny_moe_model(arch, num_experts=8, router_spread=1e-7, tokenizer=tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE (8 experts, top-2, 2 layers) whose routers are nearly tied on purpose."""
    return _save_moe(tmp_path_factory.mktemp("tiny-qwen3-moe-serve"), "qwen3_moe")


def _sampling(engine, **overrides) -> SamplingConfig:
    values = dict(temperature=0.9, eos_token_ids=list(engine.eos_token_ids), pad_token_id=engine.pad_token_id,
                  return_routing=True)  # fmt: skip
    values.update(overrides)
    return SamplingConfig(6, **values)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_routing_from_the_server_equals_in_process(arch, moe_path, tmp_path):
    """Same seed, same weights: the server's tokens and routing equal the in-process sampler's, bit for bit, with
    every prompt token recorded and only each completion's last token (never fed back) unrecorded."""
    path = moe_path if arch == "qwen3_moe" else _save_moe(tmp_path / arch, arch)
    engine = PosttrainEngine.from_pretrained(path, device="cpu")
    sampling = _sampling(engine)
    with serve_in_thread(engine) as url:
        backend = VLLMServerBackend(base_url=url, seed=11)
        remote = backend.generate(PROMPTS, sampling, 3)
        plain = backend.generate(PROMPTS, _sampling(engine, return_routing=False), 3)
    local = GroupSampler(engine.model, generator=torch.Generator().manual_seed(request_seed(11, 0, 0)),
                         record_routing=True).generate(PROMPTS, sampling, 3)  # fmt: skip
    assert remote.completion_ids == local.completion_ids and remote.logprobs == local.logprobs
    assert local.routing is not None and remote.routing is not None and len(remote.routing) == 9
    for row, (mine, theirs) in enumerate(zip(remote.routing, local.routing)):
        assert mine.dtype == theirs.dtype == torch.uint8 and torch.equal(mine, theirs), row
        prompt, completion = len(remote.prompt_ids[row]), len(remote.completion_ids[row])
        assert mine.shape == (prompt + completion, 2, 2)
        assert bool((mine[: prompt + completion - 1] > 0).all()) and bool((mine[-1] == 0).all())
    assert plain.routing is None


def test_wire_format_is_compact_and_shares_the_prompt(moe_path):
    """``return_routing`` on /v1/completions: each choice's ``routing`` covers its completion tokens, the response's
    ``prompt_routing`` each prompt once; both are base64 of ``layers × top_k`` bytes per token."""
    engine = PosttrainEngine.from_pretrained(moe_path, device="cpu")
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 5, "temperature": 0.9, "seed": 3, "logprobs": 0,
            "return_routing": True}  # fmt: skip
    with serve_in_thread(engine) as url:
        backend = VLLMServerBackend(base_url=url)
        data = backend.client.request("POST", "/v1/completions", json=body).json()
        without = backend.client.request("POST", "/v1/completions", json={**body, "return_routing": False}).json()
    assert len(data["prompt_routing"]) == len(PROMPTS)
    for p, wire in enumerate(data["prompt_routing"]):
        assert wire["dtype"] == "uint8" and wire["shape"] == [len(PROMPTS[p]), 2, 2]
        assert len(base64.b64decode(wire["data"])) == len(PROMPTS[p]) * 2 * 2  # layers × top_k bytes per token
    for choice in data["choices"]:
        assert "prompt_routing" not in choice  # the n choices of a prompt share its prefill
        assert choice["routing"]["shape"] == [len(choice["token_ids"]), 2, 2]
    assert "prompt_routing" not in without and all("routing" not in c for c in without["choices"])


def test_routing_request_on_a_dense_model_is_a_clear_error(server_url, engine):
    """The module's server serves the dense tiny model: asking it for routing is a 400 naming ``return_routing``."""
    backend = VLLMServerBackend(base_url=server_url, seed=1)
    with pytest.raises(ServerRequestError, match="return_routing=true.*no MoE router.*keep_routing=False") as err:
        backend.generate(PROMPTS, _sampling(engine), 2)
    assert err.value.param == "return_routing" and err.value.status == 400


def test_routing_refused_by_servers_that_cannot_record_it(server_url, tmp_path):
    """A server spoken to in the TRL protocol (likewise vLLM, or ``posttrain serve --backend vllm``) cannot return
    posttrain's routing: a clear error naming the fix; colocate vLLM is refused by the config."""
    from posttrain.trainers.grpo import GRPOConfig

    backend = VLLMServerBackend(base_url=server_url, protocol="trl")
    with pytest.raises(ValueError, match=r"keep_routing=True.*trl server.*posttrain serve --backend posttrain"):
        backend.check_routing_support()
    backend.protocol, backend.engine = "posttrain", "vllm"
    with pytest.raises(ValueError, match=r"posttrain serve --backend vllm"):
        backend.check_routing_support()
    with pytest.raises(ValueError, match="keep_routing=True records the MoE routing.*colocate"):
        GRPOConfig(output_dir=str(tmp_path), keep_routing=True, use_vllm=True, vllm_mode="colocate", report_to="none")
    GRPOConfig(output_dir=str(tmp_path), keep_routing=True, use_vllm=True, vllm_mode="server", report_to="none")


def _grpo_server(path: str, tmp_path, url: str, keep_routing: bool) -> dict:
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", logging_steps=1, gradient_checkpointing=False,
        write_report=False, disable_tqdm=True, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=12, max_steps=1, learning_rate=1e-3, seed=7, rollout_importance_sampling=True,
        vllm_importance_sampling_mode="token_truncate", keep_routing=keep_routing, use_vllm=True,
        vllm_mode="server", vllm_server_base_url=url,
    )  # fmt: skip
    torch.manual_seed(0)
    dataset = Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])
    trainer = GRPOTrainer(path, varied_reward, args, train_dataset=dataset)
    assert isinstance(trainer.backend, VLLMServerBackend)
    trainer.train()
    return {k: v for entry in trainer.state.log_history for k, v in entry.items()}


@pytest.mark.slow
def test_grpo_server_mode_replays_the_servers_routing(moe_path, tmp_path):
    """On-policy GRPO against ``posttrain serve``: with the server's routing replayed the importance ratio is 1 on
    every token; without it the near-tied routers route some tokens otherwise and the ratio is not 1."""
    engine = PosttrainEngine.from_pretrained(moe_path, device="cpu")
    with serve_in_thread(engine) as url:
        replayed = _grpo_server(moe_path, tmp_path / "replay", url, keep_routing=True)
        plain = _grpo_server(moe_path, tmp_path / "plain", url, keep_routing=False)
    for key in ("raw_importance_sampling_ratio/min", "raw_importance_sampling_ratio/max"):
        assert replayed[f"sampling/{key}"] == pytest.approx(1.0, abs=1e-4), key
    assert replayed["sampling/sampling_logp_difference/max"] < 1e-4
    mismatch = max(plain["sampling/raw_importance_sampling_ratio/max"] - 1.0,
                   1.0 - plain["sampling/raw_importance_sampling_ratio/min"])  # fmt: skip
    assert mismatch > 1e-3
    assert plain["sampling/sampling_logp_difference/max"] > 1e-3


def _rloo_server(path: str, tmp_path, url: str, keep_routing: bool) -> float:
    """One on-policy RLOO step against ``posttrain serve``; the largest |π_old − π_sampler| per-token log-prob gap
    over the trained tokens of every micro-batch (RLOO has no IS correction: the gap is the mismatch itself)."""
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    args = RLOOConfig(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", logging_steps=1, gradient_checkpointing=False,
        write_report=False, disable_tqdm=True, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=12, max_steps=1, learning_rate=1e-3, seed=7, beta=0.0, keep_routing=keep_routing,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=url,
    )  # fmt: skip
    torch.manual_seed(0)
    dataset = Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])
    trainer = RLOOTrainer(path, varied_reward, args, train_dataset=dataset)
    assert isinstance(trainer.backend, VLLMServerBackend)
    gaps, routed = [], []
    compute_loss = trainer._compute_loss

    def watching(model, inputs):
        mask = inputs["completion_mask"].bool()
        gap = (inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]).abs()[mask]
        gaps.append(float(gap.max()))
        routed.append("completion_routing" in inputs)
        return compute_loss(model, inputs)

    trainer._compute_loss = watching
    trainer.train()
    assert gaps and set(routed) == {keep_routing}
    return max(gaps)


@pytest.mark.slow
def test_rloo_server_mode_replays_the_servers_routing(moe_path, tmp_path):
    """RLOO in server mode goes through the same path as GRPO: the server's routing reaches the batch, π_old (the
    pipeline's forward) replays it and equals the server's sampling log-probs on every trained token (on-policy
    ratio π_old / π_sampler = 1); without replay the near-tied routers make them differ."""
    engine = PosttrainEngine.from_pretrained(moe_path, device="cpu")
    with serve_in_thread(engine) as url:
        replayed = _rloo_server(moe_path, tmp_path / "replay", url, keep_routing=True)
        plain = _rloo_server(moe_path, tmp_path / "plain", url, keep_routing=False)
    assert replayed < 1e-4
    assert plain > 1e-3


def test_grpo_server_mode_with_a_dense_policy_fails_at_construction(server_url, tiny_model_path, tmp_path):
    with pytest.raises(ValueError, match="keep_routing=True.*no MoE router"):
        _grpo_server(tiny_model_path, tmp_path, server_url, keep_routing=True)


def test_server_pool_reassembles_each_servers_routing(moe_path):
    """Two servers (``vllm_server_base_urls``): each chunk's routing comes from the server that sampled it and the
    rows keep their order: it equals the chunks sent one by one to a single server with the chunks' seeds."""
    from types import SimpleNamespace

    from posttrain.generation.registry import get_backend
    from posttrain.generation.server_pool import ServerPoolBackend, chunk_seed, split_groups

    engines = [PosttrainEngine.from_pretrained(moe_path, device="cpu") for _ in range(2)]
    sampling = _sampling(engines[0])
    with serve_in_thread(engines[0]) as url0, serve_in_thread(engines[1]) as url1:
        args = SimpleNamespace(vllm_server_base_url=None, vllm_server_base_urls=[url0, url1], vllm_server_timeout=10.0,
                               seed=5)  # fmt: skip
        pool = get_backend("vllm_server", None, None, args=args)
        assert isinstance(pool, ServerPoolBackend)
        pool.check_routing_support()
        out = pool.generate(PROMPTS, sampling, 2)
        single = VLLMServerBackend(base_url=url1, timeout=5.0)
        expected = []
        for c, groups in enumerate(split_groups(len(PROMPTS), 2)):
            chunk = SamplingConfig(6, temperature=0.9, eos_token_ids=sampling.eos_token_ids,
                                   pad_token_id=sampling.pad_token_id, return_routing=True,
                                   generation_kwargs={"seed": chunk_seed(request_seed(5, 0, 0), c)})  # fmt: skip
            expected.append(single.generate([PROMPTS[g] for g in groups], chunk, 2))
        single.close()
        pool.close()
    rows = [r for e in expected for r in e.routing]
    assert out.routing is not None and len(out.routing) == len(rows) == 6
    assert all(torch.equal(a, b) for a, b in zip(out.routing, rows))


@pytest.mark.parametrize(
    "route, body",
    [
        ("/generate/", {"prompts": [[5, 6, 7]], "max_tokens": 2, "return_routing": True}),
        ("/generate/", {"prompts": [[5, 6, 7]], "max_tokens": 2, "generation_kwargs": {"return_routing": True}}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "return_routing": True},
        ),
    ],
)
def test_routes_without_routing_answer_a_clear_400(client, route, body):
    """``return_routing`` is answered on ``/v1/completions`` only: TRL's ``/generate/`` (its response has no place for
    the prompt's routing) and the chat route (captured agent rows carry no routing) answer a 400 naming it and the
    fix, instead of a generic unknown-field error or a silent drop."""
    with pytest.raises(ServerRequestError, match=r"return_routing=true \(keep_routing\).*/v1/completions") as err:
        client.request("POST", route, json=body)
    assert err.value.status == 400 and err.value.param == "return_routing"
