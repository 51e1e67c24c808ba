"""What a run is, built once from its config: one plan class per kind of job.

The supervisor runs every job the same way (resilience/supervisor.py) and never asks which kind it is: it asks
the plan for an attempt's processes (with their roles and the environment every child gets), where the
attempt's progress is read, the newest checkpoint and the step the attempt will resume from, how long its
start-up may take, what is left on the checkpoints' disk, whether checkpoints go to a bucket, and the
watchers that look after the attempt. `plan_for` is the one place that looks at the config's kind
([job].command, run.job): a new kind of job (LoRA, DPO, a reward model, PPO, a sweep) is a new plan class.

- `CommandPlan`: an external command ([job].command), its progress from a file or its output, its
  checkpoints where job.checkpoint_dir says;
- `EnginePlan`: the embedded engine's SFT or pretraining job, one trainer (torchrun's, for several
  processes) whose other ranks' logs are scanned too;
- `RLPlan`: the engine's GRPO trainer and its rollout workers, each on its GPUs, each watched for health.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prime_train.config.schema import Config
from prime_train.contract import Event, Phase, replace_file_atomic
from prime_train.kit.gpu import GpuHealthWatcher, GpuRecorder, GpuSource, gpu_source, visible_devices
from prime_train.kit.observe import Note, Watcher, note
from prime_train.kit.ownership import disk_statement, supervisor_token
from prime_train.kit.process import ChildProcess, ProcessSpec, Role
from prime_train.kit.redact import Redactor
from prime_train.launch import gpu_devices, job_environment, node_rank, plan_engine_launch, rendezvous_endpoint
from prime_train.resilience.logscan import Finding
from prime_train.resilience.watchers import (
    DiskWatcher,
    HeartbeatFile,
    LogProgress,
    PreemptionWatcher,
    ProgressSource,
    ProgressWatcher,
    RankLogs,
    RendezvousWatcher,
    detect_cloud,
)
from prime_train.retention import newest_external_checkpoint
from prime_train.rl.client import worker_url
from prime_train.rl.workers import InferenceHealthWatcher, gpu_plan, inference_specs, worker_name
from prime_train.rl.workers import never_starts as worker_never_starts
from prime_train.rundir import best_checkpoint_step, newest_checkpoint

if TYPE_CHECKING:
    from prime_train.resilience.backup import BackupWatcher

# what a plan has to tell while it builds an attempt's processes: an event and the console's line for it
Tell = Callable[[Note, str], None]


@dataclass(frozen=True)
class AttemptContext:
    """What an attempt's watchers read of the supervisor, and the run-wide watchers it lends them."""

    number: int
    progress: ProgressWatcher
    children: Callable[[], list[ChildProcess]]  # the attempt's live children (a restarted worker replaces its own)
    step_overdue_s: Callable[[], float]  # how long without progress is longer than a real step takes
    on_finding: Callable[[Finding], None]
    backup: BackupWatcher | None = None  # one for the whole run, across attempts
    gpu_source: GpuSource | None = None  # None: NVML when available (or PRIME_TRAIN_GPU_REPLAY's record)
    preemption: PreemptionWatcher | None = None  # None: one on AWS/GCP only, found from DMI


class JobPlan(ABC):
    """One kind of job, as the supervisor runs it."""

    kind: str  # as the run_started event names it: "command", or run.job ("sft", "pretrain", "rl")
    max_steps: int | None = None  # the step total when the supervisor knows it (the heartbeat's has the last word)
    backs_up = False  # whether its checkpoints go to ckpt.remote
    cleans_partial_saves = False  # whether an attempt's unfinished step-N.tmp is removed after it (the engine's)

    def __init__(self, cfg: Config, *, redactor: Redactor, extra_env: Mapping[str, str] | None = None):
        self.cfg = cfg
        self.layout = cfg.layout  # its checkpoints where ckpt.dir puts them: what the job writes, the supervisor reads
        self.redactor = redactor
        self.extra_env = dict(extra_env or {})

    # ------------------------------------------------------------------ processes

    def environment(
        self, attempt: int, *, launch_env: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """What every process of the attempt gets, built where `prime-train train` builds it
        (launch.job_environment): the run's secrets as this run's redactor masked them, the contract's variables,
        `extra` over the supervisor's own extra variables, then the launch plan's `launch_env` where unset."""
        return job_environment(
            self.cfg,
            self.layout,
            attempt=attempt,
            supervisor_token=supervisor_token(),
            launch_env=launch_env,
            extra={**self.extra_env, **(extra or {})},
            masked=self.redactor.masked_config(self.cfg),
        )

    @abstractmethod
    def specs(self, attempt: int, *, first: bool, tell: Tell) -> list[ProcessSpec]:
        """The attempt's processes, in the order they start. `first`: the first attempt of this invocation, which
        runs the config as given. Raises ValueError for a placement the config cannot have, OSError when the
        attempt's config cannot be written."""

    # ------------------------------------------------------------------ progress and checkpoints

    @abstractmethod
    def progress_source(self) -> ProgressSource:
        """Where this attempt's progress is read (a fresh one each attempt)."""

    def progress_watcher(self, source: ProgressSource) -> ProgressWatcher:
        sup = self.cfg.supervisor
        return ProgressWatcher(
            source.read,
            stall_timeout_s=sup.stall_timeout_s,
            startup_timeout_s=self.startup_allowance(),
            save_timeout_s=sup.save_timeout_s,
        )

    def startup_allowance(self) -> float:
        return self.cfg.supervisor.startup_timeout_s

    @property
    @abstractmethod
    def checkpoints_dir(self) -> Path:
        """The checkpoints the disk watcher keeps."""

    @abstractmethod
    def newest_checkpoint_step(self) -> int | None: ...

    @abstractmethod
    def expected_resume(self, *, first: bool) -> int | None:
        """The step an attempt will start from, as far as can be told before it starts (0: fresh; None: unknown
        until the job says). The engine's heartbeat corrects it: a checkpoint that fails verification sends it
        to an older one."""

    def disk_statement(self) -> str:
        """What is left on the checkpoints' disk, in words (for a disk-full failure)."""
        return disk_statement(self.checkpoints_dir)

    # ------------------------------------------------------------------ watchers

    def watchers(self, ctx: AttemptContext) -> list[Watcher]:
        """The attempt's watchers, in the order they are polled."""
        sup, ck, backup = self.cfg.supervisor, self.cfg.ckpt, ctx.backup
        disk = DiskWatcher(
            self.checkpoints_dir,
            keep_last=ck.keep_last,
            keep_every=ck.keep_every,
            high_watermark=sup.disk_high_watermark,
            max_bytes=sup.max_disk_gb * 1e9 if sup.max_disk_gb else None,
            protect=lambda: _kept_steps(self.checkpoints_dir, backup),
        )
        gpu = self._gpu_watcher(ctx)
        preemption = ctx.preemption
        if preemption is None and detect_cloud() is not None:
            preemption = PreemptionWatcher()
        optional = [backup, gpu, *self._log_watchers(ctx), preemption]
        head: list[Watcher] = [ctx.progress, disk, *self._worker_watchers(ctx)]
        return head + [w for w in optional if w is not None]

    def never_starts(self, name: str, code: int | None, findings: list[Finding], tail: list[str]) -> str | None:
        """Why process `name`, dead with `code` (None: alive but wedged), can never start, so that restarting it is
        pointless; None when a restart may help."""
        return None

    def before_restart(self, stop: threading.Event, tell: Tell) -> None:
        """After a failed attempt's backoff, before the next attempt starts: whatever must be over first (returns
        early when `stop` is set)."""
        return None

    def _worker_watchers(self, ctx: AttemptContext) -> list[Watcher]:
        return []

    def _log_watchers(self, ctx: AttemptContext) -> list[Watcher]:
        return []

    def _serving(self, name: str) -> bool:
        """Whether worker `name` has served (so that its GPUs going empty means something)."""
        return False

    def _gpu_watcher(self, ctx: AttemptContext) -> GpuHealthWatcher | None:
        """The GPU health watcher of this attempt, recording to gpu.jsonl; None on a machine without GPUs."""
        source = ctx.gpu_source or gpu_source(ctx.number)
        if source is None:
            return None
        progress = ctx.progress

        def roles() -> dict[str, list[str] | None]:
            # a child's GPUs are what its CUDA_VISIBLE_DEVICES names (set by specs), else what this process sees
            return {c.name: visible_devices({**os.environ, **c.spec.env}) for c in ctx.children()}

        def may_judge(name: str) -> bool:
            child = next((c for c in ctx.children() if c.name == name), None)
            if child is None or child.poll() is not None:
                return False  # the process watcher judges a dead process
            if child.spec.role is Role.INFERENCE:
                return self._serving(name)
            # the trainer: in the step phase, past the attempt's first step, and a step overdue
            if progress.phase != Phase.STEP or progress.step is None or progress.first_step is None:
                return False
            return progress.step > progress.first_step and progress.idle_s() > ctx.step_overdue_s()

        def role_pids(name: str) -> set[int]:  # the process tree, looked for in NVML's process list
            return {p.pid for c in ctx.children() if c.name == name for p in c.alive_descendants()}

        recorder = GpuRecorder(self.layout.gpu_log_path, ctx.number)
        return GpuHealthWatcher(
            source, roles=roles, may_judge=may_judge, current_step=lambda: progress.step, recorder=recorder,
            role_pids=role_pids,
        )  # fmt: skip


def _kept_steps(checkpoints_dir: Path, backup: BackupWatcher | None) -> set[int]:
    """Steps retention spares for now: the one the bucket backup is uploading, and the best one (ckpt.keep_best,
    named in checkpoints/best.json by the engine)."""
    steps = {backup.uploading_step} if backup is not None and backup.uploading_step is not None else set()
    if (best := best_checkpoint_step(checkpoints_dir)) is not None:
        steps.add(best)
    return steps


# ---------------------------------------------------------------------- an external command


class CommandPlan(JobPlan):
    """[job].command: any training command, supervised. Its progress is job.progress_file, or its output read
    with job.progress_regex, or progress.json; its checkpoints are job.checkpoint_dir's, resumed through
    job.resume_args."""

    kind = "command"

    def specs(self, attempt: int, *, first: bool, tell: Tell) -> list[ProcessSpec]:
        job = self.cfg.job
        argv = list(job.command or [])
        if job.checkpoint_dir and job.resume_args:
            found = newest_external_checkpoint(Path(job.checkpoint_dir), job.checkpoint_pattern)
            if found is not None:
                step, path = found
                argv += [a.replace("{step}", str(step)).replace("{path}", str(path)) for a in job.resume_args]
        env = {**self.environment(attempt), **job.env}
        return [ProcessSpec(Role.JOB.value, argv, env, cwd=job.cwd, role=Role.JOB)]

    def progress_source(self) -> ProgressSource:
        job = self.cfg.job
        if job.progress_regex:
            # no step total: train.max_steps is the embedded engine's, an external job's own total is unknown here
            return LogProgress(job.progress_regex, process=Role.JOB.value)
        return HeartbeatFile(Path(job.progress_file) if job.progress_file else self.layout.progress_path)

    @property
    def checkpoints_dir(self) -> Path:
        job = self.cfg.job
        return Path(job.checkpoint_dir) if job.checkpoint_dir else self.layout.checkpoints_dir

    def newest_checkpoint_step(self) -> int | None:
        job = self.cfg.job
        if not job.checkpoint_dir:
            return None
        found = newest_external_checkpoint(Path(job.checkpoint_dir), job.checkpoint_pattern)
        return found[0] if found else None

    def expected_resume(self, *, first: bool) -> int | None:
        newest = self.newest_checkpoint_step()
        return 0 if newest is None else (newest if self.cfg.job.resume_args else None)


# ---------------------------------------------------------------------- the embedded engine


class EnginePlan(JobPlan):
    """The embedded engine's SFT or pretraining job: one trainer, under torchrun for several processes."""

    cleans_partial_saves = True

    def __init__(self, cfg: Config, *, redactor: Redactor, extra_env: Mapping[str, str] | None = None):
        super().__init__(cfg, redactor=redactor, extra_env=extra_env)
        self.kind = cfg.run.job
        self.max_steps = cfg.train.max_steps
        self.backs_up = cfg.ckpt.remote is not None
        self.rendezvous: RendezvousWatcher | None = None
        if cfg.distributed.nnodes > 1 and node_rank(cfg) > 0:
            # node 0's old agent lives on until node 0 notices the loss: peer_timeout_s, a beat, its teardown
            bound = 2 * cfg.distributed.peer_timeout_s + 30
            self.rendezvous = RendezvousWatcher(rendezvous_endpoint(cfg), bound_s=bound)

    def specs(self, attempt: int, *, first: bool, tell: Tell) -> list[ProcessSpec]:
        config_path = str(self._attempt_config_path(attempt, first=first))
        trainer_gpus, workers = self._place(config_path, gpu_devices(), tell)
        launch = plan_engine_launch(
            self.cfg, config_path, log_dir=str(self.layout.rank_logs(attempt)), num_gpus=len(trainer_gpus)
        )
        count, why = launch.threads
        tell(note(Event.CPU_THREADS, threads=count, why=why), f"note: {count} CPU thread(s) per trainer process: {why}")
        # the trainer's GPUs by name: the GPU watcher judges exactly these, and a user's CUDA_VISIBLE_DEVICES=4,5
        # stays 4,5
        gpus = {"CUDA_VISIBLE_DEVICES": ",".join(trainer_gpus)} if trainer_gpus else {}
        env = self.environment(attempt, launch_env=launch.env, extra=gpus)
        for w in workers:
            w.env = {**env, **w.env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        # workers first: the trainer waits for their /health before its first rollout
        return [*workers, ProcessSpec(Role.TRAINER.value, launch.argv, env, role=Role.TRAINER)]

    def _place(self, config_path: str, devices: list[str], tell: Tell) -> tuple[list[str], list[ProcessSpec]]:
        """The trainer's GPUs (of `devices`, the GPUs the run may use) and the processes beside it."""
        nproc = self.cfg.distributed.nproc_per_node
        return (devices[:nproc] if nproc else devices), []

    def _attempt_config_path(self, attempt: int, *, first: bool) -> Path:
        """The first attempt runs the config as given; later ones always resume from the newest whole checkpoint."""
        if first or self.cfg.ckpt.resume == "auto":
            return self.layout.config_path
        cfg = self.cfg.model_copy(deep=True)
        if newest_checkpoint(self.layout.checkpoints_dir) is not None:
            cfg.ckpt.resume = "auto"
        path = self.layout.root / f"config.attempt-{attempt}.toml"
        replace_file_atomic(path, self.redactor.masked_config(cfg).text.encode(), mode=0o666)  # never through a link
        return path

    def progress_source(self) -> ProgressSource:
        return HeartbeatFile(self.layout.progress_path)

    @property
    def checkpoints_dir(self) -> Path:
        return self.layout.checkpoints_dir  # ckpt.dir, where several nodes share them

    def newest_checkpoint_step(self) -> int | None:
        newest = newest_checkpoint(self.checkpoints_dir)
        return newest.step if newest else None

    def expected_resume(self, *, first: bool) -> int | None:
        newest = self.newest_checkpoint_step()
        resume = self.cfg.ckpt.resume
        if first and resume not in ("auto", "never"):
            return None  # a named checkpoint: its step is known once the job has loaded it
        if first and resume == "never":
            return 0
        return newest if newest is not None else 0

    def _log_watchers(self, ctx: AttemptContext) -> list[Watcher]:
        # torchrun keeps the other ranks' output in its --log-dir only: their failures are scanned there
        return [RankLogs(self.layout.rank_logs(ctx.number), ctx.on_finding)]

    def watchers(self, ctx: AttemptContext) -> list[Watcher]:
        return super().watchers(ctx) + ([self.rendezvous] if self.rendezvous is not None else [])

    def before_restart(self, stop: threading.Event, tell: Tell) -> None:
        if self.rendezvous is not None:
            self.rendezvous.wait_until_gone(stop, tell)


class RLPlan(EnginePlan):
    """GRPO: the engine's trainer and inference.num_workers rollout workers, each on the GPUs `gpu_plan` gives it,
    each asked for its /health; a dead or wedged worker is restarted on its own."""

    def __init__(self, cfg: Config, *, redactor: Redactor, extra_env: Mapping[str, str] | None = None):
        super().__init__(cfg, redactor=redactor, extra_env=extra_env)
        self._health: InferenceHealthWatcher | None = None  # the current attempt's

    def _place(self, config_path: str, devices: list[str], tell: Tell) -> tuple[list[str], list[ProcessSpec]]:
        gpus = gpu_plan(self.cfg, devices)
        if gpus.note:
            tell(note(Event.GPU_PLAN, note=gpus.note, trainer=gpus.trainer, workers=gpus.workers), f"note: {gpus.note}")
        return gpus.trainer, inference_specs(self.cfg, config_path, gpus)

    def startup_allowance(self) -> float:
        """supervisor.startup_timeout_s, or longer: the trainer itself waits up to inference.startup_timeout_s for
        its workers (a large vLLM model loads for many minutes)."""
        sup = self.cfg.supervisor
        return max(sup.startup_timeout_s, self.cfg.inference.startup_timeout_s + 2 * sup.poll_interval_s)

    def _worker_watchers(self, ctx: AttemptContext) -> list[Watcher]:
        inf = self.cfg.inference
        urls = {worker_name(i): worker_url(self.cfg, i) for i in range(inf.num_workers)}
        self._health = InferenceHealthWatcher(urls, timeout_s=inf.health_timeout_s)
        return [self._health]

    def _serving(self, name: str) -> bool:
        return self._health is not None and name in self._health.seen_healthy

    def never_starts(self, name: str, code: int | None, findings: list[Finding], tail: list[str]) -> str | None:
        return worker_never_starts(name, code, findings, self._health, tail)


# the embedded engine's jobs, by run.job
ENGINE_PLANS: dict[str, type[EnginePlan]] = {
    "sft": EnginePlan, "pretrain": EnginePlan, "rl": RLPlan, "reward": EnginePlan, "dpo": EnginePlan,
    "meta": EnginePlan,
}  # fmt: skip


def plan_for(cfg: Config, *, redactor: Redactor | None = None, extra_env: Mapping[str, str] | None = None) -> JobPlan:
    """The plan of the job `cfg` describes: the one place that asks which kind it is."""
    redactor = redactor if redactor is not None else Redactor.for_run(cfg, {**os.environ, **(extra_env or {})})
    if cfg.job.command:
        return CommandPlan(cfg, redactor=redactor, extra_env=extra_env)
    return ENGINE_PLANS[cfg.run.job](cfg, redactor=redactor, extra_env=extra_env)
