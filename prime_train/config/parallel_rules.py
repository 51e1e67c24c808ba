"""Which parallelism and precision settings combine: one list of rules the engine (at start, exit 78) and lint (with
the file and line) both read, so they cannot disagree. Plain config logic: no torch."""

from __future__ import annotations

from prime_train.config.schema import Config


def pipeline_combinations(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """What distributed.pp_size > 1 does not combine with yet, as (key, message): the engine raises the first, lint
    reports them all. The schedule runs its own backward (no loss scaling), the stages are not wrapped by DDP (no comm
    hook; FSDP2 shards each stage over its replicas, with the ZeRO options, but not under the interleaved schedule,
    whose two stages a rank shares one part), the stages are cut from the bare model (no float8 swap), and a
    tensor-parallel pipeline is one pipeline of plain TP (_with_tensor_parallel)."""
    d, pp = cfg.distributed, cfg.distributed.pp_size
    found = []
    found += _with_tensor_parallel(cfg)
    if cfg.train.precision == "fp16":
        found.append((("train", "precision"), f"train.precision = 'fp16' with distributed.pp_size = {pp}: the "
                      "pipeline's schedule runs its own backward, without loss scaling; use 'bf16' or "
                      "'fp32'"))  # fmt: skip
    if cfg.train.float8:
        found.append((("train", "float8"), f"train.float8 with distributed.pp_size = {pp} is not supported yet; "
                      "set train.float8 = false or pp_size = 1"))  # fmt: skip
    if d.grad_compression != "none":
        found.append((("distributed", "grad_compression"), f"distributed.grad_compression = {d.grad_compression!r}"
                      f" with distributed.pp_size = {pp}: pipelines all-reduce their gradients without DDP's comm "
                      "hooks; set it to 'none'"))  # fmt: skip
    sharded = d.strategy == "fsdp" or d.zero_stage is not None or d.cpu_offload
    if sharded and d.pp_schedule == "interleaved_1f1b":
        found.append((("distributed", "pp_schedule"), f"distributed.pp_schedule = 'interleaved_1f1b' with FSDP "
                      f"(distributed.strategy = 'fsdp', zero_stage or cpu_offload) and pp_size = {pp} is not "
                      "supported: a rank's two stages share one sharded part; use '1f1b' or 'gpipe'"))  # fmt: skip
    return found


def _with_tensor_parallel(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """A pipeline whose stages are tensor-parallel (a ("dp", "pp", "tp") mesh) runs one pipeline of plain TP under
    1F1B or GPipe; what it does not run yet, as (key, message)."""
    d, pp, tp = cfg.distributed, cfg.distributed.pp_size, cfg.distributed.tp_size
    if tp == 1:
        return []
    both = f"distributed.tp_size = {tp} with distributed.pp_size = {pp}"
    found = []
    if d.sequence_parallel:
        found.append((("distributed", "sequence_parallel"), f"distributed.sequence_parallel with {both} is not "
                      "supported yet (the stages hand over whole hidden states); set it to false"))  # fmt: skip
    if d.pp_schedule == "interleaved_1f1b":
        found.append((("distributed", "pp_schedule"), f"distributed.pp_schedule = 'interleaved_1f1b' with {both} is "
                      "not supported yet; use '1f1b' or 'gpipe'"))  # fmt: skip
    world = (d.nproc_per_node or 0) * d.nnodes
    if world > pp * tp:
        found.append((("distributed", "tp_size"), f"{both} on {world} processes: data-parallel replicas of a "
                      f"tensor-parallel pipeline are not supported yet; run {pp * tp} processes "
                      "(distributed.nproc_per_node x nnodes = pp_size x tp_size)"))  # fmt: skip
    return found
