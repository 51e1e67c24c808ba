"""An attempt's watchers, polled through one protocol (kit/observe.Watcher), each where it belongs.

The quick ones (the progress watcher: it reads a file) are polled by the attempt loop at each of its ticks; the
ones that may block (disk, GPU, worker health, backups, cloud notices, torchrun's rank logs) on a thread of
their own every supervisor.poll_interval_s, so that none of them ever delays the loop. Either way an
observation is taken the same way: its events are recorded at once, on the thread that saw them; its verdict,
requests and status values wait here for the attempt loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from prime_train.contract import Event
from prime_train.kit.failures import Failure
from prime_train.kit.observe import Note, Observation, Request, RestartWorker, StatusKey, Watcher, note


class Watching:
    """The watchers of one attempt: `begin` them before its processes start, `start` the thread once they run,
    `tick` at each turn of the attempt loop, `stop` at its end."""

    def __init__(self, watchers: Sequence[Watcher], interval: float, record: Callable[[Note], Any]):
        self.watchers = list(watchers)
        self.quick = [w for w in self.watchers if not w.blocking]
        self.slow = [w for w in self.watchers if w.blocking]
        self.interval = interval
        self.record = record
        self._lock = threading.Lock()
        self._verdicts: dict[int, Failure] = {}  # the first verdict of each watcher (by id)
        self._requests: list[Request] = []
        self._status: dict[StatusKey, Any] = {}
        self._restarts: dict[str, int] = {}  # how often each process was restarted on its own, this attempt
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="watchers", daemon=True)

    # ------------------------------------------------------------------ the attempt loop's side

    def begin(self, now: float) -> None:
        for w in self.watchers:
            self._take(w, w.begin(now))

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def tick(self, now: float) -> None:
        """Poll the quick watchers (on this thread: an exception is the supervisor's own bug, and it says so)."""
        for w in self.quick:
            self._take(w, w.poll(now))

    def settle(self, now: float) -> None:
        """The trainer exited: what the watchers still have to say before its exit is judged."""
        for w in self.watchers:
            self._take(w, w.settle(now))

    def requests(self) -> list[Request]:
        """What the watchers asked for since the last call, oldest first."""
        with self._lock:
            out, self._requests = self._requests, []
        return out

    def verdict(self, *, stopping: bool) -> Failure | None:
        """The verdict that ends the attempt, if one was given: the quick watchers' first, then in the watchers'
        order; while `stopping`, only of those that judge a stopping job."""
        with self._lock:
            for w in (*self.quick, *self.slow):
                found = self._verdicts.get(id(w))
                if found is not None and (w.judges_while_stopping or not stopping):
                    return found
        return None

    def status(self) -> dict[StatusKey, Any]:
        """The newest value of each status the watchers provide."""
        with self._lock:
            return dict(self._status)

    def restarted(self, process: str) -> None:
        """`process` was restarted on its own: every watcher judges it afresh, and a request about the process it
        replaced, made while it was being replaced, is dropped."""
        with self._lock:
            self._restarts[process] = self._restarts.get(process, 0) + 1
            self._requests = [r for r in self._requests if not _about(r, process)]
        for w in self.watchers:
            w.restarted(process)

    # ------------------------------------------------------------------ both threads

    def _take(self, w: Watcher, seen: Observation, restarts: dict[str, int] | None = None) -> None:
        for event in seen.events:
            self.record(event)
        with self._lock:
            if seen.verdict is not None:
                self._verdicts.setdefault(id(w), seen.verdict)
            current = self._restarts
            # judged before a restart that happened meanwhile: about the process that is gone
            self._requests += [r for r in seen.requests if restarts is None or not _stale(r, restarts, current)]
            self._status.update(seen.status)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for w in self.slow:
                with self._lock:
                    restarts = dict(self._restarts)
                try:
                    seen = w.poll(time.time())
                except Exception as exc:  # a watcher bug must not take the run down
                    self.record(note(Event.WATCHER_ERROR, watcher=type(w).__name__, error=repr(exc)))
                    continue
                self._take(w, seen, restarts)
            self._stop.wait(self.interval)


def _about(request: Request, process: str) -> bool:
    return isinstance(request, RestartWorker) and request.process == process


def _stale(request: Request, before: dict[str, int], now: dict[str, int]) -> bool:
    return isinstance(request, RestartWorker) and before.get(request.process, 0) != now.get(request.process, 0)
