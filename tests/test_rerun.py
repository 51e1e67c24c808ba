"""`prime-train run` again on a run directory: a finished run is left alone unless asked, --resume trains on from
the newest checkpoint with one metrics row per step, --fresh sets the old run aside (resilience/rerun.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from enginetools import TINY, WIDE, cli, env, run_cli, tiny_overrides

from prime_train.config.schema import Config
from prime_train.contract import read_json
from prime_train.engine.metrics import rewind_metrics
from prime_train.kit.events import read_events
from prime_train.resilience.rerun import RerunRefused, plan_rerun
from prime_train.rundir import RunDir

# checkpoints at step 4 and (ckpt.resumable_final_save, on by default) at the last step, 6
SHORT = {"train.max_steps": 6, "ckpt.interval": 4}


def run_again(tmp_path: Path, *flags: str, **overrides) -> subprocess.CompletedProcess[str]:
    argv = cli("run", str(TINY), *tiny_overrides(tmp_path, "again", **{**SHORT, **overrides}), *flags)
    return subprocess.run(argv, env={**env(), **WIDE}, capture_output=True, text=True, timeout=600)


def steps_recorded(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def attempts_started(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "attempt_started"]


def test_finished_run_is_left_alone_and_resume_trains_on_from_its_checkpoint_with_one_row_per_step(tmp_path):
    run_dir = tmp_path / "again"
    first = run_again(tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    weights = {p.name: p.stat().st_mtime_ns for p in (run_dir / "final").iterdir()}
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()

    # the same command again: says it is finished and where its model is, launches nothing
    again = run_again(tmp_path)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert "is finished (at step 6)" in again.stdout and str(run_dir / "final") in again.stdout
    assert len(attempts_started(run_dir)) == 1
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before
    assert {p.name: p.stat().st_mtime_ns for p in (run_dir / "final").iterdir()} == weights

    # a raised train.max_steps is not trained on unasked either
    raised = run_again(tmp_path, **{"train.max_steps": 8})
    assert raised.returncode == 0 and "--resume trains on" in raised.stdout
    assert len(attempts_started(run_dir)) == 1

    # --resume: from step-6, the checkpoint the end of the run saved (none is trained again), one row per step
    resumed = run_again(tmp_path, "--resume", **{"train.max_steps": 8})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert "resuming from step 6" in resumed.stdout and "trained again" not in resumed.stdout
    assert "6 → 8" in resumed.stdout  # the summary table: this attempt's steps
    started = attempts_started(run_dir)
    assert [(e["attempt"], e["resume_from"]) for e in started] == [(1, 0), (2, 6)]
    assert steps_recorded(run_dir) == list(range(9))
    assert read_json(run_dir / "progress.json")["step"] == 8


def test_fresh_moves_the_old_run_aside_and_starts_from_step_0_in_a_new_attempt(tmp_path):
    # a finished run's directory, as the engine leaves it (its checkpoint is never loaded: it moves first)
    run_dir = tmp_path / "again"
    (run_dir / "checkpoints" / "step-3").mkdir(parents=True)
    (run_dir / "checkpoints" / "step-3" / "shard").write_bytes(b"x" * 1000)
    (run_dir / "final").mkdir()
    (run_dir / "final" / "config.json").write_text("{}")
    old_metrics = "".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(7))
    (run_dir / "metrics.jsonl").write_text(old_metrics)
    (run_dir / "progress.json").write_text(json.dumps({"step": 6, "phase": "done"}))
    (run_dir / "logs" / "attempt-1").mkdir(parents=True)
    (run_dir / "events.jsonl").write_text(json.dumps({"time": 1.0, "event": "run_started"}) + "\n")

    result = run_again(tmp_path, "--fresh", **{"train.max_steps": 4})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    previous = list((run_dir / "previous").iterdir())
    assert len(previous) == 1 and str(previous[0]) in result.stdout
    assert (previous[0] / "checkpoints" / "step-3" / "shard").read_bytes() == b"x" * 1000  # never deleted
    assert (previous[0] / "metrics.jsonl").read_text() == old_metrics
    assert (previous[0] / "final" / "config.json").is_file()
    started = attempts_started(run_dir)
    assert [(e["attempt"], e["resume_from"]) for e in started] == [(2, 0)]  # numbered after the old attempt
    assert "resuming" not in result.stdout
    assert steps_recorded(run_dir) == list(range(5))
    assert any(e["event"] == "run_set_aside" for e in read_events(run_dir / "events.jsonl"))


def test_train_on_a_finished_run_trains_nothing_unless_asked_as_run_does(tmp_path):
    # `prime-train train` (no supervisor) used to train a finished run again from its last checkpoint
    run_dir = tmp_path / "direct"

    def train(*flags: str, **overrides) -> subprocess.CompletedProcess[str]:
        argv = cli("train", str(TINY), *tiny_overrides(tmp_path, "direct", **{**SHORT, **overrides}), *flags)
        return subprocess.run(argv, env={**env(), **WIDE}, capture_output=True, text=True, timeout=600)

    first = train()
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    metrics_before = (run_dir / "metrics.jsonl").read_bytes()
    again = train()
    assert again.returncode == 0 and "is finished (at step 6)" in again.stdout, again.stdout + again.stderr
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics_before
    resumed = train("--resume", **{"train.max_steps": 8})
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-2000:]
    assert "--resume: training on to train.max_steps = 8" in resumed.stdout
    assert steps_recorded(run_dir) == list(range(9))
    fresh = train("--fresh")
    assert fresh.returncode == 0, fresh.stdout[-3000:] + fresh.stderr[-2000:]
    assert steps_recorded(run_dir) == list(range(7)) and list((run_dir / "previous").iterdir())


def test_fresh_and_resume_together_are_refused():
    result = run_cli("run", "--fresh", "--resume")
    assert result.returncode == 78 and "one or the other" in result.stderr


def _config(tmp_path: Path, **sections) -> Config:
    return Config.model_validate({"run": {"name": "r", "output_dir": str(tmp_path)}, **sections})


def test_unfinished_run_resumes_without_being_asked(tmp_path):
    cfg = _config(tmp_path)
    RunDir(cfg.run_dir).create()
    (Path(cfg.run_dir) / "progress.json").write_text(json.dumps({"step": 150, "phase": "stopped"}))
    assert plan_rerun(cfg, fresh=False, resume=False).launch


def test_finished_external_job_is_read_from_the_supervisors_record(tmp_path):
    cfg = _config(tmp_path, job={"command": [sys.executable, "-c", "pass"]})
    RunDir(cfg.run_dir).create()
    (Path(cfg.run_dir) / "supervisor.json").write_text(json.dumps({"state": "done", "step": 42, "final": True}))
    plan = plan_rerun(cfg, fresh=False, resume=False)
    assert not plan.launch and "at step 42" in (plan.message or "")
    assert plan_rerun(cfg, fresh=False, resume=True).launch


def test_resume_of_a_finished_run_without_a_last_checkpoint_says_which_steps_are_trained_again(tmp_path):
    cfg = _config(tmp_path, train={"max_steps": 400})
    RunDir(cfg.run_dir).create()
    (Path(cfg.run_dir) / "progress.json").write_text(json.dumps({"step": 300, "phase": "done"}))
    plan = plan_rerun(cfg, fresh=False, resume=True)
    assert (
        plan.launch and "resumes from step 0: it has no checkpoint, and steps 1-300 are trained again" in plan.message
    )
    (Path(cfg.run_dir) / "checkpoints" / "step-200").mkdir(parents=True)
    (Path(cfg.run_dir) / "checkpoints" / "step-200" / ".metadata").write_bytes(b"")
    plan = plan_rerun(cfg, fresh=False, resume=True)
    assert "from step-200, its newest checkpoint, and steps 201-300 are trained again" in plan.message, plan.message


def test_resume_of_a_run_already_at_max_steps_launches_nothing(tmp_path):
    cfg = _config(tmp_path, train={"max_steps": 300})
    RunDir(cfg.run_dir).create()
    (Path(cfg.run_dir) / "progress.json").write_text(json.dumps({"step": 300, "phase": "done"}))
    plan = plan_rerun(cfg, fresh=False, resume=True)
    assert not plan.launch and "raise --train.max_steps" in (plan.message or "")


def test_fresh_is_refused_while_the_bucket_holds_the_old_checkpoints(tmp_path):
    cfg = _config(tmp_path, ckpt={"remote": "s3://bucket/runs/r"})
    with pytest.raises(RerunRefused, match=r"ckpt\.remote"):
        plan_rerun(cfg, fresh=True, resume=False)


def test_fresh_is_refused_while_ckpt_dir_outside_the_run_holds_the_old_checkpoints(tmp_path):
    """--fresh moves the run directory's outputs; checkpoints that ckpt.dir keeps elsewhere would be resumed from."""
    shared = tmp_path / "shared-ckpts"
    cfg = _config(tmp_path / "runs", ckpt={"dir": str(shared)})
    assert plan_rerun(cfg, fresh=True, resume=False).launch  # nothing there yet: nothing to resume from
    (shared / "step-4").mkdir(parents=True)
    (shared / "step-4" / ".metadata").write_bytes(b"x")
    with pytest.raises(RerunRefused, match=r"ckpt\.dir = .*shared-ckpts.*own ckpt\.dir"):
        plan_rerun(cfg, fresh=True, resume=False)
    inside = _config(tmp_path / "runs", ckpt={"dir": str(tmp_path / "runs" / "r" / "checkpoints")})
    (tmp_path / "runs" / "r" / "checkpoints" / "step-2").mkdir(parents=True)
    assert plan_rerun(inside, fresh=True, resume=False).launch  # the run directory's own: set_aside moves them


def test_rewind_keeps_rows_up_to_the_resumed_step_byte_for_byte(tmp_path):
    run_dir = RunDir(tmp_path)
    rows = [f'{{"step": {s}, "loss": {s / 3}}}\n' for s in range(6)]
    run_dir.metrics_path.write_text("".join(rows) + '{"step": 6, "lo')  # a torn last line
    assert rewind_metrics(run_dir, 3) == 3
    assert run_dir.metrics_path.read_text() == "".join(rows[:4])
    assert rewind_metrics(run_dir, 3) == 0
    # a start from step 0 writes its baseline again: nothing of an earlier run stays
    assert rewind_metrics(run_dir, 0) == 4 and run_dir.metrics_path.read_text() == ""


def test_a_rerun_with_a_changed_config_says_what_differs_and_keeps_the_runs_values_unless_resume(tmp_path):
    # the trial: `run --resume --train.max_steps 340` stopped at 218, then a plain `run` rewrote config.toml to 300
    from prime_train.launch import write_run_config
    from prime_train.resilience.service import Reporter, RunRequest, RunService

    run_cfg = _config(tmp_path, train={"max_steps": 340, "lr": 1e-3})
    write_run_config(run_cfg)
    (Path(run_cfg.run_dir) / "progress.json").write_text(json.dumps({"step": 218, "phase": "stopped"}))
    asked = _config(tmp_path, train={"max_steps": 300, "lr": 1e-3})
    said: list[str] = []
    events = tmp_path / "events.jsonl"

    def serve(**request) -> RunService:
        service = RunService(asked, RunRequest(**request), Reporter(say=said.append))
        service._drift = service._config_drift()
        from prime_train.kit.events import EventLog

        service._say_drift(EventLog(events))
        return service

    plain = serve()
    assert plain.cfg.train.max_steps == 340 and plain.cfg == run_cfg  # the run's own values, whole
    assert "train.max_steps: 340 -> 300" in said[-1] and "Resuming with the run's values" in said[-1], said
    resumed = serve(resume=True)
    assert resumed.cfg.train.max_steps == 300 and "the new values apply: train.max_steps: 340 -> 300" in said[-1]
    recorded = [e for e in read_events(events) if e["event"] == "config_changed"]
    assert [(e["kept_run_values"], e["changes"]) for e in recorded] == [
        (kept, [{"key": "train.max_steps", "old": 340, "new": 300}]) for kept in (True, False)
    ]
    # the same config, or --fresh: nothing to say
    said.clear()
    assert RunService(run_cfg)._config_drift() is None
    assert serve(fresh=True).cfg.train.max_steps == 300 and not said


def test_a_moved_run_directory_resumes_where_it_is_now_with_its_own_values(tmp_path):
    # the trial: a stopped run moved to a bigger disk and resumed there trained from step 0 in its old place
    from prime_train.launch import write_run_config
    from prime_train.resilience.service import Reporter, RunService

    old = _config(tmp_path / "old", train={"max_steps": 340, "lr": 1e-3})
    write_run_config(old)
    (Path(old.run_dir) / "progress.json").write_text(json.dumps({"step": 218, "phase": "stopped"}))
    (tmp_path / "old").rename(tmp_path / "new")
    said: list[str] = []
    moved = _config(tmp_path / "new", train={"max_steps": 340, "lr": 1e-3})
    service = RunService(moved, reporter=Reporter(say=said.append))
    assert service._config_drift() is None and service.cfg.run_dir == moved.run_dir
    # with a changed value too, the run's own values are kept, in the place the directory is now
    asked = _config(tmp_path / "new", train={"max_steps": 300, "lr": 1e-3})
    service = RunService(asked, reporter=Reporter(say=said.append))
    drift = service._config_drift()
    assert drift is not None and drift.kept and [c.key for c in drift.changes] == ["train.max_steps"]
    assert service.cfg.run_dir == asked.run_dir and service.cfg.train.max_steps == 340
    assert not (tmp_path / "old").exists()
