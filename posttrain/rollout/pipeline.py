"""The shared online-RL rollout: prompts → completions → rewards → log-probs → advantages, as one tensor batch.

``RolloutPipeline.run(rows)`` is the whole recipe of TRL's ``_generate_and_score_completions``, shared by GRPO, RLOO
and (later) on-policy distillation; they differ only in the ``AdvantageEstimator`` they pass in and in how their
loss reads the batch:

1. ``render_prompts`` — conversational prompts through the chat template (``chat_template_kwargs``), then tokenized
   without special tokens; standard prompts tokenized as they are.
2. ``generate`` — the backend samples G completions per prompt. Rows arrive as whole groups of identical prompts
   (``RepeatSampler``), so each unique prompt is handed over once with ``num_generations=G`` (the ``posttrain``
   backend prefills it once); a ``rollout_func`` gets the raw prompts instead, as in TRL.
3. ``collate`` — left-padded prompts, right-padded completions, the loss mask (EOS-cut × tool mask × truncation
   mask when ``mask_truncated_completions``), sampling log-probs when the backend returned them.
4. ``decode`` — completion text; for conversational prompts ``[{"role": "assistant", "content": text}]``.
5. log-probs — π_old (only when needed) and π_ref (β ≠ 0) in no-grad passes of ``logprob_batch_size`` rows.
6. ``score`` — the ``RewardScorer`` with TRL's keyword contract, gathered over processes.
7. advantages — the estimator on the gathered batch; this process keeps its slice.
8. metrics (TRL's names), the sampling importance-sampling ratio, and the completions table for ``log_completions``.

Besides the batch, ``run`` keeps what it gathered over all processes for its last batch: ``last_result``
(:class:`RolloutResult`: the per-function rewards and the estimator's :class:`AdvantageResult`) and, with
``keep_completions``, ``last_completions``. A trainer stage after the rollout (SDPO's teacher context, the replay
buffer's group selection) reads them there instead of re-gathering or wrapping the estimator.

``defer_importance_sampling`` (server / async rollouts): when π_old is needed *only* for the sampler-vs-trainer
correction (the batch is trained on-policy: no ``compute_old_logps``, an estimator without π_old), stages 5 and 8
skip the π_old pass and the ratio; the loss computes the ratio from its own forward pass (its detached log-probs
are π_old on-policy) with :meth:`RolloutPipeline.importance_sampling` — one no-grad forward fewer per batch, same
ratio. Its ``sampling/*`` metrics are then per micro-batch, averaged over the logging window.

``run`` reads as these stages, one named method call each, timed into ``timing/<stage>`` metrics (``STAGES``).

The returned batch holds ``prompt_ids``/``prompt_mask`` ``(B, P)``, ``completion_ids``/``completion_mask`` ``(B, C)``,
``completion_lengths`` ``(B,)``, ``advantages`` ``(B,)``, optional ``old_per_token_logps``,
``ref_per_token_logps``, ``sampling_per_token_logps``, ``importance_sampling_ratio``, and ``num_items_in_batch``
(0-d: loss tokens of the whole generation batch over all processes, for DAPO-style normalisation).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from posttrain.core.importance import rollout_importance_weights
from posttrain.core.sampling_mask import collate_sampling_mask
from posttrain.data.response_parsing import parse_response
from posttrain.data.tokenization import tokenize_prompt
from posttrain.data.utils import is_conversational
from posttrain.data.vision_prompts import check_tool_image_inputs, encode_vision_prompts, row_images
from posttrain.distributed import gather_objects, gather_rows
from posttrain.generation.base import Completions, GenerationBackend, SamplingConfig
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.estimators import AdvantageEstimator, AdvantageResult
from posttrain.rollout.metrics import completion_length_metrics, reward_metrics

MetricSink = Callable[[str, float], None]

# The stages of RolloutPipeline.run, each timed into ``timing/<stage>`` (seconds). TRL's profiling entries for the
# same work: ``transformers.generate`` / ``vLLM.generate`` (generate), ``_get_per_token_logps_and_entropies``
# (old_logps, ref_logps), ``_calculate_rewards`` (calculate_rewards).
STAGES = (
    "prepare_rows",
    "render_prompts",
    "generate",
    "collate",
    "decode",
    "old_logps",
    "ref_logps",
    "calculate_rewards",
    "advantages",
    "metrics",
    "importance_sampling",
    "completions_table",
)


class StageTimer:
    """``with timer("name"): ...`` records the block's wall time as ``timing/name`` through ``record``."""

    def __init__(self, record: MetricSink):
        self.record = record

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(f"timing/{name}", time.perf_counter() - start)


# Completions.extra fields that are the rollout's bookkeeping, not reward-function keyword arguments.
_NOT_REWARD_KWARGS = ("env_mask", "tool_mask", "tool_call_count", "tool_failure_count", "completion_messages")
LogpsFn = Callable[[RolloutBatch], torch.Tensor]


@dataclass
class ImportanceSamplingSettings:
    """The sampler-vs-trainer correction (TRL's ``vllm_importance_sampling_*`` fields)."""

    mode: str = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0
    # TRL 1.17's correction: compare π_old with the sampler's log-probs put back on the full-vocabulary scale
    # (processed log-prob + the log kept mass the sampler recorded under top-k / top-p / min-p truncation).
    truncation_correction: bool = True


@dataclass
class RolloutSettings:
    """What the pipeline needs from the trainer's config, resolved once.

    Attributes:
        num_generations / num_generations_eval: G in training / evaluation.
        logprob_batch_size: rows per no-grad log-prob pass (TRL: the per-device batch size).
        mask_truncated_completions: zero the loss mask of completions that hit ``max_completion_length``.
        pad_to_multiple_of: pad prompt and completion tensors to a multiple of this.
        chat_template_kwargs: passed to every ``apply_chat_template`` call.
        compute_old_logps: the trainer needs π_old for this batch (besides what the estimator needs).
        compute_ref_logps: the trainer needs π_ref (β ≠ 0 in the loss).
        importance_sampling: apply the sampling-log-prob correction when the backend returned log-probs.
        keep_completions: keep a table of prompts/completions/rewards/advantages for ``log_completions``.
        max_prompt_length: keep only the last this-many prompt tokens (left truncation); None = all.
        defer_importance_sampling: leave the importance-sampling ratio to the loss when π_old is needed for nothing
            else (see the module docstring); the batch then keeps ``sampling_per_token_logps`` and has no
            ``importance_sampling_ratio`` / ``old_per_token_logps``.
        multimodal: a vision-language run (the datasets have images): every batch, a text-only one too, is rendered
            as TRL renders a VLM's (prompts in content blocks, through the processor), so reward functions and the
            chat template see one prompt format.
    """

    num_generations: int
    num_generations_eval: int
    logprob_batch_size: int = 1
    mask_truncated_completions: bool = False
    pad_to_multiple_of: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    compute_old_logps: bool = False
    compute_ref_logps: bool = False
    importance_sampling: ImportanceSamplingSettings | None = None
    keep_completions: bool = False
    max_prompt_length: int | None = None  # left-truncate prompt tokens to this many (None = keep all)
    defer_importance_sampling: bool = False
    multimodal: bool = False


@dataclass
class CompletionsTable:
    """The last generation batch, for ``log_completions`` (gathered over processes)."""

    columns: dict[str, list] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))


@dataclass
class RolloutResult:
    """What :meth:`RolloutPipeline.run` gathered over all processes for its last batch (``pipeline.last_result``).

    Rows are the whole generation batch, process 0's rows first; this process's rows are
    ``slice(process_index * n_local, (process_index + 1) * n_local)``.

    Attributes:
        mode: ``"train"`` or ``"eval"``.
        num_generations: G of the batch (``num_generations`` or ``num_generations_eval``).
        rewards_per_func: ``(N, K)`` reward of each completion per reward function (NaN = None), unweighted.
        estimate: The estimator's :class:`AdvantageResult` on those rewards: ``advantages`` ``(N,)``, the combined
            ``rewards`` ``(N,)``, ``std`` and the estimator's metrics.
    """

    mode: str
    num_generations: int
    rewards_per_func: torch.Tensor
    estimate: AdvantageResult

    @property
    def rewards(self) -> torch.Tensor:
        """``(N,)`` the combined (weighted) reward of each completion, as logged under ``reward``."""
        return self.estimate.rewards

    @property
    def advantages(self) -> torch.Tensor:
        """``(N,)`` the advantage of each completion."""
        return self.estimate.advantages


def render_prompts(
    rows: Sequence[dict[str, Any]],
    tokenizer: Any,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: Sequence[list | None] | None = None,
) -> tuple[list[str], list[list[int]]]:
    """Prompt text and token ids of each row, as TRL's GRPO renders them (``data.tokenization.tokenize_prompt``).

    Conversational prompts (message lists) go through the chat template with the generation prompt (or continuing
    a final assistant message), honouring per-row ``tools`` / ``chat_template_kwargs`` columns; standard prompts are
    used as they are. Text is tokenized without adding special tokens (the template has them). ``tools`` gives each
    row's tool schemas (agent training); a row's own ``tools`` column wins. A run of rows with the same rendering
    inputs (a GRPO group: one prompt repeated G times) is rendered once.
    """
    texts, ids = [], []
    previous: tuple | None = None
    for index, row in enumerate(rows):
        row_tools = tools[index] if tools is not None else None
        key = (row.get("prompt"), row.get("tools"), row.get("chat_template_kwargs"), row_tools)
        if previous is not None and _same_render_inputs(key, previous):
            texts.append(texts[-1])
            ids.append(list(ids[-1]))
            continue
        out = tokenize_prompt(
            row, tokenizer, tools=row_tools, chat_template_kwargs=chat_template_kwargs, row_index=index
        )
        texts.append(out["prompt_text"])
        ids.append([int(t) for t in out["prompt_ids"]])
        previous = key
    return texts, ids


def _same_render_inputs(a: tuple, b: tuple) -> bool:
    """Whether two rows' (prompt, tools, chat_template_kwargs, tool schemas) are equal, so one rendering serves both."""
    try:
        return all(x is y or (type(x) is type(y) and bool(x == y)) for x, y in zip(a, b))
    except (TypeError, ValueError):  # values without a plain truth value (arrays): render again
        return False


def completions_as_messages(
    prompts: Sequence[Any],
    texts: Sequence[str],
    *,
    tokenizer: Any = None,
    completion_ids: Sequence[Sequence[int]] | None = None,
) -> list:
    """Completions in the prompts' format: plain text, or ``[{"role": "assistant", "content": ...}]``.

    As TRL, a conversational prompt ending with a (prefilled) assistant message has that content prepended. When
    ``tokenizer`` carries a ``response_template`` (see ``add_response_schema``), conversational completions are
    parsed from ``completion_ids`` with ``parse_response``, so reward functions also see ``tool_calls`` and
    ``reasoning_content``.
    """
    parse = tokenizer is not None and completion_ids is not None and _has_response_template(tokenizer)
    out = []
    for i, (prompt, text) in enumerate(zip(prompts, texts)):
        if is_conversational({"prompt": prompt}):
            bootstrap = prompt[-1]["content"] if prompt[-1]["role"] == "assistant" else ""
            message = parse_response(tokenizer, completion_ids[i]) if parse else {"role": "assistant", "content": text}
            out.append([{**message, "content": f"{bootstrap}{message['content']}"}])
        else:
            out.append(text)
    return out


def _has_response_template(tokenizer: Any) -> bool:
    inner = getattr(tokenizer, "tokenizer", tokenizer)  # processors wrap the tokenizer
    return getattr(inner, "response_template", None) is not None


def pad_rows(
    rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype, side: str, multiple: int | None = None
) -> torch.Tensor:
    """``(len(rows), L)`` tensor of ragged ``rows`` padded with ``value`` on ``side`` (``"left"``/``"right"``).

    ``L`` is the longest row, rounded up to a multiple of ``multiple`` when given, and at least 1 (an all-empty
    batch still has one column, as the loss masks expect).
    """
    length = max((len(r) for r in rows), default=0)
    if multiple:
        length = -(-length // multiple) * multiple
    out = torch.full((len(rows), max(length, 1)), value, dtype=dtype)
    for i, row in enumerate(rows):
        if len(row):
            if side == "left":
                out[i, out.shape[1] - len(row) :] = torch.tensor(row, dtype=dtype)
            else:
                out[i, : len(row)] = torch.tensor(row, dtype=dtype)
    return out


def collate_completions(
    completions: Completions,
    *,
    pad_token_id: int,
    mask_truncated_completions: bool = False,
    pad_to_multiple_of: int | None = None,
) -> RolloutBatch:
    """Tensors of a generated batch: left-padded prompts, right-padded completions and masks.

    ``completion_mask`` is the loss mask: 1 on generated tokens, times the tool mask (``tool_mask``/``env_mask``: 0 on
    tool-result tokens), times 0 for the whole row when ``mask_truncated_completions`` and the completion did not
    end with EOS.
    """
    lengths = torch.tensor([len(c) for c in completions.completion_ids], dtype=torch.long)
    batch: RolloutBatch = {
        "prompt_ids": pad_rows(completions.prompt_ids, pad_token_id, torch.long, "left", pad_to_multiple_of),
        "prompt_mask": pad_rows(
            [[1] * len(p) for p in completions.prompt_ids], 0, torch.long, "left", pad_to_multiple_of
        ),
        "completion_ids": pad_rows(completions.completion_ids, pad_token_id, torch.long, "right", pad_to_multiple_of),
        "completion_lengths": lengths,
        "finished": torch.tensor(completions.finished, dtype=torch.bool),
    }
    width = batch["completion_ids"].shape[1]
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    env_mask = completions.extra.get("tool_mask", completions.extra.get("env_mask"))
    if env_mask is not None:
        tool_mask = pad_rows(env_mask, 0, torch.long, "right", pad_to_multiple_of)[:, :width]
        batch["tool_mask"] = tool_mask
        mask = mask * tool_mask
    if mask_truncated_completions:
        mask = mask * batch["finished"].long().unsqueeze(1)
    batch["completion_mask"] = mask
    if completions.logprobs is not None:
        batch["sampling_per_token_logps"] = pad_rows(
            completions.logprobs, 0.0, torch.float32, "right", pad_to_multiple_of
        )
        if completions.log_kept_mass is not None:
            batch["sampling_log_kept_mass"] = pad_rows(
                completions.log_kept_mass, 0.0, torch.float32, "right", pad_to_multiple_of
            )
    if completions.routing is not None:  # keep_routing: the sampler's MoE routing, aligned with the two halves
        from posttrain.models.moe_routing import collate_routing

        batch["prompt_routing"], batch["completion_routing"] = collate_routing(
            completions.routing,
            [len(p) for p in completions.prompt_ids],
            batch["prompt_ids"].shape[1],
            width,
        )
    if completions.sampling_mask is not None:
        # keep_sampling_mask: the trainer scores these tokens over the sampler's support, on the sampler's own
        # (truncated) scale, so their kept-mass correction no longer applies; unknown-support tokens keep it.
        ids, threshold = collate_sampling_mask(completions.sampling_mask, width)
        batch["sampling_mask_ids"], batch["sampling_mask_threshold"] = ids, threshold
        if "sampling_log_kept_mass" in batch:
            known = threshold != float("-inf")
            batch["sampling_log_kept_mass"] = batch["sampling_log_kept_mass"].masked_fill(known, 0.0)
    return batch


def sampling_mask_metrics(batch: RolloutBatch, gather: Any) -> dict[str, float]:
    """``sampling_mask/*``: over the completion tokens of all processes, the share described by kept ids, by a
    threshold and not at all (full softmax), and the mean number of kept ids where ids describe the support."""
    valid = batch["completion_mask"].bool()
    threshold = batch["sampling_mask_threshold"][valid]
    ids_form = threshold == float("inf")
    kept_ids = (batch["sampling_mask_ids"][valid] >= 0).sum(-1).float()
    counts = torch.stack(
        [
            ids_form.sum(),
            torch.isfinite(threshold).sum(),
            (threshold == float("-inf")).sum(),
            kept_ids[ids_form].sum() if ids_form.any() else torch.zeros(()),
        ]
    ).float()
    counts = gather(counts.reshape(1, 4)).reshape(-1, 4).sum(0)
    total = float(counts[:3].sum())
    if total == 0:
        return {}
    return {
        "sampling_mask/frac_ids": float(counts[0]) / total,
        "sampling_mask/frac_threshold": float(counts[1]) / total,
        "sampling_mask/frac_full_softmax": float(counts[2]) / total,
        "sampling_mask/mean_kept_ids": float(counts[3]) / max(float(counts[0]), 1.0),
    }


class RolloutPipeline:
    """Generate, score and prepare one batch of online-RL data (see the module docstring for the stages).

    Args:
        tokenizer: The policy's tokenizer (left padding is applied here, whatever its ``padding_side``).
        backend: A ``GenerationBackend`` (a ``RolloutFuncBackend`` adds ``generate_from_prompts`` and then receives
            the raw prompts; an agent's ``ToolCallingBackend`` also takes each row's ``tools``).
        scorer: A ``RewardScorer`` (``names``, ``weights``, ``score(...)``).
        sampling: The ``SamplingConfig`` (already resolved).
        settings: ``RolloutSettings``.
        estimator: The ``AdvantageEstimator`` (GRPO's group-relative, RLOO's leave-one-out, ...).
        policy_logps: ``batch -> (B, C)`` no-grad log-probs of the completion tokens under the current policy.
        ref_logps: the same under the reference policy (None when there is no reference).
        accelerator: For gathering over processes (None = single process).
        agent: An ``agents.AgentRollout`` for agent training (tools / environments; ``backend`` is then its
            ``ToolCallingBackend``): rows are prepared by it, completions are its parsed conversations, reward
            functions get ``environments``, and ``tools/*`` metrics are logged.
    """

    def __init__(
        self,
        *,
        tokenizer: Any,
        backend: GenerationBackend,
        scorer: Any,
        sampling: SamplingConfig,
        settings: RolloutSettings,
        estimator: AdvantageEstimator,
        policy_logps: LogpsFn,
        ref_logps: LogpsFn | None = None,
        accelerator: Any = None,
        agent: Any = None,
    ):
        self.tokenizer = tokenizer
        self.agent = agent
        self.backend = backend
        self.scorer = scorer
        self.sampling = sampling
        self.settings = settings
        self.estimator = estimator
        self.policy_logps = policy_logps
        self.ref_logps = ref_logps
        self.accelerator = accelerator
        self.last_completions: CompletionsTable | None = None
        self.last_result: RolloutResult | None = None
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else sampling.pad_token_id)

    # -- distributed helpers -----------------------------------------------------------------------------------
    @property
    def num_processes(self) -> int:
        return getattr(self.accelerator, "num_processes", 1) if self.accelerator is not None else 1

    @property
    def process_index(self) -> int:
        return getattr(self.accelerator, "process_index", 0) if self.accelerator is not None else 0

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate ``tensor`` over processes along dim 0 (identity on one process)."""
        return gather_rows(self.accelerator, tensor)

    def gather_object(self, values: list) -> list:
        return gather_objects(self.accelerator, values)

    # -- stages ------------------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[Any],
        prompt_ids: list[list[int]],
        num_generations: int,
        tools: list | None = None,
        vision_inputs: list[dict[str, Any]] | None = None,
        rows: list[dict[str, Any]] | None = None,
    ) -> Completions:
        """Sample one completion per row; rows come as whole groups of ``num_generations`` identical prompts.

        ``tools`` (agent training) gives each row's tool set, in row order, to the ``ToolCallingBackend``.
        ``vision_inputs`` (a batch with images: each row's processor outputs, see
        :func:`~posttrain.data.vision_prompts.encode_vision_prompts`) go to the backend with their prompts.
        """
        kwargs: dict[str, Any] = {"tools": tools} if tools is not None else {}
        if hasattr(self.backend, "generate_from_prompts"):
            if vision_inputs is not None:
                raise ValueError(
                    "A rollout_func or a `_generate` override cannot train on images yet in posttrain: the rollout "
                    "produces its own prompt ids, which would not line up with the processor's image tokens. Use "
                    "posttrain's generation (generation_backend='posttrain' or 'transformers')."
                )
            # TRL's rollout_func contract: the raw per-process prompts, one per completion.
            return self.backend.generate_from_prompts(prompts, self.sampling, 1)
        n = len(prompt_ids)
        grouped = n % num_generations == 0 and all(
            prompt_ids[i] == prompt_ids[i - i % num_generations]
            and (vision_inputs is None or vision_inputs[i] is vision_inputs[i - i % num_generations])
            for i in range(n)
        )
        step = num_generations if grouped else 1
        if vision_inputs is not None and getattr(self.backend, "accepts_images", False):
            # a server backend sends the raw images (the server's processor rebuilds the vision inputs)
            if rows is None or len(rows) != n:
                raise ValueError("generate: a backend that takes images needs the batch's rows (one per prompt id).")
            kwargs["images"] = [row_images(row) for row in rows][::step]
        elif vision_inputs is not None:
            kwargs["vision_inputs"] = vision_inputs[::step]
        if grouped:
            unique = prompt_ids[::num_generations]
            return self.backend.generate(unique, self.sampling, num_generations, **kwargs)
        # A group split across processes (or a custom sampler): one completion per row.
        return self.backend.generate(prompt_ids, self.sampling, 1, **kwargs)

    def score(
        self,
        *,
        prompts: list[Any],
        completions: list[Any],
        completion_ids: list[list[int]],
        columns: dict[str, list],
        trainer_state: Any,
        log_extra: Callable[[str, list], None],
        log_metric: Callable[[str, float], None],
        environments: list | None = None,
    ) -> torch.Tensor:
        """``(N_local, K)`` rewards (NaN = None) from the scorer, called with TRL's keyword contract."""
        return self.scorer.score(
            prompts=[copy.deepcopy(p) for p in prompts],
            completions=completions,
            completion_ids=completion_ids,
            columns=columns,
            trainer_state=trainer_state,
            log_extra=log_extra,
            log_metric=log_metric,
            environments=environments,
        )

    def logps_in_chunks(self, fn: LogpsFn, batch: RolloutBatch, device: torch.device) -> torch.Tensor:
        """``(B, C)`` float32 no-grad log-probs ``fn(chunk)`` over ``batch`` in chunks of ``logprob_batch_size`` rows
        (each chunk moved to ``device``): the π_old / π_ref passes of :meth:`run`, for trainers that redo them."""
        size = max(1, int(self.settings.logprob_batch_size))
        keys = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_lengths")
        keys += tuple(k for k in ("sampling_mask_ids", "sampling_mask_threshold") if k in batch)  # same support
        outputs = []
        with torch.no_grad():
            for start in range(0, batch["completion_ids"].shape[0], size):
                chunk = {k: batch[k][start : start + size].to(device) for k in keys}
                for key in ("prompt_routing", "completion_routing"):  # keep_routing: replayed in these passes too
                    if key in batch:
                        chunk[key] = batch[key][start : start + size].to(device)
                if batch.get("vision_inputs") is not None:  # per-row lists: moved to the device at forward time
                    chunk["vision_inputs"] = batch["vision_inputs"][start : start + size]
                outputs.append(fn(chunk).float())
        return torch.cat(outputs, dim=0)

    # -- the recipe --------------------------------------------------------------------------------------------
    def run(
        self,
        rows: list[dict[str, Any]],
        *,
        mode: str = "train",
        device: torch.device | str = "cpu",
        trainer_state: Any = None,
        record_metric: MetricSink | None = None,
    ) -> RolloutBatch:
        """Generate, score and prepare ``rows`` (this process's share of the generation batch).

        Each stage is a named call, timed into a ``timing/<stage>`` metric (seconds on this process; see
        :data:`STAGES`), and the whole rollout into ``timing/rollout``.

        Args:
            rows: Dataset rows with a ``prompt`` column (each prompt repeated G times, consecutively).
            mode: ``"train"`` or ``"eval"`` (G = ``num_generations_eval`` in eval).
            device: Where the returned tensors live.
            trainer_state: Passed to reward functions as ``trainer_state``.
            record_metric: ``(name, value)`` sink for metrics (and for reward functions' ``log_metric``).
        """
        record = record_metric or (lambda name, value: None)
        stage = StageTimer(record)
        settings = self.settings
        g = settings.num_generations if mode == "train" else settings.num_generations_eval
        device = torch.device(device)
        with stage("rollout"):
            with stage("prepare_rows"):
                rows, agent_batch = self.prepare_rows(rows)
            prompts = [row["prompt"] for row in rows]
            vision_inputs = None
            with stage("render_prompts"):
                if (settings.multimodal and agent_batch is None) or any(row_images(row) for row in rows):
                    # images: placed in the prompts (what reward functions get, as TRL), processed once per group
                    prompts, prompt_texts, prompt_ids, vision_inputs = encode_vision_prompts(
                        rows,
                        self.tokenizer,
                        settings.chat_template_kwargs,
                        agent_batch.tool_schemas if agent_batch else None,
                    )
                else:
                    prompt_texts, prompt_ids = render_prompts(
                        rows,
                        self.tokenizer,
                        settings.chat_template_kwargs,
                        agent_batch.tool_schemas if agent_batch else None,
                    )
                    if settings.max_prompt_length:
                        prompt_ids = [ids[-settings.max_prompt_length :] for ids in prompt_ids]
            with stage("generate"):
                completions = self.generate(
                    prompts,
                    prompt_ids,
                    g,
                    agent_batch.tools if agent_batch else None,
                    vision_inputs=vision_inputs,
                    rows=rows,
                )
                self.check_completions(completions, rows)
            with stage("collate"):
                batch = collate_completions(
                    completions,
                    pad_token_id=self.pad_token_id,
                    mask_truncated_completions=settings.mask_truncated_completions,
                    pad_to_multiple_of=settings.pad_to_multiple_of,
                )
                if vision_inputs is not None:
                    # one dict per row (a group shares its prompt's); with tools, each rollout's own when a tool
                    # answered with images (the prompt's images, then the tools')
                    vision_inputs = completions.extra.get("vision_inputs") or vision_inputs
                    check_tool_image_inputs(vision_inputs, prompt_ids)
                    batch["vision_inputs"] = vision_inputs
            with stage("decode"):
                texts, completion_objs = self.decode(prompts, completions)
            importance = settings.importance_sampling if "sampling_per_token_logps" in batch else None
            if importance is not None and self.defers_importance_sampling():
                importance = None  # the loss computes the ratio from its own forward pass
            if settings.compute_old_logps or self.estimator.needs_old_logps or importance is not None:
                with stage("old_logps"):
                    batch["old_per_token_logps"] = self.logps_in_chunks(self.policy_logps, batch, device).cpu()
            if (settings.compute_ref_logps or self.estimator.needs_ref_logps) and self.ref_logps is not None:
                with stage("ref_logps"):
                    batch["ref_per_token_logps"] = self.logps_in_chunks(self.ref_logps, batch, device).cpu()
            with stage("calculate_rewards"):
                rewards_per_func, extra_columns = self.calculate_rewards(
                    rows, prompts, completions, completion_objs, trainer_state, record, agent_batch
                )
            with stage("advantages"):
                result = self.advantages(rewards_per_func, g, batch)
                self.last_result = RolloutResult(mode, g, rewards_per_func, result)
            with stage("metrics"):
                self.record_metrics(batch, completions, rewards_per_func, result, record)
            if importance is not None:
                with stage("importance_sampling"):
                    self.importance_sampling(batch, importance, record)
            batch["num_items_in_batch"] = self.gather(batch["completion_mask"].sum().reshape(1)).sum()
            if settings.keep_completions:
                with stage("completions_table"):
                    self.last_completions = self.completions_table(
                        prompt_texts, texts, rewards_per_func, extra_columns, result
                    )
        batch.pop("finished")
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def defers_importance_sampling(self) -> bool:
        """Whether the loss, not :meth:`run`, computes the importance-sampling ratio of this pipeline's batches:
        deferral is asked for and π_old is needed for nothing but the correction (so it equals the loss's own
        detached log-probs)."""
        settings = self.settings
        return (
            settings.defer_importance_sampling
            and settings.importance_sampling is not None
            and not settings.compute_old_logps
            and not self.estimator.needs_old_logps
        )

    # -- the stages of run(), in order -------------------------------------------------------------------------
    def prepare_rows(self, rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], Any]:
        """Agent training: reset the environments and complete the prompts (``AgentRollout.prepare``); check that
        every row has a prompt. Returns the rows and the agent batch (None without an agent)."""
        agent_batch = self.agent.prepare(rows) if self.agent is not None else None  # reset envs, complete prompts
        if agent_batch is not None:
            rows = agent_batch.rows
        if any("prompt" not in row for row in rows):
            raise ValueError(
                f"Every row needs a 'prompt' column; got columns {sorted(rows[0]) if rows else []}. Rename your "
                "prompt column to 'prompt' (prompt-only format: {'prompt': 'text'} or {'prompt': [messages]})."
            )
        return rows, agent_batch

    @staticmethod
    def check_completions(completions: Completions, rows: list[dict[str, Any]]) -> None:
        if len(completions) != len(rows):
            raise ValueError(
                f"The generation backend returned {len(completions)} completions for {len(rows)} rows; it must "
                "return exactly one completion per row (a rollout_func gets each prompt once per completion)."
            )

    def decode(self, prompts: list[Any], completions: Completions) -> tuple[list[str], list[Any]]:
        """Completion texts, and the completions as reward functions see them (text, or messages for
        conversational prompts; the whole parsed conversation after a tool loop, as TRL)."""
        texts = self.tokenizer.batch_decode(completions.completion_ids, skip_special_tokens=True)
        completion_objs = completions_as_messages(
            prompts, texts, tokenizer=self.tokenizer, completion_ids=completions.completion_ids
        )
        if "completion_messages" in completions.extra:  # tool loop: the whole parsed conversation (TRL)
            completion_objs = [
                messages if is_conversational({"prompt": prompt}) else text
                for prompt, messages, text in zip(prompts, completions.extra["completion_messages"], texts)
            ]
        return texts, completion_objs

    def calculate_rewards(
        self,
        rows: list[dict[str, Any]],
        prompts: list[Any],
        completions: Completions,
        completion_objs: list[Any],
        trainer_state: Any,
        record: MetricSink,
        agent_batch: Any,
    ) -> tuple[torch.Tensor, dict[str, list]]:
        """``(N, K)`` rewards gathered over processes, and the columns reward functions logged (``log_extra``).

        Reward functions get every dataset column but the prompt, plus the rollout function's extra fields."""
        columns: dict[str, list] = defaultdict(list)
        for row in rows:
            for key, value in row.items():
                if key not in ("prompt", "completion", "completion_ids"):
                    columns[key].append(value)
        for key, values in completions.extra.items():
            if key not in _NOT_REWARD_KWARGS:
                columns[key] = list(values)
        extra_columns: dict[str, list] = {}
        rewards_local = self.score(
            prompts=prompts,
            completions=completion_objs,
            completion_ids=completions.completion_ids,
            columns=dict(columns),
            trainer_state=trainer_state,
            log_extra=lambda column, values: extra_columns.__setitem__(column, list(values)),
            log_metric=record,
            environments=agent_batch.environments if agent_batch else None,
        )
        return self.gather(rewards_local.float()), extra_columns

    def advantages(self, rewards_per_func: torch.Tensor, num_generations: int, batch: RolloutBatch) -> AdvantageResult:
        """The estimator on the gathered rewards; this process keeps its slice as ``batch["advantages"]``."""
        weights = torch.as_tensor(self.scorer.weights, dtype=torch.float32).to(rewards_per_func.device)
        result = self.estimator(rewards_per_func, weights, num_generations, batch=batch, gather=self.gather)
        n_local = batch["completion_ids"].shape[0]
        local = slice(self.process_index * n_local, (self.process_index + 1) * n_local)
        batch["advantages"] = result.advantages[local].float().cpu()
        return result

    def record_metrics(
        self,
        batch: RolloutBatch,
        completions: Completions,
        rewards_per_func: torch.Tensor,
        result: AdvantageResult,
        record: MetricSink,
    ) -> None:
        """TRL's rollout metrics over the gathered batch: tokens, completion lengths, rewards, the estimator's,
        tool calls."""
        lengths = batch["completion_lengths"]
        if "tool_mask" in batch:
            lengths = batch["tool_mask"].sum(dim=1)
        record("num_tokens", float(self.gather((batch["prompt_mask"].sum() + lengths.sum()).reshape(1)).sum()))
        for name, value in completion_length_metrics(
            self.gather(lengths), self.gather(batch["finished"].long()).bool()
        ).items():
            record(name, value)
        for name, value in reward_metrics(
            rewards_per_func, list(self.scorer.names), result.rewards, result.std
        ).items():
            record(name, value)
        for name, value in result.metrics.items():
            record(name, value)
        if "sampling_mask_threshold" in batch:
            for name, value in sampling_mask_metrics(batch, self.gather).items():
                record(name, value)
        if "tool_call_count" in completions.extra:
            from posttrain.agents.loop import tool_metrics

            counts = torch.tensor(
                [completions.extra["tool_call_count"], completions.extra["tool_failure_count"]], dtype=torch.float32
            ).T.contiguous()  # (B, 2)
            counts = self.gather(counts)
            for name, value in tool_metrics(counts[:, 0].tolist(), counts[:, 1].tolist()).items():
                record(name, value)

    def importance_sampling(
        self, batch: RolloutBatch, importance: ImportanceSamplingSettings, record: MetricSink
    ) -> None:
        """The sampler-vs-trainer ratio ``batch["importance_sampling_ratio"]`` and its ``sampling/*`` metrics."""
        ratio, stats = rollout_importance_weights(
            batch["old_per_token_logps"],
            batch["sampling_per_token_logps"],
            batch["completion_mask"],
            mode=importance.mode,
            clip_min=importance.clip_min,
            clip_max=importance.clip_max,
            sampling_log_kept_mass=batch.get("sampling_log_kept_mass") if importance.truncation_correction else None,
        )
        batch["importance_sampling_ratio"] = ratio
        for name, value in stats.items():
            gathered = self.gather(value.reshape(1).float())
            reduce = name.rsplit("/", 1)[-1]
            if reduce not in ("min", "max"):
                reduce = "mean"  # means and fractions: the mean of the processes' values, as TRL reduces its means
            reduced = {"mean": gathered.mean(), "max": gathered.max(), "min": gathered.min()}[reduce]
            record(f"sampling/{name}", float(reduced))

    def completions_table(
        self,
        prompt_texts: list[str],
        texts: list[str],
        rewards_per_func: torch.Tensor,
        extra_columns: dict[str, list],
        result: AdvantageResult,
    ) -> CompletionsTable:
        """Prompts, completions, rewards, logged columns and advantages over every process (``log_completions``)."""
        table = {
            "prompt": self.gather_object(prompt_texts),
            "completion": self.gather_object(texts),
        }
        for k, name in enumerate(self.scorer.names):
            table[name] = rewards_per_func[:, k].tolist()
        for column in sorted(extra_columns):
            table[column] = self.gather_object(extra_columns[column])
        table["advantage"] = result.advantages.tolist()
        return CompletionsTable(table)
