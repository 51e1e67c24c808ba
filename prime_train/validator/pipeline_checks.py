"""Pipeline parallelism (distributed.pp_size > 1) before a launch: lint's checks of the config.

The engine (engine/pipeline.py) refuses the same things when the job starts (exit 78); these say it first, with the
file and line. What lint checks: the processes make whole pipelines of pp_size x tp_size ranks (replicated across
pipelines as DDP replicates, or each stage sharded over them by FSDP2, as it always is beside TP; not HSDP), the job
is SFT or pretraining on the native decoder without LoRA or torch.compile, embeddings are untied, every stage gets a
layer (and how they split when uneven), each micro-batch cuts into whole pipeline microbatches, and the schedule
accepts that many microbatches (torch's own rules: 1F1B needs at least pp_size, interleaved 1F1B a multiple of its
rounds). Never imports torch.
"""

from __future__ import annotations

from prime_train.config.loader import Problem, Sources
from prime_train.config.parallel_rules import pipeline_combinations
from prime_train.config.schema import Config
from prime_train.validator.model_shape import model_shape

PIPELINE_JOBS = ("sft", "pretrain")


def layer_split(num_layers: int, num_stages: int) -> list[int]:
    """Layers per stage as the engine splits them: contiguous runs, the earlier stages one longer when uneven."""
    base, extra = divmod(num_layers, num_stages)
    return [base + (stage < extra) for stage in range(num_stages)]


def schedule_problem(schedule: str, pp_size: int, n: int) -> str | None:
    """Why torch's schedule refuses n microbatches on pp_size ranks, or None."""
    if schedule == "1f1b" and n < pp_size:
        return f"1F1B needs at least as many microbatches as pipeline ranks ({pp_size}), got {n}"
    rounds = max(1, n // pp_size)
    if schedule == "interleaved_1f1b" and n % rounds:
        return f"interleaved 1F1B needs a multiple of its rounds (max(1, {n} // {pp_size}) = {rounds}), got {n}"
    return None


def pipeline_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """Lint's distributed.pp_* checks; nothing when pp_size is 1."""
    d = cfg.distributed
    if d.pp_size == 1 or cfg.job.command:
        return []
    key = ("distributed", "pp_size")
    problems = [sources.problem(k, "error", m) for k, m in _placement(cfg) + _model(cfg) + pipeline_combinations(cfg)]
    n = d.pp_num_microbatches
    if cfg.train.micro_batch_size % n:
        problems.append(
            sources.problem(
                ("train", "micro_batch_size"),
                "error",
                f"train.micro_batch_size ({cfg.train.micro_batch_size}) is not a multiple of "
                f"distributed.pp_microbatches ({n}{', its default: pp_size' * (d.pp_microbatches is None)}): each "
                "pipeline microbatch is micro_batch_size / pp_microbatches rows; change either",
            )
        )
    if why := schedule_problem(d.pp_schedule, d.pp_size, n):
        problems.append(
            sources.problem(
                ("distributed", "pp_microbatches"),
                "error",
                f"distributed.pp_schedule = {d.pp_schedule!r}: {why}; set distributed.pp_microbatches accordingly",
            )
        )
    hf, _ = model_shape(cfg)
    layers = (hf or {}).get("num_hidden_layers")
    stages = d.pp_stages
    if isinstance(layers, int) and layers < stages:
        problems.append(
            sources.problem(
                key,
                "error",
                f"distributed.pp_size = {d.pp_size} with pp_schedule {d.pp_schedule!r} makes {stages} stages of at "
                f"least one layer each and the model has {layers}; lower distributed.pp_size, or use "
                "pp_schedule = '1f1b' (one stage per rank)",
            )
        )
    elif isinstance(layers, int) and layers % stages:
        split = layer_split(layers, stages)
        problems.append(
            sources.problem(
                key,
                "warning",
                f"the model's {layers} layers do not split evenly over {stages} pipeline stages: they run as "
                f"{' + '.join(map(str, split))} (earlier stages one more; the last also runs lm_head and the loss), "
                "and the longest stage sets the pace; a layer count that is a multiple of the stages balances them",
            )
        )
    if hf is not None and hf.get("tie_word_embeddings") is True:
        problems.append(
            sources.problem(
                ("model", "tie_embeddings") if cfg.model.path is None else key,
                "error",
                f"distributed.pp_size = {d.pp_size} with tied input and output embeddings: the embedding sits on "
                "the first stage and lm_head on the last; set model.tie_embeddings = false (random-initialised "
                "models), train a model with untied embeddings, or set distributed.pp_size = 1",
            )
        )
    return problems


def _placement(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """The processes make whole pipelines (of pp_size x tp_size ranks), replicated or sharded across (when their count
    is known from the config)."""
    d = cfg.distributed
    if d.nproc_per_node is None:
        return []  # one process per GPU: counted at launch, and the engine checks it then
    world, group = d.nproc_per_node * d.nnodes, d.pp_size * d.tp_size  # a pipeline with its tensor-parallel groups
    if world % group:
        of = f"distributed.pp_size ({d.pp_size})" + f" x distributed.tp_size ({d.tp_size})" * (d.tp_size > 1)
        return [
            (
                ("distributed", "pp_size"),
                f"{of} does not divide the {world} processes (distributed.nproc_per_node x nnodes); make the "
                "processes a multiple of it",
            )
        ]
    if world > group and d.strategy not in ("auto", "ddp", "fsdp"):
        return [
            (
                ("distributed", "strategy"),
                f"distributed.strategy = {d.strategy!r} across {world // group} pipelines "
                f"(distributed.pp_size = {d.pp_size}) is not supported: pipelines are replicated ('auto' or "
                "'ddp': gradients all-reduced) or each stage is sharded over its replicas ('fsdp'); set one of those",
            )
        ]
    return []


def _model(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """The job, model code and options a pipeline runs with."""
    pp = cfg.distributed.pp_size
    out = []
    if cfg.run.job not in PIPELINE_JOBS:
        out.append(
            (
                ("distributed", "pp_size"),
                f"distributed.pp_size = {pp}: run.job = {cfg.run.job!r} does not run in a pipeline (only "
                f"{' and '.join(PIPELINE_JOBS)} do); set distributed.pp_size = 1",
            )
        )
    if cfg.model.implementation == "hf":
        out.append(
            (
                ("model", "implementation"),
                f"distributed.pp_size = {pp} splits the engine's native decoder; set model.implementation = "
                "'native' or 'auto' (Llama, Qwen2/3, Mistral), or distributed.pp_size = 1",
            )
        )
    if cfg.lora.enabled:
        out.append((("lora", "rank"), f"LoRA does not run with distributed.pp_size = {pp}; set lora.rank = 0"))
    if cfg.train.compile:
        out.append(
            (("train", "compile"), f"train.compile is not supported with distributed.pp_size = {pp}; set it false")
        )
    return out
