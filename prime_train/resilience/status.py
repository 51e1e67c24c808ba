"""`prime-train status` and `prime-train logs`: read a run directory, running or finished."""

from __future__ import annotations

import math
import time
from collections import deque
from pathlib import Path

import psutil
from rich.console import Console

from prime_train.contract import RunDir, list_checkpoints, read_heartbeat, read_json
from prime_train.resilience.events import read_events
from prime_train.resilience.redact import Redactor


def _alive(pid: object) -> bool:
    if not _is_int(pid) or pid <= 0:
        return False
    try:
        return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OverflowError):
        return False


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_or_none(value: object) -> int | None:
    return value if _is_int(value) else None


def _last_failure(value: object) -> dict | None:
    """supervisor.json's last_failure as the object it should be; a bare string is kept as its message."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str) and value:
        return {"kind": None, "message": value}
    return None


def run_status(run_dir: Path, redactor: Redactor | None = None) -> dict:
    """A run's state from its files, every string redacted (the environment's credential values included).

    Files of any shape read without an exception: a field of the wrong type reads as unknown."""
    rd = RunDir(run_dir)
    sup = read_json(rd.supervisor_path) or {}
    hb = read_heartbeat(rd.progress_path)
    state = sup.get("state") if isinstance(sup.get("state"), str) else "unknown"
    if state in ("running", "restarting", "starting") and not _alive(sup.get("pid")):
        state = "dead (supervisor not running)"
    events = read_events(rd.events_path)
    age = time.time() - hb.time if hb is not None and hb.time is not None and math.isfinite(hb.time) else None
    status = {
        "run_dir": str(rd.root),
        "state": state,
        "attempt": _int_or_none(sup.get("attempt")),
        "restarts": _int_or_none(sup.get("restarts")),
        "step": hb.step if hb is not None else _int_or_none(sup.get("step")),
        "max_steps": hb.max_steps if hb is not None else None,
        "phase": hb.phase.value if hb is not None else None,
        "loss": hb.loss if hb is not None else None,
        "heartbeat_age_s": round(age, 1) if age is not None else None,
        "checkpoints": [c.step for c in list_checkpoints(rd.checkpoints_dir)],
        "last_failure": _last_failure(sup.get("last_failure")),
        "recent_events": events[-8:],
    }
    return (redactor or Redactor.from_environment()).value(status)


def logs_command(run_dir: Path, process: str, attempt: int | None, lines: int, follow: bool) -> int:
    rd = RunDir(run_dir)
    folder = rd.attempt_logs(attempt) if attempt else rd.logs_dir / "latest"
    if not folder.is_dir():
        Console(stderr=True).print(f"[red]error[/red]: no logs at {folder}")
        return 2
    files = sorted(folder.glob("*.log"))
    if process:
        files = [f for f in files if f.stem == process]
        if not files:
            names = ", ".join(sorted(p.stem for p in folder.glob("*.log"))) or "none"
            Console(stderr=True).print(f"[red]error[/red]: no log for process {process!r}; there are: {names}")
            return 2
    for f in files:
        if len(files) > 1:
            print(f"==> {f} <==")
        with open(f, errors="replace") as fh:
            tail = deque(fh, maxlen=lines) if lines > 0 else fh.readlines()
        print("".join(tail), end="")
    if follow and files:
        with open(files[-1], errors="replace") as fh:
            fh.seek(0, 2)
            try:
                while True:
                    line = fh.readline()
                    if line:
                        print(line, end="", flush=True)
                    else:
                        time.sleep(0.5)
            except KeyboardInterrupt:
                return 0
    return 0
