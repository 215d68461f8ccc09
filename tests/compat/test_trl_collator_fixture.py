"""posttrain's public collators give TRL 1.16's output, key for key and tensor for tensor (dtype, shape, values).

Ground truth: ``trl_fixtures/trl_1_16_collators.json``, produced by TRL 1.16 itself with
``trl_fixtures/generate_collators.py`` (see its docstring to regenerate). This test never imports ``trl``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

FIXTURE = json.loads((Path(__file__).parent / "trl_fixtures" / "trl_1_16_collators.json").read_text())
CASES = FIXTURE["cases"]


def _resolve(trl_path: str) -> Any:
    module, name = ("posttrain" + trl_path[len("trl") :]).rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _assert_equal(actual: Any, expected: dict[str, Any], where: str) -> None:
    if expected.get("__tensor__"):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert str(actual.dtype) == expected["dtype"], f"{where}: dtype {actual.dtype} != {expected['dtype']}"
        assert list(actual.shape) == expected["shape"], f"{where}: shape {list(actual.shape)} != {expected['shape']}"
        assert actual.tolist() == expected["values"], f"{where}: {actual.tolist()} != {expected['values']}"
    elif "__list__" in expected:
        assert isinstance(actual, (list, tuple)), f"{where}: expected a list, got {type(actual).__name__}"
        assert len(actual) == len(expected["__list__"]), f"{where}: length {len(actual)}"
        for i, (a, e) in enumerate(zip(actual, expected["__list__"])):
            _assert_equal(a, e, f"{where}[{i}]")
    else:
        assert type(actual).__name__ == expected["type"], f"{where}: type {type(actual).__name__}"
        assert actual == expected["__python__"], f"{where}: {actual!r} != {expected['__python__']!r}"


def test_fixture_comes_from_trl_1_16():
    assert FIXTURE["trl_version"] == "1.16.0"
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_collator_matches_trl(case):
    cls = _resolve(case["collator"])
    method = case.get("method", "call")
    if "error" in case:
        with pytest.raises(Exception) as info:
            cls(*case.get("args", []), **case.get("kwargs", {}))(case["examples"])
        assert type(info.value).__name__ == case["error"]["type"]
        assert str(info.value).startswith(case["error"]["message"])
        return
    if method == "call":
        out = cls(*case.get("args", []), **case.get("kwargs", {}))(case["examples"])
        assert list(out.keys()) == case["expected"]["keys"]
        for key, expected in case["expected"]["values"].items():
            _assert_equal(out[key], expected, f"{case['name']}[{key!r}]")
    else:
        _assert_equal(getattr(cls, method)(case["examples"]), case["expected"], case["name"])
