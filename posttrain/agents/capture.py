"""Training rows from captured chat calls, and a ``rollout_func`` that trains an agent running its own loop.

An agent program (a Harbor agent, an OpenAI-client script, anything that speaks ``/v1/chat/completions``) makes
several chat calls per episode against ``posttrain serve``. Under a rollout id the server records each call (see
``posttrain.serving.capture``): the rendered prompt's ids, each choice's token ids, sampling log-probs, finish
reason and the weight version. This module turns those calls back into training rows:

- ``captured_rows(calls)``: consecutive calls whose prompt *extends* the previous call's prompt + completion (the
  agent appended tool outputs or a user turn and re-sent the conversation) merge into one row. Its loss mask
  (``env_mask``) is 1 exactly on the tokens the model sampled and 0 on everything the agent added in between (tool
  outputs, the template's turn markers), which are context. When the new prompt does not extend the previous one
  (the agent rewrote or truncated its history, or re-tokenising the conversation gave other ids than the ones
  sampled) a new row starts: a rollout may give several rows.
- ``agent_rollout_func(agent, ...)``: a TRL-style ``rollout_func`` for ``GRPOTrainer(rollout_func=...)``. For each
  prompt it runs the agent (bounded in time) under a fresh rollout id against the server, collects the capture,
  builds the row and returns ``prompt_ids`` / ``completion_ids`` / ``logprobs`` / ``env_mask`` plus the agent's
  reward as the extra field ``agent_reward`` (``agent_reward_func`` hands it to the trainer as the reward). Before
  each generation batch it pushes the policy's weights to the server, so the rows are on-policy.

Why the capture and not a re-tokenisation of the transcript: the trainer must score exactly the ids that were
sampled, with the log-probs they were sampled with (importance sampling ratio 1 on-policy); re-rendering the final
conversation can tokenise the model's own text differently, and the trainer would then train on tokens the model
never produced.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CapturedRow", "AgentRolloutFunc", "agent_reward_func", "agent_rollout_func", "captured_rows"]


@dataclass
class CapturedRow:
    """One training row assembled from one or more captured calls.

    Attributes:
        prompt_ids: The first call's prompt ids (the row's prompt).
        completion_ids: Everything after the prompt: the model's sampled tokens and, between calls, the tokens the
            agent added (tool outputs, turn markers, user turns).
        logprobs: Per completion token: the sampling log-prob for the model's tokens, ``0.0`` for context tokens.
        env_mask: Per completion token: 1 = sampled by the model (trained on), 0 = context.
        versions: The weight version of each call in the row, in order.
        calls: The capture indices of the calls in the row.
        finish_reason: The last call's finish reason (``"stop"``, ``"tool_calls"``, ``"length"``).
    """

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def version(self) -> int | None:
        """The oldest weight version any of the row's tokens were sampled with (what staleness is measured by)."""
        known = [v for v in self.versions if v is not None]
        return min(known) if known else None

    @property
    def ids(self) -> list[int]:
        """Prompt + completion: the whole sequence the next call would have to extend."""
        return self.prompt_ids + self.completion_ids


def _choices(call: Mapping[str, Any], where: str) -> list[Mapping[str, Any]]:
    for key in ("prompt_token_ids", "completions"):
        if key not in call:
            raise ValueError(f"{where} has no {key!r}: pass the calls of GET/DELETE /v1/rollouts/<id> (its 'calls').")
    choices = call["completions"]
    if not choices:
        raise ValueError(f"{where} has no completions.")
    for j, c in enumerate(choices):
        if c.get("logprobs") is None or len(c["logprobs"]) != len(c["token_ids"]):
            raise ValueError(f"{where}.completions[{j}] needs one log-prob per token id (the server records them).")
    return choices


def _extends(ids: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(ids) >= len(prefix) and list(ids[: len(prefix)]) == list(prefix)


def captured_rows(calls: Sequence[Mapping[str, Any]]) -> list[CapturedRow]:
    """Assemble a rollout's captured calls (in the order they were answered) into training rows.

    A call with several choices (``n > 1``) contributes the choice the agent went on with: the one whose prompt +
    completion the next call's prompt extends (choice 0 for the last call, or when no choice is extended; its
    siblings are not part of the agent's trajectory and are left out). A call whose prompt extends the current row
    (``row.prompt_ids + row.completion_ids``) is appended to it: the new prompt's extra tokens as context (mask 0,
    log-prob 0), then its completion (mask 1, its sampling log-probs). Any other call starts a new row.

    Args:
        calls: The ``calls`` list of ``GET``/``DELETE /v1/rollouts/<id>`` (each with ``prompt_token_ids``,
            ``completions`` of ``token_ids``/``logprobs``/``finish_reason``, ``version`` and ``index``).

    Returns:
        The rows, in call order (one per uninterrupted stretch of the conversation).
    """
    calls = sorted(calls, key=lambda c: c.get("index", 0))
    checked = [_choices(c, f"calls[{i}]") for i, c in enumerate(calls)]
    rows: list[CapturedRow] = []
    row: CapturedRow | None = None
    for i, (call, choices) in enumerate(zip(calls, checked)):
        prompt = [int(t) for t in call["prompt_token_ids"]]
        chosen = choices[0]
        if i + 1 < len(calls):
            following = calls[i + 1]["prompt_token_ids"]
            chosen = next((c for c in choices if _extends(following, prompt + list(c["token_ids"]))), chosen)
        if row is None or not _extends(prompt, row.ids):
            row = CapturedRow(prompt_ids=prompt)
            rows.append(row)
        else:  # what the agent appended since the last completion: context, not trained on
            added = prompt[len(row.ids) :]
            row.completion_ids += added
            row.logprobs += [0.0] * len(added)
            row.env_mask += [0] * len(added)
        tokens = [int(t) for t in chosen["token_ids"]]
        row.completion_ids += tokens
        row.logprobs += [float(x) for x in chosen["logprobs"]]
        row.env_mask += [1] * len(tokens)
        row.versions.append(call.get("version"))
        row.calls.append(int(call.get("index", i)))
        row.finish_reason = chosen.get("finish_reason")
    return rows


# -- the rollout_func --------------------------------------------------------------------------------------------
AgentFn = Callable[[Any, str, str], float]
"""``agent(prompt, base_url, rollout_id) -> reward``: runs its own loop against the OpenAI-compatible ``base_url``
(``http://host:port/rollouts/<id>/v1``: every call it makes there is captured under ``rollout_id``)."""

MULTI_ROW = ("last", "error")


class AgentRolloutFunc:
    """``rollout_func(prompts, trainer)`` that runs an agent program per prompt and trains on its captured calls.

    Args:
        agent: A function ``agent(prompt, base_url, rollout_id) -> float`` (run in a worker thread), or a command
            (``list[str]``) run as a subprocess per prompt with ``OPENAI_BASE_URL`` (the rollout's base URL),
            ``OPENAI_API_KEY`` (``"unused"``), ``POSTTRAIN_ROLLOUT_ID`` and ``POSTTRAIN_PROMPT`` (the prompt as
            JSON) in its environment; it prints its reward as the last line of its stdout.
        server_url: The ``posttrain serve`` server (default: the trainer's ``vllm_server_base_url``).
        timeout: Seconds one agent run may take; a run over it is a ``TimeoutError`` naming the rollout (a
            subprocess is killed; a function's thread cannot be, and is left to finish on its own; the batch as a
            whole waits at most ``timeout × ⌈prompts / max_workers⌉``, + 5 s for commands).
        max_workers: How many agents run at once (the server batches their calls).
        multi_row: What to do when an agent's calls give several rows (it rewrote its history): ``"last"`` trains
            on the last row (the stretch that ends in the answer the reward judged; the count is reported in the
            ``capture_num_rows`` field), ``"error"`` refuses with a ``ValueError``.
        sync_weights: Push the policy's weights to the server before each generation batch (once per optimizer
            step, versioned with the trainer's ``global_step``), as the trainer does for its own server backend.

    The agent decides how it samples; for the rows' log-probs to be the trainer's (importance-sampling ratio 1
    on-policy) it should sample at the trainer's ``temperature`` with ``top_p=1`` and ``top_k=0`` (the server's
    log-probs are those of the distribution it sampled from).
    """

    def __init__(
        self,
        agent: AgentFn | Sequence[str],
        server_url: str | None = None,
        *,
        timeout: float = 300.0,
        max_workers: int = 8,
        multi_row: str = "last",
        sync_weights: bool = True,
    ):
        if not callable(agent) and not (isinstance(agent, Sequence) and agent and not isinstance(agent, str)):
            raise TypeError("agent must be a function agent(prompt, base_url, rollout_id) -> reward or a command "
                            f"(a non-empty list of strings), got {type(agent).__name__}.")  # fmt: skip
        if multi_row not in MULTI_ROW:
            raise ValueError(f"multi_row must be one of {MULTI_ROW}, got {multi_row!r}.")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}.")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}.")
        self.agent, self.server_url, self.timeout = agent, server_url, float(timeout)
        self.max_workers, self.multi_row, self.sync_weights = max_workers, multi_row, sync_weights
        self._backend: Any = None  # the weight pusher (a VLLMServerBackend), made on first use
        self._synced_step: int | None = None
        self.last_rows: list[list[CapturedRow]] = []  # every row of the last batch's rollouts (inspection, tests)
        self.last_calls: list[list[dict[str, Any]]] = []  # the captured calls they were built from
        self.last_ids: list[str] = []  # and the rollout ids they were captured under

    # -- plumbing ----------------------------------------------------------------------------------------------
    def _url(self, trainer: Any) -> str:
        url = self.server_url or getattr(getattr(trainer, "args", None), "vllm_server_base_url", None)
        if not url:
            raise ValueError("agent_rollout_func needs the server's URL: pass server_url=... or set the trainer's "
                             "vllm_server_base_url.")  # fmt: skip
        return url.rstrip("/")

    def _push_weights(self, trainer: Any, url: str) -> None:
        if not self.sync_weights or trainer is None or not hasattr(trainer, "model"):
            return
        step = int(getattr(getattr(trainer, "state", None), "global_step", 0))
        if step == self._synced_step:
            return
        from posttrain.generation.vllm_server import VLLMServerBackend

        if self._backend is None:
            self._backend = VLLMServerBackend(args=getattr(trainer, "args", None), base_url=url, protocol="posttrain")
        model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
        self._backend.sync_weights(model, version=step)
        self._synced_step = step

    def _run_agent(self, prompt: Any, url: str, rollout_id: str) -> float:
        base_url = f"{url}/rollouts/{rollout_id}/v1"
        if callable(self.agent):
            return float(self.agent(prompt, base_url, rollout_id))
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "unused",
               "POSTTRAIN_ROLLOUT_ID": rollout_id, "POSTTRAIN_PROMPT": json.dumps(prompt)}  # fmt: skip
        try:
            done = subprocess.run(list(self.agent), env=env, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired as err:
            raise TimeoutError(f"The agent command for rollout {rollout_id!r} ran over timeout={self.timeout}s "
                               "and was killed.") from err  # fmt: skip
        lines = done.stdout.strip().splitlines()
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"The agent command for rollout {rollout_id!r} exited with {done.returncode} without "
                               f"printing its reward; stderr: {done.stderr[-2000:]}")  # fmt: skip
        try:
            return float(lines[-1])
        except ValueError as err:
            raise RuntimeError(f"The agent command for rollout {rollout_id!r} must print its reward (a number) as "
                               f"the last line of stdout, got {lines[-1]!r}.") from err  # fmt: skip

    def _collect(self, http: Any, url: str, rollout_id: str) -> list[dict[str, Any]]:
        resp = http.delete(f"{url}/v1/rollouts/{rollout_id}")
        if resp.status_code == 404:
            raise ValueError(f"The agent made no chat calls under rollout {rollout_id!r}: it must call the "
                             "base_url it was given (…/rollouts/<id>/v1), so its calls are captured.")  # fmt: skip
        resp.raise_for_status()
        return resp.json()["calls"]

    def _row(self, rows: list[CapturedRow], rollout_id: str) -> CapturedRow:
        if len(rows) > 1 and self.multi_row == "error":
            raise ValueError(f"Rollout {rollout_id!r} gave {len(rows)} training rows (the agent rewrote its history "
                             "between calls); multi_row='error' refuses it, multi_row='last' trains on the last "
                             "row.")  # fmt: skip
        return rows[-1]

    # -- the rollout_func contract -----------------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any = None) -> dict[str, list]:
        import httpx

        url = self._url(trainer)
        self._push_weights(trainer, url)
        run = uuid.uuid4().hex[:12]
        ids = [f"agent-{run}-{i}" for i in range(len(prompts))]
        self.last_ids = ids
        workers = min(self.max_workers, max(len(prompts), 1))
        # the whole batch's bound: every wave of `workers` agents may take `timeout`; the margin lets a subprocess's
        # own (exact) timeout fire first, so that it is killed rather than abandoned
        margin = 0.0 if callable(self.agent) else 5.0
        deadline = time.monotonic() + self.timeout * math.ceil(len(prompts) / workers) + margin
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers)
        try:
            futures = [pool.submit(self._run_agent, p, url, rid) for p, rid in zip(prompts, ids)]
            rewards = []
            for future, rid in zip(futures, ids):
                try:
                    rewards.append(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
                except concurrent.futures.TimeoutError as err:  # (the builtin TimeoutError since Python 3.11)
                    if future.done():  # the agent's own TimeoutError (a killed subprocess)
                        raise
                    raise TimeoutError(f"The agent for rollout {rid!r} ran over timeout={self.timeout}s (a function "
                                       "agent cannot be stopped: its thread is left to finish).") from err  # fmt: skip
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask",
                                                "agent_reward", "capture_num_rows", "weight_version")}  # fmt: skip
        self.last_rows, self.last_calls = [], []
        with httpx.Client(timeout=60) as http:
            for rid, reward in zip(ids, rewards):
                calls = self._collect(http, url, rid)
                rows = captured_rows(calls)
                self.last_rows.append(rows)
                self.last_calls.append(calls)
                row = self._row(rows, rid)
                for key, value in (("prompt_ids", row.prompt_ids), ("completion_ids", row.completion_ids),
                                   ("logprobs", row.logprobs), ("env_mask", row.env_mask), ("agent_reward", reward),
                                   ("capture_num_rows", len(rows)), ("weight_version", row.version)):  # fmt: skip
                    out[key].append(value)
        return out


def agent_rollout_func(
    agent: AgentFn | Sequence[str],
    server_url: str | None = None,
    *,
    timeout: float = 300.0,
    max_workers: int = 8,
    multi_row: str = "last",
    sync_weights: bool = True,
) -> AgentRolloutFunc:
    """A ``rollout_func`` for ``GRPOTrainer`` that trains an agent running its own loop (see ``AgentRolloutFunc``).

    Use it with ``reward_funcs=agent_reward_func`` (the agent's own reward) or any reward function that reads the
    ``agent_reward`` field.
    """
    return AgentRolloutFunc(agent, server_url, timeout=timeout, max_workers=max_workers, multi_row=multi_row,
                            sync_weights=sync_weights)  # fmt: skip


def agent_reward_func(completions: list[Any], agent_reward: list[float], **kwargs: Any) -> list[float]:
    """The reward each agent run returned (the ``agent_reward`` field of ``agent_rollout_func``'s rows)."""
    return [float(r) for r in agent_reward]
