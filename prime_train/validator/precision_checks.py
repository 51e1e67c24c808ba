"""ZeRO stages, CPU offload, gradient compression, fp16 and float8 before a launch: lint's checks of the config and
preflight's of the GPUs that train.

The engine (engine/parallel.py, engine/precision.py) refuses the same settings at start-up with exit 78; these say it
first, with file and line. Lint knows the config and this machine's packages (torchao, found, never imported);
preflight adds the GPUs' compute capability, which float8 needs to be 8.9 or more.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from prime_train.config.loader import Problem, Sources
from prime_train.config.schema import Config
from prime_train.validator.checks import FAIL, PASS, CheckResult

FLOAT8_INSTALL = "pip install 'prime-train[float8]'"
FLOAT8_MIN_CAPABILITY = (8, 9)
# the jobs whose step scales its loss (engine/train.py SFTJob.loss_scaling): fp16 needs it
LOSS_SCALING_JOBS = ("sft", "pretrain")


def _processes(cfg: Config) -> int:
    return (cfg.distributed.nproc_per_node or 1) * cfg.distributed.nnodes


def precision_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """Every combination of sharding, compression and precision the engine would refuse, or that does nothing."""
    return _sharding_problems(cfg, sources) + _compression_problems(cfg, sources) + _half_problems(cfg, sources)


def _sharding_problems(cfg: Config, sources: Sources) -> list[Problem]:
    dist = cfg.distributed
    key = ("distributed", "zero_stage") if dist.zero_stage is not None else ("distributed", "cpu_offload")
    if dist.zero_stage is None and not dist.cpu_offload:
        return []
    shown = f"distributed.zero_stage = {dist.zero_stage}" if dist.zero_stage is not None else "distributed.cpu_offload"
    if dist.strategy in ("ddp", "none"):
        why = f"{shown} shards the model with FSDP2, which distributed.strategy = {dist.strategy!r} does not"
        return [sources.problem(key, "error", f"{why}; set the strategy to 'fsdp' or 'auto'")]
    if _processes(cfg) == 1:
        return [sources.problem(key, "warning", f"{shown} with one process: nothing to shard, the model trains "
                                                "unwrapped; set distributed.nproc_per_node")]  # fmt: skip
    return []


def _compression_problems(cfg: Config, sources: Sources) -> list[Problem]:
    dist = cfg.distributed
    if dist.grad_compression == "none":
        return []
    key = ("distributed", "grad_compression")
    shown = f"distributed.grad_compression = {dist.grad_compression!r}"
    sharded = dist.strategy in ("fsdp", "hsdp") or dist.zero_stage is not None or dist.cpu_offload
    if sharded or dist.strategy == "none":
        what = "the sharded strategy" if sharded else "distributed.strategy = 'none'"
        fix = "use distributed.strategy = 'ddp' (or 'auto'), or set it to 'none'"
        return [sources.problem(key, "error", f"{shown} is a DDP communication hook and {what} has no DDP; {fix}")]
    if _processes(cfg) == 1:
        return [sources.problem(key, "warning", f"{shown} with one process: there is no all-reduce to compress")]
    return []


def _half_problems(cfg: Config, sources: Sources) -> list[Problem]:
    problems = []
    if cfg.train.precision == "fp16" and cfg.run.job not in LOSS_SCALING_JOBS and not cfg.job.command:
        problems.append(sources.problem(("train", "precision"), "error", (
            f"train.precision = 'fp16' needs loss scaling, which the {cfg.run.job} job does not do; use 'bf16' "
            "(or 'fp32' on GPUs without bf16)")))  # fmt: skip
    if cfg.train.float8:
        if importlib.util.find_spec("torchao") is None:
            problems.append(sources.problem(("train", "float8"), "error",
                                            f"train.float8 = true needs torchao, which is not installed: "
                                            f"{FLOAT8_INSTALL}"))  # fmt: skip
        if cfg.lora.enabled:
            problems.append(sources.problem(("train", "float8"), "error", (
                "train.float8 = true with lora.rank > 0: the frozen base's matmuls would be float8 under bf16 "
                "adapters, which the engine does not support; set one of them off")))  # fmt: skip
    return problems


def check_float8(cfg: Config, cuda: CheckResult) -> CheckResult | None:
    """Preflight: every GPU the run uses can do float8 matmuls (compute capability 8.9+); None without float8."""
    if not cfg.train.float8:
        return None
    devices: list[dict[str, Any]] = (cuda.details.get("probe") or {}).get("devices") or []
    if cuda.status != PASS or not devices:
        return CheckResult("float8", FAIL, "train.float8 = true needs CUDA GPUs of compute capability 8.9+ and none "
                           "is usable here (see the cuda check)", "set train.float8 = false")  # fmt: skip
    low = [d for d in devices if tuple(d.get("capability") or (0, 0)) < FLOAT8_MIN_CAPABILITY]
    if low:
        listing = ", ".join(f"{d.get('name')} ({'.'.join(map(str, d.get('capability') or ('?',)))})" for d in low)
        return CheckResult("float8", FAIL, f"train.float8 = true needs compute capability 8.9+; {listing} below it",
                           "set train.float8 = false, or run on Ada, Hopper or newer GPUs")  # fmt: skip
    return CheckResult("float8", PASS, "float8 matmuls supported on every GPU (compute capability 8.9+)")
