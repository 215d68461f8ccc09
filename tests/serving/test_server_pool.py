"""Several generation servers (``vllm_server_base_urls``) over loopback: a round's groups are split in chunks of
whole groups, reassembled in order, a chunk's tokens do not depend on which server serves it, weights reach every
server, a server stopped mid-run is dropped with a warning and its chunks re-issued, all stopped is a clear error."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from reward_helpers import varied_reward
from transformers import TrainerCallback

from posttrain.generation.base import SamplingConfig
from posttrain.generation.client import ServerUnavailableError
from posttrain.generation.registry import get_backend
from posttrain.generation.server_pool import (
    ServerPoolBackend,
    chunk_seed,
    resolve_server_urls,
    split_groups,
)
from posttrain.generation.vllm_server import VLLMServerBackend, request_seed
from posttrain.serving.app import serve_in_thread
from posttrain.serving.engine import PosttrainEngine

EOS, PAD = 258, 259
PROMPTS = [list(b"hello there"), list(b"a"), list(b"the quick brown fox"), list(b"xyz"), list(b"q")]
SAMPLING = SamplingConfig(6, temperature=0.9, top_k=50, eos_token_ids=[EOS], pad_token_id=PAD)


def _engine(path):
    return PosttrainEngine.from_pretrained(path, device="cpu")


def test_split_groups_is_contiguous_and_balanced():
    assert split_groups(5, 2) == [range(0, 3), range(3, 5)]
    assert split_groups(1, 3) == [range(0, 1), range(1, 1), range(1, 1)]
    assert [len(r) for r in split_groups(7, 3)] == [3, 2, 2]
    assert chunk_seed(123, 0) == 123 and chunk_seed(123, 1) != chunk_seed(123, 2)


def test_url_fields_resolve_and_conflicts_are_named():
    args = SimpleNamespace(vllm_server_base_url=None, vllm_server_base_urls=["http://a:1/", "http://b:2"])
    assert resolve_server_urls(args) == ["http://a:1", "http://b:2"]
    assert resolve_server_urls(SimpleNamespace(vllm_server_base_urls="http://a:1,http://b:2")) == [
        "http://a:1",
        "http://b:2",
    ]
    with pytest.raises(ValueError, match="vllm_server_base_url=.*vllm_server_base_urls"):
        resolve_server_urls(SimpleNamespace(vllm_server_base_url="http://c:3", vllm_server_base_urls=["http://a:1"]))
    with pytest.raises(ValueError, match="twice"):
        resolve_server_urls(SimpleNamespace(vllm_server_base_urls=["http://a:1", "http://a:1/"]))
    with pytest.raises(ValueError, match="empty"):
        resolve_server_urls(SimpleNamespace(vllm_server_base_urls=[]))


def test_registry_one_url_list_is_the_single_server_backend(server_url):
    args = SimpleNamespace(vllm_server_base_url=None, vllm_server_base_urls=[server_url], vllm_server_timeout=5.0,
                           seed=3)  # fmt: skip
    backend = get_backend("vllm_server", None, None, args=args)
    assert type(backend) is VLLMServerBackend and backend.base_url == server_url


def test_pool_reassembles_chunks_in_order_and_a_chunk_is_server_independent(tiny_model_path):
    """Rows come back in prompt order; chunk c carries chunk_seed(request seed, c); sending chunk 1 to server 0
    instead of server 1 gives the same tokens (same weights, same seed)."""
    with serve_in_thread(_engine(tiny_model_path)) as url0, serve_in_thread(_engine(tiny_model_path)) as url1:
        args = SimpleNamespace(vllm_server_base_url=None, vllm_server_base_urls=[url0, url1],
                               vllm_server_timeout=10.0, seed=5)  # fmt: skip
        pool = get_backend("vllm_server", None, None, args=args)
        assert isinstance(pool, ServerPoolBackend)
        out = pool.generate(PROMPTS, SAMPLING, 2)
        assert out.prompt_ids == [p for p in PROMPTS for _ in range(2)]
        assert pool.state_dict() == {"requests": 1}
        base = request_seed(5, 0, 0)
        single = VLLMServerBackend(base_url=url0, timeout=5.0)
        expected = []
        for c, groups in enumerate(split_groups(len(PROMPTS), 2)):
            sampling = SamplingConfig(6, temperature=0.9, top_k=50, eos_token_ids=[EOS], pad_token_id=PAD,
                                      generation_kwargs={"seed": chunk_seed(base, c)})  # fmt: skip
            expected.append(single.generate([PROMPTS[g] for g in groups], sampling, 2))  # both chunks on server 0
        assert out.completion_ids == [ids for e in expected for ids in e.completion_ids]
        assert out.logprobs == [lp for e in expected for lp in e.logprobs]
        metrics = pool.pop_metrics()
        assert metrics["server/0/requests"] == 1 and metrics["server/1/requests"] == 1
        assert metrics["server/0/tokens"] + metrics["server/1/tokens"] == sum(map(len, out.completion_ids))
        assert metrics["server/live"] == 2 and metrics["server/1/failures"] == 0
        single.close()
        pool.close()


def test_pool_keeps_each_chunks_kept_mass_and_sampling_mask(tiny_model_path):
    """Truncated sampling over two servers: the kept mass (the IS correction) and the kept support
    (``keep_sampling_mask``) of every row survive the reassembly, equal to the chunks served one by one."""
    truncated = dict(temperature=0.9, top_p=0.8, eos_token_ids=[EOS], pad_token_id=PAD, return_sampling_mask=True)
    with serve_in_thread(_engine(tiny_model_path)) as url0, serve_in_thread(_engine(tiny_model_path)) as url1:
        args = SimpleNamespace(vllm_server_base_url=None, vllm_server_base_urls=[url0, url1],
                               vllm_server_timeout=10.0, seed=5)  # fmt: skip
        pool = get_backend("vllm_server", None, None, args=args)
        out = pool.generate(PROMPTS, SamplingConfig(6, **truncated), 2)
        single = VLLMServerBackend(base_url=url1, timeout=5.0)
        expected = [
            single.generate([PROMPTS[g] for g in groups], SamplingConfig(
                6, **truncated, generation_kwargs={"seed": chunk_seed(request_seed(5, 0, 0), c)}), 2)
            for c, groups in enumerate(split_groups(len(PROMPTS), 2))
        ]  # fmt: skip
        single.close()
        pool.close()
    assert out.log_kept_mass is not None and out.sampling_mask is not None
    assert out.log_kept_mass == [m for e in expected for m in e.log_kept_mass]
    assert out.sampling_mask == [m for e in expected for m in e.sampling_mask]
    assert any(m < 0.0 for row in out.log_kept_mass for m in row)  # top_p=0.8 did cut


def test_pool_fills_a_chunk_without_truncation_with_neutral_values():
    """One server truncated nothing (its fields are None), the other did: the first's rows read log S = 0 and an
    unknown (full-softmax) support, rather than the whole round losing the other chunk's correction."""
    from posttrain.generation.base import Completions
    from posttrain.generation.server_pool import _per_token_field

    plain = Completions([[1, 2], [3]], None, [True, True], [[9], [9]])
    cut = Completions([[4]], None, [True], [[8]], log_kept_mass=[[-0.5]], sampling_mask=[[[4, 5]]])
    assert _per_token_field([plain, cut], "log_kept_mass", 0.0) == [[0.0, 0.0], [0.0], [-0.5]]
    assert _per_token_field([plain, cut], "sampling_mask", None) == [[None, None], [None], [[4, 5]]]
    assert _per_token_field([plain, plain], "log_kept_mass", 0.0) is None


def _grpo_args(tmp_path, urls, **overrides):
    from posttrain.trainers.grpo import GRPOConfig

    values = dict(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", logging_steps=1,
        gradient_checkpointing=False, write_report=False, disable_tqdm=True, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=6, max_steps=3, learning_rate=5e-2, seed=7, temperature=0.9,
        use_vllm=True, vllm_mode="server", vllm_server_base_urls=urls, steps_per_generation=1,
        lr_scheduler_type="constant", vllm_server_timeout=10.0, request_timeout=60.0,
    )  # fmt: skip
    values.update(overrides)
    return GRPOConfig(**values)


def _dataset():
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])


class _StopAfterStep(TrainerCallback):
    def __init__(self, step, servers):
        self.step, self.servers = step, servers

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            for server in self.servers:
                server.stop()


@pytest.mark.slow
def test_grpo_over_two_servers_survives_one_stopped_mid_run(tiny_model_path, tmp_path):
    """3 GRPO steps over 2 servers; in a second run server 1 is stopped after step 1: training finishes on server 0
    with a warning naming server 1, and — chunks keep their seeds when re-issued — reaches the same parameters and
    losses bitwise as the run where both servers stayed up. Weights reached every live server each step."""
    from posttrain.trainers.grpo import GRPOTrainer

    engines = [_engine(tiny_model_path), _engine(tiny_model_path)]
    with serve_in_thread(engines[0]) as a0, serve_in_thread(engines[1]) as a1:
        full = GRPOTrainer(tiny_model_path, varied_reward, _grpo_args(tmp_path / "full", [a0, a1]),
                           train_dataset=_dataset())  # fmt: skip
        assert isinstance(full.backend, ServerPoolBackend)
        full.train()
        assert full.backend.live == [0, 1] and full.backend.version == 3
        assert [s.client.health()["version"] for s in full.backend.servers] == [3, 3]
        # the last push (before step 3's generation) reached both servers
        assert all(
            torch.equal(dict(engines[0].model.named_parameters())[n], p)
            for n, p in dict(engines[1].model.named_parameters()).items()
        )

    second = serve_in_thread(_engine(tiny_model_path), graceful_timeout=5)
    with serve_in_thread(_engine(tiny_model_path)) as b0, second as b1:
        trainer = GRPOTrainer(tiny_model_path, varied_reward, _grpo_args(tmp_path / "drop", [b0, b1]),
                              train_dataset=_dataset(), callbacks=[_StopAfterStep(1, [second])])  # fmt: skip
        with pytest.warns(RuntimeWarning, match=rf"Generation server 1 at {b1} failed .*dropped"):
            trainer.train()
        assert trainer.state.global_step == 3 and trainer.backend.live == [0] and not second.running
    expected = dict(full.model.named_parameters())
    for name, value in trainer.model.named_parameters():
        assert torch.equal(value, expected[name]), name
    losses = [e["loss"] for e in full.state.log_history if "loss" in e]
    assert losses == [e["loss"] for e in trainer.state.log_history if "loss" in e] and len(losses) == 3
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert logs["server/1/failures"] == 1 and logs["server/live"] == 1
    assert logs["server/0/requests"] >= 3 and logs["server/0/tokens"] > 0


def test_all_servers_stopped_is_a_clear_error_in_bounded_time(tiny_model_path, tmp_path):
    from posttrain.trainers.grpo import GRPOTrainer

    servers = [serve_in_thread(_engine(tiny_model_path), graceful_timeout=5) for _ in range(2)]
    with servers[0] as u0, servers[1] as u1:
        trainer = GRPOTrainer(tiny_model_path, varied_reward, _grpo_args(tmp_path, [u0, u1], max_steps=2),
                              train_dataset=_dataset(), callbacks=[_StopAfterStep(1, servers)])  # fmt: skip
        start = time.monotonic()
        with (
            pytest.warns(RuntimeWarning, match="dropped"),
            pytest.raises(ServerUnavailableError, match=r"All 2 generation servers .* were dropped"),
        ):
            trainer.train()
        assert time.monotonic() - start < 60  # refused connections fail after a few quick retries, not a timeout
        assert trainer.state.global_step == 1 and trainer.backend.live == []


def test_server_stopped_before_a_generation_has_its_chunk_reissued(tiny_model_path):
    """Server 1 stops between two generations with the same request index: the second call drops it with a
    warning (during generation), re-issues its chunk to server 0 and returns the same completions as the first."""
    second = serve_in_thread(_engine(tiny_model_path), graceful_timeout=5)
    with serve_in_thread(_engine(tiny_model_path)) as url0, second as url1:
        pool = ServerPoolBackend(base_urls=[url0, url1], timeout=10.0, seed=11)
        before = pool.generate(PROMPTS, SAMPLING, 3)
        second.stop()
        pool.set_request_index(0)
        with pytest.warns(RuntimeWarning, match=rf"server 1 at {url1} failed during generation \(chunk 1\)"):
            after = pool.generate(PROMPTS, SAMPLING, 3)
        assert after.completion_ids == before.completion_ids and after.logprobs == before.logprobs
        assert pool.live == [0] and "generation" in pool.dropped[1]
        metrics = pool.pop_metrics()
        assert metrics["server/0/requests"] == 3 and metrics["server/1/requests"] == 1
        assert metrics["server/1/failures"] == 1
        pool.close()


def test_stalled_server_is_dropped_after_its_request_timeout(tiny_model_path):
    """A server that accepts connections but never answers (a stall, not a refusal): its request ends in
    ServerTimeoutError within request_timeout, the server is dropped and its chunk served by the other."""
    import socket

    from posttrain.generation.client import GenerationClient

    with (
        socket.socket() as stalled,
        serve_in_thread(_engine(tiny_model_path)) as url0,
        serve_in_thread(_engine(tiny_model_path)) as url1,
    ):
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(8)  # never accepted: requests are sent, nothing ever answers
        stalled_url = f"http://127.0.0.1:{stalled.getsockname()[1]}"
        pool = ServerPoolBackend(base_urls=[url0, url1], timeout=10.0, seed=13)
        expected = pool.generate(PROMPTS, SAMPLING, 2)
        pool.servers[1].client.close()
        pool.servers[1].client = GenerationClient(stalled_url, request_timeout=1.0, health_check_interval=0.5)
        pool.set_request_index(0)
        start = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"server 1 .* dropped .*ServerTimeoutError"):
            out = pool.generate(PROMPTS, SAMPLING, 2)
        assert time.monotonic() - start < 30
        assert out.completion_ids == expected.completion_ids and pool.live == [0]
        pool.close()


def test_rloo_over_two_servers_logs_per_server_metrics(tiny_model_path, tmp_path):
    from posttrain.trainers.rloo import RLOOConfig, RLOOTrainer

    with serve_in_thread(_engine(tiny_model_path)) as u0, serve_in_thread(_engine(tiny_model_path)) as u1:
        args = RLOOConfig(output_dir=str(tmp_path), report_to="none", save_strategy="no", write_report=False,
                          disable_tqdm=True, gradient_checkpointing=False, per_device_train_batch_size=4,
                          num_generations=2, max_completion_length=4, max_steps=1, learning_rate=5e-2, logging_steps=1,
                          use_vllm=True, vllm_mode="server", vllm_server_base_urls=[u0, u1])  # fmt: skip
        trainer = RLOOTrainer(tiny_model_path, varied_reward, args, train_dataset=_dataset())
        assert isinstance(trainer.backend, ServerPoolBackend)
        trainer.train()
        assert [s.version for s in trainer.backend.servers] == [1, 1]
    logs = {k: v for entry in trainer.state.log_history for k, v in entry.items()}
    assert logs["server/live"] == 2 and logs["server/0/failures"] == 0
    assert logs["server/0/requests"] >= 1 and logs["server/1/requests"] >= 1 and logs["server/1/tokens"] > 0


def test_async_distillation_refuses_several_servers_clearly(monkeypatch):
    """AsyncDistillation streams rounds from one student server in this release: a list of several is refused at
    configuration time (it would otherwise silently use one of them); AsyncGRPO takes it."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from posttrain.experimental.async_distillation import AsyncDistillationConfig
    from posttrain.experimental.async_grpo import AsyncGRPOConfig

    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    with pytest.raises(ValueError, match="generates on one server.*vllm_server_base_urls lists 2"):
        AsyncDistillationConfig(output_dir="/tmp/unused", report_to="none", vllm_server_base_urls=urls)
    args = AsyncGRPOConfig(output_dir="/tmp/unused", report_to="none", vllm_server_base_urls=urls)
    assert resolve_server_urls(args) == urls  # AsyncGRPO's default vllm_server_base_url does not conflict


def test_push_fanout_all_servers_gone_is_a_clear_error():
    """AsyncGRPO's uploader over several servers: every push refused → each dropped with a warning, then one error
    naming both servers (bounded: refused connections fail after a few quick retries)."""
    import socket

    from posttrain.generation.client import GenerationClient
    from posttrain.generation.server_pool import PushFanout

    urls = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            urls.append(f"http://127.0.0.1:{s.getsockname()[1]}")  # closed again: connections are refused
    fanout = PushFanout([GenerationClient(url, request_timeout=10.0, retry_backoff=0.01) for url in urls])
    start = time.monotonic()
    with (
        pytest.warns(RuntimeWarning, match="failed during the weight push"),
        pytest.raises(ServerUnavailableError, match=rf"All 2 generation servers .*{urls[0]}.*{urls[1]}"),
    ):
        fanout.load_weights([b"unused"], 1)
    assert time.monotonic() - start < 10 and fanout.live == []
    fanout.close()
