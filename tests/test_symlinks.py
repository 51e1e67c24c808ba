"""Nothing is written through a symlink in a run directory (issue 26, "Writing through symlinks").

A link planted where prime-train writes (config.toml, .lock, events.jsonl, tensorboard/, ...) must never lead a
write to a file outside the run directory. `run` and `train` refuse such a run directory with exit 78, naming the
links, before they write anything; and each writer opens its file with O_NOFOLLOW (or replaces it atomically),
so a link planted after that check is not followed either. Every test keeps a victim file outside the run
directory and checks it byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from enginetools import TINY, cli, env

from prime_train.config.loader import dump_toml
from prime_train.config.schema import Config
from prime_train.contract import UnsafeLink, append_jsonl, open_nofollow, write_json_atomic
from prime_train.kit.events import EventLog, read_events
from prime_train.kit.ownership import claim_run_dir
from prime_train.rundir import RunDir, RunDirBusy, RunDirUnsafe, RunLock

VICTIM_BYTES = b"precious: not prime-train's to touch\n" * 3


def victim_file(tmp_path: Path) -> Path:
    victim = tmp_path / "outside" / "victim.txt"
    victim.parent.mkdir(parents=True, exist_ok=True)
    victim.write_bytes(VICTIM_BYTES)
    return victim


def victim_dir(tmp_path: Path) -> Path:
    victim = tmp_path / "outside" / "victim-dir"
    victim.mkdir(parents=True, exist_ok=True)
    (victim / "keep.txt").write_bytes(VICTIM_BYTES)
    return victim


def assert_untouched(victim: Path) -> None:
    if victim.is_dir():
        assert sorted(p.name for p in victim.iterdir()) == ["keep.txt"], list(victim.iterdir())
        victim = victim / "keep.txt"
    assert victim.read_bytes() == VICTIM_BYTES


def job_config(tmp_path: Path, name: str = "r", **extra) -> Path:
    """A `prime-train run` config whose job is a one-line python command: the supervisor's whole life in ~1 s."""
    cfg = Config.model_validate(
        {
            "run": {"name": name, "output_dir": str(tmp_path / "runs")},
            "job": {"command": [sys.executable, "-c", "print('hello from the job')"]},
            "supervisor": {"poll_interval_s": 0.1, "backoff_initial_s": 0.1, "backoff_max_s": 0.2},
            **extra,
        }
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(dump_toml(cfg))
    return path


def prime_train(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), cwd=cwd, capture_output=True, text=True, timeout=120, env=env())


# ---------------------------------------------------------------- run and train refuse a run directory with links out

FILE_NAMES = [
    "config.toml",
    ".lock",
    "events.jsonl",
    "supervisor.json",
    "processes.json",
    "progress.json",
    "metrics.jsonl",
    "gpu.jsonl",
    "config.attempt-2.toml",
]
DIR_NAMES = ["logs", "tensorboard", "checkpoints", "weights", "final", "profile"]


@pytest.mark.parametrize("name", FILE_NAMES + DIR_NAMES)
def test_run_refuses_a_run_directory_with_a_link_out_naming_it_and_writes_nothing(tmp_path, name):
    victim = victim_dir(tmp_path) if name in DIR_NAMES else victim_file(tmp_path)
    root = tmp_path / "runs" / "r"
    root.mkdir(parents=True)
    (root / name).symlink_to(victim)
    before = sorted(os.listdir(root))

    result = prime_train("run", str(job_config(tmp_path)), cwd=tmp_path)

    out = result.stdout + result.stderr
    assert result.returncode == 78, out
    assert "Traceback" not in out
    assert f"{name} -> {victim}" in out, out
    assert "symbolic link" in out
    assert_untouched(victim)
    assert sorted(os.listdir(root)) == before, "nothing is written before the refusal"
    assert (root / name).is_symlink()


def test_checkpoints_linked_elsewhere_is_refused_with_a_pointer_to_ckpt_dir(tmp_path):
    victim = victim_dir(tmp_path)
    root = tmp_path / "runs" / "r"
    root.mkdir(parents=True)
    (root / "checkpoints").symlink_to(victim)
    result = prime_train("run", str(job_config(tmp_path)), cwd=tmp_path)
    assert result.returncode == 78 and "ckpt.dir" in result.stderr, result.stderr
    assert_untouched(victim)


def test_train_refuses_a_planted_lock_link_without_truncating_its_target(tmp_path):
    victim = victim_file(tmp_path)
    root = tmp_path / "runs" / "t"
    root.mkdir(parents=True)
    (root / ".lock").symlink_to(victim)
    result = prime_train(
        "train", str(TINY), "--run.output_dir", str(tmp_path / "runs"), "--run.name", "t", cwd=tmp_path
    )
    assert result.returncode == 78, result.stdout + result.stderr
    assert ".lock -> " in result.stderr and "Traceback" not in result.stderr
    assert_untouched(victim)
    assert sorted(os.listdir(root)) == [".lock"]


def test_a_file_link_is_refused_even_when_it_points_inside_the_run_directory(tmp_path):
    """Writers never follow a link at one of their own file names, so a link there could only lose what they
    write: it is refused up front, wherever it points."""
    root = tmp_path / "runs" / "r"
    root.mkdir(parents=True)
    (root / "notes.txt").write_bytes(VICTIM_BYTES)
    (root / "events.jsonl").symlink_to("notes.txt")
    result = prime_train("run", str(job_config(tmp_path)), cwd=tmp_path)
    assert result.returncode == 78 and "events.jsonl -> notes.txt" in result.stderr, result.stderr
    assert (root / "notes.txt").read_bytes() == VICTIM_BYTES


def test_links_that_stay_inside_and_a_ckpt_dir_elsewhere_still_run(tmp_path):
    """What is fine: the run directory itself reached through a link, a directory linked within the run
    directory, logs/latest (the tool's own link), and checkpoints kept elsewhere by ckpt.dir (config, not a link).
    """
    real_runs = tmp_path / "disk" / "runs"
    (real_runs / "r" / "tb-data").mkdir(parents=True)
    (tmp_path / "runs").symlink_to(real_runs, target_is_directory=True)
    (real_runs / "r" / "tensorboard").symlink_to("tb-data", target_is_directory=True)
    ckpt_elsewhere = tmp_path / "bigdisk" / "ckpts"
    config = job_config(tmp_path, ckpt={"dir": str(ckpt_elsewhere)})

    first = prime_train("run", str(config), cwd=tmp_path)
    assert first.returncode == 0, first.stdout + first.stderr
    assert (real_runs / "r" / "logs" / "latest").is_symlink()
    second = prime_train("run", str(config), "--fresh", cwd=tmp_path)  # with logs/latest in place
    assert second.returncode == 0, second.stdout + second.stderr
    assert "symbolic link" not in second.stdout + second.stderr


@pytest.mark.parametrize("name", ["events.jsonl", "metrics.jsonl", ".lock", "config.toml"])
def test_run_refuses_a_named_pipe_or_a_directory_where_it_writes_a_file_instead_of_waiting_on_it(tmp_path, name):
    # the trial: a named pipe planted at events.jsonl hung `run --resume` forever, its append waiting for a reader
    root = tmp_path / "runs" / "r"
    root.mkdir(parents=True)
    os.mkfifo(root / name)
    result = prime_train("run", str(job_config(tmp_path)), cwd=tmp_path)  # its timeout is the hang guard
    out = result.stdout + result.stderr
    assert result.returncode == 78 and "Traceback" not in out, out
    assert f"{name} (a named pipe)" in out and "nor into a pipe" in out, out
    (root / name).unlink()
    (root / name).mkdir()
    with pytest.raises(RunDirUnsafe, match=rf"{re.escape(name)} \(a directory\)"):
        claim_run_dir(RunDir(root), "test")


def test_a_named_pipe_planted_after_the_claim_fails_the_append_at_once(tmp_path):
    # the event log keeps what it could not write, as on a full disk; append_jsonl says why (no reader: ENXIO)
    pipe = tmp_path / "events.jsonl"
    os.mkfifo(pipe)
    program = f"""
from prime_train.contract import append_jsonl
from prime_train.kit.events import EventLog
log = EventLog({str(pipe)!r})
log.emit("attempt_started", attempt=1)
assert b"attempt_started" in log._unwritten
try:
    append_jsonl({str(pipe)!r}, {{"a": 1}})
except OSError as exc:
    print("refused:", exc.strerror)
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "refused: No such device or address" in done.stdout, done.stderr


# ---------------------------------------------------------------- the writers never follow a link planted later


def test_claim_run_dir_refuses_a_link_out_with_a_config_error_before_creating_the_lock(tmp_path):
    victim = victim_file(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    run_dir.config_path.symlink_to(victim)
    with pytest.raises(RunDirUnsafe) as caught:
        claim_run_dir(run_dir, "test")
    assert isinstance(caught.value, RunDirBusy)  # so every caller refuses it as it refuses a busy one: exit 78
    assert f"config.toml -> {victim}" in str(caught.value)
    assert not os.path.lexists(run_dir.lock_path)
    assert_untouched(victim)


def test_the_lock_never_truncates_a_linked_file(tmp_path):
    victim = victim_file(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    run_dir.lock_path.symlink_to(victim)
    with pytest.raises((RunDirUnsafe, OSError)):
        RunLock.acquire(run_dir, "test")  # below the check in claim_run_dir: a link planted after it
    assert_untouched(victim)


def test_append_jsonl_and_open_nofollow_refuse_a_link(tmp_path):
    victim = victim_file(tmp_path)
    link = tmp_path / "metrics.jsonl"
    link.symlink_to(victim)
    with pytest.raises(UnsafeLink, match="symbolic link"):
        append_jsonl(link, {"step": 1})
    with pytest.raises(UnsafeLink):
        open_nofollow(link, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    assert_untouched(victim)
    plain = tmp_path / "plain.jsonl"
    append_jsonl(plain, {"step": 1})
    append_jsonl(plain, {"step": 2})
    assert [json.loads(line)["step"] for line in plain.read_text().splitlines()] == [1, 2]


def test_write_json_atomic_replaces_a_link_and_never_writes_its_target(tmp_path):
    victim = victim_file(tmp_path)
    link = tmp_path / "supervisor.json"
    link.symlink_to(victim)
    write_json_atomic(link, {"state": "running"})
    assert not link.is_symlink() and json.loads(link.read_text()) == {"state": "running"}
    assert_untouched(victim)
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_the_event_log_keeps_its_events_rather_than_append_through_a_link(tmp_path):
    victim = victim_file(tmp_path)
    path = tmp_path / "events.jsonl"
    path.symlink_to(victim)
    log = EventLog(path)
    log.emit("run_started")  # a full disk's treatment: kept in memory, the supervisor goes on
    assert_untouched(victim)
    path.unlink()
    log.emit("run_finished")
    assert [e["event"] for e in read_events(path)] == ["run_started", "run_finished"]


def test_the_gpu_recorder_never_appends_through_a_link(tmp_path):
    from prime_train.kit.gpu import GpuReading, GpuRecorder

    victim = victim_file(tmp_path)
    path = tmp_path / "gpu.jsonl"
    path.symlink_to(victim)
    GpuRecorder(path, 1).record([GpuReading(0, "GPU-0", "H100", 50.0, 1000.0, 80000.0)], force=True)
    assert_untouched(victim)


def _engine_config(tmp_path: Path, *, tensorboard: bool) -> Config:
    return Config.model_validate(
        {"run": {"name": "e", "output_dir": str(tmp_path / "runs")}, "logging": {"tensorboard": tensorboard}}
    )


def test_metrics_never_append_or_rewind_through_a_link(tmp_path):
    from prime_train.engine.metrics import MetricsLogger, rewind_metrics

    victim = victim_file(tmp_path)
    cfg = _engine_config(tmp_path, tensorboard=False)
    run_dir = RunDir(cfg.run_dir)
    run_dir.root.mkdir(parents=True)
    run_dir.metrics_path.symlink_to(victim)
    logger = MetricsLogger(run_dir, cfg, enabled=True)
    with pytest.raises(OSError):
        logger.log(1, {"loss": 1.0})
    assert_untouched(victim)

    # rewind writes its new file beside metrics.jsonl and renames it over: a link at a temp name is not followed
    run_dir.metrics_path.unlink()
    run_dir.metrics_path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    (run_dir.root / "metrics.jsonl.tmp").symlink_to(victim)
    assert rewind_metrics(run_dir, 1) == 2
    assert [json.loads(line)["step"] for line in run_dir.metrics_path.read_text().splitlines()] == [1]
    assert_untouched(victim)


def test_tensorboard_linked_out_of_the_run_directory_is_a_config_error_not_a_write(tmp_path):
    pytest.importorskip("torch.utils.tensorboard")
    from prime_train.engine.metrics import EngineConfigError, MetricsLogger

    victim = victim_dir(tmp_path)
    cfg = _engine_config(tmp_path, tensorboard=True)
    run_dir = RunDir(cfg.run_dir)
    run_dir.root.mkdir(parents=True)
    run_dir.tensorboard_dir.symlink_to(victim, target_is_directory=True)
    with pytest.raises(EngineConfigError, match="tensorboard"):
        MetricsLogger(run_dir, cfg, enabled=True)
    assert_untouched(victim)

    # a link that stays inside the run directory is fine
    run_dir.tensorboard_dir.unlink()
    (run_dir.root / "tb-data").mkdir()
    run_dir.tensorboard_dir.symlink_to("tb-data", target_is_directory=True)
    logger = MetricsLogger(run_dir, cfg, enabled=True)
    logger.log(1, {"loss": 1.0})
    logger.close()
    assert any((run_dir.root / "tb-data").iterdir())


def test_run_dir_create_refuses_a_directory_linked_out(tmp_path):
    victim = victim_dir(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    run_dir.logs_dir.symlink_to(victim, target_is_directory=True)
    with pytest.raises(UnsafeLink, match="logs"):
        run_dir.create()
    with pytest.raises(UnsafeLink):
        run_dir.ensure_dir(run_dir.attempt_logs(3))
    assert_untouched(victim)


def test_the_config_written_by_train_replaces_a_link_rather_than_overwrite_its_target(tmp_path):
    from prime_train.launch import write_run_config

    victim = victim_file(tmp_path)
    cfg = _engine_config(tmp_path, tensorboard=False)
    run_dir = RunDir(cfg.run_dir)
    run_dir.root.mkdir(parents=True)
    run_dir.config_path.symlink_to(victim)
    write_run_config(cfg)
    assert not run_dir.config_path.is_symlink() and "[run]" in run_dir.config_path.read_text()
    assert_untouched(victim)


def test_logs_latest_is_replaced_in_one_rename_and_a_directory_there_is_left_alone(tmp_path):
    from prime_train.contract import replace_symlink

    logs = tmp_path / "logs"
    (logs / "attempt-1").mkdir(parents=True)
    (logs / "attempt-2").mkdir()
    replace_symlink(logs / "latest", "attempt-1")
    replace_symlink(logs / "latest", "attempt-2")
    assert os.readlink(logs / "latest") == "attempt-2"
    assert sorted(p.name for p in logs.iterdir()) == ["attempt-1", "attempt-2", "latest"]  # no temporary left
    (logs / "latest").unlink()
    (logs / "latest").mkdir()
    (logs / "latest" / "mine.txt").write_text("not prime-train's")
    with pytest.raises(FileExistsError):
        replace_symlink(logs / "latest", "attempt-2")
    assert (logs / "latest" / "mine.txt").read_text() == "not prime-train's"


def test_preflight_s_write_probe_never_writes_through_a_planted_link(tmp_path):
    from prime_train.config.schema import Config
    from prime_train.validator.preflight import check_output_dir

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    for pid in range(os.getpid() - 2, os.getpid() + 3):
        (run / f".preflight-{pid}").symlink_to(victim)
    cfg = Config.model_validate({"run": {"name": "x", "output_dir": str(tmp_path / "runs")}})
    assert check_output_dir(cfg).status == "pass"
    assert victim.read_text() == "precious\n"
