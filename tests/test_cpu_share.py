"""Trainers of several runs on one machine share its cores (prime_train/cpu_share.py): real processes' claims."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil
import pytest
import torch

from prime_train.config.schema import Config
from prime_train.cpu_share import CpuShare, usable_cores

LATER = 1e12  # a monotonic time past every claim check


@pytest.fixture
def sleepers():
    """Start live processes whose claims stand for other runs' trainers; killed at the end."""
    procs = []

    def start() -> subprocess.Popen:
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def test_two_runs_started_together_end_with_one_thread_each_and_the_survivor_takes_both_back(tmp_path, sleepers):
    first, second = sleepers(), sleepers()
    a = CpuShare(2, 2, tmp_path, pid=first.pid)
    assert a.claim() == 2  # alone: the launch's choice
    b = CpuShare(2, 2, tmp_path, pid=second.pid)
    assert b.claim() == 1  # started a moment later: what the first leaves, at least 1
    assert a.poll(now=0.0) is None  # not yet time to look again
    assert a.poll(now=LATER) == 1  # the first sees the second and gives a core up
    assert json.loads((tmp_path / f"{first.pid}.json").read_text())["threads"] == 1
    second.kill()
    second.wait()
    assert a.poll(now=2 * LATER) == 2  # the second ended (killed: its claim is still there, its process is not)
    b.release()
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == [f"{first.pid}.json"]


def test_claims_of_dead_processes_reused_ids_and_odd_files_are_not_counted(tmp_path, sleepers):
    live = sleepers()
    (tmp_path / "999999999.json").write_text(json.dumps({"pid": 999999999, "started": 1.0, "threads": 8}))
    # a live process's id with another start time: the process that claimed is gone and its id was reused
    (tmp_path / f"{live.pid}.json").write_text(json.dumps({"pid": live.pid, "started": 5.0, "threads": 8}))
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / "12.json").write_text("not json")
    outside = tmp_path.parent / f"{tmp_path.name}-outside.json"
    # a link is never read as a claim, though it points at one that would count
    outside.write_text(json.dumps({"started": psutil.Process(os.getppid()).create_time(), "threads": 8}))
    os.symlink(outside, tmp_path / f"{os.getppid()}.json")
    assert CpuShare(4, 4, tmp_path).claim() == 4
    # the claims of processes that ended go (parsed claims only); the rest of what is there stays
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(["12.json", "notes.json", f"{os.getppid()}.json", f"{os.getpid()}.json", "lock"])
    assert outside.exists()


def test_nothing_is_written_through_a_symlink(tmp_path, sleepers):
    target = tmp_path / "elsewhere"
    target.mkdir()
    link = tmp_path / "claims"
    os.symlink(target, link)
    share = CpuShare(2, 2, link)
    assert share.dir is None and share.claim() == 2  # not shared, and nothing written
    assert list(target.iterdir()) == []
    real = tmp_path / "real"
    real.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    mine = CpuShare(2, 2, real)
    os.symlink(victim, real / f"{mine.pid}.json")
    mine.claim()
    assert victim.read_text() == "keep" and not (real / f"{mine.pid}.json").is_symlink()


def test_a_trainer_whose_threads_were_chosen_for_it_takes_its_share_and_gives_it_back(tmp_path, monkeypatch, sleepers):
    from prime_train.engine.train import SFTJob

    cores = usable_cores()
    if cores < 2:
        pytest.skip("needs two usable cores")
    claims = tmp_path / "cache" / "prime-train" / "cpu-claims"
    claims.mkdir(parents=True)
    other = sleepers()
    CpuShare(cores - 1, cores, claims, pid=other.pid).claim()  # another run's trainer holds all but one core
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("PRIME_TRAIN_THREADS", "auto")
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what the launch chose (OMP_NUM_THREADS)
    cfg = Config.model_validate(
        {
            "run": {"name": "share", "output_dir": str(tmp_path / "runs")},
            "train": {"max_steps": 100, "micro_batch_size": 2, "global_batch_size": 2, "eval_interval": 100},
            "data": {"seq_len": 32, "datasets": [{"task": "reverse-text", "num_examples": 100}]},
            "logging": {"tensorboard": False},
        }
    )
    try:
        job = SFTJob(cfg)
        try:
            assert torch.get_num_threads() == 1
            assert json.loads((claims / f"{os.getpid()}.json").read_text())["threads"] == 1
            other.kill()
            other.wait()
            job.stop.startup = False
            job.cpu_share._next_check = 0.0  # the next step checks the claims
            assert job.run_step() is None
            assert torch.get_num_threads() == 2
        finally:
            job.close()
        assert not (claims / f"{os.getpid()}.json").exists()
    finally:
        torch.set_num_threads(before)
