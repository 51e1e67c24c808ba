"""GPU health from GPU traces (tests/data/gpu: measured on an H100 and an H200, the rest constructed from them):
readings in, events and decisions out.

A GPU is the trainer's or a worker's because CUDA_VISIBLE_DEVICES says so, and "empty" means back at the
memory it held before the attempt started (or less since). NVML's process list only ever says "the role is
here": where it lists a PID of the role (a VM, as on the H200); in a container it lists host PIDs and says
nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prime_train.kit.failures import FailureKind
from prime_train.kit.gpu import (
    BASELINE_MARGIN_MIB,
    ENV_GPU_REPLAY,
    GpuHealthWatcher,
    GpuProcess,
    GpuReading,
    GpuRecorder,
    NvmlSource,
    ReplaySource,
    gpu_inventory,
    readings_of,
    summary,
    visible_devices,
)

TRACES = Path(__file__).parent / "data" / "gpu"


class Clock:
    def __init__(self, now: float = 100.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def watch(
    trace: str, roles: dict, may_judge=lambda role: True, step=lambda: 41, polls=(), broken_polls=3, role_pids=None
):
    """Replay `trace`: baseline at t=0, then one poll at each time in `polls`; returns (watcher, events per poll)."""
    clock = Clock()
    source = ReplaySource(TRACES / trace, clock=clock)
    watcher = GpuHealthWatcher(
        source, roles=lambda: roles, may_judge=may_judge, current_step=step, broken_polls=broken_polls,
        role_pids=role_pids,
    )  # fmt: skip
    watcher.take_baseline()
    per_poll = []
    for t in polls:
        clock.now = source.started + t
        per_poll.append(watcher.poll().records())
    return watcher, per_poll


def test_h100_start_up_with_a_live_cuda_context_is_never_called_broken():
    # what killed every attempt on the H100: 0 %, 518 MiB (a CUDA context), no step yet, for the whole start-up
    trainer = {"trainer": None}
    during_startup, per_poll = watch("h100_startup.jsonl", trainer, may_judge=lambda r: False, polls=range(2, 120, 2))
    assert during_startup.failure is None and not any(per_poll)
    # even if the supervisor wrongly asked for a verdict, a context on the GPU is not "empty"
    asked, _ = watch("h100_startup.jsonl", trainer, may_judge=lambda r: True, polls=range(2, 120, 2))
    assert asked.failure is None
    assert asked.last_readings[0].memory_used_mib == 518.0 and asked.baseline == {0: 0.0}


def test_healthy_h100_run_gives_no_events_and_no_failure():
    watcher, per_poll = watch("h100_healthy.jsonl", {"trainer": None}, may_judge=lambda r: False, polls=range(2, 30))
    assert not any(per_poll) and watcher.failure is None
    assert watcher.last_summary["num_gpus"] == 1 and watcher.last_summary["mean_utilization_pct"] == 97


def test_trainer_gpu_gone_back_to_baseline_while_a_step_is_overdue_is_gpu_broken():
    watcher, per_poll = watch("h100_gpu_went_empty.jsonl", {"trainer": ["0"]}, polls=[10, 40, 42, 44, 46])
    events = [e for poll in per_poll for e in poll]
    assert [e["event"] for e in events] == ["gpu_empty"]
    assert events[0]["role"] == "trainer" and events[0]["gpus"] == [0] and events[0]["step"] == 41
    assert per_poll[3] == [events[0]]  # the third empty poll in a row (t = 40, 42, 44)
    f = watcher.failure
    assert f is not None and f.kind == FailureKind.GPU_BROKEN and f.retryable and f.step == 41
    assert "alive but broken" in f.message and "step 42" in f.message and "3 MiB" in f.message
    assert len(f.evidence) == 3 and all(json.loads(e)["utilization_pct"] == 0 for e in f.evidence)


def test_an_empty_gpu_is_not_judged_while_the_supervisor_says_it_may_not_be():
    # start-up, compile, eval, save, export, a rollout wait, or steps still advancing: may_judge is False
    watcher, per_poll = watch("h100_gpu_went_empty.jsonl", {"trainer": ["0"]}, may_judge=lambda r: False,
                              polls=range(40, 100, 2))  # fmt: skip
    assert watcher.failure is None and not any(per_poll)


def test_a_poll_that_is_not_empty_resets_the_count():
    judge = {"on": True}
    watcher, _ = watch("h100_gpu_went_empty.jsonl", {"trainer": ["0"]}, may_judge=lambda r: judge["on"], polls=[40, 42])
    judge["on"] = False  # progress moved: the supervisor withdraws the question
    watcher.poll()
    judge["on"] = True
    watcher.poll()
    watcher.poll()
    assert watcher.failure is None
    watcher.poll()
    assert watcher.failure is not None


def test_dead_vllm_worker_is_reported_for_a_restart_and_the_waiting_trainer_is_not_blamed():
    roles = {"inference-0": ["0"], "trainer": ["1"]}
    watcher, per_poll = watch("vllm_worker_died.jsonl", roles, polls=[10, 30, 32, 34, 36])
    events = [e for poll in per_poll for e in poll]
    assert [(e["event"], e["role"], e["gpus"]) for e in events] == [("gpu_empty", "inference-0", [0])]
    assert watcher.emptied == {"inference-0"} and watcher.failure is None
    # once restarted, the worker's GPUs get a fresh start
    watcher.forget("inference-0")
    assert watcher.emptied == set()


def test_on_an_8_gpu_box_only_the_jobs_4_gpus_are_judged():
    roles = {"trainer": visible_devices({"CUDA_VISIBLE_DEVICES": "4,5,6,7"})}
    busy, per_poll = watch("eight_gpus_job_has_four.jsonl", roles, polls=[10, 12, 14, 16])
    assert busy.failure is None and not any(per_poll)  # GPUs 0-3: another tenant's, idle; not the job's
    lost, _ = watch("eight_gpus_job_has_four.jsonl", roles, polls=[10, 40, 42, 44])
    assert lost.failure is not None and "GPU 4" in lost.failure.message and "GPU 7" in lost.failure.message
    assert "GPU 0" not in lost.failure.message


def test_gpus_named_by_uuid_prefix_are_the_roles_too():
    readings = ReplaySource(TRACES / "eight_gpus_job_has_four.jsonl").inventory()
    assert [r.index for r in readings_of(readings, [readings[5].uuid, "6"])] == [5, 6]
    # CUDA takes a unique prefix of a UUID too
    distinct = [
        GpuReading(0, "GPU-aaaa-1111", "H100", 0.0, 0.0, 1.0),
        GpuReading(1, "GPU-bbbb-2222", "H100", 0.0, 0.0, 1.0),
    ]
    assert [r.index for r in readings_of(distinct, ["GPU-bbbb"])] == [1]
    assert readings_of(readings, []) == [] and len(readings_of(readings, None)) == 8


@pytest.mark.parametrize(
    ("value", "devices"),
    [(None, None), ("", []), ("-1", []), ("0,1", ["0", "1"]), (" 4, 5 ", ["4", "5"]), ("2,-1,3", ["2"]),
     ("GPU-5f1c,MIG-ab", ["GPU-5f1c", "MIG-ab"])],
)  # fmt: skip
def test_cuda_visible_devices_is_read_as_cuda_reads_it(value, devices):
    env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert visible_devices(env) == devices


def test_xid_79_is_fatal_and_xid_13_is_only_a_warning():
    watcher, per_poll = watch("xid79.jsonl", {"trainer": None}, may_judge=lambda r: False, polls=[10, 12, 14, 16])
    xids = [e for poll in per_poll for e in poll if e["event"] == "gpu_xid"]
    assert [(e["gpu"], e["xid"], e["fatal"]) for e in xids] == [(0, 13, False), (1, 79, True)]
    assert "fallen off the bus" in xids[1]["meaning"]
    assert watcher.failure is not None and watcher.failure.kind == FailureKind.GPU_BROKEN
    assert "Xid 79" in watcher.failure.message
    # the lost GPU's unreadable fields (None) neither crash the watcher nor replace the first cause
    assert watcher.poll().records() == []
    assert "Xid 79" in watcher.failure.message


def test_a_replayed_xid_is_reported_once_even_when_polls_skip_its_line():
    clock = Clock()
    source = ReplaySource(TRACES / "xid79.jsonl", clock=clock)
    clock.now = source.started + 15  # past both XID lines at once
    assert sorted((r.index, x) for r in source.read() for x in r.xid) == [(0, 13), (1, 79)]
    assert all(not r.xid for r in source.read())


def test_uncorrected_ecc_increase_is_fatal_but_an_old_count_is_not():
    watcher, per_poll = watch("ecc.jsonl", {"trainer": None}, may_judge=lambda r: False, polls=[10, 12, 14])
    assert per_poll[0] == []
    assert per_poll[1] == [{"event": "gpu_ecc", "gpu": 1, "previous": 1, "current": 3, "fatal": True}]
    assert per_poll[2] == []
    assert watcher.failure is not None and "2 new uncorrected ECC" in watcher.failure.message


def test_throttling_warns_once_per_gpu_and_reason_not_every_poll():
    watcher, per_poll = watch("throttle.jsonl", {"trainer": None}, may_judge=lambda r: False, polls=[10, 12, 14, 16])
    events = [e for poll in per_poll for e in poll]
    assert len(events) == 1
    (warning,) = events
    assert warning["event"] == "gpu_throttle" and warning["gpu"] == 0
    assert warning["reasons"] == ["hw_thermal_slowdown", "sw_thermal_slowdown"] and warning["temperature_c"] == 87
    assert watcher.failure is None  # throttling slows a job; it does not break it


def test_replay_holds_the_latest_line_and_reads_nothing_before_the_first():
    clock = Clock()
    source = ReplaySource(TRACES / "h100_healthy.jsonl", clock=clock)
    assert source.read()[0].memory_used_mib == 0.0  # t = 0
    clock.now = source.started + 21.5
    assert source.read()[0].utilization_pct == 96
    late = ReplaySource(TRACES / "h100_healthy.jsonl", clock=clock)
    late.lines[0].t = 5.0
    assert late.read() == []


def test_recorder_writes_changes_and_a_line_a_minute_and_replays_them(tmp_path):
    clock = Clock()
    path = tmp_path / "gpu.jsonl"
    recorder = GpuRecorder(path, attempt=2, clock=clock)
    busy = GpuReading(0, "GPU-a", "H100", 97.0, 30000.0, 81559.0, [GpuProcess(7, None)])
    for t in range(0, 50, 2):  # steady state: one line
        clock.now = recorder.started + t
        recorder.record([busy])
    clock.now = recorder.started + 50
    recorder.record([GpuReading(0, "GPU-a", "H100", 0.0, 3.0, 81559.0)])  # a change that matters
    clock.now = recorder.started + 130
    recorder.record([GpuReading(0, "GPU-a", "H100", 0.0, 3.0, 81559.0)])  # a minute later: once more
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(line["attempt"], line["t"]) for line in lines] == [(2, 0.0), (2, 50.0), (2, 130.0)]
    replay = ReplaySource(path, attempt=2, clock=clock)
    clock.now = replay.started + 10
    assert replay.read() == [busy]


def test_a_replay_of_several_attempts_gives_each_attempt_its_own_lines(tmp_path):
    path = tmp_path / "gpu.jsonl"
    for attempt, used in ((1, 100.0), (2, 200.0)):
        GpuRecorder(path, attempt).record([GpuReading(0, "GPU-a", "H100", 0.0, used, 1000.0)])
    assert ReplaySource(path, attempt=1).read()[0].memory_used_mib == 100.0
    assert ReplaySource(path, attempt=2).read()[0].memory_used_mib == 200.0
    assert ReplaySource(path, attempt=5).read()[0].memory_used_mib == 200.0  # never reached: its last attempt


def test_a_bad_replay_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "gpu.jsonl"
    path.write_text('{"t": 0, "gpus": []}\n{"t": "soon", "gpus": []}\n')
    with pytest.raises(ValueError, match=r"gpu.jsonl:2: not a GPU reading line"):
        ReplaySource(path)


def test_inventory_comes_from_the_replay_when_one_is_named(monkeypatch):
    monkeypatch.setenv(ENV_GPU_REPLAY, str(TRACES / "eight_gpus_job_has_four.jsonl"))
    gpus = gpu_inventory()
    assert len(gpus) == 8 and {g.name for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    monkeypatch.delenv(ENV_GPU_REPLAY)
    assert gpu_inventory() == []  # this machine: no NVIDIA driver


def test_reading_survives_a_json_round_trip():
    r = GpuReading(3, "GPU-x", "H100", 12.5, 100.0, 81559.0, [GpuProcess(4242, None), GpuProcess(7, 99.5)],
                   xid=[13], ecc_uncorrected=0, throttle_reasons=["gpu_idle"])  # fmt: skip
    assert GpuReading.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_nvml_is_unavailable_here_and_the_watcher_degrades_cleanly():
    assert NvmlSource.available() is False
    source = NvmlSource()
    assert source.error is not None and "NVMLError" in source.error
    assert source.read() == []
    watcher = GpuHealthWatcher(source, roles=dict, may_judge=lambda r: True, current_step=lambda: 3)
    assert watcher.begin().records() == [{"event": "gpu_baseline", "memory_used_mib": {}}]
    assert watcher.poll().records() == [] and watcher.failure is None and watcher.last_summary is None
    source.close()


def test_a_source_that_raises_is_reported_once_and_not_fatal():
    class Broken:
        def read(self):
            raise RuntimeError("NVML: GPU is lost")

    watcher = GpuHealthWatcher(Broken(), roles=dict, may_judge=lambda r: True, current_step=lambda: 1)
    assert watcher.take_baseline() == []
    assert watcher.poll().records() == [{"event": "gpu_unreadable", "error": "RuntimeError: NVML: GPU is lost"}]
    assert watcher.poll().records() == [] and watcher.failure is None


def test_without_a_baseline_nothing_is_called_empty():
    watcher = GpuHealthWatcher(
        ReplaySource(TRACES / "h100_gpu_went_empty.jsonl"), roles=lambda: {"trainer": None},
        may_judge=lambda r: True, current_step=lambda: 1, broken_polls=1,
    )  # fmt: skip
    watcher.poll()
    assert watcher.failure is None and watcher.baseline == {}


def test_summary_gives_mean_utilisation_and_memory_per_gpu():
    gpus = [GpuReading(0, "a", "x", 40.0, 1024.0, 2048.0), GpuReading(1, "b", "x", 80.0, 3072.0, 4096.0),
            GpuReading(2, "c", "x", None, None, None)]  # fmt: skip
    s = summary(gpus)
    assert s["num_gpus"] == 3 and s["mean_utilization_pct"] == pytest.approx(60)
    assert s["memory_used_mib"] == 4096.0 and s["memory_used_gib"] == 4.0 and s["memory_total_mib"] == 6144.0
    assert summary([])["mean_utilization_pct"] is None


def test_broken_polls_must_be_positive():
    with pytest.raises(ValueError, match="broken_polls"):
        GpuHealthWatcher(
            ReplaySource(TRACES / "ecc.jsonl"), roles=dict, may_judge=bool, current_step=int, broken_polls=0
        )


def test_the_baseline_margin_is_below_a_cuda_context():
    # 518 MiB measured for a bare CUDA context on an H100: anything at or above it is a process on the GPU
    assert BASELINE_MARGIN_MIB < 518


# ---------------------------------------------------------------- measured on an H200 (a VM), a GPU shared by jobs

TENANT_LEFT = "h200_tenant_left.jsonl"  # baseline 1506 MiB with another job's 882; that job gone at t=2
STALLED = [6.1, 6.6, 7.1, 7.6]  # four polls of the t=6.03 line: 1665 MiB, 0 %, the trainer's context and another job's


def test_a_stalled_trainer_that_nvml_lists_on_its_gpu_is_not_called_empty():
    # the memory rule alone is fooled: the baseline held another job's 882 MiB, so the trainer's own 518 MiB
    # context plus a third job's stay within 256 MiB of it
    fooled, _ = watch(TENANT_LEFT, {"trainer": ["0"]}, polls=STALLED, role_pids=lambda role: set())
    assert fooled.failure is not None and "alive but broken" in fooled.failure.message
    # NVML lists the trainer's PID (1285, the resumed attempt's trainer): the role is on its GPU
    listed, per_poll = watch(TENANT_LEFT, {"trainer": ["0"]}, polls=STALLED, role_pids=lambda role: {1285, 1290})
    assert listed.failure is None and not any(per_poll)
    # a worker named in the list is there too; the trainer's PIDs do not vouch for a worker's GPU
    pids = {"inference-0": {1253}, "trainer": {99}}
    worker, per_poll = watch(TENANT_LEFT, {"inference-0": ["0"]}, polls=STALLED, role_pids=pids.__getitem__)
    assert not any(per_poll) and worker.emptied == set()


def test_the_baseline_follows_the_gpu_down_when_another_jobs_memory_is_freed():
    # polled from t=2.1 as the supervisor polls: the other job's memory leaves the baseline, the trainer's stays out
    watcher, per_poll = watch(TENANT_LEFT, {"trainer": ["0"]}, polls=[2.1, *STALLED], role_pids=None)
    assert watcher.failure is None
    assert per_poll[0] == [
        {"event": "gpu_baseline", "memory_used_mib": {"0": 618.4}, "reason": per_poll[0][0]["reason"]}
    ]
    assert watcher.baseline == {0: 618.375} and not any(per_poll[1:])
    # it never rises again: once the job's own memory is gone the GPU is empty against the lowered baseline
    gone = GpuReading(0, "GPU-x", "NVIDIA H200", 0.0, 620.0, 143771.0)
    watcher.source.read = lambda: [gone]
    for _ in range(3):
        watcher.poll()
    assert watcher.failure is not None and "holds 620 MiB, its 618 MiB from before" in watcher.failure.message
    assert watcher.baseline == {0: 618.375}


def test_small_moves_below_the_baseline_lower_it_quietly():
    watcher, _ = watch(TENANT_LEFT, {"trainer": ["0"]}, may_judge=lambda r: False)
    watcher.source.read = lambda: [GpuReading(0, "GPU-x", "NVIDIA H200", 0.0, 1400.0, 143771.0)]
    assert watcher.poll().records() == [] and watcher.baseline == {0: 1400.0}


def test_rl_on_one_h200_worker_and_trainer_sharing_gpu_0_is_healthy():
    # measured: tiny-rl with its embedded worker and the trainer on one H200, 0-22 % busy, judged from t=10 on
    roles = {"trainer": ["0"], "inference-0": ["0"]}
    watcher, per_poll = watch("h200_rl_one_gpu.jsonl", roles, polls=[t / 2 for t in range(20, 44)],
                              role_pids={"inference-0": {1493}, "trainer": {1496}}.__getitem__)  # fmt: skip
    assert watcher.failure is None and watcher.emptied == set() and not any(per_poll)
    assert {p.pid for p in watcher.last_readings[0].processes} == {1493, 1496}
    # the same readings judged by memory alone (a container): the two contexts keep the GPU above its baseline
    alone, per_poll = watch("h200_rl_one_gpu.jsonl", roles, polls=[t / 2 for t in range(20, 44)])
    assert alone.failure is None and not any(per_poll)
