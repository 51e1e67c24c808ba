"""ckpt.async_writer = 'process': async saves written by DCP's checkpoint process instead of a thread of the trainer
(no GIL shared with the training loop: the thread's Python work slowed the steps after each save by 20-28 % on an
H200, bench/checkpoint_stall.py). Real runs on the CPU: what the process writes resumes to the same losses and
weights as a run never stopped, a kill -9 of the trainer still reads as a kill, and several ranks each get one."""

from __future__ import annotations

import json

import pytest
import torch
from enginetools import (
    TINY,
    cli,
    final_weights,
    losses_by_step,
    run_train,
    sigkill_the_trainer_once,
    start,
    tiny_overrides,
)

from prime_train.kit.events import read_events
from prime_train.rundir import list_checkpoints

pytestmark = pytest.mark.slow  # real runs: a supervised kill -9 and resume, two FSDP ranks


def test_a_run_killed_after_a_save_by_the_checkpoint_process_resumes_as_if_never_stopped(tmp_path):
    steps = {"train.max_steps": 30, "ckpt.interval": 10}
    straight = run_train(tmp_path, "straight", **steps)  # the thread writer (the default)
    assert straight.returncode == 0, straight.stdout[-3000:]

    run_dir = tmp_path / "process"
    args = tiny_overrides(tmp_path, "process", **steps, **{
        "ckpt.async_writer": "process", "supervisor.backoff_initial_s": 0.5, "supervisor.poll_interval_s": 0.5,
    })  # fmt: skip
    proc = start(cli("run", str(TINY), *args))
    out = sigkill_the_trainer_once(proc, run_dir, 10, timeout=300)  # step-10: written by the process
    assert proc.returncode == 0, out[-4000:]

    events = read_events(run_dir / "events.jsonl")
    (failure,) = [e for e in events if e["event"] == "failure"]
    # the checkpoint process, orphaned, mostly prints an EOFError (or a reset connection) into that attempt's log on
    # its way out: an echo, not the cause (tests/test_logscan.py holds both as recorded)
    assert "SIGKILL" in failure["message"], failure
    assert not [e for e in events if e["event"] == "log_finding" and e["name"] == "python_exception"]
    resumed = [e for e in events if e["event"] == "attempt_started"][-1]["resume_from"]
    assert resumed in (10, 20)
    assert all(e["leftover_pids"] == [] for e in events if e["event"] == "attempt_ended")

    # the last attempt's async saves went through the process, which was asked to end at the close: no traceback
    log = (run_dir / "logs" / "attempt-2" / "trainer.log").read_text()
    assert "Checkpoint background process is running" in log and "Traceback" not in log, log[-3000:]
    a, b = losses_by_step(tmp_path / "straight"), losses_by_step(run_dir)
    for step in range(resumed + 1, 31):
        assert a[step] == b[step], (step, a[step], b[step])  # bitwise on CPU
    wa, wb = final_weights(tmp_path / "straight"), final_weights(run_dir)
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_two_fsdp_ranks_each_write_their_shards_through_a_checkpoint_process(tmp_path):
    steps = {"train.max_steps": 10, "ckpt.interval": 5, "distributed.nproc_per_node": 2, "distributed.strategy": "fsdp"}
    result = run_train(
        tmp_path, "fsdp", **steps, **{"ckpt.async_writer": "process", "ckpt.resumable_final_save": "false"}
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (step5,) = [c.path for c in list_checkpoints(tmp_path / "fsdp" / "checkpoints") if c.step == 5]
    assert sorted(p.name for p in step5.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    manifest = json.loads((step5 / "manifest.json").read_text())["files"]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(manifest)
    assert "Traceback" not in result.stdout + result.stderr
    more = run_train(tmp_path, "fsdp", flags=("--resume",), **{**steps, "train.max_steps": 12})
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert "resumed from" in more.stdout + more.stderr
