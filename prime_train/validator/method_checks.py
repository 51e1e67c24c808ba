"""Quantization-aware training (train.qat) and meta-learning (run.job = "meta") before a launch: lint's checks.

The engine (engine/qat.py, engine/meta.py) refuses the same settings at start-up with exit 78; these say it first, with
file and line. Lint knows the config and this machine's packages (torchao, mslk: found, never imported).
"""

from __future__ import annotations

import importlib.util

from prime_train.config.loader import Problem, Sources
from prime_train.config.schema import Config

QAT_INSTALL = "pip install 'prime-train[qat]'"
# the jobs whose model is the causal LM and whose export is final/ through the loop's export_final
QAT_JOBS = ("sft", "pretrain", "dpo", "meta")


def method_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """Every train.qat and [meta] setting the engine would refuse."""
    if cfg.job.command:
        return []
    return _qat_problems(cfg, sources) + _meta_problems(cfg, sources)


def _qat_problems(cfg: Config, sources: Sources) -> list[Problem]:
    scheme = cfg.train.qat
    if scheme == "none":
        return []
    key, problems = ("train", "qat"), []

    def error(message: str) -> None:
        problems.append(sources.problem(key, "error", message))

    if importlib.util.find_spec("torchao") is None:
        error(f"train.qat = {scheme!r} needs torchao, which is not installed: {QAT_INSTALL}")
    elif scheme == "int4_weight_only" and importlib.util.find_spec("mslk") is None:
        error(
            "train.qat = 'int4_weight_only' converts to torchao's int4 kernels, which need a CUDA GPU and the mslk "
            "package, not installed on this machine; on the CPU use 'int8_dynamic_act_int4_weight'"
        )
    if cfg.run.job not in QAT_JOBS:
        error(f"train.qat is for run.job {', '.join(QAT_JOBS)}; the {cfg.run.job} job does not fake-quantize")
    if cfg.lora.rank > 0:
        error("train.qat with lora.rank > 0 is not supported: peft's adapters would wrap the fake-quantized layers")
    if cfg.train.float8:
        error("train.qat with train.float8 = true: both swap the same linear layers; choose one")
    if cfg.distributed.tp_size > 1 or cfg.distributed.pp_size > 1 or cfg.distributed.strategy in ("fsdp", "hsdp"):
        error(
            "train.qat runs in one process or under DDP (its fake quantizers are not built for sharded weights): set "
            "distributed.strategy to 'auto', 'none' or 'ddp' and tp_size and pp_size to 1"
        )
    return problems


def _meta_problems(cfg: Config, sources: Sources) -> list[Problem]:
    if cfg.run.job != "meta":
        return []
    problems = []
    meta, datasets = cfg.meta, cfg.data.datasets
    processes = (cfg.distributed.nproc_per_node or 1) * cfg.distributed.nnodes
    if processes > 1:
        message = (
            f"run.job = 'meta' runs in one process ({processes} asked): its inner loops adapt a private copy of the "
            "weights; set distributed.nproc_per_node = 1 and nnodes = 1"
        )
        problems.append(sources.problem(("distributed", "nproc_per_node"), "error", message))
    if len(datasets) < 2:
        message = "run.job = 'meta' meta-learns over tasks: list at least two [[data.datasets]], one per task"
        problems.append(sources.problem(("data", "datasets"), "error", message))
    trained = [ds.task for ds in datasets if ds.task]
    if meta.eval_task is not None and meta.eval_task in trained:
        message = (
            f"meta.eval_task = {meta.eval_task!r} is also a training task (data.datasets): the eval measures "
            "adaptation to a task the model never trained on; hold it out"
        )
        problems.append(sources.problem(("meta", "eval_task"), "error", message))
    if meta.adapt_target_loss is not None and meta.eval_task is None:
        message = "meta.adapt_target_loss is set without meta.eval_task: there is no adaptation to measure"
        problems.append(sources.problem(("meta", "adapt_target_loss"), "warning", message))
    if cfg.lora.rank > 0:
        message = "run.job = 'meta' trains the whole model: lora.rank > 0 is not supported; set lora.rank = 0"
        problems.append(sources.problem(("lora", "rank"), "error", message))
    return problems


def meta_step_sequences(cfg: Config) -> int:
    """Sequences one Reptile step trains on (cost): the inner steps' micro-batches of every sampled task."""
    return cfg.meta.tasks_per_step * cfg.meta.inner_steps * cfg.train.micro_batch_size


def meta_cost_note(cfg: Config) -> str:
    """What the cost estimate assumes of a meta job's step."""
    meta = cfg.meta
    note = (
        f"meta: a step is {meta.tasks_per_step} task(s) × {meta.inner_steps} inner steps of "
        f"{cfg.train.micro_batch_size} sequences, each trained forward and backward as SFT"
    )
    if meta.eval_task:
        note += f"; each eval adds {meta.adapt_steps} adaptation steps on meta.eval_task (not counted)"
    return note
