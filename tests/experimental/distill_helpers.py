"""Shared pieces of the distillation-family tests: a tiny teacher that answers "abcabc..." and a divergence probe."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer


@pytest.fixture(scope="session")
def abc_teacher_path(tmp_path_factory) -> str:
    """A tiny Qwen2 that answers "abcabc..." after any "Q<n>:" prompt (80 full-batch Adam steps, ~1 s)."""
    torch.manual_seed(0)
    tokenizer = build_tiny_tokenizer()
    teacher = build_tiny_model("qwen2", tokenizer=tokenizer, seed=1)
    enc = tokenizer([f"Q{i}:abcabcabcabc" for i in range(16)], return_tensors="pt", padding=True)
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    optimizer = torch.optim.Adam(teacher.parameters(), lr=1e-2)
    for _ in range(80):
        teacher(**enc, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    path = str(tmp_path_factory.mktemp("abc-teacher"))
    teacher.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def prompts(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Q{i}:"} for i in range(n)])


def pairs(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Q{i}:", "completion": "abcabc"} for i in range(n)])


@torch.no_grad()
def mean_reverse_kl(student, teacher, tokenizer, text: str = "Q3:abcabcab") -> float:
    """KL(p_S‖p_T) per position of a fixed probe text (how far the student is from the teacher)."""
    enc = tokenizer([text], return_tensors="pt")
    ls = torch.log_softmax(student(**enc).logits.float(), -1)
    lt = torch.log_softmax(teacher(**enc).logits.float(), -1)
    return (ls.exp() * (ls - lt)).sum(-1).mean().item()
