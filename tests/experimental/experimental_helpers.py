"""Data and reference computations shared by the experimental trainers' tests."""

from __future__ import annotations

import torch
from datasets import Dataset


def pairs(n: int = 4) -> Dataset:
    prompts = ["The sky is", "Grass is", "Snow is", "Coal is"]
    chosen = [" blue.", " green.", " white.", " black."]
    rejected = [" red.", " pink.", " hot.", " soft and round."]
    idx = [i % 4 for i in range(n)]
    return Dataset.from_dict(
        {
            "prompt": [prompts[i] for i in idx],
            "chosen": [chosen[i] for i in idx],
            "rejected": [rejected[i] for i in idx],
        }
    )


def naive_logps(model, batch):
    """Per-row completion log-prob sums and token counts from full logits (the reference the chunked path must match)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    logps = torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["completion_mask"][:, 1:].float()
    return (logps * mask).sum(-1), mask.sum(-1), logps, mask


def merged_logs(trainer) -> dict:
    """Every logged key of ``trainer.state.log_history``, the latest value winning."""
    merged = {}
    for entry in trainer.state.log_history:
        merged.update(entry)
    return merged
