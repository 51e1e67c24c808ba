"""The spot monitor: heartbeats written by the engine's own writer and SkyPilot job states → decisions,
the relaunch policy, and the GitHub Actions workflow that runs it."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from prime_train.config.loader import load_config
from prime_train.config.schema import Config
from prime_train.engine.metrics import MetricsLogger
from prime_train.integrations import monitor as mon
from prime_train.kit.redact import redact
from prime_train.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "training-monitor.yml"
STALL, GRACE, STARTUP = 840.0, 900.0, 2580.0
SECRET = "aws-secret-value-0123456789abcdefXYZ"


def _cfg(**sections) -> Config:
    cfg = Config()
    cfg.logging.tensorboard = False
    cfg.train.max_steps = 100
    for name, values in sections.items():
        for k, v in values.items():
            setattr(getattr(cfg, name), k, v)
    return cfg


def recorded(tmp_path: Path, step: int, phase: str, **fields) -> dict:
    """A heartbeat as the engine writes it (MetricsLogger.heartbeat), read back from progress.json."""
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir(parents=True, exist_ok=True)
    MetricsLogger(run_dir, _cfg(), enabled=True).heartbeat(step, phase=phase, **fields)
    hb = mon.file_heartbeat_reader(str(run_dir.progress_path))()
    assert hb is not None and hb["step"] == step and hb["phase"] == phase and hb["max_steps"] == 100
    return hb


def judge(hb, status, age=None, wandb=None, **kw):
    now = (hb["time"] if hb else 1_000_000.0) + (age or 0.0)
    return mon.decide(hb, status, wandb, now, STALL, GRACE, startup_grace_s=STARTUP, **kw)


def test_a_checkpoint_being_saved_is_not_a_stall(tmp_path):
    saving = recorded(tmp_path, 40, "save")
    d = judge(saving, "RUNNING", age=STALL + 300)
    assert d.state == "healthy" and d.exit_code == 0
    # the same age in a training step is a stall; past the save grace a save is one too
    assert judge(recorded(tmp_path, 40, "step"), "RUNNING", age=STALL + 300).state == "stalled"
    assert judge(saving, "RUNNING", age=STALL + GRACE + 1).state == "stalled"
    assert judge(recorded(tmp_path, 99, "export"), "RUNNING", age=STALL + 300).state == "healthy"


def test_a_heartbeat_from_an_older_prime_train_keeps_its_phase_meaning():
    # a spot job launched before an upgrade still uploads "saving"/"training" (the names before the contract module)
    old_save = {"step": 40, "max_steps": 100, "phase": "saving", "time": 1_000_000.0}
    assert judge(old_save, "RUNNING", age=STALL + 300).state == "healthy"
    assert judge({**old_save, "phase": "training"}, "RUNNING", age=STALL + 300).state == "stalled"


def test_stale_heartbeat_while_skypilot_says_running_is_stalled(tmp_path):
    hb = recorded(tmp_path, 17, "step", tokens=1234)
    fresh = judge(hb, "RUNNING", age=30)
    assert fresh.state == "healthy" and "step 17/100" in fresh.reason
    d = judge(hb, "RUNNING", age=STALL + 60, wandb="running")
    assert d.state == "stalled" and d.exit_code == 3 and d.relaunchable
    assert d.evidence["stalled_for_s"] == pytest.approx(60, abs=1)
    # W&B saying "running" is no heartbeat
    assert "W&B" in d.reason


@pytest.mark.parametrize(
    ("status", "state", "relaunchable"),
    [
        ("FAILED", "dead", True),
        ("FAILED_SETUP", "dead", True),
        ("FAILED_NO_RESOURCE", "dead", True),
        ("FAILED_CONTROLLER", "dead", True),
        ("FAILED_PRECHECKS", "dead", False),
        ("SUCCEEDED", "finished", False),
        ("CANCELLED", "finished", False),
        ("CANCELLING", "finished", False),
        ("RECOVERING", "healthy", False),
        ("PENDING", "healthy", False),
        ("STARTING", "healthy", False),
    ],
)
def test_skypilot_states(tmp_path, status, state, relaunchable):
    # a heartbeat far older than any allowance: only SkyPilot's state can make this healthy
    d = judge(recorded(tmp_path, 5, "step"), status, age=10 * STALL)
    assert (d.state, d.relaunchable) == (state, relaunchable), d
    assert d.exit_code == {"dead": 4, "finished": 0, "healthy": 0}[state]


def test_a_configuration_error_is_dead_but_not_relaunched(tmp_path):
    hb = recorded(tmp_path, 0, "failed", exit_code=78, reason="bad config")
    d = judge(hb, "FAILED", age=5)
    assert d.state == "dead" and not d.relaunchable and "78" in d.reason


def test_no_heartbeat_yet_within_the_startup_grace(tmp_path):
    now = 2_000_000.0
    young = mon.decide(None, "RUNNING", None, now, STALL, GRACE, startup_grace_s=STARTUP, job_started_at=now - 100)
    assert young.state == "healthy" and "no heartbeat yet" in young.reason
    old = mon.decide(None, "RUNNING", None, now, STALL, GRACE, startup_grace_s=STARTUP, job_started_at=now - 5000)
    assert old.state == "stalled" and old.relaunchable
    # the last heartbeat of an earlier job (before SkyPilot recovered this one) is no evidence of a stall
    before = recorded(tmp_path, 80, "stopped", exit_code=75)
    d = mon.decide(before, "RUNNING", None, before["time"] + 200, STALL, GRACE, job_started_at=before["time"] + 100)
    assert d.state == "healthy" and d.evidence["heartbeat_predates_job"] is True


def test_done_finished_unknown_and_no_job(tmp_path):
    assert judge(recorded(tmp_path, 100, "done"), "RUNNING", age=10 * STALL).state == "finished"
    nothing = mon.decide(None, None, None, 1e6, STALL, GRACE)
    assert nothing.state == "unknown" and nothing.exit_code == 2
    # SkyPilot knows no such job and the heartbeat is stale: dead, but never relaunched blindly
    gone = judge(recorded(tmp_path, 9, "step"), None, age=10 * STALL)
    assert gone.state == "dead" and not gone.relaunchable
    # SkyPilot could not be asked: the heartbeat alone decides and nothing is relaunched
    blind = judge(recorded(tmp_path, 9, "step"), None, age=10 * STALL, job_status_error="timeout")
    assert blind.state == "stalled" and not blind.relaunchable
    assert judge(recorded(tmp_path, 9, "step"), None, age=5, job_status_error="timeout").state == "healthy"


def test_clock_skew_and_wrapped_heartbeats(tmp_path):
    hb = recorded(tmp_path, 3, "step")
    ahead = judge(hb, "RUNNING", age=-120)
    assert ahead.state == "healthy" and ahead.evidence["clock_skew_s"] == pytest.approx(120, abs=1)
    wrapped = {"progress": hb, "uploaded_at": hb["time"] + 5}
    stale = mon.decide(wrapped, "RUNNING", None, hb["time"] + STALL + 60, STALL, GRACE)
    assert stale.state == "stalled" and stale.evidence["step"] == 3
    assert mon.normalize_heartbeat(wrapped)["uploaded_at"] == hb["time"] + 5


# ---------------------------------------------------------------- the monitor and its relaunch


class Relaunch:
    def __init__(self, fail: Exception | None = None):
        self.calls: list[mon.Decision] = []
        self.fail = fail

    def __call__(self, decision):
        self.calls.append(decision)
        if self.fail:
            raise self.fail
        return {"job_ids": [7]}


def _monitor(hb, job, *, resume, relaunch, now, **kw):
    return mon.monitor(
        _cfg(),
        resume=resume,
        heartbeat_reader=lambda: hb,
        job_status_reader=lambda: job,
        relaunch=relaunch,
        now=now,
        **kw,
    )


def test_relaunch_once_when_dead_and_resume(tmp_path):
    hb = recorded(tmp_path, 50, "step")
    job = {"status": "FAILED", "start_at": hb["time"] - 600, "recent_failures": 0}
    r = Relaunch()
    result = _monitor(hb, job, resume=True, relaunch=r, now=hb["time"] + 60)
    assert result.action == "relaunched" and len(r.calls) == 1 and r.calls[0].state == "dead"
    assert result.exit_code == 4 and result.to_dict()["job_ids"] == [7]

    for job_state, resume in (("FAILED", False), ("RUNNING", True), ("SUCCEEDED", True), ("FAILED_PRECHECKS", True)):
        r = Relaunch()
        result = _monitor(hb, {"status": job_state}, resume=resume, relaunch=r, now=hb["time"] + 60)
        assert r.calls == [], (job_state, resume)
    assert "--resume" in _monitor(hb, {"status": "FAILED"}, resume=False, relaunch=Relaunch(), now=hb["time"]).action


def test_a_job_that_keeps_dying_is_left_to_a_human(tmp_path):
    hb = recorded(tmp_path, 50, "step")
    r = Relaunch()
    result = _monitor(hb, {"status": "FAILED", "recent_failures": 3}, resume=True, relaunch=r, now=hb["time"])
    assert r.calls == [] and "not relaunched" in result.action and result.exit_code == 4


def test_stalled_is_relaunched_only_past_the_limit(tmp_path):
    hb = recorded(tmp_path, 50, "step")
    stall_after = mon.thresholds(_cfg())["stall_after_s"]
    r = Relaunch()
    briefly = _monitor(hb, {"status": "RUNNING"}, resume=True, relaunch=r, now=hb["time"] + stall_after + 60)
    assert briefly.decision.state == "stalled" and briefly.action == "none" and r.calls == []
    long = _monitor(
        hb,
        {"status": "RUNNING"},
        resume=True,
        relaunch=r,
        now=hb["time"] + stall_after + 60,
        stalled_relaunch_after_s=30,
    )
    assert long.action == "relaunched" and len(r.calls) == 1 and r.calls[0].evidence["job_status"] == "RUNNING"


def test_failing_readers_and_relaunch_are_reported_without_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)

    def broken_bucket():
        raise PermissionError(f"denied: aws_secret_access_key={SECRET}")

    def broken_sky():
        raise TimeoutError("SkyPilot did not answer `status` within 180s")

    result = mon.monitor(
        _cfg(), resume=True, heartbeat_reader=broken_bucket, job_status_reader=broken_sky, now=1e6, relaunch=Relaunch()
    )
    assert result.decision.state == "unknown" and result.exit_code == 2
    assert "PermissionError" in result.decision.evidence["heartbeat_error"]
    assert SECRET not in json.dumps(result.to_dict()) and SECRET not in result.format()

    hb = recorded(tmp_path, 50, "step")
    failing = Relaunch(fail=RuntimeError(f"launch refused, token={SECRET}"))
    result = _monitor(hb, {"status": "FAILED"}, resume=True, relaunch=failing, now=hb["time"])
    assert result.action.startswith("relaunch failed") and SECRET not in result.action and len(failing.calls) == 1


def test_thresholds_leave_the_on_node_supervisor_its_turn():
    cfg = _cfg(supervisor={"stall_timeout_s": 100.0, "save_timeout_s": 50.0}, ckpt={"heartbeat_interval_s": 60.0})
    th = mon.thresholds(cfg)
    assert th["stall_after_s"] > cfg.supervisor.stall_timeout_s + cfg.ckpt.heartbeat_interval_s
    assert th["save_grace_s"] == 50.0
    assert th["startup_grace_s"] > cfg.supervisor.startup_timeout_s


def test_run_monitor_refuses_what_cannot_work(monkeypatch):
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.delenv("SKYPILOT_API_SERVER_ENDPOINT", raising=False)
    with pytest.raises(mon.MonitorConfigError, match="SKYPILOT_API_SERVER_ENDPOINT"):
        mon.run_monitor(_cfg(), config_files=[], overrides=[], resume=True, sky_python=sys.executable)
    monkeypatch.delenv("GITHUB_ACTIONS")
    with pytest.raises(mon.MonitorConfigError, match=r"ckpt\.remote"):
        mon.run_monitor(_cfg(), config_files=[], overrides=[], resume=True, sky_python=sys.executable)
    assert mon.wandb_state_reader(_cfg()) is None


# ---------------------------------------------------------------- the GitHub Actions workflow


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _steps(workflow):
    return [s for job in workflow["jobs"].values() for s in job["steps"]]


def test_workflow_triggers_permissions_and_concurrency(workflow):
    triggers = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` key as true
    assert triggers["schedule"][0]["cron"] == "*/30 * * * *"
    inputs = triggers["workflow_dispatch"]["inputs"]
    assert {"config", "resume"} <= set(inputs) and inputs["resume"]["type"] == "boolean"
    assert workflow["permissions"] == {"contents": "read"}
    for job in workflow["jobs"].values():
        assert "write" not in json.dumps(job.get("permissions", {}))
        assert isinstance(job["timeout-minutes"], int) and job["timeout-minutes"] <= 30
    group = workflow["concurrency"]["group"]
    assert group.startswith("training-monitor-") and "inputs.config" in group
    assert workflow["concurrency"]["cancel-in-progress"] is False


def test_workflow_installs_and_runs_the_monitor_with_resume(workflow):
    runs = [s.get("run", "") for s in _steps(workflow)]
    assert any("prime-train spot install" in r for r in runs)
    monitor_step = next(r for r in runs if "prime-train monitor" in r)
    assert "--resume" in monitor_step
    # untrusted inputs reach scripts only through the environment, never pasted into the script
    assert all("${{" not in r for r in runs)


def test_workflow_secrets_only_from_the_secrets_store(workflow):
    text = WORKFLOW.read_text()
    assert redact(text) == text  # no token-shaped literal anywhere
    env = {k: v for job in workflow["jobs"].values() for k, v in job.get("env", {}).items()}
    for step in _steps(workflow):
        env.update(step.get("env", {}))
    credentials = {
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "WANDB_API_KEY",
        "HF_TOKEN",
        "SKYPILOT_API_SERVER_ENDPOINT",
        "SKYPILOT_SERVICE_ACCOUNT_TOKEN",
    }
    assert credentials <= set(env)
    for name, value in env.items():
        uses_secret = "secrets." in str(value)
        assert uses_secret == (name in credentials), name
        if uses_secret:
            assert re.fullmatch(r"\$\{\{ secrets\.[A-Z_]+ \}\}", value), (name, value)


@pytest.mark.parametrize(("resume", "expected"), [("true", ["--resume"]), ("false", [])])
def test_workflow_monitor_step_passes_resume(workflow, tmp_path, resume, expected):
    script = next(s["run"] for s in _steps(workflow) if "prime-train monitor" in s.get("run", ""))
    record = tmp_path / "argv.json"
    fake = tmp_path / "prime-train"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {"PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "RESUME": resume, "CONFIG": "configs/my run.toml"}
    subprocess.run(["bash", "-e", "-c", script], env=env, check=True, timeout=30)
    assert json.loads(record.read_text()) == ["monitor", "configs/my run.toml", *expected]


def test_monitor_config_loads_from_toml(tmp_path):
    # the monitor reads the same config files the run was launched with
    path = tmp_path / "spot.toml"
    path.write_text('[run]\nname = "m"\n[ckpt]\nremote = "s3://b/p"\nheartbeat_interval_s = 60\n')
    cfg = load_config([str(path)])
    assert mon.thresholds(cfg)["stall_after_s"] == pytest.approx(
        cfg.supervisor.stall_timeout_s + cfg.supervisor.term_grace_s + cfg.supervisor.backoff_max_s + 60
    )
