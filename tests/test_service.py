"""The run service behind `prime-train run` and `prime-train train` (resilience/service.py), without the engine:
the environment a `train` child gets, a refused run directory, and a finished run left alone."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prime_train import launch
from prime_train.cli import common
from prime_train.cli.app import app
from prime_train.config.schema import Config
from prime_train.contract import ENV_ATTEMPT, ENV_RUN_DIR, ENV_SUPERVISOR, ExitCode
from prime_train.resilience.service import Reporter, RunRefused, RunRequest, RunService
from prime_train.rundir import RunLock

WIDE = {"COLUMNS": "200"}

# Stands in for the engine's module: writes the environment it was started with where ENV_DUMP says
ENV_DUMP_JOB = "import json, os\nwith open(os.environ['ENV_DUMP'], 'w') as f:\n    json.dump(dict(os.environ), f)\n"


def test_a_train_child_gets_the_environment_a_supervised_attempt_gets(tmp_path, monkeypatch):
    (tmp_path / "envdump_job.py").write_text(ENV_DUMP_JOB)
    monkeypatch.setitem(launch.JOB_MODULES, "sft", "envdump_job")  # `python -m envdump_job --config ...`
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("ENV_DUMP", str(tmp_path / "env.json"))
    monkeypatch.setattr(common, "ENGINE_MODULES", ())  # the stand-in needs no torch
    runs = tmp_path / "runs"
    result = CliRunner().invoke(
        app,
        ["train", "--run.output_dir", str(runs), "--run.name", "t", "--distributed.nproc_per_node", "1"],
        env=WIDE,
    )
    assert result.exit_code == 0, result.output
    seen = json.loads((tmp_path / "env.json").read_text())
    assert seen[ENV_RUN_DIR] == str(runs / "t")
    assert seen[ENV_ATTEMPT] == "1"
    assert seen["PYTHONUNBUFFERED"] == "1"
    assert seen[ENV_SUPERVISOR] == f"{os.getpid()}:" + seen[ENV_SUPERVISOR].split(":", 1)[1]
    assert seen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def _config(tmp_path: Path) -> Config:
    return Config.model_validate({"run": {"name": "r", "output_dir": str(tmp_path / "runs")}})


@pytest.mark.parametrize("command", ["supervise", "train"])
def test_a_run_directory_another_process_owns_is_refused_as_a_config_error(tmp_path, command):
    cfg = _config(tmp_path)
    with (
        RunLock.acquire(cfg.layout, "someone else"),
        pytest.raises(RunRefused, match="is in use by `someone else`") as refused,
    ):
        getattr(RunService(cfg), command)()
    assert refused.value.code == ExitCode.CONFIG


@pytest.mark.parametrize("command", ["supervise", "train"])
def test_a_finished_run_is_said_and_not_run_again(tmp_path, command):
    cfg = _config(tmp_path)
    cfg.layout.create()
    cfg.layout.progress_path.write_text(json.dumps({"step": 6, "phase": "done", "time": 1.0}))
    said: list[str] = []
    outcome = getattr(RunService(cfg, RunRequest(), Reporter(say=said.append)), command)()
    assert outcome.exit_code == ExitCode.OK and not outcome.launched
    assert said == [outcome.message] and "is finished (at step 6)" in said[0]
    assert outcome.to_dict() == {"ok": True, "launched": False, "run_dir": cfg.run_dir, "message": said[0]}
    assert not cfg.layout.config_path.exists()  # nothing ran, nothing written
    RunLock.acquire(cfg.layout, "the next one").release()  # and the run directory was given back
