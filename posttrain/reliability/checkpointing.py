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
        if file_problem(os.path.join(found, TRAINER_STATE_FILE)):
            raise corrupt_checkpoint_error(found, "trainer state")
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
    if file_problem(os.path.join(path, TRAINER_STATE_FILE)):
        raise corrupt_checkpoint_error(path, "trainer state")
    return path


# -- corrupt checkpoints on resume ------------------------------------------------------------------------------

# What each resume stage reads from a checkpoint folder (glob patterns).
RESUME_FILES: dict[str, tuple[str, ...]] = {
    "model": ("*.safetensors", "pytorch_model*.bin", "adapter_model.bin", "*.safetensors.index.json"),
    "optimizer and scheduler": ("optimizer.pt", "optimizer.bin", "scheduler.pt"),
    "RNG state": ("rng_state*.pth",),
    "gradient scaler": ("scaler.pt",),
    "posttrain resume state": ("posttrain_state_*.pt",),
    "trainer state": (TRAINER_STATE_FILE,),
}


class CorruptCheckpointError(RuntimeError):
    """A checkpoint chosen for resume cannot be read: the message names the folder, the file and what to do."""


def file_problem(path: str) -> str | None:
    """Why ``path`` is unreadable as a checkpoint file (truncated, not valid JSON / safetensors / torch zip), or
    None when it looks intact. Checks structure and CRCs only; nothing is deserialised."""
    import json
    import struct
    import zipfile

    try:
        size = os.path.getsize(path)
        if size == 0:
            return "it is empty (0 bytes)"
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                json.load(f)
            return None
        if path.endswith(".safetensors"):
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                if 8 + header_len > size:
                    return "its safetensors header is cut off (the file is truncated)"
                header = json.loads(f.read(header_len))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if size < 8 + header_len + end:
                return f"it is truncated ({size} bytes, its header describes {8 + header_len + end})"
            return None
        if path.endswith((".pt", ".pth", ".bin")):
            if not zipfile.is_zipfile(path):
                return "it is not a valid torch.save archive (truncated or overwritten)"
            with zipfile.ZipFile(path) as archive:
                bad = archive.testzip()
            return f"its entry {bad!r} fails its checksum" if bad else None
    except (OSError, ValueError, KeyError, TypeError, struct.error, zipfile.BadZipFile) as err:
        return f"it cannot be read ({type(err).__name__}: {err})"
    return None


def previous_checkpoint(checkpoint: str) -> str | None:
    """The newest complete checkpoint in the same folder with a smaller step than ``checkpoint``."""
    step = checkpoint_step(checkpoint)
    if step is None:
        return None
    older = [p for p in sorted_checkpoints(os.path.dirname(os.path.abspath(checkpoint))) if checkpoint_step(p) < step]
    return older[-1] if older else None


def stage_files(checkpoint: str, stage: str) -> list[str]:
    """The files of ``checkpoint`` that the resume ``stage`` reads (see ``RESUME_FILES``)."""
    import glob

    return sorted({p for pattern in RESUME_FILES.get(stage, ()) for p in glob.glob(os.path.join(checkpoint, pattern))})


def damaged_files(checkpoint: str, stage: str) -> list[tuple[str, str]]:
    """``(file name, problem)`` for each file of ``stage`` in ``checkpoint`` that :func:`file_problem` rejects."""
    return [(os.path.basename(p), problem) for p in stage_files(checkpoint, stage) if (problem := file_problem(p))]


def corrupt_checkpoint_error(checkpoint: str, stage: str, err: BaseException | None = None) -> CorruptCheckpointError:
    """The error for a checkpoint whose ``stage`` files failed to load: which files are damaged and why (found by
    :func:`file_problem`), and the checkpoint to resume from instead."""
    files = stage_files(checkpoint, stage)
    damaged = damaged_files(checkpoint, stage)
    if damaged:
        what = "; ".join(f"{name}: {problem}" for name, problem in damaged)
    else:
        names = ", ".join(os.path.basename(p) for p in files) or "its files"
        what = f"loading the {stage} ({names}) failed with {type(err).__name__}: {err}"
    previous = previous_checkpoint(checkpoint)
    advice = (
        f"Resume from the previous checkpoint instead: resume_from_checkpoint={previous!r} (and delete or move "
        f"{os.path.basename(os.path.normpath(checkpoint))!r} so that resume_from_checkpoint=True does not pick it)."
        if previous
        else "There is no earlier complete checkpoint in that folder: start from scratch (resume_from_checkpoint=None)"
        " or restore the damaged file from a copy."
    )
    return CorruptCheckpointError(f"Checkpoint {checkpoint!r} is damaged: {what}. {advice}")
