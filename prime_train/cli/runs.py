"""`prime-train runs`: the runs under an output directory, one line each (resilience/runs.py reads them)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag
from prime_train.cli.errors import BAD_INPUT, CliError

if TYPE_CHECKING:
    from rich.console import Console


def runs(
    directory: Annotated[
        Path, typer.Argument(help="An output directory (run.output_dir) holding run directories.")
    ] = Path("runs"),
    as_json: JsonFlag = False,
) -> None:
    """List the runs under an output directory: name, job, state, step, last eval metric, when, size on disk.

    Newest activity first. Exit 0 (an output directory with no runs in it lists none), 78 when DIRECTORY does not
    exist or is not a directory.

    Examples:

      prime-train runs

      prime-train runs /data/runs --json
    """
    from prime_train.resilience.runs import list_runs

    if not directory.is_dir():
        what = "does not exist" if not directory.exists() else "is not a directory"
        raise CliError(f"{directory} {what}: pass the output directory of your runs (run.output_dir)", BAD_INPUT)
    rows = list_runs(directory)
    output.emit({"directory": str(directory), "runs": rows}, as_json, lambda console: _render(directory, rows, console))


def when(stamp: object) -> str:
    """A time as `YYYY-MM-DD HH:MM`, or "-"."""
    if not isinstance(stamp, int | float) or isinstance(stamp, bool):
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M", time.localtime(stamp))
    except (OverflowError, OSError, ValueError):
        return "-"


def size(n: object) -> str:
    from prime_train.kit.bounded import size_text

    return size_text(n) if isinstance(n, int) else "-"


def _render(directory: Path, rows: list[dict], console: Console) -> None:
    from rich.table import Table

    if not rows:
        output.say(f"no runs in {directory}")
        return
    table = Table(title=output.literal(str(directory)))
    for column in ("name", "job", "state", "step", "last eval", "when", "size"):
        table.add_column(column, no_wrap=column != "name")
    for r in rows:
        step = "-" if r["step"] is None else str(r["step"])
        if r["max_steps"] is not None:
            step += f"/{r['max_steps']}"
        ev = r["last_eval"]
        metric = f"{ev['name'].removeprefix('eval_')} {ev['value']:.4g}" if ev else "-"
        cells = (r["name"], r["job"] or "-", r["state"], step, metric, when(r["time"]), size(r["bytes"]))
        table.add_row(*(output.literal(output.clip(c, 200)) for c in cells))
    console.print(table)
