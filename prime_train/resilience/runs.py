"""`prime-train runs`: the runs under an output directory, one row each, read with `status`'s readers.

A row is what a user scans for first: the run's name, its job, its state, how far it got, its last eval metric,
when it last did something and how much disk it holds. Every value comes from the run's own files (status.py
reads them within bounds); a value a run never wrote is None, never a guess.
"""

from __future__ import annotations

import os
from pathlib import Path

from prime_train.kit import bounded
from prime_train.kit.redact import Redactor
from prime_train.resilience.status import RUN_MARKERS, _run_config, run_status

# the eval metric a row shows first, when the run logged it: the one a user compares runs by
EVAL_KEYS = ("eval_exact_match", "eval_loss", "eval_reward", "eval_accuracy", "eval_mc_accuracy")


def run_dirs(directory: Path) -> list[Path]:
    """The run directories directly inside `directory`, by name; a symlinked one is not followed."""
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    return [
        p for p in entries if not p.is_symlink() and p.is_dir() and any(os.path.lexists(p / m) for m in RUN_MARKERS)
    ]


def disk_bytes(root: Path) -> int:
    """Bytes of every file under `root`, links not followed (a link's target is not the run's)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):  # os.walk does not descend into linked directories
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += st.st_size
    return total


def last_eval(metrics_path: Path, notes: list[str]) -> dict | None:
    """The newest eval metric the run logged: {"step", "name", "value"}, or None when it logged none."""
    for record in bounded.records_from_end(metrics_path, notes, contains=(b'"eval_',)):
        for key in (*EVAL_KEYS, *sorted(k for k in record if k.startswith("eval_"))):
            value = record.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                step = record.get("step")
                return {"step": step if isinstance(step, int) else None, "name": key, "value": value}
    return None


def _job(config: dict) -> str | None:
    """What the run trains: its run.job, or "command" for an external [job] command."""
    job = config.get("job")
    if isinstance(job, dict) and job.get("command"):
        return "command"
    run = config.get("run")
    value = run.get("job") if isinstance(run, dict) else None
    return value if isinstance(value, str) else None


def _last_activity(run_dir: Path) -> float | None:
    """When the run last wrote one of its record files (the newest modification time), or None."""
    times = []
    for name in ("progress.json", "supervisor.json", "events.jsonl", "metrics.jsonl", "config.toml"):
        try:
            times.append(os.lstat(run_dir / name).st_mtime)
        except OSError:
            continue
    return max(times) if times else None


def run_row(run_dir: Path, redactor: Redactor | None = None) -> dict:
    """One run's row: name, job, state, step, max_steps, last eval, time of last activity, bytes on disk."""
    status = run_status(run_dir, redactor)
    notes: list[str] = list(status["notes"])
    config = _run_config(run_dir / "config.toml", notes)
    state = status["state"]
    if state == "unknown" and status["phase"] in ("done", "stopped", "failed"):
        state = status["phase"]  # a `prime-train train` run has no supervisor.json; its heartbeat says how it ended
    return {
        "name": run_dir.name,
        "run_dir": str(run_dir),
        "job": _job(config),
        "state": state,
        "step": status["step"],
        "max_steps": status["max_steps"],
        "last_eval": last_eval(run_dir / "metrics.jsonl", notes),
        "time": _last_activity(run_dir),
        "bytes": disk_bytes(run_dir),
        "notes": notes,
    }


def list_runs(directory: Path) -> list[dict]:
    """A row for each run directly inside `directory`, newest activity first."""
    redactor = Redactor.from_environment()
    rows = [run_row(p, redactor) for p in run_dirs(directory)]
    rows.sort(key=lambda r: r["time"] or 0.0, reverse=True)
    return rows
