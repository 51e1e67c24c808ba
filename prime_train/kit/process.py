"""A supervised child: its own process group, output to a log file and through a line callback.

Teardown is SIGTERM to the group, a grace period, then SIGKILL to the group and to any
descendant that left it (psutil finds them): no orphans, ever.

The child's output never waits on the supervisor. One thread (the pump) copies the pipe to the
log file and hands each line to a bounded queue; another thread calls `on_line` from that queue.
When the callback falls behind (a job printing faster than the log scanner reads), the queue drops
its oldest lines, counted in `lines_dropped`, and keeps the newest: a process dies at the end of
its output, so that is where its cause is. A full disk does not stop the pump either: a failed
write is counted in `log_bytes_lost` and the pipe keeps draining.

The log file gets the output as the job wrote it, with two exceptions (`_LogFile`). Secret values
(the job's credentials, in any escaped form) are masked as they are written, as CI systems do:
a line is written once it is whole, so a secret split across two reads is still found. And a log
is capped at `logging.max_log_mb`: past it, the file keeps its first half and its newest output,
with a line between them saying how much was dropped.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from prime_train.config.schema import LoggingConfig
from prime_train.contract import open_nofollow
from prime_train.kit.bounded import size_text
from prime_train.kit.redact import Redactor


class Role(enum.StrEnum):
    """What a process of a job is to its supervisor; the values are what logs and events have always said."""

    TRAINER = "trainer"  # the embedded engine's trainer (torchrun's, under several processes)
    INFERENCE = "inference"  # a rollout worker: restarted on its own while the trainer routes around it
    JOB = "job"  # an external command ([job].command)


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    role: Role = Role.TRAINER

    def __post_init__(self) -> None:
        self.role = Role(self.role)  # "inference" reads as Role.INFERENCE


LineCallback = Callable[[str, str, int], None]  # (process name, line, line number)

# The pipe is read in pieces of at most this many bytes; a line without a newline (a progress bar
# redrawn with \r for hours) is kept as its head and tail, so it never has to fit in memory whole.
READ_BYTES = 65_536
# Longer lines reach `on_line` and `tail` as their head and tail, half each (the log file gets them whole).
LINE_CHARS = 16_384
# Lines waiting for a slow `on_line` at most: about 160 MB in the worst case of LINE_CHARS lines,
# about 1 MB for ordinary ones, and drained in a fraction of a second by the log scanner.
PENDING_LINES = 10_000


# The default of logging.max_log_mb: a process's log of one attempt keeps at most this much (head and tail).
DEFAULT_MAX_LOG_MB: float = LoggingConfig.model_fields["max_log_mb"].default
# A cap is never below this, so that a head, the note and a tail always fit.
MIN_LOG_BYTES = 65_536
# An unfinished line is held for masking up to this many bytes; past it, its older part is written.
HOLD_BYTES = 1 << 20
_COPY_BYTES = 1 << 20  # compaction moves the tail up in pieces of this size


def log_cap_bytes(max_log_mb: float | None) -> int | None:
    """The byte cap of a log for `logging.max_log_mb` (0 or None: no cap)."""
    if not max_log_mb:
        return None
    return max(MIN_LOG_BYTES, int(max_log_mb * 2**20))


class _LogFile:
    """A child's log file: its output with secret values masked, line by line, and at most `max_bytes` of it.

    Masking works on whole lines: a line is held until its newline comes (a line longer than HOLD_BYTES is
    written in pieces, cut at a carriage return or where no secret value spans the cut), so a secret split
    across two reads of the pipe is masked all the same. Only by value (the redactor's known secrets, in every
    escaped form): the shape and name rules run where a log is shown (`status`, `diagnose`).

    The cap: when the file reaches max_bytes, its middle goes. What stays is the head (the first half, to a
    line end), a line saying how much was dropped (rewritten with the running total), and the newest quarter
    (from a line start), moved up in pieces: the file never holds more than max_bytes and a chunk, memory
    stays bounded, and the end of the output, where a process's cause of death is, is always in the file.
    A reader following the file by offset sees it shrink when that happens."""

    def __init__(self, path: Path, redactor: Redactor | None, max_bytes: int | None):
        self.redactor = redactor if redactor is not None and redactor.values else None
        self.max_bytes = max_bytes
        self.lost = 0  # bytes that a failed write lost (ENOSPC, EIO)
        self.dropped = 0  # bytes the cap removed from the middle
        self._held = b""  # the start of a line whose newline has not come yet
        self._head_end: int | None = None  # where the head ends, once the cap has cut the file
        self._note_len = 0
        self.fd: int | None
        fd = None
        try:
            # read and write (the cap moves the tail up), never through a link planted at the log's name
            fd = open_nofollow(path, os.O_RDWR | os.O_CREAT)
            self.size = os.lseek(fd, 0, os.SEEK_END)  # a restarted process appends to its log
            self.fd = fd
        except OSError:  # UnsafeLink is one too; a named pipe planted there cannot seek
            # a full disk (or a link) refused even the file: the pipe is drained all the same, the loss counted
            if fd is not None:
                os.close(fd)
            self.fd, self.size = None, 0

    def write(self, chunk: bytes) -> None:
        """Take a piece of output; what ends in a newline is written now, the rest when its line is whole."""
        data = self._held + chunk
        end = data.rfind(b"\n") + 1
        self._held = data[end:]
        out = self._mask(data[:end])
        if len(self._held) > HOLD_BYTES:
            out += self._cut_held()
        self._put(out)

    def close(self) -> None:
        """Write what is held (the last line, without a newline) and close the file."""
        if self._held:
            self._put(self._mask(self._held))
            self._held = b""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def _mask(self, data: bytes) -> bytes:
        if self.redactor is None or not data or not self.redactor.might_hold_values(data):
            return data
        return self.redactor.mask_values(data.decode("utf-8", "surrogateescape")).encode("utf-8", "surrogateescape")

    def _cut_held(self) -> bytes:
        """The older part of a held line too long to wait for its newline, masked; the rest stays held."""
        held = self._held
        if self.redactor is None:
            self._held = b""
            return held
        cr = held.rfind(b"\r") + 1  # a progress bar redrawn in place: each redraw is a line to the eye
        if cr and len(held) - cr <= HOLD_BYTES:
            self._held = held[cr:]
            return self._mask(held[:cr])
        # keep the last longest-form characters, and any secret that starts before the cut and ends after it
        text = held.decode("utf-8", "surrogateescape")
        cut = max(0, len(text) - self.redactor.longest_form)
        for m in self.redactor.matches(text):
            if m.start() < cut < m.end():
                cut = m.start()
                break
        self._held = text[cut:].encode("utf-8", "surrogateescape")
        return self.redactor.mask_values(text[:cut]).encode("utf-8", "surrogateescape")

    def _put(self, data: bytes) -> None:
        if not data:
            return
        if self.fd is None:
            self.lost += len(data)
            return
        try:
            view = memoryview(data)
            while view:
                written = os.write(self.fd, view)
                self.size += written
                view = view[written:]
        except OSError:
            # ENOSPC, EIO: the job must not block on a full pipe because the disk is full; the line still
            # reaches on_line (the scanner reports the full disk) and tail
            self.lost += len(view)
            with contextlib.suppress(OSError):
                self.size = os.lseek(self.fd, 0, os.SEEK_END)
        if self.max_bytes is not None and self.size >= self.max_bytes:
            try:
                self._compact()
            except OSError:
                with contextlib.suppress(OSError):
                    self.size = os.lseek(self.fd, 0, os.SEEK_END)

    def _line_end(self, offset: int) -> int:
        """The offset just past the first newline at or after `offset` (within a window), else `offset`."""
        assert self.max_bytes is not None and self.fd is not None
        window = os.pread(self.fd, max(1, self.max_bytes // 8), offset)
        newline = window.find(b"\n")
        return offset + newline + 1 if newline >= 0 else offset

    def _compact(self) -> None:
        """Drop the middle: keep the head, a note with the bytes dropped so far, and the newest quarter."""
        assert self.max_bytes is not None and self.fd is not None
        fd = self.fd
        if self._head_end is None:
            self._head_end = self._line_end(self.max_bytes // 2)
            self._note_len = 0
        start = self._line_end(self.size - self.max_bytes // 4)  # the tail begins at a line start
        self.dropped += start - self._head_end - self._note_len
        head_ends_line = self._head_end == 0 or os.pread(fd, 1, self._head_end - 1) == b"\n"
        note = (
            ("" if head_ends_line else "\n")
            + f"[prime-train] {size_text(self.dropped)} of this process's output dropped here: this log keeps its "
            f"first {size_text(self._head_end)} and its newest output (logging.max_log_mb = "
            f"{self.max_bytes / 2**20:g})\n"
        ).encode()
        os.pwrite(fd, note, self._head_end)
        self._note_len = len(note)
        dst = self._head_end + len(note)
        while start < self.size:  # dst < start: a piece never overwrites what is still to be copied
            piece = os.pread(fd, min(_COPY_BYTES, self.size - start), start)
            if not piece:
                break
            os.pwrite(fd, piece, dst)
            start += len(piece)
            dst += len(piece)
        os.ftruncate(fd, dst)
        self.size = os.lseek(fd, dst, os.SEEK_SET)


class _LineQueue:
    """Lines from the pump to the callback thread. put() never blocks: past max_lines the oldest go."""

    def __init__(self, max_lines: int):
        self.max_lines = max_lines
        self.dropped = 0
        self._items: collections.deque[tuple[str, int]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False

    def put_many(self, lines: list[str], first_no: int) -> None:
        """Queue `lines`, numbered from first_no; past max_lines the oldest waiting ones are dropped."""
        with self._cond:
            self._items.extend(zip(lines, range(first_no, first_no + len(lines)), strict=True))
            excess = len(self._items) - self.max_lines
            for _ in range(max(0, excess)):
                self._items.popleft()
            self.dropped += max(0, excess)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def take_all(self) -> list[tuple[str, int]] | None:
        """Every waiting line, in order, once there is one; None once closed and empty."""
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            if not self._items:
                return None
            items = list(self._items)
            self._items.clear()
            return items


def _line_text(raw: bytes) -> str:
    """One output line as `on_line` and `tail` get it: decoded, without its line ending, at most LINE_CHARS."""
    text = raw.decode("utf-8", errors="replace").rstrip("\r")
    if len(text) > LINE_CHARS:
        half = LINE_CHARS // 2
        text = text[:half] + " … " + text[-half:]
    return text


class ChildProcess:
    def __init__(
        self,
        spec: ProcessSpec,
        log_path: Path,
        on_line: LineCallback | None = None,
        tail: int = 200,
        on_output_closed: Callable[[], None] | None = None,
        max_pending_lines: int = PENDING_LINES,
        redactor: Redactor | None = None,
        max_log_bytes: int | None = log_cap_bytes(DEFAULT_MAX_LOG_MB),
    ):
        """`redactor`: the secret values masked in the log file (None: those the child's own environment names,
        `Redactor.for_process`); `max_log_bytes`: the log's cap (`log_cap_bytes(cfg.logging.max_log_mb)`)."""
        self.spec = spec
        self.redactor = redactor
        self.max_log_bytes = max_log_bytes
        self.on_output_closed = on_output_closed
        self.log_path = log_path
        self.on_line = on_line
        self.tail: collections.deque[str] = collections.deque(maxlen=tail)
        self.popen: subprocess.Popen | None = None
        self.started_at = 0.0
        self.exited_at: float | None = None
        self.log_bytes_lost = 0  # output the log file did not get (a full disk); on_line and tail still did
        self.log_bytes_dropped = 0  # output the cap (max_log_bytes) removed from the middle of the log file
        self._reader: threading.Thread | None = None  # the pump: pipe -> log file, tail, queue
        self._caller: threading.Thread | None = None  # queue -> on_line
        self._lines = _LineQueue(max_pending_lines)
        self._known: dict[int, psutil.Process] = {}

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen else None

    @property
    def lines_dropped(self) -> int:
        """Lines `on_line` never got because it fell behind (they are in the log file)."""
        return self._lines.dropped

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        if self.redactor is None:
            self.redactor = Redactor.for_process(env)
        self.started_at = time.time()
        self.popen = subprocess.Popen(
            self.spec.argv,
            env=env,
            cwd=self.spec.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: one signal reaches torchrun and every rank
        )
        if self.on_line is not None:
            self._caller = threading.Thread(target=self._call, name=f"lines-{self.name}", daemon=True)
            self._caller.start()
        self._reader = threading.Thread(target=self._pump, name=f"log-{self.name}", daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.popen is not None and self.popen.stdout is not None
        fd = self.popen.stdout.fileno()
        half = READ_BYTES // 2
        partial = b""  # the start of a line whose newline has not come yet: its head and tail when long
        line_no = 0
        try:
            log = _LogFile(self.log_path, self.redactor, self.max_log_bytes)
            try:
                # whatever the pipe holds, up to READ_BYTES, in one read and one write: the job's
                # output is copied as fast as it comes, however many lines it is cut into
                while chunk := os.read(fd, READ_BYTES):
                    self._write(log, chunk)
                    pieces = chunk.split(b"\n")
                    pieces[0] = partial + pieces[0]
                    partial = pieces.pop()
                    if len(partial) > READ_BYTES:
                        partial = partial[:half] + " … ".encode() + partial[-half:]
                    if pieces:
                        lines = [_line_text(p) for p in pieces]
                        self._deliver(lines, line_no)
                        line_no += len(lines)
                if partial:  # the last line, without a newline
                    self._deliver([_line_text(partial)], line_no)
            finally:
                log.close()
                self.log_bytes_lost, self.log_bytes_dropped = log.lost, log.dropped
        finally:
            self._lines.close()
            # the pipe closes when the process (and every child holding it) exits: wake the supervisor
            # now, or once the callback thread has delivered the last line
            if self._caller is None and self.on_output_closed is not None:
                self.on_output_closed()

    def _deliver(self, lines: list[str], first_no: int) -> None:
        """Hand lines numbered first_no + 1, ... to tail and the callback queue."""
        self.tail.extend(lines)
        if self.on_line is not None:
            self._lines.put_many(lines, first_no + 1)

    def _write(self, log: _LogFile, data: bytes) -> None:
        log.write(data)  # a failed write is counted, never raised: the pipe keeps draining
        self.log_bytes_lost, self.log_bytes_dropped = log.lost, log.dropped

    def _call(self) -> None:
        assert self.on_line is not None
        while (batch := self._lines.take_all()) is not None:
            for line, line_no in batch:
                # a broken callback must not stop the others from being called
                with contextlib.suppress(Exception):
                    self.on_line(self.name, line, line_no)
        if self.on_output_closed is not None:
            self.on_output_closed()

    def poll(self) -> int | None:
        if self.popen is None:
            return None
        code = self.popen.poll()
        if code is None and self._reader is not None and not self._reader.is_alive():
            # the output closed: the process is exiting; reap it rather than wait for the next poll
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self.popen.wait(timeout=0.5)
        if code is not None and self.exited_at is None:
            self.exited_at = time.time()
        self.remember_descendants()
        return code

    def remember_descendants(self) -> None:
        """Note every descendant while the tree is intact, so those that escape the group can be found later."""
        if self.popen is None:
            return
        try:
            root = psutil.Process(self.popen.pid)
            for p in [root, *root.children(recursive=True)]:
                self._known.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def signal(self, sig: int) -> None:
        """Send `sig` to the child's whole process group."""
        if self.popen is None:
            return
        # the group's id is the child's pid: once the child is reaped and no member of its group is left, the
        # kernel may give that id to an unrelated group, which must never get our signal
        pgid = self.popen.pid
        if self.popen.poll() is not None and not any(_in_group(p, pgid) for p in self.alive_descendants()):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)

    def known_processes(self) -> list[psutil.Process]:
        """The child and every descendant seen so far (remember_descendants), dead ones included."""
        return list(self._known.values())

    def alive_descendants(self) -> list[psutil.Process]:
        out = []
        for p in self._known.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.Error:
                continue
        return out

    def stop(self, grace_s: float) -> int | None:
        """SIGTERM the group, wait up to grace_s, then SIGKILL whatever is left; returns the exit code."""
        if self.popen is None:
            return None
        self.remember_descendants()
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            deadline = time.time() + grace_s
            while time.time() < deadline and (self.popen.poll() is None or self.alive_descendants()):
                time.sleep(0.1)
        self.kill()
        return self.popen.returncode

    def kill(self) -> None:
        if self.popen is None:
            return
        self.signal(signal.SIGKILL)
        alive = self.alive_descendants()
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        # SIGKILL is not death: an orphan (init reaps it, not us) still runs for a moment, and the attempt's
        # leftover_pids would name a process that was on its way out (DCP's checkpoint process after a kill -9)
        psutil.wait_procs(alive, timeout=5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=10)
        if self.exited_at is None:
            self.exited_at = time.time()
        self.join_output(timeout=5)

    def join_output(self, timeout: float = 5.0) -> None:
        """Wait for the output to drain after the process exited: the log file written, every queued line delivered."""
        deadline = time.monotonic() + timeout
        for thread in (self._reader, self._caller):
            if thread is not None:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))


def _in_group(proc: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(proc.pid) == pgid
    except OSError:
        return False
