"""Harbor task directories: reading, checking and finding them.

A Harbor task is a directory::

    <task>/
    ├── instruction.md     # the task prompt the agent sees
    ├── task.toml          # [metadata], [verifier] (timeout_sec, env), [agent] (timeout_sec), [environment]
    ├── environment/       # the sandbox's build context (a Dockerfile and the files it copies)
    ├── solution/solve.sh  # optional reference solution (Harbor's "oracle" agent)
    └── tests/test.sh      # the verifier: writes /logs/verifier/reward.txt (a float) or reward.json (an object)

A suite is a directory of such tasks (or a directory with a ``tasks/`` subtree), ordered by directory name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTRUCTION = "instruction.md"
CONFIG = "task.toml"
TEST_SCRIPT = Path("tests") / "test.sh"

# Metadata keys TRL folds into the dataset rows (``[metadata]`` of task.toml), as (column, task.toml key).
METADATA_COLUMNS = (
    ("gold_answer", "gold_answer"),
    ("reward_mode", "reward_mode_initial"),
    ("difficulty_level", "difficulty_level"),
    ("kaggle_dataset", "kaggle_dataset_name"),
)


def _toml() -> Any:
    """The TOML reader: ``tomllib`` (Python >= 3.11) or the ``tomli`` backport."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError as e:
            raise ImportError("Reading Harbor task.toml files on Python 3.10 needs `pip install tomli`.") from e
    return tomllib


class HarborTaskError(ValueError):
    """A Harbor task directory is malformed, or asks for what the chosen sandbox cannot give (the message names
    the task and the fix)."""


@dataclass(frozen=True)
class HarborTask:
    """One parsed Harbor task.

    Attributes:
        path: The task directory (resolved).
        instruction: ``instruction.md``'s text.
        config: ``task.toml`` parsed.
    """

    path: Path
    instruction: str
    config: dict[str, Any] = field(repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def environment_dir(self) -> Path:
        return self.path / "environment"

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def metadata(self) -> dict[str, Any]:
        return dict(self.config.get("metadata") or {})

    def _section(self, name: str) -> dict[str, Any]:
        return dict(self.config.get(name) or {})

    @property
    def verifier_timeout_s(self) -> float | None:
        return self._section("verifier").get("timeout_sec")

    @property
    def agent_timeout_s(self) -> float | None:
        return self._section("agent").get("timeout_sec")

    @property
    def verifier_env(self) -> dict[str, str]:
        return dict(self._section("verifier").get("env") or {})

    @property
    def environment(self) -> dict[str, Any]:
        return self._section("environment")


def _fail(path: Path, what: str) -> HarborTaskError:
    return HarborTaskError(f"Harbor task {path.name!r} ({path}): {what}")


def load_task(task_dir: str | Path) -> HarborTask:
    """Read and check one task directory.

    Raises:
        HarborTaskError: the directory, ``instruction.md``, ``task.toml`` or ``tests/test.sh`` is missing or
            malformed (the message names the task and the file).
    """
    path = Path(task_dir).resolve()
    if not path.is_dir():
        raise _fail(path, "is not a directory.")
    instruction_path = path / INSTRUCTION
    if not instruction_path.is_file():
        raise _fail(path, f"has no {INSTRUCTION} (the task prompt); every Harbor task needs one.")
    try:
        instruction = instruction_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"{INSTRUCTION} is not UTF-8 text ({e}).") from e
    if not instruction.strip():
        raise _fail(path, f"{INSTRUCTION} is empty; write the task prompt in it.")
    config_path = path / CONFIG
    if not config_path.is_file():
        raise _fail(path, f'has no {CONFIG}; add one (at least `version = "1.0"`).')
    tomllib = _toml()
    try:
        config = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise _fail(path, f"{CONFIG} is not valid TOML: {e}.") from e
    for section in ("metadata", "verifier", "agent", "environment"):
        if section in config and not isinstance(config[section], dict):
            raise _fail(path, f"[{section}] in {CONFIG} must be a table, got {type(config[section]).__name__}.")
    for section in ("verifier", "agent"):
        timeout = (config.get(section) or {}).get("timeout_sec")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout)
            or timeout <= 0
        ):  # fmt: skip
            raise _fail(path, f"[{section}] timeout_sec in {CONFIG} must be a positive number, got {timeout!r}.")
    env = (config.get("verifier") or {}).get("env") or {}
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise _fail(path, f"[verifier] env in {CONFIG} must map names to strings, got {env!r}.")
    if not (path / TEST_SCRIPT).is_file():
        raise _fail(path, f"has no {TEST_SCRIPT} (the verifier that writes /logs/verifier/reward.txt).")
    return HarborTask(path, instruction, config)


def find_task_dirs(root: str | Path) -> list[Path]:
    """The task directories of a local suite, sorted by name.

    ``root`` may hold a ``tasks/`` subtree (TRL's layout), hold the task directories directly, or be one task.

    Raises:
        HarborTaskError: ``root`` is not a directory or holds no task (no ``*/task.toml``).
    """
    root = Path(root)
    if not root.is_dir():
        raise HarborTaskError(f"Harbor dataset {str(root)!r} is not a directory.")
    base = root / "tasks" if (root / "tasks").is_dir() else root
    dirs = sorted((p.parent for p in base.glob(f"*/{CONFIG}")), key=lambda p: p.name)
    if not dirs and (root / CONFIG).is_file():
        dirs = [root]
    if not dirs:
        raise HarborTaskError(
            f"No Harbor tasks under {str(root)!r}: expected directories holding {CONFIG} (directly or under tasks/)."
        )
    return dirs


def metadata_row(task_dir: Path) -> dict[str, Any]:
    """TRL's per-task metadata columns, from ``[metadata]`` of ``task.toml`` (``None`` when absent/unreadable)."""
    tomllib = _toml()
    try:
        meta = tomllib.loads((task_dir / CONFIG).read_text(encoding="utf-8")).get("metadata") or {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        meta = {}
    return {column: meta.get(key) for column, key in METADATA_COLUMNS}
