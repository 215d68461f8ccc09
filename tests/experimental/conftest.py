"""The experimental trainers' tests reuse the stable trainers' helpers (tests/trainers/trainer_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

_TRAINERS = str(Path(__file__).resolve().parents[1] / "trainers")
if _TRAINERS not in sys.path:
    sys.path.insert(0, _TRAINERS)

from distill_helpers import abc_teacher_path, merged_teacher_path  # noqa: E402, F401  (distillation-family teachers)
