"""A supervised child: its own process group, output to a log file and through a line callback.

Teardown is SIGTERM to the group, a grace period, then SIGKILL to the group and to any
descendant that left it (psutil finds them): no orphans, ever.

The child's output never waits on the supervisor. One thread (the pump) copies the pipe to the
log file, every byte, and hands each line to a bounded queue; another thread calls `on_line`
from that queue. When the callback falls behind (a job printing faster than the log scanner
reads), the queue drops its oldest lines, counted in `lines_dropped`, and keeps the newest: a
process dies at the end of its output, so that is where its cause is. A full disk does not stop
the pump either: a failed write is counted in `log_bytes_lost` and the pipe keeps draining.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import psutil


@dataclass
class ProcessSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    role: str = "trainer"  # "trainer" | "inference" | "job"


LineCallback = Callable[[str, str, int], None]  # (process name, line, line number)

# The pipe is read in pieces of at most this many bytes; a line without a newline (a progress bar
# redrawn with \r for hours) is kept as its head and tail, so it never has to fit in memory whole.
READ_BYTES = 65_536
# Longer lines reach `on_line` and `tail` as their head and tail, half each (the log file gets them whole).
LINE_CHARS = 16_384
# Lines waiting for a slow `on_line` at most: about 160 MB in the worst case of LINE_CHARS lines,
# about 1 MB for ordinary ones, and drained in a fraction of a second by the log scanner.
PENDING_LINES = 10_000


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
    ):
        self.spec = spec
        self.on_output_closed = on_output_closed
        self.log_path = log_path
        self.on_line = on_line
        self.tail: collections.deque[str] = collections.deque(maxlen=tail)
        self.popen: subprocess.Popen | None = None
        self.started_at = 0.0
        self.exited_at: float | None = None
        self.log_bytes_lost = 0  # output the log file did not get (a full disk); on_line and tail still did
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
            try:
                log: BinaryIO | None = open(self.log_path, "ab", buffering=0)  # noqa: SIM115 (closed below)
            except OSError:
                log = None  # a full disk refused even the file: the pipe is drained all the same
            with log or contextlib.nullcontext():
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

    def _write(self, log: BinaryIO | None, data: bytes) -> None:
        try:
            if log is None:
                raise OSError("no log file")
            log.write(data)
        except OSError:
            # ENOSPC, EIO: the job must not block on a full pipe because the disk is full; the
            # line still reaches on_line (the scanner reports the full disk) and tail
            self.log_bytes_lost += len(data)

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
        for p in self.alive_descendants():
            with contextlib.suppress(psutil.Error):
                p.kill()
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
