"""Processes and parallelism: process group, device mesh, and one function per way of wrapping the model.

`parallelize` applies them in a fixed order, as torchtitan does: activation checkpointing, then
torch.compile of each decoder layer, then exactly one of FSDP2, HSDP or DDP. Each step logs one line.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import logging
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as torch_dist
from torch import nn

from prime_train.config.schema import Config, DistributedConfig
from prime_train.engine import tensor_parallel
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import decoder_layers, is_native

logger = logging.getLogger("prime_train.engine")


@dataclass
class DistInfo:
    """Where this process sits in the job: its ranks, its device and the collective backend."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str
    # Where this process sits among the data-parallel replicas: ranks that share a tensor- or pipeline-parallel
    # group see the same batches. Unset (no model parallelism): every rank is its own replica.
    data_rank: int | None = None
    data_world: int | None = None

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This process's index among the data-parallel replicas: which slice of each global batch it reads."""
        return self.rank if self.data_rank is None else self.data_rank

    @property
    def dp_size(self) -> int:
        """How many data-parallel replicas the job has: the global batch is split this many ways."""
        return self.world_size if self.data_world is None else self.data_world


# ---------------------------------------------------------------- process group


# Where mpirun (Open MPI; MPICH and Intel MPI through PMI) and srun put a process's place in the job, as torchrun's
# names: (rank, world size, local rank, local world size); a launcher that has no local size leaves it None
LAUNCHER_VARS = {
    "Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "PMI": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "Slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
}  # fmt: skip


def adopt_launcher_environment(cfg: DistributedConfig, environ: dict[str, str] | None = None) -> str | None:
    """Under mpirun or srun (no torchrun), set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT from the launcher's own variables, so the rest of the job reads one set of names; returns the
    launcher's name, or None when torchrun's variables are already there or no launcher is found.

    The rendezvous address is MASTER_ADDR, else distributed.rdzv_endpoint's host; the port MASTER_PORT, else the
    endpoint's port, else distributed.master_port. Neither launcher says where rank 0 runs, so one of the two
    addresses must be set (Slurm: `export MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -1)`).
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return None
    found = next(((n, v) for n, v in LAUNCHER_VARS.items() if v[0] in env and v[1] in env), None)
    if found is None:
        return None
    name, (rank, size, local_rank, local_size) = found
    host, _, port = (cfg.rdzv_endpoint or "").rpartition(":")
    addr = env.get("MASTER_ADDR") or host
    if not addr:
        raise EngineConfigError(
            f"started by {name} ({rank}={env[rank]}, {size}={env[size]}) without torchrun, and the address of rank "
            "0 is unknown: export MASTER_ADDR (the first node's host name) or set distributed.rdzv_endpoint = "
            "'host:port'"
        )
    world = int(env[size])
    # SLURM_NTASKS_PER_NODE reads like "4" or "4(x2)"; without a local size, assume one node
    local_world = env.get(local_size, "").split("(")[0] or str(world)
    env.update(
        RANK=env[rank], WORLD_SIZE=str(world), LOCAL_RANK=env.get(local_rank, env[rank]),
        LOCAL_WORLD_SIZE=local_world, MASTER_ADDR=addr,
        MASTER_PORT=env.get("MASTER_PORT") or port or str(cfg.master_port),
    )  # fmt: skip
    return name


def _mpi_backend(cfg: DistributedConfig) -> None:
    if cfg.backend == "mpi" and not torch_dist.is_mpi_available():
        raise EngineConfigError(
            f"distributed.backend = 'mpi', but this torch ({torch.__version__}) was built without MPI "
            "(torch.distributed.is_mpi_available() is False); set distributed.backend = 'auto' (NCCL on GPU, gloo on "
            "CPU), which works under mpirun and srun too, or build torch from source with MPI"
        )


def init_distributed(cfg: DistributedConfig) -> DistInfo:
    """Join the process group torchrun (or mpirun, or srun) describes; without one, one process and no group."""
    use_cuda = torch.cuda.is_available()
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if use_cuda else "gloo")
    if backend == "nccl" and not use_cuda:
        raise EngineConfigError(
            "distributed.backend = 'nccl' needs CUDA GPUs and none is usable here; set distributed.backend = "
            "'auto' (gloo on CPU)"
        )
    _mpi_backend(cfg)
    if launcher := adopt_launcher_environment(cfg):
        logger.info("started by %s: rank and world size from its environment", launcher)
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
        enable_tf32(device)
    if launched and not torch_dist.is_initialized():
        # On GPU a gloo group rides along for CPU tensors (dcp.async_save stages through CPU, and the
        # trainer's small metric reductions are CPU tensors); device_id makes NCCL connect eagerly.
        group_backend = f"cuda:{backend},cpu:gloo" if use_cuda and backend == "nccl" else backend
        torch_dist.init_process_group(
            backend=group_backend,
            timeout=timedelta(seconds=cfg.timeout_s),
            device_id=device if use_cuda else None,
        )
    info = DistInfo(rank, local_rank, world_size, local_world_size, device, backend)
    if cfg.tp_size > 1:  # a tensor-parallel group is one data-parallel replica: its ranks read the same batches
        data_rank, data_world = tensor_parallel.data_ranks(rank, world_size, local_world_size, cfg.tp_size)
        info = dataclasses.replace(info, data_rank=data_rank, data_world=data_world)
    logger.info(
        "process %d of %d (local %d of %d) on %s, backend %s",
        rank,
        world_size,
        local_rank,
        local_world_size,
        device,
        backend if launched else "none",
    )
    return info


def destroy_distributed() -> None:
    """Leave the process group, if one was joined. Drop DDP/FSDP-wrapped models before calling it."""
    if not torch_dist.is_initialized():
        return
    # A DDP reducer (or FSDP state) that outlives the group it holds can abort the process at interpreter
    # exit ("terminate called without an active exception": SIGABRT after a successful run, about one exit
    # in three on gloo here). Wrappers hold reference cycles, so collect the ones the caller has dropped
    # while the group is still alive. No barrier: after a failure on one rank it would hang the others'
    # exit for the whole collective timeout.
    gc.collect()
    torch_dist.destroy_process_group()


def set_seed(seed: int, rank: int) -> None:
    """Seed Python, NumPy, torch and CUDA with `seed` on every rank, so random-initialised weights match."""
    # The same seed everywhere on purpose: DDP would overwrite differing weights with rank 0's, but FSDP2
    # keeps each rank's own slice of its own initialisation. Per-rank data order is the data loader's job,
    # which takes the seed and the rank itself.
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    logger.debug("seeded rank %d with %d", rank, seed)


def _group_active(dist: DistInfo) -> bool:
    return dist.world_size > 1 and torch_dist.is_initialized()


def all_reduce_sum(x: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """Element-wise sum of `x` over ranks, returned on `x`'s device (a copy; `x` is untouched)."""
    out = x.detach().clone()
    if _group_active(dist):
        on_device = out.to(dist.device)
        torch_dist.all_reduce(on_device, op=torch_dist.ReduceOp.SUM)
        out = on_device.to(x.device)
    return out


def all_reduce_(x: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """Sum `x` over ranks in place, where it lives: on a GPU an NCCL op the host does not wait for."""
    if _group_active(dist):
        torch_dist.all_reduce(x, op=torch_dist.ReduceOp.SUM)
    return x


def all_reduce_host_ints(values: list[int], dist: DistInfo) -> list[int]:
    """Element-wise sums over ranks of host integers (token counts), computed without touching the GPU.

    A CPU tensor goes through the group's gloo backend (init_distributed gives an NCCL job a gloo side too), so
    no device work is queued or waited for: the hosts meet, the GPU streams run on.
    """
    if not _group_active(dist):
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.SUM)
    return [int(v) for v in t.tolist()]


def all_gather_host(t: torch.Tensor, dist: DistInfo) -> torch.Tensor:
    """Every rank's CPU tensor `t` (one shape on all), stacked in rank order; through the gloo side on GPU too."""
    if not _group_active(dist):
        return t[None]
    out = [torch.empty_like(t) for _ in range(dist.world_size)]
    torch_dist.all_gather(out, t.contiguous())
    return torch.stack(out)


def model_parallel_size(dist: DistInfo) -> int:
    """Ranks that read the same batches (a tensor-parallel group): a sum over all ranks counts each batch this often."""
    return dist.world_size // dist.dp_size


def all_reduce_mean(x: float | torch.Tensor, dist: DistInfo) -> float:
    """Mean of a scalar over ranks."""
    t = torch.as_tensor(x, dtype=torch.float64).detach().reshape(1)
    return float(all_reduce_sum(t, dist)[0]) / max(1, dist.world_size if _group_active(dist) else 1)


def all_reduce_max(x: float | torch.Tensor, dist: DistInfo) -> float:
    """Maximum of a scalar over ranks."""
    t = torch.as_tensor(x, dtype=torch.float64).detach().reshape(1).clone()
    if _group_active(dist):
        t = t.to(dist.device)
        torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return float(t[0])


def barrier(dist: DistInfo) -> None:
    """Wait for every rank."""
    if not _group_active(dist):
        return
    if dist.backend == "nccl":
        torch_dist.barrier(device_ids=[dist.local_rank])
    else:
        torch_dist.barrier()


# ---------------------------------------------------------------- strategy and mesh


def resolve_strategy(cfg: DistributedConfig, world_size: int) -> str:
    """The data-parallel strategy to use: 'none', 'ddp', 'fsdp' or 'hsdp'."""
    if cfg.tp_size > 1:  # over the tensor-parallel groups: FSDP2 on mesh["dp"], or nothing
        return tensor_parallel.data_parallel_strategy(cfg, world_size)
    if cfg.zero_stage is not None or cfg.cpu_offload:
        return _sharded_strategy(cfg, world_size)
    if cfg.strategy == "auto":
        return "ddp" if world_size > 1 else "none"
    if cfg.strategy == "none" and world_size > 1:
        raise EngineConfigError(
            f"distributed.strategy = 'none' with {world_size} processes would train {world_size} unrelated "
            "copies of the model; set distributed.strategy = 'auto' (DDP), 'fsdp' or 'hsdp'"
        )
    if cfg.strategy != "none" and world_size == 1:
        logger.info("distributed.strategy = %r has nothing to split over one process; training unwrapped", cfg.strategy)
        return "none"
    return cfg.strategy


def _sharded_strategy(cfg: DistributedConfig, world_size: int) -> str:
    """distributed.zero_stage and cpu_offload are FSDP2's options: they imply 'fsdp' and refuse DDP or none."""
    key = f"distributed.zero_stage = {cfg.zero_stage}" if cfg.zero_stage is not None else "distributed.cpu_offload"
    if cfg.strategy in ("ddp", "none"):
        raise EngineConfigError(
            f"{key} shards the model with FSDP2, which distributed.strategy = {cfg.strategy!r} does not; "
            "set distributed.strategy = 'fsdp' (or 'auto'), or unset the sharding option"
        )
    if world_size == 1:
        logger.info("%s has nothing to shard over one process; training unwrapped", key)
        return "none"
    return "fsdp" if cfg.strategy == "auto" else cfg.strategy


def reshard_after_forward(cfg: DistributedConfig) -> bool:
    """FSDP2's reshard_after_forward for distributed.zero_stage: free gathered parameters after forward only at 3.

    Stage 3 shards parameters, gradients and optimizer states and gathers each layer's parameters again in
    backward. Stage 2 keeps them gathered from forward to backward (one all-gather a step, not two, for a whole
    unsharded copy of the weights held through backward). FSDP2 shards gradients whenever it shards the optimizer
    states, so stage 1 (optimizer states alone) runs as stage 2, its nearest. Unset: stage 3.
    """
    if cfg.zero_stage == 1:
        _note_zero1()
    return cfg.zero_stage in (None, 3)


@functools.cache
def _note_zero1() -> None:
    logger.info(
        "distributed.zero_stage = 1 runs as stage 2: FSDP2 shards gradients along with the optimizer states, "
        "and keeps parameters gathered from forward to backward"
    )


def hsdp_shard_size(dist: DistInfo, hsdp_shard_size: int | None) -> int:
    """Ranks in one HSDP shard group: the configured size, else one node's processes."""
    size = hsdp_shard_size or dist.local_world_size
    if size < 1 or dist.world_size % size:
        raise EngineConfigError(
            f"distributed.hsdp_shard_size = {size} does not divide the {dist.world_size} processes of the job; "
            "choose a divisor (usually the processes per node)"
        )
    return size


def replica_count(dist: DistInfo, cfg: Config) -> int:
    """How many ranks hold an identical copy of each parameter (shard): DDP all, FSDP one, HSDP the replicas."""
    strategy = resolve_strategy(cfg.distributed, dist.world_size)
    if strategy == "ddp":
        return dist.world_size
    if strategy == "hsdp":
        return dist.world_size // hsdp_shard_size(dist, cfg.distributed.hsdp_shard_size)
    return 1


def build_mesh(strategy: str, dist: DistInfo, hsdp_shard_size_: int | None = None):
    """The DeviceMesh FSDP2 shards over: 1-D ('shard',) for FSDP, 2-D ('replicate', 'shard') for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    if strategy == "fsdp":
        return init_device_mesh(dist.device.type, (dist.world_size,), mesh_dim_names=("shard",))
    if strategy == "hsdp":
        shard = hsdp_shard_size(dist, hsdp_shard_size_)
        return init_device_mesh(
            dist.device.type, (dist.world_size // shard, shard), mesh_dim_names=("replicate", "shard")
        )
    return None


# ---------------------------------------------------------------- precision


def resolve_precision(precision: str, device: torch.device) -> str:
    """'bf16', 'fp16' or 'fp32': what train.precision means on `device`."""
    bf16_gpu = device.type == "cuda" and torch.cuda.is_bf16_supported()
    if precision == "auto":
        return "bf16" if bf16_gpu else "fp32"
    if precision == "bf16" and device.type == "cuda" and not bf16_gpu:
        raise EngineConfigError(
            f"train.precision = 'bf16' but {torch.cuda.get_device_name(device)} has no bf16 support; "
            "set train.precision = 'auto' or 'fp32'"
        )
    return precision


HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.cache
def _warn_cpu_half(precision: str) -> None:
    logger.warning(
        "train.precision = %r on the CPU: autocast works but is usually slower than fp32 here; "
        "use 'auto' unless you are checking %s numerics",
        precision,
        precision,
    )


def autocast(precision: str, device: torch.device):
    """A context manager running the forward in bf16 or fp16 autocast when that precision is in effect, else nothing."""
    resolved = resolve_precision(precision, device)
    if resolved not in HALF_DTYPES:
        return nullcontext()
    if device.type == "cpu":
        _warn_cpu_half(resolved)
    return torch.autocast(device.type, dtype=HALF_DTYPES[resolved])


def mixed_precision_policy(precision: str, device: torch.device):
    """FSDP2 policy: bf16 (or fp16) parameters with fp32 gradient reduction when that precision is in effect."""
    resolved = resolve_precision(precision, device)
    if resolved not in HALF_DTYPES:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # fp32 reduction: summing half-precision gradients over many ranks loses the low bits small updates live in
    return MixedPrecisionPolicy(param_dtype=HALF_DTYPES[resolved], reduce_dtype=torch.float32)


def enable_tf32(device: torch.device) -> bool:
    """Let fp32 matmuls use TF32 on Ampere or newer GPUs; returns whether it did."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 0):
        return False
    # The long-standing API, not `torch.backends.cuda.matmul.fp32_precision`: once that newer one is set,
    # any library reading the legacy `allow_tf32` flag raises a "mix of the legacy and new APIs" error.
    torch.set_float32_matmul_precision("high")
    return True


# ---------------------------------------------------------------- model wrappers


def apply_ac(model: nn.Module, layers: nn.ModuleList, mode: str = "full") -> None:
    """Recompute each decoder layer's activations in backward instead of keeping them.

    "full" keeps only each layer's input and reruns its whole forward in backward: about 8N FLOPs a token instead
    of 6N. "selective" keeps the outputs of the layer's matmuls and of its attention kernel (the expensive ops) and
    recomputes the rest (norms, rotary, the MLP's activation and product): little recompute for most of full's
    memory saving on the MLP's elementwise tensors. torchtitan's op-level policy is built on the same
    torch.utils.checkpoint mechanism.
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    kwargs = {}
    if mode == "selective":
        kwargs["context_fn"] = _selective_contexts
    elif mode != "full":
        raise ValueError(f"activation checkpointing must be 'full' or 'selective', not {mode!r}")
    # the wrapper's state_dict hooks strip its `_checkpoint_wrapped_module.` prefix, so checkpoints and
    # exported weights keep the plain transformers names
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, **kwargs)


def selective_save_ops() -> set:
    """The ops whose outputs selective checkpointing keeps: matmuls and the attention kernels of every backend."""
    aten = torch.ops.aten
    names = [
        "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    ]  # fmt: skip
    ops = {getattr(aten, n).default for n in names if hasattr(aten, n)}
    try:  # FlexAttention is a higher-order op; the checkpoint policy sees it as one op too
        from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

        ops.add(flex_hop)
    except ImportError:
        pass
    return ops


def _selective_contexts():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = selective_save_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_compile(
    model: nn.Module, layers: nn.ModuleList, *, backend: str = "inductor", whole_model: bool = False
) -> None:
    """torch.compile in place: the whole model (its loss inside), or each decoder layer (one shared graph).

    whole_model is for the native decoder without FSDP: one graph from the embedding to the loss, so rotary,
    masks, the final norm, lm_head and the chunked cross-entropy are fused too, not left eager between layers.
    Per layer (under FSDP2, and for transformers' models) the native blocks compile with fullgraph: a graph break
    inside a block is an error, not a silent fall back to eager.
    """
    # Module.compile() keeps the module and its parameter names (no `_orig_mod.`), which FSDP, DCP and
    # save_pretrained all depend on. FSDP2 hooks run between blocks, so under it the unit of compilation is the
    # block; transformers' glue code around its layers breaks graphs, so its models compile per layer as well.
    if whole_model:
        model.compile(backend=backend)
        return
    fullgraph = is_native(model)
    for layer in layers:
        layer.compile(backend=backend, fullgraph=fullgraph)


def apply_ddp(model: nn.Module, dist: DistInfo, bucket_cap_mb: int, compiled: bool) -> nn.Module:
    """Wrap in DistributedDataParallel: gradients all-reduced in buckets during backward."""
    from torch.nn.parallel import DistributedDataParallel

    # `compiled` does not turn on static_graph, though compiled layers would allow it; the argument stays so
    # callers need not change when it can. In torch 2.13 static_graph=True with no_sync() accumulation fails
    # its first backward with an `expect_autograd_hooks_` internal assert (pytorch/pytorch#143580; the open
    # fix, PR #187732, notes it then stops all-reducing silently), and accumulation is worth more than the
    # bucket-order reuse static_graph buys. The layers are compiled before wrapping, so DDP's own forward is
    # never traced and dynamo's DDP optimizer (torch._dynamo.config.optimize_ddp) does not come into play.
    model.to(dist.device)
    return DistributedDataParallel(
        model,
        device_ids=[dist.local_rank] if dist.device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
    )


def apply_fsdp(model: nn.Module, mesh, mp_policy, reshard_after_forward: bool = True, offload_policy=None) -> nn.Module:
    """FSDP2: fully_shard each decoder layer, then the root (embeddings, final norm, lm_head)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = mp_policy or MixedPrecisionPolicy()
    offload = offload_policy or OffloadPolicy()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # backward starts with the last layer: keeping it gathered after forward saves one all-gather
        last = i == len(layers) - 1
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward and not last,
                    offload_policy=offload)  # fmt: skip
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=offload)
    return model


def apply_hsdp(model: nn.Module, mesh, mp_policy, reshard_after_forward: bool = True, offload_policy=None) -> nn.Module:
    """HSDP: FSDP2 over a 2-D mesh, sharded within each 'shard' group and replicated across 'replicate'."""
    if mesh.ndim != 2:
        raise ValueError(f"HSDP needs a 2-D ('replicate', 'shard') mesh, got {mesh.ndim} dimension(s)")
    return apply_fsdp(model, mesh, mp_policy, reshard_after_forward, offload_policy)


def cpu_offload_policy(dist: DistInfo):
    """FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer states in host memory.

    Memory is pinned only when there is a GPU to copy to: on a CPU-only machine the parameters already live in
    host memory, the policy then only keeps FSDP2's bookkeeping the same, and pinning needs CUDA.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=dist.device.type == "cuda")


def _bf16_compress_hook(process_group, bucket):
    """torch's bf16_compress_hook, for backends other than NCCL: the bucket cast to bf16, averaged, cast back."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


def apply_grad_compression(model: nn.Module, cfg: DistributedConfig) -> str | None:
    """Register distributed.grad_compression's DDP communication hook on a DDP model; returns what it registered.

    'bf16' all-reduces each bucket in bfloat16 and casts back (half the bytes on the wire, 8 bits of mantissa);
    'powersgd' sends rank-`powersgd_rank` factors of each gradient matrix with error feedback, after
    `powersgd_warmup_steps` optimizer steps of plain all-reduce. PowerSGD's state (its error-feedback residuals and
    warm-started factors) lives in the hook, not in checkpoints: a resumed run starts it afresh, with another
    warm-up of plain all-reduce.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if cfg.grad_compression == "bf16":
        # DDP accepts torch's bf16_compress_hook only over NCCL 2.10+ (it checks the hook's name); gloo sums bf16
        # as well, so elsewhere the same compression goes through the hook's own body under another name
        nccl = torch_dist.get_backend() == "nccl" or "cuda:nccl" in str(torch_dist.get_backend())
        model.register_comm_hook(None, default_hooks.bf16_compress_hook if nccl else _bf16_compress_hook)
        return "bf16 all-reduce"
    if cfg.grad_compression == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_warmup_steps,
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return f"PowerSGD rank {cfg.powersgd_rank} after {cfg.powersgd_warmup_steps} steps of plain all-reduce"
    return None


def parallelize(model: nn.Module, cfg: Config, dist: DistInfo) -> nn.Module:
    """Apply tensor parallelism, activation checkpointing, compile and the data-parallel strategy, in that order."""
    strategy = resolve_strategy(cfg.distributed, dist.world_size)
    if cfg.train.float8:
        from prime_train.engine.precision import apply_float8

        apply_float8(model, dist.device)  # first, as torchtitan does: the wrappers below see Float8Linear layers
    if cfg.train.qat != "none":
        from prime_train.engine.qat import apply_qat

        apply_qat(model, cfg.train.qat, dist.device)  # before any wrapper, as float8: they see the swapped layers
    layers = decoder_layers(model)
    model.to(dist.device)
    mesh_2d = None
    if cfg.distributed.tp_size > 1:
        tensor_parallel.check_supported(model, cfg)
        mesh_2d = tensor_parallel.build_mesh(dist.device.type, dist.world_size, cfg.distributed.tp_size)
        tensor_parallel.apply_tp(model, mesh_2d["tp"], cfg.distributed.sequence_parallel)
        tensor_parallel.log_applied(mesh_2d["tp"], cfg.distributed.sequence_parallel)
    if cfg.model.activation_checkpointing != "none":
        apply_ac(model, layers, cfg.model.activation_checkpointing)
        logger.info("Applied %s activation checkpointing to %d decoder layers", cfg.model.activation_checkpointing,
                    len(layers))  # fmt: skip
    if cfg.train.compile:
        if is_native(model) and dist.device.type == "cuda":
            # packed rows' document masks as FlexAttention block masks: compiled, a fused kernel that skips the
            # masked blocks, where SDPA with a dense B x 1 x T x T mask cannot use the flash kernel. Not on the
            # CPU: torch 2.13's FlexAttention has no CPU backward.
            model.attention = "flex"
            logger.info("Packed rows attend through FlexAttention block masks")
        whole = is_native(model) and strategy not in ("fsdp", "hsdp")
        apply_compile(model, layers, whole_model=whole)
        if whole:
            logger.info("Applied torch.compile to the whole model, loss included")
        else:
            logger.info("Applied torch.compile to %d decoder layers%s", len(layers), " (fullgraph)" * is_native(model))
    if strategy in ("fsdp", "hsdp"):
        model = _apply_sharding(model, strategy, cfg, dist, mesh_2d["dp"] if mesh_2d is not None else None)
    elif strategy == "ddp":
        model = apply_ddp(model, dist, cfg.distributed.bucket_cap_mb, compiled=cfg.train.compile)
        logger.info("Applied DDP over %d processes (bucket %d MB)", dist.world_size, cfg.distributed.bucket_cap_mb)
        if compression := apply_grad_compression(model, cfg.distributed):
            logger.info("Applied gradient compression: %s", compression)
    return model


def _apply_sharding(model: nn.Module, strategy: str, cfg: Config, dist: DistInfo, mesh=None) -> nn.Module:
    """FSDP or HSDP with the run's precision, ZeRO stage and offload; logs one line saying which. `mesh`: the
    data-parallel dimension of a tensor-parallel mesh; unset, the strategy's own mesh over every rank."""
    mesh = mesh if mesh is not None else build_mesh(strategy, dist, cfg.distributed.hsdp_shard_size)
    mp_policy = mixed_precision_policy(cfg.train.precision, dist.device)
    reshard = reshard_after_forward(cfg.distributed)
    offload = cpu_offload_policy(dist) if cfg.distributed.cpu_offload else None
    apply = apply_fsdp if strategy == "fsdp" else apply_hsdp
    model = apply(model, mesh, mp_policy, reshard, offload)
    half = resolve_precision(cfg.train.precision, dist.device)
    extras = [f"ZeRO stage {cfg.distributed.zero_stage}"] if cfg.distributed.zero_stage else []
    extras += ["parameters kept gathered from forward to backward"] * (not reshard)
    extras += ["CPU offload of parameters, gradients and optimizer states"] * bool(offload)
    logger.info(
        "Applied %s over mesh %s %s%s",
        strategy.upper(),
        dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)),
        f"with {half} parameters, fp32 reduction" if mp_policy else "in fp32",
        "".join(f"; {e}" for e in extras),
    )
    return model


@contextmanager
def grad_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Around a micro-step's forward and backward: reduce gradients over ranks only when `enabled`."""
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with nullcontext() if enabled else model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            # leave the model syncing, so a caller that forgets the context still gets correct gradients
            model.set_requires_gradient_sync(True)
    else:
        yield
