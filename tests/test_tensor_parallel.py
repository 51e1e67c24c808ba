"""Tensor parallelism (distributed.tp_size, engine/tensor_parallel.py) against the single-process run, in real
processes over gloo: the same losses step by step, resume across tp sizes, kill -9 and resume, the HF export.

Tolerance: fp32 on the CPU, a relative 1e-5 per step's loss (row-parallel matmuls sum their halves in another order
than one matmul does; the differences measured here were at most 2.2e-7 relative). The runs through the CLI take
20-45 s each on two CPU cores, hence slow.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from enginetools import (
    TINY,
    cli,
    final_weights,
    kill_group,
    losses_by_step,
    metrics,
    run_train,
    start,
    tiny_overrides,
    wait_for,
)

from prime_train.engine.tensor_parallel import SEQUENCE_PARALLEL_MIN_TORCH
from prime_train.engine.versions import torch_minor
from prime_train.validator.lint import lint_files

THIS_FILE = Path(__file__).resolve()
STEPS = {"train.max_steps": 10, "ckpt.interval": 5, "logging.log_interval": 1}
TP2 = {**STEPS, "distributed.nproc_per_node": 2, "distributed.tp_size": 2}

# sequence parallel needs torch >= 2.13; on older torch the engine refuses it (tested below)
OLD_TORCH_SP = pytest.mark.skipif(
    torch_minor() < SEQUENCE_PARALLEL_MIN_TORCH,
    reason=f"sequence parallel needs torch >= 2.13, this is {torch.__version__}",
)


def _ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def _assert_same_losses(a: dict[int, float], b: dict[int, float], steps) -> None:
    for step in steps:
        assert math.isclose(a[step], b[step], rel_tol=1e-5), (step, a[step], b[step])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process and TP=2 on two processes, ten steps each, checkpoints at 5 and 10."""
    root = tmp_path_factory.mktemp("tp")
    _ok(run_train(root, "one", **STEPS))
    _ok(run_train(root, "tp2", **TP2))
    return root


@pytest.mark.slow
def test_tp2_losses_and_weights_match_one_process(runs):
    one, tp2 = losses_by_step(runs / "one"), losses_by_step(runs / "tp2")
    assert sorted(one) == sorted(tp2) == list(range(1, 11))
    _assert_same_losses(one, tp2, range(1, 11))
    # the two ranks of the group read one batch: tokens and the batch are counted once, not twice
    rows = {r["step"]: r for r in metrics(runs / "one") if "tokens" in r}
    for row in metrics(runs / "tp2"):
        if "tokens" in row:
            assert row["tokens"] == rows[row["step"]]["tokens"] and row["global_batch"] == 32, row
    wa, wb = final_weights(runs / "one"), final_weights(runs / "tp2")
    assert wa.keys() == wb.keys()
    for key in wa:  # final/ holds whole tensors, gathered from the shards
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@OLD_TORCH_SP
def test_tp2_with_sequence_parallel_matches_one_process(runs):
    _ok(run_train(runs, "tp2-sp", **TP2, **{"distributed.sequence_parallel": "true"}))
    _assert_same_losses(losses_by_step(runs / "one"), losses_by_step(runs / "tp2-sp"), range(1, 11))


@pytest.mark.slow
def test_resume_across_tp_sizes_continues_the_uninterrupted_run(runs):
    one = losses_by_step(runs / "one")
    # saved at tp=2, resumed by one process; saved by one process, resumed at tp=2
    down = run_train(runs, "tp2-to-1", **STEPS, **{"ckpt.resume": str(runs / "tp2" / "checkpoints" / "step-5")})
    up = run_train(runs, "1-to-tp2", **TP2, **{"ckpt.resume": str(runs / "one" / "checkpoints" / "step-5")})
    for result, name in ((down, "tp2-to-1"), (up, "1-to-tp2")):
        _ok(result)
        assert "resumed from" in result.stdout + result.stderr
        resumed = losses_by_step(runs / name)
        assert sorted(resumed) == list(range(6, 11)), name
        _assert_same_losses(one, resumed, range(6, 11))


@pytest.mark.slow
def test_tp2_by_dp2_fsdp_on_four_processes_matches_one_process(runs):
    _ok(
        run_train(
            runs, "tp2-dp2", **STEPS,
            **{"distributed.nproc_per_node": 4, "distributed.tp_size": 2, "distributed.strategy": "fsdp"},
        )
    )  # fmt: skip
    _assert_same_losses(losses_by_step(runs / "one"), losses_by_step(runs / "tp2-dp2"), range(1, 11))
    tokens = {r["step"]: r["tokens"] for r in metrics(runs / "one") if "tokens" in r}
    assert all(r["tokens"] == tokens[r["step"]] for r in metrics(runs / "tp2-dp2") if "tokens" in r)


@pytest.mark.slow
def test_resume_after_kill_under_tp2_matches_uninterrupted_run(runs):
    proc = start(cli("train", str(TINY), *tiny_overrides(runs, "killed", **TP2)))
    try:
        wait_for((runs / "killed" / "checkpoints" / "step-5").is_dir, 300, "the step-5 checkpoint")
        # kill -9 everything at once, as a machine dies: the CLI with torchrun, then the ranks (torchrun starts each
        # in a session of its own), before they could notice their supervisor gone and save on their way out
        ranks = psutil.Process(proc.pid).children(recursive=True)
        kill_group(proc, signal.SIGKILL)
        for rank in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                rank.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_group(proc, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    assert not (runs / "killed" / "final").exists()  # killed before the end, or the resume proves nothing
    resumed = run_train(runs, "killed", **TP2)
    _ok(resumed)
    assert "at step 5" in resumed.stdout + resumed.stderr  # from step-5's checkpoint, with steps 6-10 to train
    a, b = losses_by_step(runs / "tp2"), losses_by_step(runs / "killed")
    for step in range(6, 11):
        assert a[step] == b[step], (step, a[step], b[step])  # bitwise on CPU, as without TP


# ---------------------------------------------------------------------- the plan itself, and the export


def test_sequence_parallel_on_a_torch_older_than_2_13_is_refused_naming_the_key(monkeypatch):
    from transformers import LlamaConfig

    from prime_train.config.schema import Config
    from prime_train.engine import tensor_parallel
    from prime_train.engine.llama import from_config
    from prime_train.engine.metrics import EngineConfigError

    monkeypatch.setattr(tensor_parallel, "torch_minor", lambda: (2, 11))
    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=64, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=64)  # fmt: skip
    cfg = Config.model_validate({"distributed": {"tp_size": 2, "sequence_parallel": True}})
    with pytest.raises(EngineConfigError, match=r"distributed\.sequence_parallel needs torch 2\.13"):
        tensor_parallel.check_supported(from_config(config, seed=0), cfg)
    cfg.distributed.sequence_parallel = False
    tensor_parallel.check_supported(from_config(config, seed=0), cfg)  # tensor parallel alone runs there


@OLD_TORCH_SP
def test_sequence_parallel_tied_gqa_model_trains_as_one_process_and_exports_its_own_logits(tmp_path):
    """Two ranks, sequence parallel, tied embeddings, grouped KV heads, packed rows; logits at a sequence length
    tp does not divide (greedy evaluation's case); final/ written from the DTensors loads in transformers."""
    from transformers import AutoModelForCausalLM

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(THIS_FILE)]
    proc = subprocess.run(
        [*cmd, str(tmp_path)], capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    expected = torch.load(tmp_path / "expected.pt")
    for ref, tp in expected["steps"]:  # (loss, gradient norm) of each step
        assert math.isclose(ref[0], tp[0], rel_tol=1e-5) and math.isclose(ref[1], tp[1], rel_tol=1e-5), (ref, tp)
    torch.testing.assert_close(expected["tp_logits"], expected["ref_logits"], rtol=1e-5, atol=1e-5)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    with torch.no_grad():
        hf_logits = exported(expected["ids"]).logits
    torch.testing.assert_close(hf_logits, expected["tp_logits"], rtol=1e-5, atol=1e-5)


def _worker(root: Path) -> None:
    import torch.distributed as dist
    from test_export import tiny_tokenizer
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig

    from prime_train.engine.export import export_hf
    from prime_train.engine.llama import from_config
    from prime_train.engine.tensor_parallel import apply_tp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = LlamaConfig(
        hidden_size=64, num_hidden_layers=2, vocab_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    ref, model = from_config(config, seed=0), from_config(config, seed=0)
    apply_tp(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)), sequence_parallel=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    torch.manual_seed(1)  # the same batches on both ranks, as a tensor-parallel group reads them
    steps = []
    for _ in range(3):
        ids = torch.randint(0, 64, (2, 16))
        positions = torch.arange(16).repeat(2, 1)
        positions[1, 9:] -= 9  # a second document packed into row 1
        step = []
        for m, optimizer in zip((ref, model), optimizers, strict=True):
            loss = m(ids, position_ids=positions, labels=ids).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1.0)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            optimizer.step()
            optimizer.zero_grad()
            step.append((loss.item(), norm.item()))
        steps.append(step)
    ids = torch.randint(0, 64, (2, 13))
    with torch.no_grad():
        tp_logits = model.eval()(ids, attention_mask=torch.ones_like(ids)).logits
        ref_logits = ref.eval()(ids, attention_mask=torch.ones_like(ids)).logits
    export_hf(model, tiny_tokenizer(), root / "final", rank=rank)
    if rank == 0:
        torch.save({"steps": steps, "ids": ids, "tp_logits": tp_logits, "ref_logits": ref_logits}, root / "expected.pt")


# ---------------------------------------------------------------------- refused before a launch


def _tp_lint(*overrides: str) -> list[tuple[str, str]]:
    problems, _ = lint_files([str(TINY)], ["--distributed.nproc_per_node", "2", "--distributed.tp_size", "2",
                                           *overrides])  # fmt: skip
    return [(p.key, p.message) for p in problems if p.severity == "error"]


def test_lint_accepts_tp2_on_the_tiny_config_and_names_each_refusal():
    assert _tp_lint() == []
    cases = {
        ("--model.num_kv_heads", "1"): ("distributed.tp_size", "model.num_kv_heads (1)"),
        ("--distributed.nproc_per_node", "3"): ("distributed.tp_size", "nproc_per_node = 3"),
        ("--run.job", "dpo"): ("distributed.tp_size", "run.job = 'dpo'"),
        ("--lora.rank", "8"): ("distributed.tp_size", "LoRA (lora.rank = 8)"),
        ("--model.implementation", "hf"): ("distributed.tp_size", "native decoder only"),
        ("--distributed.strategy", "hsdp"): ("distributed.strategy", "'hsdp'"),
    }
    for override, (key, words) in cases.items():
        errors = _tp_lint(*override)
        assert any(k == key and words in m for k, m in errors), (override, errors)
    # four processes: two tensor-parallel groups; DDP cannot reduce DTensor parameters, FSDP2 can
    four = ("--distributed.nproc_per_node", "4")
    assert any("'ddp'" in m for _, m in _tp_lint(*four, "--distributed.strategy", "ddp"))
    assert _tp_lint(*four, "--distributed.strategy", "fsdp") == []


def test_engine_refuses_tp_for_transformers_model_and_lora_with_the_key():
    from enginetools import tiny_llama

    from prime_train.config.schema import Config
    from prime_train.engine.metrics import EngineConfigError
    from prime_train.engine.model import _to_native
    from prime_train.engine.tensor_parallel import check_supported

    cfg = Config.model_validate({"distributed": {"tp_size": 2}})
    with pytest.raises(EngineConfigError, match=r"distributed.tp_size = 2 needs the engine's native decoder"):
        check_supported(tiny_llama(0), cfg)
    check_supported(_to_native(tiny_llama(0)), cfg)  # the native decoder of the same model is accepted
    with pytest.raises(EngineConfigError, match=r"num_key_value_heads \(1\)"):
        check_supported(_to_native(tiny_llama(0, num_key_value_heads=1)), cfg)
    lora = Config.model_validate({"distributed": {"tp_size": 2}, "lora": {"rank": 8}})
    with pytest.raises(EngineConfigError, match="with LoRA"):
        check_supported(_to_native(tiny_llama(0)), lora)


if __name__ == "__main__":
    from prime_train.engine.parallel import destroy_distributed

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    _worker(Path(sys.argv[1]))
    destroy_distributed()  # after the worker returned: its models must not outlive the group
