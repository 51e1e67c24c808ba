"""`prime-train diagnose PATH... [--json]`: the log-surfacing library run over logs after the fact.

Works on a run directory (every attempt: a failure the run recovered from is still its story; or the
latest one alone) or on any log files or directories, a prime-rl or torchtitan output directory say.
Each file gets a verdict: its root cause (the earliest finding of the most causal kind, see
logscan.root_cause) and what followed from it, with the attempt it belongs to; the whole gets one the
same way. Exit code: 0 nothing fatal found, 1 a fatal finding, 78 (bad input) a path that does not exist.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from prime_train.config.loader import near_paths
from prime_train.contract import ExitCode
from prime_train.kit.redact import Redactor
from prime_train.resilience.logscan import FATAL, LOG_SUFFIXES, Finding, log_files, root_cause, scan_log

EXIT_CLEAN, EXIT_FATAL, EXIT_BAD_PATH = int(ExitCode.OK), int(ExitCode.FAILED), int(ExitCode.CONFIG)
_ATTEMPT_DIR = re.compile(r"^attempt-(\d+)$")


def attempt_of(path: str) -> int | None:
    """The attempt a log file belongs to: the N of the `attempt-N` directory it lies in, if any."""
    for part in reversed(os.path.normpath(path).split(os.sep)[:-1]):
        m = _ATTEMPT_DIR.match(part)
        if m:
            return int(m.group(1))
    return None


@dataclass
class FileVerdict:
    """What one log file shows: its root cause and the fatal findings that followed from it."""

    file: str
    process: str | None
    findings: list[Finding]
    suppressed: dict[str, int] = field(default_factory=dict)

    @property
    def root_cause(self) -> Finding | None:
        return root_cause(self.findings)

    def consequences(self) -> Counter[str]:
        """Fatal kinds other than the root cause's, with how many findings show each."""
        cause = self.root_cause
        return Counter(
            f.kind for f in self.findings if f.severity == FATAL and f.kind and cause and f.kind != cause.kind
        )

    @property
    def attempt(self) -> int | None:
        return attempt_of(self.file)

    def to_dict(self) -> dict[str, Any]:
        cause = self.root_cause
        return {
            "file": self.file,
            "process": self.process,
            "attempt": self.attempt,
            "kind": cause.kind if cause else None,
            "root_cause": cause.to_dict() if cause else None,
            "consequences": dict(self.consequences()),
            "warnings": sum(1 for f in self.findings if f.severity != FATAL),
        }


def _where(f: Finding) -> str:
    attempt = attempt_of(f.file or "")
    who = [w for w in (f.process, f"attempt {attempt}" if attempt is not None else None) if w]
    return f"{_shown_path(f.file)}:{f.line}" + (f" ({', '.join(who)})" if who else "")


def _then(consequences: Counter[str]) -> str:
    return ", ".join(f"{kind} ×{n}" if n > 1 else kind for kind, n in consequences.most_common())


def _verdict(verdicts: list[FileVerdict], paths: Sequence[str]) -> str:
    if not verdicts:
        return (
            f"verdict: no log files found in {', '.join(paths)} "
            f"(looked for logs/latest of a run directory, or {' / '.join('*' + s for s in LOG_SUFFIXES)})"
        )
    scanned = f"{len(verdicts)} log file{'s' if len(verdicts) != 1 else ''}"
    causes = [(v, cause) for v in verdicts if (cause := v.root_cause) is not None]
    if not causes:
        warnings = sum(1 for v in verdicts for f in v.findings if f.severity != FATAL)
        if warnings:
            return f"verdict: no fatal failure found in {scanned}; {warnings} warning{'s' if warnings != 1 else ''}"
        return f"verdict: nothing known found in {scanned}"
    # the files' own root causes compete like findings do; what else failed in the winner's file
    # followed from it, what failed in other files is reported beside it
    cause = root_cause(c for _, c in causes)
    assert cause is not None
    home = next(v for v, c in causes if c is cause)
    out = f"verdict: {cause.kind}, root cause at {_where(cause)}: {cause.hint}"
    if then := home.consequences():
        out += f"\n  then: {_then(then)} (consequences of it)"
    elsewhere = [f"{_shown_path(v.file)}: {c.kind}" for v, c in causes if v is not home]
    if elsewhere:
        out += f"\n  also failing: {'; '.join(elsewhere)}"
    attempts = sorted({a for v in verdicts if (a := v.attempt) is not None})
    failed = {v.attempt for v, _ in causes}
    if len(attempts) > 1 and attempts[-1] not in failed:
        out += f"\n  the latest attempt ({attempts[-1]}) shows no fatal failure: the run went on after it"
    return out


def _shown_path(path: str | None) -> str:
    """`path` relative to the working directory when it lies below it: table cells are narrow."""
    if not path:
        return "?"
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def _print_table(verdicts: list[FileVerdict]) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    # each file's findings in line order: finish() reports a cut-off traceback after the rest
    findings = [f for v in verdicts for f in sorted(v.findings, key=lambda f: f.line)]
    if findings:
        causes = {id(v.root_cause) for v in verdicts if v.root_cause is not None}
        table = Table(expand=True, show_lines=True)
        # the log line and, under it, what to do, get most of the width
        table.add_column("where", ratio=2, overflow="fold")
        table.add_column("process", no_wrap=True)  # short names; a header broken in two reads wrong
        table.add_column("kind", no_wrap=True)
        table.add_column("line → what to do", ratio=5, overflow="fold")
        for f in findings:
            style = "red" if f.severity == FATAL else "yellow"
            kind = Text(f.kind or "warning", style=style)
            if id(f) in causes:
                kind.append("\nroot cause", style="bold")
            # Text(), not markup: log lines are full of "[rank0]:" and "[core.py:708]"
            line_and_hint = Text(f.text)
            line_and_hint.append(f"\n→ {f.hint}", style="dim")
            table.add_row(Text(f"{_shown_path(f.file)}:{f.line}"), Text(f.process or ""), kind, line_and_hint)
        console.print(table)
    for v in verdicts:
        for name, count in v.suppressed.items():
            more = f"{count} more line{'s' if count != 1 else ''}"
            console.print(Text(f"{_shown_path(v.file)}: {more} like {name} not shown"))
    # with several files, each one's own verdict: which rank or worker failed first, and how
    fatal_files = [(v, cause) for v in verdicts if (cause := v.root_cause) is not None]
    if len(fatal_files) > 1:
        for v, cause in fatal_files:
            then = v.consequences()
            after = f", then {_then(then)}" if then else ""
            console.print(Text(f"{_shown_path(v.file)}: {cause.kind} at line {cause.line}{after}"))


def diagnose_command(paths: list[str], as_json: bool, all_attempts: bool = True) -> int:
    """Print what the known-failure library finds in `paths`, a verdict per file and one for all; returns the exit code.

    With `as_json`, stdout is one JSON object: {"verdict": {...}, "files": [per-file verdicts], "findings": [...],
    "skipped": [notes]}. Paths that are not regular files (a FIFO, a device, a symlink loop) or cannot be read are
    skipped with a note on stderr. Log lines are shown with secrets masked: by shape, and by value for the
    credential variables of this environment."""
    missing = [p for p in paths if not os.path.lexists(p)]
    if not paths or missing:
        what = ", ".join(missing) if missing else "(none given)"
        near = [n for p in missing for n in near_paths(p)]
        message = f"no such file or directory: {what} (give a run directory, runs/<name>, or log files)"
        message += f"; did you mean {' or '.join(near)}?" if near else ""
        print(f"error: {message}", file=sys.stderr)
        if as_json:  # stdout stays JSON for a script, errors too
            print(json.dumps({"ok": False, "error": message, "exit_code": EXIT_BAD_PATH}, indent=2))
        return EXIT_BAD_PATH
    redactor = Redactor.from_environment()
    skipped: list[str] = []
    verdicts = []
    for path in log_files(paths, all_attempts=all_attempts, skipped=skipped):
        try:
            scanner = scan_log(path, notes=skipped)  # a huge log: its head and end, the lines between noted
        except OSError as exc:  # unreadable, or gone since it was listed
            skipped.append(f"{path}: cannot be read ({exc.strerror or exc}); skipped")
            continue
        findings = [redactor.value(f) for f in scanner.findings]
        verdicts.append(FileVerdict(str(path), scanner.process, findings, dict(scanner.suppressed)))
    for note in skipped:
        print(f"note: {note}", file=sys.stderr)
    findings = [f for v in verdicts for f in v.findings]
    verdict = _verdict(verdicts, paths)
    if as_json:
        cause = root_cause(findings)
        document = {
            "verdict": {
                "kind": cause.kind if cause else None,
                "root_cause": cause.to_dict() if cause else None,
                "text": verdict,
            },
            "files": [v.to_dict() for v in verdicts],
            "findings": [f.to_dict() for f in findings],
            "skipped": skipped,
        }
        print(json.dumps(document, indent=2))
        # stdout stays one JSON document for `| jq`; the verdict is for the human watching
        print(verdict, file=sys.stderr)
    else:
        _print_table(verdicts)
        print(verdict)
    return EXIT_FATAL if any(f.severity == FATAL for f in findings) else EXIT_CLEAN
