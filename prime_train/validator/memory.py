"""`prime-train memory`: will a run fit, GPU by GPU, and how should one GPU be split between trainer and vLLM.

Preflight's memory_fit check asks the same estimate about one run; this is the whole answer, as a
report and as rich tables. Inputs come from a run config or from flags (memory_inputs.py), the bytes
part by part from memory_breakdown.py (whose docstring holds every formula), the GPUs from gpus.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from prime_train.validator.gpus import GpuSpec, GpuTable, load_gpus
from prime_train.validator.memory_breakdown import (
    NF4_BYTES_PER_PARAM,
    InferenceMemory,
    TrainerMemory,
    inference_memory,
    max_micro_batch,
    trainer_memory,
)
from prime_train.validator.memory_inputs import (
    GIB,
    ZERO_FAMILY,
    MemoryInputError,
    MemoryInputs,
    ModelShape,
    resolve_model,
)
from prime_train.validator.model_shape import model_shape

if TYPE_CHECKING:
    from rich.console import Console

    from prime_train.config.schema import Config

TIGHT_FRACTION = 0.10  # headroom under this fraction of the GPU's memory is flagged as tight


# ---------------------------------------------------------------- inputs


def engine_strategy(cfg: Config, world_size: int) -> str:
    """distributed.strategy as the engine resolves "auto" on `world_size` processes: nothing to wrap without
    data-parallel replicas, FSDP2 where ZeRO options are set or beside tensor parallelism, else DDP."""
    d = cfg.distributed
    if d.strategy != "auto":
        return d.strategy
    return auto_strategy(world_size // (d.tp_size * d.pp_size), d.zero_stage is not None or d.cpu_offload, d.tp_size)


def resolved_strategy(cfg: Config, world_size: int) -> str:
    """engine_strategy, and 'none' for one process whatever distributed.strategy says (the engine trains it unwrapped:
    engine/parallel.py resolve_strategy)."""
    return engine_strategy(cfg, world_size) if world_size > 1 else "none"


def auto_strategy(replicas: int, sharded: bool, tp_size: int) -> str:
    """What the engine's distributed.strategy = 'auto' runs over `replicas` data-parallel replicas: nothing with one,
    FSDP2 with ZeRO options or beside tensor parallelism (DDP cannot reduce its DTensors), else DDP."""
    return "none" if replicas <= 1 else "fsdp" if sharded or tp_size > 1 else "ddp"


def inputs_from_config(cfg: Config, **overrides: Any) -> MemoryInputs:
    """MemoryInputs for a run config, as the embedded engine would run it on GPUs; `overrides` win.

    GPUs per node come from ``distributed.nproc_per_node`` (1 when unset: this plans a run, it does not look
    at the GPUs of this machine); ``precision = "auto"`` is bf16, what it means on a GPU. Inference settings
    are filled in for RL runs, whose rollout workers they describe.
    """
    names = {f.name for f in fields(MemoryInputs)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise MemoryInputError(f"unknown memory setting(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    if "model" in overrides:
        hf, source = resolve_model(overrides.pop("model"))
    else:
        hf, source = model_shape(cfg)
        if hf is None:
            raise MemoryInputError(f"the model's shape is unknown: {source}")
    gpus_per_node = overrides.get("gpus_per_node") or cfg.distributed.nproc_per_node or 1
    nodes = overrides.get("num_nodes") or cfg.distributed.nnodes
    d = cfg.distributed
    strategy = engine_strategy(cfg, gpus_per_node * nodes)
    attention = {"flash_attention_2": "flash"}.get(cfg.model.attn_implementation, cfg.model.attn_implementation)
    values: dict[str, Any] = {
        "model": hf,
        "model_source": overrides.pop("model_source", source),
        "seq_len": cfg.data.seq_len,
        "micro_batch": cfg.train.micro_batch_size,
        "gpus_per_node": gpus_per_node,
        "num_nodes": nodes,
        "strategy": strategy,
        "precision": cfg.train.precision if cfg.train.precision in ("fp32", "fp16") else "bf16",
        "float8": cfg.train.float8,
        "activation_checkpointing": cfg.model.activation_checkpointing,
        "attention": attention,
        "loss": {"native": "chunked"}.get(cfg.model.implementation, "auto"),
        "hsdp_shard_size": cfg.distributed.hsdp_shard_size,
        # the engine runs one process unwrapped: neither stage nor offload then applies
        "zero_stage": cfg.distributed.zero_stage if strategy in ("fsdp", "hsdp") else None,
        "cpu_offload": cfg.distributed.cpu_offload and strategy in ("fsdp", "hsdp"),
        "tp_size": d.tp_size,
        "sequence_parallel": d.sequence_parallel,
        "pp_size": d.pp_size,
        "pp_schedule": d.pp_schedule,
        "pp_microbatches": d.pp_microbatches,
        "lora_rank": cfg.lora.rank,
        "lora_targets": cfg.lora.target_modules,
        "lora_quantize": cfg.lora.quantize,
        "lora_dropout": cfg.lora.dropout,
        "lora_target_parameters": tuple(cfg.lora.target_parameters),
        "router_aux_loss_coef": cfg.model.router_aux_loss_coef,
    }
    # the job as the config runs it ([dpo], rl.algorithm and rl.kl_coef), or as `overrides` name it
    job = values["job"] = overrides.get("job", cfg.run.job)
    if job == "dpo":
        values["reference"] = not cfg.dpo.precompute_reference
    elif job == "rl":
        values.update(rl_algorithm=cfg.rl.algorithm, reference=cfg.rl.kl_coef > 0)
    if cfg.run.job == "rl" and not cfg.job.command:
        inf = cfg.inference
        values.update(
            max_model_len=inf.max_model_len,
            max_num_seqs=inf.max_num_seqs,
            gpu_memory_utilization=inf.gpu_memory_utilization,
            tensor_parallel=inf.gpus_per_worker,
            colocate=inf.colocate,
        )
    values.update(overrides)
    return MemoryInputs(**values)


def inputs_from_flags(model: dict[str, Any] | str, **settings: Any) -> MemoryInputs:
    """MemoryInputs without a run config: `model` is a config dict, a config.json, a model directory or a hub id;
    `settings` are MemoryInputs fields (those left None keep their defaults)."""
    hf, source = resolve_model(model)
    names = {f.name for f in fields(MemoryInputs)} - {"model", "model_source"}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise MemoryInputError(f"unknown memory setting(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    given = {k: v for k, v in settings.items() if v is not None}
    tp, pp = given.get("tp_size", 1), given.get("pp_size", 1)
    if "strategy" not in given and (tp > 1 or pp > 1):
        # beside tensor or pipeline parallelism the engine refuses 'none' over several replicas: count its 'auto'
        world = given.get("gpus_per_node", 1) * given.get("num_nodes", 1)
        sharded = given.get("zero_stage") is not None or bool(given.get("cpu_offload"))
        given["strategy"] = auto_strategy(world // (tp * pp), sharded, tp)
    return MemoryInputs(model=hf, model_source=source, **given)


# ---------------------------------------------------------------- verdicts per GPU


@dataclass
class GpuVerdict:
    """Whether the trainer (and vLLM, alone or sharing the GPU) fits on one GPU of the table, and with what margin."""

    gpu: str
    memory_bytes: int
    trainer_need_bytes: int
    trainer_fits: bool
    trainer_headroom_bytes: int  # negative: the shortfall
    max_micro_batch: int
    tight: bool
    # inference alone on this GPU
    kv_available_bytes: int | None = None
    full_length_seqs: int | None = None
    inference_verdict: str | None = None  # fits | limited | fails
    # trainer and vLLM sharing this GPU
    colocation: dict[str, Any] | None = None
    # why the run cannot start on this GPU whatever its memory (a bf16 run on a GPU without bf16), or None
    cannot_start: str | None = None

    @property
    def headroom_gib(self) -> float:
        return self.trainer_headroom_bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["memory_gib"] = round(self.memory_bytes / GIB, 2)
        out["trainer_need_gib"] = round(self.trainer_need_bytes / GIB, 2)
        out["trainer_headroom_gib"] = round(self.headroom_gib, 2)
        return out


def _colocation(
    inputs: MemoryInputs, m: ModelShape, gpu: GpuSpec, trainer: TrainerMemory, inf: InferenceMemory
) -> dict[str, Any]:
    """How to split one GPU between the trainer and vLLM: the utilisation, micro-batch and max_num_seqs that fit."""
    cap = gpu.memory_bytes
    one_seq = inf.fixed_bytes + inf.kv_bytes_per_sequence
    min_trainer = trainer_memory(inputs, m, micro_batch=1).total
    if min_trainer + one_seq > cap:
        return {
            "fits": False,
            "need_bytes": min_trainer + one_seq,
            "reason": f"micro-batch 1 ({min_trainer / GIB:.1f} GiB) and one full-length sequence in vLLM "
            f"({one_seq / GIB:.1f} GiB) need {(min_trainer + one_seq) / GIB:.1f} GiB",
        }
    # give the trainer what it needs at the configured micro-batch and vLLM the rest
    trainer_need = trainer.total
    util_for_rest = math.floor((cap - trainer_need) / cap * 100) / 100
    seqs_at_split = max(0, int((util_for_rest * cap - inf.fixed_bytes) // inf.kv_bytes_per_sequence))
    # or give vLLM what max_num_seqs full-length sequences need and the trainer the rest
    util_for_seqs = math.ceil((inf.fixed_bytes + inf.kv_needed_bytes) / cap * 100) / 100
    mb_at_seqs = max_micro_batch(inputs, m, (1 - util_for_seqs) * cap) if util_for_seqs < 1 else 0
    fits = trainer_need + inf.fixed_bytes + inf.kv_needed_bytes <= cap
    if fits:
        # both fit as configured: split the spare memory, so neither side runs at its very edge
        spare = cap - trainer_need - inf.fixed_bytes - inf.kv_needed_bytes
        recommended = math.floor((inf.fixed_bytes + inf.kv_needed_bytes + spare / 2) / cap * 100) / 100
    else:
        recommended = util_for_rest if seqs_at_split >= 1 else util_for_seqs
    return {
        "fits": fits,
        "recommended_gpu_memory_utilization": recommended,
        "max_num_seqs_at_recommended": max(0, int((recommended * cap - inf.fixed_bytes) // inf.kv_bytes_per_sequence)),
        "max_micro_batch_at_recommended": max_micro_batch(inputs, m, (1 - recommended) * cap),
        "trainer_first": {"gpu_memory_utilization": util_for_rest, "max_num_seqs": seqs_at_split},
        "inference_first": {"gpu_memory_utilization": util_for_seqs, "max_micro_batch": mb_at_seqs},
    }


def gpu_verdicts(
    inputs: MemoryInputs, m: ModelShape, trainer: TrainerMemory, inf: InferenceMemory | None, table: GpuTable
) -> list[GpuVerdict]:
    """A verdict for each GPU `inputs.gpus` names, or for every GPU of the table."""
    gpus = [table.find(name) for name in inputs.gpus] if inputs.gpus is not None else list(table.gpus)
    out = []
    for gpu in gpus:
        cap = gpu.memory_bytes
        headroom = cap - trainer.total
        verdict = GpuVerdict(
            gpu=gpu.name,
            memory_bytes=cap,
            trainer_need_bytes=trainer.total,
            trainer_fits=headroom >= 0,
            trainer_headroom_bytes=headroom,
            max_micro_batch=max_micro_batch(inputs, m, cap),
            tight=0 <= headroom < TIGHT_FRACTION * cap,
        )
        if inf is not None:
            available = int(inf.gpu_memory_utilization * cap) - inf.fixed_bytes
            seqs = max(0, available // inf.kv_bytes_per_sequence) if available > 0 else 0
            verdict.kv_available_bytes = available
            verdict.full_length_seqs = int(seqs)
            verdict.inference_verdict = "fits" if seqs >= inf.max_num_seqs else "limited" if seqs >= 1 else "fails"
            if inputs.colocate:
                verdict.colocation = _colocation(inputs, m, gpu, trainer, inf)
        out.append(verdict)
    return out


# ---------------------------------------------------------------- the report


@dataclass
class MemoryReport:
    """What `prime-train memory` prints (or writes as --json): the inputs, the parts, a verdict per GPU."""

    inputs: MemoryInputs
    shape: ModelShape
    trainer: TrainerMemory
    inference: InferenceMemory | None
    gpus: list[GpuVerdict]
    gpu_table_checked: str
    notes: list[str] = field(default_factory=list)
    stages: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        settings = {k: v for k, v in asdict(self.inputs).items() if k != "model"}
        ad = self.inputs.adapters
        lora = None
        if ad is not None:
            lora = {
                "rank": ad.rank,
                "targets": sorted({lin.name.rsplit(".", 1)[-1] for lin in ad.adapted}),
                "quantize": self.inputs.lora_quantize,
                "trainable_params": ad.trainable,
                "exact": ad.exact,
            }
        return {
            "model": {"source": self.inputs.model_source, **asdict(self.shape)},
            "settings": settings,
            "lora": lora,
            "trainer": self.trainer.to_dict(),
            "inference": self.inference.to_dict() if self.inference else None,
            "gpus": [g.to_dict() for g in self.gpus],
            "gpu_table_checked": self.gpu_table_checked,
            "notes": self.notes,
            "zero_stages": self.stages,
        }


def estimate(params: MemoryInputs, *, gpu_table: GpuTable | None = None) -> MemoryReport:
    """The whole estimate: trainer memory per GPU, inference memory, and a verdict for each GPU."""
    shape = ModelShape.from_hf(params.model, params.model_source)
    if params.strategy == "hsdp" and params.world_size % params.shard_group:
        raise MemoryInputError(
            f"hsdp_shard_size = {params.shard_group} does not divide the {params.world_size} GPUs of the job"
        )
    table = gpu_table or load_gpus()
    notes = lora_notes(params) + job_notes(params)
    trainer = trainer_memory(params, shape)
    inf = inference_memory(params, shape)
    if params.strategy in ZERO_FAMILY and params.half:
        notes.append(f"ZeRO family: {params.precision} weights and gradients, fp32 master weights inside the "
                     "optimizer states")  # fmt: skip
    if params.strategy in ("none", "ddp") and params.half:
        notes.append(f"none/ddp in {params.precision}: fp32 weights under autocast, as the embedded engine runs them")
    notes += precision_notes(params) + model_parallel_notes(params, trainer)
    if params.world_size == 1 and params.strategy not in ("none",):
        notes.append(f"strategy {params.strategy} on one GPU shards nothing")
    verdicts = gpu_verdicts(params, shape, trainer, inf, table)
    if params.precision == "bf16":
        no_bf16 = [v.gpu for v in verdicts if not table.find(v.gpu).bf16]
        for v in verdicts:
            if v.gpu in no_bf16:
                v.cannot_start = "no bf16"
        if no_bf16:
            notes.append(f"{', '.join(no_bf16)}: no bf16, so a bf16 run cannot start there (its memory figures are "
                         "what it would take); train in fp32 (--precision fp32) for theirs")  # fmt: skip
    if inf is not None and params.colocate:
        notes.append(
            "colocated: vLLM takes gpu_memory_utilization × the GPU and the trainer gets the rest; start vLLM "
            "first, since it refuses to start when less than that fraction is free"
        )
    return MemoryReport(
        inputs=params,
        shape=shape,
        trainer=trainer,
        inference=inf,
        gpus=verdicts,
        gpu_table_checked=table.checked,
        notes=notes,
        stages=zero_stages(params, shape),
    )


def precision_notes(params: MemoryInputs) -> list[str]:
    """What fp16, float8, the engine's ZeRO stage and CPU offload change in the estimate."""
    notes = []
    if params.precision == "fp16":
        notes.append("fp16: the bytes of bf16; dynamic loss scaling adds a few scalars and skips overflowing steps")
    if params.float8:
        notes.append("float8 (torchao): the same bytes as without it; Float8Linear keeps each linear layer's "
                     "high-precision input and weight for backward, its float8 casts are transient")  # fmt: skip
    if params.zero_stage == 1:
        notes.append("zero_stage 1 runs as stage 2 on FSDP2 (gradients are sharded with the optimizer states)")
    if params.cpu_offload:
        notes.append("cpu_offload: the sharded weights, gradients and optimizer states live in host memory "
                     "(trainer host_bytes, per process); the optimizer steps on the CPU")  # fmt: skip
    return notes


def model_parallel_notes(params: MemoryInputs, trainer: TrainerMemory | None) -> list[str]:
    """What tensor and pipeline parallelism change in the estimate (memory_parallel.py), and which rank it is for."""
    notes = []
    t, p = params.tp_size, params.pp_size
    if t > 1:
        sp = "split too (sequence parallel)" if params.sequence_parallel else "whole on every rank"
        notes.append(f"tp_size = {t}: q/k/v/o and gate/up/down, their gradients and optimizer states split over {t} "
                     "ranks; embeddings, norms and lm_head whole on every rank, as the engine keeps them (the loss "
                     f"is computed in full on each); attention and MLP activations split, the norms' and the residual "
                     f"stream's {sp}")  # fmt: skip
    if p > 1 and trainer is not None and trainer.rank_totals:
        totals = ", ".join(f"{b / GIB:,.2f}" for b in trainer.rank_totals)
        notes.append(f"pp_size = {p} ({params.pp_schedule}): figures for pipeline rank {trainer.pp_rank}, the "
                     f"busiest (GiB per rank: {totals}); rank 0 holds the embeddings, rank {p - 1} the final norm, "
                     "lm_head and the loss")  # fmt: skip
    if t > 1 or p > 1:
        notes.append(f"{params.strategy} over dp = {params.dp_size} replica(s) of the {t} × {p} (tp × pp) ranks; the "
                     "ZeRO stage table is for data parallelism alone and is left out")  # fmt: skip
    return notes


# the rows of the side-by-side table: (stage, the engine's settings on FSDP2, DeepSpeed's ZeRO accounting)
STAGE_ROWS = (
    ("0", {"strategy": "ddp"}, {"strategy": "ddp"}),
    ("1", {"strategy": "fsdp", "zero_stage": 1}, {"strategy": "zero1"}),
    ("2", {"strategy": "fsdp", "zero_stage": 2}, {"strategy": "zero2"}),
    ("3", {"strategy": "fsdp", "zero_stage": 3}, {"strategy": "zero3"}),
    ("3 + cpu offload", {"strategy": "fsdp", "zero_stage": 3, "cpu_offload": True},
     {"strategy": "zero3", "cpu_offload": True}),
)  # fmt: skip
STAGE_SHARDS = {
    "0": "nothing (DDP: every GPU holds everything)",
    "1": "optimizer states (engine: + gradients, as stage 2)",
    "2": "optimizer states, gradients",
    "3": "optimizer states, gradients, parameters",
    "3 + cpu offload": "as 3, the shards in host memory",
}


def zero_stages(params: MemoryInputs, shape: ModelShape) -> list[dict[str, Any]]:
    """Per-GPU trainer memory at each ZeRO stage and with CPU offload, the rest of `params` as given: as the engine
    runs each stage on FSDP2 (fp32 parameters), and as DeepSpeed's ZeRO accounts it (half-precision weights, fp32
    master copy in the optimizer states). Empty for LoRA with NF4, which cannot be sharded."""
    if params.lora_quantize == "nf4" or params.tp_size > 1 or params.pp_size > 1:
        return []
    rows = []
    base = {"zero_stage": None, "cpu_offload": False, "hsdp_shard_size": None}
    for stage, engine, zero in STAGE_ROWS:
        ours = trainer_memory(replace(params, **{**base, **engine}), shape)
        theirs = trainer_memory(replace(params, **{**base, **zero}), shape)
        rows.append({
            "stage": stage,
            "shards": STAGE_SHARDS[stage],
            "engine_bytes": ours.total, "engine_gib": round(ours.total / GIB, 2),
            "engine_host_gib": round(ours.host_bytes / GIB, 2),
            "deepspeed_bytes": theirs.total, "deepspeed_gib": round(theirs.total / GIB, 2),
        })  # fmt: skip
    return rows


def lora_notes(params: MemoryInputs) -> list[str]:
    """What the estimate says of LoRA's adapters; MemoryInputError for target_modules that name no linear layer of a
    model whose layers the counter knows (the engine would refuse them at start-up)."""
    ad = params.adapters
    if ad is None:
        return []
    if ad.unmatched and (ad.exact or not ad.adapted):
        shown = ", ".join(repr(t) for t in ad.unmatched)
        raise MemoryInputError(
            f"lora.target_modules: {shown} {'matches' if len(ad.unmatched) == 1 else 'match'} no linear layer in the "
            f"decoder blocks; its linear layers are: {', '.join(ad.linear_names)} (or use 'all-linear')"
        )
    if why := ad.expert_problem():
        raise MemoryInputError(why)
    notes = [f"LoRA adapters: {n}" for n in ad.notes]
    if ad.unmatched_experts:
        notes.append(
            f"lora.target_parameters {', '.join(map(repr, ad.unmatched_experts))}: the counter does not know this "
            "family's expert tensors; their adapters and merged weights are not counted"
        )
    if ad.unmatched:
        notes.append(f"lora.target_modules {', '.join(map(repr, ad.unmatched))}: no such layer in the counted model")
    if params.lora_quantize == "nf4":
        notes.append(
            f"NF4 base: {NF4_BYTES_PER_PARAM:.3f} B a weight (bitsandbytes' 4-bit NormalFloat with double-quantized "
            "block constants); its matmuls dequantize each weight, so expect slower steps than a bf16 base"
        )
    return notes


def job_notes(params: MemoryInputs) -> list[str]:
    """What the estimate assumes of the job: pairs, a reference model, the heads it adds."""
    notes = []
    if params.sequences_per_sample == 2:
        notes.append(
            f"{params.job}: micro_batch counts preference pairs, each a chosen and a rejected sequence: activations "
            f"are those of {2 * params.micro_batch} sequences"
        )
    if params.job == "dpo":
        if params.holds_reference:
            notes.append(
                "dpo: the frozen reference (a copy of the starting weights) is counted; dpo.precompute_reference = "
                "true or LoRA hold none"
            )
        else:
            why = "LoRA: the base with the adapters switched off" if params.lora_rank else "precomputed log-probs"
            notes.append(f"dpo: no reference model held ({why})")
    if params.job == "reward":
        notes.append("reward: a Linear(hidden, 1) score head in place of lm_head; no vocabulary logits")
    if params.job == "meta":
        notes.append(
            "meta: Reptile's inner copy of the weights (with gradients, Adam's moments and the mean of the adapted "
            "weights) is counted; a step's activations are one micro-batch's, as SFT's"
        )
    if params.job == "rl" and params.holds_reference:
        notes.append("rl.kl_coef > 0: the KL anchor, a frozen copy of the starting weights, is counted")
    if params.value_head:
        notes.append("ppo: the value head shares the policy's trunk; only its Linear(hidden, 1) is added")
    return notes


# ---------------------------------------------------------------- rendering


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.2f}"


def render_memory(report: MemoryReport, console: Console) -> None:
    """Rich tables: the per-GPU breakdown, a verdict per GPU, and the inference and colocation figures."""
    from rich.table import Table

    p, m = report.inputs, report.shape
    from rich.markup import escape  # a model path is text: "runs/[x]/final" keeps its "[x]"

    console.print(
        f"[bold]{escape(str(p.model_source))}[/]: {m.num_params / 1e9:,.3f}B params, {m.layers} layers, "
        f"hidden {m.hidden}, {m.heads} heads ({m.kv_heads} kv), vocab {m.vocab:,}"
    )
    job = f"{p.job}, {p.rl_algorithm}" if p.job == "rl" else p.job
    pairs = " pair(s)" if p.sequences_per_sample == 2 else ""
    loss = "from a score head" if p.job == "reward" else "chunked" if p.chunked_loss else "on whole logits"
    mesh = f" = dp {p.dp_size} × tp {p.tp_size} × pp {p.pp_size}" if p.tp_size * p.pp_size > 1 else ""
    console.print(
        f"training ({job}): {p.strategy} over {p.world_size} GPU(s){mesh} ({p.gpus_per_node}/node × {p.num_nodes}), "
        f"{p.precision}, {p.optimizer}, micro-batch {p.micro_batch}{pairs} × seq {p.seq_len}, "
        f"checkpointing {p.activation_checkpointing}, attention {p.attention}, loss {loss}"
    )
    if (ad := p.adapters) is not None:
        t = report.trainer
        targets = ", ".join(sorted({lin.name.rsplit(".", 1)[-1] for lin in ad.adapted}))
        if ad.experts:
            targets += f" and every expert's {', '.join(t.name.rsplit('.', 1)[-1] for t in ad.experts)}"
        console.print(
            f"LoRA rank {ad.rank} on {escape(targets)}: {t.trainable_params:,} trainable of {t.total_params:,} "
            f"parameters ({100 * t.trainable_fraction:.3f} %)" + (", base in NF4" if p.lora_quantize == "nf4" else "")
        )
    parts = Table(title="Trainer memory per GPU", title_justify="left")
    parts.add_column("part")
    parts.add_column("GiB", justify="right")
    parts.add_column("how")
    for part in report.trainer.parts:
        parts.add_row(part.name, _gib(part.bytes), part.how)
    parts.add_row("[bold]total[/]", f"[bold]{_gib(report.trainer.total)}[/]", "")
    console.print(parts)

    verdicts = Table(title=f"Fit per GPU (table checked {report.gpu_table_checked})", title_justify="left")
    for col, justify in (("GPU", "left"), ("memory GiB", "right"), ("trainer", "left"), ("headroom GiB", "right"),
                         ("max micro-batch", "right")):  # fmt: skip
        verdicts.add_column(col, justify=justify)  # type: ignore[arg-type]
    inf = report.inference
    if inf is not None:
        verdicts.add_column("vLLM full-length seqs", justify="right")
    for g in report.gpus:
        fit = "[yellow]tight[/]" if g.tight else "[green]fits[/]" if g.trainer_fits else "[red]does not fit[/]"
        if g.cannot_start:
            fit = f"[red]cannot start ({g.cannot_start})[/]"
        row = [g.gpu, f"{g.memory_bytes / GIB:,.1f}", fit, f"{g.headroom_gib:+,.2f}", str(g.max_micro_batch)]
        if inf is not None:
            colour = {"fits": "green", "limited": "yellow", "fails": "red"}[g.inference_verdict or "fails"]
            row.append(f"[{colour}]{g.full_length_seqs} / {inf.max_num_seqs}[/]")
        verdicts.add_row(*row)
    console.print(verdicts)

    if inf is not None:
        console.print(
            f"vLLM: weights {_gib(inf.weights_bytes)} GiB (TP {inf.tensor_parallel}), profiling forward "
            f"{_gib(inf.activation_bytes)} GiB, runtime {_gib(inf.runtime_bytes)} GiB; KV cache "
            f"{inf.kv_bytes_per_token / 1024:,.1f} KiB/token = {_gib(inf.kv_bytes_per_sequence)} GiB per "
            f"{inf.max_model_len}-token sequence; {inf.max_num_seqs} sequences need {_gib(inf.kv_needed_bytes)} GiB "
            f"at gpu_memory_utilization {inf.gpu_memory_utilization}"
        )
        colocated = [g for g in report.gpus if g.colocation]
        if colocated:
            table = Table(title="Trainer and vLLM on one GPU", title_justify="left")
            for col in ("GPU", "both fit", "gpu_memory_utilization", "max_num_seqs", "max micro-batch"):
                table.add_column(col)
            for g in colocated:
                c = g.colocation or {}
                if "recommended_gpu_memory_utilization" not in c:
                    table.add_row(g.gpu, "[red]no[/]", f"needs {c['need_bytes'] / GIB:,.1f} GiB", "", "")
                    continue
                table.add_row(
                    g.gpu,
                    "[green]yes[/]" if c["fits"] else "[yellow]not as configured[/]",
                    f"{c['recommended_gpu_memory_utilization']:.2f}",
                    str(c["max_num_seqs_at_recommended"]),
                    str(c["max_micro_batch_at_recommended"]),
                )
            console.print(table)
    _render_stages(report, console)
    for note in report.notes:
        console.print(f"[dim]note: {escape(note)}[/]")


def _render_stages(report: MemoryReport, console: Console) -> None:
    """The ZeRO stages side by side: per-GPU GiB as the engine runs them and as DeepSpeed accounts them."""
    from rich.table import Table

    if not report.stages:
        return
    p = report.inputs
    table = Table(title=f"ZeRO stages per GPU over {p.world_size} GPU(s), {p.precision}", title_justify="left")
    for col, justify in (("stage", "left"), ("shards", "left"), ("engine (FSDP2) GiB", "right"),
                         ("host GiB", "right"), ("DeepSpeed accounting GiB", "right")):  # fmt: skip
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for row in report.stages:
        host = f"{row['engine_host_gib']:,.2f}" if row["engine_host_gib"] else ""
        table.add_row(row["stage"], row["shards"], f"{row['engine_gib']:,.2f}", host, f"{row['deepspeed_gib']:,.2f}")
    console.print(table)
