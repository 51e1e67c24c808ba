"""SkyPilot recovers `recover_on_exit_codes` without limit; the generated task caps it with `spot recovery-gate`,
counting recoveries in the bucket. The node script runs here as SkyPilot would run it after each recovery, against
moto's S3 server (a real process on 127.0.0.1); only `prime-train run` is a stand-in that exits 75."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from test_spot import _calls, _fake_prime_train
from test_storage import aws_env, bucket, make_checkpoint, s3_endpoint  # noqa: F401 (fixtures)

from prime_train.config.loader import load_config
from prime_train.integrations import monitor as mon
from prime_train.integrations import skypilot as sp
from prime_train.integrations.storage import CheckpointStore, DirectoryRecoveries


class Node:
    """One node of the managed job: the task's run script, its config where the file mount puts it, and the
    environment SkyPilot gives it (SKYPILOT_TASK_ID stays the same across the job's recoveries)."""

    def __init__(self, tmp_path: Path, endpoint: str, bucket_name: str, *, max_recoveries: int = 2):
        self._place(
            tmp_path,
            f'[run]\nname = "capped"\n[ckpt]\nremote = "s3://{bucket_name}/capped"\n'
            f'remote_endpoint_url = "{endpoint}"\n[spot]\naccelerators = "H100:1"\nmax_recoveries = {max_recoveries}\n',
        )
        self.store = CheckpointStore(self.cfg.ckpt.remote, endpoint_url=endpoint)

    def _place(self, tmp_path: Path, config_text: str) -> None:
        """The config where the task's file mount puts it, and a stand-in `prime-train run` on PATH."""
        self.tmp = tmp_path
        self.config = tmp_path / "spot.toml"
        self.config.write_text(config_text)
        self.cfg = load_config([str(self.config)])
        self.task = sp.task_from_config(self.cfg, config_files=[str(self.config)], overrides=[])
        self.home = tmp_path / "home"
        remote = next(k for k in self.task["file_mounts"] if k.startswith(sp.REMOTE_CONFIG_DIR))
        (self.home / remote[2:]).parent.mkdir(parents=True)
        (self.home / remote[2:]).write_text(self.config.read_text())
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        self.record = _fake_prime_train(bin_dir, exit_code=75)
        self.path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"

    def start(self, *, task_id: str = "sky-managed-7_capped-0", rank: int = 0) -> subprocess.CompletedProcess:
        env = {**os.environ, "PATH": self.path, "HOME": str(self.home), "SKYPILOT_TASK_ID": task_id,
               "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": "1", "SKYPILOT_NODE_IPS": "10.0.0.1"}  # fmt: skip
        return subprocess.run(["bash", "-c", self.task["run"]], env=env, capture_output=True, text=True, timeout=120)

    def runs(self) -> int:
        return len(_calls(self.record))


def test_a_job_that_exits_75_without_progress_stops_after_max_recoveries(tmp_path, s3_endpoint, bucket):  # noqa: F811
    node = Node(tmp_path, s3_endpoint, bucket, max_recoveries=2)
    # the first start and the two recoveries it is allowed exit 75, and SkyPilot would recover each; the third exit
    # 75 in a row with no new checkpoint would be a third recovery: the job ends with 1 instead, saying why
    for attempt in range(2):
        result = node.start()
        assert result.returncode == 75, (attempt, result.stderr)
    stopped = node.start()
    assert stopped.returncode == 1, stopped.stderr
    assert "spot.max_recoveries (2) reached: the job exited 75 3 times in a row" in stopped.stderr
    assert "without a new checkpoint" in stopped.stderr and "prime-train spot logs" in stopped.stderr
    assert node.runs() == 3
    # SkyPilot restarts a failed job up to max_restarts_on_errors times: each stops at the gate, before training
    again = node.start()
    assert again.returncode == 1 and "spot.max_recoveries (2) reached" in again.stderr
    assert node.runs() == 3, "prime-train run did not start again"
    record = node.store.get_recoveries()
    assert record["recoveries"] == 3 and record["in_a_row"] == 3 and record["task_id"] == "sky-managed-7_capped-0"
    # a new launch of the job (a new SKYPILOT_TASK_ID) starts a new count
    assert node.start(task_id="sky-managed-8_capped-0").returncode == 75


def test_recoveries_that_bring_new_checkpoints_are_not_capped(tmp_path, s3_endpoint, bucket):  # noqa: F811
    node = Node(tmp_path, s3_endpoint, bucket, max_recoveries=1)
    for step in (100, 200, 300, 400):  # each preemption left a new checkpoint in the bucket: progress
        node.store.upload(make_checkpoint(tmp_path / "ckpts", step), step)
        assert node.start().returncode == 75
    assert node.store.get_recoveries()["in_a_row"] == 0
    assert node.start().returncode == 75  # the first without progress is within the limit of 1
    assert node.start().returncode == 1


def test_only_node_0_counts_a_recovery(tmp_path, s3_endpoint, bucket):  # noqa: F811
    node = Node(tmp_path, s3_endpoint, bucket, max_recoveries=0)
    for _ in range(3):
        assert node.start(rank=1).returncode == 75
    assert node.store.get_recoveries() is None
    assert node.start(rank=0).returncode == 1


def test_the_monitor_does_not_relaunch_a_job_that_stopped_itself(tmp_path, s3_endpoint, bucket):  # noqa: F811
    node = Node(tmp_path, s3_endpoint, bucket, max_recoveries=0)
    assert node.start().returncode == 1
    record = node.store.get_recoveries()
    relaunches = []
    result = mon.monitor(
        node.cfg,
        resume=True,
        heartbeat_reader=lambda: None,
        job_status_reader=lambda: {"status": "FAILED", "start_at": record["gave_up_at"] - 60, "recent_failures": 0},
        relaunch=relaunches.append,
        now=record["gave_up_at"] + 60,
        recoveries_reader=mon.storage_recoveries_reader(node.cfg),
    )
    assert result.decision.state == "dead" and not result.decision.relaunchable and relaunches == []
    assert "stopped itself: spot.max_recoveries (0) reached" in result.decision.reason
    # a verdict older than the job SkyPilot runs now belongs to an earlier job
    later = mon.monitor(
        node.cfg,
        resume=True,
        heartbeat_reader=lambda: None,
        job_status_reader=lambda: {"status": "FAILED", "start_at": record["gave_up_at"] + 60},
        relaunch=lambda d: relaunches.append(d) or {"job_ids": [1]},
        now=record["gave_up_at"] + 120,
        recoveries_reader=mon.storage_recoveries_reader(node.cfg),
    )
    assert later.action == "relaunched"


# ---------------------------------------------------------------- several nodes: the count in the mounted ckpt.dir


class MountedNode(Node):
    """A node of a two-node job whose checkpoints are a bucket SkyPilot mounts at ckpt.dir (spot.ckpt_mount): here
    the mount is a directory both nodes' scripts see, as every node sees the one bucket."""

    def __init__(self, tmp_path: Path, *, max_recoveries: int = 1):
        self.shared = tmp_path / "mounted-bucket"
        self._place(
            tmp_path,
            f'[run]\nname = "capped"\n[distributed]\nnnodes = 2\n[ckpt]\ndir = "{self.shared}"\n[spot]\n'
            f'accelerators = "H100:1"\nnum_nodes = 2\nckpt_mount = "s3://bucket/capped"\n'
            f"max_recoveries = {max_recoveries}\n",
        )
        self.store = DirectoryRecoveries(self.shared)


def test_a_two_node_job_counts_its_recoveries_in_the_mounted_checkpoint_directory(tmp_path):
    node = MountedNode(tmp_path, max_recoveries=1)
    assert node.task["file_mounts"][str(node.shared)] == {"source": "s3://bucket/capped", "mode": "MOUNT_CACHED"}
    # both nodes exit 75 at a preemption; node 1 never counts, node 0 counts once per recovery
    assert node.start(rank=1).returncode == 75 and node.store.get_recoveries() is None
    assert node.start(rank=0).returncode == 75
    assert node.store.get_recoveries()["in_a_row"] == 1 and (node.shared / "spot-recoveries.json").is_file()
    # a recovery that left a new whole checkpoint in the shared directory is progress
    make_checkpoint(node.shared, 100)
    assert node.start(rank=0).returncode == 75
    record = node.store.get_recoveries()
    assert (record["recoveries"], record["in_a_row"], record["newest_step"]) == (2, 0, 100)
    # then two in a row without one: past max_recoveries (1) node 0 stops the job, and node 1 stops at the gate
    assert node.start(rank=0).returncode == 75
    stopped = node.start(rank=0)
    assert stopped.returncode == 1 and "spot.max_recoveries (1) reached" in stopped.stderr, stopped.stderr
    assert "mounted-bucket" in stopped.stderr
    assert node.start(rank=1).returncode == 1
    assert node.runs() == 5, "the run after the verdict never started"
