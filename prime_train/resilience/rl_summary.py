"""An RL run's reward and pass rate, start against end, read back from its metrics.jsonl.

The GRPO job (rl/train.py) logs per step the sampled `reward` and `pass_rate` (the share of completions
with reward 1), and at eval steps the greedy `eval_reward` and `eval_pass_rate` on held-out prompts. A
single step's sampled figures are noisy (a few hundred completions), so start and end are means over
`window` steps; the eval figures are taken as they are, first eval against last. `prime-train status`
shows the rows of `status_rows` (with each curve as a sparkline), the end of `prime-train run` the table of
`summary_lines`.
Torch-free; a file of any shape reads without an exception, and one of any size within bounds (bounded.records).
"""

from __future__ import annotations

import math
import os
from typing import Any

from prime_train.kit import bounded

# steps averaged at each end of the sampled curves: the measure ("last 10 steps minus the first 10")
WINDOW = 10
SAMPLED = ("reward", "pass_rate")
GREEDY = ("eval_reward", "eval_pass_rate")
LABELS = {
    "reward": "reward (sampled)",
    "pass_rate": "pass rate (sampled)",
    "eval_reward": "eval reward (greedy)",
    "eval_pass_rate": "eval pass rate (greedy)",
}


# the curve status draws: at most this many points, each the mean of its share of the steps
CURVE_POINTS = 24
SPARK = "▁▂▃▄▅▆▇█"


def _binned(points: list[tuple[int, float]], n: int = CURVE_POINTS) -> list[float]:
    """The curve's values in at most `n` points: all of them, or `n` means of consecutive runs of steps."""
    values = [v for _, v in points]
    if len(values) <= n:
        return values
    return [_mean(points[i * len(values) // n : (i + 1) * len(values) // n]) for i in range(n)]


def sparkline(values: list[float]) -> str:
    """The curve as a line of block characters, lowest to highest of its own range (flat: the lowest)."""
    if not values:
        return ""
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        return SPARK[0] * len(values)
    top = len(SPARK) - 1
    return "".join(SPARK[min(top, int((v - lo) / (hi - lo) * len(SPARK)))] for v in values)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def read_curves(
    metrics_path: str | os.PathLike[str], notes: list[str] | None = None
) -> dict[str, list[tuple[int, float]]]:
    """(step, value) of each RL curve in metrics.jsonl, in step order; a step logged twice keeps its last value.
    A huge metrics.jsonl is read at its head and its end, a huge line skipped (said in `notes`)."""
    by_step: dict[str, dict[int, float]] = {key: {} for key in (*SAMPLED, *GREEDY)}
    for record in bounded.records(metrics_path, notes, contains=(b"reward", b"pass_rate")):
        step = record.get("step")
        if not isinstance(step, int) or isinstance(step, bool):
            continue
        for key, points in by_step.items():
            value = _number(record.get(key))
            if value is not None:
                points[step] = value
    return {key: sorted(points.items()) for key, points in by_step.items()}


def _mean(points: list[tuple[int, float]]) -> float:
    return sum(v for _, v in points) / len(points)


def rl_summary(
    metrics_path: str | os.PathLike[str], window: int = WINDOW, notes: list[str] | None = None
) -> dict[str, dict] | None:
    """Start, end, change and latest value of each RL curve; None when the run logged no reward (not RL).

    Sampled curves: start and end are the means of the first and last `window` steps (fewer when the run has
    under 2 x window steps, so the two never overlap). Greedy eval curves: the first and the last eval.
    """
    curves = read_curves(metrics_path, notes)
    if not curves["reward"]:
        return None
    out: dict[str, dict] = {}
    for key in SAMPLED:
        points = curves[key]
        if not points:
            continue
        n = max(1, min(window, len(points) // 2))
        start, end = _mean(points[:n]), _mean(points[-n:])
        out[key] = {
            "start": start, "end": end, "change": end - start, "latest": points[-1][1], "latest_step": points[-1][0],
            "steps": n, "curve": _binned(points),
        }  # fmt: skip
    for key in GREEDY:
        points = curves[key]
        if points:
            (first_step, start), (last_step, end) = points[0], points[-1]
            out[key] = {
                "start": start, "end": end, "change": end - start, "latest": end, "latest_step": last_step,
                "start_step": first_step, "curve": _binned(points),
            }  # fmt: skip
    return out


def _trend(change: float) -> str:
    # within a percent either way a 10-step mean of a few hundred samples cannot tell up from down
    return "flat" if abs(change) < 0.01 else ("up" if change > 0 else "down")


def status_rows(summary: dict[str, dict] | None) -> list[tuple[str, str]]:
    """Rows for `prime-train status`: each curve's latest value, its change since the start of the run (sampled:
    mean of the last `window` steps against the first; greedy: last eval against the first), and the curve itself
    as a sparkline with its range."""
    rows = []
    for key, figures in (summary or {}).items():
        trend = f"{_trend(figures['change'])} {figures['change']:+.3f} since the start"
        row = f"{figures['latest']:.3f} at step {figures['latest_step']}, {trend}"
        curve = figures.get("curve") or []
        if len(curve) >= 2:
            # the curve is binned means; the range also holds the latest value the row starts with
            lo, hi = min(*curve, figures["latest"]), max(*curve, figures["latest"])
            row += f"  {sparkline(curve)} {lo:.2f}-{hi:.2f}"
        rows.append((LABELS[key], row))
    return rows


def summary_lines(summary: dict[str, dict] | None) -> list[str]:
    """The end-of-run table: each RL curve at the start and at the end of the run, and the change."""
    if not summary:
        return []
    width = max(len(LABELS[key]) for key in summary)
    lines = [f"{'RL':<{width}}  {'start':>7}  {'end':>7}  {'change':>7}"]
    for key, figures in summary.items():
        lines.append(
            f"{LABELS[key]:<{width}}  {figures['start']:>7.3f}  {figures['end']:>7.3f}  {figures['change']:>+7.3f}"
        )
    sampled = summary.get("reward", {}).get("steps")
    if sampled:
        lines.append(f"(sampled: mean of the first and last {sampled} steps; greedy: first and last eval)")
    return lines
