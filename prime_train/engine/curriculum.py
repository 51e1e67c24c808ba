"""Curriculum learning (data.curriculum): easy sequences first, the harder ones let in on a schedule.

Each document gets a difficulty: its token count ('length'), or ('difficulty') a number from its record
(data.difficulty_field) or, for a built-in task, the task's own measure: the answer's length (letters of the word to
reverse, digits of the sum, items to sort). Documents are packed within buckets of similar difficulty (at most
BUCKETS, by quantile), so a packed row has one difficulty and packing does not average it away.

The schedule is a function of the position in the stream of sequences, the loader's whole state: the sequence at
global position g, while g is inside the first data.curriculum_steps steps' worth of sequences, is drawn (seeded by
g) from the easiest fraction c(g) of the rows, c growing linearly from data.curriculum_start to 1; after that the
ordinary shuffled epochs go on. A resumed loader therefore yields exactly the batches an uninterrupted one would,
and every world size draws the same global batch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from prime_train.engine.errors import EngineConfigError

BUCKETS = 16


def content_difficulty(content: Any, fields: dict[str, Any], where: str, field: str | None, task: bool) -> float:
    """One record's difficulty for data.curriculum = 'difficulty'."""
    if field is not None:
        value = fields.get(field)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise EngineConfigError(
                f"{where}: data.difficulty_field {field!r} must be a finite number in every record, got {value!r}"
            )
        return float(value)
    if task:  # a built-in task's (prompt, answer): the answer's length
        return float(len(content[1]))
    raise EngineConfigError(
        "data.curriculum = 'difficulty' needs data.difficulty_field (a numeric field of each record) for datasets "
        f"that are not a built-in task ({where})"
    )


def buckets(difficulties: list[float]) -> list[list[int]]:
    """Document indices grouped by difficulty: each distinct value its own group, or BUCKETS quantile groups when
    there are more values than that; easiest first."""
    if not difficulties:
        return []
    values = np.asarray(difficulties, dtype=np.float64)
    distinct = np.unique(values)
    if len(distinct) <= BUCKETS:
        edges = distinct
        group = np.searchsorted(edges, values)
    else:
        edges = np.unique(np.quantile(values, np.linspace(0, 1, BUCKETS + 1)[1:-1]))
        group = np.searchsorted(edges, values, side="right")
    return [list(np.flatnonzero(group == g)) for g in range(int(group.max()) + 1) if (group == g).any()]


class Curriculum:
    """Which row the sequence at global position g reads while the curriculum lasts (`horizon` sequences)."""

    def __init__(self, difficulty: np.ndarray, start: float, horizon: int, seed: int):
        # rows easiest first; equal difficulties in a seeded order, not in the order packing made them
        tiebreak = np.random.default_rng([seed, 5]).permutation(len(difficulty))
        self.sorted_rows = np.lexsort((tiebreak, difficulty)).astype(np.int64)
        self.start = start
        self.horizon = horizon
        self.seed = seed

    def fraction(self, g: int) -> float:
        """The easiest fraction of the rows position g draws from."""
        return min(1.0, self.start + (1.0 - self.start) * g / max(1, self.horizon))

    def row(self, g: int) -> int:
        pool = max(1, int(self.fraction(g) * len(self.sorted_rows)))
        return int(self.sorted_rows[np.random.default_rng([self.seed, 6, g]).integers(pool)])
