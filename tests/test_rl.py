"""RL end to end on the CPU: SFT warm start, GRPO with a supervised embedded worker, a worker killed mid-run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from enginetools import TINY_RL, cli, env, final_weights, free_port, kill_group, metrics, start, wait_for

from prime_train.contract import read_json
from prime_train.kit.events import read_events


def rl_args(tmp_path, sft_model, name: str, **extra) -> list[str]:
    args = {
        "run.output_dir": str(tmp_path),
        "run.name": name,
        "model.path": str(sft_model),
        "inference.base_port": free_port(),
        "logging.tensorboard": "false",
        "supervisor.poll_interval_s": 0.5,
        **extra,
    }
    out = []
    for key, value in args.items():
        out += [f"--{key}", str(value)]
    return out


# A smaller budget than configs/tiny-rl.toml (40 steps of 32 prompts, words of 3-4 letters): 20 steps of 16 prompts
# of 3-letter words, where the half-trained model is right often enough for the exact-match reward to move within
# 20 steps. Measured (issue 16): sampled reward 0.378 (steps 1-5) -> 0.530 (steps 16-20); with the loss's sign
# flipped 0.222 -> 0.0.
LEARNING_BUDGET = {
    "train.max_steps": 20, "rl.prompts_per_step": 16, "rl.env_args.min_letters": 3, "rl.env_args.max_letters": 3,
    "train.eval_interval": 1000, "rl.eval_prompts": 32,
}  # fmt: skip
LEARNING_MARGIN = 0.05


def rewards(run_dir) -> dict[int, float]:
    import json

    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "reward" in record:
            out[record["step"]] = record["reward"]
    return out


@pytest.mark.slow
def test_tiny_rl_raises_reward_and_greedy_pass_rate_of_a_half_trained_model(tmp_path, half_trained_sft_model):
    """configs/tiny-rl.toml as the README runs it, from the 60-step SFT model: issue 16's bar, +0.1 on both. Measured
    on this CPU (the same twice: the run is on-policy and seeded): sampled reward 0.190 -> 0.375 (+0.185, first 10
    steps against the last 10), greedy eval pass rate on 200 prompts 0.255 -> 0.390 (+0.135); on 2026-11-26, on
    another machine of the same kind, 0.192 -> 0.393 and 0.255 -> 0.450 (float rounding differs by CPU)."""
    result = subprocess.run(
        cli("run", str(TINY_RL), *rl_args(tmp_path, half_trained_sft_model, "rl")),
        env=env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    r = rewards(tmp_path / "rl")
    assert sorted(r) == list(range(1, 41))
    first = sum(r[s] for s in range(1, 11)) / 10
    last = sum(r[s] for s in range(31, 41)) / 10
    assert last >= first + 0.1, (first, last)
    evals = {row["step"]: row["eval_pass_rate"] for row in metrics(tmp_path / "rl") if "eval_pass_rate" in row}
    assert evals[40] >= evals[0] + 0.1, evals


def test_grpo_raises_the_reward_of_a_half_trained_model(tmp_path, half_trained_sft_model):
    """The README's RL example on a smaller budget: from the 60-step SFT model the loss must raise the sampled
    reward. A flipped sign, or a normalisation that weighs the wrong tokens (padding, other completions), lowers
    it or leaves it flat (checked once by flipping the sign in grpo_loss: issue 16's report)."""
    result = subprocess.run(
        cli("run", str(TINY_RL), *rl_args(tmp_path, half_trained_sft_model, "learn", **LEARNING_BUDGET)),
        env=env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    rows = {r["step"]: r for r in metrics(tmp_path / "learn")}
    steps = LEARNING_BUDGET["train.max_steps"]
    assert sorted(s for s in rows if "reward" in rows[s]) == list(range(1, steps + 1))
    first = sum(rows[s]["reward"] for s in range(1, 6)) / 5
    last = sum(rows[s]["reward"] for s in range(steps - 4, steps + 1)) / 5
    assert last >= first + LEARNING_MARGIN, (first, last)
    # the new per-step figures: the policy's entropy, and the worker/trainer mismatch at the first (on-policy) step
    entropy = [rows[s]["entropy"] for s in range(1, steps + 1) if "entropy" in rows[s]]
    assert len(entropy) >= steps // 2 and all(e > 0 for e in entropy)  # absent where every group scored alike
    mismatch = [rows[s]["logprob_mismatch"] for s in range(1, steps + 1) if "logprob_mismatch" in rows[s]]
    # on-policy (rl.max_async_level 0): the same weights on both sides, measured at every step, also one that
    # trained on nothing because every group scored alike
    assert len(mismatch) == steps and max(mismatch) < 1e-3, mismatch
    # and the end-of-run table says so
    assert "reward (sampled)" in result.stdout and "eval pass rate (greedy)" in result.stdout


def test_killed_rollout_worker_is_restarted_and_training_reaches_the_end(tmp_path, sft_model):
    run_dir = tmp_path / "kill-worker"
    proc = start(
        cli(
            "run",
            str(TINY_RL),
            "--verbose-vllm",
            *rl_args(tmp_path, sft_model, "kill-worker", **{"train.max_steps": 16}),
        )
    )
    try:
        wait_for(lambda: ((read_json(run_dir / "progress.json") or {}).get("step") or 0) >= 4, 300, "RL step 4")
        worker = next(
            e["pid"] for e in read_events(run_dir / "events.jsonl")
            if e["event"] == "process_started" and e["process"] == "inference-0"
        )  # fmt: skip
        psutil.Process(worker).kill()
        out, _ = proc.communicate(timeout=600)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    events = read_events(run_dir / "events.jsonl")
    died = [e for e in events if e["event"] == "inference_died"]
    assert died and died[0]["process"] == "inference-0"
    restarted = [e for e in events if e["event"] == "process_started" and e.get("restart")]
    assert restarted, "the worker was not restarted"
    assert read_json(run_dir / "progress.json")["step"] == 16
    loaded = [e["step"] for e in events if e["event"] == "weights_loaded"]  # the workers' policies, on record
    assert loaded == sorted(set(loaded)) and loaded[-1] == 16, loaded
    assert "inference-0" in out  # surfaced in the console with its last lines
    # --verbose-vllm streams the workers' own output whole: both starts' banners reach the console
    assert out.count("[inference-0]") >= 2 and out.count("serving") >= 2


LONG_TAIL_ENV = '''
from prime_train.environments import Prompt


class LongTail:
    """Short reverse prompts, and one train prompt in 128 far longer than any context allows."""

    name = "long-tail"
    uses_tools = False

    def prompts(self, split, n, seed):
        out = []
        for i in range(n):
            word = "abcdefgh"[i % 8] + "xyz"[i % 3] + "q"
            if split == "train" and i % 128 == 127:
                out.append(Prompt("reverse " + "w" * 300 + "=", "w" * 300, {}))
            else:
                out.append(Prompt(f"reverse {word}=", word[::-1], {}))
        return out

    def reward(self, prompt, completion):
        return 1.0 if completion.split("\\n")[0].strip() == prompt.answer else 0.0


def load_environment(**kwargs):
    return LongTail()
'''


def test_a_prompt_that_cannot_fit_is_refused_surfaced_and_classified_not_waited_on(tmp_path, sft_model):
    # the 99th-percentile budget passes lint (4 long prompts in 512), so only the worker can catch it
    (tmp_path / "long_tail_env.py").write_text(LONG_TAIL_ENV)
    run_env = {**env(), "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        cli("run", str(TINY_RL), *rl_args(tmp_path, sft_model, "long", **{
            "rl.environment": "long_tail_env:load_environment", "train.max_steps": 200,
            "rl.eval_prompts": 0, "supervisor.max_restarts": 3,
        })),
        env=run_env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 78, result.stdout[-4000:] + result.stderr[-2000:]
    assert "maximum context length is 128 tokens" in result.stdout  # surfaced in the console
    events = read_events(tmp_path / "long" / "events.jsonl")
    assert len([e for e in events if e["event"] == "attempt_started"]) == 1  # never retried
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "config_error"
    assert any(e["event"] == "log_finding" and e.get("process") == "inference-0" for e in events)


@pytest.mark.slow
def test_profile_of_tiny_rl_weighs_rollout_latency_against_training(tmp_path, sft_model):
    import json

    result = subprocess.run(
        cli("profile", str(TINY_RL), "--steps", "2", "--warmup", "1", "--json", *rl_args(tmp_path, sft_model, "prl")),
        env=env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["job"] == "rl" and summary["profiled_steps"] == 2
    assert summary["rollout_latency_s"] > 0
    assert summary["phases_s"]["weight_sync"] > 0 and "rollout_wait" in summary["phases_s"]
    assert summary["bottleneck"]["kind"] in {"latency-bound rollouts", "compute-bound"}
    assert (tmp_path / "prl-profile" / "profile" / "trace-rank0.json").is_file()


def test_kill_9_of_the_rl_trainer_resumes_exactly_like_sft(tmp_path, sft_model):
    """The shared loop: the RL trainer killed after a checkpoint replays the lost steps bit for bit."""
    steps = {
        "train.max_steps": 10, "ckpt.interval": 4, "rl.max_async_level": 0, "rl.eval_prompts": 16,
        "supervisor.backoff_initial_s": 0.5,
    }  # fmt: skip
    straight = subprocess.run(
        cli("run", str(TINY_RL), *rl_args(tmp_path, sft_model, "straight", **steps)),
        env=env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stdout[-4000:] + straight.stderr[-2000:]

    run_dir = tmp_path / "killed"
    proc = start(cli("run", str(TINY_RL), *rl_args(tmp_path, sft_model, "killed", **steps)))
    try:
        wait_for(lambda: ((read_json(run_dir / "progress.json") or {}).get("step") or 0) >= 6, 600, "RL step 6")
        assert (run_dir / "checkpoints" / "step-4").is_dir()
        trainer = next(
            e["pid"] for e in read_events(run_dir / "events.jsonl")
            if e["event"] == "process_started" and e["process"] == "trainer"
        )  # fmt: skip
        psutil.Process(trainer).kill()
        out, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    events = read_events(run_dir / "events.jsonl")
    resumed = [e for e in events if e["event"] == "attempt_started" and e["attempt"] == 2]
    assert resumed and resumed[0]["resume_from"] == 4, resumed
    # weights a lost step published are gone: a restarted worker must not load a policy from the future
    assert sorted(int(p.name[5:]) for p in (run_dir / "weights").glob("step-*")) == [9, 10]

    def by_step(run: Path, key: str) -> dict[int, float]:
        # the last record of each step: the resumed attempt rewrote the steps after its checkpoint
        return {r["step"]: r[key] for r in metrics(run) if key in r}

    # rl.max_async_level 0: every batch was sampled by the weights the trainer holds, so the worker's logprobs are
    # the trainer's up to float32 rounding (a stale policy would be off by far more than 1e-3)
    mismatch = by_step(tmp_path / "straight", "logprob_mismatch")
    assert sorted(mismatch) == list(range(1, 11)) and max(mismatch.values()) < 1e-3, mismatch
    print(f"\nembedded worker logprob mismatch per step: max {max(mismatch.values()):.2e}")
    for key in ("reward", "loss", "grad_norm"):
        a, b = by_step(tmp_path / "straight", key), by_step(run_dir, key)
        assert sorted(a) == sorted(b) == list(range(1, 11)), key
        for step in range(5, 11):
            assert a[step] == b[step], (key, step, a[step], b[step])  # bitwise on CPU
    wa, wb = final_weights(tmp_path / "straight"), final_weights(run_dir)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
