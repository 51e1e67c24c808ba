"""Checkpoint retention and deletion: the only code that deletes checkpoints.

Two rules guard them (the run-directory contract, prime_train/contract.py): a directory named step-<N>
is always whole, and cleanup never deletes outside the checkpoints directory, through a symlink, or
the newest whole checkpoint. The supervisor's disk watcher, the engine's checkpointer and the bucket's
retention all decide here.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from prime_train.contract import STEP_RE, TMP_RE, list_checkpoints

logger = logging.getLogger("prime_train.retention")


def select_for_deletion(
    steps: list[int],
    keep_last: int | None,
    keep_every: int | None,
    protect: frozenset[int] = frozenset(),
) -> list[int]:
    """Steps the retention policy deletes, oldest first; the newest step is never among them."""
    if keep_last is not None and keep_last < 0:
        raise ValueError(f"ckpt.keep_last must be >= 1 or unset, got {keep_last}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"ckpt.keep_every must be >= 1 or unset, got {keep_every}")
    ordered = sorted(set(steps))
    if not ordered or keep_last is None:
        return []
    keep = set(protect)
    keep.add(ordered[-1])
    if keep_last > 0:
        keep.update(ordered[-keep_last:])
    if keep_every is not None:
        keep.update(s for s in ordered if s % keep_every == 0)
    return [s for s in ordered if s not in keep]


def _checkpoint_name_ok(name: str) -> bool:
    return bool(STEP_RE.match(name) or TMP_RE.match(name))


def safe_remove_checkpoint(path: str | os.PathLike[str], ckpt_dir: str | os.PathLike[str]) -> None:
    """Delete one step-N (or step-N.tmp) directory directly inside `ckpt_dir`; refuse anything else.

    A symlink is unlinked, never followed; symlinks inside the checkpoint are removed as links.
    A missing path is not an error (the supervisor and the trainer may both clean up).
    """
    root = Path(ckpt_dir).resolve(strict=True)
    p = Path(path)
    if not _checkpoint_name_ok(p.name):
        raise ValueError(f"refusing to delete {p}: not named step-N or step-N.tmp")
    # resolve the parent, never the path itself: a symlink named step-N must not lead us elsewhere
    if p.parent.resolve() != root:
        raise ValueError(f"refusing to delete {p}: it is not directly inside the checkpoint directory {root}")
    target = root / p.name
    if target.is_symlink():
        target.unlink()
        return
    if not target.exists():
        return
    if not target.is_dir():
        raise ValueError(f"refusing to delete {target}: a file, not a checkpoint directory")
    if STEP_RE.match(target.name):
        # rename first so that a crash half-way through rmtree leaves a step-N.tmp, never a
        # partial step-N that would pass for whole
        doomed = root / f"{target.name}.tmp"
        if doomed.is_symlink() or doomed.exists():
            safe_remove_checkpoint(doomed, root)
        os.rename(target, doomed)
        target = doomed
    # rmtree unlinks symlinks it meets instead of descending into them
    shutil.rmtree(target)


def apply_retention(
    ckpt_dir: str | os.PathLike[str],
    keep_last: int | None,
    keep_every: int | None,
    protect: frozenset[int] = frozenset(),
) -> list[Path]:
    """Delete whole checkpoints the policy does not keep; return the paths removed."""
    found = list_checkpoints(ckpt_dir)
    doomed = set(select_for_deletion([c.step for c in found], keep_last, keep_every, protect))
    removed: list[Path] = []
    for c in found:
        if c.step not in doomed:
            continue
        try:
            safe_remove_checkpoint(c.path, ckpt_dir)
        except OSError as e:
            logger.warning("could not delete old checkpoint %s: %s", c.path, e)
            continue
        removed.append(c.path)
    if removed:
        logger.info("retention removed %s", ", ".join(p.name for p in removed))
    return removed


def clean_stale_tmp(ckpt_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove step-N.tmp directories left by a crashed save; call it only while no save is running."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(ckpt_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        if not TMP_RE.match(entry.name):
            continue
        path = Path(ckpt_dir) / entry.name
        if not entry.is_symlink() and not entry.is_dir(follow_symlinks=False):
            logger.warning("leaving %s alone: a file named like a checkpoint, not a directory", path)
            continue
        safe_remove_checkpoint(path, ckpt_dir)
        removed.append(path)
    if removed:
        logger.info("removed incomplete checkpoint(s) from an interrupted save: %s", ", ".join(p.name for p in removed))
    return removed
