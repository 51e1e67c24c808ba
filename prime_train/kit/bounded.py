"""Reading what a job (or anyone) wrote into a run directory within fixed bounds of memory and time.

`status`, `logs` and the end of `run` read files another process wrote: a JSON line of 50 MB, a heartbeat of a
gigabyte or a log that is one line of 500 MB must not take minutes or gigabytes. Each reader here reads at most
a fixed number of bytes (a JSON file whole only when it is small; a JSON-lines file from its head or its end; a
log's last lines from its end), skips or cuts an over-long line, and says what it left out in a note for the
reader. Standard library only, torch-free.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

MAX_JSON_BYTES = 4 << 20  # a JSON file (supervisor.json, progress.json, .lock): a few hundred bytes when sane
MAX_LINE_BYTES = 1 << 20  # one JSON line (an event, a metrics row): a few hundred bytes when sane
MAX_LOG_LINE_BYTES = 64 << 10  # a log line as `logs` shows it: longer ones are cut, with a note
SCAN_BYTES = 64 << 20  # how much of a file a read from its end (or its head and end) goes through at most
MAX_TEXT_BYTES = 1 << 20  # a run's config.toml, read back by `status`
CHUNK = 1 << 20


def size_text(n: int) -> str:
    """A byte count as people read it: 512 B, 64 KiB, 50.0 MiB."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def _note(notes: list[str] | None, text: str) -> None:
    if notes is not None and text not in notes:
        notes.append(text)


def _file_size(fh: IO[bytes]) -> int | None:
    try:
        st = os.fstat(fh.fileno())
    except (OSError, ValueError):
        return None
    return st.st_size if st.st_mode & 0o170000 == 0o100000 else None  # a regular file's; a pipe has none


def _open(path: str | os.PathLike[str]) -> IO[bytes]:
    """open(path, "rb"), except that a FIFO opens at once instead of waiting for a writer (O_NONBLOCK): each reader
    then reads only a regular file (_file_size), so a FIFO planted at progress.json cannot hang `status`."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb")


def read_bytes(path: str | os.PathLike[str], limit: int, notes: list[str] | None = None) -> bytes | None:
    """The bytes of `path` when it holds at most `limit`; None (with a note) when it holds more, or is unreadable
    or not a regular file."""
    try:
        with _open(path) as fh:
            if _file_size(fh) is None:  # a FIFO, a device, a directory: nothing a run writes
                return None
            data = fh.read(limit + 1)
            if len(data) <= limit:
                return data
            size = _file_size(fh)
    except OSError:
        return None
    shown = f"{size_text(size)}" if size is not None else f"over {size_text(limit)}"
    _note(notes, f"{path}: not read: {shown}, over the {size_text(limit)} such a file may hold")
    return None


def read_text(path: str | os.PathLike[str], limit: int = MAX_TEXT_BYTES, notes: list[str] | None = None) -> str | None:
    """The text of a small file, undecodable bytes replaced; None when missing, unreadable or over `limit`."""
    data = read_bytes(path, limit, notes)
    return data.decode("utf-8", "replace") if data is not None else None


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError):  # half-written or garbled, a number too long, nesting too deep
        return None


def read_json(path: str | os.PathLike[str], limit: int = MAX_JSON_BYTES, notes: list[str] | None = None) -> dict | None:
    """contract.read_json within `limit` bytes: the JSON object in `path`, None when missing, torn, not an object
    or over the limit (then with a note)."""
    data = read_bytes(path, limit, notes)
    obj = _loads(data) if data is not None else None
    return obj if isinstance(obj, dict) else None


@dataclass
class Line:
    """A line read from the end of a file: its bytes (its last `max_line` bytes when longer), its length without the
    newline, and where it starts (None when it starts before the bytes read: `length` is then a lower bound)."""

    data: bytes
    length: int
    start: int | None

    @property
    def whole(self) -> bool:
        return self.start is not None and self.length == len(self.data)


def lines_from_end(
    fh: IO[bytes],
    *,
    max_line: int = MAX_LINE_BYTES,
    budget: int = SCAN_BYTES,
    end: int | None = None,
    keep_empty: bool = False,
) -> Iterator[Line]:
    """The lines of a binary file, newest first, reading at most `budget` bytes back from `end` (the file's end).

    Memory stays within a chunk and `max_line` however long a line is. A last line without its newline (being
    written) counts as a line; empty lines are left out unless `keep_empty`."""
    if end is None:
        end = fh.seek(0, os.SEEK_END)
    pos = end
    tail, tail_len = b"", 0  # the end of the line whose start is not read yet
    stop = max(0, end - budget)
    last = True  # the piece after the file's last newline: a line only when not empty
    while pos > stop:
        n = min(CHUNK, pos - stop)
        pos -= n
        fh.seek(pos)
        chunk = fh.read(n)
        if len(chunk) != n:  # the file shrank under us (truncated, rotated): what was read stands
            return
        pieces = chunk.split(b"\n")
        offset = pos + n  # where the piece being looked at ends
        for i in range(len(pieces) - 1, -1, -1):
            piece = pieces[i]
            start = offset - len(piece)  # the piece starts after the newline that ends pieces[i - 1]
            offset = start - 1
            if i == len(pieces) - 1:
                length = len(piece) + tail_len
                data = (piece + tail)[-max_line:] if len(tail) < max_line else tail
            else:
                length, data = len(piece), piece[-max_line:]
            if i == 0:
                tail, tail_len = data, length
            elif length or (keep_empty and not last):
                yield Line(data, length, start)
            last = False
    if tail_len or (keep_empty and pos == 0 and not last):
        yield Line(tail, tail_len, pos if pos == 0 else None)


def records_from_end(
    path: str | os.PathLike[str],
    notes: list[str] | None = None,
    *,
    max_line: int = MAX_LINE_BYTES,
    budget: int = SCAN_BYTES,
    contains: tuple[bytes, ...] = (),
) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (events.jsonl), newest first, from its last `budget` bytes.

    A line over `max_line` bytes is skipped and noted; a torn or garbled line, or one that is not an object, is
    skipped as contract.read_jsonl does. With `contains`, lines holding none of those byte strings are skipped
    unparsed."""
    name = str(path)
    try:
        fh = _open(path)
    except OSError:
        return
    try:
        if _file_size(fh) is None:  # a pipe or a device: nothing to seek in
            return
        for line in lines_from_end(fh, max_line=max_line, budget=budget):
            if line.start is None:
                _note(notes, f"{name}: only its last {size_text(budget)} read")
                continue
            if line.length > max_line:
                _note(notes, f"{name}: a line of {size_text(line.length)} skipped (over {size_text(max_line)})")
                continue
            if contains and not any(c in line.data for c in contains):
                continue
            obj = _loads(line.data)
            if isinstance(obj, dict):
                yield obj
    finally:
        fh.close()


def _forward_lines(fh: IO[bytes], max_line: int, budget: int) -> Iterator[tuple[bytes | None, int]]:
    """(line, length) from the file's position on, reading at most about `budget` bytes; an over-long line is
    (None, its length) and is read through in chunks, never held (its length negative: at least that, when the
    budget ran out inside it)."""
    read = 0
    while read < budget:
        piece = fh.readline(max_line + 1)
        if not piece:
            return
        read += len(piece)
        if piece.endswith(b"\n") or len(piece) <= max_line:
            yield piece.rstrip(b"\n"), len(piece.rstrip(b"\n"))
            continue
        length = len(piece)
        while not piece.endswith(b"\n") and read < budget:
            piece = fh.readline(CHUNK)
            if not piece:
                break
            read += len(piece)
            length += len(piece.rstrip(b"\n"))
        yield None, length if piece.endswith(b"\n") or not piece else -length


def _skip_line(fh: IO[bytes]) -> None:
    """Read through the rest of the current line, in chunks."""
    while (piece := fh.readline(CHUNK)) and not piece.endswith(b"\n"):
        pass


def records(
    path: str | os.PathLike[str],
    notes: list[str] | None = None,
    *,
    max_line: int = MAX_LINE_BYTES,
    budget: int = SCAN_BYTES,
    contains: tuple[bytes, ...] = (),
) -> Iterator[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (metrics.jsonl) in file order, like contract.read_jsonl, within bounds.

    A file over `budget` bytes is read at its head and its end (half of `budget` each; what lies between is left
    out, with a note); a line over `max_line` bytes is skipped and noted. With `contains`, lines without those bytes
    are skipped unparsed."""
    name = str(path)
    try:
        fh = _open(path)
    except OSError:
        return
    try:
        size = _file_size(fh)
        if size is None:
            return
        parts = [(0, budget)] if size <= budget else [(0, budget // 2), (size - budget // 2, budget // 2)]
        if len(parts) > 1:
            _note(notes, f"{name}: {size_text(size)}; only its first and last {size_text(budget // 2)} read")
        for offset, part_budget in parts:
            fh.seek(offset)
            if offset:  # the middle of a line: the next whole one starts after a newline
                _skip_line(fh)
            for data, length in _forward_lines(fh, max_line, part_budget):
                if data is None:
                    size = size_text(abs(length)) if length > 0 else f"over {size_text(-length)}"
                    _note(notes, f"{name}: a line of {size} skipped (over {size_text(max_line)})")
                    continue
                if contains and not any(c in data for c in contains):
                    continue
                obj = _loads(data)
                if isinstance(obj, dict):
                    yield obj
    finally:
        fh.close()


def tail_lines(
    path: str | os.PathLike[str], lines: int, *, max_line: int = MAX_LOG_LINE_BYTES, budget: int = SCAN_BYTES
) -> list[str]:
    """The last `lines` lines of a log file, each ending in a newline, undecodable bytes replaced.

    Reads from the end, at most `budget` bytes. A line over `max_line` bytes shows its head and a note of how long
    it was; a line that starts before the bytes read shows its end, after a note."""
    out: list[str] = []
    with _open(path) as fh:
        if _file_size(fh) is None:  # a pipe or a device: no end to read back from
            return [f"[prime-train: {path} is not a regular file; not read]\n"]
        for line in lines_from_end(fh, max_line=max_line, budget=budget, keep_empty=True):
            if len(out) >= lines:
                break
            if line.start is None:
                text = line.data.decode("utf-8", "replace")
                out.append(f"[prime-train: earlier output not read: only the last {size_text(budget)}] …{text}\n")
            elif line.whole:
                out.append(line.data.decode("utf-8", "replace") + "\n")
            else:
                fh.seek(line.start)
                head = fh.read(max_line).decode("utf-8", "replace")
                out.append(f"{head}{cut_note(line.length, max_line)}\n")
    out.reverse()
    return out


def all_lines(path: str | os.PathLike[str], *, max_line: int = MAX_LOG_LINE_BYTES) -> Iterator[str]:
    """Every line of a log file in order, each ending in a newline; a line over `max_line` bytes cut to its head,
    with a note. Memory stays within `max_line` and a chunk."""
    with _open(path) as fh:
        if _file_size(fh) is None:  # a pipe or a device: no lines of a log
            return
        yield from cut_lines(fh, max_line=max_line)


def cut_lines(fh: IO[bytes], *, max_line: int = MAX_LOG_LINE_BYTES) -> Iterator[str]:
    """The lines of a binary stream from its position to its end (see all_lines)."""
    while True:
        piece = fh.readline(max_line + 1)
        if not piece:
            return
        if piece.endswith(b"\n") or len(piece) <= max_line:
            yield piece.decode("utf-8", "replace")
            continue
        head, length = piece[:max_line], len(piece)
        while piece and not piece.endswith(b"\n"):
            piece = fh.readline(CHUNK)
            length += len(piece.rstrip(b"\n"))
        yield f"{head.decode('utf-8', 'replace')}{cut_note(length, max_line)}\n"


def cut_note(length: int, limit: int) -> str:
    """What follows the head of a log line that was cut."""
    return f" … [prime-train: line of {size_text(length)} cut to its first {size_text(limit)}]"


def clip(text: object, limit: int = 2000) -> str:
    """`str(text)`, cut to `limit` characters with a note of how many were left out: what rich lays out stays small
    (its cropping of one cell is quadratic in the cell's length)."""
    s = str(text)
    if len(s) <= limit:
        return s
    return f"{s[:limit]} … [{len(s) - limit} more characters]"
