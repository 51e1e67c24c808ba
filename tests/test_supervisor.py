"""The supervisor against a real external command (tests/jobs/counter_job.py): crashes, hangs, config
errors, surfaced log lines, restarts exhausted, SIGTERM. Real subprocesses, real signals, no torch."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from prime_train.config.schema import Config
from prime_train.contract import read_json
from prime_train.kit.events import EventLog, read_events
from prime_train.kit.failures import FailureKind
from prime_train.kit.ownership import Housekeeper
from prime_train.resilience.status import run_status
from prime_train.resilience.supervisor import Observer, Supervisor, SupervisorOptions

JOB = Path(__file__).parent / "jobs" / "counter_job.py"


def job_config(tmp_path: Path, *job_args: str, **supervisor) -> Config:
    ckpt = tmp_path / "job-ckpt"
    progress = tmp_path / "job-progress.json"
    sup = {
        "poll_interval_s": 0.2,
        "backoff_initial_s": 0.1,
        "backoff_max_s": 0.2,
        "term_grace_s": 5,
        "stall_timeout_s": 30,
        "startup_timeout_s": 30,
        **supervisor,
    }
    return Config.model_validate(
        {
            "run": {"name": "sup", "output_dir": str(tmp_path / "runs")},
            "job": {
                "command": [sys.executable, str(JOB), "--ckpt-dir", str(ckpt), "--progress", str(progress), *job_args],
                "checkpoint_dir": str(ckpt),
                "progress_file": str(progress),
                "resume_args": ["--resume-step", "{step}"],
            },
            "supervisor": sup,
        }
    )


class Recorder(Observer):
    def __init__(self):
        self.messages: list[str] = []
        self.findings = []
        self.statuses: list[dict] = []
        super().__init__(status=self.statuses.append, finding=self.findings.append, message=self.messages.append)


def supervise(cfg: Config, **options) -> tuple[Supervisor, int, Recorder]:
    rec = Recorder()
    sup = Supervisor(cfg, rec, SupervisorOptions(**options))
    code = sup.run()
    return sup, code, rec


def events_of(sup: Supervisor, name: str) -> list[dict]:
    return [e for e in read_events(sup.run_dir.events_path) if e["event"] == name]


def test_crash_resumes_from_newest_checkpoint_and_finishes(tmp_path):
    cfg = job_config(tmp_path, "--steps", "12", "--interval", "5", "--crash-once-at", "7")
    sup, code, rec = supervise(cfg)
    assert code == 0
    assert len(sup.attempts) == 2
    assert sup.attempts[0].failure.kind is FailureKind.CRASH
    assert "injected crash at step 7" in sup.attempts[0].failure.message
    # the second attempt was started with the resume argument filled in from the newest whole checkpoint
    started = events_of(sup, "process_started")
    assert started[1]["argv"][-2:] == ["--resume-step", "5"]
    assert read_json(Path(cfg.job.progress_file))["step"] == 12
    assert read_json(sup.run_dir.supervisor_path)["state"] == "done"
    assert (sup.run_dir.logs_dir / "latest").resolve() == sup.run_dir.attempt_logs(2).resolve()
    assert any(f.kind == "crash" for f in rec.findings), "the traceback's last line is surfaced"


def test_sigstop_hang_is_found_within_stall_timeout_and_restarted(tmp_path):
    stall = 3.0
    cfg = job_config(tmp_path, "--steps", "30", "--interval", "5", "--step-time", "0.1", stall_timeout_s=stall)
    rec = Recorder()
    sup = Supervisor(cfg, rec, SupervisorOptions())
    stopped_at = {}

    def freeze_once():
        progress = Path(cfg.job.progress_file)
        deadline = time.time() + 60
        while time.time() < deadline:
            hb = read_json(progress)
            if hb and hb.get("step", 0) >= 6 and sup.children:
                os.kill(sup.children[0].pid, signal.SIGSTOP)
                stopped_at["t"] = time.time()
                return
            time.sleep(0.05)

    threading.Thread(target=freeze_once, daemon=True).start()
    code = sup.run()
    assert code == 0
    hang = events_of(sup, "hang_detected")
    assert hang, "the SIGSTOPped job was not reported as a hang"
    assert hang[0]["time"] - stopped_at["t"] <= stall + 5
    assert sup.attempts[0].failure.kind is FailureKind.HANG
    assert sup.attempts[0].failure.step >= 6
    assert len(sup.attempts) == 2


def test_config_error_is_not_retried_and_exits_78(tmp_path):
    cfg = job_config(
        tmp_path,
        "--print-and-exit",
        "configuration error: train.lr must be positive",
        "--exit-code",
        "78",
        max_restarts=5,
    )
    sup, code, _rec = supervise(cfg)
    assert code == 78
    assert len(sup.attempts) == 1
    assert sup.attempts[0].failure.kind is FailureKind.CONFIG_ERROR
    assert "train.lr" in sup.attempts[0].failure.message
    decision = events_of(sup, "decision")[0]
    assert decision["restart"] is False and "not retryable" in decision["reason"]


def test_restarts_exhausted_gives_clear_message_and_nonzero_exit(tmp_path):
    cfg = job_config(tmp_path, "--steps", "10", "--crash-always-at", "2", max_restarts=2)
    sup, code, rec = supervise(cfg)
    assert code == 1
    assert len(sup.attempts) == 3
    assert any("max_restarts (2) exhausted" in m for m in rec.messages)
    assert read_json(sup.run_dir.supervisor_path)["state"] == "failed"


def test_recorded_vllm_fatal_line_is_surfaced_with_hint_and_classified(tmp_path):
    line = (
        "ValueError: To serve at least one request with the models's max seq len (32768), (4.50 GiB KV cache is "
        "needed, which is larger than the available KV cache memory (2.10 GiB). Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
    )
    cfg = job_config(tmp_path, "--print-and-exit", line, "--exit-code", "1", max_restarts=3)
    sup, code, rec = supervise(cfg)
    # a KV cache too small for max_model_len fails the same way every time: a config error, never retried
    assert code == 78
    assert len(sup.attempts) == 1
    assert sup.attempts[0].failure.kind is FailureKind.CONFIG_ERROR
    kv = [f for f in rec.findings if "KV cache" in f.text]
    assert kv, "the vLLM line was not surfaced"
    assert "max_model_len" in kv[0].hint or "gpu_memory_utilization" in kv[0].hint
    assert events_of(sup, "log_finding")
    assert sup.attempts[0].failure.message.startswith("ValueError")


def test_sigterm_to_supervisor_stops_job_with_75_and_leaves_no_process(tmp_path):
    cfg = job_config(tmp_path, "--steps", "100000", "--interval", "1000", "--step-time", "0.05")
    rec = Recorder()
    sup = Supervisor(cfg, rec, SupervisorOptions())

    def stop_when_running():
        deadline = time.time() + 60
        while time.time() < deadline:
            hb = read_json(Path(cfg.job.progress_file))
            if hb and hb.get("step", 0) >= 5:
                sup.request_stop("SIGTERM")
                return
            time.sleep(0.05)

    threading.Thread(target=stop_when_running, daemon=True).start()
    code = sup.run()
    assert code == 75
    hb = read_json(Path(cfg.job.progress_file))
    assert hb["phase"] == "stopped"
    assert (Path(cfg.job.checkpoint_dir) / f"step-{hb['step']}").is_dir()
    assert events_of(sup, "run_stopped")
    pids = [e["pid"] for e in events_of(sup, "process_started")]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("signal_name", ["SIGKILL"])
def test_killed_job_is_classified_and_resumed(tmp_path, signal_name):
    cfg = job_config(tmp_path, "--steps", "40", "--interval", "5", "--step-time", "0.05")
    rec = Recorder()
    sup = Supervisor(cfg, rec, SupervisorOptions())

    def kill_once():
        deadline = time.time() + 60
        while time.time() < deadline:
            hb = read_json(Path(cfg.job.progress_file))
            if hb and hb.get("step", 0) >= 12 and sup.children:
                os.killpg(sup.children[0].pid, getattr(signal, signal_name))
                return
            time.sleep(0.02)

    threading.Thread(target=kill_once, daemon=True).start()
    code = sup.run()
    assert code == 0
    first = sup.attempts[0]
    assert first.failure.kind is FailureKind.CRASH
    assert "SIGKILL" in first.failure.message
    assert sup.attempts[1].resumed_from == 10


def test_supervisor_modules_never_import_torch():
    import subprocess

    code = (
        "import sys\n"
        "import prime_train.resilience.supervisor, prime_train.resilience.console, prime_train.resilience.status\n"
        "import prime_train.kit.gpu, prime_train.validator.preflight, prime_train.launch\n"
        "print(sorted(m for m in ('torch', 'transformers', 'numpy', 'wandb') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_logs_and_status_read_a_supervised_run_and_the_status_line_shows_progress(tmp_path):
    import subprocess

    from prime_train.resilience.console import status_line, summary_table

    cfg = job_config(tmp_path, "--steps", "8", "--interval", "4")
    sup, code, rec = supervise(cfg)
    assert code == 0
    run = str(sup.run_dir.root)
    logs = subprocess.run([sys.executable, "-m", "prime_train", "logs", run, "-p", "job", "-n", "2"],
                          capture_output=True, text=True)  # fmt: skip
    assert logs.returncode == 0 and logs.stdout.splitlines() == ["step 8 loss 0.1250", "done"]
    wrong = subprocess.run([sys.executable, "-m", "prime_train", "logs", run, "-p", "nope"],
                           capture_output=True, text=True)  # fmt: skip
    assert wrong.returncode == 78 and "job" in wrong.stderr
    status = subprocess.run([sys.executable, "-m", "prime_train", "status", run], capture_output=True, text=True)
    assert status.returncode == 0 and "done" in status.stdout
    line = status_line({"attempt": 2, "restarts": 1, "step": 40, "max_steps": 100, "loss": 1.25,
                        "tokens_per_s": 12_500, "eta_s": 75, "disk": 0.5,
                        "gpu": {"mean_utilization_pct": 97, "memory_used_gib": 71.5}})  # fmt: skip
    for part in ("attempt 2", "step 40/100", "loss 1.2500", "12.5k tok/s", "eta 1m15s", "gpu 97% 71.5GiB",
                 "disk 50%", "restarts 1"):  # fmt: skip
        assert part in line, (part, line)
    assert rec.statuses, "the observer received live status updates"
    table = summary_table(sup)
    assert table.row_count == 1


def test_vllm_use_v1_gets_a_warning_not_a_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V1", "0")
    sup, code, rec = supervise(job_config(tmp_path, "--steps", "2"))
    assert code == 0
    warning = events_of(sup, "env_warning")
    assert warning and warning[0]["variable"] == "VLLM_USE_V1"
    assert any("VLLM_USE_V1" in m and "does nothing" in m for m in rec.messages)
    # passed through untouched: prime-train warns, it does not rewrite the user's environment
    assert os.environ["VLLM_USE_V1"] == "0"


def test_a_job_ended_by_the_sigterm_of_a_requested_stop_is_stopped_not_a_crash(tmp_path):
    # `sleep` has no SIGTERM handler, like a trainer still importing torch: the stop's signal ends it
    cfg = Config.model_validate(
        {
            "run": {"name": "stop", "output_dir": str(tmp_path / "runs")},
            "job": {"command": ["sleep", "600"]},
            "supervisor": {"poll_interval_s": 0.2, "term_grace_s": 5},
        }
    )
    rec = Recorder()
    sup = Supervisor(cfg, rec, SupervisorOptions())

    def stop_once_started():
        deadline = time.time() + 30
        while time.time() < deadline and not sup.children:
            time.sleep(0.05)
        sup.request_stop("SIGTERM")

    threading.Thread(target=stop_once_started, daemon=True).start()
    assert sup.run() == 75
    assert not events_of(sup, "failure") and events_of(sup, "run_stopped")
    assert sup.attempts[0].failure is None and sup.state == "stopped"
    assert not any("crash" in m for m in rec.messages)
    assert any("before the attempt's first step: nothing new to checkpoint" in m for m in rec.messages), rec.messages


def test_quiet_run_prints_no_progress_lines_but_keeps_what_went_wrong_and_the_summary(tmp_path):
    from enginetools import run_cli

    from prime_train.config.loader import dump_toml

    outputs = {}
    for name, flags in (("loud", []), ("quiet", ["-q"])):
        cfg = job_config(tmp_path / name, "--steps", "6", "--interval", "2", "--crash-once-at", "4")
        path = tmp_path / f"{name}.toml"
        path.write_text(dump_toml(cfg))
        done = run_cli(*flags, "run", str(path), "--skip-preflight", cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        outputs[name] = done.stdout + done.stderr
    assert "attempt 1 | step" in outputs["loud"], outputs["loud"]  # the plain progress line, when not quiet
    quiet = outputs["quiet"]
    assert "| step" not in quiet, quiet
    assert "injected crash at step 4" in quiet, quiet  # a failure is a problem: -q keeps it
    assert "run sup:" in quiet, quiet  # and the summary table is the result


# ---------------------------------------------------------------- checkpoints in ckpt.dir, outside the run directory


def shared_ckpt_config(tmp_path: Path, shared: Path, *job_args: str, command: bool = True, **supervisor) -> Config:
    """A run whose checkpoints are in `shared` (ckpt.dir, as several nodes need), outside its run directory."""
    progress = tmp_path / "job-progress.json"
    job = [sys.executable, str(JOB), "--ckpt-dir", str(shared), "--progress", str(progress), *job_args]
    return Config.model_validate(
        {
            "run": {"name": "shared", "output_dir": str(tmp_path / "runs")},
            "ckpt": {"dir": str(shared), "keep_last": None},  # keep all: only the disk cap deletes
            "job": {"command": job, "progress_file": str(progress)} if command else {},
            "supervisor": {"poll_interval_s": 0.1, "stall_timeout_s": 30, "startup_timeout_s": 30, **supervisor},
        }
    )


def test_with_ckpt_dir_outside_the_run_the_disk_cap_deletes_the_oldest_checkpoints_there_and_says_so(tmp_path):
    shared = tmp_path / "shared-ckpt"
    # 100 kB checkpoints under a 250 kB cap: about two fit
    cfg = shared_ckpt_config(tmp_path, shared, "--steps", "40", "--interval", "5", "--step-time", "0.1",
                             "--ckpt-bytes", "100000", max_disk_gb=250e-6, disk_high_watermark=1.0)  # fmt: skip
    sup = Supervisor(cfg, Recorder())
    aside = shared / "step-1.corrupt"

    def set_one_aside():  # as a job does with a checkpoint it found damaged: reported, never deleted
        deadline = time.time() + 60
        while time.time() < deadline and (read_json(Path(cfg.job.progress_file)) or {}).get("step", 0) < 3:
            time.sleep(0.05)
        aside.mkdir()
        (aside / "quarantine.json").write_text(json.dumps({"step": 1, "reason": "a shard failed its checksum"}))

    threading.Thread(target=set_one_aside, daemon=True).start()
    assert sup.run() == 0
    deleted = events_of(sup, "checkpoint_deleted")
    assert deleted, "the disk cap watched an empty checkpoints/ in the run directory, not ckpt.dir"
    assert {Path(e["path"]).parent for e in deleted} == {shared}
    assert all(e["reason"] == "watermark" and e["step"] < 40 for e in deleted)
    assert deleted[0]["step"] == 5, "the oldest goes first"
    left = sorted(int(p.name[5:]) for p in shared.glob("step-*") if p.name[5:].isdigit())
    assert left[-1] == 40 and len(left) <= 3, "the newest stays; the cap holds but for the one saved last"
    assert not any(e["step"] in left for e in deleted)
    assert aside.is_dir()
    [quarantined] = events_of(sup, "checkpoint_quarantined")
    assert Path(quarantined["path"]) == aside
    assert run_status(sup.run_dir.root)["checkpoints"] == left


def test_unfinished_saves_are_cleaned_up_in_ckpt_dir_after_an_engine_attempt(tmp_path):
    shared = tmp_path / "shared-ckpt"
    stale = shared / "step-7.tmp"  # a save its writer died in: no live writer names it
    stale.mkdir(parents=True)
    (shared / "step-5").mkdir()
    cfg = shared_ckpt_config(tmp_path, shared, command=False)
    sup = Supervisor(cfg, Recorder())
    sup.run_dir.create()
    events = EventLog(sup.run_dir.events_path)
    Housekeeper(sup.run_dir, events, lambda m: None).after_attempt({}, clean_tmp=True)
    assert not stale.exists() and (shared / "step-5").is_dir()
    assert [e["path"] for e in read_events(sup.run_dir.events_path) if e["event"] == "checkpoint_tmp_removed"] == [
        str(stale)
    ]
    assert "step-5" in sup.plan.disk_statement()
