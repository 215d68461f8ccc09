"""A scripted policy for agent tests: the real tiny model runs, but each assistant turn is forced to a script.

``ScriptedLM`` wraps the tiny causal LM. Its forward runs the real model (so the ``GroupSampler``'s prefill, KV-cache
expansion and row dropping all happen for real) and then replaces the logits with a near one-hot distribution on
the next token of ``script(context)``, where ``context`` is the conversation text up to the current assistant turn.
The sampler never tells the model which rows it keeps, so the wrapper shadows the token history on the cache
object itself: ``batch_repeat_interleave`` / ``batch_select_indices`` (the cache calls the sampler makes) are
patched to re-index the shadow history the same way. A prefill may come in two forwards (a long prefix the prompts
share, at batch 1, then each prompt's left-padded rest): a multi-token forward after the first extends each row's
history with its rest's real tokens.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

EOS = 258
PAD = 259
_TURN_MARKER = [257, *b"assistant\n"]  # <|im_start|>assistant\n


def _track(cache, history: list[list[int]]) -> None:
    cache._script_history = history
    repeat, select = cache.batch_repeat_interleave, cache.batch_select_indices

    def batch_repeat_interleave(repeats: int):
        cache._script_history = [list(h) for h in cache._script_history for _ in range(repeats)]
        return repeat(repeats)

    def batch_select_indices(indices):
        cache._script_history = [list(cache._script_history[i]) for i in indices.tolist()]
        return select(indices)

    cache.batch_repeat_interleave = batch_repeat_interleave
    cache.batch_select_indices = batch_select_indices


class ScriptedLM(torch.nn.Module):
    """The tiny model with each assistant turn forced to ``script(context_text)`` followed by ``<|im_end|>``."""

    def __init__(self, model, tokenizer, script: Callable[[str], str]):
        super().__init__()
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.script = script
        self.contexts: list[str] = []  # each distinct context a turn was scripted for
        self._targets: dict[tuple[int, ...], list[int]] = {}

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def _target(self, context: list[int]) -> list[int]:
        key = tuple(context)
        if key not in self._targets:
            text = self.tokenizer.decode(context, skip_special_tokens=False)
            self.contexts.append(text)
            turn = self.script(text) + "<|im_end|>"
            self._targets[key] = self.tokenizer.encode(turn, add_special_tokens=False)
        return self._targets[key]

    def _next_token(self, history: list[int]) -> int:
        m = len(_TURN_MARKER)
        starts = [i for i in range(len(history) - m, -1, -1) if history[i : i + m] == _TURN_MARKER]
        if not starts:
            return EOS
        split = starts[0] + m
        target, generated = self._target(history[:split]), history[split:]
        assert generated == target[: len(generated)], "the scripted turn went off script"
        return target[len(generated)] if len(generated) < len(target) else EOS

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, use_cache=None,
                logits_to_keep=0, **kwargs):  # fmt: skip
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                         use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)  # fmt: skip
        if getattr(cache, "_script_history", None) is None:  # prefill: the real tokens of each left-padded row
            mask = attention_mask[:, -input_ids.shape[1] :].bool()
            _track(cache, [row[m].tolist() for row, m in zip(input_ids, mask)])
        elif input_ids.shape[1] > 1:  # the prompts' rests after their shared prefix (2-D mask, padding masked)
            mask = attention_mask[:, -input_ids.shape[1] :].bool()
            for history, row, m in zip(cache._script_history, input_ids, mask):
                history.extend(row[m].tolist())
        else:
            for history, token in zip(cache._script_history, input_ids[:, -1].tolist()):
                history.append(token)
        logits = torch.full_like(out.logits, -30.0)
        for row, history in enumerate(cache._script_history):
            logits[row, -1, self._next_token(history)] = 30.0
        out.logits = logits
        return out


def scripted_sampler(script: Callable[[str], str], model=None, tokenizer=None, **sampler_kwargs):
    """``(GroupSampler over a ScriptedLM, tokenizer, scripted model)``; pass ``model`` to reuse a tiny model."""
    from posttrain.generation.group_sampler import GroupSampler

    tokenizer = tokenizer or build_tiny_tokenizer(padding_side="left")
    model = model if model is not None else build_tiny_model("qwen2", tokenizer=tokenizer)
    scripted = ScriptedLM(model, tokenizer, script).eval()
    return GroupSampler(scripted, tokenizer, **sampler_kwargs), tokenizer, scripted


def last_user(context: str) -> str:
    """Content of the last user message of a rendered ChatML context."""
    return context.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]


def tool_responses(context: str) -> list[str]:
    """Tool responses after the last user message, in order."""
    tail = context.rsplit("<|im_start|>user\n", 1)[-1]
    return re.findall(r"<tool_response>(.*?)</tool_response>", tail, flags=re.DOTALL)


def call(name: str, arguments: str) -> str:
    """A Hermes tool-call block with raw argument JSON text."""
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: What to complain about.
    """
    raise RuntimeError(f"boom: {reason}")
