"""Goodput: the share of a run's wall time that trained steps the run kept, and where the rest went.

Read from the run directory alone (the supervisor's events.jsonl, the engine's metrics.jsonl), so `run` prints it
at the end, `status` shows it live, and a run directory copied elsewhere still gives it. The latest supervisor
session counts (from its `run_started` to its end, or now while it runs). The parts, disjoint:

- start-up: from the session's start to the first attempt's first step (imports, model load, data, resume);
- compile: the first step of each attempt (torch.compile, CUDA and allocator warm-up), the engine's `first_step_s`;
- checkpoint saves: the part of each save that blocked the loop (an async save's staging), the engine's `save_s`;
- evaluations: the engine's `evaluation_s`;
- restarts: from an attempt's death to the next attempt's first step (backoff, process start, resume);
- lost steps: steps trained after the checkpoint a failed attempt left, trained again after the resume: from when
  that attempt reached its last step that metrics.jsonl keeps (a resume drops the rows of the steps it retrains)
  to its death;
- end: from the last step to the session's end (the final save, export, exit).

productive = wall - the parts. A step's row carries the seconds of the save or eval done before it; a row lost
with its attempt takes them into "lost steps", never twice.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from prime_train.contract import EVALUATION_S, FIRST_STEP_S, SAVE_S, Event
from prime_train.kit import bounded
from prime_train.rundir import RunDir

PARTS = ("startup", "compile", "save", "eval", "restart", "lost_steps", "end")
LABELS = {
    "startup": "start-up",
    "compile": "compile",
    "save": "checkpoint saves",
    "eval": "evaluations",
    "restart": "restarts",
    "lost_steps": "lost steps",
    "end": "end",
}
SESSION_ENDS = {Event.RUN_FINISHED, Event.RUN_STOPPED, Event.RUN_PREEMPTED, Event.RUN_FAILED}
# the engine's seconds on a step's row (engine/loop.py writes them)
ROW_PARTS = {FIRST_STEP_S: "compile", SAVE_S: "save", EVALUATION_S: "eval"}


@dataclass
class _Attempt:
    started: float
    died: float | None = None  # its first process exit (the attempt's death), else its end


def _number(value: Any) -> float | None:
    """A finite number as a float, else None (files read as they are: a wrong type or NaN is unknown)."""
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


def _session(events: list[dict]) -> tuple[float, float | None, list[_Attempt]] | None:
    """The latest session's start, end (None: still running) and attempts, from events.jsonl."""
    starts = [i for i, e in enumerate(events) if e.get("event") == Event.RUN_STARTED and _number(e.get("time"))]
    if not starts:
        return None
    begun, end, attempts = float(events[starts[-1]]["time"]), None, []
    for e in events[starts[-1] + 1 :]:
        kind, stamp = e.get("event"), _number(e.get("time"))
        if stamp is None:
            continue
        if kind == Event.ATTEMPT_STARTED:
            attempts.append(_Attempt(stamp))
        elif kind in (Event.PROCESS_EXITED, Event.ATTEMPT_ENDED) and attempts and attempts[-1].died is None:
            attempts[-1].died = stamp
        elif kind in SESSION_ENDS:
            end = stamp
    return begun, end, attempts


def goodput(run_dir: RunDir, now: float | None = None) -> dict[str, Any] | None:
    """The latest session's goodput and its lost parts in seconds; None when events.jsonl holds no session."""
    notes: list[str] = []
    session = _session(list(bounded.records(run_dir.events_path, notes)))
    if session is None:
        return None
    begun, end, attempts = session
    ended = end if end is not None else (now if now is not None else time.time())
    rows = [r for r in bounded.records(run_dir.metrics_path, notes) if (t := _number(r.get("time"))) and t >= begun]
    parts = dict.fromkeys(PARTS, 0.0)
    for row in rows:
        for key, part in ROW_PARTS.items():
            parts[part] += max(0.0, _number(row.get(key)) or 0.0)
    last_death = None  # the previous attempt's death, when it failed
    for i, a in enumerate(attempts):
        until = a.died if a.died is not None else ended
        inside = [r for r in rows if a.started <= r["time"] <= until]
        first = next((r for r in inside if _number(r.get(FIRST_STEP_S)) is not None), None)
        first_start = _first_step_start(first) if first is not None else None
        reached = max((r["time"] for r in inside), default=None)
        waited_from = begun if last_death is None else last_death
        if first_start is not None:
            parts["startup" if last_death is None else "restart"] += max(0.0, first_start - waited_from)
        if i < len(attempts) - 1:
            # this attempt died and the next trained again from its checkpoint: what it did after it is lost
            if first_start is None:  # no step kept: the whole attempt was waiting for one
                parts["startup" if last_death is None else "restart"] += max(0.0, until - waited_from)
            else:
                parts["lost_steps"] += max(0.0, until - (reached if reached is not None else first_start))
            last_death = until
        elif first_start is None:  # the last attempt never finished a step (failed at start-up, or starting now)
            parts["startup" if last_death is None else "restart"] += max(0.0, ended - waited_from)
        elif reached is not None:
            parts["end"] += max(0.0, ended - reached)
    if not attempts:  # the session ended (or waits) before any attempt: nothing trained
        parts["startup"] = max(0.0, ended - begun)
    wall = max(0.0, ended - begun)
    lost = sum(parts.values())
    productive = max(0.0, wall - lost)
    return {
        "wall_s": round(wall, 3),
        "productive_s": round(productive, 3),
        "goodput": round(productive / wall, 4) if wall > 0 else None,
        "lost_s": {k: round(v, 3) for k, v in parts.items()},
        "attempts": len(attempts),
        "running": end is None,
        "notes": notes,
    }


def _first_step_start(row: dict) -> float:
    """When an attempt's first step began: its row is written when the step (and an eval due at it) is done."""
    return row["time"] - (_number(row.get(FIRST_STEP_S)) or 0.0) - (_number(row.get(EVALUATION_S)) or 0.0)


def goodput_line(figures: dict[str, Any] | None) -> list[str]:
    """One line for the end of a run: goodput, wall time, and each part that lost time."""
    if not figures or figures.get("goodput") is None:
        return []
    lost = ", ".join(f"{LABELS[k]} {v:.1f}s" for k, v in figures["lost_s"].items() if v >= 0.05)
    head = f"goodput {figures['goodput']:.1%} ({figures['productive_s']:.1f}s training of {figures['wall_s']:.1f}s)"
    return [head + (f"; lost: {lost}" if lost else "")]
