"""What a run says about itself after the fact: every attempt counts (a failure the run recovered from stays its
story), and a job stopped from outside is a stop, not a crash. Real supervised runs of tiny [job].command scripts
(a second or two each), read back through the real CLI in subprocesses."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from enginetools import run_cli

from prime_train.contract import ExitCode
from prime_train.kit.events import read_events

# attempt 1 reaches step 3, saves step-3 and dies of a (printed) CUDA OOM; attempt 2 saves step-6 and finishes
RECOVERING_JOB = """
    import os, pathlib, sys
    attempt = int(os.environ["PRIME_TRAIN_ATTEMPT"])
    for step in range(1, 4):
        print(f"step {step}", flush=True)
    (pathlib.Path(sys.argv[1]) / f"step-{attempt * 3}").mkdir(parents=True, exist_ok=True)
    if attempt == 1:
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        sys.exit(1)
"""
# a job that gets SIGTERM from something other than the supervisor (a kill, a scheduler) before its first step
SIGTERMED_JOB = """
    import os, signal
    os.kill(os.getpid(), signal.SIGTERM)
"""


def external_run(tmp_path: Path, script: str) -> tuple[Path, Path]:
    """A config for `script` as an external job with a checkpoint directory; (config path, run directory)."""
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(script))
    ckpts = tmp_path / "ckpts"
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        f'[run]\nname = "ext"\noutput_dir = "{tmp_path / "runs"}"\n'
        f'[job]\ncommand = ["{sys.executable}", "{job}", "{ckpts}"]\ncheckpoint_dir = "{ckpts}"\n'
        "progress_regex = 'step (\\d+)'\n"
        "[supervisor]\nbackoff_initial_s = 0.0\npoll_interval_s = 0.2\n"
    )
    return cfg, tmp_path / "runs" / "ext"


def test_after_a_recovered_failure_status_and_diagnose_read_every_attempt(tmp_path):
    cfg, run_dir = external_run(tmp_path, RECOVERING_JOB)
    run = run_cli("run", str(cfg), "--skip-preflight", "--json")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    # the job never said how many steps it takes: its total is unknown, not the engine's default train.max_steps
    assert "step 3/?" in run.stderr and "/300" not in run.stderr, run.stderr[-3000:]
    outcome = json.loads(run.stdout)  # the live view went to stderr: stdout is the outcome alone
    assert outcome["ok"] is True and outcome["state"] == "done"
    assert [(a["attempt"], (a["failure"] or {}).get("kind")) for a in outcome["attempts"]] == [
        (1, "out_of_memory"),
        (2, None),
    ]

    status = run_cli("status", str(run_dir), "--json")
    assert status.returncode == 0, status.stderr
    state = json.loads(status.stdout)
    assert state["state"] == "done" and state["attempt"] == 2
    assert state["last_failure"]["kind"] == "out_of_memory" and state["last_failure"]["attempt"] == 1
    assert state["checkpoints"] == [3, 6], "the job's own checkpoints, in its job.checkpoint_dir"
    assert state["max_steps"] is None

    diagnosed = run_cli("diagnose", str(run_dir))
    assert diagnosed.returncode == ExitCode.FAILED, diagnosed.stdout + diagnosed.stderr
    assert "verdict: out_of_memory, root cause at" in diagnosed.stdout
    assert "attempt-1/job.log:4 (job, attempt 1)" in diagnosed.stdout
    assert "the latest attempt (2) shows no fatal failure" in diagnosed.stdout
    latest = run_cli("diagnose", str(run_dir), "--latest")
    assert latest.returncode == 0 and "nothing known found in 1 log file" in latest.stdout, latest.stdout
    document = json.loads(run_cli("diagnose", str(run_dir), "--json").stdout)
    assert document["verdict"]["kind"] == "out_of_memory"
    assert {f["attempt"] for f in document["files"]} == {1, 2}


def test_a_job_stopped_by_a_sigterm_from_outside_is_a_stop_not_a_crash(tmp_path):
    cfg, run_dir = external_run(tmp_path, SIGTERMED_JOB)
    run = run_cli("run", str(cfg), "--skip-preflight")
    out = run.stdout + run.stderr
    assert run.returncode == ExitCode.PREEMPTED, out[-3000:]
    assert "stopped (SIGTERM sent to job)" in out and "crash" not in out, out[-3000:]
    events = [e["event"] for e in read_events(run_dir / "events.jsonl")]
    assert "failure" not in events and "run_stopped" in events
    assert events.count("attempt_started") == 1, "a stop is not restarted"


def test_ctrl_c_to_run_stops_the_job_and_says_ctrl_c(tmp_path):
    import os
    import signal
    import subprocess
    import time

    from enginetools import WIDE, cli

    cfg, run_dir = external_run(tmp_path, 'import time\nprint("step 1", flush=True)\ntime.sleep(60)\n')
    proc = subprocess.Popen(cli("run", str(cfg), "--skip-preflight"), env={**os.environ, **WIDE},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.time() + 60
        while not any(e["event"] == "process_started" for e in read_events(run_dir / "events.jsonl")):
            assert time.time() < deadline, "the job was never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the supervisor
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.PREEMPTED, out[-3000:]
    assert "stopped (Ctrl-C)" in out and "crash" not in out, out[-3000:]
