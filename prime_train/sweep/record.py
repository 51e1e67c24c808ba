"""What a sweep leaves in its directory for people and for `prime-train status`: sweep.json (every trial of the
study: parameters, state, step, value), best.toml (the best trial's run config, runnable), sweep.png (the metric
against each parameter and over the trials)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from prime_train.contract import read_heartbeat, read_json, replace_file_atomic, write_json_atomic
from prime_train.sweep.spec import SWEEP_RECORD, SweepSpec
from prime_train.sweep.study import shown_url
from prime_train.sweep.trial import TrialRun, trial_name

BEST = "best.toml"
PLOT = "sweep.png"
STATES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running", "WAITING": "waiting"}


def shown_storage(url: str) -> str:
    return shown_url(url)


def trial_params(t) -> dict[str, Any]:
    """A trial's parameters as it ended: PBT's explored values where it changed them."""
    final = t.user_attrs.get("params_final")
    return dict(final) if isinstance(final, dict) else dict(t.params)


def study_rows(spec: SweepSpec, study, runs: dict[int, TrialRun]) -> list[dict[str, Any]]:
    """Every trial of the study, this process's (`runs`) or not, with the step its run directory's heartbeat
    reached."""
    rows = []
    for t in study.get_trials(deepcopy=False):
        run_dir = spec.sweep_dir / trial_name(t.number)
        heartbeat = read_heartbeat(run_dir / "progress.json")
        mine = runs.get(t.number)
        state = STATES.get(t.state.name, t.state.name.lower())
        if state == "running" and mine is not None and mine.state == "interrupted":
            state = "interrupted"
        elif state == "running" and mine is None:
            state = "running elsewhere"
        rows.append(
            {
                "trial": t.number, "params": trial_params(t), "state": state,
                "step": heartbeat.step if heartbeat is not None else None,
                "value": t.value if t.value is not None else _last(t.intermediate_values),
                "failure": t.user_attrs.get("failure"), "run_dir": str(run_dir),
            }
        )  # fmt: skip
    return rows


def _last(values: dict[int, float]) -> float | None:
    """A pruned or running trial's newest reported value."""
    return values[max(values)] if values else None


def _best(study):
    try:
        return study.best_trial
    except ValueError:  # no complete trial yet
        return None


def save(spec: SweepSpec, study, storage: str, runs: dict[int, TrialRun]) -> None:
    """sweep.json, rewritten atomically: what `prime-train status SWEEP_DIR` shows."""
    s = spec.section
    best = _best(study)
    doc = {
        "name": s.name, "spec": str(spec.path), "metric": s.metric, "direction": s.direction,
        "sampler": s.sampler, "pruner": s.pruner, "trials_wanted": s.trials,
        "storage": shown_storage(storage), "trials": study_rows(spec, study, runs),
        "best": {"trial": best.number, "value": best.value, "params": trial_params(best)} if best else None,
    }  # fmt: skip
    write_json_atomic(spec.sweep_dir / SWEEP_RECORD, doc)


def write_best(spec: SweepSpec, study) -> tuple[dict[str, Any] | None, str | None]:
    """best.toml: the keys the base config and the sweep set, with the best trial's parameters: a run config as
    short as the base (secret values as ***), checked as a run would check it."""
    import tomli_w

    from prime_train.config.loader import load_raw
    from prime_train.kit.redact import Redactor
    from prime_train.validator.lint import load_checked

    best = _best(study)
    if best is None:
        return None, None
    params = trial_params(best)
    overrides = [*spec.run_overrides(params), "--run.name", f"{spec.section.name}-best"]
    cfg = load_checked([str(spec.base_path)], overrides)  # a config the trials' checks refuse is never written
    data, _ = load_raw([str(spec.base_path)], overrides)
    header = (
        f"# the best trial of sweep {spec.section.name!r}: trial {best.number}, "
        f"{spec.section.metric} = {best.value:.6g}\n# run it: prime-train run {spec.sweep_dir / BEST}\n"
    )
    text = header + tomli_w.dumps(Redactor.for_run(cfg).value(data))
    path = spec.sweep_dir / BEST
    replace_file_atomic(path, text.encode(), mode=0o644)
    return {"trial": best.number, "value": best.value, "params": params}, str(path)


def write_plot(spec: SweepSpec, study, runs: dict[int, TrialRun]) -> tuple[str | None, str | None]:
    """sweep.png with matplotlib (the `sweep` extra): (its path, None), or (None, why there is none)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, "no plot: matplotlib is not installed (pip install 'prime-train[sweep]')"
    rows = [
        r for r in study_rows(spec, study, runs) if isinstance(r["value"], int | float) and math.isfinite(r["value"])
    ]
    if not rows:
        return None, "no plot: no trial has a value yet"
    space = spec.section.space
    metric = spec.section.metric
    fig, axes = plt.subplots(1, len(space) + 1, figsize=(4 * (len(space) + 1), 3.4), squeeze=False)
    for ax, (key, p) in zip(axes[0], space.items(), strict=False):
        xs = [r["params"].get(key) for r in rows]
        numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x in xs)
        ax.scatter(xs if numeric else [str(x) for x in xs], [r["value"] for r in rows], c=_colors(rows))
        if p.log and numeric:
            ax.set_xscale("log")
        ax.set_xlabel(key)
        ax.set_ylabel(metric)
    ax = axes[0][-1]
    ax.scatter([r["trial"] for r in rows], [r["value"] for r in rows], c=_colors(rows))
    pick = min if spec.section.direction == "minimize" else max
    trials, best_so_far = [], []
    for r in sorted((r for r in rows if r["state"] == "complete"), key=lambda r: r["trial"]):
        trials.append(r["trial"])
        best_so_far.append(r["value"] if not best_so_far else pick(best_so_far[-1], r["value"]))
    if trials:
        ax.step(trials, best_so_far, where="post", color="black", label="best so far")
        ax.legend(fontsize="small")
    ax.set_xlabel("trial")
    ax.set_ylabel(metric)
    fig.suptitle(f"sweep {spec.section.name}: blue complete, orange pruned (last value)", fontsize="small")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    path = spec.sweep_dir / PLOT
    replace_file_atomic(path, buf.getvalue(), mode=0o644)
    return str(path), None


def _colors(rows: list[dict[str, Any]]) -> list[str]:
    return ["tab:blue" if r["state"] == "complete" else "tab:orange" for r in rows]


def trial_line(run: TrialRun, metric: str) -> str:
    params = ", ".join(f"{k}={_fmt(v)}" for k, v in run.params.items())
    what = f"{metric} {_fmt(run.value)}" if run.value is not None else "no value"
    tail = f" ({run.failure})" if run.failure else ""
    return f"trial {run.number} {run.state} at step {run.step}: {what}; {params}{tail}"


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


# ---------------------------------------------------------------- status


def sweep_status(path: Path) -> dict[str, Any]:
    """`prime-train status SWEEP_DIR`: the sweep's record, each trial's step refreshed from its heartbeat."""
    doc = read_json(path / SWEEP_RECORD) or {}
    for row in doc.get("trials", []):
        heartbeat = read_heartbeat(path / trial_name(int(row.get("trial", -1))) / "progress.json")
        if heartbeat is not None:
            row["step"] = heartbeat.step
    doc["sweep_dir"] = str(path)
    return json.loads(json.dumps(doc, default=str))
