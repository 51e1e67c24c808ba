"""ZeRO stages and CPU offload on FSDP2, fp16 loss scaling across shards, DDP gradient compression, and jobs
started by mpirun or srun instead of torchrun: on real gloo processes, against the single-process run.

The multi-process tests run this file as a script (see `_worker` at the bottom), under torchrun or as two plain
processes with a launcher's environment; each rank writes what it saw to JSON. The model, batches and the
single-process reference are test_parallel's, so every comparison is against the same golden run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from enginetools import free_port
from test_parallel import _build, _config, _rank_batches, _single_process_losses, _train_steps

from prime_train.config.schema import DistributedConfig
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.parallel import (
    DistInfo,
    adopt_launcher_environment,
    all_reduce_mean,
    init_distributed,
    reshard_after_forward,
    resolve_strategy,
)
from prime_train.engine.precision import LossScaler

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "OMPI_"))}
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    return env


def _read(out: Path, mode: str) -> list[dict]:
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, str]:
    """One torchrun of two gloo ranks running every mode below; the tests read their parts of it."""
    out = tmp_path_factory.mktemp("zero")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, "all",
           str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=400)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return out, output


# ---------------------------------------------------------------- ZeRO stages and offload


def test_zero_stages_and_cpu_offload_give_the_single_process_losses(two_ranks):
    out, output = two_ranks
    r0, r1 = _read(out, "zero")
    assert "Applied FSDP over mesh {'shard': 2} in fp32; ZeRO stage 2; parameters kept gathered" in output
    assert "ZeRO stage 3; CPU offload of parameters, gradients and optimizer states" in output
    assert "distributed.zero_stage = 1 runs as stage 2" in output
    for variant in ("1", "2", "3", "3+offload"):
        assert r0[variant] == r1[variant]
        # fp32 on gloo: the same sums in another order, so equal to rounding (rel 1e-5, as test_parallel's FSDP)
        assert r0[variant] == pytest.approx(list(_single_process_losses()), rel=1e-5), variant


def test_zero_stage_implies_fsdp_and_refuses_ddp_by_name():
    assert resolve_strategy(DistributedConfig(zero_stage=2), 2) == "fsdp"
    assert resolve_strategy(DistributedConfig(zero_stage=3, strategy="hsdp"), 4) == "hsdp"
    assert resolve_strategy(DistributedConfig(cpu_offload=True), 1) == "none"
    assert [reshard_after_forward(DistributedConfig(zero_stage=s)) for s in (None, 1, 2, 3)] == [
        True, False, False, True,
    ]  # fmt: skip
    with pytest.raises(EngineConfigError, match=r"distributed.zero_stage = 2 .* distributed.strategy = 'ddp'"):
        resolve_strategy(DistributedConfig(zero_stage=2, strategy="ddp"), 2)
    with pytest.raises(EngineConfigError, match=r"distributed.cpu_offload .* 'none'"):
        resolve_strategy(DistributedConfig(cpu_offload=True, strategy="none"), 2)


# ---------------------------------------------------------------- fp16 loss scaling


def test_fp16_under_fsdp_trains_and_an_overflow_on_one_rank_skips_the_step_on_both(two_ranks):
    out, _ = two_ranks
    r0, r1 = _read(out, "fp16")
    clean, poisoned = r0["clean"], r0["poisoned"]
    # fp16 compute against the fp32 golden run: within 2 % (bf16's tolerance in test_parallel), and it learns
    assert clean["losses"] == pytest.approx(list(_single_process_losses()), rel=2e-2)
    assert clean["losses"][-1] < clean["losses"][0]
    assert clean["stepped"] == [True] * 4
    # an inf in rank 0's gradient shard at step 1: ShardedGradScaler all-reduces the overflow, so both ranks skip
    assert r0["poisoned"]["stepped"] == r1["poisoned"]["stepped"] == [True, False, True, True]
    assert poisoned["metrics"][1] == {"loss_scale": 32768.0, "overflow_steps": 1.0}
    assert r1["poisoned"]["metrics"][-1] == {"loss_scale": 32768.0, "overflow_steps": 1.0}
    # the skipped step left the weights alone: step 2 sees step 1's loss again
    assert poisoned["losses"][2] == pytest.approx(poisoned["losses"][1], rel=1e-6)


def test_fp16_scaler_skips_overflowing_steps_halves_the_scale_and_resumes_its_state():
    from test_parallel import SEED, VOCAB, _global_batches

    from prime_train.engine.model import build_model
    from prime_train.engine.optim import build_optimizer
    from prime_train.engine.parallel import autocast, set_seed

    cfg = _config()
    set_seed(SEED, 0)
    model = build_model(cfg.model, VOCAB, for_training=True)
    optimizer = build_optimizer(model, cfg.train, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    # a scale fp16's gradients cannot hold (65504 is its largest value): every step overflows
    scaler = LossScaler(True, sharded=False, device=torch.device("cpu"), init_scale=2.0**40)
    stepped = []
    for ids in _global_batches()[:3]:
        with autocast("fp16", torch.device("cpu")):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        stepped.append(scaler.step(optimizer))
        optimizer.zero_grad(set_to_none=True)
    assert stepped == [False, False, False]
    assert scaler.metrics() == {"loss_scale": 2.0**37, "overflow_steps": 3.0}
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # the checkpoint entry (TrainState's loss_scaler) carries the scale and the count into a resumed run
    resumed = LossScaler(True, sharded=False, device=torch.device("cpu"))
    resumed.load_state_dict(scaler.state_dict())
    assert resumed.metrics() == scaler.metrics()


# ---------------------------------------------------------------- gradient compression


def test_bf16_compression_follows_plain_ddp_and_powersgd_trains(two_ranks):
    out, output = two_ranks
    r0, r1 = _read(out, "compress")
    assert "Applied gradient compression: bf16 all-reduce" in output
    assert "Applied gradient compression: PowerSGD rank 1 after 2 steps of plain all-reduce" in output
    golden = list(_single_process_losses())
    # bf16 keeps 8 bits of mantissa: the gradients differ in the third digit, the losses by far less
    assert r0["bf16"] == r1["bf16"]
    assert r0["bf16"] == pytest.approx(golden, rel=1e-3)
    assert r0["bf16"] != pytest.approx(golden, rel=1e-9)  # it did compress
    # PowerSGD: plain all-reduce for the 2 warm-up steps (exact), then rank-1 factors: it still learns
    assert r0["powersgd"][:2] == pytest.approx(golden[:2], rel=1e-5)
    assert r0["powersgd"][-1] < r0["powersgd"][0]
    assert r0["powersgd"] == r1["powersgd"]


# ---------------------------------------------------------------- launchers


@pytest.mark.slow
@pytest.mark.parametrize(
    "launcher",
    [
        {"SLURM_PROCID": "{rank}", "SLURM_NTASKS": "2", "SLURM_LOCALID": "{rank}", "SLURM_NTASKS_PER_NODE": "2"},
        {
            "OMPI_COMM_WORLD_RANK": "{rank}",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "{rank}",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        },
    ],
    ids=["slurm", "openmpi"],
)
def test_two_processes_started_by_a_launcher_form_a_group_and_train_like_one(launcher, tmp_path):
    port = free_port()
    procs = []
    for rank in range(2):
        env = {**_clean_env(), **{k: v.format(rank=rank) for k, v in launcher.items()}}
        env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(port)
        cmd = [sys.executable, __file__, "launched", str(tmp_path)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=200)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    r0, r1 = _read(tmp_path, "launched")
    assert (r0["rank"], r1["rank"], r0["world_size"], r0["group_size"]) == (0, 1, 2, 2)
    assert r0["losses"] == r1["losses"]
    assert r0["losses"] == pytest.approx(list(_single_process_losses()), rel=1e-5)


def test_a_launcher_without_the_rank0_address_and_the_mpi_backend_are_refused_by_name():
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}
    with pytest.raises(EngineConfigError, match=r"started by Slurm .*export MASTER_ADDR.*distributed\.rdzv_endpoint"):
        adopt_launcher_environment(DistributedConfig(), env)
    adopt_launcher_environment(DistributedConfig(rdzv_endpoint="node7:29411"), env)
    assert {k: env[k] for k in LAUNCH_VARS} == {
        "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node7",
        "MASTER_PORT": "29411",
    }  # fmt: skip
    pmi = {"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}
    assert adopt_launcher_environment(DistributedConfig(master_port=29999), pmi) == "PMI"
    assert (pmi["RANK"], pmi["MASTER_PORT"]) == ("0", "29999")
    assert adopt_launcher_environment(DistributedConfig(), {"RANK": "0", "WORLD_SIZE": "1", "PMI_RANK": "3"}) is None
    if not torch.distributed.is_mpi_available():
        with pytest.raises(EngineConfigError, match=r"distributed\.backend = 'mpi'.*built without MPI"):
            init_distributed(DistributedConfig(backend="mpi"))


# ---------------------------------------------------------------- the ranks' side


def _worker_zero(dist: DistInfo) -> dict:
    out = {}
    for name, stage, offload in (("1", 1, False), ("2", 2, False), ("3", 3, False), ("3+offload", 3, True)):
        cfg = _config("fsdp")
        cfg.distributed.zero_stage, cfg.distributed.cpu_offload = stage, offload
        local = _train_steps(*_build(cfg, dist), _rank_batches(dist.rank, dist.world_size))
        out[name] = [all_reduce_mean(x, dist) for x in local]
    return out


def _fp16_steps(dist: DistInfo, poison_step: int | None) -> dict:
    """fp16 under FSDP with the engine's scaler; `poison_step`: put an inf into rank 0's gradient shard there."""
    cfg = _config("fsdp")
    cfg.train.precision = "fp16"
    model, optimizer, scheduler = _build(cfg, dist)
    scaler = LossScaler.for_run("fp16", "fsdp", dist.device)
    losses, stepped, metrics = [], [], []
    for step, ids in enumerate(_rank_batches(dist.rank, dist.world_size)):
        loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        if step == poison_step and dist.rank == 0:
            next(iter(model.parameters())).grad.to_local().view(-1)[0] = float("inf")
        scaler.unscale_(optimizer)
        stepped.append(scaler.step(optimizer))
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(all_reduce_mean(loss.detach(), dist))
        metrics.append(scaler.metrics())
    return {"losses": losses, "stepped": stepped, "metrics": metrics}


def _worker_fp16(dist: DistInfo) -> dict:
    return {"clean": _fp16_steps(dist, None), "poisoned": _fp16_steps(dist, 1)}


def _worker_compress(dist: DistInfo) -> dict:
    out = {}
    for compression in ("bf16", "powersgd"):
        cfg = _config("ddp")
        cfg.distributed.grad_compression, cfg.distributed.powersgd_warmup_steps = compression, 2
        local = _train_steps(*_build(cfg, dist), _rank_batches(dist.rank, dist.world_size))
        out[compression] = [all_reduce_mean(x, dist) for x in local]
    return out


def _worker_launched(dist: DistInfo) -> dict:
    local = _train_steps(*_build(_config("ddp"), dist), _rank_batches(dist.rank, dist.world_size))
    return {
        "rank": dist.rank,
        "world_size": dist.world_size,
        "group_size": torch.distributed.get_world_size(),
        "losses": [all_reduce_mean(x, dist) for x in local],
    }


def _worker(mode: str, out_dir: str) -> None:
    from prime_train.engine.parallel import destroy_distributed

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    dist = init_distributed(DistributedConfig())
    workers = {"zero": _worker_zero, "fp16": _worker_fp16, "compress": _worker_compress, "launched": _worker_launched}
    # "all": every mode torchrun runs (not "launched", which its own test starts without torchrun)
    for name in [n for n in workers if n != "launched"] if mode == "all" else [mode]:
        result = workers[name](dist)
        Path(out_dir, f"{name}-rank{dist.rank}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


# ---------------------------------------------------------------- fp16 in the engine, float8


# fp16 matmuls on a CPU without fp16 units run about ten times slower than fp32 (1.4k against 13k tokens/s on the tiny
# default): the fp16 runs take 8 rows of 64 tokens a step, an eighth of the default's, as the loss scaler's logic is
# the same whatever the shape
FP16_SHAPE = {"data.seq_len": 64, "train.global_batch_size": 8, "train.micro_batch_size": 8}


@pytest.mark.slow
def test_fp16_engine_run_learns_and_reports_its_loss_scale(tmp_path):
    from enginetools import metrics, run_train

    proc = run_train(tmp_path, "fp16", **{**FP16_SHAPE, "train.precision": "fp16", "train.max_steps": 20,
                                          "ckpt.interval": 20})  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rows = [r for r in metrics(tmp_path / "fp16") if r.get("loss") is not None and r.get("step", 0) > 0]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert {"loss_scale", "overflow_steps"} <= set(rows[-1])
    assert rows[-1]["loss_scale"] >= 1.0 and rows[-1]["overflow_steps"] >= 0


# ---------------------------------------------------------------- kill -9 and resume


def _killed_and_resumed(root: Path, name: str, **overrides) -> subprocess.CompletedProcess:
    """Run `name` through the CLI, kill -9 it and its ranks once checkpoints/step-5 exists, then resume it."""
    from enginetools import TINY, cli, kill_everything_once, run_train, start, tiny_overrides

    proc = start(cli("train", str(TINY), *tiny_overrides(root, name, **overrides)))
    kill_everything_once(proc, root / name / "checkpoints" / "step-5")
    assert proc.returncode == -9
    assert not (root / name / "final").exists()  # killed before the end, or the resume proves nothing
    resumed = run_train(root, name, **overrides)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert "at step 5" in resumed.stdout + resumed.stderr
    return resumed


def _fields_by_step(run_dir: Path, *keys: str) -> dict[int, tuple]:
    from enginetools import metrics

    return {r["step"]: tuple(r[k] for k in keys) for r in metrics(run_dir) if "loss" in r and r.get("step", 0) > 0}


# a start the tiny model's fp16 gradients cannot hold: steps 1-4 overflow and the scale halves to 2**18 before the
# step-5 checkpoint; a resume that lost the scaler would start from 2**22 again and skip steps 6-9
FP16_RESUME = {**FP16_SHAPE, "train.precision": "fp16", "train.loss_scale_init": 2**22, "train.max_steps": 10,
               "ckpt.interval": 5, "logging.log_interval": 1}  # fmt: skip


@pytest.mark.slow
def test_fp16_resume_after_kill_keeps_the_loss_scale_and_the_losses(tmp_path):
    from enginetools import run_train

    straight = run_train(tmp_path, "straight", **FP16_RESUME)
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-4000:]
    _killed_and_resumed(tmp_path, "killed", **FP16_RESUME)
    keys = ("loss", "loss_scale", "overflow_steps")
    a, b = _fields_by_step(tmp_path / "straight", *keys), _fields_by_step(tmp_path / "killed", *keys)
    assert a[5][1:] == (2.0**18, 4.0)  # the scale fell before the checkpoint, so resuming it is tested
    assert sorted(b) == list(range(1, 11))
    for step in range(6, 11):
        assert a[step] == b[step], (step, a[step], b[step])  # loss, scale and overflow count: bitwise on CPU


@pytest.mark.slow
@pytest.mark.parametrize(
    "zero", [{"distributed.zero_stage": 2}, {"distributed.zero_stage": 3, "distributed.cpu_offload": "true"}],
    ids=["stage2", "stage3-offload"],
)  # fmt: skip
def test_zero_stage_resume_after_kill_on_two_ranks_matches_uninterrupted_run(zero, tmp_path):
    from enginetools import final_weights, losses_by_step, run_train

    overrides = {"distributed.nproc_per_node": 2, "distributed.strategy": "fsdp", "train.max_steps": 10,
                 "ckpt.interval": 5, "logging.log_interval": 1, **zero}  # fmt: skip
    straight = run_train(tmp_path, "straight", **overrides)
    assert straight.returncode == 0, (straight.stdout + straight.stderr)[-4000:]
    assert f"ZeRO stage {zero['distributed.zero_stage']}" in straight.stdout + straight.stderr
    _killed_and_resumed(tmp_path, "killed", **overrides)
    a, b = losses_by_step(tmp_path / "straight"), losses_by_step(tmp_path / "killed")
    assert sorted(b) == list(range(1, 11))
    for step in range(6, 11):
        assert a[step] == b[step], (step, a[step], b[step])  # the same ranks, the same order of sums: bitwise
    wa, wb = final_weights(tmp_path / "straight"), final_weights(tmp_path / "killed")
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def _float8_capable() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(_float8_capable(), reason="checks the refusal where float8 cannot run")
def test_float8_without_a_capable_gpu_is_a_config_error_with_the_reason():
    from prime_train.engine.model import build_model
    from prime_train.engine.parallel import parallelize
    from prime_train.engine.precision import float8_unavailable

    dist = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")
    assert "needs a CUDA GPU of compute capability 8.9+" in float8_unavailable(torch.device("cpu"))
    cfg = _config()
    cfg.train.float8 = True
    with pytest.raises(EngineConfigError, match=r"train.float8 = true needs .*; set train.float8 = false"):
        parallelize(build_model(cfg.model, 256, for_training=True), cfg, dist)


def test_float8_converts_the_decoder_linears_with_dims_of_16_and_never_lm_head():
    from torch import nn

    from prime_train.engine.precision import float8_eligible

    assert float8_eligible(nn.Linear(64, 128), "model.layers.0.mlp.up_proj")
    assert not float8_eligible(nn.Linear(64, 256), "lm_head")
    assert not float8_eligible(nn.Linear(64, 40), "model.layers.0.self_attn.k_proj")
    assert not float8_eligible(nn.LayerNorm(64), "model.norm")


def test_lint_names_fp16_without_loss_scaling_and_float8_with_lora(tmp_path):
    from prime_train.config.loader import Sources
    from prime_train.config.schema import Config
    from prime_train.validator.precision_checks import precision_problems

    cfg = Config.model_validate({"run": {"job": "rl"}, "train": {"precision": "fp16", "float8": True},
                                 "lora": {"rank": 8}, "distributed": {"grad_compression": "bf16"}})  # fmt: skip
    found = {p.key: p for p in precision_problems(cfg, Sources({}, []))}
    assert "the rl job does not do" in found["train.precision"].message
    assert "lora.rank > 0" in found["train.float8"].message
    assert found["distributed.grad_compression"].severity == "warning"  # one process: nothing to compress


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_trains_on_a_gpu_with_loss_scaling():
    _assert_trains_on_gpu(precision="fp16")


@pytest.mark.gpu
@pytest.mark.skipif(not _float8_capable(), reason="needs a CUDA GPU of compute capability 8.9+")
def test_float8_trains_on_a_capable_gpu():
    _assert_trains_on_gpu(precision="bf16", float8=True)


def _assert_trains_on_gpu(precision: str, float8: bool = False) -> None:
    from test_parallel import _global_batches

    from prime_train.engine.parallel import autocast

    device = torch.device("cuda", 0)
    dist = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=device, backend="nccl")
    cfg = _config()
    cfg.train.precision, cfg.train.float8 = precision, float8
    model, optimizer, _ = _build(cfg, dist)  # parallelize converts to float8 first, as the engine does
    if float8:
        assert sum(type(m).__name__ == "Float8Linear" for m in model.modules()) == 2 * 7  # q k v o gate up down
    scaler = LossScaler.for_run(precision, "none", device)
    losses = []
    for ids in _global_batches().to(device):
        with autocast(precision, device):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
