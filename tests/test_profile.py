"""`prime-train profile`: real steps under torch.profiler, phase shares, the bottleneck verdict, a Chrome trace."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from enginetools import TINY, cli, env, tiny_overrides

from prime_train.engine.profiling import PhaseTimer, diagnose, profile_request, summarize


def _summary(job="sft", world_size=1, **phases) -> dict:
    steps = [{**phases, "step": sum(phases.values())}] * 3
    out = summarize(steps, world_size=world_size, tokens_per_step=1000, job=job)
    out["communication_in_trace_s"] = 0.0
    return out


def test_verdicts_follow_the_largest_avoidable_share():
    assert diagnose(_summary(data=0.5, forward=0.2, backward=0.3))["kind"] == "data-bound"
    assert diagnose(_summary(data=0.01, forward=0.4, backward=0.5, optimizer=0.09))["kind"] == "compute-bound"
    comm = _summary(world_size=4, forward=0.2, backward=0.3, communication=0.5)
    assert diagnose(comm)["kind"] == "communication-bound"
    # the same collectives in a single process are not a communication bottleneck
    assert diagnose(_summary(world_size=1, forward=0.2, backward=0.3, communication=0.5))["kind"] == "compute-bound"
    rl = _summary(job="rl", rollout_wait=3.0, forward=0.5, backward=0.5)
    rl["rollout_latency_s"] = 3.2
    verdict = diagnose(rl)
    assert verdict["kind"] == "latency-bound rollouts"
    assert "max_async_level" in verdict["advice"] and "75%" in verdict["evidence"]


def test_compute_bound_at_low_mfu_says_how_far_from_what_the_gpu_reaches():
    # the H100 verdict that was wrong: "compute-bound ... this is where a step should be" at 14 % MFU
    low = _summary(data=0.01, forward=0.4, backward=0.5, optimizer=0.09)
    low["mfu"] = 0.14
    verdict = diagnose(low)
    assert verdict["kind"] == "under-utilised compute"
    assert "MFU 14%" in verdict["evidence"] and "35% of the ~40%" in verdict["evidence"]
    assert "train.compile" in verdict["advice"] and "where a step should be" not in verdict["advice"]
    tuned = {**low, "mfu": 0.38}  # nanoGPT's measured MFU at GPT-2-124M shape on an H100
    assert diagnose(tuned)["kind"] == "compute-bound" and "where a step should be" in diagnose(tuned)["advice"]
    # on a device with no known peak the verdict says it cannot tell
    unknown = {**low, "mfu": None}
    assert diagnose(unknown)["kind"] == "compute-bound" and "unknown" in diagnose(unknown)["evidence"]


def test_a_slow_checkpoint_is_noted_against_its_interval():
    s = _summary(forward=0.5, backward=0.5)
    s["checkpoint_save_s"] = 30.0
    assert any("ckpt.interval" in n for n in diagnose(s, ckpt_interval=100)["notes"])  # 30 s of 100 s
    assert diagnose(s, ckpt_interval=10_000)["notes"] == []


def test_phase_timer_accounts_every_phase_and_the_rest(monkeypatch):
    timer = PhaseTimer()
    for _ in range(2):
        with timer("forward"):
            sum(range(20000))
        with timer("forward"):
            pass
        timer.end_step()
    assert len(timer.steps) == 2
    assert all(0 < s["forward"] <= s["step"] for s in timer.steps)
    summary = summarize(timer.steps, world_size=1, tokens_per_step=10, job="sft")
    assert summary["phases_s"]["data"] == 0.0
    assert abs(sum(summary["phases_s"].values()) - summary["step_s"]) < 1e-9


def test_profile_request_is_parsed_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv("PRIME_TRAIN_PROFILE", raising=False)
    assert profile_request() is None
    monkeypatch.setenv("PRIME_TRAIN_PROFILE", "2,5")
    assert profile_request() == (2, 5)
    monkeypatch.setenv("PRIME_TRAIN_PROFILE", "five")
    with pytest.raises(ValueError, match="PRIME_TRAIN_PROFILE"):
        profile_request()


def _profile(tmp_path, *extra: str, name="p") -> subprocess.CompletedProcess:
    return subprocess.run(
        cli("profile", str(TINY), "--steps", "2", "--warmup", "1", "--json", *tiny_overrides(tmp_path, name), *extra),
        env=env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_profile_of_the_tiny_run_writes_a_trace_and_names_a_bottleneck(tmp_path):
    result = _profile(tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["profiled_steps"] == 2 and summary["job"] == "sft"
    assert summary["bottleneck"]["kind"] in {"compute-bound", "data-bound"}
    assert summary["phases_s"]["forward"] > 0 and summary["phases_s"]["backward"] > 0
    assert summary["checkpoint_save_s"] > 0
    trace = json.loads(Path(summary["trace"]).read_text())
    assert trace["traceEvents"], "the Chrome trace holds events"
    # the real run's directory is never touched; the profile has its own
    assert not (tmp_path / "p").exists()
    root = tmp_path / "p-profile"
    assert (root / "profile" / "summary.json").is_file()
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step-3"]
    # a second profile replaces the first one's directory (it carries the marker), nothing else
    again = _profile(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads(again.stdout)["profiled_steps"] == 2


@pytest.mark.slow
def test_two_process_ddp_profile_sees_the_collectives(tmp_path):
    result = _profile(tmp_path, "--distributed.nproc_per_node", "2", "--distributed.strategy", "ddp", name="ddp")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["world_size"] == 2
    assert summary["communication_in_trace_s"] > 0, "gloo all-reduces appear in the trace"
    assert (tmp_path / "ddp-profile" / "profile" / "trace-rank1.json").is_file()
