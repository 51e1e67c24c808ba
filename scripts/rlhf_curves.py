"""Plot the tiny RLHF pipeline's curves from its runs' metrics.jsonl (issue 29; docs/rlhf.md).

    pip install matplotlib
    python scripts/rlhf_curves.py --runs /tmp/rlhf/runs --out docs/images/rlhf-tiny.png

It reads, under --runs, the run directories docs/rlhf.md's commands make: `rm` (the reward model), `dpo`, and any
RL runs against the reward model named on the command line (--rl, default the page's four), and draws four panels:
the reward model's held-out preference accuracy, DPO's held-out preference accuracy and SFT loss, the RL runs'
greedy reward-model score and their greedy exact-match pass rate. It trains nothing; a run that is missing is left out
of its panel and named on stderr. A table of each run's first and last values goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RL_RUNS = ("rmrl-kl0", "g-lr2e4", "g-rule5", "ppo-rule5")


def rows(run: Path) -> list[dict]:
    """The metrics.jsonl rows of `run`, [] when it has none (named on stderr)."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        print(f"no {path}: left out", file=sys.stderr)
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            out.append(row)
    return out


def series(data: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have `key`."""
    picked = [(r["step"], float(r[key])) for r in data if isinstance(r.get(key), int | float)]
    return [s for s, _ in picked], [v for _, v in picked]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=Path, required=True, help="The output_dir the pipeline's runs are in.")
    parser.add_argument("--rl", nargs="*", default=list(RL_RUNS), help="RL run names to draw.")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "images" / "rlhf-tiny.png", help="The PNG.")
    args = parser.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1

    panels = [
        ("reward model: held-out pair accuracy", [("rm", "eval_preference_accuracy")]),
        ("DPO: held-out pair accuracy and SFT loss", [("dpo", "eval_preference_accuracy"), ("dpo", "eval_loss")]),
        ("RL against the reward model: greedy score", [(name, "eval_reward") for name in args.rl]),
        ("RL: greedy exact-match pass rate", [(name, "eval_pass_rate") for name in args.rl]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6))
    for ax, (title, lines) in zip(axes, panels, strict=True):
        for name, key in lines:
            steps, values = series(rows(args.runs / name), key)
            if steps:
                ax.plot(steps, values, marker="o", markersize=3, label=f"{name} {key}")
                first, last = f"step {steps[0]:>4} {values[0]:8.3f}", f"step {steps[-1]:>4} {values[-1]:8.3f}"
                print(f"{name:12s} {key:28s} {first} -> {last}")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
