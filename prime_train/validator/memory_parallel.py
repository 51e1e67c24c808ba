"""The memory calculator under tensor and pipeline parallelism: what the busiest GPU of a (pp, dp, tp) job holds.

The engine's layout (engine/tensor_parallel.py, engine/pipeline.py), counted rank by rank:

Tensor parallel (``tp_size`` = t). q/k/v/o_proj and gate/up/down_proj are split over the t ranks of a group (column-
and row-wise), so their weights, gradients and optimizer states are 1/t on each rank; the decoder's RMSNorm weights,
the embeddings, the final norm and lm_head stay whole on every rank of the group, as the engine keeps them (lm_head
on purpose: the fused chunked loss computes the same loss on every rank, so the logits and the loss are counted in
full on each). Activations: each rank keeps its heads' q, k, v and attention output and its slice of the MLP (1/t);
the norms' inputs and the residual stream are whole on every rank, unless ``sequence_parallel`` shards them over the
sequence too (1/t), when the attention's and the MLP's inputs are gathered whole for their matmuls and kept so.
Qwen3's per-head q/k norm weights (a few hundred parameters a layer) are counted as split.

Pipeline parallel (``pp_size`` = p). The layers go to the stages in contiguous runs, the earlier stages one layer
longer when uneven; ``interleaved_1f1b`` makes 2p stages, rank r holding stages r and r + p. Rank 0 holds the
embeddings, rank p - 1 the final norm, lm_head and the loss; a pipeline rank keeps activations for the pipeline
microbatches in flight at its peak (each micro_batch_size / pp_microbatches rows, n of them), as torch's schedules
run them: ``gpipe`` all n; ``1f1b`` min(n, p - r) on rank r, so rank 0 holds the most; ``interleaved_1f1b``
min(w + 1, 2n) chunks of one virtual stage, w its warm-up forwards ((n // max(1, n // p)) + 2 (p - 1 - r)). The
last rank's loss keeps the hidden states' gradient of the microbatches in flight there (n under gpipe, else one).
The boundary activations a stage receives are its first layer's input, already counted.

Data parallel: the remaining dp = GPUs / (t × p) replicas shard the states with fsdp and its ZeRO stages (over the
"dp" mesh dimension only: FSDP2 on each stage of a pipeline, or beside TP), or replicate them: a replicated pipeline
averages its gradients in place, without DDP's buckets.
The figures are the busiest pipeline rank's (every rank's total is reported); preflight's fit check uses them.
This module is the layout's arithmetic; memory_breakdown.busiest_rank_memory adds the parts up for each rank.
"""

from __future__ import annotations

import math
from dataclasses import replace

from prime_train.validator.memory_inputs import MemoryInputError, MemoryInputs, ModelShape


def virtual_stages(inputs: MemoryInputs) -> int:
    """Stages a pipeline rank holds: two under the interleaved schedule, else one."""
    return 2 if inputs.pp_schedule == "interleaved_1f1b" and inputs.pp_size > 1 else 1


def rank_layers(inputs: MemoryInputs, layers: int) -> list[int]:
    """Decoder layers on each pipeline rank, as engine/pipeline.py's split_layers cuts them."""
    v, p = virtual_stages(inputs), inputs.pp_size
    if layers < p * v:
        raise MemoryInputError(f"pp_size = {p}: {layers} layers cannot fill {p * v} pipeline stages")
    base, extra = divmod(layers, p * v)
    sizes = [base + (stage < extra) for stage in range(p * v)]
    return [sum(sizes[r::p]) for r in range(p)]


def microbatches(inputs: MemoryInputs) -> int:
    """Pipeline microbatches a micro-batch is cut into: pp_microbatches, else pp_size (1 without a pipeline)."""
    return 1 if inputs.pp_size == 1 else inputs.pp_microbatches or inputs.pp_size


def in_flight(inputs: MemoryInputs, rank: int) -> float:
    """Pipeline microbatches whose activations of all this rank's layers it holds at its peak (module docstring)."""
    n, p = microbatches(inputs), inputs.pp_size
    if p == 1 or inputs.pp_schedule == "gpipe":
        return float(n)
    if inputs.pp_schedule == "1f1b":
        return float(min(n, p - rank))
    warmup = n // max(1, n // p) + 2 * (p - 1 - rank)  # torch's _get_warmup_ops with two local stages
    return min(warmup + 1, 2 * n) / 2  # chunks of one of the rank's two stages


def rank_shape(inputs: MemoryInputs, m: ModelShape, rank: int, layers: int) -> ModelShape:
    """The model as one rank holds it: its layers with their linear layers split over tp, and its share of the
    embeddings, final norm and lm_head (all of them, whole, without a pipeline)."""
    t, p = inputs.tp_size, inputs.pp_size
    if t > 1 and m.experts:
        raise MemoryInputError(f"tp_size = {t}: the engine's tensor-parallel plan splits dense decoders only")
    for name, value in (("attention heads", m.heads), ("KV heads", m.kv_heads), ("MLP width", m.mlp_width)):
        if value % t:
            raise MemoryInputError(f"tp_size = {t} does not divide the model's {name} ({value})")
    if p > 1 and m.tied:
        raise MemoryInputError(
            f"pp_size = {p} with tied embeddings: the engine refuses them (embeddings on the first stage, lm_head on "
            "the last); untie them (model.tie_embeddings = false) or set pp_size = 1"
        )
    norms = 2 * m.hidden  # the two RMSNorm weights of a layer: whole on every tensor-parallel rank
    layer = norms + math.ceil((m.layer_params - norms) / t)
    embed = m.vocab * m.hidden
    root = m.root_params if p == 1 else (embed if rank == 0 else 0) + (embed + m.hidden if rank == p - 1 else 0)
    return replace(
        m,
        layers=layers,
        heads=m.heads // t,
        kv_heads=m.kv_heads // t,
        mlp_width=m.mlp_width // t,
        num_params=root + layers * layer,
        layer_params=layer,
        root_params=root,
    )


def sequence_parallel_activations(inputs: MemoryInputs, m: ModelShape, act: dict[str, float]) -> dict[str, float]:
    """Activations with the norms and the residual stream sharded over the sequence: the norms' fp32 input and
    normalised value, the layer inputs and the row-parallel outputs become 1/t; the matmuls' gathered inputs stay."""
    if not (inputs.sequence_parallel and inputs.tp_size > 1):
        return act
    cut = 1 - 1 / inputs.tp_size
    a = 2 if inputs.half else 4
    out = dict(act)
    out["norms"] -= 2 * 8 * m.hidden * cut
    out["final_norm"] -= 8 * m.hidden * cut
    out["layer_input"] -= act["layer_input"] * cut
    out["selective"] -= (act["layer_input"] + 2 * m.hidden * a) * cut
    return out
