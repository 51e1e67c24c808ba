"""The optuna side of a sweep: the storage, the sampler and pruner a SWEEP.toml names, and who owns which trial.

Several `prime-train sweep` processes may share one study (a database, or optuna's journal file on a shared disk).
A trial is owned by the process that runs it: its host, pid and process start time are in the trial's user
attributes, with a heartbeat it refreshes. A trial left RUNNING by an owner that is gone (kill -9, a lost machine)
is interrupted, and the next sweep process adopts it: its run resumes from its newest checkpoint, so no trial
trains twice. New trials are asked under a lock file in the sweep directory, so that processes sharing it never
ask more than `trials`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prime_train.config.loader import ConfigError, Problem
from prime_train.contract import process_started_at, same_process_alive
from prime_train.sweep.spec import SweepSpec, grid_points, is_int_key

JOURNAL_PREFIX = "journal:"
STUDY_DB = "study.db"
# another machine's trial is interrupted when its owner has not beaten for this long
STALE_S = 600.0
HEARTBEAT_S = 30.0


def storage_url(spec: SweepSpec, given: str | None) -> str:
    """--storage as given, or the SQLite file in the sweep directory."""
    return given or f"sqlite:///{spec.sweep_dir / STUDY_DB}"


def open_storage(url: str):
    """optuna's storage for a URL: `journal:PATH` is its journal file (for a shared disk), anything else a database
    URL (sqlite:///, postgresql://, mysql://)."""
    import optuna

    if url.startswith(JOURNAL_PREFIX):
        from optuna.storages.journal import JournalFileBackend

        return optuna.storages.JournalStorage(JournalFileBackend(url[len(JOURNAL_PREFIX) :]))
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite:"):
        kwargs = {"connect_args": {"timeout": 60}}  # several threads and processes write the one file
    try:
        return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)
    except Exception as exc:  # SQLAlchemy's errors: a URL it cannot parse, a driver missing, a server refusing
        msg = f"--storage: cannot open {_masked_url(url)}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        raise ConfigError([Problem("--storage", 0, 0, "storage", "error", msg)]) from None


def _masked_url(url: str) -> str:
    """A database URL without its password, for messages and files."""
    from sqlalchemy.engine import make_url

    with contextlib.suppress(Exception):
        return make_url(url).render_as_string(hide_password=True)
    return url.split("@")[-1]


def shown_url(url: str) -> str:
    return url if url.startswith((JOURNAL_PREFIX, "sqlite:")) else _masked_url(url)


def make_sampler(spec: SweepSpec, process: int = 0):
    """The sampler; the `process`-th sweep process to join a study with a seed gets seed + process: processes that
    share a study (or a sweep run again after a stop) would otherwise draw the same values."""
    import optuna

    s = spec.section
    seed = None if s.seed is None else s.seed + process
    if s.sampler == "grid":
        space = {k: grid_points(k, p) for k, p in s.space.items()}
        return optuna.samplers.GridSampler(space, seed=seed)
    if s.sampler == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if s.sampler == "cmaes":
        return optuna.samplers.CmaEsSampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)  # random, and PBT's first population


def make_pruner(spec: SweepSpec, eval_interval: int, max_steps: int):
    """The pruner: hyperband's rungs from the first evaluation to the last step."""
    import optuna

    s = spec.section
    if s.pruner == "hyperband" and s.sampler != "pbt":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, eval_interval), max_resource=max(1, max_steps))
    if s.pruner == "median" and s.sampler != "pbt":
        return optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    return optuna.pruners.NopPruner()


def open_study(spec: SweepSpec, url: str, eval_interval: int, max_steps: int):
    """The study (made, or joined), with this process's sampler: it counts the sweep processes that joined it."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with study_lock(spec.sweep_dir):
        study = optuna.create_study(
            study_name=spec.section.name,
            storage=open_storage(url),
            sampler=make_sampler(spec),
            pruner=make_pruner(spec, eval_interval, max_steps),
            direction=spec.section.direction,
            load_if_exists=True,
        )
        joined = int(study.user_attrs.get("sweep_processes", 0))
        study.set_user_attr("sweep_processes", joined + 1)
    if joined:
        study.sampler = make_sampler(spec, process=joined)
    return study


def suggest(trial, spec: SweepSpec) -> dict[str, Any]:
    """The trial's parameters, through optuna's suggest API (the sampler decides)."""
    params: dict[str, Any] = {}
    for key, p in spec.section.space.items():
        if p.choices is not None:
            params[key] = trial.suggest_categorical(key, p.choices)
        elif is_int_key(key):
            params[key] = trial.suggest_int(key, int(p.low), int(p.high), step=int(p.step or 1), log=p.log)
        else:
            params[key] = trial.suggest_float(key, float(p.low), float(p.high), step=p.step, log=p.log)
    return params


# ---------------------------------------------------------------- a trial by its number

# optuna reopens no trial by number but in `tell`: reporting to, or setting an attribute of, a RUNNING trial that
# another process asked (an interrupted trial taken over) goes through the study's storage by the trial's id


def trial_id(study, number: int) -> int:
    return study._storage.get_trial_id_from_study_id_trial_number(study._study_id, number)


def live_trial(study, number: int):
    """The optuna Trial to report a RUNNING trial's values to, whichever process asked it."""
    import optuna

    return optuna.trial.Trial(study, trial_id(study, number))


def set_trial_attr(study, number: int, key: str, value: Any) -> None:
    study._storage.set_trial_user_attr(trial_id(study, number), key, value)


# ---------------------------------------------------------------- ownership


def owner() -> dict[str, Any]:
    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "pid_started": process_started_at(pid), "beat": time.time()}


def owner_gone(attrs: dict[str, Any], now: float | None = None) -> bool:
    """Whether the process that owned a RUNNING trial is gone: on this host by its pid, elsewhere by its heartbeat."""
    o = attrs.get("owner")
    if not isinstance(o, dict):
        return True
    if o.get("host") == socket.gethostname() and isinstance(o.get("pid"), int):
        return not same_process_alive(o["pid"], o.get("pid_started"))
    beat = o.get("beat")
    return not isinstance(beat, int | float) or (now or time.time()) - beat > STALE_S


@contextlib.contextmanager
def study_lock(sweep_dir: Path) -> Iterator[None]:
    """The sweep directory's lock: one process at a time asks a trial or adopts one."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(sweep_dir / ".study.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the flock
