"""Fixtures for running third-party training scripts: tiny local datasets in each script's format (session-wide)."""

from __future__ import annotations

from pathlib import Path

import pytest
import script_harness as h


@pytest.fixture(scope="session")
def datasets_dir(tmp_path_factory) -> Path:
    """One directory per dataset format, each with ``train`` and ``test`` splits (8 and 4 rows)."""
    root = tmp_path_factory.mktemp("script-datasets")
    kinds = {
        "messages": h.messages_rows,
        "preference": h.preference_rows,
        "unpaired": h.unpaired_preference_rows,
        "triple": h.triple_preference_rows,
        "prompts": h.prompt_rows,
        "stepwise": h.stepwise_rows,
        "problems": h.problem_rows,
        "golden": h.golden_response_rows,
    }
    for name, rows in kinds.items():
        all_rows = rows(12)
        h.write_dataset(root / name, {"train": all_rows[:8], "test": all_rows[8:]})
    return root
