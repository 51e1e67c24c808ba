"""On a real GPU (marked `gpu`, skipped without CUDA): what failed on an H100 while every CPU test passed.

Run on a GPU machine with one command: `pytest -m gpu` (in this project's lent-GPU setup:
`bash .gpu/run.sh pytest -m gpu -x`). The same behaviours are replayed on CPU elsewhere
(tests/test_gpu_replay.py, tests/test_checkpoint.py); these check them against the real device.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from enginetools import (
    TINY,
    TINY_RL,
    cli,
    env,
    free_port,
    losses_by_step,
    run_train,
    sigkill_the_trainer_once,
    start,
    tiny_overrides,
)

from prime_train.contract import read_json
from prime_train.kit.events import read_events

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with -m gpu on a GPU machine)"),
]


def supervised(tmp_path, name: str, config=TINY, timeout: float = 900, **overrides) -> subprocess.CompletedProcess:
    args = tiny_overrides(tmp_path, name, **{"supervisor.poll_interval_s": 1.0, **overrides})
    return subprocess.run(cli("run", str(config), *args), env=env(), capture_output=True, text=True, timeout=timeout)


def killed_at_step_20_and_resumed(tmp_path, name: str, **overrides):
    """A supervised run whose trainer is SIGKILLed once its step-20 checkpoint exists; returns its run directory
    after checking the run finished (exit 0) and its last attempt resumed from step 20."""
    run_dir = tmp_path / name
    proc = start(cli("run", str(TINY), *tiny_overrides(tmp_path, name, **{
        "ckpt.interval": 20, "supervisor.backoff_initial_s": 0.5, **overrides,
    })))  # fmt: skip
    out = sigkill_the_trainer_once(proc, run_dir, 20, timeout=900)
    assert proc.returncode == 0, out[-4000:]
    resumed = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "attempt_started"]
    assert resumed[-1]["resume_from"] == 20
    return run_dir


def test_qlora_run_survives_kill_9_and_exports_merged_and_adapter_on_the_gpu(tmp_path):
    # lora.quantize = "nf4" runs on CUDA only: the supervised path (quantize as the base moves to the GPU, adapter
    # checkpoints, resume into a freshly quantized base, merge of the dequantized base at export) is checked here
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    run_dir = killed_at_step_20_and_resumed(tmp_path, "gpu-qlora", **{
        "train.max_steps": 40, "lora.rank": 8, "lora.quantize": "nf4", "train.lr": 1e-2,
    })  # fmt: skip
    losses = losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, 41))
    assert losses[40] < losses[1]
    assert (run_dir / "final" / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert all(torch.isfinite(p).all() for p in merged.parameters())


def test_default_run_completes_under_the_gpu_watcher(tmp_path):
    # on the H100 the watcher called the start-up "alive but broken" and killed every attempt
    result = supervised(tmp_path, "gpu-default", **{"train.max_steps": 60})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    events = read_events(tmp_path / "gpu-default" / "events.jsonl")
    assert not [e for e in events if e["event"] in ("failure", "gpu_empty")]
    assert (tmp_path / "gpu-default" / "gpu.jsonl").is_file()


def test_async_saves_twice_and_more_on_the_gpu(tmp_path):
    # torch 2.11 closed its stager after the first save: the second crashed with KeyError: <class 'type'>
    result = run_train(tmp_path, "gpu-saves", **{"train.max_steps": 40, "ckpt.interval": 10, "ckpt.keep_last": 5})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    steps = sorted(int(p.name[5:]) for p in (tmp_path / "gpu-saves" / "checkpoints").glob("step-*"))
    assert steps[:3] == [10, 20, 30]


def test_kill_9_and_resume_on_the_gpu(tmp_path):
    run_dir = killed_at_step_20_and_resumed(tmp_path, "gpu-resume", **{"train.max_steps": 60})
    assert sorted(losses_by_step(run_dir)) == list(range(1, 61))


def test_rl_on_one_gpu_runs(tmp_path):
    # on the H100: a traceback from the GPU split ("inference needs 1 GPU(s) ... but 1 are visible")
    sft = run_train(tmp_path, "gpu-sft", **{"train.max_steps": 60, "data.datasets.0.num_examples": 20000})
    assert sft.returncode == 0, sft.stdout[-3000:]
    # tiny-rl.toml has no data.datasets (its prompts come from the environment): that override is left out
    result = supervised(tmp_path, "gpu-rl", config=TINY_RL, **{
        "train.max_steps": 6, "model.path": str(tmp_path / "gpu-sft" / "final"), "data.datasets.0.num_examples": None,
        "inference.base_port": free_port(),
    })  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert read_json(tmp_path / "gpu-rl" / "progress.json")["step"] == 6


def test_profile_on_the_gpu_judges_mfu(tmp_path):
    args = tiny_overrides(tmp_path, "gpu-prof")
    result = subprocess.run(
        cli("profile", str(TINY), *args, "--steps", "3", "--warmup", "2", "--json"), env=env(),
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["device"].startswith("cuda")
    assert summary["bottleneck"]["kind"] != "compute-bound" or summary["mfu"] >= 0.3


def test_engine_steps_at_gpt2_shape_make_no_host_sync_between_logging_steps():
    # issue 17: the engine's non-logging steps must not wait for the device (set_sync_debug_mode counts them);
    # the bench prints ms/step, tokens/s, MFU and the ratio to a nanoGPT-style loop at the same shape
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "vs_nanogpt.py"
    result = subprocess.run(
        [sys.executable, str(bench), "--shape", "gpt2", "--sides", "engine,native", "--rounds", "2", "--steps", "10",
         "--warmup", "5"],
        env=env(), capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "host syncs in non-logging engine steps: 0" in result.stdout
