"""`prime-train run`: preflight, launch, watch, classify, restart — the job's whole life.

Plain Python, never imports torch. It meets the job only in the run directory (prime_train/contract.py,
docs/architecture.md): it reads progress.json and the checkpoints, writes events.jsonl and supervisor.json.

What kind of job it runs is its plan's business (resilience/plan.py), built once from the config: the
supervisor runs every kind the same way. An attempt is: start its processes, watch them (every watcher
through one protocol, kit/observe.py) until a process exits, a watcher gives its verdict or a stop is carried
out, then tear it down and judge what happened.

It owns its run directory for its whole life (kit/ownership.py): a second owner is refused, and
what a killed predecessor left running is ended before anything starts. Its own files never take it
down: on a full disk it keeps its state in memory and writes it again on the next poll.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_train.config.schema import Config
from prime_train.contract import (
    ENV_STOP_AT,
    LIVE_STATES,
    Event,
    ExitCode,
    Heartbeat,
    SupervisorState,
    read_heartbeat,
    replace_file_atomic,
    replace_symlink,
)
from prime_train.kit.events import EventLog
from prime_train.kit.failures import Failure, FailureKind
from prime_train.kit.observe import ForwardStop, Note, Request, RestartWorker, StatusKey, note
from prime_train.kit.ownership import Housekeeper, attempt_numbers, claim_run_dir, end_orphans, record_state
from prime_train.kit.process import ChildProcess, ProcessSpec, Role, log_cap_bytes
from prime_train.kit.redact import Redactor, redact_argv
from prime_train.launch import job_exit_code
from prime_train.resilience.background import Watching
from prime_train.resilience.logscan import Finding, LogScanner
from prime_train.resilience.plan import AttemptContext, JobPlan, plan_for
from prime_train.resilience.policy import RestartPolicy
from prime_train.resilience.verdict import exit_verdict, stop_signal
from prime_train.resilience.watchers import PreemptionWatcher, ProgressSource, ProgressWatcher
from prime_train.rundir import RunLock


@dataclass
class Attempt:
    number: int
    started: float
    ended: float | None = None
    exit_code: int | None = None
    failure: Failure | None = None
    first_step: int | None = None
    last_step: int | None = None
    resumed_from: int | None = None  # the step it started from (0: fresh); the job's heartbeat has the last word
    checkpoint_step_at_end: int | None = None


@dataclass
class _Stopping:
    """An attempt's stop, once forwarded to the job: when it must have exited, and the cloud notice that asked."""

    deadline: float | None = None
    notice: dict[str, Any] | None = None

    @property
    def sent(self) -> bool:
        return self.deadline is not None


@dataclass
class Observer:
    """What the supervisor reports as it goes; the CLI plugs in a rich console."""

    status: Callable[[dict[str, Any]], None] = lambda s: None
    finding: Callable[[Finding], None] = lambda f: None
    message: Callable[[str], None] = lambda m: None


@dataclass
class SupervisorOptions:
    gpu_source: Any = None  # a gpu.GpuSource; None: NVML when available
    preemption: PreemptionWatcher | None = None  # None: on AWS/GCP only, found from DMI
    verbose_inference: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)
    stop_at_step: int | None = None  # the job checkpoints and stops at this step (75): a stop on request, not a failure


class Supervisor:
    def __init__(self, cfg: Config, observer: Observer | None = None, options: SupervisorOptions | None = None):
        self.cfg = cfg
        self.options = options or SupervisorOptions()
        # secrets out of every file it writes and every line it prints: by shape, and by value (the credentials
        # of its environment and of the config)
        extra_env = dict(self.options.extra_env)
        if self.options.stop_at_step is not None:
            extra_env[ENV_STOP_AT] = str(self.options.stop_at_step)  # engine/stopping.py
        self.redactor = Redactor.for_run(cfg, {**os.environ, **extra_env})
        self.plan: JobPlan = plan_for(cfg, redactor=self.redactor, extra_env=extra_env)
        self.run_dir = self.plan.layout  # its checkpoints where ckpt.dir puts them: what the job writes, this watches
        self.observer = _redacting(observer or Observer(), self.redactor)
        self.policy = RestartPolicy(
            cfg.supervisor.max_restarts, cfg.supervisor.backoff_initial_s, cfg.supervisor.backoff_max_s
        )
        self.attempts: list[Attempt] = []
        self.children: list[ChildProcess] = []
        self.findings: list[Finding] = []
        self._findings_lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_now = threading.Event()  # a second Ctrl-C: kill the job now, do not wait for its checkpoint
        self._wake = threading.Event()
        self._stop_reason = ""
        self._scanners: dict[str, LogScanner] = {}
        self._roles: dict[str, Role] = {}
        self._worker_restarts: dict[str, int] = {}
        self._progress_source: ProgressSource | None = None  # the attempt's: it sees every line of its processes
        self.events: EventLog | None = None
        self.state = SupervisorState.STARTING
        self._step_times: list[float] = []
        self._last_status: dict[str, Any] = {}
        self._cloud_notice: dict[str, Any] | None = None
        self._backup = None  # BackupWatcher when the plan backs up to ckpt.remote: one for the whole run
        self.lock: RunLock | None = None  # the run directory is this process's while held (claim)
        self._orphans: list[dict[str, Any]] = []  # what a killed predecessor left running, ended by claim()
        self._attempt_base = 0  # attempts of earlier invocations in this run directory: numbering goes on after them
        self._keeper: Housekeeper | None = None
        self._state_unwritten = False  # supervisor.json could not be written (a full disk): try again each poll

    # ------------------------------------------------------------------ public

    def request_stop(self, reason: str = "signal", *, now: bool = False) -> None:
        """Checkpoint and stop: the trainer gets SIGTERM and exits 75; no restart follows. `now` (a second Ctrl-C):
        the job is killed at the next poll, its checkpoint not waited for; still "stopped", 75. Only sets flags."""
        if not (now and self._stop.is_set()):
            self._stop_reason = reason
        if now:
            self._stop_now.set()
        self._stop.set()
        self._wake.set()

    def claim(self) -> None:
        """Own the run directory: take its lock (rundir.RunDirBusy, naming the holder, when another process
        has it) and end whatever job a killed predecessor left running. `run` claims if this was not called;
        the CLI calls it first, so that preflight never sees an orphan's ports and GPU memory."""
        if self.lock is not None:
            return
        self.lock = claim_run_dir(self.run_dir, "prime-train run")
        self._orphans = end_orphans(self.run_dir, self.cfg.supervisor.term_grace_s)
        for orphan in self._orphans:
            how = "SIGKILL" if orphan["killed"] else "SIGTERM"
            self.observer.message(
                f"ended {orphan['name']} (pid {orphan['pid']}) left running by a previous supervisor ({how})"
            )

    def run(self) -> int:
        self.claim()
        try:
            return self._run()
        except BaseException:  # a bug, a KeyboardInterrupt: supervisor.json must not go on saying "running"
            if self.state in LIVE_STATES:
                with contextlib.suppress(Exception):
                    stopped = self._stop.is_set()
                    self._set_state(SupervisorState.STOPPED if stopped else SupervisorState.FAILED, final=True)
            raise
        finally:
            assert self.lock is not None
            self.lock.release()

    # ------------------------------------------------------------------ the run: attempts until one decides it

    def _run(self) -> int:
        code = self._open_run()
        if code is not None:
            return code
        restarts = 0
        while True:
            attempt = Attempt(self._attempt_base + len(self.attempts) + 1, time.time())
            self.attempts.append(attempt)
            failure = self._run_attempt(attempt)
            attempt.ended = time.time()
            attempt.failure = failure
            attempt.checkpoint_step_at_end = self.plan.newest_checkpoint_step()
            if failure is not None and failure.kind is FailureKind.DISK_FULL:
                failure.message += f"; {self.plan.disk_statement()}"
            code = self._succeeded(attempt) if failure is None else self._failed(attempt, failure, restarts)
            if code is not None:
                break
            restarts += 1
        self._finish_backup(code)
        self._write_state(final=True)
        return code

    def _open_run(self) -> int | None:
        """Before the first attempt: the run's record begun, its config written, its backup started; an exit code
        when the run cannot go on."""
        self.run_dir.create()
        self.events = EventLog(self.run_dir.events_path, self.redactor)
        self.events.emit(Event.RUN_STARTED, run_dir=str(self.run_dir.root), pid=os.getpid(), job=self.plan.kind)
        for orphan in self._orphans:
            self.events.emit(Event.ORPHAN_ENDED, **orphan)
        self._attempt_base = max(attempt_numbers(self.run_dir), default=0)
        self._keeper = Housekeeper(self.run_dir, self.events, self.observer.message)
        try:
            masked = self.redactor.masked_config(self.cfg).text.encode()  # secret values as ***
            replace_file_atomic(self.run_dir.config_path, masked, mode=0o666)  # renamed over a link, never through it
        except OSError as exc:
            self.events.emit(Event.RUN_FAILED, reason=f"cannot write {self.run_dir.config_path}: {exc}")
            self.observer.message(f"cannot write {self.run_dir.config_path}: {exc}; {self.plan.disk_statement()}")
            self._set_state(SupervisorState.FAILED)
            return ExitCode.FAILED
        if "VLLM_USE_V1" in os.environ:
            # vLLM 0.11 removed the V0 engine; the variable is ignored, and people believe it does something
            self.events.emit(
                Event.ENV_WARNING, variable="VLLM_USE_V1", detail="ignored since vLLM 0.11 (V1 is the only engine)"
            )
            self.observer.message("warning: VLLM_USE_V1 is set but does nothing since vLLM 0.11; unset it")
        if self._start_backup() is not None:
            self._set_state(SupervisorState.FAILED)
            self._write_state(final=True)
            return ExitCode.FAILED
        return None

    def _succeeded(self, attempt: Attempt) -> int:
        assert self.events is not None
        if self._stop.is_set():
            self._set_state(SupervisorState.STOPPED)
            self.events.emit(Event.RUN_STOPPED, reason=self._stop_reason, step=attempt.last_step)
            self.observer.message(self._stopped_message(attempt))
            return ExitCode.PREEMPTED
        self._set_state(SupervisorState.DONE)
        self.events.emit(Event.RUN_FINISHED, step=attempt.last_step, attempts=len(self.attempts))
        return ExitCode.OK

    def _failed(self, attempt: Attempt, failure: Failure, restarts: int) -> int | None:
        """The run's exit code after a failed attempt, or None once the backoff has passed and the next may start."""
        assert self.events is not None
        self.events.emit(Event.FAILURE, attempt=attempt.number, **failure.to_dict())
        self.observer.message(f"attempt {attempt.number} failed: {failure.kind}: {failure.message} — {failure.hint}")
        if self._stop.is_set():
            self._set_state(SupervisorState.STOPPED)
            return ExitCode.PREEMPTED
        if failure.kind is FailureKind.PREEMPTED and self._cloud_notice is not None:
            # the instance is going away: restarting here would be killed with it. Exit 75 so the
            # layer above (SkyPilot's recover_on_exit_codes) resumes the run on a new instance.
            self._set_state(SupervisorState.PREEMPTED)
            self.events.emit(Event.RUN_PREEMPTED, step=attempt.last_step, **self._cloud_notice)
            return ExitCode.PREEMPTED
        decision = self.policy.decide(failure, restarts)
        self.events.emit(Event.DECISION, restart=decision.restart, delay_s=decision.delay_s, reason=decision.reason)
        if not decision.restart:
            self._set_state(SupervisorState.FAILED)
            self.observer.message(f"giving up: {decision.reason}")
            return ExitCode.CONFIG if failure.kind is FailureKind.CONFIG_ERROR else ExitCode.FAILED
        self._set_state(SupervisorState.RESTARTING)
        self.observer.message(f"{decision.reason}; restarting in {decision.delay_s:.0f}s")
        if self._stop.wait(decision.delay_s):
            self._set_state(SupervisorState.STOPPED)
            return ExitCode.PREEMPTED
        self.plan.before_restart(self._stop, self._tell)  # node k > 0: node 0's old rendezvous gone first
        if self._stop.is_set():
            self._set_state(SupervisorState.STOPPED)
            return ExitCode.PREEMPTED
        return None

    # ------------------------------------------------------------------ object storage

    def _start_backup(self) -> str | None:
        """When the plan backs up to ckpt.remote (resilience/backup.start_backup): an error message when the bucket
        cannot be read."""
        if not self.plan.backs_up:
            return None
        from prime_train.resilience.backup import start_backup

        self._backup, error = start_backup(self.cfg.ckpt, self.run_dir, self.events, self.observer.message)
        return error

    def _finish_backup(self, code: int) -> None:
        """Upload what the last attempt saved (the SIGTERM checkpoint on a preemption) before exiting."""
        if self._backup is None:
            return
        # a preempted instance has about two minutes (AWS) or thirty seconds (GCP) left
        timeout = 25.0 if self._cloud_notice is not None else self.cfg.supervisor.term_grace_s * 5
        for event in self._backup.flush(timeout).events:
            self._record(event)

    # ------------------------------------------------------------------ one attempt

    def _run_attempt(self, attempt: Attempt) -> Failure | None:
        """Start the attempt's processes, watch them until the attempt ends, tear them down."""
        progress = self._open_attempt(attempt)
        watching = Watching(
            self.plan.watchers(self._attempt_context(attempt, progress)),
            self.cfg.supervisor.poll_interval_s,
            self._record,
        )
        watching.begin(time.time())  # the GPUs' memory before any process of this attempt runs
        failure = self._start(attempt)
        if failure is not None:
            return failure
        self._set_state(SupervisorState.RUNNING, attempt=attempt.number)
        watching.start()
        try:
            failure = self._watch(attempt, progress, watching)
        finally:
            watching.stop()
            self._teardown(attempt)
        if failure is not None and failure.step is None:
            failure.step = progress.step
        return failure

    def _open_attempt(self, attempt: Attempt) -> ProgressWatcher:
        assert self.events is not None
        attempt.resumed_from = self.plan.expected_resume(first=attempt is self.attempts[0])
        self.events.emit(Event.ATTEMPT_STARTED, attempt=attempt.number, resume_from=attempt.resumed_from)
        if attempt.resumed_from:
            self.observer.message(f"resuming from step {attempt.resumed_from}")
        self._progress_source = self.plan.progress_source()
        progress = self.plan.progress_watcher(self._progress_source)
        with self._findings_lock:
            self.findings = []
        return progress

    def _attempt_context(self, attempt: Attempt, progress: ProgressWatcher) -> AttemptContext:
        return AttemptContext(
            attempt.number,
            progress,
            children=lambda: self.children,
            step_overdue_s=self._step_overdue_s,
            on_finding=self._on_finding,
            backup=self._backup,
            gpu_source=self.options.gpu_source,
            preemption=self.options.preemption,
        )

    def _start(self, attempt: Attempt) -> Failure | None:
        """Start the attempt's processes; the Failure when they cannot be."""
        try:
            self._start_children(attempt)
        except ValueError as exc:  # a placement the config cannot have (vLLM without GPUs): never retried
            self._teardown(attempt)
            return Failure(FailureKind.CONFIG_ERROR, str(exc))
        except OSError as exc:  # its log directory or config on a full disk; retried, space may come back
            self._teardown(attempt)
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            return Failure(FailureKind.DISK_FULL if full else FailureKind.CRASH, f"cannot start the attempt: {exc}")
        return None

    def _start_children(self, attempt: Attempt) -> None:
        self.children = []  # first: a start that fails half way must not leave the last attempt's children listed
        self._scanners = {}
        logs = self.run_dir.attempt_logs(attempt.number)
        self.run_dir.ensure_dir(logs)  # contract.UnsafeLink (an OSError) when logs/ leads out of the run directory
        with contextlib.suppress(OSError):  # a convenience: a full disk (or a `latest` not ours) must not stop it
            replace_symlink(self.run_dir.latest_logs, logs.name)
        specs = self.plan.specs(attempt.number, first=attempt is self.attempts[0], tell=self._tell)
        self._roles = {spec.name: spec.role for spec in specs}
        for spec in specs:
            log_path = logs / f"{spec.name}.log"
            self._scanners[spec.name] = LogScanner(process=spec.name, file=str(log_path))
            child = self._child(spec, log_path)
            child.start()
            self.children.append(child)
            assert self.events is not None
            self.events.emit(Event.PROCESS_STARTED, attempt=attempt.number, process=spec.name, pid=child.pid,
                             argv=redact_argv(spec.argv))  # fmt: skip
        self._housekeeping()

    def _watch(self, attempt: Attempt, progress: ProgressWatcher, watching: Watching) -> Failure | None:
        """The attempt loop: each tick polls the watchers, carries a stop to the job, acts on the watchers'
        requests, and ends the attempt at a process's exit or the first verdict (None: success, or a stop)."""
        stop = _Stopping()
        while True:
            exited = [(c, c.poll()) for c in self.children]
            watching.tick(time.time())
            self._follow(attempt, progress, watching.status())
            if self._stop.is_set():
                line = f"stopping ({self._stop_reason}): the trainer saves a checkpoint and exits"
                self._forward_stop(stop, note(Event.STOP_REQUESTED, reason=self._stop_reason), line)
            if self._stop_now.is_set():
                self._kill_now(progress)
                return None
            if stop.deadline is not None and time.time() > stop.deadline:
                reason = "did not exit within supervisor.term_grace_s after SIGTERM"
                return Failure(FailureKind.HANG, reason, step=progress.step)
            restarts = self._act_on(watching.requests(), stop)
            dead = [(c, code) for c, code in exited if code is not None]
            if not stop.sent:
                failure = self._mend_workers(dead, restarts, watching)
                if failure is not None:
                    return failure
                dead = [(c, code) for c, code in dead if c.spec.role is not Role.INFERENCE]
            if dead:
                child, returncode = dead[0]
                return self._judge_exit(child, returncode, progress, attempt, watching, preempted=bool(stop.notice))
            verdict = watching.verdict(stopping=stop.sent)
            if verdict is not None:
                return verdict
            # sleep until the next poll, or until a child's output closes (it exited)
            self._wake.wait(min(0.5, self.cfg.supervisor.poll_interval_s))
            self._wake.clear()

    def _follow(self, attempt: Attempt, progress: ProgressWatcher, status: dict[StatusKey, Any]) -> None:
        """Each tick: the attempt's steps as the progress watcher saw them, the console's status, housekeeping."""
        attempt.last_step = progress.step if progress.step is not None else attempt.last_step
        if attempt.first_step is None and progress.first_step is not None:
            attempt.first_step = progress.first_step
        if progress.phase is not None and progress.last_seen and progress.last_seen.resumed_from is not None:
            attempt.resumed_from = progress.last_seen.resumed_from  # fresh: where the job really resumed
        self._status(attempt, progress, status)
        self._housekeeping()

    def _forward_stop(self, stop: _Stopping, why: Note, line: str) -> None:
        """The one place a stop reaches the job, once an attempt: SIGTERM to every process; it has
        supervisor.term_grace_s to checkpoint and exit. `why` is recorded and `line` shown as it is sent."""
        if stop.sent:
            return
        self._tell(why, line)
        for c in self.children:
            c.signal(signal.SIGTERM)
        stop.deadline = time.time() + self.cfg.supervisor.term_grace_s

    def _kill_now(self, progress: ProgressWatcher) -> None:
        """A second Ctrl-C: the job is killed, its checkpoint not waited for."""
        assert self.events is not None
        self.events.emit(Event.STOP_FORCED, reason="a second Ctrl-C", step=progress.step)
        self.observer.message("second Ctrl-C: killing the job now, without waiting for its checkpoint")
        for c in self.children:
            c.kill()

    def _act_on(self, requests: list[Request], stop: _Stopping) -> dict[str, str]:
        """Carry out the watchers' requests: a stop is forwarded now; the workers to restart are returned (process
        name: why), for when no stop is under way."""
        restarts: dict[str, str] = {}
        for request in requests:
            match request:
                case ForwardStop(reason=reason, notice=notice):
                    stop.notice = self._cloud_notice = dict(notice)
                    forwarded = note(Event.PREEMPTION_FORWARDED, **notice)
                    self._forward_stop(stop, forwarded, f"{reason}: checkpointing now")
                case RestartWorker(process=name, reason=why):
                    restarts[name] = why
        return restarts

    def _mend_workers(
        self, dead: list[tuple[ChildProcess, int]], wedged: dict[str, str], watching: Watching
    ) -> Failure | None:
        """Restart a dead or wedged rollout worker on its own; the trainer's pool routes around it meanwhile.

        Wedged (a watcher's request): alive but no longer answering /health, or its GPUs back at their memory from
        before the attempt (a vLLM engine that died silently under a live API server)."""
        broken = [(c, code, f"exited with {code}") for c, code in dead if c.spec.role is Role.INFERENCE]
        broken += [(c, None, wedged[c.name]) for c in self.children if c.name in wedged and c.poll() is None]
        for child, code, why in broken:
            failure = self._restart_worker(child, code, why, watching)
            if failure is not None:
                return failure
        return None

    def _restart_worker(self, child: ChildProcess, code: int | None, why: str, watching: Watching) -> Failure | None:
        count = self._worker_restarts.get(child.name, 0) + 1
        self._worker_restarts[child.name] = count
        tail = [line for line in child.tail if line.strip()][-10:]
        if (cause := self.plan.never_starts(child.name, code, list(self.findings), tail)) is not None:
            return Failure(FailureKind.CONFIG_ERROR, cause, tail, child.name, exit_code=code)
        assert self.events is not None
        self.events.emit(Event.INFERENCE_DIED, process=child.name, exit_code=code, reason=why, restarts=count,
                         last_lines=tail)  # fmt: skip
        self.observer.message(f"{child.name} {why}; last lines:\n  " + "\n  ".join(tail or ["(no output)"]))
        limit = self.cfg.supervisor.max_restarts
        if count > limit:
            message = f"{child.name} {why} {count} times (supervisor.max_restarts = {limit})"
            return Failure(FailureKind.INFERENCE_DIED, message, tail, child.name, exit_code=code)
        child.stop(self.cfg.supervisor.term_grace_s)
        replacement = self._child(child.spec, child.log_path)
        replacement.start()
        self.children[self.children.index(child)] = replacement
        watching.restarted(child.name)
        self.events.emit(Event.PROCESS_STARTED, process=child.name, pid=replacement.pid,
                         argv=redact_argv(child.spec.argv), restart=count)  # fmt: skip
        self.observer.message(f"restarted {child.name} (restart {count})")
        return None

    def _judge_exit(
        self,
        child: ChildProcess,
        returncode: int,
        progress: ProgressWatcher,
        attempt: Attempt,
        watching: Watching,
        *,
        preempted: bool,
    ) -> Failure | None:
        """Turn a child's exit into success or a classified Failure with its evidence."""
        child.join_output()
        scanner = self._scanners.get(child.name)
        if scanner is not None:
            for finding in scanner.finish():
                self._on_finding(finding)
        if child.spec.role is Role.TRAINER:
            watching.settle(time.time())  # the rank that failed first may have written its last words in its log
        hb = read_heartbeat(self.run_dir.progress_path)
        code = job_exit_code(returncode, hb, child.started_at)
        attempt.exit_code = code
        asked = self.options.stop_at_step
        if code == ExitCode.PREEMPTED and asked is not None and hb is not None and (hb.step or 0) >= asked:
            self.request_stop(f"stopped at step {hb.step}, as asked (stop at step {asked})")
        assert self.events is not None
        self.events.emit(
            Event.PROCESS_EXITED, process=child.name, exit_code=code, returncode=returncode, step=progress.step
        )
        with self._findings_lock:
            findings = list(self.findings)
        verdict = exit_verdict(
            child.spec, returncode, code, hb, child.started_at, list(child.tail)[-20:], findings,
            stop_requested=self._stop.is_set(), preempted=preempted,
        )  # fmt: skip
        stopped_by = stop_signal(returncode)
        if verdict is None and stopped_by is not None and not self._stop.is_set():
            # stopped from outside (a kill, a Ctrl-C that reached its group): the run stops, it is not restarted
            self.request_stop(f"{stopped_by} sent to {child.name}")
        return verdict

    def _teardown(self, attempt: Attempt) -> None:
        grace = self.cfg.supervisor.term_grace_s
        for child in self.children:
            child.stop(grace)
        assert self.events is not None
        leftovers = [p.pid for c in self.children for p in c.alive_descendants()]
        assert self._keeper is not None
        named = {c.name: c.known_processes() for c in self.children}
        self._keeper.after_attempt(named, clean_tmp=self.plan.cleans_partial_saves)
        self.events.emit(Event.ATTEMPT_ENDED, attempt=attempt.number, leftover_pids=leftovers)

    def _step_overdue_s(self) -> float:
        """How long without progress is longer than a real step takes: three mean steps, at least three polls."""
        polls = 3 * self.cfg.supervisor.poll_interval_s
        mean = self.mean_step_time()
        return max(polls, 3 * mean) if mean is not None else max(polls, 30.0)

    def _stopped_message(self, attempt: Attempt) -> str:
        newest = self.plan.newest_checkpoint_step()
        then = f"the next run resumes from step-{newest}" if newest is not None else "the next run starts from step 0"
        if attempt.last_step is None or attempt.last_step == attempt.resumed_from:
            return f"stopped ({self._stop_reason}) before the attempt's first step: nothing new to checkpoint; {then}"
        return f"stopped ({self._stop_reason}) at step {attempt.last_step}; {then}"

    # ------------------------------------------------------------------ children's output, findings, events

    def _record(self, note: Note) -> None:
        """An event a watcher saw, into events.jsonl."""
        assert self.events is not None
        self.events.record(note)

    def _tell(self, note: Note, line: str) -> None:
        """An event the plan has to tell, and its line on the console."""
        self._record(note)
        self.observer.message(line)

    def _on_finding(self, finding: Finding) -> None:
        with self._findings_lock:
            self.findings.append(finding)
        if self.events is not None:
            self.events.emit(Event.LOG_FINDING, **finding.to_dict())
        self.observer.finding(finding)

    def _child(self, spec: ProcessSpec, log_path: Path) -> ChildProcess:
        """A child whose log is masked with the run's secrets as written and capped at logging.max_log_mb."""
        return ChildProcess(
            spec,
            log_path,
            on_line=self._on_line,
            on_output_closed=self._wake.set,
            redactor=self.redactor,
            max_log_bytes=log_cap_bytes(self.cfg.logging.max_log_mb),
        )

    def _on_line(self, process: str, line: str, line_no: int) -> None:
        scanner = self._scanners.get(process)
        if scanner is not None:
            for finding in scanner.feed(line, line_no):
                self._on_finding(finding)
        if self._progress_source is not None:
            self._progress_source.feed(process, line)
        if self.options.verbose_inference and self._roles.get(process) is Role.INFERENCE:
            self.observer.message(f"[{process}] {line}")

    def _housekeeping(self) -> None:
        """Each poll: the process record, quarantine notices, and supervisor.json if a full disk refused it."""
        assert self._keeper is not None
        self._keeper.poll({c.name: c.known_processes() for c in self.children})
        if self._state_unwritten:
            self._write_state()

    # ------------------------------------------------------------------ state and status

    def _set_state(self, state: SupervisorState, **extra: Any) -> None:
        self.state = state
        self._write_state(**extra)

    def _write_state(self, final: bool = False, **extra: Any) -> None:
        last = self.attempts[-1] if self.attempts else None
        self._state_unwritten = not record_state(
            self.run_dir,
            {
                "pid": os.getpid(),
                "state": self.state,
                "attempt": last.number if last else 0,
                "restarts": max(0, len(self.attempts) - 1),
                "step": last.last_step if last else None,
                "run_dir": str(self.run_dir.root),
                "updated": time.time(),
                "last_failure": self.redactor.value(last.failure.to_dict()) if last and last.failure else None,
                "final": final,
                **extra,
            },
        )

    def _status(self, attempt: Attempt, progress: ProgressWatcher, values: dict[StatusKey, Any]) -> None:
        hb = progress.last_seen or Heartbeat(None)
        status = {
            "attempt": attempt.number,
            "restarts": len(self.attempts) - 1,
            "step": progress.step,
            # from the heartbeat, else the plan's (the engine's train.max_steps; an external job's is unknown)
            "max_steps": hb.max_steps or self.plan.max_steps,
            "phase": progress.phase,
            "loss": hb.loss,
            "loss_step": hb.loss_step,  # the step the loss was read at (every logging.log_interval steps)
            "reward": hb.reward,  # RL: the mean sampled reward of the last step
            "tokens_per_s": hb.tokens_per_s,
            "disk": values.get(StatusKey.DISK),
            "gpu": values.get(StatusKey.GPU),
        }
        if hb.step_time_s is not None and math.isfinite(hb.step_time_s):
            self._step_times.append(hb.step_time_s)
            self._step_times = self._step_times[-50:]
        if self._step_times and progress.step is not None and status["max_steps"]:
            status["eta_s"] = sum(self._step_times) / len(self._step_times) * (status["max_steps"] - progress.step)
        if status != self._last_status:
            self._last_status = status
            self.observer.status(status)

    def mean_step_time(self) -> float | None:
        return sum(self._step_times) / len(self._step_times) if self._step_times else None


def _redacting(observer: Observer, redactor: Redactor) -> Observer:
    """`observer` behind `redactor`: the log lines in findings and messages reach the console masked."""
    return Observer(
        status=observer.status,
        finding=lambda f: observer.finding(redactor.value(f)),
        message=lambda m: observer.message(redactor(m)),
    )
