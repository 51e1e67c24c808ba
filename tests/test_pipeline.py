"""Pipeline parallelism (distributed.pp_size): the stage split, lint's and the engine's refusals, and the correctness
harness: two gloo ranks running the CLI's `train` under torchrun give the one-process run's losses, gradient norms,
held-out losses and exported weights for every schedule, and resume after kill -9 (or across pp_size) as if never
stopped; so do four (replicated or FSDP-sharded pipelines, tensor-parallel stages) and eight (the 3-D mesh).

Tolerances (fp32 on the CPU): losses and eval losses within 1e-6 relative (measured: equal to the last bit; only the
order of float sums differs from one process), gradient norms within 1e-5 (the norm is summed per stage first),
weights after 8 steps within 1e-5 absolute.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess

import pytest
import torch
from enginetools import (
    TINY,
    cli,
    final_weights,
    kill_everything_once,
    losses_by_step,
    metrics,
    run_train,
    start,
    tiny_overrides,
)
from transformers import LlamaConfig

from prime_train.config.loader import load_config
from prime_train.config.schema import Config
from prime_train.engine import llama, pipeline
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.pipeline import StageModule, check_pipeline_config, split_layers
from prime_train.validator.lint import lint_files
from prime_train.validator.pipeline_checks import layer_split

# rank 0's line: its stage holds the embedding
FSDP_STAGE = r"Applied FSDP to the stage of (?:layers \d+-\d+|layer \d+) and the embedding"

STEPS = 8
# 4 layers: two stages of two (1f1b, gpipe) or four of one (interleaved); untied, since lm_head and the embedding
# sit on different stages
SHAPE = {"model.num_layers": 4, "model.tie_embeddings": "false", "train.max_steps": STEPS, "ckpt.interval": 4,
         "train.eval_interval": 4, "logging.log_interval": 1, "data.datasets.0.num_examples": 2000}  # fmt: skip
PP2 = {"distributed.nproc_per_node": 2, "distributed.pp_size": 2}
SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b"]
# the kill test's runs: long enough that the kill after the first checkpoint lands well before the end (8 steps left,
# as the other kill tests leave 5 of 10)
LONG = {**PP2, "train.max_steps": 12}
# two pipelines of two stages, each stage sharded by FSDP2 over its two replicas (a ("dp", "pp") mesh): ZeRO stage 2
# with two micro-batches a step (gradients reduce-scattered after each), stage 3 with CPU offload under GPipe, and
# interleaved 1F1B (two stages a rank, each its own FSDP2 root over the same two replicas; stage 3, the default, with
# two micro-batches a step)
PP_FSDP = {**PP2, "distributed.nproc_per_node": 4, "distributed.strategy": "fsdp"}
# one pipeline of four stages (interleaved: two a rank), each tensor-parallel over two ranks with sequence-parallel
# norms (a ("dp", "pp", "tp") mesh of 1 x 2 x 2: the stages hand over their rank's shard of the sequence)
PP_TP = {**PP2, "distributed.nproc_per_node": 4, "distributed.tp_size": 2, "distributed.sequence_parallel": "true",
         "distributed.pp_schedule": "interleaved_1f1b"}  # fmt: skip
# the 3-D mesh, 2 x 2 x 2: two pipelines of two tensor-parallel stages (1F1B), each stage sharded by FSDP2 over its
# two replicas; four steps (all in the warm-up, so at the one-process run's learning rates), a checkpoint every two
MESH_3D = {**PP_TP, "distributed.nproc_per_node": 8, "distributed.pp_schedule": "1f1b",
           "distributed.sequence_parallel": "false", "train.max_steps": 4, "ckpt.interval": 2}  # fmt: skip
FSDP_RUNS = {
    "pp-fsdp-zero2": {**PP_FSDP, "distributed.zero_stage": 2, "train.micro_batch_size": 8},
    "pp-fsdp-zero3-offload": {**PP_FSDP, "distributed.zero_stage": 3, "distributed.cpu_offload": "true",
                              "distributed.pp_schedule": "gpipe"},
    "pp-fsdp-interleaved": {**PP_FSDP, "distributed.pp_schedule": "interleaved_1f1b", "train.micro_batch_size": 8},
}  # fmt: skip


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def _by_step(run_dir, key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in metrics(run_dir) if key in r and r["step"] > 0}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs of this module by name, each trained once: 'single' (one process), 'pp-<schedule>' (PP=2) and
    'pp-dp' (4 processes: two pipelines of two stages)."""
    root = tmp_path_factory.mktemp("pipeline")
    done: dict[str, object] = {}

    def get(name: str):
        if name not in done:
            extra = {} if name == "single" else {**PP2, "distributed.pp_schedule": name.removeprefix("pp-")}
            if name == "pp-dp":
                extra = {**PP2, "distributed.nproc_per_node": 4}
            if name in FSDP_RUNS:
                extra = FSDP_RUNS[name]
            if name == "pp-tp":
                extra = PP_TP
            if name == "pp-long":
                extra = LONG
            _ok(run_train(root, name, **{**SHAPE, **extra}))
            done[name] = root / name
        return done[name]

    get.root = root
    return get


# ---------------------------------------------------------------- the split, without processes


def test_layers_split_contiguously_with_the_earlier_stages_one_longer():
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert split_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert split_layers(7, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 7)]
    for layers, stages in [(4, 2), (5, 2), (7, 4), (30, 8)]:  # what lint tells the user is what the engine does
        assert layer_split(layers, stages) == [len(r) for r in split_layers(layers, stages)]
    with pytest.raises(ValueError):
        split_layers(3, 4)


# torch before 2.13 fails in its pipelining on these stages; the engine refuses it (test below), so the runs skip
OLD_TORCH = pytest.mark.skipif(
    pipeline.torch_minor() < pipeline.MIN_TORCH, reason=f"pipelines need torch >= 2.13, this is {torch.__version__}"
)


def _native(tie: bool = False, layers: int = 4):
    config = LlamaConfig(hidden_size=32, num_hidden_layers=layers, vocab_size=64, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
                         tie_word_embeddings=tie)  # fmt: skip
    return llama.from_config(config, seed=0).eval()


def test_stages_in_a_chain_compute_the_whole_model_and_keep_its_parameter_names():
    full = _native()
    first = StageModule(full, [0, 1], first=True, last=False)
    last = StageModule(full, [2, 3], first=False, last=True)
    names = [*first.state_dict(), *last.state_dict()]
    assert sorted(names) == sorted(full.state_dict())  # disjoint slices of the HF state dict, nothing renamed
    assert "model.layers.2.mlp.up_proj.weight" in last.state_dict() and "lm_head.weight" not in first.state_dict()
    ids = torch.randint(0, 64, (2, 12))
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])  # a packed row, a plain one
    with torch.no_grad():
        chained = last(first(ids, positions), positions)
        torch.testing.assert_close(chained, full.hidden_states(ids, positions), rtol=0, atol=0)


def test_an_interleaved_ranks_stages_share_the_parameters_of_its_part():
    full = _native()
    part = StageModule(full, [0, 2], first=True, last=False)  # rank 0 of 2 under interleaving: stages 0 and 2
    stage0, stage2 = StageModule(part, [0], first=True, last=False), StageModule(part, [2], first=False, last=False)
    assert stage0.model.layers["0"] is part.model.layers["0"] is full.model.layers[0]
    assert stage2.model.layers["2"] is part.model.layers["2"] and stage2.model.embed_tokens is None
    assert sorted(part.state_dict()) == sorted({**stage0.state_dict(), **stage2.state_dict()})


def _cfg(distributed: dict | None = None, **sections) -> Config:
    return Config.model_validate(
        {"distributed": {"nproc_per_node": 2, "pp_size": 2, **(distributed or {})}, **sections}
    )


def test_a_torch_older_than_2_13_is_refused_naming_the_version(monkeypatch):
    monkeypatch.setattr(pipeline, "torch_minor", lambda: (2, 11))
    with pytest.raises(EngineConfigError, match=r"distributed\.pp_size = 2 needs torch 2\.13 or newer"):
        check_pipeline_config(_cfg(model={"tie_embeddings": False}), _native(), strategy="none")


def test_engine_refuses_tied_embeddings_lora_compile_and_too_few_layers_naming_the_key(monkeypatch):
    monkeypatch.setattr(pipeline, "torch_minor", lambda: pipeline.MIN_TORCH)  # the config's checks, on any torch
    check_pipeline_config(_cfg(), _native())  # the supported case passes
    cases = [
        (_cfg(), _native(tie=True), "model.tie_embeddings = false"),
        (_cfg({"pp_schedule": "interleaved_1f1b"}), _native(layers=3), "needs 4 stages"),
        (_cfg(lora={"rank": 8}), _native(), "lora.rank = 0"),
        (_cfg(train={"compile": True}), _native(), "train.compile"),
        (
            _cfg({"pp_microbatches": 3}, train={"micro_batch_size": 4, "global_batch_size": 8}),
            _native(),
            "distributed.pp_microbatches (3)",
        ),
    ]
    for cfg, model, expected in cases:
        with pytest.raises(EngineConfigError, match=r"distributed\.pp|train\.micro_batch_size") as caught:
            check_pipeline_config(cfg, model)
        assert expected in str(caught.value), str(caught.value)
    check_pipeline_config(_cfg(), _native(), strategy="fsdp")  # each stage sharded over its replicas
    with pytest.raises(EngineConfigError, match=r"distributed\.strategy = 'hsdp' across pipelines .*\('fsdp'\)"):
        check_pipeline_config(_cfg(), _native(), strategy="hsdp")
    check_pipeline_config(_cfg({"pp_schedule": "interleaved_1f1b"}), _native(), strategy="fsdp")  # a root per stage


def test_lint_refuses_pipelines_for_other_jobs_hf_models_lora_compile_and_hsdp():
    pipeline = ["--distributed.nproc_per_node", "4", "--distributed.pp_size", "2", "--model.tie_embeddings", "false",
                "--model.num_layers", "4"]  # fmt: skip
    # four processes: two pipelines of two stages, replicated by DDP, each reading half of the global batch
    clean, _ = lint_files([str(TINY)], pipeline)
    assert [p.format() for p in clean if p.severity == "error"] == []
    sharded, _ = lint_files([str(TINY)], [*pipeline, "--distributed.strategy", "fsdp", "--distributed.zero_stage", "2"])
    assert [p.format() for p in sharded if p.severity == "error"] == []  # FSDP2 on each stage over its replicas
    unsupported = ["--model.implementation", "hf", "--train.compile", "true", "--lora.rank", "8",
                   "--distributed.strategy", "hsdp"]  # fmt: skip
    problems, _ = lint_files([str(TINY)], [*pipeline, *unsupported])
    errors = {p.key: p.message for p in problems if p.severity == "error"}
    assert "model.implementation = 'native'" in errors["model.implementation"]
    assert "LoRA does not run" in errors["lora.rank"]
    assert "not supported with distributed.pp_size" in errors["train.compile"]
    assert "or each stage is sharded over its replicas ('fsdp')" in errors["distributed.strategy"]
    job, _ = lint_files([str(TINY)], [*pipeline, "--run.job", "dpo"])
    assert any("run.job = 'dpo' does not run in a pipeline" in p.message for p in job)


def test_pipelines_refuse_what_they_do_not_combine_with_in_lint_and_the_engine():
    pipeline = ["--distributed.nproc_per_node", "4", "--distributed.pp_size", "2", "--model.tie_embeddings", "false",
                "--model.num_layers", "4"]  # fmt: skip
    each = {
        "train.precision": ["--train.precision", "fp16"],
        "train.float8": ["--train.float8", "true"],
        "distributed.grad_compression": ["--distributed.grad_compression", "bf16"],
    }
    for key, flags in each.items():
        problems, _ = lint_files([str(TINY)], [*pipeline, *flags])
        # (the key may carry other problems too: float8 without torchao installed, say)
        mine = [p for p in problems if p.severity == "error" and p.key == key and "pp_size = 2" in p.message]
        assert mine, (key, [p.format() for p in problems])
        cfg = load_config([str(TINY)], [*pipeline, *flags])
        with pytest.raises(EngineConfigError, match=r"pp_size = 2"):
            check_pipeline_config(cfg, _native(), strategy="ddp")


def test_replicas_of_a_tensor_parallel_pipeline_pass_lint_and_the_engine_when_the_processes_fill_them(monkeypatch):
    monkeypatch.setattr(pipeline, "torch_minor", lambda: pipeline.MIN_TORCH)  # the config's checks, on any torch
    mesh = ["--distributed.pp_size", "2", "--distributed.tp_size", "2", "--model.tie_embeddings", "false",
            "--model.num_layers", "4"]  # fmt: skip
    # 8 processes: two pipelines of two tensor-parallel stages, FSDP2 over the replicas ('auto' beside TP)
    clean, _ = lint_files([str(TINY)], [*mesh, "--distributed.nproc_per_node", "8"])
    assert [p.format() for p in clean if p.severity == "error"] == []
    check_pipeline_config(load_config([str(TINY)], [*mesh, "--distributed.nproc_per_node", "8"]), _native(), "fsdp")
    # the interleaved schedule too: one pipeline of tensor-parallel stages, or FSDP-sharded replicas of it
    interleaved = [*mesh, "--distributed.pp_schedule", "interleaved_1f1b", "--distributed.nproc_per_node"]
    for processes in ("4", "8"):
        problems, _ = lint_files([str(TINY)], [*interleaved, processes])
        assert [p.format() for p in problems if p.severity == "error"] == [], processes
    # 6 processes make one pipeline of 2 x 2 and half of another
    problems, _ = lint_files([str(TINY)], [*mesh, "--distributed.nproc_per_node", "6"])
    errors = {p.key: p.message for p in problems if p.severity == "error"}
    assert (
        "distributed.pp_size (2) x distributed.tp_size (2) does not divide the 6 processes"
        in errors["distributed.pp_size"]
    ), errors


def test_one_f_one_b_needs_as_many_microbatches_as_stages_in_lint(tmp_path):
    args = ["--distributed.nproc_per_node", "2", "--distributed.pp_size", "2", "--model.tie_embeddings", "false",
            "--distributed.pp_microbatches", "1"]  # fmt: skip
    problems, _ = lint_files([str(TINY)], args)
    assert any("1F1B needs at least as many microbatches" in p.message for p in problems)
    gpipe, _ = lint_files([str(TINY)], [*args, "--distributed.pp_schedule", "gpipe"])
    assert [p.format() for p in gpipe if p.severity == "error"] == []


# ---------------------------------------------------------------- the harness: real torchrun, gloo, the CLI


def _assert_same_metrics(single, piped, rel_tol: dict[str, float], steps: range | None = None) -> None:
    """The two runs logged the same steps (of `steps` only, when given) of each metric in `rel_tol`, equal within its
    tolerance."""
    for key, rel in rel_tol.items():
        a, b = _by_step(single, key), _by_step(piped, key)
        a = a if steps is None else {s: v for s, v in a.items() if s in steps}
        assert sorted(a) == sorted(b) and a, (key, a, b)
        for step in a:
            assert math.isclose(a[step], b[step], rel_tol=rel), (key, step, a[step], b[step])


def _assert_same_training(single, piped, rel_tol: dict[str, float]) -> None:
    """_assert_same_metrics, and the two runs ended with the same weights (atol 1e-5)."""
    _assert_same_metrics(single, piped, rel_tol)
    wa, wb = final_weights(single), final_weights(piped)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=0, atol=1e-5)


@pytest.mark.slow
@OLD_TORCH
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_stage_pipeline_matches_one_process_run(runs, schedule):
    single, piped = runs("single"), runs(f"pp-{schedule}")
    _assert_same_training(single, piped, {"loss": 1e-6, "grad_norm": 1e-5, "eval_loss": 1e-6})
    assert sorted(_by_step(piped, "loss")) == list(range(1, STEPS + 1))


@pytest.mark.slow
@OLD_TORCH
def test_two_pipelines_of_two_stages_match_one_process_run(runs):
    # 4 gloo ranks on a ("dp", "pp") mesh: each pipeline reads half of the global batch, gradients averaged per step
    single, piped = runs("single"), runs("pp-dp")
    # measured: within 3e-7 (the data-parallel split sums in another order)
    _assert_same_training(single, piped, {"loss": 1e-5, "grad_norm": 1e-5, "eval_loss": 1e-5})


@pytest.mark.slow
@OLD_TORCH
@pytest.mark.parametrize("name", list(FSDP_RUNS))
def test_pipelines_whose_stages_fsdp_shards_match_one_process_run(runs, name):
    single, piped = runs("single"), runs(name)
    # measured: losses within 1e-7, gradient norms 3.1e-7, weights 3.7e-7 (reduce-scatter sums in another order)
    _assert_same_training(single, piped, {"loss": 1e-5, "grad_norm": 1e-5, "eval_loss": 1e-5})


def _kill_then_resume(root, name: str, overrides: dict, at_step: int) -> tuple[list, str]:
    """Train run `name`, kill -9 the CLI and every rank at once when its checkpoint step-`at_step` is whole (the run
    must not have finished), then resume it to the end; the processes killed and the resumed run's log."""
    proc = start(cli("train", str(TINY), *tiny_overrides(root, name, **overrides)))
    # the CLI, torchrun and the ranks at once: no rank lives on to notice its parent gone and save on its way out
    tree = kill_everything_once(proc, root / name / "checkpoints" / f"step-{at_step}")
    assert proc.returncode == -signal.SIGKILL
    assert not (root / name / "final").exists()  # it died mid-run
    resumed = run_train(root, name, **overrides)
    _ok(resumed)
    return tree, resumed.stdout + resumed.stderr


@pytest.mark.slow
@OLD_TORCH
def test_pipeline_with_fsdp_resume_after_kill_matches_uninterrupted_run(runs):
    name, straight = "pp-fsdp-zero2", runs("pp-fsdp-zero2")
    _, log = _kill_then_resume(runs.root, "fsdp-killed", {**SHAPE, **FSDP_RUNS[name]}, at_step=4)
    assert "at step 4" in log
    assert re.search(rf"{FSDP_STAGE} over mesh\['dp'\] \(2 replicas\); ZeRO stage 2", log), log[-3000:]
    a, b = losses_by_step(straight), losses_by_step(runs.root / "fsdp-killed")
    assert sorted(b) == list(range(1, STEPS + 1))
    for step in range(5, STEPS + 1):
        assert a[step] == b[step], (step, a[step], b[step])  # the same ranks, the same order of sums: bitwise


@pytest.mark.slow
@OLD_TORCH
def test_a_pipeline_of_tensor_parallel_stages_matches_one_process_and_resumes_from_its_checkpoint(runs):
    single, piped, root = runs("single"), runs("pp-tp"), runs.root
    # measured (interleaved, sequence parallel): losses within 1.1e-7, gradient norms 1.9e-7, eval losses equal,
    # final weights within 1.4e-6
    _assert_same_training(single, piped, {"loss": 1e-5, "grad_norm": 1e-5, "eval_loss": 1e-5})
    # its DCP checkpoint, resumed in the same layout (the rest bitwise) and in one process (the whole model is in it)
    resume = {"ckpt.resume": str(piped / "checkpoints" / "step-4")}
    resumed = run_train(root, "pp-tp-resumed", **SHAPE, **PP_TP, **resume)
    _ok(resumed)
    assert "sequence-parallel norms" in resumed.stdout + resumed.stderr
    assert "4 stages over 2 ranks x 1 replica(s) (interleaved_1f1b" in resumed.stdout + resumed.stderr
    _ok(run_train(root, "pp-tp-to-1", **SHAPE, **resume))
    a, b, c = losses_by_step(piped), losses_by_step(root / "pp-tp-resumed"), losses_by_step(root / "pp-tp-to-1")
    assert sorted(b) == sorted(c) == list(range(5, STEPS + 1))
    one = losses_by_step(single)
    for step in range(5, STEPS + 1):
        assert a[step] == b[step], (step, a[step], b[step])
        assert math.isclose(one[step], c[step], rel_tol=1e-5), (step, one[step], c[step])


def _model_keys(run_dir, step: int) -> set[str]:
    """The model entries of a run's DCP checkpoint (the full model's HF names under "model.")."""
    from prime_train.engine import safe_dcp

    keys = safe_dcp.read_metadata(run_dir / "checkpoints" / f"step-{step}").state_dict_metadata
    return {k for k in keys if k.startswith("model.")}


def _checkpoint_weights(run_dir, step: int, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The weights a run's DCP checkpoint holds, read into tensors shaped and named as `like`'s (an HF export)."""
    from prime_train.engine import safe_dcp

    state = {"model": {k: torch.empty_like(v) for k, v in like.items()}}
    safe_dcp.load(state, run_dir / "checkpoints" / f"step-{step}", no_dist=True)
    return state["model"]


@pytest.mark.slow
@OLD_TORCH
def test_replicated_pipelines_of_tensor_parallel_stages_match_one_process_run_through_a_kill(runs):
    # 8 gloo ranks on a ("dp", "pp", "tp") mesh of 2 x 2 x 2, in one run: killed with kill -9 once its step-2
    # checkpoint is whole and resumed, so steps 1-2 are the first attempt's and 3-4 the resumed one's
    single, root = runs("single"), runs.root
    _, log = _kill_then_resume(root, "mesh-3d", {**SHAPE, **MESH_3D}, at_step=2)
    assert re.search(r"resumed from \S+step-2 at step 2", log), log[-3000:]
    assert "Applied tensor parallelism over 2 ranks" in log
    assert re.search(rf"{FSDP_STAGE} over mesh\['dp'\] \(2 replicas\)", log), log[-3000:]
    assert "2 stages over 2 ranks x 2 replica(s)" in log
    # measured: the four losses equal to one process's, gradient norms within 1.1e-7, the eval loss 5e-8
    _assert_same_metrics(single, root / "mesh-3d", {"loss": 1e-5, "grad_norm": 1e-5, "eval_loss": 1e-5}, range(1, 5))
    # one DCP checkpoint holds every stage's and tp rank's part under the full model's names, and the export
    # gathers the whole model: the one-process run's weights at the same step
    assert _model_keys(root / "mesh-3d", 4) == _model_keys(single, 4)
    exported = final_weights(root / "mesh-3d")
    at_step_4 = _checkpoint_weights(single, 4, exported)
    for key, value in exported.items():  # measured: within 2.7e-6
        torch.testing.assert_close(value, at_step_4[key], rtol=0, atol=1e-5)


@pytest.mark.slow
@OLD_TORCH
def test_pipeline_checkpoint_holds_the_whole_model_and_its_export_loads_in_transformers(runs):
    from transformers import AutoModelForCausalLM

    single, piped = runs("single"), runs("pp-1f1b")
    assert _model_keys(single, 4) == _model_keys(piped, 4) and "model.lm_head.weight" in _model_keys(piped, 4)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    logits = [AutoModelForCausalLM.from_pretrained(run / "final").eval()(ids).logits for run in (single, piped)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-4)


@pytest.mark.slow
@OLD_TORCH
def test_pipeline_resume_after_kill_matches_uninterrupted_run(runs):
    straight = runs("pp-long")
    root = runs.root
    tree, log = _kill_then_resume(root, "killed", {**SHAPE, **LONG}, at_step=4)
    assert len(tree) >= 4, tree  # the CLI, torchrun and both ranks
    start_step = int(re.search(r"resumed from \S+step-(\d+) at step", log).group(1))
    a, b = losses_by_step(straight), losses_by_step(root / "killed")
    assert sorted(b) == list(range(1, LONG["train.max_steps"] + 1))
    for step in range(start_step + 1, LONG["train.max_steps"] + 1):
        assert a[step] == b[step], (step, a[step], b[step])  # the same ranks, the same order of sums: bitwise
    wa, wb = final_weights(straight), final_weights(root / "killed")
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.mark.slow
@OLD_TORCH
def test_checkpoints_move_between_one_process_and_a_two_stage_pipeline(runs):
    single, piped, root = runs("single"), runs("pp-1f1b"), runs.root
    # a one-process checkpoint resumed by a pipeline, and a pipeline's by one process
    for name, source, extra in (("into-pp", single, PP2), ("out-of-pp", piped, {})):
        resume = {"ckpt.resume": str(source / "checkpoints" / "step-4")}
        _ok(run_train(root, name, **SHAPE, **extra, **resume))
        a, b = losses_by_step(single), losses_by_step(root / name)
        assert sorted(b) == list(range(5, STEPS + 1)), (name, b)
        for step in b:
            assert math.isclose(a[step], b[step], rel_tol=1e-6), (name, step, a[step], b[step])
        lr_a, lr_b = _by_step(single, "lr"), _by_step(root / name, "lr")
        assert all(lr_a[s] == lr_b[s] for s in b), (name, lr_a, lr_b)


def test_pipeline_of_the_wrong_size_is_a_config_error_at_start(tmp_path):
    # 3 processes cannot make pipelines of 2: lint says so before anything starts (exit 78 from the engine too)
    result = run_train(tmp_path, "bad", **SHAPE, **{"distributed.nproc_per_node": 3, "distributed.pp_size": 2})
    assert result.returncode != 0
    assert "does not divide the 3 processes" in result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert not os.path.exists(tmp_path / "bad" / "checkpoints")


def test_ranks_of_one_pipeline_are_one_data_parallel_replica():
    from prime_train.engine.parallel import DistInfo
    from prime_train.engine.pipeline import with_pipeline_ranks

    cpu = torch.device("cpu")
    ranks = [with_pipeline_ranks(DistInfo(r, r, 4, 4, cpu, "gloo"), 2) for r in range(4)]
    assert [(d.dp_rank, d.dp_size) for d in ranks] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    one = DistInfo(1, 1, 2, 2, cpu, "gloo")
    assert with_pipeline_ranks(one, 1) is one  # no pipeline: every rank its own replica
    with pytest.raises(
        EngineConfigError, match=r"distributed\.pp_size = 2 x distributed\.tp_size = 1 does not divide the 3 processes"
    ):
        with_pipeline_ranks(DistInfo(0, 0, 3, 3, cpu, "gloo"), 2)
