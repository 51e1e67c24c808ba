"""Helpers shared by the tests: the CLI and the engine in real subprocesses, free ports, tiny models.

Fixtures live in conftest.py; these are plain functions, for module-level helpers and parametrisation.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "prime_train" / "configs" / "tiny-sft.toml"
TINY_RL = REPO / "prime_train" / "configs" / "tiny-rl.toml"
# a wide, colourless terminal: help and tables do not wrap, output has no escape codes
WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prime_train", *args]


def run_cli(*args: str, cwd: Path = REPO, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `prime-train ARGS` in a fresh interpreter, as a user would, on a wide terminal."""
    return subprocess.run(
        cli(*args), cwd=cwd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **WIDE}
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_llama(seed: int = 0, *, tie: bool = False, **config):
    """A random-initialised 2-layer Llama (hidden 32, vocab 64) in eval mode; `config` overrides LlamaConfig fields."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = dict(
        hidden_size=32,
        num_hidden_layers=2,
        vocab_size=64,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(LlamaConfig(**{**shape, **config}, tie_word_embeddings=tie)).eval()


def env() -> dict[str, str]:
    out = dict(os.environ)
    out.setdefault("OMP_NUM_THREADS", "1")
    out["PYTHONUNBUFFERED"] = "1"
    return out


def tiny_overrides(out: Path, name: str, **extra) -> list[str]:
    """Overrides that keep an engine test small: a short run, frequent checkpoints, no TensorBoard."""
    base = {
        "run.output_dir": str(out),
        "run.name": name,
        "train.max_steps": 20,
        "train.eval_interval": 1000,
        "ckpt.interval": 10,
        "logging.tensorboard": "false",
        "logging.log_interval": 5,
        "data.datasets.0.num_examples": 4000,
    }
    base.update(extra)
    args: list[str] = []
    for key, value in base.items():
        if value is None:  # a key this config must not get (tiny-rl.toml has no data.datasets)
            continue
        args += [f"--{key}", str(value)]
    return args


def run_train(
    out: Path, name: str, timeout: float = 600, flags: tuple[str, ...] = (), **extra
) -> subprocess.CompletedProcess:
    return subprocess.run(
        cli("train", str(TINY), *tiny_overrides(out, name, **extra), *flags),
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start(argv: list[str], **kw) -> subprocess.Popen:
    """Start `argv` in its own session (kill_group ends it and its children), output merged into stdout."""
    kw.setdefault("env", env())
    return subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kw
    )


def wait_for(predicate, timeout: float, what: str, poll: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def sigkill_the_trainer_once(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 600) -> str:
    """Once the step-`step` checkpoint of the supervised run `proc` (started with `start`) exists, SIGKILL its
    trainer (the pid events.jsonl names) and wait for the run to end; returns its output. Ends the group either way."""
    from prime_train.kit.events import read_events

    try:
        wait_for((run_dir / "checkpoints" / f"step-{step}").is_dir, timeout, f"the step-{step} checkpoint")
        trainer = next(
            e["pid"] for e in read_events(run_dir / "events.jsonl")
            if e["event"] == "process_started" and e["process"] == "trainer"
        )  # fmt: skip
        os.kill(trainer, signal.SIGKILL)
        out, _ = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return out


def kill_everything_once(proc: subprocess.Popen, ready: Path, timeout: float = 300) -> list:
    """Once `ready` exists, kill -9 the CLI and every process under it at once, as a machine dies: torchrun starts
    each rank in a session of its own, so killing the CLI's group alone would leave ranks that notice their
    supervisor gone and save a checkpoint on their way out. Returns the processes killed (psutil.Process)."""
    import psutil

    tree: list = []
    try:
        wait_for(ready.exists, timeout, str(ready))
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        proc.wait(30)  # the CLI through Popen (psutil would reap it first and leave Popen a return code of 0)
        psutil.wait_procs(tree[1:], timeout=30)
    finally:
        kill_group(proc, signal.SIGKILL)
    return tree


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The last recorded loss of each training step (a resumed run rewrites the steps after its checkpoint)."""
    out: dict[int, float] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "loss" in record and record.get("step", 0) > 0:
            out[record["step"]] = record["loss"]
    return out


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def final_weights(run_dir: Path) -> dict:
    files = sorted((run_dir / "final").glob("*.safetensors"))
    assert files, f"no safetensors in {run_dir / 'final'}"
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights
