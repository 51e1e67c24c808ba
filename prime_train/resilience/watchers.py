"""Watchers: small classes the supervisor polls, each through kit/observe.Watcher: `poll(now)` returns an
Observation (events, a verdict, requests, status values).

Progress (hangs) and where it is read from, torchrun's rank logs, disk (retention and the watermark) and
preemption notices live here; GPU health is in kit/gpu.py, the rollout workers' health in rl/workers.py, log
surfacing in logscan.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from prime_train.contract import SLOW_PHASES, STARTUP_PHASES, Event, Heartbeat, Phase, read_json
from prime_train.kit.failures import Failure, FailureKind
from prime_train.kit.observe import NOTHING, ForwardStop, Note, Observation, StatusKey, Watcher, note
from prime_train.kit.process import Role
from prime_train.resilience.logscan import Finding, LogScanner
from prime_train.retention import safe_remove_checkpoint, select_for_deletion
from prime_train.rundir import list_checkpoints


class ProgressWatcher(Watcher):
    """A step that does not advance within stall_timeout_s of wall clock is a hang.

    Start-up (before the first step, and while compiling) gets startup_timeout_s; a heartbeat that
    says it is saving, exporting or evaluating gets save_timeout_s. The clock restarts at every change
    of the heartbeat, so a slow save that keeps writing its phase is not a stall. The clock is the
    supervisor's own: when it saw the heartbeat change, not the `time` the job wrote in it. `read` returns the
    raw heartbeat object (progress.json, an external job's file, or LogProgress); it is read through
    the contract's Heartbeat, so an older prime-train's phase names still count.

    Polled by the attempt loop at each tick (it only reads a file). Once the job was asked to stop, its stall
    verdict no longer counts: the stop's deadline bounds the job then.
    """

    judges_while_stopping = False

    def __init__(
        self,
        read: Callable[[], dict[str, Any] | None],
        *,
        stall_timeout_s: float,
        startup_timeout_s: float,
        save_timeout_s: float,
        clock: Callable[[], float] = time.time,
    ):
        self.read = read
        self.stall_timeout_s = stall_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.save_timeout_s = save_timeout_s
        self.clock = clock
        self.started = clock()
        self.last_change = self.started
        self.last_seen: Heartbeat | None = None
        self.step: int | None = None
        self.phase: Phase | None = None
        self.first_step: int | None = None
        self.failure: Failure | None = None
        self.weights_step: int | None = None  # RL: the newest policy step recorded as loaded by the workers

    def restart(self) -> None:
        """A new attempt: the clock starts over; the last step seen is kept for reports."""
        self.started = self.last_change = self.clock()
        self.last_seen = None
        self.phase = None
        self.first_step = None
        self.failure = None

    @staticmethod
    def _key(hb: Heartbeat) -> tuple:
        return (hb.step, hb.phase, hb.time)

    def poll(self, now: float | None = None) -> Observation:
        now = self.clock() if now is None else now
        hb = Heartbeat.from_dict(self.read())
        events: list[Note] = []
        if hb is not None and (self.last_seen is None or self._key(hb) != self._key(self.last_seen)):
            # Judged on this process's clock, never the job's: a heartbeat that changes while this attempt is
            # watched was written by this attempt, whatever its `time` says (a job's clock may be hours off, a
            # TZ bug). Only the first heartbeat an attempt sees may be the previous attempt's last word: it counts
            # when its own time says it is this attempt's, else it is the baseline the next change is seen against.
            if self.last_seen is None:
                fresh = hb.time is not None and hb.time >= self.started - 1
            else:
                fresh = True
            if fresh:
                self.last_change = now
                self.phase = hb.phase
                if hb.weights_step is not None and hb.weights_step != self.weights_step:
                    # RL: each policy the workers loaded is on record, with how many loaded it and how fast
                    self.weights_step = hb.weights_step
                    events.append(note(
                        Event.WEIGHTS_LOADED, step=hb.weights_step, workers=hb.workers_reloaded,
                        reload_s=hb.weight_reload_s,
                    ))  # fmt: skip
                if hb.step is not None:
                    if self.first_step is None:
                        self.first_step = hb.step
                    self.step = hb.step
            self.last_seen = hb
        allowance, what = self._allowance()
        idle = now - self.last_change
        if idle > allowance and self.failure is None:
            self.failure = Failure(
                FailureKind.HANG,
                f"no progress for {idle:.0f}s ({what} allowance {allowance:.0f}s); last step {self.step}",
                evidence=[json.dumps(self.last_seen.to_dict())] if self.last_seen else [],
                step=self.step,
            )
            events.append(note(Event.HANG_DETECTED, idle_s=round(idle, 1), step=self.step, phase=self.phase))
        return Observation(events, verdict=self.failure)

    def idle_s(self) -> float:
        """Seconds since the heartbeat last changed (or since the attempt started)."""
        return self.clock() - self.last_change

    def _allowance(self) -> tuple[float, str]:
        if self.phase in SLOW_PHASES:
            return self.save_timeout_s, f"{self.phase}"
        if self.first_step is None or self.phase is None or self.phase in STARTUP_PHASES:
            return self.startup_timeout_s, "start-up"
        return self.stall_timeout_s, "step"


class ProgressSource(Protocol):
    """Where an attempt's progress is read: `read` gives the raw heartbeat object (or None), and `feed` sees
    every line a process of the attempt writes."""

    def read(self) -> dict[str, Any] | None: ...

    def feed(self, process: str, line: str) -> None: ...


class HeartbeatFile:
    """Progress from a heartbeat file: the engine's progress.json, or an external job's job.progress_file."""

    def __init__(self, path: Path):
        self.path = path

    def read(self) -> dict[str, Any] | None:
        return read_json(self.path)

    def feed(self, process: str, line: str) -> None:
        return None


class LogProgress:
    """Progress of an external command read from its output with a regex (group 1 or `step`): only the lines of
    `process` count."""

    def __init__(self, pattern: str, max_steps: int | None = None, *, process: str = Role.JOB.value):
        self.process = process
        self.regex = re.compile(pattern)
        self.step: int | None = None
        self.time: float | None = None
        self.max_steps = max_steps

    def feed(self, process: str, line: str) -> None:
        if process != self.process:
            return
        m = self.regex.search(line)
        if not m:
            return
        value = m.groupdict().get("step") if m.groupdict() else None
        value = value if value is not None else (m.group(1) if m.groups() else None)
        if value is not None and value.isdigit():
            self.step = int(value)
            self.time = time.time()

    def read(self) -> dict[str, Any] | None:
        if self.step is None:
            return None
        return Heartbeat(self.step, Phase.STEP, time=self.time, max_steps=self.max_steps).to_dict()


class RankLogs(Watcher):
    """The logs of the ranks whose output only torchrun's --log-dir holds, scanned as they grow.

    torchrun writes <log_dir>/<run id>/attempt_<k>/<local rank>/{stdout,stderr}.log; local rank 0's output
    also reaches the trainer's own log (--tee with --local-ranks-filter=0), so the others are read here:
    another rank's CUDA OOM or NCCL error is what killed the job, and rank 0 only shows the consequence.
    `poll` runs on the watcher thread, `settle` on the main one before the trainer's exit is judged; a lock keeps
    them apart. What they find goes to `on_finding`, as the lines of the processes' own logs do.
    """

    blocking = True

    def __init__(self, root: Path, on_finding: Callable[[Finding], None], *, max_bytes_per_poll: int = 1 << 20):
        self.root = root
        self.on_finding = on_finding
        self.max_bytes_per_poll = max_bytes_per_poll
        self._files: dict[Path, _TailedLog] = {}
        self._lock = threading.Lock()

    def poll(self, now: float | None = None) -> Observation:
        self.drain()
        return Observation()

    def settle(self, now: float | None = None) -> Observation:
        self.drain(final=True)  # the rank that failed first may have written its last words there
        return Observation()

    def drain(self, *, final: bool = False) -> None:
        """Scan what the rank logs gained since the last call; `final`: the job exited, flush what is open."""
        with self._lock:
            for path in sorted(self.root.glob("*/attempt_*/*/std*.log")):
                if path.parent.name == "0":
                    continue
                log = self._files.get(path)
                if log is None:
                    log = self._files[path] = _TailedLog(path, LogScanner(f"trainer-rank{path.parent.name}", str(path)))
                for finding in log.read(self.max_bytes_per_poll):
                    self.on_finding(finding)
            if final:
                for log in self._files.values():
                    for finding in log.finish():
                        self.on_finding(finding)


class _TailedLog:
    def __init__(self, path: Path, scanner: LogScanner):
        self.path = path
        self.scanner = scanner
        self.offset = 0
        self.line_no = 0
        self.partial = b""

    def read(self, limit: int) -> list[Finding]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(limit)
        except OSError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        found: list[Finding] = []
        for raw in lines:
            self.line_no += 1
            found += self.scanner.feed(raw.decode("utf-8", errors="replace"), self.line_no)
        return found

    def finish(self) -> list[Finding]:
        found = []
        if self.partial:
            self.line_no += 1
            found += self.scanner.feed(self.partial.decode("utf-8", errors="replace"), self.line_no)
            self.partial = b""
        return found + self.scanner.finish()


class DiskWatcher(Watcher):
    """Applies keep_last/keep_every and the disk watermark to the run's whole checkpoints.

    Never deletes the newest whole checkpoint, one still being written (step-N.tmp is never a
    candidate), anything outside the checkpoint directory, or through a symlink.
    """

    blocking = True

    def __init__(
        self,
        ckpt_dir: Path,
        *,
        keep_last: int | None,
        keep_every: int | None,
        high_watermark: float,
        max_bytes: float | None,
        disk_usage: Callable[[str], Any] = shutil.disk_usage,
        protect: Callable[[], set[int]] | None = None,
    ):
        self.ckpt_dir = ckpt_dir
        # steps that must stay for now (the one being uploaded to the bucket); retention waits for them
        self.protect = protect or (lambda: set())
        self.keep_last = keep_last
        self.keep_every = keep_every
        self.high_watermark = high_watermark
        self.max_bytes = max_bytes
        self.disk_usage = disk_usage
        self.failure: Failure | None = None
        self.last_usage: float | None = None

    def poll(self, now: float | None = None) -> Observation:
        events: list[Note] = []
        if not self.ckpt_dir.is_dir():
            return Observation()
        checkpoints = list_checkpoints(self.ckpt_dir)
        steps = [c.step for c in checkpoints]
        by_step = {c.step: c.path for c in checkpoints}
        protected = frozenset(self.protect())
        for step in select_for_deletion(steps, self.keep_last, self.keep_every, protected):
            events.append(self._delete(by_step[step], step, "retention"))
        remaining = [c for c in list_checkpoints(self.ckpt_dir)]
        # over the watermark (or the byte cap): the oldest whole checkpoints go first, never the newest
        breached = False
        while len(remaining) > 1 and self._over_limit(remaining):
            candidates = [c for c in remaining[:-1] if c.step not in protected]
            if not candidates:
                break
            oldest = candidates[0]
            remaining.remove(oldest)
            events.append(self._delete(oldest.path, oldest.step, "watermark"))
            breached = True
        remaining = list_checkpoints(self.ckpt_dir)  # what is really left (a refused delete leaves one)
        if breached and self.keep_last is not None and len(remaining) < self.keep_last:
            why = "the disk is over supervisor.disk_high_watermark (or supervisor.max_disk_gb): oldest went first"
            kept = [c.step for c in remaining]
            events.append(note(Event.RETENTION_BELOW_KEEP_LAST, kept=kept, keep_last=self.keep_last, reason=why))
        usage = self._usage_fraction()
        self.last_usage = usage
        if usage is not None and usage > 0.98 and len(remaining) <= 1:
            left = f"only step-{remaining[0].step}" if remaining else "no whole checkpoint"
            self.failure = Failure(
                FailureKind.DISK_FULL,
                f"disk {usage:.0%} full and retention cannot free more ({left} on it)",
                evidence=[str(self.ckpt_dir)],
            )
        return Observation(events, verdict=self.failure, status={StatusKey.DISK: usage})

    def _usage_fraction(self) -> float | None:
        try:
            du = self.disk_usage(str(self.ckpt_dir))
        except OSError:
            return None
        return du.used / du.total if du.total else None

    def _over_limit(self, remaining) -> bool:
        usage = self._usage_fraction()
        if usage is not None and usage > self.high_watermark:
            return True
        if self.max_bytes is not None:
            return sum(_tree_bytes(c.path) for c in remaining) > self.max_bytes
        return False

    def _delete(self, path: Path, step: int, reason: str) -> Note:
        size = _tree_bytes(path)
        try:
            safe_remove_checkpoint(path, self.ckpt_dir)
        except (ValueError, OSError) as exc:
            return note(Event.CHECKPOINT_DELETE_REFUSED, path=str(path), step=step, reason=str(exc))
        return note(Event.CHECKPOINT_DELETED, path=str(path), step=step, reason=reason, bytes=size)


def _tree_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path, followlinks=False):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


# ---------------------------------------------------------------- preemption notices


class PreemptionWatcher(Watcher):
    """Polls the cloud's instance metadata for a spot interruption notice.

    AWS: IMDSv2 token (PUT /latest/api/token), then GET /latest/meta-data/spot/instance-action
    (404 until the instance is marked, about two minutes ahead). GCP: GET
    /computeMetadata/v1/instance/preempted with `Metadata-Flavor: Google` ("TRUE" about 30 s ahead).
    Off a cloud both requests fail fast and the watcher switches itself off. Once the notice came, every poll
    asks the supervisor to forward the stop (a ForwardStop); the event is recorded once.
    """

    blocking = True

    def __init__(
        self,
        *,
        aws_endpoint: str | None = "http://169.254.169.254",
        gcp_endpoint: str | None = "http://metadata.google.internal",
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.time,
    ):
        self.aws = aws_endpoint
        self.gcp = gcp_endpoint
        self.timeout_s = timeout_s
        self.notice: dict[str, Any] | None = None
        self._errors = {"aws": 0, "gcp": 0}
        self.clock = clock

    def poll(self, now: float | None = None) -> Observation:
        if self.notice is not None:
            return Observation(requests=[self._forward()])
        for name, check in (("aws", self._aws), ("gcp", self._gcp)):
            if getattr(self, name) is None:
                continue
            try:
                found = check()
                self._errors[name] = 0
            except (urllib.error.URLError, OSError, ValueError):
                # off this cloud the endpoint does not answer: stop asking after a few tries
                self._errors[name] += 1
                if self._errors[name] >= 3:
                    setattr(self, name, None)
                continue
            if found:
                self.notice = {"cloud": name, "detail": found, "time": self.clock() if now is None else now}
                seen = note(Event.PREEMPTION_NOTICE, cloud=name, detail=found)
                return Observation([seen], requests=[self._forward()])
        return Observation()

    def _forward(self) -> ForwardStop:
        assert self.notice is not None
        return ForwardStop(f"preemption notice from {self.notice['cloud']}", dict(self.notice))

    @property
    def active(self) -> bool:
        return self.notice is None and (self.aws is not None or self.gcp is not None)

    def _aws(self) -> str | None:
        if self.aws is None:
            return None
        token_req = urllib.request.Request(
            f"{self.aws}/latest/api/token", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"}
        )
        with urllib.request.urlopen(token_req, timeout=self.timeout_s) as r:
            token = r.read().decode()
        req = urllib.request.Request(
            f"{self.aws}/latest/meta-data/spot/instance-action", headers={"X-aws-ec2-metadata-token": token}
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return r.read().decode() or "instance-action"
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # not marked for interruption
                return None
            raise

    def _gcp(self) -> str | None:
        if self.gcp is None:
            return None
        req = urllib.request.Request(
            f"{self.gcp}/computeMetadata/v1/instance/preempted", headers={"Metadata-Flavor": "Google"}
        )
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            body = r.read().decode().strip()
        return "preempted" if body.upper() == "TRUE" else None


class RendezvousWatcher(Watcher):
    """A node other than node 0 of a multi-node engine run: whether node 0's torchrun agent of this attempt, which
    serves the static rendezvous' store at the rendezvous endpoint, has gone; and, before a restart, a wait for it.

    A node that restarts while node 0's agent of the failed attempt still serves (node 0 has not noticed the loss
    yet: up to distributed.peer_timeout_s when the dead rank reset no connection, as under NCCL) joins that dying
    store. At best its new agent meets it as it goes (`DistNetworkError: Broken pipe`: a restart lost); at worst it
    completes the old rendezvous, and node 0's next agent waits distributed.join_timeout_s for a node that never
    comes. So the store is probed at each poll (a TCP connect, nothing sent; blocking: the watchers' thread), and
    `wait_until_gone` holds the next attempt until a store seen open in this attempt has been seen closed. A
    closure shorter than a poll (node 0's next agent up within supervisor.poll_interval_s) can be missed: the wait
    then ends at its bound and the node rejoins, as it did before.
    """

    blocking = True

    def __init__(self, endpoint: str, *, bound_s: float, probe_timeout_s: float = 1.0):
        host, _, port = endpoint.rpartition(":")
        self.endpoint = endpoint
        self.address = (host.strip("[]"), int(port))
        self.bound_s = bound_s
        self.probe_timeout_s = probe_timeout_s
        self.seen_open = False  # in this attempt
        self.gone = False  # ... and closed after that

    def begin(self, now: float) -> Observation:
        self.seen_open = self.gone = False
        return NOTHING

    def poll(self, now: float | None = None) -> Observation:
        self._look()
        return NOTHING

    def _look(self) -> bool:
        """Whether something listens at the endpoint now; remembered for the wait."""
        try:
            with socket.create_connection(self.address, timeout=self.probe_timeout_s):
                pass
        except OSError:  # refused, unreachable, timed out: no store there now
            self.gone = self.gone or self.seen_open
            return False
        self.seen_open = True
        return True

    def wait_until_gone(self, stop: threading.Event, tell: Callable[[Note, str], None], poll_s: float = 0.2) -> None:
        """Before the next attempt: return once the store this attempt met is gone (at once if it was seen to go, or
        never seen), after bound_s, or when `stop` is set."""
        if not self.seen_open or self.gone:
            return
        where = self.endpoint
        tell(
            note(Event.RENDEZVOUS_WAIT, endpoint=where, bound_s=self.bound_s),
            f"waiting for node 0's agent of the failed attempt to leave {where} before rejoining (at most "
            f"{self.bound_s:.0f}s): a node that rejoins that store is lost with it",
        )
        started = time.monotonic()
        while (waited := time.monotonic() - started) < self.bound_s:
            if not self._look():
                line = f"node 0's agent of the failed attempt left {where} after {waited:.0f}s: rejoining"
                tell(note(Event.RENDEZVOUS_WAIT, endpoint=where, waited_s=round(waited, 1), gone=True), line)
                return
            if stop.wait(poll_s):
                return
        line = (
            f"{where} still answers after {self.bound_s:.0f}s (node 0 may have restarted between two looks): rejoining"
        )
        tell(note(Event.RENDEZVOUS_WAIT, endpoint=where, waited_s=self.bound_s, gone=False), line)


def detect_cloud() -> str | None:
    """The cloud this machine runs on, from DMI strings (no network): "aws", "gcp" or None."""
    text = ""
    for name in ("sys_vendor", "product_name", "bios_vendor", "bios_version"):
        try:
            text += Path(f"/sys/class/dmi/id/{name}").read_text(errors="replace") + " "
        except OSError:
            continue
    if "Amazon" in text:
        return "aws"
    if "Google" in text:
        return "gcp"
    return None
