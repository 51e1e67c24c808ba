"""Stopping on request: the flag SIGTERM/SIGINT (or a lost supervisor) sets, and the ranks' agreement on it.

SIGTERM/SIGINT only set a flag; the step in progress finishes, every rank agrees to stop at the same step, a
checkpoint is saved synchronously and the process exits 75 (engine/checkpoint.py has the full design). Before the
first step there is nothing to save: a stop then ends start-up at once (StopRequested), also with 75.

The agreement is an all-reduce of the flag. One process reads its flag every step, without a collective; several
agree every STOP_CHECK_S seconds' worth of steps (the slowest rank's step time sets how many), so a SIGTERM is acted
on within about 2 s plus a step, far inside supervisor.term_grace_s (60 s by default) with the save it triggers.
"""

from __future__ import annotations

import os
import signal

import torch

from prime_train.contract import ENV_STOP_AT
from prime_train.engine import parallel

STOP_CHECK_S = 2.0
STOP_CHECK_MAX_STEPS = 50


class StopRequested(BaseException):
    """A stop asked for during start-up, before the first step: there is nothing to save, so start-up ends.

    A BaseException, like KeyboardInterrupt: library code that catches Exception must not swallow it."""


class StopFlag:
    """Set by SIGTERM/SIGINT: finish the step, save, exit 75. During start-up it raises StopRequested instead.

    PRIME_TRAIN_STOP_AT_STEP=N (a PBT round's end, set by the sweep) stops the same way once step N is trained:
    every rank reads it and counts the same steps, so they stop together without agreeing on it."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""
        self.reason = ""  # why, when it was not a signal from outside (the supervisor is gone)
        self.startup = True  # until the training loop starts: a stop ends start-up at once
        value = os.environ.get(ENV_STOP_AT, "").strip()
        self.stop_at = int(value) if value.isdigit() else None

    def due_at(self, step: int) -> bool:
        """Whether the run stops at `step` (the steps trained so far) because it was asked to stop there."""
        if self.stop_at is None or step < self.stop_at:
            return False
        self.reason = self.reason or f"asked to stop at step {self.stop_at} ({ENV_STOP_AT})"
        return True

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        if self.startup:
            self.startup = False  # a second signal while start-up unwinds only sets the flag
            raise StopRequested(self.describe() + " during start-up, before the first step: nothing to save")

    def describe(self) -> str:
        """Why the job stops, in words."""
        if self.reason:
            return self.reason
        if self.signal_name:
            return f"{self.signal_name} received"
        # the agreement on stopping carries no reason: the rank that asked may be on another node
        return "another rank asked to stop (a signal there, or its supervisor is gone)"

    def supervisor_gone(self, reason: str) -> None:
        """Called from the lifeline's thread: stop as on SIGTERM, handled on the main thread like one."""
        self.reason = reason
        os.kill(os.getpid(), signal.SIGTERM)


class StopAgreement:
    """All ranks stop at the same step: a stop asked of any rank stops every rank.

    `agreed()` is called once per step on every rank; it is a collective on the steps it checks (every step for
    one process, every `every` steps for several). `adapt(step_time_s)` is called with each read of the steps'
    metrics on every rank (a collective too) and sets `every` from the slowest rank's step time.
    """

    def __init__(self, flag: StopFlag, dist: parallel.DistInfo):
        self.flag = flag
        self.dist = dist
        self.every = 1  # steps between agreements (1 until a step time is known)
        self._since = 0

    def agreed(self) -> bool:
        """Whether every rank stops now (False on the steps between two checks)."""
        if not self._due():
            return False
        flag = torch.tensor([1.0 if self.flag.requested else 0.0])
        return bool(parallel.all_reduce_sum(flag, self.dist)[0] > 0)

    def _due(self) -> bool:
        if self.dist.world_size == 1:
            return True  # one process: the flag is read every step, without a collective
        self._since += 1
        if self._since < self.every:
            return False
        self._since = 0
        return True

    def adapt(self, step_time_s: float) -> None:
        """Agree every STOP_CHECK_S seconds of steps: the same number of steps on every rank (the slowest's)."""
        if self.dist.world_size == 1:
            return
        slowest = parallel.all_reduce_max(step_time_s, self.dist)
        self.every = max(1, min(STOP_CHECK_MAX_STEPS, int(STOP_CHECK_S / max(slowest, 1e-6))))
