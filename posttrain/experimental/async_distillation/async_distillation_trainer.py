"""``AsyncDistillationTrainer``: on-policy distillation with generation decoupled from training (TRL's experimental
``AsyncDistillationTrainer``).

``DistillationTrainer``'s loss on ``AsyncGRPOTrainer``'s machinery (the shared ``posttrain.rollout.async_worker``):

- **rollout worker** (a spawned CPU process, ``rollout_worker.py``): takes the next round of prompts in the
  distillation trainer's order, has the student's ``posttrain serve`` server (``vllm_server_base_url``) sample the
  completions, scores them against the teacher server(s) (``teacher_server_urls``: top-``teacher_top_k`` log-probs
  plus the sampled token's at ``teacher_temperature``) and queues the round tagged with the student server's weight
  ``version``;
- **trainer** (this process): takes the next round at each optimizer step, drops it when ``global_step - version >
  max_staleness`` (``sample/dropped_stale_total``), trains on it and pushes its weights to the student's server every
  ``weight_sync_steps`` steps (``version = global_step``).

The loss (Σ over completion tokens / completion tokens of the optimizer step, TRL's normalisation), at
``teacher_temperature`` on both sides:

- served teacher (TRL's only mode): the generalized JSD on a sparse support with a tail bucket
  (``add_tail_bucket``): β = 0 forward KL on the teacher's top-k ∪ {sampled token}; β > 0 {teacher top-1, sampled
  token} (just the sampled token at β = 1) — ``server_sparse_divergence`` of the server-distillation trainer;
- local teacher (posttrain: ``teacher_model=`` or ``teacher_model_name_or_path``; the teacher forward runs here, at
  the loss, under the trainer's process): ``DistillationTrainer``'s exact full-vocabulary generalized JSD.

``max_staleness=0`` is synchronous distillation in server mode: the worker generates round ``r`` only from weight
version ``r``. With a local teacher a run equals ``DistillationTrainer(use_vllm=True, vllm_mode="server")`` on the
same server bitwise; with a served teacher it equals ``ServerDistillationTrainer`` for β > 0 (the same support; at
β = 0 TRL's async support also holds the sampled token, ServerDistillation's does not). That one is bitwise on the
tests' CPU runs but not by construction: the worker scores a whole round per teacher request, the synchronous
trainer each micro-batch, so the teacher's padded forward runs at other batch shapes.

Metrics (TRL's names): ``jsd`` (the divergence per token; also ``distillation_loss``), ``entropy``,
``teacher_entropy`` (served teacher: of its sparse distribution on the loss's support), ``sample/*`` (staleness,
version, time in queue, queue size, forwarded/trained tokens), ``batch/samples_per_step``,
``batch/{forwarded,trained}_tokens_per_step``, ``perf/rollout_wait_s``, ``perf/weight_sync_s``, ``rollout/*``
(``rollout/score_s``: teacher scoring), ``completions/*``, ``num_tokens``; with several teachers (MOPD: each row's
``teacher_id`` picks its server) ``teacher_jsd/{id}``, ``teacher_entropy/{id}``, ``teacher_token_frac/{id}`` and
``teacher_score_s/{id}``; with a ``token_budget`` ``batch/dropped_oversize_total`` and
``batch/packs_per_micro_batch`` (forwards per micro-batch).

``token_budget`` packs each micro-batch's rows into forwards of at most that many tokens (see the config);
``heartbeat_stale_after_s`` and ``weight_sync_timeout`` bound a hung worker and a hung weight push (shared worker).
A PEFT student (``peft_config``) is pushed as its merged weights (``posttrain.generation.weights.policy_weights``, as
GRPO's server mode; TRL's merged-sync fallback), or, with ``vllm_sync_adapter_only=True`` against ``posttrain serve``,
as its LoRA adapter alone (``adapter_weights``; the server applies it to its base with PEFT).

Resume (``rollout_state.json``: ``next_round``, ``weight_version``, ``dropped_stale_total``, here also
``dropped_oversize_total``) as AsyncGRPO; several training processes as AsyncGRPO (``posttrain.rollout.multiprocess``).
Not supported: tools (as TRL), streaming datasets,
LoRA adapter-only sync with vLLM ``--enable-lora`` servers (merged pushes instead), injected ``rollout_worker`` / ``weight_transfer`` objects.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch

from posttrain.core.distill import add_tail_bucket, chunked_token_map
from posttrain.experimental._distill_support import server_sparse_divergence
from posttrain.experimental._sparse_loss import SparseDistillationLoss
from posttrain.experimental.async_distillation.async_distillation_config import AsyncDistillationConfig
from posttrain.experimental.async_distillation.rollout_worker import (
    DistillationWorkerSpec,
    flat_teacher_scores,
    row_teacher_ids,
    score_with_teachers,
)
from posttrain.models.distillation_scoring import score_distillation_completions
from posttrain.rollout.async_worker import ROLLOUT_STATE, AsyncRollout, RolloutWorkerError
from posttrain.rollout.buffer import select_rows, token_budget_packs, trim_padding
from posttrain.trainers.distillation import DistillationLoss, DistillationTrainer, FullVocabularyDivergence

logger = logging.getLogger(__name__)

__all__ = ["AsyncDistillationTrainer", "RolloutWorkerError"]


class _RoundTeacher:
    """The served teacher as the sparse loss sees it: the worker's scores carried by the round, or (evaluation
    batches, built here) a request to the teacher server now."""

    def __init__(self, trainer: AsyncDistillationTrainer):
        self.trainer = trainer
        self.servers: dict[str, Any] | None = None

    def score(self, inputs: dict[str, Any], top_k: int, temperature: float) -> dict[str, torch.Tensor]:
        if "teacher_topk_logprobs" not in inputs:
            if self.servers is None:
                from posttrain.experimental._distill_support import ServedTeacher

                args = self.trainer.args
                self.servers = {name: ServedTeacher(url, self.trainer.vocab_rows, float(args.request_timeout))
                                for name, url in args.teacher_server_urls.items()}  # fmt: skip
            if len(self.servers) > 1:
                raise ValueError("Evaluation with several teachers (MOPD) is not supported: rows carry no teacher_id.")
            n = inputs["completion_ids"].shape[0]
            scores = score_with_teachers(inputs, [next(iter(self.servers))] * n, self.servers, top_k, temperature)
            inputs = {**inputs, **{k: v.to(inputs["completion_ids"].device) for k, v in scores.items()}}
        return flat_teacher_scores(inputs)

    def close(self) -> None:
        for server in (self.servers or {}).values():
            server.close()


class _AsyncDistillationLoss:
    """The loss strategy (a :class:`~posttrain.trainers.distillation.DistillationLoss`) at ``teacher_temperature``:
    a local teacher's exact full-vocabulary generalized JSD, or the served teacher's sparse support
    (:class:`SparseDistillationLoss`, whose scores come with the round: ``_RoundTeacher``); then TRL's ``jsd`` and,
    served, the teacher metrics."""

    def __init__(self) -> None:
        self.full_vocabulary = FullVocabularyDivergence()
        self.sparse = SparseDistillationLoss(make_teacher=_RoundTeacher)

    def __call__(self, trainer: AsyncDistillationTrainer, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        mode = trainer._mode()
        with _divergence_temperature(trainer.args):
            strategy = self.full_vocabulary if trainer._local_teacher else self.sparse
            loss = strategy(trainer, model, inputs)
        window = trainer._metrics[mode]
        if window.get("distillation_loss"):
            trainer.record_metric("jsd", window["distillation_loss"][-1], mode=mode)
        if not trainer._local_teacher:
            trainer._record_teacher_metrics(model, inputs, mode)
        return loss


@contextlib.contextmanager
def _divergence_temperature(args: AsyncDistillationConfig):
    """The distillation losses read ``args.temperature``; here the divergence's is ``teacher_temperature`` (TRL),
    while ``temperature`` is the sampling temperature (already in the worker's and the trainer's SamplingConfig)."""
    sampling = args.temperature
    args.temperature = args.teacher_temperature
    try:
        yield
    finally:
        args.temperature = sampling


class AsyncDistillationTrainer(DistillationTrainer):
    """TRL's ``AsyncDistillationTrainer(model, args, train_dataset, processing_class, callbacks, optimizers,
    peft_config)`` (see the module docstring).

    posttrain additions: ``teacher_model`` (a local teacher: hub id, path or model; else
    ``args.teacher_model_name_or_path``; else the servers of ``args.teacher_server_urls``) and ``eval_dataset``.
    The dataset and tokenizer must be picklable (the worker process receives them).

    The rollout worker and the weight pushes are the :class:`~posttrain.rollout.async_worker.AsyncRollout` component
    (``self.async_rollout``); the loss is ``DistillationTrainer``'s with the ``_AsyncDistillationLoss`` strategy.
    """

    config_class = AsyncDistillationConfig
    _trainer_name = "AsyncDistillation"
    _tag_names = ["posttrain", "async-distillation", "distillation"]
    loss_strategy: DistillationLoss = _AsyncDistillationLoss()
    served_teacher: _RoundTeacher | None = None  # the served teacher as the loss sees it, made on first use

    def __init__(
        self,
        model: str | torch.nn.Module,
        args: AsyncDistillationConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: list | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
        *,
        teacher_model: str | torch.nn.Module | None = None,
        eval_dataset: Any = None,
    ):
        args = self.resolve_args(args, model, self.config_class, self._trainer_name)
        if isinstance(model, str) and args.dtype is not None:
            args.model_init_kwargs = {"dtype": args.dtype, **(args.model_init_kwargs or {})}
        if isinstance(train_dataset, torch.utils.data.IterableDataset):
            raise ValueError("AsyncDistillationTrainer needs a map-style train_dataset (the worker indexes prompts).")
        self._local_teacher = teacher_model is not None or bool(args.teacher_model_name_or_path)
        self._teacher_ids = [] if self._local_teacher else list(args.teacher_server_urls)
        if len(self._teacher_ids) > 1 and train_dataset is not None:
            columns = getattr(train_dataset, "column_names", None) or []
            if "teacher_id" not in columns:
                raise ValueError(
                    f"teacher_server_urls has {len(self._teacher_ids)} teachers (MOPD): every train_dataset row needs "
                    "a `teacher_id` column naming its teacher."
                )
            row_teacher_ids([{"teacher_id": t} for t in set(train_dataset["teacher_id"])], self._teacher_ids)
        super().__init__(
            model, teacher_model, args, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, callbacks=callbacks, optimizers=optimizers, peft_config=peft_config,
        )  # fmt: skip
        self.async_rollout = AsyncRollout(
            self, make_spec=self._worker_spec, score=self._score_with_current_policy, trainer_name=self._trainer_name,
            picklable_hint="the dataset and processing class",
        )  # fmt: skip
        self._token_budget: int | None = None  # resolved at the first round (the server's max_model_len when None)
        self._packed_inputs: dict[str, Any] | None = None  # the pack training_step is running
        self.dropped_oversize_total = 0

    # -- teacher -----------------------------------------------------------------------------------------------
    def _uses_teacher_server(self, args: Any) -> bool:
        return not self._local_teacher

    # -- worker ------------------------------------------------------------------------------------------------
    def _worker_spec(self) -> DistillationWorkerSpec:
        args = self.args
        rollout_kwargs = dict(
            num_generations=args.num_generations, lmbda=1.0, seq_kd=False, max_prompt_length=args.max_prompt_length,
            max_completion_length=args.max_completion_length, pad_to_multiple_of=args.pad_to_multiple_of,
            mask_truncated_completions=args.mask_truncated_completions, chat_template_kwargs=args.chat_template_kwargs,
            keep_completions=args.log_completions, seed=args.seed,
        )  # fmt: skip
        return DistillationWorkerSpec(
            **self.async_rollout.spec_fields(), rollout_kwargs=rollout_kwargs, num_slices=args.steps_per_generation,
            teacher_server_urls=None if self._local_teacher else dict(args.teacher_server_urls),
            teacher_top_k=args.teacher_top_k, teacher_temperature=args.teacher_temperature, vocab_rows=self.vocab_rows,
        )  # fmt: skip

    # -- token budget ----------------------------------------------------------------------------------------
    def _resolve_token_budget(self) -> int:
        """TRL's ``token_budget``: None → the student server's ``max_model_len`` (off when it reports none), ≤ 0 →
        off (0 here)."""
        if self._token_budget is None:
            budget = self.args.token_budget
            if budget is None:
                with contextlib.suppress(Exception):  # a server without /v1/models or max_model_len: no budget
                    budget = self.backend.client.request("GET", "/v1/models").json()["data"][0].get("max_model_len")
            self._token_budget = max(int(budget or 0), 0)
        return self._token_budget

    def _drop_oversize(self, batch: dict[str, Any], record: Any) -> dict[str, Any]:
        """Rows longer than ``token_budget`` (prompt + completion tokens) fit in no forward: TRL drops them with a
        warning (``batch/dropped_oversize_total``); here their loss mask is cleared and ``num_items_in_batch``
        recounted, and ``training_step`` never forwards them."""
        budget = self._resolve_token_budget()
        if not budget:
            return batch
        over = (batch["prompt_mask"].sum(1) + batch["completion_lengths"]) > budget
        if over.any():
            logger.warning(
                f"Dropping {int(over.sum())} rollout sample(s) longer than token_budget={budget} tokens. Raise "
                "token_budget to avoid dropping samples."
            )
            self.dropped_oversize_total += int(over.sum())
            mask = batch["completion_mask"] * (~over)[:, None].to(batch["completion_mask"].dtype)
            batch = {**batch, "completion_mask": mask, "num_items_in_batch": mask.sum()}
        record("batch/dropped_oversize_total", float(self.dropped_oversize_total))
        return batch

    def _extra_checkpoint_state(self) -> dict[str, Any]:
        states = self.async_rollout.checkpoint_state(super()._extra_checkpoint_state())
        states[ROLLOUT_STATE] = {**states[ROLLOUT_STATE], "dropped_oversize_total": self.dropped_oversize_total}
        return states

    def _load_extra_checkpoint_state(self, states: dict[str, Any]) -> None:
        super()._load_extra_checkpoint_state(states)
        self.async_rollout.load_checkpoint_state(states)
        self.dropped_oversize_total = int(states.get(ROLLOUT_STATE, {}).get("dropped_oversize_total", 0))

    def _prepare_inputs(self, inputs: Any) -> Any:
        if self._packed_inputs is not None:  # one token-budget pack of the micro-batch (training_step)
            return self._packed_inputs
        return self.async_rollout.prepare_inputs(inputs, super()._prepare_inputs)

    def evaluate(self, *args, **kwargs):
        self.async_rollout.join_push()  # evaluate on the newest pushed weights, not on ones still being uploaded
        return super().evaluate(*args, **kwargs)

    def _load_rng_state(self, checkpoint: Any) -> None:
        self.async_rollout.load_rng_state(checkpoint, super()._load_rng_state)

    def _save_checkpoint(self, *args, **kwargs):
        self.async_rollout.join_push()  # the checkpoint's weight_version is on the server when it is written
        return super()._save_checkpoint(*args, **kwargs)

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """With a ``token_budget``: the micro-batch's rows, in order, are forwarded and backpropagated in packs of at
        most ``token_budget`` real tokens (peak memory bounded independently of the row count); the gradients add
        up to the whole micro-batch's, as every pack's loss is normalised by the optimizer step's tokens."""
        budget = self._resolve_token_budget()
        if not budget:
            return super().training_step(model, inputs, num_items_in_batch)
        model.train()  # as HF's training_step does first: _prepare_inputs reads the mode from it
        batch = self._prepare_inputs(inputs)
        lengths = (batch["prompt_mask"].sum(1) + batch["completion_lengths"]).tolist()
        packs, _ = token_budget_packs([int(n) for n in lengths], budget)
        if not packs:  # every row dropped as oversize: nothing to forward
            return torch.zeros((), device=self.accelerator.device)
        total = None
        for pack in packs:
            whole = len(packs) == 1 and len(pack) == len(lengths)
            self._packed_inputs = batch if whole else trim_padding(select_rows(batch, torch.tensor(pack)))
            try:
                loss = super().training_step(model, inputs, num_items_in_batch)
            finally:
                self._packed_inputs = None
            total = loss if total is None else total + loss
        self.record_metric("batch/packs_per_micro_batch", float(len(packs)), mode="train")
        return total

    def _score_with_current_policy(self, batch: dict[str, Any], record: Any) -> dict[str, Any]:
        """A consumed round needs nothing more here (teacher scores came with it); drops oversize rows
        (``token_budget``) and logs TRL's sample/batch sizes."""
        batch = self._drop_oversize(batch, record)
        forwarded = (batch["prompt_mask"].sum(1) + batch["completion_lengths"]).float()
        trained = batch["completion_mask"].sum(1).float()
        with contextlib.suppress(NotImplementedError, OSError, ValueError):  # qsize is not available everywhere
            record("sample/rollout_queue_size", self.async_rollout.queued_rows())
        record("sample/forwarded_tokens_mean", forwarded.mean().item())
        record("sample/forwarded_tokens_max", forwarded.max().item())
        record("sample/trained_tokens_mean", trained.mean().item())
        record("batch/samples_per_step", float(forwarded.numel()))
        record("batch/forwarded_tokens_per_step", forwarded.sum().item())
        record("batch/trained_tokens_per_step", trained.sum().item())
        return self.async_rollout.to_device(batch)

    # -- loss (the _AsyncDistillationLoss strategy) -------------------------------------------------------------
    @torch.no_grad()
    def _record_teacher_metrics(self, model: torch.nn.Module, inputs: dict[str, Any], mode: str) -> None:
        """``teacher_entropy`` on the loss's support (with the tail bucket) and, with several teachers,
        ``teacher_token_frac/{id}`` (each teacher's share of the micro-batch's loss tokens), ``teacher_jsd/{id}``
        and ``teacher_entropy/{id}`` (those metrics over the tokens that teacher scored)."""
        if "teacher_topk_logprobs" not in inputs:
            return
        args = self.args
        teacher = flat_teacher_scores(inputs)
        if args.beta == 0:
            lp = teacher["topk_logprobs"]
        elif args.beta == 1:
            lp = teacher["actual_logprobs"][:, None]
        else:
            tokens = inputs["completion_ids"][inputs["completion_mask"].bool()]
            same = teacher["topk_token_ids"][:, 0] == tokens
            sampled = torch.where(same, torch.full_like(teacher["actual_logprobs"], float("-inf")),
                                  teacher["actual_logprobs"])  # fmt: skip
            lp = torch.stack([teacher["topk_logprobs"][:, 0], sampled], -1)
        mask = torch.isfinite(lp)
        if args.add_tail_bucket:
            lp, mask = add_tail_bucket(torch.where(mask, lp, float("-inf")), mask)
        else:
            lp = lp - torch.logsumexp(lp, -1, keepdim=True)
        entropy = -torch.where(mask, lp.exp() * lp, torch.zeros_like(lp)).nan_to_num(0.0).sum(-1)
        if entropy.numel():
            self.record_metric("teacher_entropy", entropy.mean(), mode=mode)
        if len(self._teacher_ids) > 1 and "teacher_index" in inputs:
            # MOPD: the divergence per token again (no grad: one more student forward) to split it by teacher
            student = score_distillation_completions(model, *self._scoring_inputs(model, inputs))
            tokens = student.tokens

            def per_chunk(student_lp: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor]:
                chunk_teacher = {key: value[rows] for key, value in teacher.items()}
                return (server_sparse_divergence(student_lp, tokens[rows], chunk_teacher, beta=args.beta,
                                                 add_tail=args.add_tail_bucket),)  # fmt: skip

            (per_token,) = chunked_token_map(
                student.logits_fn(self.vocab_rows), tokens.shape[0], per_chunk, temperature=args.teacher_temperature,
                chunk_size=self._loss_chunk_size(), device=tokens.device,
            )  # fmt: skip
            mask = inputs["completion_mask"].bool()
            rows = inputs["teacher_index"][:, None].expand_as(mask)[mask]
            for i, name in enumerate(self._teacher_ids):
                chosen = rows == i
                self.record_metric(f"teacher_token_frac/{name}", chosen.float().mean(), mode=mode)
                if chosen.any():
                    self.record_metric(f"teacher_jsd/{name}", per_token[chosen].mean(), mode=mode)
                    self.record_metric(f"teacher_entropy/{name}", entropy[chosen].mean(), mode=mode)

    def train(self, *args, **kwargs):
        try:
            return self.async_rollout.run(super().train, *args, **kwargs)
        finally:
            if self.served_teacher is not None:
                self.served_teacher.close()
                self.served_teacher = None
