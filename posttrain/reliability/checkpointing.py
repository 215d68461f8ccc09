"""Crash-safe checkpoint folders: staged writes, atomic publication, discovery and rotation.

A checkpoint is written into a temporary sibling ``tmp-checkpoint-N`` (model, optimizer, scheduler, RNG states,
posttrain's resume state, and ``trainer_state.json`` last), its files are flushed to disk, and only then is the
folder renamed to ``checkpoint-N``. A rename within one directory is atomic on POSIX file systems, so a process
killed at any moment leaves either no ``checkpoint-N`` or a complete one; the previous checkpoints are untouched.

Discovery (``get_last_checkpoint``) only returns ``checkpoint-N`` folders that hold ``trainer_state.json`` (so it also
skips half-written folders left by tools without staging) and never ``tmp-*`` folders. Rotation
(``rotate_checkpoints``) orders by step number and never deletes the checkpoint just written nor the best one.
"""

from __future__ import annotations

import os
import re
import shutil

CHECKPOINT_PREFIX = "checkpoint"
TMP_PREFIX = "tmp-"
TRAINER_STATE_FILE = "trainer_state.json"
_CHECKPOINT_RE = re.compile(rf"^{CHECKPOINT_PREFIX}-(\d+)$")


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step N of a ``checkpoint-N`` folder name (None for any other name, including ``tmp-checkpoint-N``)."""
    match = _CHECKPOINT_RE.match(os.path.basename(os.path.normpath(str(path))))
    return int(match.group(1)) if match else None


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """True for a ``checkpoint-N`` folder that holds ``trainer_state.json`` (written last, so the rest is there)."""
    path = str(path)
    return (
        checkpoint_step(path) is not None
        and os.path.isdir(path)
        and os.path.isfile(os.path.join(path, TRAINER_STATE_FILE))
    )


def sorted_checkpoints(folder: str | os.PathLike) -> list[str]:
    """Complete ``checkpoint-N`` folders in ``folder``, oldest (smallest N) first."""
    folder = str(folder)
    if not os.path.isdir(folder):
        return []
    found = [(checkpoint_step(name), os.path.join(folder, name)) for name in os.listdir(folder)]
    return [path for step, path in sorted((s, p) for s, p in found if s is not None) if is_complete_checkpoint(path)]


def get_last_checkpoint(folder: str | os.PathLike) -> str | None:
    """The complete checkpoint with the highest step in ``folder``; None when there is none.

    Unlike ``transformers.trainer_utils.get_last_checkpoint`` this skips folders without ``trainer_state.json``
    (a crash mid-write with another tool) and, like it, ignores ``tmp-checkpoint-N`` staging folders.
    """
    checkpoints = sorted_checkpoints(folder)
    return checkpoints[-1] if checkpoints else None


def staging_dir(final_dir: str) -> str:
    """``.../tmp-checkpoint-N`` for ``.../checkpoint-N``."""
    parent, name = os.path.split(os.path.normpath(final_dir))
    return os.path.join(parent, TMP_PREFIX + name)


def remove_stale_staging(folder: str | os.PathLike) -> list[str]:
    """Delete ``tmp-checkpoint-*`` folders left by a crashed save; returns what was removed."""
    folder = str(folder)
    removed = []
    if os.path.isdir(folder):
        for name in os.listdir(folder):
            path = os.path.join(folder, name)
            if name.startswith(TMP_PREFIX + CHECKPOINT_PREFIX + "-") and os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    return removed


def _fsync_tree(root: str) -> None:
    """Flush every file and folder under ``root`` to disk, so a power loss cannot publish empty files."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic there
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish_checkpoint(tmp_dir: str, final_dir: str) -> None:
    """Flush ``tmp_dir`` to disk and rename it to ``final_dir`` (atomically when ``final_dir`` does not exist).

    If ``final_dir`` already exists (the run resumed from an earlier step and reached N again), the old folder is
    first renamed aside to ``tmp-old-checkpoint-N`` and deleted after the new one is in place, so at every moment
    either the old or the new complete ``checkpoint-N`` (or, for an instant, neither) exists - never a mix.
    """
    _fsync_tree(tmp_dir)
    parent = os.path.dirname(os.path.normpath(final_dir))
    old = None
    if os.path.exists(final_dir):
        old = os.path.join(parent, TMP_PREFIX + "old-" + os.path.basename(os.path.normpath(final_dir)))
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    _fsync_dir(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def rotate_checkpoints(
    folder: str | os.PathLike, save_total_limit: int | None, keep: tuple[str | None, ...] = ()
) -> list[str]:
    """Delete the oldest complete checkpoints until at most ``save_total_limit`` remain.

    Checkpoints are ordered by step number (not mtime, which renames and copies do not preserve reliably). The
    newest complete checkpoint and every folder in ``keep`` (the one just written, the best one) are never deleted,
    even if that leaves more than ``save_total_limit``. Returns the deleted folders.
    """
    if not save_total_limit or save_total_limit <= 0:
        return []
    checkpoints = sorted_checkpoints(folder)
    protected = {os.path.normpath(p) for p in keep if p}
    if checkpoints:
        protected.add(os.path.normpath(checkpoints[-1]))
    deleted = []
    remaining = len(checkpoints)
    for path in checkpoints:
        if remaining <= save_total_limit:
            break
        if os.path.normpath(path) in protected:
            continue
        # Rename first so a crash mid-delete never leaves a partial folder that still looks like a checkpoint.
        doomed = staging_dir(path)
        shutil.rmtree(doomed, ignore_errors=True)
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        deleted.append(path)
        remaining -= 1
    return deleted


def resolve_resume_checkpoint(resume_from_checkpoint: str | bool | None, output_dir: str) -> str | None:
    """Turn ``train(resume_from_checkpoint=...)`` into a checkpoint folder, or raise a ValueError saying what to do.

    ``True`` picks the newest complete ``checkpoint-N`` in ``output_dir``; a path must be a complete checkpoint
    folder (not a ``tmp-*`` staging folder, which is what a crash mid-save leaves behind).
    """
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        return None
    if resume_from_checkpoint is True:
        found = get_last_checkpoint(output_dir)
        if found is None:
            raise ValueError(
                f"resume_from_checkpoint=True but output_dir {output_dir!r} holds no complete checkpoint-N folder. "
                "Pass the path of a checkpoint folder, or resume_from_checkpoint=None to start from scratch."
            )
        return found
    path = os.fspath(resume_from_checkpoint)
    if not os.path.isdir(path):
        raise ValueError(
            f"resume_from_checkpoint={path!r} is not a folder. Pass a checkpoint-N folder written by a previous "
            "run, or True to pick the newest one in output_dir."
        )
    if os.path.basename(os.path.normpath(path)).startswith(TMP_PREFIX):
        raise ValueError(
            f"resume_from_checkpoint={path!r} is an unfinished staging folder left by an interrupted save. Resume "
            "from the newest complete checkpoint-N folder instead (resume_from_checkpoint=True finds it)."
        )
    if not os.path.isfile(os.path.join(path, TRAINER_STATE_FILE)):
        raise ValueError(
            f"resume_from_checkpoint={path!r} has no {TRAINER_STATE_FILE}, so it is not a complete training "
            "checkpoint (a final model folder cannot be resumed). Pick a checkpoint-N folder, or load it as the "
            "model to start a new run from its weights."
        )
    return path
