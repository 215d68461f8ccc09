"""Whether a teacher can score the student's tokens: the checks every logit-distillation trainer runs once.

- :func:`model_vocab_size`: the rows of a model's LM head (its text config's ``vocab_size``).
- :func:`check_shared_vocabulary`: student and teacher must map every token to the same id (same tokenizer
  vocabulary) with LM heads that cover it; returns how many head rows the divergence compares.

Deliberate difference from TRL: student and teacher heads of different sizes are accepted when both cover the
tokenizer (e.g. Qwen2.5-0.5B's 151 936 rows vs Qwen2.5-7B's 152 064): the divergence then compares the first
``min(V_student, V_teacher)`` rows, which are the only ones a token can map to. TRL requires equal ``vocab_size``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from posttrain.models.unwrap import unwrap_base_model

__all__ = ["check_shared_vocabulary", "model_vocab_size"]

logger = logging.getLogger(__name__)
_LOGGED: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logger.warning(message)


def model_vocab_size(model: torch.nn.Module) -> int:
    """Rows of the model's LM head (``config.vocab_size`` of its text config)."""
    inner = unwrap_base_model(model)
    config = getattr(inner, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    size = getattr(text, "vocab_size", None)
    if size is None:
        head = inner.get_output_embeddings()
        size = head.weight.shape[0]
    return int(size)


def check_shared_vocabulary(
    student_tokenizer: Any, teacher_tokenizer: Any, student_vocab_size: int, teacher_vocab_size: int
) -> int:
    """Check that the teacher scores the student's token ids; return the number of head rows to compare.

    Args:
        student_tokenizer: The trainer's tokenizer.
        teacher_tokenizer: The teacher's own tokenizer, or None when it cannot be loaded (then only sizes are
            checked).
        student_vocab_size / teacher_vocab_size: LM-head rows of each model.

    Returns:
        ``V`` = the head size when both are equal, else ``min`` of the two when both cover the tokenizer (the extra
        rows are embedding padding that no token maps to).

    Raises:
        ValueError: the tokenizers map tokens to different ids, or a head is smaller than the tokenizer.
    """
    tok = getattr(student_tokenizer, "tokenizer", student_tokenizer)
    if teacher_tokenizer is not None:
        teacher_tok = getattr(teacher_tokenizer, "tokenizer", teacher_tokenizer)
        student_vocab, teacher_vocab = tok.get_vocab(), teacher_tok.get_vocab()
        if student_vocab != teacher_vocab:
            differ = sorted(
                (t for t in set(student_vocab) | set(teacher_vocab) if student_vocab.get(t) != teacher_vocab.get(t)),
                key=lambda t: (student_vocab.get(t, teacher_vocab.get(t, 0)), t),
            )
            examples = ", ".join(
                f"{t!r}: student {student_vocab.get(t)} / teacher {teacher_vocab.get(t)}" for t in differ[:3]
            )
            raise ValueError(
                f"The teacher's tokenizer does not match the student's: {len(differ)} tokens have different ids "
                f"({examples}). Distillation compares next-token distributions id by id, so the teacher must use "
                "the student's tokenizer (same model family); cross-tokenizer distillation (TRL's GOLD) is not "
                "supported."
            )
    n_tokens = len(tok)
    if student_vocab_size == teacher_vocab_size:
        if student_vocab_size < n_tokens:
            raise ValueError(
                f"The models' LM heads have {student_vocab_size} rows but the tokenizer has {n_tokens} tokens; "
                "resize the embeddings (model.resize_token_embeddings(len(tokenizer))) of both models."
            )
        return student_vocab_size
    rows = min(student_vocab_size, teacher_vocab_size)
    if rows < n_tokens:
        raise ValueError(
            f"The student has vocab_size {student_vocab_size} but the teacher has vocab_size {teacher_vocab_size}, "
            f"and the tokenizer has {n_tokens} tokens: the smaller head cannot score every token. Distillation "
            "needs a shared vocabulary: use a teacher from the student's model family (same tokenizer)."
        )
    _log_once(
        f"posttrain: student vocab_size {student_vocab_size} != teacher vocab_size {teacher_vocab_size}; both cover "
        f"the tokenizer's {n_tokens} tokens, so the divergence compares the first {rows} rows (the others are "
        "embedding padding)."
    )
    return rows
