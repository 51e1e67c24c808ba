"""Records to packed, sharded, resumable batches: the in-memory loader, and the entry points of the data pipeline.

The pipeline, run once per rank at start: read each dataset's records (a built-in task, local
files, or a hub stream; records.py), drop the held-out ones (a hash of the record's content and the
seed), tokenize into documents that end with eos (documents.py), and pack them by best fit into rows
of seq_len (packing.py). Data split by shards (a hub stream, or files the ranks divide) is read as
disjoint whole shards per rank; everything else is packed whole and identically on every rank, and
rank r reads positions r, r + world_size, … of one shared order, so a step's global batch is the
same rows whatever the world size. The rows are read as an infinite stream of epochs, each a seeded
permutation mixing the datasets by `sampling_probs`; the position in that stream is the loader's
whole state, so a restored loader yields exactly the batches an uninterrupted one would.

Data too big for memory is streamed instead (data.streaming; streaming.py), with the same records,
documents and packing. Call the model with use_cache=False: with a cache (the default, even in
training) transformers skips the packed-document mask that position_ids imply (packing.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from prime_train import tasks
from prime_train.engine.curriculum import Curriculum, SelfPaced, buckets, content_difficulty
from prime_train.engine.documents import Document, Encoder
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.packing import Batch, PackedRows, PackingStats, build_rows, concat_rows
from prime_train.engine.records import (
    detect_format,
    expand_local_path,
    extract,
    is_held_out,
    read_records,
    task_record,
)
from prime_train.engine.row_cache import RowCache, rows_key
from prime_train.engine.streaming import build_streaming_loader

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from prime_train.config.schema import DataConfig, DatasetConfig

logger = logging.getLogger("prime_train.engine.data")

_STATE_VERSION = 1


# ----------------------------------------------------------------------------------------------------------------
# From config to rows
# ----------------------------------------------------------------------------------------------------------------


def _check_data_config(data: DataConfig) -> None:
    probs = data.sampling_probs
    if probs is None:
        return
    if len(probs) != len(data.datasets):
        raise EngineConfigError(
            f"data.sampling_probs has {len(probs)} values for {len(data.datasets)} datasets; give one per dataset"
        )
    if any(p < 0 for p in probs) or not math.isclose(sum(probs), 1.0, abs_tol=1e-6):
        raise EngineConfigError(f"data.sampling_probs {probs} must be non-negative and sum to 1")


def _dataset_contents(
    ds: DatasetConfig,
    index: int,
    seed: int,
    held_out_fraction: float,
    rank: int,
    world_size: int,
    *,
    held_out: bool,
    keep_all: bool = False,
    limit: int | None = None,
    streaming: bool = False,
    difficulties: list[float] | None = None,
    difficulty_field: str | None = None,
) -> tuple[str, list[Any]]:
    """(format, contents) of this rank's training records (all of them when `keep_all`), or of all
    held-out records when `held_out`; reading stops after `limit` contents when given. With `difficulties`, each
    kept content's difficulty (data.curriculum = 'difficulty') is appended to it."""
    # Held-out records are read from every shard by every rank, so all ranks agree on the eval set.
    records, sharded = read_records(ds, index, seed, rank, world_size, split_by_rank=not held_out, streaming=streaming)
    fmt: str | None = None
    contents: list[Any] = []
    kept = 0
    for record in records:
        if fmt is None:
            fmt = detect_format(ds, index, record)
        content = extract(ds, index, fmt, record)
        if is_held_out(content, seed, held_out_fraction) != held_out:
            continue
        if not held_out and not sharded and not keep_all:
            kept += 1
            if (kept - 1) % world_size != rank:
                continue
        contents.append(content)
        if difficulties is not None:
            difficulties.append(
                content_difficulty(content, record.fields, record.where, difficulty_field, bool(ds.task))
            )
        if limit is not None and len(contents) >= limit:
            break
    return fmt or "text", contents


def _splits_by_shard(ds: DatasetConfig, world_size: int) -> bool:
    """Whether ranks read disjoint whole shards of this dataset (a hub stream, or files the ranks divide)."""
    if world_size == 1 or ds.task is not None:
        return False
    if ds.hub is not None:
        return True
    files = expand_local_path(ds.path or "", 0)
    return len(files) > 1 and len(files) % world_size == 0


def _rank_rows(
    data: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    job: str,
    rank: int,
    world_size: int,
    seed: int,
    replayed: list[DatasetConfig] | None = None,
    cache: RowCache | None = None,
) -> tuple[list[PackedRows], bool, np.ndarray | None]:
    """Packed training rows of each dataset, and whether they are the global rows every rank shares.

    Data that fits in memory and is not split by shards is packed whole on every rank, identically,
    and each rank reads every world_size-th row of one shared order: the global batch of a step is
    then the same rows whatever the world size, so 1 process and N processes train alike.
    With `cache`, rows an earlier start built from the same inputs are read back (row_cache.py).
    """
    encoder = Encoder(tokenizer, job)

    def rows_of(docs: list[Document]) -> PackedRows:
        return build_rows(docs, data.seq_len, tokenizer.pad_token_id, data.packing, data.document_masking)

    datasets = [*data.datasets, *(replayed or [])]  # continual.previous after this run's own
    shared = not any(_splits_by_shard(ds, world_size) for ds in datasets)

    def build() -> tuple[list[PackedRows], np.ndarray | None]:
        parts, row_difficulty = [], []
        for index, ds in enumerate(datasets):
            scores: list[float] | None = [] if data.curriculum == "difficulty" else None
            fmt, contents = _dataset_contents(
                ds, index, seed, data.held_out_fraction, rank, world_size, held_out=False, keep_all=shared,
                difficulties=scores, difficulty_field=data.difficulty_field,
            )  # fmt: skip
            docs = encoder.encode(fmt, contents)
            if data.curriculum == "none":
                parts.append(rows_of(docs))
                continue
            if scores is None:  # by length: the document's tokens
                scores = [float(len(doc.ids)) for doc in docs]
            groups = buckets(scores)
            # packed within each group: a row holds documents of one difficulty
            rows = [rows_of([docs[i] for i in g]) for g in groups]
            parts.append(concat_rows(rows) if rows else rows_of([]))
            row_difficulty += [
                np.full(len(r.lengths), np.mean([scores[i] for i in g])) for r, g in zip(rows, groups, strict=True)
            ]
        return parts, np.concatenate(row_difficulty) if data.curriculum != "none" and row_difficulty else None

    if cache is None:
        parts, difficulty = build()
    else:
        key = rows_key(data, datasets, encoder, seed=seed, rank=rank, world_size=world_size, shared=shared)
        parts, difficulty = cache.rows(
            RowCache.part(shared, rank), key, build, num_datasets=len(datasets), seq_len=data.seq_len,
            vocab=len(tokenizer), difficulty=data.curriculum != "none",
        )  # fmt: skip
    return parts, shared, difficulty


def _replay_probs(probs: list[float] | None, sizes: list[int], own: int, replay: float) -> list[float]:
    """Mixing probabilities of this run's `own` datasets (data.sampling_probs, else by size) scaled to 1 - replay,
    then of the replayed ones (by size) scaled to replay."""
    if sum(sizes[own:]) == 0:
        raise EngineConfigError("continual.previous has no training sequences to replay")
    mine = probs if probs is not None else [s / max(1, sum(sizes[:own])) for s in sizes[:own]]
    theirs = [s / sum(sizes[own:]) for s in sizes[own:]]
    return [p * (1 - replay) for p in mine] + [p * replay for p in theirs]


# ----------------------------------------------------------------------------------------------------------------
# Epochs, their order, and the resumable loader
# ----------------------------------------------------------------------------------------------------------------


def _largest_remainder(weights: list[float], total: int) -> list[int]:
    """Integer counts summing to `total`, proportional to `weights`."""
    exact = [w * total / sum(weights) for w in weights]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return counts


class _EpochOrder:
    """Which rows each epoch reads, in order: per-dataset quotas from sampling_probs, then a seeded shuffle."""

    def __init__(self, sizes: list[int], probs: list[float] | None, seed: int, rank: int) -> None:
        self.sizes = sizes
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.length = int(sum(sizes))
        weights = list(sizes) if probs is None else [p if s else 0.0 for p, s in zip(probs, sizes, strict=True)]
        if self.length and sum(weights) <= 0:
            raise EngineConfigError("data.sampling_probs gives every non-empty dataset probability 0")
        self.quotas = _largest_remainder(weights, self.length) if self.length else [0] * len(sizes)
        self.seed = seed
        self.rank = rank
        self._cache: dict[int, np.ndarray] = {}

    def _rng(self, *tags: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.rank, *tags])

    def _dataset_positions(self, dataset: int, begin: int, end: int) -> np.ndarray:
        # Dataset d is read as endless passes over its rows, each pass its own permutation; epoch e takes
        # positions [e * quota, (e + 1) * quota) of that stream, so up- and down-sampling stay exact.
        size = self.sizes[dataset]
        chunks = []
        for cycle in range(begin // size, (end - 1) // size + 1):
            perm = self._rng(1, dataset, cycle).permutation(size)
            lo, hi = max(begin, cycle * size) - cycle * size, min(end, (cycle + 1) * size) - cycle * size
            chunks.append(perm[lo:hi])
        return np.concatenate(chunks) + self.offsets[dataset]

    def rows(self, epoch: int) -> np.ndarray:
        """Row indices of `epoch`, in the order they are read."""
        order = self._cache.get(epoch)
        if order is None:
            picked = [
                self._dataset_positions(d, epoch * quota, (epoch + 1) * quota)
                for d, quota in enumerate(self.quotas)
                if quota
            ]
            order = np.concatenate(picked)[self._rng(2, epoch).permutation(self.length)]
            self._cache = {epoch: order, **{e: o for e, o in self._cache.items() if e == epoch - 1}}
        return order


class _BatchesAt(Dataset):
    """Map-style dataset: item `position` is the micro-batch starting at that sequence of the rank's stream."""

    def __init__(
        self, rows: PackedRows, order: _EpochOrder, micro_batch_size: int, stride: int = 1, offset: int = 0
    ) -> None:
        self.rows = rows
        self.order = order
        self.micro_batch_size = micro_batch_size
        # shared rows: this rank's p-th sequence is position p * stride + offset of the common order
        self.stride = stride
        self.offset = offset
        self.curriculum: Curriculum | None = None  # data.curriculum: the first positions draw easy rows

    def _row(self, g: int) -> int:
        if self.curriculum is not None and g < self.curriculum.horizon:
            return self.curriculum.row(g)
        return int(self.order.rows(g // self.order.length)[g % self.order.length])

    def positions(self, position: int) -> np.ndarray:
        """The shared-order positions of the micro-batch that starts at this rank's sequence `position`."""
        return np.arange(position, position + self.micro_batch_size, dtype=np.int64) * self.stride + self.offset

    def __getitem__(self, position: int) -> Batch:
        return self.rows.batch(np.asarray([self._row(int(g)) for g in self.positions(position)], dtype=np.int64))


class _PositionSampler(Sampler[int]):
    """Endless batch start positions from `start`; lives in the main process, so resuming only moves it."""

    def __init__(self, start: int, step: int) -> None:
        self.start = start
        self.step = step

    def __iter__(self) -> Iterator[int]:
        position = self.start
        while True:
            yield position
            position += self.step


class TrainLoader:
    """Endless micro-batches for one rank, resumable from `state_dict()` to the exact next batch."""

    def __init__(
        self,
        dataset: _BatchesAt,
        *,
        num_workers: int,
        device: torch.device,
        stats: PackingStats,
        seed: int,
        rank: int,
        world_size: int,
        prefetch: bool | None = None,
    ) -> None:
        self.stats = stats
        self.num_workers = num_workers
        self._dataset = dataset
        self._device = device
        self._on_cuda = device.type == "cuda"
        # Copying the next batch while the current one computes only pays off on an accelerator.
        self.prefetch = self._on_cuda if prefetch is None else prefetch
        self._identity = {"seed": seed, "rank": rank, "world_size": world_size}
        self._position = 0  # sequences of this rank's stream already handed out
        self._sampler = _PositionSampler(0, dataset.micro_batch_size)
        self._loader: DataLoader | None = None
        self._batches: Iterator[Batch] | None = None
        self._pending: Batch | None = None
        self._handed: list[np.ndarray] = []  # self_paced: positions handed out since the last take_handed()

    @property
    def self_paced(self) -> SelfPaced | None:
        """data.curriculum = 'self_paced': the score table and its order, else None."""
        curriculum = self._dataset.curriculum
        return curriculum if isinstance(curriculum, SelfPaced) else None

    def take_handed(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(positions, rows) of the sequences handed out since the last call, while the self-paced schedule lasts
        (judged at the first of them, the same on every rank); None otherwise, when no losses need reporting."""
        handed, self._handed = self._handed, []
        paced = self.self_paced
        if paced is None or not handed or int(handed[0][0]) - self._dataset.offset >= paced.horizon:
            return None
        positions = np.concatenate(handed)
        return positions, np.asarray([self._dataset._row(int(g)) for g in positions], dtype=np.int64)

    def score_table(self) -> torch.Tensor | None:
        """A copy of the self-paced scores (NaN: not seen yet) for the checkpoint; None without self_paced."""
        paced = self.self_paced
        return None if paced is None else torch.from_numpy(paced.scores.copy())

    def load_score_table(self, table: torch.Tensor) -> None:
        """The scores a checkpoint held (same rows: Checkpointer.load drops a table of another size)."""
        if (paced := self.self_paced) is not None:
            paced.load_scores(table.to(torch.float64).numpy())

    def _shared_position(self) -> int:
        """Position of the next sequence in the order all ranks share (this rank's own when not shared)."""
        return self._position * self._dataset.stride + self._dataset.offset

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self._shared_position() // self._dataset.order.length

    @property
    def micro_batch_size(self) -> int:
        """Sequences per batch."""
        return self._dataset.micro_batch_size

    def _start(self) -> None:
        self._sampler.start = self._position
        self._pending = None
        if self._loader is None:
            self._loader = DataLoader(
                self._dataset,
                batch_size=None,
                sampler=self._sampler,
                num_workers=self.num_workers,
                persistent_workers=self.num_workers > 0,
                pin_memory=self._on_cuda,
                prefetch_factor=2 if self.num_workers > 0 else None,
            )
        # With persistent workers a fresh iterator reuses them and re-reads the sampler from its new start.
        self._batches = iter(self._loader)

    def _fetch(self) -> Batch:
        assert self._batches is not None
        batch = next(self._batches)
        return batch.to(self._device, non_blocking=self._on_cuda)

    def __iter__(self) -> TrainLoader:
        return self

    def __next__(self) -> Batch:
        if self._batches is None:
            self._start()
        if self.prefetch:
            batch = self._pending if self._pending is not None else self._fetch()
            self._pending = self._fetch()
        else:
            batch = self._fetch()
        if self.self_paced is not None:
            self._handed.append(self._dataset.positions(self._position))
        self._position += self._dataset.micro_batch_size
        return batch

    def state_dict(self) -> dict:
        """The position of the next batch (JSON-able)."""
        length = self._dataset.order.length
        position = self._shared_position()
        return {
            "version": _STATE_VERSION,
            "epoch": position // length,
            "index": position % length,
            "num_sequences": length,
            "rank_sequences": len(range(self._dataset.offset, length, self._dataset.stride)),
            **self._identity,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (from `state_dict()`): the next batch is the one that was next then."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"data loader state has version {state.get('version')!r}, expected {_STATE_VERSION}")
        length = self._dataset.order.length
        changed = [
            f"{key} {state.get(key)} -> {value}"
            for key, value in {**self._identity, "num_sequences": length}.items()
            if state.get(key) != value
        ]
        index = int(state["index"])
        if changed:
            # Another world size or changed data gives other shards: the old position names other rows.
            logger.warning(
                "data loader state is from a different setup (%s): continuing at epoch %d, but not with the "
                "exact batches the interrupted run would have seen",
                ", ".join(changed), state["epoch"],
            )  # fmt: skip
            index = min(index, length - 1)
        position = int(state["epoch"]) * length + index
        stride, offset = self._dataset.stride, self._dataset.offset
        self._position = max(0, -(-(position - offset) // stride))  # first own sequence at or after it
        self._batches = None
        self._pending = None
        self._handed = []


# ----------------------------------------------------------------------------------------------------------------
# Entry points: the train loader, eval batches, prompts
# ----------------------------------------------------------------------------------------------------------------


def _default_num_workers() -> int:
    """Workers when data.num_workers is unset."""
    # Rows are tokenized and packed once at start; a batch is a slice of in-memory arrays (tens of
    # microseconds), so worker processes only add pickling and IPC. Measured: workers=0 is faster.
    return 0


def build_train_loader(
    data: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    job: str,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device,
    replayed: list[DatasetConfig] | None = None,
    replay: float = 0.0,
    global_batch_size: int | None = None,
    max_steps: int | None = None,
    cache: RowCache | None = None,
) -> TrainLoader:
    """This rank's endless, resumable stream of packed training micro-batches; with `replay` > 0 a fraction `replay`
    of the sequences comes from the `replayed` datasets (continual learning), mixed into the same epoch order;
    with `cache`, the rows are kept between starts (row_cache.py)."""
    _check_data_config(data)
    if data.streaming:
        return build_streaming_loader(  # type: ignore[return-value]
            data, tokenizer, job=job, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size,
            seed=seed, device=device,
        )  # fmt: skip
    if micro_batch_size < 1:
        raise EngineConfigError(f"train.micro_batch_size must be at least 1, got {micro_batch_size}")
    if replay > 0 and data.streaming:
        raise EngineConfigError("continual.replay needs data that fits in memory: set data.streaming = false")
    replayed = replayed if replay > 0 else None
    if data.curriculum != "none" and data.streaming:
        raise EngineConfigError("data.curriculum needs data that fits in memory: set data.streaming = false")
    parts, shared, difficulty = _rank_rows(data, tokenizer, job, rank, world_size, seed, replayed, cache)
    rows = concat_rows(parts)
    sizes = [len(p.lengths) for p in parts]
    probs = (
        data.sampling_probs
        if replayed is None
        else _replay_probs(data.sampling_probs, sizes, len(data.datasets), replay)
    )
    order = _EpochOrder(sizes, probs, seed, 0 if shared else rank)
    if order.length < (world_size if shared else 1):
        raise EngineConfigError(
            f"rank {rank} of {world_size} has no training sequences: the datasets are too small for this many "
            "ranks or data.held_out_fraction leaves nothing; add data or lower data.held_out_fraction"
        )
    logger.info("rank %d: %s", rank, rows.stats.describe())
    num_workers = _default_num_workers() if data.num_workers is None else data.num_workers
    batches = _BatchesAt(rows, order, micro_batch_size, *((world_size, rank) if shared else (1, 0)))
    if difficulty is not None:
        steps = data.curriculum_steps or max(1, (max_steps or 2) // 2)
        # the schedule runs over global positions when the ranks share one order, else over this rank's own
        sequences = steps * (global_batch_size or micro_batch_size * world_size) // (1 if shared else world_size)
        if data.curriculum == "self_paced":
            _check_self_paced(data, shared, num_workers)
            batches.curriculum = SelfPaced(difficulty, data.curriculum_start, sequences, seed)
        else:
            batches.curriculum = Curriculum(difficulty, data.curriculum_start, sequences, seed)
        logger.info(
            "curriculum by %s: the easiest %.0f%% of %d sequences at step 0, all of them from step %d",
            data.curriculum, 100 * data.curriculum_start, len(difficulty), steps,
        )  # fmt: skip
    return TrainLoader(
        batches,
        num_workers=num_workers,
        device=device,
        stats=rows.stats,
        seed=seed,
        rank=rank,
        world_size=world_size,
        # self_paced: a batch is drawn from the scores of every step before its own, so none is drawn ahead
        prefetch=False if data.curriculum == "self_paced" else None,
    )


def _check_self_paced(data: DataConfig, shared: bool, num_workers: int) -> None:
    """The score table is one for all ranks and lives in the main process."""
    if not shared:
        raise EngineConfigError(
            "data.curriculum = 'self_paced' needs rows every rank shares: a dataset split by shards over the ranks "
            "(a hub dataset, or local files the ranks divide) gives each rank its own rows; use 'length'"
        )
    if num_workers > 0:
        raise EngineConfigError(
            f"data.curriculum = 'self_paced' reads batches in the training process (the scores change every step): "
            f"set data.num_workers = 0, not {num_workers}"
        )


# held-out documents read per eval row when streaming: generous for short documents, bounded for any
EVAL_DOCS_PER_ROW = 32


def build_eval_batches(
    data: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    job: str,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    max_batches: int,
    cache: RowCache | None = None,
) -> list[Batch]:
    """Fixed held-out micro-batches for this rank; every rank gets the same count (collectives stay paired).
    With `cache`, the held-out rows are kept between starts as the training rows are (row_cache.py)."""
    _check_data_config(data)
    encoder = Encoder(tokenizer, job)

    def build() -> tuple[list[PackedRows], None]:
        docs: list[Document] = []
        # a streamed dataset may be web-scale: read only the first held-out documents the eval can use
        # (every rank reads the same ones, so the eval set still agrees across ranks)
        limit = max_batches * micro_batch_size * world_size * EVAL_DOCS_PER_ROW if data.streaming else None
        for index, ds in enumerate(data.datasets):
            fmt, contents = _dataset_contents(
                ds, index, seed, data.held_out_fraction, rank, world_size, held_out=True, limit=limit,
                streaming=data.streaming,
            )  # fmt: skip
            docs.extend(encoder.encode(fmt, contents))
        return [build_rows(docs, data.seq_len, tokenizer.pad_token_id, data.packing, data.document_masking)], None

    if cache is None or data.streaming:
        (rows,), _ = build()
    else:  # every rank packs the same held-out rows
        key = rows_key(data, data.datasets, encoder, seed=seed, rank=0, world_size=1, shared=True, held_out=True)
        (rows,), _ = cache.rows(
            "eval", key, build, num_datasets=1, seq_len=data.seq_len, vocab=len(tokenizer), difficulty=False
        )
    total = len(rows.lengths)
    if total == 0 or max_batches < 1:
        return []
    num_batches = min(max_batches, math.ceil(total / (world_size * micro_batch_size)))
    mine = np.arange(rank, total, world_size) if rank < total else np.array([rank % total])
    batches = []
    for number in range(num_batches):
        picked = mine[number * micro_batch_size : (number + 1) * micro_batch_size]
        if len(picked) == 0:
            # A rank whose share ran out repeats its rows rather than skipping an eval step the others take.
            picked = mine[[(number * micro_batch_size + k) % len(mine) for k in range(min(micro_batch_size, total))]]
        batches.append(rows.batch(picked))
    return batches


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The ids of `prompt` exactly as training documents begin (with the tokenizer's bos, if it adds one)."""
    return Encoder(tokenizer, "sft").prompt_ids(prompt)


def held_out_examples(data: DataConfig, seed: int, n: int) -> list[tasks.Example]:
    """Up to `n` distinct held-out examples of the built-in task datasets, interleaved across them (at most the
    first `n` of each dataset are taken, so each is generated only until it has them)."""
    per_dataset: list[list[tasks.Example]] = []
    for ds in data.datasets:
        if ds.task is None:
            continue
        seen: set[str] = set()
        kept = []
        for example in tasks.iter_examples(ds.task, ds.num_examples, seed):
            record = task_record(example)
            content = (record["prompt"], record["completion"])
            if example.prompt not in seen and is_held_out(content, seed, data.held_out_fraction):
                seen.add(example.prompt)
                kept.append(example)
                if len(kept) == n:
                    break
        per_dataset.append(kept)
    interleaved = [ex for group in zip(*per_dataset, strict=False) for ex in group] if per_dataset else []
    longest = max((len(g) for g in per_dataset), default=0)
    # zip stops at the shortest list; take the rest of the longer ones in turn.
    for i in range(min((len(g) for g in per_dataset), default=0), longest):
        interleaved.extend(g[i] for g in per_dataset if i < len(g))
    return interleaved[:n]
