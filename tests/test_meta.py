"""Meta-learning (run.job = "meta", engine/meta.py): Reptile's meta update by hand, the tasks a step samples, lint of
[meta], the plan, and a short real run that learns, evaluates adaptation to its held-out task, and resumes after kill -9
as the uninterrupted run trains."""

from __future__ import annotations

import signal
import subprocess

import pytest
import torch
from enginetools import REPO, cli, env, final_weights, kill_group, losses_by_step, metrics, start, wait_for
from torch import nn

from prime_train.engine.meta import reptile_update, steps_to_reach

TINY_META = REPO / "configs" / "examples" / "tiny-meta.toml"


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


# ---------------------------------------------------------------- the update


def test_reptile_update_moves_the_weights_a_fraction_of_the_way_to_the_mean_of_the_adapted_weights():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    theta = [p.detach().clone() for p in model.parameters()]
    # two tasks' adapted weights
    a = [t + torch.tensor(1.0) for t in theta]
    b = [t - torch.tensor(3.0) for t in theta]
    mean = [(x + y) / 2 for x, y in zip(a, b, strict=True)]  # θ - 1
    eps = 0.25
    optimizer = torch.optim.SGD(model.parameters(), lr=eps)
    norm = reptile_update(model, mean, optimizer)
    for p, t in zip(model.parameters(), theta, strict=True):
        # θ + ε (mean θ' − θ) = θ + 0.25 · (−1)
        assert torch.allclose(p.detach(), t - 0.25), (p, t)
        assert p.grad is None  # the meta-gradient is spent, not left for the next step
    assert norm.item() == pytest.approx((sum(t.numel() for t in theta)) ** 0.5)  # ‖θ − mean‖ = ‖1‖


def test_with_outer_lr_one_reptile_lands_on_the_adapted_weights():
    model = nn.Linear(2, 2, bias=False)
    target = [torch.tensor([[1.0, 2.0], [3.0, 4.0]])]
    reptile_update(model, target, torch.optim.SGD(model.parameters(), lr=1.0))
    assert torch.equal(model.weight.detach(), target[0])


def test_steps_to_reach_counts_from_the_loss_before_adapting():
    assert steps_to_reach([3.0, 2.5, 1.9, 1.5], 2.0) == 2
    assert steps_to_reach([1.0, 0.5], 2.0) == 0
    assert steps_to_reach([3.0, 2.5], 2.0) == 2  # not reached: one past the last step


# ---------------------------------------------------------------- config, lint, plan


def test_the_meta_job_runs_as_its_own_module_under_the_engine_plan():
    from prime_train.config.schema import Config
    from prime_train.launch import plan_engine_launch
    from prime_train.resilience.plan import ENGINE_PLANS, EnginePlan

    cfg = Config.model_validate({"run": {"job": "meta"}})
    assert plan_engine_launch(cfg, "c.toml").argv[2] == "prime_train.engine.meta"
    assert ENGINE_PLANS["meta"] is EnginePlan


def test_lint_names_the_line_of_a_held_out_task_that_is_also_trained(tmp_path):
    text = TINY_META.read_text().replace('task = "sorting"', 'task = "reverse-text"')
    bad = tmp_path / "meta.toml"
    bad.write_text(text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if row.startswith("eval_task"))
    result = subprocess.run(
        cli("lint", str(bad), "--distributed.nproc_per_node", "2"), env=env(), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 78, output(result)
    assert f"meta.toml:{line}:" in output(result) and "meta.eval_task = 'reverse-text'" in output(result)
    assert "runs in one process (2 asked)" in output(result)
    assert "Traceback" not in output(result)


# ---------------------------------------------------------------- a real run and its resume

SHORT = {
    "train.max_steps": "12",
    "train.eval_interval": "6",
    "ckpt.interval": "6",
    "ckpt.async_save": "false",
    "meta.inner_steps": "2",
    "meta.adapt_steps": "3",
    "meta.adapt_target_loss": "5.0",
    "data.datasets.0.num_examples": "1500",
    "data.datasets.1.num_examples": "1500",
    "logging.tensorboard": "false",
    "logging.log_interval": "3",
}


def meta_argv(out, name: str) -> list[str]:
    args = [f"--{k}={v}" for k, v in {**SHORT, "run.output_dir": str(out), "run.name": name}.items()]
    return cli("train", str(TINY_META), *args)


@pytest.fixture(scope="module")
def straight_meta_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("meta")
    result = subprocess.run(meta_argv(out, "straight"), env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, output(result)[-4000:]
    return out


@pytest.mark.slow
def test_a_short_meta_run_learns_and_evaluates_adaptation_to_the_held_out_task(straight_meta_run):
    rows = metrics(straight_meta_run / "straight")
    steps = [r for r in rows if "adapted_loss" in r]
    assert [r["step"] for r in steps] == list(range(1, 13))
    # the inner steps adapt: their last batch's loss is below their first's, over the run (one step's pair of batches
    # may differ by more than two inner steps learn)
    assert sum(r["adapted_loss"] for r in steps) < sum(r["loss"] for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"]  # and the meta-learned start gets better
    evals = [r for r in rows if "eval_adapt_loss" in r]
    assert [r["step"] for r in evals] == [0, 6, 12]
    for r in evals:  # a few steps on the held-out task lower its held-out loss
        assert r["eval_adapt_loss"] < r["eval_adapt_loss_start"]
        assert 0 <= r["eval_adapt_steps_to_target"] <= 4
    assert (straight_meta_run / "straight" / "final" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_meta_run_killed_after_a_checkpoint_resumes_to_the_same_steps_and_weights(straight_meta_run):
    out = straight_meta_run
    proc = start(meta_argv(out, "killed"))
    try:
        wait_for((out / "killed" / "checkpoints" / "step-6").is_dir, 300, "the step-6 checkpoint")
        kill_group(proc, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_group(proc, signal.SIGKILL)
    resumed = subprocess.run(meta_argv(out, "killed"), env=env(), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, output(resumed)[-4000:]
    assert "resumed from" in output(resumed)
    straight, killed = losses_by_step(out / "straight"), losses_by_step(out / "killed")
    for step in range(7, 13):  # every task stream, the sampled tasks and the outer schedule continue exactly
        assert straight[step] == killed[step], (step, straight[step], killed[step])
    wa, wb = final_weights(out / "straight"), final_weights(out / "killed")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
