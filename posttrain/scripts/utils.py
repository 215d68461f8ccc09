"""TRL's ``trl.scripts.utils``: ``TrlParser``, ``ScriptArguments``, ``DatasetConfig``, ``DatasetMixtureConfig``,
``get_dataset`` (from :mod:`posttrain.cli` and :mod:`posttrain.data.loading`), ``init_zero_verbose`` and
``get_git_commit_hash``."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import warnings

from posttrain.cli.configs import ScriptArguments
from posttrain.cli.parser import TrlParser
from posttrain.data.loading import DatasetConfig, DatasetMixtureConfig, get_dataset

__all__ = [
    "DatasetConfig",
    "DatasetMixtureConfig",
    "ScriptArguments",
    "TrlParser",
    "get_dataset",
    "get_git_commit_hash",
    "init_zero_verbose",
]


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


def get_git_commit_hash(package_name: str) -> str | None:
    """The git commit of a package imported from a source checkout (TRL's helper, used by ``trl env``).

    Imports ``package_name``; when the folder above it holds a ``.git`` directory, returns ``git rev-parse HEAD``
    there, else None (an installed wheel). As TRL's, it never raises: a failure (the package cannot be imported,
    git is missing) comes back as the string ``"Error: <reason>"``.
    """
    try:
        package = importlib.import_module(package_name)
        repo = os.path.abspath(os.path.join(os.path.dirname(package.__file__), ".."))
        if not os.path.isdir(os.path.join(repo, ".git")):
            return None
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=repo).strip().decode("utf-8")
    except Exception as err:  # TRL's contract: report, don't raise
        return f"Error: {err}"
