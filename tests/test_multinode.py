"""Several nodes (issue 20), with real processes on 127.0.0.1: a node notices when another node is gone, within a
bounded time instead of the collective timeout. (The end of the node that holds the store is not pinned yet: torch's
store client can hang on a server that went away instead of failing; see the issue 20 note.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from enginetools import free_port

SRC = str(Path(__file__).resolve().parents[1])

# A node's lifeline to the others (its local rank 0's): prints when a peer is lost, else lives until killed.
RANK = """
import sys, time
sys.path.insert(0, {src!r})
from prime_train.engine.lifeline import watch_peers
node, nnodes, port = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
def lost(reason):
    print("LOST " + reason, flush=True)
watch_peers(lost, node=node, nnodes=nnodes, host="127.0.0.1", port=port, timeout_s=float(sys.argv[4]), beat_s=0.2)
print("WATCHING", flush=True)
time.sleep(600)
"""

# Node 0's torchrun agent, as far as the store goes: the TCPStore server.
STORE = """
import sys, time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
print("SERVING", flush=True)
time.sleep(600)
"""


def _start(code: str, *args: object) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    return proc


def _wait_line(proc: subprocess.Popen, prefix: str, timeout_s: float) -> tuple[str, float]:
    """The first line starting with `prefix` and when it came; fails with the output so far after timeout_s."""
    import selectors

    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
            break
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line[len(prefix) :].strip(), time.monotonic()
    raise AssertionError(f"no {prefix!r} line within {timeout_s} s:\n{''.join(seen)}")


def _kill(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_node_whose_trainer_is_killed_9_is_noticed_by_the_other_within_the_peer_timeout():
    port = free_port()
    store = _start(STORE, port)
    ranks: list[subprocess.Popen] = []
    try:
        _wait_line(store, "SERVING", 60)
        ranks = [_start(RANK.format(src=SRC), r, 2, port, 3.0) for r in (0, 1)]
        for r in ranks:
            _wait_line(r, "WATCHING", 60)
        time.sleep(4.0)  # longer than the timeout: beating ranks are never taken for gone
        assert ranks[0].poll() is None and ranks[1].poll() is None
        killed = time.monotonic()
        ranks[1].kill()
        reason, when = _wait_line(ranks[0], "LOST ", 30)
        assert "node 1 has been silent for 3 s" in reason, reason
        assert when - killed < 3.0 + 2.0, when - killed
    finally:
        _kill(*ranks, store)
