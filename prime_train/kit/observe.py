"""What a watcher saw, in one shape: every watcher of the supervisor answers `poll(now)` with an `Observation`.

An observation holds the events to record (each a `Note`, named from contract.Event), at most one verdict (a
Failure that ends the attempt), typed requests for the supervisor to act on (restart one rollout worker, forward
a stop to the job), and values for the console's status line. Nothing comes back any other way: the supervisor
never reads a watcher's attributes or asks for its type.

The `Watcher` protocol also has three hooks with nothing to do by default: `begin` (before the attempt's
processes start: the GPU watcher's baseline), `settle` (the trainer exited: what is still to be read before its
exit is judged, torchrun's rank logs) and `restarted` (a process was restarted on its own: judge it afresh).
A watcher that may block (the network, NVML, a walk of the disk) says so with `blocking`: it is polled on the
watchers' thread, never on the attempt loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

from prime_train.contract import Event
from prime_train.kit.failures import Failure


@dataclass(frozen=True)
class Note:
    """One line for events.jsonl: its name from the catalogue (contract.Event) and its fields."""

    event: Event
    fields: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.event, Event):  # a stray string never reaches events.jsonl
            raise TypeError(f"an event is named from contract.Event, not {self.event!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.event, **self.fields}


def note(event: Event, **fields: Any) -> Note:
    """The event `event` with `fields`, to be recorded."""
    return Note(event, fields)


class StatusKey(StrEnum):
    """The console's status values a watcher provides (keys of the status the CLI shows)."""

    DISK = "disk"  # the checkpoints' disk, used as a fraction
    GPU = "gpu"  # kit.gpu.summary of the last readings


@dataclass(frozen=True)
class RestartWorker:
    """Restart this rollout worker on its own: alive but useless (wedged, or gone from its GPU)."""

    process: str
    reason: str  # why, in words: "stopped answering /health"


@dataclass(frozen=True)
class ForwardStop:
    """Ask the job to checkpoint and stop now (a cloud's preemption notice): SIGTERM to every process."""

    reason: str  # what asked, in words: "preemption notice from aws"
    notice: Mapping[str, Any]  # the notice's fields, as the events record them


Request = RestartWorker | ForwardStop


@dataclass(frozen=True)
class Observation:
    """What one poll of a watcher saw. A verdict is kept by the supervisor: a watcher may give it once."""

    events: Sequence[Note] = ()
    verdict: Failure | None = None
    requests: Sequence[Request] = ()
    status: Mapping[StatusKey, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))
        object.__setattr__(self, "requests", tuple(self.requests))
        object.__setattr__(self, "status", MappingProxyType(dict(self.status)))

    def records(self) -> list[dict[str, Any]]:
        """The events as events.jsonl has them, less the time: {"event": name, **fields}."""
        return [n.to_dict() for n in self.events]


NOTHING = Observation()


class Watcher(Protocol):
    """What the supervisor polls during an attempt. Subclass it for the hooks' defaults."""

    # it may block (the network, NVML, a walk of the disk): polled on the watchers' thread every
    # supervisor.poll_interval_s; else by the attempt loop at each of its ticks
    blocking: ClassVar[bool] = False
    # whether its verdict still ends an attempt once the job was asked to stop (the stop's own deadline,
    # supervisor.term_grace_s, bounds the job then)
    judges_while_stopping: ClassVar[bool] = True

    def poll(self, now: float) -> Observation:
        """Look once; `now` is the supervisor's clock (time.time())."""
        ...

    def begin(self, now: float) -> Observation:
        """Before the attempt's processes start."""
        return NOTHING

    def settle(self, now: float) -> Observation:
        """The job's trainer exited: what is still to be seen before its exit is judged."""
        return NOTHING

    def restarted(self, process: str) -> None:
        """`process` was restarted on its own: what was judged of it is forgotten."""
        return None
