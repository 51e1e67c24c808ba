"""The restart policy: reads a Failure, decides whether and when to try again."""

from __future__ import annotations

from dataclasses import dataclass

from prime_train.kit.failures import WHY_NOT_RETRIED, Failure, FailureKind


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay_s: float
    reason: str


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int
    backoff_initial_s: float = 2.0
    backoff_max_s: float = 300.0

    def delay(self, restarts_so_far: int) -> float:
        """Exponential backoff: initial, 2×, 4×, … capped at backoff_max_s."""
        return min(self.backoff_max_s, self.backoff_initial_s * (2**restarts_so_far))

    def decide(self, failure: Failure, restarts_so_far: int) -> Decision:
        if not failure.retryable:
            why = WHY_NOT_RETRIED.get(failure.kind)
            return Decision(False, 0.0, f"{failure.kind} is not retryable" + (f": {why}" if why else ""))
        if restarts_so_far >= self.max_restarts:
            return Decision(False, 0.0, f"supervisor.max_restarts ({self.max_restarts}) exhausted")
        # a preemption notice means the job checkpointed on purpose: resume at once, no backoff
        delay = 0.0 if failure.kind is FailureKind.PREEMPTED else self.delay(restarts_so_far)
        return Decision(True, delay, f"restart {restarts_so_far + 1}/{self.max_restarts} after {failure.kind}")
