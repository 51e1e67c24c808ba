"""One owner per run directory: its lock, the record of its job's processes, and ending an orphaned job.

The process that runs a job in a run directory (`prime-train run`'s supervisor, or `prime-train train`)
holds <run>/.lock for its whole life (rundir.RunLock; the kernel releases it however the process
dies). A second one is refused, naming the holder. Holding the lock also proves that no owner is alive,
so whatever the last owner's job left running is an orphan: the owner records its job's processes in
<run>/processes.json (pid, process group, create time), and the next owner ends those still alive
before it launches anything. A pid is trusted only together with its create time (psutil), so a
process that later got a recycled pid is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import psutil

from prime_train.contract import Event, UnsafeLink, read_json, write_json_atomic
from prime_train.kit.events import EventLog
from prime_train.retention import clean_stale_tmp, list_quarantined
from prime_train.rundir import RunDir, RunDirUnsafe, RunLock, list_checkpoints


def claim_run_dir(run_dir: RunDir, command: str) -> RunLock:
    """Lock the run directory for this process (rundir.RunDirBusy, naming the holder, when another has it).

    First, before anything is written: rundir.RunDirUnsafe (a RunDirBusy: exit 78), naming them, when the run
    directory holds symlinks where prime-train writes (RunDir.unsafe_links: config.toml, .lock, events.jsonl, ...,
    or logs/, tensorboard/, checkpoints/, ... leading out of it). Every writer refuses a link on its own as well
    (O_NOFOLLOW, atomic replace), so one planted later is not followed either.
    """
    links = run_dir.unsafe_links()
    if links:
        raise RunDirUnsafe(run_dir, links)
    try:
        return RunLock.acquire(run_dir, command)
    except UnsafeLink:  # .lock became a link since the look above
        raise RunDirUnsafe(run_dir, run_dir.unsafe_links() or [".lock -> ?"]) from None


def supervisor_token() -> str:
    """This process as PRIME_TRAIN_SUPERVISOR names it for its job: "<pid>:<create time>"."""
    return f"{os.getpid()}:{psutil.Process().create_time()!r}"


def _describe(proc: psutil.Process) -> dict[str, Any] | None:
    try:
        with proc.oneshot():
            return {"pid": proc.pid, "create_time": proc.create_time(), "pgid": os.getpgid(proc.pid)}
    except (psutil.Error, OSError):
        return None  # already gone: nothing to record


def record_processes(run_dir: RunDir, named: dict[str, Iterable[psutil.Process]]) -> bool:
    """Write processes.json: every process of the job, by the child it belongs to; False when it could not be
    written (a full disk: the record is then as old as the last write, which only makes the next owner look
    for processes that are gone)."""
    entries = []
    for name, procs in named.items():
        for proc in procs:
            described = _describe(proc)
            if described is not None:
                entries.append({"name": name, **described})
    try:
        write_json_atomic(run_dir.processes_path, {"owner_pid": os.getpid(), "processes": entries})
    except OSError:
        return False
    return True


def record_state(run_dir: RunDir, state: dict[str, Any]) -> bool:
    """Write supervisor.json (`prime-train status` reads it); False when it could not be written: a full disk is not
    the supervisor's death, it keeps the state in memory and writes it again later."""
    try:
        write_json_atomic(run_dir.supervisor_path, state)
    except OSError:
        return False
    return True


def _recorded_alive(run_dir: RunDir) -> list[tuple[str, psutil.Process]]:
    """The recorded processes still alive as themselves (same pid and create time), with their descendants."""
    record = read_json(run_dir.processes_path) or {}
    entries = record.get("processes")
    found: dict[int, tuple[str, psutil.Process]] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("pid"), int) or entry["pid"] <= 1:
            continue
        created = entry.get("create_time")
        try:
            proc = psutil.Process(entry["pid"])
            if not isinstance(created, int | float) or abs(proc.create_time() - created) >= 1.0:
                continue  # the pid was recycled: someone else's process now
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            name = str(entry.get("name", "?"))
            found.setdefault(proc.pid, (name, proc))
            for child in proc.children(recursive=True):  # started after the last record (a rank, a loader worker)
                found.setdefault(child.pid, (name, child))
        except psutil.Error:
            continue
    return list(found.values())


def end_orphans(run_dir: RunDir, grace_s: float) -> list[dict[str, Any]]:
    """End what the previous owner of the run directory left running: SIGTERM (the trainer checkpoints and
    exits 75), then SIGKILL after `grace_s`. Call it only while holding the run's lock. Returns what was
    found, for the event log: name, pid, command line, and whether it needed SIGKILL."""
    alive = _recorded_alive(run_dir)
    if not alive:
        return []
    report = []
    for name, proc in alive:
        cmdline: list[str] = []
        with contextlib.suppress(psutil.Error):
            cmdline = proc.cmdline()
        report.append({"name": name, "pid": proc.pid, "cmdline": " ".join(cmdline)[:300], "killed": False})
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)  # psutil checks the create time again before it signals
    still = _wait_gone([p for _, p in alive], grace_s)
    for proc in still:
        with contextlib.suppress(psutil.Error):
            proc.kill()
        for r in report:
            if r["pid"] == proc.pid:
                r["killed"] = True
    _wait_gone(still, 5.0)
    return report


def _running(proc: psutil.Process) -> bool:
    # an orphan's exit is reaped by init, or by nobody in a container whose pid 1 does not reap: a zombie is gone
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to `timeout_s` for `procs` (not our children: nothing to reap) to exit; those still running."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if _running(p)]
    return alive


# ---------------------------------------------------------------- what the owner keeps in order


class Housekeeper:
    """What the owner of a run directory keeps in order while its job runs: processes.json, an event for
    each checkpoint the job set aside as damaged, and the unfinished saves of a job that died."""

    def __init__(self, run_dir: RunDir, events: EventLog, message: Callable[[str], None]):
        self.run_dir = run_dir
        self.events = events
        self.message = message
        self._recorded: frozenset[int] | None = None  # the pids processes.json holds
        # reported by an earlier owner already
        self._quarantine_seen = {q["path"] for q in list_quarantined(run_dir.checkpoints_dir)}

    def poll(self, named: dict[str, list[psutil.Process]]) -> None:
        """Each poll of the supervisor: the process record when it changed, and new quarantine notices."""
        self.record(named)
        self.report_quarantined()

    def record(self, named: dict[str, list[psutil.Process]], *, clear: bool = False) -> None:
        """Keep processes.json up to date (the next owner ends orphans by it); `clear` once the job is gone."""
        named = {} if clear else named
        pids = frozenset(p.pid for procs in named.values() for p in procs)
        if pids != self._recorded and record_processes(self.run_dir, named):
            self._recorded = pids

    def report_quarantined(self) -> None:
        """An event and a message for each checkpoint the job set aside as damaged (engine/checkpoint.py)."""
        for q in list_quarantined(self.run_dir.checkpoints_dir):
            if q["path"] in self._quarantine_seen:
                continue
            self._quarantine_seen.add(q["path"])
            reason = q["reason"] or "no reason recorded"
            self.events.emit(Event.CHECKPOINT_QUARANTINED, step=q["step"], path=q["path"], reason=reason)
            self.message(
                f"checkpoint step-{q['step']} failed verification ({reason}): set aside as {Path(q['path']).name}, "
                "never deleted; the job resumes from the newest checkpoint that verifies"
            )

    def after_attempt(self, named: dict[str, list[psutil.Process]], *, clean_tmp: bool) -> None:
        """Once an attempt's processes are stopped: clear the record if none is left, report quarantines, and
        (with `clean_tmp`: the engine's checkpoints) remove the saves the dead job did not finish, now rather than
        at the next start, since on a full disk they hold the space a restart needs. A step-N.tmp a live
        process still writes stays (retention.tmp_writer)."""
        alive = {name: [p for p in procs if _running(p)] for name, procs in named.items()}
        self.record(alive, clear=not any(alive.values()))
        self.report_quarantined()
        if not clean_tmp:
            return
        try:
            removed = clean_stale_tmp(self.run_dir.checkpoints_dir)
        except (OSError, ValueError) as exc:
            self.events.emit(Event.CHECKPOINT_TMP_REMOVE_FAILED, reason=str(exc))
            return
        for path in removed:
            self.events.emit(
                Event.CHECKPOINT_TMP_REMOVED, path=str(path), reason="an unfinished save of a job that died"
            )


def disk_statement(ckpt_dir: Path) -> str:
    """What is left on the checkpoints' disk, in words: its free space, the whole checkpoints, and the space held
    by checkpoints set aside as damaged (never deleted by prime-train: a person decides)."""
    try:
        du = shutil.disk_usage(ckpt_dir if ckpt_dir.is_dir() else ckpt_dir.parent)
        free = f"{_size(du.free)} free of {_size(du.total)} on {ckpt_dir}"
    except OSError:
        free = f"free space on {ckpt_dir} unknown"
    steps = [c.step for c in list_checkpoints(ckpt_dir)]
    left = ", ".join(f"step-{s}" for s in steps) if steps else "none"
    statement = f"{free}; whole checkpoints left: {left}"
    aside = [Path(q["path"]) for q in list_quarantined(ckpt_dir)]
    if aside:
        held = ", ".join(f"{p.name} ({_size(_tree_bytes(p))})" for p in aside)
        statement += f"; set aside as damaged, yours to delete once looked at: {held}"
    return statement


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path, followlinks=False):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def attempt_numbers(run_dir: RunDir) -> list[int]:
    """The attempt numbers logs/ already holds (from earlier runs in this run directory)."""
    try:
        names = os.listdir(run_dir.logs_dir)
    except OSError:
        return []
    return [int(m.group(1)) for name in names if (m := re.fullmatch(r"attempt-(\d+)", name))]
