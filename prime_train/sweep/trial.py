"""One trial of a sweep: a whole supervised run (resilience/service.py: the claim, the rerun decision, preflight,
the supervisor and its restarts) in its own run directory under the sweep directory, with its metric followed in
metrics.jsonl as the run writes it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_train.contract import ExitCode, read_heartbeat
from prime_train.resilience.service import Reporter, RunOutcome, RunRefused, RunRequest, RunService
from prime_train.sweep.spec import SweepSpec
from prime_train.sweep.study import HEARTBEAT_S

FOLLOW_S = 0.5


def trial_name(number: int) -> str:
    return f"trial-{number:04d}"


class MetricFollower:
    """New (step, value) pairs of one metrics.jsonl key, read as the file grows (a shorter file is read again)."""

    def __init__(self, path: Path, metric: str):
        self.path, self.metric = path, metric
        self._offset = 0
        self._partial = b""
        self.values: list[tuple[int, float]] = []

    def poll(self) -> list[tuple[int, float]]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(0, 2)
                if fh.tell() < self._offset:  # rewritten: read it whole again
                    self._offset, self._partial = 0, b""
                fh.seek(self._offset)
                chunk = fh.read(1 << 22)
                self._offset = fh.tell()
        except OSError:
            return []
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        new = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            value, step = row.get(self.metric), row.get("step")
            if isinstance(step, int) and isinstance(value, int | float) and not isinstance(value, bool):
                new.append((step, float(value)))
        self.values += new
        return new


def final_value(values: list[tuple[int, float]], report: str, direction: str) -> float | None:
    """A trial's value: its metric's last value, or its best (per direction)."""
    if not values:
        return None
    if report == "last":
        return values[-1][1]
    return (min if direction == "minimize" else max)(v for _, v in values)


@dataclass
class TrialRun:
    """A trial as this process runs it: what the live table and the study are told."""

    number: int
    params: dict[str, Any]
    run_dir: Path
    state: str = "starting"  # starting | running | complete | pruned | failed | interrupted | busy
    step: int | None = None
    value: float | None = None
    failure: str | None = None
    adopted: bool = False  # an interrupted trial taken over: its run resumes
    service: RunService | None = None
    pruned_at: int | None = None
    stop_at: int | None = None  # PBT: stop this round at this step
    resume_from: str | None = None  # PBT: the copied checkpoint the next round resumes from
    values: list[tuple[int, float]] = field(default_factory=list)
    outcome: RunOutcome | None = None

    def row(self) -> dict[str, Any]:
        return {
            "trial": self.number, "params": self.params, "state": self.state, "step": self.step,
            "value": self.value, "failure": self.failure, "run_dir": str(self.run_dir),
        }  # fmt: skip


def _preflight(say: Callable[[str], None], name: str) -> Callable[[Any], int]:
    """A trial's preflight: its warnings and failures said on one line each, named by the trial; 78 when one fails."""

    def check(cfg) -> int:
        from prime_train.validator.checks import FAIL, PASS
        from prime_train.validator.preflight import run_preflight

        results = run_preflight(cfg)
        for r in results:
            if r.status != PASS:
                say(f"{name}: preflight {r.status}: {r.name}: {r.message}" + (f" ({r.fix})" if r.fix else ""))
        return ExitCode.CONFIG if any(r.status == FAIL for r in results) else ExitCode.OK

    return check


def run_trial(
    spec: SweepSpec,
    run: TrialRun,
    *,
    on_value: Callable[[int, float], bool] | None = None,
    beat: Callable[[], None] | None = None,
    extra: list[str] | None = None,
    say: Callable[[str], None] = print,
) -> None:
    """Run one trial's supervised run to its end; `on_value(step, value)` sees each new metric value and answers
    True to prune (the run is stopped with a checkpoint, 75). Fills in run.state, value, failure."""
    from prime_train.config.loader import ConfigError

    try:
        cfg = spec.trial_config(run.params, run.run_dir.name, extra)
    except ConfigError as exc:
        run.state, run.failure = "failed", f"config: {exc}"
        return
    # resume: the sweep's values are the trial's (PBT's explored ones, its copied checkpoint), never the run dir's old
    # config.toml, which a plain rerun of a stopped run would keep (resilience/rerun.py config_drift)
    # a PBT round ends at an exact step: the engine stops there itself (a stop asked for once the heartbeat showed the
    # step came a step or two late on a loaded machine, and the round's checkpoints were not at its end)
    request = RunRequest(own_signals=False, resume=True, stop_at_step=run.stop_at)
    service = RunService(cfg, request, Reporter(preflight=_preflight(say, run.run_dir.name)))
    run.service = service
    follower = MetricFollower(run.run_dir / "metrics.jsonl", spec.section.metric)
    done = threading.Event()

    def follow() -> None:
        last_beat = 0.0
        while not done.wait(FOLLOW_S):
            heartbeat = read_heartbeat(run.run_dir / "progress.json")
            if heartbeat is not None:
                run.step = heartbeat.step
                run.state = "running"
            for step, value in follower.poll():
                run.values.append((step, value))
                if on_value is not None and run.pruned_at is None and on_value(step, value):
                    run.pruned_at = step
                    service.request_stop(f"pruned by the sweep at step {step}")
            if beat is not None and time.time() - last_beat > HEARTBEAT_S:
                last_beat = time.time()
                beat()

    watcher = threading.Thread(target=follow, name=f"sweep-{run.run_dir.name}", daemon=True)
    watcher.start()
    try:
        outcome = service.supervise()
    except RunRefused as exc:  # another sweep process runs this trial: not ours to judge
        run.state, run.failure = "busy", str(exc)
        return
    finally:
        done.set()
        watcher.join()
    for step, value in follower.poll():
        run.values.append((step, value))
    run.outcome = outcome
    _judge(spec, run, outcome)


def _judge(spec: SweepSpec, run: TrialRun, outcome: RunOutcome) -> None:
    """What the run came to, for the study: complete with its value, pruned, failed with its kind, interrupted."""
    s = spec.section
    values = sorted(dict(run.values).items())  # a resumed run writes some steps again: the newest value counts
    run.value = final_value(values, s.report, s.direction)
    heartbeat = read_heartbeat(run.run_dir / "progress.json")
    if heartbeat is not None:
        run.step = heartbeat.step
    if outcome.preflight_failed:
        run.state, run.failure = "failed", "preflight"
    elif outcome.exit_code == ExitCode.OK:
        if run.value is None:
            run.state, run.failure = "failed", f"metric {s.metric!r} never appeared in metrics.jsonl"
        else:
            run.state = "complete"
    elif outcome.exit_code == ExitCode.PREEMPTED and run.pruned_at is not None:
        run.state = "pruned"
    elif outcome.exit_code == ExitCode.PREEMPTED:
        run.state = "interrupted"  # Ctrl-C, a spot notice, a PBT round: it resumes from its checkpoint
    else:
        sup = outcome.supervisor
        last = sup.attempts[-1].failure if sup is not None and sup.attempts else None
        run.state = "failed"
        run.failure = str(last.kind) if last is not None else f"exit {outcome.exit_code}"
