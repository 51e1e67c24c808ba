"""The job contract: what the supervisor and a training job agree on, and the only thing they share.

Both sides import this module and nothing else of each other (docs/architecture.md, "The run
directory"). It holds the exit codes, the phases a job reports, the heartbeat it writes, the
environment variables the supervisor sets, and the run directory's paths and checkpoint naming.
Standard library only: the supervisor, lint and the pre-commit hook import it on machines without
torch, and it must stay cheap to import.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------- exit codes


class ExitCode(enum.IntEnum):
    """Exit codes of a job and of `prime-train run`; anything not listed is a crash."""

    OK = 0
    FAILED = 1  # `prime-train run` only: restarts exhausted, or a failure that is not retried
    PREEMPTED = 75  # EX_TEMPFAIL: checkpointed and stopped on request (SIGTERM, a spot notice); resume me
    CONFIG = 78  # EX_CONFIG: a configuration error; never retried


# ---------------------------------------------------------------- phases


class Phase(enum.StrEnum):
    """What a job is doing, as its heartbeat says; the supervisor sizes its patience by it."""

    STARTUP = "startup"  # from process start to the first step: imports, model load, resume, workers' health
    COMPILE = "compile"  # the first step, while torch.compile traces and compiles
    STEP = "step"  # training steps
    EVAL = "eval"
    SAVE = "save"  # a checkpoint is being written
    EXPORT = "export"  # HF weights are being written (final/, or RL's weights/ for the workers)
    ROLLOUT_WAIT = "rollout_wait"  # an RL step blocked on rollouts from the inference workers
    DONE = "done"  # finished; the process exits 0
    STOPPED = "stopped"  # checkpointed on request; the process exits 75
    FAILED = "failed"  # gave up; `exit_code` says how

    @classmethod
    def parse(cls, value: Any) -> Phase | None:
        """The phase a heartbeat names; names written by prime-train before 0.3 map to today's, unknown ones to None."""
        if isinstance(value, Phase):
            return value
        if not isinstance(value, str):
            return None
        try:
            return cls(value)
        except ValueError:
            return _LEGACY_PHASES.get(value)


# Heartbeats copied to a bucket by an older prime-train outlive an upgrade (the monitor reads them).
_LEGACY_PHASES = {
    "loading": Phase.STARTUP,
    "starting": Phase.STARTUP,
    "training": Phase.STEP,
    "saving": Phase.SAVE,
    "exporting": Phase.EXPORT,
}

# Phases before the first step: the supervisor allows supervisor.startup_timeout_s.
STARTUP_PHASES = frozenset({Phase.STARTUP, Phase.COMPILE})
# Phases that legitimately outlast a training step: the supervisor allows supervisor.save_timeout_s.
SLOW_PHASES = frozenset({Phase.EVAL, Phase.SAVE, Phase.EXPORT})


# ---------------------------------------------------------------- the heartbeat


@dataclass
class Heartbeat:
    """progress.json: rewritten atomically by rank 0 at every step and every phase change.

    `step` is the number of optimizer steps completed; `time` is the writer's wall clock. An external
    job's heartbeat (job.progress_file) needs only "step"; every other field is optional.
    """

    step: int | None
    phase: Phase = Phase.STEP
    time: float | None = None
    pid: int | None = None
    max_steps: int | None = None
    tokens: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    reward: float | None = None  # RL: the mean sampled reward of the last step
    exit_code: int | None = None  # with phase stopped or failed: torchrun reports every worker failure as 1
    reason: str | None = None  # with phase failed

    @classmethod
    def now(cls, step: int | None, phase: Phase, **fields: Any) -> Heartbeat:
        """A heartbeat of this process, stamped with the wall clock."""
        return cls(step=step, phase=phase, time=time.time(), pid=os.getpid(), **fields)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of progress.json: unset fields left out, NaN and infinities as null (JSON has none)."""
        out: dict[str, Any] = {}
        for key, value in asdict(self).items():
            if value is None:
                continue
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            out[key] = value.value if isinstance(value, Phase) else value
        return out

    @classmethod
    def from_dict(cls, obj: Any) -> Heartbeat | None:
        """A heartbeat read back, its phase in today's names; None when `obj` has neither a step nor a phase.

        Fields of the wrong type read as unset: an external job's heartbeat is not trusted to be well formed.
        """
        if not isinstance(obj, dict):
            return None
        step = _int(obj.get("step"))
        phase = Phase.parse(obj.get("phase"))
        if step is None and phase is None:
            return None
        hb = cls(step=step, phase=phase or Phase.STEP)
        for name in ("pid", "max_steps", "tokens", "exit_code"):
            setattr(hb, name, _int(obj.get(name)))
        for name in ("time", "loss", "tokens_per_s", "step_time_s", "reward"):
            setattr(hb, name, _float(obj.get(name)))
        reason = obj.get("reason")
        hb.reason = reason if isinstance(reason, str) else None
        return hb


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def read_heartbeat(path: str | os.PathLike[str]) -> Heartbeat | None:
    """progress.json (or an external job's heartbeat file); None when missing, torn or not a heartbeat."""
    return Heartbeat.from_dict(read_json(path))


def write_heartbeat(path: str | os.PathLike[str], heartbeat: Heartbeat) -> None:
    """Replace progress.json atomically: the supervisor sees the old heartbeat or the new one."""
    write_json_atomic(path, heartbeat.to_dict())


# ---------------------------------------------------------------- environment the supervisor sets

ENV_RUN_DIR = "PRIME_TRAIN_RUN_DIR"  # the run directory, absolute
ENV_ATTEMPT = "PRIME_TRAIN_ATTEMPT"  # the attempt number, from 1
ENV_PROFILE = "PRIME_TRAIN_PROFILE"  # "<warmup>,<steps>": `prime-train profile` asks the job to time itself


# ---------------------------------------------------------------- the run directory

STEP_RE = re.compile(r"^step-(\d+)$")
TMP_RE = re.compile(r"^step-(\d+)\.tmp$")


class RunDir:
    """Paths of one run directory; building one does no I/O.

    ```
    runs/<name>/
      config.toml  events.jsonl  supervisor.json  progress.json  metrics.jsonl
      gpu.jsonl                 the GPU readings the supervisor acted on (PRIME_TRAIN_GPU_REPLAY replays them)
      logs/attempt-<n>/<process>.log  logs/latest -> attempt-<n>
      checkpoints/step-<N>/     written as step-<N>.tmp, renamed when whole
      weights/step-<N>/         RL: HF weights published for the inference workers, renamed when whole
      final/                    HF-format export
      profile/summary.json      `prime-train profile`
      tensorboard/
    ```
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self.config_path = self.root / "config.toml"
        self.events_path = self.root / "events.jsonl"
        self.supervisor_path = self.root / "supervisor.json"
        self.logs_dir = self.root / "logs"
        self.latest_logs = self.logs_dir / "latest"
        self.progress_path = self.root / "progress.json"
        self.gpu_log_path = self.root / "gpu.jsonl"
        self.metrics_path = self.root / "metrics.jsonl"
        self.checkpoints_dir = self.root / "checkpoints"
        self.weights_dir = self.root / "weights"
        self.final_dir = self.root / "final"
        self.profile_dir = self.root / "profile"
        self.profile_summary_path = self.profile_dir / "summary.json"
        self.tensorboard_dir = self.root / "tensorboard"

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def attempt_logs(self, n: int) -> Path:
        """Log directory of restart attempt `n` (logs/attempt-<n>)."""
        if n < 0:
            raise ValueError(f"attempt number must be >= 0, got {n}")
        return self.logs_dir / f"attempt-{n}"

    def published_weights(self, step: int) -> Path:
        """Where an RL trainer publishes the weights of `step` for its workers."""
        return self.weights_dir / f"step-{step}"

    def create(self) -> None:
        """Create the run directory with its logs/ and checkpoints/ (existing ones are kept)."""
        for d in (self.root, self.logs_dir, self.checkpoints_dir):
            d.mkdir(parents=True, exist_ok=True)


@dataclass(frozen=True)
class CheckpointInfo:
    """A whole checkpoint directory and the step it holds."""

    step: int
    path: Path


def list_checkpoints(ckpt_dir: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Whole checkpoints in `ckpt_dir`: real directories (not symlinks) named step-N, oldest first."""
    found: list[CheckpointInfo] = []
    try:
        entries = list(os.scandir(ckpt_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        m = STEP_RE.match(entry.name)
        if m and entry.is_dir(follow_symlinks=False):
            found.append(CheckpointInfo(int(m.group(1)), Path(ckpt_dir) / entry.name))
    found.sort(key=lambda c: (c.step, c.path.name))
    return found


def newest_checkpoint(ckpt_dir: str | os.PathLike[str]) -> CheckpointInfo | None:
    """The whole checkpoint with the highest step, or None."""
    found = list_checkpoints(ckpt_dir)
    return found[-1] if found else None


# ---------------------------------------------------------------- files both sides read while the other writes


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable; a no-op where directories cannot be opened (Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write `obj` as JSON so that readers see the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def read_json(path: str | os.PathLike[str]) -> dict | None:
    """The JSON object in `path`, or None when the file is missing, half-written or not an object."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        obj = json.loads(text)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, ValueError):
        # ValueError covers JSONDecodeError and UnicodeDecodeError: a garbled file reads as absent
        return None
    return obj if isinstance(obj, dict) else None


def append_jsonl(path: str | os.PathLike[str], obj: Any) -> None:
    """Append `obj` as one JSON line and flush it."""
    line = json.dumps(obj) + "\n"
    # one write() of the whole line keeps concurrent appenders (O_APPEND) from interleaving
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
