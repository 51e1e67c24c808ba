"""`prime-train status` and `prime-train logs`: read a run directory, running or finished.

Every attempt counts: the last failure is the newest one of any attempt (a run that recovered keeps it), an
external job's checkpoints are read where its config says it writes them, and a step total comes from the
heartbeat alone (unknown when the job does not say it: never a default the job never saw).
"""

from __future__ import annotations

import codecs
import difflib
import itertools
import math
import os
import re
import sys
import time
import tomllib
from pathlib import Path
from typing import BinaryIO

import psutil

from prime_train.contract import LIVE_STATES, Heartbeat
from prime_train.kit import bounded
from prime_train.kit.redact import Redactor
from prime_train.resilience.goodput import goodput
from prime_train.resilience.rl_summary import rl_summary
from prime_train.rundir import RunDir, list_checkpoints


def _alive(pid: object) -> bool:
    if not _is_int(pid) or pid <= 0:
        return False
    try:
        return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.Error, OverflowError):
        return False


def _started_after(pid: object, since: object) -> bool:
    """Whether process `pid` started after `since`: then it is not the one that took the lock, its pid was reused."""
    if not isinstance(since, int | float) or not _is_int(pid):
        return False
    try:
        return psutil.Process(pid).create_time() > since + 1.0  # create_time is rounded to the clock tick
    except (psutil.Error, OverflowError, ValueError):
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


# What makes a directory a run directory: any one of these (a run that died at once may have only some).
RUN_MARKERS = ("supervisor.json", "events.jsonl", "progress.json", "config.toml", "logs", "checkpoints", ".lock")


class NotARunDir(Exception):
    """The directory given to `status` or `logs` holds nothing a run writes; the message says what one holds."""


def check_run_dir(run_dir: Path) -> None:
    """Raise NotARunDir unless `run_dir` looks like a run directory; the message names near run directories."""
    if run_dir.is_dir() and any((run_dir / marker).exists() for marker in RUN_MARKERS):
        return
    what = (
        "does not exist" if not run_dir.exists() else "is not a directory" if not run_dir.is_dir() else "holds no run"
    )
    message = (
        f"{run_dir} {what}: a run directory is <output_dir>/<run.name> (runs/tiny-sft by default) and holds "
        "supervisor.json, events.jsonl, progress.json, config.toml and logs/"
    )
    near = near_run_dirs(run_dir)
    if near:
        message += f"; did you mean {' or '.join(near)}?"
    elif run_dir.parent.is_dir():  # no name is close: say which runs are there, or that there are none
        there = _runs_in(run_dir.parent)
        listed = ", ".join(str(p) for p in there[:8]) + (f" and {len(there) - 8} more" if len(there) > 8 else "")
        message += f"; the runs in {run_dir.parent}: {listed}" if there else f"; {run_dir.parent} holds no runs"
    raise NotARunDir(message)


def near_run_dirs(run_dir: Path, limit: int = 3) -> list[str]:
    """Run directories beside `run_dir` (or inside it) whose names are close to its name, or all of them if few."""
    inside = _runs_in(run_dir) if run_dir.is_dir() else []
    if inside:  # `status runs` names the runs in runs/
        return [str(p) for p in inside[:limit]]
    parent = run_dir.parent
    runs = {p.name: p for p in _runs_in(parent)} if parent.is_dir() else {}
    close = difflib.get_close_matches(run_dir.name, list(runs), n=limit, cutoff=0.6)
    return [str(runs[name]) for name in close]


def _runs_in(directory: Path) -> list[Path]:
    try:
        entries = sorted(directory.iterdir())
    except OSError:
        return []
    return [p for p in entries if p.is_dir() and any((p / m).exists() for m in RUN_MARKERS)]


def _run_config(path: Path, notes: list[str] | None = None) -> dict:
    """The config the run was started with (its config.toml), {} where there is none, it is not TOML, or it is over
    the size a config may have (noted: parsing a huge one would take minutes)."""
    text = bounded.read_text(path, bounded.MAX_TEXT_BYTES, notes)
    try:
        return tomllib.loads(text) if text is not None else {}
    except (tomllib.TOMLDecodeError, RecursionError):
        return {}


def _job_table(config: dict) -> dict:
    """The [job] table of the run's config, or {} when it has none."""
    job = config.get("job")
    return job if isinstance(job, dict) and job.get("command") else {}


def _config_section(config: dict, name: str) -> dict:
    """A table of the run's config, {} where there is none."""
    section = config.get(name)
    return section if isinstance(section, dict) else {}


def _node(config: dict) -> dict | None:
    """Which node of a multi-node job this run directory is ({node_rank, nnodes}; node_rank None when SkyPilot's
    environment gave it), None for one node. The step and checkpoints shown are the job's: ranks step together."""
    dist = _config_section(config, "distributed")
    nnodes = dist.get("nnodes")
    if not _is_int(nnodes) or nnodes < 2:
        return None
    rank = dist.get("node_rank")
    return {"node_rank": rank if _is_int(rank) else None, "nnodes": nnodes}


def _checkpoint_steps(rd: RunDir, job: dict) -> list[int]:
    """Steps of the whole checkpoints: the run's own (in ckpt.dir when its config set one: a relative one is read
    from here, as the supervisor that ran it did from its directory), and an external job's in job.checkpoint_dir."""
    steps = {c.step for c in list_checkpoints(rd.checkpoints_dir)}
    directory, pattern = job.get("checkpoint_dir"), job.get("checkpoint_pattern", r"step[-_]?(\d+)$")
    if isinstance(directory, str) and isinstance(pattern, str):
        try:  # relative to where the supervisor ran, as it reads it; from elsewhere it may not be found
            regex, entries = re.compile(pattern), list(Path(directory).iterdir())
        except (OSError, re.error):
            entries = []
        for entry in entries:
            m = regex.search(entry.name)
            if m and m.groups() and not entry.name.endswith(".tmp") and m.group(1).isdigit():
                steps.add(int(m.group(1)))
    return sorted(steps)


RECENT_EVENTS = 8


def _recent_events(path: Path, notes: list[str]) -> list[dict]:
    """The last RECENT_EVENTS events, oldest first, read from the end of events.jsonl (bounded.records_from_end)."""
    recent: list[dict] = []
    for event in bounded.records_from_end(path, notes):
        recent.append(event)
        if len(recent) >= RECENT_EVENTS:
            break
    return recent[::-1]


def _newest_failure(sup: dict, events: list[dict], events_path: Path, notes: list[str]) -> dict | None:
    """The newest failure of any attempt: supervisor.json's (the last attempt's) or the last `failure` event
    (among `events`, the recent ones, then further back in events.jsonl, within bounds)."""
    failure = _last_failure(sup.get("last_failure"))
    if failure is not None:
        return failure
    older = bounded.records_from_end(events_path, notes, contains=(b'"failure"',))
    for event in itertools.chain(reversed(events), older):
        if event.get("event") == "failure":
            return {k: v for k, v in event.items() if k not in ("time", "event")}
    return None


def _parameters(metrics_path: Path, notes: list[str]) -> dict | None:
    """The model's trainable and total parameter counts as the job logged them at its start (the last start's, after
    a resume); None when it logged none. LoRA trains a small fraction: this says how small."""
    found = None
    for record in bounded.records(metrics_path, notes, contains=(b"trainable_params",)):
        trainable, total = record.get("trainable_params"), record.get("total_params")
        if _is_int(trainable) and _is_int(total) and 0 <= trainable <= total:
            found = {"trainable": trainable, "total": total, "fraction": trainable / total if total else None}
    return found


def _last_eval(metrics_path: Path, notes: list[str]) -> dict | None:
    """The newest evaluation the job logged: its step and eval_* figures (loss, exact match, reward); None if none."""
    found = None
    for record in bounded.records(metrics_path, notes, contains=(b'"eval_',)):
        figures = {k: v for k, v in record.items() if k.startswith("eval_") and isinstance(v, int | float)}
        if figures and not isinstance(record.get("step"), bool):
            found = {"step": _int_or_none(record.get("step")), **figures}
    return found


def _training_time(events_path: Path, notes: list[str], live: bool) -> float | None:
    """Seconds the attempts ran, from attempt_started to attempt_ended in events.jsonl, summed (a resume's pauses
    left out); an attempt still running counts up to now. None when no attempt is recorded."""
    total, started = 0.0, None
    for event in bounded.records(events_path, notes, contains=(b'"attempt_',)):
        when = event.get("time")
        if not isinstance(when, int | float) or isinstance(when, bool) or not math.isfinite(when):
            continue
        if event.get("event") == "attempt_started":
            started = when
        elif event.get("event") == "attempt_ended" and started is not None:
            total, started = total + max(0.0, when - started), None
    if started is not None and live:
        total += max(0.0, time.time() - started)
    elif started is None and total == 0.0:
        return None
    return round(total, 1)


def run_status(run_dir: Path, redactor: Redactor | None = None) -> dict:
    """A run's state from its files, every string redacted (the environment's credential values included).

    Files of any shape read without an exception: a field of the wrong type reads as unknown. Files of any size
    read within bounds (bounded.py): what was left out is said in `notes`."""
    notes: list[str] = []
    config = _run_config(RunDir(run_dir).config_path, notes)
    rd = RunDir.of_run(run_dir, config)  # its checkpoints where its config put them
    sup = bounded.read_json(rd.supervisor_path, notes=notes) or {}
    job = _job_table(config)
    hb = Heartbeat.from_dict(bounded.read_json(rd.progress_path, notes=notes))
    if hb is None and isinstance(job.get("progress_file"), str):
        hb = Heartbeat.from_dict(bounded.read_json(job["progress_file"], notes=notes))
    state = sup.get("state") if isinstance(sup.get("state"), str) else "unknown"
    if state in LIVE_STATES and not _alive(sup.get("pid")):
        state = "dead (supervisor not running)"
    events = _recent_events(rd.events_path, notes)
    live = state in LIVE_STATES
    finished = state == "done" or (hb is not None and hb.phase.value == "done")
    age = time.time() - hb.time if hb is not None and hb.time is not None and math.isfinite(hb.time) else None
    if finished and not live:
        age = None  # a finished run's heartbeat is not late: its age would only grow
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
        "duration_s": _training_time(rd.events_path, notes, live),  # the attempts' time, pauses between left out
        "checkpoints": _checkpoint_steps(rd, job),
        "eval": _last_eval(rd.metrics_path, notes),  # the newest evaluation: step and eval_* figures
        "final_dir": str(rd.final_dir) if (rd.final_dir / "config.json").is_file() else None,
        "parameters": _parameters(rd.metrics_path, notes),  # trainable of total: LoRA trains a fraction
        "node": _node(config),
        "last_failure": _newest_failure(sup, events, rd.events_path, notes),
        "recent_events": events,
        "goodput": goodput(rd),  # productive time / wall time of the latest session, and the lost parts
        "rl": rl_summary(rd.metrics_path, notes=notes),  # RL runs: reward and pass rate, start against now
        "notes": notes,  # what was left out of files too big to read whole
    }
    return (redactor or Redactor.from_environment()).value(status)


class NoLogs(Exception):
    """The logs asked for do not exist; the message names the ones that do."""


def owner_alive(rd: RunDir) -> bool:
    """Whether a live process owns the run: the holder named in .lock, or a supervisor.json still running.

    Read, never locked: taking the lock, even for a moment, could refuse a `run` starting at that moment."""
    holder = bounded.read_json(rd.lock_path) or {}
    if _alive(holder.get("pid")) and not _started_after(holder.get("pid"), holder.get("since")):
        return True
    sup = bounded.read_json(rd.supervisor_path) or {}
    state = sup.get("state")
    return isinstance(state, str) and state in LIVE_STATES and _alive(sup.get("pid"))


def run_logs(run_dir: Path, process: str = "", attempt: int | None = None) -> list[Path]:
    """The log files of one attempt of a run (the latest unless `attempt`), one process's when `process` is given.

    Raises NotARunDir for a directory that holds no run, NoLogs (naming what there is) for logs that do not exist."""
    rd = RunDir(run_dir)
    check_run_dir(rd.root)
    folder = rd.attempt_logs(attempt) if attempt else rd.latest_logs
    if not folder.is_dir():
        have = sorted(p.name for p in rd.logs_dir.glob("attempt-*")) if rd.logs_dir.is_dir() else []
        raise NoLogs(f"no logs at {folder}; there are: {', '.join(have) or 'none (the run has not started)'}")
    files = sorted(folder.glob("*.log"))
    if process:
        names = sorted(p.stem for p in files)
        files = [f for f in files if f.stem == process]
        if not files:
            near = difflib.get_close_matches(process, names, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise NoLogs(f"no log for process {process!r} in {folder} (there are: {', '.join(names) or 'none'}){hint}")
    return files


def tail(path: Path, lines: int) -> list[str]:
    """The last `lines` lines of a log (all of them for 0), undecodable bytes replaced; read from the end within
    bounds, a line over bounded.MAX_LOG_LINE_BYTES cut with a note (a job's one line can be gigabytes)."""
    return bounded.tail_lines(path, lines) if lines > 0 else list(bounded.all_lines(path))


def logs_command(
    run_dir: Path, process: str, attempt: int | None, lines: int, follow: bool, poll_s: float = 0.5
) -> int:
    """Print the last `lines` of a run's process logs; with `follow`, new lines until the run has no live owner."""
    files = run_logs(run_dir, process, attempt)
    for f in files:
        if len(files) > 1:
            print(f"==> {f} <==")
        for line in tail(f, lines) if lines > 0 else bounded.all_lines(f):  # all of a big log: one line at a time
            sys.stdout.write(line)
        sys.stdout.flush()
    if follow and files:
        with open(files[-1], "rb") as fh:
            fh.seek(0, 2)
            try:
                return _follow(fh, RunDir(run_dir), poll_s)
            except KeyboardInterrupt:
                return 0
    return 0


def _follow(fh: BinaryIO, rd: RunDir, poll_s: float) -> int:
    """Print what is appended to `fh` until the run has no live owner; a line over bounded.MAX_LOG_LINE_BYTES is
    cut with a note, so that memory stays bounded whatever the job writes."""
    limit = bounded.MAX_LOG_LINE_BYTES
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    in_line = 0  # bytes of the current line seen so far

    def show(piece: bytes) -> None:
        nonlocal in_line
        ends = piece.endswith(b"\n")
        body = piece[:-1] if ends else piece
        text = decoder.decode(body[: max(0, limit - in_line)])
        in_line += len(body)
        if ends:
            text += decoder.decode(b"", final=True)
            decoder.reset()
            if in_line > limit:
                text += bounded.cut_note(in_line, limit)
            text, in_line = text + "\n", 0
        sys.stdout.write(text)
        sys.stdout.flush()

    while True:
        piece = fh.readline(bounded.CHUNK)
        if piece:
            show(piece)
            continue
        size = os.fstat(fh.fileno()).st_size
        if size < fh.tell():  # logging.max_log_mb cut the log's middle: what is newest is now at its end
            sys.stdout.write(f"[prime-train] the log was capped and shrank to {size} bytes; following its end\n")
            fh.seek(size)
            continue
        # the owner gone (finished, failed, killed): what it wrote last is in the file; then stop
        if not owner_alive(rd):
            while piece := fh.readline(bounded.CHUNK):
                show(piece)
            return 0
        time.sleep(poll_s)
