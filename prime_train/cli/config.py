"""`prime-train lint` and `prime-train config show|diff`: check, print and compare run configs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from prime_train.cli import output
from prime_train.cli.common import OVERRIDES, JsonFlag, default_config, load, split_overrides
from prime_train.cli.errors import BAD_INPUT
from prime_train.contract import ExitCode

if TYPE_CHECKING:
    from rich.console import Console

config_app = typer.Typer(help="Show and compare resolved run configs.", no_args_is_help=True)


def _json_or_format(as_json: bool, fmt: str | None, human: str) -> bool:
    """Whether to print JSON: `--json`, or the older `--format json` (hidden, deprecated, kept for existing scripts)."""
    if fmt is None:
        return as_json
    if fmt not in (human, "json"):
        raise typer.BadParameter(f"--format is {human} or json (or use --json)", param_hint="--format")
    # on stderr: stdout stays the one JSON document the script reads
    output.warning(f"--format {fmt} is deprecated and will be removed: use {'--json' if fmt == 'json' else 'no flag'}")
    return as_json or fmt == "json"


def lint(
    ctx: typer.Context,
    files: Annotated[list[str], typer.Argument(help="Config files; each is linted on its own unless --merge.")],
    merge: Annotated[bool, typer.Option("--merge", help="Lint the files as one config merged in order.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Warnings fail too.")] = False,
    as_json: JsonFlag = False,
    fmt: Annotated[
        Optional[str], typer.Option("--format", hidden=True, help="Deprecated: text or json; use --json.")
    ] = None,
) -> None:
    """Check run configs (and SWEEP.toml files, by their [sweep]): every mistake with file:line:col, the key and
    what to do.

    Exit 0 when clean, 78 (bad input) when there are errors (or warnings with --strict).

    Examples:

      prime-train lint configs/tiny-sft.toml

      prime-train lint base.toml overlay.toml --merge --train.max_steps 50

      prime-train lint --json --strict configs/*.toml
    """
    from prime_train.sweep.spec import is_sweep_file, load_spec
    from prime_train.validator.lint import has_errors, lint_files

    as_json = _json_or_format(as_json, fmt, "text")
    paths, overrides = split_overrides(files, ctx.args)
    if not paths:
        raise typer.BadParameter("name at least one config file", param_hint="FILES")
    groups = [paths] if merge else [[p] for p in paths]
    problems = []
    for group in groups:
        if len(group) == 1 and is_sweep_file(group[0]):
            problems.extend(load_spec(group[0], overrides)[1])
            continue
        found, _ = lint_files(group, overrides)
        problems.extend(found)
    if as_json:
        output.print_json([p.to_dict() for p in problems])
    else:
        output.problems(problems, stderr=False)  # the findings are lint's result
        if not problems:
            output.success("ok", f"{len(paths)} file(s), no problems")
    raise typer.Exit(BAD_INPUT if has_errors(problems, strict) else ExitCode.OK)


@config_app.command("show", context_settings=OVERRIDES)
def config_show(
    ctx: typer.Context,
    files: Annotated[Optional[list[str]], typer.Argument(help="Config files merged in order.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Print the resolved config (defaults, files and overrides merged) as TOML (or JSON), every key: the unset
    ones as comments. With no file, the config `prime-train run` runs with no file (the tiny CPU default).

    Secret values are shown as ***, as a run directory's config.toml keeps them.

    Examples:

      prime-train config show

      prime-train config show configs/tiny-sft.toml

      prime-train config show base.toml overlay.toml --train.lr 3e-4
    """
    import tomllib

    from prime_train.config.show import with_unset_keys
    from prime_train.kit.redact import Redactor

    paths, overrides = split_overrides(files, ctx.args)
    cfg = load(paths or [default_config()], overrides)  # what `run` runs with the same arguments
    text = Redactor.for_run(cfg).masked_config(cfg).text  # secret values as ***, never printed
    if as_json:
        output.print_json(tomllib.loads(text))
        return
    sys.stdout.write(with_unset_keys(text, cfg))


@config_app.command("diff")
def config_diff(
    a: Annotated[Path, typer.Argument(help="First config.")],
    b: Annotated[Path, typer.Argument(help="Second config.")],
    as_json: JsonFlag = False,
    fmt: Annotated[
        Optional[str], typer.Option("--format", hidden=True, help="Deprecated: table or json; use --json.")
    ] = None,
) -> None:
    """Show what differs between two resolved configs: changed, added and removed fields.

    Exit 0 when they are the same, 1 when they differ.

    Examples:

      prime-train config diff configs/tiny-sft.toml runs/tiny/config.toml

      prime-train config diff base.toml tuned.toml --json
    """
    from prime_train.config.diff import diff
    from prime_train.config.loader import to_toml_dict

    as_json = _json_or_format(as_json, fmt, "table")
    changes = diff(to_toml_dict(load([str(a)], [])), to_toml_dict(load([str(b)], [])))
    output.emit([c.__dict__ for c in changes], as_json, lambda console: _render_diff(changes, a, b, console))
    raise typer.Exit(ExitCode.FAILED if changes else ExitCode.OK)


def _render_diff(changes: list, a: Path, b: Path, console: Console) -> None:
    from rich.table import Table

    if not changes:
        output.success("same", "no differences")
        return
    table = Table(title=output.literal(f"A: {a}\nB: {b}"), title_justify="left")
    # short headers (the paths are in the title): at 80 columns a path header would be cut, a key must not be
    table.add_column("key", style="bold", overflow="fold")
    table.add_column("A", overflow="fold")
    table.add_column("B", overflow="fold")
    table.add_column("", no_wrap=True)
    style = {"changed": "yellow", "added": "green", "removed": "red"}
    for c in changes:
        old = "" if c.kind == "added" else repr(c.old)
        new = "" if c.kind == "removed" else repr(c.new)
        table.add_row(
            output.literal(c.key), output.literal(old), output.literal(new), output.literal(c.kind, style[c.kind])
        )
    console.print(table)
