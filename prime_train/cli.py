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
    from prime_train.engine_launch import train_directly

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
) -> None:
    """Run a job under supervision: preflight, launch, watch, and resume after failures.

    Exit codes: 0 done, 1 failed (restarts exhausted or not retryable), 75 checkpointed and
    stopped on request, 78 configuration error.

    Examples:

      prime-train run

      prime-train run configs/tiny-sft.toml --train.max_steps 100

      prime-train run my-job.toml --supervisor.max_restarts 10
    """
    import signal

    from prime_train.resilience.console import ConsoleObserver, summary_table
    from prime_train.resilience.supervisor import Supervisor, SupervisorOptions
    from prime_train.validator.preflight import preflight_command

    paths, overrides = _split_overrides(files, ctx.args)
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
    from prime_train.profile_run import profile_config, render_profile, run_profile, summary_json
    from prime_train.resilience.console import ConsoleObserver

    paths, overrides = _split_overrides(files, ctx.args)
    cfg = _load(paths or [default_config()], overrides)
    if cfg.job.command:
        _console(stderr=True).print("[red]error[/red]: profile runs the embedded engine; [job].command is set")
        raise typer.Exit(78)
    _require_engine(cfg)
    console = _console(stderr=as_json)
    from prime_train.validator.preflight import preflight_command

    pcfg = profile_config(cfg, warmup, steps)
    code = preflight_command(pcfg, as_json=False, quiet_pass=True, stderr=as_json)
    if code != 0:
        console.print("[red]preflight failed[/red]: fix the above first")
        raise typer.Exit(code)
    with ConsoleObserver(console) as observer:
        code, summary, root = run_profile(pcfg, warmup=warmup, steps=steps, observer=observer)
    if summary is None:
        _console(stderr=True).print(
            f"[red]error[/red]: the profiled job wrote no summary (exit {code}); see {root}/logs/latest"
        )
        raise typer.Exit(code or 1)
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
        _console(stderr=True).print(f"[red]error[/red]: {exc}", highlight=False)
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
        _console(stderr=True).print(f"[red]error[/red]: {exc}")
        raise typer.Exit(1) from None
    _console().print(f"[green]wrote[/green] {out}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
