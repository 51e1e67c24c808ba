"""The job never outlives the process that started it: a thread that watches for that process to go.

The supervisor (`prime-train run`, or `prime-train train`) names itself in PRIME_TRAIN_SUPERVISOR as
"<pid>:<create time>". Every rank polls it once a second and, when it is gone, stops as on SIGTERM:
the step finishes, a checkpoint is saved, the process exits 75 and its last heartbeat says why. A
supervisor killed with kill -9 thus leaves no trainer behind to compete with the next one (which also
ends any job of its run directory still alive, resilience/ownership.py).

Why a poll of the pid and its start time rather than prctl(PR_SET_PDEATHSIG) or a pipe: both signal the
death of the *direct* parent, and under torchrun the ranks' parent is torchrun, not the supervisor; a
pipe's end is not inherited past torchrun either (it starts its workers with close_fds). PDEATHSIG also
fires when the parent *thread* that forked the child exits, and setting it on the child before exec needs
preexec_fn, which is unsafe in the supervisor's threaded process. The poll reaches every rank, works on
macOS too, and tells the supervisor from a later process with its recycled pid by the start time.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import psutil

from prime_train.contract import ENV_SUPERVISOR

logger = logging.getLogger("prime_train.engine")

POLL_S = 1.0


def parse_supervisor(token: str) -> tuple[int, float] | None:
    """(pid, create time) from PRIME_TRAIN_SUPERVISOR's "<pid>:<create time>", or None when malformed."""
    pid, _, started = token.partition(":")
    try:
        return int(pid), float(started)
    except ValueError:
        return None


def supervisor_alive(pid: int, started: float) -> bool:
    """Whether the process `pid` that started at `started` (psutil's create time) still runs."""
    try:
        proc = psutil.Process(pid)
        # a zombie has exited: its parent has not reaped it yet (or is itself gone)
        return abs(proc.create_time() - started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True  # alive but not ours to inspect: not evidence that it is gone


def watch_supervisor(on_gone: Callable[[str], None], poll_s: float = POLL_S) -> threading.Thread | None:
    """Call `on_gone(reason)` once, from a daemon thread, when the supervisor named in the environment is gone.

    None (nothing watched) when the job was started without one, by hand or by another launcher.
    """
    token = os.environ.get(ENV_SUPERVISOR)
    if not token:
        return None
    parsed = parse_supervisor(token)
    if parsed is None:
        logger.warning("%s=%r is not <pid>:<create time>; not watching the supervisor", ENV_SUPERVISOR, token)
        return None
    pid, started = parsed

    def watch() -> None:
        while supervisor_alive(pid, started):
            time.sleep(poll_s)
        reason = f"its supervisor (pid {pid}) is gone"
        logger.warning("%s: stopping", reason)
        on_gone(reason)

    thread = threading.Thread(target=watch, name="supervisor-lifeline", daemon=True)
    thread.start()
    return thread
