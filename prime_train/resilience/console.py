"""What a person sees during `prime-train run`: one live status line, surfaced errors, a summary."""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from prime_train.contract import Phase, SupervisorState
from prime_train.kit import bounded
from prime_train.resilience.goodput import goodput, goodput_line
from prime_train.resilience.logscan import Finding
from prime_train.resilience.rl_summary import rl_summary, summary_lines
from prime_train.resilience.supervisor import Observer, Supervisor


def _fmt_duration(seconds: float | None) -> str:
    if not isinstance(seconds, int | float) or not math.isfinite(seconds):
        return "-"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


def status_line(s: dict[str, Any]) -> str:
    parts = [f"attempt {s.get('attempt', '-')}"]
    step, max_steps = s.get("step"), s.get("max_steps")
    parts.append(f"step {step if step is not None else '-'}/{max_steps or '?'}")
    if s.get("phase") and s.get("phase") != Phase.STEP:
        parts.append(str(s["phase"]))
    if isinstance(s.get("reward"), int | float):  # RL
        parts.append(f"reward {s['reward']:.3f}")
    if isinstance(s.get("loss"), int | float):
        at = s.get("loss_step")
        # read every logging.log_interval steps: an older step's loss says so, not to pass for this step's
        parts.append(f"loss {s['loss']:.4f}" + (f" (step {at})" if isinstance(at, int) and at != step else ""))
    if isinstance(s.get("tokens_per_s"), int | float):
        parts.append(f"{s['tokens_per_s'] / 1e3:.1f}k tok/s")
    if s.get("eta_s") is not None:
        parts.append(f"eta {_fmt_duration(s['eta_s'])}")
    gpu = s.get("gpu")
    if gpu:
        parts.append(f"gpu {gpu.get('mean_utilization_pct') or 0:.0f}% {gpu.get('memory_used_gib') or 0:.1f}GiB")
    if isinstance(s.get("disk"), int | float):
        parts.append(f"disk {s['disk']:.0%}")
    parts.append(f"restarts {s.get('restarts', 0)}")
    return " | ".join(parts)


class ConsoleObserver(Observer):
    """A rich live status line on a terminal; plain periodic lines otherwise (logs, CI)."""

    def __init__(self, console: Console, plain_interval_s: float = 30.0, *, quiet: bool = False):
        super().__init__(status=self._status, finding=self._finding, message=self._message)
        self.console = console
        self.quiet = quiet  # -q: no progress lines; findings and messages (what went wrong, what it did) stay
        self.live: Live | None = None
        self.plain_interval_s = plain_interval_s
        self._last_plain = 0.0
        self._last_line = ""

    def __enter__(self) -> ConsoleObserver:
        if self.console.is_terminal and not self.quiet:
            self.live = Live(Text("starting…"), console=self.console, refresh_per_second=4, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)
            self.live = None
        if self._last_line and not self.quiet:
            self.console.print(self._last_line, highlight=False)

    def _status(self, s: dict[str, Any]) -> None:
        line = status_line(s)
        self._last_line = line
        if self.quiet:
            return
        if self.live is not None:
            self.live.update(Text(line))
        elif time.time() - self._last_plain >= self.plain_interval_s:
            self._last_plain = time.time()
            self.console.print(line, highlight=False)

    def _finding(self, f: Finding) -> None:
        colour = "red" if f.severity == "fatal" else "yellow"
        where = f"{f.process or '?'}:{f.line}"
        # Text, never markup: process names, log lines and hints may hold "[rank0]" or "[engine]"
        self.console.print(Text.assemble((f.severity, colour), " ", (where, "bold"), " "), end="")
        self.console.print(f.text, markup=False, highlight=False)
        self.console.print(Text(f"  → {f.hint}", style="dim"), highlight=False)

    def _message(self, m: str) -> None:
        # messages carry log lines: "[inference-0] …" must print as text, not be read as rich markup
        self.console.print(f"[bold cyan]prime-train[/bold cyan]: {escape(m)}", highlight=False)


def summary_table(sup: Supervisor) -> Table:
    """One row per attempt: how long, from which step to which, how it ended and what its failure cost."""
    table = Table(title=Text(f"run {sup.cfg.run.name}: {sup.state}"))
    for col in ("attempt", "duration", "steps", "exit", "cause", "time lost"):
        table.add_column(col, no_wrap=True)  # short cells: a header or a "2 → 6" broken in two reads wrong
    for a in sup.attempts:
        duration = (a.ended or time.time()) - a.started
        # where it resumed (the job's heartbeat says so), not 0: a resumed run did not train from the start
        first = a.resumed_from if a.resumed_from is not None else a.first_step
        steps = f"{first if first is not None else '-'} → {a.last_step if a.last_step is not None else '-'}"
        cause = f"{a.failure.kind}" if a.failure else ("stopped" if sup.state == SupervisorState.STOPPED else "ok")
        table.add_row(
            str(a.number),
            _fmt_duration(duration),
            steps,
            str(a.exit_code) if a.exit_code is not None else "-",
            cause,
            _fmt_duration(time_lost(sup, a)) if a.failure else "-",
        )
    return table


def time_lost(sup: Supervisor, attempt: Any) -> float | None:
    """The wall time an attempt's failure threw away: from when the run reached the step of the newest checkpoint
    the attempt left (the one the next attempt resumes from) to the attempt's end, or the whole attempt when it left
    no checkpoint of its own. None for an attempt that did not fail.

    When the step was reached is read from the run's files, not estimated from a step time: the step's row in
    metrics.jsonl (written when the step was done), else the checkpoint's own time (an external job's). A mean
    step time times the steps lost misses the step in progress at the crash, a slow step, and everything when the
    job reports no step time."""
    if attempt.failure is None:
        return None
    ended = attempt.ended if attempt.ended is not None else time.time()
    since = attempt.started
    reached = _step_reached(sup, attempt.checkpoint_step_at_end, attempt.started, ended)
    if reached is not None:
        since = reached
    return max(0.0, ended - since)


def _step_reached(sup: Supervisor, step: int | None, started: float, ended: float) -> float | None:
    """When `step` was reached within [started, ended]: its metrics.jsonl row's time, else its checkpoint's."""
    if step is None:
        return None
    run_dir = getattr(sup, "run_dir", None)
    if run_dir is not None:
        keys = (b'"step": %d' % step, b'"step":%d' % step)
        for row in bounded.records_from_end(run_dir.metrics_path, contains=keys):
            stamp = row.get("time")
            if row.get("step") == step and isinstance(stamp, int | float) and started <= stamp <= ended:
                return float(stamp)
    path = _checkpoint_path(sup, step)
    try:
        stamp = path.stat().st_mtime if path is not None else None
    except OSError:
        stamp = None
    return stamp if stamp is not None and started <= stamp <= ended else None


def _checkpoint_path(sup: Supervisor, step: int) -> Path | None:
    """The checkpoint of `step`: checkpoints/step-N of the engine, or the entry of an external job's
    job.checkpoint_dir whose name matches job.checkpoint_pattern."""
    cfg = getattr(sup, "cfg", None)
    if cfg is None:
        return None
    job = cfg.job
    if not job.command:
        return cfg.layout.checkpoints_dir / f"step-{step}"
    if not job.checkpoint_dir:
        return None
    try:
        regex, entries = re.compile(job.checkpoint_pattern), os.scandir(job.checkpoint_dir)
    except (OSError, re.error):
        return None
    with entries:
        for entry in entries:
            m = regex.search(entry.name)
            found = m.group(1) if m and m.groups() and not entry.name.endswith(".tmp") else None
            if found is not None and found.isdigit() and int(found) == step:
                return Path(entry.path)
    return None


def _number(value: Any) -> str:
    """A metric as the console shows it: NaN and infinities by name, null (a NaN in JSON) as "null"."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "null" if value is None else str(value)
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def final_results(run_dir, *, written_since: float | None = None) -> list[str]:
    """The last training and eval figures and where the model is, for the end of a run.

    final/ is announced only when it was written at or after `written_since` (this run's start; None: never),
    so that a stopped or failed run does not point at an earlier run's model. metrics.jsonl is read whatever
    it holds: nulls (a diverged loss), NaN, torn lines and bytes that are not UTF-8.
    """
    # newest first, within bounds however big the file (bounded.py); eval rows found by their bytes before parsing
    last = next((r for r in bounded.records_from_end(run_dir.metrics_path) if "loss" in r), {})
    evals = next(
        (
            r
            for r in bounded.records_from_end(run_dir.metrics_path, contains=(b'"eval_',))
            if any(isinstance(k, str) and k.startswith("eval_") for k in r)
        ),
        {},
    )
    out = []
    if last:
        out.append(f"step {last.get('step')}: loss {_number(last['loss'])}")
    shown = {k: v for k, v in evals.items() if k.startswith("eval_") and isinstance(v, int | float | None)}
    if shown:
        out.append(f"eval at step {evals.get('step')}: " + ", ".join(f"{k} {_number(v)}" for k, v in shown.items()))
    try:
        final_written = (run_dir.final_dir / "config.json").stat().st_mtime
    except OSError:
        final_written = None
    out += summary_lines(rl_summary(run_dir.metrics_path))  # RL: reward and pass rate at start and end
    out += goodput_line(goodput(run_dir))  # productive time of the wall time, and where the rest went
    if final_written is not None and written_since is not None and final_written >= written_since:
        out.append(f"model (HF format): {run_dir.final_dir}")
    return out
