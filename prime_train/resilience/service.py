"""The run service: what `prime-train run` and `prime-train train` do between a loaded config and an exit code.

Both commands take the same first steps, in this order:

1. own the run directory (kit/ownership.py): a second owner is refused (`RunRefused`, 78), and what a killed
   owner left running is ended before anything starts;
2. decide what running again means (resilience/rerun.py), now that what the directory holds cannot change under
   the decision: a --fresh cut short is finished first, a finished run is not run again unasked, --fresh
   that would not start over is refused (78);
3. with --fresh, set the old run's outputs aside into previous/<time>/.

Then `RunService.supervise` (`run`) runs preflight before step 3 (a refused run moves nothing), records the
set-aside in events.jsonl, and runs the supervisor with its restarts until the run ends: the first SIGINT or
SIGTERM asks for a checkpoint and a clean stop, a second Ctrl-C stops at once (still 75). `RunService.train`
(`train`) writes the resolved config and runs the engine in the foreground, with the environment a supervised
attempt gets (launch.job_environment), SIGTERM passed on to it; its exit code is the job's.

Nothing here prints: what there is to say goes to a `Reporter` (the CLI's console, cli/run.py), what the run
came to is a `RunOutcome`, and a run that cannot start raises `RunRefused` with its message and exit code.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from prime_train.config.schema import Config
from prime_train.contract import Event, ExitCode, SupervisorState, read_heartbeat
from prime_train.kit.events import EventLog
from prime_train.kit.ownership import claim_run_dir, end_orphans, record_processes, supervisor_token
from prime_train.kit.redact import Redactor
from prime_train.launch import job_environment, job_exit_code, plan_engine_launch, write_run_config
from prime_train.resilience.goodput import goodput
from prime_train.resilience.rerun import (
    ConfigDrift,
    Rerun,
    RerunRefused,
    config_drift,
    describe_set_aside,
    finish_set_aside,
    plan_rerun,
    set_aside,
)
from prime_train.rundir import RunDir, RunDirBusy

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from prime_train.resilience.supervisor import Observer, Supervisor


class RunRefused(Exception):
    """The run cannot start: the message says why, `code` is the exit code (78 a configuration error: another
    owner, an unsafe run directory, --fresh that would not start over; 1 when the old run cannot be moved aside)."""

    def __init__(self, message: object, code: int):
        super().__init__(str(message))
        self.code = int(code)


@dataclass(frozen=True)
class RunRequest:
    """What was asked besides the config."""

    fresh: bool = False  # --fresh: start over, the old run's outputs moved to previous/<time>/ first
    resume: bool = False  # --resume: train a finished run on (after raising train.max_steps)
    skip_preflight: bool = False  # run: launch even if preflight fails
    verbose_inference: bool = False  # run: stream the inference workers' logs whole
    own_signals: bool = True  # run: SIGINT/SIGTERM stop this run; False when a caller (a sweep) owns them
    stop_at_step: int | None = None  # a sweep's PBT round: the job stops with a checkpoint at this step (75)


def _silent(_: str) -> None:
    pass


def _preflight(cfg: Config) -> int:
    from prime_train.validator.preflight import preflight_command

    return preflight_command(cfg, quiet_pass=True)


@dataclass
class Reporter:
    """What the service has to say as it goes; the CLI prints it (cli/run.py). The defaults say nothing."""

    say: Callable[[str], None] = _silent  # a line of its own: the rerun decision, what --fresh moved
    starting: Callable[[str], None] = _silent  # the supervisor starts now, in this run directory (cfg.run_dir)
    preflight: Callable[[Config], int] = _preflight  # preflight, shown as the caller likes: its exit code
    observer: Observer | None = None  # the supervisor's own reports: status, log findings, messages
    live: AbstractContextManager[Any] = field(default_factory=contextlib.nullcontext)  # held while it runs


@dataclass
class RunOutcome:
    """What `run` or `train` came to."""

    exit_code: int
    run_dir: str  # the config's run directory (cfg.run_dir), or the supervisor's when it ran
    launched: bool = True  # False: nothing ran (a finished run not asked to go on, or a failed preflight)
    message: str | None = None  # the rerun decision, as said (a finished run: where its model is)
    preflight_failed: bool = False
    supervisor: Supervisor | None = None  # `run`'s supervisor once it ran: its state and attempts (the summary)
    results: list[str] = field(default_factory=list)  # the final figures and where the model is, a line each

    def to_dict(self) -> dict[str, Any]:
        """`run --json`'s document: how the run ended, each attempt, and the final figures."""
        ok = self.exit_code == ExitCode.OK
        if not self.launched:
            return {"ok": ok, "launched": False, "run_dir": self.run_dir, "message": self.message}
        sup = self.supervisor
        if sup is None:
            return {"ok": ok, "exit_code": int(self.exit_code), "run_dir": self.run_dir}
        attempts = [
            {
                "attempt": a.number,
                "exit_code": a.exit_code,
                "first_step": a.resumed_from if a.resumed_from is not None else a.first_step,
                "last_step": a.last_step,
                "failure": sup.redactor.value(a.failure.to_dict()) if a.failure else None,  # log lines may hold secrets
            }
            for a in sup.attempts
        ]
        return {
            "ok": ok, "exit_code": int(self.exit_code), "state": sup.state, "run_dir": self.run_dir,
            "attempts": attempts, "results": self.results, "goodput": goodput(sup.run_dir),
        }  # fmt: skip


class RunService:
    """One config's run, supervised (`supervise`, `prime-train run`) or in the foreground (`train`, `prime-train
    train`): the same claim of the run directory, the same rerun decision, the same --fresh."""

    def __init__(self, cfg: Config, request: RunRequest | None = None, reporter: Reporter | None = None):
        self.cfg = cfg
        self.request = request or RunRequest()
        self.reporter = reporter or Reporter()
        self.supervisor: Supervisor | None = None  # `supervise`'s, once made: what `request_stop` reaches
        self._stop_reason: str | None = None
        self._drift: ConfigDrift | None = None

    def request_stop(self, reason: str) -> None:
        """Checkpoint and stop (75), from any thread: now if the supervisor runs, else as soon as it is made."""
        self._stop_reason = reason
        if self.supervisor is not None:
            self.supervisor.request_stop(reason)

    # ------------------------------------------------------------------ prime-train run

    def supervise(self) -> RunOutcome:
        """Claim, decide, preflight, set the old run aside (--fresh), then the supervisor until the run ends."""
        from prime_train.resilience.supervisor import Supervisor, SupervisorOptions

        self._drift = self._config_drift()  # before the supervisor is built: it runs the config this settles
        options = SupervisorOptions(
            verbose_inference=self.request.verbose_inference, stop_at_step=self.request.stop_at_step
        )
        sup = Supervisor(self.cfg, self.reporter.observer, options)
        self.supervisor = sup
        if self._stop_reason is not None:  # asked before the supervisor existed
            sup.request_stop(self._stop_reason)
        try:
            # before preflight: a second run into this directory is refused at once, and an orphaned job of a killed
            # supervisor is ended before preflight counts its ports and GPU memory as taken
            with _refused_when_busy():
                sup.claim()
        except OSError:
            pass  # the run directory cannot be made: preflight says why (sup.run() claims again, or fails the same way)
        try:
            prepared = self._prepare(sup)
        except BaseException:
            _release(sup)
            raise
        if isinstance(prepared, RunOutcome):
            _release(sup)
            return prepared
        return self._watch(sup, started=prepared)

    def _prepare(self, sup: Supervisor) -> RunOutcome | float:
        """Before the supervisor runs: the decision, preflight, and the old run set aside. An outcome when nothing
        is to run; else when this run started (a final/ written since is this run's model)."""
        owned = sup.lock is not None
        events = EventLog(sup.run_dir.events_path, sup.redactor) if owned else None
        rerun = self._decide(sup.run_dir, events, finish=owned)
        if not rerun.launch:
            return RunOutcome(ExitCode.OK, str(self.cfg.run_dir), launched=False, message=rerun.message)
        self._say_drift(events)
        started = time.time()
        if not self.request.skip_preflight:
            code = self.reporter.preflight(self.cfg)
            if code != ExitCode.OK:
                return RunOutcome(
                    code, str(self.cfg.run_dir), launched=False, message=rerun.message, preflight_failed=True
                )
        if self.request.fresh:  # after preflight: a refused run moves nothing
            events = EventLog(sup.run_dir.events_path, sup.redactor)
            moved = self._set_aside(sup.run_dir, events)
            if moved is not None:
                sup.run_dir.create()
                events.emit(Event.RUN_SET_ASIDE, moved_to=str(moved[0]), moved=moved[1])
        return started

    def _watch(self, sup: Supervisor, *, started: float) -> RunOutcome:
        """The supervisor until the run ends (it releases the run directory itself), then what it came to."""
        from prime_train.resilience.console import final_results

        self.reporter.starting(str(self.cfg.run_dir))
        with self.reporter.live:
            if self.request.own_signals:
                _stop_on_signals(sup)
            code = sup.run()
        written_since = started if sup.state == SupervisorState.DONE else None
        results = final_results(sup.run_dir, written_since=written_since)
        return RunOutcome(code, str(sup.run_dir.root), supervisor=sup, results=results)

    # ------------------------------------------------------------------ prime-train train

    def train(self) -> RunOutcome:
        """Claim, decide, set the old run aside (--fresh), then the engine in the foreground until it exits."""
        run_dir = self.cfg.layout
        with _refused_when_busy():
            lock = claim_run_dir(run_dir, "prime-train train")
        with lock:
            end_orphans(run_dir, self.cfg.supervisor.term_grace_s)
            self._drift = self._config_drift()
            rerun = self._decide(run_dir, None)
            if not rerun.launch:
                return RunOutcome(ExitCode.OK, str(self.cfg.run_dir), launched=False, message=rerun.message)
            self._say_drift(EventLog(run_dir.events_path, Redactor.for_run(self.cfg)) if self._drift else None)
            if self.request.fresh:
                self._set_aside(run_dir, None)
            return RunOutcome(self._train_in_foreground(), str(run_dir.root), message=rerun.message)

    def _train_in_foreground(self) -> int:
        """Write the config and train: SIGTERM is passed on so the job checkpoints and exits 75; Ctrl-C reaches it
        through the terminal's process group. The job stops when this process is gone (PRIME_TRAIN_SUPERVISOR)."""
        run_dir = write_run_config(self.cfg)
        plan = plan_engine_launch(self.cfg, str(run_dir.config_path))
        # `train` has no restarts: its one attempt is attempt 1
        env = job_environment(self.cfg, run_dir, attempt=1, supervisor_token=supervisor_token(), launch_env=plan.env)
        started = time.time()
        child = subprocess.Popen(plan.argv, env={**os.environ, **env})
        with contextlib.suppress(psutil.Error):
            record_processes(run_dir, {"trainer": [psutil.Process(child.pid)]})

        def forward(signum, frame):
            child.send_signal(signum)

        # Ctrl-C reaches the child through the terminal's process group; we only have to outlive it
        previous = {s: signal.signal(s, h) for s, h in ((signal.SIGTERM, forward), (signal.SIGINT, signal.SIG_IGN))}
        try:
            returncode = child.wait()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        record_processes(run_dir, {})
        return job_exit_code(returncode, read_heartbeat(run_dir.progress_path), started)

    # ------------------------------------------------------------------ the steps both take

    def _config_drift(self) -> ConfigDrift | None:
        """The run directory's config.toml against this config (resilience/rerun.py); the config to run becomes
        the run's own where a stopped run resumes without --resume."""
        drift = config_drift(self.cfg, fresh=self.request.fresh, resume=self.request.resume)
        if drift is not None:
            self.cfg = drift.cfg
        return drift

    def _say_drift(self, events: EventLog | None) -> None:
        """What differs from the run's config.toml, said and recorded, once the run is going to launch."""
        drift = self._drift
        if drift is None:
            return
        self.reporter.say(drift.describe())
        if events is not None:
            events.emit(Event.CONFIG_CHANGED, **drift.event_fields())

    def _decide(self, run_dir: RunDir, events: EventLog | None, *, finish: bool = True) -> Rerun:
        """Launch or not (resilience/rerun.py), said; call it owning the run directory. A --fresh killed part way
        is finished first (with `finish`): half its old outputs must not read as this run's."""
        if finish:
            self._finish_interrupted_set_aside(run_dir, events)
        try:
            rerun = plan_rerun(self.cfg, fresh=self.request.fresh, resume=self.request.resume)
        except RerunRefused as exc:  # --fresh that would not start over: a configuration error
            raise RunRefused(exc, ExitCode.CONFIG) from None
        if rerun.message:
            self.reporter.say(rerun.message)
        return rerun

    def _set_aside(self, run_dir: RunDir, events: EventLog | None) -> tuple[Path, list[str]] | None:
        """--fresh: the old run's outputs into previous/<time>/, said; RunRefused when they cannot move.

        With `events`, the intent is in events.jsonl before the first rename (and the journal in the run directory
        says the same): a supervisor killed part way leaves a move the next start finishes."""

        def record(dest: Path, names: list[str]) -> None:
            if events is not None:
                events.emit(Event.RUN_SET_ASIDE_STARTED, moving_to=str(dest), moving=names)

        try:
            moved = set_aside(run_dir, record=record)
        except (OSError, ValueError) as exc:
            raise RunRefused(
                f"--fresh: cannot move the old run aside in {run_dir.root}: {exc}", ExitCode.FAILED
            ) from None
        if moved is not None:
            self.reporter.say(describe_set_aside(*moved))
        return moved

    def _finish_interrupted_set_aside(self, run_dir: RunDir, events: EventLog | None) -> None:
        """A --fresh that was killed part way (its journal is still there): finish moving the old run aside, said,
        before anything reads the run directory; RunRefused when it cannot be finished."""
        try:
            moved = finish_set_aside(run_dir)
        except (OSError, ValueError) as exc:
            raise RunRefused(
                f"an earlier --fresh was interrupted while moving the old run aside in {run_dir.root}, and its move "
                f"cannot be finished: {exc}",
                ExitCode.FAILED,
            ) from None
        if moved is None:
            return
        dest, names = moved
        self.reporter.say(
            f"an earlier --fresh was interrupted while it moved the old run aside: finished moving its "
            f"{', '.join(names)} to {dest}; this run starts over"
        )
        if events is not None:
            events.emit(Event.RUN_SET_ASIDE, moved_to=str(dest), moved=names, finished_after_interruption=True)


@contextlib.contextmanager
def _refused_when_busy() -> Iterator[None]:
    """Another live owner, or symlinks where prime-train writes (rundir.RunDirBusy): a configuration error."""
    try:
        yield
    except RunDirBusy as exc:
        raise RunRefused(exc, ExitCode.CONFIG) from None


def _stop_on_signals(sup: Supervisor) -> None:
    """The first SIGINT/SIGTERM asks for a checkpoint and a clean stop; a second Ctrl-C stops waiting for it: the
    job is killed now and the run still ends as stopped (75), with supervisor.json saying so."""
    interrupts = 0

    def on_signal(signum, frame):
        # never an exception here: one raised at an arbitrary point of the supervisor would leave its record "running"
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1 and signum == signal.SIGINT:
            sup.request_stop("a second Ctrl-C", now=True)
            return
        sup.request_stop("Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def _release(sup: Supervisor) -> None:
    """Give the run directory back when `run` ends before the supervisor runs (it releases it itself after)."""
    if sup.lock is not None:
        sup.lock.release()
