"""The `prime-train` command line: parse, call one function, print.

Heavy modules (torch, transformers, wandb, boto3) are imported inside the commands that need
them, so `--help`, `lint` and `config` stay fast on a laptop without a GPU.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from prime_train import __version__

OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}
RunConfigFiles = Annotated[
    # str, not Path: click also hands `--key value` overrides through here, and Path("s3://b/x") would become "s3:/b/x"
    Optional[list[str]], typer.Argument(help="Config files merged in order; none: the tiny CPU default.")
]

app = typer.Typer(
    name="prime-train",
    help="Keeps LLM training jobs alive and says why they die.",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Show and compare resolved run configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")


def _console(stderr: bool = False):
    from rich.console import Console

    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def _error(message: object) -> None:
    """`error: <message>` on stderr, the message printed as is (no rich markup inside it)."""
    from rich.text import Text

    _console(stderr=True).print(Text.assemble(("error", "red"), ": ", str(message)))


def _split_overrides(files: list[str] | list[Path] | None, extra: list[str]) -> tuple[list[str], list[str]]:
    """Click hands unknown `--section.key` options to the file list; everything from the first one on is overrides."""
    tokens = [str(f) for f in files or []] + list(extra)
    for i, token in enumerate(tokens):
        if token.startswith("--"):
            return tokens[:i], tokens[i:]
    return tokens, []


def _print_problems(problems, stream=None) -> None:
    console = _console(stderr=True)
    for p in problems:
        colour = "red" if p.severity == "error" else "yellow"
        where = p.file if p.line <= 0 else f"{p.file}:{p.line}:{p.column}"
        console.print(f"[bold]{where}[/bold]: [{colour}]{p.severity}[/{colour}]: ", end="")
        console.print(p.message, markup=False, highlight=False)


def _load(files: list[str], overrides: list[str]):
    """Load and check a config for a command; on mistakes print them and exit 78 (config error)."""
    from prime_train.config.loader import ConfigError
    from prime_train.validator.lint import load_checked

    try:
        return load_checked(files, overrides)
    except ConfigError as exc:
        _print_problems(exc.problems)
        raise typer.Exit(78) from None


def _require_engine(cfg) -> None:
    """The embedded engine needs the `engine` extra; an external [job] command does not."""
    import importlib.util

    if cfg.job.command:
        return
    missing = [m for m in ("torch", "transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        _console(stderr=True).print(
            f"[red]error[/red]: the embedded engine needs {', '.join(missing)}: pip install 'prime-train[engine]' "
            "(on a machine without a GPU install torch's CPU build first, see the README)"
        )
        raise typer.Exit(78)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"prime-train {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
) -> None:
    """Keeps LLM training jobs alive and says why they die."""


@app.command(context_settings=OVERRIDES)
def lint(
    ctx: typer.Context,
    files: Annotated[list[str], typer.Argument(help="Config files; each is linted on its own unless --merge.")],
    merge: Annotated[bool, typer.Option("--merge", help="Lint the files as one config merged in order.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Warnings fail too.")] = False,
    fmt: Annotated[str, typer.Option("--format", help="text or json.")] = "text",
) -> None:
    """Check run configs: every mistake with file:line:col, the key and what to do.

    Examples:

      prime-train lint configs/tiny-sft.toml

      prime-train lint base.toml overlay.toml --merge --train.max_steps 50

      prime-train lint --format json --strict configs/*.toml
    """
    from prime_train.validator.lint import has_errors, lint_files

    if fmt not in ("text", "json"):
        raise typer.BadParameter("--format is text or json", param_hint="--format")
    paths, overrides = _split_overrides(files, ctx.args)
    if not paths:
        raise typer.BadParameter("name at least one config file", param_hint="FILES")
    groups = [paths] if merge else [[p] for p in paths]
    problems = []
    for group in groups:
        found, _ = lint_files(group, overrides)
        problems.extend(found)
    if fmt == "json":
        typer.echo(json.dumps([p.to_dict() for p in problems], indent=2))
    else:
        _print_problems(problems)
        if not problems:
            _console().print(f"[green]ok[/green]: {len(paths)} file(s), no problems")
    raise typer.Exit(1 if has_errors(problems, strict) else 0)


@config_app.command("show", context_settings=OVERRIDES)
def config_show(
    ctx: typer.Context,
    files: Annotated[Optional[list[str]], typer.Argument(help="Config files merged in order.")] = None,
) -> None:
    """Print the resolved config (defaults, files and overrides merged) as TOML.

    Examples:

      prime-train config show configs/tiny-sft.toml

      prime-train config show base.toml overlay.toml --train.lr 3e-4
    """
    from prime_train.config.loader import dump_toml

    cfg = _load(*_split_overrides(files, ctx.args))
    sys.stdout.write(dump_toml(cfg))


@config_app.command("diff")
def config_diff(
    a: Annotated[Path, typer.Argument(help="First config.")],
    b: Annotated[Path, typer.Argument(help="Second config.")],
    fmt: Annotated[str, typer.Option("--format", help="table or json.")] = "table",
) -> None:
    """Show what differs between two resolved configs: changed, added and removed fields.

    Exit 0 when they are the same, 1 when they differ.

    Examples:

      prime-train config diff configs/tiny-sft.toml runs/tiny/config.toml
    """
    from rich.table import Table

    from prime_train.config.diff import diff
    from prime_train.config.loader import to_toml_dict

    changes = diff(to_toml_dict(_load([str(a)], [])), to_toml_dict(_load([str(b)], [])))
    if fmt == "json":
        typer.echo(json.dumps([c.__dict__ for c in changes], indent=2, default=str))
        raise typer.Exit(1 if changes else 0)
    console = _console()
    if not changes:
        console.print("[green]same[/green]: no differences")
        raise typer.Exit(0)
    table = Table(title=f"{a} → {b}")
    table.add_column("key", style="bold")
    table.add_column(str(a))
    table.add_column(str(b))
    table.add_column("")
    style = {"changed": "yellow", "added": "green", "removed": "red"}
    for c in changes:
        old = "" if c.kind == "added" else repr(c.old)
        new = "" if c.kind == "removed" else repr(c.new)
        table.add_row(c.key, old, new, f"[{style[c.kind]}]{c.kind}[/{style[c.kind]}]")
    console.print(table)
    raise typer.Exit(1)


def default_config() -> str:
    """The tiny CPU config shipped inside the package: what runs when no config is given."""
    return str(Path(__file__).parent / "configs" / "tiny-sft.toml")


@app.command(context_settings=OVERRIDES)
def train(
    ctx: typer.Context,
    files: RunConfigFiles = None,
) -> None:
    """Run the embedded training engine directly, without supervision (torchrun when several processes).

    Writes the resolved config to <output_dir>/<name>/config.toml and trains. Exit codes: 0 done,
    75 checkpointed and stopped on SIGTERM/Ctrl-C, 78 configuration error.

    Examples:

      prime-train train

      prime-train train configs/tiny-sft.toml --train.max_steps 50

      prime-train train configs/tiny-sft.toml --distributed.nproc_per_node 2 --distributed.strategy fsdp
    """
    from prime_train.launch import train_directly

    paths, overrides = _split_overrides(files, ctx.args)
    cfg = _load(paths or [default_config()], overrides)
    _require_engine(cfg)
    raise typer.Exit(train_directly(cfg))


@app.command(context_settings=OVERRIDES)
def run(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    skip_preflight: Annotated[bool, typer.Option("--skip-preflight", help="Launch even if preflight fails.")] = False,
    verbose_vllm: Annotated[bool, typer.Option("--verbose-vllm", help="Stream inference worker logs whole.")] = False,
    spot: Annotated[bool, typer.Option("--spot", help="Launch as a SkyPilot managed job from [spot].")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="With --spot: print the SkyPilot task, launch nothing.")
    ] = False,
) -> None:
    """Run a job under supervision: preflight, launch, watch, and resume after failures.

    Exit codes: 0 done, 1 failed (restarts exhausted or not retryable), 75 checkpointed and
    stopped on request, 78 configuration error.

    With --spot the job runs on cloud instances instead, as a SkyPilot managed job that runs
    `prime-train run` on each node and is recovered after preemptions (see `prime-train spot`).

    Examples:

      prime-train run

      prime-train run configs/tiny-sft.toml --train.max_steps 100

      prime-train run my-job.toml --supervisor.max_restarts 10

      prime-train run --spot configs/examples/spot.toml --dry-run
    """
    import signal

    from prime_train.resilience.console import ConsoleObserver, summary_table
    from prime_train.resilience.supervisor import Supervisor, SupervisorOptions
    from prime_train.validator.preflight import preflight_command

    paths, overrides = _split_overrides(files, ctx.args)
    if spot:
        raise typer.Exit(_run_spot(paths, overrides, dry_run))
    if dry_run:
        raise typer.BadParameter("--dry-run goes with --spot", param_hint="--dry-run")
    cfg = _load(paths or [default_config()], overrides)
    _require_engine(cfg)
    console = _console()
    if not skip_preflight:
        code = preflight_command(cfg, as_json=False, quiet_pass=True)
        if code != 0:
            console.print("[red]preflight failed[/red]: fix the above, or pass --skip-preflight")
            raise typer.Exit(code)
    console.print(f"[bold cyan]prime-train[/bold cyan]: run directory {cfg.run_dir}", highlight=False)
    with ConsoleObserver(console) as observer:
        sup = Supervisor(cfg, observer, SupervisorOptions(verbose_inference=verbose_vllm))
        interrupts = {"n": 0}

        def on_signal(signum, frame):
            interrupts["n"] += 1
            if interrupts["n"] > 1 and signum == signal.SIGINT:
                raise KeyboardInterrupt
            sup.request_stop(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        code = sup.run()
    console.print(summary_table(sup))
    from prime_train.resilience.console import final_results

    for line in final_results(sup.run_dir):
        console.print(line, highlight=False)
    raise typer.Exit(code)


def _run_spot(paths: list[str], overrides: list[str], dry_run: bool) -> int:
    """`run --spot`: the [spot] task, checked by lint and by SkyPilot's own schema, launched as a managed job."""
    from prime_train.integrations import skypilot
    from prime_train.validator.lint import has_errors, lint_files

    if not paths:
        raise typer.BadParameter("name the run's config files: they are copied to the nodes", param_hint="FILES")
    problems, cfg = lint_files(paths, overrides, spot=True)  # SkyPilot's limits whether or not [spot] was written
    _print_problems(problems)
    if cfg is None or has_errors(problems):
        return 78
    task = skypilot.task_from_config(cfg, config_files=paths, overrides=overrides)
    err = _console(stderr=True)
    try:
        python = skypilot.find_sky_python(required=False)
    except skypilot.SkyPilotNotFound as exc:
        _error(exc)
        return 2
    if python is None:
        if dry_run:
            print(skypilot.render_yaml(task).rstrip("\n"))
            err.print("[yellow]note[/yellow]: not checked against SkyPilot's schema: `prime-train spot install` first")
            return 0
        err.print("[red]error[/red]: SkyPilot is not installed: `prime-train spot install` (it gets its own venv)")
        return 2
    try:
        result = skypilot.launch(task, python, dry_run=dry_run)
    except skypilot.SkyPilotError as exc:
        _error(exc)
        return 1
    if dry_run:
        print(result["yaml"].rstrip("\n"))
        err.print(f"checked with SkyPilot {skypilot.sky_version(python)}: valid; nothing launched", highlight=False)
        return 0
    for name in result["missing_secrets"]:
        err.print(f"[yellow]warning[/yellow]: {name} is not set here, so the job does not get it", highlight=False)
    err.print(f"launched managed job {result['name']} {result['job_ids']}; follow it: prime-train spot logs "
              f"{' '.join(paths)}", highlight=False)  # fmt: skip
    return 0


spot_app = typer.Typer(help="SkyPilot managed jobs started by `run --spot`: install, status, logs, cancel.")
app.add_typer(spot_app, name="spot")


def _spot_name(files: list[str] | None, name: str | None) -> str:
    from prime_train.integrations.skypilot import job_name

    if name:
        return name
    if not files:
        raise typer.BadParameter("give the run's config files or --name", param_hint="FILES")
    paths, overrides = _split_overrides(files, [])
    return job_name(_load(paths, overrides))


def _sky_python() -> str:
    from prime_train.integrations.skypilot import SkyPilotNotFound, find_sky_python

    try:
        return find_sky_python()
    except SkyPilotNotFound as exc:
        _error(exc)
        raise typer.Exit(2) from None


SpotFiles = Annotated[Optional[list[str]], typer.Argument(help="The run's config files (the job name is in them).")]
SpotName = Annotated[Optional[str], typer.Option("--name", help="Managed job name instead of config files.")]


@spot_app.command("install")
def spot_install(
    version: Annotated[str, typer.Option(help="pip requirement of SkyPilot.")] = "skypilot==0.14.1",
    prefix: Annotated[Optional[Path], typer.Option(help="Venv directory; default: the managed one.")] = None,
) -> None:
    """Install SkyPilot in a venv of its own (it pins click<8.2, which wandb refuses) and use it from then on.

    Examples:

      prime-train spot install

      prime-train spot install --version 'skypilot[aws,gcp]==0.14.1'
    """
    from prime_train.integrations.skypilot import SkyPilotError, install_skypilot

    try:
        python = install_skypilot(prefix, version)
    except SkyPilotError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    _console().print(f"SkyPilot installed: {python}", highlight=False)


@spot_app.command("status")
def spot_status_cmd(
    files: SpotFiles = None, name: SpotName = None, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """The managed job's status, recoveries and failure reason (exit 1 when there is no such job).

    Examples:

      prime-train spot status configs/examples/spot.toml

      prime-train spot status --name qwen-sft-spot --json
    """
    from prime_train.integrations.skypilot import SkyPilotError, spot_status

    job = _spot_name(files, name)
    try:
        info = spot_status(job, _sky_python())
    except SkyPilotError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    if as_json:
        print(json.dumps(info, indent=2, default=str))
    elif info is None:
        _console().print(f"no managed job called {job}")
    else:
        _console().print(
            f"{job}: {info['status']} · recoveries {info.get('recovery_count', 0)} · "
            f"failures in 24 h {info.get('recent_failures', 0)}"
            + (f" · {info['failure_reason']}" if info.get("failure_reason") else ""),
            highlight=False,
        )
    raise typer.Exit(0 if info is not None else 1)


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
    from prime_train.integrations.skypilot import SkyPilotError, spot_logs

    try:
        code = spot_logs(_spot_name(files, name), _sky_python(), follow=follow, tail=tail)
    except SkyPilotError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    raise typer.Exit(code or 0)


@spot_app.command("cancel")
def spot_cancel_cmd(files: SpotFiles = None, name: SpotName = None) -> None:
    """Cancel the managed job (SkyPilot tears its instances down; the bucket keeps the checkpoints).

    Examples:

      prime-train spot cancel configs/examples/spot.toml

      prime-train spot cancel --name qwen-sft-spot
    """
    from prime_train.integrations.skypilot import SkyPilotError, spot_cancel

    job = _spot_name(files, name)
    try:
        cancelled = spot_cancel(job, _sky_python())
    except SkyPilotError as exc:
        _error(exc)
        raise typer.Exit(1) from None
    _console().print(f"{job}: {'cancelled' if cancelled else 'nothing in progress'}")


@app.command(context_settings=OVERRIDES)
def monitor(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    resume: Annotated[bool, typer.Option("--resume", help="Relaunch the managed job when it is dead.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the decision as JSON.")] = False,
) -> None:
    """Is a spot run healthy, stalled or dead? From its heartbeat in the bucket, SkyPilot and W&B.

    Decided on wall-clock time: a checkpoint being saved is not a stall, and W&B's own lag is not
    one either. With --resume a dead run is relaunched (it resumes from the bucket's newest
    checkpoint). Exit codes: 0 healthy or finished, 2 unknown or configuration error, 3 stalled,
    4 dead. `.github/workflows/training-monitor.yml` runs this on a schedule.

    Examples:

      prime-train monitor configs/examples/spot.toml

      prime-train monitor configs/examples/spot.toml --resume --json
    """
    from prime_train.integrations.monitor import MonitorConfigError, run_monitor
    from prime_train.integrations.skypilot import SkyPilotNotFound

    paths, overrides = _split_overrides(files, ctx.args)
    if not paths:
        raise typer.BadParameter("name the run's config files", param_hint="FILES")
    cfg = _load(paths, overrides)
    try:
        result = run_monitor(cfg, config_files=paths, overrides=overrides, resume=resume)
    except (MonitorConfigError, SkyPilotNotFound) as exc:
        _error(exc)
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        _console().print(result.format(), markup=False, highlight=False)
    raise typer.Exit(result.exit_code)


@app.command("verify-model")
def verify_model_cmd(
    model: Annotated[str, typer.Argument(help="HF model id, HF cache entry or local directory with config.json.")],
    job: Annotated[str, typer.Option(help="The job it is for: sft, pretrain or rl.")] = "rl",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """Can this model be used, before you pay: architecture, vLLM support, size, memory, tool calling.

    Reads config.json (and tokenizer_config.json) from a directory, the HF cache, or the hub when
    online. Exit 0 when usable for the job, 1 when not, 2 when its config cannot be found.

    Examples:

      prime-train verify-model Qwen/Qwen2.5-7B-Instruct

      prime-train verify-model runs/tiny-sft/final --job sft --json
    """
    from prime_train.validator.models import ModelConfigNotFound, render_report, verify_model

    try:
        report = verify_model(model, job=job)
    except ModelConfigNotFound as exc:
        if as_json:
            print(json.dumps({"ok": False, "error": str(exc)}))
        else:
            _error(exc)
        raise typer.Exit(2) from None
    except ValueError as exc:
        _error(exc)
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        render_report(report, _console())
    raise typer.Exit(0 if report.ok else 1)


models_app = typer.Typer(help="The tested-model registry shipped with prime-train.", no_args_is_help=True)
app.add_typer(models_app, name="models")


@models_app.command("list")
def models_list(as_json: Annotated[bool, typer.Option("--json", help="Print the registry as JSON.")] = False) -> None:
    """Models with the vLLM and transformers versions they were checked against, and their known issues.

    Examples:

      prime-train models list

      prime-train models list --json
    """
    from prime_train.validator.registry import models_json, render_models

    if as_json:
        print(json.dumps(models_json(), indent=2))
    else:
        render_models(_console())


@app.command(context_settings=OVERRIDES)
def memory(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    model: Annotated[Optional[str], typer.Option(help="Without a config: HF id, directory or config.json.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sequence.")] = None,
    micro_batch: Annotated[Optional[int], typer.Option(help="Sequences per forward/backward per GPU.")] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option(help="GPUs (trainer processes) per node.")] = None,
    nodes: Annotated[Optional[int], typer.Option(help="Nodes.")] = None,
    strategy: Annotated[Optional[str], typer.Option(help="none, ddp, zero1, zero2, zero3, fsdp or hsdp.")] = None,
    precision: Annotated[Optional[str], typer.Option(help="bf16 or fp32.")] = None,
    optimizer: Annotated[Optional[str], typer.Option(help="adamw, adamw8bit or sgd.")] = None,
    checkpointing: Annotated[
        Optional[str], typer.Option(help="Activation checkpointing: none, selective, full.")
    ] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="vLLM: longest sequence (turns on inference).")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(help="vLLM: sequences batched at once.")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(help="vLLM: its share of the GPU.")] = None,
    colocate: Annotated[Optional[bool], typer.Option(help="Trainer and vLLM on the same GPU.")] = None,
    gpu: Annotated[Optional[list[str]], typer.Option(help="GPUs to give a verdict for (repeatable).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON.")] = False,
) -> None:
    """Will it fit: per-GPU memory of the trainer (and vLLM), and a verdict for each common GPU.

    Weights, gradients and optimizer states by precision, optimizer and sharding strategy;
    activations by sequence length, micro-batch and checkpointing (Korthikanti et al. 2022); the
    KV cache of vLLM; a recommended split when both share one GPU.

    Examples:

      prime-train memory configs/tiny-sft.toml

      prime-train memory --model Qwen/Qwen2.5-7B-Instruct --seq-len 4096 --gpus-per-node 8 --strategy fsdp

      prime-train memory configs/tiny-rl.toml --colocate --gpu H100 --json
    """
    from prime_train.validator.memory import (
        MemoryInputError,
        estimate,
        inputs_from_config,
        inputs_from_flags,
        render_memory,
    )

    paths, overrides = _split_overrides(files, ctx.args)
    flags = {
        "seq_len": seq_len, "micro_batch": micro_batch, "gpus_per_node": gpus_per_node, "num_nodes": nodes,
        "strategy": strategy, "precision": precision, "optimizer": optimizer,
        "activation_checkpointing": checkpointing, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
        "gpu_memory_utilization": gpu_memory_utilization, "colocate": colocate, "gpus": gpu,
    }  # fmt: skip
    flags = {k: v for k, v in flags.items() if v is not None}
    try:
        if paths or overrides or model is None:
            cfg = _load(paths or [default_config()], overrides)
            inputs = inputs_from_config(cfg, **({"model": model} if model else {}), **flags)
        else:
            inputs = inputs_from_flags(model, **flags)
        report = estimate(inputs)
    except MemoryInputError as exc:
        _error(exc)
        raise typer.Exit(78) from None
    if as_json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        render_memory(report, _console())


@app.command(context_settings=OVERRIDES)
def cost(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    gpu: Annotated[Optional[str], typer.Option(help="One GPU type; default: every priced GPU.")] = None,
    num_gpus: Annotated[Optional[int], typer.Option(help="GPUs in all; default: from the config.")] = None,
    step_time: Annotated[Optional[float], typer.Option(help="Measured seconds per step on those GPUs.")] = None,
    measure: Annotated[
        bool, typer.Option("--measure", help="Measure the step time here with a short profile.")
    ] = False,
    mfu: Annotated[float, typer.Option(help="Model FLOPs utilisation assumed when estimating.")] = 0.4,
    prices: Annotated[Optional[Path], typer.Option(help="TOML/JSON file overriding the shipped prices.")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Steps; default: train.max_steps.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the estimate as JSON.")] = False,
) -> None:
    """What will it cost: steps × step time × GPU price, as a range, spot and on-demand side by side.

    The step time is estimated from FLOPs per token at a stated MFU, or given (--step-time), or
    measured on this machine by a short profile run (--measure; then use --gpu for this machine's
    GPU). Prices come from a shipped, dated table that --prices can override.

    Examples:

      prime-train cost configs/tiny-sft.toml --gpu H100

      prime-train cost my-run.toml --num-gpus 8 --mfu 0.35 --prices my-prices.toml --json
    """
    from prime_train.validator.cost import estimate_cost, render_cost
    from prime_train.validator.memory import MemoryInputError

    paths, overrides = _split_overrides(files, ctx.args)
    cfg = _load(paths or [default_config()], overrides)
    if measure:
        if step_time is not None:
            raise typer.BadParameter("--measure and --step-time exclude each other", param_hint="--measure")
        _require_engine(cfg)
        from prime_train.profile_run import ProfileFailed, profile

        try:
            _, summary = profile(cfg, warmup=1, steps=3, console=_console(stderr=True), preflight=False)
        except ProfileFailed as exc:
            _error(exc)
            raise typer.Exit(exc.code) from None
        step_time = summary["step_s"]
        _console(stderr=True).print(f"measured {step_time:.4f} s per step ({summary['device']})", highlight=False)
    try:
        report = estimate_cost(
            cfg, gpu=gpu, num_gpus=num_gpus, step_time_s=step_time, mfu=mfu,
            prices_file=str(prices) if prices else None, steps=steps,
        )  # fmt: skip
    except MemoryInputError as exc:
        _error(exc)
        raise typer.Exit(78) from None
    if as_json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        render_cost(report, _console())


@app.command(context_settings=OVERRIDES)
def profile(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Steps recorded under torch.profiler.")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", min=0, help="Steps run first and not counted.")] = 2,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Run a few real steps under torch.profiler and name the bottleneck, with the evidence.

    Times data wait, forward, backward, optimizer, communication and one checkpoint save (for RL:
    rollout latency against trainer time), writes a Chrome trace, and says what to change. Runs in
    <output_dir>/<name>-profile: the real run's directory is not touched.

    Examples:

      prime-train profile configs/tiny-sft.toml

      prime-train profile configs/tiny-rl.toml --steps 3 --json
    """
    from prime_train.profile_run import ProfileFailed, profile, render_profile, summary_json

    paths, overrides = _split_overrides(files, ctx.args)
    cfg = _load(paths or [default_config()], overrides)
    if cfg.job.command:
        _console(stderr=True).print("[red]error[/red]: profile runs the embedded engine; [job].command is set")
        raise typer.Exit(78)
    _require_engine(cfg)
    console = _console(stderr=as_json)
    try:
        code, summary = profile(cfg, warmup=warmup, steps=steps, console=console)
    except ProfileFailed as exc:
        _error(exc)
        raise typer.Exit(exc.code) from None
    if as_json:
        print(summary_json(summary))
    else:
        render_profile(summary, console)
    raise typer.Exit(code)


@app.command()
def init(
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write the config.")] = Path(
        "prime-train.toml"
    ),
    job: Annotated[Optional[str], typer.Option(help="sft, pretrain or rl.")] = None,
    model: Annotated[Optional[str], typer.Option(help="'tiny' (random-initialised, CPU), an HF id or a path.")] = None,
    hardware: Annotated[Optional[str], typer.Option(help="'cpu' or '<GPU>:<count>', e.g. H100:8.")] = None,
    nodes: Annotated[Optional[int], typer.Option(min=1, help="Nodes.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Run name.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(min=8, help="Tokens per sequence.")] = None,
    max_steps: Annotated[Optional[int], typer.Option(min=1, help="Optimizer steps.")] = None,
    environment: Annotated[Optional[str], typer.Option(help="RL environment.")] = None,
    dataset: Annotated[Optional[str], typer.Option(help="SFT/pretrain data: a local file, directory or glob.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Save without asking.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
) -> None:
    """Write a lint-clean run config by answering a few questions (job, model, hardware).

    Every question is also a flag; without a terminal nothing is asked and defaults fill the rest.

    Examples:

      prime-train init

      prime-train init --job rl --model Qwen/Qwen2.5-1.5B-Instruct --hardware H100:8 -o rl.toml --yes
    """
    import tempfile

    from rich.syntax import Syntax

    from prime_train.init_wizard import Answers, build_config, check_text

    console = _console()
    interactive = sys.stdin.isatty() and not yes
    a = Answers()

    def ask(value, prompt: str, default):
        if value is not None:
            return value
        if not interactive:
            return default
        return typer.prompt(prompt, default=default, type=type(default))

    a.job = ask(job, "Job (sft, pretrain, rl)", a.job)
    a.model = ask(model, "Model ('tiny', an HF id or a local path)", a.model)
    a.hardware = ask(hardware, "Hardware ('cpu' or GPU:count, e.g. H100:8)", a.hardware)
    a.nodes = ask(nodes, "Nodes", a.nodes)
    if a.job == "rl":
        a.environment = ask(environment, "RL environment", a.environment)
    a.name, a.seq_len, a.max_steps, a.dataset = name, seq_len, max_steps, dataset
    try:
        text = build_config(a)
    except ValueError as exc:
        _error(exc)
        raise typer.Exit(2) from None
    with tempfile.TemporaryDirectory() as tmp:
        problems = check_text(text, Path(tmp) / output.name)
    for p in problems:
        p.file = str(output)
    if console.is_terminal:
        console.print(Syntax(text, "toml", line_numbers=False, word_wrap=True))
    else:
        console.print(text, markup=False, highlight=False, end="")
    for note in a.notes:
        console.print(f"[yellow]note[/yellow]: {note}", highlight=False)
    if problems:
        _print_problems(problems)
        if any(p.severity == "error" for p in problems):
            console.print("[red]not saved[/red]: the generated config does not lint (a bug: please report it)")
            raise typer.Exit(1)
    if output.exists() and not force:
        _console(stderr=True).print(f"[red]error[/red]: {output} exists; pass --force to overwrite it")
        raise typer.Exit(1)
    if interactive and not typer.confirm(f"Save to {output}?", default=True):
        raise typer.Exit(1)
    output.write_text(text)
    console.print(f"[green]saved[/green] {output}; next: prime-train preflight {output}", highlight=False)


@app.command(context_settings=OVERRIDES)
def preflight(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list of checks.")] = False,
) -> None:
    """Check the machine for a run in seconds: open files, CUDA, disk, ports, secrets, memory fit.

    Examples:

      prime-train preflight configs/tiny-sft.toml

      prime-train preflight my-job.toml --json
    """
    from prime_train.validator.preflight import preflight_command

    paths, overrides = _split_overrides(files, ctx.args)
    cfg = _load(paths or [default_config()], overrides)
    raise typer.Exit(preflight_command(cfg, as_json=as_json))


@app.command()
def diagnose(
    paths: Annotated[list[Path], typer.Argument(help="Run directories or log files (any trainer's).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print findings as a JSON list.")] = False,
) -> None:
    """Find known failures in logs: OOM, NCCL timeouts, vLLM errors, tracebacks — with what to do.

    Exit 0 when nothing fatal is found, 1 when something is.

    Examples:

      prime-train diagnose runs/tiny-sft

      prime-train diagnose outputs/logs/trainer.log --json
    """
    from prime_train.resilience.diagnose import diagnose_command

    raise typer.Exit(diagnose_command([str(p) for p in paths], as_json))


@app.command()
def status(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (<output_dir>/<name>).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the state as JSON.")] = False,
) -> None:
    """Show a running or finished run: state, step, attempts, last failure, recent events.

    Examples:

      prime-train status runs/tiny-sft
    """
    from prime_train.resilience.status import status_command

    raise typer.Exit(status_command(run_dir, as_json))


@app.command()
def logs(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (<output_dir>/<name>).")],
    process: Annotated[str, typer.Option("--process", "-p", help="trainer, job, inference-0, …")] = "",
    attempt: Annotated[Optional[int], typer.Option("--attempt", help="Attempt number; default the latest.")] = None,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Last N lines; 0 for all.")] = 100,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
) -> None:
    """Print a run's process logs (the latest attempt unless --attempt).

    Examples:

      prime-train logs runs/tiny-sft

      prime-train logs runs/tiny-sft --process trainer --attempt 1 -n 0
    """
    from prime_train.resilience.status import logs_command

    raise typer.Exit(logs_command(run_dir, process, attempt, lines, follow))


ckpt_app = typer.Typer(help="Work with checkpoints.", no_args_is_help=True)
app.add_typer(ckpt_app, name="ckpt")


@ckpt_app.command("to-hf")
def ckpt_to_hf(
    step_dir: Annotated[Path, typer.Argument(help="A whole DCP checkpoint: <run>/checkpoints/step-N.")],
    out: Annotated[Path, typer.Argument(help="Output directory for the HF model (safetensors, config, tokenizer).")],
) -> None:
    """Convert a DCP checkpoint to HF format, loadable by transformers and vLLM.

    Examples:

      prime-train ckpt to-hf runs/tiny-sft/checkpoints/step-200 exported/
    """
    from prime_train.engine.export import dcp_to_hf

    try:
        dcp_to_hf(step_dir, out)
    except (FileNotFoundError, ValueError) as exc:
        _error(exc)
        raise typer.Exit(1) from None
    _console().print(f"[green]wrote[/green] {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
