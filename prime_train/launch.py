"""How a training job is started: one Python process, or torchrun for several; and `prime-train train`.

Torch-free on purpose: the supervisor builds the same argv without importing torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from prime_train.config.schema import Config
from prime_train.contract import ENV_SUPERVISOR, ExitCode, Heartbeat, RunDir, read_heartbeat, replace_file_atomic

if TYPE_CHECKING:
    from prime_train.kit.redact import MaskedConfig

# The module each job runs as (`python -m MODULE --config RUN/config.toml`, under torchrun for several processes).
JOB_MODULES = {"sft": "prime_train.engine.train", "pretrain": "prime_train.engine.train", "rl": "prime_train.rl.train"}


def gpu_devices() -> list[str]:
    """The GPUs a run here may use, as CUDA_VISIBLE_DEVICES entries: the user's own list when it is set, else
    every GPU NVML sees (or the recording PRIME_TRAIN_GPU_REPLAY names); [] on a machine without NVIDIA GPUs."""
    from prime_train.kit.gpu import ENV_GPU_REPLAY, gpu_inventory, readings_of, visible_devices

    devices = visible_devices()
    if devices is not None and not os.environ.get(ENV_GPU_REPLAY):
        return devices
    inventory = gpu_inventory()
    if devices is None:
        return [str(r.index) for r in inventory]
    # a replayed machine seen through the user's mask: the entries that name one of its GPUs
    return [d for d in devices if readings_of(inventory, [d])]


def visible_gpu_count() -> int:
    """How many GPUs a run here may use (gpu_devices); 0 on a machine without NVIDIA GPUs."""
    return len(gpu_devices())


def procs_per_node(cfg: Config, num_gpus: int | None = None) -> int:
    """`distributed.nproc_per_node`, or one per GPU the trainer gets (`num_gpus`, default every visible one), or 1."""
    if cfg.distributed.nproc_per_node:
        return cfg.distributed.nproc_per_node
    return max(1, visible_gpu_count() if num_gpus is None else num_gpus)


def node_rank(cfg: Config) -> int:
    if cfg.distributed.node_rank is not None:
        return cfg.distributed.node_rank
    return int(os.environ.get("SKYPILOT_NODE_RANK", "0"))


def rendezvous_endpoint(cfg: Config) -> str:
    """host:port of the c10d rendezvous: the config, else SkyPilot's first node, else this host."""
    if cfg.distributed.rdzv_endpoint:
        return cfg.distributed.rdzv_endpoint
    ips = [ip.strip() for ip in os.environ.get("SKYPILOT_NODE_IPS", "").splitlines() if ip.strip()]
    host = ips[0] if ips else "127.0.0.1"
    return f"{host}:{cfg.distributed.master_port}"


@dataclass
class LaunchPlan:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    world_size: int = 1
    uses_torchrun: bool = False


def plan_engine_launch(
    cfg: Config, config_path: str, *, log_dir: str | None = None, num_gpus: int | None = None
) -> LaunchPlan:
    """The argv that runs the embedded engine on the resolved config written at `config_path`.

    `num_gpus`: the GPUs the trainer is given (after RL's workers took theirs); default every visible one.
    """
    nproc = procs_per_node(cfg, num_gpus)
    nnodes = cfg.distributed.nnodes
    job = [JOB_MODULES[cfg.run.job], "--config", config_path]
    env = {"PYTHONUNBUFFERED": "1"}
    # torch's default of 1 thread per rank is safe but slow on CPU; split the cores between local ranks instead
    cores = os.cpu_count() or 1
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    if nproc == 1 and nnodes == 1:
        return LaunchPlan([sys.executable, "-m", *job], env)
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if nnodes == 1:
        argv.append("--standalone")
    else:
        # The static rendezvous, not c10d: c10d ignores --node-rank and numbers nodes by arrival, so global rank 0
        # (metrics, the final export, the checkpoint's rename) could land on any node (pytorch/pytorch#150660).
        # Static gives rank = node_rank * nproc + local_rank: rank 0 is on node 0, where the user looks. Nothing is
        # lost: the supervisors restart a failed attempt, never torchrun's elastic restarts (--max-restarts=0).
        argv += [
            f"--nnodes={nnodes}",
            f"--node-rank={node_rank(cfg)}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={rendezvous_endpoint(cfg)}",
            f"--rdzv-id={os.environ.get('SKYPILOT_TASK_ID', cfg.run.name)}",
            f"--rdzv-conf=timeout={int(cfg.distributed.join_timeout_s)}",
            "--max-restarts=0",
        ]
    # only local rank 0 reaches the console; every rank's output still lands in log_dir when given
    argv.append("--local-ranks-filter=0")
    if log_dir:
        argv += [f"--log-dir={log_dir}", "--tee=3"]
    argv += ["-m", *job]
    return LaunchPlan(argv, env, world_size=nproc * nnodes, uses_torchrun=True)


def job_exit_code(returncode: int, heartbeat: Heartbeat | None, started_at: float) -> int:
    """The job's own exit code: torchrun reports any worker failure as 1, so read the heartbeat's verdict.

    The engine writes `exit_code` into progress.json before it exits 75 or 78; a heartbeat older than
    this attempt (`started_at`) is not evidence.
    """
    if returncode in (ExitCode.OK, ExitCode.PREEMPTED, ExitCode.CONFIG) or heartbeat is None:
        return returncode
    if heartbeat.exit_code is not None and (heartbeat.time or 0) >= started_at:
        return heartbeat.exit_code
    return returncode


def write_run_config(cfg: Config) -> RunDir:
    """Create the run directory and keep the resolved config in it, as run, secret values as `***` (the job
    reads the real ones from the environment `masked_run_config(cfg).env` gives it)."""
    run_dir = cfg.layout
    run_dir.create()
    # a new file renamed over config.toml: a link planted there is replaced, never written through
    replace_file_atomic(run_dir.config_path, masked_run_config(cfg).text.encode("utf-8"), mode=0o666)
    return run_dir


def masked_run_config(cfg: Config) -> MaskedConfig:
    """The run's config.toml text with secrets masked, and the job's environment that restores them."""
    from prime_train.kit.redact import Redactor

    return Redactor.for_run(cfg).masked_config(cfg)


def train_directly(cfg: Config, decide: Callable[[], bool] | None = None) -> int:
    """Train in the foreground; SIGTERM is passed on so the job checkpoints and exits 75.

    Like `prime-train run`, it owns the run directory while it trains (contract.RunDirBusy when another
    process does), ends what a killed predecessor left running, and its job stops when it is gone.
    `decide`, called once the directory is owned (so what it holds cannot change under it), says whether to
    train at all: a finished run is not trained again unasked (resilience/rerun.py); 0 when it says no.
    """
    from prime_train.kit.ownership import claim_run_dir, end_orphans, record_processes, supervisor_token

    with claim_run_dir(cfg.layout, "prime-train train"):
        end_orphans(cfg.layout, cfg.supervisor.term_grace_s)
        if decide is not None and not decide():
            return ExitCode.OK
        run_dir = write_run_config(cfg)
        plan = plan_engine_launch(cfg, str(run_dir.config_path))
        env = {**os.environ, **{k: v for k, v in plan.env.items() if k not in os.environ}}
        env[ENV_SUPERVISOR] = supervisor_token()
        env.update(masked_run_config(cfg).env)  # the real values of config.toml's ***
        started = time.time()
        child = subprocess.Popen(plan.argv, env=env)
        with contextlib.suppress(psutil.Error):
            record_processes(run_dir, {"trainer": [psutil.Process(child.pid)]})

        def forward(signum, frame):
            child.send_signal(signum)

        # Ctrl-C reaches the child through the terminal's process group; we only have to outlive it
        previous = {s: signal.signal(s, h) for s, h in ((signal.SIGTERM, forward), (signal.SIGINT, signal.SIG_IGN))}
        try:
            returncode = child.wait()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        record_processes(run_dir, {})
        return job_exit_code(returncode, read_heartbeat(run_dir.progress_path), started)
