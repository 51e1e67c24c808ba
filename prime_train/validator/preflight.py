"""`prime-train preflight`: what would kill a run at step 15, found in its first seconds.

Each check is one function returning a `CheckResult` (pass / warn / fail, a message, and for a fail the
fix: a config key or a command). `run_preflight` runs them all; the supervisor calls it before it
launches anything. Torch-free: whether CUDA works is asked of a short subprocess with a timeout, so a
hung driver cannot hang the supervisor.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import json
import netrc
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from prime_train.config.schema import Config
from prime_train.contract import ExitCode
from prime_train.kit.gpu import ENV_GPU_REPLAY, replayed_probe
from prime_train.launch import node_rank, procs_per_node, rendezvous_endpoint, visible_gpu_count
from prime_train.validator.checks import FAIL, PASS, WARN, CheckResult
from prime_train.validator.lora_checks import check_lora
from prime_train.validator.memory import estimate, inputs_from_config, resolved_strategy
from prime_train.validator.memory_breakdown import STATE_PARTS
from prime_train.validator.memory_inputs import MemoryInputError
from prime_train.validator.model_files import hub_model_unavailable
from prime_train.validator.model_shape import model_shape
from prime_train.validator.precision_checks import check_float8
from prime_train.validator.rl_checks import rl_preflight_checks
from prime_train.validator.storage_checks import (
    DiskUsage,
    check_disk,
    check_shared_memory,
)
from prime_train.validator.storage_checks import existing_ancestor as _existing_ancestor
from prime_train.validator.storage_checks import human_bytes as _human

try:
    import resource
except ImportError:  # Windows has no rlimits
    resource = None  # type: ignore[assignment]

# Open files the job needs. Without inference workers, 4096: torch's DataLoader workers pass tensors to the
# trainer as file descriptors (Linux's default "file_descriptor" sharing strategy, one fd per tensor in flight),
# DCP saves open files per rank and thread, and logs, sockets and tokenizer files add more; 1024, a common
# default, is the classic "Too many open files". With vLLM workers 65536 is recommended: an RL trainer keeps
# hundreds to thousands of rollout requests in flight, each an HTTP connection with a socket at both ends, and
# vLLM adds ZMQ sockets between its processes; vLLM itself raises its soft limit to 65535 at start and only
# warns when the hard limit stops it, so below 65536 (but above the trainer's need) is a warning, not a failure:
# many hosts cap the hard limit lower (20000 on the machines this project is built on).
NOFILE_TRAINER = 4096
NOFILE_WITH_VLLM = 65536

CUDA_PROBE_TIMEOUT_S = 60.0

# Per process beyond the model: the CUDA context, cuBLAS workspaces and NCCL buffers on a GPU; the Python
# interpreter and torch's own allocations in host RAM on the CPU.
GPU_OVERHEAD_BYTES = 1 << 30
CPU_OVERHEAD_BYTES = 512 << 20
MEMORY_WARN_FRACTION = 0.8

GpuProbe = Callable[[int], dict[str, Any]]


# ---------------------------------------------------------------- open files


def inference_workers(cfg: Config) -> int:
    """The rollout workers a run starts beside its trainer: inference.num_workers for the embedded RL job."""
    return cfg.inference.num_workers if cfg.run.job == "rl" and not cfg.job.command else 0


def open_files_needed(cfg: Config) -> tuple[int, int]:
    """(needed, recommended) open files: the trainer's need, and vLLM's own target when vLLM workers run."""
    if inference_workers(cfg) == 0:
        return NOFILE_TRAINER, NOFILE_TRAINER
    from prime_train.rl.workers import resolve_backend

    try:
        backend = resolve_backend(cfg, visible_gpu_count())
    except ValueError:
        backend = cfg.inference.backend  # the GPU placement check reports why it cannot be used
    return NOFILE_TRAINER, NOFILE_WITH_VLLM if backend == "vllm" else NOFILE_TRAINER


def check_open_files(needed: int = NOFILE_TRAINER, recommended: int | None = None) -> CheckResult:
    """Raise the soft open-files limit to the hard one (children inherit it); fail below `needed`, warn below
    `recommended`."""
    recommended = max(needed, recommended or needed)
    if resource is None:
        return CheckResult("open_files", PASS, "no open-files limit on this platform")
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = hard == resource.RLIM_INFINITY
    # Linux refuses an infinite soft limit for files (it is capped by fs.nr_open): ask for what is wanted then
    target = max(before, recommended) if unlimited else hard
    if before < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    details = {
        "soft_before": before, "soft": soft, "hard": None if unlimited else hard, "needed": needed,
        "recommended": recommended,
    }  # fmt: skip
    raised = f" (raised from {before})" if soft > before else ""
    enough = soft == resource.RLIM_INFINITY or soft >= recommended
    if enough:
        return CheckResult("open_files", PASS, f"limit {soft}{raised}, {recommended} wanted", details=details)
    want = needed if soft < needed else recommended
    fix = f"run `ulimit -n {want}` in the shell that starts prime-train"
    if not unlimited and hard < want:
        fix += (
            f"; the hard limit ({hard}) is below it: add `* hard nofile {want}` and `* soft nofile {want}` "
            "to /etc/security/limits.conf and log in again (in Docker: --ulimit nofile="
            f"{want}:{want})"
        )
    limit = f"open-files limit is {soft} (hard {hard if not unlimited else 'unlimited'})"
    if soft >= needed:
        return CheckResult(
            "open_files",
            WARN,
            f"{limit}: enough for the trainer ({needed}), below the {recommended} vLLM raises itself to; under "
            "heavy rollout load it may fail with 'Too many open files'",
            fix,
            details,
        )
    return CheckResult("open_files", FAIL, f"{limit}; {needed} needed", fix, details)


# ---------------------------------------------------------------- CUDA

_PROBE_SCRIPT = r"""
import json, sys
requested = int(sys.argv[1])
out = {"error": None, "torch_version": None, "cuda_version": None, "cuda_available": False,
       "device_count": 0, "devices": [], "nvml_count": None, "nvml_error": None}
try:
    import pynvml
    pynvml.nvmlInit()
    try:
        out["nvml_count"] = int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()
except Exception as exc:
    out["nvml_error"] = f"{type(exc).__name__}: {exc}"
try:
    import torch
    out["torch_version"] = torch.__version__
    out["cuda_version"] = torch.version.cuda
    out["cuda_available"] = bool(torch.cuda.is_available())
    if out["cuda_available"]:
        out["device_count"] = torch.cuda.device_count()
        for i in range(min(requested, out["device_count"])):
            dev = {"index": i, "ok": False, "error": None}
            try:
                torch.ones(1, device=f"cuda:{i}").add_(1)
                torch.cuda.synchronize(i)
                props = torch.cuda.get_device_properties(i)
                free, total = torch.cuda.mem_get_info(i)
                dev.update(name=props.name, total_memory_mib=total / 2**20, free_memory_mib=free / 2**20, ok=True,
                           capability=[props.major, props.minor])
            except Exception as exc:
                dev["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            out["devices"].append(dev)
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""


def probe_gpus(num_devices: int, timeout_s: float = CUDA_PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Create a CUDA context on each of the first `num_devices` GPUs in a subprocess; report what worked, as data."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _PROBE_SCRIPT, str(num_devices)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # a process stuck in the driver may ignore even SIGKILL for a while: do not wait on it for long
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=5)
        return {"error": f"creating CUDA contexts did not finish within {timeout_s:.0f} s (a hung driver or GPU?)"}
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = " | ".join(stderr.strip().splitlines()[-3:]) or f"exit code {proc.returncode}, no output"
        return {"error": f"the CUDA probe failed: {tail}"}


def _gpu_requirements(cfg: Config) -> list[str]:
    """Settings that only work on a GPU, as `key = value` strings."""
    needs = []
    if cfg.model.attn_implementation == "flash_attention_2":
        needs.append("model.attn_implementation = 'flash_attention_2'")
    if cfg.distributed.backend == "nccl":
        needs.append("distributed.backend = 'nccl'")
    if cfg.train.float8:
        needs.append("train.float8 = true")
    return needs


def check_cuda(cfg: Config, gpu_probe: GpuProbe | None = None) -> CheckResult:
    """Every GPU the job asks for takes a CUDA context, NVML sees it, and the counts match."""
    visible = visible_gpu_count()
    needs = _gpu_requirements(cfg)
    if visible == 0 and not needs:
        return CheckResult("cuda", PASS, "CPU run: no GPU visible and none needed", details={"gpu_run": False})
    # one GPU per local rank; a config that needs a GPU on a machine showing none asks for at least one
    requested = procs_per_node(cfg) if visible else max(1, cfg.distributed.nproc_per_node or 1)
    probe = (gpu_probe or probe_gpus)(requested)
    devices = probe.get("devices") or []
    details = {"gpu_run": True, "requested": requested, "visible": visible, "probe": probe}
    why = f"; needed by {', '.join(needs)}" if needs else ""
    cpu_fix = (
        "set model.attn_implementation = 'sdpa' and distributed.backend = 'auto' to run on the CPU"
        if needs
        else "check `nvidia-smi`, the driver and CUDA_VISIBLE_DEVICES"
    )
    if probe.get("error"):
        return CheckResult("cuda", FAIL, f"CUDA is not usable: {probe['error']}{why}", cpu_fix, details)
    if not probe.get("cuda_available"):
        build = f"CUDA {probe['cuda_version']}" if probe.get("cuda_version") else "a CPU-only build"
        return CheckResult(
            "cuda",
            FAIL,
            f"CUDA is not usable: torch {probe.get('torch_version')} ({build}) finds no GPU, "
            f"but {requested} requested{why}",
            cpu_fix if needs or probe.get("cuda_version") else "install a CUDA build of torch, or " + cpu_fix,
            details,
        )
    count = int(probe.get("device_count") or 0)
    if count < requested:
        return CheckResult(
            "cuda",
            FAIL,
            f"{requested} GPU(s) requested per node but torch sees {count}",
            f"set distributed.nproc_per_node = {count} or make more GPUs visible (CUDA_VISIBLE_DEVICES)",
            details,
        )
    broken = [d for d in devices if not d.get("ok")]
    if broken:
        listing = "; ".join(f"cuda:{d.get('index')}: {d.get('error')}" for d in broken)
        return CheckResult(
            "cuda",
            FAIL,
            f"no CUDA context on {len(broken)} of {requested} GPU(s): {listing}",
            "check `nvidia-smi` for the failing GPU (an Xid in `dmesg` means it needs a reset); exclude it "
            "with CUDA_VISIBLE_DEVICES and lower distributed.nproc_per_node",
            details,
        )
    nvml_count = probe.get("nvml_count")
    if nvml_count is None or nvml_count < count:
        seen = f"NVML sees {nvml_count}" if nvml_count is not None else f"NVML fails ({probe.get('nvml_error')})"
        return CheckResult(
            "cuda",
            FAIL,
            f"torch sees {count} GPU(s) but {seen}: GPU health cannot be watched",
            "install nvidia-ml-py matching the driver (`pip install -U nvidia-ml-py`) and check `nvidia-smi`",
            details,
        )
    names = ", ".join(sorted({str(d.get("name")) for d in devices}))
    memory = min(float(d.get("total_memory_mib") or 0) for d in devices) / 1024
    return CheckResult(
        "cuda",
        PASS,
        f"{requested} GPU(s) usable ({names}, {memory:.0f} GiB each); NVML sees {nvml_count}"
        + (f" (replayed from {probe['replayed']})" if probe.get("replayed") else ""),
        None,
        details,
    )


# ---------------------------------------------------------------- model source


# 'namespace/name', or a bare name such as gpt2 (the hub's older models have no namespace)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
HUB_FILES = {"path": ("config.json",), "tokenizer": ("tokenizer_config.json", "tokenizer.json", "config.json")}


def check_model_source(cfg: Config) -> CheckResult:
    """model.path (and model.tokenizer) must be a local directory or something that reads as a hub id."""
    for key in ("path", "tokenizer"):
        value = getattr(cfg.model, key)
        if value is None:
            continue
        local = Path(os.path.expanduser(value))
        try:
            exists = local.exists()
        except OSError:
            exists = False
        if exists:
            if not local.is_dir():
                return CheckResult(
                    "model_source", FAIL, f"model.{key} = {value!r} is a file, not a model directory",
                    f"point model.{key} at the directory holding config.json",
                )  # fmt: skip
            missing = _missing_model_files(local, key)
            if missing:
                return CheckResult(
                    "model_source", FAIL, f"model.{key} = {value!r} is a directory without {missing}",
                    f"point model.{key} at a model directory (a run's final/, or a hub download), or fix the path",
                )  # fmt: skip
            continue
        if not HUB_ID.match(value):  # at most one slash between names: anything else ('./x', '/x', 'a/b/c') is a path
            return CheckResult(
                "model_source", FAIL,
                f"model.{key} = {value!r} does not exist here, and is not a hub id ('namespace/name' or 'name')",
                f"create it first (a previous run's final/ directory: run that run), or fix the path"
                f" (relative paths are from {os.getcwd()})",
            )  # fmt: skip
        # the loader would find out too, after start-up and a minute of retries: the cache and one HEAD say it now
        why = hub_model_unavailable(value, HUB_FILES[key])
        if why is not None:
            where = (
                None if "/" in value else f"if {value!r} was meant as a directory, fix the path (from {os.getcwd()})"
            )
            return CheckResult("model_source", FAIL, f"model.{key} = {value!r}: {why}", where)
    return CheckResult("model_source", PASS, "model source found" if cfg.model.path else "random-initialised model")


# What transformers' from_pretrained needs in a local directory: a tokenizer's files, a model's config and weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "model*.bin")


def _missing_model_files(directory: Path, key: str) -> str | None:
    """What a local model.path / model.tokenizer directory lacks that the engine will load from it, or None."""
    try:
        if key == "tokenizer":
            return None if any((directory / name).is_file() for name in TOKENIZER_FILES) else "tokenizer files"
        if not (directory / "config.json").is_file():
            return "config.json"
        return None if any(next(directory.glob(p), None) for p in WEIGHT_PATTERNS) else "weights (*.safetensors)"
    except OSError as exc:
        return f"readable files ({exc.strerror or exc})"


# ---------------------------------------------------------------- output directory


def check_output_dir(cfg: Config) -> CheckResult:
    """Whether the run directory can be written, leaving nothing behind: a file written (then deleted) in it, or,
    while it does not exist yet, a directory made (then removed) in its nearest existing parent. A check must not
    change the machine: an empty run directory left by preflight would read as a run that never started."""
    run_dir = Path(os.path.expanduser(cfg.run_dir))
    try:
        if run_dir.is_dir():
            # a temporary file of a fresh name (O_EXCL, O_NOFOLLOW): a link planted at a name is never written through
            with tempfile.NamedTemporaryFile(prefix=".preflight-", dir=run_dir) as probe:
                probe.write(b"preflight\n")
        else:
            os.rmdir(tempfile.mkdtemp(prefix=".prime-train-preflight-", dir=_existing_ancestor(run_dir)))
    except OSError as exc:
        return CheckResult(
            "output_dir",
            FAIL,
            f"cannot write the run directory {run_dir}: {exc.strerror or exc}",
            f"set run.output_dir (now {cfg.run.output_dir!r}) to a directory this user can write",
            {"path": str(run_dir)},
        )
    return CheckResult("output_dir", PASS, f"{run_dir} is writable", None, {"path": str(run_dir)})


# ---------------------------------------------------------------- ports


def _local_addresses() -> set[str]:
    addrs = {"localhost", "127.0.0.1", "::1", "0.0.0.0", socket.gethostname()}
    try:
        for entries in psutil.net_if_addrs().values():
            addrs |= {e.address.split("%")[0] for e in entries if e.family in (socket.AF_INET, socket.AF_INET6)}
    except (OSError, psutil.Error):
        pass
    return addrs


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def ports_to_bind(cfg: Config) -> list[tuple[int, str]]:
    """(port, config key) of every port this node will listen on for the job: RL's rollout workers
    (inference.base_port + i, worker i) and a multi-node rendezvous served here."""
    if cfg.job.command:
        return []
    workers: list[tuple[int, str]] = []
    if cfg.run.job == "rl":
        base = cfg.inference.base_port
        workers = [(base + i, f"inference.base_port + {i}" if i else "inference.base_port") for i in range(
            cfg.inference.num_workers)]  # fmt: skip
    if cfg.distributed.nnodes == 1:
        # one node: torchrun --standalone picks a free rendezvous port itself (launch.py)
        return workers
    if node_rank(cfg) != 0:
        # the static rendezvous (launch.py) has node 0's agent serve the store: another node only connects to it,
        # even one on this host (node 0 there already holds the port while a restarted node 1 checks it)
        return workers
    host, _, port = rendezvous_endpoint(cfg).rpartition(":")
    key = "distributed.rdzv_endpoint" if cfg.distributed.rdzv_endpoint else "distributed.master_port"
    # node 0 serves it on the endpoint's host: a name we cannot match without DNS (slow, and this runs before
    # everything else) is taken to be this host
    local = host in _local_addresses() or not _is_ip(host)
    return workers + ([(int(port), key)] if local and port.isdigit() else [])


def _bind_error(host: str, port: int) -> OSError | None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # SO_REUSEADDR as servers set it: a closed connection in TIME_WAIT does not make a port busy
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
    return None


def port_holder(port: int) -> str | None:
    """'pid N (name)' of the process listening on `port`, when psutil may see it (rl/workers.py, which the
    embedded rollout worker also asks when its own bind fails)."""
    from prime_train.rl.workers import port_holder as holder

    return holder(port)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_ports(cfg: Config) -> CheckResult:
    """Bind-test every port the job will listen on, on 127.0.0.1 and 0.0.0.0 (and RL's inference.host)."""
    ports = ports_to_bind(cfg)
    if not ports:
        why = "an external command" if cfg.job.command else "one node: torchrun picks its own port"
        return CheckResult("ports", PASS, f"no fixed port to bind ({why})")
    hosts = ["127.0.0.1", "0.0.0.0"]
    host = cfg.inference.host
    if cfg.run.job == "rl" and _is_ip(host) and ipaddress.ip_address(host).version == 4 and host not in hosts:
        hosts.append(host)  # where the workers listen (a name would need DNS: the two above cover it)
    busy = []
    for port, key in ports:
        errors = [e for e in (_bind_error(h, port) for h in hosts) if e is not None]
        errors = [e for e in errors if e.errno != errno.EADDRNOTAVAIL]  # an address this host does not have
        if errors:
            holder = port_holder(port)
            busy.append((port, key, holder, errors[0].strerror or str(errors[0])))
    if not busy:
        listing = ", ".join(f"{p} ({k})" for p, k in ports)
        return CheckResult("ports", PASS, f"free: {listing}", details={"ports": [p for p, _ in ports]})
    said = []
    for port, key, holder, error in busy:
        # psutil sees other users' sockets only with privileges: without them the holder has no name
        said.append(f"port {port} ({key}) is in use: {error}, held by {holder or 'another process'}")
    port, key, holder, _ = busy[0]
    if key.startswith("inference.base_port"):
        fix = f"set inference.base_port to a free range (worker i listens on base_port + i; e.g. {_free_port()})"
    else:
        fix = f"set {key} to a free port (e.g. {_free_port()})"
    holders = sorted({b[2] for b in busy if b[2]})
    if holders:
        fix += f", or stop {', '.join(holders)} if it is a leftover run"
    return CheckResult("ports", FAIL, "; ".join(said), fix, {"busy": [b[0] for b in busy]})


# ---------------------------------------------------------------- secrets


def _netrc_has(host: str) -> bool:
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def check_secrets(cfg: Config) -> CheckResult:
    """Every environment variable the run needs is set; reports names only, never a value."""
    needed: dict[str, str] = {name: "supervisor.required_env" for name in cfg.supervisor.required_env}
    log = cfg.logging
    if log.wandb_project and log.wandb_mode == "online" and not _netrc_has("api.wandb.ai"):
        needed.setdefault("WANDB_API_KEY", f"logging.wandb_project = {log.wandb_project!r} in online mode")
    if not needed:
        return CheckResult("secrets", PASS, "no secrets required")
    # [job].env is handed to an external command, so a name set there counts as present
    missing = [name for name in needed if not (os.environ.get(name) or cfg.job.env.get(name))]
    details = {"required": list(needed), "missing": missing}
    if not missing:
        return CheckResult("secrets", PASS, f"present: {', '.join(needed)}", None, details)
    listing = ", ".join(f"{name} ({needed[name]})" for name in missing)
    fix = f"export {missing[0]}=… in the shell that runs prime-train"
    if "WANDB_API_KEY" in missing:
        fix += "; for W&B, `wandb login` or logging.wandb_mode = 'offline'"
    return CheckResult("secrets", FAIL, f"missing or empty: {listing}", fix, details)


# ---------------------------------------------------------------- memory fit


def estimate_memory(cfg: Config, hf: dict[str, Any], *, on_gpu: bool) -> dict[str, Any]:
    """Bytes one training process needs, by part, from the memory calculator (`prime-train memory`).

    The same figures as `prime-train memory`, so preflight and the calculator never disagree; on the
    CPU the run is fp32 and the CUDA runtime allowance is replaced by the CPU process's own.
    """
    nproc = procs_per_node(cfg)
    world = nproc * cfg.distributed.nnodes
    strategy = resolved_strategy(cfg, world)
    precision = "bf16" if cfg.train.precision == "bf16" or (on_gpu and cfg.train.precision == "auto") else "fp32"
    report = estimate(
        inputs_from_config(
            cfg, model=hf, model_source="run config", gpus_per_node=nproc, num_nodes=cfg.distributed.nnodes,
            strategy=strategy, precision=precision, max_model_len=None, gpus=[],
        )
    )  # fmt: skip
    trainer = report.trainer
    states = sum(trainer.get(name) for name in STATE_PARTS)
    activations = trainer.get("activations")
    logits = trainer.total - states - activations - trainer.get("runtime")  # logits and loss, or a score head's
    overhead = GPU_OVERHEAD_BYTES if on_gpu else CPU_OVERHEAD_BYTES
    return {
        "num_params": report.shape.num_params,
        "strategy": strategy,
        "state_shards": trainer.shard_group,
        "states_bytes": int(states),
        "activation_bytes": int(activations),
        "logits_bytes": int(logits),
        "overhead_bytes": overhead,
        "per_rank_bytes": int(states + activations + logits + overhead),
        "ranks_per_node": nproc,
        "trainable_params": trainer.trainable_params,
        "trainable_fraction": round(trainer.trainable_fraction, 6),
        "job": cfg.run.job,
        "sequences_per_micro_batch": cfg.train.micro_batch_size * report.inputs.sequences_per_sample,
        "reference_bytes": trainer.get("reference weights"),
        "head_bytes": trainer.get("value head") + trainer.get("score head"),
    }


def check_memory_fit(
    cfg: Config, *, gpu_run: bool = False, gpu_memory_bytes: float | None = None, available_ram: float | None = None
) -> CheckResult:
    """Estimated memory per process against one GPU's memory, or all local processes against available RAM."""
    if cfg.job.command:
        return CheckResult("memory_fit", PASS, "not estimated for an external [job].command")
    hf, source = model_shape(cfg)
    if hf is None:
        return CheckResult("memory_fit", WARN, f"model size unknown: {source}")
    try:
        est = estimate_memory(cfg, hf, on_gpu=gpu_run)
    except MemoryInputError as exc:  # a config.json the parameter count reads but the calculator cannot
        return CheckResult("memory_fit", WARN, f"memory not estimated: {exc}")
    if gpu_run:
        if not gpu_memory_bytes:
            return CheckResult("memory_fit", WARN, "GPU memory unknown (see the cuda check)", None, est)
        need, capacity, where = est["per_rank_bytes"], gpu_memory_bytes, "one GPU's memory, per process"
    else:
        capacity = available_ram if available_ram is not None else psutil.virtual_memory().available
        need, where = est["per_rank_bytes"] * est["ranks_per_node"], f"available RAM, {est['ranks_per_node']} proc"
    est.update(need_bytes=int(need), capacity_bytes=int(capacity))
    fraction = need / capacity if capacity else float("inf")
    trains = f", LoRA: {est['trainable_params'] / 1e6:,.1f}M trainable" if cfg.lora.enabled else ""
    message = (
        f"about {_human(need)} needed: {fraction:.0%} of {_human(capacity)} ({where}; "
        f"{est['num_params'] / 1e6:,.1f}M params{trains}, strategy {est['strategy']}{_job_words(est)}, {source})"
    )
    fix = (
        f"lower train.micro_batch_size (now {cfg.train.micro_batch_size}) or data.seq_len (now {cfg.data.seq_len}), "
        "set model.activation_checkpointing = true, or shard the states with distributed.strategy = 'fsdp'"
    )
    if est["reference_bytes"] and cfg.run.job == "dpo":
        less = _human(est["reference_bytes"])
        fix += f", or set dpo.precompute_reference = true (no reference model held: {less} less)"
    if fraction > MEMORY_WARN_FRACTION and not cfg.lora.enabled and cfg.model.path is not None:
        fix += _lora_offer(cfg, hf, gpu_run, need / est["per_rank_bytes"])
    if fraction > 1.0:
        return CheckResult("memory_fit", FAIL, message, fix, est)
    if fraction > MEMORY_WARN_FRACTION:
        return CheckResult("memory_fit", WARN, message, fix, est)
    return CheckResult("memory_fit", PASS, message, None, est)


def _job_words(est: dict[str, Any]) -> str:
    """What the job adds to the estimate, for the memory_fit message: pairs' sequences, a reference copy."""
    words = []
    if est["job"] in ("dpo", "reward"):
        words.append(f"{est['sequences_per_micro_batch']} sequences a micro-batch (pairs)")
    if est["reference_bytes"]:
        words.append(f"reference copy {_human(est['reference_bytes'])}")
    return f", {est['job']}: " + ", ".join(words) if words else ""


LORA_OFFER_RANK = 16


def _lora_offer(cfg: Config, hf: dict[str, Any], gpu_run: bool, ranks: float) -> str:
    """The fix's last option when the whole model does not fit: LoRA adapters of rank 16, with what they need."""
    from prime_train.config.schema import LoraConfig

    try:
        with_lora = cfg.model_copy(update={"lora": LoraConfig(rank=LORA_OFFER_RANK)})
        need = estimate_memory(with_lora, hf, on_gpu=gpu_run)["per_rank_bytes"] * ranks
    except MemoryInputError:
        return ""
    return f", or train LoRA adapters only (--lora.rank {LORA_OFFER_RANK}: about {_human(need)})"


# ---------------------------------------------------------------- all of it


def _gpu_memory_bytes(cuda: CheckResult) -> float | None:
    devices = (cuda.details.get("probe") or {}).get("devices") or []
    sizes = [d.get("free_memory_mib") or d.get("total_memory_mib") for d in devices if d.get("ok")]
    sizes = [s for s in sizes if s]
    return min(sizes) * 2**20 if sizes and cuda.status == PASS else None


def run_preflight(
    cfg: Config,
    *,
    gpu_probe: GpuProbe | None = None,
    disk_usage: DiskUsage | None = None,
    shm_usage: DiskUsage | None = None,
) -> list[CheckResult]:
    """Every preflight check, in order; `gpu_probe`, `disk_usage` and `shm_usage` (/dev/shm's) replace the real
    probes (tests, replays)."""
    if gpu_probe is None and os.environ.get(ENV_GPU_REPLAY):
        gpu_probe = replayed_probe  # the machine a gpu.jsonl recorded: its GPUs, as preflight would have seen them
    cuda = check_cuda(cfg, gpu_probe)
    gpu_run = bool(cuda.details.get("gpu_run"))
    lora = check_lora(cfg, cuda, resolved_strategy(cfg, procs_per_node(cfg) * cfg.distributed.nnodes))
    float8 = check_float8(cfg, cuda)
    shm = check_shared_memory(cfg, shm_usage)
    return [
        check_open_files(*open_files_needed(cfg)),
        check_model_source(cfg),
        cuda,
        *([lora] if lora is not None else []),
        *([float8] if float8 is not None else []),
        check_output_dir(cfg),
        check_disk(cfg, disk_usage),
        *([shm] if shm is not None else []),
        check_ports(cfg),
        check_secrets(cfg),
        check_memory_fit(cfg, gpu_run=gpu_run, gpu_memory_bytes=_gpu_memory_bytes(cuda)),
        *rl_preflight_checks(cfg),
    ]


_MARKS = {PASS: ("✓", "green"), WARN: ("!", "yellow"), FAIL: ("✗", "red")}


def preflight_command(cfg: Config, as_json: bool = False, *, quiet_pass: bool = False, stderr: bool = False) -> int:
    """`prime-train preflight`: print one line per check (or a JSON list); 0 when nothing failed, else 78."""
    results = run_preflight(cfg)
    failed = any(r.status == FAIL for r in results)
    if as_json:
        print(json.dumps([r.to_dict() for r in results], indent=2, default=str))
        return ExitCode.CONFIG if failed else ExitCode.OK

    from rich.console import Console
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True, stderr=stderr)
    for r in results:
        if quiet_pass and r.status == PASS:
            continue
        mark, colour = _MARKS[r.status]
        line = Text()
        line.append(f"{mark} ", style=f"bold {colour}")
        line.append(f"{r.name}: ", style="bold")
        line.append(r.message)
        if r.fix:
            line.append(" → ", style=colour)
            line.append(r.fix)
        console.print(line)
    counts = {s: sum(r.status == s for r in results) for s in (PASS, WARN, FAIL)}
    summary = f"preflight: {counts[PASS]} passed, {counts[WARN]} warning(s), {counts[FAIL]} failed"
    console.print(Text(summary, style="red" if failed else "green"))
    return ExitCode.CONFIG if failed else ExitCode.OK
