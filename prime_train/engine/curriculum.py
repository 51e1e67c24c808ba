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

'self_paced' (SelfPaced) ranks the rows by what the model finds easy now: each row keeps a score, an exponential
moving average (weight EMA_NEW on the newest) of its mean token loss, taken from the training steps' own forward
passes. A row not seen yet scores the mean of the seen rows of its length bucket (of all seen rows while none of its
bucket is), and rows of equal score keep the length order, so before the first step the order is the length
curriculum's; afterwards a bucket whose rows the model finds easy comes before one it finds hard, whatever their
lengths, and a seen row before or after its bucket by its own loss. The scores change only between optimizer steps, from
the per-row losses of the whole global batch that every rank gathers, so every rank holds the same table; it goes
into the checkpoint (TrainState), and a resumed run draws exactly the batches of an uninterrupted one.
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
        ranked = self.ranked()
        pool = max(1, int(self.fraction(g) * len(ranked)))
        return int(ranked[np.random.default_rng([self.seed, 6, g]).integers(pool)])

    def ranked(self) -> np.ndarray:
        """Row indices, easiest first."""
        return self.sorted_rows


EMA_NEW = 0.5  # weight of a row's newest loss in its score: a row is seen a few times while the schedule lasts


class SelfPaced(Curriculum):
    """data.curriculum = 'self_paced': position g draws from the c(g) fraction of rows with the lowest score."""

    def __init__(self, prior: np.ndarray, start: float, horizon: int, seed: int):
        super().__init__(prior, start, horizon, seed)  # sorted_rows: the length order, kept among equal scores
        self.scores = np.full(len(prior), np.nan)  # NaN: not seen yet
        self._group = np.unique(prior, return_inverse=True)[1]  # rows of one length bucket
        self._order: np.ndarray | None = self.sorted_rows

    def estimates(self) -> np.ndarray:
        """Every row's score; a row not seen yet gets the mean score of the seen rows of its length bucket, or of all
        seen rows when none of its bucket is (nothing seen: all equal, the length order)."""
        seen = ~np.isnan(self.scores)
        neutral = float(self.scores[seen].mean()) if seen.any() else 0.0
        counts = np.bincount(self._group[seen], minlength=self._group.max(initial=0) + 1)
        sums = np.bincount(self._group[seen], weights=self.scores[seen], minlength=len(counts))
        by_group = np.where(counts > 0, sums / np.maximum(counts, 1), neutral)
        return np.where(seen, self.scores, by_group[self._group])

    def ranked(self) -> np.ndarray:
        if self._order is None:  # sorted again after each step's scores, once
            self._order = self.sorted_rows[np.argsort(self.estimates()[self.sorted_rows], kind="stable")]
        return self._order

    def observe(self, positions: np.ndarray, rows: np.ndarray, losses: np.ndarray) -> None:
        """Fold one optimizer step's per-row mean losses into the scores, in position order (a row drawn twice is
        updated twice, the same way on every rank); a position seen twice (tensor-parallel copies) counts once."""
        _, first = np.unique(positions, return_index=True)  # sorted by position
        for row, loss in zip(rows[first], losses[first], strict=True):
            if np.isfinite(loss):
                old = self.scores[row]
                self.scores[row] = loss if np.isnan(old) else (1 - EMA_NEW) * old + EMA_NEW * loss
        self._order = None

    def load_scores(self, scores: np.ndarray) -> None:
        """The table a checkpoint held."""
        self.scores[:] = scores
        self._order = None
