"""`prime-train status` on run directories written wrong: a supervisor.json of the wrong shape, events whose
fields have the wrong types, bytes that are not UTF-8. Each is read through the real CLI in a subprocess; a
file written by an older prime-train, a half-dead disk or another tool must never make status raise."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from enginetools import run_cli

from prime_train.contract import RunDir
from prime_train.resilience.events import read_events
from prime_train.resilience.status import run_status

GOOD_EVENT = {"time": 1_700_000_000.0, "event": "attempt_started", "attempt": 1}


def make_run(tmp_path: Path, supervisor: str | bytes | None = None, events: bytes | None = None) -> Path:
    run = RunDir(tmp_path / "run")
    run.create()
    if supervisor is not None:
        data = supervisor.encode() if isinstance(supervisor, str) else supervisor
        run.supervisor_path.write_bytes(data)
    if events is not None:
        run.events_path.write_bytes(events)
    return run.root


def status_both_ways(run: Path) -> tuple[str, dict]:
    """`status RUN` (its text) and `status RUN --json` (its document); both must exit 0 without a traceback."""
    human = run_cli("status", str(run))
    machine = run_cli("status", str(run), "--json")
    for result in (human, machine):
        output = result.stdout + result.stderr
        assert result.returncode == 0, output
        assert "Traceback" not in output and "unexpected" not in output, output
    return human.stdout, json.loads(machine.stdout)


# supervisor.json as other writers or damage leave it: each field the wrong type
WRONG_SUPERVISOR = {
    "last_failure_is_a_string": '{"state": "failed", "last_failure": "boom"}',
    "last_failure_is_a_list": '{"state": "failed", "last_failure": ["boom", 1]}',
    "pid_is_a_string": '{"state": "running", "pid": "x", "attempt": "two"}',
    "pid_is_huge": '{"state": "running", "pid": 100000000000000000000000}',
    "state_is_a_number": '{"state": 3, "restarts": {"n": 1}, "step": "ten"}',
    "whole_file_is_a_list": "[1, 2, 3]",
    "not_utf8": b'{"state": "failed\xff\xfe", "last_failure": {"message": "x\xff"}}',
}


@pytest.mark.parametrize("text", WRONG_SUPERVISOR.values(), ids=WRONG_SUPERVISOR.keys())
def test_status_reads_a_supervisor_json_of_the_wrong_shape(tmp_path, text):
    shown, document = status_both_ways(make_run(tmp_path, supervisor=text))
    assert "state" in shown
    assert document["last_failure"] is None or isinstance(document["last_failure"], dict)
    assert document["attempt"] is None or isinstance(document["attempt"], int)


def test_a_failure_written_as_a_bare_string_is_shown_as_its_message(tmp_path):
    shown, document = status_both_ways(make_run(tmp_path, supervisor='{"state": "failed", "last_failure": "boom"}'))
    assert document["last_failure"]["message"] == "boom"
    assert "boom" in shown
    assert document["state"] == "failed"


def test_a_running_state_with_a_pid_that_is_not_a_number_reads_as_dead(tmp_path):
    _, document = status_both_ways(make_run(tmp_path, supervisor='{"state": "running", "pid": "x"}'))
    assert document["state"] == "dead (supervisor not running)"


# events.jsonl lines whose fields have the wrong types: the time a string, NaN, out of any clock's range
WRONG_EVENTS = {
    "time_is_a_string": {"time": "x", "event": "attempt_started"},
    "time_is_null": {"time": None, "event": "attempt_started"},
    "time_is_huge": {"time": 1e300, "event": "attempt_started"},
    "time_is_negative_huge": {"time": -1e20, "event": "attempt_started"},
    "time_is_a_list": {"time": [1], "event": {"nested": True}},
    "time_is_a_bool": {"time": True, "event": 7},
}


@pytest.mark.parametrize("event", WRONG_EVENTS.values(), ids=WRONG_EVENTS.keys())
def test_status_shows_events_whose_fields_have_the_wrong_type(tmp_path, event):
    lines = (json.dumps(event) + "\n" + json.dumps(GOOD_EVENT) + "\n").encode()
    shown, document = status_both_ways(make_run(tmp_path, supervisor='{"state": "done"}', events=lines))
    assert len(document["recent_events"]) == 2
    assert "--:--:--" in shown  # the unreadable time, shown as such
    assert "attempt_started" in shown


def test_events_with_bytes_that_are_not_utf8_are_read_with_the_rest_of_the_file(tmp_path):
    lines = (
        b'{"time": 1700000000, "event": "log_finding", "text": "bad \xff\xfe bytes"}\n'
        + b"\xc3\x28 not json at all\n"
        + json.dumps(GOOD_EVENT).encode()
        + b"\n"
    )
    events_path = make_run(tmp_path, supervisor='{"state": "failed"}', events=lines) / "events.jsonl"
    events = read_events(events_path)
    assert [e["event"] for e in events] == ["log_finding", "attempt_started"]
    assert "\ufffd" in events[0]["text"]
    shown, document = status_both_ways(events_path.parent)
    assert [e["event"] for e in document["recent_events"]] == ["log_finding", "attempt_started"]
    assert "log_finding" in shown


def test_json_lines_that_are_not_objects_are_skipped(tmp_path):
    lines = b'"a string"\n[1, 2]\n42\nnull\n' + json.dumps(GOOD_EVENT).encode() + b"\n"
    run = make_run(tmp_path, supervisor='{"state": "done"}', events=lines)
    assert read_events(run / "events.jsonl") == [GOOD_EVENT]
    status_both_ways(run)


def test_status_json_has_no_nan_even_when_the_heartbeat_has_one(tmp_path):
    run = make_run(tmp_path, supervisor='{"state": "failed"}')
    (run / "progress.json").write_text('{"step": 3, "phase": "step", "loss": NaN, "time": Infinity}')
    assert math.isnan(run_status(run)["loss"])
    _, document = status_both_ways(run)  # json.loads of stdout: Python's NaN would be read back, jq refuses it
    result = run_cli("status", str(run), "--json")
    assert "NaN" not in result.stdout and "Infinity" not in result.stdout
    assert document["loss"] is None and document["heartbeat_age_s"] is None
    assert document["step"] == 3


def test_a_missing_or_unreadable_events_file_reads_as_no_events(tmp_path):
    assert read_events(tmp_path / "absent.jsonl") == []
    (tmp_path / "dir.jsonl").mkdir()
    assert read_events(tmp_path / "dir.jsonl") == []
