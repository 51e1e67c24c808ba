"""Early stopping (train.early_stopping) and the best checkpoint (ckpt.keep_best): the judges, and real runs."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest
from enginetools import TINY, WIDE, cli, env, metrics, tiny_overrides
from safetensors.torch import load_file

from prime_train.config.methods import EarlyStoppingConfig, KeepBestConfig
from prime_train.config.schema import Config
from prime_train.contract import Phase, read_heartbeat, read_json
from prime_train.engine.best import EarlyStopping, Judges, KeepBest, MetricWatch
from prime_train.engine.export import dcp_to_hf
from prime_train.engine.metrics import EngineConfigError
from prime_train.resilience.plan import _kept_steps
from prime_train.rundir import BEST_FILE, best_checkpoint_step, list_checkpoints

# ----------------------------------------------------------------------------- the judges


def test_auto_direction_minimizes_losses_and_maximizes_the_rest():
    assert MetricWatch("k", "eval_loss", "auto").direction == "minimize"
    assert MetricWatch("k", "eval_ppl", "auto").direction == "minimize"
    assert MetricWatch("k", "eval_exact_match", "auto").direction == "maximize"
    assert MetricWatch("k", "eval_exact_match", "minimize").direction == "minimize"


def test_early_stopping_counts_evaluations_without_an_improvement_larger_than_min_delta():
    early = EarlyStopping(EarlyStoppingConfig(metric="eval_loss", patience=2, min_delta=0.05))
    assert early.observe(0, {"eval_loss": 2.0}) is None  # the baseline: the first value to beat
    assert early.observe(10, {"eval_loss": 1.9}) is None  # better by 0.1: the new best
    assert early.observe(20, {"eval_loss": 1.87}) is None  # better by 0.03 < min_delta: does not count
    reason = early.observe(30, {"eval_loss": math.nan})  # a NaN eval never improves
    assert reason is not None and "eval_loss" in reason and "1.9 at step 10" in reason and "patience = 2" in reason


def test_early_stopping_on_a_maximized_metric_resets_on_improvement():
    early = EarlyStopping(EarlyStoppingConfig(metric="eval_exact_match", patience=2))
    for step, value in [(0, 0.1), (5, 0.1), (10, 0.3), (15, 0.2)]:
        assert early.observe(step, {"eval_exact_match": value}) is None
    assert early.observe(20, {"eval_exact_match": 0.3}) is not None  # equal is not better


def test_a_metric_the_job_does_not_report_is_a_configuration_error_naming_what_it_reports():
    keep = KeepBest(KeepBestConfig(metric="eval_acc"))
    with pytest.raises(EngineConfigError) as e:
        keep.observe(0, {"eval_loss": 1.0, "eval_ppl": 2.7, "loss": 3.0})
    assert "ckpt.keep_best.metric = 'eval_acc'" in str(e.value) and "eval_loss, eval_ppl" in str(e.value)


def test_keep_best_never_picks_step_0_and_the_judges_state_round_trips():
    judges = Judges(EarlyStoppingConfig(metric="eval_loss", patience=3), KeepBestConfig(metric="eval_loss"))
    assert judges.best.observe(0, {"eval_loss": 0.1}) is False  # the input model's weights: nothing to save
    assert judges.best.observe(4, {"eval_loss": 2.0}) is True
    assert judges.best.observe(8, {"eval_loss": 2.5}) is False
    judges.early.observe(0, {"eval_loss": 2.0})
    judges.early.observe(4, {"eval_loss": 2.1})
    state = json.loads(json.dumps(judges.state_dict()))
    again = Judges(EarlyStoppingConfig(metric="eval_loss", patience=3), KeepBestConfig(metric="eval_loss"))
    again.load_state_dict(state)
    assert again.best.record() == {"step": 4, "metric": "eval_loss", "value": 2.0, "direction": "minimize"}
    assert again.early.watch.since == 1
    # a resume that judges another metric starts that one afresh
    other = Judges(EarlyStoppingConfig(metric="eval_ppl"), KeepBestConfig())
    other.load_state_dict(state)
    assert other.early.watch.best is None and other.best is None


def test_config_keys_and_overrides(tmp_path):
    cfg = Config.model_validate(
        {"train": {"early_stopping": {"metric": "eval_loss", "patience": 2}}, "ckpt": {"keep_best": {"metric": "x"}}}
    )
    assert cfg.train.early_stopping.patience == 2 and cfg.ckpt.keep_best.metric == "x"
    with pytest.raises(ValueError):
        Config.model_validate({"train": {"early_stopping": {"patience": 0}}})
    with pytest.raises(ValueError):
        Config.model_validate({"ckpt": {"keep_best": {"metric": "eval_loss", "direction": "down"}}})


def test_the_supervisors_retention_spares_the_step_best_json_names(tmp_path):
    assert _kept_steps(tmp_path, None) == set()
    (tmp_path / BEST_FILE).write_text(json.dumps({"step": 40, "metric": "eval_loss"}))
    assert _kept_steps(tmp_path, None) == {40} and best_checkpoint_step(tmp_path) == 40
    (tmp_path / BEST_FILE).write_text('{"step": "40"}')  # not what the engine writes: nothing is kept for it
    assert best_checkpoint_step(tmp_path) is None


# ----------------------------------------------------------------------------- real runs


def run(tmp_path: Path, name: str, *flags: str, **overrides) -> subprocess.CompletedProcess[str]:
    argv = cli("run", str(TINY), *tiny_overrides(tmp_path, name, **overrides), *flags)
    return subprocess.run(argv, env={**env(), **WIDE}, capture_output=True, text=True, timeout=600)


def test_early_stopping_ends_the_run_as_done_with_a_checkpoint_final_and_the_reason(tmp_path):
    # min_delta 100: no eval after the baseline counts as an improvement, so the second eval after it ends the run
    done = run(
        tmp_path, "early",
        **{"train.max_steps": 40, "train.eval_interval": 2, "train.early_stopping.metric": "eval_loss",
           "train.early_stopping.patience": 2, "train.early_stopping.min_delta": 100, "ckpt.interval": 100},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    run_dir = tmp_path / "early"
    hb = read_heartbeat(run_dir / "progress.json")
    assert hb.phase is Phase.DONE and hb.step == 4
    assert "early stopping: eval_loss did not improve" in hb.reason
    assert [c.step for c in list_checkpoints(run_dir / "checkpoints")] == [4]  # saved: --resume can train on
    assert (run_dir / "final" / "model.safetensors").is_file()
    assert max(r["step"] for r in metrics(run_dir)) == 4
    # a plain re-run says why it ended where it did
    again = run(tmp_path, "early", **{"train.max_steps": 40, "train.early_stopping.metric": "eval_loss"})
    assert again.returncode == 0 and "early stopping" in again.stdout + again.stderr


def test_keep_best_keeps_the_best_eval_out_of_retention_and_exports_it(tmp_path):
    done = run(
        tmp_path, "best",
        **{"train.max_steps": 16, "train.eval_interval": 2, "ckpt.interval": 4, "ckpt.keep_last": 1,
           # maximised, the eval loss is best early and then falls: the best is not the last step
           "ckpt.keep_best.metric": "eval_loss", "ckpt.keep_best.direction": "maximize",
           "ckpt.keep_best.export": "true", "ckpt.async_save": "false"},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    run_dir = tmp_path / "best"
    evals = {r["step"]: r["eval_loss"] for r in metrics(run_dir) if "eval_loss" in r and r["step"] > 0}
    best_step = max(evals, key=lambda s: (evals[s], -s))  # the first of equal values is the best
    best = read_json(run_dir / "checkpoints" / BEST_FILE)
    assert best == {"step": best_step, "metric": "eval_loss", "value": evals[best_step], "direction": "maximize"}
    assert best_step != 16
    kept = [c.step for c in list_checkpoints(run_dir / "checkpoints")]
    # keep_last 1 keeps the newest, the last step's (ckpt.resumable_final_save); the best stays beside it
    assert kept == [best_step, 16]
    # final/ is the best checkpoint's model, not the last step's
    dcp_to_hf(run_dir / "checkpoints" / f"step-{best_step}", tmp_path / "best-hf")
    exported = load_file(run_dir / "final" / "model.safetensors")
    expected = load_file(tmp_path / "best-hf" / "model.safetensors")
    assert exported.keys() == expected.keys()
    assert all((exported[k] == expected[k]).all() for k in exported)


def test_a_resumed_run_judges_as_the_uninterrupted_one_would(tmp_path):
    # patience 3, no eval after the baseline improves: the uninterrupted run would end at step 6 (evals 2, 4, 6)
    judged = {"train.eval_interval": 2, "train.early_stopping.metric": "eval_loss",
              "train.early_stopping.patience": 3, "train.early_stopping.min_delta": 100}  # fmt: skip
    first = run(tmp_path, "judged", **judged, **{"train.max_steps": 4, "ckpt.resumable_final_save": "true"})
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-2000:]
    # trained on from its step-4 checkpoint, whose judges have seen two evals without improvement: one more ends it
    # (judged afresh, the first eval after the resume would be the best, and the run would go on to step 12)
    more = run(tmp_path, "judged", "--resume", **judged, **{"train.max_steps": 40})
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-2000:]
    hb = read_heartbeat(tmp_path / "judged" / "progress.json")
    assert hb.phase is Phase.DONE and hb.step == 6 and "for 3 evaluations" in hb.reason
