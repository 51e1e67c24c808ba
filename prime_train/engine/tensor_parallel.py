"""Tensor parallelism (distributed.tp_size) for the native decoder: the plans, the 2-D mesh and the rank bookkeeping.

Layout. The job's ranks form a ("dp", "tp") DeviceMesh, tp the inner dimension: ranks r and r + 1 share a tensor-
parallel group when tp_size = 2, so a group sits on one node where the all-reduces are cheapest. Every rank of a tp
group reads the same batches (DistInfo.dp_rank / dp_size); the data-parallel strategy (FSDP2) runs on mesh["dp"].

The plan, Megatron's split of each decoder block written with torch.distributed.tensor.parallel:
- q/k/v_proj and gate/up_proj are ColwiseParallel (each rank computes its heads, its slice of the MLP);
- o_proj and down_proj are RowwiseParallel (the partial outputs are summed: one all-reduce per block half);
- the attention module keeps num_heads / tp and num_kv_heads / tp heads (the grouping ratio is unchanged), and
  Qwen3's per-head q/k norms see their heads as a shard of dimension 2;
- everything else (embeddings, RMSNorms, lm_head) is replicated, as DTensors with a Replicate placement, so that
  every parameter lives on the same mesh: clipping, the parameter norm and FSDP2's 2-D sharding then treat them
  all alike. lm_head stays whole on purpose: the fused chunked loss (engine/loss.py) takes its weight as a local
  tensor and computes the same loss on every rank of the group, from the same full hidden states, so its value and
  gradients are exactly the single-process ones without a vocabulary-parallel loss. The cost is the replicated
  vocabulary matrix (and its gradient and optimizer state) on every tp rank, and the loss computed tp times.

Sequence parallel (distributed.sequence_parallel): between the blocks' matmuls the residual stream and the norms
are sharded over the sequence (Shard(1)); the attention and MLP inputs are all-gathered once each and their outputs
reduce-scattered, where plain TP all-reduces. The embedding's output is sliced to this rank's sequence shard and
the final norm's output gathered again, so the loss still sees every position. The stream stays a DTensor, so a
sequence that tp does not divide (greedy evaluation grows one token at a time) is sharded unevenly and still right.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import is_native
from prime_train.engine.versions import torch_minor

if TYPE_CHECKING:
    from prime_train.config.schema import Config, DistributedConfig

logger = logging.getLogger("prime_train.engine")


# ---------------------------------------------------------------- ranks and mesh


def data_ranks(rank: int, world_size: int, local_world_size: int, tp_size: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of a process: tp_size consecutive ranks form a group sharing batches."""
    if world_size % tp_size:
        raise EngineConfigError(
            f"distributed.tp_size = {tp_size} does not divide the {world_size} processes of the job; "
            "choose a divisor of the processes per node"
        )
    if local_world_size % tp_size:
        raise EngineConfigError(
            f"distributed.tp_size = {tp_size} does not divide the {local_world_size} processes per node: a "
            "tensor-parallel group must sit on one node; set distributed.nproc_per_node to a multiple of it"
        )
    return rank // tp_size, world_size // tp_size


def data_parallel_strategy(cfg: DistributedConfig, world_size: int) -> str:
    """What runs on the "dp" mesh dimension beside tensor parallelism: 'none' (dp = 1) or 'fsdp'."""
    dp = world_size // cfg.tp_size
    if cfg.strategy == "hsdp":
        raise EngineConfigError(
            f"distributed.strategy = 'hsdp' with distributed.tp_size = {cfg.tp_size}: tensor parallelism takes the "
            "node's ranks that HSDP would shard over; set distributed.strategy = 'fsdp' (FSDP2 across the "
            "tensor-parallel groups)"
        )
    if cfg.strategy == "ddp" and dp > 1:
        raise EngineConfigError(
            f"distributed.strategy = 'ddp' with distributed.tp_size = {cfg.tp_size}: DDP cannot reduce the "
            "tensor-parallel (DTensor) parameters; set distributed.strategy = 'fsdp' or 'auto' (FSDP2 over the "
            f"{dp} data-parallel replicas)"
        )
    if cfg.strategy == "none" and dp > 1:
        raise EngineConfigError(
            f"distributed.strategy = 'none' with {dp} tensor-parallel groups would train {dp} unrelated copies; "
            "set distributed.strategy = 'auto' or 'fsdp'"
        )
    return "fsdp" if dp > 1 else "none"


def build_mesh(device_type: str, world_size: int, tp_size: int) -> DeviceMesh:
    """The 2-D ("dp", "tp") DeviceMesh, tp inner: a tensor-parallel group is tp_size consecutive ranks."""
    return init_device_mesh(device_type, (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))


# ---------------------------------------------------------------- what can be split


def check_supported(model: nn.Module, cfg: Config) -> None:
    """Refuse (exit 78) a model or config the plans below cannot split exactly."""
    tp = cfg.distributed.tp_size
    if cfg.lora.enabled:
        raise EngineConfigError(
            f"distributed.tp_size = {tp} with LoRA (lora.rank = {cfg.lora.rank}): peft's adapters are not split "
            "over tensor-parallel ranks; set distributed.tp_size = 1 (shard with distributed.strategy = 'fsdp')"
        )
    if not is_native(model):
        raise EngineConfigError(
            f"distributed.tp_size = {tp} needs the engine's native decoder (engine/llama.py) and this run trains "
            "transformers' model; set model.implementation = 'auto' or 'native' with a supported model, or "
            "distributed.tp_size = 1"
        )
    config = model.config
    sizes = {
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "intermediate_size": config.intermediate_size,
    }
    for name, value in sizes.items():
        if value % tp:
            raise EngineConfigError(
                f"distributed.tp_size = {tp} does not divide the model's {name} ({value}); choose a tp_size that "
                "divides the attention heads, the KV heads and the MLP width"
            )
    if cfg.distributed.sequence_parallel and torch_minor() < SEQUENCE_PARALLEL_MIN_TORCH:
        raise EngineConfigError(
            f"distributed.sequence_parallel needs torch 2.13 or newer here (this is {torch.__version__}): on 2.11 a "
            "tied, grouped-query model under it drifted from the one-process run by its third step (gradient norm "
            "5e-4 apart) where 2.13 and 2.14 match; set distributed.sequence_parallel = false (tensor parallel "
            "itself matches on 2.11) or upgrade torch"
        )


# the oldest torch whose sequence-parallel run matched the one-process run in the tests (2.11 drifted, see above)
SEQUENCE_PARALLEL_MIN_TORCH = (2, 13)


# ---------------------------------------------------------------- a replicated module


class Replicated(ParallelStyle):
    """A ParallelStyle of our own: the module's parameters become Replicate DTensors, its input a DTensor of
    `input_layout` and its output is redistributed to `output_layout` (a local tensor unless use_local_output=False).

    torch has no style for a module that stays whole under tensor parallelism; without one, its parameters would
    stay plain tensors beside the DTensors, and gradient clipping, the parameter norm and FSDP2 need one kind.
    """

    def __init__(
        self, *, input_layout: Placement | None = None, output_layout: Placement | None = None,
        use_local_output: bool = True,
    ):  # fmt: skip
        super().__init__()
        self.input_layout = input_layout or Replicate()
        self.output_layout = output_layout or Replicate()
        self.use_local_output = use_local_output

    @staticmethod
    def _replicate_params(name: str, module: nn.Module, mesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, DTensor):  # a tied weight its other module distributed already
                continue
            # distribute_tensor broadcasts from the mesh's first rank, so the replicas agree whatever each built
            replicated = distribute_tensor(param.detach(), mesh, [Replicate()])
            module.register_parameter(param_name, nn.Parameter(replicated, requires_grad=param.requires_grad))

    def _input(self, module: nn.Module, inputs: tuple, mesh) -> tuple:
        first, *rest = inputs
        if isinstance(first, DTensor):
            first = first.redistribute(placements=[self.input_layout])
        else:
            first = DTensor.from_local(first, mesh, [self.input_layout], run_check=False)
        return (first, *rest)

    def _output(self, module: nn.Module, output: Any, mesh) -> Any:
        if tuple(output.placements) != (self.output_layout,):
            output = output.redistribute(placements=[self.output_layout])
        return output.to_local() if self.use_local_output else output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._replicate_params, self._input, self._output)


# ---------------------------------------------------------------- the plan


def _block_plan(sequence_parallel: bool, qk_norm: bool) -> dict[str, Any]:
    """The plan of one decoder block, by submodule name."""
    plan: dict[str, Any] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
    }
    if qk_norm:  # per-head norms over this rank's heads: their weight's gradient sums over the group's heads
        plan["self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    if not sequence_parallel:
        plan.update({
            "input_layernorm": Replicated(),
            "post_attention_layernorm": Replicated(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        })  # fmt: skip
        return plan
    # the residual stream stays a sequence-sharded DTensor; each half of the block gathers its input once
    plan.update({
        "input_layernorm": SequenceParallel(),
        "post_attention_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        ),
        "mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
    })  # fmt: skip
    return plan


def apply_tp(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> None:
    """Split the native decoder's blocks over `tp_mesh` in place (the plan in the module docstring)."""
    # a pipeline stage (engine/pipeline.py StageModule) holds some of the modules: its layers in a ModuleDict, the
    # embedding only on the first stage, norm and lm_head only on the last
    embed, norm, head = model.model.embed_tokens, model.model.norm, model.lm_head
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None:
        # under sequence parallel the residual stream starts sharded over the sequence, and stays a DTensor
        output = Replicated(output_layout=Shard(1), use_local_output=False) if sequence_parallel else Replicated()
        parallelize_module(embed, tp_mesh, output)
    if norm is not None and sequence_parallel:
        parallelize_module(norm, tp_mesh, SequenceParallel())
        # the loss reads every position: the final norm's output is gathered back whole
        parallelize_module(
            norm,
            tp_mesh,
            PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True),
        )
    elif norm is not None:
        parallelize_module(norm, tp_mesh, Replicated())
    if head is not None:
        if tied:  # distributing the embedding gave it a new Parameter: lm_head shares it again
            head.weight = embed.weight
        parallelize_module(head, tp_mesh, Replicated())
    _split_blocks(model.model.layers.values() if isinstance(model.model.layers, nn.ModuleDict) else model.model.layers,
                  tp_mesh, sequence_parallel)  # fmt: skip


def _split_blocks(layers, tp_mesh, sequence_parallel: bool) -> None:
    """The block plan on each decoder layer; each rank then attends with its own heads."""
    tp = tp_mesh.size()
    for layer in layers:
        attn = layer.self_attn
        parallelize_module(layer, tp_mesh, _block_plan(sequence_parallel, attn.q_norm is not None))
        # each rank attends with its own heads: the grouping ratio num_heads / num_kv_heads is unchanged
        attn.num_heads //= tp
        attn.num_kv_heads //= tp


def parameter_norm(model: nn.Module) -> float:
    """The L2 norm of all parameters of a tensor-parallel (and FSDP-sharded) model: every shard once, replicas once."""
    norm = torch.nn.utils.get_total_norm([p.detach() for p in model.parameters()], 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def log_applied(tp_mesh, sequence_parallel: bool) -> None:
    """The one line parallelize logs after apply_tp."""
    logger.info(
        "Applied tensor parallelism over %d ranks (column/row-wise attention and MLP, replicated embeddings, "
        "norms and lm_head)%s",
        tp_mesh.size(),
        ", sequence-parallel norms" if sequence_parallel else "",
    )
