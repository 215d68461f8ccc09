"""TRL's ``trl.scripts.utils``: ``TrlParser``, ``ScriptArguments``, ``DatasetConfig``, ``DatasetMixtureConfig``,
``get_dataset`` (from :mod:`posttrain.cli` and :mod:`posttrain.data.loading`) and ``init_zero_verbose``."""

from __future__ import annotations

import logging
import warnings

from posttrain.cli.configs import ScriptArguments
from posttrain.cli.parser import TrlParser
from posttrain.data.loading import DatasetConfig, DatasetMixtureConfig, get_dataset

__all__ = ["DatasetConfig", "DatasetMixtureConfig", "ScriptArguments", "TrlParser", "get_dataset", "init_zero_verbose"]


def init_zero_verbose() -> None:
    """Quiet logging for scripts (TRL's): the root logger shows errors only, as bare messages (through rich when it
    is installed), and Python warnings are routed to logging as ``file:line: Category: message`` lines.

    Call it at the top of a script, before the heavy imports, as TRL's examples do.
    """
    try:
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler()
    except ImportError:
        handler = logging.StreamHandler()
    logging.basicConfig(format="%(message)s", datefmt="[%X]", handlers=[handler], level=logging.ERROR)

    def warning_handler(message, category, filename, lineno, file=None, line=None):
        logging.warning(f"{filename}:{lineno}: {category.__name__}: {message}")

    warnings.showwarning = warning_handler
