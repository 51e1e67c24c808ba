"""Tensor parallelism (distributed.tp_size) before a launch: what the engine (engine/tensor_parallel.py) refuses.

The engine says the same once the job has started (exit 78); lint says it first, with the file and line. Only the
config is read (and the model's config.json when it is local): no torch.
"""

from __future__ import annotations

from prime_train.config.loader import Problem, Sources
from prime_train.config.schema import Config
from prime_train.validator.model_shape import model_shape

TP_JOBS = ("sft", "pretrain")


def tp_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """tp_size fits the job, the model, the processes per node and the data-parallel strategy."""
    dist = cfg.distributed
    tp = dist.tp_size
    key = ("distributed", "tp_size")
    if tp == 1:
        if dist.sequence_parallel:
            return [
                sources.problem(
                    ("distributed", "sequence_parallel"),
                    "warning",
                    "distributed.sequence_parallel = true does nothing with distributed.tp_size = 1; set tp_size "
                    "to 2 or more, or drop it",
                )
            ]
        return []

    def error(message: str, path=key) -> Problem:
        return sources.problem(path, "error", message)

    problems = []
    if cfg.run.job not in TP_JOBS:
        problems.append(
            error(
                f"distributed.tp_size = {tp} is for run.job 'sft' and 'pretrain'; run.job = {cfg.run.job!r} has no "
                "tensor-parallel step: set distributed.tp_size = 1 and shard with distributed.strategy = 'fsdp'"
            )
        )
    if cfg.lora.enabled:
        what = "QLoRA (lora.quantize = 'nf4')" if cfg.lora.quantize == "nf4" else f"LoRA (lora.rank = {cfg.lora.rank})"
        problems.append(
            error(
                f"distributed.tp_size = {tp} with {what}: peft's adapters are not split over tensor-parallel "
                "ranks; set distributed.tp_size = 1 (and distributed.strategy = 'fsdp' to shard the base)"
            )
        )
    if cfg.model.implementation == "hf" or cfg.model.attn_implementation != "sdpa":
        problems.append(
            error(
                f"distributed.tp_size = {tp} runs on the engine's native decoder only, and model.implementation = "
                f"{cfg.model.implementation!r} / model.attn_implementation = {cfg.model.attn_implementation!r} "
                "select transformers' model; set model.implementation = 'auto' and attn_implementation = 'sdpa'"
            )
        )
    if dist.strategy == "hsdp":
        problems.append(
            error(
                f"distributed.strategy = 'hsdp' with distributed.tp_size = {tp}: tensor parallelism takes the node's "
                "ranks HSDP would shard over; set distributed.strategy = 'fsdp'",
                ("distributed", "strategy"),
            )
        )
    nproc = dist.nproc_per_node
    if nproc is not None and nproc % tp:
        problems.append(
            error(
                f"distributed.tp_size = {tp} does not divide distributed.nproc_per_node = {nproc}: a tensor-parallel "
                "group must sit on one node; make nproc_per_node a multiple of tp_size"
            )
        )
    elif nproc is not None and dist.strategy == "ddp" and nproc * dist.nnodes // tp > 1:
        problems.append(
            error(
                f"distributed.strategy = 'ddp' with distributed.tp_size = {tp}: DDP cannot reduce tensor-parallel "
                "(DTensor) parameters; set distributed.strategy = 'fsdp' or 'auto' (FSDP2 across the groups)",
                ("distributed", "strategy"),
            )
        )
    problems.extend(_shape_problems(cfg, sources, key))
    return problems


def _shape_problems(cfg: Config, sources: Sources, key) -> list[Problem]:
    """tp_size divides the heads, the KV heads and the MLP width, when the model's shape is known here."""
    m, tp = cfg.model, cfg.distributed.tp_size
    if m.path is None:  # random-initialised: the shape is the config's own, whatever the tokenizer
        sizes = {"model.num_heads": m.num_heads, "model.num_kv_heads": m.num_kv_heads or m.num_heads}
        if m.intermediate_size:
            sizes["model.intermediate_size"] = m.intermediate_size
    else:
        hf, _ = model_shape(cfg)
        if hf is None:
            return []
        names = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
        sizes = {f"the model's {n}": hf.get(n) for n in names}
        sizes["the model's num_key_value_heads"] = sizes["the model's num_key_value_heads"] or hf.get(names[0])
    return [
        sources.problem(
            key,
            "error",
            f"distributed.tp_size = {tp} does not divide {name} ({value}): each rank takes 1/tp_size of the "
            "attention heads, KV heads and MLP width; choose a tp_size that divides all three",
        )
        for name, value in sizes.items()
        if isinstance(value, int) and value % tp
    ]
