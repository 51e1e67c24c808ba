"""`prime-train cost`: what a run will cost, on each GPU type and provider, on-demand and spot.

cost = GPU-hours × price; GPU-hours = wall-clock hours × GPUs; wall-clock = the run's tokens × FLOPs per token /
(GPUs × bf16 peak × MFU), or the run's steps × a measured step time. One figure would claim a precision nobody
has before the run, so every figure is a range: MFU ± 0.1 around the given one (0.3–0.5 at the default 0.4), or
a measured step time ± 10 % (packing, evaluation and checkpoint pauses move it about that much). Start-up,
evaluation passes and checkpoint saves beyond that are not counted.

FLOPs per token are the engine's (engine/model.py `flops_per_token`): 6N for the matmuls with weights (N without
the input embedding table; a tied lm_head still counts, as a matmul) plus 12 · layers · heads · head_dim ·
seq_len for attention. They are recomputed here from the HF config dict, so this module stays torch-free; a test
holds the two equal.

The preference jobs train on pairs: a step of global_batch_size pairs is twice as many sequences (chosen and
rejected), each trained as an SFT sequence is, so a dpo or reward step does about twice the work of an SFT step of
the same micro_batch_size. dpo adds its frozen reference's forward over both sequences (2 FLOPs a matmul weight plus
attention's forward, a third of a trained token's), unless dpo.precompute_reference computed it once before
training (that one pass is not counted); a reward model has no lm_head matmul (its score head is one vector). RL
(GRPO and PPO alike) is priced from a measured step time only: rollout generation dominates it.

Prices come from data/prices.json through prices.py (a user's file overrides it entry by entry).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from prime_train.config.accelerators import Accelerators, parse_accelerators
from prime_train.validator.gpus import GpuSpec, GpuTable, load_gpus
from prime_train.validator.memory import estimate, inputs_from_config
from prime_train.validator.memory_inputs import MemoryInputError, resolve_model
from prime_train.validator.method_checks import meta_cost_note, meta_step_sequences
from prime_train.validator.model_shape import model_shape
from prime_train.validator.param_count import count_adapters, count_parameters
from prime_train.validator.prices import CostInputError, PriceTable, load_prices

if TYPE_CHECKING:
    from rich.console import Console

    from prime_train.config.schema import Config, TrainConfig

MFU_SPREAD = 0.1
MEASURED_SPREAD = 0.10

# ---------------------------------------------------------------- FLOPs and tokens


def flops_per_token(hf: dict[str, Any], seq_len: int, adapters: int | None = None) -> float:
    """Training FLOPs per token (forward + backward): the engine's formula, on an HF config dict.

    With LoRA (`adapters`: the trainable adapter parameters) the frozen base computes no weight gradients: 4 FLOPs
    per base parameter (2 forward, 2 for the input gradients) instead of 6, and the adapters 6 each."""
    if "hidden_size" not in hf and isinstance(hf.get("text_config"), dict):
        hf = hf["text_config"]
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
    head_dim = hf.get("head_dim") or h // heads
    tied = hf.get("tie_word_embeddings", True)
    # the input embedding is a lookup, not a matmul; a tied lm_head shares its table but is a matmul
    matmul_params = count_parameters(hf) - (0 if tied else vocab * h)
    weights = 6.0 * matmul_params if adapters is None else 4.0 * matmul_params + 6.0 * adapters
    return weights + 12.0 * layers * heads * head_dim * seq_len


def job_flops_per_token(
    hf: dict[str, Any], seq_len: int, job: str, adapters: int | None = None, *, reference_forward: bool = False
) -> float:
    """FLOPs per token a job computes: `flops_per_token`'s training work, less lm_head's matmul for a reward model
    (its score head, hidden wide, trains in full), plus a forward of the frozen reference (`reference_forward`,
    DPO's without precomputed log-probs): 2 FLOPs a matmul weight and a third of attention's, forward only."""
    flops = flops_per_token(hf, seq_len, adapters)
    if "hidden_size" not in hf and isinstance(hf.get("text_config"), dict):
        hf = hf["text_config"]
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    if job == "reward":
        flops += 6.0 * h - (6.0 if adapters is None else 4.0) * vocab * h
    if reference_forward:
        heads, layers = hf["num_attention_heads"], hf["num_hidden_layers"]
        head_dim = hf.get("head_dim") or h // heads
        matmul_params = count_parameters(hf) - (0 if hf.get("tie_word_embeddings", True) else vocab * h)
        flops += 2.0 * matmul_params + 4.0 * layers * heads * head_dim * seq_len
    return flops


def sequences_per_sample(job: str) -> int:
    """Sequences one unit of train.global_batch_size is: 2 for a preference pair (dpo, reward), else 1."""
    return 2 if job in ("dpo", "reward") else 1


def total_sequences(train: TrainConfig, seq_len: int, world_size: int, steps: int | None = None) -> int:
    """Sequences the run trains on over `steps` (default max_steps), with the engine's batch ramp.

    The ramp follows engine/schedule.py `batch_size_at` (which imports torch, so it is mirrored here; a test
    holds the two equal): from batch_ramp_start (or one micro-batch per rank) up to global_batch_size, linearly
    in tokens seen, in whole micro-batches per rank. Every packed sequence counts seq_len tokens.
    """
    steps = train.max_steps if steps is None else steps
    target = train.global_batch_size
    ramp = train.batch_ramp_tokens
    if not ramp:
        return steps * target
    unit = train.micro_batch_size * world_size
    start = train.batch_ramp_start or unit
    total, tokens = 0, 0
    for _ in range(steps):
        if tokens >= ramp:
            batch = target
        else:
            batch = min(target, max(unit, int(start + (target - start) * tokens / ramp) // unit * unit))
        total += batch
        tokens += batch * seq_len
    return total


# ---------------------------------------------------------------- the estimate


@dataclass
class ProviderCost:
    provider: str
    on_demand_rate: float | None
    spot_rate: float | None
    on_demand_usd: tuple[float, float, float] | None  # low, mid, high
    spot_usd: tuple[float, float, float] | None
    as_of: str
    source: str


@dataclass
class GpuCost:
    gpu: str
    num_gpus: int
    step_time_s: tuple[float, float, float]  # fast, mid, slow
    wall_hours: tuple[float, float, float]
    gpu_hours: tuple[float, float, float]
    basis: str
    providers: list[ProviderCost]
    memory_need_bytes: int | None = None  # per GPU, from the memory calculator
    memory_bytes: int | None = None

    @property
    def fits_memory(self) -> bool | None:
        if self.memory_need_bytes is None or self.memory_bytes is None:
            return None
        return self.memory_need_bytes <= self.memory_bytes


@dataclass
class CostReport:
    model_source: str
    num_params: int
    flops_per_token: float
    steps: int
    seq_len: int
    total_tokens: int
    tokens_per_full_step: int
    num_gpus: int
    rows: list[GpuCost]
    prices_as_of: str
    prices_note: str
    price_files: list[str]
    notes: list[str] = field(default_factory=list)
    job: str = "sft"  # run.job: dpo and reward count two sequences a pair

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _gpu_request(cfg: Config) -> Accelerators | None:
    """The accelerators per node a config asks for in [spot].accelerators ('H100:8').

    Only a config that has a [spot] table asks for GPUs this way; the section's defaults mean nothing.
    """
    if "spot" not in cfg.model_fields_set:
        return None
    try:
        return parse_accelerators(cfg.spot.accelerators, what="spot.accelerators")
    except ValueError as exc:
        raise CostInputError(str(exc)) from None


def local_gpu_names() -> list[str]:
    """The names of this machine's GPUs that CUDA_VISIBLE_DEVICES leaves visible (NVML, or a replayed gpu.jsonl);
    [] on a machine without NVIDIA GPUs."""
    from prime_train.kit.gpu import ENV_GPU_REPLAY, NvmlSource, gpu_inventory, readings_of, visible_devices

    if not (os.environ.get(ENV_GPU_REPLAY) or NvmlSource.available()):
        return []
    return [r.name for r in readings_of(gpu_inventory(), visible_devices())]


def gpu_to_measure(gpu: str | None, here: list[str]) -> GpuSpec:
    """The GPU type a step time measured on this machine prices: this machine's GPU, which `gpu` may only name.

    Asked before measuring (`cost --measure`), so a machine that cannot answer the question says so at once: a
    step timed on a CPU says nothing about any GPU's, and one timed on an A10 nothing about an H100's.
    """
    if not here:
        raise CostInputError(
            "--measure times steps on this machine, and it has no GPU (NVML finds none): a CPU step time says nothing "
            "about a GPU's. Run `cost --measure` on the GPU you will rent, or leave out --measure to estimate from "
            "FLOPs per token at --mfu (add --gpu NAME for one GPU type)"
        )
    try:
        local = load_gpus().find(here[0])
    except MemoryInputError as exc:
        raise CostInputError(f"this machine's GPU is not in the GPU table, so it cannot be priced: {exc}") from None
    if gpu is not None:
        try:
            asked = load_gpus().find(gpu)
        except MemoryInputError as exc:
            raise CostInputError(str(exc)) from None
        if asked.name != local.name:
            raise CostInputError(
                f"--gpu {gpu} with --measure: this machine's GPU is a {local.name}, and a step time measured on it "
                f"says nothing about a {asked.name}. Measure on a {asked.name}, or leave out --measure to estimate it"
            )
    return local


def measured_on_cpu_error(device: str) -> CostInputError:
    """The refusal when a measured step ran on the CPU although this machine lists a GPU (a CPU build of torch)."""
    return CostInputError(
        f"the measured steps ran on {device}, not on this machine's GPU (is torch a CPU build? `python -c 'import "
        "torch; print(torch.cuda.is_available())'`): a CPU step time says nothing about a GPU's, so it is not priced"
    )


def estimate_cost(
    cfg: Config,
    *,
    gpu: str | None = None,
    num_gpus: int | None = None,
    step_time_s: float | None = None,
    mfu: float = 0.4,
    prices_file: str | None = None,
    steps: int | None = None,
    model: dict[str, Any] | str | None = None,
    here_gpus: list[str] | None = None,
) -> CostReport:
    """The cost of `cfg`'s run per GPU type and provider, on-demand and spot, as low–mid–high ranges.

    `gpu` picks one GPU type (a name or alias from data/gpus.json, or an accelerator string such as 'H100:8', whose
    count is then `num_gpus`); unset, the GPU of [spot].accelerators, else every GPU type with a known bf16 peak
    and a price is listed. `num_gpus` defaults to distributed.nproc_per_node × nnodes, else to the count in
    spot.accelerators × spot.num_nodes. `step_time_s` is a measured seconds per full-batch step on `gpu` × `num_gpus`
    (from a profile run); without it the step time is estimated from FLOPs at `mfu`. `here_gpus`, this machine's
    GPUs (`local_gpu_names`), only words a note: a config that names no GPU runs on this machine's CPU when it has
    none.
    """
    _check_arguments(mfu, step_time_s, num_gpus)
    gpus = load_gpus()
    prices = load_prices(prices_file, gpus=gpus)
    notes: list[str] = []

    if gpu is not None and ":" in gpu:
        gpu, num_gpus = _split_accelerators(gpu, num_gpus)
    requested = _gpu_request(cfg)
    requested_gpu = requested.name if requested else None
    if num_gpus is None:
        num_gpus = _default_num_gpus(cfg, requested, notes)
    if gpu is None and requested_gpu is None:
        _note_no_gpu_type(cfg, num_gpus, here_gpus, notes)
    if step_time_s is not None and gpu is None:
        gpu = _measured_gpu(requested_gpu, notes)
    selected = _named_gpu(gpu, gpus, prices, notes)
    _require_measured_step(cfg, step_time_s)

    run = _run_size(cfg, model, steps, num_gpus)
    if step_time_s is None:
        notes.extend(_job_notes(cfg))
    if cfg.lora.enabled and step_time_s is None:
        notes.append(
            f"LoRA (rank {cfg.lora.rank}): the frozen base computes no weight gradients, 4N + 6 × adapters FLOPs per "
            "token instead of 6N"
            + ("; NF4 dequantizes every base weight in each matmul: expect a lower MFU (measure it)"
               if cfg.lora.quantize == "nf4" else "")
        )  # fmt: skip
    if cfg.train.precision == "fp32" and step_time_s is None:
        notes.append("train.precision = 'fp32': the estimate uses bf16 peaks; fp32 (TF32) runs are slower")
    if not selected:
        selected = _priced_gpus(gpus, prices, step_time_s, notes)
    # an external command's model is not [model]'s: its memory is not ours to judge
    need = None if cfg.job.command else _memory_need(cfg, run.hf, num_gpus, notes)
    rows = [_gpu_cost(spec, num_gpus, run, step_time_s, mfu, prices, need) for spec in selected]
    return CostReport(
        model_source=run.source,
        num_params=count_parameters(run.hf),
        flops_per_token=run.flops_per_token,
        steps=run.steps,
        seq_len=run.seq_len,
        total_tokens=run.total_tokens,
        tokens_per_full_step=run.full_step_tokens,
        num_gpus=num_gpus,
        rows=rows,
        prices_as_of=prices.as_of,
        prices_note=prices.note,
        price_files=list(prices.files),
        notes=notes,
        job=cfg.run.job,
    )


def _job_notes(cfg: Config) -> list[str]:
    """What the FLOPs estimate assumes of a preference job."""
    job = cfg.run.job
    if job == "meta" and not cfg.job.command:
        return [meta_cost_note(cfg)]
    if job not in ("dpo", "reward") or cfg.job.command:
        return []
    pairs = cfg.train.global_batch_size
    notes = [
        f"{job}: a step's {pairs} pairs are {2 * pairs} sequences (chosen and rejected), each trained forward and "
        "backward as an SFT sequence: about twice the work of an SFT step of the same micro_batch_size"
    ]
    if job == "reward":
        notes.append("reward: a Linear(hidden, 1) score head in place of lm_head, whose matmul is not computed")
    elif cfg.dpo.precompute_reference:
        notes.append(
            "dpo.precompute_reference: no reference forward in the steps; its one pass over the training pairs "
            "before step 1 (a resume reads it back from the checkpoint) is not counted"
        )
    else:
        whose = "the base with the adapters switched off (LoRA)" if cfg.lora.enabled else "the frozen reference"
        notes.append(
            f"dpo: plus {whose}'s forward over both sequences, 2 FLOPs a matmul weight and a third of attention's "
            "(a third of a trained token), at the same MFU"
        )
    return notes


def _check_arguments(mfu: float, step_time_s: float | None, num_gpus: int | None) -> None:
    """CostInputError for an MFU, step time or GPU count that no run can have."""
    if not 0 < mfu <= 1:
        raise CostInputError(f"mfu = {mfu!r}: must be a fraction in (0, 1], e.g. 0.4")
    if step_time_s is not None and not step_time_s > 0:
        raise CostInputError(f"step time = {step_time_s!r} s: must be > 0")
    if num_gpus is not None and num_gpus < 1:
        raise CostInputError(f"num_gpus = {num_gpus!r}: must be ≥ 1")


def _split_accelerators(gpu: str, num_gpus: int | None) -> tuple[str, int]:
    """--gpu 'H100:8': the GPU type and, unless `num_gpus` is given, the count."""
    try:
        asked = parse_accelerators(gpu, what="--gpu")
        count = asked.whole_count("cost counts whole GPUs", what="--gpu")
    except ValueError as exc:
        raise CostInputError(str(exc)) from None
    return asked.name, num_gpus if num_gpus is not None else count


def _default_num_gpus(cfg: Config, requested: Accelerators | None, notes: list[str]) -> int:
    """The GPUs the run uses when none were given: distributed.nproc_per_node × nnodes, else spot.accelerators ×
    spot.num_nodes, else 1."""
    if cfg.distributed.nproc_per_node:
        return cfg.distributed.nproc_per_node * cfg.distributed.nnodes
    if requested is not None and not requested.is_cpu:
        try:  # GPUs are priced and sharded whole, though SkyPilot may share one
            per_node = requested.whole_count("cost counts whole GPUs (or pass num_gpus)", what="spot.accelerators")
        except ValueError as exc:
            raise CostInputError(str(exc)) from None
        num_gpus = per_node * cfg.spot.num_nodes
        notes.append(f"{num_gpus} GPU(s) from spot.accelerators = {cfg.spot.accelerators!r} × spot.num_nodes")
        return num_gpus
    return 1


def _note_no_gpu_type(cfg: Config, num_gpus: int, here_gpus: list[str] | None, notes: list[str]) -> None:
    """The notes for a config and a question that name no GPU type: every priced one is listed."""
    how_many = f"{num_gpus} GPU(s) (distributed.nproc_per_node × nnodes)" if cfg.distributed.nproc_per_node else "1 GPU"
    notes.append(
        f"the config names no GPU type (no [spot] table with accelerators) and --gpu was not given: every priced "
        f"GPU type is listed, at {how_many}"
    )
    if here_gpus == [] and not cfg.distributed.nproc_per_node:
        notes.append(
            "as written, this config runs on this machine's CPU (it has no GPU), which costs nothing listed here; "
            "these are the GPUs you could rent for it"
        )


def _measured_gpu(requested_gpu: str | None, notes: list[str]) -> str:
    """The GPU type a measured step time belongs to when --gpu is not given: the one of spot.accelerators."""
    if requested_gpu is None:
        raise CostInputError("a measured step time belongs to one GPU type: name it (--gpu NAME, e.g. --gpu H100)")
    notes.append(
        f"the step time is taken as measured on {requested_gpu} (from spot.accelerators); name the GPU to change it"
    )
    return requested_gpu


def _named_gpu(gpu: str | None, gpus: GpuTable, prices: PriceTable, notes: list[str]) -> list[GpuSpec]:
    """The one GPU type asked for, from the GPU table; [] when none is named."""
    if not gpu:
        return []
    try:
        selected = [gpus.find(gpu)]
    except MemoryInputError as exc:
        raise CostInputError(str(exc)) from None
    if not prices.for_gpu(selected[0].name):
        notes.append(f"no price listed for {selected[0].name}: add one with a prices file")
    return selected


def _require_measured_step(cfg: Config, step_time_s: float | None) -> None:
    """CostInputError for a run whose step time FLOPs cannot predict (RL, an external job) without a measured one."""
    if cfg.run.job == "rl" and step_time_s is None:
        raise CostInputError(
            "an RL step's time is mostly rollout generation, which FLOPs per token do not predict: pass a measured "
            "step time (prime-train profile) for the GPU you will use"
        )
    if cfg.job.command and step_time_s is None:
        raise CostInputError(
            "the cost of an external [job].command needs its measured step time (and steps, if not train.max_steps)"
        )


@dataclass(frozen=True)
class _RunSize:
    """What the run computes, whatever it runs on: the model, its steps and tokens, and FLOPs per token."""

    hf: dict[str, Any]
    source: str
    steps: int
    seq_len: int
    total_tokens: int
    full_step_tokens: int
    flops_per_token: float


def _run_size(cfg: Config, model: dict[str, Any] | str | None, steps: int | None, num_gpus: int) -> _RunSize:
    """The model's shape (`model`, else the config's) and the tokens of the run's steps on `num_gpus` GPUs."""
    if model is not None:
        hf, source = resolve_model(model)
    else:
        hf, source = model_shape(cfg)
        if hf is None:
            raise CostInputError(f"the model's shape is unknown: {source}")
    seq_len = cfg.data.seq_len
    run_steps = cfg.train.max_steps if steps is None else steps
    if run_steps < 1:
        raise CostInputError(f"steps = {run_steps!r}: must be ≥ 1")
    sequences = total_sequences(cfg.train, seq_len, num_gpus, run_steps)
    job = cfg.run.job if not cfg.job.command else "sft"  # an external command's work is only known as measured
    per = sequences_per_sample(job)  # global_batch_size counts pairs in the preference jobs
    step_sequences = meta_step_sequences(cfg) if job == "meta" else cfg.train.global_batch_size
    if job == "meta":
        sequences = run_steps * step_sequences
    reference = job == "dpo" and not cfg.dpo.precompute_reference
    try:
        flops = job_flops_per_token(hf, seq_len, job, _adapters(cfg, hf), reference_forward=reference)
    except (KeyError, TypeError) as exc:
        raise CostInputError(f"the model's config lacks {exc}: FLOPs per token not counted") from None
    return _RunSize(
        hf=hf,
        source=source,
        steps=run_steps,
        seq_len=seq_len,
        total_tokens=sequences * per * seq_len,
        full_step_tokens=step_sequences * per * seq_len,
        flops_per_token=flops,
    )


def _adapters(cfg: Config, hf: dict[str, Any]) -> int | None:
    """The trainable adapter parameters of a LoRA run (None without LoRA)."""
    if not cfg.lora.enabled:
        return None
    try:
        return count_adapters(hf, cfg.lora.rank, cfg.lora.target_modules, cfg.lora.target_parameters).trainable
    except (KeyError, TypeError, ValueError) as exc:
        raise CostInputError(f"LoRA adapters not counted: the model's config lacks {exc}") from None


def _priced_gpus(gpus: GpuTable, prices: PriceTable, step_time_s: float | None, notes: list[str]) -> list[GpuSpec]:
    """Every GPU type with a price and a way to its step time (a bf16 peak, or the measured step time)."""
    selected = [g for g in gpus.gpus if prices.for_gpu(g.name) and (g.bf16_tflops or step_time_s)]
    skipped = [g.name for g in gpus.gpus if prices.for_gpu(g.name) and not g.bf16_tflops]
    if skipped:
        notes.append(f"left out (no published bf16 peak; measure a step time): {', '.join(skipped)}")
    return selected


def _step_times(
    spec: GpuSpec, num_gpus: int, run: _RunSize, step_time_s: float | None, mfu: float
) -> tuple[tuple[float, float, float], str]:
    """Seconds per full-batch step on `num_gpus` of `spec` (fast, mid, slow), and how they were found."""
    if step_time_s is not None:
        mid = step_time_s
        fast, slow = mid * (1 - MEASURED_SPREAD), mid * (1 + MEASURED_SPREAD)
        return (fast, mid, slow), f"measured {duration(mid)}/step ± {MEASURED_SPREAD:.0%}"
    if not spec.bf16_tflops:
        raise CostInputError(f"{spec.name} has no published bf16 peak to estimate from: pass a measured step time")
    lo, hi = max(0.05, mfu - MFU_SPREAD), min(1.0, mfu + MFU_SPREAD)
    flops_per_s = num_gpus * spec.bf16_tflops * 1e12
    step_flops = run.full_step_tokens * run.flops_per_token
    mid = step_flops / (flops_per_s * mfu)
    fast, slow = step_flops / (flops_per_s * hi), step_flops / (flops_per_s * lo)
    return (fast, mid, slow), f"estimated at MFU {lo:.2f}–{hi:.2f} of {spec.bf16_tflops:g} TFLOP/s bf16"


def _gpu_cost(
    spec: GpuSpec,
    num_gpus: int,
    run: _RunSize,
    step_time_s: float | None,
    mfu: float,
    prices: PriceTable,
    need: int | None,
) -> GpuCost:
    """The run on `num_gpus` of `spec`: its step time, hours and cost at each provider that prices `spec`."""
    step_time, basis = _step_times(spec, num_gpus, run, step_time_s, mfu)
    full_steps = run.total_tokens / run.full_step_tokens  # a ramped batch makes early steps shorter
    wall = tuple(t * full_steps / 3600 for t in step_time)
    gpu_hours = tuple(w * num_gpus for w in wall)
    providers = []
    for price in sorted(prices.for_gpu(spec.name), key=lambda p: p.provider):
        providers.append(
            ProviderCost(
                provider=price.provider,
                on_demand_rate=price.on_demand,
                spot_rate=price.spot,
                on_demand_usd=None if price.on_demand is None else tuple(h * price.on_demand for h in gpu_hours),
                spot_usd=None if price.spot is None else tuple(h * price.spot for h in gpu_hours),
                as_of=price.as_of,
                source=price.source,
            )  # type: ignore[arg-type]
        )
    return GpuCost(
        gpu=spec.name,
        num_gpus=num_gpus,
        step_time_s=step_time,
        wall_hours=wall,  # type: ignore[arg-type]
        gpu_hours=gpu_hours,  # type: ignore[arg-type]
        basis=basis,
        providers=providers,
        memory_need_bytes=need,
        memory_bytes=spec.memory_bytes,
    )


def _memory_need(cfg: Config, hf: dict[str, Any], num_gpus: int, notes: list[str]) -> int | None:
    """Per-GPU training memory of the run on `num_gpus` GPUs (the memory calculator), to flag GPUs it cannot fit."""
    per_node = cfg.distributed.nproc_per_node or max(1, num_gpus // max(1, cfg.spot.num_nodes))
    if num_gpus % per_node:
        per_node = num_gpus
    try:
        inputs = inputs_from_config(cfg, model=hf, gpus_per_node=per_node, num_nodes=num_gpus // per_node, gpus=[])
        return estimate(inputs).trainer.total
    except MemoryInputError as exc:
        notes.append(f"memory fit not checked: {exc}")
        return None


# ---------------------------------------------------------------- rendering


def duration(seconds: float) -> str:
    """A time in the unit that reads best, to 3 significant figures: '39.2 µs', '118 ms', '4.20 s', '3.10 h'."""
    for unit, size, top in (("µs", 1e-6, 1e-3), ("ms", 1e-3, 1.0), ("s", 1.0, 60.0), ("min", 60.0, 3600.0)):
        text = _sig3(seconds / size)
        if seconds < top and float(text) < round(top / size):  # 999.96 µs reads as 1.00 ms, not 1000 µs
            return f"{text} {unit}"
    hours = seconds / 3600
    return f"{hours:,.0f} h" if hours >= 1000 else f"{_sig3(hours)} h"


def _sig3(value: float) -> str:
    """3 significant figures, never in exponent form: 0.123, 1.23, 12.3, 123."""
    if value == 0:
        return "0"
    rounded = float(f"{value:.3g}")  # 0.9999 -> 1.0: the digits follow the rounded value
    digits = max(0, 2 - math.floor(math.log10(abs(rounded))))
    return f"{rounded:.{digits}f}"


def gpu_hours(hours: float) -> str:
    """GPU-hours, or the GPU time of a run too short to count in hours."""
    if hours >= 1000:
        return f"{hours:,.0f} GPU-h"
    if hours >= 0.1:
        return f"{_sig3(hours)} GPU-h"
    return f"{duration(hours * 3600)} of GPU time"


def usd(value: float) -> str:
    """Dollars as a price reads: '$1,234', '$12.34', cents to 2 significant figures ('4.2¢'), '< $0.01', '$0'."""
    if value >= 100:
        return f"${value:,.0f}"
    cents = value * 100
    if value >= 1 or round(cents) >= 100:
        return f"${value:,.2f}"
    if cents >= 10:
        return f"{cents:.0f}¢"
    if round(cents, 1) >= 1:
        return f"{cents:.1f}¢"
    return "$0" if value == 0 else "< $0.01"


def _usd_range(values: tuple[float, float, float] | None) -> str:
    if values is None:
        return "—"
    low, mid, high = (usd(v) for v in values)
    if low == mid == high:
        return mid
    return f"{mid} ({low}–{high})"


def render_cost(report: CostReport, console: Console) -> None:
    """One table per GPU type: each provider's on-demand and spot cost, mid figure with its range."""
    from rich.markup import escape  # a model path is text: "runs/[x]/final" keeps its "[x]"
    from rich.table import Table
    from rich.text import Text

    console.print(
        f"[bold]{escape(str(report.model_source))}[/]: {report.num_params / 1e9:,.3f}B params, "
        f"{report.flops_per_token / 1e9:,.2f} GFLOP/token; {report.steps:,} steps, {report.total_tokens:,} tokens "
        f"(seq {report.seq_len}{', 2 sequences a pair' if sequences_per_sample(report.job) == 2 else ''}), "
        f"{report.num_gpus} GPU(s)"
    )
    if not report.rows:
        console.print("[yellow]no GPU type with both a price and a way to time it[/]")
    for row in report.rows:
        fast, mid, slow = row.wall_hours
        fit = ""
        if row.fits_memory is False:
            fit = (
                f" [red]does not fit: {(row.memory_need_bytes or 0) / 2**30:,.1f} GiB per GPU needed, "
                f"{(row.memory_bytes or 0) / 2**30:,.1f} GiB there (prime-train memory)[/]"
            )
        table = Table(
            title=f"{row.gpu} × {row.num_gpus}: {duration(mid * 3600)} wall ({duration(fast * 3600)}–"
            f"{duration(slow * 3600)}), {gpu_hours(row.gpu_hours[1])}; step {duration(row.step_time_s[1])} "
            f"({row.basis}){fit}",
            title_justify="left",
        )
        # short headers and no wrapping: the table stays readable at 80 columns; where each price comes from is
        # listed under it (a column of it wrapped every row into four lines)
        table.caption = "on-demand and spot: USD per GPU-hour; total: the run"
        table.caption_justify = "left"
        for col, justify in (("provider", "left"), ("on-demand", "right"), ("total", "right"),
                             ("spot", "right"), ("total", "right")):  # fmt: skip
            table.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
        sources: dict[str, list[str]] = {}
        for p in row.providers:
            table.add_row(
                p.provider,
                "—" if p.on_demand_rate is None else f"{p.on_demand_rate:.2f}",
                _usd_range(p.on_demand_usd),
                "—" if p.spot_rate is None else f"{p.spot_rate:.2f}",
                _usd_range(p.spot_usd),
            )
            as_of = (
                p.as_of if len(report.price_files) == 1 or p.source == report.price_files[0] else f"{p.as_of} (yours)"
            )
            sources.setdefault(as_of, []).append(p.provider)
        if not row.providers:
            table.add_row("(no price)", "—", "—", "—", "—")
        console.print(table)
        for as_of, providers in sources.items():
            console.print(Text(f"  {', '.join(providers)}: {as_of}", style="dim"))
    console.print(
        f"[dim]Prices are approximate list prices in USD per GPU-hour (table of {report.prices_as_of}), not quotes: "
        "check the provider; spot prices move daily and spot runs lose time to preemptions. "
        "Your own prices: --prices FILE (TOML or JSON, same form as prime_train/validator/data/prices.json).[/]"
    )
    for note in report.notes:
        console.print(f"[dim]note: {escape(note)}[/]")
