"""On-policy distillation's rollout: ``DistillationRollout`` builds one generation round.

Each gradient-accumulation slice is on-policy with probability ``lmbda`` (GKD, Agarwal et al. 2024,
https://huggingface.co/papers/2306.13649): its completions are sampled from the student through the shared
generation backend. The other slices use the dataset's completions, or, with ``seq_kd``, completions sampled from the
teacher (sequence-level KD). Prompts go through the shared rollout stages (``render_prompts``, ``collate_completions``,
TRL's completion metrics), so the batch has the online-RL layout that ``RolloutBuffer`` shuffles, splits and replays.
``run`` reads as named stages, each timed into a ``timing/<stage>`` metric (``STAGES``), as ``RolloutPipeline.run``
does.

What the distillation trainers need besides the rollout lives with the models: the student/teacher vocabulary checks
in :mod:`posttrain.models.vocabulary`, the divergence at the loss tokens (``token_divergence``) beside the scoring
that feeds it in :mod:`posttrain.models.distillation_scoring`. Both stay importable from here for older imports.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from posttrain.data.tokenization import tokenize_prompt_completion, truncate_sequence
from posttrain.distributed import gather_objects, gather_rows
from posttrain.generation.base import Completions, SamplingConfig, truncate_at_eos
from posttrain.models.distillation_scoring import token_divergence  # noqa: F401  (moved; older import path)
from posttrain.models.vocabulary import check_shared_vocabulary, model_vocab_size  # noqa: F401  (moved; older path)
from posttrain.rollout.buffer import RolloutBatch
from posttrain.rollout.metrics import completion_length_metrics
from posttrain.rollout.pipeline import CompletionsTable, StageTimer, collate_completions, render_prompts

SOURCES = ("student", "dataset", "teacher")
# The stages of DistillationRollout.run, each timed into ``timing/<stage>`` (seconds), as RolloutPipeline.run's are.
STAGES = (
    "prepare_rows",
    "render_prompts",
    "generate",
    "dataset_completions",
    "collate",
    "metrics",
    "completions_table",
)


# ----------------------------------------------------------------------------------------------------------------
# One generation round
# ----------------------------------------------------------------------------------------------------------------


DATASET_TRUNCATIONS = ("completion_budget", "keep_end", "fill")


class DistillationRollout:
    """Build the rollout batch of one round: choose each slice's source, get its completions, collate, log.

    Args:
        tokenizer: The student's tokenizer (prompts are rendered and tokenized with it).
        student_backend: Generation backend sampling from the student (on-policy slices).
        teacher_backend: Generation backend sampling from the teacher (``seq_kd``), or None.
        sampling: ``SamplingConfig`` for both backends.
        num_generations: Completions per prompt on the generating paths (rows arrive as groups of this size).
        lmbda: Probability that a training slice is on-policy (evaluation: on-policy iff ``lmbda > 0``).
        seq_kd: Off-policy slices use teacher samples instead of dataset completions.
        max_prompt_length: Prompts are cut to this many tokens (keeping the end when the tokenizer truncates on
            the left), None = no limit.
        max_completion_length: Sampled completions' budget; dataset completions are cut to it with the default
            ``dataset_truncation``.
        dataset_truncation / max_length: How a dataset row is cut, as each TRL trainer's collator does:
            ``"completion_budget"`` (prompt to ``max_prompt_length``, completion to ``max_completion_length``),
            ``"keep_end"`` (GKD/GOLD: prompt + completion keep their last ``max_length`` tokens, the prompt losing
            its oldest first) or ``"fill"`` (IW-OPD: prompt to ``max_prompt_length``, completion to what is left
            of ``max_length``).
        pad_to_multiple_of / mask_truncated_completions / chat_template_kwargs: As for the online-RL pipeline.
        keep_completions: Keep a table of (prompt, completion, source) for ``log_completions``.
        seed: Seed of the slice draws — the same on every process, so all processes take the same path (a vLLM
            or ZeRO-3 generation needs every process to join).
        accelerator: For gathering metrics over processes (None = one process).
    """

    def __init__(
        self,
        *,
        tokenizer: Any,
        student_backend: Any,
        teacher_backend: Any = None,
        sampling: SamplingConfig,
        num_generations: int = 1,
        lmbda: float = 1.0,
        seq_kd: bool = False,
        max_prompt_length: int | None = None,
        max_completion_length: int = 512,
        dataset_truncation: str = "completion_budget",
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        mask_truncated_completions: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        keep_completions: bool = False,
        seed: int = 0,
        accelerator: Any = None,
        agent: Any = None,
    ):
        if seq_kd and teacher_backend is None:
            raise ValueError("seq_kd=True needs a teacher generation backend.")
        self.tokenizer = tokenizer
        self.student_backend = student_backend
        self.teacher_backend = teacher_backend
        self.sampling = sampling
        self.num_generations = num_generations
        self.lmbda = float(lmbda)
        self.seq_kd = seq_kd
        self.max_prompt_length = max_prompt_length
        self.max_completion_length = max_completion_length
        if dataset_truncation not in DATASET_TRUNCATIONS:
            raise ValueError(f"dataset_truncation must be one of {DATASET_TRUNCATIONS}, got {dataset_truncation!r}.")
        if dataset_truncation != "completion_budget" and max_length is None:
            raise ValueError(f"dataset_truncation={dataset_truncation!r} needs max_length.")
        self.dataset_truncation = dataset_truncation
        self.max_length = max_length
        self.pad_to_multiple_of = pad_to_multiple_of
        self.mask_truncated_completions = mask_truncated_completions
        self.chat_template_kwargs = chat_template_kwargs
        self.keep_completions = keep_completions
        self.accelerator = accelerator
        # Agent training (tools): rows are completed by agent.prepare, prompts rendered with the tool schemas, and
        # student_backend is the agent's ToolCallingBackend; its tool tokens are context, not loss tokens.
        self.agent = agent
        self.generator = torch.Generator().manual_seed(int(seed))
        self.last_completions: CompletionsTable | None = None
        tok = getattr(tokenizer, "tokenizer", tokenizer)
        self.pad_token_id = int(tok.pad_token_id if tok.pad_token_id is not None else sampling.pad_token_id)
        self._truncation = "keep_end" if getattr(tok, "truncation_side", "left") == "left" else "keep_start"

    # -- distributed helpers -----------------------------------------------------------------------------------
    def _gather_sum(self, value: torch.Tensor) -> torch.Tensor:
        return gather_rows(self.accelerator, value.reshape(1).float()).sum().cpu()

    def _gather_list(self, values: list) -> list:
        return gather_objects(self.accelerator, values)

    # -- sources -----------------------------------------------------------------------------------------------
    def draw_on_policy(self, num_slices: int, mode: str = "train") -> list[bool]:
        """Whether each slice is on-policy: a Bernoulli(``lmbda``) draw per training slice (GKD's λ)."""
        if mode != "train":
            return [self.lmbda > 0.0] * num_slices
        if self.lmbda >= 1.0 or self.lmbda <= 0.0:  # no draw: the RNG state stays put
            return [self.lmbda >= 1.0] * num_slices
        return (torch.rand(num_slices, generator=self.generator) < self.lmbda).tolist()

    @staticmethod
    def as_prompt_completion(row: dict[str, Any], index: int) -> dict[str, Any]:
        """Rows in GKD's conversational ``messages`` format become prompt (all but the last turn) + completion (the
        final assistant turn); prompt-only and prompt-completion rows pass unchanged."""
        if "prompt" in row:
            return row
        messages = row.get("messages")
        if isinstance(messages, list) and messages and messages[-1].get("role") == "assistant":
            return {**row, "prompt": messages[:-1], "completion": messages[-1:]}
        raise ValueError(
            f"Row {index} has neither a 'prompt' column nor a 'messages' conversation ending with an assistant turn "
            f"(columns: {sorted(row)}). Use prompt-only ({{'prompt': ...}}), prompt-completion ({{'prompt': ..., "
            "'completion': ...}}) or conversational ({'messages': [..., {'role': 'assistant', ...}]}) rows."
        )

    def row_source(self, on_policy: bool, row: dict[str, Any]) -> str:
        """``"student"`` on-policy; else ``"teacher"`` with ``seq_kd``, ``"dataset"`` when the row has a completion,
        and ``"student"`` for prompt-only rows (with prompt-only data everything is on-policy)."""
        if on_policy:
            return "student"
        if self.seq_kd:
            return "teacher"
        return "dataset" if row.get("completion") is not None else "student"

    # -- completions -------------------------------------------------------------------------------------------
    def _truncate_prompt(self, ids: list[int]) -> list[int]:
        return truncate_sequence(ids, self.max_prompt_length, self._truncation)

    def _generate(self, backend: Any, prompt_ids: list[list[int]], tools: list | None = None) -> Completions:
        """Sample one completion per row; whole groups of identical prompts are handed over once with G.
        ``tools``: per row, the tools its rollout may call (agent training; the student's backend only)."""
        g, n = self.num_generations, len(prompt_ids)
        grouped = g > 1 and n % g == 0 and all(prompt_ids[i] == prompt_ids[i - i % g] for i in range(n))
        kwargs = {"tools": tools} if tools is not None else {}
        if grouped:
            return backend.generate(prompt_ids[::g], self.sampling, g, **kwargs)
        return backend.generate(prompt_ids, self.sampling, 1, **kwargs)

    def _dataset_completion(self, row: dict[str, Any], index: int) -> tuple[list[int], list[int], bool]:
        """(prompt ids, completion ids cut after the first EOS, ended with EOS), both cut as the class doc says:
        by ``dataset_truncation``."""
        out = tokenize_prompt_completion(
            row, self.tokenizer, add_eos=True, chat_template_kwargs=self.chat_template_kwargs, row_index=index
        )
        n_prompt = len(out["completion_mask"]) - sum(out["completion_mask"])
        ids = out["input_ids"]
        # Cut after the EOS, as a sampled completion would end (chat templates add text after <|im_end|>).
        completion, ended = truncate_at_eos(ids[n_prompt:], self.sampling.eos_token_ids)
        if self.dataset_truncation == "keep_end":
            prompt = ids[:n_prompt]
            overflow = len(prompt) + len(completion) - self.max_length
            if overflow > 0:  # oldest tokens first: the prompt's start, then (no prompt left) the completion's
                drop = min(overflow, len(prompt))
                prompt, completion = prompt[drop:], completion[overflow - drop :]
            return prompt, completion, ended
        prompt = self._truncate_prompt(ids[:n_prompt])
        budget = self.max_completion_length
        if self.dataset_truncation == "fill":
            budget = max(0, self.max_length - len(prompt))
        if len(completion) > budget:
            completion, ended = completion[:budget], False
        return prompt, completion, ended

    # -- the round ---------------------------------------------------------------------------------------------
    def run(
        self,
        rows: list[dict[str, Any]],
        *,
        num_slices: int = 1,
        mode: str = "train",
        device: torch.device | str = "cpu",
        record: Callable[[str, float], None] | None = None,
        slice_size: int | None = None,
    ) -> RolloutBatch:
        """Completions for ``rows`` (this process's share of the round) as one rollout batch.

        Rows are split into ``num_slices`` consecutive slices (the gradient-accumulation micro-batches of the
        round), or with ``slice_size`` into consecutive slices of that many rows, the last one shorter (an epoch's
        short last round); each slice gets one source. The batch holds ``prompt_ids``/``prompt_mask`` ``(B, P)``,
        ``completion_ids``/``completion_mask`` ``(B, C)``, ``completion_lengths`` ``(B,)``, ``sources`` (one of
        ``SOURCES`` per row), ``tool_mask`` with tools (tool-result tokens: context, not loss tokens),
        ``sampling_per_token_logps`` ``(B, C)`` when every row was sampled by a student backend that returns its
        sampling log-probs (IW-OPD), and ``num_items_in_batch`` (loss tokens of the round over all processes).

        Each stage is a named call, timed into a ``timing/<stage>`` metric (seconds on this process; see
        :data:`STAGES`), and the whole round into ``timing/rollout``; stages with nothing to do (no sampled or no
        dataset rows, no completions table) record nothing.
        """
        record = record or (lambda name, value: None)
        stage = StageTimer(record)
        with stage("rollout"):
            with stage("prepare_rows"):
                rows, sources, agent_batch = self.prepare_rows(rows, num_slices, mode, slice_size=slice_size)
            with stage("render_prompts"):
                schemas = agent_batch.tool_schemas if agent_batch is not None else None
                prompt_texts, rendered = render_prompts(rows, self.tokenizer, self.chat_template_kwargs, schemas)
                prompt_ids: list[list[int]] = [self._truncate_prompt(ids) for ids in rendered]
            completion_ids: list[list[int]] = [[] for _ in rows]
            finished = [False] * len(rows)
            tool_mask: list[list[int] | None] = [None] * len(rows)
            tool_counts: list[tuple[float, float]] = []
            logprobs: list[list[float] | None] = [None] * len(rows)
            if any(source != "dataset" for source in sources):
                with stage("generate"):
                    self.generate(
                        sources, prompt_ids, completion_ids, finished, agent_batch, tool_mask, tool_counts, logprobs
                    )
            if "dataset" in sources:
                with stage("dataset_completions"):
                    self.dataset_completions(rows, sources, prompt_ids, completion_ids, finished)
            with stage("collate"):
                extra = {}
                if any(m is not None for m in tool_mask):  # tool-result tokens: context for both models, no loss
                    extra["tool_mask"] = [
                        m if m is not None else [1] * len(c) for m, c in zip(tool_mask, completion_ids)
                    ]
                # The student sampler's per-token log-probs (IW-OPD's behaviour policy), when every row has them.
                sampled = logprobs if all(lp is not None for lp in logprobs) else None
                batch = collate_completions(
                    Completions(completion_ids, sampled, finished, prompt_ids, extra=extra),
                    pad_token_id=self.pad_token_id,
                    mask_truncated_completions=self.mask_truncated_completions,
                    pad_to_multiple_of=self.pad_to_multiple_of,
                )
            with stage("metrics"):
                self.record_metrics(batch, sources, finished, record, tool_counts)
            batch["num_items_in_batch"] = self._gather_sum(batch["completion_mask"].sum())
            batch["sources"] = sources
            if self.keep_completions:
                with stage("completions_table"):
                    self.last_completions = self.completions_table(prompt_texts, completion_ids, sources)
        batch.pop("finished")
        return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    # -- the stages of run(), in order -------------------------------------------------------------------------
    def prepare_rows(
        self, rows: list[dict[str, Any]], num_slices: int, mode: str, slice_size: int | None = None
    ) -> tuple[list, list[str], Any]:
        """Rows as prompt(-completion) rows (:meth:`as_prompt_completion`, completed by the agent's ``prepare``
        with tools), each row's source — the round is cut into ``num_slices`` equal consecutive slices (or, with
        ``slice_size``, slices of that many rows, the last one shorter), one on-policy draw
        (:meth:`draw_on_policy`) per slice — and the agent batch (None without tools)."""
        rows = [self.as_prompt_completion(row, i) for i, row in enumerate(rows)]
        agent_batch = self.agent.prepare(rows) if self.agent is not None else None
        if agent_batch is not None:
            rows = agent_batch.rows
        n = len(rows)
        if slice_size is not None:
            if slice_size < 1:
                raise ValueError(f"slice_size must be positive, got {slice_size}.")
            size, num_slices = slice_size, max(1, -(-n // slice_size))
        elif num_slices < 1 or n % num_slices != 0:
            raise ValueError(f"Cannot split a round of {n} rows into {num_slices} equal slices.")
        else:
            size = n // num_slices
        on_policy = self.draw_on_policy(num_slices, mode)
        return rows, [self.row_source(on_policy[i // size], row) for i, row in enumerate(rows)], agent_batch

    def generate(
        self,
        sources: list[str],
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        finished: list[bool],
        agent_batch: Any = None,
        tool_mask: list | None = None,
        tool_counts: list | None = None,
        logprobs: list | None = None,
    ) -> None:
        """Sample the completions of the ``student`` and ``teacher`` rows from their backends (in place). With tools
        the student rows get their tools; their tool masks and (calls, failures) counts are filled in. ``logprobs``
        receives the student rows' sampling log-probs when the student backend returns them."""
        n = len(sources)
        for source, backend in (("student", self.student_backend), ("teacher", self.teacher_backend)):
            index = [i for i in range(n) if sources[i] == source]
            if not index:
                continue
            tools = [agent_batch.tools[i] for i in index] if agent_batch is not None and source == "student" else None
            out = self._generate(backend, [prompt_ids[i] for i in index], tools)
            if len(out) != len(index):
                raise ValueError(
                    f"The {source} generation backend returned {len(out)} completions for {len(index)} rows."
                )
            masks = out.extra.get("tool_mask") if source == "student" else None
            if source == "student" and "tool_call_count" in out.extra and tool_counts is not None:
                tool_counts += list(zip(out.extra["tool_call_count"], out.extra["tool_failure_count"]))
            for j, i in enumerate(index):
                completion_ids[i] = list(out.completion_ids[j])
                finished[i] = bool(out.finished[j])
                if source == "student" and logprobs is not None and out.logprobs is not None:
                    logprobs[i] = list(out.logprobs[j])
                if masks is not None and tool_mask is not None:
                    tool_mask[i] = list(masks[j])

    def dataset_completions(
        self,
        rows: list[dict[str, Any]],
        sources: list[str],
        prompt_ids: list[list[int]],
        completion_ids: list[list[int]],
        finished: list[bool],
    ) -> None:
        """Tokenize the ``dataset`` rows' own completions (in place; their prompt ids are re-tokenized with the
        completion, as training on the pair renders it)."""
        for i in range(len(rows)):
            if sources[i] == "dataset":
                prompt_ids[i], completion_ids[i], finished[i] = self._dataset_completion(rows[i], i)

    def record_metrics(
        self,
        batch: RolloutBatch,
        sources: list[str],
        finished: list[bool],
        record: Callable[[str, float], None],
        tool_counts: list | None = None,
    ) -> None:
        """``num_tokens`` (prompt + completion tokens over all processes), TRL's ``completions/*`` metrics of the
        sampled (student or teacher) completions and, with tools, ``tools/*`` over the on-policy samples."""
        lengths = batch["completion_lengths"]
        record("num_tokens", float(self._gather_sum(batch["prompt_mask"].sum() + lengths.sum())))
        generated = [i for i in range(len(sources)) if sources[i] != "dataset"]
        gen_lengths = self._gather_list([int(lengths[i]) for i in generated])
        gen_finished = self._gather_list([bool(finished[i]) for i in generated])
        if gen_lengths:  # TRL's completion metrics describe sampled completions
            for name, value in completion_length_metrics(
                torch.tensor(gen_lengths), torch.tensor(gen_finished, dtype=torch.bool)
            ).items():
                record(name, value)
        if self.agent is not None:  # TRL's tools/call_frequency, tools/failure_frequency
            from posttrain.agents.loop import tool_metrics

            counts = self._gather_list(list(tool_counts or []))
            if counts:
                for name, value in tool_metrics([c for c, _ in counts], [f for _, f in counts]).items():
                    record(name, value)

    def completions_table(
        self, prompt_texts: list[str], completion_ids: list[list[int]], sources: list[str]
    ) -> CompletionsTable:
        """(prompt, completion, source) of every row over all processes, for ``log_completions``."""
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return CompletionsTable(
            {
                "prompt": self._gather_list(prompt_texts),
                "completion": self._gather_list(texts),
                "source": self._gather_list(sources),
            }
        )

    # -- checkpointing -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The slice-draw RNG (a resumed run draws the same sources as an uninterrupted one)."""
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
