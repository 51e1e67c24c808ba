"""Experiment trackers (logging.trackers): MLflow for real across a kill -9 and resume of a supervised run, ClearML
and Neptune in their offline modes, the config keys, and no secret in what they write."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from enginetools import TINY, WIDE, cli, env, kill_group, metrics, start, tiny_overrides, wait_for

from prime_train.config.schema import Config

SECRET = "sk-trackers-0123456789abcdef"


def supervised(tmp_path: Path, name: str, **overrides) -> subprocess.CompletedProcess[str]:
    argv = cli("run", str(TINY), *tiny_overrides(tmp_path, name, **overrides))
    return subprocess.run(argv, env={**env(), **WIDE}, capture_output=True, text=True, timeout=600)


def test_trackers_key_defaults_to_the_older_keys_and_an_explicit_list_is_exactly_what_runs():
    def active(**logging):
        return Config.model_validate({"logging": logging}).logging.active_trackers()

    assert active() == ["tensorboard"]
    assert active(tensorboard=False, wandb_project="p") == ["wandb"]
    assert active(tensorboard=False, wandb_project="p", wandb_mode="disabled") == []
    assert active(trackers=["mlflow", "mlflow", "neptune"]) == ["mlflow", "neptune"]
    with pytest.raises(ValueError, match="wandb_project is unset"):
        active(trackers=["wandb"])
    with pytest.raises(ValueError):
        active(trackers=["comet"])


@pytest.mark.slow
def test_an_mlflow_run_holds_the_metrics_and_config_of_a_supervised_run_across_kill_9_and_resume(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'prime-train[mlflow]')")
    from mlflow.tracking import MlflowClient

    keys = {"logging.trackers": '["mlflow"]', "train.max_steps": 24, "ckpt.interval": 8, "logging.log_interval": 2}
    run_dir = tmp_path / "tracked"
    proc = start(cli("run", str(TINY), *tiny_overrides(tmp_path, "tracked", **keys)), env={**env(), **WIDE})
    try:
        wait_for((run_dir / "checkpoints" / "step-8").is_dir, 300, "the step-8 checkpoint")
        kill_group(proc, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_group(proc, signal.SIGKILL)
    first_id = json.loads((run_dir / "trackers" / "mlflow_id.json").read_text())["id"]
    again = supervised(tmp_path, "tracked", **keys)  # the same command: resumes the unfinished run
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'trackers' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("prime-train")
    runs = client.search_runs([experiment.experiment_id])
    assert [r.info.run_id for r in runs] == [first_id]  # the resume went into the same MLflow run
    run = runs[0]
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params["train.max_steps"] == "24" and run.data.params["logging.trackers"] == "['mlflow']"
    history = client.get_metric_history(first_id, "loss")
    logged = {m.step: m.value for m in history}  # a retrained step logged twice: its newest value is last
    expected = {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}
    assert set(expected) == set(range(1, 25)) and set(logged) == set(expected)
    assert all(abs(logged[s] - expected[s]) < 1e-6 for s in expected)
    assert any(m.step == 0 for m in client.get_metric_history(first_id, "eval_loss"))  # the step-0 baseline
    config = json.loads(Path(client.download_artifacts(first_id, "config.json", str(tmp_path))).read_text())
    assert config["run"]["name"] == "tracked"
    # the artifacts stayed in the run directory, not in the working directory
    assert (run_dir / "trackers" / "mlartifacts").is_dir()


@pytest.mark.slow
def test_clearml_and_neptune_offline_sessions_hold_the_metrics_in_the_run_directory_and_no_secret(tmp_path):
    pytest.importorskip("clearml", reason="clearml is not installed (pip install 'prime-train[clearml]')")
    pytest.importorskip("neptune", reason="neptune is not installed (pip install 'prime-train[neptune]')")
    keys = {
        "logging.trackers": '["clearml", "neptune"]', "logging.clearml_offline": "true",
        "logging.neptune_mode": "offline", "logging.neptune_project": "team/prime", "train.max_steps": 6,
        "logging.log_interval": 1,
    }  # fmt: skip
    home = tmp_path / "home"
    home.mkdir()
    environment = {**env(), **WIDE, "HOME": str(home), "NEPTUNE_API_TOKEN": SECRET, "CLEARML_API_SECRET_KEY": SECRET}
    done = subprocess.run(
        cli("train", str(TINY), *tiny_overrides(tmp_path, "offline", **keys)),
        env=environment, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    trackers = tmp_path / "offline" / "trackers"
    # ClearML: one offline session (a folder and its zip) with the loss of every step
    sessions = [p for p in (trackers / "clearml" / "offline").iterdir() if p.is_dir()]
    assert len(sessions) == 1
    reported = [json.loads(line) for line in (sessions[0] / "metrics.jsonl").read_text().splitlines() if line]
    events = [e for batch in reported for e in (batch if isinstance(batch, list) else [batch])]
    assert {e["iter"] for e in events if e.get("metric") == "loss"} == set(range(1, 7))
    # Neptune: one offline run whose operation log holds the loss series
    runs = list((trackers / "neptune" / "offline").iterdir())
    assert len(runs) == 1
    log = "".join(p.read_text(errors="replace") for p in runs[0].glob("data-*.log"))
    assert "metrics/loss" in log or '"metrics", "loss"' in log
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), f"{path} holds a secret"
    assert SECRET not in done.stdout + done.stderr
