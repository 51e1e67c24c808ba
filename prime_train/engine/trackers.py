"""Experiment trackers behind one small protocol: TensorBoard, W&B, MLflow, ClearML and Neptune (rank 0 only).

`logging.trackers` picks them (unset: TensorBoard when logging.tensorboard, W&B when logging.wandb_project). Every
tracker takes the same calls from MetricsLogger, which writes metrics.jsonl first (the record the supervisor and
`status` read; a tracker is a copy):

- `log(step, scalars)`: one step's numbers; `text(step, tag, text)`: sample generations;
- `rewind(step)`: a resume retrains the steps after `step` (TensorBoard purges them; the others keep what they have
  and take the new points at the same steps);
- `close(failed)`.

Each opens with the run's config (job.env left out: it holds the external command's tokens) and resumes into the
same tracker run after a restart: the id is kept in the run directory (wandb_id.json, trackers/<name>_id.json).
Tracker files live under the run directory (trackers/) unless the user points a tracker at its server. No tracker
is told a credential: each reads its own from its usual place (environment, ~/.netrc, clearml.conf), and the
tracking URI, which may carry one, is never logged.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
import time
from typing import Any, Protocol

from prime_train.config.schema import Config
from prime_train.contract import UnsafeLink, read_json, write_json_atomic
from prime_train.engine.errors import EngineConfigError
from prime_train.rundir import RunDir

logger = logging.getLogger("prime_train.engine")

TRACKERS_DIR = "trackers"


class Tracker(Protocol):
    name: str

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def text(self, step: int, tag: str, text: str) -> None: ...

    def rewind(self, step: int) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def logged_config(cfg: Config) -> dict[str, Any]:
    """The config a tracker records: everything but job.env (the external command's environment: tokens, keys)."""
    return cfg.model_dump(mode="json", exclude={"job": {"env"}})


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict):
            out.update(_flat(value, name))
        else:
            out[name] = str(value)
    return out


def _missing(package: str, extra: str, tracker: str) -> EngineConfigError:
    return EngineConfigError(
        f"logging.trackers has {tracker!r} but {package} is not installed: pip install 'prime-train[{extra}]', "
        f"or take {tracker!r} out of logging.trackers"
    )


class _Ids:
    """A tracker's run id in the run directory (trackers/<name>_id.json), so that a restart resumes into it."""

    def __init__(self, run_dir: RunDir, name: str, where: str = ""):
        self.path = run_dir.root / TRACKERS_DIR / f"{name}_id.json"
        # the id belongs to one store: pointed at another server, the run starts a new tracker run there
        self.where = hashlib.sha256(where.encode()).hexdigest()[:16]

    def saved(self) -> str | None:
        saved = read_json(self.path) or {}
        run_id = saved.get("id")
        return run_id if isinstance(run_id, str) and saved.get("where") == self.where else None

    def save(self, run_id: str) -> None:
        write_json_atomic(self.path, {"id": run_id, "where": self.where})


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, run_dir: RunDir):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self._writer = SummaryWriter(log_dir=str(run_dir.tensorboard_dir))
        self._fresh = True  # nothing written through it yet: rewind may reopen it with a purge step

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._fresh = False
        for key, value in scalars.items():
            self._writer.add_scalar(key, value, step)

    def text(self, step: int, tag: str, text: str) -> None:
        self._fresh = False
        self._writer.add_text(tag, text, step)

    def rewind(self, step: int) -> None:
        if not self._fresh:
            return
        # a writer opened with purge_step makes TensorBoard drop the earlier attempts' points from that step on, so a
        # resumed curve does not double back
        from torch.utils.tensorboard import SummaryWriter

        self._writer.close()
        self._writer = SummaryWriter(log_dir=str(self.run_dir.tensorboard_dir), purge_step=step + 1 if step else 0)
        self._fresh = False

    def close(self, failed: bool = False) -> None:
        self._writer.close()


class WandbTracker:
    name = "wandb"

    def __init__(self, run_dir: RunDir, cfg: Config):
        try:
            import wandb
        except ImportError:
            raise EngineConfigError(
                "logging.wandb_project is set but wandb is not installed; pip install 'prime-train[wandb]' "
                "or unset logging.wandb_project"
            ) from None
        # one W&B run per prime-train run: resumes after a restart append to the same run
        id_file = run_dir.root / "wandb_id.json"
        saved = read_json(id_file) or {}
        # our own id: wandb.util.generate_id is gone in wandb 0.31; W&B ids allow lowercase letters and digits
        run_id = saved.get("id") or secrets.token_hex(6)
        write_json_atomic(id_file, {"id": run_id})
        self._run = wandb.init(
            project=cfg.logging.wandb_project,
            entity=cfg.logging.wandb_entity,
            mode=cfg.logging.wandb_mode,
            name=cfg.run.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir.root),
            config=logged_config(cfg),
        )

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self._run.log(scalars, step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        self._run.log({tag: text}, step=step)

    def rewind(self, step: int) -> None:
        pass  # W&B ignores steps lower than a resumed run's last

    def close(self, failed: bool = False) -> None:
        self._run.finish(exit_code=1 if failed else 0)


class MlflowTracker:
    """MLflow through its client (no global active run). Store: logging.mlflow_tracking_uri, else MLFLOW_TRACKING_URI,
    else an SQLite file in the run directory (trackers/mlflow.db, artifacts in trackers/mlartifacts)."""

    name = "mlflow"

    def __init__(self, run_dir: RunDir, cfg: Config):
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise _missing("mlflow", "mlflow", "mlflow") from None
        local = run_dir.root / TRACKERS_DIR
        uri = cfg.logging.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{local}/mlflow.db"
        self._client = MlflowClient(tracking_uri=uri)
        ids = _Ids(run_dir, "mlflow", uri)
        run_id = ids.saved()
        if run_id is not None and self._exists(run_id):
            self._client.update_run(run_id, status="RUNNING")
            logger.info("mlflow: resuming run %s", run_id)
        else:
            name = cfg.logging.mlflow_experiment
            found = self._client.get_experiment_by_name(name)
            if found is not None:
                experiment = found.experiment_id
            else:
                # a local store keeps its artifacts in the run directory too, never in the working directory
                artifacts = (local / "mlartifacts").as_uri() if uri.startswith("sqlite:///") else None
                experiment = self._client.create_experiment(name, artifact_location=artifacts)
            run_id = self._client.create_run(experiment, run_name=cfg.run.name).info.run_id
            ids.save(run_id)
            # params once: MLflow refuses a param logged again with another value (a resume with a changed config)
            params = [Param(k[:250], v[:6000]) for k, v in _flat(logged_config(cfg)).items()]
            for i in range(0, len(params), 100):  # log_batch takes at most 100 params
                self._client.log_batch(run_id, params=params[i : i + 100])
            self._client.log_dict(run_id, logged_config(cfg), "config.json")
        self._run_id = run_id

    def _exists(self, run_id: str) -> bool:
        try:
            self._client.get_run(run_id)
        except Exception:  # MlflowException: deleted, or another store
            return False
        return True

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in scalars.items()]
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics
            self._client.log_batch(self._run_id, metrics=metrics[i : i + 1000])

    def text(self, step: int, tag: str, text: str) -> None:
        self._client.log_text(self._run_id, text, f"{tag}/step-{step}.txt")

    def rewind(self, step: int) -> None:
        pass  # MLflow keeps every point; the retrained steps are logged again at the same steps

    def close(self, failed: bool = False) -> None:
        self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")


class ClearmlTracker:
    """ClearML's Task; logging.clearml_offline keeps the session in the run directory (trackers/clearml) for
    `clearml-task`'s import_offline_session later. Its automatic framework and console capture stay off."""

    name = "clearml"

    def __init__(self, run_dir: RunDir, cfg: Config):
        if cfg.logging.clearml_offline:
            # before clearml's import: its cache directory (where offline sessions go) is read at import
            os.environ["CLEARML_CACHE_DIR"] = str(run_dir.root / TRACKERS_DIR / "clearml")
        try:
            from clearml import Task
        except ImportError:
            raise _missing("clearml", "clearml", "clearml") from None
        Task.set_offline(offline_mode=cfg.logging.clearml_offline)
        ids = _Ids(run_dir, "clearml", "offline" if cfg.logging.clearml_offline else "server")
        previous = ids.saved()
        self._task = Task.init(
            project_name=cfg.logging.clearml_project,
            task_name=cfg.run.name,
            continue_last_task=previous or False,
            reuse_last_task_id=False,
            auto_connect_frameworks=False,
            auto_connect_arg_parser=False,
            auto_connect_streams=False,
            auto_resource_monitoring=False,
        )
        ids.save(self._task.id)
        if previous is None:
            self._task.connect_configuration(logged_config(cfg), name="prime-train config")
        self._logger = self._task.get_logger()

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            title, _, series = key.partition("/")
            self._logger.report_scalar(title, series or title, float(value), iteration=step)

    def text(self, step: int, tag: str, text: str) -> None:
        self._logger.report_text(f"{tag} (step {step})\n{text}", print_console=False)

    def rewind(self, step: int) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        if failed:
            self._task.mark_failed(status_reason="the run failed")
        self._task.close()


class NeptuneTracker:
    """Neptune's run (client 1.x); logging.neptune_mode 'offline' keeps it in the run directory (trackers/neptune) for
    `neptune sync` later. The project comes from logging.neptune_project or NEPTUNE_PROJECT, the token from
    NEPTUNE_API_TOKEN."""

    name = "neptune"

    def __init__(self, run_dir: RunDir, cfg: Config):
        # before the run opens: where its offline and async queues live
        os.environ["NEPTUNE_DATA_DIRECTORY"] = str(run_dir.root / TRACKERS_DIR / "neptune")
        try:
            import neptune
        except ImportError:
            raise _missing("neptune", "neptune", "neptune") from None
        mode = cfg.logging.neptune_mode
        ids = _Ids(run_dir, "neptune", f"{mode}:{cfg.logging.neptune_project}")
        previous = ids.saved()
        run_id = previous or f"{cfg.run.name[:24]}-{secrets.token_hex(6)}"
        ids.save(run_id)
        self._run = neptune.init_run(
            project=cfg.logging.neptune_project,
            mode=mode,
            custom_run_id=run_id,  # the same id after a restart: the same Neptune run
            name=cfg.run.name,
            capture_stdout=False,
            capture_stderr=False,
            capture_hardware_metrics=False,
            capture_traceback=False,
            git_ref=False,
            source_files=[],
        )
        if previous is None:
            self._run["config"] = _flat(logged_config(cfg))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for key, value in scalars.items():
            self._run[f"metrics/{key}"].append(float(value), step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        self._run[f"text/{tag}"].append(text, step=step)

    def rewind(self, step: int) -> None:
        pass  # Neptune refuses steps lower than a series' last: the retrained steps are dropped there

    def close(self, failed: bool = False) -> None:
        self._run["sys/failed"] = failed
        self._run.stop()


def open_trackers(run_dir: RunDir, cfg: Config) -> list[Tracker]:
    """The trackers logging.trackers names (rank 0 calls this), opened; TensorBoard without its package is a
    warning (it always was), any other tracker without its package a configuration error (78)."""
    trackers: list[Tracker] = []
    names = cfg.logging.active_trackers()
    if names:
        try:
            # a real directory of the run: one leading elsewhere would get our tracker files
            if "tensorboard" in names:
                run_dir.ensure_dir(run_dir.tensorboard_dir)
            if set(names) - {"tensorboard", "wandb"}:
                run_dir.ensure_dir(run_dir.root / TRACKERS_DIR)
        except UnsafeLink as exc:
            raise EngineConfigError(f"{exc.filename}: {exc.strerror}; remove the link") from None
    for name in names:
        if name == "tensorboard":
            try:
                trackers.append(TensorBoardTracker(run_dir))
            except ImportError:
                logger.warning(
                    "logging.tensorboard is on but the tensorboard package is missing; pip install tensorboard"
                )
        elif name == "wandb":
            trackers.append(WandbTracker(run_dir, cfg))
        else:
            trackers.append({"mlflow": MlflowTracker, "clearml": ClearmlTracker, "neptune": NeptuneTracker}[name](
                run_dir, cfg
            ))  # fmt: skip
    return trackers
