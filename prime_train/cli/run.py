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
from prime_train.contract import ExitCode

if TYPE_CHECKING:
    from collections.abc import Callable

    from rich.console import Console

    from prime_train.resilience.service import Reporter, RunOutcome


# run and train re-run a run directory alike (resilience/rerun.py)
FreshFlag = Annotated[
    bool, typer.Option("--fresh", help="Start over: the run directory's old outputs move to previous/<time>/ first.")
]
ResumeFlag = Annotated[bool, typer.Option("--resume", help="Train a finished run on (after raising train.max_steps).")]


def _one_of(fresh: bool, resume: bool) -> None:
    if fresh and resume:
        raise typer.BadParameter("--fresh starts over, --resume trains on: one or the other", param_hint="--fresh")


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
    from prime_train.resilience.service import Reporter, RunRequest, RunService

    _one_of(fresh, resume)
    cfg = load_run_config(files, ctx.args)
    require_engine(cfg)
    service = RunService(cfg, RunRequest(fresh=fresh, resume=resume), Reporter(say=_sayer(output.console())))
    raise typer.Exit(_served(service.train).exit_code)


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
    paths, overrides = split_overrides(files, ctx.args)  # first: a mistyped flag is told before the imports
    from prime_train.resilience.service import RunRequest, RunService

    if spot:
        from prime_train.cli.spot import run_spot

        raise typer.Exit(run_spot(paths, overrides, dry_run))
    if dry_run:
        raise typer.BadParameter("--dry-run goes with --spot", param_hint="--dry-run")
    _one_of(fresh, resume)
    cfg = load(paths or [default_config()], overrides)
    require_engine(cfg)
    console = output.console(stderr=as_json)  # with --json, stdout is the outcome document alone
    request = RunRequest(fresh=fresh, resume=resume, skip_preflight=skip_preflight, verbose_inference=verbose_vllm)
    outcome = _served(RunService(cfg, request, _run_reporter(console, as_json)).supervise)
    _print_outcome(outcome, console, as_json)
    raise typer.Exit(outcome.exit_code)


def _served(call: Callable[[], RunOutcome]) -> RunOutcome:
    """What the run service came to; a run it refused ends as `error: <why>` with the refusal's exit code."""
    from prime_train.resilience.service import RunRefused

    try:
        return call()
    except RunRefused as exc:  # another owner, --fresh that would not start over (78); an old run that cannot move
        raise CliError(exc, exc.code) from None


def _sayer(console: Console) -> Callable[[str], None]:
    """The service's lines, as they are (a path may hold brackets)."""
    return lambda text: console.print(output.literal(text), highlight=False, soft_wrap=True)


def _run_reporter(console: Console, as_json: bool) -> Reporter:
    """`run`'s console: the service's lines, preflight's failures and warnings, and the supervisor's live view."""
    from prime_train.resilience.console import ConsoleObserver
    from prime_train.resilience.service import Reporter
    from prime_train.validator.preflight import preflight_command

    def starting(run_dir: str) -> None:
        console.print(output.literal("prime-train", "bold cyan") + output.literal(f": run directory {run_dir}"))

    observer = ConsoleObserver(console, quiet=output.MODE.quiet)
    return Reporter(
        say=_sayer(console),
        starting=starting,
        preflight=lambda cfg: preflight_command(cfg, as_json=False, quiet_pass=True, stderr=as_json),
        observer=observer,
        live=observer,
    )


def _print_outcome(outcome: RunOutcome, console: Console, as_json: bool) -> None:
    """How `run` ended: preflight's refusal, or the summary table and the final figures; with --json, the outcome
    document on stdout."""
    if outcome.preflight_failed:
        output.labelled("preflight failed", "fix the above, or pass --skip-preflight", style="red", stderr=as_json)
        output.failure_json("preflight failed: fix what it says, or pass --skip-preflight", outcome.exit_code)
        return
    if outcome.supervisor is not None:
        from prime_train.resilience.console import summary_table

        console.print(summary_table(outcome.supervisor))
        for line in outcome.results:
            console.print(output.literal(line), highlight=False)
    if as_json:
        output.print_json(outcome.to_dict())


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
