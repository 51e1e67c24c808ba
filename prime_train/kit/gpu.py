"""GPU health: NVML readings behind a small interface, their record, and the watcher that judges them.

The supervisor polls `GpuHealthWatcher` from its watcher thread. Readings come from a `GpuSource`:
`NvmlSource` on a real machine, or `ReplaySource` reading a gpu.jsonl when PRIME_TRAIN_GPU_REPLAY names
one, so a run's GPU history (recorded by `GpuRecorder` into its run directory) or a field incident can
be replayed anywhere, CPU machines included. Torch-free on purpose: the supervisor never imports torch.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from prime_train.contract import Event, append_jsonl
from prime_train.kit.failures import Failure, FailureKind
from prime_train.kit.observe import Note, Observation, RestartWorker, StatusKey, Watcher, note
from prime_train.kit.process import Role

logger = logging.getLogger("prime_train.gpu")

MIB = 1024 * 1024

# NVIDIA Xid catalogue (docs.nvidia.com/deploy/xid-errors, "Analyzing Xid Errors with the Xid Catalog",
# and the dynamic page retirement guide, docs.nvidia.com/deploy/dynamic-page-retirement). The ones below
# mean the GPU, its memory or its links can no longer be trusted: the job's state on it is suspect and a
# restart on the same device without a GPU reset usually fails again.
FATAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error (uncorrectable memory error)",
    63: "ECC page retirement / row remapping recorded (takes effect after a GPU reset)",
    64: "ECC page retirement / row remapping failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error (the affected application must restart)",
    95: "uncontained ECC error (every application on the GPU is affected; reset the GPU)",
}
# These are usually raised by the application rather than the hardware (a bad kernel, an illegal address, a
# killed context): worth a warning in the events, not a verdict on the GPU. The process watcher sees the crash.
WARNING_XIDS: dict[int, str] = {
    13: "graphics engine exception (often an application error)",
    31: "GPU memory page fault (often an illegal address in the application)",
    43: "GPU stopped processing (a channel was reset after an application error)",
    45: "preemptive cleanup after a previous error or a killed process",
}

# Bits of nvmlDeviceGetCurrentClocksEventReasons (called ...ThrottleReasons before driver 535); the values are
# part of NVML's stable ABI, so they are spelled out here rather than looked up by names that differ by version.
CLOCK_EVENT_REASONS: dict[int, str] = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
# Idle, user-set clocks, sync boost and display clocks are normal operation; these slow a job down.
THROTTLE_WARNINGS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)

# A GPU is "back at its baseline" when it holds at most this much more than before the attempt started. A live
# CUDA context alone holds ~500 MiB (518 MiB of 81559 on an H100 during the tiny job's whole start-up), so any
# process still on the GPU stays above it, and an empty GPU falls below it.
BASELINE_MARGIN_MIB = 256.0
# at most this long between two lines of gpu.jsonl while nothing changes
RECORD_INTERVAL_S = 60.0
ENV_GPU_REPLAY = "PRIME_TRAIN_GPU_REPLAY"
# why a rollout worker whose GPUs went empty is restarted, as the events and the console say it
LEFT_ITS_GPU = "left its GPU (back at its memory from before the attempt, 0 %) while its process lives on"


@dataclass
class GpuProcess:
    pid: int  # as NVML reports it: in a container, a host PID the supervisor cannot match
    used_mib: float | None  # None where the driver cannot attribute memory (WDDM, some containers)


@dataclass
class GpuReading:
    """One GPU at one poll; a field NVML could not read is None (or empty)."""

    index: int
    uuid: str
    name: str
    utilization_pct: float | None
    memory_used_mib: float | None
    memory_total_mib: float | None
    processes: list[GpuProcess] = field(default_factory=list)
    xid: list[int] = field(default_factory=list)
    ecc_uncorrected: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    throttle_reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """The gpu.jsonl form of a reading (throttle_reasons only when there are any)."""
        out = asdict(self)
        if not out["throttle_reasons"]:
            del out["throttle_reasons"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GpuReading:
        """A reading from its gpu.jsonl form; missing optional fields read as unknown."""

        def number(key: str) -> float | None:
            value = data.get(key)
            return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

        ecc = data.get("ecc_uncorrected")
        return cls(
            index=int(data["index"]),
            uuid=str(data.get("uuid") or ""),
            name=str(data.get("name") or ""),
            utilization_pct=number("utilization_pct"),
            memory_used_mib=number("memory_used_mib"),
            memory_total_mib=number("memory_total_mib"),
            processes=[GpuProcess(int(p["pid"]), p.get("used_mib")) for p in data.get("processes") or []],
            xid=[int(x) for x in data.get("xid") or []],
            ecc_uncorrected=int(ecc) if isinstance(ecc, int) and not isinstance(ecc, bool) else None,
            temperature_c=number("temperature_c"),
            power_w=number("power_w"),
            throttle_reasons=[str(r) for r in data.get("throttle_reasons") or []],
        )


class GpuSource(Protocol):
    def read(self) -> list[GpuReading]: ...


class NvmlSource:
    """Readings from NVML (nvidia-ml-py); every field is read on its own so one unsupported query costs only it."""

    def __init__(self) -> None:
        self.error: str | None = None
        self._handles: list[Any] = []
        self._event_sets: dict[int, Any] = {}
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as exc:  # no library, no driver: a machine without NVIDIA GPUs reads as no GPUs
            self.error = f"{type(exc).__name__}: {exc}"
            logger.info("NVML unavailable (%s); GPU health is not watched", self.error)
            return
        self._nvml = pynvml
        count = self._get(pynvml.nvmlDeviceGetCount) or 0
        for i in range(count):
            handle = self._get(pynvml.nvmlDeviceGetHandleByIndex, i)
            if handle is not None:
                self._handles.append((i, handle))
                self._register_xid_events(i, handle)

    @classmethod
    def available(cls) -> bool:
        """Whether NVML loads and initialises here (False on a machine without an NVIDIA driver)."""
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:
            return False
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
        return True

    def _get(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except self._nvml.NVMLError:
            return None

    def _register_xid_events(self, index: int, handle: Any) -> None:
        # One event set per device, so an event's device is known without mapping handles back to indices.
        # Consumer GPUs and some virtualised ones refuse registration (NotSupported): no XIDs for them.
        nvml = self._nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            return
        try:
            nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
        except nvml.NVMLError:
            self._get(nvml.nvmlEventSetFree, event_set)
            return
        self._event_sets[index] = event_set

    def _drain_xids(self, index: int) -> list[int]:
        event_set = self._event_sets.get(index)
        if event_set is None:
            return []
        nvml = self._nvml
        xids: list[int] = []
        for _ in range(64):  # bounded: a GPU in an error storm must not stall the watcher thread
            try:
                # timeout 0: return at once, raising NVMLError_Timeout when no event is pending
                data = nvml.nvmlEventSetWait(event_set, 0)
            except nvml.NVMLError:
                break
            if data.eventType == nvml.nvmlEventTypeXidCriticalError:
                xids.append(int(data.eventData))
        return xids

    def _throttle_reasons(self, handle: Any) -> list[str]:
        nvml = self._nvml
        query = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        mask = self._get(query, handle) if query is not None else None
        if not mask:
            return []
        return [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]

    def _read_device(self, index: int, handle: Any) -> GpuReading:
        nvml = self._nvml
        util = self._get(nvml.nvmlDeviceGetUtilizationRates, handle)
        memory = self._get(nvml.nvmlDeviceGetMemoryInfo, handle)
        power_mw = self._get(nvml.nvmlDeviceGetPowerUsage, handle)
        temperature = self._get(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
        ecc = self._get(
            nvml.nvmlDeviceGetTotalEccErrors, handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )
        procs = self._get(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
        uuid = self._get(nvml.nvmlDeviceGetUUID, handle)
        name = self._get(nvml.nvmlDeviceGetName, handle)
        return GpuReading(
            index=index,
            # nvidia-ml-py returns str; older pynvml builds returned bytes
            uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid or ""),
            name=name.decode() if isinstance(name, bytes) else str(name or ""),
            utilization_pct=float(util.gpu) if util is not None else None,
            # NVML reports bytes
            memory_used_mib=memory.used / MIB if memory is not None else None,
            memory_total_mib=memory.total / MIB if memory is not None else None,
            processes=[
                GpuProcess(int(p.pid), p.usedGpuMemory / MIB if p.usedGpuMemory is not None else None) for p in procs
            ],
            xid=self._drain_xids(index),
            ecc_uncorrected=int(ecc) if ecc is not None else None,
            temperature_c=float(temperature) if temperature is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            throttle_reasons=self._throttle_reasons(handle),
        )

    def read(self) -> list[GpuReading]:
        """One reading per GPU NVML sees; an empty list when NVML is unavailable."""
        if self._nvml is None:
            return []
        return [self._read_device(i, h) for i, h in self._handles]

    def close(self) -> None:
        """Free the event sets and release NVML."""
        if self._nvml is None:
            return
        for event_set in self._event_sets.values():
            self._get(self._nvml.nvmlEventSetFree, event_set)
        self._event_sets.clear()
        self._get(self._nvml.nvmlShutdown)
        self._nvml = None


@dataclass
class _Line:
    t: float
    readings: list[GpuReading]
    attempt: int | None


def read_gpu_log(path: str | Path) -> list[_Line]:
    """The lines of a gpu.jsonl: {"t", "gpus": [...]} and optionally "attempt"; other lines are skipped."""
    out = []
    for number, text in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
            if "gpus" not in obj:
                continue  # a note, not a reading
            line = _Line(float(obj["t"]), [GpuReading.from_dict(g) for g in obj["gpus"]], obj.get("attempt"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: not a GPU reading line ({type(exc).__name__}: {exc})") from None
        out.append(line)
    return out


class ReplaySource:
    """GPU readings replayed from a gpu.jsonl: the latest line with t <= seconds since the source was made holds.

    A recording of several attempts replays the lines of `attempt` (lines without an attempt apply to all; an
    attempt the recording never reached replays its last one). An XID is an event: each line's XIDs are
    reported by the first read that reaches that line, never again.
    """

    def __init__(self, path: str | Path, *, attempt: int | None = None, clock: Callable[[], float] = time.monotonic):
        lines = read_gpu_log(path)
        attempts = sorted({line.attempt for line in lines if line.attempt is not None})
        if attempt is not None and attempts:
            chosen = max((a for a in attempts if a <= attempt), default=attempts[0])
            lines = [line for line in lines if line.attempt in (None, chosen)]
        self.lines = sorted(lines, key=lambda line: line.t)
        self.clock = clock
        self.started = clock()
        self._served = -1  # index of the latest line a read has reached

    def inventory(self) -> list[GpuReading]:
        """The GPUs of the recording (its first line): what preflight and the launcher count."""
        return [GpuReading(**{**asdict(r), "xid": []}) for r in self.lines[0].readings] if self.lines else []

    def read(self) -> list[GpuReading]:
        now = self.clock() - self.started
        current = -1
        for i, line in enumerate(self.lines):
            if line.t > now:
                break
            current = i
        if current < 0:
            return []
        fresh = range(self._served + 1, current + 1)
        self._served = max(self._served, current)
        xids: dict[int, list[int]] = {}
        for i in fresh:
            for r in self.lines[i].readings:
                xids.setdefault(r.index, []).extend(r.xid)
        return [
            GpuReading(**{**asdict(r), "processes": list(r.processes), "xid": xids.get(r.index, [])})
            for r in self.lines[current].readings
        ]


class GpuRecorder:
    """Appends the readings the supervisor acted on to gpu.jsonl: on every change that matters, else once a minute.

    A line is {"attempt", "t" (seconds since the attempt started), "gpus": [...]}; `ReplaySource` reads it back.
    """

    def __init__(self, path: Path, attempt: int, *, clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.attempt = attempt
        self.clock = clock
        self.started = clock()
        self._last: list[tuple] | None = None
        self._last_t = -math.inf

    @staticmethod
    def _shape(readings: list[GpuReading]) -> list[tuple]:
        # what makes a reading worth a line: utilisation in steps of 10 %, memory in steps of 256 MiB, any
        # XID, ECC count, throttle reason or process change
        return [
            (
                r.index,
                None if r.utilization_pct is None else int(r.utilization_pct // 10),
                None if r.memory_used_mib is None else int(r.memory_used_mib // BASELINE_MARGIN_MIB),
                tuple(r.xid),
                r.ecc_uncorrected,
                tuple(r.throttle_reasons),
                tuple(sorted(p.pid for p in r.processes)),
            )
            for r in readings
        ]

    def record(self, readings: list[GpuReading], *, force: bool = False) -> None:
        t = self.clock() - self.started
        shape = self._shape(readings)
        if not force and shape == self._last and t - self._last_t < RECORD_INTERVAL_S:
            return
        self._last, self._last_t = shape, t
        line = {"attempt": self.attempt, "t": round(t, 3), "gpus": [r.to_dict() for r in readings]}
        try:
            append_jsonl(self.path, line)  # never through a link planted at gpu.jsonl (contract.UnsafeLink)
        except OSError as exc:  # a full disk must not stop the watcher; the readings are in memory meanwhile
            logger.warning("could not record GPU readings to %s: %s", self.path, exc)


def gpu_source(attempt: int | None = None) -> GpuSource | None:
    """Where the supervisor reads its GPUs: a replayed gpu.jsonl when PRIME_TRAIN_GPU_REPLAY names one, else
    NVML when it loads, else None (a machine without NVIDIA GPUs)."""
    replay = os.environ.get(ENV_GPU_REPLAY)
    if replay:
        return ReplaySource(replay, attempt=attempt)
    return NvmlSource() if NvmlSource.available() else None


def gpu_inventory() -> list[GpuReading]:
    """The GPUs of this machine (or of the replayed recording): one reading each, for preflight and the launcher."""
    replay = os.environ.get(ENV_GPU_REPLAY)
    if replay:
        return ReplaySource(replay).inventory()
    source = NvmlSource()
    try:
        return source.read()
    finally:
        source.close()


def visible_devices(env: dict[str, str] | None = None) -> list[str] | None:
    """The entries of CUDA_VISIBLE_DEVICES (indices or GPU-/MIG- UUIDs), [] for none, None when it is unset."""
    value = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    entries = [d.strip() for d in value.split(",") if d.strip()]
    # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU
    out = []
    for entry in entries:
        if entry.startswith("-"):
            break
        out.append(entry)
    return out


def _matches(r: GpuReading, device: str) -> bool:
    if device.isdigit():
        return r.index == int(device)
    return bool(r.uuid) and r.uuid.startswith(device)  # CUDA accepts a unique prefix of a UUID


def readings_of(readings: list[GpuReading], devices: list[str] | None) -> list[GpuReading]:
    """The readings of the GPUs a CUDA_VISIBLE_DEVICES list names (every GPU when None).

    Indices are NVML's, which match CUDA's because the supervisor sets CUDA_DEVICE_ORDER=PCI_BUS_ID.
    """
    if devices is None:
        return list(readings)
    return [r for r in readings if any(_matches(r, d) for d in devices)]


def summary(readings: list[GpuReading]) -> dict[str, Any]:
    """Mean utilisation and memory used/total, per GPU and in all, for the supervisor's status line."""
    gpus = [
        {
            "index": r.index,
            "utilization_pct": r.utilization_pct,
            "memory_used_mib": r.memory_used_mib,
            "memory_total_mib": r.memory_total_mib,
        }
        for r in readings
    ]
    utils = [r.utilization_pct for r in readings if r.utilization_pct is not None]
    used = sum(r.memory_used_mib for r in readings if r.memory_used_mib is not None)
    total = sum(r.memory_total_mib for r in readings if r.memory_total_mib is not None)
    return {
        "num_gpus": len(readings),
        "mean_utilization_pct": sum(utils) / len(utils) if utils else None,
        "memory_used_mib": used,
        "memory_total_mib": total,
        "memory_used_gib": used / 1024,
        "memory_total_gib": total / 1024,
        "gpus": gpus,
    }


class GpuHealthWatcher(Watcher):
    """Turns GPU readings into events; a GPU_BROKEN failure for the trainer, an emptied GPU for a rollout worker.

    Fatal on any GPU: a fatal XID, a rising count of uncorrected ECC errors. "Alive but broken" is judged per
    role (the trainer, inference-<i>) on the GPUs its CUDA_VISIBLE_DEVICES names: every GPU of the role at 0 %
    and back at the memory it held before the attempt started (`take_baseline`), for `broken_polls` polls in a
    row, while `may_judge(role)` says the role should be using it now (the supervisor: its process is alive,
    and for the trainer a step is overdue in the step phase past the attempt's first step; for a worker, it
    answered /health before). The trainer's GPU going empty is the attempt's failure (the observation's
    verdict); a worker's is a RestartWorker request (and kept in `emptied` until the worker is `restarted`).

    NVML's process list is evidence one way only. A PID of the role's process tree (`role_pids`) listed on one
    of its GPUs means the role is there, whatever the memory says: on a VM or bare metal NVML lists the PIDs
    the supervisor sees (an H200 VM did). A list without them proves nothing: in a container it holds host PIDs.
    The baseline follows the GPU down: on a shared GPU another job's memory in the baseline leaves when that
    job ends (seen on the H200, tests/data/gpu/h200_tenant_left.jsonl), and a baseline still holding it would
    hide the role's own context.
    """

    def __init__(
        self,
        source: GpuSource,
        *,
        roles: Callable[[], dict[str, list[str] | None]],
        may_judge: Callable[[str], bool],
        current_step: Callable[[], int | None],
        broken_polls: int = 3,
        recorder: GpuRecorder | None = None,
        role_pids: Callable[[str], set[int]] | None = None,
    ):
        if broken_polls < 1:
            raise ValueError(f"broken_polls must be at least 1, got {broken_polls}")
        self.source = source
        self.roles = roles
        self.may_judge = may_judge
        self.current_step = current_step
        self.broken_polls = broken_polls
        self.recorder = recorder
        self.role_pids = role_pids
        self.failure: Failure | None = None
        self.emptied: set[str] = set()  # workers whose GPUs went empty while they should be serving
        self.baseline: dict[int, float] = {}  # memory used per GPU index before the attempt started (or less since)
        self._reported_baseline: dict[int, float] = {}
        self.last_readings: list[GpuReading] = []
        self.last_summary: dict[str, Any] | None = None
        self._empty_polls: dict[str, deque[list[GpuReading]]] = {}
        self._ecc_seen: dict[int, int] = {}
        self._throttle_warned: dict[int, set[str]] = {}
        self._read_error_reported = False
        self._unreadable: Note | None = None

    blocking = True

    def begin(self, now: float | None = None) -> Observation:
        """The GPUs' memory before any process of the attempt runs: "empty" later means back at this."""
        return Observation(self.take_baseline())

    def restarted(self, process: str) -> None:
        self.forget(process)

    def take_baseline(self) -> list[Note]:
        """Read every GPU before the attempt's processes start: what each holds when the job holds nothing."""
        readings = self._read()
        if readings is None:
            return []
        self.baseline = {r.index: r.memory_used_mib for r in readings if r.memory_used_mib is not None}
        self._reported_baseline = dict(self.baseline)
        self._record(readings, force=True)
        return [note(Event.GPU_BASELINE, memory_used_mib={str(i): round(m, 1) for i, m in self.baseline.items()})]

    def forget(self, role: str) -> None:
        """The role's process was restarted: its GPUs get a fresh start-up."""
        self.emptied.discard(role)
        self._empty_polls.pop(role, None)

    def _read(self) -> list[GpuReading] | None:
        """The source's readings; None when it failed (reported once, by the next poll)."""
        try:
            return self.source.read()
        except Exception as exc:  # NVML can fail mid-run (a GPU lost); a watcher must not crash the supervisor
            if not self._read_error_reported:
                self._read_error_reported = True
                self._unreadable = note(Event.GPU_UNREADABLE, error=f"{type(exc).__name__}: {exc}")
            return None

    def _record(self, readings: list[GpuReading], force: bool = False) -> None:
        if self.recorder is not None and readings:
            self.recorder.record(readings, force=force)

    def poll(self, now: float | None = None) -> Observation:
        """Read every GPU once: the events seen, the first fatal condition as the verdict (kept in `failure`), a
        restart for each worker whose GPUs went empty."""
        readings = self._read()
        if readings is None:
            error, self._unreadable = self._unreadable, None
            return Observation([error] if error else [], verdict=self.failure)
        self.last_readings = readings
        self.last_summary = summary(readings) if readings else None
        if not readings:
            return Observation(verdict=self.failure, status={StatusKey.GPU: None})
        emptied = set(self.emptied)
        events: list[Note] = self._follow_baseline_down(readings)
        for reading in readings:
            events += self._check_xids(reading)
            events += self._check_ecc(reading)
            events += self._check_throttle(reading)
        for role, devices in self.roles().items():
            events += self._check_empty(role, readings_of(readings, devices))
        self._record(readings, force=bool(events))
        restarts = [RestartWorker(role, LEFT_ITS_GPU) for role in sorted(self.emptied - emptied)]
        return Observation(events, verdict=self.failure, requests=restarts, status={StatusKey.GPU: self.last_summary})

    def _fail(self, message: str, evidence: list[GpuReading]) -> None:
        if self.failure is None:  # the first fatal condition is the cause; later ones are its consequences
            self.failure = Failure(
                FailureKind.GPU_BROKEN,
                message,
                evidence=[json.dumps(r.to_dict(), sort_keys=True) for r in evidence],
                step=self.current_step(),
            )

    def _check_xids(self, r: GpuReading) -> list[Note]:
        events = []
        for xid in r.xid:
            fatal = xid in FATAL_XIDS
            meaning = FATAL_XIDS.get(xid) or WARNING_XIDS.get(xid) or "see NVIDIA's Xid catalogue"
            events.append(note(Event.GPU_XID, gpu=r.index, xid=xid, meaning=meaning, fatal=fatal))
            if fatal:
                self._fail(f"GPU {r.index} ({r.name or r.uuid}) reported Xid {xid}: {meaning}", [r])
        return events

    def _check_ecc(self, r: GpuReading) -> list[Note]:
        if r.ecc_uncorrected is None:
            return []
        before = self._ecc_seen.get(r.index)
        self._ecc_seen[r.index] = r.ecc_uncorrected
        # the first reading is the baseline: the volatile counter covers everything since the driver loaded
        if before is None or r.ecc_uncorrected <= before:
            return []
        self._fail(
            f"GPU {r.index} ({r.name or r.uuid}) counted {r.ecc_uncorrected - before} new uncorrected ECC "
            f"error(s) ({before} -> {r.ecc_uncorrected}): its memory can no longer be trusted",
            [r],
        )
        return [note(Event.GPU_ECC, gpu=r.index, previous=before, current=r.ecc_uncorrected, fatal=True)]

    def _check_throttle(self, r: GpuReading) -> list[Note]:
        # warn once per GPU and reason: a power-capped GPU flips the bit every few seconds, and one line
        # in the events says all there is to say
        active = THROTTLE_WARNINGS.intersection(r.throttle_reasons)
        warned = self._throttle_warned.setdefault(r.index, set())
        new = active - warned
        if not new:
            return []
        warned |= new
        return [
            note(
                Event.GPU_THROTTLE,
                gpu=r.index,
                reasons=sorted(active),
                new_reasons=sorted(new),
                temperature_c=r.temperature_c,
                power_w=r.power_w,
            )
        ]

    def _follow_baseline_down(self, readings: list[GpuReading]) -> list[Note]:
        """Lower a GPU's baseline to what it holds now when that is less: memory of another job that has ended.

        Only ever down, so the baseline never takes in memory the job added; reported once it fell by more than
        the margin (smaller moves are the driver's own).
        """
        lowered = {}
        for r in readings:
            base = self.baseline.get(r.index)
            if base is None or r.memory_used_mib is None or r.memory_used_mib >= base:
                continue
            self.baseline[r.index] = r.memory_used_mib
            reported = self._reported_baseline.setdefault(r.index, base)
            if reported - r.memory_used_mib > BASELINE_MARGIN_MIB:
                self._reported_baseline[r.index] = r.memory_used_mib
                lowered[str(r.index)] = round(r.memory_used_mib, 1)
        if not lowered:
            return []
        return [note(Event.GPU_BASELINE, memory_used_mib=lowered, reason="lowered: memory of another process that "
                     "was on the GPU before this attempt has been freed")]  # fmt: skip

    def _role_listed(self, role: str, gpus: list[GpuReading]) -> bool:
        """Whether NVML lists a process of the role on one of its GPUs (never true in a container: host PIDs)."""
        if self.role_pids is None:
            return False
        listed = {p.pid for r in gpus for p in r.processes}
        return bool(listed and listed & self.role_pids(role))

    def _at_baseline(self, r: GpuReading) -> bool:
        """0 % utilisation and no more memory than before the attempt: nothing of the job is on this GPU."""
        if r.utilization_pct is None or r.utilization_pct >= 1.0 or r.memory_used_mib is None:
            return False
        base = self.baseline.get(r.index)
        return base is not None and r.memory_used_mib <= base + BASELINE_MARGIN_MIB

    def _check_empty(self, role: str, gpus: list[GpuReading]) -> list[Note]:
        history = self._empty_polls.setdefault(role, deque(maxlen=self.broken_polls))
        if (
            not gpus
            or role in self.emptied
            or not all(self._at_baseline(r) for r in gpus)
            or not self.may_judge(role)
            or self._role_listed(role, gpus)
        ):
            history.clear()
            return []
        history.append(gpus)
        if len(history) < self.broken_polls:
            return []
        step = self.current_step()
        where = ", ".join(f"GPU {r.index} ({r.name or r.uuid})" for r in gpus)
        held = ", ".join(f"{r.memory_used_mib:.0f}" for r in gpus)
        base = ", ".join(f"{self.baseline[r.index]:.0f}" for r in gpus)
        evidence = [r for poll in history for r in poll]
        fields = {"role": role, "gpus": [r.index for r in gpus], "polls": len(history)}
        if role == Role.TRAINER:  # the trainer's process is named by its role
            if self.failure is not None:
                return []
            self._fail(
                f"{where} alive but broken: the trainer is running and overdue for step "
                f"{(step or 0) + 1}, yet its GPU is at 0 % and holds {held} MiB, its {base} MiB from before the "
                f"attempt: nothing of the job is on it any more ({len(history)} polls)",
                evidence,
            )
            return [note(Event.GPU_EMPTY, **fields, step=step)]
        self.emptied.add(role)
        return [note(Event.GPU_EMPTY, **fields, detail=f"{where}: 0 % and {held} MiB (before the attempt: {base} MiB)")]


def replayed_probe(num_devices: int) -> dict[str, Any]:
    """What preflight's CUDA probe would report on the machine PRIME_TRAIN_GPU_REPLAY recorded: its first
    `num_devices` GPUs, each taking a context (torch cannot see replayed GPUs, so it is not asked)."""
    replay = os.environ.get(ENV_GPU_REPLAY, "")
    gpus = ReplaySource(replay).inventory() if replay else []
    devices = [
        {"index": i, "name": r.name, "total_memory_mib": r.memory_total_mib, "ok": True}
        for i, r in enumerate(readings_of(gpus, visible_devices())[:num_devices])
    ]
    return {
        "cuda_available": bool(devices),
        "device_count": len(devices),
        "devices": devices,
        "nvml_count": len(gpus),
        "torch_version": f"(replayed from {replay})",
        "replayed": replay,
    }
