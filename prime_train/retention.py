"""Checkpoint retention and deletion: the only code that deletes checkpoints.

Two rules guard them (the run-directory contract, prime_train/rundir.py): a directory named step-<N>
is always whole, and cleanup never deletes outside the checkpoints directory, through a symlink, or
the newest whole checkpoint. The supervisor's disk watcher, the engine's checkpointer and the bucket's
retention all decide here. A checkpoints directory that is itself a symlink is never cleaned (the link could
lead anywhere), and a step-N.tmp another live process is writing is never deleted.

It also says which directories a command may write over: an install command's venv (`venv_prefix_problem`)
only when it is missing, empty, or one an install made (it holds VENV_MARKER).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from prime_train.contract import process_started_at, read_json, same_process_alive, write_json_atomic
from prime_train.rundir import QUARANTINE_NOTE, QUARANTINE_RE, STEP_RE, TMP_RE, list_checkpoints

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
    p = Path(path)
    if os.path.islink(ckpt_dir):
        raise ValueError(f"refusing to delete {p}: {_linked_dir_reason(ckpt_dir)}")
    root = Path(ckpt_dir).resolve(strict=True)
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
    doomed = root / f"{target.name}.tmp" if STEP_RE.match(target.name) else target
    # a save another live process is making: neither deleted nor moved over (its writer names itself inside)
    writer = None if doomed.is_symlink() or not doomed.is_dir() else tmp_writer(doomed)
    if writer is not None:
        raise ValueError(f"refusing to delete {target}: {doomed.name} is being written by {writer}")
    if STEP_RE.match(target.name):
        # rename first so that a crash half-way through rmtree leaves a step-N.tmp, never a
        # partial step-N that would pass for whole
        if doomed.is_symlink() or doomed.exists():
            safe_remove_checkpoint(doomed, root)
        os.rename(target, doomed)
        target = doomed
    # rmtree unlinks symlinks it meets instead of descending into them
    shutil.rmtree(target)


def _linked_dir_reason(ckpt_dir: str | os.PathLike[str]) -> str:
    try:
        target = os.readlink(ckpt_dir)
    except OSError:
        target = "?"
    return f"{ckpt_dir} is a symbolic link (-> {target}); prime-train deletes nothing through a link"


def apply_retention(
    ckpt_dir: str | os.PathLike[str],
    keep_last: int | None,
    keep_every: int | None,
    protect: frozenset[int] = frozenset(),
) -> list[Path]:
    """Delete whole checkpoints the policy does not keep; return the paths removed.

    A checkpoints directory that is a symlink is left alone, with a warning: nothing is deleted through a link.
    """
    if os.path.islink(ckpt_dir):
        logger.warning("retention skipped: %s", _linked_dir_reason(ckpt_dir))
        return []
    found = list_checkpoints(ckpt_dir)
    doomed = set(select_for_deletion([c.step for c in found], keep_last, keep_every, protect))
    removed: list[Path] = []
    for c in found:
        if c.step not in doomed:
            continue
        try:
            safe_remove_checkpoint(c.path, ckpt_dir)
        except (OSError, ValueError) as e:  # ValueError: refused (a live writer's step-N.tmp is in the way)
            logger.warning("could not delete old checkpoint %s: %s", c.path, e)
            continue
        removed.append(c.path)
    if removed:
        logger.info("retention removed %s", ", ".join(p.name for p in removed))
    return removed


# Who is writing a step-N.tmp: its writer's pid, host and process start time, inside it from the moment it
# appears (claim_tmp builds it under a private name and renames it), so that cleanup can tell a save in
# progress from one a dead process left behind.
TMP_OWNER_FILE = ".writer.json"
_PREP_RE = re.compile(r"^\.step-\d+\.tmp\.(\d+)$")  # claim_tmp's private name: .step-N.tmp.<pid>


def claim_tmp(tmp: str | os.PathLike[str]) -> None:
    """Create the step-N.tmp this process is about to write, with its owner file already inside."""
    tmp = Path(tmp)
    pid = os.getpid()
    prep = tmp.with_name(f".{tmp.name}.{pid}")
    if prep.is_dir() and not prep.is_symlink():
        shutil.rmtree(prep)
    prep.mkdir()
    owner = {"pid": pid, "host": socket.gethostname(), "started_at": process_started_at(pid), "time": time.time()}
    try:
        write_json_atomic(prep / TMP_OWNER_FILE, owner)
        os.rename(prep, tmp)
    except BaseException:
        shutil.rmtree(prep, ignore_errors=True)
        raise


def tmp_writer(tmp: str | os.PathLike[str]) -> str | None:
    """Who is still writing step-N.tmp, in words, or None when nobody is (it is safe to delete).

    Someone is while its owner file names a live process of this host that started when the owner did (a
    recycled pid is not the writer), or a process of another host, which this one cannot see. A step-N.tmp
    without an owner file was left by an older prime-train, or is a checkpoint half way through deletion.
    """
    owner = read_json(Path(tmp) / TMP_OWNER_FILE)
    if owner is None or not isinstance(owner.get("pid"), int):
        return None
    pid, host = owner["pid"], owner.get("host")
    started = owner.get("started_at") if isinstance(owner.get("started_at"), int | float) else None
    if host not in (None, socket.gethostname()):
        return f"pid {pid} on {host} (another machine)"
    if pid != os.getpid() and same_process_alive(pid, started):
        return f"pid {pid}, still running"
    return None


def clean_stale_tmp(ckpt_dir: str | os.PathLike[str]) -> list[Path]:
    """Remove step-N.tmp directories left by a crashed save; one another process is still writing stays.

    This process's own unfinished saves count as stale: call it only while this process is not saving.
    """
    removed: list[Path] = []
    if os.path.islink(ckpt_dir):
        logger.warning("unfinished saves left alone: %s", _linked_dir_reason(ckpt_dir))
        return []
    try:
        entries = list(os.scandir(ckpt_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        prep = _PREP_RE.match(entry.name)
        if prep and entry.is_dir(follow_symlinks=False) and not same_process_alive(int(prep.group(1)), None):
            shutil.rmtree(entry.path, ignore_errors=True)  # a claim_tmp its process did not finish
            continue
        if not TMP_RE.match(entry.name):
            continue
        path = Path(ckpt_dir) / entry.name
        if not entry.is_symlink() and not entry.is_dir(follow_symlinks=False):
            logger.warning("leaving %s alone: a file named like a checkpoint, not a directory", path)
            continue
        writer = None if entry.is_symlink() else tmp_writer(path)
        if writer is not None:
            logger.warning("leaving %s alone: it is being written by %s", path, writer)
            continue
        safe_remove_checkpoint(path, ckpt_dir)
        removed.append(path)
    if removed:
        logger.info("removed incomplete checkpoint(s) from an interrupted save: %s", ", ".join(p.name for p in removed))
    return removed


# ---------------------------------------------------------------- checkpoints that failed verification


def quarantine_checkpoint(path: str | os.PathLike[str], ckpt_dir: str | os.PathLike[str], reason: str) -> Path:
    """Set a checkpoint that failed verification aside: rename step-N to step-N.corrupt (never delete it).

    The new name is neither whole nor unfinished, so nothing resumes from it, retention never counts or
    deletes it, and stale-save cleanup leaves it; `quarantine.json` inside says why, for people and for the
    supervisor (which reports it as an event). Returns the new path.
    """
    root = Path(ckpt_dir).resolve(strict=True)
    p = Path(path)
    m = STEP_RE.match(p.name)
    if not m or p.parent.resolve() != root or p.is_symlink() or not p.is_dir():
        raise ValueError(f"refusing to quarantine {p}: not a step-N directory directly inside {root}")
    dest = root / f"{p.name}.corrupt"
    n = 1
    while dest.exists() or dest.is_symlink():
        n += 1
        dest = root / f"{p.name}.corrupt-{n}"
    note = {"step": int(m.group(1)), "reason": reason, "time": time.time(), "pid": os.getpid(), "from": p.name}
    try:  # the note first: whoever sees the new name (the supervisor's event) finds the reason beside it
        write_json_atomic(root / p.name / QUARANTINE_NOTE, note)
    except OSError as e:  # the rename is what matters; a full disk may refuse the note
        logger.warning("quarantining %s as %s without its note: %s", p.name, dest.name, e)
    os.rename(root / p.name, dest)
    logger.warning("checkpoint %s failed verification (%s); set aside as %s", p.name, reason, dest.name)
    return dest


def list_quarantined(ckpt_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Checkpoints set aside as corrupt, oldest step first: path, step and reason (from their note, if any)."""
    try:
        entries = list(os.scandir(ckpt_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for entry in entries:
        m = QUARANTINE_RE.match(entry.name)
        if not m or not entry.is_dir(follow_symlinks=False):
            continue
        note = read_json(Path(entry.path) / QUARANTINE_NOTE) or {}
        reason = note.get("reason")
        out.append({"path": entry.path, "step": int(m.group(1)), "reason": reason if isinstance(reason, str) else None})
    out.sort(key=lambda q: (q["step"], q["path"]))
    return out


# ---------------------------------------------------------------- `prime-train ckpt list | rm`


def _tree_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes of the files under `path`, links not followed."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):  # never descends into a linked directory
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def checkpoint_inventory(ckpt_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every checkpoint directory in `ckpt_dir`, by step: whole (step-N), partial (step-N.tmp: its writer, if one is
    still writing) and quarantined (step-N.corrupt: why), each with its path, bytes and modification time.

    Symlinks named like checkpoints are listed as links (kind "link"), never followed or measured."""
    try:
        entries = list(os.scandir(ckpt_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: list[dict[str, Any]] = []
    for entry in entries:
        kinds = (("whole", STEP_RE), ("partial", TMP_RE), ("quarantined", QUARANTINE_RE))
        kind, m = next(((k, m) for k, rx in kinds if (m := rx.match(entry.name))), (None, None))
        if kind is None or m is None:
            continue
        row: dict[str, Any] = {"step": int(m.group(1)), "name": entry.name, "path": entry.path, "kind": kind}
        if entry.is_symlink() or not entry.is_dir(follow_symlinks=False):
            row.update(kind="link" if entry.is_symlink() else "file", bytes=None, time=None)
            out.append(row)
            continue
        row.update(bytes=_tree_bytes(entry.path), time=entry.stat(follow_symlinks=False).st_mtime)
        if kind == "partial":
            row["writer"] = tmp_writer(entry.path)
        if kind == "quarantined":
            reason = (read_json(Path(entry.path) / QUARANTINE_NOTE) or {}).get("reason")
            row["reason"] = reason if isinstance(reason, str) else None
        out.append(row)
    out.sort(key=lambda r: (r["step"], r["name"]))
    return out


class RemovalRefused(ValueError):
    """`ckpt rm` will not delete this step (the message says why and what to do)."""


def remove_step(ckpt_dir: str | os.PathLike[str], step: int) -> list[Path]:
    """Delete checkpoint `step` of `ckpt_dir` on a user's request, by the retention rules; the paths removed.

    A whole step-N goes unless it is the newest whole one (a resume starts there); a step-N.tmp goes unless a live
    process is writing it; a quarantined step-N.corrupt is never deleted (it is kept for inspection). Nothing is
    deleted through a link or outside `ckpt_dir` (safe_remove_checkpoint)."""
    if os.path.islink(ckpt_dir):
        raise RemovalRefused(f"refusing to delete step {step}: {_linked_dir_reason(ckpt_dir)}")
    found = checkpoint_inventory(ckpt_dir)
    mine = [r for r in found if r["step"] == step]
    if not mine:
        steps = ", ".join(str(r["step"]) for r in found if r["kind"] == "whole") or "none"
        raise RemovalRefused(f"no checkpoint of step {step} in {ckpt_dir} (whole checkpoints: {steps})")
    whole = [r["step"] for r in found if r["kind"] == "whole"]
    removed: list[Path] = []
    for row in mine:
        if row["kind"] == "quarantined":
            raise RemovalRefused(
                f"refusing to delete {row['path']}: it failed verification ({row.get('reason') or 'no note'}) and is "
                "kept for inspection; prime-train never deletes a quarantined checkpoint, remove it yourself"
            )
        if row["kind"] == "whole" and step == max(whole):
            raise RemovalRefused(
                f"refusing to delete {row['path']}: it is the newest whole checkpoint, the one a resume starts from"
            )
        if row["kind"] in ("file", "link"):
            what = "a symbolic link" if row["kind"] == "link" else "a file"
            raise RemovalRefused(f"refusing to delete {row['path']}: {what}, not a checkpoint prime-train wrote")
        safe_remove_checkpoint(row["path"], ckpt_dir)  # links unlinked, never followed; a live writer's .tmp refused
        removed.append(Path(row["path"]))
    return removed


# ---------------------------------------------------------------- venvs an install command made

# written into every venv `prime-train inference install` or `spot install` creates: the one thing that lets a
# later install update (pip install into) a directory that already holds something
VENV_MARKER = ".prime-train-venv.json"


def venv_prefix_problem(prefix: str | os.PathLike[str], *, managed: bool) -> str | None:
    """Why an install command must not make or update a venv at `prefix`, in words; None when it may.

    It may when `prefix` does not exist, is an empty directory, or is a venv an install made (it holds
    VENV_MARKER); `managed` (prime-train's own default place, where releases before the marker made their
    venvs) also allows any venv there. Anything else (a directory of the user's, a venv someone else made, a
    file) is never written into: `python -m venv` and pip would write over what is in it.
    """
    prefix = Path(prefix)
    if not os.path.lexists(prefix):
        return None
    if not prefix.is_dir():
        return f"{prefix} exists and is not a directory"
    try:
        empty = next(os.scandir(prefix), None) is None
    except OSError as exc:
        return f"{prefix} cannot be read ({exc.strerror or exc})"
    if empty or (prefix / VENV_MARKER).is_file():
        return None
    if managed and (prefix / "pyvenv.cfg").is_file():
        return None
    what = "a venv prime-train did not make" if (prefix / "pyvenv.cfg").is_file() else "not a venv"
    return f"{prefix} is {what} (it has no {VENV_MARKER}), and installing would write over what it holds"


def mark_venv(prefix: str | os.PathLike[str], what: str) -> None:
    """Record in `prefix` that an install command made this venv (`what`: 'vllm', 'skypilot')."""
    write_json_atomic(Path(prefix) / VENV_MARKER, {"made_by": "prime-train", "for": what, "time": time.time()})


def newest_external_checkpoint(directory: Path, pattern: str) -> tuple[int, Path] | None:
    """The highest-step entry of an external job's checkpoint directory whose name matches `pattern` (group 1:
    the step); entries ending in .tmp are unfinished saves and never count."""
    if not directory.is_dir():
        return None
    regex = re.compile(pattern)
    best: tuple[int, Path] | None = None
    for entry in directory.iterdir():
        m = regex.search(entry.name)
        if not m or entry.name.endswith(".tmp"):
            continue
        try:
            step = int(m.group(1))
        except (IndexError, ValueError):
            continue
        if best is None or step > best[0]:
            best = (step, entry)
    return best
