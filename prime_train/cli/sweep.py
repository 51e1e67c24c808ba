"""`prime-train sweep SWEEP.toml`: hyper-parameter search on optuna, each trial a supervised run."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag, require_engine, split_overrides
from prime_train.cli.errors import CliError
from prime_train.contract import ExitCode

if TYPE_CHECKING:
    from rich.console import Console


def sweep(
    ctx: typer.Context,
    spec_file: Annotated[str, typer.Argument(help="SWEEP.toml: a [sweep] section and its [sweep.space].")],
    storage: Annotated[
        Optional[str],
        typer.Option(
            "--storage",
            help="optuna storage shared by several sweep processes: a database URL (postgresql://, mysql://, "
            "sqlite:///) or journal:PATH (optuna's journal file, for a shared disk). Default: <sweep dir>/study.db.",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Search hyper-parameters with optuna; every trial is a whole supervised run (preflight, restarts, resume).

    Samplers grid, random, tpe, cmaes and pbt; pruners none, median and hyperband, fed from each trial's
    metrics.jsonl as it is written (a pruned trial stops with a checkpoint). Each trial runs in
    <output_dir>/<name>/trial-NNNN. Run again after a crash or kill -9, the sweep goes on with the same study:
    finished trials are kept, interrupted ones resume from their checkpoints. Ctrl-C stops every trial with a
    checkpoint (75). At the end: best.toml (a runnable config) and sweep.png. Overrides (--train.max_steps 50)
    apply to every trial.

    Exit codes: 0 done, 75 stopped (run again to go on), 78 bad SWEEP.toml or base config.

    Examples:

      prime-train sweep SWEEP.toml

      prime-train sweep SWEEP.toml --storage journal:/shared/lr-search.log --json
    """
    if importlib.util.find_spec("optuna") is None:
        raise CliError("prime-train sweep needs optuna: pip install 'prime-train[sweep]'", ExitCode.CONFIG)
    from prime_train.sweep.pbt import sweep_for
    from prime_train.sweep.runner import stop_on_signals
    from prime_train.sweep.spec import load_checked_spec
    from prime_train.sweep.study import storage_url

    _, overrides = split_overrides([spec_file], ctx.args)
    spec = load_checked_spec(spec_file, overrides)
    console = output.console(stderr=as_json)  # with --json, stdout is the outcome document alone
    runner = sweep_for(spec, storage_url(spec, storage), say=lambda line: console.print(output.literal(line)))
    require_engine(spec.trial_config({}, "base"))
    console.print(output.literal("prime-train sweep", "bold cyan") + output.literal(f": {spec.sweep_dir}"))
    stop_on_signals(runner)
    live = _live_table(runner, console)
    with live:
        outcome = runner.run(live=lambda: live.update(sweep_table(_rows(runner))))
    if as_json:
        output.print_json(outcome.to_dict())
    else:
        _print_outcome(outcome, console)
    raise typer.Exit(outcome.exit_code)


def _rows(runner) -> list[dict[str, Any]]:
    """This process's trials, with the step each one's heartbeat reached."""
    return [r.row() for r in sorted(runner.runs.values(), key=lambda r: r.number)]


def _live_table(runner, console: Console):
    from rich.live import Live

    return Live(sweep_table(_rows(runner)), console=console, refresh_per_second=2, transient=True)


def sweep_table(rows: list[dict[str, Any]], title: str = "trials"):
    """trial · params · state · step · metric."""
    from rich.table import Table

    table = Table(title=output.literal(title))
    for column in ("trial", "params", "state", "step", "metric"):
        table.add_column(column, justify="right" if column in ("trial", "step", "metric") else "left")
    for r in rows:
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in (r.get("params") or {}).items())
        state = str(r.get("state")) + (f" ({r['failure']})" if r.get("failure") else "")
        step = "-" if r.get("step") is None else str(r["step"])
        table.add_row(str(r.get("trial")), output.literal(params), output.literal(state), step, _fmt(r.get("value")))
    return table


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _print_outcome(outcome, console: Console) -> None:
    console.print(sweep_table(outcome.rows, title="the study"))
    if outcome.best:
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in outcome.best["params"].items())
        console.print(output.literal(f"best: trial {outcome.best['trial']}, {_fmt(outcome.best['value'])}; {params}"))
        console.print(output.literal(f"best config: {outcome.best_toml}"))
    if outcome.plot:
        console.print(output.literal(f"plot: {outcome.plot}"))
    for note in outcome.notes:
        console.print(output.literal(note))
    if outcome.exit_code == ExitCode.PREEMPTED:
        console.print(output.literal("stopped: run the same command again to go on"))


def render_sweep_status(s: dict, console: Console) -> None:
    """`prime-train status SWEEP_DIR`."""
    console.print(output.literal(f"sweep {s.get('name')} ({s.get('sampler')}, {s.get('pruner')}): {s['sweep_dir']}"))
    console.print(sweep_table(s.get("trials", []), title=f"{s.get('metric')} ({s.get('direction')})"))
    best = s.get("best")
    if best:
        console.print(output.literal(f"best: trial {best['trial']}, {s.get('metric')} {_fmt(best['value'])}"))
