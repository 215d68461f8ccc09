"""Several generation servers behind one backend: ``vllm_server_base_urls`` (posttrain's field; TRL has none).

``ServerPoolBackend`` holds one :class:`~posttrain.generation.vllm_server.VLLMServerBackend` per URL and routes a
generation round over them:

- **Chunks, not servers, carry the randomness.** A round's groups (a prompt and its ``num_generations``
  completions) are split, in order, into ``C = len(urls)`` contiguous chunks of sizes differing by at most one; all
  G completions of a group stay in one chunk (the server prefills its prompt once). Chunk ``c`` of the ``k``-th
  round is one request seeded with ``chunk_seed(request_seed(seed, rank, k), c)``. Chunk ``c`` goes to server ``c``
  while it is live, otherwise to the live servers in turn; chunks sent to one server go one request at a time, the
  servers in parallel. Results are reassembled in the original row order.
- **What is and is not equal.** The posttrain engine samples a seeded request's rows from one generator, so a
  group's tokens depend on the other groups in its request: a 2-server run is *not* token-equal to a 1-server run
  (the request is split). It is reproducible, and it is independent of *which* server serves a chunk: a chunk
  re-issued to another server (same weights, same seed) gets the same tokens, so a run where a server died mid-run
  equals the run where it did not. A one-URL list is exactly the single-server backend.
- **Weights** are pushed to every live server (each push verified by that server's answer — digest and version,
  ``WeightSyncError`` otherwise — and by the post-sync probe when ``vllm_weight_sync_probe`` is on) before the next
  generation.
- **Failures.** A server that is unreachable or stalls (``ServerUnavailableError``, including
  ``ServerTimeoutError``: connection refused, no answer within ``request_timeout``, a dead ``/health`` probe) during
  a generation or a push is dropped for the rest of the run with a warning naming it; its unfinished chunks are
  re-issued to the others. A server that answers wrongly (a 4xx, a ``WeightSyncError``) is not dropped: the error
  propagates. When no server is left, ``ServerUnavailableError`` names every URL and why each was dropped.
- **Metrics**, per configured server index ``i`` (``pop_metrics``, logged by the trainer each round):
  ``server/<i>/requests``, ``server/<i>/tokens`` (completion tokens), ``server/<i>/tokens_per_second``,
  ``server/<i>/failures`` and ``server/live`` (the number of servers still in use).

AsyncGRPO: the rollout worker builds this backend from the spec's ``base_urls`` (admission and a round's version use
:meth:`ServerPoolBackend.health_version` / ``version``: the oldest live server's), and the trainer's background
uploader pushes through :class:`PushFanout`, which drops a server whose push fails the same way.

Several training processes: each routes its own share of the round over the servers; dropping a server is
single-process only (only rank 0 pushes, so the ranks would disagree on who is live) — in a multi-process run a
failed server ends training with ``ServerUnavailableError`` naming it, as with one server.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from posttrain.generation.base import Completions, SamplingConfig

logger = logging.getLogger(__name__)


def chunk_seed(base: int, chunk: int) -> int:
    """The seed of chunk ``chunk`` of a round whose request seed is ``base`` (chunk 0 keeps ``base``)."""
    return (int(base) + int(chunk) * 2_654_435_761) % (2**31 - 1)


def split_groups(num_groups: int, num_chunks: int) -> list[range]:
    """``num_groups`` group indices in ``num_chunks`` contiguous ranges whose sizes differ by at most one (the first
    ones larger; empty ranges when there are fewer groups than chunks)."""
    base, extra = divmod(num_groups, num_chunks)
    out, start = [], 0
    for c in range(num_chunks):
        size = base + (c < extra)
        out.append(range(start, start + size))
        start += size
    return out


def resolve_server_urls(args: Any, base_urls: list[str] | None = None) -> list[str] | None:
    """The configured server list (``base_urls`` or ``args.vllm_server_base_urls``), or None for the single-URL
    fields. Both ``vllm_server_base_url`` (changed from its default, e.g. AsyncGRPO's ``http://localhost:8000``) and a
    list not containing it is an error (ambiguous)."""
    urls = base_urls if base_urls is not None else getattr(args, "vllm_server_base_urls", None)
    if urls is None:
        return None
    if isinstance(urls, str):
        urls = [u for u in urls.split(",") if u.strip()]
    urls = [str(u).strip().rstrip("/") for u in urls]
    if not urls:
        raise ValueError("vllm_server_base_urls is empty; give at least one server URL or leave it None.")
    if len(set(urls)) != len(urls):
        raise ValueError(f"vllm_server_base_urls lists a server twice: {urls}.")
    single = getattr(args, "vllm_server_base_url", None)
    default = getattr(getattr(type(args), "__dataclass_fields__", {}).get("vllm_server_base_url"), "default", None)
    if single is not None and single != default and single.rstrip("/") not in urls:
        raise ValueError(
            f"Both vllm_server_base_url={single!r} and vllm_server_base_urls={urls} are set; set only "
            "vllm_server_base_urls (every server) or only vllm_server_base_url (one server)."
        )
    return urls


def make_server_backend(model: Any = None, tokenizer: Any = None, args: Any = None, **kwargs: Any) -> Any:
    """The ``"vllm_server"`` registry entry: a :class:`ServerPoolBackend` when ``vllm_server_base_urls`` lists two
    or more servers, else the single-server :class:`VLLMServerBackend` (unchanged behaviour)."""
    from posttrain.generation.vllm_server import VLLMServerBackend

    base_urls = kwargs.pop("base_urls", None)
    urls = None if "base_url" in kwargs else resolve_server_urls(args, base_urls)
    if urls is not None and len(urls) >= 2:
        return ServerPoolBackend(model, tokenizer, args, base_urls=urls, **kwargs)
    if urls is not None:
        kwargs["base_url"] = urls[0]
    return VLLMServerBackend(model, tokenizer, args, **kwargs)


class ServerPoolBackend:
    """Generate over several generation servers and keep all of them in sync (see the module docstring).

    Args:
        model, tokenizer, args: As for ``VLLMServerBackend``.
        base_urls: The servers (default: ``args.vllm_server_base_urls``).
        **kwargs: ``VLLMServerBackend`` keywords (``protocol``, ``timeout``, ``seed``, ``client_kwargs``, ...),
            applied to every server.
    """

    def __init__(
        self, model: Any = None, tokenizer: Any = None, args: Any = None, *, base_urls: list[str] | None = None,
        **kwargs: Any,
    ):  # fmt: skip
        from posttrain.generation.vllm_server import VLLMServerBackend

        urls = resolve_server_urls(args, base_urls)
        if urls is None:
            raise ValueError("ServerPoolBackend needs base_urls (or args.vllm_server_base_urls).")
        self.base_urls = urls
        self.servers = [VLLMServerBackend(model, tokenizer, args, base_url=url, **kwargs) for url in urls]
        self.seed = self.servers[0].seed
        self.seed_requests = self.servers[0].seed_requests
        self.live = list(range(len(urls)))
        self.dropped: dict[int, str] = {}  # server index -> why it was dropped
        self._requests = 0
        self.seed_rank: int | None = None  # as VLLMServerBackend.seed_rank (None: this process's rank)
        self._lock = threading.Lock()
        self._metrics: dict[str, float] = {}
        self._totals = {i: {"requests": 0, "tokens": 0, "failures": 0} for i in range(len(urls))}

    # -- resume state (the same shape as the single-server backend's) --------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"requests": int(self._requests)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._requests = int(state["requests"])

    @property
    def request_index(self) -> int:
        return self._requests

    def set_request_index(self, k: int) -> None:
        if int(k) < 0:
            raise ValueError(f"set_request_index: k must be >= 0, got {k}.")
        self._requests = int(k)

    @property
    def version(self) -> int | None:
        """The oldest weight version the live servers last reported (they are pushed together; while a push is
        landing server by server, the oldest is the one a round's staleness must be counted from)."""
        versions = [self.servers[i].version for i in self._live()]
        return None if any(v is None for v in versions) else min(versions)

    @version.setter
    def version(self, value: int | None) -> None:
        for i in self._live():
            self.servers[i].version = value

    def health_version(self) -> int:
        """The oldest weight version the live servers report on ``/health`` now (an unreachable one is dropped)."""
        from posttrain.generation.client import ServerUnavailableError

        versions = []
        for i in self._live():
            try:
                versions.append(int(self.servers[i].client.health().get("version") or 0))
            except ServerUnavailableError as err:
                self._drop(i, err, "a health check")
        self._live()  # all dropped: the error naming every server
        return min(versions)

    @property
    def base_url(self) -> str:
        """The first live server's URL: for callers that need one server of the pool (e.g. a served teacher scoring
        sequences with the policy's weights, which every live server holds)."""
        return self.base_urls[self._live()[0]]

    @property
    def chunk_bytes(self) -> int:
        return self.servers[0].chunk_bytes

    @property
    def protocol(self) -> str:
        return self.servers[0].protocol

    # -- liveness ----------------------------------------------------------------------------------------------
    def _live(self) -> list[int]:
        if not self.live:
            reasons = "; ".join(f"{self.base_urls[i]}: {why}" for i, why in sorted(self.dropped.items()))
            from posttrain.generation.client import ServerUnavailableError

            raise ServerUnavailableError(
                f"All {len(self.base_urls)} generation servers in vllm_server_base_urls were dropped: {reasons}. "
                "Restart them (`posttrain serve` / `vllm serve`) and resume from the last checkpoint."
            )
        return list(self.live)

    def _drop(self, index: int, err: BaseException, during: str) -> None:
        from posttrain.generation.vllm_server import _dist

        if _dist()[1]:
            # Each process would drop on its own (only rank 0 pushes): the ranks' pushes and barriers would diverge.
            from posttrain.generation.client import ServerUnavailableError

            raise ServerUnavailableError(
                f"Generation server {index} at {self.base_urls[index]} failed during {during} ({err}); dropping a "
                "server is supported in single-process training only. Restart it and resume from the last "
                "checkpoint, or remove it from vllm_server_base_urls."
            ) from err
        with self._lock:
            if index not in self.live:
                return
            self.live.remove(index)
            self.dropped[index] = f"{type(err).__name__} during {during}: {err}"
            self._totals[index]["failures"] += 1
        message = (
            f"Generation server {index} at {self.base_urls[index]} failed during {during} and is dropped for the rest "
            f"of the run ({type(err).__name__}: {err}); {len(self.live)} of {len(self.base_urls)} servers left."
        )
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        logger.warning(message)

    # -- generation --------------------------------------------------------------------------------------------
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingConfig, num_generations: int = 1) -> Completions:
        """``num_generations`` completions per prompt, rows ``[p0 g0, p0 g1, ..., p1 g0, ...]``, spread over the live
        servers by chunks of whole groups (module docstring)."""
        from posttrain.generation.client import ServerUnavailableError
        from posttrain.generation.vllm_server import _dist, request_seed

        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}.")
        if not prompt_ids:
            return Completions([], [], [], [])
        extra = dict(sampling.generation_kwargs or {})
        base = extra.pop("seed", None)
        if base is None and self.seed_requests:
            base = request_seed(self.seed, _dist()[0] if self.seed_rank is None else self.seed_rank, self._requests)
        self._requests += 1
        chunks = [c for c in split_groups(len(prompt_ids), len(self.base_urls))]
        results: dict[int, Completions] = {}
        pending = [c for c, groups in enumerate(chunks) if len(groups)]
        timing = {i: 0.0 for i in range(len(self.base_urls))}
        tokens = {i: 0 for i in range(len(self.base_urls))}
        requests = {i: 0 for i in range(len(self.base_urls))}

        def serve(index: int, mine: list[int]) -> list[int]:
            """Send this server its chunks one by one; return the chunks it did not finish (after a failure)."""
            for pos, c in enumerate(mine):
                kwargs = dict(extra)
                if base is not None:
                    kwargs["seed"] = chunk_seed(base, c)
                chunk_sampling = dataclasses.replace(sampling, generation_kwargs=kwargs or None)
                start = time.perf_counter()
                try:
                    out = self.servers[index].generate(
                        [prompt_ids[g] for g in chunks[c]], chunk_sampling, num_generations
                    )
                except ServerUnavailableError as err:
                    self._drop(index, err, f"generation (chunk {c})")
                    return mine[pos:]
                timing[index] += time.perf_counter() - start
                requests[index] += 1
                tokens[index] += sum(len(ids) for ids in out.completion_ids)
                results[c] = out
            return []

        while pending:
            live = self._live()
            assignment: dict[int, list[int]] = {i: [] for i in live}
            spill = 0
            for c in pending:
                if c in assignment:
                    assignment[c].append(c)
                else:
                    assignment[live[spill % len(live)]].append(c)
                    spill += 1
            work = {i: chunks_ for i, chunks_ in assignment.items() if chunks_}
            if len(work) == 1:
                ((i, mine),) = work.items()
                left = {i: serve(i, mine)}
            else:
                with ThreadPoolExecutor(max_workers=len(work), thread_name_prefix="posttrain-server-pool") as pool:
                    futures = {i: pool.submit(serve, i, mine) for i, mine in work.items()}
                    left = {i: f.result() for i, f in futures.items()}
            pending = sorted(c for unfinished in left.values() for c in unfinished)
        self._record_round(requests, tokens, timing)
        parts = [results[c] for c in sorted(results)]
        logprobs = None if any(p.logprobs is None for p in parts) else [lp for p in parts for lp in p.logprobs]
        # keep_routing: every server's sampler recorded its chunk's routing (each asked return_routing)
        routing = None if any(p.routing is None for p in parts) else [r for p in parts for r in p.routing]
        return Completions(
            [ids for p in parts for ids in p.completion_ids],
            logprobs,
            [f for p in parts for f in p.finished],
            [r for p in parts for r in p.prompt_ids],
            log_kept_mass=_per_token_field(parts, "log_kept_mass", 0.0),
            routing=routing,
            sampling_mask=_per_token_field(parts, "sampling_mask", None),
        )

    def check_routing_support(self) -> None:
        """``keep_routing``: every server must be a ``posttrain serve`` with the posttrain engine
        (:meth:`VLLMServerBackend.check_routing_support`)."""
        for server in self.servers:
            server.check_routing_support()

    def _record_round(self, requests: dict[int, int], tokens: dict[int, int], timing: dict[int, float]) -> None:
        for i in range(len(self.base_urls)):
            totals = self._totals[i]
            totals["requests"] += requests[i]
            totals["tokens"] += tokens[i]
            self._metrics[f"server/{i}/requests"] = float(totals["requests"])
            self._metrics[f"server/{i}/tokens"] = float(totals["tokens"])
            self._metrics[f"server/{i}/failures"] = float(totals["failures"])
            if timing[i] > 0:
                self._metrics[f"server/{i}/tokens_per_second"] = tokens[i] / timing[i]
        self._metrics["server/live"] = float(len(self.live))

    def pop_metrics(self) -> dict[str, float]:
        """Per-server metrics since the last call (running totals for requests/tokens/failures, the last round's
        tokens/s); the trainer logs them with the round's metrics."""
        metrics, self._metrics = self._metrics, {}
        for i in self.dropped:  # a drop during a push shows up even before the next generation
            metrics.setdefault(f"server/{i}/failures", float(self._totals[i]["failures"]))
        metrics.setdefault("server/live", float(len(self.live)))
        return metrics

    # -- weights -----------------------------------------------------------------------------------------------
    def sync_weights(self, model: Any, version: int | None = None) -> None:
        """Push the policy's weights to every live server, each push verified by that server's answer (and by the
        post-sync probe when enabled); a server that is unreachable or stalls is dropped with a warning."""
        from posttrain.generation.client import ServerUnavailableError

        if version is None:  # one version for all (a server that joined fresh would otherwise lag behind)
            version = max(int(self.servers[i].version or 0) for i in self._live()) + 1
        for i in self._live():
            try:
                self.servers[i].sync_weights(model, version=version)
            except ServerUnavailableError as err:
                self._drop(i, err, "the weight push")
        versions = {self.servers[i].version for i in self._live()}
        if len(versions) > 1:
            from posttrain.generation.client import WeightSyncError

            raise WeightSyncError(
                "After pushing weights, the generation servers report different weight versions: "
                + ", ".join(f"{self.base_urls[i]}={self.servers[i].version}" for i in self.live)
                + ". A server was restarted or pushed by another trainer; restart them together and resume."
            )

    def probe(self, model: Any) -> list[dict[str, Any]]:
        """Run the post-sync probe on every live server (see ``VLLMServerBackend.probe``)."""
        return [self.servers[i].probe(model) for i in self._live()]

    def close(self) -> None:
        for server in self.servers:
            try:
                server.close()
            except Exception:  # a dropped server may already be gone
                logger.debug("closing %s failed", server.base_url, exc_info=True)


class PushFanout:
    """Weight pushes to several servers behind ``GenerationClient``'s push interface (``load_weights``,
    ``get_sequence_logprobs``, ``base_url``, ``close``), for the async trainers' background uploader.

    ``load_weights`` pushes the same chunks to every live server in turn (each push verified by that server's answer:
    digests and version, ``WeightSyncError`` otherwise) and returns the version they report; a server that is
    unreachable or stalls is dropped with a warning naming it; with none left, ``ServerUnavailableError``.
    ``get_sequence_logprobs`` (the post-sync probe) asks the first live server.
    """

    def __init__(self, clients: list[Any]):
        self.clients = list(clients)
        self.live = list(range(len(self.clients)))
        self.dropped: dict[int, str] = {}

    @property
    def base_url(self) -> str:
        return self.clients[self._live()[0]].base_url

    def _live(self) -> list[int]:
        if not self.live:
            from posttrain.generation.client import ServerUnavailableError

            reasons = "; ".join(f"{self.clients[i].base_url}: {why}" for i, why in sorted(self.dropped.items()))
            raise ServerUnavailableError(
                f"All {len(self.clients)} generation servers in vllm_server_base_urls were dropped: {reasons}. "
                "Restart them and resume from the last checkpoint."
            )
        return list(self.live)

    def load_weights(self, chunks: list[bytes], version: int | None = None) -> int:
        from posttrain.generation.client import ServerUnavailableError

        versions = []
        for i in self._live():
            try:
                versions.append(self.clients[i].load_weights(chunks, version))
            except ServerUnavailableError as err:
                self.live.remove(i)
                self.dropped[i] = f"{type(err).__name__} during the weight push: {err}"
                message = (
                    f"Generation server {i} at {self.clients[i].base_url} failed during the weight push and is "
                    f"dropped for the rest of the run ({type(err).__name__}: {err}); {len(self.live)} of "
                    f"{len(self.clients)} servers left."
                )
                warnings.warn(message, RuntimeWarning, stacklevel=2)
                logger.warning(message)
        self._live()
        return min(versions)

    def get_sequence_logprobs(self, *args: Any, **kwargs: Any) -> Any:
        return self.clients[self._live()[0]].get_sequence_logprobs(*args, **kwargs)

    def close(self) -> None:
        for client in self.clients:
            client.close()


def _per_token_field(parts: list[Completions], name: str, neutral: Any) -> list[list[Any]] | None:
    """Concatenate a per-token ``Completions`` field (``log_kept_mass``, ``sampling_mask``) over the servers' chunks.

    ``None`` when no chunk carries it. A chunk without it (its server truncated nothing) contributes its rows filled
    with the field's neutral value, which means the same thing per token: log S = 0.0 (nothing cut) and a support of
    ``None`` (the full softmax) — so mixing chunks never drops a correction that another chunk needs.
    """
    if all(getattr(p, name) is None for p in parts):
        return None
    rows: list[list[Any]] = []
    for p in parts:
        values = getattr(p, name)
        rows.extend(values if values is not None else [[neutral] * len(ids) for ids in p.completion_ids])
    return rows
