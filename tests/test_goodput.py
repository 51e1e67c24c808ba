"""Goodput from a run directory's files: a synthetic run with known times gives the exact figures (the real
supervised run with a kill -9 is in tests/test_run.py)."""

from __future__ import annotations

import json

import pytest

from prime_train.resilience.goodput import goodput, goodput_line
from prime_train.rundir import RunDir


def write_lines(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def killed_once(tmp_path) -> RunDir:
    """An earlier session (ignored), then one whose first attempt is killed after its step-10 checkpoint."""
    rd = RunDir(tmp_path)
    write_lines(
        rd.events_path,
        [
            {"time": 10, "event": "run_started"},
            {"time": 11, "event": "attempt_started", "attempt": 1},
            {"time": 50, "event": "run_stopped"},
            {"time": 100, "event": "run_started"},
            {"time": 101, "event": "attempt_started", "attempt": 2},
            {"time": 125, "event": "process_exited", "exit_code": -9},  # kill -9: the attempt's death
            {"time": 126, "event": "attempt_ended"},
            {"time": 126.5, "event": "failure", "kind": "crash"},
            {"time": 127, "event": "attempt_started", "attempt": 3},
            {"time": 146, "event": "process_exited", "exit_code": 0},
            {"time": 146, "event": "attempt_ended"},
            {"time": 150, "event": "run_finished"},
        ],
    )
    rows = [{"step": 0, "time": 20, "evaluation_s": 100.0}]  # the earlier session's: not this session's time
    rows += [{"step": s, "time": 109 + s} for s in range(1, 11)]  # steps 1-10 at 110..119
    rows[1]["first_step_s"] = 3.0  # step 1 began at 107: start-up 7 s, compile 3 s
    rows[5]["evaluation_s"] = 1.0  # an eval at step 5
    rows[6]["save_s"] = 0.5  # the save after step 5 blocked 0.5 s (on step 6's row)
    # steps 11.. of the killed attempt were rewound by the resume; step-10's row at 119: 125 - 119 = 6 s lost
    rows += [{"step": s, "time": 124 + s} for s in range(11, 21)]  # the second attempt: 135..144
    rows[11]["first_step_s"] = 2.0  # its first step began at 133: restart 133 - 125 = 8 s, compile 2 s
    write_lines(rd.metrics_path, rows)
    return rd


def test_goodput_of_a_run_killed_once_names_every_lost_part_exactly(tmp_path):
    figures = goodput(killed_once(tmp_path))
    lost = {"startup": 7.0, "compile": 5.0, "save": 0.5, "eval": 1.0, "restart": 8.0, "lost_steps": 6.0, "end": 6.0}
    assert figures["lost_s"] == lost
    assert figures["wall_s"] == 50.0
    assert figures["productive_s"] == pytest.approx(50.0 - sum(lost.values()))
    assert figures["goodput"] == pytest.approx(16.5 / 50.0)
    assert figures["attempts"] == 2 and not figures["running"]
    line = goodput_line(figures)[0]
    assert line.startswith("goodput 33.0% (16.5s training of 50.0s)")
    assert "restarts 8.0s" in line and "lost steps 6.0s" in line


def test_goodput_of_a_live_run_counts_to_now_and_of_no_session_is_none(tmp_path):
    rd = RunDir(tmp_path)
    assert goodput(rd) is None and goodput_line(None) == []
    write_lines(rd.events_path, [{"time": 100, "event": "run_started"}, {"time": 101, "event": "attempt_started"}])
    write_lines(rd.metrics_path, [{"step": 1, "time": 105, "first_step_s": 1.0}, {"step": 2, "time": 106}])
    figures = goodput(rd, now=110.0)
    assert figures["running"] and figures["wall_s"] == 10.0
    assert figures["lost_s"]["startup"] == 4.0 and figures["lost_s"]["compile"] == 1.0
    assert figures["lost_s"]["end"] == 4.0  # since the newest step: not counted as training while unknown
    assert figures["goodput"] == pytest.approx(0.1)


def test_a_session_that_never_finished_a_step_trained_nothing(tmp_path):
    """A run that fails at start-up (exit 78 before its first step), one still starting, one with no attempt: none
    of their time is training (it was reported as goodput 100 %)."""
    rd = RunDir(tmp_path)
    write_lines(
        rd.events_path,
        [
            {"time": 100, "event": "run_started"},
            {"time": 101, "event": "attempt_started", "attempt": 1},
            {"time": 105, "event": "process_exited", "exit_code": 78},
            {"time": 106, "event": "attempt_ended"},
            {"time": 106, "event": "run_failed"},
        ],
    )
    write_lines(rd.metrics_path, [])
    figures = goodput(rd)
    assert figures["goodput"] == 0.0 and figures["lost_s"]["startup"] == 6.0
    assert goodput_line(figures)[0].startswith("goodput 0.0% (0.0s training of 6.0s)")
    # one crash, then a second attempt still starting: the first is start-up, the wait since its death restart
    write_lines(
        rd.events_path,
        [
            {"time": 100, "event": "run_started"},
            {"time": 101, "event": "attempt_started", "attempt": 1},
            {"time": 104, "event": "process_exited", "exit_code": 1},
            {"time": 105, "event": "attempt_started", "attempt": 2},
        ],
    )
    figures = goodput(rd, now=110.0)
    assert figures["goodput"] == 0.0 and (figures["lost_s"]["startup"], figures["lost_s"]["restart"]) == (4.0, 6.0)
    write_lines(rd.events_path, [{"time": 100, "event": "run_started"}, {"time": 103, "event": "run_failed"}])
    assert goodput(rd)["goodput"] == 0.0
