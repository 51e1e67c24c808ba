"""Watchers and the restart policy: hangs by wall clock, disk retention and watermark, cloud notices."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prime_train.config.schema import Config
from prime_train.contract import Event
from prime_train.kit.events import read_events
from prime_train.kit.failures import Failure, FailureKind
from prime_train.kit.observe import ForwardStop, Note, Observation, RestartWorker, StatusKey, Watcher, note
from prime_train.resilience.background import Watching
from prime_train.resilience.policy import RestartPolicy
from prime_train.resilience.supervisor import Observer, Supervisor, SupervisorOptions
from prime_train.resilience.watchers import DiskWatcher, PreemptionWatcher, ProgressWatcher
from prime_train.rundir import list_checkpoints

JOB = Path(__file__).parent / "jobs" / "counter_job.py"


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def watcher(hb: dict, clock: Clock) -> ProgressWatcher:
    return ProgressWatcher(
        lambda: dict(hb) if hb else None, stall_timeout_s=10, startup_timeout_s=60, save_timeout_s=100, clock=clock
    )


# ---------------------------------------------------------------- progress


def test_startup_gets_its_own_allowance_then_steps_must_advance():
    clock, hb = Clock(), {}
    w = watcher(hb, clock)
    clock.now += 50
    assert w.poll().records() == [] and w.failure is None  # start-up: 60 s allowed
    hb.update(step=1, phase="step", time=clock.now)
    w.poll()
    clock.now += 9
    w.poll()
    assert w.failure is None
    clock.now += 2  # 11 s without a new step
    events = w.poll().records()
    assert w.failure is not None and w.failure.kind is FailureKind.HANG and w.failure.step == 1
    assert events[0]["event"] == "hang_detected"


@pytest.mark.parametrize(("step_phase", "save_phase"), [("step", "save"), ("training", "saving")])
def test_a_slow_checkpoint_save_is_not_a_hang(step_phase, save_phase):
    # ("training", "saving") are the names prime-train wrote before the contract module: still understood
    clock, hb = Clock(), {"step": 5, "phase": step_phase, "time": 1000.0}
    w = watcher(hb, clock)
    w.poll()
    clock.now += 1
    hb.update(phase=save_phase, time=clock.now)
    w.poll()
    clock.now += 90  # far past the 10 s step allowance, within the 100 s save allowance
    w.poll()
    assert w.failure is None
    clock.now += 20
    w.poll()
    assert w.failure is not None and "save allowance" in w.failure.message


def test_the_previous_attempts_last_heartbeat_does_not_end_the_next_start_up():
    # a restarted trainer takes a while to write its first heartbeat; until then progress.json still holds
    # the dead attempt's last step, which must not put the new attempt on the (short) step allowance
    clock = Clock()
    stale = {"step": 15, "phase": "step", "time": clock.now - 30}
    w = watcher(stale, clock)
    clock.now += 50  # past the 10 s step allowance, within the 60 s start-up allowance
    assert w.poll().records() == [] and w.failure is None and w.first_step is None
    stale.update(step=10, phase="startup", time=clock.now)  # the new trainer, resumed from step 10
    w.poll()
    assert w.first_step == 10 and w.failure is None


def test_an_external_heartbeat_without_a_clock_counts_only_when_its_step_moves():
    clock, hb = Clock(), {"step": 7}
    w = watcher(hb, clock)
    w.poll()
    assert w.first_step is None  # maybe the last attempt's: not evidence yet
    hb.update(step=8)
    w.poll()
    assert w.step == 8 and w.first_step == 8


def test_each_policy_the_rl_workers_loaded_becomes_one_weights_loaded_event():
    # the GRPO job's step heartbeat names the policy its workers were told to load (rl/train.py)
    clock, hb = Clock(), {"step": 1, "phase": "step", "time": 1000.0}
    w = watcher(hb, clock)
    assert w.poll().records() == []  # an SFT heartbeat: no weights
    for step in (2, 3):
        clock.now += 1
        hb.update(step=step, time=clock.now, weights_step=step, workers_reloaded=2, weight_reload_s=0.1)
        assert w.poll().records() == [{"event": "weights_loaded", "step": step, "workers": 2, "reload_s": 0.1}]
    clock.now += 1
    hb.update(phase="save", time=clock.now)  # the same policy, another heartbeat: no second event
    assert w.poll().records() == []


def test_startup_that_never_reaches_a_step_is_a_hang():
    clock = Clock()
    w = watcher({}, clock)
    clock.now += 61
    w.poll()
    assert w.failure is not None and "start-up" in w.failure.message


# ---------------------------------------------------------------- disk


def make_checkpoints(ckpt_dir: Path, steps, size: int = 1000) -> None:
    for step in steps:
        d = ckpt_dir / f"step-{step}"
        d.mkdir(parents=True)
        (d / "shard.distcp").write_bytes(b"\0" * size)


class Usage:
    """Disk use that goes down as checkpoints go: 50 % plus 10 % per checkpoint left."""

    def __init__(self, ckpt_dir: Path):
        self.ckpt_dir = ckpt_dir

    def __call__(self, path):
        n = len(list_checkpoints(self.ckpt_dir))
        total = 1000
        return type("du", (), {"total": total, "used": int(total * (0.5 + 0.1 * n)), "free": 0})()


def test_watermark_removes_oldest_first_and_keeps_the_newest(tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoints(ckpt, [10, 20, 30, 40, 50])
    w = DiskWatcher(ckpt, keep_last=None, keep_every=None, high_watermark=0.85, max_bytes=None, disk_usage=Usage(ckpt))
    events = w.poll().records()
    assert [c.step for c in list_checkpoints(ckpt)] == [30, 40, 50]
    assert [e["step"] for e in events] == [10, 20]
    assert all(e["event"] == "checkpoint_deleted" and e["reason"] == "watermark" for e in events)


def test_a_checkpoint_being_uploaded_waits_for_its_upload(tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoints(ckpt, [10, 20, 30, 40, 50])
    uploading = {20}
    w = DiskWatcher(ckpt, keep_last=2, keep_every=None, high_watermark=0.85, max_bytes=None,
                    disk_usage=Usage(ckpt), protect=lambda: set(uploading))  # fmt: skip
    w.poll()
    assert [c.step for c in list_checkpoints(ckpt)] == [20, 40, 50]  # retention spared the one in flight
    uploading.clear()  # uploaded: the next poll applies the policy to it too
    w.poll()
    assert [c.step for c in list_checkpoints(ckpt)] == [40, 50]


def test_watermark_never_deletes_the_last_whole_checkpoint_or_one_being_written(tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoints(ckpt, [10, 20])
    (ckpt / "step-30.tmp").mkdir()
    full = lambda path: type("du", (), {"total": 100, "used": 99, "free": 1})()  # noqa: E731
    w = DiskWatcher(ckpt, keep_last=None, keep_every=None, high_watermark=0.85, max_bytes=None, disk_usage=full)
    w.poll()
    assert [c.step for c in list_checkpoints(ckpt)] == [20]
    assert (ckpt / "step-30.tmp").is_dir()
    assert w.failure is not None and w.failure.kind is FailureKind.DISK_FULL


def test_symlink_pointing_outside_is_not_followed_or_deleted(tmp_path):
    ckpt = tmp_path / "checkpoints"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data.bin").write_bytes(b"keep me")
    make_checkpoints(ckpt, [10, 20, 30])
    (ckpt / "step-5").symlink_to(outside, target_is_directory=True)  # looks like the oldest checkpoint
    (ckpt / "step-10" / "link-out").symlink_to(outside, target_is_directory=True)
    w = DiskWatcher(
        ckpt,
        keep_last=1,
        keep_every=None,
        high_watermark=0.99,
        max_bytes=None,
        disk_usage=lambda p: type("du", (), {"total": 100, "used": 10, "free": 90})(),
    )
    w.poll()
    assert [c.step for c in list_checkpoints(ckpt)] == [30]
    assert (outside / "data.bin").read_bytes() == b"keep me"


def test_byte_cap_deletes_real_bytes_until_under(tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoints(ckpt, [1, 2, 3, 4], size=100_000)
    w = DiskWatcher(ckpt, keep_last=None, keep_every=None, high_watermark=1.0, max_bytes=250_000)
    events = w.poll().records()
    assert [c.step for c in list_checkpoints(ckpt)] == [3, 4]
    assert sum(e["bytes"] for e in events) == 200_000


def test_a_watermark_breach_below_keep_last_says_so_and_keeps_one_whole_checkpoint_not_a_quarantined_one(tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoints(ckpt, [1, 2, 3], size=100_000)
    corrupt = ckpt / "step-4.corrupt"  # set aside by the engine (failed verification): not whole, never deleted
    corrupt.mkdir()
    (corrupt / "__0_0.distcp").write_bytes(b"\0" * 100_000)
    w = DiskWatcher(ckpt, keep_last=3, keep_every=None, high_watermark=1.0, max_bytes=50_000)
    events = w.poll().records()
    assert [c.step for c in list_checkpoints(ckpt)] == [3], "the newest whole one stays, over the cap or not"
    assert corrupt.is_dir()
    [below] = [e for e in events if e["event"] == "retention_below_keep_last"]
    assert below["kept"] == [3] and below["keep_last"] == 3 and "max_disk_gb" in below["reason"]
    assert w.poll().records() == [], "said once, when it happens"


def test_a_full_disk_failure_says_which_checkpoint_is_left(tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoints(ckpt, [7])
    full = lambda path: type("du", (), {"total": 100, "used": 100, "free": 0})()  # noqa: E731
    w = DiskWatcher(ckpt, keep_last=2, keep_every=None, high_watermark=0.9, max_bytes=None, disk_usage=full)
    w.poll()
    assert w.failure.message == "disk 100% full and retention cannot free more (only step-7 on it)"
    for path in ckpt.iterdir():
        shutil.rmtree(path)
    w.failure = None
    w.poll()
    assert w.failure.message == "disk 100% full and retention cannot free more (no whole checkpoint on it)"


# ---------------------------------------------------------------- cloud notices


class Metadata(BaseHTTPRequestHandler):
    """AWS IMDSv2 and GCP metadata, as far as spot notices go."""

    marked = False

    def log_message(self, *args):
        pass

    def do_PUT(self):
        if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
            self._send(200, "token-abc")
        else:
            self._send(400, "")

    def do_GET(self):
        if self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != "token-abc":
                self._send(401, "")
            elif type(self).marked:
                self._send(200, json.dumps({"action": "terminate", "time": "2026-11-22T01:00:00Z"}))
            else:
                self._send(404, "")
        elif self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                self._send(403, "")
            else:
                self._send(200, "TRUE" if type(self).marked else "FALSE")
        else:
            self._send(404, "")

    def _send(self, code: int, body: str):
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def metadata_server():
    handler = type("Handler", (Metadata,), {"marked": False})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_preemption_notice_is_seen_only_once_the_instance_is_marked(metadata_server, cloud):
    _, handler, url = metadata_server
    w = PreemptionWatcher(aws_endpoint=url if cloud == "aws" else None, gcp_endpoint=url if cloud == "gcp" else None)
    assert w.poll().records() == [] and w.notice is None
    handler.marked = True
    events = w.poll().records()
    assert events and events[0]["event"] == "preemption_notice" and events[0]["cloud"] == cloud
    assert w.poll().records() == []  # reported once


def test_unreachable_metadata_endpoint_switches_the_watcher_off():
    w = PreemptionWatcher(aws_endpoint="http://127.0.0.1:9", gcp_endpoint=None, timeout_s=0.2)
    for _ in range(3):
        w.poll()
    assert not w.active


def test_preemption_notice_checkpoints_the_job_and_exits_75_without_restarting(tmp_path, metadata_server):
    _, handler, url = metadata_server
    ckpt, progress = tmp_path / "ckpt", tmp_path / "progress.json"
    cfg = Config.model_validate(
        {
            "run": {"name": "spot", "output_dir": str(tmp_path / "runs")},
            "job": {
                "command": [
                    sys.executable,
                    str(JOB),
                    "--ckpt-dir",
                    str(ckpt),
                    "--progress",
                    str(progress),
                    "--steps",
                    "100000",
                    "--interval",
                    "1000",
                ],
                "checkpoint_dir": str(ckpt),
                "progress_file": str(progress),
                "resume_args": ["--resume-step", "{step}"],
            },
            "supervisor": {"poll_interval_s": 0.2, "term_grace_s": 10},
        }
    )
    sup = Supervisor(
        cfg, Observer(), SupervisorOptions(preemption=PreemptionWatcher(aws_endpoint=url, gcp_endpoint=None))
    )

    def mark_when_running():
        deadline = time.time() + 60
        while time.time() < deadline:
            if progress.exists() and json.loads(progress.read_text()).get("step", 0) >= 5:
                handler.marked = True
                return
            time.sleep(0.05)

    threading.Thread(target=mark_when_running, daemon=True).start()
    code = sup.run()
    assert code == 75
    assert len(sup.attempts) == 1
    assert sup.attempts[0].failure.kind is FailureKind.PREEMPTED
    step = json.loads(progress.read_text())["step"]
    assert (ckpt / f"step-{step}").is_dir()
    names = [e["event"] for e in read_events(sup.run_dir.events_path)]
    assert "preemption_notice" in names and "preemption_forwarded" in names and "run_preempted" in names
    assert os.path.exists(sup.run_dir.supervisor_path)


# ---------------------------------------------------------------- policy


def test_backoff_doubles_to_its_cap_and_config_errors_never_retry():
    policy = RestartPolicy(max_restarts=5, backoff_initial_s=2, backoff_max_s=10)
    crash = Failure(FailureKind.CRASH, "boom")
    assert [policy.decide(crash, n).delay_s for n in range(5)] == [2, 4, 8, 10, 10]
    assert not policy.decide(crash, 5).restart
    assert not policy.decide(Failure(FailureKind.CONFIG_ERROR, "bad key"), 0).restart
    assert policy.decide(Failure(FailureKind.PREEMPTED, "notice"), 0).delay_s == 0


# ---------------------------------------------------------------- one protocol: an attempt's watchers together


class Scripted(Watcher):
    """A watcher that answers each poll with the next observation it was given."""

    def __init__(self, *seen: Observation, blocking: bool = False, judges_while_stopping: bool = True):
        self.seen = list(seen)
        self.blocking = blocking
        self.judges_while_stopping = judges_while_stopping
        self.forgotten: list[str] = []

    def poll(self, now: float) -> Observation:
        return self.seen.pop(0) if self.seen else Observation()

    def restarted(self, process: str) -> None:
        self.forgotten.append(process)


def test_watching_records_events_keeps_verdicts_in_order_and_drops_a_stall_verdict_during_a_stop():
    recorded: list[Note] = []
    stall = Failure(FailureKind.HANG, "no progress")
    broken = Failure(FailureKind.GPU_BROKEN, "Xid 79")
    hang = Observation([note(Event.HANG_DETECTED, idle_s=1.0)], verdict=stall)
    progress = Scripted(hang, judges_while_stopping=False)
    gpu = Scripted(Observation(verdict=broken, status={StatusKey.GPU: {"num_gpus": 1}}), blocking=True)
    watching = Watching([progress, gpu], interval=0.01, record=recorded.append)
    watching.tick(0.0)  # only the quick one: the blocking one is the thread's
    assert [n.event for n in recorded] == [Event.HANG_DETECTED] and watching.verdict(stopping=False) is stall
    watching.start()
    try:
        deadline = time.time() + 10
        while watching.verdict(stopping=True) is None and time.time() < deadline:
            time.sleep(0.01)
    finally:
        watching.stop()
    assert watching.verdict(stopping=False) is stall, "the quick watchers' verdict first, as ever"
    assert watching.verdict(stopping=True) is broken, "a stop's own deadline bounds a stopping job, not the stall"
    assert watching.status() == {StatusKey.GPU: {"num_gpus": 1}}


def test_a_restart_request_about_a_process_replaced_meanwhile_is_dropped():
    worker = Scripted(Observation(requests=[RestartWorker("inference-0", "stopped answering /health")]), blocking=True)
    watching = Watching([worker], interval=0.01, record=lambda n: None)
    before = {"inference-0": 0}
    seen = worker.poll(0.0)
    watching.restarted("inference-0")  # the supervisor restarted it while that poll was under way
    watching._take(worker, seen, before)
    assert watching.requests() == [] and worker.forgotten == ["inference-0"]
    watching._take(worker, Observation(requests=[ForwardStop("preemption notice from aws", {"cloud": "aws"})]), {})
    assert watching.requests() == [ForwardStop("preemption notice from aws", {"cloud": "aws"})]
    assert watching.requests() == [], "each request is handed over once"


def test_a_note_is_named_from_the_catalogue():
    assert note(Event.GPU_XID, gpu=0).to_dict() == {"event": "gpu_xid", "gpu": 0}
    with pytest.raises(TypeError):
        Note("gpu_xid", {})  # type: ignore[arg-type]
