"""`prime-train status | logs | diagnose`: read a run directory or any trainer's logs, running or finished."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

STATUS_FIELDS = (
    "state", "attempt", "restarts", "step", "max_steps", "phase", "loss", "heartbeat_age_s", "duration_s",
    "checkpoints",
)  # fmt: skip


def status(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (<output_dir>/<name>).")],
    as_json: JsonFlag = False,
) -> None:
    """Show a running or finished run (state, step, attempts, last failure, recent events), or a sweep directory
    (every trial: parameters, state, step, metric; the best).

    Every attempt counts: a failure the run recovered from is still its last failure, and an external
    job's checkpoints are read from its job.checkpoint_dir. Exit 78 for a directory that holds no run.

    Examples:

      prime-train status runs/tiny-sft

      prime-train status runs/tiny-sft --json
    """
    from prime_train.resilience.status import check_run_dir, run_status
    from prime_train.sweep.spec import is_sweep_dir

    if is_sweep_dir(run_dir):
        from prime_train.cli.sweep import render_sweep_status
        from prime_train.sweep.record import sweep_status

        swept = sweep_status(run_dir)
        output.emit(json_safe(swept), as_json, lambda console: render_sweep_status(swept, console))
        return
    check_run_dir(run_dir)  # a directory that holds no run is bad input, named with the runs near it
    state = run_status(run_dir)
    output.emit(json_safe(state) if as_json else state, as_json, lambda console: render_status(state, console))


def json_safe(value: object) -> object:
    """`value` with NaN and infinities as null: JSON has neither, and `| jq` refuses Python's NaN."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def _cell(key: str, value: object) -> str:
    """A status value for the table: the loss to 4 significant digits, an unknown as "-", checkpoints as a list."""
    if value is None:
        return "-"
    if key == "loss" and isinstance(value, float):
        return f"{value:.4g}"
    if key == "duration_s" and isinstance(value, int | float):
        minutes, seconds = divmod(int(value), 60)
        return f"{value:.1f} s" if value < 60 else f"{minutes // 60}h{minutes % 60:02d}m{seconds:02d}s"
    if key == "checkpoints" and isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def _clock(stamp: object) -> str:
    """HH:MM:SS of an event's `time`; a time that is not a plausible number (a string, NaN, 1e300) shows as such."""
    if isinstance(stamp, int | float) and not isinstance(stamp, bool):
        try:
            return time.strftime("%H:%M:%S", time.localtime(stamp))
        except (OverflowError, OSError, ValueError):
            pass
    return "--:--:--"


def render_status(s: dict, console: Console) -> None:
    """The run's state as a two-column table, then its recent events one a line."""
    from rich.table import Table

    from prime_train.resilience.goodput import goodput_line
    from prime_train.resilience.rl_summary import status_rows

    def literal(text: object, style: str = "") -> Text:
        # cut before rich lays it out: a job's 50 MB failure message would take rich minutes to fold
        return output.literal(output.clip(text), style)

    table = Table(show_header=False, title=literal(s["run_dir"]))
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")
    for key in STATUS_FIELDS:
        table.add_row(key, literal(_cell(key, s[key])))
    if s.get("parameters"):  # trainable of total, as the job logged them at its start
        p = s["parameters"]
        share = f" ({p['fraction']:.2%})" if isinstance(p.get("fraction"), float) else ""
        table.add_row("trainable", literal(f"{p['trainable']:,} of {p['total']:,} parameters{share}"))
    if s.get("node"):  # one node of several: the step and checkpoints are the job's, metrics and export on node 0
        node = s["node"]
        rank = "?" if node["node_rank"] is None else node["node_rank"]
        table.add_row("node", literal(f"{rank} of {node['nnodes']} (metrics and the export are on node 0)"))
    if s.get("eval"):  # the newest evaluation's figures
        figures = {k: v for k, v in s["eval"].items() if k != "step"}
        shown = ", ".join(f"{k.removeprefix('eval_')} {v:.4g}" for k, v in figures.items())
        table.add_row("eval", literal(f"{shown} (step {s['eval'].get('step')})"))
    if s.get("final_dir"):
        table.add_row("final model", literal(s["final_dir"]))
    for key, value in status_rows(s.get("rl")):  # an RL run's reward and pass rate, and their trend
        table.add_row(key, literal(value))
    for line in goodput_line(s.get("goodput")):  # productive time of the wall time, and where the rest went
        table.add_row("goodput", literal(line.removeprefix("goodput ")))
    if s["last_failure"]:
        failure = s["last_failure"]
        kind, message = failure.get("kind"), failure.get("message")
        table.add_row("last failure", literal(f"{kind}: {message}" if kind else f"{message}"))
    console.print(table)
    for event in s["recent_events"]:
        stamp = _clock(event.get("time"))
        rest = {k: v for k, v in event.items() if k not in ("time", "event")}
        name = output.clip(event.get("event"), 80)
        console.print(literal(stamp, "dim") + literal(f" {name} {json.dumps(rest, default=str)[:160]}"))
    for note in s.get("notes") or ():  # what was too big to read whole (bounded.py)
        console.print(literal("note: ", "yellow") + literal(note))


def logs(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (<output_dir>/<name>).")],
    process: Annotated[str, typer.Option("--process", "-p", help="trainer, job, inference-0, …")] = "",
    attempt: Annotated[Optional[int], typer.Option("--attempt", help="Attempt number; default the latest.")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Last N lines; 0 for all.")] = 100,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until the run ends.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Print a run's process logs (the latest attempt unless --attempt), exactly as the processes wrote them.

    Secret values the job was given (its environment's credentials, config.toml's masked values) are
    masked in every form (raw, JSON, repr, URL-encoded) as the log is written, and a token of a known
    shape when a log is shown. A log is capped at logging.max_log_mb: past it the log keeps its head
    and its newest output, with a line saying how much was dropped.

    Examples:

      prime-train logs runs/tiny-sft

      prime-train logs runs/tiny-sft --process trainer --attempt 1 -n 0
    """
    from prime_train.resilience.status import logs_command, run_logs, tail

    if as_json:
        if follow:
            raise typer.BadParameter("--json prints one document: it does not --follow", param_hint="--json")
        files = run_logs(run_dir, process, attempt)
        tails = [{"file": str(f), "lines": [line.rstrip("\n") for line in tail(f, lines)]} for f in files]
        output.print_json({"files": tails})
        return
    raise typer.Exit(logs_command(run_dir, process, attempt, lines, follow))


def diagnose(
    paths: Annotated[list[Path], typer.Argument(help="Run directories or log files (any trainer's).")],
    latest: Annotated[
        bool, typer.Option("--latest", help="Of a run directory, only the latest attempt (default: every attempt).")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Find known failures in logs: OOM, NCCL timeouts, vLLM errors, tracebacks — with what to do.

    A run directory is read attempt by attempt (a failure the run recovered from is still found, and
    named with its attempt). Exit 0 when nothing fatal is found, 1 when something is, 78 for a path
    that does not exist.

    Examples:

      prime-train diagnose runs/tiny-sft

      prime-train diagnose outputs/logs/trainer.log --json
    """
    from prime_train.resilience.diagnose import diagnose_command

    raise typer.Exit(diagnose_command([str(p) for p in paths], as_json, all_attempts=not latest))
