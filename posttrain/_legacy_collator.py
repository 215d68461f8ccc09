"""``DataCollatorForCompletionOnlyLM``: TRL ≤ 0.19's collator, kept for old scripts (see :mod:`posttrain.legacy`).

It lives apart from ``posttrain.legacy`` because it subclasses ``transformers.DataCollatorForLanguageModeling``,
whose import would make ``import posttrain`` slow.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from transformers import DataCollatorForLanguageModeling as _HFDataCollatorForLanguageModeling

from posttrain.legacy import warn_once

_TOKEN_KEYS = ("input_ids", "attention_mask")


def _starts(labels: torch.Tensor, pattern: list[int]) -> list[int]:
    """Positions where ``pattern`` begins in the 1-D ``labels`` (matched on labels, as TRL did: padding is -100)."""
    n = len(pattern)
    row = labels.tolist()
    return [i for i in range(len(row) - n + 1) if row[i] == pattern[0] and row[i : i + n] == pattern]


class DataCollatorForCompletionOnlyLM(_HFDataCollatorForLanguageModeling):
    """Causal-LM batches whose labels are ``ignore_index`` everywhere except the responses (TRL ≤ 0.19).

    Deprecated: TRL 0.20 removed it; use ``SFTConfig(completion_only_loss=True)`` with a prompt/completion dataset,
    or ``assistant_only_loss=True`` with conversations.

    Args:
        response_template: Text (tokenized without special tokens) or token ids that start every response, e.g.
            ``"### Answer:"``. Labels up to and including it are masked.
        instruction_template: Text or token ids that start every human turn. With it, each turn from an
            instruction template to the next response template is masked too (multi-turn); a trailing human turn
            with no response is masked to the end.
        tokenizer: Pads the batch (``tokenizer.pad``: its ``padding_side``); labels are ``input_ids`` with the pad
            token masked, then the masking above.
        mlm: Must stay False (causal LM).
        ignore_index: Label value of masked positions.
        padding_free: Concatenate the batch's rows into one row with ``position_ids`` (and flash-attention
            ``cu_seq_lens_*`` / ``max_length_*``); the first token of each row is masked.

    A row where the response template (or, with one, the instruction template) is not found is masked entirely,
    with a ``UserWarning`` (usually ``max_length`` cut it off).
    """

    def __init__(
        self,
        response_template: str | list[int],
        instruction_template: str | list[int] | None = None,
        *args: Any,
        mlm: bool = False,
        ignore_index: int = -100,
        padding_free: bool = False,
        **kwargs: Any,
    ):
        super().__init__(*args, mlm=mlm, **kwargs)
        warn_once(
            "DataCollatorForCompletionOnlyLM",
            "`DataCollatorForCompletionOnlyLM` was removed in TRL 0.20; train on completions only with "
            "`SFTConfig(completion_only_loss=True)` (prompt/completion datasets) or `assistant_only_loss=True` "
            "(conversations). posttrain still applies the old masking.",
            stacklevel=2,
        )
        if mlm:
            raise ValueError("DataCollatorForCompletionOnlyLM is for causal language modelling: pass mlm=False.")
        self.response_template = response_template
        self.response_token_ids = self._ids(response_template)
        self.instruction_template = instruction_template
        self.instruction_token_ids = self._ids(instruction_template) if instruction_template else None
        if not self.response_token_ids:
            raise ValueError(f"response_template {response_template!r} tokenizes to no tokens.")
        if self.instruction_template and self.tokenizer.pad_token_id == self.tokenizer.eos_token_id:
            warnings.warn(
                "The tokenizer's pad and EOS tokens are the same id: with multi-turn data the EOS after each answer "
                "is masked as padding, and the model may not learn to stop. Set a distinct pad token.",
                UserWarning,
                stacklevel=2,
            )
        self.ignore_index = ignore_index
        self.padding_free = padding_free

    def _ids(self, template: str | list[int]) -> list[int]:
        if isinstance(template, str):
            return list(self.tokenizer.encode(template, add_special_tokens=False))
        return list(template)

    def _mask_row(self, labels: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Mask ``labels`` (one row, in place) outside the responses."""
        response_ends = [i + len(self.response_token_ids) for i in _starts(labels, self.response_token_ids)]
        if not response_ends:
            self._not_found("response", self.response_template, input_ids)
            labels[:] = self.ignore_index
            if self.instruction_token_ids is None:
                return
        if self.instruction_token_ids is None:
            labels[: response_ends[-1]] = self.ignore_index  # the last response template wins (TRL)
            return
        human_starts = _starts(labels, self.instruction_token_ids)
        if not human_starts:
            self._not_found("instruction", self.instruction_template, input_ids)
            labels[:] = self.ignore_index
            return
        if response_ends and human_starts[0] > response_ends[0]:
            human_starts = [0, *human_starts]  # the text opens with a response: everything before it is context
        for turn, (start, end) in enumerate(zip(human_starts, response_ends)):
            labels[(0 if turn == 0 else start) : end] = self.ignore_index
        if len(response_ends) < len(human_starts):
            labels[human_starts[-1] :] = self.ignore_index  # a final human turn with no response

    def _not_found(self, kind: str, template: Any, input_ids: torch.Tensor) -> None:
        warnings.warn(
            f"Could not find {kind} key `{template}` in the following instance: "
            f"{self.tokenizer.decode(input_ids)}. This instance will be ignored in loss calculation. Note, if this "
            "happens often, consider increasing the `max_length`.",
            UserWarning,
            stacklevel=4,
        )

    def torch_call(self, examples: list[Any]) -> dict[str, Any]:
        if examples and isinstance(examples[0], Mapping):
            # the trainer's rows may carry extra columns (masks, lengths) that tokenizer.pad cannot pad
            examples = [{k: ex[k] for k in _TOKEN_KEYS if k in ex} for ex in examples]
        batch = super().torch_call(examples)
        for i in range(batch["labels"].shape[0]):
            self._mask_row(batch["labels"][i], batch["input_ids"][i])
        if self.padding_free:
            keep = batch.pop("attention_mask").bool()
            position_ids = keep.long().cumsum(1)[keep].unsqueeze(0) - 1
            batch["input_ids"] = batch["input_ids"][keep].unsqueeze(0)
            batch["labels"] = batch["labels"][keep].unsqueeze(0)
            batch["labels"][position_ids == 0] = self.ignore_index
            batch["position_ids"] = position_ids
            flat = position_ids.flatten()
            starts = torch.nonzero(flat == 0).flatten().to(torch.int32)
            cu = torch.cat([starts, torch.tensor([flat.numel()], dtype=torch.int32)]).unsqueeze(0)
            batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
            batch["max_length_q"] = batch["max_length_k"] = torch.tensor([int(flat.max()) + 1])
        return batch
