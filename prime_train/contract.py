"""The job contract: what the supervisor and a training job agree on, and the only thing they share.

Both sides import this module and nothing else of each other (docs/architecture.md, "The run
directory"). It holds the exit codes, the phases a job reports, the heartbeat it writes and the failures
it may name there, the environment variables the supervisor sets, the supervisor's states and the
events it records, and how files both sides share are written and read. Where they lie (the run directory's
paths, checkpoint naming, its one owner's lock) is rundir.py, the contract's other half.
Standard library only: the supervisor, lint and the pre-commit hook import it on machines without
torch, and it must stay cheap to import.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import math
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# ---------------------------------------------------------------- exit codes


class ExitCode(enum.IntEnum):
    """Exit codes of a job and of `prime-train run`; anything not listed is a crash."""

    OK = 0
    FAILED = 1  # `prime-train run` only: restarts exhausted, or a failure that is not retried
    PREEMPTED = 75  # EX_TEMPFAIL: checkpointed and stopped on request (SIGTERM, a spot notice); resume me
    # the engine: another node went silent and this rank ended itself (its heartbeat names node_lost); retried. Apart
    # from a crash (1) and the codes above, so its log and `echo $?` say so
    NODE_LOST = 76
    CONFIG = 78  # EX_CONFIG: a configuration error; never retried


class JobFailure(enum.StrEnum):
    """The failures a job names itself in its heartbeat (`failure`, with phase failed); the supervisor takes its
    word over its own reading of the log. Each is a kind of kit/failures.FailureKind, with its retry rule."""

    LOSS_NOT_FINITE = "loss_not_finite"  # the loss or the gradients became NaN/inf: the run diverged
    NODE_LOST = "node_lost"  # another node of a multi-node job went silent (exit 76)


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
    # the step `loss` was read at: the loss is read from the device every logging.log_interval steps, so between
    # two reads the heartbeat carries the older one (the live view says how old)
    loss_step: int | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    reward: float | None = None  # RL: the mean sampled reward of the last step
    exit_code: int | None = None  # with phase stopped or failed: torchrun reports every worker failure as 1
    reason: str | None = None  # with phase stopped or failed: why, in words; with done: why before max_steps
    # with phase failed: the kind of failure the job diagnosed itself (JobFailure; an external job may name any
    # of kit/failures.FailureKind); the supervisor takes it over its own reading of the log
    failure: str | None = None
    resumed_from: int | None = None  # the step this attempt started from: its checkpoint's step, 0 when fresh
    # RL: the policy step the rollout workers were last told to load, how many loaded it, and the slowest one's
    # seconds (the supervisor records each new one as a `weights_loaded` event)
    weights_step: int | None = None
    workers_reloaded: int | None = None
    weight_reload_s: float | None = None

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
            out[key] = value.value if isinstance(value, enum.Enum) else value
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
        for name in (
            "pid", "max_steps", "tokens", "exit_code", "resumed_from", "weights_step", "workers_reloaded", "loss_step",
        ):  # fmt: skip
            setattr(hb, name, _int(obj.get(name)))
        for name in ("time", "loss", "tokens_per_s", "step_time_s", "reward", "weight_reload_s"):
            setattr(hb, name, _float(obj.get(name)))
        for name in ("reason", "failure"):
            value = obj.get(name)
            setattr(hb, name, value if isinstance(value, str) else None)
        return hb


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def read_heartbeat(path: str | os.PathLike[str]) -> Heartbeat | None:
    """progress.json (or an external job's heartbeat file); None when missing, torn or not a heartbeat."""
    return Heartbeat.from_dict(read_json(path))


def write_heartbeat(path: str | os.PathLike[str], heartbeat: Heartbeat, *, durable: bool = True) -> None:
    """Replace progress.json atomically: the supervisor sees the old heartbeat or the new one.

    durable=False skips the fsyncs (5-12 ms a write on a cloud disk) for the heartbeats of a running job, written
    about once a second: the rename alone keeps the file whole for every reader while the machine runs (a torn
    heartbeat would read as none, and look like a stall); only a power loss could roll it back, and the next
    heartbeat replaces it anyway. The final verdict (done, stopped, failed) stays durable.
    """
    write_json_atomic(path, heartbeat.to_dict(), durable=durable)


FIRST_STEP_S, SAVE_S, EVALUATION_S = "first_step_s", "save_s", "evaluation_s"  # metrics.jsonl seconds (goodput)


# ---------------------------------------------------------------- environment the supervisor sets

ENV_RUN_DIR = "PRIME_TRAIN_RUN_DIR"  # the run directory, absolute
ENV_ATTEMPT = "PRIME_TRAIN_ATTEMPT"  # the attempt number, from 1
ENV_PROFILE = "PRIME_TRAIN_PROFILE"  # "<warmup>,<steps>": `prime-train profile` asks the job to time itself
ENV_STOP_AT = "PRIME_TRAIN_STOP_AT_STEP"  # N: the engine stops at step N as on SIGTERM (a PBT round's end)
# "<pid>:<create time>" of the process that started the job (`prime-train run` or `train`): the job must not
# outlive it. The create time (seconds since the epoch, as psutil.Process.create_time gives it) tells that
# process from a later one that got its recycled pid.
ENV_SUPERVISOR = "PRIME_TRAIN_SUPERVISOR"


# ---------------------------------------------------------------- what the supervisor records


class SupervisorState(enum.StrEnum):
    """supervisor.json's `state`: where `prime-train run` is in the run's life (`prime-train status` reads it)."""

    STARTING = "starting"  # the run directory is claimed; no attempt runs yet
    RUNNING = "running"  # an attempt's processes run
    RESTARTING = "restarting"  # an attempt failed; the next one waits out its backoff
    DONE = "done"  # the job finished: exit 0
    STOPPED = "stopped"  # stopped on request (Ctrl-C, SIGTERM) after the job checkpointed: exit 75
    PREEMPTED = "preempted"  # the cloud takes the instance back: exit 75, for the layer above to resume elsewhere
    FAILED = "failed"  # restarts exhausted or a failure never retried: exit 1 (78 for a configuration error)


# States of a supervisor still at work: one whose pid is gone died without saying how it ended.
LIVE_STATES = frozenset({SupervisorState.STARTING, SupervisorState.RUNNING, SupervisorState.RESTARTING})


class Event(enum.StrEnum):
    """events.jsonl's names, grouped as a run meets them: each line is {"time", "event": <one of these>, ...fields},
    written by the supervisor (and `run --fresh`), read by `status`, `diagnose` and people. Every name the package
    emits is here (tests/test_architecture.py)."""

    RUN_STARTED = "run_started"  # the supervisor took the run directory: run_dir, pid, job
    ORPHAN_ENDED = "orphan_ended"  # a process a killed predecessor left running was ended
    RUN_SET_ASIDE_STARTED = "run_set_aside_started"  # --fresh begins moving the old outputs into previous/
    RUN_SET_ASIDE = "run_set_aside"  # --fresh moved the old outputs into previous/<time>/
    CONFIG_CHANGED = "config_changed"  # a re-run's config differs from the run's: changes, kept_run_values
    ENV_WARNING = "env_warning"  # an environment variable that does not do what it is believed to
    ATTEMPT_STARTED = "attempt_started"  # an attempt begins: its number and the step it resumes from
    PROCESS_STARTED = "process_started"  # a child started (or a rollout worker restarted): its pid and masked argv
    PROCESS_EXITED = "process_exited"  # a child exited: its exit code and the step reached
    ATTEMPT_ENDED = "attempt_ended"  # the attempt's processes are stopped; any left alive are named
    FAILURE = "failure"  # an attempt failed: the classified Failure (kind, message, evidence, retryable)
    DECISION = "decision"  # the restart policy's answer to a failure: restart or not, the delay, why
    RENDEZVOUS_WAIT = "rendezvous_wait"  # node k > 0 holds its restart until node 0's old agent has left
    RUN_FINISHED = "run_finished"  # the job finished
    RUN_STOPPED = "run_stopped"  # the run stopped on request
    RUN_PREEMPTED = "run_preempted"  # the instance is going away: exit 75 for the layer above
    RUN_FAILED = "run_failed"  # the run could not start (its config.toml could not be written)
    STOP_REQUESTED = "stop_requested"  # SIGTERM forwarded to the job: it checkpoints and exits 75
    STOP_FORCED = "stop_forced"  # a second Ctrl-C: the job killed without waiting for its checkpoint
    PREEMPTION_NOTICE = "preemption_notice"  # the cloud's metadata server announced a spot interruption
    PREEMPTION_FORWARDED = "preemption_forwarded"  # that notice forwarded to the job as SIGTERM
    HANG_DETECTED = "hang_detected"  # no progress within the phase's allowance
    WEIGHTS_LOADED = "weights_loaded"  # RL: the rollout workers loaded a new policy step (from the heartbeat)
    LOG_FINDING = "log_finding"  # a line of a child's log matched a known failure or warning pattern
    WATCHER_ERROR = "watcher_error"  # a watcher raised; the run goes on without that poll
    CHECKPOINT_DELETED = "checkpoint_deleted"  # retention or the disk cap deleted a whole checkpoint (never the newest)
    CHECKPOINT_DELETE_REFUSED = "checkpoint_delete_refused"  # a deletion refused (a symlink, outside the directory)
    RETENTION_BELOW_KEEP_LAST = "retention_below_keep_last"  # the disk cap left fewer than ckpt.keep_last
    CHECKPOINT_QUARANTINED = "checkpoint_quarantined"  # the job set a checkpoint aside as damaged (step-N.corrupt)
    CHECKPOINT_TMP_REMOVED = "checkpoint_tmp_removed"  # an unfinished save of a dead job was removed
    CHECKPOINT_TMP_REMOVE_FAILED = "checkpoint_tmp_remove_failed"  # ... and could not be
    REMOTE_RESTORE_SKIPPED = "remote_restore_skipped"  # nothing fetched: a local checkpoint, or none in the bucket
    REMOTE_RESTORE_FAILED = "remote_restore_failed"  # the bucket could not be read: the run does not start
    REMOTE_CHECKPOINT_RESTORED = "remote_checkpoint_restored"  # a checkpoint fetched from the bucket, verified
    REMOTE_CHECKPOINT_CORRUPT = "remote_checkpoint_corrupt"  # one in the bucket failed verification: an older one tried
    CHECKPOINT_BACKUP_NOTE = "checkpoint_backup_note"  # something the store says about itself (compression fallback)
    CHECKPOINT_UPLOAD_STARTED = "checkpoint_upload_started"  # a whole checkpoint is being uploaded
    CHECKPOINT_UPLOADED = "checkpoint_uploaded"  # ... and is in the bucket
    CHECKPOINT_UPLOAD_FAILED = "checkpoint_upload_failed"  # ... and failed: retried after a backoff
    CHECKPOINT_UPLOAD_SKIPPED = "checkpoint_upload_skipped"  # deleted here while it was being uploaded
    CHECKPOINT_ALREADY_UPLOADED = "checkpoint_already_uploaded"  # the bucket already holds this step or a newer one
    CHECKPOINT_UPLOAD_UNFINISHED = "checkpoint_upload_unfinished"  # an upload still running when the run ended
    REMOTE_CHECKPOINTS_DELETED = "remote_checkpoints_deleted"  # ckpt.remote_keep_last applied in the bucket
    REMOTE_RETENTION_FAILED = "remote_retention_failed"  # ... and failed
    HEARTBEAT_UPLOAD_FAILED = "heartbeat_upload_failed"  # progress.json could not be copied to the bucket
    HEARTBEAT_UPLOAD_RECOVERED = "heartbeat_upload_recovered"  # ... and can again
    GPU_BASELINE = "gpu_baseline"  # the GPUs' memory before the attempt (or lowered): "empty" means back at it
    GPU_UNREADABLE = "gpu_unreadable"  # NVML failed; GPU health is not judged meanwhile
    GPU_XID = "gpu_xid"  # the driver reported an Xid error
    GPU_ECC = "gpu_ecc"  # uncorrectable ECC errors
    GPU_THROTTLE = "gpu_throttle"  # a GPU throttles (power, heat)
    GPU_EMPTY = "gpu_empty"  # a role's GPUs back at their baseline memory, 0 %, while its process lives
    CPU_THREADS = "cpu_threads"  # the CPU threads each trainer process gets (OMP_NUM_THREADS), and why
    GPU_PLAN = "gpu_plan"  # how the GPUs were split between the trainer and the workers, when it is not as asked
    INFERENCE_HEALTHY = "inference_healthy"  # a worker answers /health
    INFERENCE_WEDGED = "inference_wedged"  # a worker stopped answering /health
    INFERENCE_DIED = "inference_died"  # a worker died or is wedged: restarted on its own
    # a sweep's own events.jsonl (in the sweep directory), and PBT's in the trial's run directory
    SWEEP_STARTED = "sweep_started"  # a sweep process joined the study: its pid and storage
    SWEEP_TRIAL_STARTED = "sweep_trial_started"  # a new trial: its number and parameters
    SWEEP_TRIAL_ADOPTED = "sweep_trial_adopted"  # an interrupted trial taken over: its run resumes
    SWEEP_TRIAL_ENDED = "sweep_trial_ended"  # a trial told to the study: complete, pruned or failed
    SWEEP_TRIAL_INTERRUPTED = "sweep_trial_interrupted"  # stopped with a checkpoint, left RUNNING to resume
    SWEEP_ENDED = "sweep_ended"  # this sweep process is done: its exit code and the best trial
    PBT_EXPLOIT = "pbt_exploit"  # a trial copied a better trial's checkpoint, to resume from it
    PBT_EXPLORE = "pbt_explore"  # ... and perturbed its hyper-parameters: before and after


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


class UnsafeLink(OSError):
    """A write refused because it would go through a symlink: a link at the file itself (O_NOFOLLOW), or a directory
    of the run directory that leads out of it. An OSError (ELOOP), so that every writer that survives a full disk
    survives this too, and the path is named."""

    def __init__(self, path: str | os.PathLike[str], why: str = "is a symbolic link"):
        super().__init__(errno.ELOOP, f"{why}: prime-train never writes through a link in a run directory", str(path))


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = 0o666) -> int:
    """os.open with O_NOFOLLOW and O_CLOEXEC: a symlink at `path` is refused (UnsafeLink), never followed, so a
    link planted at a file prime-train writes (events.jsonl, a process log) cannot send the write elsewhere. `mode`
    (before the umask) as open() gives a file it creates.

    For appends: `open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)`, then os.fdopen(fd, "ab") if a
    file object is wanted. Directories on the way are followed: see RunDir.ensure_dir for those. Also O_NONBLOCK
    (no effect on a file): a named pipe planted there is an error at once (ENXIO with no reader), never an open
    that waits forever.
    """
    try:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        # ELOOP on Linux and macOS, EMLINK on FreeBSD; a loop among the directories on the way says ELOOP too
        if exc.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise UnsafeLink(path) from None
        raise


def replace_file_atomic(path: str | os.PathLike[str], data: bytes, *, durable: bool = True, mode: int = 0o600) -> None:
    """Replace `path` with `data` so that readers see the old file or the new one, never half of one.

    The new file is written under a fresh name beside it, created with O_EXCL and O_NOFOLLOW (nothing planted at
    that name, a link included, is ever opened), then renamed over `path`: a symlink at `path` is replaced, never
    followed, and a file hard-linked elsewhere is not written through either. `mode` is the new file's permissions
    before the umask (0o600: as tempfile.mkstemp; 0o666: as open() creates a file).
    durable: fsync the file and its directory, so the new file survives a power loss.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
        try:
            fd = os.open(tmp, flags, mode)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(errno.EEXIST, "no free temporary name beside it", str(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def replace_symlink(path: str | os.PathLike[str], target: str) -> None:
    """Point the symlink `path` at `target` in one rename (readers see the old link or the new one); a file or a
    directory at `path` is not prime-train's link and is left as it is (FileExistsError)."""
    path = Path(path)
    if os.path.lexists(path) and not path.is_symlink():
        raise FileExistsError(errno.EEXIST, "not a symbolic link; left as it is", str(path))
    tmp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.tmp")
    os.symlink(target, tmp)
    try:
        os.replace(tmp, path)
    except OSError:
        os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike[str], obj: Any, *, durable: bool = True) -> None:
    """Write `obj` as JSON so that readers see the old file or the new one, never half of one; a symlink at `path`
    is replaced, never written through (replace_file_atomic).

    durable: fsync the file and its directory, so the new file survives a power loss (the heartbeat skips it).
    """
    replace_file_atomic(path, (json.dumps(obj) + "\n").encode("utf-8"), durable=durable)


@contextlib.contextmanager
def open_regular(path: str | os.PathLike[str], *, follow: bool = True) -> Iterator[int]:
    """A read-only descriptor of the regular file at `path`, closed on leaving; OSError when it is missing,
    unreadable or not a regular file (UnsafeLink, with follow=False, when it is a symlink).

    Opened non-blocking, so a FIFO planted at a name the tool reads (progress.json, events.jsonl) is an error at
    once instead of a read that waits forever for a writer."""
    if follow:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    else:
        fd = open_nofollow(path, os.O_RDONLY)  # non-blocking too
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        yield fd
    finally:
        os.close(fd)


def read_regular(path: str | os.PathLike[str], *, follow: bool = True) -> bytes:
    """The bytes of the regular file at `path` (open_regular's errors)."""
    with open_regular(path, follow=follow) as fd, os.fdopen(os.dup(fd), "rb") as f:
        return f.read()


def read_json(path: str | os.PathLike[str]) -> dict | None:
    """The JSON object in `path`, or None when the file is missing, unreadable, half-written or not an object.

    Bytes that are not UTF-8 read as U+FFFD, so that one stray byte in a string (a job's heartbeat `reason`)
    does not hide the whole heartbeat; NaN and Infinity read as floats, null as None.
    """
    try:
        data = read_regular(path)
    except OSError:
        return None
    try:
        obj = json.loads(data.decode("utf-8", "replace"))
    except (ValueError, RecursionError):  # half-written or garbled: reads as absent
        return None
    return obj if isinstance(obj, dict) else None


def append_jsonl(path: str | os.PathLike[str], obj: Any) -> None:
    """Append `obj` as one JSON line; UnsafeLink when `path` is a symlink (never appended through)."""
    line = (json.dumps(obj) + "\n").encode("utf-8")
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        # one write() of the whole line keeps concurrent appenders (O_APPEND) from interleaving; a short one (a
        # filling disk) goes on where it stopped
        while line:
            line = line[os.write(fd, line) :]
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file another process may be writing (metrics.jsonl, events.jsonl).

    Nothing in it stops the reading: a torn or garbled line, a line that is not an object, and bytes that
    are not UTF-8 (read as U+FFFD) are skipped or replaced; NaN and Infinity read as floats, null as None.
    A missing or unreadable file has no records.
    """
    try:
        data = read_regular(path)
    except OSError:
        return []
    out = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # torn, garbled, a number too long to parse, nesting too deep
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


# ---------------------------------------------------------------- processes, told apart from a recycled pid


def process_started_at(pid: int) -> float | None:
    """When process `pid` started, in seconds since the epoch, or None when it does not exist or cannot be told.

    The value psutil.Process(pid).create_time() gives on Linux (boot time + /proc/<pid>/stat's starttime),
    read without psutil so that this module stays standard library only. Elsewhere None: callers fall back
    to the pid alone.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            proc_stat = f.read().decode("ascii", "replace")
        with open("/proc/stat", "rb") as f:
            btime = next(int(line.split()[1]) for line in f.read().decode().splitlines() if line.startswith("btime"))
        # the command name (field 2) may hold spaces and parentheses: count the fields after its last ')'
        ticks = int(proc_stat[proc_stat.rindex(")") + 2 :].split()[19])
        return ticks / os.sysconf("SC_CLK_TCK") + btime
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def same_process_alive(pid: int, started_at: float | None) -> bool:
    """Whether `pid` is alive and is the process that started at `started_at` (None: any process with that pid).

    The start times are compared to within a second: both sides read them the same way, but the boot time
    they are counted from moves when the wall clock is stepped.
    """
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's
    if started_at is None:
        return True
    now = process_started_at(pid)
    return now is None or abs(now - started_at) < 1.0
