"""`prime-train run | train | preflight | profile`: check the machine, train, supervise, and time a few steps."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from prime_train.cli import output
from prime_train.cli.common import (
    JsonFlag,
    RunConfigFiles,
    default_config,
    load,
    load_run_config,
    require_engine,
    split_overrides,
)
from prime_train.cli.errors import CliError
from prime_train.contract import Event, ExitCode, RunDir, SupervisorState

if TYPE_CHECKING:
    from pathlib import Path

    from rich.console import Console

    from prime_train.config.schema import Config
    from prime_train.kit.events import EventLog


# run and train re-run a run directory alike (resilience/rerun.py)
FreshFlag = Annotated[
    bool, typer.Option("--fresh", help="Start over: the run directory's old outputs move to previous/<time>/ first.")
]
ResumeFlag = Annotated[bool, typer.Option("--resume", help="Train a finished run on (after raising train.max_steps).")]


def _one_of(fresh: bool, resume: bool) -> None:
    if fresh and resume:
        raise typer.BadParameter("--fresh starts over, --resume trains on: one or the other", param_hint="--fresh")


def _set_old_run_aside(
    run_dir: RunDir, console: Console, events: EventLog | None = None
) -> tuple[Path, list[str]] | None:
    """--fresh: the old run's outputs into previous/<time>/, said on the console; CliError when they cannot move.

    With `events`, the intent is in events.jsonl before the first rename (and the journal in the run directory
    says the same): a supervisor killed part way leaves a move the next start finishes."""
    from prime_train.resilience.rerun import describe_set_aside, set_aside

    def record(dest: Path, names: list[str]) -> None:
        if events is not None:
            events.emit(Event.RUN_SET_ASIDE_STARTED, moving_to=str(dest), moving=names)

    try:
        moved = set_aside(run_dir, record=record)
    except (OSError, ValueError) as exc:
        raise CliError(f"--fresh: cannot move the old run aside in {run_dir.root}: {exc}", ExitCode.FAILED) from None
    if moved is not None:
        console.print(output.literal(describe_set_aside(*moved)), highlight=False, soft_wrap=True)
    return moved


def _finish_interrupted_set_aside(run_dir: RunDir, console: Console, events: EventLog | None = None) -> None:
    """A --fresh that was killed part way (its journal is still there): finish moving the old run aside, said on
    the console, before anything reads the run directory; CliError when it cannot be finished."""
    from prime_train.resilience.rerun import finish_set_aside

    try:
        moved = finish_set_aside(run_dir)
    except (OSError, ValueError) as exc:
        raise CliError(
            f"an earlier --fresh was interrupted while moving the old run aside in {run_dir.root}, and its move "
            f"cannot be finished: {exc}",
            ExitCode.FAILED,
        ) from None
    if moved is None:
        return
    dest, names = moved
    console.print(
        output.literal(
            f"an earlier --fresh was interrupted while it moved the old run aside: finished moving its "
            f"{', '.join(names)} to {dest}; this run starts over"
        ),
        highlight=False,
        soft_wrap=True,
    )
    if events is not None:
        events.emit(Event.RUN_SET_ASIDE, moved_to=str(dest), moved=names, finished_after_interruption=True)


def train(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    fresh: FreshFlag = False,
    resume: ResumeFlag = False,
) -> None:
    """Run the embedded training engine directly, without supervision (torchrun when several processes).

    Writes the resolved config to <output_dir>/<name>/config.toml and trains. Exit codes: 0 done,
    75 checkpointed and stopped on SIGTERM/Ctrl-C, 78 configuration error. Run again, it resumes as `run`
    does; a finished run says so and trains nothing, unless --resume or --fresh.

    Examples:

      prime-train train

      prime-train train configs/tiny-sft.toml --train.max_steps 50

      prime-train train configs/tiny-sft.toml --distributed.nproc_per_node 2 --distributed.strategy fsdp
    """
    from prime_train.contract import RunDirBusy
    from prime_train.launch import train_directly
    from prime_train.resilience.rerun import RerunRefused, plan_rerun

    _one_of(fresh, resume)
    cfg = load_run_config(files, ctx.args)
    require_engine(cfg)
    console = output.console()

    def decide() -> bool:
        """As `run` decides it (resilience/rerun.py), once the directory is ours: a finished run is not trained
        again unasked; --fresh moves the old outputs aside first."""
        _finish_interrupted_set_aside(cfg.layout, console)
        rerun = plan_rerun(cfg, fresh=fresh, resume=resume)
        if rerun.message:
            console.print(output.literal(rerun.message), highlight=False, soft_wrap=True)
        if rerun.launch and fresh:
            _set_old_run_aside(cfg.layout, console)
        return rerun.launch

    try:
        code = train_directly(cfg, decide)
    except (RunDirBusy, RerunRefused) as exc:  # a second owner, or --fresh that would not start over: config errors
        raise CliError(exc, ExitCode.CONFIG) from None
    raise typer.Exit(code)


def run(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    skip_preflight: Annotated[bool, typer.Option("--skip-preflight", help="Launch even if preflight fails.")] = False,
    verbose_vllm: Annotated[bool, typer.Option("--verbose-vllm", help="Stream inference worker logs whole.")] = False,
    spot: Annotated[bool, typer.Option("--spot", help="Launch as a SkyPilot managed job from [spot].")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="With --spot: print the SkyPilot task, launch nothing.")
    ] = False,
    fresh: FreshFlag = False,
    resume: ResumeFlag = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="The outcome as one JSON document on stdout; the live view goes to stderr.")
    ] = False,
) -> None:
    """Run a job under supervision: preflight, launch, watch, and resume after failures.

    Exit codes: 0 done, 1 failed (restarts exhausted or not retryable), 75 checkpointed and
    stopped on request, 78 configuration error. Ctrl-C checkpoints and stops; a second Ctrl-C
    stops at once without waiting for that checkpoint (still 75: the next run resumes from the
    newest whole one).

    Run again on the same run directory, a stopped or crashed run resumes from its newest
    checkpoint; a finished one says so and launches nothing, unless --resume (train on, after
    raising train.max_steps) or --fresh (start over; the old outputs are moved aside, not deleted).

    With --spot the job runs on cloud instances instead, as a SkyPilot managed job that runs
    `prime-train run` on each node and is recovered after preemptions (see `prime-train spot`).

    Examples:

      prime-train run

      prime-train run configs/tiny-sft.toml --train.max_steps 100

      prime-train run my-job.toml --supervisor.max_restarts 10

      prime-train run --spot configs/examples/spot.toml --dry-run
    """
    paths, overrides = split_overrides(files, ctx.args)
    if spot:
        from prime_train.cli.spot import run_spot

        raise typer.Exit(run_spot(paths, overrides, dry_run))
    if dry_run:
        raise typer.BadParameter("--dry-run goes with --spot", param_hint="--dry-run")
    _one_of(fresh, resume)
    cfg = load(paths or [default_config()], overrides)
    require_engine(cfg)
    raise typer.Exit(
        _supervise(
            cfg,
            skip_preflight=skip_preflight,
            verbose_inference=verbose_vllm,
            fresh=fresh,
            resume=resume,
            as_json=as_json,
        )
    )


def _supervise(
    cfg: Config, *, skip_preflight: bool, verbose_inference: bool, fresh: bool, resume: bool, as_json: bool = False
) -> int:
    """Preflight, then the supervisor with a live console until the run ends; its summary; the exit code."""
    import signal
    import time

    from prime_train.contract import RunDirBusy
    from prime_train.kit.events import EventLog
    from prime_train.resilience.console import ConsoleObserver, final_results, summary_table
    from prime_train.resilience.rerun import RerunRefused, plan_rerun
    from prime_train.resilience.supervisor import Supervisor, SupervisorOptions
    from prime_train.validator.preflight import preflight_command

    console = output.console(stderr=as_json)  # with --json, stdout is the outcome document alone
    observer = ConsoleObserver(console, quiet=output.MODE.quiet)
    sup = Supervisor(cfg, observer, SupervisorOptions(verbose_inference=verbose_inference))
    try:
        # before preflight: a second run into this directory is refused at once, and an orphaned job of a killed
        # supervisor is ended before preflight counts its ports and GPU memory as taken
        sup.claim()
    except RunDirBusy as exc:
        raise CliError(exc, ExitCode.CONFIG) from None
    except OSError:
        pass  # the run directory cannot be made: preflight says why (sup.run() claims again, or fails the same way)
    # owned now: what the directory holds cannot change under the decision. A finished run is not run again unasked.
    try:
        # a --fresh killed part way is finished first: half its old outputs must not read as this run's
        if sup.lock is not None:
            _finish_interrupted_set_aside(sup.run_dir, console, EventLog(sup.run_dir.events_path, sup.redactor))
        rerun = plan_rerun(cfg, fresh=fresh, resume=resume)
    except CliError:
        _release(sup)
        raise
    except RerunRefused as exc:
        _release(sup)
        raise CliError(exc, ExitCode.CONFIG) from None
    if rerun.message:
        console.print(output.literal(rerun.message), highlight=False, soft_wrap=True)
    if not rerun.launch:
        _release(sup)
        if as_json:
            output.print_json({"ok": True, "launched": False, "run_dir": str(cfg.run_dir), "message": rerun.message})
        return ExitCode.OK
    started = time.time()
    if not skip_preflight:
        code = preflight_command(cfg, as_json=False, quiet_pass=True, stderr=as_json)
        if code != ExitCode.OK:
            output.labelled("preflight failed", "fix the above, or pass --skip-preflight", style="red", stderr=as_json)
            output.failure_json("preflight failed: fix what it says, or pass --skip-preflight", code)
            _release(sup)
            return code
    try:  # after preflight: a refused run moves nothing
        events = EventLog(sup.run_dir.events_path, sup.redactor) if fresh else None
        moved = _set_old_run_aside(sup.run_dir, console, events) if fresh else None
    except (CliError, OSError):
        _release(sup)
        raise
    if moved is not None:
        sup.run_dir.create()
        assert events is not None
        events.emit(Event.RUN_SET_ASIDE, moved_to=str(moved[0]), moved=moved[1])
    console.print(output.literal("prime-train", "bold cyan") + output.literal(f": run directory {cfg.run_dir}"))
    with observer:
        interrupts = 0

        def on_signal(signum, frame):
            # the first SIGINT/SIGTERM asks for a checkpoint and a clean stop; a second Ctrl-C stops waiting for it:
            # the job is killed now and the run still ends as stopped (75), with supervisor.json saying so. Never an
            # exception here: one raised at an arbitrary point of the supervisor would leave its record "running".
            nonlocal interrupts
            interrupts += 1
            if interrupts > 1 and signum == signal.SIGINT:
                sup.request_stop("a second Ctrl-C", now=True)
                return
            sup.request_stop("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        code = sup.run()
    console.print(summary_table(sup))
    results = final_results(sup.run_dir, written_since=started if sup.state == SupervisorState.DONE else None)
    for line in results:
        console.print(output.literal(line), highlight=False)
    if as_json:
        output.print_json(_outcome(sup, code, results))
    return code


def _outcome(sup, code: int, results: list[str]) -> dict:
    """`run --json`'s document: how the run ended, each attempt, and the final figures."""
    attempts = [
        {
            "attempt": a.number,
            "exit_code": a.exit_code,
            "first_step": a.resumed_from if a.resumed_from is not None else a.first_step,
            "last_step": a.last_step,
            "failure": sup.redactor.value(a.failure.to_dict()) if a.failure else None,  # log lines may hold secrets
        }
        for a in sup.attempts
    ]
    return {
        "ok": code == ExitCode.OK, "exit_code": int(code), "state": sup.state, "run_dir": str(sup.run_dir.root),
        "attempts": attempts, "results": results,
    }  # fmt: skip


def _release(sup) -> None:
    """Give the run directory back when `run` ends before the supervisor runs (it releases it itself after)."""
    if sup.lock is not None:
        sup.lock.release()


def preflight(ctx: typer.Context, files: RunConfigFiles = None, as_json: JsonFlag = False) -> None:
    """Check the machine for a run in seconds: open files, CUDA, disk, ports, secrets, memory fit.

    Exit 0 when every check passes or warns, 78 when one fails.

    Examples:

      prime-train preflight configs/tiny-sft.toml

      prime-train preflight my-job.toml --json
    """
    from prime_train.validator.preflight import preflight_command

    raise typer.Exit(preflight_command(load_run_config(files, ctx.args), as_json=as_json))


def profile(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Steps recorded under torch.profiler.")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Steps run first and not counted.")] = 2,
    as_json: JsonFlag = False,
) -> None:
    """Run a few real steps under torch.profiler and name the bottleneck, with the evidence.

    Times data wait, forward, backward, optimizer, communication and one checkpoint save (for RL:
    rollout latency against trainer time), writes a Chrome trace, and says what to change. Runs in
    <output_dir>/<name>-profile: the real run's directory is not touched.

    Examples:

      prime-train profile configs/tiny-sft.toml

      prime-train profile configs/tiny-rl.toml --steps 3 --json
    """
    from prime_train.resilience.profile import profile as profiled_run

    cfg = load_run_config(files, ctx.args)
    if cfg.job.command:
        raise CliError("profile runs the embedded engine; [job].command is set", ExitCode.CONFIG)
    require_engine(cfg)
    # with --json, stdout is the summary alone: the live status goes to stderr
    code, summary = profiled_run(cfg, warmup=warmup, steps=steps, console=output.console(stderr=as_json))
    output.emit(summary, as_json, lambda console: render_profile(summary, console))
    raise typer.Exit(code)


def render_profile(summary: dict, console: Console) -> None:
    """Where a profiled step's time goes, phase by phase, then the bottleneck with its evidence and advice."""
    from rich.table import Table

    literal = output.literal
    table = Table(title=literal(f"where a step goes ({summary['profiled_steps']} profiled steps, {summary['device']})"))
    table.add_column("phase")
    table.add_column("seconds / step", justify="right")
    table.add_column("share", justify="right")
    for phase, seconds in summary["phases_s"].items():
        share = summary["shares"].get(phase, 0.0)
        table.add_row(literal(phase), f"{seconds:.4f}", f"{share:.0%}")
    table.add_row(literal("step", "bold"), literal(f"{summary['step_s']:.4f}", "bold"), "100%")
    console.print(table)
    extra = [f"{summary['tokens_per_s']:,.0f} tokens/s"]
    if summary.get("mfu") is not None:
        extra.append(f"MFU {summary['mfu']:.1%}")
    if summary.get("communication_in_trace_s"):
        extra.append(f"collectives in the trace {summary['communication_in_trace_s']:.4f}s/step")
    if summary.get("checkpoint_save_s") is not None:
        extra.append(f"one checkpoint save {summary['checkpoint_save_s']:.2f}s")
    if summary.get("rollout_latency_s") is not None:
        extra.append(f"rollout batch latency {summary['rollout_latency_s']:.2f}s")
    console.print(literal(" · ".join(extra)))
    b = summary["bottleneck"]
    console.print(literal(f"bottleneck: {b['kind']}", "bold"))
    console.print(literal(f"  evidence: {b['evidence']}"))
    console.print(literal(f"  change:   {b['advice']}"))
    for note in b.get("notes", []):
        console.print(literal(f"  note:     {note}"))
    if summary.get("trace"):
        console.print(literal(f"Chrome trace: {summary['trace']} (chrome://tracing or ui.perfetto.dev)"))
    if str(summary.get("device", "")).startswith("cuda"):
        console.print(
            literal("(phase timers synchronise the GPU, so a profiled step is a little slower than a normal one)")
        )
