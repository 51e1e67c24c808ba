"""Rollout workers as supervised children: their argv, GPU placement, and an HTTP health watcher.

Torch-free. A dead or wedged worker is restarted on its own while the trainer keeps going: the
trainer's RolloutPool sends requests to the workers that answer.
"""

from __future__ import annotations

import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from prime_train.config.schema import Config
from prime_train.resilience.process import ProcessSpec


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def resolve_backend(cfg: Config, num_gpus: int, *, have_vllm: bool | None = None) -> str:
    """'embedded' or 'vllm': vLLM needs CUDA GPUs and the vllm package; 'auto' takes it when both are there."""
    backend = cfg.inference.backend
    have_vllm = vllm_installed() if have_vllm is None else have_vllm
    if backend == "embedded":
        return "embedded"
    if backend == "vllm":
        if num_gpus == 0:
            raise ValueError(
                "inference.backend = 'vllm' needs CUDA GPUs and none are visible; use 'embedded' (or 'auto') on CPU"
            )
        if not have_vllm:
            raise ValueError(
                "inference.backend = 'vllm' but vllm is not installed: pip install vllm (a CUDA build of torch comes "
                "with it), or use 'embedded'"
            )
        return "vllm"
    return "vllm" if num_gpus > 0 and have_vllm and cfg.model.path is not None else "embedded"


def gpu_split(cfg: Config, num_gpus: int) -> tuple[list[int], list[list[int]]]:
    """GPUs of the trainer and of each worker: workers take the first ones, the trainer the rest.

    With inference.colocate every process sees every GPU (the user keeps gpu_memory_utilization low).
    """
    inf = cfg.inference
    if num_gpus == 0:
        return [], [[] for _ in range(inf.num_workers)]
    if inf.colocate:
        every = list(range(num_gpus))
        return every, [every for _ in range(inf.num_workers)]
    need = inf.num_workers * inf.gpus_per_worker
    if need >= num_gpus:
        raise ValueError(
            f"inference needs {need} GPU(s) (inference.num_workers × gpus_per_worker) and the trainer at least one, "
            f"but {num_gpus} are visible; lower inference.num_workers or set inference.colocate = true"
        )
    workers = [list(range(i * inf.gpus_per_worker, (i + 1) * inf.gpus_per_worker)) for i in range(inf.num_workers)]
    return list(range(need, num_gpus)), workers


def inference_specs(
    cfg: Config, config_path: str, num_gpus: int, *, have_vllm: bool | None = None
) -> list[ProcessSpec]:
    backend = resolve_backend(cfg, num_gpus, have_vllm=have_vllm)
    module = "prime_train.rl.vllm_server" if backend == "vllm" else "prime_train.rl.worker"
    _, devices = gpu_split(cfg, num_gpus)
    specs = []
    for i in range(cfg.inference.num_workers):
        # spawn, not fork: a forked vLLM worker inherits an initialised CUDA context and hangs (prime-rl sets it
        # too); the embedded worker ignores it
        env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
        if num_gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices[i]))
        argv = [sys.executable, "-m", module, "--config", config_path, "--index", str(i)]
        specs.append(ProcessSpec(f"inference-{i}", argv, env, role="inference"))
    return specs


def http_healthy(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class InferenceHealthWatcher:
    """Asks each worker's /health with a bounded timeout; a worker that answered before and then misses
    `misses` polls in a row is wedged (alive as a process, useless as a server)."""

    def __init__(
        self,
        urls: dict[str, str],
        *,
        timeout_s: float,
        misses: int = 3,
        check: Callable[[str, float], bool] = http_healthy,
    ):
        self.urls = urls
        self.timeout_s = timeout_s
        self.misses = misses
        self.check = check
        self.seen_healthy: set[str] = set()
        self.failed_polls: dict[str, int] = {}
        self.wedged: set[str] = set()
        self.failure = None  # a worker problem never ends the attempt by itself: the supervisor restarts it

    def forget(self, name: str) -> None:
        """The worker was restarted: it gets a fresh start-up."""
        self.seen_healthy.discard(name)
        self.failed_polls.pop(name, None)
        self.wedged.discard(name)

    def poll(self) -> list[dict[str, Any]]:
        events = []
        for name, url in self.urls.items():
            if name in self.wedged:
                continue
            t0 = time.time()
            ok = self.check(url, self.timeout_s)
            if ok:
                if name not in self.seen_healthy:
                    events.append({"event": "inference_healthy", "process": name, "url": url})
                self.seen_healthy.add(name)
                self.failed_polls[name] = 0
                continue
            if name not in self.seen_healthy:
                continue  # still starting: its start-up is bounded by the trainer's wait and the process watcher
            self.failed_polls[name] = self.failed_polls.get(name, 0) + 1
            if self.failed_polls[name] >= self.misses:
                self.wedged.add(name)
                events.append(
                    {"event": "inference_wedged", "process": name, "url": url, "misses": self.failed_polls[name],
                     "last_wait_s": round(time.time() - t0, 2)}
                )  # fmt: skip
        return events
