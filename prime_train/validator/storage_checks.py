"""Preflight's storage checks: the disk the checkpoints and the export fill, and the shared memory
ckpt.async_writer = 'process' stages saves in."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from prime_train.config.schema import Config
from prime_train.launch import procs_per_node
from prime_train.validator.checks import FAIL, PASS, WARN, CheckResult
from prime_train.validator.lora_checks import adapters
from prime_train.validator.memory import resolved_strategy
from prime_train.validator.model_shape import model_shape
from prime_train.validator.param_count import count_parameters

# Bytes per parameter on disk. A DCP checkpoint holds fp32 weights (4) and AdamW's two fp32 moments (8).
# The HF export in final/ is written from the fp32 master weights (engine/export.py), so 4, not bf16's 2.
DCP_BYTES_PER_PARAM = 12
EXPORT_BYTES_PER_PARAM = 4
DISK_WARN_MARGIN = 1.5

DiskUsage = Callable[[str], Any]


def human_bytes(num_bytes: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes / 1e3:.1f} kB"


def existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def checkpoint_disk_need(cfg: Config, num_params: int, adapters: int | None = None) -> dict[str, int]:
    """Bytes the run's checkpoints and export occupy at their peak, with the counts behind it. With LoRA
    (`adapters` parameters) a checkpoint holds the adapters and their optimizer state only, and the export the
    adapter (PEFT's format) and, with lora.merge_on_export, the merged model."""
    ck, max_steps = cfg.ckpt, cfg.train.max_steps
    written = max_steps // ck.interval + (1 if ck.resumable_final_save and max_steps % ck.interval else 0)
    # keep_last + 1: the next checkpoint is written whole before the oldest is deleted
    kept = written if ck.keep_last is None else min(written, ck.keep_last + 1)
    if ck.keep_every:
        kept = min(written, kept + max_steps // ck.keep_every)
    if ck.keep_best.metric:  # the best one is kept beside them (and saved at an eval, off the interval)
        kept += 1
    per_checkpoint = (num_params if adapters is None else adapters) * DCP_BYTES_PER_PARAM
    exported = num_params if adapters is None else adapters + (num_params if cfg.lora.merge_on_export else 0)
    export = exported * EXPORT_BYTES_PER_PARAM if ck.export_final else 0
    total = kept * per_checkpoint + export
    return {"checkpoints": kept, "checkpoint_bytes": per_checkpoint, "export_bytes": export, "total_bytes": total}


def check_disk(cfg: Config, disk_usage: DiskUsage | None = None) -> CheckResult:
    """Free space of the output filesystem against the checkpoints kept (keep_last + 1) and the final export."""
    where = existing_ancestor(Path(os.path.expanduser(cfg.run_dir)))
    usage = (disk_usage or psutil.disk_usage)(str(where))
    free = int(usage.free)
    details: dict[str, Any] = {"path": str(where), "free_bytes": free}
    if cfg.job.command:
        return CheckResult(
            "disk",
            PASS,
            f"{human_bytes(free)} free on {where}; not estimated for an external [job].command",
            None,
            details,
        )
    need, source = _run_checkpoint_need(cfg)
    if need is None:
        return CheckResult(
            "disk", WARN, f"{human_bytes(free)} free on {where}; checkpoint size unknown: {source}", None, details
        )
    details.update(need)
    total = need["total_bytes"]
    breakdown = f"{need['checkpoints']} checkpoint(s) × {human_bytes(need['checkpoint_bytes'])}"
    if need["export_bytes"]:
        breakdown += f" + final export {human_bytes(need['export_bytes'])}"
    message = f"{human_bytes(free)} free on {where}; the run needs about {human_bytes(total)} ({breakdown})"
    fix = (
        f"free space on {where}, lower ckpt.keep_last (now {cfg.ckpt.keep_last}), or set run.output_dir to a "
        "larger filesystem"
    )
    return _against_free("disk", free, total, message, fix, details)


def _run_checkpoint_need(cfg: Config) -> tuple[dict[str, int] | None, str]:
    """checkpoint_disk_need of the run's model (with LoRA, of its adapters) and its num_params; None, and why, when
    the model's shape is unknown."""
    hf, source = model_shape(cfg)
    if hf is None:
        return None, source
    num_params = count_parameters(hf)
    ad = adapters(cfg)
    return {
        **checkpoint_disk_need(cfg, num_params, ad.trainable if ad is not None else None),
        "num_params": num_params,
    }, source


def _against_free(name: str, free: int, need: int, message: str, fix: str, details: dict[str, Any]) -> CheckResult:
    """Fails below `need`, warns below DISK_WARN_MARGIN times it."""
    if free < need:
        return CheckResult(name, FAIL, message, fix, details)
    if free < DISK_WARN_MARGIN * need:
        return CheckResult(name, WARN, message + f": less than {DISK_WARN_MARGIN}× headroom", fix, details)
    return CheckResult(name, PASS, message, None, details)


def check_shared_memory(cfg: Config, shm_usage: DiskUsage | None = None) -> CheckResult | None:
    """ckpt.async_writer = 'process' stages each async save in shared memory (/dev/shm) for DCP's checkpoint
    process: a node's ranks hold one checkpoint's state there at a time (their shards under FSDP, each its own whole
    copy otherwise). A container's default /dev/shm (64 MiB in Docker) holds no real model's; None: not asked for."""
    ck = cfg.ckpt
    if cfg.job.command or not (ck.async_save and ck.async_writer == "process"):
        return None
    where = "/dev/shm"
    try:
        free = int((shm_usage or psutil.disk_usage)(where).free)
    except OSError as e:
        fix = "run where /dev/shm exists, or set ckpt.async_writer = 'thread'"
        return CheckResult("shared memory", FAIL, f"ckpt.async_writer = 'process' stages saves in {where}: {e}", fix)
    details: dict[str, Any] = {"path": where, "free_bytes": free}
    per_checkpoint, source = _run_checkpoint_need(cfg)
    if per_checkpoint is None:
        unknown = f"{human_bytes(free)} free in {where}; checkpoint size unknown: {source}"
        return CheckResult("shared memory", WARN, unknown, None, details)
    nproc = procs_per_node(cfg)
    world = nproc * cfg.distributed.nnodes
    sharded = resolved_strategy(cfg, world) in ("fsdp", "hsdp")
    need = per_checkpoint["checkpoint_bytes"] * nproc // (world if sharded else 1)
    details["need_bytes"] = need
    message = (
        f"{human_bytes(free)} free in {where}; ckpt.async_writer = 'process' stages about {human_bytes(need)} there "
        f"a save ({nproc} process(es) on this node{', sharded' if sharded else ', each a whole copy'})"
    )
    fix = (
        f"give the container a larger {where} (docker run --shm-size, a Kubernetes emptyDir with medium: Memory) or "
        "set ckpt.async_writer = 'thread'"
    )
    return _against_free("shared memory", free, need, message, fix, details)
