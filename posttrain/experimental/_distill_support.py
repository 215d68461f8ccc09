"""What the experimental distillation trainers (IW-OPD, server distillation) share: TRL's sparse top-k supports
(local teacher or teacher server) on a chunk of loss tokens, and the teacher-server request.

Tokens are the ``N`` loss tokens of a micro-batch in row-major order of ``completion_mask`` (the order of
``score_distillation_completions``); ``(B, C)`` tensors are scattered back with :func:`to_rows`.
"""

from __future__ import annotations

from typing import Any

import torch

from posttrain.core.distill import sparse_support_divergence

__all__ = [
    "ServedTeacher",
    "local_sparse_divergence",
    "server_sparse_divergence",
    "to_rows",
]


def to_rows(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scatter ``(N,)`` per-loss-token values into ``(B, C)`` (zeros off the mask)."""
    out = values.new_zeros(mask.shape)
    return out.masked_scatter(mask.bool(), values)


def _dedup(support: torch.Tensor, first: int) -> torch.Tensor:
    """Mask of ``support`` ``(N, K1 + K2)`` keeping the first ``first`` columns and any later id not among them."""
    mask = torch.ones_like(support, dtype=torch.bool)
    if support.shape[-1] > first:
        later = support[:, first:]
        seen = (later[:, :, None] == support[:, None, :first]).any(-1)
        mask[:, first:] = ~seen
    return mask


def local_sparse_divergence(
    student_log_probs: torch.Tensor,
    teacher_log_probs: torch.Tensor,
    tokens: torch.Tensor,
    *,
    beta: float,
    top_k: int,
    add_tail: bool,
    reverse_top_1_mode: str = "sampled",
) -> torch.Tensor:
    """TRL's local-teacher sparse loss ``(N,)``: support = teacher top-k (β = 0), student top-k (β = 1), their union
    (mixed). With ``top_k == 1`` and β > 0 the reverse token is the sampled one (``"sampled"``) or the student's
    argmax (``"argmax"``); the forward token is always the teacher's top-1."""
    if top_k == 1 and beta > 0:
        reverse = tokens if reverse_top_1_mode == "sampled" else student_log_probs.argmax(-1)
        support = reverse[:, None] if beta == 1 else torch.stack([teacher_log_probs.argmax(-1), reverse], -1)
    else:
        teacher_top = teacher_log_probs.topk(top_k, dim=-1).indices
        student_top = student_log_probs.topk(top_k, dim=-1).indices
        support = teacher_top if beta == 0 else student_top if beta == 1 else torch.cat([teacher_top, student_top], -1)
    mask = _dedup(support, 1 if (top_k == 1 and 0 < beta < 1) else (top_k if 0 < beta < 1 else support.shape[-1]))
    return sparse_support_divergence(
        student_log_probs.gather(-1, support), teacher_log_probs.gather(-1, support), mask, beta=beta, add_tail=add_tail
    )


def server_sparse_divergence(
    student_log_probs: torch.Tensor,
    tokens: torch.Tensor,
    teacher: dict[str, torch.Tensor],
    *,
    beta: float,
    add_tail: bool,
) -> torch.Tensor:
    """TRL's teacher-server sparse loss ``(N,)``: β = 0 → forward KL on the teacher's top-k; β > 0 (top-1 only) →
    support {teacher top-1, sampled token} (just the sampled token for β = 1) with the teacher's log-prob of the
    sampled token from ``actual_logprobs``."""
    if beta == 0:
        ids, teacher_lp = teacher["topk_token_ids"], teacher["topk_logprobs"]
        mask = torch.isfinite(teacher_lp)
        return sparse_support_divergence(
            student_log_probs.gather(-1, ids), teacher_lp, mask, beta=0.0, add_tail=add_tail
        )
    actual = teacher["actual_logprobs"]
    if beta == 1:
        support, teacher_lp = tokens[:, None], actual[:, None]
    else:
        support = torch.stack([teacher["topk_token_ids"][:, 0], tokens], -1)
        teacher_lp = torch.stack([teacher["topk_logprobs"][:, 0], actual], -1)
    mask = _dedup(support, 1)
    return sparse_support_divergence(
        student_log_probs.gather(-1, support), teacher_lp, mask, beta=beta, add_tail=add_tail
    )


class ServedTeacher:
    """The teacher behind ``posttrain serve`` (or ``trl vllm-serve``): ``POST /get_sequence_logprobs/`` for the
    student's ``[prompt | completion]`` sequences, flattened to the loss tokens."""

    def __init__(self, base_url: str, vocab_rows: int, timeout: float = 240.0, timeout_hint: str = "request_timeout"):
        from posttrain.generation.client import GenerationClient

        # timeout_hint: the config field a timeout error tells the user to raise
        self.client = GenerationClient(base_url.rstrip("/"), request_timeout=timeout, timeout_hint=timeout_hint)
        self.vocab_rows = vocab_rows

    def score(self, inputs: dict[str, Any], top_k: int, temperature: float) -> dict[str, torch.Tensor]:
        """``actual_logprobs`` ``(N,)``, ``topk_logprobs`` / ``topk_token_ids`` ``(N, K)`` at the loss tokens."""
        prompt_ids, prompt_mask = inputs["prompt_ids"].cpu(), inputs["prompt_mask"].cpu().bool()
        completion_ids, lengths = inputs["completion_ids"].cpu(), inputs["completion_lengths"].cpu()
        loss_mask = inputs["completion_mask"].cpu().bool()
        sequences, prompt_lengths = [], []
        for i in range(prompt_ids.shape[0]):
            prompt = prompt_ids[i][prompt_mask[i]].tolist()
            sequences.append(prompt + completion_ids[i, : int(lengths[i])].tolist())
            prompt_lengths.append(len(prompt))
        keep = [i for i in range(len(sequences)) if loss_mask[i].any()]
        result = self.client.get_sequence_logprobs(
            [sequences[i] for i in keep], [prompt_lengths[i] for i in keep], top_logprobs=max(top_k, 1),
            temperature=temperature,
        )  # fmt: skip
        actual, top_lp, top_ids = [], [], []
        for j, i in enumerate(keep):
            cols = loss_mask[i].nonzero(as_tuple=True)[0].tolist()
            got = len(result["actual_logprobs"][j])
            if cols and cols[-1] >= got:
                raise ValueError(
                    f"The teacher server returned {got} completion log-probs for a completion of "
                    f"{int(lengths[i])} tokens; every loss token needs one."
                )
            actual += [result["actual_logprobs"][j][c][0] for c in cols]
            top_lp += [result["logprobs"][j][c] for c in cols]
            top_ids += [result["logprob_token_ids"][j][c] for c in cols]
        device = inputs["completion_ids"].device
        k = max(top_k, 1)
        ids = torch.tensor(top_ids, dtype=torch.long, device=device).reshape(-1, k)
        if ids.numel() and int(ids.max()) >= self.vocab_rows:
            raise ValueError(
                f"The teacher server returned token id {int(ids.max())}, outside the student's vocabulary "
                f"({self.vocab_rows} rows): server distillation needs a teacher with the student's tokenizer."
            )
        return {
            "actual_logprobs": torch.tensor(actual, dtype=torch.float32, device=device),
            "topk_logprobs": torch.tensor(top_lp, dtype=torch.float32, device=device).reshape(-1, k),
            "topk_token_ids": ids,
        }

    def close(self) -> None:
        self.client.close()
