"""The AsyncDistillation rollout worker: on-policy distillation rounds for the shared async worker
(``posttrain.rollout.async_worker``: prompt order, admission, request seeds, queue, errors).

One *round* is one optimizer step's worth of rows (``per_device_train_batch_size × gradient_accumulation_steps``),
in ``DistillationTrainer``'s ``RepeatSampler`` order. The worker runs the shared ``DistillationRollout`` with the
student's server as its generation backend (every slice on-policy, as in TRL) and, with served teachers, scores the
student's completions against them (``POST /get_sequence_logprobs/`` of ``posttrain serve``, TRL's teacher-forced
``prompt_logprobs`` request) before queueing the round, so teacher scoring overlaps training as in TRL. A local
teacher is scored by the trainer instead (it holds the teacher's weights).

Teacher scores travel as row tensors (``(B, C, K + 1)``, see :func:`score_with_teachers`), so the rollout buffer
shuffles and splits them with the rest of the round.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from posttrain.rollout.async_worker import AsyncWorkerSpec, Producer

TEACHER_KEYS = ("teacher_topk_token_ids", "teacher_topk_logprobs", "teacher_actual_logprobs")
_SCORE_KEYS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_lengths")


def row_teacher_ids(rows: list[dict[str, Any]], teacher_ids: list[str]) -> list[str]:
    """The teacher of each row: the only one, or (MOPD, several teachers) the row's ``teacher_id`` column."""
    if len(teacher_ids) == 1:
        return [teacher_ids[0]] * len(rows)
    out = []
    for i, row in enumerate(rows):
        teacher_id = row.get("teacher_id")
        if teacher_id not in teacher_ids:
            raise ValueError(
                f"Row {i} has teacher_id={teacher_id!r}, which is not among the teachers in teacher_server_urls "
                f"({teacher_ids}); with several teachers every row needs a `teacher_id` naming one of them."
            )
        out.append(teacher_id)
    return out


def score_with_teachers(
    batch: dict[str, Any],
    row_teachers: list[str],
    teachers: dict[str, Any],
    top_k: int,
    temperature: float,
    record: Any = None,
) -> dict[str, torch.Tensor]:
    """Teacher scores of every loss token of ``batch`` as row tensors, each row scored by its teacher.

    ``teachers`` maps ids to :class:`~posttrain.experimental._distill_support.ServedTeacher`. Returns
    ``teacher_topk_token_ids`` / ``teacher_topk_logprobs`` ``(B, C, top_k + 1)``: the teacher's top-k, then the
    sampled token with its log-prob, masked (−inf) where it already is among the top-k — TRL's candidate set, which
    always holds the realized token — and ``teacher_actual_logprobs`` ``(B, C)``; plus ``teacher_index`` ``(B,)``
    (position of each row's teacher in ``teachers``) with several teachers. Off the loss mask: id 0, −inf.
    """
    mask = batch["completion_mask"].bool().cpu()
    b, c = mask.shape
    k = top_k + 1
    ids = torch.zeros(b, c, k, dtype=torch.long)
    logprobs = torch.full((b, c, k), float("-inf"))
    actual = torch.full((b, c), float("-inf"))
    names = list(teachers)
    for name, teacher in teachers.items():
        index = torch.tensor([i for i in range(b) if row_teachers[i] == name], dtype=torch.long)
        if not index.numel():
            continue
        sub = {key: batch[key].cpu()[index] for key in _SCORE_KEYS}
        start = time.perf_counter()
        scores = teacher.score(sub, top_k, temperature)
        if record is not None:
            record("rollout/score_s", time.perf_counter() - start)
            if len(teachers) > 1:
                record(f"teacher_score_s/{name}", time.perf_counter() - start)
        sub_mask = mask[index]
        tokens = sub["completion_ids"][sub_mask]
        top_ids, top_lp = scores["topk_token_ids"].cpu(), scores["topk_logprobs"].cpu()
        seen = (top_ids == tokens[:, None]).any(-1)
        sampled_lp = torch.where(seen, torch.full_like(scores["actual_logprobs"].cpu(), float("-inf")),
                                 scores["actual_logprobs"].cpu())  # fmt: skip
        rows_ids, rows_lp = ids[index], logprobs[index]
        rows_ids[sub_mask] = torch.cat([top_ids, tokens[:, None]], -1)
        rows_lp[sub_mask] = torch.cat([top_lp, sampled_lp[:, None]], -1)
        rows_actual = actual[index]
        rows_actual[sub_mask] = scores["actual_logprobs"].cpu()
        ids[index], logprobs[index], actual[index] = rows_ids, rows_lp, rows_actual
    out = {"teacher_topk_token_ids": ids, "teacher_topk_logprobs": logprobs, "teacher_actual_logprobs": actual}
    if len(teachers) > 1:
        out["teacher_index"] = torch.tensor([names.index(t) for t in row_teachers], dtype=torch.long)
    return out


def flat_teacher_scores(inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The row tensors of :func:`score_with_teachers` at the loss tokens, in ``completion_mask``'s row-major order
    (the ``ServedTeacher.score`` layout the served loss reads). The buffer may have trimmed the completion columns."""
    mask = inputs["completion_mask"].bool()
    width = mask.shape[1]
    return {
        "topk_token_ids": inputs["teacher_topk_token_ids"][:, :width][mask],
        "topk_logprobs": inputs["teacher_topk_logprobs"][:, :width][mask],
        "actual_logprobs": inputs["teacher_actual_logprobs"][:, :width][mask],
    }


@dataclass(kw_only=True)
class DistillationWorkerSpec(AsyncWorkerSpec):
    """The shared worker spec plus ``DistillationRollout``'s options and the teacher servers (None: local teacher)."""

    rollout_kwargs: dict[str, Any]
    num_slices: int
    teacher_server_urls: dict[str, str] | None
    teacher_top_k: int
    teacher_temperature: float
    vocab_rows: int

    def make_producer(self, backend: Any, accelerator: Any = None) -> Producer:
        from posttrain.experimental._distill_support import ServedTeacher
        from posttrain.rollout.distillation import DistillationRollout

        rollout = DistillationRollout(
            tokenizer=self.tokenizer, student_backend=backend, sampling=self.sampling, accelerator=accelerator,
            **self.rollout_kwargs,
        )
        teachers = {
            name: ServedTeacher(url, self.vocab_rows, self.request_timeout)
            for name, url in (self.teacher_server_urls or {}).items()
        }

        def produce(rows: list, record: Any) -> tuple[Any, Any]:
            row_teachers = row_teacher_ids(rows, list(teachers)) if teachers else None
            batch = rollout.run(rows, num_slices=self.num_slices, mode="train", device="cpu", record=record)
            if teachers:
                batch.update(score_with_teachers(batch, row_teachers, teachers, self.teacher_top_k,
                                                 self.teacher_temperature, record))  # fmt: skip
            return batch, rollout.last_completions

        return produce
