"""`run --spot`, `prime-train spot install|status|logs|cancel` and `prime-train monitor`: runs as SkyPilot managed jobs.

SkyPilot's failures (`SkyPilotError`: exit 1; not installed, `SkyPilotNotFound`: exit 78, bad input) and the
monitor's (`MonitorConfigError`: exit 78) reach the user through the CLI's error handler (prime_train/cli/errors.py);
a config that cannot become a managed job (`SpotConfigError`: no [spot] table, nothing to install) exits 78.
`prime-train spot recovery-gate` is the generated task's, run on the nodes around `prime-train run`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from prime_train.cli import output
from prime_train.cli.common import OVERRIDES, JsonFlag, RunConfigFiles, load, split_overrides
from prime_train.cli.errors import BAD_INPUT, CliError
from prime_train.contract import ExitCode

spot_app = typer.Typer(help="SkyPilot managed jobs started by `run --spot`: install, status, logs, cancel.")

SpotFiles = Annotated[Optional[list[str]], typer.Argument(help="The run's config files (the job name is in them).")]
SpotName = Annotated[Optional[str], typer.Option("--name", help="Managed job name instead of config files.")]


def run_spot(paths: list[str], overrides: list[str], dry_run: bool) -> int:
    """`run --spot`: the [spot] task, checked by lint and by SkyPilot's own schema, launched as a managed job."""
    from prime_train.integrations import skypilot
    from prime_train.validator.lint import has_errors, lint_files

    if not paths:
        raise typer.BadParameter("name the run's config files: they are copied to the nodes", param_hint="FILES")
    problems, cfg = lint_files(paths, overrides, spot=True)  # SkyPilot's limits whether or not [spot] was written
    if cfg is not None:
        try:  # before lint's findings: they would be about defaults nobody chose
            skypilot.require_spot_section(cfg)
        except skypilot.SpotConfigError as exc:
            raise CliError(exc, ExitCode.CONFIG) from None
    output.problems(problems)
    if cfg is None or has_errors(problems):
        return ExitCode.CONFIG
    try:
        task = skypilot.task_from_config(cfg, config_files=paths, overrides=overrides)
    except skypilot.SpotConfigError as exc:
        raise CliError(exc, ExitCode.CONFIG) from None
    python = skypilot.find_sky_python(required=False)
    if python is None:
        if not dry_run:
            raise CliError("SkyPilot is not installed: `prime-train spot install` (it gets its own venv)", BAD_INPUT)
        output.document(skypilot.render_yaml(task))
        output.note("not checked against SkyPilot's schema: `prime-train spot install` first")
        return ExitCode.OK
    result = skypilot.launch(task, python, dry_run=dry_run)
    if dry_run:
        output.document(result["yaml"])
        output.say(f"checked with SkyPilot {skypilot.sky_version(python)}: valid; nothing launched", stderr=True)
        return ExitCode.OK
    for name in result["missing_secrets"]:
        output.warning(f"{name} is not set here, so the job does not get it")
    follow = f"prime-train spot logs {' '.join(paths)}"
    output.say(f"launched managed job {result['name']} {result['job_ids']}; follow it: {follow}", stderr=True)
    return ExitCode.OK


def _job_name(files: list[str] | None, name: str | None) -> str:
    """The managed job's name: --name, else the one the run's config gives it."""
    from prime_train.integrations.skypilot import job_name

    if name:
        return name
    if not files:
        raise typer.BadParameter("give the run's config files or --name", param_hint="FILES")
    return job_name(load(*split_overrides(files, [])))


def _sky_python() -> str:
    from prime_train.integrations.skypilot import find_sky_python

    return find_sky_python()


@spot_app.command("install")
def spot_install(
    version: Annotated[str, typer.Option(help="pip requirement of SkyPilot.")] = "skypilot==0.14.1",
    prefix: Annotated[Optional[Path], typer.Option(help="Venv directory; default: the managed one.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Install SkyPilot in a venv of its own (it pins click<8.2, which wandb refuses) and use it from then on.

    --prefix must be new, empty, or a venv an earlier install made: anything else is refused (exit 78), untouched.

    Examples:

      prime-train spot install

      prime-train spot install --version 'skypilot[aws,gcp]==0.14.1'
    """
    from prime_train.integrations.skypilot import SKY_PYTHON_ENV, install_skypilot, managed_venv_dir
    from prime_train.retention import mark_venv, venv_prefix_problem

    where = Path(prefix) if prefix is not None else managed_venv_dir()
    if (problem := venv_prefix_problem(where, managed=where.absolute() == managed_venv_dir().absolute())) is not None:
        raise CliError(
            f"{problem}: nothing was installed.\nChoose a new or empty --prefix, or to use a SkyPilot you installed "
            f"yourself, set {SKY_PYTHON_ENV} to its Python.",
            BAD_INPUT,
        )
    where.mkdir(parents=True, exist_ok=True)
    mark_venv(where, "skypilot")  # first: a later install may update what this one made, even if it fails half way
    python = install_skypilot(where, version)
    output.done(as_json, {"python": str(python)}, f"SkyPilot installed: {python}")


@spot_app.command("status")
def spot_status_cmd(files: SpotFiles = None, name: SpotName = None, as_json: JsonFlag = False) -> None:
    """The managed job's status, recoveries and failure reason (exit 1 when there is no such job).

    Examples:

      prime-train spot status configs/examples/spot.toml

      prime-train spot status --name qwen-sft-spot --json
    """
    from prime_train.integrations.skypilot import spot_status

    job = _job_name(files, name)
    info = spot_status(job, _sky_python())
    output.emit(info, as_json, lambda console: _render_status(job, info))
    raise typer.Exit(ExitCode.OK if info is not None else ExitCode.FAILED)


def _render_status(job: str, info: dict | None) -> None:
    if info is None:
        output.say(f"no managed job called {job}")
        return
    reason = f" · {info['failure_reason']}" if info.get("failure_reason") else ""
    output.say(
        f"{job}: {info['status']} · recoveries {info.get('recovery_count', 0)} · "
        f"failures in 24 h {info.get('recent_failures', 0)}{reason}"
    )


@spot_app.command("logs")
def spot_logs_cmd(
    files: SpotFiles = None,
    name: SpotName = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep streaming.")] = False,
    tail: Annotated[Optional[int], typer.Option(help="Last N lines only.")] = None,
) -> None:
    """The managed job's logs (secrets scrubbed).

    Examples:

      prime-train spot logs configs/examples/spot.toml --tail 200

      prime-train spot logs --name qwen-sft-spot --follow
    """
    from prime_train.integrations.skypilot import spot_logs

    raise typer.Exit(spot_logs(_job_name(files, name), _sky_python(), follow=follow, tail=tail) or ExitCode.OK)


@spot_app.command("cancel")
def spot_cancel_cmd(files: SpotFiles = None, name: SpotName = None, as_json: JsonFlag = False) -> None:
    """Cancel the managed job (SkyPilot tears its instances down; the bucket keeps the checkpoints).

    Examples:

      prime-train spot cancel configs/examples/spot.toml

      prime-train spot cancel --name qwen-sft-spot
    """
    from prime_train.integrations.skypilot import spot_cancel

    job = _job_name(files, name)
    cancelled = spot_cancel(job, _sky_python())
    line = f"{job}: {'cancelled' if cancelled else 'nothing in progress'}"
    output.done(as_json, {"job": job, "cancelled": bool(cancelled)}, line)


@spot_app.command("recovery-gate", context_settings=OVERRIDES)
def spot_recovery_gate(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    exited: Annotated[
        Optional[int], typer.Option(help="`prime-train run` exited with this code: count it, then exit with it.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """On the nodes of a managed job: stop a job SkyPilot would recover forever (spot.max_recoveries).

    The task `run --spot` generates runs it before `prime-train run` (exit 1 when this job already gave up) and
    after it with --exited CODE: a code in spot.recover_on_exit_codes is counted by node 0 in the bucket
    (ckpt.remote, or the checkpoint directory spot.ckpt_mount mounts), and more than spot.max_recoveries in a row
    without a new checkpoint end the job with exit 1 instead of CODE. Needs SKYPILOT_TASK_ID (set by SkyPilot);
    elsewhere it only passes CODE through.

    Examples:

      prime-train spot recovery-gate configs/examples/spot.toml

      prime-train spot recovery-gate configs/examples/spot.toml --exited 75
    """
    import os

    from prime_train.integrations.storage import CheckpointStore, DirectoryRecoveries, StorageError, recovery_gate

    paths, overrides = split_overrides(files, ctx.args)
    cfg = load(paths, overrides)
    passed = ExitCode.OK if exited is None else exited
    task_id = os.environ.get("SKYPILOT_TASK_ID", "")
    # the bucket (ckpt.remote), else the shared checkpoint directory SkyPilot mounts at ckpt.dir (spot.ckpt_mount)
    mounted = cfg.spot.ckpt_mount is not None and cfg.ckpt.dir is not None
    if not (cfg.ckpt.remote or mounted) or not task_id:
        if exited is None:
            why = (
                "no ckpt.remote or spot.ckpt_mount to count them in"
                if task_id
                else "not on a SkyPilot node (no SKYPILOT_TASK_ID)"
            )
            output.note(f"recoveries are not counted: {why}; SkyPilot recovers exit codes "
                        f"{sorted(cfg.spot.recover_on_exit_codes)} without limit")  # fmt: skip
        if as_json:
            output.print_json({"ok": True, "exit_code": passed, "counted": False})
        raise typer.Exit(passed)
    try:
        store = (
            CheckpointStore(cfg.ckpt.remote, endpoint_url=cfg.ckpt.remote_endpoint_url)
            if cfg.ckpt.remote
            else DirectoryRecoveries(cfg.layout.checkpoints_dir)
        )
        why = recovery_gate(
            store, task_id=task_id, max_recoveries=cfg.spot.max_recoveries, exit_code=exited,
            recover_codes=cfg.spot.recover_on_exit_codes, count=os.environ.get("SKYPILOT_NODE_RANK", "0") == "0",
        )  # fmt: skip
    except StorageError as exc:  # a bucket that does not answer must not stop training: the count is lost
        output.warning(f"recoveries not counted: {exc}")
        raise typer.Exit(passed) from None
    if why is not None:
        output.error(why)
        output.failure_json(why, ExitCode.FAILED)
        raise typer.Exit(ExitCode.FAILED)
    if as_json:
        output.print_json({"ok": True, "exit_code": passed})
    raise typer.Exit(passed)


def monitor(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    resume: Annotated[bool, typer.Option("--resume", help="Relaunch the managed job when it is dead.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Is a spot run healthy, stalled or dead? From its heartbeat in the bucket, SkyPilot and W&B.

    Decided on wall-clock time: a checkpoint being saved is not a stall, and W&B's own lag is not
    one either. With --resume a dead run is relaunched (it resumes from the bucket's newest
    checkpoint). Exit codes: 0 healthy or finished, 2 unknown, 3 stalled, 4 dead, 78 a configuration
    error. `.github/workflows/training-monitor.yml` runs this on a schedule.

    Examples:

      prime-train monitor configs/examples/spot.toml

      prime-train monitor configs/examples/spot.toml --resume --json
    """
    from prime_train.integrations.monitor import run_monitor

    paths, overrides = split_overrides(files, ctx.args)
    if not paths:
        raise typer.BadParameter("name the run's config files", param_hint="FILES")
    result = run_monitor(load(paths, overrides), config_files=paths, overrides=overrides, resume=resume)
    output.emit(result, as_json, lambda console: output.say(result.format()))
    raise typer.Exit(result.exit_code)
