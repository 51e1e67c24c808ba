"""`prime-train sweep`: an optuna study whose trials are supervised runs, `parallel` at a time.

Each worker thread takes the next trial: first an interrupted one (RUNNING in the study, its owner gone: a
kill -9 of an earlier sweep process), whose run resumes from its checkpoints; else a new one asked of the sampler,
while the study holds fewer than `trials`. The trial's metric goes to the pruner as metrics.jsonl grows; a pruned
trial is stopped with a checkpoint (75) and told PRUNED, a failed one FAIL with its failure kind, a finished one
COMPLETE with its value. A stop (Ctrl-C, SIGTERM) stops every running trial with a checkpoint and leaves it RUNNING
in the study for the next sweep to resume.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prime_train.contract import Event, ExitCode
from prime_train.kit.events import EventLog
from prime_train.sweep import record
from prime_train.sweep.spec import SweepSpec
from prime_train.sweep.study import (
    live_trial,
    open_study,
    owner,
    owner_gone,
    set_trial_attr,
    study_lock,
    suggest,
)
from prime_train.sweep.trial import TrialRun, run_trial, trial_name


@dataclass
class SweepOutcome:
    exit_code: int
    sweep_dir: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    best: dict[str, Any] | None = None
    best_toml: str | None = None
    plot: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.exit_code == ExitCode.OK, "exit_code": int(self.exit_code), "sweep_dir": self.sweep_dir,
            "trials": self.rows, "best": self.best, "best_toml": self.best_toml, "plot": self.plot,
            "notes": self.notes,
        }  # fmt: skip


class Sweep:
    """One sweep process's share of a study."""

    def __init__(self, spec: SweepSpec, storage: str, say: Callable[[str], None] | None = None):
        self.spec = spec
        self.storage = storage
        self.say = say or (lambda _: None)
        self.runs: dict[int, TrialRun] = {}
        self.stopping = threading.Event()
        self.errors: list[str] = []  # what ended a worker thread early
        self._lock = threading.Lock()
        base = spec.trial_config({}, "base")  # the base's schedule sets the pruner's rungs
        self.eval_interval, self.max_steps = base.train.eval_interval, base.train.max_steps
        self.study = None
        self.events = EventLog(spec.sweep_dir / "events.jsonl")  # the sweep's own: trials started, adopted, ended

    # ------------------------------------------------------------------ the sweep

    def open(self) -> None:
        self.spec.sweep_dir.mkdir(parents=True, exist_ok=True)
        self.study = open_study(self.spec, self.storage, self.eval_interval, self.max_steps)
        self.events.emit(Event.SWEEP_STARTED, pid=owner()["pid"], storage=record.shown_storage(self.storage))

    def request_stop(self, reason: str, *, now: bool = False) -> None:
        """Stop every running trial with a checkpoint (`now`: without waiting for it); they stay RUNNING in the
        study and resume next time."""
        self.stopping.set()
        with self._lock:
            running = [r.service for r in self.runs.values() if r.service is not None and r.outcome is None]
        for service in running:
            service.request_stop(reason)
            if now and service.supervisor is not None:
                service.supervisor.request_stop(reason, now=True)

    def run(self, live: Callable[[], None] | None = None) -> SweepOutcome:
        """All the trials this process gets, `parallel` at a time; then the record, best.toml and the plot."""
        self.open()
        workers = self._workers()
        for w in workers:
            w.start()
        while any(w.is_alive() for w in workers):
            if live is not None:
                live()
            for w in workers:
                w.join(timeout=0.5)
            self._save_record()
        return self._finish()

    def _workers(self) -> list[threading.Thread]:
        """The threads that run this process's trials: `parallel` of them, each taking trials one after another."""
        n = self.spec.section.parallel
        return [threading.Thread(target=self._worker, name=f"sweep-worker-{i}", daemon=True) for i in range(n)]

    def _worker(self) -> None:
        while not self.stopping.is_set():
            run = self._next_trial()
            if run is None:
                return
            try:
                self._run(run)
            except Exception as exc:  # a bug, a storage gone away: said, and the trial left RUNNING to resume
                self.errors.append(f"trial {run.number}: {type(exc).__name__}: {exc}")
                self.say(f"error: {self.errors[-1]}; the trial is left to resume on the next run")
                return

    def _next_trial(self) -> TrialRun | None:
        """An interrupted trial to resume, else a new one; None when the study has its trials."""
        import optuna

        with self._lock, study_lock(self.spec.sweep_dir):
            assert self.study is not None
            trials = self.study.get_trials(deepcopy=False)
            for t in trials:
                running = t.state == optuna.trial.TrialState.RUNNING
                if running and t.number not in self.runs and owner_gone(t.user_attrs):
                    set_trial_attr(self.study, t.number, "owner", owner())
                    run = TrialRun(t.number, dict(t.params), self.spec.sweep_dir / trial_name(t.number), adopted=True)
                    self.runs[t.number] = run
                    self.events.emit(Event.SWEEP_TRIAL_ADOPTED, **run.row())
                    return run
            if len(trials) >= self.spec.section.trials or self._grid_done():
                return None
            trial = self.study.ask()
            trial.set_user_attr("owner", owner())
            params = suggest(trial, self.spec)
            run = TrialRun(trial.number, params, self.spec.sweep_dir / trial_name(trial.number))
            self.runs[trial.number] = run
            self.events.emit(Event.SWEEP_TRIAL_STARTED, **run.row())
            return run

    def _grid_done(self) -> bool:
        import optuna

        sampler = self.study.sampler  # type: ignore[union-attr]
        return isinstance(sampler, optuna.samplers.GridSampler) and sampler.is_exhausted(self.study)

    def _run(self, run: TrialRun, extra: list[str] | None = None, *, tell: bool = True) -> None:
        """One trial, start to end, and (with `tell`) what the study is told."""
        trial = live_trial(self.study, run.number)

        def on_value(step: int, value: float) -> bool:
            with warnings.catch_warnings():  # a resumed run reports some steps again: optuna keeps the first
                warnings.simplefilter("ignore")
                trial.report(value, step)
            return trial.should_prune()

        def beat() -> None:
            with contextlib.suppress(Exception):
                trial.set_user_attr("owner", owner())

        run_trial(self.spec, run, on_value=on_value, beat=beat, extra=extra, say=self.say)
        if tell:
            self._tell(run)

    def _tell(self, run: TrialRun) -> None:
        import optuna

        State = optuna.trial.TrialState
        assert self.study is not None
        if run.state == "complete":
            self.study.tell(run.number, run.value)
        elif run.state == "pruned":
            self.study.tell(run.number, state=State.PRUNED)
        elif run.state == "failed":
            set_trial_attr(self.study, run.number, "failure", run.failure)
            self.study.tell(run.number, state=State.FAIL)
        else:  # interrupted or busy: left RUNNING for whoever resumes it
            self.events.emit(Event.SWEEP_TRIAL_INTERRUPTED, **run.row())
            return
        self.events.emit(Event.SWEEP_TRIAL_ENDED, **run.row())
        self.say(record.trial_line(run, self.spec.section.metric))

    # ------------------------------------------------------------------ the record

    def _save_record(self) -> None:
        with contextlib.suppress(Exception):  # the record is for `status`: a failed write must not end the sweep
            record.save(self.spec, self.study, self.storage, self.runs)

    def _finish(self) -> SweepOutcome:
        record.save(self.spec, self.study, self.storage, self.runs)
        # stopped, or a trial left to resume (a spot notice stopped it): 75, run again to go on
        unfinished = self.stopping.is_set() or any(r.state == "interrupted" for r in self.runs.values())
        code = ExitCode.FAILED if self.errors else ExitCode.PREEMPTED if unfinished else ExitCode.OK
        out = SweepOutcome(code, str(self.spec.sweep_dir), notes=list(self.errors))
        out.rows = record.study_rows(self.spec, self.study, self.runs)
        out.best, out.best_toml = record.write_best(self.spec, self.study)
        out.plot, note = record.write_plot(self.spec, self.study, self.runs)
        if note:
            out.notes.append(note)
        self.events.emit(Event.SWEEP_ENDED, exit_code=int(out.exit_code), best=out.best)
        return out


def stop_on_signals(sweep: Sweep) -> None:
    """Ctrl-C or SIGTERM: every running trial checkpoints and stops; a second Ctrl-C stops them without waiting for
    their checkpoints (each resumes from its newest whole one)."""
    interrupts = 0

    def on_signal(signum, frame):
        nonlocal interrupts
        interrupts += 1
        now = interrupts > 1 and signum == signal.SIGINT
        sweep.request_stop("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name, now=now)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
