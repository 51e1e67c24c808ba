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
    """The tiny SFT model RL starts from: 120 steps of reverse-text (held-out exact match ~0.8), built once."""
    out = tmp_path_factory.mktemp("sft")
    result = run_train(out, "sft", **{"train.max_steps": 120, "data.datasets.0.num_examples": 20000,
                                      "ckpt.interval": 1000})  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:]
    return out / "sft" / "final"
