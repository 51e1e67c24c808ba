"""The loop's judges of evaluations: early stopping (train.early_stopping) and the best checkpoint (ckpt.keep_best).

Both watch one eval metric. Every rank sees the same eval values (they are reduced over the ranks), so every rank
reaches the same verdict at the same step without a collective of its own. What they have seen (the best value, its
step, the evaluations since it) is part of the checkpoint (TrainState.judges), so a resumed run judges as the
uninterrupted one would.

- EarlyStopping ends the run as done, with its checkpoint and final/, after `patience` evaluations in a row that did
  not improve on the best by more than `min_delta`; the step-0 baseline counts as the first value to beat.
- KeepBest saves a checkpoint at every eval that improves on the best (step 0 excepted: its weights are the input
  model's), names it in checkpoints/best.json and keeps it out of retention until a better one replaces it; with
  `export` the run's final/ is exported from it.
"""

from __future__ import annotations

import math
from typing import Any

from prime_train.config.methods import EarlyStoppingConfig, KeepBestConfig, metric_direction
from prime_train.engine.metrics import EngineConfigError


class MetricWatch:
    """The best value of one eval metric so far, its step, and the evaluations since it improved."""

    def __init__(self, key: str, metric: str, direction: str, min_delta: float = 0.0):
        self.key = key  # the config key that asked for it, for messages
        self.metric = metric
        self.direction = metric_direction(metric, direction)
        self.min_delta = min_delta
        self.best: float | None = None
        self.best_step: int | None = None
        self.since = 0  # evaluations since the best

    def value(self, metrics: dict[str, Any]) -> float | None:
        """The metric in one eval's results. A metric the job does not produce is a configuration error (78)."""
        if self.metric not in metrics:
            have = sorted(k for k, v in metrics.items() if k.startswith("eval_") and isinstance(v, int | float))
            raise EngineConfigError(
                f"{self.key} = {self.metric!r}: this job's evaluations do not report it; they report "
                f"{', '.join(have) or 'nothing'}. Set {self.key} to one of those"
            )
        value = metrics[self.metric]
        return float(value) if isinstance(value, int | float) and math.isfinite(value) else None

    def observe(self, step: int, metrics: dict[str, Any]) -> bool:
        """Take one eval's results; True when it improves on the best by more than min_delta."""
        value = self.value(metrics)
        if value is None:  # a NaN eval never improves
            self.since += 1
            return False
        if self.best is None:
            better = True
        elif self.direction == "minimize":
            better = value < self.best - self.min_delta
        else:
            better = value > self.best + self.min_delta
        if better:
            self.best, self.best_step, self.since = value, step, 0
        else:
            self.since += 1
        return better

    def state_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "best": self.best, "best_step": self.best_step, "since": self.since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("metric") != self.metric:
            return  # another metric was judged before this resume: judge this one from here
        self.best, self.best_step, self.since = state.get("best"), state.get("best_step"), int(state.get("since", 0))


class EarlyStopping:
    def __init__(self, cfg: EarlyStoppingConfig):
        self.patience = cfg.patience
        self.watch = MetricWatch("train.early_stopping.metric", cfg.metric or "", cfg.direction, cfg.min_delta)

    def observe(self, step: int, metrics: dict[str, Any]) -> str | None:
        """The reason to end the run here, or None."""
        self.watch.observe(step, metrics)
        w = self.watch
        if w.since < self.patience:
            return None
        best = f"{w.best:.6g} at step {w.best_step}" if w.best is not None else "no finite value"
        return (
            f"early stopping: {w.metric} did not improve by more than {w.min_delta:g} for {w.since} evaluations "
            f"(train.early_stopping.patience = {self.patience}; best {best})"
        )


class KeepBest:
    def __init__(self, cfg: KeepBestConfig):
        self.export = cfg.export
        self.watch = MetricWatch("ckpt.keep_best.metric", cfg.metric or "", cfg.direction)

    def observe(self, step: int, metrics: dict[str, Any]) -> bool:
        """True when this eval is the new best and its step must be saved (never step 0)."""
        if step == 0:
            self.watch.value(metrics)  # the metric is checked at the baseline, before any step
            return False
        return self.watch.observe(step, metrics)

    def record(self) -> dict[str, Any]:
        """What checkpoints/best.json holds."""
        w = self.watch
        return {"step": w.best_step, "metric": w.metric, "value": w.best, "direction": w.direction}


class Judges:
    """The loop's early stopping and best checkpoint, either of which may be off."""

    def __init__(self, early: EarlyStoppingConfig, best: KeepBestConfig):
        self.early = EarlyStopping(early) if early.metric else None
        self.best = KeepBest(best) if best.metric else None

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {}
        if self.early is not None:
            state["early_stopping"] = self.early.watch.state_dict()
        if self.best is not None:
            state["keep_best"] = self.best.watch.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.early is not None and isinstance(state.get("early_stopping"), dict):
            self.early.watch.load_state_dict(state["early_stopping"])
        if self.best is not None and isinstance(state.get("keep_best"), dict):
            self.best.watch.load_state_dict(state["keep_best"])
