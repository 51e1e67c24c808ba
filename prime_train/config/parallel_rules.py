"""Which parallelism and precision settings combine: one list of rules the engine (at start, exit 78) and lint (with
the file and line) both read, so they cannot disagree. Plain config logic: no torch."""

from __future__ import annotations

from prime_train.config.schema import Config


def pipeline_combinations(cfg: Config) -> list[tuple[tuple[str, ...], str]]:
    """What distributed.pp_size > 1 does not combine with yet, as (key, message): the engine raises the first, lint
    reports them all. The schedule runs its own backward (no loss scaling), the stages are not wrapped by DDP (no comm
    hook; FSDP2 shards each stage over its replicas, with the ZeRO options, under every schedule), and the stages are
    cut from the bare model (no float8 swap). Tensor-parallel stages, sequence parallel included, run under every
    schedule too."""
    d, pp = cfg.distributed, cfg.distributed.pp_size
    found = []
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
    return found
