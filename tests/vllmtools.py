"""The real vLLM server for the `vllm` tests: started as the supervisor starts a rollout worker.

Plain functions and a small class; the session fixture that uses them is in conftest.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from enginetools import free_port

from prime_train.config.loader import dump_toml
from prime_train.config.schema import Config
from prime_train.rl.client import WorkerClient
from prime_train.rl.workers import gpu_plan, inference_specs

MAX_MODEL_LEN = 128
STARTUP_TIMEOUT_S = 420.0  # measured here: ~45 s alone; a loaded 2-core machine takes several times that


def vllm_config(root: Path, model: Path, python: str, **inference) -> Config:
    """An RL config whose one worker is vLLM serving `model` on the CPU."""
    cfg = Config.model_validate(
        {
            "run": {"name": "vllm", "output_dir": str(root), "job": "rl", "seed": 3},
            "model": {"path": str(model)},
            "inference": {
                "backend": "vllm", "python": python, "base_port": free_port(), "max_model_len": MAX_MODEL_LEN,
                "max_num_seqs": 32, "request_timeout_s": 120.0, **inference,
            },
        }
    )  # fmt: skip
    return cfg


@dataclass
class VllmServer:
    """A running vLLM server: its config, URL, process, log and how long it took to answer /health."""

    cfg: Config
    url: str
    proc: subprocess.Popen
    log: Path
    startup_s: float

    def client(self, timeout_s: float = 120.0) -> WorkerClient:
        return WorkerClient(self.url, timeout_s, backend="vllm")

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def start_vllm_server(python: str, model: Path, root: Path, **inference) -> VllmServer:
    """Start one worker's vLLM server the way the supervisor does and wait for /health (its log on failure)."""
    cfg = vllm_config(root, model, python, **inference)
    config_path = root / "config.toml"
    config_path.write_text(dump_toml(cfg))
    (spec,) = inference_specs(cfg, str(config_path), gpu_plan(cfg, []))
    log = root / "vllm.log"
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            spec.argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **spec.env}, start_new_session=True
        )
    url = f"http://127.0.0.1:{cfg.inference.base_port}"
    client = WorkerClient(url, 10.0, backend="vllm")
    while not client.health(timeout_s=2.0):
        if proc.poll() is not None or time.monotonic() - t0 > STARTUP_TIMEOUT_S:
            server = VllmServer(cfg, url, proc, log, time.monotonic() - t0)
            server.stop()
            raise AssertionError(f"vLLM did not become healthy (exit {proc.returncode}):\n{log.read_text()[-6000:]}")
        time.sleep(0.5)
    return VllmServer(cfg, url, proc, log, time.monotonic() - t0)
