"""events.jsonl: one JSON object a line, everything the supervisor saw and did."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from prime_train.contract import open_nofollow
from prime_train.kit.observe import Note
from prime_train.kit.redact import Redactor

# Bytes of events kept in memory at most while the disk refuses them (a full disk); the oldest go first.
UNWRITTEN_BYTES = 16 * 2**20


class EventLog:
    """Append-only, thread-safe; every string is redacted before it is written (by value too, with the run's
    Redactor; by shape and name alone without one)."""

    def __init__(self, path: str | Path, redactor: Redactor | None = None):
        self.path = Path(path)
        self.redactor = redactor or Redactor()
        self._lock = threading.Lock()
        self._unwritten = b""  # what a full disk refused, written first, from the byte where the write stopped
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"time": time.time(), "event": event, **self.redactor.value(fields)}
        line = json.dumps(record, default=str)
        with self._lock:
            self._unwritten += (line + "\n").encode()
            try:
                # never through a link planted at events.jsonl: refused (UnsafeLink, an OSError) and kept below
                fd = open_nofollow(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    while self._unwritten:  # a short write on a filling disk: the rest goes on where it stopped
                        self._unwritten = self._unwritten[os.write(fd, self._unwritten) :]
                finally:
                    os.close(fd)
            except OSError:
                # ENOSPC, EDQUOT, EIO, a link where the file should be: the supervisor must outlive a full disk; the
                # newest events wait in memory
                if len(self._unwritten) > UNWRITTEN_BYTES:
                    cut = self._unwritten.find(b"\n", len(self._unwritten) - UNWRITTEN_BYTES) + 1
                    self._unwritten = b"\n" + self._unwritten[cut:]  # the newline ends a line cut short on disk
        return record

    def record(self, note: Note) -> dict[str, Any]:
        """Write what a watcher saw (kit/observe.Note)."""
        return self.emit(note.event, **note.fields)


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """All events, each a JSON object; a torn line, a line that is not an object, and bytes that are not UTF-8
    (replaced by U+FFFD) never stop the reading. A missing or unreadable file has none."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return []
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # a torn line, a number too long to parse, nesting too deep
            continue
        if isinstance(record, dict):
            out.append(record)
    return out
