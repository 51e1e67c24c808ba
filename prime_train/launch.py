"""How a training job is started: one Python process, or torchrun for several, and the environment it gets.

Torch-free on purpose: the supervisor and `prime-train train` (resilience/service.py) build the same argv and the
same environment without importing torch.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prime_train.config.schema import Config
from prime_train.contract import ENV_ATTEMPT, ENV_RUN_DIR, ENV_SUPERVISOR, ExitCode, Heartbeat, replace_file_atomic
from prime_train.cpu_share import usable_cores
from prime_train.rundir import RunDir

if TYPE_CHECKING:
    from prime_train.kit.redact import MaskedConfig

# The module each job runs as (`python -m MODULE --config RUN/config.toml`, under torchrun for several processes).
JOB_MODULES = {
    "sft": "prime_train.engine.train",
    "pretrain": "prime_train.engine.train",
    "rl": "prime_train.rl.train",
    "reward": "prime_train.engine.reward",
    "dpo": "prime_train.engine.dpo",
    "meta": "prime_train.engine.meta",
}


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
    threads: tuple[int, str] = (1, "")  # OMP_NUM_THREADS of each process, and why that many


def user_threads(cfg: Config) -> tuple[int, str] | None:
    """The threads the user chose, and where: an exported OMP_NUM_THREADS, else train.threads; None if neither."""
    exported = os.environ.get("OMP_NUM_THREADS", "").strip()
    if exported.isdigit() and int(exported) > 0:
        return int(exported), f"OMP_NUM_THREADS={exported} exported"
    if cfg.train.threads:
        return cfg.train.threads, "train.threads"
    return None


def cpu_threads(cfg: Config, nproc: int) -> tuple[int, str]:
    """CPU threads for each of the node's `nproc` trainer processes, and why: an exported OMP_NUM_THREADS, else
    train.threads, else the cores free now. torch sizes its pool to every core whatever else runs; on a busy
    machine its threads then wait on each other (the trial: 3x the CPU time a step at load average 5 on 2
    cores), so a shared machine slows the job in proportion to what is free, not 3x."""
    if (chosen := user_threads(cfg)) is not None:
        return chosen
    cores = usable_cores()
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    free = max(1, min(cores, int(cores - load + 0.5)))
    split = f", split between {nproc} processes" if nproc > 1 else ""
    why = f"{free} of {cores} cores free (load average {load:.1f}){split}; set train.threads to choose"
    return max(1, free // nproc), why


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
    threads = cpu_threads(cfg, nproc)
    env["OMP_NUM_THREADS"] = str(threads[0])
    if user_threads(cfg) is None:
        # chosen for the run: each trainer shares them with other runs' trainers as they come and go (cpu_share.py)
        env["PRIME_TRAIN_THREADS"] = "auto"
    if nproc == 1 and nnodes == 1:
        return LaunchPlan([sys.executable, "-m", *job], env, threads=threads)
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
    return LaunchPlan(argv, env, world_size=nproc * nnodes, uses_torchrun=True, threads=threads)


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


def job_environment(
    cfg: Config,
    run_dir: RunDir,
    *,
    attempt: int,
    supervisor_token: str,
    launch_env: Mapping[str, str] | None,
    extra: Mapping[str, str] | None = None,
    masked: MaskedConfig | None = None,
) -> dict[str, str]:
    """What a job's child process gets on top of the environment it inherits (os.environ), for the supervisor's
    attempts and `prime-train train` alike; the caller starts it with `{**os.environ, **job_environment(...)}`.

    - the real values of config.toml's `***` (`masked.env`, the config file the child reads as it was masked;
      default `masked_run_config(cfg)`, what `write_run_config` writes): config.loader restores them;
    - PYTHONUNBUFFERED=1, so the child's output reaches its log as it is written;
    - PRIME_TRAIN_RUN_DIR (the run directory, absolute), PRIME_TRAIN_ATTEMPT (`attempt`, from 1),
      PRIME_TRAIN_SUPERVISOR (`supervisor_token`, "<pid>:<create time>" of the owner: the job stops when that
      process is gone, engine/lifeline.py);
    - `extra` over all of these (the supervisor's own extra variables, the trainer's CUDA_VISIBLE_DEVICES);
    - `launch_env`, the launch plan's variables (OMP_NUM_THREADS, ...), each only where none of the above set it,
      and a value the user exported wins over the plan's; None for a job that is no launch plan of ours (an
      external [job].command), which gets neither these nor the next;
    - CUDA_DEVICE_ORDER=PCI_BUS_ID unless `extra` sets it: GPU numbers as nvidia-smi and NVML count them, which
      CUDA_VISIBLE_DEVICES and the GPU watcher use.
    """
    env = {
        **(masked if masked is not None else masked_run_config(cfg)).env,
        "PYTHONUNBUFFERED": "1",
        ENV_RUN_DIR: os.path.abspath(run_dir.root),
        ENV_ATTEMPT: str(attempt),
        ENV_SUPERVISOR: supervisor_token,
        **(extra or {}),
    }
    if launch_env is None:
        return env
    for k, v in launch_env.items():
        env.setdefault(k, os.environ.get(k, v))
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    return env
