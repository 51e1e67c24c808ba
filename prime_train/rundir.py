"""The run directory's side of the job contract: its layout, how checkpoints are named and found, and its one owner.

The supervisor and a training job meet in the run directory (docs/architecture.md, "The run directory");
`contract.py` holds what they say there (exit codes, phases, the heartbeat, events, safe file writes), this module
where it lies: `RunDir`'s paths, the step-<N> checkpoint naming and listing, and the flock() that makes one process
its owner. Standard library only, like contract.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_train.contract import UnsafeLink, open_nofollow, read_json

# ---------------------------------------------------------------- the run directory

STEP_RE = re.compile(r"^step-(\d+)$")
TMP_RE = re.compile(r"^step-(\d+)\.tmp$")
# a checkpoint set aside because it failed verification: neither whole nor unfinished, so neither resumed from,
# counted by retention, nor cleaned up as a stale save; `quarantine.json` inside says why
QUARANTINE_RE = re.compile(r"^step-(\d+)\.corrupt(?:-\d+)?$")
QUARANTINE_NOTE = "quarantine.json"


# What prime-train writes at the top of a run directory: its files, and its directories (with the names other
# modules give them: rerun.py's previous/, the vLLM cache under inference/, W&B's wandb/). `run` and `train` refuse
# a run directory with a symlink at one of them (RunDir.unsafe_links, kit/ownership.claim_run_dir).
RUN_FILES = frozenset(
    {
        ".lock",
        "processes.json",
        "config.toml",
        "events.jsonl",
        "supervisor.json",
        "progress.json",
        "metrics.jsonl",
        "gpu.jsonl",
        "wandb_id.json",
    }
)
CONFIG_ATTEMPT_RE = re.compile(r"^config\.attempt-\d+\.toml$")  # the config of a restart that resumes
RUN_DIRS = frozenset(
    {
        "logs",
        "checkpoints",
        "weights",
        "final",
        "profile",
        "tensorboard",
        "previous",
        "inference",
        "wandb",
        "trackers",
        "cache",
    }
)


LATEST_LOGS = "latest"  # logs/latest -> attempt-<n>, the newest attempt's logs


def _inside(path: str, root: str) -> bool:
    """Whether resolved `path` is `root` or below it (both resolved)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class RunDir:
    """Paths of one run directory; building one does no I/O.

    ```
    runs/<name>/
      .lock                     flock()ed by the one process that owns the run (`run` or `train`); names it inside
      processes.json            the owner's job processes (pid, pgid, create time): the next owner ends orphans
      config.toml  events.jsonl  supervisor.json  progress.json  metrics.jsonl
      gpu.jsonl                 the GPU readings the supervisor acted on (PRIME_TRAIN_GPU_REPLAY replays them)
      logs/attempt-<n>/<process>.log  logs/latest -> attempt-<n>
      logs/attempt-<n>/ranks/   torchrun's --log-dir: every rank's output
      checkpoints/step-<N>/     written as step-<N>.tmp, renamed when whole
      checkpoints/step-<N>.corrupt/  a checkpoint that failed verification, set aside (never deleted, never whole)
      weights/step-<N>/         RL: HF weights published for the inference workers, renamed when whole
      final/                    HF-format export
      profile/summary.json      `prime-train profile`
      tensorboard/
      cache/rows-<part>-<key>.safetensors  the trainer's tokenized, packed rows (engine/row_cache.py)
    ```

    The checkpoints are where the run's config puts them: `ckpt_dir` is its ckpt.dir (a directory every node
    sees, with several nodes), None or "" for checkpoints/ above. Build one from a config with
    `Config.layout`, from a run directory alone with `RunDir.of_run` and the run's config.toml: every
    reader of the checkpoints, on either side, then gets the same answer.
    """

    def __init__(self, root: str | os.PathLike[str], *, ckpt_dir: str | os.PathLike[str] | None = None):
        self.root = Path(root)
        self.lock_path = self.root / ".lock"
        self.processes_path = self.root / "processes.json"
        self.config_path = self.root / "config.toml"
        self.events_path = self.root / "events.jsonl"
        self.supervisor_path = self.root / "supervisor.json"
        self.logs_dir = self.root / "logs"
        self.latest_logs = self.logs_dir / LATEST_LOGS
        self.progress_path = self.root / "progress.json"
        self.gpu_log_path = self.root / "gpu.jsonl"
        self.metrics_path = self.root / "metrics.jsonl"
        # the one rule for where the step-N checkpoints are (a relative ckpt.dir is read from the working directory)
        self.checkpoints_dir = Path(ckpt_dir).expanduser() if ckpt_dir else self.root / "checkpoints"
        self.weights_dir = self.root / "weights"
        self.final_dir = self.root / "final"
        self.profile_dir = self.root / "profile"
        self.profile_summary_path = self.profile_dir / "summary.json"
        self.tensorboard_dir = self.root / "tensorboard"
        self.cache_dir = self.root / "cache"

    @classmethod
    def of_run(cls, root: str | os.PathLike[str], config: Any) -> RunDir:
        """The run directory `root` as its run laid it out: checkpoints where its config.toml's ckpt.dir says.

        `config`: that file as parsed TOML (read within bounds by the caller: it may be hostile); anything of
        the wrong shape reads as the defaults (checkpoints/ in the run directory).
        """
        ckpt = config.get("ckpt") if isinstance(config, dict) else None
        shared = ckpt.get("dir") if isinstance(ckpt, dict) else None
        return cls(root, ckpt_dir=shared if isinstance(shared, str) else None)

    def __repr__(self) -> str:
        return f"RunDir({str(self.root)!r})"

    def attempt_logs(self, n: int) -> Path:
        """Log directory of restart attempt `n` (logs/attempt-<n>)."""
        if n < 0:
            raise ValueError(f"attempt number must be >= 0, got {n}")
        return self.logs_dir / f"attempt-{n}"

    def rank_logs(self, n: int) -> Path:
        """torchrun's --log-dir of attempt `n`: every rank's output (only rank 0's reaches the trainer log)."""
        return self.attempt_logs(n) / "ranks"

    def published_weights(self, step: int) -> Path:
        """Where an RL trainer publishes the weights of `step` for its workers."""
        return self.weights_dir / f"step-{step}"

    def create(self) -> None:
        """Create the run directory with its logs/ and checkpoints/ (existing ones are kept); UnsafeLink when one of
        them is a symlink leading out of the run directory. A ckpt.dir elsewhere is the job's to create."""
        self.root.mkdir(parents=True, exist_ok=True)
        for d in (self.logs_dir, self.root / "checkpoints"):
            self.ensure_dir(d)

    def ensure_dir(self, path: str | os.PathLike[str]) -> Path:
        """Create a directory of the run directory (logs/attempt-<n>, tensorboard/, ...) if it is missing; UnsafeLink
        when it is, or is reached through, a symlink leading out of the run directory: what the tool writes there
        would land elsewhere. A link that stays inside the run directory is followed."""
        path = Path(path)
        self._refuse_outside(path)  # before mkdir: nothing is created at the far end of a link either
        path.mkdir(parents=True, exist_ok=True)
        self._refuse_outside(path)
        return path

    def _refuse_outside(self, path: Path) -> None:
        # realpath resolves the links among the parts that exist and keeps the rest as written
        where = os.path.realpath(path)
        if not _inside(where, os.path.realpath(self.root)):
            raise UnsafeLink(path, f"leads out of the run directory {self.root}, to {where}")

    def unsafe_links(self) -> list[str]:
        """What stands at the names prime-train writes in this run directory that it must not write to: a symlink
        at one of its files (its writers never follow one, so what they write would be lost) or at one of its
        directories leading out of the run directory, as "<name> -> <target>"; and at one of its files anything but
        a file (a named pipe, whose opening for an append waits for a reader forever; a socket, a device, a
        directory), as "<name> (a named pipe)"."""
        try:
            entries = sorted(os.scandir(self.root), key=lambda e: e.name)
        except OSError:  # missing (a new run), or not a directory: nothing written yet is at risk
            return []
        root = os.path.realpath(self.root)
        found = []
        for entry in entries:
            file_name = entry.name in RUN_FILES or CONFIG_ATTEMPT_RE.match(entry.name) is not None
            if file_name and not entry.is_symlink() and (special := _special_kind(entry)):
                found.append(f"{entry.name} ({special})")
                continue
            if not (file_name or entry.name in RUN_DIRS) or not entry.is_symlink():
                continue
            if file_name or not _inside(os.path.realpath(entry.path), root):
                try:
                    target = os.readlink(entry.path)
                except OSError:
                    target = "?"
                found.append(f"{entry.name} -> {target}")
        return found


def _special_kind(entry: os.DirEntry) -> str | None:
    """What a directory entry is when it is not a regular file ("a named pipe", ...); None for a file."""
    try:
        mode = entry.stat(follow_symlinks=False).st_mode
    except OSError:
        return None
    kinds = ((stat.S_ISREG, None), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
             (stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))  # fmt: skip
    return next((kind for test, kind in kinds if test(mode)), "not a regular file")


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


BEST_FILE = "best.json"  # ckpt.keep_best: {"step", "metric", "value", "direction"}; every retention keeps it


def best_checkpoint_step(ckpt_dir: str | os.PathLike[str]) -> int | None:
    """The step checkpoints/best.json names, or None (no file, or not one the engine wrote)."""
    step = (read_json(Path(ckpt_dir) / BEST_FILE) or {}).get("step")
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


# ---------------------------------------------------------------- one owner per run directory


class RunDirBusy(Exception):
    """The run directory is owned by another live process; `holder` is what it wrote about itself."""

    def __init__(self, run_dir: RunDir, holder: dict[str, Any] | None):
        self.run_dir = run_dir
        self.holder = holder or {}
        h = self.holder
        who = f"`{h['command']}`" if isinstance(h.get("command"), str) else "another prime-train"
        details = []
        if isinstance(h.get("pid"), int):
            details.append(f"pid {h['pid']}")
        if isinstance(h.get("host"), str):
            details.append(f"on {h['host']}")
        if isinstance(h.get("since"), int | float):
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["since"]))
            details.append(f"since {stamp} ({max(0, time.time() - h['since']) / 60:.0f} min ago)")
        holder_text = f"{who} ({', '.join(details)})" if details else f"{who} (it has not said which process)"
        stop = f"stop it (kill -TERM {h['pid']}), " if isinstance(h.get("pid"), int) else ""
        super().__init__(
            f"run directory {run_dir.root} is in use by {holder_text}: one process owns a run directory at a "
            f"time. Wait for it to finish, {stop}or give this run another run.name or run.output_dir."
        )


class RunDirUnsafe(RunDirBusy):
    """The run directory holds symlinks where prime-train writes (RunDir.unsafe_links): it is not taken, and nothing
    is written in it. A RunDirBusy, so that `run` and `train` refuse it as they refuse one another process owns:
    a configuration error, exit 78."""

    def __init__(self, run_dir: RunDir, links: list[str]):
        self.run_dir = run_dir
        self.holder = {}
        self.links = links
        hint = ""
        if any(link.split(" -> ")[0] == "checkpoints" for link in links):
            hint = " To keep checkpoints on another disk, set ckpt.dir to it instead of linking checkpoints/."
        what = "a symbolic link" if all(" -> " in link for link in links) else "what it must not write to"
        Exception.__init__(
            self,
            f"run directory {run_dir.root} holds {what} where prime-train writes its own files: "
            f"{'; '.join(links)}. prime-train never writes through a link there (the write would land outside the "
            f"run directory, or be lost), nor into a pipe, socket or device; remove them, or give this run another "
            f"run.name or run.output_dir." + hint,
        )


class RunLock:
    """The flock() on <run>/.lock, held for the life of the process that owns the run directory.

    The kernel releases it when the holder exits however it exits (kill -9 included), so a stale lock
    cannot outlive its owner; the file itself stays (deleting it would let two processes lock two
    different files). The descriptor is not inherited by children: an orphaned job must not keep the
    run locked against the supervisor that comes to end it. On NFS, Linux emulates flock() with POSIX
    byte-range locks, which the server arbitrates between machines.
    """

    def __init__(self, run_dir: RunDir, fd: int):
        self.run_dir = run_dir
        self._fd: int | None = fd

    @classmethod
    def acquire(cls, run_dir: RunDir, command: str) -> RunLock:
        """Take the run directory for this process, or raise RunDirBusy naming the process that has it."""
        import fcntl
        import socket

        run_dir.root.mkdir(parents=True, exist_ok=True)
        fd = open_nofollow(run_dir.lock_path, os.O_RDWR | os.O_CREAT, 0o644)  # a planted link is never truncated
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirBusy(run_dir, read_lock_holder(run_dir)) from None
        except BaseException:
            os.close(fd)
            raise
        holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "command": command}
        with contextlib.suppress(OSError):  # a full disk must not stop a run that holds its lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        return cls(run_dir, fd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the run directory up (closing the descriptor releases the flock)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_lock_holder(run_dir: RunDir) -> dict[str, Any] | None:
    """What the owner of the run directory wrote about itself in .lock (pid, host, since, command), or None."""
    try:
        obj = json.loads(run_dir.lock_path.read_bytes().decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None
