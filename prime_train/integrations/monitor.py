"""`prime-train monitor`: is a spot training run healthy, stalled, dead or finished, and bring it back.

The run lives on machines we cannot see. Three readings tell us about it:
- the heartbeat: the job's progress.json ({"step", "max_steps", "phase", "time", ...}), copied to
  the checkpoint bucket every `ckpt.heartbeat_interval_s`. Its "time" (the job's wall clock when
  it wrote it) is the only measure of liveness used here;
- SkyPilot's managed-job status (RUNNING, RECOVERING, FAILED, ...), with when the job last
  started or recovered;
- optionally W&B's run state. Only evidence: W&B's data lags on its own, a W&B run says
  "running" long after its process froze, and "finished" also follows a preemption.

`decide` turns one set of readings into a Decision; `monitor` takes the readings, decides, and
(with resume) relaunches the managed job when it is dead, or when it has been stalled for longer
than a limit (cancelling the wedged job first). It is meant to run from cron or the GitHub
Actions workflow in .github/workflows/training-monitor.yml.

Exit codes of `prime-train monitor` (Decision.exit_code):
  0  healthy or finished
  2  unknown (nothing to judge yet, a reading failed)
  3  stalled: SkyPilot says the job runs but its heartbeat stopped
  4  dead: the job failed, or its heartbeat stopped and SkyPilot has no job
  78 a configuration error (MonitorConfigError, through the CLI's error handler)

Thresholds come from the config (`thresholds`): the on-node supervisor gets its own chance to
detect a hang and restart (stall_timeout_s + term_grace_s + backoff_max_s) before the monitor,
which also allows for the heartbeat's upload interval, calls the run stalled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prime_train.config.schema import Config
from prime_train.contract import SLOW_PHASES, STARTUP_PHASES, ExitCode, Phase
from prime_train.integrations.skypilot import FAILURE_STATUSES, scrub

EXIT_OK = 0
EXIT_UNKNOWN = 2
EXIT_STALLED = 3
EXIT_DEAD = 4
_EXIT = {"healthy": EXIT_OK, "finished": EXIT_OK, "unknown": EXIT_UNKNOWN, "stalled": EXIT_STALLED, "dead": EXIT_DEAD}

# SkyPilot 0.14 ManagedJobStatus values, grouped by what they mean for the run
RUNNING_STATUSES = ("RUNNING", "WINDING_DOWN")
STARTING_STATUSES = ("PENDING", "SUBMITTED", "STARTING")
RECOVERING_STATUSES = ("RECOVERING",)
CANCELLED_STATUSES = ("CANCELLED", "CANCELLING")
SUCCEEDED_STATUSES = ("SUCCEEDED",)
# failures a relaunch cannot fix: SkyPilot found no feasible resources or the precheck failed
NOT_RELAUNCHABLE = ("FAILED_PRECHECKS",)

# a new node installs prime-train and its engine (torch, transformers) before the first heartbeat
SETUP_ALLOWANCE_S = 1800.0


class MonitorConfigError(RuntimeError):
    """The monitor cannot run with this config or environment (exit code 78, as every command's bad input)."""


@dataclass(frozen=True)
class Decision:
    state: str  # healthy | stalled | dead | finished | unknown
    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)
    relaunchable: bool = False

    @property
    def exit_code(self) -> int:
        return _EXIT[self.state]

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "reason": self.reason, "relaunchable": self.relaunchable, **self.evidence}


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def normalize_heartbeat(heartbeat: Any) -> dict[str, Any] | None:
    """progress.json as a dict, whether given bare or wrapped as {"progress": {...}, "uploaded_at": t}.

    Its phase is read in today's names (an older prime-train's heartbeat may still be in the bucket).
    """
    if not isinstance(heartbeat, dict):
        return None
    inner = heartbeat.get("progress")
    if isinstance(inner, dict):
        uploaded = heartbeat.get("uploaded_at", heartbeat.get("upload_time"))
        heartbeat = {**inner, **({"uploaded_at": uploaded} if uploaded is not None else {})}
    phase = Phase.parse(heartbeat.get("phase"))
    return {**heartbeat, "phase": phase.value} if phase is not None else heartbeat


@dataclass(frozen=True)
class _Readings:
    """One set of readings made ready to judge: the status, the heartbeat (None when it is no evidence), its age."""

    status: str | None
    hb: dict[str, Any] | None
    hb_time: float | None
    age: float | None
    phase: Any
    step: Any
    at_step: str  # " (last step N)", or ""
    ev: dict[str, Any]  # the evidence the Decision carries


def decide(
    heartbeat: dict[str, Any] | None,
    job_status: str | None,
    wandb_state: str | None,
    now: float,
    stall_after_s: float,
    save_grace_s: float,
    *,
    startup_grace_s: float | None = None,
    job_started_at: float | None = None,
    job_status_error: str | None = None,
) -> Decision:
    """One verdict from one set of readings (no I/O: recorded readings give the same answer).

    `job_status` None means SkyPilot has no job by this name; `job_status_error` set means its
    status could not be read (then the heartbeat alone decides, and nothing is relaunched).
    `job_started_at` (when SkyPilot last started or recovered the job) dates the heartbeat: one
    written before it belongs to an earlier job and is no evidence about this one.
    """
    startup_grace_s = stall_after_s if startup_grace_s is None else startup_grace_s
    r = _readings(heartbeat, job_status, wandb_state, now, job_started_at, job_status_error)
    settled = _settled(r)
    if settled is not None:
        return settled
    # RUNNING, an unrecognised status, no job at all, or a status we could not read
    if r.status is not None and r.status not in RUNNING_STATUSES:
        r.ev["unrecognised_status"] = True
    if r.hb is None or r.hb_time is None:
        return _without_heartbeat(r, now, startup_grace_s, job_started_at, job_status_error)
    return _by_heartbeat_age(r, wandb_state, stall_after_s, save_grace_s, startup_grace_s, job_status_error)


def _readings(
    heartbeat: dict[str, Any] | None,
    job_status: str | None,
    wandb_state: str | None,
    now: float,
    job_started_at: float | None,
    job_status_error: str | None,
) -> _Readings:
    """The readings, normalised: a heartbeat from before the job started is set aside, a clock ahead of ours is
    counted as no age, and what was seen goes into the evidence."""
    status = job_status.strip().upper() if isinstance(job_status, str) and job_status.strip() else None
    hb = normalize_heartbeat(heartbeat)
    ev: dict[str, Any] = {"job_status": status, "wandb_state": wandb_state}
    if job_status_error:
        ev["job_status_error"] = job_status_error
    if heartbeat is not None and hb is None:
        ev["heartbeat_malformed"] = True
    hb_time = _number(hb.get("time")) if hb else None
    if hb is not None and hb_time is None:
        hb_time = _number(hb.get("uploaded_at"))
    if hb is not None:
        ev.update(step=hb.get("step"), max_steps=hb.get("max_steps"), phase=hb.get("phase"))
    if hb is not None and job_started_at is not None and hb_time is not None and hb_time < job_started_at:
        # an earlier job's last words (SkyPilot restarted or a relaunch happened since)
        ev["heartbeat_predates_job"] = True
        hb, hb_time = None, None
    step = hb.get("step") if hb else None
    age: float | None = None
    if hb_time is not None:
        age = now - hb_time
        if age < 0:  # the node's clock is ahead of ours
            ev["clock_skew_s"] = round(-age, 1)
            age = 0.0
        ev["heartbeat_age_s"] = round(age, 1)
    return _Readings(
        status=status,
        hb=hb,
        hb_time=hb_time,
        age=age,
        phase=hb.get("phase") if hb else None,
        step=step,
        at_step=f" (last step {step})" if step is not None else "",
        ev=ev,
    )


def _settled(r: _Readings) -> Decision | None:
    """The verdict when the status or the heartbeat's phase settles it (done, cancelled, failed, recovering,
    starting), whatever the heartbeat's age; None when its age must decide."""
    status, at_step, ev = r.status, r.at_step, r.ev
    if status in SUCCEEDED_STATUSES:
        return Decision("finished", f"SkyPilot reports the job {status}{at_step}", ev)
    if status in CANCELLED_STATUSES:
        return Decision("finished", f"the job was cancelled ({status}); a cancelled job is not relaunched", ev)
    if status in FAILURE_STATUSES:
        config_error = r.hb is not None and r.hb.get("exit_code") == ExitCode.CONFIG
        relaunchable = status not in NOT_RELAUNCHABLE and not config_error
        why = ""
        if config_error:
            why = "; the job exited with a configuration error (78): fix the config, a relaunch would fail again"
        elif status in NOT_RELAUNCHABLE:
            why = "; SkyPilot's prechecks failed (resources, credentials): a relaunch would fail again"
        return Decision("dead", f"SkyPilot reports the job {status}{at_step}{why}", ev, relaunchable)
    if r.phase == Phase.DONE:
        return Decision("finished", f"the heartbeat says training is done{at_step}", ev)
    if status in RECOVERING_STATUSES:
        return Decision(
            "healthy",
            f"SkyPilot is recovering the job (preemption or failure){at_step}; a stale heartbeat is expected",
            ev,
        )
    if status in STARTING_STATUSES:
        return Decision("healthy", f"the job is {status} (waiting for the controller or a node)", ev)
    return None


def _without_heartbeat(
    r: _Readings, now: float, startup_grace_s: float, job_started_at: float | None, job_status_error: str | None
) -> Decision:
    """The verdict with no heartbeat to go by: unknown, still starting up, or stalled since the job started."""
    status, ev = r.status, r.ev
    unreadable = job_status_error is not None
    if unreadable:
        return Decision("unknown", f"no heartbeat, and SkyPilot could not be asked: {job_status_error}", ev)
    if status is None:
        return Decision("unknown", "no heartbeat, and SkyPilot has no job by this name: nothing launched yet?", ev)
    if job_started_at is None:
        return Decision("healthy", f"the job is {status}; no heartbeat yet", ev)
    since = max(0.0, now - job_started_at)
    ev["since_start_s"] = round(since, 1)
    if since <= startup_grace_s:
        return Decision(
            "healthy",
            f"the job is {status}; no heartbeat yet {since:.0f}s after it started "
            f"(start-up allowance {startup_grace_s:.0f}s)",
            ev,
        )
    ev["stalled_for_s"] = round(since - startup_grace_s, 1)
    return Decision(
        "stalled",
        f"SkyPilot says {status} but no heartbeat arrived in the {since:.0f}s since the job started "
        f"(start-up allowance {startup_grace_s:.0f}s)",
        ev,
        relaunchable=not unreadable,
    )


def _by_heartbeat_age(
    r: _Readings,
    wandb_state: str | None,
    stall_after_s: float,
    save_grace_s: float,
    startup_grace_s: float,
    job_status_error: str | None,
) -> Decision:
    """The verdict from the heartbeat's age against what its phase is allowed: healthy, stalled, or dead when
    SkyPilot has no job."""
    status, hb, age, phase, ev = r.status, r.hb, r.age, r.phase, r.ev
    assert hb is not None and age is not None
    if phase in SLOW_PHASES:
        allowance, what = stall_after_s + save_grace_s, f"phase '{phase}'"
    elif phase in STARTUP_PHASES:
        allowance, what = max(stall_after_s, startup_grace_s), f"phase '{phase}'"
    else:
        allowance, what = stall_after_s, "a training step"
    ev["allowance_s"] = round(allowance, 1)
    of = f"/{hb.get('max_steps')}" if hb.get("max_steps") is not None else ""
    if age <= allowance:
        return Decision("healthy", f"step {r.step}{of}, heartbeat {age:.0f}s old (allowance {allowance:.0f}s)", ev)
    ev["stalled_for_s"] = round(age - allowance, 1)
    stale = f"the heartbeat is {age:.0f}s old, over the {allowance:.0f}s allowed for {what}{r.at_step}"
    if job_status_error is not None:
        return Decision("stalled", f"{stale}; SkyPilot could not be asked: {job_status_error}", ev)
    if status is None:
        return Decision(
            "dead",
            f"{stale}, and SkyPilot has no job by this name; not relaunched automatically (it may run under "
            "another SkyPilot API server): launch it with `prime-train run --spot` if it is gone",
            ev,
        )
    lag = " (W&B still says 'running'; its state lags and is not a heartbeat)" if wandb_state == "running" else ""
    return Decision("stalled", f"{stale} while SkyPilot says {status}{lag}", ev, relaunchable=True)


# ---------------------------------------------------------------- thresholds and the monitor


def thresholds(cfg: Config) -> dict[str, float]:
    """stall_after_s, save_grace_s, startup_grace_s and stalled_relaunch_after_s for this config."""
    sup, ck = cfg.supervisor, cfg.ckpt
    stall = sup.stall_timeout_s + sup.term_grace_s + sup.backoff_max_s + ck.heartbeat_interval_s
    return {
        "stall_after_s": stall,
        "save_grace_s": sup.save_timeout_s,
        "startup_grace_s": sup.startup_timeout_s + ck.heartbeat_interval_s + SETUP_ALLOWANCE_S,
        # relaunch a stalled job once it has been stalled this much longer (about one more monitor run)
        "stalled_relaunch_after_s": stall,
    }


@dataclass
class MonitorResult:
    decision: Decision
    action: str  # "none", "relaunched", or why a relaunch was wanted but not done
    relaunch_result: Any = None

    @property
    def exit_code(self) -> int:
        return self.decision.exit_code

    def to_dict(self) -> dict[str, Any]:
        out = {**self.decision.to_dict(), "action": self.action, "exit_code": self.exit_code}
        if isinstance(self.relaunch_result, dict):
            out["job_ids"] = self.relaunch_result.get("job_ids")
        return out

    def format(self) -> str:
        d = self.decision
        lines = [f"{d.state}: {d.reason}"]
        if self.action != "none":
            lines.append(f"action: {self.action}")
        shown = {k: v for k, v in d.evidence.items() if v is not None}
        if shown:
            lines.append("evidence: " + json.dumps(shown, sort_keys=True, default=str))
        return "\n".join(lines)


def _job_info(value: Any) -> tuple[str | None, float | None, int]:
    """(status, started_at, recent_failures) from a status string or a spot_status() record."""
    if value is None or isinstance(value, str):
        return value, None, 0
    if isinstance(value, dict):
        starts = [_number(value.get(k)) for k in ("start_at", "last_recovered_at")]
        started = max((s for s in starts if s is not None), default=None)
        failures = value.get("recent_failures")
        return (
            (str(value["status"]) if value.get("status") else None),
            started,
            int(failures) if isinstance(failures, int) else 0,
        )
    raise TypeError(f"job_status_reader returned {type(value).__name__}; expected str, dict or None")


def _read(reader: Callable[[], Any] | None, what: str, evidence: dict[str, str]) -> Any:
    if reader is None:
        return None
    try:
        return reader()
    except Exception as exc:
        evidence[what] = scrub(f"{type(exc).__name__}: {exc}")[:500]
        return None


def monitor(
    cfg: Config,
    *,
    resume: bool,
    heartbeat_reader: Callable[[], dict[str, Any] | None],
    job_status_reader: Callable[[], str | dict[str, Any] | None],
    wandb_reader: Callable[[], str | None] | None = None,
    relaunch: Callable[[Decision], Any] | None = None,
    now: float | None = None,
    max_relaunches: int = 3,
    stalled_relaunch_after_s: float | None = None,
    recoveries_reader: Callable[[], dict[str, Any] | None] | None = None,
) -> MonitorResult:
    """Read, decide, and with `resume` relaunch a dead (or long-stalled) run through `relaunch`.

    `job_status_reader` returns SkyPilot's status string, or a `skypilot.spot_status` record
    (status, start_at, last_recovered_at, recent_failures), or None when SkyPilot has no such
    job. A reader that raises is recorded and judged as "could not read". A relaunch happens at
    most once per call, never for a cancelled or finished job or a configuration error, and not
    when `recent_failures` already reached `max_relaunches` (a job that keeps dying needs a human), nor for a job
    that stopped itself at spot.max_recoveries (`recoveries_reader`: the bucket's count, storage.recovery_gate).
    """
    errors: dict[str, str] = {}
    heartbeat = _read(heartbeat_reader, "heartbeat_error", errors)
    raw_job = _read(job_status_reader, "job_status_error", errors)
    wandb_state = _read(wandb_reader, "wandb_error", errors)
    recoveries = _read(recoveries_reader, "recoveries_error", errors)
    status, started_at, recent_failures = _job_info(raw_job)
    th = thresholds(cfg)
    decision = decide(
        heartbeat,
        status,
        wandb_state if isinstance(wandb_state, str) else None,
        time.time() if now is None else now,
        th["stall_after_s"],
        th["save_grace_s"],
        startup_grace_s=th["startup_grace_s"],
        job_started_at=started_at,
        job_status_error=errors.get("job_status_error"),
    )
    extra = {k: v for k, v in errors.items() if k != "job_status_error"}
    if recent_failures:
        extra["recent_failures"] = recent_failures
    if extra:
        decision = Decision(decision.state, decision.reason, {**decision.evidence, **extra}, decision.relaunchable)
    if decision.state == "dead" and decision.relaunchable:
        decision = _unless_it_gave_up(decision, recoveries, started_at)

    limit = th["stalled_relaunch_after_s"] if stalled_relaunch_after_s is None else stalled_relaunch_after_s
    wanted = decision.relaunchable and (
        decision.state == "dead"
        or (decision.state == "stalled" and float(decision.evidence.get("stalled_for_s") or 0) >= limit)
    )
    if not wanted:
        return MonitorResult(decision, "none")
    if not resume:
        return MonitorResult(decision, "relaunch needed: run again with --resume to relaunch it")
    if recent_failures >= max_relaunches:
        return MonitorResult(
            decision,
            f"not relaunched: {recent_failures} failed job(s) under this name in the last day "
            f"(limit {max_relaunches}); look at `prime-train spot logs` first",
        )
    if relaunch is None:
        return MonitorResult(decision, "relaunch needed but no way to relaunch was given")
    try:
        result = relaunch(decision)
    except Exception as exc:
        return MonitorResult(decision, "relaunch failed: " + scrub(f"{type(exc).__name__}: {exc}")[:1000])
    return MonitorResult(decision, "relaunched", result)


def _unless_it_gave_up(decision: Decision, record: Any, started_at: float | None) -> Decision:
    """A dead job that stopped itself at spot.max_recoveries is not relaunched: it would exit the same way again."""
    if not isinstance(record, dict) or not record.get("gave_up"):
        return decision
    gave_up_at = _number(record.get("gave_up_at"))
    if started_at is not None and gave_up_at is not None and gave_up_at < started_at:
        return decision  # an earlier job's verdict
    reason = f"{decision.reason}; it stopped itself: {record['gave_up']}"
    return Decision("dead", reason, {**decision.evidence, "recoveries": record.get("recoveries")}, relaunchable=False)


# ---------------------------------------------------------------- real readers and the relaunch


def storage_heartbeat_reader(cfg: Config) -> Callable[[], dict[str, Any] | None]:
    """The heartbeat the job copies to `<ckpt.remote>/progress.json` (boto3, imported when read)."""
    if not cfg.ckpt.remote:
        raise MonitorConfigError(
            "ckpt.remote is not set: the monitor reads the run's heartbeat from the checkpoint bucket "
            "(set ckpt.remote = 's3://bucket/prefix')"
        )

    def read() -> dict[str, Any] | None:
        from prime_train.integrations.storage import CheckpointStore

        return CheckpointStore(cfg.ckpt.remote, endpoint_url=cfg.ckpt.remote_endpoint_url).get_heartbeat()

    return read


def storage_recoveries_reader(cfg: Config) -> Callable[[], dict[str, Any] | None] | None:
    """The recovery count `spot recovery-gate` keeps in the bucket; None without ckpt.remote."""
    if not cfg.ckpt.remote:
        return None

    def read() -> dict[str, Any] | None:
        from prime_train.integrations.storage import CheckpointStore

        return CheckpointStore(cfg.ckpt.remote, endpoint_url=cfg.ckpt.remote_endpoint_url).get_recoveries()

    return read


def file_heartbeat_reader(path: str) -> Callable[[], dict[str, Any] | None]:
    """progress.json read from a path (a run directory on this machine, a mounted bucket)."""
    from prime_train.contract import read_json

    return lambda: read_json(path)


def skypilot_job_reader(name: str, sky_python: str | None = None) -> Callable[[], dict[str, Any] | None]:
    from prime_train.integrations.skypilot import spot_status

    return lambda: spot_status(name, sky_python)


def wandb_state_reader(cfg: Config) -> Callable[[], str | None] | None:
    """W&B's state ("running", "finished", "crashed", ...) of the newest run with this run's name.

    None when the config logs to no W&B project. The engine picks its own W&B run id, so the run
    is found by its display name (run.name) in the project.
    """
    if not cfg.logging.wandb_project or cfg.logging.wandb_mode != "online":
        return None
    project, entity, name = cfg.logging.wandb_project, cfg.logging.wandb_entity, cfg.run.name

    def read() -> str | None:
        import wandb

        path = f"{entity}/{project}" if entity else project
        runs = wandb.Api(timeout=30).runs(path, filters={"display_name": name}, order="-created_at", per_page=1)
        for run in runs:
            return str(run.state)
        return None

    return read


def skypilot_relaunch(
    cfg: Config,
    *,
    config_files: list[str],
    overrides: list[str],
    sky_python: str | None = None,
    stream: Callable[[str], None] | None = None,
) -> Callable[[Decision], dict[str, Any]]:
    """A relaunch that cancels a wedged job first, then launches the config as a new managed job."""
    from prime_train.integrations import skypilot

    def relaunch(decision: Decision) -> dict[str, Any]:
        name = skypilot.job_name(cfg)
        if decision.evidence.get("job_status") in (*RUNNING_STATUSES, *STARTING_STATUSES, *RECOVERING_STATUSES):
            skypilot.spot_cancel(name, sky_python)
        task = skypilot.task_from_config(cfg, config_files=config_files, overrides=overrides)
        return skypilot.launch(task, sky_python, stream=stream)

    return relaunch


def run_monitor(
    cfg: Config,
    *,
    config_files: list[str],
    overrides: list[str],
    resume: bool,
    sky_python: str | None = None,
    now: float | None = None,
) -> MonitorResult:
    """`prime-train monitor CFG... [--resume]`: the real readers (bucket, SkyPilot, W&B) and relaunch."""
    from prime_train.integrations import skypilot

    problem = skypilot.api_server_problem()
    if problem:
        raise MonitorConfigError(problem)
    python = sky_python or skypilot.find_sky_python()
    return monitor(
        cfg,
        resume=resume,
        heartbeat_reader=storage_heartbeat_reader(cfg),
        job_status_reader=skypilot_job_reader(skypilot.job_name(cfg), python),
        wandb_reader=wandb_state_reader(cfg),
        relaunch=skypilot_relaunch(cfg, config_files=config_files, overrides=overrides, sky_python=python),
        now=now,
        recoveries_reader=storage_recoveries_reader(cfg),
    )
