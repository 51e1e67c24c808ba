"""Process groups, DDP / FSDP2 / HSDP on real gloo processes, activation checkpointing, compile, precision.

The multi-process tests run this file as a torchrun script (see `_worker` at the bottom): each rank
trains the tiny model on its share of a fixed global batch and writes what it saw to JSON, which the
test compares with a single-process run on the same global batch.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import prime_train.engine.parallel as parallel_module
from prime_train.config.schema import Config, DistributedConfig, ModelConfig, TrainConfig
from prime_train.engine.hf_head import has_fused_head
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import build_model, decoder_layers
from prime_train.engine.optim import build_optimizer
from prime_train.engine.parallel import (
    DistInfo,
    all_reduce_max,
    all_reduce_mean,
    all_reduce_sum,
    apply_ac,
    apply_compile,
    autocast,
    enable_tf32,
    grad_sync,
    hsdp_shard_size,
    init_distributed,
    mixed_precision_policy,
    parallelize,
    replica_count,
    resolve_strategy,
    set_seed,
)
from prime_train.engine.schedule import build_scheduler

VOCAB = 256
SEQ_LEN = 32
GLOBAL_BATCH = 8
MICRO_BATCH = 2
NUM_STEPS = 4
SEED = 1234
CPU = torch.device("cpu")
SINGLE = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU, backend="gloo")


def _config(strategy: str = "none", **model) -> Config:
    return Config(
        model=ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, **model),
        train=TrainConfig(
            lr=3e-3, warmup_steps=0, scheduler="constant", global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH
        ),
        distributed=DistributedConfig(strategy=strategy),
    )


def _global_batches() -> torch.Tensor:
    """(steps, global batch, seq_len) token ids, the same for every process: one batch repeated, so loss falls."""
    batch = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    return batch.expand(NUM_STEPS, GLOBAL_BATCH, SEQ_LEN)


def _train_steps(model, optimizer, scheduler, sequences_per_step, on_micro_step=None) -> list[float]:
    """Train on each step's sequences in micro-batches with gradient accumulation; the mean loss per step."""
    losses = []
    for step_batch in sequences_per_step:
        micro = step_batch.split(MICRO_BATCH)
        step_loss = 0.0
        for i, ids in enumerate(micro):
            with grad_sync(model, enabled=i == len(micro) - 1):
                loss = model(input_ids=ids, labels=ids).loss
                (loss / len(micro)).backward()
            step_loss += loss.item() / len(micro)
            if on_micro_step is not None:
                on_micro_step(i)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
    return losses


@functools.cache
def _single_process_losses() -> tuple[float, ...]:
    cfg = _config()
    set_seed(SEED, 0)
    model = build_model(cfg.model, VOCAB, for_training=True)
    optimizer = build_optimizer(model, cfg.train, CPU)
    return tuple(_train_steps(model, optimizer, build_scheduler(optimizer, cfg.train), _global_batches()))


def _torchrun(mode: str, tmp_path: Path) -> tuple[list[dict], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           __file__, mode, str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in range(2)], output


def _assert_matches_single_process(losses: list[float]) -> None:
    assert losses == pytest.approx(list(_single_process_losses()), rel=1e-5)


# ---------------------------------------------------------------- multi-process


def test_ddp_with_accumulation_matches_single_process_and_keeps_ranks_identical(tmp_path):
    (r0, r1), output = _torchrun("ddp", tmp_path)

    assert "Applied DDP over 2 processes" in output
    # grad_sync: the first micro-step's gradients stay local, the last one's are all-reduced
    assert r0["grad_checksums_micro0"] != r1["grad_checksums_micro0"]
    assert r0["grad_checksums_last"] == r1["grad_checksums_last"]
    assert r0["param_checksums"] == r1["param_checksums"]
    assert r0["losses"] == r1["losses"]
    _assert_matches_single_process(r0["losses"])
    # DDP set up for compiled layers still accumulates (static_graph + no_sync breaks in torch 2.13)
    assert r0["compiled_ddp_losses"] == pytest.approx(r0["losses"], rel=1e-6)
    assert r0["whole_compiled_ddp_losses"] == pytest.approx(r0["losses"], rel=1e-5)


def test_fsdp2_with_activation_checkpointing_trains_like_a_single_process(tmp_path):
    (r0, r1), output = _torchrun("fsdp", tmp_path)

    assert "Applied full activation checkpointing to 2 decoder layers" in output
    assert "Applied FSDP over mesh {'shard': 2}" in output
    assert r0["losses"] == r1["losses"]
    assert r0["losses"][-1] < r0["losses"][0]
    # grad_sync: no reduce-scatter until the last micro-step of the accumulation
    assert (r0["sharded_grads_after_micro0"], r0["sharded_grads_after_last"]) == (False, True)
    _assert_matches_single_process(r0["losses"])
    assert "Applied FSDP over mesh {'shard': 2} with bf16 parameters, fp32 reduction" in output
    assert r0["bf16_losses"] == pytest.approx(r0["losses"], rel=2e-2)
    assert r0["bf16_losses"][-1] < r0["bf16_losses"][0]
    # optimizer groups found through DTensor parameters: the tied embedding and norms do not decay
    assert r0["all_dtensor"]
    assert r0["tied"]
    assert r0["no_decay"] == sorted(
        ["model.embed_tokens.weight", "model.norm.weight"]
        + [f"model.layers.{i}.{n}.weight" for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")]
    )
    assert len(r0["decay"]) == 2 * 7 and all(n.endswith("proj.weight") for n in r0["decay"])
    assert r0["replica_count"] == 1
    assert r0["hf_fused"]
    _assert_matches_single_process(r0["hf_losses"])


@pytest.mark.slow
def test_fsdp2_over_blocks_compiled_with_fullgraph_trains_like_eager_fsdp(tmp_path):
    # issue 17: under FSDP the native blocks compile one by one with fullgraph (a graph break would be an error)
    (r0, r1), output = _torchrun("fsdp_compile", tmp_path)
    assert "Applied torch.compile to 2 decoder layers (fullgraph)" in output
    assert "Applied FSDP over mesh {'shard': 2}" in output
    assert r0["compiled_losses"] == r1["compiled_losses"]
    assert r0["compiled_losses"] == pytest.approx(r0["eager_losses"], rel=1e-5)
    assert r0["compiled_losses"][-1] < r0["compiled_losses"][0]
    assert r0["graph_breaks"] == 0 and r0["unique_graphs"] >= 1


def test_hsdp_builds_and_trains_with_shard_groups_of_one_and_two(tmp_path):
    (r0, r1), output = _torchrun("hsdp", tmp_path)

    assert "Applied HSDP over mesh {'replicate': 2, 'shard': 1}" in output
    assert "Applied HSDP over mesh {'replicate': 1, 'shard': 2}" in output
    for shard_size in ("1", "2"):
        assert r0["losses"][shard_size] == r1["losses"][shard_size]
        _assert_matches_single_process(r0["losses"][shard_size])
    assert r0["replica_count"] == {"1": 2, "2": 1}


# ---------------------------------------------------------------- one process


def test_single_process_without_torchrun_has_no_process_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    info = init_distributed(DistributedConfig())
    assert (info.rank, info.world_size, info.is_rank0) == (0, 1, True)
    assert not torch.distributed.is_initialized()
    if not torch.cuda.is_available():
        assert (info.device, info.backend) == (CPU, "gloo")
    # collectives degrade to the local value
    assert all_reduce_mean(3.0, info) == 3.0
    assert all_reduce_max(torch.tensor(2.5), info) == 2.5
    assert torch.equal(all_reduce_sum(torch.tensor([1.0, 2.0]), info), torch.tensor([1.0, 2.0]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_nccl_without_cuda_is_a_config_error():
    with pytest.raises(EngineConfigError, match=r"distributed\.backend"):
        init_distributed(DistributedConfig(backend="nccl"))


def test_strategy_auto_is_ddp_only_with_several_processes():
    assert resolve_strategy(DistributedConfig(), 1) == "none"
    assert resolve_strategy(DistributedConfig(), 2) == "ddp"
    assert resolve_strategy(DistributedConfig(strategy="fsdp"), 1) == "none"
    assert resolve_strategy(DistributedConfig(strategy="hsdp"), 8) == "hsdp"
    with pytest.raises(EngineConfigError, match=r"distributed\.strategy"):
        resolve_strategy(DistributedConfig(strategy="none"), 2)


def test_hsdp_shard_size_defaults_to_a_node_and_must_divide_the_world():
    node_of_four = DistInfo(rank=0, local_rank=0, world_size=8, local_world_size=4, device=CPU, backend="gloo")
    assert hsdp_shard_size(node_of_four, None) == 4
    assert hsdp_shard_size(node_of_four, 2) == 2
    with pytest.raises(EngineConfigError, match=r"distributed\.hsdp_shard_size"):
        hsdp_shard_size(node_of_four, 3)
    hsdp = _config("hsdp")
    assert replica_count(node_of_four, hsdp) == 2
    assert replica_count(node_of_four, _config("fsdp")) == 1
    assert replica_count(node_of_four, _config("ddp")) == 8


def test_parallelize_without_a_group_leaves_the_model_unwrapped():
    model = build_model(_config().model, VOCAB, for_training=True)
    assert parallelize(model, _config(), SINGLE) is model


def _twin_models():
    """Two training models of _config() with the same initial weights: one to change, one to compare with."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build_model(_config().model, VOCAB, for_training=True))
    return models


def test_activation_checkpointing_keeps_losses_gradients_and_state_dict_names():
    plain, checkpointed = _twin_models()
    apply_ac(checkpointed, decoder_layers(checkpointed))
    ids = _global_batches()[0]

    for model in (plain, checkpointed):
        model(input_ids=ids, labels=ids).loss.backward()

    assert "CheckpointWrapper" in type(decoder_layers(checkpointed)[0]).__name__
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for name, p in checkpointed.named_parameters():
        assert torch.allclose(p.grad, grads[name.replace("_checkpoint_wrapped_module.", "")], atol=1e-6), name


def _ops_in_backward(model, ids) -> dict[str, int]:
    """How many times each aten op ran during backward (recomputation included)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    loss = model(input_ids=ids, labels=ids).loss
    with Count() as count:
        loss.backward()
    return count.ops


def test_selective_checkpointing_keeps_gradients_and_recomputes_the_cheap_ops_not_the_matmuls():
    """selective: the layer's matmul outputs are kept, so backward runs no more matmuls than without checkpointing,
    while the RMSNorms and the MLP's SiLU run again; full reruns the matmuls too. Gradients are the same."""
    plain, selective = _twin_models()
    _, full = _twin_models()
    apply_ac(selective, decoder_layers(selective), "selective")
    apply_ac(full, decoder_layers(full), "full")
    ids = _global_batches()[0]
    ops = {name: _ops_in_backward(model, ids) for name, model in (("plain", plain), ("sel", selective), ("full", full))}

    assert ops["sel"]["mm"] == ops["plain"]["mm"] < ops["full"]["mm"]
    assert ops["sel"]["silu"] > ops["plain"].get("silu", 0) and ops["sel"]["rsqrt"] > ops["plain"].get("rsqrt", 0)
    assert list(selective.state_dict()) == list(plain.state_dict())
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for model in (selective, full):
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                p.grad, grads[name.replace("_checkpoint_wrapped_module.", "")], atol=1e-6, rtol=0
            )


def test_selective_checkpointing_under_compiled_layers_gives_the_same_gradients():
    """The FSDP configuration of the 8B plan compiles each checkpointed block: the policy's saved ops must survive
    tracing (aot_eager: inductor's tracing without its slow C++ codegen on 2 cores)."""
    plain, compiled = _twin_models()
    apply_ac(compiled, decoder_layers(compiled), "selective")
    apply_compile(compiled, decoder_layers(compiled), backend="aot_eager")
    torch._dynamo.reset()
    ids = _global_batches()[0]
    for model in (plain, compiled):
        model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in plain.named_parameters()}
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p.grad, grads[name.replace("_checkpoint_wrapped_module.", "")], atol=1e-6, rtol=0)


def test_activation_checkpointing_true_means_full_and_a_bad_mode_names_the_key():
    from pydantic import ValidationError

    assert ModelConfig(activation_checkpointing=True).activation_checkpointing == "full"
    assert ModelConfig(activation_checkpointing=False).activation_checkpointing == "none"
    with pytest.raises(ValidationError, match="activation_checkpointing"):
        ModelConfig(activation_checkpointing="partial")


def test_compiled_layers_keep_parameter_names_and_numerics():
    eager, compiled = _twin_models()
    # aot_eager traces forward and backward like inductor but skips its C++ codegen (slow on 2 cores)
    apply_compile(compiled, decoder_layers(compiled), backend="aot_eager")
    ids = _global_batches()[0]
    torch._dynamo.reset()
    counters.clear()
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    assert torch.allclose(compiled(input_ids=ids, labels=ids).loss, eager(input_ids=ids, labels=ids).loss, rtol=1e-5)
    # one graph for every layer, traced whole: a graph break (e.g. a KV-cache update) would fall back to eager
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_whole_native_model_compiles_into_one_graph_with_its_loss():
    eager, compiled = _twin_models()
    apply_compile(compiled, decoder_layers(compiled), backend="aot_eager", whole_model=True)
    ids = _global_batches()[0]
    torch._dynamo.reset()
    counters.clear()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    loss = compiled(input_ids=ids, position_ids=positions, labels=ids).loss
    assert torch.allclose(loss, eager(input_ids=ids, position_ids=positions, labels=ids).loss, rtol=1e-5)
    # embedding to loss in one graph: rotary, mask, final norm, lm_head and the chunked loss are not left eager
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]


def test_parallelize_compiles_the_native_model_whole_without_fsdp(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(parallel_module, "apply_compile", lambda m, layers, **kw: calls.append(kw))
    cfg = _config()
    cfg.train.compile = True
    with caplog.at_level(logging.INFO, logger="prime_train.engine"):
        parallelize(build_model(cfg.model, VOCAB, for_training=True), cfg, SINGLE)
    assert calls == [{"whole_model": True}]
    assert "Applied torch.compile to the whole model, loss included" in caplog.text


@pytest.mark.slow
def test_parallelize_with_compile_and_ac_trains_with_inductor():
    cfg = _config(activation_checkpointing=True)
    cfg.train.compile = True
    set_seed(SEED, 0)
    model = parallelize(build_model(cfg.model, VOCAB, for_training=True), cfg, SINGLE)
    optimizer = build_optimizer(model, cfg.train, CPU)
    losses = _train_steps(model, optimizer, build_scheduler(optimizer, cfg.train), _global_batches())
    assert losses == pytest.approx(list(_single_process_losses()), rel=1e-4)


def test_precision_auto_on_cpu_is_fp32_without_autocast():
    with autocast("auto", CPU):
        assert not torch.is_autocast_enabled("cpu")
    with autocast("fp32", CPU):
        assert not torch.is_autocast_enabled("cpu")
    assert mixed_precision_policy("auto", CPU) is None
    assert enable_tf32(CPU) is False


def test_bf16_on_cpu_autocasts_and_warns_once_that_it_is_slow(caplog):
    a = torch.randn(4, 4)
    with caplog.at_level(logging.WARNING, logger="prime_train.engine"):
        for _ in range(3):
            with autocast("bf16", CPU):
                assert (a @ a).dtype == torch.bfloat16
    assert sum("slower than fp32" in r.message for r in caplog.records) <= 1
    policy = mixed_precision_policy("bf16", CPU)
    assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_grad_sync_on_an_unwrapped_model_is_a_no_op():
    model = torch.nn.Linear(2, 2)
    with grad_sync(model, enabled=False):
        model(torch.ones(1, 2)).sum().backward()
    assert model.weight.grad is not None


# ---------------------------------------------------------------- the torchrun worker


def _grad_checksum(model) -> float:
    return sum(float(p.grad.double().sum()) for p in model.parameters() if p.grad is not None)


def _gathered(value: float) -> list[float]:
    out = [None, None]
    torch.distributed.all_gather_object(out, value)
    return out


def _rank_batches(rank: int, world_size: int) -> torch.Tensor:
    per_rank = GLOBAL_BATCH // world_size
    return _global_batches()[:, rank * per_rank : (rank + 1) * per_rank]


def _build(cfg: Config, dist: DistInfo):
    set_seed(SEED, dist.rank)
    model = parallelize(build_model(cfg.model, VOCAB, for_training=True), cfg, dist)
    optimizer = build_optimizer(model, cfg.train, dist.device)
    return model, optimizer, build_scheduler(optimizer, cfg.train)


def _worker_ddp(dist: DistInfo) -> dict:
    model, optimizer, scheduler = _build(_config("ddp"), dist)
    micro_checksums: dict[int, float] = {}

    def record(i: int) -> None:
        micro_checksums.setdefault(i, _grad_checksum(model))

    batches = _rank_batches(dist.rank, dist.world_size)
    local = _train_steps(model, optimizer, scheduler, batches, on_micro_step=record)
    losses = [all_reduce_mean(x, dist) for x in local]
    param_checksum = sum(float(p.detach().double().sum()) for p in model.parameters())

    from prime_train.engine.parallel import apply_ddp

    set_seed(SEED, dist.rank)
    ddp = apply_ddp(build_model(_config().model, VOCAB, for_training=True), dist, bucket_cap_mb=25, compiled=True)
    optimizer = build_optimizer(ddp, _config().train, dist.device)
    compiled_local = _train_steps(ddp, optimizer, build_scheduler(optimizer, _config().train), batches)

    # the native model compiled whole (its loss inside), then DDP: what parallelize does without FSDP
    from prime_train.engine.parallel import apply_compile

    set_seed(SEED, dist.rank)
    whole = build_model(_config().model, VOCAB, for_training=True)
    apply_compile(whole, decoder_layers(whole), backend="aot_eager", whole_model=True)
    whole = apply_ddp(whole, dist, bucket_cap_mb=25, compiled=True)
    optimizer = build_optimizer(whole, _config().train, dist.device)
    whole_local = _train_steps(whole, optimizer, build_scheduler(optimizer, _config().train), batches)
    return {
        "whole_compiled_ddp_losses": [all_reduce_mean(x, dist) for x in whole_local],
        "losses": losses,
        "grad_checksums_micro0": micro_checksums[0],
        "grad_checksums_last": micro_checksums[max(micro_checksums)],
        "param_checksums": param_checksum,
        "compiled_ddp_losses": [all_reduce_mean(x, dist) for x in compiled_local],
    }


def _worker_fsdp(dist: DistInfo) -> dict:
    from torch.distributed.tensor import DTensor

    cfg = _config("fsdp", activation_checkpointing=True)
    model, optimizer, scheduler = _build(cfg, dist)
    names = {id(p): n.replace("_checkpoint_wrapped_module.", "") for n, p in model.named_parameters()}
    grads_after: dict[int, bool] = {}

    def record(i: int) -> None:
        # FSDP2 sets the sharded .grad only when it reduce-scatters, i.e. on a syncing micro-step
        grads_after.setdefault(i, any(p.grad is not None for p in model.parameters()))

    local = _train_steps(model, optimizer, scheduler, _rank_batches(dist.rank, dist.world_size), record)

    # bf16 parameters with fp32 reduction (the GPU policy) also runs over gloo
    bf16 = _config("fsdp")
    bf16.train.precision = "bf16"
    with autocast("bf16", dist.device):
        bf16_local = _train_steps(*_build(bf16, dist), _rank_batches(dist.rank, dist.world_size))
    # transformers' Llama given the chunked head (engine/hf_head.py): FSDP2 gathers lm_head's weight for it
    hf = _build(_config("fsdp", activation_checkpointing=True, implementation="hf"), dist)
    hf_local = _train_steps(*hf, _rank_batches(dist.rank, dist.world_size))
    return {
        "hf_losses": [all_reduce_mean(x, dist) for x in hf_local],
        "hf_fused": type(hf[0]).__name__ == "FSDPLlamaForCausalLM" and has_fused_head(hf[0]),
        "bf16_losses": [all_reduce_mean(x, dist) for x in bf16_local],
        "sharded_grads_after_micro0": grads_after[0],
        "sharded_grads_after_last": grads_after[max(grads_after)],
        "losses": [all_reduce_mean(x, dist) for x in local],
        "decay": sorted(names[id(p)] for p in optimizer.param_groups[0]["params"]),
        "no_decay": sorted(names[id(p)] for p in optimizer.param_groups[1]["params"]),
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "replica_count": replica_count(dist, cfg),
    }


def _worker_fsdp_compile(dist: DistInfo) -> dict:
    """FSDP2 with train.compile: each native block compiled with fullgraph before fully_shard, as parallelize does
    it, so FSDP2's all-gather and reshard hooks run around (and, through Module.compile, inside) each block's
    graph. aot_eager traces forward and backward as inductor does, without its slow C++ codegen on this CPU."""
    real = parallel_module.apply_compile
    parallel_module.apply_compile = functools.partial(real, backend="aot_eager")
    try:
        torch._dynamo.reset()
        counters.clear()
        cfg = _config("fsdp")
        cfg.train.compile = True
        compiled = _train_steps(*_build(cfg, dist), _rank_batches(dist.rank, dist.world_size))
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    finally:
        parallel_module.apply_compile = real
    eager = _train_steps(*_build(_config("fsdp"), dist), _rank_batches(dist.rank, dist.world_size))
    return {
        "compiled_losses": [all_reduce_mean(x, dist) for x in compiled],
        "eager_losses": [all_reduce_mean(x, dist) for x in eager],
        "unique_graphs": graphs,
        "graph_breaks": breaks,
    }


def _worker_hsdp(dist: DistInfo) -> dict:
    losses, replicas = {}, {}
    for shard_size in (1, 2):
        cfg = _config("hsdp")
        cfg.distributed.hsdp_shard_size = shard_size
        model, optimizer, scheduler = _build(cfg, dist)
        # with one rank per shard group each rank holds the whole model: its batch slice is what differs
        local = _train_steps(model, optimizer, scheduler, _rank_batches(dist.rank, dist.world_size))
        losses[str(shard_size)] = [all_reduce_mean(x, dist) for x in local]
        replicas[str(shard_size)] = replica_count(dist, cfg)
    return {"losses": losses, "replica_count": replicas}


def _worker(mode: str, out_dir: str) -> None:
    from prime_train.engine.parallel import destroy_distributed

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    dist = init_distributed(DistributedConfig())
    # the models live only inside the mode's function: gone before the group is destroyed
    workers = {"ddp": _worker_ddp, "fsdp": _worker_fsdp, "fsdp_compile": _worker_fsdp_compile, "hsdp": _worker_hsdp}
    result = workers[mode](dist)
    destroy_distributed()
    Path(out_dir, f"{mode}-rank{dist.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
