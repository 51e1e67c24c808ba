"""A supervised child's output: every byte reaches the log file, and the job never waits on the line callback."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import pytest

from prime_train.kit.process import LINE_CHARS, ChildProcess, LineCallback, ProcessSpec

HOSTILE_LINES = 60_000  # ~2.4 MB of `[0001ab] Traceback (most recent call last):`


def _python(name: str, code: str) -> ProcessSpec:
    return ProcessSpec(name, [sys.executable, "-c", code], role="job")


def _collector() -> tuple[list[tuple[str, int]], LineCallback]:
    """A list and an on_line callback that appends (line, line number) to it."""
    got: list[tuple[str, int]] = []

    def on_line(process: str, line: str, line_no: int) -> None:
        got.append((line, line_no))

    return got, on_line


def test_job_flooding_hostile_lines_is_not_slowed_by_a_slow_callback(tmp_path):
    # 1 ms a line: called inline, the callback would hold the job for a minute (the pipe fills and
    # the job's writes block); behind the queue the job finishes as fast as it prints
    code = (
        "import sys\n"
        f"for i in range({HOSTILE_LINES}):\n"
        "    sys.stdout.write(f'[{i:06x}] Traceback (most recent call last):\\n')\n"
    )
    got: list[int] = []

    def slow(process: str, line: str, line_no: int) -> None:
        time.sleep(0.001)
        got.append(line_no)

    child = ChildProcess(_python("job", code), tmp_path / "job.log", on_line=slow, max_pending_lines=500)
    started = time.monotonic()
    child.start()
    assert child.popen is not None
    assert child.popen.wait(timeout=30) == 0
    assert time.monotonic() - started < 20  # generous: unsupervised it takes well under a second
    child.join_output(timeout=30)

    lines = (tmp_path / "job.log").read_text().splitlines()
    assert len(lines) == HOSTILE_LINES and lines[-1] == f"[{HOSTILE_LINES - 1:06x}] Traceback (most recent call last):"
    # the callback fell behind: it got the newest lines, in order, and every line is accounted for
    assert got[-1] == HOSTILE_LINES and got == sorted(got)
    assert len(got) + child.lines_dropped == HOSTILE_LINES
    assert child.lines_dropped > 0


def test_every_line_reaches_the_callback_in_order_when_it_keeps_up(tmp_path):
    got, on_line = _collector()
    child = ChildProcess(
        _python("job", "for i in range(2000): print('line', i)"), tmp_path / "job.log", on_line=on_line
    )
    child.start()
    assert child.popen is not None and child.popen.wait(timeout=30) == 0
    child.join_output(timeout=10)
    assert got == [(f"line {i}", i + 1) for i in range(2000)]
    assert child.lines_dropped == 0
    assert list(child.tail)[-1] == "line 1999"


def test_output_closed_is_signalled_after_the_last_line_was_delivered(tmp_path):
    got, on_line = _collector()
    closed = threading.Event()
    seen_at_close: list[int] = []

    def on_closed() -> None:
        seen_at_close.append(len(got))
        closed.set()

    child = ChildProcess(
        _python("job", "for i in range(500): print(i)"),
        tmp_path / "job.log",
        on_line=on_line,
        on_output_closed=on_closed,
    )
    child.start()
    assert closed.wait(timeout=30)
    assert seen_at_close == [500]


def test_a_failing_callback_does_not_stop_the_lines_after_it(tmp_path):
    got: list[int] = []

    def flaky(process: str, line: str, line_no: int) -> None:
        got.append(line_no)
        if line_no % 2:
            raise RuntimeError("scanner bug")

    child = ChildProcess(_python("job", "for i in range(10): print(i)"), tmp_path / "job.log", on_line=flaky)
    child.start()
    assert child.popen is not None and child.popen.wait(timeout=30) == 0
    child.join_output(timeout=10)
    assert got == list(range(1, 11))


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, where every write fails with ENOSPC")
def test_a_full_disk_under_the_log_does_not_block_the_job_or_hide_its_lines(tmp_path):
    got, on_line = _collector()
    code = "for i in range(3000): print('step', i)\nprint('OSError: [Errno 28] No space left on device')"
    child = ChildProcess(_python("job", code), Path("/dev/full"), on_line=on_line)
    child.start()
    assert child.popen is not None and child.popen.wait(timeout=30) == 0
    child.join_output(timeout=10)
    assert len(got) == 3001 and got[-1] == ("OSError: [Errno 28] No space left on device", 3001)
    assert child.log_bytes_lost == sum(len(f"step {i}\n") for i in range(3000)) + len(got[-1][0]) + 1


def test_a_line_without_newline_is_logged_whole_and_delivered_cut(tmp_path):
    # 8 MB of a progress bar that never printed a newline, then the shell's "Killed"
    size = 8 * 1024 * 1024
    code = f"import sys\nsys.stdout.write('x' * {size} + 'it/s]')\nsys.stdout.write('\\nKilled\\n')"
    got, on_line = _collector()
    child = ChildProcess(_python("job", code), tmp_path / "job.log", on_line=on_line)
    child.start()
    assert child.popen is not None and child.popen.wait(timeout=60) == 0
    child.join_output(timeout=30)
    assert (tmp_path / "job.log").stat().st_size == size + len("it/s]\nKilled\n")
    (bar, bar_no), killed = got
    assert bar_no == 1 and len(bar) <= LINE_CHARS + 3 and bar.startswith("xxx") and bar.endswith("it/s]")
    assert killed == ("Killed", 2)


def test_a_named_pipe_at_a_log_is_dropped_without_a_wait_or_a_leaked_descriptor(tmp_path):
    from prime_train.kit.process import _LogFile

    pipe = tmp_path / "trainer.log"
    os.mkfifo(pipe)
    before = len(os.listdir("/proc/self/fd"))
    log = _LogFile(pipe, None, None)
    log.write(b"a line\n")
    log.close()
    assert log.fd is None and log.lost > 0
    assert len(os.listdir("/proc/self/fd")) == before
