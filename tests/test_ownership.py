"""One owner per run directory (issue 14.1), with real processes: two `prime-train run` into one directory,
`prime-train train` beside a run, kill -9 of a supervisor with its job running, a recycled pid in the record,
and the trainer's lifeline to its supervisor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from enginetools import TINY, cli, env, kill_group, start, tiny_overrides, wait_for

from prime_train.config.loader import dump_toml
from prime_train.config.schema import Config
from prime_train.contract import read_json
from prime_train.kit.events import read_events
from prime_train.rundir import RunDir

JOB = Path(__file__).parent / "jobs" / "counter_job.py"


# Runs the counter job with its output in a file of its own, as a job whose output does not go through its
# supervisor (a server logging elsewhere, a hung trainer): one that prints to the supervisor's pipe dies of
# the broken pipe once the supervisor is gone, and is no orphan to find.
OWN_LOG = (
    "import os, sys\n"
    "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
    "os.dup2(fd, 1)\n"
    "os.dup2(fd, 2)\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)


def command_config(tmp_path: Path, name: str, *job_args: str) -> Path:
    """A `prime-train run` config file for tests/jobs/counter_job.py (which knows nothing of its supervisor)."""
    ckpt, progress = tmp_path / f"{name}-ckpt", tmp_path / f"{name}-progress.json"
    job = [str(JOB), "--ckpt-dir", str(ckpt), "--progress", str(progress), *job_args]
    cfg = Config.model_validate(
        {
            "run": {"name": name, "output_dir": str(tmp_path / "runs")},
            "job": {
                "command": [sys.executable, "-c", OWN_LOG, str(tmp_path / f"{name}-job.log"), *job],
                "checkpoint_dir": str(ckpt),
                "progress_file": str(progress),
                "resume_args": ["--resume-step", "{step}"],
            },
            "supervisor": {"poll_interval_s": 0.2, "term_grace_s": 5, "backoff_initial_s": 0.1, "backoff_max_s": 0.2},
        }
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(dump_toml(cfg))
    return path


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def started_pids(run_dir: Path) -> list[int]:
    return [e["pid"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "process_started"]


def test_the_run_lock_names_its_holder_and_the_kernel_releases_it_when_the_holder_is_killed(tmp_path):
    from prime_train.rundir import RunDirBusy, RunLock

    run_dir = RunDir(tmp_path / "run")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom prime_train.rundir import RunDir, RunLock\n"
         f"RunLock.acquire(RunDir({str(run_dir.root)!r}), 'prime-train run')\nprint('held', flush=True)\n"
         "time.sleep(600)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirBusy) as busy:
            RunLock.acquire(run_dir, "prime-train train")
        message = str(busy.value)
        assert f"pid {holder.pid}" in message and "`prime-train run`" in message and "since" in message
        assert os.uname().nodename in message
        holder.kill()  # kill -9: no cleanup of its own runs
        holder.wait()
        with RunLock.acquire(run_dir, "prime-train run") as lock:
            assert lock.held
            assert read_json(run_dir.lock_path)["pid"] == os.getpid()
    finally:
        holder.kill()


def test_a_second_run_or_train_into_a_live_run_directory_exits_78_naming_the_holder(tmp_path):
    first = start(cli("run", str(command_config(tmp_path, "one", "--steps", "100000", "--step-time", "0.05"))))
    run_dir = tmp_path / "runs" / "one"
    try:
        wait_for(lambda: (read_json(tmp_path / "one-progress.json") or {}).get("step", 0) >= 3, 60, "step 3")
        second = subprocess.run(
            cli("run", str(command_config(tmp_path, "one", "--steps", "5"))),
            capture_output=True, text=True, timeout=60, env=env(),
        )  # fmt: skip
        assert second.returncode == 78, second.stdout + second.stderr
        assert f"pid {first.pid}" in second.stderr and "in use by `prime-train run`" in second.stderr
        assert "Traceback" not in second.stderr
        train = subprocess.run(
            cli("train", str(TINY), "--run.output_dir", str(tmp_path / "runs"), "--run.name", "one"),
            capture_output=True, text=True, timeout=60, env=env(),
        )  # fmt: skip
        assert train.returncode == 78 and f"pid {first.pid}" in train.stderr, train.stdout + train.stderr
        # neither started anything: one run, one job process, in the run's own records
        events = read_events(run_dir / "events.jsonl")
        assert [e["event"] for e in events].count("run_started") == 1
        assert len(started_pids(run_dir)) == 1
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=60)
        assert first.returncode == 75, out[-3000:]
    finally:
        kill_group(first)


def test_a_new_supervisor_ends_the_orphaned_job_of_its_run_dir_before_launching(tmp_path):
    config = command_config(tmp_path, "orphan", "--steps", "100000", "--step-time", "0.05", "--interval", "20")
    first = start(cli("run", str(config)))
    run_dir = tmp_path / "runs" / "orphan"
    try:
        wait_for(lambda: (read_json(tmp_path / "orphan-progress.json") or {}).get("step", 0) >= 25, 60, "step 25")
        [job_pid] = started_pids(run_dir)
        os.kill(first.pid, signal.SIGKILL)  # the supervisor dies; the counter job knows nothing of it
        first.wait()
        time.sleep(1.0)
        assert alive(job_pid), "the external job should be an orphan now"
        second = subprocess.run(cli("run", str(command_config(tmp_path, "orphan", "--steps", "30"))),
                                capture_output=True, text=True, timeout=120, env=env())  # fmt: skip
    finally:
        kill_group(first)
        if alive(job_pid):
            os.kill(job_pid, signal.SIGKILL)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert not alive(job_pid)
    events = read_events(run_dir / "events.jsonl")
    names = [e["event"] for e in events]
    ended = [e for e in events if e["event"] == "orphan_ended"]
    assert [e["pid"] for e in ended] == [job_pid] and ended[0]["name"] == "job" and not ended[0]["killed"]
    # ended before the new job was launched: it checkpointed on SIGTERM, and the new job resumed from that
    assert names.index("orphan_ended") < max(i for i, n in enumerate(names) if n == "process_started")
    assert f"pid {job_pid}" in second.stdout and "left running by a previous supervisor" in second.stdout
    assert read_json(run_dir / "supervisor.json")["state"] == "done"


def test_a_recycled_pid_in_the_process_record_is_never_signalled(tmp_path):
    from prime_train.kit.ownership import end_orphans, record_processes

    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        proc = psutil.Process(bystander.pid)
        record = {"name": "trainer", "pid": bystander.pid, "pgid": bystander.pid}
        # the record names this pid, but a process that started 100 s earlier: the pid was recycled since
        recycled = {**record, "create_time": proc.create_time() - 100}
        run_dir.processes_path.write_text(json.dumps({"processes": [recycled]}))
        assert end_orphans(run_dir, grace_s=2) == []
        assert alive(bystander.pid)
        # the same pid recorded with its own create time is the orphan, and is ended
        assert record_processes(run_dir, {"trainer": [proc]})
        ended = end_orphans(run_dir, grace_s=2)
        assert [e["pid"] for e in ended] == [bystander.pid]
        bystander.wait(timeout=10)
        assert bystander.returncode == -signal.SIGTERM
    finally:
        bystander.kill()


def test_the_lifeline_calls_back_once_its_supervisor_is_gone_and_never_for_a_recycled_pid(monkeypatch):
    from prime_train.contract import ENV_SUPERVISOR
    from prime_train.engine.lifeline import watch_supervisor

    stand_in = subprocess.Popen(["sleep", "600"])  # a real process plays the supervisor
    gone: list[tuple[str, float]] = []
    done = threading.Event()

    def on_gone(reason: str) -> None:
        gone.append((reason, time.monotonic()))
        done.set()

    monkeypatch.setenv(ENV_SUPERVISOR, f"{stand_in.pid}:{psutil.Process(stand_in.pid).create_time()!r}")
    watch_supervisor(on_gone, poll_s=0.1)
    time.sleep(0.5)
    assert not gone, "the supervisor is alive"
    killed = time.monotonic()
    stand_in.kill()
    stand_in.wait()
    assert done.wait(5)
    reason, when = gone[0]
    assert f"pid {stand_in.pid}" in reason and "gone" in reason and when - killed < 2
    # a live process with the supervisor's pid but another start time is not the supervisor
    gone.clear()
    done.clear()
    monkeypatch.setenv(ENV_SUPERVISOR, f"{os.getpid()}:{psutil.Process().create_time() - 50!r}")
    watch_supervisor(on_gone, poll_s=0.1)
    assert done.wait(5) and gone


def test_kill9_of_the_supervisor_stops_its_trainer_with_a_checkpoint_and_a_heartbeat_that_says_why(tmp_path):
    run_dir = tmp_path / "lifeline"
    proc = start(cli("run", str(TINY), *tiny_overrides(tmp_path, "lifeline", **{
        "train.max_steps": 100000, "ckpt.interval": 100000, "data.datasets.0.num_examples": 400,
        "supervisor.poll_interval_s": 0.5})))  # fmt: skip
    try:
        wait_for(lambda: ((read_json(run_dir / "progress.json") or {}).get("step") or 0) >= 2, 300, "step 2")
        [trainer] = started_pids(run_dir)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        killed = time.monotonic()
        wait_for(lambda: not alive(trainer), 120, "the trainer to exit")
        took = time.monotonic() - killed
    finally:
        kill_group(proc)
    hb = read_json(run_dir / "progress.json")
    assert hb["phase"] == "stopped" and hb["exit_code"] == 75, hb
    assert f"supervisor (pid {proc.pid}) is gone" in hb["reason"]
    assert (run_dir / "checkpoints" / f"step-{hb['step']}").is_dir(), "it saved its last step before exiting"
    print(f"trainer exited {took:.1f}s after its supervisor's kill -9")
