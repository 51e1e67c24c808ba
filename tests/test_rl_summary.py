"""An RL run's reward and pass rate, start against end: `prime-train status` and the end-of-run table read them
from metrics.jsonl (resilience/rl_summary.py); through the real CLI where the user sees them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from enginetools import run_cli

from prime_train.resilience.console import final_results
from prime_train.resilience.rl_summary import rl_summary, sparkline, status_rows, summary_lines
from prime_train.rundir import RunDir


def write_rl_metrics(root: Path, steps: int = 30) -> RunDir:
    """metrics.jsonl as the GRPO job writes it: reward and pass_rate each step, greedy evals every 10 steps."""
    run = RunDir(root / "rl")
    run.create()
    lines = [json.dumps({"step": 0, "eval_reward": 0.5, "eval_pass_rate": 0.10})]
    for step in range(1, steps + 1):
        record = {"step": step, "loss": 0.0, "reward": 0.2 + 0.01 * step, "pass_rate": 0.1 + 0.005 * step}
        if step % 10 == 0:
            record |= {"eval_reward": 0.5 + 0.01 * step, "eval_pass_rate": 0.1 + 0.004 * step}
        lines.append(json.dumps(record))
    lines.insert(5, '{"step": 4, "reward": 0.2')  # a torn line, as a writer killed mid-line leaves it
    run.metrics_path.write_text("\n".join(lines) + "\n")
    return run


def test_start_and_end_are_ten_step_means_and_evals_first_against_last(tmp_path):
    summary = rl_summary(write_rl_metrics(tmp_path).metrics_path)
    assert summary["reward"]["start"] == pytest.approx(0.2 + 0.01 * 5.5)  # steps 1-10
    assert summary["reward"]["end"] == pytest.approx(0.2 + 0.01 * 25.5)  # steps 21-30
    assert summary["reward"]["change"] == pytest.approx(0.2) and summary["reward"]["latest_step"] == 30
    assert summary["eval_pass_rate"]["start"] == pytest.approx(0.10)
    assert summary["eval_pass_rate"]["end"] == pytest.approx(0.22)
    short = rl_summary(write_rl_metrics(tmp_path / "short", steps=6).metrics_path)
    assert short["reward"]["steps"] == 3  # a short run's two ends never overlap


def test_a_run_without_rewards_has_no_rl_summary(tmp_path):
    run = RunDir(tmp_path / "sft")
    run.create()
    run.metrics_path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5, "eval_exact_match": 0.2}\n')
    assert rl_summary(run.metrics_path) is None
    assert status_rows(None) == [] and summary_lines(None) == []
    assert not any("reward" in line for line in final_results(run))


def test_the_end_of_run_table_shows_reward_and_pass_rate_at_start_and_end(tmp_path):
    lines = final_results(write_rl_metrics(tmp_path))
    table = "\n".join(lines)
    assert "start" in table and "end" in table and "change" in table
    reward = next(line for line in lines if line.startswith("reward (sampled)"))
    assert reward.split()[-3:] == ["0.255", "0.455", "+0.200"]
    passed = next(line for line in lines if line.startswith("eval pass rate (greedy)"))
    assert passed.split()[-3:] == ["0.100", "0.220", "+0.120"]


def test_status_shows_the_latest_reward_and_pass_rate_and_their_trend(tmp_path):
    run = write_rl_metrics(tmp_path)
    shown = run_cli("status", str(run.root))
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "reward (sampled)" in shown.stdout and "0.500 at step 30, up +0.200" in shown.stdout
    assert "eval pass rate (greedy)" in shown.stdout
    document = json.loads(run_cli("status", str(run.root), "--json").stdout)
    assert document["rl"]["pass_rate"]["latest"] == pytest.approx(0.25)
    # the curves themselves: 29 rising steps (one line torn) in 24 points, the 4 evals as they are
    reward = document["rl"]["reward"]["curve"]
    assert len(reward) == 24 and reward == sorted(reward) and reward[0] < 0.23 and reward[-1] > 0.49
    assert document["rl"]["eval_pass_rate"]["curve"] == pytest.approx([0.10, 0.14, 0.18, 0.22])
    row = next(line for line in shown.stdout.splitlines() if "eval pass rate (greedy)" in line)
    assert "▁▃▆█ 0.10-0.22" in row


def test_the_sparkline_spans_the_curves_own_range():
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([0.3, 0.3]) == "▁▁" and sparkline([]) == ""
    assert sparkline([2.0, 1.0]) == "█▁"  # falls show as falls


def test_the_sparklines_range_holds_the_latest_value_its_row_shows(tmp_path):
    # 29 rising steps binned into 24 means: the last bin's mean (0.495) is below the latest reward (0.500)
    [reward] = [
        row
        for label, row in status_rows(rl_summary(write_rl_metrics(tmp_path).metrics_path))
        if "sampled)" in label and "reward" in label
    ]
    assert reward.startswith("0.500 at step 30") and reward.endswith("-0.50"), reward
