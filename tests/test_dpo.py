"""The DPO job (engine/dpo.py), end to end in real subprocesses: the loss types against hand-computed values;
configs/examples/tiny-dpo.toml raises the held-out preference accuracy of the 60-step tiny SFT model to >= 0.9 without
its SFT loss blowing up; the three references (a frozen copy, LoRA's adapters switched off, precomputed log-probs)
give the same losses; a run killed with -9 resumes from its checkpoint exactly."""

from __future__ import annotations

import math
import re
import signal
import subprocess

import pytest
import torch
from enginetools import (
    REPO,
    TINY,
    cli,
    env,
    final_weights,
    kill_group,
    losses_by_step,
    metrics,
    run_train,
    start,
    tiny_overrides,
    wait_for,
)

from prime_train.contract import read_json
from prime_train.engine.dpo import preference_loss
from prime_train.launch import JOB_MODULES
from prime_train.resilience.plan import ENGINE_PLANS, EnginePlan

TINY_DPO = REPO / "configs" / "examples" / "tiny-dpo.toml"
LN2 = math.log(2.0)


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


# ---------------------------------------------------------------- the loss


# two pairs: margins (policy - reference log-ratio of chosen over rejected) +1.5 and -1.5; beta 0.5 makes them ±0.75
POLICY = (torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -1.0]))
REFERENCE = (torch.tensor([-1.5, -1.5]), torch.tensor([-2.0, -2.0]))


@pytest.mark.parametrize(
    ("loss_type", "smoothing", "expected"),
    [
        ("sigmoid", 0.0, [0.3868710061149, 1.1368710061149]),  # log(1 + e^-0.75), log(1 + e^0.75)
        ("sigmoid", 0.1, [0.4618710061149, 1.0618710061149]),  # 0.9 · the above + 0.1 · the other's
        ("ipo", 0.0, [0.25, 6.25]),  # (1.5 - 1/(2·0.5))², (-1.5 - 1)²
        ("hinge", 0.0, [0.25, 1.75]),  # max(0, 1 - 0.75), max(0, 1 + 0.75)
    ],
)
def test_loss_types_against_hand_computed_values(loss_type, smoothing, expected):
    losses, r_chosen, r_rejected = preference_loss(
        *POLICY, *REFERENCE, beta=0.5, loss_type=loss_type, label_smoothing=smoothing
    )
    torch.testing.assert_close(losses, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    # implicit rewards: beta times each side's log-ratio to the reference
    torch.testing.assert_close(r_chosen, torch.tensor([0.25, -0.25]))
    torch.testing.assert_close(r_rejected, torch.tensor([-0.5, 0.5]))


def test_the_sigmoid_loss_pushes_chosen_up_and_rejected_down():
    chosen, rejected = (t.clone().requires_grad_(True) for t in POLICY)
    losses, *_ = preference_loss(chosen, rejected, *REFERENCE, beta=0.5)
    losses.sum().backward()
    assert (chosen.grad < 0).all() and (rejected.grad > 0).all()
    # d/dm of -log σ(βm) = -β σ(-βm): the pair ranked wrong (m = -1.5) pulls harder
    torch.testing.assert_close(chosen.grad, -0.5 * torch.sigmoid(torch.tensor([-0.75, 0.75])))


def test_dpo_is_a_registered_engine_job():
    assert JOB_MODULES["dpo"] == "prime_train.engine.dpo" and ENGINE_PLANS["dpo"] is EnginePlan


# ---------------------------------------------------------------- the example learns


@pytest.fixture(scope="module")
def tiny_dpo_run(tmp_path_factory, half_trained_sft_model):
    """configs/examples/tiny-dpo.toml as its comment runs it, from the 60-step tiny SFT model (about 45 s)."""
    out = tmp_path_factory.mktemp("tiny-dpo")
    result = subprocess.run(
        cli("train", str(TINY_DPO), "--model.path", str(half_trained_sft_model), "--run.output_dir", str(out),
            "--logging.tensorboard", "false"),
        env=env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, output(result)[-4000:]
    return out / "tiny-dpo", result


@pytest.mark.slow
def test_tiny_dpo_example_ranks_held_out_pairs_without_the_sft_loss_blowing_up(tiny_dpo_run):
    """Measured on a 2-core CPU: eval_preference_accuracy 0 (step 0: policy = reference) -> 0.95 at step 60, eval_loss
    on the chosen completions 1.62 -> 1.94, exact match 0.17 -> 0.22."""
    run_dir, _ = tiny_dpo_run
    evals = {r["step"]: r for r in metrics(run_dir) if "eval_preference_accuracy" in r}
    assert set(evals) == {0, 20, 40, 60}, evals
    assert evals[0]["eval_preference_accuracy"] == 0.0 and evals[0]["eval_preference_margin"] == 0.0
    assert evals[60]["eval_preference_accuracy"] >= 0.9, evals
    assert evals[60]["eval_preference_margin"] > 0.5, evals
    # the SFT loss of the held-out right answers may rise a little, not run away
    assert evals[60]["eval_loss"] < 1.5 * evals[0]["eval_loss"], evals
    assert "eval_exact_match" in evals[60]
    rows = {r["step"]: r for r in metrics(run_dir) if "reward_accuracy" in r}
    assert rows[1]["loss"] == pytest.approx(LN2, abs=1e-5)  # the policy is the reference at the first step
    late = [rows[s] for s in range(51, 61)]
    assert sum(r["reward_accuracy"] for r in late) / 10 > 0.8
    assert all(r["reward_margin"] == pytest.approx(r["rewards_chosen"] - r["rewards_rejected"], abs=1e-5) for r in late)
    assert sum(r["loss"] for r in late) / 10 < 0.9 * LN2


def test_tiny_dpo_example_lints_clean():
    result = subprocess.run(cli("lint", str(TINY_DPO)), env=env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "no problems" in result.stdout, output(result)


# ---------------------------------------------------------------- the references agree

SHORT = {"run.job": "dpo", "train.max_steps": 8, "train.eval_interval": 4, "logging.log_interval": 1,
         "ckpt.interval": 4, "data.datasets.0.num_examples": 400, "train.lr": 3e-3}  # fmt: skip
VARIANTS = {
    "held": {},
    "precomputed": {"dpo.precompute_reference": "true"},
    "lora-held": {"lora.rank": 16},
    "lora-precomputed": {"lora.rank": 16, "dpo.precompute_reference": "true"},
}


@pytest.fixture(scope="module")
def reference_runs(tmp_path_factory):
    """8 DPO steps of the random-initialised tiny default with each kind of reference (a few seconds each)."""
    out = tmp_path_factory.mktemp("references")
    results = {}
    for name, extra in VARIANTS.items():
        results[name] = run_train(out, name, **SHORT, **extra)
        assert results[name].returncode == 0, output(results[name])[-4000:]
    return out, results


def _rows(run_dir, key):
    return {r["step"]: r[key] for r in metrics(run_dir) if key in r}


@pytest.mark.slow
@pytest.mark.parametrize(("held", "precomputed"), [("held", "precomputed"), ("lora-held", "lora-precomputed")])
def test_precomputed_reference_log_probs_give_the_held_reference_s_losses(reference_runs, held, precomputed):
    out, results = reference_runs
    a, b = losses_by_step(out / held), losses_by_step(out / precomputed)
    assert a[1] == pytest.approx(LN2, abs=1e-6) and b[1] == pytest.approx(LN2, abs=1e-6)
    for step in range(1, 9):
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-6), (step, a, b)
    for key in ("eval_preference_accuracy", "eval_preference_margin", "eval_loss"):
        ea, eb = _rows(out / held, key), _rows(out / precomputed, key)
        assert ea.keys() == eb.keys() == {0, 4, 8}
        assert all(eb[s] == pytest.approx(ea[s], rel=1e-4, abs=1e-5) for s in ea), (key, ea, eb)
    assert "no reference model held" in output(results[precomputed])
    assert "no reference model held" not in output(results[held])


@pytest.mark.slow
def test_lora_dpo_trains_the_adapters_against_the_base_with_adapters_off(reference_runs):
    out, results = reference_runs
    run_dir = out / "lora-held"
    assert "LoRA rank 16" in output(results["lora-held"])
    assert read_json(run_dir / "checkpoints" / "step-4" / "meta.json")["lora"]["rank"] == 16
    losses = losses_by_step(run_dir)
    # the reference stays the base: once the adapters have moved, the policy is no longer it (were the reference the
    # current policy, every margin would stay 0 and every loss log 2)
    assert all(abs(losses[s] - LN2) > 1e-4 for s in range(3, 9)), losses
    margins = _rows(run_dir, "reward_margin")
    assert margins[1] == pytest.approx(0.0, abs=1e-6) and max(abs(margins[s]) for s in range(2, 9)) > 1e-4, margins
    assert (run_dir / "final" / "adapter" / "adapter_model.safetensors").is_file()


# ---------------------------------------------------------------- kill -9 and resume

RESUMABLE = {"run.job": "dpo", "train.max_steps": 24, "ckpt.interval": 8, "data.datasets.0.num_examples": 1000,
             "dpo.precompute_reference": "true"}  # fmt: skip


@pytest.mark.slow
def test_a_dpo_run_killed_after_a_checkpoint_resumes_from_it_exactly(tmp_path):
    """With precomputed reference log-probs, which a resumed run computes again from the starting weights."""
    straight = run_train(tmp_path, "straight", **RESUMABLE)
    assert straight.returncode == 0, output(straight)[-4000:]
    proc = start(cli("train", str(TINY), *tiny_overrides(tmp_path, "killed", **RESUMABLE)))
    try:
        wait_for((tmp_path / "killed" / "checkpoints" / "step-8").is_dir, 300, "the step-8 checkpoint")
        kill_group(proc, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_group(proc, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    resumed = run_train(tmp_path, "killed", **RESUMABLE)
    assert resumed.returncode == 0, output(resumed)[-4000:]
    assert "resumed from" in output(resumed) and "no reference model held" in output(resumed)
    # the reference values came with the checkpoint: no second pass over the pairs
    assert re.search(r"reference log-probs of \d+ pairs read from checkpoint step-\d+", output(resumed))
    assert "precomputed" not in output(resumed)
    a, b = losses_by_step(tmp_path / "straight"), losses_by_step(tmp_path / "killed")
    for step in range(17, 25):  # after any checkpoint the killed run could have resumed from
        assert a[step] == b[step], (step, a[step], b[step])  # bitwise on CPU
    wa, wb = final_weights(tmp_path / "straight"), final_weights(tmp_path / "killed")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _saved_reference(checkpoint) -> torch.Tensor:
    """The training pairs' reference log-probs a checkpoint holds, read as a resume reads them (no pickle)."""
    from prime_train.engine import safe_dcp
    from prime_train.engine.dpo import REFERENCE_KEY

    size = safe_dcp.read_metadata(checkpoint).state_dict_metadata[REFERENCE_KEY].size
    box = {REFERENCE_KEY: torch.full(tuple(size), float("nan"), dtype=torch.float64)}
    safe_dcp.load(box, checkpoint, no_dist=True)
    return box[REFERENCE_KEY]


@pytest.mark.slow
def test_a_resume_reads_the_reference_log_probs_of_its_pairs_and_computes_those_of_changed_pairs(tmp_path):
    """dpo.precompute_reference: a checkpoint keeps the training pairs' reference log-probs with the digest of the
    pairs; a resume over the same pairs reads them, one over other pairs (here the same number of pairs, cut shorter
    by a lower data.seq_len) computes them again from the starting weights and saves those."""
    base = {"run.job": "dpo", "ckpt.interval": 4, "data.datasets.0.num_examples": 400,
            "dpo.precompute_reference": "true"}  # fmt: skip
    first = run_train(tmp_path, "run", **base, **{"train.max_steps": 4})
    assert first.returncode == 0, output(first)[-4000:]
    assert "reference log-probs precomputed for" in output(first)
    step4 = tmp_path / "run" / "checkpoints" / "step-4"
    saved = _saved_reference(step4)
    assert saved.shape[1] == 2 and torch.isfinite(saved).all() and (saved < 0).all()
    digest = read_json(step4 / "meta.json")["reference_pairs"]

    same = run_train(tmp_path, "run", flags=("--resume",), **base, **{"train.max_steps": 8})
    assert same.returncode == 0, output(same)[-4000:]
    assert f"reference log-probs of {saved.shape[0]} pairs read from checkpoint step-4" in output(same)
    assert "precomputed" not in output(same)
    assert torch.equal(_saved_reference(tmp_path / "run" / "checkpoints" / "step-8"), saved)

    short = {**base, "data.seq_len": 16}
    changed = run_train(tmp_path, "run", flags=("--resume",), **short, **{"train.max_steps": 12})
    assert changed.returncode == 0, output(changed)[-4000:]
    assert f"reference log-probs precomputed for {saved.shape[0]} pairs" in output(changed)
    assert "read from checkpoint" not in output(changed) and "starting it fresh" not in output(changed)
    step12 = tmp_path / "run" / "checkpoints" / "step-12"
    assert read_json(step12 / "meta.json")["reference_pairs"] != digest
    # the values of the shorter pairs under the starting weights: those a fresh run over them computes
    fresh = run_train(tmp_path, "fresh", **short, **{"train.max_steps": 4})
    assert fresh.returncode == 0, output(fresh)[-4000:]
    recomputed = _saved_reference(step12)
    assert torch.equal(recomputed, _saved_reference(tmp_path / "fresh" / "checkpoints" / "step-4"))
    assert not torch.equal(recomputed, saved)
