"""The CLI's one error handler: what a user can cause ends as `error: <message>` and an exit code, never a traceback.

Commands raise; they do not print their own error tails. `handle` (called by the root command group,
prime_train/cli/app.py, around every command) turns

- `CliError`, raised by the commands themselves, into its message and code;
- a config that does not load or lint (`ConfigError`) into its problems, one per line with file:line:col,
  and exit 78 (`ExitCode.CONFIG`: a configuration error, never retried);
- the exceptions our modules raise for what the user gave them (`USER_ERRORS`) into their message and code;
- a missing or unreadable file the user named into `error: <path>: <reason>`;

and anything else, a bug, into one line that says where the traceback was written, exit 1.
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

# click's own exceptions: a usage mistake (printed by click, exit 2), --help's exit, Ctrl-C's abort. Recent typer
# carries its own copy of click, so they are found through typer's names.
CLICK_EXCEPTIONS = (
    typer.Exit,
    typer.Abort,
    *(cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "ClickException"),
)
# click's code for a usage mistake; our commands also end with it for an argument that names nothing usable
USAGE = 2


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
    "ModelConfigNotFound": USAGE,  # validator/models.py: no config.json where the model argument points
    "SkyPilotNotFound": USAGE,  # integrations/skypilot.py: `prime-train spot install` first
    "SkyPilotError": ExitCode.FAILED,
    "MonitorConfigError": USAGE,  # integrations/monitor.py
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
        return ExitCode.FAILED
    return None


def _message(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror or exc}"
    return str(exc) or type(exc).__name__


def handle(exc: Exception) -> NoReturn:
    """Print `exc` for the user and exit with its code; click's own exceptions (usage, exit, abort) pass through."""
    if isinstance(exc, CLICK_EXCEPTIONS):
        raise exc
    from prime_train.config.loader import ConfigError

    if isinstance(exc, ConfigError):
        output.problems(exc.problems)
        raise typer.Exit(ExitCode.CONFIG) from None
    code = user_error_code(exc)
    if code is not None:
        output.error(_message(exc))
        raise typer.Exit(code) from None
    output.error(f"unexpected {type(exc).__name__}: {_message(exc)}; {_save_traceback(exc)}")
    raise typer.Exit(ExitCode.FAILED) from None


def _save_traceback(exc: BaseException) -> str:
    """Write the traceback to a file and say where; if that fails, print it (it must not be lost)."""
    from prime_train.resilience.redact import redact_argv

    text = "".join(traceback.format_exception(exc))
    try:
        fd, path = tempfile.mkstemp(prefix="prime-train-error-", suffix=".txt")
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # a bug report gets attached: no secret from the command line
            f.write(f"prime-train {' '.join(redact_argv(sys.argv[1:]))}\n\n{text}")
    except OSError:
        sys.stderr.write(text)
        return "the traceback is above; this is a bug in prime-train: please report it"
    return f"this is a bug in prime-train: please report it with the traceback in {path}"
