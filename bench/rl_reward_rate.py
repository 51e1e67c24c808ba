"""Reward gained per minute by the tiny RL example, from a half-trained SFT model, on this machine.

    python bench/rl_reward_rate.py [--model DIR] [--steps N] [--seed S] [--out DIR] [-- more overrides]

Without --model it first trains the 60-step SFT model of the tiny default (`prime-train run
--train.max_steps 60`), the starting point of the README's RL example. Then it runs configs/tiny-rl.toml
through the real CLI (supervisor, embedded rollout worker, trainer) and prints the sampled reward and pass
rate (mean of the first and last 10 steps), the greedy eval pass rate (first and last eval), the wall time,
and the reward gained per minute of wall time. Wall time includes start-up and the evals, as a user sees it.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prime_train.resilience.rl_summary import rl_summary

REPO = Path(__file__).resolve().parents[1]


def prime_train(*args: str) -> float:
    """Run `prime-train ARGS` in a fresh interpreter; its wall seconds. Exits with its output when it fails."""
    t0 = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "prime_train", *args], capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        sys.exit(f"prime-train {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}{result.stderr}")
    return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the SFT model to start from (default: train the 60-step one first)")
    parser.add_argument("--steps", type=int, help="train.max_steps of the RL run (default: the config's)")
    parser.add_argument("--seed", type=int, help="run.seed of the RL run (default: the config's)")
    parser.add_argument("--out", help="where the runs go (default: a temporary directory)")
    parser.add_argument("overrides", nargs="*", help="more --section.key value overrides for the RL run")
    args = parser.parse_args()
    out = Path(args.out or tempfile.mkdtemp(prefix="rl-bench-"))
    common = ["--run.output_dir", str(out), "--logging.tensorboard", "false", "--fresh"]
    model = args.model
    if model is None:
        sft_s = prime_train("run", "--train.max_steps", "60", "--run.name", "sft60", *common)
        model = str(out / "sft60" / "final")
        print(f"60-step SFT model in {sft_s:.0f} s: {model}")
    rl = ["run", "configs/tiny-rl.toml", "--model.path", model, "--run.name", "rl", *common]
    rl += ["--inference.base_port", str(free_port())]
    if args.steps:
        rl += ["--train.max_steps", str(args.steps)]
    if args.seed is not None:
        rl += ["--run.seed", str(args.seed)]
    wall_s = prime_train(*rl, *args.overrides)
    summary = rl_summary(out / "rl" / "metrics.jsonl")
    if summary is None:
        sys.exit(f"no reward in {out / 'rl' / 'metrics.jsonl'}")
    table = Table(title=f"tiny RL from {model}")
    table.add_column("")
    for column in ("start", "end", "change"):
        table.add_column(column, justify="right")
    for key, figures in summary.items():
        table.add_row(key, f"{figures['start']:.3f}", f"{figures['end']:.3f}", f"{figures['change']:+.3f}")
    console = Console()
    console.print(table)
    steps = summary["reward"]["latest_step"]
    minutes = wall_s / 60
    console.print(
        f"{steps} steps in {wall_s:.0f} s wall ({steps / minutes:.1f} steps/min): sampled reward "
        f"{summary['reward']['change'] / minutes:+.3f} per minute"
    )


if __name__ == "__main__":
    main()
