"""Pipeline parallelism for the native decoder: stages split by layers, run by torch.distributed.pipelining.

distributed.pp_size ranks form one pipeline; with more processes than that, the pipelines are data-parallel
replicas on a 2-D ("dp", "pp") mesh (rank = dp_index x pp_size + pp_index), each reading its share of the global batch
and averaging gradients with the others once a step (`Pipeline.reduce_gradients`). Every rank of a pipeline reads the
same batches (DistInfo.dp_rank / dp_size), so token counts are counted once per pipeline, not once per stage.
With distributed.strategy = 'fsdp' (or a ZeRO option) each stage is instead sharded by FSDP2 over its replicas on
mesh["dp"] (`_shard_stage`, under every schedule: the two stages of an interleaved rank are two FSDP2 roots over
the same replicas), torch's PipelineStage reduce-scattering the gradients at each schedule step's last backward, as
torchtitan composes them. With distributed.tp_size > 1 the mesh is ("dp", "pp", "tp") and each stage is split by
tensor_parallel.apply_tp after it is cut, then, with several pipelines, sharded by FSDP2 over mesh["dp"] (its
parameters 2-D DTensors over dp and tp; DDP cannot reduce TP's DTensors, so 'auto' means FSDP here as it does beside
TP without a pipeline): rank = (dp_index x pp_size + pp_index) x tp_size + tp_index. Under sequence
parallel a stage sends its rank's shard of the sequence (a plain tensor) and the next stage takes it up again as the
sequence-sharded residual stream; the last stage's final norm gathers the whole sequence for the loss.

How the model is cut (`split_layers`): the decoder layers go to the stages in contiguous runs, the earlier stages
taking one more layer when they do not divide evenly (the last stage also runs the final norm, lm_head and the loss).
Stage 0 holds embed_tokens, the last stage the final norm and lm_head. `interleaved_1f1b` gives each rank two stages
(rank r holds stages r and r + pp_size), so the model needs at least 2 x pp_size layers. A stage is a `StageModule`:
the parts it holds under the very names the whole model gives them (`model.layers.<original index>` in an
nn.ModuleDict), so its state dict is a slice of the HF state dict: one DCP checkpoint holds every stage's part with
the full model's keys, a checkpoint saved at another pp_size (pp_size 1 included) loads, and the export gathers the
parts on rank 0 into one HF model.

The loss is the engine's fused, chunked one (engine/loss.py) on the last stage: summed per pipeline microbatch and
scaled by the same 1 / (global labelled tokens) the unpipelined step uses, with the schedule's own 1/n_microbatches
scaling off, so losses and gradients equal a one-process run's (up to the order of float sums). Tied embeddings are
refused: the embedding lives on stage 0 and lm_head on the last, and one weight in two places would need its
gradient summed across them; a random-initialised model unties with model.tie_embeddings = false.

What one `Pipeline.step` is: one of the step's micro-batches (train.micro_batch_size rows), cut into
distributed.pp_microbatches pipeline microbatches of micro_batch_size / pp_microbatches rows; gradients accumulate
over the step's micro-batches as without PP. The pipeline fills and drains once per micro-batch, so its idle share is
about (stages - 1) / (pp_microbatches + stages - 1): raise pp_microbatches (and micro_batch_size with it) to shrink it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn

from prime_train.config.schema import Config
from prime_train.engine.llama import NativeCausalLM, dense_attention_mask, flex_block_mask
from prime_train.engine.loss import IGNORE_INDEX, chunked_cross_entropy
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.parallel import DistInfo
from prime_train.engine.versions import torch_minor

logger = logging.getLogger("prime_train.engine")


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """The decoder layers of each stage: contiguous runs, the earlier stages one layer longer when uneven."""
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for stage in range(num_stages):
        size = base + (stage < extra)
        out.append(range(start, start + size))
        start += size
    return out


def with_pipeline_ranks(dist: DistInfo, pp_size: int, tp_size: int = 1) -> DistInfo:
    """`dist` with its data-parallel place set: the ranks of one pipeline (with its tensor-parallel groups) are one
    replica and read the same data."""
    if pp_size == 1:
        return dist
    group = pp_size * tp_size
    if dist.world_size % group:
        raise EngineConfigError(
            f"distributed.pp_size = {pp_size} x distributed.tp_size = {tp_size} does not divide the "
            f"{dist.world_size} processes of the job; set distributed.nproc_per_node x distributed.nnodes to a "
            "multiple of it"
        )
    return dataclasses.replace(dist, data_rank=dist.rank // group, data_world=dist.world_size // group)


def build_pp_mesh(dist: DistInfo, pp_size: int, tp_size: int = 1):
    """The ("dp", "pp") DeviceMesh: each row one pipeline, each column one stage's data-parallel replicas; with tensor
    parallelism ("dp", "pp", "tp"), tp innermost (consecutive ranks), as tensor_parallel.build_mesh lays it out."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp_size > 1:
        shape = (dist.world_size // (pp_size * tp_size), pp_size, tp_size)
        return init_device_mesh(dist.device.type, shape, mesh_dim_names=("dp", "pp", "tp"))
    return init_device_mesh(dist.device.type, (dist.world_size // pp_size, pp_size), mesh_dim_names=("dp", "pp"))


class StageModule(nn.Module):
    """The layers, and the embedding or head, of one pipeline stage of a NativeCausalLM, under the full model's names.

    forward(x, position_ids): x is token ids on the first stage, the previous stage's hidden states elsewhere; it
    returns hidden states (final-normed on the last stage, where the loss function applies lm_head).
    """

    def __init__(self, source: nn.Module, layer_ids: list[int], *, first: bool, last: bool):
        """source: the whole NativeCausalLM, or a StageModule holding these layers (whose modules are then shared:
        the two stages of an interleaved rank are views of its one part)."""
        super().__init__()
        self.config = source.config
        self.attention = source.attention
        layers = source.model.layers
        self.model = nn.Module()
        self.model.embed_tokens = source.model.embed_tokens if first else None
        # keyed by the original index: parameter names stay model.layers.<i>.…, the HF names
        self.model.layers = nn.ModuleDict(
            {str(i): layers[i] if isinstance(layers, nn.ModuleList) else layers[str(i)] for i in layer_ids}
        )
        self.model.norm = source.model.norm if last else None
        self.lm_head = source.lm_head if last else None
        self.register_buffer("rope_cos", source.rope_cos, persistent=False)
        self.register_buffer("rope_sin", source.rope_sin, persistent=False)
        # under sequence parallel, the "tp" mesh: stages hand over their rank's shard of the sequence (whole on the
        # last stage's output, which the final norm gathers)
        self.sequence_mesh = getattr(source, "sequence_mesh", None)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Run this stage's part of the decoder on one pipeline microbatch."""
        if self.model.embed_tokens is not None:
            x = self.model.embed_tokens(x)
        elif self.sequence_mesh is not None:  # the previous stage's shard of the sequence, as the residual stream
            from torch.distributed.tensor import DTensor, Shard

            # the whole shape from the positions: a sequence tp does not divide is sharded unevenly
            rows, length, width = x.shape[0], position_ids.shape[1], x.shape[2]
            x = DTensor.from_local(x, self.sequence_mesh, [Shard(1)], run_check=False,
                                   shape=(rows, length, width), stride=(length * width, width, 1))  # fmt: skip
        cos, sin = self.rope_cos[position_ids], self.rope_sin[position_ids]
        # packed rows: the document mask from the positions, as NativeCausalLM builds it, on every stage
        mask = flex_block_mask(position_ids) if self.attention == "flex" else dense_attention_mask(position_ids)
        for layer in self.model.layers.values():
            x = layer(x, cos, sin, mask)
        if self.model.norm is not None:
            x = self.model.norm(x)
        elif self.sequence_mesh is not None:  # the pipeline sends plain tensors: this rank's shard
            x = x.to_local()
        return x


# the oldest torch whose pipelining runs the engine's stages (checked: 2.11 fails, 2.13 and 2.14 run)
MIN_TORCH = (2, 13)


def check_pipeline_config(cfg: Config, model: nn.Module, strategy: str = "none") -> None:
    """EngineConfigError (exit 78) for what the engine's pipeline does not run, each with the key and what to do.

    strategy: the data-parallel strategy across pipelines (parallel.resolve_strategy over one stage's ranks)."""
    d = cfg.distributed
    from prime_train.config.parallel_rules import pipeline_combinations

    if combined := pipeline_combinations(cfg):
        raise EngineConfigError(combined[0][1])
    if strategy not in ("none", "ddp", "fsdp"):
        raise EngineConfigError(
            f"distributed.strategy = {strategy!r} across pipelines (distributed.pp_size = {d.pp_size}) is not "
            "supported: pipelines are replicated (gradients all-reduced, 'auto' or 'ddp') or each stage is sharded "
            "over its replicas ('fsdp'); set distributed.strategy to one of those"
        )
    if d.tp_size > 1:
        from prime_train.engine.tensor_parallel import check_supported

        check_supported(model, cfg)  # heads, KV heads and MLP width divisible, the native decoder, no LoRA
    if not isinstance(model, NativeCausalLM):
        raise EngineConfigError(
            f"distributed.pp_size = {d.pp_size} splits the engine's native decoder, and this model runs on "
            f"transformers' class ({type(model).__name__}); set model.implementation = 'native' (Llama, Qwen2/3, "
            "Mistral) or distributed.pp_size = 1"
        )
    if model.config.tie_word_embeddings:
        raise EngineConfigError(
            f"distributed.pp_size = {d.pp_size} with tied input and output embeddings: the embedding sits on the "
            "first stage and lm_head on the last; set model.tie_embeddings = false (random-initialised models) or "
            "use a model with untied embeddings, or distributed.pp_size = 1"
        )
    if cfg.lora.enabled:
        raise EngineConfigError("distributed.pp_size > 1 does not run with LoRA; set lora.rank = 0 or pp_size = 1")
    if cfg.train.compile:
        raise EngineConfigError(
            "train.compile with distributed.pp_size > 1 is not supported; set train.compile = false or pp_size = 1"
        )
    stages = d.pp_stages
    layers = model.config.num_hidden_layers
    if layers < stages:
        raise EngineConfigError(
            f"distributed.pp_size = {d.pp_size} with pp_schedule {d.pp_schedule!r} needs {stages} stages of at "
            f"least one layer and the model has {layers}; lower distributed.pp_size or use pp_schedule = '1f1b'"
        )
    rows, n = cfg.train.micro_batch_size, d.pp_num_microbatches
    if rows % n:
        raise EngineConfigError(
            f"train.micro_batch_size ({rows}) is not a multiple of distributed.pp_microbatches ({n}): each pipeline "
            "microbatch is micro_batch_size / pp_microbatches rows; change either"
        )
    if torch_minor() < MIN_TORCH:
        # torch 2.11's schedules lose the last stage's input gradient with this stage layout ("[1] for chunk 0 has
        # gradients None and is expecting to send gradients to stage 0"); 2.13 and 2.14 run it (tests/test_pipeline.py)
        raise EngineConfigError(
            f"distributed.pp_size = {d.pp_size} needs torch {MIN_TORCH[0]}.{MIN_TORCH[1]} or newer (this is "
            f"{torch.__version__}, whose torch.distributed.pipelining fails on the engine's stages); upgrade torch "
            "or set distributed.pp_size = 1"
        )


class Pipeline:
    """This rank's stages of the pipeline, its schedule, and the step, evaluation and clipping that go through it.

    `part` is one module holding everything this rank trains (for interleaved, both its stages, sharing their
    modules; under FSDP each stage is its own root and `part` holds their sharded parameters): the optimizer,
    checkpoints and the export read it.
    """

    def __init__(self, full: NativeCausalLM, cfg: Config, dist: DistInfo, strategy: str = "none"):
        """strategy: across the pipelines, 'fsdp' shards each stage over its replicas (mesh["dp"]); else the
        gradients are averaged by `reduce_gradients`."""
        from torch.distributed.pipelining import PipelineStage

        d = cfg.distributed
        self.dist = dist
        self.pp_size = d.pp_size
        self.tp_size = d.tp_size
        self.mesh = build_pp_mesh(dist, d.pp_size, d.tp_size)
        self.pp_group = self.mesh.get_group("pp")
        pp_rank = self.mesh.get_local_rank("pp")
        num_stages = d.pp_stages
        per_rank = num_stages // d.pp_size
        ranges = split_layers(full.config.num_hidden_layers, num_stages)
        mine = [pp_rank + k * d.pp_size for k in range(per_rank)]  # the looping assignment interleaving expects
        self.holds_last = num_stages - 1 in mine
        held = [i for s in mine for i in ranges[s]]
        self.part = StageModule(full, held, first=0 in mine, last=self.holds_last).to(dist.device)
        if d.tp_size > 1:  # before checkpointing wraps the layers, as parallel.parallelize orders them
            from prime_train.engine import tensor_parallel

            tensor_parallel.apply_tp(self.part, self.mesh["tp"], d.sequence_parallel)
            tensor_parallel.log_applied(self.mesh["tp"], d.sequence_parallel)
            self.part.sequence_mesh = self.mesh["tp"] if d.sequence_parallel else None
        if cfg.model.activation_checkpointing != "none":
            from prime_train.engine.parallel import apply_ac

            layers = list(self.part.model.layers.values())
            apply_ac(self.part, layers, cfg.model.activation_checkpointing)
            for key, wrapped in zip(list(self.part.model.layers), layers, strict=True):
                self.part.model.layers[key] = wrapped
        modules = (
            [self.part]
            if per_rank == 1
            else [StageModule(self.part, ranges[s], first=s == 0, last=s == num_stages - 1) for s in mine]
        )
        self.sharded = strategy == "fsdp" and dist.dp_size > 1
        if self.sharded:  # each stage its own FSDP2 root (interleaved: the part holds both roots' parameters)
            for module in modules:
                _shard_stage(module, cfg, dist, self.mesh["dp"])
        self.stages = [
            PipelineStage(m, s, num_stages, dist.device, group=self.pp_group)
            for m, s in zip(modules, mine, strict=True)
        ]
        self.n_microbatches = d.pp_num_microbatches
        self.schedule = self._schedule(d.pp_schedule)
        self.dp_group = self.mesh.get_group("dp") if dist.dp_size > 1 else None
        self._scale = 1.0
        self._parts: list[torch.Tensor] = []  # the unscaled loss sum of each microbatch the loss function saw
        logger.info(
            "Applied pipeline parallel: %d stages over %d ranks x %d replica(s) (%s, %d microbatches per "
            "micro-batch); this rank holds stage(s) %s = layers %s%s%s",
            num_stages, d.pp_size, dist.dp_size, d.pp_schedule, self.n_microbatches, mine, held,
            " + embeddings" * (0 in mine), " + norm, lm_head, loss" * self.holds_last,
        )  # fmt: skip

    def _schedule(self, name: str):
        from torch.distributed import pipelining

        # scale_grads=False: the loss is already divided by the global labelled-token count (see _loss)
        try:
            if name == "interleaved_1f1b":
                return pipelining.ScheduleInterleaved1F1B(
                    self.stages, self.n_microbatches, loss_fn=self._loss, scale_grads=False
                )
            cls = {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B}[name]
            return cls(self.stages[0], self.n_microbatches, loss_fn=self._loss, scale_grads=False)
        except ValueError as exc:  # torch's own rule for the microbatch count, in its words
            raise EngineConfigError(
                f"distributed.pp_schedule = {name!r} with distributed.pp_microbatches = {self.n_microbatches}: "
                f"{exc} Set distributed.pp_microbatches to a count the schedule accepts"
            ) from None

    def _loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """One pipeline microbatch's summed token loss, times the step's scale; the unscaled sum is kept for metrics."""
        weight = self.part.lm_head.weight
        weight = weight.to_local() if hasattr(weight, "to_local") else weight  # tensor parallel keeps it whole
        part = chunked_cross_entropy(hidden, weight, targets, reduction="sum")
        self._parts.append(part.detach().float())
        return part * self._scale

    def _run(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, *, train: bool
    ) -> torch.Tensor:
        """One micro-batch through the schedule; the summed token loss of its microbatches (0 off the last stage)."""
        self._parts = []
        # position t predicts label t + 1, as NativeCausalLM.forward shifts them
        targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        first = any(stage.is_first for stage in self.stages)
        args = (input_ids,) if first else ()
        run = self.schedule.step if train else self.schedule.eval
        kwargs = {"return_outputs": False} if train else {}
        run(*args, target=targets, position_ids=position_ids, **kwargs)
        # the schedule's set-up (first step, and after each switch between eval and train) also calls the loss
        # function, on the first microbatch, to infer the gradients' shapes: the step's own calls are the last ones
        parts = self._parts[-self.n_microbatches :] if self.holds_last else []
        return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float32, device=self.dist.device)

    def step(self, batch, scale: float) -> torch.Tensor:
        """Forward and backward of one micro-batch through the pipeline; its summed token loss (0 off the last
        stage). Gradients are those of loss_sum x scale, accumulated into .grad."""
        self._scale = scale
        return self._run(batch.input_ids, batch.position_ids, batch.labels, train=True)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the step's gradients over the pipelines (the "dp" axis), once, after its last micro-batch.

        Not DDP around the stages: torch 2.13's PipelineStage runs DDP's forwards under no_sync and its reducer then
        never rebuilds its buckets, so the second optimizer step fails an internal assert ("rebuilt parameter indices
        size is not same as original model parameters size"). One all-reduce per step also sends less than DDP would
        (it syncs at the end of every schedule step, i.e. every micro-batch); it does not overlap the backward.
        """
        if self.dp_group is None or self.sharded:  # FSDP2 reduce-scattered them at each schedule's last backward
            return
        grads = [p.grad for p in self.part.parameters() if p.grad is not None]
        works = [torch_dist.all_reduce(g, group=self.dp_group, async_op=True) for g in grads]
        for work, grad in zip(works, grads, strict=True):
            work.wait()
            grad.div_(self.dist.dp_size)

    @torch.no_grad()
    def eval_loss(self, batches, autocast: Callable[[], AbstractContextManager], rows: int) -> dict[str, float]:
        """Held-out loss per token through the pipeline (forward only); short batches are padded to `rows` rows
        without labels, since the stages' buffers keep the shape of the first microbatch."""
        from prime_train.engine.parallel import all_reduce_sum

        self.part.eval()
        total = torch.zeros(2, dtype=torch.float64)
        for batch in batches:
            # padding rows: positions 0 (each token its own document), no labels
            ids, pos, labels = (
                _pad_rows(t, rows, fill).to(self.dist.device)
                for t, fill in ((batch.input_ids, 0), (batch.position_ids, 0), (batch.labels, IGNORE_INDEX))
            )
            self._scale = 1.0
            with autocast():
                loss_sum = self._run(ids, pos, labels, train=False)
            if self.holds_last:  # one rank per pipeline counts, so replicas sum and stages do not
                total += torch.tensor([loss_sum.item(), int((labels[:, 1:] != IGNORE_INDEX).sum())])
        total = all_reduce_sum(total, self.dist)
        self.part.train()
        if total[1] == 0:
            return {}
        loss = float(total[0] / total[1])
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Clip to max_norm by the norm of every stage's gradients together; returns that norm (before clipping)."""
        params = [p for p in self.part.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.dist.device)
        if hasattr(local, "full_tensor"):  # FSDP2's or TP's DTensor gradients: the norm over the stage's shards
            local = local.full_tensor()
        squared = local.float().pow(2)
        torch_dist.all_reduce(squared, op=torch_dist.ReduceOp.SUM, group=self.pp_group)
        total = squared.sqrt()
        if max_norm is not None and params:
            if self.sharded or self.tp_size > 1:  # DTensor gradients take a plain number; the same fp32 factor
                coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
                torch._foreach_mul_(grads, coef.item())
            else:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def sum_over_stages(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over this pipeline's ranks (each holds a disjoint part of the model)."""
        out = value.detach().clone().to(self.dist.device)
        torch_dist.all_reduce(out, op=torch_dist.ReduceOp.SUM, group=self.pp_group)
        return out.to(value.device)

    def gathered_model(self) -> NativeCausalLM | None:
        """On global rank 0 the whole model, its weights gathered from every stage (CPU); None elsewhere. A
        collective over the first pipeline's ranks; the other replicas hold the same weights and send nothing."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # sharded stages gather their whole tensors first (a collective over each stage's replicas or its tensor-
        # parallel group: every rank)
        options = StateDictOptions(full_state_dict=self.sharded or self.tp_size > 1)
        own = {k: v.detach().cpu() for k, v in get_model_state_dict(self.part, options=options).items()}
        parts: list[dict | None] = [None] * self.pp_size
        first_tp = self.tp_size == 1 or self.mesh.get_local_rank("tp") == 0
        if self.dist.dp_rank == 0 and first_tp:  # the pipeline holding global rank 0
            torch_dist.gather_object(own, parts if self.dist.rank == 0 else None, dst=0, group=self.pp_group)
        if self.dist.rank != 0:
            return None
        state = {k: v for part in parts for k, v in (part or {}).items()}
        with torch.device("meta"):
            model = NativeCausalLM(self.part.config, max_seq_len=self.part.rope_cos.shape[0])
        model.load_state_dict(state, strict=True, assign=True)
        model.reset_rope("cpu")
        return model


def _shard_stage(part: StageModule, cfg: Config, dist: DistInfo, dp_mesh) -> None:
    """FSDP2 on one stage over its data-parallel replicas, as the engine shards a whole model (parallel.apply_fsdp):
    each decoder layer a unit, then the stage (its embedding, or norm and lm_head) as the root, with the run's
    precision, ZeRO stage and CPU offload. torch's PipelineStage drives the units: gradients are reduce-scattered at
    the last backward of each schedule step. Under interleaved 1F1B each of a rank's stages is sharded on its own (two
    roots over one mesh, as torchtitan shards each model chunk). A tensor-parallel stage is sharded the same way:
    FSDP2 joins mesh["dp"] and the parameters' "tp" dimension (one root mesh) into 2-D DTensors."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    from prime_train.engine import parallel

    d = cfg.distributed
    policy = parallel.mixed_precision_policy(cfg.train.precision, dist.device) or MixedPrecisionPolicy()
    offload = parallel.cpu_offload_policy(dist) if d.cpu_offload else OffloadPolicy()
    reshard = parallel.reshard_after_forward(d)
    layers = list(part.model.layers.values())
    for i, layer in enumerate(layers):
        fully_shard(layer, mesh=dp_mesh, mp_policy=policy, offload_policy=offload,
                    reshard_after_forward=reshard and i < len(layers) - 1)  # fmt: skip
    fully_shard(part, mesh=dp_mesh, mp_policy=policy, offload_policy=offload)
    extras = [f"ZeRO stage {d.zero_stage}"] * (d.zero_stage is not None) + ["CPU offload"] * d.cpu_offload
    ids = [int(i) for i in part.model.layers]
    held = f"layers {ids[0]}-{ids[-1]}" if len(ids) > 1 else f"layer {ids[0]}" if ids else "no layers"
    held += " and the embedding" * (part.model.embed_tokens is not None) + " and the head" * (part.lm_head is not None)
    logger.info("Applied FSDP to the stage of %s over mesh['dp'] (%d replicas)%s", held, dp_mesh.size(),
                "".join(f"; {e}" for e in extras))  # fmt: skip


def _pad_rows(t: torch.Tensor, rows: int, fill: int) -> torch.Tensor:
    if t.shape[0] >= rows:
        return t
    return torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), fill)])
