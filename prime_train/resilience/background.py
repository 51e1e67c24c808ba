"""The supervisor's slow watchers (disk, GPU, worker health, backups, cloud notices), polled on a thread of
their own so that none of them ever delays the main loop."""

from __future__ import annotations

import threading
from typing import Any

from prime_train.contract import Event
from prime_train.kit.events import EventLog
from prime_train.kit.failures import Failure
from prime_train.resilience.watchers import DiskWatcher, PreemptionWatcher


class Background:
    """Slow watchers (disk, GPU, cloud notices) polled in one thread so they never delay the main loop."""

    def __init__(self, watchers: list, interval: float, events: EventLog):
        self.watchers = watchers
        self.interval = interval
        self.events = events
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="watchers", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for w in self.watchers:
                try:
                    for event in w.poll():
                        self.events.emit(**event)
                except Exception as exc:  # a watcher bug must not take the run down
                    self.events.emit(Event.WATCHER_ERROR, watcher=type(w).__name__, error=repr(exc))
            self._stop.wait(self.interval)

    def failure(self) -> Failure | None:
        for w in self.watchers:
            f = getattr(w, "failure", None)
            if f is not None:
                return f
        return None

    def preemption_notice(self) -> dict[str, Any] | None:
        for w in self.watchers:
            if isinstance(w, PreemptionWatcher) and w.notice is not None:
                return w.notice
        return None

    def disk_usage(self) -> float | None:
        for w in self.watchers:
            if isinstance(w, DiskWatcher):
                return w.last_usage
        return None

    def gpu_summary(self) -> dict[str, Any] | None:
        for w in self.watchers:
            summary = getattr(w, "last_summary", None)
            if summary is not None:
                return summary
        return None
