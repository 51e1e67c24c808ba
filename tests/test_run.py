"""`prime-train run` with the real engine: fault injection on real processes (CPU, gloo)."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import psutil
import torch
from enginetools import (
    TINY,
    cli,
    env,
    final_weights,
    kill_group,
    metrics,
    run_train,
    start,
    tiny_overrides,
    wait_for,
)

from prime_train.contract import read_json
from prime_train.kit.events import read_events
from prime_train.resilience.goodput import goodput
from prime_train.rundir import RunDir


def trainer_pids(run_dir) -> list[int]:
    return [e["pid"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "process_started"]


def processes_of(run_dir) -> list[psutil.Process]:
    """Every live process whose command line mentions this run directory."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(str(run_dir) in a for a in p.info["cmdline"] or []):
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_kill9_trainer_is_resumed_and_final_weights_equal_an_uninterrupted_run(tmp_path):
    steps = {"train.max_steps": 40, "ckpt.interval": 20}
    straight = run_train(tmp_path, "straight", **steps, **{"data.cache_rows": "false"})
    assert straight.returncode == 0, straight.stdout[-3000:]
    assert not (tmp_path / "straight" / "cache").exists()

    run_dir = tmp_path / "supervised"
    proc = start(
        cli(
            "run",
            str(TINY),
            *tiny_overrides(tmp_path, "supervised", **steps),
            "--supervisor.poll_interval_s",
            "0.5",
            "--supervisor.backoff_initial_s",
            "0.5",
        )
    )
    try:
        wait_for((run_dir / "checkpoints" / "step-20").is_dir, 300, "the step-20 checkpoint")
        first_trainer = trainer_pids(run_dir)[0]
        psutil.Process(first_trainer).kill()  # kill -9 the trainer, not the supervisor
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    events = read_events(run_dir / "events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "crash" and "SIGKILL" in failure["message"]
    restarted = [e for e in events if e["event"] == "attempt_started"]
    assert len(restarted) == 2 and restarted[1]["resume_from"] == 20
    assert read_json(run_dir / "supervisor.json")["state"] == "done"
    assert "crash" in out  # the summary table names the cause
    assert "resuming from step 20" in out
    # the steps after step-20 that the killed attempt recorded were trained again: each is recorded once
    assert [m["step"] for m in metrics(run_dir)] == list(range(41))
    # goodput: the kill cost a restart and the steps after step-20 trained twice; the summary names both
    figures = goodput(RunDir(run_dir))
    assert 0 < figures["goodput"] < 1 and figures["attempts"] == 2
    assert figures["lost_s"]["restart"] > 0 and figures["lost_s"]["lost_steps"] > 0
    assert figures["lost_s"]["startup"] > 0 and figures["lost_s"]["end"] > 0  # the final save and export
    assert "goodput " in out and "restarts " in out and "lost steps " in out
    # the restart read the rows the first attempt tokenized (cache/), and trained to the same weights
    assert "the tokenized rows from" not in (run_dir / "logs" / "attempt-1" / "trainer.log").read_text()
    assert "the tokenized rows from" in (run_dir / "logs" / "attempt-2" / "trainer.log").read_text()
    wa, wb = final_weights(tmp_path / "straight"), final_weights(run_dir)
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_sigterm_to_supervisor_checkpoints_torchrun_job_exits_75_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "term"
    proc = start(
        cli(
            "run",
            str(TINY),
            *tiny_overrides(
                tmp_path,
                "term",
                **{
                    "train.max_steps": 100000,
                    "ckpt.interval": 100000,
                    "distributed.nproc_per_node": 2,
                },
            ),
            "--supervisor.poll_interval_s",
            "0.5",
        )
    )
    try:
        wait_for(lambda: ((read_json(run_dir / "progress.json") or {}).get("step") or 0) >= 3, 300, "step 3")
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=180)
    finally:
        kill_group(proc)
    assert proc.returncode == 75, out[-4000:]
    hb = read_json(run_dir / "progress.json")
    assert hb["phase"] == "stopped" and hb["exit_code"] == 75
    assert (run_dir / "checkpoints" / f"step-{hb['step']}").is_dir()
    names = [e["event"] for e in read_events(run_dir / "events.jsonl")]
    assert "stop_requested" in names and "run_stopped" in names
    assert read_json(run_dir / "supervisor.json")["state"] == "stopped"
    time.sleep(0.5)
    assert processes_of(run_dir) == []
    assert not [p for p in trainer_pids(run_dir) if psutil.pid_exists(p)]


def test_config_error_on_the_command_line_exits_78_naming_the_key_without_launching(tmp_path):
    result = subprocess.run(
        cli("run", str(TINY), "--run.output_dir", str(tmp_path), "--train.lr", "-1"),
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 78
    assert "train.lr" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "tiny-sft" / "events.jsonl").exists()


def test_engine_config_error_is_not_retried(tmp_path):
    run_dir = tmp_path / "bad-model"
    argv = cli(
        "run",
        str(TINY),
        *tiny_overrides(tmp_path, "bad-model", **{"model.path": str(tmp_path / "missing")}),
        "--supervisor.max_restarts",
        "3",
    )
    # preflight stops it first, in seconds, naming the key
    stopped = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=300)
    assert stopped.returncode == 78 and "model.path" in stopped.stdout and "does not exist" in stopped.stdout
    assert not (run_dir / "events.jsonl").exists()
    # past preflight, the engine refuses it once and the supervisor does not retry
    result = subprocess.run([*argv, "--skip-preflight"], env=env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 78, result.stdout[-3000:] + result.stderr[-3000:]
    events = read_events(run_dir / "events.jsonl")
    assert len([e for e in events if e["event"] == "attempt_started"]) == 1
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "config_error" and "model.path" in failure["message"]


def test_status_and_diagnose_read_a_finished_run(tmp_path):
    result = run_train(tmp_path, "done", **{"train.max_steps": 5})
    assert result.returncode == 0
    # `train` has no supervisor: status still reads the heartbeat
    status = subprocess.run(cli("status", str(tmp_path / "done"), "--json"), env=env(), capture_output=True, text=True)
    assert status.returncode == 0
    assert json.loads(status.stdout)["step"] == 5


def test_sigstopped_trainer_is_found_as_a_hang_and_the_run_resumes_to_the_end(tmp_path):
    run_dir = tmp_path / "frozen"
    stall = 6.0
    proc = start(
        cli(
            "run",
            str(TINY),
            *tiny_overrides(tmp_path, "frozen", **{"train.max_steps": 60, "ckpt.interval": 10}),
            "--supervisor.poll_interval_s",
            "0.5",
            "--supervisor.stall_timeout_s",
            str(stall),
            "--supervisor.save_timeout_s",
            str(stall),
            "--supervisor.backoff_initial_s",
            "0.5",
            "--supervisor.term_grace_s",
            "5",
        )
    )
    try:
        wait_for(lambda: ((read_json(run_dir / "progress.json") or {}).get("step") or 0) >= 15, 300, "step 15")
        trainer = trainer_pids(run_dir)[0]
        psutil.Process(trainer).suspend()  # SIGSTOP
        stopped_at = time.time()
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    events = read_events(run_dir / "events.jsonl")
    hang = next(e for e in events if e["event"] == "hang_detected")
    assert hang["time"] - stopped_at <= stall + 5
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "hang" and failure["step"] >= 15
    assert not psutil.pid_exists(trainer) or psutil.Process(trainer).status() == psutil.STATUS_ZOMBIE
    assert read_json(run_dir / "progress.json")["step"] == 60


OOM_ON_RANK_1 = """
import os

if os.environ.get("RANK") == "1":
    # the job runs as __main__, so its classes cannot be patched by name: the checkpointer's per-step poll is
    from prime_train.engine.checkpoint import Checkpointer

    calls = {"n": 0}
    real_poll = Checkpointer.poll

    def poll(self):
        calls["n"] += 1
        if calls["n"] == 3:
            import torch

            # the wording torch uses for a CUDA OOM (GPU 1 of an 80 GB card)
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.10 GiB of which "
                "1.02 GiB is free. Including non-PyTorch memory, this process has 78.07 GiB memory in use."
            )
        return real_poll(self)

    Checkpointer.poll = poll
"""


def test_another_ranks_oom_is_found_in_its_torchrun_log_and_classified(tmp_path):
    # rank 1's traceback goes only to torchrun's --log-dir; rank 0's console shows a ChildFailedError at best
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(OOM_ON_RANK_1)
    args = tiny_overrides(tmp_path, "oom", **{
        "train.max_steps": 50, "distributed.nproc_per_node": 2, "supervisor.max_restarts": 0,
        "supervisor.poll_interval_s": 0.5,
    })  # fmt: skip
    result = subprocess.run(
        cli("run", str(TINY), *args), env={**env(), "PYTHONPATH": str(inject)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout[-4000:] + result.stderr[-2000:]
    events = read_events(tmp_path / "oom" / "events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "out_of_memory", failure
    assert any(e["event"] == "log_finding" and e.get("process") == "trainer-rank1" for e in events)
