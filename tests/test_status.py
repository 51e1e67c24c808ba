"""`prime-train status` on run directories written wrong: a supervisor.json of the wrong shape, events whose
fields have the wrong types, bytes that are not UTF-8. Each is read through the real CLI in a subprocess; a
file written by an older prime-train, a half-dead disk or another tool must never make status raise."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from enginetools import run_cli

from prime_train.kit.events import read_events
from prime_train.resilience.status import run_status
from prime_train.rundir import RunDir

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


# ---------------------------------------------------------------- every attempt counts; what is not a run


def test_status_of_a_recovered_external_job_keeps_its_failure_checkpoints_and_unknown_total(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    ckpts = tmp_path / "ckpts"
    for name in ("step-4", "step-8", "step-12.tmp", "notes"):
        (ckpts / name).mkdir(parents=True)
    run.config_path.write_text(f'[job]\ncommand = ["python", "train.py"]\ncheckpoint_dir = "{ckpts}"\n')
    # the last attempt succeeded, so supervisor.json has no failure; events.jsonl has attempt 1's
    run.supervisor_path.write_text('{"state": "done", "attempt": 2, "restarts": 1, "last_failure": null}')
    failure = {"event": "failure", "time": 1.0, "attempt": 1, "kind": "out_of_memory", "message": "CUDA OOM"}
    run.events_path.write_text(json.dumps(failure) + "\n")
    run.progress_path.write_text('{"step": 10, "phase": "step", "time": 1.0}')
    _, state = status_both_ways(run.root)
    assert state["last_failure"]["kind"] == "out_of_memory" and state["last_failure"]["attempt"] == 1
    assert state["checkpoints"] == [4, 8]
    assert state["step"] == 10 and state["max_steps"] is None


@pytest.mark.parametrize("what", ["empty", "missing", "parent-of-runs"])
def test_status_of_a_directory_that_holds_no_run_is_bad_input_naming_the_runs_near_it(tmp_path, what):
    runs = tmp_path / "runs"
    RunDir(runs / "tiny-sft").create()
    given = {"empty": runs / "tiny-sf", "missing": runs / "tiny-sf", "parent-of-runs": runs}[what]
    if what == "empty":
        given.mkdir()
    result = invoke("status", str(given))
    assert result.exit_code == 78, result.output
    assert result.stdout == "" and isinstance(result.exception, SystemExit | None)
    assert "a run directory is <output_dir>/<run.name>" in result.stderr
    assert f"did you mean {runs / 'tiny-sft'}?" in result.stderr
    as_json = invoke("status", str(given), "--json")
    assert as_json.exit_code == 78 and json.loads(as_json.stdout)["ok"] is False


def test_status_of_a_name_near_no_run_names_the_runs_that_exist(tmp_path):
    runs = tmp_path / "runs"
    for name in ("tiny-sft", "tiny-rl"):
        RunDir(runs / name).create()
    result = invoke("status", str(runs / "nope"))
    assert result.exit_code == 78, result.output
    assert f"the runs in {runs}: {runs / 'tiny-rl'}, {runs / 'tiny-sft'}" in result.stderr, result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"{empty} holds no runs" in invoke("status", str(empty / "nope")).stderr


def invoke(*args: str):
    """The CLI in-process (fast), on a wide colourless terminal."""
    from enginetools import WIDE
    from typer.testing import CliRunner

    from prime_train.cli import app

    return CliRunner().invoke(app, list(args), env=WIDE)


def _run_with_a_log(tmp_path: Path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.create()
    run.attempt_logs(1).mkdir()
    (run.attempt_logs(1) / "job.log").write_text("step 1\n")
    (run.logs_dir / "latest").symlink_to("attempt-1")
    return run


def test_logs_follow_of_a_finished_run_prints_the_log_and_exits(tmp_path):
    run = _run_with_a_log(tmp_path)
    run.supervisor_path.write_text('{"state": "done", "pid": 1}')  # no .lock holder: nobody owns the run
    result = run_cli("logs", str(run.root), "-f", timeout=20)
    assert result.returncode == 0 and result.stdout == "step 1\n", result.stderr


def test_logs_follow_takes_a_lock_naming_a_reused_pid_for_no_owner(tmp_path):
    import os

    run = _run_with_a_log(tmp_path)
    # a live process (this one), but started long after the lock was taken: the owner is gone, its pid reused
    run.lock_path.write_text(json.dumps({"pid": os.getpid(), "since": 1_000_000.0, "command": "prime-train run"}))
    result = run_cli("logs", str(run.root), "-f", timeout=20)
    assert result.returncode == 0 and result.stdout == "step 1\n", result.stderr


def test_logs_follow_prints_new_lines_until_the_owner_of_the_run_exits(tmp_path):
    import subprocess
    import sys
    import time

    from enginetools import cli

    run = _run_with_a_log(tmp_path)
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    follower = None
    try:
        run.lock_path.write_text(json.dumps({"pid": owner.pid, "since": time.time(), "command": "prime-train run"}))
        follower = subprocess.Popen([*cli("logs", str(run.root), "-f")], stdout=subprocess.PIPE, text=True)
        time.sleep(2)
        with open(run.attempt_logs(1) / "job.log", "a") as log:
            log.write("step 2\n")
        time.sleep(1)
        assert follower.poll() is None, "the owner is alive: logs -f keeps following"
        owner.kill()
        owner.wait()
        out, _ = follower.communicate(timeout=20)
    finally:
        owner.kill()
        if follower is not None and follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0 and out == "step 1\nstep 2\n"


def test_logs_of_a_process_that_has_none_names_the_near_one(tmp_path):
    run = _run_with_a_log(tmp_path)
    result = invoke("logs", str(run.root), "-p", "jbo")
    assert result.exit_code == 78 and "did you mean 'job'?" in result.stderr, result.output


# ---------------------------------------------------------------- tables at 80 columns, piped


NARROW = {"COLUMNS": "80", "NO_COLOR": "1"}


def test_status_piped_at_80_columns_rounds_the_loss_to_4_significant_digits(tmp_path):
    from typer.testing import CliRunner

    from prime_train.cli import app

    run = RunDir(tmp_path / "run")
    run.create()
    run.progress_path.write_text('{"step": 7, "phase": "step", "time": 1.0, "loss": 2.345678912, "max_steps": 10}')
    result = CliRunner().invoke(app, ["status", str(run.root)], env=NARROW)
    assert result.exit_code == 0, result.output
    assert "│ loss            │ 2.346" in result.stdout, result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


def test_diagnose_piped_at_80_columns_wraps_no_header(tmp_path):
    from typer.testing import CliRunner

    from prime_train.cli import app

    log = tmp_path / "trainer.log"
    log.write_text("step 1\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    result = CliRunner().invoke(app, ["diagnose", str(log)], env=NARROW)
    assert result.exit_code == 1, result.output
    header = next(line for line in result.stdout.splitlines() if "where" in line)
    assert "process" in header and "kind" in header, result.stdout
    table = [line for line in result.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert table and max(len(line) for line in table) <= 80


def test_status_shows_the_trainable_share_of_parameters_the_job_logged_at_its_last_start(tmp_path):
    # a LoRA run trains a small fraction; a resumed run logs its counts again, and garbled rows are passed over
    run = make_run(tmp_path, supervisor='{"state": "done"}')
    rows = [
        {"step": 0, "total_params": 660_096, "trainable_params": 94_208, "trainable_fraction": 0.1427},
        {"step": 5, "loss": 1.2},
        {"step": 5, "total_params": 660_096, "trainable_params": 47_104},
        {"step": 6, "total_params": "many", "trainable_params": 3},
    ]
    RunDir(run).metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shown, document = status_both_ways(run)
    assert document["parameters"] == {"trainable": 47_104, "total": 660_096, "fraction": 47_104 / 660_096}
    assert "47,104 of 660,096 parameters (7.14%)" in shown


def test_status_of_a_run_that_logged_no_parameter_counts_says_nothing_of_them(tmp_path):
    shown, document = status_both_ways(make_run(tmp_path, supervisor='{"state": "running"}'))
    assert document["parameters"] is None
    assert "trainable" not in shown


def test_status_of_a_finished_run_shows_its_eval_its_model_and_its_duration_not_a_growing_age(tmp_path):
    run = RunDir(tmp_path / "done")
    run.create()
    run.supervisor_path.write_text(json.dumps({"state": "done", "attempt": 2, "step": 300, "final": True}))
    run.progress_path.write_text(json.dumps({"step": 300, "max_steps": 300, "phase": "done", "time": 1_700_000_090.0}))
    t0 = 1_700_000_000.0
    run.events_path.write_text("".join(json.dumps(e) + "\n" for e in [
        {"time": t0, "event": "attempt_started", "attempt": 1}, {"time": t0 + 50, "event": "attempt_ended"},
        {"time": t0 + 900, "event": "attempt_started", "attempt": 2}, {"time": t0 + 932.5, "event": "attempt_ended"},
    ]))  # fmt: skip
    run.metrics_path.write_text(
        '{"step": 200, "loss": 0.5, "eval_loss": 0.61, "eval_exact_match": 0.75}\n{"step": 250, "loss": 0.4}\n'
        '{"step": 300, "loss": 0.3, "eval_loss": 0.42, "eval_exact_match": 0.97}\n'
    )
    (run.final_dir).mkdir()
    (run.final_dir / "config.json").write_text("{}")
    shown, document = status_both_ways(run.root)
    assert document["heartbeat_age_s"] is None  # a finished run is not late
    assert document["duration_s"] == 82.5  # the two attempts, the pause between them left out
    assert document["eval"] == {"step": 300, "eval_loss": 0.42, "eval_exact_match": 0.97}
    assert document["final_dir"] == str(run.final_dir)
    assert "exact_match 0.97" in shown and "(step 300)" in shown and str(run.final_dir) in shown
    assert "0h01m22s" in shown
