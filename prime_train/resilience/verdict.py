"""A child's exit, judged: success, a requested stop, or a Failure classified from its evidence.

The order of the rules is the point: a clean exit, then a checkpointed stop (75), then a stop the
supervisor asked for that arrived before the job could handle it, then a configuration error (78), then
what the job diagnosed itself in its last heartbeat (a non-finite loss), and only then a reading of
its log (logscan.classify), with SIGKILL without a word named as such.
"""

from __future__ import annotations

import signal

from prime_train.contract import ExitCode, Heartbeat, Phase
from prime_train.kit.failures import Failure, FailureKind
from prime_train.kit.process import ProcessSpec, Role
from prime_train.resilience.logscan import Finding, classify

# How a process the supervisor sent SIGTERM (or a Ctrl-C reached) ends before it has a handler of its own:
# by the signal (Popen's -N), or as a shell's 128 + N
STOP_SIGNALS = frozenset({-signal.SIGTERM, -signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGINT})
# How a stop is named to a person: Ctrl-C is what they pressed, SIGTERM what `kill` or a scheduler sent
STOP_NAMES = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}


def stop_signal(returncode: int) -> str | None:
    """ "Ctrl-C" or "SIGTERM" when `returncode` is a process ended by that signal (or a shell's 128 + N), else None.

    Such an end is a stop, never a crash: either the supervisor forwarded it, or a person or a scheduler sent it
    to the job directly, and restarting what they stopped would undo their decision."""
    if returncode not in STOP_SIGNALS:
        return None
    return STOP_NAMES[signal.Signals(abs(returncode) if returncode < 0 else returncode - 128)]


def exit_verdict(
    spec: ProcessSpec,
    returncode: int,
    code: int,
    heartbeat: Heartbeat | None,
    started_at: float,
    tail: list[str],
    findings: list[Finding],
    *,
    stop_requested: bool,
    preempted: bool,
) -> Failure | None:
    """None when the exit is a success or the stop the supervisor asked for; else the Failure, with evidence.

    `code` is the job's own exit code (launch.job_exit_code: torchrun reports every worker failure as 1),
    `returncode` the process's; `heartbeat` counts only when written after `started_at`.
    """
    name = spec.name
    if code == 0:
        if spec.role in (Role.TRAINER, Role.JOB):
            return None
        return Failure(FailureKind.INFERENCE_DIED, f"{name} exited", tail, name, exit_code=code)
    if code == ExitCode.PREEMPTED:
        if stop_requested:
            return None
        # the job's own word on who asked (with several nodes, often a rank on another node)
        said = heartbeat.reason if heartbeat is not None and (heartbeat.time or 0) >= started_at else None
        return Failure(
            FailureKind.PREEMPTED,
            "the job checkpointed and stopped on request"
            + (" (cloud preemption notice)" if preempted else "")
            + (f": {said}" if said else ""),
            tail,
            name,
            exit_code=code,
        )
    if stop_signal(returncode) is not None and (stop_requested or spec.role in (Role.TRAINER, Role.JOB)):
        # the SIGTERM we sent arrived before the job could handle it (in start-up), or someone else stopped the
        # job itself (kill, a Ctrl-C that reached its process group): a stop the supervisor honours, not a crash
        return None
    if code == ExitCode.CONFIG:
        return Failure(FailureKind.CONFIG_ERROR, last_message(findings, tail), tail, name, exit_code=code)
    fresh = heartbeat if heartbeat is not None and (heartbeat.time or 0) >= started_at else None
    diagnosed = fresh.failure if fresh is not None and fresh.phase is Phase.FAILED else None
    if diagnosed in FailureKind.__members__.values() and spec.role is not Role.INFERENCE:
        # the job named its failure itself (a non-finite loss): its word over a reading of its log
        assert fresh is not None
        return Failure(FailureKind(diagnosed), fresh.reason or last_message(findings, tail), tail, name, exit_code=code)
    if spec.role is Role.INFERENCE:
        return Failure(FailureKind.INFERENCE_DIED, last_message(findings, tail), tail, name, exit_code=code)
    kind = classify(findings) or FailureKind.CRASH
    if kind is FailureKind.CRASH and returncode in (-signal.SIGKILL, 137) and not findings:
        message = "killed by SIGKILL (the kernel OOM killer, or a kill -9): no traceback"
    else:
        message = last_message(findings, tail, returncode)
    return Failure(kind, message, tail, name, exit_code=code)


def last_message(findings: list[Finding], tail: list[str], returncode: int | None = None) -> str:
    """The line that says why: the last fatal finding, else the last line of output, else how it ended."""
    fatal = [f for f in findings if f.severity == "fatal"]
    if fatal:
        return fatal[-1].text
    lines = [t for t in tail if t.strip()]
    if lines:
        return lines[-1]
    if returncode is None:
        return "exited without output"
    if returncode < 0 and -returncode in signal.valid_signals():
        return f"killed by {signal.Signals(-returncode).name} before it wrote any output"
    return f"exited with code {returncode} without writing any output"
