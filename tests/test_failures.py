"""Failure kinds as data: every kind has a retry rule and a hint, and the restart policy reads them."""

from __future__ import annotations

import pytest

from prime_train.contract import ExitCode, JobFailure
from prime_train.kit.failures import HINTS, RETRYABLE, Failure, FailureKind
from prime_train.resilience.patterns import PATTERNS
from prime_train.resilience.policy import WHY_NOT_RETRIED, RestartPolicy

K = FailureKind


def test_every_kind_has_a_retry_rule_and_a_hint_and_every_unretried_kind_a_reason():
    assert set(RETRYABLE) == set(FailureKind) == set(HINTS)
    assert all(HINTS[k] and "\n" not in HINTS[k] for k in FailureKind)
    assert set(WHY_NOT_RETRIED) == {k for k, retry in RETRYABLE.items() if not retry}


def test_every_failure_a_job_may_name_in_its_heartbeat_is_a_kind_the_supervisor_knows():
    assert {k.value for k in JobFailure} <= {k.value for k in FailureKind}
    assert ExitCode.NODE_LOST == 76 and len({int(c) for c in ExitCode}) == len(ExitCode)


def test_every_kind_the_log_scanner_reports_is_a_failure_kind_the_policy_knows():
    assert {p.kind for p in PATTERNS if p.kind is not None} <= set(RETRYABLE)


@pytest.mark.parametrize("kind", [K.DEVICE_ASSERT, K.LOSS_NOT_FINITE, K.CONFIG_ERROR])
def test_failures_that_recur_after_a_resume_are_not_retried_and_the_decision_says_why(kind):
    decision = RestartPolicy(max_restarts=5).decide(Failure(kind, "x"), restarts_so_far=0)
    assert not decision.restart
    assert "not retryable" in decision.reason and WHY_NOT_RETRIED[kind] in decision.reason


@pytest.mark.parametrize("kind", [K.HOST_OUT_OF_MEMORY, K.NCCL_ERROR, K.CUDA_ERROR])
def test_new_transient_kinds_are_retried_with_backoff(kind):
    policy = RestartPolicy(max_restarts=3, backoff_initial_s=2.0)
    first, third = policy.decide(Failure(kind, "x"), 0), policy.decide(Failure(kind, "x"), 2)
    assert first.restart and first.delay_s == 2.0 and third.delay_s == 8.0
    assert not policy.decide(Failure(kind, "x"), 3).restart


def test_failure_dict_names_the_kind_and_whether_it_is_retried():
    d = Failure(K.DEVICE_ASSERT, "assert", exit_code=1).to_dict()
    assert d["kind"] == "device_assert" and d["retryable"] is False


# ---------------------------------------------------------------- how a child's exit is judged (resilience/verdict.py)


def _judge(returncode: int, *, stop_requested: bool = False, role: str = "job", tail: list[str] | None = None):
    import time

    from prime_train.kit.process import ProcessSpec
    from prime_train.resilience.verdict import exit_verdict

    spec = ProcessSpec(role, ["job"], role=role)
    return exit_verdict(
        spec, returncode, returncode, None, time.time(), tail or [], [], stop_requested=stop_requested, preempted=False
    )


@pytest.mark.parametrize("returncode", [-15, -2, 143, 130], ids=["SIGTERM", "SIGINT", "shell-SIGTERM", "shell-SIGINT"])
@pytest.mark.parametrize("stop_requested", [True, False], ids=["forwarded", "sent-by-someone-else"])
def test_a_job_ended_by_sigterm_or_ctrl_c_is_a_stop_not_a_crash(returncode, stop_requested):
    assert _judge(returncode, stop_requested=stop_requested) is None


def test_the_stop_signal_is_named_as_a_person_knows_it():
    from prime_train.resilience.verdict import stop_signal

    assert [stop_signal(c) for c in (-2, 130, -15, 143, -9, 1)] == [
        "Ctrl-C",
        "Ctrl-C",
        "SIGTERM",
        "SIGTERM",
        None,
        None,
    ]


def test_an_inference_worker_killed_without_a_stop_request_is_still_a_dead_worker():
    failure = _judge(-15, role="inference")
    assert failure is not None and failure.kind is K.INFERENCE_DIED


def test_a_crash_without_output_says_how_it_ended_and_points_at_no_excerpt_that_is_not_there():
    failure = _judge(1)
    assert failure is not None and failure.kind is K.CRASH
    assert failure.message == "exited with code 1 without writing any output"
    assert "above" not in failure.hint and "prime-train logs" in failure.hint
    killed = _judge(-6)
    assert killed is not None and killed.message == "killed by SIGABRT before it wrote any output"
