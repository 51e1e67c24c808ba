"""`prime-train run`: preflight, launch, watch, classify, restart — the job's whole life.

Plain Python, never imports torch. It meets the job only in the run directory (prime_train/contract.py,
docs/architecture.md): it reads progress.json and the checkpoints, writes events.jsonl and supervisor.json.

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
    ENV_ATTEMPT,
    ENV_RUN_DIR,
    ENV_SUPERVISOR,
    LIVE_STATES,
    Event,
    ExitCode,
    Heartbeat,
    Phase,
    RunLock,
    SupervisorState,
    newest_checkpoint,
    newest_external_checkpoint,
    read_heartbeat,
    read_json,
    replace_file_atomic,
    replace_symlink,
)
from prime_train.kit.events import EventLog
from prime_train.kit.failures import Failure, FailureKind
from prime_train.kit.ownership import (
    Housekeeper,
    attempt_numbers,
    claim_run_dir,
    disk_statement,
    end_orphans,
    record_state,
    supervisor_token,
)
from prime_train.kit.process import ChildProcess, ProcessSpec, log_cap_bytes
from prime_train.kit.redact import Redactor, redact_argv
from prime_train.launch import gpu_devices, job_exit_code, plan_engine_launch
from prime_train.resilience.background import Background
from prime_train.resilience.logscan import Finding, LogScanner
from prime_train.resilience.policy import RestartPolicy
from prime_train.resilience.verdict import exit_verdict, stop_signal
from prime_train.resilience.watchers import (
    DiskWatcher,
    LogProgress,
    PreemptionWatcher,
    ProgressWatcher,
    RankLogs,
    detect_cloud,
)
from prime_train.rl.client import worker_url
from prime_train.rl.workers import InferenceHealthWatcher, gpu_plan, inference_specs, never_starts


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


class Supervisor:
    def __init__(self, cfg: Config, observer: Observer | None = None, options: SupervisorOptions | None = None):
        self.cfg = cfg
        self.run_dir = cfg.layout  # its checkpoints where ckpt.dir puts them: what the job writes, this watches
        self.options = options or SupervisorOptions()
        # secrets out of every file it writes and every line it prints: by shape, and by value (the credentials
        # of its environment and of the config)
        self.redactor = Redactor.for_run(cfg, {**os.environ, **self.options.extra_env})
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
        self._roles: dict[str, str] = {}
        self._worker_restarts: dict[str, int] = {}
        self._log_progress: LogProgress | None = None
        self.events: EventLog | None = None
        self.state = SupervisorState.STARTING
        self._step_times: list[float] = []
        self._last_status: dict[str, Any] = {}
        self._cloud_notice: dict[str, Any] | None = None
        self._backup = None  # BackupWatcher when ckpt.remote is set: one for the whole run, across attempts
        self._health_watcher: InferenceHealthWatcher | None = None
        self._rank_logs: RankLogs | None = None
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
        """Own the run directory: take its lock (contract.RunDirBusy, naming the holder, when another process
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

    def _run(self) -> int:
        self.run_dir.create()
        self.events = EventLog(self.run_dir.events_path, self.redactor)
        self.events.emit(Event.RUN_STARTED, run_dir=str(self.run_dir.root), pid=os.getpid(), job=self._job_kind())
        for orphan in self._orphans:
            self.events.emit(Event.ORPHAN_ENDED, **orphan)
        self._attempt_base = max(attempt_numbers(self.run_dir), default=0)
        self._keeper = Housekeeper(self.run_dir, self.events, self.observer.message)
        try:
            masked = self.redactor.masked_config(self.cfg).text.encode()  # secret values as ***
            replace_file_atomic(self.run_dir.config_path, masked, mode=0o666)  # renamed over a link, never through it
        except OSError as exc:
            self.events.emit(Event.RUN_FAILED, reason=f"cannot write {self.run_dir.config_path}: {exc}")
            self.observer.message(f"cannot write {self.run_dir.config_path}: {exc}; {self._disk_statement()}")
            self._set_state(SupervisorState.FAILED)
            return ExitCode.FAILED
        if "VLLM_USE_V1" in os.environ:
            # vLLM 0.11 removed the V0 engine; the variable is ignored, and people believe it does something
            self.events.emit(
                Event.ENV_WARNING, variable="VLLM_USE_V1", detail="ignored since vLLM 0.11 (V1 is the only engine)"
            )
            self.observer.message("warning: VLLM_USE_V1 is set but does nothing since vLLM 0.11; unset it")
        restart_error = self._start_backup()
        if restart_error is not None:
            self._set_state(SupervisorState.FAILED)
            self._write_state(final=True)
            return ExitCode.FAILED
        restarts = 0
        code = ExitCode.FAILED
        while True:
            attempt = Attempt(self._attempt_base + len(self.attempts) + 1, time.time())
            self.attempts.append(attempt)
            failure = self._run_attempt(attempt)
            attempt.ended = time.time()
            attempt.failure = failure
            attempt.checkpoint_step_at_end = self._newest_checkpoint_step()
            if failure is not None and failure.kind is FailureKind.DISK_FULL:
                failure.message += f"; {self._disk_statement()}"
            if failure is None:
                if self._stop.is_set():
                    self._set_state(SupervisorState.STOPPED)
                    self.events.emit(Event.RUN_STOPPED, reason=self._stop_reason, step=attempt.last_step)
                    self.observer.message(self._stopped_message(attempt))
                    code = ExitCode.PREEMPTED
                else:
                    self._set_state(SupervisorState.DONE)
                    self.events.emit(Event.RUN_FINISHED, step=attempt.last_step, attempts=len(self.attempts))
                    code = ExitCode.OK
                break
            self.events.emit(Event.FAILURE, attempt=attempt.number, **failure.to_dict())
            self.observer.message(
                f"attempt {attempt.number} failed: {failure.kind}: {failure.message} — {failure.hint}"
            )
            if self._stop.is_set():
                self._set_state(SupervisorState.STOPPED)
                code = ExitCode.PREEMPTED
                break
            if failure.kind is FailureKind.PREEMPTED and self._cloud_notice is not None:
                # the instance is going away: restarting here would be killed with it. Exit 75 so the
                # layer above (SkyPilot's recover_on_exit_codes) resumes the run on a new instance.
                self._set_state(SupervisorState.PREEMPTED)
                self.events.emit(Event.RUN_PREEMPTED, step=attempt.last_step, **self._cloud_notice)
                code = ExitCode.PREEMPTED
                break
            decision = self.policy.decide(failure, restarts)
            self.events.emit(Event.DECISION, restart=decision.restart, delay_s=decision.delay_s, reason=decision.reason)
            if not decision.restart:
                self._set_state(SupervisorState.FAILED)
                code = ExitCode.CONFIG if failure.kind is FailureKind.CONFIG_ERROR else ExitCode.FAILED
                self.observer.message(f"giving up: {decision.reason}")
                break
            restarts += 1
            self._set_state(SupervisorState.RESTARTING)
            self.observer.message(f"{decision.reason}; restarting in {decision.delay_s:.0f}s")
            if self._stop.wait(decision.delay_s):
                self._set_state(SupervisorState.STOPPED)
                code = ExitCode.PREEMPTED
                break
        self._finish_backup(code)
        self._write_state(final=True)
        return code

    # ------------------------------------------------------------------ object storage

    def _start_backup(self) -> str | None:
        """With ckpt.remote (resilience/backup.start_backup): an error message when the bucket cannot be read."""
        if self.cfg.ckpt.remote is None or self.cfg.job.command:
            return None
        from prime_train.resilience.backup import start_backup

        self._backup, error = start_backup(self.cfg.ckpt, self.run_dir, self.events, self.observer.message)
        return error

    def _uploading_steps(self) -> set[int]:
        step = getattr(self._backup, "uploading_step", None)
        return {step} if step is not None else set()

    def _finish_backup(self, code: int) -> None:
        """Upload what the last attempt saved (the SIGTERM checkpoint on a preemption) before exiting."""
        if self._backup is None:
            return
        # a preempted instance has about two minutes (AWS) or thirty seconds (GCP) left
        timeout = 25.0 if self._cloud_notice is not None else self.cfg.supervisor.term_grace_s * 5
        for event in self._backup.flush(timeout):
            self.events.emit(**event)

    # ------------------------------------------------------------------ one attempt

    def _newest_checkpoint_step(self) -> int | None:
        job = self.cfg.job
        if job.command:
            found = (
                newest_external_checkpoint(Path(job.checkpoint_dir), job.checkpoint_pattern)
                if job.checkpoint_dir
                else None
            )
            return found[0] if found else None
        newest = newest_checkpoint(self.run_dir.checkpoints_dir)  # ckpt.dir, where several nodes share them
        return newest.step if newest else None

    def _job_kind(self) -> str:
        return "command" if self.cfg.job.command else self.cfg.run.job

    def _attempt_config_path(self, attempt: Attempt) -> Path:
        """The first attempt runs the config as given; later ones always resume from the newest whole checkpoint."""
        if attempt is self.attempts[0] or self.cfg.ckpt.resume == "auto":
            return self.run_dir.config_path
        cfg = self.cfg.model_copy(deep=True)
        if newest_checkpoint(self.run_dir.checkpoints_dir) is not None:
            cfg.ckpt.resume = "auto"
        path = self.run_dir.root / f"config.attempt-{attempt.number}.toml"
        replace_file_atomic(path, self.redactor.masked_config(cfg).text.encode(), mode=0o666)  # never through a link
        return path

    def _specs(self, attempt: Attempt) -> list[ProcessSpec]:
        env = {
            **self.redactor.masked_config(self.cfg).env,  # the real values of config.toml's ***, for the job
            "PYTHONUNBUFFERED": "1",
            ENV_RUN_DIR: str(self.run_dir.root),
            ENV_ATTEMPT: str(attempt.number),
            ENV_SUPERVISOR: supervisor_token(),  # the job stops when this process is gone (engine/lifeline.py)
            **self.options.extra_env,
        }
        if self.cfg.job.command:
            return [self._command_spec(env)]
        config_path = str(self._attempt_config_path(attempt))
        workers: list[ProcessSpec] = []
        devices = gpu_devices()
        trainer_gpus = (
            devices[: self.cfg.distributed.nproc_per_node] if self.cfg.distributed.nproc_per_node else devices
        )
        if self.cfg.run.job == "rl":
            gpus = gpu_plan(self.cfg, devices)
            if gpus.note:
                self.events.emit(Event.GPU_PLAN, note=gpus.note, trainer=gpus.trainer, workers=gpus.workers)
                self.observer.message(f"note: {gpus.note}")
            workers = inference_specs(self.cfg, config_path, gpus)
            trainer_gpus = gpus.trainer
        if trainer_gpus:
            # the trainer's GPUs by name: the GPU watcher judges exactly these, and a user's CUDA_VISIBLE_DEVICES=4,5
            # stays 4,5
            env["CUDA_VISIBLE_DEVICES"] = ",".join(trainer_gpus)
        plan = plan_engine_launch(
            self.cfg,
            config_path,
            log_dir=str(self.run_dir.rank_logs(attempt.number)),
            num_gpus=len(trainer_gpus),
        )
        for k, v in plan.env.items():
            env.setdefault(k, os.environ.get(k, v))
        env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        for w in workers:
            w.env = {**env, **w.env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        # workers first: the trainer waits for their /health before its first rollout
        return [*workers, ProcessSpec("trainer", plan.argv, env, role="trainer")]

    def _command_spec(self, env: dict[str, str]) -> ProcessSpec:
        job = self.cfg.job
        argv = list(job.command or [])
        if job.checkpoint_dir and job.resume_args:
            found = newest_external_checkpoint(Path(job.checkpoint_dir), job.checkpoint_pattern)
            if found is not None:
                step, path = found
                argv += [a.replace("{step}", str(step)).replace("{path}", str(path)) for a in job.resume_args]
        return ProcessSpec("job", argv, {**env, **job.env}, cwd=job.cwd, role="job")

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
        if self._log_progress is not None and process == "job":
            self._log_progress.feed(line)
        if self.options.verbose_inference and self._roles.get(process) == "inference":
            self.observer.message(f"[{process}] {line}")

    def _start_children(self, attempt: Attempt) -> None:
        self.children = []  # first: a start that fails half way must not leave the last attempt's children listed
        self._scanners = {}
        logs = self.run_dir.attempt_logs(attempt.number)
        self.run_dir.ensure_dir(logs)  # contract.UnsafeLink (an OSError) when logs/ leads out of the run directory
        with contextlib.suppress(OSError):  # a convenience: a full disk (or a `latest` not ours) must not stop it
            replace_symlink(self.run_dir.latest_logs, logs.name)
        specs = self._specs(attempt)
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

    def _progress_reader(self) -> Callable[[], dict[str, Any] | None]:
        job = self.cfg.job
        if job.command and job.progress_regex:
            # no step total: train.max_steps is the embedded engine's, an external job's own total is unknown here
            self._log_progress = LogProgress(job.progress_regex)
            return self._log_progress.read
        self._log_progress = None
        path = Path(job.progress_file) if job.command and job.progress_file else self.run_dir.progress_path
        return lambda: read_json(path)

    def _run_attempt(self, attempt: Attempt) -> Failure | None:
        assert self.events is not None
        sup = self.cfg.supervisor
        attempt.resumed_from = self._expected_resume(attempt)
        self.events.emit(Event.ATTEMPT_STARTED, attempt=attempt.number, resume_from=attempt.resumed_from)
        if attempt.resumed_from:
            self.observer.message(f"resuming from step {attempt.resumed_from}")
        progress = ProgressWatcher(
            self._progress_reader(),
            stall_timeout_s=sup.stall_timeout_s,
            startup_timeout_s=self._startup_allowance(),
            save_timeout_s=sup.save_timeout_s,
        )
        with self._findings_lock:
            self.findings = []
        # the GPUs' memory before any process of this attempt runs: "empty" later means back at this
        gpu = self._gpu_watcher(progress, attempt)
        if gpu is not None:
            for event in gpu.take_baseline():
                self.events.emit(**event)
        try:
            self._start_children(attempt)
        except ValueError as exc:  # a placement the config cannot have (vLLM without GPUs): never retried
            self._teardown(attempt)
            return Failure(FailureKind.CONFIG_ERROR, str(exc))
        except OSError as exc:  # its log directory or config on a full disk; retried, space may come back
            self._teardown(attempt)
            full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            return Failure(FailureKind.DISK_FULL if full else FailureKind.CRASH, f"cannot start the attempt: {exc}")
        self._set_state(SupervisorState.RUNNING, attempt=attempt.number)
        background = Background(self._background_watchers(progress, gpu, attempt), sup.poll_interval_s, self.events)
        background.start()
        failure: Failure | None = None
        stop_sent = False
        try:
            while True:
                exited = [(c, c.poll()) for c in self.children]
                for event in progress.poll():
                    self.events.emit(**event)
                attempt.last_step = progress.step if progress.step is not None else attempt.last_step
                if attempt.first_step is None and progress.first_step is not None:
                    attempt.first_step = progress.first_step
                if progress.phase is not None and progress.last_seen and progress.last_seen.resumed_from is not None:
                    attempt.resumed_from = progress.last_seen.resumed_from  # fresh: where the job really resumed
                self._status(attempt, progress, background)
                self._housekeeping()
                if self._stop.is_set() and not stop_sent:
                    self.events.emit(Event.STOP_REQUESTED, reason=self._stop_reason)
                    self.observer.message(f"stopping ({self._stop_reason}): the trainer saves a checkpoint and exits")
                    for c in self.children:
                        c.signal(signal.SIGTERM)
                    stop_sent = True
                    stop_deadline = time.time() + sup.term_grace_s
                if self._stop_now.is_set():
                    self.events.emit(Event.STOP_FORCED, reason="a second Ctrl-C", step=progress.step)
                    self.observer.message("second Ctrl-C: killing the job now, without waiting for its checkpoint")
                    for c in self.children:
                        c.kill()
                    break
                if stop_sent and time.time() > stop_deadline:
                    failure = Failure(
                        FailureKind.HANG,
                        "did not exit within supervisor.term_grace_s after SIGTERM",
                        step=progress.step,
                    )
                    break
                notice = background.preemption_notice()
                if notice:
                    self._cloud_notice = notice
                if notice and not stop_sent:
                    self.events.emit(Event.PREEMPTION_FORWARDED, **notice)
                    self.observer.message(f"preemption notice from {notice['cloud']}: checkpointing now")
                    for c in self.children:
                        c.signal(signal.SIGTERM)
                    stop_sent = True
                    stop_deadline = time.time() + sup.term_grace_s
                dead = [(c, code) for c, code in exited if code is not None]
                if not stop_sent:
                    worker_failure = self._mend_inference(dead, background)
                    if worker_failure is not None:
                        failure = worker_failure
                        break
                    dead = [(c, code) for c, code in dead if c.spec.role != "inference"]
                if dead:
                    failure = self._judge_exit(dead[0][0], dead[0][1], progress, attempt, preempted=bool(notice))
                    break
                if progress.failure is not None and not stop_sent:
                    failure = progress.failure
                    break
                watcher_failure = background.failure()
                if watcher_failure is not None:
                    failure = watcher_failure
                    break
                # sleep until the next poll, or until a child's output closes (it exited)
                self._wake.wait(min(0.5, sup.poll_interval_s))
                self._wake.clear()
        finally:
            background.stop()
            self._teardown(attempt)
        if failure is not None and failure.step is None:
            failure.step = progress.step
        return failure

    def _mend_inference(self, dead, background: Background) -> Failure | None:
        """Restart a dead or wedged rollout worker on its own; the trainer's pool routes around it meanwhile.

        Wedged: alive but no longer answering /health, or its GPUs back at their memory from before the attempt
        (a vLLM engine that died silently under a live API server)."""
        from prime_train.kit.gpu import GpuHealthWatcher

        health = self._health_watcher
        gpu = next((w for w in background.watchers if isinstance(w, GpuHealthWatcher)), None)
        broken = [(c, code) for c, code in dead if c.spec.role == "inference"]
        wedged = (health.wedged if health is not None else set()) | (gpu.emptied if gpu is not None else set())
        broken += [(c, None) for c in self.children if c.name in wedged and c.poll() is None]
        for child, code in broken:
            count = self._worker_restarts.get(child.name, 0) + 1
            self._worker_restarts[child.name] = count
            tail = [line for line in child.tail if line.strip()][-10:]
            if (cause := never_starts(child.name, code, list(self.findings), health, tail)) is not None:
                return Failure(FailureKind.CONFIG_ERROR, cause, tail, child.name, exit_code=code)
            if code is not None:
                why = f"exited with {code}"
            elif gpu is not None and child.name in gpu.emptied:
                why = "left its GPU (back at its memory from before the attempt, 0 %) while its process lives on"
            else:
                why = "stopped answering /health"
            assert self.events is not None
            self.events.emit(Event.INFERENCE_DIED, process=child.name, exit_code=code, reason=why, restarts=count,
                             last_lines=tail)  # fmt: skip
            self.observer.message(f"{child.name} {why}; last lines:\n  " + "\n  ".join(tail or ["(no output)"]))
            if count > self.cfg.supervisor.max_restarts:
                return Failure(
                    FailureKind.INFERENCE_DIED,
                    f"{child.name} {why} {count} times (supervisor.max_restarts = {self.cfg.supervisor.max_restarts})",
                    tail,
                    child.name,
                    exit_code=code,
                )
            child.stop(self.cfg.supervisor.term_grace_s)
            replacement = self._child(child.spec, child.log_path)
            replacement.start()
            self.children[self.children.index(child)] = replacement
            if health is not None:
                health.forget(child.name)
            if gpu is not None:
                gpu.forget(child.name)
            self.events.emit(Event.PROCESS_STARTED, process=child.name, pid=replacement.pid,
                             argv=redact_argv(child.spec.argv), restart=count)  # fmt: skip
            self.observer.message(f"restarted {child.name} (restart {count})")
        return None

    def _background_watchers(self, progress: ProgressWatcher, gpu, attempt: Attempt) -> list:
        sup, ck = self.cfg.supervisor, self.cfg.ckpt
        watchers: list = [
            DiskWatcher(
                self._checkpoints_dir(),
                keep_last=ck.keep_last,
                keep_every=ck.keep_every,
                high_watermark=sup.disk_high_watermark,
                max_bytes=sup.max_disk_gb * 1e9 if sup.max_disk_gb else None,
                protect=self._uploading_steps,
            )
        ]
        if self.cfg.run.job == "rl" and not self.cfg.job.command:
            urls = {f"inference-{i}": worker_url(self.cfg, i) for i in range(self.cfg.inference.num_workers)}
            self._health_watcher = InferenceHealthWatcher(urls, timeout_s=self.cfg.inference.health_timeout_s)
            watchers.append(self._health_watcher)
        if self._backup is not None:
            watchers.append(self._backup)
        if gpu is not None:
            watchers.append(gpu)
        self._rank_logs = None
        if not self.cfg.job.command:
            # torchrun keeps the other ranks' output in its --log-dir only: their failures are scanned there
            self._rank_logs = RankLogs(self.run_dir.rank_logs(attempt.number), self._on_finding)
            watchers.append(self._rank_logs)
        preemption = self.options.preemption
        if preemption is None and detect_cloud() is not None:
            preemption = PreemptionWatcher()
        if preemption is not None:
            watchers.append(preemption)
        return watchers

    def _startup_allowance(self) -> float:
        """supervisor.startup_timeout_s, or longer for RL: the trainer itself waits up to
        inference.startup_timeout_s for its workers (a large vLLM model loads for many minutes)."""
        allowance = self.cfg.supervisor.startup_timeout_s
        if self.cfg.run.job == "rl" and not self.cfg.job.command:
            allowance = max(allowance, self.cfg.inference.startup_timeout_s + 2 * self.cfg.supervisor.poll_interval_s)
        return allowance

    def _gpu_watcher(self, progress: ProgressWatcher, attempt: Attempt):
        """The GPU health watcher of this attempt, recording to gpu.jsonl; None on a machine without GPUs."""
        from prime_train.kit.gpu import GpuHealthWatcher, GpuRecorder, gpu_source, visible_devices

        source = self.options.gpu_source or gpu_source(attempt.number)
        if source is None:
            return None

        def roles() -> dict[str, list[str] | None]:
            # a child's GPUs are what its CUDA_VISIBLE_DEVICES names (set by _specs), else what this process sees
            return {c.name: visible_devices({**os.environ, **c.spec.env}) for c in self.children}

        def may_judge(role: str) -> bool:
            child = next((c for c in self.children if c.name == role), None)
            if child is None or child.poll() is not None:
                return False  # the process watcher judges a dead process
            if child.spec.role == "inference":
                health = self._health_watcher
                return health is not None and role in health.seen_healthy
            # the trainer: in the step phase, past the attempt's first step, and a step overdue
            if progress.phase != Phase.STEP or progress.step is None or progress.first_step is None:
                return False
            return progress.step > progress.first_step and progress.idle_s() > self._step_overdue_s()

        def role_pids(role: str) -> set[int]:  # the role's process tree, looked for in NVML's process list
            return {p.pid for c in self.children if c.name == role for p in c.alive_descendants()}

        recorder = GpuRecorder(self.run_dir.gpu_log_path, attempt.number)
        return GpuHealthWatcher(
            source, roles=roles, may_judge=may_judge, current_step=lambda: progress.step, recorder=recorder,
            role_pids=role_pids,
        )  # fmt: skip

    def _step_overdue_s(self) -> float:
        """How long without progress is longer than a real step takes: three mean steps, at least three polls."""
        polls = 3 * self.cfg.supervisor.poll_interval_s
        mean = self.mean_step_time()
        return max(polls, 3 * mean) if mean is not None else max(polls, 30.0)

    def _judge_exit(
        self, child: ChildProcess, returncode: int, progress: ProgressWatcher, attempt: Attempt, preempted: bool
    ) -> Failure | None:
        """Turn a child's exit into success or a classified Failure with its evidence."""
        child.join_output()
        scanner = self._scanners.get(child.name)
        if scanner is not None:
            for finding in scanner.finish():
                self._on_finding(finding)
        if self._rank_logs is not None and child.spec.role == "trainer":
            self._rank_logs.drain(final=True)  # the rank that failed first may have written its last words there
        hb = read_heartbeat(self.run_dir.progress_path)
        code = job_exit_code(returncode, hb, child.started_at)
        attempt.exit_code = code
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
        self._keeper.after_attempt(named, clean_tmp=not self.cfg.job.command)
        self.events.emit(Event.ATTEMPT_ENDED, attempt=attempt.number, leftover_pids=leftovers)

    def _housekeeping(self) -> None:
        """Each poll: the process record, quarantine notices, and supervisor.json if a full disk refused it."""
        assert self._keeper is not None
        self._keeper.poll({c.name: c.known_processes() for c in self.children})
        if self._state_unwritten:
            self._write_state()

    def _expected_resume(self, attempt: Attempt) -> int | None:
        """The step an attempt will start from, as far as the supervisor can tell before it starts (the engine's
        heartbeat corrects it: a checkpoint that fails verification sends it to an older one)."""
        newest = self._newest_checkpoint_step()
        if self.cfg.job.command:
            return 0 if newest is None else (newest if self.cfg.job.resume_args else None)
        resume = self.cfg.ckpt.resume
        if attempt is self.attempts[0] and resume not in ("auto", "never"):
            return None  # a named checkpoint: its step is known once the job has loaded it
        if attempt is self.attempts[0] and resume == "never":
            return 0
        return newest if newest is not None else 0

    def _stopped_message(self, attempt: Attempt) -> str:
        newest = self._newest_checkpoint_step()
        then = f"the next run resumes from step-{newest}" if newest is not None else "the next run starts from step 0"
        if attempt.last_step is None or attempt.last_step == attempt.resumed_from:
            return f"stopped ({self._stop_reason}) before the attempt's first step: nothing new to checkpoint; {then}"
        return f"stopped ({self._stop_reason}) at step {attempt.last_step}; {then}"

    def _checkpoints_dir(self) -> Path:
        """The checkpoints the disk watcher keeps: the layout's (ckpt.dir), or an external job's job.checkpoint_dir."""
        job = self.cfg.job
        return Path(job.checkpoint_dir) if job.command and job.checkpoint_dir else self.run_dir.checkpoints_dir

    def _disk_statement(self) -> str:
        """What is left on the checkpoints' disk, in words (for a disk-full failure)."""
        return disk_statement(self._checkpoints_dir())

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

    def _status(self, attempt: Attempt, progress: ProgressWatcher, background: Background) -> None:
        hb = progress.last_seen or Heartbeat(None)
        status = {
            "attempt": attempt.number,
            "restarts": len(self.attempts) - 1,
            "step": progress.step,
            # from the heartbeat; train.max_steps only for the engine (an external job never saw it): else unknown
            "max_steps": hb.max_steps or (None if self.cfg.job.command else self.cfg.train.max_steps),
            "phase": progress.phase,
            "loss": hb.loss,
            "tokens_per_s": hb.tokens_per_s,
            "disk": background.disk_usage(),
            "gpu": background.gpu_summary(),
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
