"""Real log excerpts from public issue trackers (tests/data/real_logs/): the right kind on the tuned part, >= 90 %
recall on the held-out part, no fatal finding on the look-alikes, and each new kind's restart rule."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from prime_train.kit.failures import HINTS, RETRYABLE, WHY_NOT_RETRIED, Failure, FailureKind
from prime_train.resilience.logscan import LogScanner, classify, root_cause, scan_file
from prime_train.resilience.patterns import FATAL
from prime_train.resilience.policy import RestartPolicy

REAL = Path(__file__).parent / "data" / "real_logs"
SOURCES: dict[str, dict[str, str]] = tomllib.loads((REAL / "sources.toml").read_text(encoding="utf-8"))["excerpts"]
K = FailureKind


def _part(part: str) -> list[str]:
    return sorted(name for name in SOURCES if name.startswith(f"{part}/"))


def _kind(name: str) -> FailureKind | None:
    return classify(scan_file(REAL / name))


def test_every_excerpt_has_a_source_and_every_source_a_file():
    assert {str(p.relative_to(REAL)) for p in REAL.glob("*/*.log")} == set(SOURCES)
    for name, entry in SOURCES.items():
        assert entry["source"].startswith("https://github.com/"), name
        assert entry["kind"] == "" or entry["kind"] in set(FailureKind), name
        # the split rule, decided before any pattern was written: every third excerpt of a family is held out
        if not name.startswith("benign/"):
            number = int(Path(name).stem.rsplit("-", 1)[1])
            assert name.startswith("held_out/" if number % 3 == 0 else "tuned/"), name


@pytest.mark.parametrize("name", _part("tuned"))
def test_tuned_excerpt_gets_its_kind(name):
    findings = scan_file(REAL / name)
    assert classify(findings) == FailureKind(SOURCES[name]["kind"]), [(f.line, f.name, f.kind) for f in findings]
    assert root_cause(findings).hint  # type: ignore[union-attr]


def test_held_out_excerpts_get_their_family_nine_times_in_ten():
    held_out = _part("held_out")
    missed = [(name, _kind(name)) for name in held_out if _kind(name) != FailureKind(SOURCES[name]["kind"])]
    assert len(held_out) >= 40
    assert (len(held_out) - len(missed)) / len(held_out) >= 0.9, missed


@pytest.mark.parametrize("name", _part("benign"))
def test_look_alike_stays_quiet(name):
    findings = scan_file(REAL / name)
    assert [f for f in findings if f.severity == FATAL] == []


def test_every_family_has_at_least_nine_real_excerpts():
    families: dict[str, int] = {}
    for name in SOURCES:
        if not name.startswith("benign/"):
            family = Path(name).stem.rsplit("-", 1)[0]
            families[family] = families.get(family, 0) + 1
    assert len(families) == 11 and min(families.values()) >= 9, families


# kind -> whether a restart can help: transient ones are retried with backoff, configuration ones never
RESTART_RULES = {
    K.KILLED_BY_SIGNAL: True,
    K.HUB_UNAVAILABLE: True,
    K.STORAGE_TRANSIENT: True,
    K.PORT_IN_USE: True,
    K.CHECKPOINT_MISMATCH: False,
    K.DRIVER_ERROR: False,
    K.BROKEN_INSTALL: False,
    K.COMPILE_ERROR: False,
    K.DTYPE_OR_DEVICE: False,
    K.STORAGE_ERROR: False,
    K.TRACKER_ERROR: False,
    K.TOKENIZER_ERROR: False,
}


@pytest.mark.parametrize("kind", sorted(RESTART_RULES))
def test_restart_rule_of_each_new_kind(kind):
    policy = RestartPolicy(max_restarts=3, backoff_initial_s=2.0)
    first, second = (policy.decide(Failure(kind, "x"), n) for n in (0, 1))
    assert RETRYABLE[kind] is RESTART_RULES[kind] and HINTS[kind]
    if RESTART_RULES[kind]:
        assert (first.restart, first.delay_s, second.delay_s) == (True, 2.0, 4.0)  # backoff, not a tight loop
    else:
        assert not first.restart and WHY_NOT_RETRIED[kind] in first.reason


def test_compile_hint_points_at_the_config_key_and_tracker_hint_says_the_run_was_fine():
    compile_cause = root_cause(scan_file(REAL / "tuned/compile-07.log"))
    assert compile_cause is not None and "train.compile = false" in compile_cause.hint
    tracker = root_cause(scan_file(REAL / "tuned/tracker-02.log"))
    assert tracker is not None and "training itself was fine" in tracker.hint


def test_tracker_network_warnings_never_make_a_verdict():
    findings = scan_file(REAL / "benign/wandb-upload-retries.log")
    assert {f.name for f in findings} == {"tracker_network"} and classify(findings) is None


def test_hub_offline_mode_is_a_configuration_error_and_a_timeout_is_retried():
    assert _kind("tuned/hub-10.log") is K.CONFIG_ERROR and not RETRYABLE[K.CONFIG_ERROR]
    assert _kind("tuned/hub-04.log") is K.HUB_UNAVAILABLE and RETRYABLE[K.HUB_UNAVAILABLE]


def test_signal_finding_names_the_rank_and_the_signal():
    (first, *_) = [f for f in scan_file(REAL / "tuned/signal-01.log") if f.kind == K.KILLED_BY_SIGNAL]
    assert first.text.startswith("exitcode  : -6") and "rank 1" in first.text and "SIGABRT" in first.text
    (agent,) = [f for f in scan_file(REAL / "tuned/signal-02.log") if f.line == 1]
    assert "rank 0" in agent.text and "SIGABRT" in agent.text


def test_torchrun_error_line_of_a_taken_port_names_the_port_from_the_warning_before_it():
    (error,) = [f for f in scan_file(REAL / "tuned/port-04.log") if f.severity == FATAL]
    assert error.line == 6 and error.text.endswith("failed to listen on any (port 25641)")
    (own,) = [f for f in scan_file(REAL / "tuned/port-05.log") if f.severity == FATAL]
    assert "(port" not in own.text and ":44796" in own.text  # the line names it already


def test_torchrun_summary_of_a_signal_points_to_the_ranks_own_earlier_error():
    # a rank's CUDA error (as torch prints it), then torchrun's summary of the same rank (tuned/signal-01.log)
    rank_error = [
        "terminate called after throwing an instance of 'c10::Error'",
        "  what():  CUDA error: an illegal memory access was encountered",
    ]
    summary = (REAL / "tuned/signal-01.log").read_text(encoding="utf-8").splitlines()
    scanner = LogScanner("trainer")
    found = [f for n, line in enumerate([*rank_error, *summary], 1) for f in scanner.feed(line, n)]
    cause = root_cause(found)
    assert cause is not None and (cause.line, cause.kind) == (2, "cuda_error")
    assert K.KILLED_BY_SIGNAL in {f.kind for f in found}
    # alone, the summary names the signal
    assert _kind("tuned/signal-01.log") is K.KILLED_BY_SIGNAL
