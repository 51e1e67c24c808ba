"""The `prime-train` command tree: every command and group, in the order `--help` lists them.

A command parses its arguments, calls one function of the package, and prints through
prime_train/cli/output.py. The root group (`PrimeTrainGroup`) runs each command under the one error handler
(prime_train/cli/errors.py). Help is click's plain text (no rich markup), so `[spot]` in a docstring stays `[spot]`.

Command modules import only typer and this package at the top; what a command needs (the validator,
the supervisor, torch through the engine) is imported inside it, so `--help` and `lint` stay fast.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from typer.core import TyperGroup

from prime_train import __version__
from prime_train.cli import (
    ckpt,
    config,
    data,
    errors,
    evaluate,
    generate,
    hub,
    inference,
    init,
    output,
    pairs,
    plan,
    run,
    runs,
    spot,
    sweep,
    watch,
)
from prime_train.cli.common import OVERRIDES


class PrimeTrainGroup(TyperGroup):
    """The root command group: the error handler around every command, and examples in help kept as written."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        # typer builds the whole tree (fresh objects) before the root, so one walk marks each help text once
        _keep_indented_paragraphs(self)

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        # the root: one invocation begins (its output mode, -q/-v moved in front of the command to be parsed here)
        args = output.start(list(args)) if parent is None else args
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except errors.USAGE_ERRORS as exc:
            raise errors.usage(exc) from None

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            errors.handle(exc)


def _keep_indented_paragraphs(command: Any) -> None:
    """Mark each indented paragraph of a help text (the examples) with click's \\b, so that click's plain help does
    not rewrap it: an example broken at a hyphen (`my-\\nprices.toml`) cannot be copied."""
    text = getattr(command, "help", None)
    if text:
        paragraphs = text.split("\n\n")
        command.help = "\n\n".join(
            "\b\n" + p if p.strip() and all(line.startswith(" ") for line in p.splitlines() if line) else p
            for p in paragraphs
        )
    for sub in getattr(command, "commands", {}).values():
        _keep_indented_paragraphs(sub)


app = typer.Typer(
    name="prime-train",
    cls=PrimeTrainGroup,
    help="Keeps LLM training jobs alive and says why they die.",
    no_args_is_help=True,
    # plain click help: typer's rich help imports rich_utils and rich's markdown on every --help and usage error
    # (0.3 s of 0.5 s, bench/cli_startup.py), and shows a <bool> metavar beside every flag
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"prime-train {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version.")
    ] = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Results and problems only: no notes (any command, any position).")
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="More detail: a bug's traceback on stderr too (any command).")
    ] = False,
) -> None:
    """Keeps LLM training jobs alive and says why they die.

    Every command takes --json (one JSON document on stdout, errors too), -q and -v. Exit codes: 0 done,
    1 the outcome is bad (a failed run, a fatal finding, configs that differ), 75 stopped with a checkpoint,
    78 bad input (a config, flag, argument or path to fix; never retried).
    """
    output.MODE.quiet, output.MODE.verbose = quiet, verbose


# Commands that take config files also take `--section.key value` overrides (OVERRIDES).
app.command(context_settings=OVERRIDES)(config.lint)
app.add_typer(config.config_app, name="config")
app.command(context_settings=OVERRIDES)(run.train)
app.command(context_settings=OVERRIDES)(run.run)
app.command(context_settings=OVERRIDES)(sweep.sweep)
app.add_typer(spot.spot_app, name="spot")
app.add_typer(inference.inference_app, name="inference")
app.command(context_settings=OVERRIDES)(spot.monitor)
app.command("verify-model")(plan.verify_model)
app.add_typer(plan.models_app, name="models")
app.command(context_settings=OVERRIDES)(plan.memory)
app.command(context_settings=OVERRIDES)(plan.cost)
app.command(context_settings=OVERRIDES)(run.profile)
app.command("sample-pairs", context_settings=OVERRIDES)(pairs.sample_pairs)
app.command()(init.init)
app.command(context_settings=OVERRIDES)(run.preflight)
app.command()(watch.diagnose)
app.command()(watch.status)
app.command()(watch.logs)
app.command()(runs.runs)
app.command()(generate.generate)
app.command()(generate.chat)
app.command("eval", context_settings=OVERRIDES)(evaluate.evaluate)
app.add_typer(ckpt.ckpt_app, name="ckpt")
app.add_typer(data.data_app, name="data")
app.command()(hub.download)
app.command()(hub.push)


def main() -> None:
    """The `prime-train` console script and `python -m prime_train`."""
    app()
