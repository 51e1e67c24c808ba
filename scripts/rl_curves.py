"""Train the tiny GRPO example in a few variants and plot their curves (issue 16; docs/rl-tuning.md).

    pip install matplotlib
    python scripts/rl_curves.py                       # all variants, writes docs/images/rl-tiny.png
    python scripts/rl_curves.py --variants tiny-rl kl --workdir /tmp/rl --out /tmp/rl.png

It trains the half-trained SFT model once (`prime-train run --train.max_steps 60`, the tiny default config) unless
`--sft` names an existing `<run>/final`, then runs each variant of prime_train/configs/tiny-rl.toml from it:

- tiny-rl: the config as it is (on-policy: the PPO ratio is 1 when the gradient is taken, clip fraction 0);
- off-policy: `--rl.max_async_level 1`, rollouts one step old, where PPO's clip acts;
- kl: `--rl.kl_coef 0.1`, a KL penalty to the SFT model;
- partial-credit: `--rl.env_args.partial_credit true`, the positional reward instead of exact match.

The figure has one line per variant in each of 8 panels, read from each run's metrics.jsonl: sampled reward, greedy
pass rate on the held-out prompts, KL, clip fraction, entropy, grad norm, worker/trainer logprob mismatch and the
fraction of samples trained on. A table per variant goes to stdout. A run already finished in --workdir is reused
(only plotted); a fresh --workdir trains everything again (each run took 17-180 s on a shared 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "prime_train" / "configs" / "tiny-rl.toml"
VARIANTS: dict[str, list[str]] = {
    "tiny-rl": [],
    "off-policy": ["--rl.max_async_level", "1"],
    "kl": ["--rl.kl_coef", "0.1"],
    "partial-credit": ["--rl.env_args.partial_credit", "true"],
}
# (metrics.jsonl key, panel title)
PANELS: list[tuple[str, str]] = [
    ("reward", "sampled reward (mean of the batch)"),
    ("eval_pass_rate", "greedy pass rate, held-out prompts"),
    ("kl", "KL to the SFT model (per token)"),
    ("clip_fraction", "clip fraction (tokens)"),
    ("entropy", "entropy at trained tokens (nats)"),
    ("grad_norm", "grad norm (before clipping)"),
    ("logprob_mismatch", "logprob mismatch, worker vs trainer"),
    ("trained_samples_fraction", "fraction of samples trained on"),
]
Rows = list[dict[str, float]]


def prime_train(*args: str) -> None:
    """Run `prime-train run ARGS` in this interpreter; stop the script if it fails."""
    cmd = [sys.executable, "-m", "prime_train", "run", *args]
    print("$ prime-train run " + " ".join(args), flush=True)
    done = subprocess.run(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"prime-train exited {done.returncode}:\n{done.stderr[-2000:]}")


def ensure_sft(workdir: Path) -> Path:
    """The 60-step SFT model in workdir, trained now if it is not there."""
    final = workdir / "sft60" / "final"
    if not final.is_dir():
        prime_train("--train.max_steps", "60", "--run.output_dir", str(workdir), "--run.name", "sft60")
    return final


def run_variant(name: str, sft: Path, workdir: Path) -> float | None:
    """Train one variant; returns its wall time in seconds, None when a finished run was reused."""
    if (workdir / name / "final").is_dir():
        return None
    t0 = time.perf_counter()
    prime_train(
        str(CONFIG),
        *("--model.path", str(sft), "--run.output_dir", str(workdir), "--run.name", name),
        *("--logging.tensorboard", "false", *VARIANTS[name]),
    )
    return time.perf_counter() - t0


def read_metrics(path: Path) -> Rows:
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["step"])


def series(rows: Rows, key: str) -> tuple[list[int], list[float]]:
    points = [(int(r["step"]), float(r[key])) for r in rows if r.get(key) is not None]
    return [s for s, _ in points], [v for _, v in points]


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary(name: str, rows: Rows, seconds: float | None) -> str:
    _, reward = series(rows, "reward")
    _, passed = series(rows, "eval_pass_rate")
    clip, kl = series(rows, "clip_fraction")[1], series(rows, "kl")[1]
    took = "reused" if seconds is None else f"{seconds:.0f} s"
    return (
        f"{name:<16} {mean(reward[:10]):.3f} -> {mean(reward[-10:]):.3f}   "
        f"{passed[0] if passed else float('nan'):.3f} -> {passed[-1] if passed else float('nan'):.3f}   "
        f"{max(clip, default=0.0):>8.4f} {max(kl, default=0.0):>8.4f}   {took}"
    )


def plot(runs: dict[str, Rows], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(18, 8), constrained_layout=True)
    for ax, (key, title) in zip(axes.flat, PANELS, strict=True):
        flat = []  # variants at 0 all along: their lines lie under one another, so the panel names them
        for name, rows in runs.items():
            steps, values = series(rows, key)
            sparse = key.startswith("eval_") or len(steps) < 10  # eval every 10 steps; mismatch on some steps
            ax.plot(steps, values, marker="o" if sparse else None, markersize=4, label=name)
            if values and not any(values):
                flat.append(name)
        ax.set_title(title, fontsize=11)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        if flat:
            ax.text(0.02, 0.97, "0 throughout: " + ", ".join(flat), transform=ax.transAxes, va="top", fontsize=9)
        if key == "logprob_mismatch":
            ax.set_yscale("log")
    axes.flat[0].legend(fontsize=9)
    fig.suptitle(
        "GRPO on reverse-text (prime_train/configs/tiny-rl.toml) from the 60-step SFT model: scripts/rl_curves.py"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--workdir", type=Path, help="Where the runs go; default: a new temporary directory.")
    parser.add_argument("--sft", type=Path, help="An SFT model (<run>/final); default: train one (60 steps).")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images" / "rl-tiny.png", help="The PNG.")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("rl_curves.py needs matplotlib: pip install matplotlib")

    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="rl-curves-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    sft = args.sft.resolve() if args.sft else ensure_sft(workdir)
    if not (sft / "config.json").is_file():
        sys.exit(f"--sft {sft}: not a model directory (expected <run>/final with config.json)")

    runs: dict[str, Rows] = {}
    lines = []
    for name in args.variants:
        seconds = run_variant(name, sft, workdir)
        runs[name] = read_metrics(workdir / name / "metrics.jsonl")
        lines.append(summary(name, runs[name], seconds))
    plot(runs, args.out)
    head = f"{'variant':<16} {'reward (first/last 10)':<22} {'eval pass rate':<17} {'max clip':>8} {'max kl':>8}"
    print(f"\n{head}   time")
    print("\n".join(lines))
    print(f"\nruns in {workdir}\nfigure: {args.out}")


if __name__ == "__main__":
    main()
