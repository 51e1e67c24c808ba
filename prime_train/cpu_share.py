"""The machine's cores shared between the trainers of this user's runs, while they run.

The launch picks a trainer's threads from the load average (launch.cpu_threads), which cannot see a run that
started a second ago: two runs started together on 2 cores took 2 threads each, and their steps took 2.5x as
long as with one thread each (0.79 s against 0.31 s a step of the tiny SFT run; RL steps 0.3 s -> 15-25 s).
So each trainer process whose threads were chosen for it (PRIME_TRAIN_THREADS=auto, set by the launch) claims
them in a per-user directory, and every CLAIM_CHECK_S it reads the others' claims: while the claims add up to
more than the usable cores it drops to what the others leave (at least 1), and it takes its threads back, up to
the launch's choice, when they end. A claim is a small JSON file named by the process id that wrote it, with
the process's start time, so a claim left by a killed process (or by an unrelated process that reused its id)
is not counted. Nothing here follows a symlink: the directory must be a real directory of this user's, and a
claim is written to a temporary name and renamed over its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import stat
import time
from pathlib import Path

import psutil

logger = logging.getLogger("prime_train.engine")

CLAIM_CHECK_S = 10.0  # how often a trainer reads the other claims (a listdir and a few small reads)
AUTO = "auto"  # PRIME_TRAIN_THREADS: the launch chose the threads (no OMP_NUM_THREADS exported, no train.threads)


def usable_cores() -> int:
    """The CPUs this process may run on (taskset, cgroups' cpusets), or every core where that cannot be asked."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def claims_dir() -> Path:
    """$XDG_CACHE_HOME/prime-train/cpu-claims (~/.cache/... without it): per user, never a shared /tmp path."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prime-train" / "cpu-claims"


def _own_directory(path: Path) -> Path | None:
    """`path`, made if missing; None (and why, logged) unless it is a real directory of this user's."""
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = os.lstat(path)
    except OSError as e:
        logger.warning("CPU threads are not shared with other runs: %s", e)
        return None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        logger.warning("CPU threads are not shared with other runs: %s is not a directory of this user's", path)
        return None
    return path


def _started(pid: int) -> float | None:
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, OSError):
        return None


class CpuShare:
    """This process's claim on the cores, and its share while other claims come and go."""

    def __init__(self, wanted: int, cores: int, directory: Path | None = None, *, pid: int | None = None):
        self.wanted, self.cores = max(1, wanted), max(1, cores)
        self.pid = os.getpid() if pid is None else pid
        self.started = _started(self.pid)
        self.dir = _own_directory(directory or claims_dir())
        self.threads = self.wanted
        self._next_check = 0.0

    @property
    def path(self) -> Path | None:
        return None if self.dir is None else self.dir / f"{self.pid}.json"

    def others(self, *, tidy: bool = False) -> int:
        """Threads claimed by other live processes; `tidy`: remove the claims of processes that ended (killed ones
        leave theirs), which this module wrote."""
        if self.dir is None:
            return 0
        total = 0
        for entry in os.scandir(self.dir):
            name = entry.name
            if not name.endswith(".json") or not name[:-5].isdigit() or int(name[:-5]) == self.pid:
                continue
            if not entry.is_file(follow_symlinks=False):
                continue
            try:
                claim = json.loads(Path(entry.path).read_text(encoding="utf-8"))
                pid, started, threads = int(name[:-5]), float(claim["started"]), int(claim["threads"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            alive = _started(pid)
            if alive is not None and abs(alive - started) < 1.0:
                total += max(0, threads)
            elif tidy:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
        return total

    def _write(self) -> None:
        if self.path is None or self.started is None:
            return
        tmp = self.path.with_name(f".{self.pid}.json.tmp")
        body = json.dumps({"pid": self.pid, "started": self.started, "threads": self.threads}).encode()
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)  # this process's own temporary name, from an earlier write of a process with its id
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, self.path)  # replaces a link at the claim's name, never writes through it
        except OSError as e:
            logger.warning("could not write the CPU claim %s: %s", self.path, e)

    @contextlib.contextmanager
    def _locked(self):
        if self.dir is None:
            yield
            return
        try:
            fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError:  # a link or something else at its name: go on unlocked rather than follow it
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def fair_threads(self, *, tidy: bool = False) -> int:
        """The threads this process may use now: what the other claims leave of the cores, at least 1, at most
        the launch's choice."""
        return max(1, min(self.wanted, self.cores - self.others(tidy=tidy)))

    def claim(self) -> int:
        """Take this process's share as it starts (under the directory's lock, so two starts see each other)."""
        with self._locked():
            self.threads = self.fair_threads(tidy=True)
            self._write()
        self._next_check = time.monotonic() + CLAIM_CHECK_S
        return self.threads

    def poll(self, now: float | None = None) -> int | None:
        """Every CLAIM_CHECK_S: the new thread count when this process's share changed, else None."""
        now = time.monotonic() if now is None else now
        if now < self._next_check:
            return None
        self._next_check = now + CLAIM_CHECK_S
        with self._locked():
            share = self.fair_threads()
            if share == self.threads:
                return None
            self.threads = share
            self._write()
        return share

    def release(self) -> None:
        """Remove this process's claim (only its own file)."""
        if self.path is not None:
            with contextlib.suppress(OSError):
                if not self.path.is_symlink():
                    os.unlink(self.path)


def from_environment() -> CpuShare | None:
    """The share of a trainer whose launch chose its threads (PRIME_TRAIN_THREADS=auto), claimed; else None."""
    if os.environ.get("PRIME_TRAIN_THREADS") != AUTO:
        return None
    import torch

    share = CpuShare(torch.get_num_threads(), usable_cores())
    threads = share.claim()
    if threads != torch.get_num_threads():
        logger.info("CPU threads: %d (other runs of prime-train claim the rest of %d cores)", threads, share.cores)
        torch.set_num_threads(threads)
    return share
