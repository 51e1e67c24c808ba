"""What the commands share: config arguments with `--section.key value` overrides, loading a config, and flags."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from prime_train.cli.errors import CliError
from prime_train.contract import ExitCode

if TYPE_CHECKING:
    from prime_train.config.schema import Config

# Commands that take a config also take overrides: click hands the unknown `--train.lr 3e-4` to the file list.
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}
# str, not Path: click also hands `--key value` overrides through here, and Path("s3://b/x") would become "s3:/b/x"
RunConfigFiles = Annotated[
    Optional[list[str]], typer.Argument(help="Config files merged in order; none: the tiny CPU default.")
]
# The one spelling of "print machine-readable output" in every command.
JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON on stdout (one document) instead of the view.")]
# What the embedded engine imports; `require_engine` checks them before a long launch.
ENGINE_MODULES = ("torch", "transformers", "safetensors")


def split_overrides(files: list[str] | None, extra: list[str]) -> tuple[list[str], list[str]]:
    """(config files, overrides): everything from the first `--` token on is `--section.key value` overrides.

    A flag that is neither an option of the command nor an override (`--skpi-preflight`) is a usage mistake
    with the command's nearest options suggested, as click suggests them for commands without overrides."""
    tokens = [str(f) for f in files or []] + list(extra)
    reject_unknown_flags(tokens)
    for i, token in enumerate(tokens):
        if token.startswith("--"):
            return tokens[:i], tokens[i:]
    return tokens, []


def reject_unknown_flags(tokens: list[str]) -> None:
    """Raise click's NoSuchOption, with "did you mean", for a token that looks like a flag of the running command
    but is none: an override always names a section and a key (`--train.lr`), a flag never has a dot."""
    import difflib

    ctx = click_context()
    if ctx is None:
        return
    i = 0
    while i < len(tokens):
        token = tokens[i]
        name = token.split("=", 1)[0]
        if token.startswith("--") and "." in name:  # an override; its value follows unless written with =
            i += 1 if "=" in token else 2
            continue
        if token.startswith("-") and token != "-" and not _is_number(token):
            known = [o for p in ctx.command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
            near = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
            hint = f"; did you mean {' or '.join(near)}?" if near else f"; see `{ctx.command_path} --help`"
            no_such = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
            raise no_such(f"no such option: {name}{hint} (overrides name a section and a key: --train.lr 3e-4)", ctx)
        i += 1


def _is_number(text: str) -> bool:
    """Whether a token is a number ("-1e-4" is a value, not a flag); here, as the config loader is slow to import."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def click_context():
    """The running command's click context, or None outside a command."""
    from typer import _click  # typer carries its own click: its context is the one commands run in

    return _click.globals.get_current_context(silent=True)


def default_config() -> str:
    """The tiny CPU config shipped inside the package: what runs when no config is given."""
    return str(Path(__file__).resolve().parents[1] / "configs" / "tiny-sft.toml")


def load(files: list[str], overrides: list[str]) -> Config:
    """Load and lint a config for a command; its mistakes raise ConfigError (printed by the error handler, exit 78)."""
    from prime_train.validator.lint import load_checked

    return load_checked(files, overrides)


def load_run_config(files: list[str] | None, extra: list[str]) -> Config:
    """The config of a command's FILES and overrides; with no files, the shipped tiny one."""
    paths, overrides = split_overrides(files, extra)
    return load(paths or [default_config()], overrides)


def require_engine(cfg: Config) -> None:
    """The embedded engine needs the `engine` extra; an external [job] command does not."""
    if cfg.job.command:
        return
    missing = [m for m in ENGINE_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        raise CliError(
            f"the embedded engine needs {', '.join(missing)}: pip install 'prime-train[engine]' "
            "(on a machine without a GPU install torch's CPU build first, see the README)",
            ExitCode.CONFIG,
        )


def require_engine_modules(*extra: str) -> None:
    """78 naming the install command when torch/transformers (or `extra` modules, e.g. peft) are missing: commands
    that load a model (generate, chat, eval, data inspect) need the `engine` extra."""
    missing = [m for m in (*ENGINE_MODULES, *extra) if importlib.util.find_spec(m) is None]
    if missing:
        raise CliError(f"this command needs {', '.join(missing)}: pip install 'prime-train[engine]'", ExitCode.CONFIG)
