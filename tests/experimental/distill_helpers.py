"""Shared pieces of the distillation-family tests: a tiny teacher that answers "abcabc..." and a divergence probe."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from trainer_helpers import save_abc_teacher

from posttrain.models.tiny import build_tiny_tokenizer


@pytest.fixture(scope="session")
def abc_teacher_path(tmp_path_factory) -> str:
    """A tiny Qwen2 that answers "abcabc..." after any "Q<n>:" prompt (see ``save_abc_teacher``)."""
    return save_abc_teacher(build_tiny_tokenizer(), str(tmp_path_factory.mktemp("abc-teacher")), seed=1)


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


@torch.no_grad()
def sampled_reverse_kl(student, teacher, tokenizer, n: int = 32, max_new_tokens: int = 8, seed: int = 0) -> float:
    """E_{y~p_S}[log p_S(y_t) − log p_T(y_t)] per sampled token over prompts "Q<i>:" (the on-policy reverse KL the
    sampled-token objectives minimise), from ``n`` seeded student samples."""
    torch.manual_seed(seed)
    student.eval()
    enc = tokenizer([f"Q{i % 16}:" for i in range(n)], return_tensors="pt", padding=True, padding_side="left")
    out = student.generate(**enc, do_sample=True, top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=max_new_tokens,
                           min_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    mask = torch.cat([enc.attention_mask, torch.ones_like(out[:, enc.input_ids.shape[1]:])], 1)
    c = out.shape[1] - enc.input_ids.shape[1]
    targets = out[:, -c:, None]
    ls = torch.log_softmax(student(out, attention_mask=mask).logits[:, -c - 1 : -1].float(), -1).gather(-1, targets)
    lt = torch.log_softmax(teacher(out, attention_mask=mask).logits[:, -c - 1 : -1].float(), -1).gather(-1, targets)
    return (ls - lt).mean().item()


def perturbed_copy(path: str, out: str, scale: float = 0.05, seed: int = 3) -> str:
    """A student that starts near the teacher at ``path`` (every weight + N(0, scale²)), saved to ``out``: on-policy
    sampled-token objectives get informative feedback on its samples, unlike a random student's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(path).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def merged_teacher_path(tmp_path_factory) -> str:
    """A tiny Qwen2 with the *other* tokenizer (``build_tiny_merged_tokenizer``: different ids, "abc" one token)
    that answers "abcabc..." after "Q<n>:" (see ``save_abc_teacher``)."""
    from posttrain.models.tiny import build_tiny_merged_tokenizer

    return save_abc_teacher(build_tiny_merged_tokenizer(), str(tmp_path_factory.mktemp("merged-teacher")), seed=2)


class LogitsTracker:
    """Records the largest freshly allocated (non-view) tensor whose last dimension is ``vocab`` — full-vocabulary
    logits/log-probs — across every op run while active, forward, checkpoint recompute and backward included
    (a ``TorchDispatchMode``: deterministic, no timing). ``rows`` = its numel // vocab, ``bytes`` = its size."""

    def __init__(self, *vocabs: int):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.vocabs, self.rows, self.bytes = set(vocabs), 0, 0

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                inputs = torch.utils._pytree.tree_leaves((args, kwargs))
                shared = {x.untyped_storage().data_ptr() for x in inputs if isinstance(x, torch.Tensor)}
                for t in torch.utils._pytree.tree_leaves(out):
                    is_logits = isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] in tracker.vocabs
                    if is_logits and t.untyped_storage().data_ptr() not in shared:  # a new buffer, not a view
                        tracker.rows = max(tracker.rows, t.numel() // t.shape[-1])
                        tracker.bytes = max(tracker.bytes, t.numel() * t.element_size())
                return out

        self._mode = _Mode()

    def __enter__(self) -> LogitsTracker:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def served_loss_batch(tokenizer) -> dict:
    """Two rows, left-padded prompts (pad 259), a masked last completion token: a fixed micro-batch for the served
    teacher losses."""
    prompt = torch.tensor([[259] + tokenizer("Q1:").input_ids, tokenizer("Q22:").input_ids])
    prompt_mask = (prompt != 259).long()
    completion = torch.tensor([tokenizer("abca").input_ids, tokenizer("xyz").input_ids + [259]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    return {
        "prompt_ids": prompt, "prompt_mask": prompt_mask, "completion_ids": completion, "completion_mask": mask,
        "completion_lengths": torch.tensor([4, 3]), "num_items_in_batch": mask.sum(),
    }  # fmt: skip


def iw_opd_batch(tokenizer) -> dict:
    """Two unpadded rows, the second's last completion token masked: the IW-OPD tests' fixed micro-batch."""
    prompt = torch.tensor([tokenizer("Q1:").input_ids, tokenizer("Q2:").input_ids])
    completion = torch.tensor([tokenizer("abca").input_ids, tokenizer("xyzw").input_ids])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    return {
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
        "completion_mask": mask, "completion_lengths": torch.tensor([4, 3]), "num_items_in_batch": mask.sum(),
    }  # fmt: skip
