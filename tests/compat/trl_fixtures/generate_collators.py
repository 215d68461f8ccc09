"""Regenerate ``trl_1_16_collators.json``: TRL 1.16's public collators run on a table of inputs.

The JSON is the ground truth ``tests/compat/test_trl_collator_fixture.py`` compares posttrain's collators with (key for
key, dtype, shape and values); the test itself never imports ``trl``. Run it with an interpreter that has
``trl==1.16.0`` (e.g. ``benchmarks/.venv-trl``, made by ``bash benchmarks/setup_trl.sh``)::

    benchmarks/.venv-trl/bin/python tests/compat/trl_fixtures/generate_collators.py

Each case is ``{"name", "collator", "args", "kwargs", "method", "examples", "expected" | "error"}``: ``collator`` is
the dotted TRL import path (posttrain's test maps ``trl`` to ``posttrain``), ``method`` is ``"call"`` (the collator on
``examples``) or the name of a static method called with ``examples`` as its single argument.
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
import trl

OUT = Path(__file__).with_name("trl_1_16_collators.json")

LM = "trl.trainer.sft_trainer.DataCollatorForLanguageModeling"
KTO = "trl.trainer.kto_trainer.DataCollatorForUnpairedPreference"
DPO = "trl.trainer.dpo_trainer.DataCollatorForPreference"
RM = "trl.trainer.reward_trainer.DataCollatorForPreference"

_plain = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7, 8, 9, 10]}]
_labelled = [
    {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},
    {"input_ids": [4, 5], "labels": [-100, 5]},
]
_mixed_labels = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [-100, 5]}]
_packed = [
    {"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]},
    {"input_ids": [6, 7, 8], "seq_lengths": [1, 1, 1]},
    {"input_ids": [9, 10], "seq_lengths": [2]},
]
_packed_labelled = [
    {"input_ids": [1, 2, 3, 4], "labels": [-100, 2, -100, 4], "seq_lengths": [2, 2]},
    {"input_ids": [5, 6, 7], "labels": [5, 6, 7], "seq_lengths": [3]},
]
_masks = [
    {"input_ids": [1, 2, 3, 4], "completion_mask": [0, 0, 1, 1], "assistant_masks": [0, 1, 1, 0]},
    {"input_ids": [5, 6], "completion_mask": [0, 1], "assistant_masks": [1, 1]},
]

_kto = [
    {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "label": True},
    {"prompt_ids": [7, 8], "completion_ids": [9], "label": False},
    {"prompt_ids": [10], "completion_ids": [11, 12, 13, 14], "label": True},
]
_kto_kl = [
    {"prompt_ids": [1, 2, 3], "completion_ids": [4, 5], "KL_completion_ids": [6], "label": True},
    {"prompt_ids": [7, 8], "completion_ids": [9], "KL_completion_ids": [10, 11, 12], "label": False},
]
_kto_ref = [
    {"prompt_ids": [1, 2], "completion_ids": [3], "KL_completion_ids": [4, 5], "label": True,
     "ref_logps": -1.25, "ref_KL_logps": -2.5},
    {"prompt_ids": [6], "completion_ids": [7, 8], "KL_completion_ids": [9], "label": False,
     "ref_logps": -0.5, "ref_KL_logps": -3.0},
]  # fmt: skip
_kto_int_labels = [
    {"prompt_ids": [1, 2], "completion_ids": [3], "label": 1},
    {"prompt_ids": [4], "completion_ids": [5, 6], "label": 0},
]

_dpo = [
    {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]},
    {"prompt_ids": [7, 8], "chosen_ids": [9], "rejected_ids": [10, 11, 12]},
]
_dpo_ref = [
    {"prompt_ids": [1], "chosen_ids": [2, 3], "rejected_ids": [4], "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.0},
    {"prompt_ids": [5, 6], "chosen_ids": [7], "rejected_ids": [8, 9], "ref_chosen_logps": -0.25, "ref_rejected_logps": -4.0},
]  # fmt: skip

_rm = [{"chosen_ids": [1, 2, 3], "rejected_ids": [4, 5]}, {"chosen_ids": [6, 7], "rejected_ids": [8]}]
_rm_margin = [
    {"chosen_ids": [1, 2, 3], "rejected_ids": [4, 5], "margin": 0.5},
    {"chosen_ids": [6], "rejected_ids": [8, 9, 10, 11], "margin": 0.0},
]

CASES: list[dict[str, Any]] = [
    # DataCollatorForLanguageModeling
    {"name": "lm_default", "collator": LM, "kwargs": {"pad_token_id": 0}, "examples": _plain},
    {"name": "lm_pad_id_99", "collator": LM, "kwargs": {"pad_token_id": 99}, "examples": _plain},
    {"name": "lm_labels", "collator": LM, "kwargs": {"pad_token_id": 0}, "examples": _labelled},
    {"name": "lm_mixed_labels", "collator": LM, "kwargs": {"pad_token_id": 0}, "examples": _mixed_labels},
    {"name": "lm_multiple_of_4", "collator": LM, "kwargs": {"pad_token_id": 0, "pad_to_multiple_of": 4},
     "examples": _plain},
    {"name": "lm_multiple_of_5_exact", "collator": LM, "kwargs": {"pad_token_id": 0, "pad_to_multiple_of": 5},
     "examples": _plain},
    {"name": "lm_return_position_ids", "collator": LM, "kwargs": {"pad_token_id": 0, "return_position_ids": True},
     "examples": _plain},
    {"name": "lm_return_position_ids_multiple", "collator": LM,
     "kwargs": {"pad_token_id": 0, "return_position_ids": True, "pad_to_multiple_of": 4}, "examples": _labelled},
    {"name": "lm_padding_free", "collator": LM, "kwargs": {"pad_token_id": 0, "padding_free": True},
     "examples": _plain},
    {"name": "lm_padding_free_labels", "collator": LM, "kwargs": {"pad_token_id": 0, "padding_free": True},
     "examples": _labelled},
    {"name": "lm_padding_free_multiple", "collator": LM,
     "kwargs": {"pad_token_id": 0, "padding_free": True, "pad_to_multiple_of": 4}, "examples": _plain},
    {"name": "lm_packed", "collator": LM, "kwargs": {"pad_token_id": 0}, "examples": _packed},
    {"name": "lm_packed_position_ids", "collator": LM, "kwargs": {"pad_token_id": 0, "return_position_ids": True},
     "examples": _packed},
    {"name": "lm_packed_padding_free", "collator": LM, "kwargs": {"pad_token_id": 0, "padding_free": True},
     "examples": _packed},
    {"name": "lm_packed_labels_padding_free", "collator": LM, "kwargs": {"pad_token_id": 0, "padding_free": True},
     "examples": _packed_labelled},
    {"name": "lm_packed_padding_free_multiple", "collator": LM,
     "kwargs": {"pad_token_id": 0, "padding_free": True, "pad_to_multiple_of": 8}, "examples": _packed},
    {"name": "lm_masks_ignored", "collator": LM, "kwargs": {"pad_token_id": 0}, "examples": _masks},
    {"name": "lm_positional_padding_free", "collator": LM, "args": [0, True], "examples": _labelled},
    {"name": "lm_positional_all", "collator": LM, "args": [7, False, True, 4], "examples": _plain},
    {"name": "lm_static_position_ids", "collator": LM, "kwargs": {"pad_token_id": 0},
     "method": "get_position_ids_from_packed_seq_lengths", "examples": [[2, 3], [1, 1, 1], [4]]},
    {"name": "lm_static_position_ids_single", "collator": LM, "kwargs": {"pad_token_id": 0},
     "method": "get_position_ids_from_packed_seq_lengths", "examples": [[5]]},
    # DataCollatorForUnpairedPreference (KTO)
    {"name": "kto_default", "collator": KTO, "kwargs": {"pad_token_id": 0}, "examples": _kto},
    {"name": "kto_kl", "collator": KTO, "kwargs": {"pad_token_id": 0}, "examples": _kto_kl},
    {"name": "kto_ref_logps", "collator": KTO, "kwargs": {"pad_token_id": 0}, "examples": _kto_ref},
    {"name": "kto_max_length", "collator": KTO, "kwargs": {"pad_token_id": 0, "max_length": 3}, "examples": _kto_kl},
    {"name": "kto_multiple_of", "collator": KTO, "kwargs": {"pad_token_id": 5, "pad_to_multiple_of": 4},
     "examples": _kto_kl},
    {"name": "kto_int_labels", "collator": KTO, "kwargs": {"pad_token_id": 0}, "examples": _kto_int_labels},
    {"name": "kto_positional", "collator": KTO, "args": [0, 3, 8], "examples": _kto},
    # DataCollatorForPreference (DPO)
    {"name": "dpo_default", "collator": DPO, "kwargs": {"pad_token_id": 0}, "examples": _dpo},
    {"name": "dpo_ref_logps", "collator": DPO, "kwargs": {"pad_token_id": 0}, "examples": _dpo_ref},
    {"name": "dpo_keep_start", "collator": DPO, "kwargs": {"pad_token_id": 0, "max_length": 4}, "examples": _dpo},
    {"name": "dpo_keep_end", "collator": DPO,
     "kwargs": {"pad_token_id": 0, "max_length": 3, "truncation_mode": "keep_end"}, "examples": _dpo},
    {"name": "dpo_multiple_of", "collator": DPO, "kwargs": {"pad_token_id": 3, "pad_to_multiple_of": 4},
     "examples": _dpo},
    {"name": "dpo_positional", "collator": DPO, "args": [0, 4, "keep_end", 8], "examples": _dpo},
    # DataCollatorForPreference (reward modelling)
    {"name": "rm_default", "collator": RM, "kwargs": {"pad_token_id": 0}, "examples": _rm},
    {"name": "rm_margin", "collator": RM, "kwargs": {"pad_token_id": 2}, "examples": _rm_margin},
    {"name": "rm_multiple_of", "collator": RM, "kwargs": {"pad_token_id": 0, "pad_to_multiple_of": 4},
     "examples": _rm},
    {"name": "rm_positional", "collator": RM, "args": [9, 8], "examples": _rm_margin},
]  # fmt: skip


def encode(value: Any) -> Any:
    """A collator output as JSON: tensors keep dtype and shape; lists and dicts are encoded element-wise."""
    if isinstance(value, torch.Tensor):
        return {"__tensor__": True, "dtype": str(value.dtype), "shape": list(value.shape), "values": value.tolist()}
    if isinstance(value, dict):
        return {"__dict__": {k: encode(v) for k, v in value.items()}}  # key order matters: kept as a list of pairs
    if isinstance(value, (list, tuple)):
        return {"__list__": [encode(v) for v in value]}
    return {"__python__": value, "type": type(value).__name__}


def resolve(path: str) -> Any:
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def run(case: dict[str, Any]) -> dict[str, Any]:
    cls = resolve(case["collator"])
    method = case.get("method", "call")
    result = dict(case)
    try:
        if method == "call":
            out = cls(*case.get("args", []), **case.get("kwargs", {}))(case["examples"])
            result["expected"] = {"keys": list(out.keys()), "values": {k: encode(v) for k, v in out.items()}}
        else:
            out = getattr(cls, method)(case["examples"])
            result["expected"] = encode(out)
    except Exception as err:  # the error TRL raises is part of the ground truth
        result["error"] = {"type": type(err).__name__, "message": str(err)}
    return result


def main() -> None:
    cases = [run(case) for case in CASES]
    payload = {
        "trl_version": trl.__version__,
        "torch_version": torch.__version__,
        "generator": "tests/compat/trl_fixtures/generate_collators.py",
        "cases": cases,
    }
    OUT.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {OUT} (trl {trl.__version__})", file=sys.stderr)


if __name__ == "__main__":
    main()
