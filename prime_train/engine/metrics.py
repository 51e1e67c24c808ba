"""Per-step metrics: metrics.jsonl, the progress.json heartbeat, TensorBoard and W&B (rank 0 only)."""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from typing import Any

from prime_train.config.schema import Config
from prime_train.contract import (
    Heartbeat,
    Phase,
    RunDir,
    UnsafeLink,
    open_nofollow,
    read_json,
    read_jsonl,
    replace_file_atomic,
    write_heartbeat,
    write_json_atomic,
)

logger = logging.getLogger("prime_train.engine")

# the verdicts a job leaves when it ends: written durably, as nothing replaces them
_FINAL_PHASES = frozenset({Phase.DONE, Phase.STOPPED, Phase.FAILED})


class EngineConfigError(ValueError):
    """A setting or an input the engine cannot run with (a key, a data file and its line, a checkpoint to resume
    from); the job exits 78 and is never retried. A ValueError, as such problems were raised before."""


class MetricsLogger:
    """Writes what rank 0 measured; every other rank gets a logger that does nothing."""

    def __init__(self, run_dir: RunDir, cfg: Config, *, enabled: bool):
        self.run_dir = run_dir
        self.cfg = cfg
        self.enabled = enabled
        self._tb = None
        self._tb_fresh = False
        self._wandb = None
        if not enabled:
            return
        if cfg.logging.tensorboard:
            try:
                # a real directory of the run (or a link within it): one leading elsewhere would get our event files
                run_dir.ensure_dir(run_dir.tensorboard_dir)
            except UnsafeLink as exc:
                raise EngineConfigError(f"{exc.filename}: {exc.strerror}; remove the link") from None
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir.tensorboard_dir))
                self._tb_fresh = True  # nothing written through it yet: rewind may reopen it with a purge step
            except ImportError:
                logger.warning(
                    "logging.tensorboard is on but the tensorboard package is missing; pip install tensorboard"
                )
        if cfg.logging.wandb_project and cfg.logging.wandb_mode != "disabled":
            self._wandb = self._init_wandb()

    def _init_wandb(self):
        try:
            import wandb
        except ImportError:
            raise EngineConfigError(
                "logging.wandb_project is set but wandb is not installed; pip install 'prime-train[wandb]' "
                "or unset logging.wandb_project"
            ) from None
        # one W&B run per prime-train run: resumes after a restart append to the same run
        id_file = self.run_dir.root / "wandb_id.json"
        saved = read_json(id_file) or {}
        # our own id: wandb.util.generate_id is gone in wandb 0.31; W&B ids allow lowercase letters and digits
        run_id = saved.get("id") or secrets.token_hex(6)
        write_json_atomic(id_file, {"id": run_id})
        return wandb.init(
            project=self.cfg.logging.wandb_project,
            entity=self.cfg.logging.wandb_entity,
            mode=self.cfg.logging.wandb_mode,
            name=self.cfg.run.name,
            id=run_id,
            resume="allow",
            dir=str(self.run_dir.root),
            # job.env holds the external command's environment (tokens, keys): it stays out of W&B
            config=self.cfg.model_dump(mode="json", exclude={"job": {"env"}}),
        )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's metrics everywhere they are configured to go."""
        if not self.enabled:
            return
        self.log_many([(step, metrics)])

    def log_many(self, rows: list[tuple[int, dict[str, Any]]]) -> None:
        """Record several steps' metrics at once: the loop buffers steps between logging steps (one write)."""
        if not self.enabled or not rows:
            return
        now = time.time()
        lines = "".join(json.dumps(_finite({"step": step, "time": now, **m})) + "\n" for step, m in rows)
        # one write() of all the lines, as contract.append_jsonl does for one: appends never interleave; never
        # through a link planted at metrics.jsonl (contract.UnsafeLink)
        fd = open_nofollow(self.run_dir.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(lines)
        self._tb_fresh = False
        for step, metrics in rows:
            if self._tb is not None:
                for key, value in metrics.items():
                    if isinstance(value, int | float) and not isinstance(value, bool):
                        self._tb.add_scalar(key, value, step)
            if self._wandb is not None:
                self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, int | float | str)}, step=step)

    def rewind(self, step: int) -> int:
        """Make metrics.jsonl hold only what led to the state the job starts from; returns the rows dropped.

        A resume from step-N retrains the steps after N, so their old rows go (else metrics.jsonl holds two rows
        for one step, and curves double back); a start from step 0 keeps none, as its step-0 baseline is written
        again. Done by the job, not the supervisor: only the job knows the step it really resumed from (a
        checkpoint that fails verification sends it to an older one), and `prime-train train` has no supervisor.
        """
        if not self.enabled:
            return 0
        dropped = rewind_metrics(self.run_dir, step)
        if dropped:
            after = f"after step {step}" if step > 0 else "of an earlier run (starting from step 0)"
            logger.info("metrics.jsonl: dropped %d row(s) %s; they are trained again", dropped, after)
        if self._tb is not None and self._tb_fresh:
            # TensorBoard too: a writer opened with purge_step makes its readers drop the earlier attempts' points
            # from that step on, so a resumed curve does not double back (W&B keeps what it has: it ignores steps
            # lower than a resumed run's last)
            from torch.utils.tensorboard import SummaryWriter

            self._tb.close()
            self._tb = SummaryWriter(log_dir=str(self.run_dir.tensorboard_dir), purge_step=step + 1 if step else 0)
            self._tb_fresh = False
        return dropped

    def log_text(self, step: int, tag: str, text: str) -> None:
        if not self.enabled:
            return
        self._tb_fresh = False
        if self._tb is not None:
            self._tb.add_text(tag, text, step)
        if self._wandb is not None:
            self._wandb.log({tag: text}, step=step)

    def heartbeat(self, step: int | None, *, phase: Phase = Phase.STEP, **fields: Any) -> None:
        """Rewrite progress.json atomically: the supervisor's proof that the job is alive, and what it is doing."""
        if not self.enabled:
            return
        hb = Heartbeat.now(step, Phase(phase), max_steps=self.cfg.train.max_steps, **fields)
        # a running job's heartbeat is replaced within a second: rename keeps it whole, no fsync (contract.py)
        write_heartbeat(self.run_dir.progress_path, hb, durable=Phase(phase) in _FINAL_PHASES)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN or inf: write them as null (and keep them visible as such)."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def read_metrics(run_dir: RunDir) -> list[dict[str, Any]]:
    """All records of metrics.jsonl; torn or garbled lines and bytes that are not UTF-8 never stop the reading
    (a NaN written by an older prime-train reads as a float NaN, null as None)."""
    return read_jsonl(run_dir.metrics_path)


def rewind_metrics(run_dir: RunDir, step: int) -> int:
    """Keep the rows of metrics.jsonl up to `step` (none when `step` is 0), byte for byte, and replace the file
    atomically; returns how many rows were dropped. Rows with no step of their own (torn lines, garbage) go too.
    """
    path = run_dir.metrics_path
    try:
        lines = path.read_bytes().splitlines(keepends=True)
    except FileNotFoundError:
        return 0
    kept = [line for line in lines if step > 0 and _row_step(line) <= step]
    dropped = sum(1 for line in lines if line.strip()) - len(kept)
    if dropped == 0:
        return 0
    # a fresh file beside it, renamed over it: nothing planted at a temporary name or at metrics.jsonl is followed
    data = b"".join(line if line.endswith(b"\n") else line + b"\n" for line in kept)
    replace_file_atomic(path, data, mode=0o666)
    return dropped


def _row_step(line: bytes) -> float:
    """The step a metrics row records; infinity (never kept) for a line that is not a row."""
    try:
        step = json.loads(line).get("step")
    except (ValueError, AttributeError):
        return math.inf
    return step if isinstance(step, int) and not isinstance(step, bool) else math.inf
