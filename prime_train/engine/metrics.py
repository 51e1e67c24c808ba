"""Per-step metrics: metrics.jsonl, the progress.json heartbeat, the experiment trackers (rank 0 only).

`MetricsLogger` writes what rank 0 measured. `MetricsBuffer` holds the steps' metrics between two reads of the device:
a step's loss and gradient norm stay on the device, and the buffer reads every buffered step at once (one sync) on
logging steps (`due`), at evaluations, saves and stops; it measures tokens/s over the wall clock between two reads
and stops at the first non-finite loss or gradient norm (`Divergence`). `HeartbeatWriter` is progress.json, written
at every phase change and, between them, about once a second.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prime_train.config.schema import Config
from prime_train.contract import Heartbeat, Phase, open_nofollow, read_jsonl, replace_file_atomic, write_heartbeat
from prime_train.engine.errors import EngineConfigError  # noqa: F401 (re-exported: where the engine raises it from)
from prime_train.rundir import RunDir

logger = logging.getLogger("prime_train.engine")

# the verdicts a job leaves when it ends: written durably, as nothing replaces them
_FINAL_PHASES = frozenset({Phase.DONE, Phase.STOPPED, Phase.FAILED})
# The steps' heartbeat: progress.json at most this often (a phase change is written at once).
HEARTBEAT_INTERVAL_S = 1.0
# the metrics whose non-finite value ends the run (the weights diverged)
DIVERGENCE_KEYS = ("loss", "grad_norm")


class MetricsLogger:
    """Writes what rank 0 measured: metrics.jsonl, then each tracker (engine/trackers.py); every other rank gets a
    logger that does nothing."""

    def __init__(self, run_dir: RunDir, cfg: Config, *, enabled: bool):
        self.run_dir = run_dir
        self.cfg = cfg
        self.enabled = enabled
        self.trackers: list = []
        if not enabled:
            return
        from prime_train.engine.trackers import open_trackers

        self.trackers = open_trackers(run_dir, cfg)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's metrics everywhere they are configured to go."""
        if not self.enabled:
            return
        self.log_many([(step, metrics)])

    def log_many(self, rows: list[tuple[int, dict[str, Any]]]) -> None:
        """Record several steps' metrics at once: the loop buffers steps between logging steps (one write)."""
        if not self.enabled or not rows:
            return
        now = time.time()
        lines = "".join(json.dumps(_finite({"step": step, "time": now, **m})) + "\n" for step, m in rows)
        # one write() of all the lines, as contract.append_jsonl does for one: appends never interleave; never
        # through a link planted at metrics.jsonl (contract.UnsafeLink)
        fd = open_nofollow(self.run_dir.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(lines)
        for step, metrics in rows:
            scalars = {k: v for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
            for tracker in self.trackers:
                tracker.log(step, scalars)

    def rewind(self, step: int) -> int:
        """Make metrics.jsonl hold only what led to the state the job starts from; returns the rows dropped.

        A resume from step-N retrains the steps after N, so their old rows go (else metrics.jsonl holds two rows
        for one step, and curves double back); a start from step 0 keeps none, as its step-0 baseline is written
        again. Done by the job, not the supervisor: only the job knows the step it really resumed from (a
        checkpoint that fails verification sends it to an older one), and `prime-train train` has no supervisor.
        """
        if not self.enabled:
            return 0
        dropped = rewind_metrics(self.run_dir, step)
        if dropped:
            after = f"after step {step}" if step > 0 else "of an earlier run (starting from step 0)"
            logger.info("metrics.jsonl: dropped %d row(s) %s; they are trained again", dropped, after)
        for tracker in self.trackers:  # TensorBoard purges the retrained steps' points; the others keep theirs
            tracker.rewind(step)
        return dropped

    def log_text(self, step: int, tag: str, text: str) -> None:
        if not self.enabled:
            return
        for tracker in self.trackers:
            tracker.text(step, tag, text)

    def heartbeat(self, step: int | None, *, phase: Phase = Phase.STEP, **fields: Any) -> None:
        """Rewrite progress.json atomically: the supervisor's proof that the job is alive, and what it is doing."""
        if not self.enabled:
            return
        hb = Heartbeat.now(step, Phase(phase), max_steps=self.cfg.train.max_steps, **fields)
        # a running job's heartbeat is replaced within a second: rename keeps it whole, no fsync (contract.py)
        write_heartbeat(self.run_dir.progress_path, hb, durable=Phase(phase) in _FINAL_PHASES)

    def close(self, failed: bool = False) -> None:
        """Close every tracker (a failed run is marked failed where the tracker has the notion)."""
        for tracker in self.trackers:
            try:
                tracker.close(failed)
            except Exception as e:  # a tracker's upload failing at the end must not turn a finished run into a crash
                logger.warning("closing the %s tracker failed: %s", tracker.name, e)
        self.trackers = []


class HeartbeatWriter:
    """progress.json in this node's run directory; `enabled` on local rank 0 of each node (every node's supervisor
    reads its own run directory: node 0's holds global rank 0's).

    `beat` is the steps' heartbeat: written at once on a phase change or when forced, else only once
    HEARTBEAT_INTERVAL_S has passed, about once a second whatever the step time. `write` writes now.
    """

    def __init__(self, run_dir: RunDir, max_steps: int, *, enabled: bool):
        self.run_dir = run_dir
        self.max_steps = max_steps
        self.enabled = enabled
        self.phase = Phase.STARTUP
        self._last = 0.0

    def beat(self, step: int | None, phase: Phase, *, force: bool = True, **fields: Any) -> None:
        now = time.monotonic()
        if not force and phase == self.phase and now - self._last < HEARTBEAT_INTERVAL_S:
            return
        self.phase = phase
        self._last = now
        self.write(step, phase, **fields)

    def write(self, step: int | None, phase: Phase, **fields: Any) -> None:
        if not self.enabled:
            return
        hb = Heartbeat.now(step, Phase(phase), max_steps=self.max_steps, **fields)
        # a running job's heartbeat is replaced within a second: rename keeps it whole, no fsync (contract.py)
        write_heartbeat(self.run_dir.progress_path, hb, durable=Phase(phase) in _FINAL_PHASES)


@dataclass
class Divergence:
    """A step whose loss or gradient norm is not finite: the run ends there (contract.JobFailure.LOSS_NOT_FINITE)."""

    step: int
    metrics: dict[str, Any]
    names: list[str]

    def describe(self) -> str:
        values = ", ".join(f"{k} {self.metrics[k]}" for k in DIVERGENCE_KEYS if k in self.metrics)
        return f"{' and '.join(self.names)} not finite at step {self.step} ({values})"


class MetricsBuffer:
    """The steps' metrics from their step to metrics.jsonl: buffered, read from the device at once, checked.

    `record` keeps a step's metrics as the step returned them (0-dim device tensors and host values). `due` says
    when a step is a logging step (every `interval` steps, the last, the first of an attempt); `flush` then reads
    every buffered device value in one sync, gives the newest step the throughput of the wall clock since the last
    read (`throughput(tokens, seconds)`, then `step_time_s`), calls `on_read(step_time_s)` (the stop agreement's
    cadence), and stops at the first non-finite loss or gradient norm: the rows before it and its own are written
    and the `Divergence` returned. So a divergence is seen up to `interval` steps after it happened, and always
    before a save could keep the diverged weights (a save flushes first).

    `heartbeat_keys` are the job's fields of progress.json; `heartbeat(m)` gives the newest read values of them,
    with what the step `m` already holds on the host (fresh without a sync).
    """

    def __init__(
        self,
        sink: MetricsLogger,
        *,
        interval: int,
        heartbeat_keys: tuple[str, ...],
        throughput: Callable[[int, float], dict[str, float]],
        on_read: Callable[[float], None] = lambda step_time_s: None,
        param_norms: bool = True,
    ):
        self.sink = sink
        self.interval = interval
        self.heartbeat_keys = heartbeat_keys
        self.param_norms = param_norms
        self._throughput = throughput
        self._on_read = on_read
        self._pending: list[tuple[int, dict[str, Any]]] = []  # steps recorded, not yet read from the device
        self.last: dict[str, Any] = {}  # the heartbeat fields of the newest step read
        self.last_loss: float | None = None
        self._step: int | None = None  # the newest step recorded
        self.start(0, 0)

    def start(self, step: int, tokens: int) -> None:
        """An attempt trains on from `step` (`tokens` seen): its first step is a logging step; the clock starts."""
        self._start_step, self._t_start, self._tokens = step, time.time(), tokens
        self.restart_window()

    @property
    def first_step(self) -> int:
        """The attempt's first step: its time is compile and warm-up."""
        return self._start_step + 1

    def restart_window(self) -> None:
        """Tokens/s counts from now (an eval or a save is not training time)."""
        self._window = (time.perf_counter(), self._tokens)

    def record(self, step: int, metrics: dict[str, Any], *, tokens: int) -> None:
        """A step trained; `tokens` is the run's count after it."""
        self._pending.append((step, metrics))
        self._tokens = tokens
        self._step = step

    def due(self, step: int, *, last: bool) -> bool:
        """Whether `step` is read and logged now; also a step whose host values already say it diverged."""
        return (
            step % self.interval == 0
            or last
            or step == self._start_step + 1
            or any(_not_finite(m.get(k)) for _, m in self._pending[-1:] for k in DIVERGENCE_KEYS)
        )

    def param_norm_due(self, step: int, *, last: bool) -> bool:
        """Whether `step`'s row gets the parameter norm: every `interval` steps and the last."""
        return self.param_norms and (step % self.interval == 0 or last)

    def eta_s(self, step: int, max_steps: int) -> float:
        elapsed = time.time() - self._t_start
        return elapsed / max(1, step - self._start_step) * (max_steps - step)

    def heartbeat(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The heartbeat's step metrics: those of the newest step read, and this step's own where they are on the
        host already; `loss_step` says which step the loss is from."""
        host = {k: metrics[k] for k in self.heartbeat_keys if isinstance(metrics.get(k), float)}
        if "loss" in host and self._step is not None:
            host["loss_step"] = self._step
        return {**self.last, **host}

    def flush(self, *, write: bool = True) -> Divergence | None:
        """Read the buffered steps (one sync) and write them; the Divergence when one of them diverged.

        write=False leaves the rows buffered for the caller to add to (parameter norm, eval) and `write`.
        """
        if not self._pending:
            return None
        _read_device_values(self._pending)
        t0, tokens0 = self._window
        seconds = time.perf_counter() - t0
        newest = self._pending[-1][1]
        for key, value in self._throughput(self._tokens - tokens0, seconds).items():
            newest.setdefault(key, value)
        newest.setdefault("step_time_s", seconds / len(self._pending))
        self.restart_window()
        self._on_read(newest["step_time_s"])
        for i, (step, m) in enumerate(self._pending):
            if names := [k for k in DIVERGENCE_KEYS if _not_finite(m.get(k))]:
                self.sink.log_many(self._pending[: i + 1])  # the diverged step's record too, its NaN as null
                self._pending = []
                return Divergence(step, m, names)
        self.last_loss = newest.get("loss")
        self.last = {k: newest[k] for k in self.heartbeat_keys if k in newest}
        if "loss" in self.last:
            self.last["loss_step"] = self._pending[-1][0]
        if write:
            self.write()
        return None

    def write(self) -> None:
        """Write the buffered (read) rows to metrics.jsonl."""
        self.sink.log_many(self._pending)
        self._pending = []


def _read_device_values(rows: list[tuple[int, dict[str, Any]]]) -> None:
    """Replace every tensor in `rows` by its value, read in one transfer (in float64: a job's float64 sums keep
    every digit, and a float32 value reads as the same number)."""
    import torch

    tensors = [v for _, m in rows for v in m.values() if isinstance(v, torch.Tensor)]
    if not tensors:
        return
    values = iter(torch.stack([t.detach().double().reshape(()) for t in tensors]).tolist())
    for _, m in rows:
        for k, v in m.items():
            if isinstance(v, torch.Tensor):
                m[k] = next(values)


def _not_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN or inf: write them as null (and keep them visible as such)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def read_metrics(run_dir: RunDir) -> list[dict[str, Any]]:
    """All records of metrics.jsonl; torn or garbled lines and bytes that are not UTF-8 never stop the reading
    (a NaN written by an older prime-train reads as a float NaN, null as None)."""
    return read_jsonl(run_dir.metrics_path)


def rewind_metrics(run_dir: RunDir, step: int) -> int:
    """Keep the rows of metrics.jsonl up to `step` (none when `step` is 0), byte for byte, and replace the file
    atomically; returns how many rows were dropped. Rows with no step of their own (torn lines, garbage) go too.
    """
    path = run_dir.metrics_path
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    kept = [line for line in lines if step > 0 and _row_step(line) <= step]
    dropped = sum(1 for line in lines if line.strip()) - len(kept)
    if dropped == 0:
        return 0
    # a fresh file beside it, renamed over it: nothing planted at a temporary name or at metrics.jsonl is followed
    data = b"".join(line if line.endswith(b"\n") else line + b"\n" for line in kept)
    replace_file_atomic(path, data, mode=0o666)
    return dropped


def _row_step(line: bytes) -> float:
    """The step a metrics row records; infinity (never kept) for a line that is not a row."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return math.inf
    return step if isinstance(step, int) and not isinstance(step, bool) else math.inf
