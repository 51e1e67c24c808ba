"""Known failures in a child's output: a line-by-line scanner over the pattern library, and classify().

The supervisor runs one LogScanner per child process and feeds it every output line;
`prime-train diagnose` runs the same scanner over log files after the fact. A Finding names the
line, the failure it shows and what to do about it; root_cause() picks, among a dead child's
findings, the one that explains the others, and classify() turns it into the FailureKind the
restart policy reads. The patterns themselves, data, are in patterns.py. Torch-free: this runs
in the supervisor.

The scanner is linear in its input and bounded in memory whatever the input: each line is cut to
MAX_LINE_CHARS before it is matched, at most MAX_OPEN_TRACEBACKS tracebacks are followed at once,
and the state carried from line to line is a few short strings.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import stat
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from prime_train.kit.failures import FailureKind
from prime_train.kit.redact import redact
from prime_train.resilience.patterns import (
    CONTEXT_PATTERNS,
    ECHO_TRACEBACKS,
    EXCEPTION_LINE,
    FATAL,
    FRAME_MARKS,
    GRAD_NORM_STREAK,
    GRAD_NORM_STUCK,
    GRAD_NORM_VALUE,
    PATTERNS,
    PYTHON_EXCEPTION,
    ROOT_CAUSE_TIERS,
    TRACEBACK_CUT_OFF,
    Pattern,
)
from prime_train.rundir import LATEST_LOGS

# Longer lines are cut in findings: vLLM's "Supported architectures: dict_keys([...])" runs to
# thousands of characters and would bury the console.
MAX_TEXT_CHARS = 500
# Longer lines are matched on their head and tail only (half each): a progress bar redrawn with \r
# for hours, or a binary blob, is one "line" of megabytes, and its decisive part is at one end
# ("...it/s]Killed" at the tail, a "[rank3]:" prefix at the head).
MAX_LINE_CHARS = 16_384
# Log files are read in pieces of at most this many bytes, so a line without a newline never has
# to fit in memory whole.
MAX_READ_BYTES = 65_536
# A log file read after the fact (`diagnose`) is scanned at most this far from its head and from its end: a chatty
# job writes gigabytes, and the scanner reads a few MB a second. The lines between are counted (a newline count, at
# the disk's speed), never scanned, so the line numbers after them stay true; the caller is told what was left out.
SCAN_HEAD_BYTES = 4 << 20
SCAN_TAIL_BYTES = 12 << 20


def _literal_union(words: Iterable[str]) -> re.Pattern[str]:
    """One regex matching any of `words`, shaped as a trie so that each position costs one branch per
    distinct next character rather than one per word."""
    trie: dict[str, dict] = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}

    def emit(node: dict[str, dict]) -> str:
        branches = [re.escape(ch) + emit(child) for ch, child in sorted(node.items()) if ch]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        return f"(?:{body})?" if "" in node else body

    return re.compile(emit(trie))


# The pattern whose findings count gradient norms in a row (see LogScanner._grad_norm).
_GRAD_NORM_NOT_FINITE = next(p for p in PATTERNS if p.name == "grad_norm_not_finite")
# The gate looks for the needles' first _GATE_CHARS characters only: a needle's prefix is in every
# line the needle is, shorter words make the gate cheaper, and a needle cut by a wrap then starts
# within _CUT characters of the cut.
_GATE_CHARS = 16
_CUT = _GATE_CHARS - 1
# None when some pattern has no needles: then every line goes through every pattern
_GATE: re.Pattern[str] | None = (
    _literal_union({n[:_GATE_CHARS] for p in PATTERNS for n in p.needles}) if all(p.needles for p in PATTERNS) else None
)

# Exception lines without a message are taken only for names like these: `KeyboardInterrupt`, `StopIteration`.
_BARE_EXCEPTION_SUFFIXES = ("Error", "Exception", "Interrupt", "Exit", "Iteration", "Warning")


@dataclass
class Finding:
    """One log line that matched a known pattern."""

    file: str | None
    line: int
    process: str | None
    name: str
    kind: str | None
    severity: str
    text: str  # the log line, redacted and cut to MAX_TEXT_CHARS
    hint: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_TRACEBACK_HEADER = "Traceback (most recent call last):"
_GROUP_HEADER = "Exception Group Traceback (most recent call last):"
# Tracebacks that Python prints for an error it survives: a __del__ or callback that raised
# ("Exception ignored in: <function ...>"), a logging handler that failed ("--- Logging error ---").
_BENIGN_INTRODUCERS = ("Exception ignored in", "Exception ignored on calling", "--- Logging error ---")
# Colour codes as a terminal gets them (ESC), as syslog/journald/docker escape them (#033[), as
# `cat -v` or `less` shows them (^[[), and JSON- or repr-escaped.
_ANSI = re.compile(r"(?:\x1b|#033|\^\[|\\033|\\x1b|\\u001b)\[[0-9;?]*[A-Za-z]")
_DIGITS_TO_ZERO = str.maketrans("0123456789", "0000000000")
# Non-frame lines tolerated inside a traceback before it is given up: interleaved output from
# other threads or ranks, not the traceback's own.
_MAX_FOREIGN_LINES = 50
# Tracebacks followed at once. Every rank or worker prefix ("[rank3]:", "(EngineCore pid=7)") has
# its own; past this many the least recently continued one is dropped, so lines that open a
# traceback and never close it (`[abc123] Traceback (most recent call last):` over and over) cost
# constant time and memory each.
MAX_OPEN_TRACEBACKS = 16
# Lines that are themselves warnings: Python's `file.py:12: UserWarning: ...` and torch's C++
# `[W socket.cpp:464]` / `[W1121 10:00:00.123 ProcessGroupNCCL.cpp:1250]`. Such a line is never the
# cause of a death (torch warns "Address already in use" for IPv6 and then binds IPv4), so only
# warning patterns apply to it.
_WARNING_LINE = re.compile(r"\b[A-Z][a-z]\w*Warning: |^(?:\[rank\d+\]:)?\[W(?:\d{4} [\d:.]+(?: \d+)?)? [\w./-]+:\d+\]")
# A wrapped line: a terminal or a log collector broke the decisive phrase over two lines. The
# scanner matches the end of the previous line joined to the start of this one, directly (a hard
# wrap at the terminal width) or with a space (a soft wrap that ate it); only a match that spans
# the join counts, so nothing is reported twice.
_WRAP_WINDOW = 96
# No terminal is narrower than this: a shorter line ended where its writer ended it, not at a wrap.
_MIN_WRAP_WIDTH = 40
# A per-line prefix a log collector repeats on the continuation of a wrapped line.
_LINE_PREFIX = re.compile(r"^(?:\[[^\]\n]{1,40}\]:?\s|\([^)\n]{1,60}\)\s)")
# What the previous line was, for a wrap: never joined (a warning, a traceback header or frame),
# passed the needle gate (the join is searched whole), or plain (searched where a needle was cut).
_UNJOINABLE, _GATED, _PLAIN = "unjoinable", "gated", "plain"
# torchrun's failure table puts a rank on the line before its exit code ("rank : 1 (local_rank: 1)", then
# "exitcode : -6"); its agent's log line carries both ("failed (exitcode: -6) local_rank: 0").
_RANK = re.compile(r"\b(?:local_)?rank\s*:\s*(\d+)")
_SIGNAL_NAME = re.compile(r"\bSIG[A-Z]{2,6}\b")
_EXIT_SIGNAL = re.compile(r"exitcode\s*:\s*-(\d+)")
# A port as bind errors print it ("0.0.0.0:29500", "[::]:8000", "port: 29500"); torchrun's last word on a taken port,
# "[E socket.cpp:500] ... failed to listen on any local network address.", leaves it to the warning line before it.
_PORT = re.compile(r"(?:\bport:?\s*|[\d\]]:)(\d{4,5})\b")


@dataclass
class _OpenTraceback:
    """A `Traceback (most recent call last):` block whose exception line has not come yet."""

    prefix: str  # whatever precedes the header on its line: "[rank1]:", "(EngineCore pid=7) ERROR … ] "
    shape: str  # prefix with digits zeroed, to follow prefixes that carry a changing timestamp
    group: bool  # an exception group: body lines carry "| " markers
    last_line: int
    last_text: str
    benign: bool = False  # printed for an exception Python survived (see _BENIGN_INTRODUCERS)
    foreign: int = 0
    marks: set[str] = field(default_factory=set)  # what its frames show (see FRAME_MARKS)


def _clean(line: str) -> str:
    line = line.rstrip("\r\n")
    if len(line) > MAX_LINE_CHARS:
        half = MAX_LINE_CHARS // 2
        line = line[:half] + " … " + line[-half:]
    if "\r" in line:
        # progress bars redraw with \r; what the reader last saw is the final segment
        segments = [s for s in line.split("\r") if s.strip()]
        line = segments[-1] if segments else ""
    if "\x1b" in line or "033[" in line or "[[" in line or "1b[" in line:
        line = _ANSI.sub("", line)
    while line.endswith("^M"):
        # a carriage return as `cat -v` and some pastes show it
        line = line[:-2]
    return line


def _is_exception_line(body: str) -> bool:
    m = EXCEPTION_LINE.match(body)
    if m is None:
        return False
    name = m.group("name")
    if m.group("colon"):
        # "INFO: …", "ERROR: …" are log lines that landed inside the block, not exceptions
        return not (name.isupper() and len(name) > 1)
    return m.end() == len(body.rstrip()) and name[:1].isupper() and name.endswith(_BARE_EXCEPTION_SUFFIXES)


def _matching(line: str, warning_line: bool) -> list[Pattern]:
    """The patterns `line` shows, fatal ones first in table order; none fatal on a warning line."""
    matched = [p for p in PATTERNS if p.search(line)]
    if warning_line:
        return [p for p in matched if p.severity != FATAL]
    if len(matched) > 1:
        matched.sort(key=lambda p: p.severity != FATAL)
    return matched


def _gate(tail: str, line: str) -> tuple[bool, bool]:
    """Whether a needle lies wholly in `line`, and whether one is cut by the join of `tail` (the end of the
    previous line) and `line`: one search of the gate regex for both, the cost of almost every line."""
    if _GATE is None:
        return True, bool(tail)
    joined = tail + line
    at = len(tail)
    cut = False
    m = _GATE.search(joined)
    while m is not None:
        if m.start() >= at:
            return True, cut
        cut = cut or m.end() > at
        m = _GATE.search(joined, m.start() + 1)
    return False, cut


def _soft_cut(tail: str, line: str) -> bool:
    """Whether a needle spans `tail` and `line` joined by a space: a soft wrap that ate the space
    between two words (the caller checked that both sides of the cut are letters)."""
    if _GATE is None:
        return False
    window = tail + " " + line[:_CUT]
    return any(m.start() < len(tail) and m.end() > len(tail) + 1 for m in _GATE.finditer(window))


def _context_note(kind: FailureKind | None, prev: str, line: str) -> str:
    """What the line before tells about a fatal `line` that `line` does not: a signal's rank, a taken port."""
    if kind is FailureKind.PORT_IN_USE:
        port = None if _PORT.search(line) else _PORT.search(prev)
        return f" (port {port.group(1)})" if port else ""
    return _signal_note(prev, line)


def _signal_note(prev: str, line: str) -> str:
    """What to add to a line that shows a process killed by a signal, as " (rank N, SIGABRT)": the rank from the line
    or the one before it (torchrun's table), the signal's name when the line gives only its number; "" for neither."""
    rank = _RANK.search(line) or _RANK.search(prev)
    name = _SIGNAL_NAME.search(line)
    number = _EXIT_SIGNAL.search(line)
    signame = name.group() if name else None
    if signame is None and number is not None and int(number.group(1)) in signal.valid_signals():
        signame = signal.Signals(int(number.group(1))).name
    parts = [f"rank {rank.group(1)}"] if rank else []
    parts += [signame] if signame and signame not in line else []
    return f" ({', '.join(parts)})" if parts else ""


def _continuation(prev: str, line: str) -> str:
    """`line` as the continuation of `prev`: without the prefix a log collector repeats on every line."""
    prefix = _LINE_PREFIX.match(prev)
    if prefix is not None and line.startswith(prefix.group()):
        return line[len(prefix.group()) :]
    return line


def _wrapped(prev: str, line: str) -> tuple[Pattern, str] | None:
    """A fatal pattern whose phrase starts at the end of `prev` and goes on at the start of `line` (its
    continuation, see _continuation), and the two lines joined as its finding's text."""
    tail = prev[-_WRAP_WINDOW:]
    head = line[:_WRAP_WINDOW]
    for sep in ("", " "):
        window = tail + sep + head
        for pattern in _matching(window, warning_line=False):
            if pattern.severity != FATAL:
                break
            if not pattern.wraps:
                continue
            if any(m.start() < len(tail) and m.end() > len(tail) + len(sep) for m in pattern.regex.finditer(window)):
                return pattern, tail.lstrip() + sep + line
    return None


class LogScanner:
    """Finds known failures in one process's output, fed one line at a time (not thread-safe)."""

    def __init__(self, process: str | None = None, file: str | None = None, max_per_pattern: int = 20):
        self.process = process
        self.file = file
        self.findings: list[Finding] = []
        # A pattern repeated every step (a NaN loss, throttling) would flood the console and
        # events.jsonl: after max_per_pattern findings of one name the rest are only counted.
        self.max_per_pattern = max_per_pattern
        self.suppressed: dict[str, int] = {}
        self._counts: dict[str, int] = {}
        self._open: list[_OpenTraceback] = []
        # the previous line, cleaned, and what it was: what a traceback header or a wrapped phrase follows
        self._prev = ""
        self._prev_state = _UNJOINABLE
        self._prev_fatal: Pattern | None = None  # the pattern of the previous line's fatal finding
        self._grad_streak = 0

    def feed(self, line: str, line_no: int) -> list[Finding]:
        """Scan one line (1-based `line_no`); returns the findings it produced."""
        line = _clean(line)
        prev, prev_state = self._prev, self._prev_state
        warning_line = ("Warning: " in line or "[W" in line) and _WARNING_LINE.search(line) is not None
        # warnings, traceback headers and frames are never half of a wrapped phrase
        self._prev, self._prev_state = line, _UNJOINABLE
        header_at = line.find(_TRACEBACK_HEADER)
        if header_at >= 0:
            self._open_traceback(line, header_at, line_no, benign=any(s in prev for s in _BENIGN_INTRODUCERS))
            # what precedes the header on its line is output of its own: a bar or a message it was glued to
            before = line[:header_at]
            if _gate("", before)[0] and (found := _matching(before, warning_line)):
                return [f for f in [self._record(found[0], line, line_no)] if f is not None]
            return []
        ended: _OpenTraceback | None = None
        exception = ""
        if self._open:
            block, body = self._route(line)
            if block is not None:
                if block.group:
                    if body.startswith("+-"):
                        body = " "
                    elif body.startswith("|"):
                        body = body[2:] if body.startswith("| ") else body[1:]
                if not body.strip() or body[0] in " \t":
                    # a frame: source lines quote code ("raise RuntimeError('Engine core …')"),
                    # which must not count as the message itself
                    block.last_line, block.last_text = line_no, line
                    for mark, words in FRAME_MARKS:
                        if any(w in body for w in words):
                            block.marks.add(mark)
                    return []
                if _is_exception_line(body):
                    self._open.remove(block)
                    ended, exception = block, body.strip()
                    if any(mark in block.marks and rx.search(exception) for mark, rx in ECHO_TRACEBACKS):
                        block.benign = True
                else:
                    block.foreign += 1
                    if block.foreign > _MAX_FOREIGN_LINES:
                        self._open.remove(block)
        tail, cont = "", line
        if not warning_line and prev_state != _UNJOINABLE and len(prev) >= _MIN_WRAP_WIDTH:
            tail = prev[-_CUT:]
            if line[:1] in ("[", "(") and line[0] == prev[0]:
                cont = _continuation(prev, line)
        in_line, cut = _gate(tail, cont)
        if not warning_line:
            self._prev_state = _GATED if in_line else _PLAIN
        joinable = bool(tail) and (
            cut
            or in_line
            or prev_state == _GATED
            or (tail[-1].isalpha() and cont[:1].isalpha() and _soft_cut(tail, cont))
        )
        prev_fatal, self._prev_fatal = self._prev_fatal, None
        if not (in_line or joinable or ended or self._grad_streak):
            return []  # the common case, kept free of the bookkeeping below
        matched = _matching(line, warning_line) if in_line else []
        chosen = [(p, line) for p in matched[:1]]
        fatal = bool(matched) and matched[0].severity == FATAL
        if ended is not None and not fatal:
            context = next(
                (p for mark, p in CONTEXT_PATTERNS if mark in ended.marks and p.regex.search(exception)), None
            )
            if context is not None:
                chosen, fatal = [(context, line)], True
            elif not ended.benign:
                chosen.append((PYTHON_EXCEPTION, line))
        if not fatal and joinable:
            wrapped = _wrapped(prev, cont)
            # the previous line already showed this failure: the join adds its end, not a second one
            if wrapped is not None and wrapped[0] is not prev_fatal:
                chosen, fatal = [wrapped], True
        if fatal:
            self._prev_fatal = chosen[0][0]
        if (matched or self._grad_streak) and self._grad_norm(line, matched) and not fatal:
            chosen.append((GRAD_NORM_STUCK, line))
        if fatal and chosen[0][0].kind in (FailureKind.KILLED_BY_SIGNAL, FailureKind.PORT_IN_USE):
            chosen[0] = (chosen[0][0], chosen[0][1] + _context_note(chosen[0][0].kind, prev, line))
        return [f for p, text in chosen if (f := self._record(p, text, line_no)) is not None]

    def finish(self) -> list[Finding]:
        """Flush what end of input completes: a traceback whose exception line never came."""
        out = []
        for block in self._open:
            if block.benign:
                continue
            finding = self._record(TRACEBACK_CUT_OFF, block.last_text, block.last_line)
            if finding is not None:
                out.append(finding)
        self._open.clear()
        return out

    def _grad_norm(self, line: str, matched: list[Pattern]) -> bool:
        """Count non-finite gradient norms in a row; True on the one that makes GRAD_NORM_STREAK."""
        if any(p is _GRAD_NORM_NOT_FINITE for p in matched):
            self._grad_streak += 1
            return self._grad_streak == GRAD_NORM_STREAK
        if self._grad_streak and ("grad" in line or "Grad" in line):
            m = GRAD_NORM_VALUE.search(line)
            if m is not None and m.group("value")[:1].isdigit():
                self._grad_streak = 0  # a finite norm: the loss scaler recovered
        return False

    def _open_traceback(self, line: str, header_at: int, line_no: int, benign: bool) -> None:
        group_at = line.find(_GROUP_HEADER)
        group = group_at >= 0
        if group:
            # "  + Exception Group Traceback …" continues as "  | …" lines: the prefix is what precedes "+ "
            before = line[:group_at]
            prefix = before[:-2] if before.endswith("+ ") else before
        else:
            prefix = line[:header_at]
        self._open = [b for b in self._open if b.prefix != prefix]
        if len(self._open) >= MAX_OPEN_TRACEBACKS:
            # drop the one continued longest ago: a prefix that never comes back was never a traceback
            self._open.remove(min(self._open, key=lambda b: b.last_line))
        self._open.append(_OpenTraceback(prefix, prefix.translate(_DIGITS_TO_ZERO), group, line_no, line, benign))
        self._open.sort(key=lambda b: len(b.prefix), reverse=True)

    def _route(self, line: str) -> tuple[_OpenTraceback | None, str]:
        """The open traceback `line` continues, and the line without that traceback's prefix."""
        # self._open is sorted longest prefix first, so a "[rank1]:" block gets its lines before
        # an unprefixed one; the unprefixed block, which every line "continues", comes last
        for block in self._open:
            if block.prefix and line.startswith(block.prefix):
                return block, line[len(block.prefix) :]
        for block in self._open:
            n = len(block.prefix)
            if n and line[:n].translate(_DIGITS_TO_ZERO) == block.shape:
                return block, line[n:]
        if not self._open[-1].prefix:
            return self._open[-1], line
        return None, ""

    def _record(self, pattern: Pattern, line: str, line_no: int) -> Finding | None:
        seen = self._counts.get(pattern.name, 0)
        self._counts[pattern.name] = seen + 1
        if seen >= self.max_per_pattern:
            self.suppressed[pattern.name] = self.suppressed.get(pattern.name, 0) + 1
            return None
        text = redact(line.strip())
        if len(text) > MAX_TEXT_CHARS:
            text = text[: MAX_TEXT_CHARS - 1] + "…"
        finding = Finding(
            file=self.file,
            line=line_no,
            process=self.process,
            name=pattern.name,
            kind=str(pattern.kind) if pattern.kind is not None else None,
            severity=pattern.severity,
            text=text,
            hint=pattern.hint,
        )
        self.findings.append(finding)
        return finding


def _tier(kind: str) -> int:
    for i, tier in enumerate(ROOT_CAUSE_TIERS):
        if kind in tier:
            return i
    return len(ROOT_CAUSE_TIERS)


def root_cause(findings: Iterable[Finding]) -> Finding | None:
    """The fatal finding that explains the others: the earliest one of the most causal tier (ROOT_CAUSE_TIERS).

    `findings` in the order they were seen: a CUDA illegal memory access, then the NCCL timeout it
    left the other ranks in, names the memory access; two causes in one tier name the first."""
    best: Finding | None = None
    for f in findings:
        if f.severity == FATAL and f.kind is not None and (best is None or _tier(f.kind) < _tier(best.kind or "")):
            best = f
    return best


def classify(findings: Iterable[Finding]) -> FailureKind | None:
    """The kind of the root cause among `findings` (see root_cause), or None when none is fatal."""
    cause = root_cause(findings)
    return FailureKind(cause.kind) if cause is not None and cause.kind is not None else None


# What counts as a log file below a directory that is not a run directory (a prime-rl output
# dir, torchrun's --log-dir, SLURM's slurm-<id>.out).
LOG_SUFFIXES = (".log", ".out", ".err")
_ATTEMPT_RE = re.compile(r"^attempt-(\d+)$")
_STREAM_STEMS = {"stdout", "stderr", "console", "output"}


def process_name(path: str | os.PathLike[str]) -> str:
    """The process a log file belongs to: `trainer` for trainer.log, `rank1/stderr` for torchrun's 1/stderr.log."""
    p = Path(path)
    stem = p.name.split(".")[0] or p.name
    if stem in _STREAM_STEMS and p.parent.name:
        parent = p.parent.name
        return f"rank{parent}/{stem}" if parent.isdigit() else f"{parent}/{stem}"
    return stem


def read_lines(f: IO[bytes], max_bytes: int = MAX_READ_BYTES) -> Iterator[bytes]:
    """The newline-terminated lines of a binary stream, each cut to its head and tail when longer than max_bytes.

    Memory stays within a few max_bytes however long a line is: a progress bar redrawn with \\r for
    hours has no newline and can run to gigabytes."""
    half = max_bytes // 2
    while True:
        piece = f.readline(max_bytes)
        if not piece:
            return
        if piece.endswith(b"\n") or len(piece) < max_bytes:
            yield piece
            continue
        head, tail = piece[:half], piece[-half:]
        while piece and not piece.endswith(b"\n"):
            piece = f.readline(max_bytes)
            tail = (tail + piece)[-half:]
        yield head + " … ".encode() + tail


def scan_log(path: str | os.PathLike[str], process: str | None = None, notes: list[str] | None = None) -> LogScanner:
    """Scan one log file to its end; the finished scanner holds its findings and suppressed counts.

    A file over SCAN_HEAD_BYTES + SCAN_TAIL_BYTES is scanned at its head and its end only; `notes` gets a line
    saying which lines were not scanned."""
    scanner = LogScanner(process or process_name(path), str(path))
    # binary read: text mode would also split on the \r of progress bars and shift line numbers
    with open(path, "rb") as f:
        for line_no, raw in _numbered_lines(f, str(path), notes):
            scanner.feed(raw.decode("utf-8", "replace"), line_no)
    scanner.finish()
    return scanner


def _numbered_lines(f: IO[bytes], name: str, notes: list[str] | None) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a log file: every line, or those of its head and its end when it is big."""
    try:
        st = os.fstat(f.fileno())
    except (OSError, ValueError):
        st = None
    if st is None or not stat.S_ISREG(st.st_mode) or st.st_size <= SCAN_HEAD_BYTES + SCAN_TAIL_BYTES:
        yield from enumerate(read_lines(f), 1)
        return
    line_no = 0
    for raw in read_lines(f):
        line_no += 1
        yield line_no, raw
        if f.tell() >= SCAN_HEAD_BYTES:
            break
    head_lines, pos, tail_start = line_no, f.tell(), st.st_size - SCAN_TAIL_BYTES
    last = b"\n"
    while pos < tail_start and (chunk := f.read(min(MAX_READ_BYTES * 16, tail_start - pos))):
        line_no += chunk.count(b"\n")
        pos, last = pos + len(chunk), chunk[-1:]
    if last != b"\n":  # the end starts at a line's start: the rest of the line cut at tail_start is not scanned
        while (piece := f.readline(MAX_READ_BYTES)) and not piece.endswith(b"\n"):
            pass
        line_no += 1 if piece.endswith(b"\n") else 0
    if line_no > head_lines and notes is not None:
        notes.append(
            f"{name}: {st.st_size / 2**20:.0f} MiB; lines {head_lines + 1}-{line_no} not scanned (only its first "
            f"{SCAN_HEAD_BYTES >> 20} MiB and last {SCAN_TAIL_BYTES >> 20} MiB are)"
        )
    yield head_lines, b""  # nothing joins across what was left out (a wrapped phrase, a traceback's lines)
    for raw in read_lines(f):
        line_no += 1
        yield line_no, raw


def scan_file(path: str | os.PathLike[str], process: str | None = None) -> list[Finding]:
    """Findings in one log file; line numbers count newline-terminated lines from 1."""
    return scan_log(path, process).findings


def _attempt_dirs(logs_dir: Path) -> list[Path]:
    found = []
    try:
        children = list(logs_dir.iterdir())
    except OSError:  # unreadable: no attempts to choose from; os.walk skips it the same way
        return []
    for child in children:
        m = _ATTEMPT_RE.match(child.name)
        if m and child.is_dir():
            found.append((int(m.group(1)), child))
    return [d for _, d in sorted(found)]


def not_a_regular_file(path: str | os.PathLike[str]) -> str | None:
    """What `path` is when it is not a regular file to read (through symlinks): "a FIFO", "a symlink loop", …;
    None for a regular file. Opening a FIFO blocks until a writer comes, a device can be endless."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return "a symlink loop"
        if exc.errno == errno.ENOENT and os.path.islink(path):
            return "a broken symlink"
        return f"unreadable ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"


def _files_below(directory: Path, skipped: list[str]) -> list[Path]:
    out = []
    # os.walk does not follow symlinked directories, so a symlink loop cannot make it go round
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.endswith(LOG_SUFFIXES):
                continue
            path = Path(root) / name
            what = not_a_regular_file(path)
            if what is None:
                out.append(path)
            else:
                skipped.append(f"{path}: {what}, not a regular file; skipped")
    return out


def _logs_of_directory(directory: Path, all_attempts: bool, skipped: list[str]) -> list[Path]:
    logs_dir = directory / "logs" if (directory / "logs").is_dir() else directory
    attempts = _attempt_dirs(logs_dir)
    if not attempts:
        return _files_below(directory, skipped)
    if all_attempts:
        chosen = attempts
    else:
        latest = logs_dir / LATEST_LOGS
        # realpath, not Path.resolve: it never raises, a symlink loop included
        target = Path(os.path.realpath(latest)) if latest.is_dir() else attempts[-1]
        # report paths through attempt-<n>, which stays true after the next restart moves `latest`
        chosen = [logs_dir / target.name]
    return [f for d in chosen for f in _files_below(d, skipped)]


def log_files(
    paths: Iterable[str | os.PathLike[str]], all_attempts: bool = False, skipped: list[str] | None = None
) -> list[Path]:
    """The log files `paths` stand for: files as given; for a run directory logs/latest (or every
    attempt), for any other directory every *.log / *.out / *.err below it. Only regular files: a FIFO, a
    socket, a device or a symlink loop is left out, with a note appended to `skipped` when given.
    Raises FileNotFoundError for a path that does not exist."""
    notes: list[str] = [] if skipped is None else skipped
    out: list[Path] = []
    seen: set[str] = set()
    for raw in paths:
        p = Path(raw)
        if not os.path.lexists(p):
            raise FileNotFoundError(f"no such file or directory: {raw}")
        what = not_a_regular_file(p)
        if what is None:
            found = [p]
        elif what == "a directory":
            found = _logs_of_directory(p, all_attempts, notes)
        else:
            notes.append(f"{raw}: {what}, not a regular file; skipped")
            continue
        for f in found:
            key = os.path.realpath(f)
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def scan_paths(paths: Iterable[str | os.PathLike[str]], all_attempts: bool = False) -> list[Finding]:
    """Findings in every log file `paths` stand for (see log_files), file by file."""
    findings: list[Finding] = []
    for f in log_files(paths, all_attempts):
        findings.extend(scan_file(f))
    return findings
