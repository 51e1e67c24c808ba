"""The job never outlives the process that started it: a thread that watches for that process to go.

The supervisor (`prime-train run`, or `prime-train train`) names itself in PRIME_TRAIN_SUPERVISOR as
"<pid>:<create time>". Every rank polls it once a second and, when it is gone, stops as on SIGTERM:
the step finishes, a checkpoint is saved, the process exits 75 and its last heartbeat says why. A
supervisor killed with kill -9 thus leaves no trainer behind to compete with the next one (which also
ends any job of its run directory still alive, kit/ownership.py).

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


# ---------------------------------------------------------------- the other nodes

# How long a rank on another node may go without a beat before it is taken for gone. A beat comes from a thread
# once a second whatever the main thread does (a compile, a save, a hung collective all keep beating), so silence
# means the process or its machine is gone, never that it is slow. 15 s: many times a beat, a fraction of the
# collective timeout (10 min) a survivor would otherwise wait in.
PEER_TIMEOUT_S = 15.0
BEAT_S = 1.0
PEER_PREFIX = "prime_train/beat/"
PEER_DONE_PREFIX = "prime_train/done/"


class PeerWatch:
    """A running watch of the other nodes (watch_peers); `finish()` ends it when this node's part of the job ended
    as planned."""

    def __init__(self, thread: threading.Thread, finished: threading.Event):
        self.thread = thread
        self._finished = finished

    def finish(self, timeout_s: float = 5.0) -> None:
        """Tell the other nodes this one is done (so its silence from now on is not a loss) and stop watching.

        Called once the node's ranks have left their last collective together (the end of the run, a stop, a
        divergence), never on a crash: a node that crashed must be seen as lost."""
        self._finished.set()
        self.thread.join(timeout_s)


def watch_peers(
    on_lost: Callable[[str], None],
    *,
    node: int,
    nnodes: int,
    host: str,
    port: int,
    timeout_s: float = PEER_TIMEOUT_S,
    beat_s: float = BEAT_S,
) -> PeerWatch:
    """Beat for `node` and watch the other nodes' beats in the rendezvous store at host:port (a TCPStore: the one
    torchrun's agent on node 0 serves); call `on_lost(reason)` once, from a daemon thread, when a node has been
    silent for `timeout_s`, when a request to the store fails (node 0's agent ended: the connection is reset), or
    when one has had no answer for `timeout_s` (node 0's machine gone or frozen: torch's client then waits on the
    socket past its own timeout, seen for minutes on torch 2.13 with a SIGSTOPped server, so a second thread
    times the request). One watcher a node (its local rank 0): a rank that exits makes torchrun end the node's
    other ranks. A node that finished (PeerWatch.finish) is never taken for lost, nor the store's end once node 0
    finished.

    Why: a trainer that dies on one node leaves the ranks of the others blocked in their next collective until its
    timeout (10 minutes by default, NCCL's or gloo's) with nothing to tell them apart from a slow step. A beat
    counter in the store (an add, so no clock is compared across machines) tells them within `timeout_s`; two
    requests a beat whatever the node count (an add, and one multi_get of every node's counter and done mark). The
    watch has a store client of its own, so it never waits behind the main thread's collectives.
    """
    from datetime import timedelta

    from torch.distributed import TCPStore

    keys = [f"{PEER_PREFIX}{n}" for n in range(nnodes)]
    done_keys = [f"{PEER_DONE_PREFIX}{n}" for n in range(nnodes)]
    finished = threading.Event()
    reason = ""
    # connected before the thread starts: a watch that returned is a watch in place
    try:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=max(5.0, 5 * beat_s)))
        for key in keys + done_keys:
            store.add(key, 0)  # every key exists, so multi_get never waits for a node that has not beaten yet
    except Exception as exc:  # any failure to reach the store means node 0's agent is gone
        store = None
        reason = f"the job's rendezvous store at {host}:{port} cannot be reached ({_first_line(exc)})"

    told = threading.Lock()  # on_lost is called once, by whichever thread sees the loss first
    request_since: list[float | None] = [None]  # when the store request in flight was sent

    def lost(why: str) -> None:
        if told.acquire(blocking=False):
            on_lost(why)

    def time_requests() -> None:
        while not finished.is_set():
            since = request_since[0]
            if since is not None and time.monotonic() - since > timeout_s:
                lost(f"the job's rendezvous store at {host}:{port} has not answered for {timeout_s:.0f} s: node 0's "
                     "machine is gone or frozen")  # fmt: skip
                return
            finished.wait(min(beat_s, timeout_s / 4))

    def watch() -> None:
        if store is None:
            lost(reason)
            return
        threading.Thread(target=time_requests, name="peer-lifeline-timer", daemon=True).start()
        seen: dict[int, tuple[bytes, float]] = {}
        done: set[int] = set()
        while True:
            now = time.monotonic()
            try:
                request_since[0] = now
                if finished.is_set():
                    store.add(done_keys[node], 1)
                    return
                store.add(keys[node], 1)
                values = store.multi_get(keys + done_keys)
                request_since[0] = None
            except Exception as exc:  # the store closed: its host (node 0's agent) is gone
                # not a loss once node 0 finished (its agent ends the store as it exits) or this node did
                if 0 not in done and not finished.is_set():
                    lost(f"the job's rendezvous store at {host}:{port} is gone ({_first_line(exc)})")
                return
            counts, marks = values[:nnodes], values[nnodes:]
            done = {n for n, mark in enumerate(marks) if mark not in (b"0", b"")}
            for n, count in enumerate(counts):
                if n not in seen or seen[n][0] != count:
                    seen[n] = (count, now)
            silent = [n for n in range(nnodes) if n != node and n not in done and now - seen[n][1] > timeout_s]
            if silent:
                lost(f"node {silent[0]} has been silent for {timeout_s:.0f} s: its trainer or its machine is gone")
                return
            finished.wait(beat_s)

    thread = threading.Thread(target=watch, name="peer-lifeline", daemon=True)
    thread.start()
    return PeerWatch(thread, finished)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
