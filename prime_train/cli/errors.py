"""The CLI's one error handler: what a user can cause ends as `error: <message>` and an exit code, never a traceback.

Commands raise; they do not print their own error tails. `handle` (called by the root command group,
prime_train/cli/app.py, around every command) turns

- `CliError`, raised by the commands themselves, into its message and code;
- a config that does not load or lint (`ConfigError`) into its problems, one per line with file:line:col,
  and exit 78 (`ExitCode.CONFIG`: a configuration error, never retried);
- the exceptions our modules raise for what the user gave them (`USER_ERRORS`) into their message and code;
- a missing or unreadable file the user named into `error: <path>: <reason>`;

and anything else, a bug, into one line that says where the traceback was written, exit 1.

With `--json` (or lint's deprecated `--format json`) an error is also one JSON document on stdout,
`{"ok": false, "error": "<message>", "exit_code": N}`, so a script reading stdout learns why.
The exit codes of every command are in one table, `EXIT_CODES`, below (README.md shows it).
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from typing import NoReturn

import typer

from prime_train.cli import output
from prime_train.contract import ExitCode

# click's own exceptions: a usage mistake (printed by click, with BAD_INPUT set by `usage`), --help's exit, Ctrl-C's
# abort. Recent typer carries its own copy of click, so they are found through typer's names.
CLICK_EXCEPTIONS = (
    typer.Exit,
    typer.Abort,
    *(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "ClickException"),
)
USAGE_ERRORS = tuple(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "UsageError")
# Bad input (a config, a flag, an argument or a path the user must fix) ends every command with one code, and that
# code is 78, the run directory contract's "configuration error, never retried" (ExitCode.CONFIG): `run` and `train`
# must end a bad config with it (the supervisor gives up on it; SkyPilot recovers only spot.recover_on_exit_codes),
# so every other command's bad input (click's usage mistakes included, 2 by click's default) ends with it too.
BAD_INPUT = int(ExitCode.CONFIG)

# The exit codes of every command, in one place: README.md's CLI section shows this table (tests/test_cli_errors.py).
EXIT_CODES: dict[int, str] = {
    int(ExitCode.OK): "done: the run finished, the check passed, nothing fatal found, the configs are the same",
    int(ExitCode.FAILED): "the outcome is bad: the run failed (restarts exhausted or not retryable); diagnose "
    "found a fatal failure; verify-model: not usable; config diff: the configs differ; a bug in prime-train "
    "(the message names the file with its traceback); the reader of the output went away (piped into `head`, say)",
    int(ExitCode.PREEMPTED): "stopped on request (Ctrl-C, SIGTERM, a spot notice), with a checkpoint unless a "
    "second Ctrl-C stopped without waiting for one: `prime-train run` again resumes from the newest whole one",
    BAD_INPUT: "bad input, never retried: a config that does not lint or pass preflight, a mistyped flag or "
    "argument, a file or run directory that does not exist, a tool that must be installed first",
}


class CliError(Exception):
    """A mistake the user can fix: printed as `error: <message>`, then the command exits with `code`."""

    def __init__(self, message: object, code: int = ExitCode.FAILED):
        super().__init__(str(message))
        self.code = int(code)


# Exceptions our modules raise for what the user gave them, by class name, and the exit code each ends with
# (None: the exception's own `.code`). Matched by name along the exception's MRO, most specific class first,
# instead of imported: handling an error must not import half the package, and a class keeps its name when its
# module is split.
USER_ERRORS: dict[str, int | None] = {
    "MemoryInputError": ExitCode.CONFIG,  # validator/memory.py: sizes, GPU names, strategies; cost's prices too
    "ModelConfigNotFound": BAD_INPUT,  # validator/models.py: no config.json where the model argument points
    "SkyPilotNotFound": BAD_INPUT,  # integrations/skypilot.py: `prime-train spot install` first
    "SkyPilotError": ExitCode.FAILED,
    "MonitorConfigError": BAD_INPUT,  # integrations/monitor.py
    "NotARunDir": BAD_INPUT,  # resilience/status.py: status or logs of a directory that holds no run
    "NoLogs": BAD_INPUT,  # resilience/status.py: logs of an attempt or a process that has none
    "ProfileFailed": None,  # resilience/profile.py: preflight failed, or the profiled job wrote no summary
}
# An OSError about a file the user named (it has a filename) is theirs to fix; one without one is ours.
USER_OS_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def user_error_code(exc: BaseException) -> int | None:
    """The exit code for an exception a user caused, or None for one that is a bug."""
    if isinstance(exc, CliError):
        return exc.code
    for cls in type(exc).__mro__:
        if cls.__module__.startswith("prime_train.") and cls.__name__ in USER_ERRORS:
            code = USER_ERRORS[cls.__name__]
            return int(code if code is not None else getattr(exc, "code", ExitCode.FAILED))
    if isinstance(exc, USER_OS_ERRORS) and exc.filename is not None:
        return BAD_INPUT
    return None


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        message = f"{exc.filename}: {exc.strerror or exc}"
        if isinstance(exc, FileNotFoundError):
            from prime_train.config.loader import near_paths

            near = near_paths(str(exc.filename))
            message += f"; did you mean {' or '.join(near)}?" if near else ""
        return message
    return str(exc) or type(exc).__name__


def usage(exc: Exception) -> Exception:
    """A usage mistake click found (an unknown flag, a missing argument): bad input's exit code, and with --json
    the same message as a JSON document on stdout; click prints it for people."""
    exc.exit_code = BAD_INPUT  # type: ignore[attr-defined]
    output.failure_json(exc.format_message(), BAD_INPUT)  # type: ignore[attr-defined]
    return exc


def handle(exc: Exception) -> NoReturn:
    """Print `exc` for the user and exit with its code; click's own exceptions (usage, exit, abort) pass through."""
    if isinstance(exc, CLICK_EXCEPTIONS):
        if isinstance(exc, USAGE_ERRORS):
            raise usage(exc)
        raise exc
    if isinstance(exc, BrokenPipeError):
        # the reader went away (`| head`): not a bug. click ends such a command quietly with 1 when the pipe breaks
        # outside a command (its own EPIPE handling); one inside a command ends the same way
        _detach_stdout()
        raise typer.Exit(ExitCode.FAILED) from None
    from prime_train.config.loader import ConfigError

    if isinstance(exc, ConfigError):
        output.problems(exc.problems)
        found = [p for p in exc.problems if p.severity == "error"]
        output.failure_json(
            f"the config has {len(found)} error(s)", BAD_INPUT, problems=[p.to_dict() for p in exc.problems]
        )
        raise typer.Exit(BAD_INPUT) from None
    code = user_error_code(exc)
    if code is not None:
        output.error(_message(exc))
        output.failure_json(_message(exc), code)
        raise typer.Exit(code) from None
    message = f"unexpected {type(exc).__name__}: {_message(exc)}; {_save_traceback(exc)}"
    output.error(message)
    output.failure_json(message, ExitCode.FAILED)
    raise typer.Exit(ExitCode.FAILED) from None


def _detach_stdout() -> None:
    """Point stdout at /dev/null: whoever read it has gone (`| head`), and Python's flush on the way out would fail
    again and print "Exception ignored ... BrokenPipeError" (the recipe of Python's signal module docs)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (a test runner's capture): nothing to detach
        pass


def _save_traceback(exc: BaseException) -> str:
    """Write the traceback to a file and say where; if that fails, print it (it must not be lost)."""
    from prime_train.kit.redact import redact_argv

    text = "".join(traceback.format_exception(exc))
    if output.MODE.verbose:  # -v: the traceback here too, not only in the file
        sys.stderr.write(text)
    try:
        fd, path = tempfile.mkstemp(prefix="prime-train-error-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # a bug report gets attached: no secret from the command line
            f.write(f"prime-train {' '.join(redact_argv(sys.argv[1:]))}\n\n{text}")
    except OSError:
        sys.stderr.write(text)
        return "the traceback is above; this is a bug in prime-train: please report it"
    return f"this is a bug in prime-train: please report it with the traceback in {path}"
