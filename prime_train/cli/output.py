"""The one way the CLI prints: rich for people, `--json` for machines, and never markup in what it did not write.

Every line a command prints goes through here. Text that comes from outside the CLI's own source (paths,
config values, messages of exceptions, log lines) is printed as a `rich.text.Text`, never parsed as rich
markup, so `pip install 'prime-train[engine]'` keeps its `[engine]` and a path like `runs/[x]` keeps its
`[x]`. Labels (`error:`, `warning:`, `note:`, `ok:`) are the only styled parts. Messages go to stderr and
results to stdout, so `--json` output stays one JSON document for `| jq`.

Rich is imported inside the functions: `prime-train --help` and `lint` stay fast (bench/cli_startup.py).
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

    from prime_train.config.loader import Problem


@dataclass
class Mode:
    """How this invocation prints: `--json` (errors too become JSON on stdout), `-q` (results and problems only),
    `-v` (a bug's traceback on stderr too). Set once per invocation by the root command group."""

    json: bool = False
    quiet: bool = False
    verbose: bool = False


MODE = Mode()
# -q/-v are options of the root group; written after a command (`prime-train run cfg.toml -q`) they are moved
# in front of it, so every command takes them without declaring them
HOISTED = {"-q": "quiet", "--quiet": "quiet", "-v": "verbose", "--verbose": "verbose"}


def start(args: list[str]) -> list[str]:
    """Begin one invocation: reset the mode, note whether JSON was asked for, and move -q/-v to the front."""
    global MODE
    end = args.index("--") if "--" in args else len(args)
    head, tail = args[:end], args[end:]
    MODE = Mode(json="--json" in head or "--format=json" in head or _pair(head, "--format", "json"))
    hoisted = [a for a in head if a in HOISTED]
    return hoisted + [a for a in head if a not in HOISTED] + tail


def _pair(args: list[str], flag: str, value: str) -> bool:
    return any(a == flag and b == value for a, b in itertools.pairwise(args))


def console(*, stderr: bool = False) -> Console:
    """A console on stdout (results) or stderr (messages); no highlighting of numbers and paths, no hard wraps."""
    from rich.console import Console

    # soft_wrap: long lines (paths, commands to copy) are not broken in the middle
    return Console(stderr=stderr, highlight=False, soft_wrap=True)


def literal(text: object, style: str = "") -> Text:
    """`text` as it is: brackets stay brackets."""
    from rich.text import Text

    return Text(str(text), style=style)


def clip(text: object, limit: int = 2000) -> str:
    """`str(text)` cut to `limit` characters, saying how many were left out: what a job wrote (a 50 MB message) is
    cut before rich lays it out, as rich's folding of one long cell takes time quadratic in its length."""
    from prime_train.kit.bounded import clip as clipped

    return clipped(text, limit)


def labelled(label: str, message: object, *, style: str, stderr: bool, sep: str = ": ") -> None:
    """`<label><sep><message>`: the label styled, the message printed as is."""
    from rich.text import Text

    console(stderr=stderr).print(Text.assemble((label, style), sep, str(message)))


def error(message: object) -> None:
    """`error: <message>` on stderr."""
    labelled("error", message, style="red", stderr=True)


def warning(message: object) -> None:
    """`warning: <message>` on stderr."""
    labelled("warning", message, style="yellow", stderr=True)


def note(message: object) -> None:
    """`note: <message>` on stderr (not with -q)."""
    if not MODE.quiet:
        labelled("note", message, style="yellow", stderr=True)


def success(label: str, message: object, *, sep: str = ": ") -> None:
    """A green `<label>` and the outcome on stdout (`ok: 2 file(s), no problems`, `saved run.toml`); not with -q."""
    if not MODE.quiet:
        labelled(label, message, style="green", stderr=False, sep=sep)


def say(message: object, *, stderr: bool = False) -> None:
    """One plain line, printed as is; a line on stderr is commentary, left out with -q."""
    if not (stderr and MODE.quiet):
        console(stderr=stderr).print(literal(message))


def done(as_json: bool, data: dict[str, Any], line: str, *, label: str = "") -> None:
    """The result of a command that acts (installs, converts, saves): `{"ok": true, ...}` with --json, else `line`
    (after a green `label` when given)."""
    if as_json:
        print_json({"ok": True, **data})
    elif label:
        success(label, line, sep=" ")
    else:
        say(line)


def failure_json(message: str, code: int, **extra: Any) -> None:
    """With --json, an error as one JSON document on stdout: a script reading stdout learns why, not just the code."""
    if MODE.json:
        print_json({"ok": False, "error": message, "exit_code": int(code), **extra})


def document(text: str) -> None:
    """A document for other programs (YAML, TOML) on stdout, byte for byte, ending in one newline."""
    sys.stdout.write(text.rstrip("\n") + "\n")
    sys.stdout.flush()


def problems(found: Iterable[Problem], *, stderr: bool = True) -> None:
    """Config problems as `file:line:col: error: message`, on stderr where they are why a command stopped, on
    stdout where they are the command's result (`prime-train lint x.toml > out` keeps them)."""
    from rich.text import Text

    err = console(stderr=stderr)
    for p in found:
        where = p.file if p.line <= 0 else f"{p.file}:{p.line}:{p.column}"
        colour = "red" if p.severity == "error" else "yellow"
        err.print(Text.assemble((where, "bold"), ": ", (p.severity, colour), ": ", p.message))


def to_json(data: Any) -> Any:
    """`data` as JSON values: objects with `to_dict()` (reports) become their dict, lists of them lists."""
    if hasattr(data, "to_dict"):
        return data.to_dict()
    if isinstance(data, list | tuple):
        return [to_json(item) for item in data]
    return data


def print_json(data: Any) -> None:
    """`data` as one indented JSON document on stdout; values JSON has no type for (paths, dates) as strings."""
    sys.stdout.write(json.dumps(to_json(data), indent=2, default=str) + "\n")
    sys.stdout.flush()


def emit(data: Any, as_json: bool, render: Callable[[Console], None]) -> None:
    """The tail of a command that has a result: JSON on stdout with `--json`, else `render` it on a stdout console."""
    if as_json:
        print_json(data)
    else:
        render(console())
