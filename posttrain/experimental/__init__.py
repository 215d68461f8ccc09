"""Trainers that are not stable yet (TRL's ``trl.experimental``): APIs may change or be removed.

Importing this package warns once with ``TRLExperimentalWarning`` unless ``TRL_EXPERIMENTAL_SILENCE`` is set (as TRL).
"""

from __future__ import annotations

import os
import warnings


class TRLExperimentalWarning(UserWarning):
    """Emitted when ``posttrain.experimental`` is imported (silence with ``TRL_EXPERIMENTAL_SILENCE=1``)."""


if not os.environ.get("TRL_EXPERIMENTAL_SILENCE"):
    warnings.warn(
        "You are importing from 'posttrain.experimental'. APIs here may change or be removed without notice. "
        "Set TRL_EXPERIMENTAL_SILENCE=1 to silence this warning.",
        TRLExperimentalWarning,
        stacklevel=2,
    )
