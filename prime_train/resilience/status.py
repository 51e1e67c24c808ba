"""`prime-train status` and `prime-train logs`: read a run directory, running or finished."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

import psutil
from rich.console import Console

from prime_train.contract import RunDir, list_checkpoints, read_heartbeat, read_json
from prime_train.resilience.events import read_events


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        return psutil.pid_exists(int(pid)) and psutil.Process(int(pid)).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_status(run_dir: Path) -> dict:
    rd = RunDir(run_dir)
    sup = read_json(rd.supervisor_path) or {}
    hb = read_heartbeat(rd.progress_path)
    state = sup.get("state", "unknown")
    if state in ("running", "restarting", "starting") and not _alive(sup.get("pid")):
        state = "dead (supervisor not running)"
    events = read_events(rd.events_path)
    return {
        "run_dir": str(rd.root),
        "state": state,
        "attempt": sup.get("attempt"),
        "restarts": sup.get("restarts"),
        "step": hb.step if hb is not None else sup.get("step"),
        "max_steps": hb.max_steps if hb is not None else None,
        "phase": hb.phase.value if hb is not None else None,
        "loss": hb.loss if hb is not None else None,
        "heartbeat_age_s": round(time.time() - hb.time, 1) if hb is not None and hb.time else None,
        "checkpoints": [c.step for c in list_checkpoints(rd.checkpoints_dir)],
        "last_failure": sup.get("last_failure"),
        "recent_events": events[-8:],
    }


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
