"""A plan per job kind (resilience/plan.py): what each kind's attempt runs, where its progress is read, where it
resumes from, and which watchers look after it; built from a config in tmp_path, no process started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prime_train.config.schema import Config
from prime_train.contract import ENV_ATTEMPT, ENV_RUN_DIR, ENV_SUPERVISOR, Event
from prime_train.kit.observe import Note
from prime_train.kit.process import Role
from prime_train.resilience import plan as plan_module
from prime_train.resilience.plan import AttemptContext, CommandPlan, EnginePlan, RLPlan, plan_for
from prime_train.resilience.watchers import (
    DiskWatcher,
    HeartbeatFile,
    LogProgress,
    ProgressWatcher,
    RankLogs,
)
from prime_train.rl.workers import InferenceHealthWatcher


@pytest.fixture(autouse=True)
def no_gpus_no_cloud(monkeypatch):
    """The same machine everywhere: three GPUs named 0-2 where a plan asks, no NVML, no cloud."""
    monkeypatch.setattr(plan_module, "gpu_devices", lambda: ["0", "1", "2"])
    monkeypatch.setattr(plan_module, "gpu_source", lambda attempt=None: None)
    monkeypatch.setattr(plan_module, "detect_cloud", lambda: None)


def config(tmp_path: Path, **sections) -> Config:
    return Config.model_validate({"run": {"name": "p", "output_dir": str(tmp_path / "runs"), **sections.pop("run", {})},
                                  **sections})  # fmt: skip


def command_config(tmp_path: Path, **job) -> Config:
    ckpt = tmp_path / "job-ckpt"
    ckpt.mkdir(exist_ok=True)
    return config(
        tmp_path,
        job={"command": [sys.executable, "train.py"], "checkpoint_dir": str(ckpt), "env": {"MINE": "1"},
             "cwd": str(tmp_path), **job},
    )  # fmt: skip


def context(plan, number: int = 1) -> AttemptContext:
    progress = plan.progress_watcher(plan.progress_source())
    return AttemptContext(number, progress, children=list, step_overdue_s=lambda: 30.0, on_finding=lambda f: None)


def test_the_factory_is_the_one_place_that_reads_the_kind(tmp_path):
    assert type(plan_for(command_config(tmp_path))) is CommandPlan
    assert type(plan_for(config(tmp_path, run={"job": "sft"}))) is EnginePlan
    assert type(plan_for(config(tmp_path, run={"job": "pretrain"}))) is EnginePlan
    assert type(plan_for(config(tmp_path, run={"job": "rl"}))) is RLPlan
    kinds = [plan_for(c).kind for c in (command_config(tmp_path), config(tmp_path, run={"job": "pretrain"}))]
    assert kinds == ["command", "pretrain"]


def test_a_command_runs_as_one_job_process_resumed_through_its_resume_args(tmp_path):
    cfg = command_config(tmp_path, resume_args=["--resume", "{path}", "--step", "{step}"])
    plan = plan_for(cfg)
    assert plan.expected_resume(first=True) == 0 and plan.newest_checkpoint_step() is None
    [spec] = plan.specs(1, first=True, tell=lambda n, line: None)
    assert (spec.name, spec.role, spec.argv, spec.cwd) == ("job", Role.JOB, [sys.executable, "train.py"], str(tmp_path))
    (tmp_path / "job-ckpt" / "step-7").mkdir()
    [spec] = plan.specs(2, first=False, tell=lambda n, line: None)
    assert spec.argv[2:] == ["--resume", str(tmp_path / "job-ckpt" / "step-7"), "--step", "7"]
    assert spec.env["MINE"] == "1" and spec.env[ENV_ATTEMPT] == "2" and spec.env[ENV_RUN_DIR] == str(plan.layout.root)
    assert plan.newest_checkpoint_step() == 7 and plan.expected_resume(first=False) == 7
    assert plan.checkpoints_dir == tmp_path / "job-ckpt"
    assert not plan.backs_up and not plan.cleans_partial_saves and plan.max_steps is None
    # without resume_args the step it resumes from is the command's business
    assert plan_for(command_config(tmp_path)).expected_resume(first=False) is None


def test_a_commands_progress_is_its_file_or_its_output(tmp_path):
    beat = tmp_path / "beat.json"
    beat.write_text('{"step": 3}')
    from_file = plan_for(command_config(tmp_path, progress_file=str(beat))).progress_source()
    assert isinstance(from_file, HeartbeatFile) and from_file.read() == {"step": 3}
    from_output = plan_for(command_config(tmp_path, progress_regex=r"step (\d+)")).progress_source()
    assert isinstance(from_output, LogProgress) and from_output.read() is None
    from_output.feed("trainer", "step 5")  # only the job's own lines count
    assert from_output.read() is None
    from_output.feed("job", "step 5")
    assert from_output.read()["step"] == 5


def test_the_engine_runs_one_trainer_on_its_gpus_and_resumes_later_attempts(tmp_path):
    cfg = config(tmp_path, run={"job": "sft"}, distributed={"nproc_per_node": 2}, ckpt={"resume": "never"})
    plan = plan_for(cfg)
    plan.layout.create()
    assert plan.expected_resume(first=True) == 0
    [trainer] = plan.specs(1, first=True, tell=lambda n, line: None)
    assert (trainer.name, trainer.role) == ("trainer", Role.TRAINER)
    assert trainer.env["CUDA_VISIBLE_DEVICES"] == "0,1" and trainer.env[ENV_SUPERVISOR]
    assert str(plan.layout.config_path) in trainer.argv
    (plan.checkpoints_dir / "step-4").mkdir(parents=True)
    [again] = plan.specs(2, first=False, tell=lambda n, line: None)
    attempt_config = plan.layout.root / "config.attempt-2.toml"
    assert str(attempt_config) in again.argv and 'resume = "auto"' in attempt_config.read_text()
    assert plan.expected_resume(first=False) == 4 and plan.newest_checkpoint_step() == 4
    assert isinstance(plan.progress_source(), HeartbeatFile)
    assert plan.cleans_partial_saves and plan.max_steps == cfg.train.max_steps


def test_a_named_checkpoint_is_known_only_once_loaded_and_ckpt_dir_is_where_checkpoints_are(tmp_path):
    shared = tmp_path / "shared"
    cfg = config(tmp_path, run={"job": "pretrain"}, ckpt={"resume": str(tmp_path / "x" / "step-3"), "dir": str(shared)})
    plan = plan_for(cfg)
    assert plan.expected_resume(first=True) is None
    assert plan.checkpoints_dir == shared == plan.layout.checkpoints_dir


def test_rl_starts_its_workers_first_each_on_its_gpus_and_waits_longer_for_them(tmp_path, monkeypatch):
    cfg = config(tmp_path, run={"job": "rl"}, inference={"num_workers": 2, "gpus_per_worker": 1, "backend": "embedded"})
    plan = plan_for(cfg)
    plan.layout.create()
    told: list[tuple[Note, str]] = []
    specs = plan.specs(1, first=True, tell=lambda n, line: told.append((n, line)))
    assert [(s.name, s.role) for s in specs] == [
        ("inference-0", Role.INFERENCE),
        ("inference-1", Role.INFERENCE),
        ("trainer", Role.TRAINER),
    ]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1", "2"]
    assert all(s.env[ENV_RUN_DIR] == str(plan.layout.root) for s in specs)  # one environment for every child
    assert [n.event for n, _ in told] == [Event.CPU_THREADS]  # the trainer's threads, said; nothing else
    told.clear()
    sup = cfg.supervisor
    assert plan.startup_allowance() == max(
        sup.startup_timeout_s, cfg.inference.startup_timeout_s + 2 * sup.poll_interval_s
    )
    # too few GPUs for inference to have its own: it shares the trainer's, and the plan says so
    monkeypatch.setattr(plan_module, "gpu_devices", lambda: ["0"])
    plan.specs(1, first=True, tell=lambda n, line: told.append((n, line)))
    [(event, line)] = [(n, line) for n, line in told if n.event is not Event.CPU_THREADS]
    assert event.event is Event.GPU_PLAN and line.startswith("note: ")


def test_each_kind_watches_with_its_own_watchers(tmp_path):
    def kinds(cfg):
        plan = plan_for(cfg)
        return [type(w) for w in plan.watchers(context(plan))]

    assert kinds(command_config(tmp_path)) == [ProgressWatcher, DiskWatcher]
    assert kinds(config(tmp_path, run={"job": "sft"})) == [ProgressWatcher, DiskWatcher, RankLogs]
    rl = config(tmp_path, run={"job": "rl"}, inference={"num_workers": 1})
    assert kinds(rl) == [ProgressWatcher, DiskWatcher, InferenceHealthWatcher, RankLogs]
    plan = plan_for(rl)
    plan.watchers(context(plan))
    # a worker that never answered /health and died with a configuration error is not restarted
    assert plan.never_starts("inference-0", 78, [], ["error: old vLLM"]) == "error: old vLLM"
    assert plan_for(command_config(tmp_path)).never_starts("job", 78, [], ["x"]) is None
