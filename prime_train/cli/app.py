"""The `prime-train` command tree: every command and group, in the order `--help` lists them.

A command parses its arguments, calls one function of the package, and prints through
prime_train/cli/output.py. The root group (`PrimeTrainGroup`) does the two things every command needs:
it runs each command under the one error handler (prime_train/cli/errors.py), and it makes every help
text literal, so `[spot]` in a docstring is shown as `[spot]` instead of being taken for rich markup.

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
    """The root command group: literal help text everywhere below it, and the error handler around every command."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        # typer builds the whole tree (fresh objects) before the root, so one walk escapes each help text once
        _escape_help(self)

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


def _escape_help(command: Any) -> None:
    """Escape rich markup in the help of `command`, its parameters and every command below it."""
    from rich.markup import escape

    for attr in ("help", "short_help", "epilog"):
        text = getattr(command, attr, None)
        if text:
            setattr(command, attr, escape(text))
    for param in command.params:
        if getattr(param, "help", None):
            param.help = escape(param.help)  # type: ignore[attr-defined]
    for sub in getattr(command, "commands", {}).values():
        _escape_help(sub)


app = typer.Typer(
    name="prime-train",
    cls=PrimeTrainGroup,
    help="Keeps LLM training jobs alive and says why they die.",
    no_args_is_help=True,
    rich_markup_mode="rich",
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
