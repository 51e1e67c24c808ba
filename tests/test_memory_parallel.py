"""The memory calculator under tensor and pipeline parallelism (validator/memory_parallel.py): each term moves the
way the split says, a small case computed by hand, and the parameters each rank holds against the real thing: the
engine's tensor-parallel plan on two gloo ranks (the sum of each rank's local shards) and its pipeline stages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from prime_train.config.schema import Config
from prime_train.validator.memory import estimate, inputs_from_config, inputs_from_flags
from prime_train.validator.memory_breakdown import trainer_memory
from prime_train.validator.memory_inputs import MemoryInputError, ModelShape
from prime_train.validator.memory_parallel import in_flight, rank_layers, rank_shape

# a Llama with grouped-query attention, untied (a pipeline needs it), small enough to build for real below
HF = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
      "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96, "tie_word_embeddings": False,
      "max_position_embeddings": 64}  # fmt: skip
SHAPE = ModelShape.from_hf(HF)


def _inputs(**kw):
    settings = {"gpus_per_node": 2, "strategy": "none", "precision": "fp32", "seq_len": 32, "micro_batch": 4, **kw}
    return inputs_from_flags(dict(HF), **settings)


def _parts(inputs) -> dict[str, int]:
    return {p.name: p.bytes for p in trainer_memory(inputs, SHAPE).parts}


def test_tensor_parallel_by_hand_and_each_term_in_its_direction():
    h, f, vocab, layers = 64, 128, 96, 4
    # a layer: q, o (h × h), k, v (h × h/2 with 2 of 4 heads' width), gate, up, down (h × f), two norms (h)
    linear = 2 * h * h + 2 * h * (h // 2) + 3 * h * f
    assert SHAPE.layer_params == linear + 2 * h
    one, tp2 = _parts(_inputs(gpus_per_node=1)), _parts(_inputs(tp_size=2, strategy="none"))
    # by hand: the linears halve, the norms, embeddings, final norm and lm_head stay whole; fp32 takes 4 bytes
    per_rank = 2 * vocab * h + h + layers * (2 * h + linear // 2)
    assert tp2["weights"] == 4 * per_rank and tp2["gradients"] == 4 * per_rank
    assert tp2["optimizer states"] == 8 * per_rank
    assert one["weights"] == 4 * SHAPE.num_params > tp2["weights"]
    # activations: attention and MLP halve, the norms and the residual stream do not, unless sequence parallel
    sp = _parts(_inputs(tp_size=2, sequence_parallel=True))
    assert one["activations"] > tp2["activations"] > sp["activations"]
    assert tp2["activations"] > one["activations"] / 2  # the whole norms keep it above half
    # by hand, per token in fp32 on a rank of 2 heads (q 32 wide) and 1 KV head (16): each norm its input, normalised
    # value and output (12h; with sequence parallel the first two halve: 8h); q, k, v, the attention output and the
    # log-sum-exp; gate, up, activation and product of a 64-wide MLP slice; the final norm and the token ids
    attention, mlp = (2 * 32 + 2 * 16) * 4 + 4 * 2, 4 * (f // 2) * 4
    tokens = 4 * 32
    assert tp2["activations"] == tokens * (layers * (2 * 12 * h + attention + mlp) + 12 * h + 8)
    assert sp["activations"] == tokens * (layers * (2 * 8 * h + attention + mlp) + 8 * h + 8)
    assert one["logits and loss"] == tp2["logits and loss"] == sp["logits and loss"]  # lm_head and the loss whole


def test_pipeline_stages_by_hand_and_in_flight_microbatches_by_schedule():
    h, vocab = 64, 96
    two = _inputs(pp_size=2, micro_batch=4)
    ranks = [rank_shape(two, SHAPE, r, n) for r, n in enumerate(rank_layers(two, 4))]
    assert [r.num_params for r in ranks] == [vocab * h + 2 * SHAPE.layer_params, 2 * SHAPE.layer_params + vocab * h + h]
    assert rank_layers(_inputs(pp_size=2, pp_schedule="interleaved_1f1b"), 4) == [2, 2]  # stages 0+2 and 1+3
    # in flight at the peak: gpipe all n, 1f1b p - r, interleaved its warm-up + 1 chunks of half the rank's layers
    n8 = {"pp_size": 2, "pp_microbatches": 8, "micro_batch": 8}
    assert [in_flight(_inputs(**n8, pp_schedule="gpipe"), r) for r in (0, 1)] == [8, 8]
    assert [in_flight(_inputs(**n8, pp_schedule="1f1b"), r) for r in (0, 1)] == [2, 1]
    # interleaved, by hand: 8 // max(1, 8 // 2) = 2 per round, so 2 + 2 (1 - r) warm-up forwards, then one more:
    # 5 and 3 chunks of one of the rank's two stages
    assert [in_flight(_inputs(**n8, pp_schedule="interleaved_1f1b"), r) for r in (0, 1)] == [2.5, 1.5]
    acts = {s: trainer_memory(_inputs(**n8, pp_schedule=s), SHAPE) for s in ("gpipe", "1f1b", "interleaved_1f1b")}
    whole = trainer_memory(_inputs(micro_batch=8, gpus_per_node=1), SHAPE)
    assert acts["gpipe"].activations > acts["interleaved_1f1b"].activations > acts["1f1b"].activations
    assert acts["1f1b"].activations < whole.activations / 4  # half the layers, 2 of 8 microbatches
    # the busiest rank is reported, with every rank's total beside it
    for memory in acts.values():
        assert memory.total == max(memory.rank_totals) and memory.rank_totals[memory.pp_rank] == memory.total
    # the last rank has the loss, the first none; more microbatches under 1F1B hold less
    fewer = trainer_memory(_inputs(pp_size=2, pp_microbatches=2, micro_batch=8), SHAPE)
    assert fewer.activations > acts["1f1b"].activations


def test_tp_and_pp_combine_with_fsdp_over_the_remaining_replicas():
    deep = ModelShape.from_hf({**HF, "num_hidden_layers": 8})  # 4 layers a stage: more than FSDP2 gathers at once
    base = _inputs(gpus_per_node=8, tp_size=2, pp_size=2, strategy="fsdp", micro_batch=4)
    assert (base.dp_size, base.shard_group) == (2, 2)
    sharded = trainer_memory(base, deep)
    stage2 = trainer_memory(replace(base, zero_stage=2), deep)
    offload = trainer_memory(replace(base, zero_stage=3, cpu_offload=True), deep)
    assert stage2.get("gathered units") > sharded.get("gathered units")  # stage 2 keeps its layers gathered
    assert offload.get("weights") == 0 and offload.host_bytes > 0
    rank = rank_shape(base, deep, sharded.pp_rank, rank_layers(base, 8)[sharded.pp_rank])
    assert sharded.get("weights") == -(-rank.num_params * 4 // 2)  # the rank's params, fp32, over dp = 2


def test_what_the_engine_refuses_is_refused_here_by_name():
    with pytest.raises(MemoryInputError, match=r"tp_size = 3 does not divide the model's attention heads \(4\)"):
        trainer_memory(_inputs(gpus_per_node=3, tp_size=3), SHAPE)
    with pytest.raises(MemoryInputError, match=r"pp_size = 2 with tied embeddings"):
        trainer_memory(_inputs(pp_size=2), replace(SHAPE, tied=True))
    with pytest.raises(MemoryInputError, match=r"4 layers cannot fill 6 pipeline stages"):
        trainer_memory(_inputs(gpus_per_node=3, pp_size=3, pp_schedule="interleaved_1f1b"), SHAPE)
    with pytest.raises(MemoryInputError, match=r"tp × pp must divide the 2 GPUs"):
        _inputs(tp_size=2, pp_size=2)
    with pytest.raises(MemoryInputError, match=r"no LoRA"):
        _inputs(tp_size=2, lora_rank=8)
    with pytest.raises(MemoryInputError, match=r"strategy 'zero2'"):
        _inputs(pp_size=2, strategy="zero2")


def test_config_reaches_the_estimate_and_the_report_names_the_busiest_rank():
    cfg = Config.model_validate({
        "model": {"hidden_size": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
                  "tie_embeddings": False},
        "distributed": {"nproc_per_node": 4, "tp_size": 2, "pp_size": 2, "sequence_parallel": True,
                        "pp_schedule": "gpipe"},
    })  # fmt: skip
    inputs = inputs_from_config(cfg)
    assert (inputs.tp_size, inputs.pp_size, inputs.sequence_parallel, inputs.pp_schedule) == (2, 2, True, "gpipe")
    assert inputs.strategy == "none"  # dp = 1: nothing to replicate over
    report = estimate(inputs)
    assert not any("not modelled" in n for n in report.notes)
    assert any(n.startswith("tp_size = 2: q/k/v/o and gate/up/down") for n in report.notes)
    assert any(f"figures for pipeline rank {report.trainer.pp_rank}, the busiest" in n for n in report.notes)
    assert report.stages == [] and report.to_dict()["trainer"]["rank_totals"] == report.trainer.rank_totals
    # preflight's fit check reads the same figures
    from prime_train.validator.model_shape import model_shape
    from prime_train.validator.preflight import estimate_memory

    hf, _ = model_shape(cfg)
    fit = estimate_memory(cfg, hf, on_gpu=True)
    assert fit["activation_bytes"] == report.trainer.activations and fit["strategy"] == "none"


def test_memory_command_takes_the_parallel_flags_and_refuses_a_bad_split_with_78():
    from typer.testing import CliRunner

    from prime_train.cli import app

    llama = str(Path(__file__).parent / "data" / "model_configs" / "Llama-3.1-8B")
    args = ["memory", "--model", llama, "--gpus-per-node", "8", "--strategy", "fsdp", "--gpu", "H100"]
    flat = CliRunner().invoke(app, [*args, "--json"], env={"NO_COLOR": "1"})
    split = CliRunner().invoke(app, [*args, "--tp-size", "2", "--pp-size", "2", "--pp-schedule", "gpipe", "--json"])
    assert flat.exit_code == split.exit_code == 0, split.output
    one, both = json.loads(flat.stdout)["trainer"], json.loads(split.stdout)["trainer"]
    assert len(both["rank_totals"]) == 2 and both["total_bytes"] == max(both["rank_totals"])
    assert both["shard_group"] == 2 and one["shard_group"] == 8 and "rank_totals" not in one
    refused = CliRunner().invoke(app, [*args, "--tp-size", "3"])
    assert refused.exit_code == 78 and "tp × pp must divide the 8 GPUs" in refused.output
    # no --strategy: what the engine's 'auto' runs on the 2 x 2 x 2 mesh, FSDP2 over the two replicas of each
    # tensor-parallel stage (not 'none', which the engine refuses there)
    unset = [a for a in args if a not in ("--strategy", "fsdp")]
    auto, fsdp = (
        CliRunner().invoke(app, [*flags, "--tp-size", "2", "--pp-size", "2", "--json"]) for flags in (unset, args)
    )
    assert auto.exit_code == 0, auto.output
    report = json.loads(auto.stdout)
    assert report["settings"]["strategy"] == "fsdp" and report["trainer"]["shard_group"] == 2
    assert len(report["trainer"]["rank_totals"]) == 2 and report["trainer"] == json.loads(fsdp.stdout)["trainer"]


# ---------------------------------------------------------------- against the real split


@pytest.mark.slow  # 25 s on two loaded cores, most of it torchrun starting two interpreters
def test_each_ranks_parameters_are_what_the_real_split_holds(tmp_path):
    from transformers import LlamaConfig

    from prime_train.engine.llama import from_config
    from prime_train.engine.pipeline import StageModule, split_layers

    # pipeline stages, as engine/pipeline.py cuts them (no process group needed to build one)
    full = from_config(LlamaConfig(**HF), seed=0)
    pp2 = _inputs(pp_size=2)
    for rank, ids in enumerate(split_layers(4, 2)):
        stage = StageModule(full, list(ids), first=rank == 0, last=rank == 1)
        assert sum(p.numel() for p in stage.parameters()) == rank_shape(pp2, SHAPE, rank, len(ids)).num_params
    # tensor parallel: two gloo ranks apply the engine's plan; each counts its local shards
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__, str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    counts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    expected = rank_shape(_inputs(tp_size=2), SHAPE, 0, 4).num_params
    assert counts[0] == counts[1] == expected
    assert expected < SHAPE.num_params  # it did split


def _count_local_shards(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from transformers import LlamaConfig

    from prime_train.engine.llama import from_config
    from prime_train.engine.parallel import destroy_distributed
    from prime_train.engine.tensor_parallel import apply_tp

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    model = from_config(LlamaConfig(**HF), seed=0)
    apply_tp(model, mesh)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(local))
    del model, mesh  # DTensors outliving their group abort the exit (see parallel.destroy_distributed)
    destroy_distributed()


if __name__ == "__main__":
    _count_local_shards(sys.argv[1])
