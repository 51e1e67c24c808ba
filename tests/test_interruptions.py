"""Clocks, interruptions and messages (issue 26): a job's clock hours off is no hang, a `run --fresh` killed part
way is finished by the next start, two quick Ctrl-C leave a truthful record and a documented exit code, a rollout
worker's taken port fails in seconds as a configuration error that preflight and diagnose name, and `init` where it
cannot write says so. Real processes and real signals throughout; no torch in this process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
from enginetools import TINY, WIDE, cli, env, run_cli, tiny_overrides

from prime_train.config.schema import Config
from prime_train.contract import ExitCode, read_json
from prime_train.kit.events import read_events
from prime_train.resilience.logscan import LogScanner
from prime_train.resilience.rerun import SET_ASIDE_JOURNAL, finish_set_aside, plan_rerun
from prime_train.resilience.supervisor import Observer, Supervisor
from prime_train.rl.workers import never_starts
from prime_train.rundir import RunDir
from prime_train.validator.checks import FAIL, PASS
from prime_train.validator.preflight import check_ports


def write_job(tmp_path: Path, script: str) -> Path:
    job = tmp_path / "job.py"
    job.write_text(textwrap.dedent(script))
    return job


# ---------------------------------------------------------------- a job whose clock is hours off

# steps 1..15, 0.5 s apart, each heartbeat stamped 9 hours in the past (a job that writes local time as UTC)
SKEWED_CLOCK_JOB = """
    import json, os, sys, time
    progress = sys.argv[1]
    for step in range(1, 16):
        time.sleep(0.5)
        with open(progress + ".tmp", "w") as f:
            json.dump({"step": step, "phase": "step", "time": time.time() - 9 * 3600}, f)
        os.replace(progress + ".tmp", progress)
        print(f"step {step}", flush=True)
"""


def test_an_external_job_whose_heartbeat_clock_is_9_hours_behind_is_progress_not_a_hang(tmp_path):
    progress = tmp_path / "progress.json"
    job = write_job(tmp_path, SKEWED_CLOCK_JOB)
    cfg = Config.model_validate({
        "run": {"name": "skewed", "output_dir": str(tmp_path / "runs")},
        "job": {"command": [sys.executable, str(job), str(progress)], "progress_file": str(progress)},
        # the whole job takes 7.5 s: past both allowances, so only its changing steps keep it alive
        "supervisor": {"poll_interval_s": 0.2, "startup_timeout_s": 3, "stall_timeout_s": 2, "max_restarts": 0},
    })  # fmt: skip
    sup = Supervisor(cfg, Observer())
    code = sup.run()
    events = read_events(sup.run_dir.events_path)
    assert [e for e in events if e["event"] == "hang_detected"] == []
    assert code == ExitCode.OK and sup.state == "done"
    assert sup.attempts[-1].last_step == 15 and len(sup.attempts) == 1


# ---------------------------------------------------------------- kill -9 in the middle of `run --fresh`

SHORT = {"train.max_steps": 4, "ckpt.interval": 3}


def finished_engine_run(run_dir: Path) -> str:
    """A finished run's directory as the engine leaves it; returns its metrics text."""
    (run_dir / "checkpoints" / "step-3").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-3" / "shard").write_bytes(b"x" * 1000)
    (run_dir / "final").mkdir()
    (run_dir / "final" / "config.json").write_text("{}")
    metrics = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(7))
    (run_dir / "metrics.jsonl").write_text(metrics)
    (run_dir / "progress.json").write_text(json.dumps({"step": 6, "phase": "done"}))
    (run_dir / "logs" / "attempt-1").mkdir(parents=True)
    (run_dir / "events.jsonl").write_text(json.dumps({"time": 1.0, "event": "run_started"}) + "\n")
    return metrics


# `prime-train run --fresh` itself, SIGKILLed by its third rename: two of the old outputs moved, the rest not
KILLED_FRESH = """
import os, signal, sys
renames = []
real = os.rename
def rename(src, dst):
    renames.append(src)
    if len(renames) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst)
os.rename = rename
from prime_train.cli.app import main
sys.argv = ["prime-train", *sys.argv[1:]]
main()
"""


def test_a_fresh_start_killed_part_way_is_finished_by_the_next_run_which_starts_over(tmp_path):
    run_dir = tmp_path / "again"
    old_metrics = finished_engine_run(run_dir)
    args = [str(TINY), *tiny_overrides(tmp_path, "again", **SHORT)]
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_FRESH, "run", *args, "--fresh", "--skip-preflight"],
        env={**env(), **WIDE}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    # the intent was on record before the first rename, in events.jsonl and in the journal
    started = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "run_set_aside_started"]
    assert len(started) == 1 and (run_dir / SET_ASIDE_JOURNAL).is_file()
    assert not (run_dir / "progress.json").exists(), "the heartbeat moves first: a half-moved run is never finished"

    # the same command without --fresh: the move is finished, then the run starts over from step 0
    again = subprocess.run(cli("run", *args), env={**env(), **WIDE}, capture_output=True, text=True, timeout=600)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-4000:]
    assert "is finished" not in out and "interrupted" in out, out[-4000:]
    [previous] = list((run_dir / "previous").iterdir())
    assert previous == Path(started[0]["moving_to"])
    assert (previous / "checkpoints" / "step-3" / "shard").read_bytes() == b"x" * 1000
    assert (previous / "final" / "config.json").is_file()
    assert (previous / "metrics.jsonl").read_text() == old_metrics
    assert json.loads((previous / "progress.json").read_text())["phase"] == "done"
    assert not (run_dir / SET_ASIDE_JOURNAL).exists()
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]
    assert read_json(run_dir / "progress.json")["phase"] == "done" and (run_dir / "final" / "config.json").is_file()
    events = read_events(run_dir / "events.jsonl")
    assert any(e["event"] == "run_set_aside" and e.get("finished_after_interruption") for e in events)
    assert [e["resume_from"] for e in events if e["event"] == "attempt_started"] == [0]


def test_a_half_moved_run_is_never_finished_and_its_journal_is_checked(tmp_path):
    cfg = Config.model_validate({"run": {"name": "r", "output_dir": str(tmp_path)}})
    run_dir = RunDir(cfg.run_dir)
    finished_engine_run(run_dir.root)
    (run_dir.root / "previous" / "T").mkdir(parents=True)
    os.rename(run_dir.root / "checkpoints", run_dir.root / "previous" / "T" / "checkpoints")
    journal = run_dir.root / SET_ASIDE_JOURNAL
    journal.write_text(json.dumps({"dest": "T", "moving": ["progress.json", "checkpoints", "final"]}))
    # even before the move is finished, the heartbeat's "done" does not make the directory a finished run
    assert plan_rerun(cfg, fresh=False, resume=False).launch
    assert finish_set_aside(run_dir) == (run_dir.root / "previous" / "T", ["progress.json", "checkpoints", "final"])
    moved = sorted(p.name for p in (run_dir.root / "previous" / "T").iterdir())
    assert moved == ["checkpoints", "final", "progress.json"]
    assert (run_dir.root / "metrics.jsonl").exists(), "what the journal did not name stays"
    assert not journal.exists() and finish_set_aside(run_dir) is None
    # a journal naming a place outside previous/ or something that is not an old output moves nothing
    for bad in ({"dest": "../../etc", "moving": ["checkpoints"]}, {"dest": "T2", "moving": ["events.jsonl"]}):
        journal.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="journal"):
            finish_set_aside(run_dir)
    assert (run_dir.root / "events.jsonl").exists()


# ---------------------------------------------------------------- two quick Ctrl-C

# a job that ignores SIGTERM (it would never checkpoint and stop): only a second Ctrl-C ends the wait for it
STUBBORN_JOB = """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *a: print("ignoring SIGTERM", flush=True))
    step = 0
    while True:
        step += 1
        print(f"step {step}", flush=True)
        time.sleep(0.2)
"""


def test_two_quick_ctrl_c_kill_the_job_now_and_leave_a_stopped_run_with_exit_75(tmp_path):
    job = write_job(tmp_path, STUBBORN_JOB)
    cfg = tmp_path / "job.toml"
    cfg.write_text(
        f'[run]\nname = "ctrlc"\noutput_dir = "{tmp_path / "runs"}"\n'
        f'[job]\ncommand = ["{sys.executable}", "{job}"]\nprogress_regex = \'step (\\d+)\'\n'
        "[supervisor]\npoll_interval_s = 0.2\nterm_grace_s = 20\n"
    )
    run_dir = tmp_path / "runs" / "ctrlc"
    proc = subprocess.Popen(cli("run", str(cfg), "--skip-preflight"), env={**os.environ, **WIDE},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.time() + 60
        while (read_json(run_dir / "supervisor.json") or {}).get("state") != "running":
            assert time.time() < deadline and proc.poll() is None, "the job was never started"
            time.sleep(0.2)
        [started] = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "process_started"]
        # the job ignores SIGTERM once it prints its first step; on a loaded machine Python's start-up can take
        # longer than the supervisor's, and a SIGTERM before the handler ends the job at once (no second press)
        log = run_dir / "logs" / "attempt-1" / "job.log"
        while not (log.is_file() and "step 1" in log.read_text()):
            assert time.time() < deadline and proc.poll() is None, "the job never printed its first step"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.7)  # a person's second press; two signals at once would be delivered as one
        pressed = time.time()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        waited = time.time() - pressed
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.PREEMPTED, out[-3000:]
    assert int(proc.returncode) in (0, 1, 75, 78), "only the exit codes README documents"
    assert waited < 10, f"the second Ctrl-C waited {waited:.0f}s (term_grace_s is 20)"
    assert "Traceback" not in out and "second Ctrl-C" in out, out[-3000:]
    state = read_json(run_dir / "supervisor.json")
    assert state["state"] == "stopped" and state["final"] is True, state
    assert not psutil.pid_exists(started["pid"]) or psutil.Process(started["pid"]).status() == psutil.STATUS_ZOMBIE
    events = [e["event"] for e in read_events(run_dir / "events.jsonl")]
    assert "stop_forced" in events and "run_stopped" in events and "failure" not in events
    status = run_cli("status", str(run_dir), "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["state"] == "stopped", status.stdout + status.stderr


# ---------------------------------------------------------------- a rollout worker's port held by another process


def held_port() -> socket.socket:
    """A socket listening on 127.0.0.1, as another tenant's server would."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def rl_config(tmp_path: Path, base_port: int, workers: int = 1) -> Config:
    return Config.model_validate({
        "run": {"name": "rl", "output_dir": str(tmp_path / "runs"), "job": "rl"},
        "inference": {"host": "127.0.0.1", "base_port": base_port, "num_workers": workers},
    })  # fmt: skip


def test_preflight_names_the_process_that_holds_a_port_a_rollout_worker_binds(tmp_path):
    with held_port() as held:
        port = held.getsockname()[1]
        started = time.monotonic()
        result = check_ports(rl_config(tmp_path, port - 1, workers=2))  # worker 1 listens on base_port + 1
        assert time.monotonic() - started < 5
        assert result.status == FAIL, result.message
        assert f"port {port} (inference.base_port + 1) is in use" in result.message
        assert f"held by pid {os.getpid()}" in result.message
        assert "inference.base_port" in result.fix
    assert check_ports(rl_config(tmp_path, port - 1, workers=2)).status == PASS


def test_a_rollout_worker_that_cannot_bind_exits_78_naming_the_holder_and_diagnose_knows_it(tmp_path):
    with held_port() as held:
        port = held.getsockname()[1]
        config = tmp_path / "config.toml"
        config.write_text(
            f'[run]\nname = "rl"\njob = "rl"\noutput_dir = "{tmp_path / "runs"}"\n'
            f'[inference]\nhost = "127.0.0.1"\nbase_port = {port}\n'
        )
        started = time.monotonic()
        worker = subprocess.run(
            [sys.executable, "-m", "prime_train.rl.worker", "--config", str(config), "--index", "0"],
            env=env(), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        took = time.monotonic() - started
    out = worker.stdout + worker.stderr
    assert worker.returncode == ExitCode.CONFIG, out[-3000:]
    assert f"127.0.0.1:{port}: address already in use, held by pid {os.getpid()}" in out, out[-3000:]
    assert took < 60
    log = tmp_path / "inference-0.log"
    log.write_text(out)
    # the supervisor's reading: a worker that can never start, not restarted, with the line that says why
    scanner = LogScanner("inference-0", str(log))
    findings = [f for n, line in enumerate(out.splitlines(), 1) for f in scanner.feed(line, n)] + scanner.finish()
    tail = [line for line in out.splitlines() if line.strip()][-10:]
    cause = never_starts("inference-0", worker.returncode, findings, None, tail)
    assert cause is not None and "address already in use" in cause and str(port) in cause
    # and diagnose, later, finds it in the log
    diagnosed = run_cli("diagnose", str(log), "--json")
    assert "address_in_use" in diagnosed.stdout, diagnosed.stdout[-3000:] + diagnosed.stderr[-2000:]


def test_a_vllm_worker_that_dies_of_a_taken_port_before_it_served_is_not_restarted():
    from prime_train.resilience.logscan import Finding

    line = "OSError: [Errno 98] Address already in use"
    found = [Finding(None, 9, "inference-0", "address_in_use", "crash", "fatal", line, "hint")]

    class Health:
        def __init__(self, seen: set[str]):
            self.seen_healthy = seen

    assert never_starts("inference-0", 1, found, Health(set()), [line]) == line
    # one that served before and then died is restarted as ever
    assert never_starts("inference-0", 1, found, Health({"inference-0"}), [line]) is None


# ---------------------------------------------------------------- init where it cannot write

needs_proc = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc (unwritable even to root)")


def init(cwd: Path | str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prime_train", "init", "--yes", *args],
        cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env={**os.environ, **WIDE},
    )  # fmt: skip


@needs_proc
def test_init_in_a_directory_it_cannot_write_says_so_with_the_os_error_and_exits_78():
    result = init("/proc")
    assert result.returncode == ExitCode.CONFIG, result.stdout + result.stderr
    assert "cannot write the config to prime-train.toml in /proc" in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "error: prime-train.toml: No such file or directory"
    assert "a bug" not in result.stderr + result.stdout and "Traceback" not in result.stderr


def test_init_to_a_path_under_a_file_says_it_cannot_write_there(tmp_path):
    (tmp_path / "a-file").write_text("")
    target = tmp_path / "a-file" / "run.toml"
    result = init(tmp_path, "-o", str(target))
    assert result.returncode == ExitCode.CONFIG, result.stdout + result.stderr
    assert f"cannot write the config to {target} in {tmp_path / 'a-file'}" in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: {target}: Not a directory"
    assert "[run]" not in result.stdout, "nothing is asked or shown before it is known that it cannot be saved"


@needs_proc
def test_init_from_an_unwritable_directory_saves_elsewhere_and_warns_about_the_run_directory(tmp_path):
    result = init("/proc", "-o", str(tmp_path / "run.toml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "run.toml").is_file()
    assert "warning: run.output_dir cannot be written" in result.stderr and "a bug" not in result.stderr
