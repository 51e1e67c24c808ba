"""MetricsLogger: metrics.jsonl, the progress.json heartbeat, TensorBoard events and W&B in offline mode."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from prime_train.config.schema import Config
from prime_train.engine.metrics import MetricsLogger, read_metrics
from prime_train.rundir import RunDir

SECRET = "sk-test-0123456789abcdef0123456789abcdef01234567"  # 40+ characters, like a real W&B key


def make_config(tmp_path: Path, **logging) -> Config:
    return Config.model_validate(
        {
            "run": {"output_dir": str(tmp_path / "runs"), "name": "metrics-test"},
            "train": {"max_steps": 77},
            "logging": {"tensorboard": False, **logging},
        }
    )


def make_run_dir(cfg: Config) -> RunDir:
    run_dir = RunDir(cfg.run_dir)
    run_dir.create()
    return run_dir


def strict_json(text: str):
    """json.loads that refuses the NaN / Infinity literals Python's json would otherwise write and read."""

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


# ---------------------------------------------------------------- metrics.jsonl and progress.json


def test_log_appends_one_record_per_call_with_step_and_null_for_nonfinite(tmp_path):
    cfg = make_config(tmp_path)
    run_dir = make_run_dir(cfg)
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    metrics.log(1, {"loss": 2.5, "lr": 1e-3, "tokens": 4096})
    metrics.log(2, {"loss": float("nan"), "grad_norm": float("inf"), "mfu": float("-inf"), "phase": "x"})
    metrics.close()

    lines = run_dir.metrics_path.read_text().splitlines()
    assert len(lines) == 2
    first, second = (strict_json(line) for line in lines)
    assert {k: first[k] for k in ("step", "loss", "lr", "tokens")} == {
        "step": 1,
        "loss": 2.5,
        "lr": 1e-3,
        "tokens": 4096,
    }
    assert second["step"] == 2 and second["phase"] == "x"
    assert second["loss"] is None and second["grad_norm"] is None and second["mfu"] is None
    assert isinstance(first["time"], float)
    assert read_metrics(run_dir) == [first, second]


@pytest.mark.parametrize(("resume_from", "expected"), [(5, range(1, 9)), (0, range(0, 4))])
def test_a_resumed_job_purges_tensorboards_points_after_its_step(tmp_path, resume_from, expected):
    # attempt 1 logged steps 1-10 and died; attempt 2 resumes from step-5 (or from nothing) and trains again
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config(tmp_path, tensorboard=True)
    run_dir = make_run_dir(cfg)
    first = MetricsLogger(run_dir, cfg, enabled=True)
    first.rewind(0)
    for step in range(1, 11):
        first.log(step, {"loss": 10.0 - step})
    first.close()
    second = MetricsLogger(run_dir, cfg, enabled=True)
    second.rewind(resume_from)
    for step in range(resume_from + 1 if resume_from else 0, max(expected) + 1):
        second.log(step, {"loss": 100.0 + step})
    second.close()

    events = EventAccumulator(str(run_dir.tensorboard_dir))
    events.Reload()
    points = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [step for step, _ in points] == list(expected), points  # each step once, no curve doubling back
    assert all(
        value == (100.0 + step if step > resume_from or not resume_from else 10.0 - step) for step, value in points
    )


def test_read_metrics_skips_a_torn_last_line(tmp_path):
    cfg = make_config(tmp_path)
    run_dir = make_run_dir(cfg)
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    metrics.log(1, {"loss": 1.0})
    with open(run_dir.metrics_path, "a") as f:
        f.write('{"step": 2, "lo')  # a crash in the middle of a write
    assert [r["step"] for r in read_metrics(run_dir)] == [1]


def test_heartbeat_writes_liveness_fields_to_progress_json(tmp_path):
    cfg = make_config(tmp_path)
    run_dir = make_run_dir(cfg)
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    before = time.time()
    metrics.heartbeat(5, phase="eval", tokens=640, loss=float("nan"))
    after = time.time()

    progress = strict_json(run_dir.progress_path.read_text())
    assert progress["step"] == 5
    assert progress["phase"] == "eval"
    assert progress["max_steps"] == 77
    assert progress["pid"] == os.getpid()
    assert before <= progress["time"] <= after
    assert progress["tokens"] == 640 and progress["loss"] is None

    metrics.heartbeat(6)  # rewritten, not appended; phase defaults to step
    progress = strict_json(run_dir.progress_path.read_text())
    assert (progress["step"], progress["phase"]) == (6, "step")
    assert "tokens" not in progress
    # the heartbeat's fields are the contract's: a field the supervisor does not know is a bug here, not a silent key
    with pytest.raises(TypeError):
        metrics.heartbeat(7, bogus=1)


def test_heartbeat_readers_never_see_a_partial_progress_json(tmp_path):
    cfg = make_config(tmp_path)
    run_dir = make_run_dir(cfg)
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    metrics.heartbeat(0)
    # a supervisor-like reader polls while the trainer rewrites; each read must be a whole object
    torn: list[str] = []
    steps_seen: set[int] = set()
    done = threading.Event()

    def read_loop():
        while not done.is_set():
            text = run_dir.progress_path.read_text()
            try:
                steps_seen.add(strict_json(text)["step"])
            except (ValueError, KeyError):
                torn.append(text)

    reader = threading.Thread(target=read_loop)
    reader.start()
    try:
        for step in range(1, 201):
            metrics.heartbeat(step, tokens=step * 1000, reason="x" * 2000)
    finally:
        done.set()
        reader.join()
    assert torn == []
    assert len(steps_seen) > 1  # the reader did overlap the writes
    # no temporary file is left beside it
    assert sorted(p.name for p in run_dir.root.iterdir() if p.is_file()) == ["progress.json"]


# ---------------------------------------------------------------- TensorBoard


def test_tensorboard_events_hold_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = make_config(tmp_path, tensorboard=True)
    run_dir = make_run_dir(cfg)
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    for step, loss in [(1, 3.0), (2, 2.25), (3, 1.5)]:
        metrics.log(step, {"loss": loss, "lr": 0.01 * step, "phase": "training", "flag": True})
    metrics.log_text(3, "samples", "'7+5=' -> '12'")
    metrics.close()

    assert list(run_dir.tensorboard_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(run_dir.tensorboard_dir))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("loss")] == [(1, 3.0), (2, 2.25), (3, 1.5)]
    assert [s.step for s in events.Scalars("lr")] == [1, 2, 3]
    # strings and booleans are not scalars
    assert set(events.Tags()["scalars"]) == {"loss", "lr"}


def test_tensorboard_off_writes_no_event_files(tmp_path):
    cfg = make_config(tmp_path, tensorboard=False)
    run_dir = make_run_dir(cfg)
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    metrics.log(1, {"loss": 1.0})
    metrics.close()
    assert not run_dir.tensorboard_dir.exists()


@pytest.mark.parametrize("wandb_mode", ["offline", "disabled"])
def test_disabled_logger_on_other_ranks_writes_nothing(tmp_path, wandb_mode):
    # W&B configured too: a non-zero rank must not even try to import or start it
    cfg = make_config(tmp_path, tensorboard=True, wandb_project="prime-train-test", wandb_mode=wandb_mode)
    run_dir = make_run_dir(cfg)
    existing = sorted(run_dir.root.rglob("*"))
    metrics = MetricsLogger(run_dir, cfg, enabled=False)
    metrics.log(1, {"loss": 1.0})
    metrics.log_text(1, "samples", "text")
    metrics.heartbeat(1, tokens=10)
    metrics.close()
    assert sorted(run_dir.root.rglob("*")) == existing


def test_wandb_mode_disabled_starts_no_wandb_run(tmp_path):
    cfg = make_config(tmp_path, wandb_project="prime-train-test", wandb_mode="disabled")
    run_dir = make_run_dir(cfg)
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    metrics.log(1, {"loss": 1.0})
    metrics.close()
    assert not (run_dir.root / "wandb").exists()
    assert not (run_dir.root / "wandb_id.json").exists()


def test_metrics_and_heartbeat_never_hold_the_wandb_api_key(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    cfg = make_config(tmp_path, tensorboard=True)
    run_dir = make_run_dir(cfg)
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    metrics.log(1, {"loss": 1.0, "lr": 0.1})
    metrics.log_text(1, "samples", "text")
    metrics.heartbeat(1, phase="step", tokens=10)
    metrics.close()
    written = files_under(run_dir.root)
    assert run_dir.metrics_path in written and run_dir.progress_path in written
    for path in written:
        assert SECRET.encode() not in path.read_bytes(), f"{path} holds the WANDB_API_KEY value"


# ---------------------------------------------------------------- W&B


def wandb_records(path: Path):
    """The protobuf records of a .wandb transaction log (W&B's LevelDB-style log: 32 KiB blocks of chunks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    block, pos, pending = 32768, 7, b""  # 7-byte file header: ':W&B', magic, version
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a chunk header never straddles a block: the tail is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a FULL chunk, or the LAST of FIRST/MIDDLE/LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            out[record.history.step.num] = items
    return out


def wandb_run_id(run_file: Path) -> str:
    return next(r.run.run_id for r in wandb_records(run_file) if r.WhichOneof("record_type") == "run")


def offline_runs(run_dir: RunDir, run_id: str) -> list[Path]:
    """Offline run directories of `run_id`: offline-run-<date>_<time>-<id>, with -1, -2 … when one second has two."""
    pattern = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}(-\d+)?")
    return sorted(p for p in (run_dir.root / "wandb").iterdir() if p.is_dir() and pattern.fullmatch(p.name))


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'prime-train[wandb]')")
    home = tmp_path / "wandb-home"
    # everything W&B writes stays in tmp_path, and offline mode never reaches the network
    for var, value in {
        "WANDB_DIR": home,
        "WANDB_CONFIG_DIR": home / "config",
        "WANDB_CACHE_DIR": home / "cache",
        "WANDB_DATA_DIR": home / "data",
    }.items():
        value.mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(var, str(value))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    return home


def wait_for_records(run_file: Path, kinds: set[str], timeout: float = 30.0) -> None:
    """wandb's service process may still be flushing a run file after finish() returns (seen under load, in CI):
    wait, bounded, until it holds the record kinds the test reads."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            found = {r.WhichOneof("record_type") for r in wandb_records(run_file)}
        except Exception:  # missing, empty or half-written: not ready yet
            found = set()
        if kinds <= found:
            return
        time.sleep(0.2)


def test_wandb_offline_run_records_history_and_resumes_same_run_id(tmp_path, wandb_env):
    cfg = make_config(tmp_path, wandb_project="prime-train-test", wandb_mode="offline")
    cfg.job.env = {"HF_TOKEN": SECRET}  # the external command's environment must not reach W&B's config
    run_dir = make_run_dir(cfg)

    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    for step, loss in [(1, 3.0), (2, 2.0), (3, 1.0)]:
        metrics.log(step, {"loss": loss, "lr": 0.5})
    metrics.close()

    run_id = json.loads((run_dir.root / "wandb_id.json").read_text())["id"]
    first_runs = offline_runs(run_dir, run_id)
    assert len(first_runs) == 1, sorted(p.name for p in (run_dir.root / "wandb").iterdir())
    run_file = first_runs[0] / f"run-{run_id}.wandb"
    wait_for_records(run_file, {"run", "history"})
    assert wandb_run_id(run_file) == run_id
    history = wandb_history(run_file)
    assert sorted(history) == [1, 2, 3]
    assert [history[s]["loss"] for s in (1, 2, 3)] == [3.0, 2.0, 1.0]

    # a restarted job logs into the same W&B run
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    metrics.log(4, {"loss": 0.5})
    metrics.close()
    assert json.loads((run_dir.root / "wandb_id.json").read_text())["id"] == run_id
    runs = offline_runs(run_dir, run_id)
    assert len(runs) == 2 and len(list((run_dir.root / "wandb").glob("offline-run-*"))) == 2
    resumed = next(p for p in runs if p != first_runs[0]) / f"run-{run_id}.wandb"
    wait_for_records(resumed, {"run", "history"})
    assert wandb_run_id(resumed) == run_id
    assert wandb_history(resumed)[4]["loss"] == 0.5

    for path in files_under(tmp_path):
        assert SECRET.encode() not in path.read_bytes(), f"{path} holds a secret"


def test_wandb_project_without_wandb_installed_is_a_config_error(tmp_path):
    # a real interpreter in which `import wandb` fails, as it does where the package is absent
    program = f"""
import sys
sys.modules["wandb"] = None
from prime_train.config.schema import Config
from prime_train.engine.metrics import EngineConfigError, MetricsLogger
from prime_train.rundir import RunDir
cfg = Config.model_validate({{
    "run": {{"output_dir": {str(tmp_path)!r}, "name": "no-wandb"}},
    "logging": {{"tensorboard": False, "wandb_project": "prime-train-test", "wandb_mode": "offline"}},
}})
run_dir = RunDir(cfg.run_dir)
run_dir.create()
try:
    MetricsLogger(run_dir, cfg, enabled=True)
except EngineConfigError as exc:
    print("EngineConfigError:", exc)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("EngineConfigError:"), done.stdout + done.stderr
    assert "logging.wandb_project" in done.stdout
    assert not (tmp_path / "no-wandb" / "wandb_id.json").exists()


def test_running_heartbeats_skip_fsync_and_the_final_verdict_is_durable(tmp_path, monkeypatch):
    from prime_train.contract import Phase, read_heartbeat

    cfg = make_config(tmp_path)
    run_dir = make_run_dir(cfg)
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])

    metrics.heartbeat(3, phase=Phase.STEP, loss=1.5)
    # rename without fsync: the file is whole for every reader, and the step costs no disk flush
    assert synced == []
    assert read_heartbeat(run_dir.progress_path).step == 3
    metrics.heartbeat(3, phase=Phase.DONE)
    assert synced  # nothing replaces the last heartbeat: it must survive the machine going down
    assert read_heartbeat(run_dir.progress_path).phase == Phase.DONE


def test_log_many_writes_buffered_steps_in_order_as_rows(tmp_path):
    cfg = make_config(tmp_path)
    run_dir = make_run_dir(cfg)
    metrics = MetricsLogger(run_dir, cfg, enabled=True)
    metrics.log_many([(1, {"loss": 2.0}), (2, {"loss": float("nan")}), (3, {"loss": 1.0})])
    rows = read_metrics(run_dir)
    assert [(r["step"], r["loss"]) for r in rows] == [(1, 2.0), (2, None), (3, 1.0)]


def test_the_heartbeat_says_which_step_its_loss_was_read_at_and_the_live_line_shows_it(tmp_path):
    # the trial: the live view showed step 6's loss for steps 6-21, as if each step's (read every log_interval)
    import torch

    from prime_train.contract import Heartbeat
    from prime_train.engine.metrics import MetricsBuffer
    from prime_train.resilience.console import status_line

    cfg = make_config(tmp_path)
    buffer = MetricsBuffer(
        MetricsLogger(make_run_dir(cfg), cfg, enabled=True), interval=5, heartbeat_keys=("loss", "reward"),
        throughput=lambda tokens, seconds: {},
    )  # fmt: skip
    for step in range(1, 8):
        m = {"loss": torch.tensor(10.0 - step), "reward": 0.1 * step}  # the loss on the device, the reward on the host
        buffer.record(step, m, tokens=step)
        if buffer.due(step, last=False):
            buffer.flush()
        beat = buffer.heartbeat(m)
        if step == 7:
            assert beat["loss"] == 5.0 and beat["loss_step"] == 5 and beat["reward"] == pytest.approx(0.7)
    hb = Heartbeat.from_dict(Heartbeat.now(7, max_steps=10, phase="step", **beat).to_dict())
    line = status_line({"attempt": 1, "step": 7, "max_steps": 10, "loss": hb.loss, "loss_step": hb.loss_step,
                        "reward": hb.reward})  # fmt: skip
    assert "loss 5.0000 (step 5)" in line and "reward 0.700" in line, line
    assert "(step" not in status_line({"step": 5, "loss": 5.0, "loss_step": 5})


def test_a_heartbeat_between_steps_carries_the_last_steps_loss_and_reward():
    # an RL step is mostly rollout wait: its heartbeats had no loss or reward, so the live view showed neither
    from types import SimpleNamespace

    from prime_train.contract import Phase
    from prime_train.engine.loop import TrainingJob

    beats: list[dict] = []
    job = SimpleNamespace(
        state=SimpleNamespace(step=7, tokens_seen=70), resumed_from=0,
        _beat=lambda step, phase, **fields: beats.append({"phase": phase, **fields}),
    )  # fmt: skip
    TrainingJob.heartbeat(job, Phase.ROLLOUT_WAIT)  # before the first step: nothing to carry
    job._step_fields = {"loss": 0.25, "loss_step": 5, "reward": 0.5}
    TrainingJob.heartbeat(job, Phase.ROLLOUT_WAIT)
    TrainingJob.heartbeat(job, Phase.DONE, loss=0.125)  # what a phase says itself wins
    TrainingJob.heartbeat(job, Phase.STEP)  # an RL step back from its rollouts, training: nothing of its own yet
    assert "loss" not in beats[0]
    assert (beats[1]["loss"], beats[1]["loss_step"], beats[1]["reward"]) == (0.25, 5, 0.5)
    assert (beats[2]["loss"], beats[2]["reward"]) == (0.125, 0.5)
    assert (beats[3]["phase"], beats[3]["loss"], beats[3]["reward"]) == (Phase.STEP, 0.25, 0.5)
