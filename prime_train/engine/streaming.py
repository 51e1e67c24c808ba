"""Bounded-memory streaming of parquet shards (local, or on the hub) into packed, resumable batches (data.streaming).

data.py reads a rank's whole share of records into memory, which web-scale shards (FineWeb-style
parquet) do not fit. Here a rank reads its shards row group by row group, in a per-epoch seeded
shard order, and cuts the record stream into windows of at most `buffer_documents` training
documents. Each window is tokenized and packed by best fit on its own, its rows shuffled by a seed
of where the window starts, and handed out in micro-batches. Nothing is carried from one window to
the next, so a window is a pure function of its start position: the loader's state is that start
(epoch, shard, row) plus the rows of the window already handed out, and a restored loader re-reads
the window and yields exactly the batches an uninterrupted one would.

Records, documents and packing are data.py's (records.py, documents.py, packing.py): held-out records
are dropped by the same content hash, so the eval split agrees. With
several shards that the ranks divide, rank r reads shards r, r + world_size, …; otherwise every rank
reads every shard and keeps the rows whose index in their shard is r modulo world_size.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prime_train.engine import hub_files
from prime_train.engine.documents import Encoder
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.packing import Batch, PackedRows, build_rows
from prime_train.engine.records import (
    Record,
    dataset_key,
    detect_format,
    expand_local_path,
    extract,
    is_held_out,
    parquet_num_rows,
    parquet_rows,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from prime_train.config.schema import DataConfig, DatasetConfig

logger = logging.getLogger("prime_train.engine.streaming")

_STATE_VERSION = 1
# Documents packed together: enough for best fit to fill rows well (the few part-filled rows of a
# window are then rare), few enough that a window's tokens are a few MB whatever the shard size.
BUFFER_DOCUMENTS = 4096


@dataclass(frozen=True)
class _Position:
    """Where a window starts: row `row` of the `shard`-th shard of epoch `epoch`'s order."""

    epoch: int
    shard: int
    row: int


@dataclass
class _Window:
    start: _Position
    end: _Position  # where the next window starts
    rows: PackedRows
    order: np.ndarray  # the order the rows are handed out in


class StreamingLoader:
    """Endless micro-batches for one rank read from parquet shards in bounded memory; resumable exactly."""

    def __init__(
        self,
        ds: DatasetConfig,
        tokenizer: PreTrainedTokenizerBase,
        *,
        job: str,
        seq_len: int,
        packing: bool,
        held_out_fraction: float,
        document_masking: bool = True,
        micro_batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        device: torch.device,
        buffer_documents: int = BUFFER_DOCUMENTS,
        index: int = 0,
        prefetch: bool = True,
    ) -> None:
        if micro_batch_size < 1:
            raise EngineConfigError(f"train.micro_batch_size must be at least 1, got {micro_batch_size}")
        if buffer_documents < 1:
            raise EngineConfigError(f"buffer_documents must be at least 1, got {buffer_documents}")
        self._ds = ds
        self._index = index
        self._encoder = Encoder(tokenizer, job)
        self._pad_id = tokenizer.pad_token_id
        self._seq_len = seq_len
        self._packing = packing
        self._document_masking = document_masking
        self._held_out_fraction = held_out_fraction
        self._micro_batch_size = micro_batch_size
        self._seed = seed
        self._rank = rank
        self._world_size = world_size
        self._device = device
        self.buffer_documents = buffer_documents
        # Largest number of documents (or record contents) held at once; tests pin it to the buffer.
        self.max_buffered_documents = 0
        self._format: str | None = None

        if ds.hub is not None:
            self._source_key, self._source = dataset_key(index, "hub"), ds.hub
            files = hub_files.list_parquet(ds.hub, ds.split, key=self._source_key)
        else:
            self._source_key, self._source = dataset_key(index, "path"), ds.path
            files = expand_local_path(ds.path or "", index)
        not_parquet = [f for f in files if not f.endswith(".parquet")]
        if not_parquet:
            raise EngineConfigError(
                f"{self._source_key} = {self._source!r} holds non-parquet files ({not_parquet[0]}, ...): "
                "data.streaming reads .parquet shards only; convert them or set data.streaming = false"
            )
        self._sharded = world_size > 1 and len(files) > 1 and len(files) % world_size == 0
        if world_size > 1 and not self._sharded and rank == 0:
            logger.warning(
                "%s = %r has %d files, which %d ranks do not divide: every rank reads every file and keeps one "
                "row in %d (give it a multiple of %d files to read whole files per rank)",
                self._source_key, self._source, len(files), world_size, world_size, world_size,
            )  # fmt: skip
        self._shards = files[rank::world_size] if self._sharded else files
        # read when first needed: a web-scale hub dataset has thousands of shards, each footer a request
        self._row_counts: dict[int, int] = {}

        self._window: _Window | None = None
        self._next = _Position(0, 0, 0)  # start of the window to read when the current one is used up
        self._handed = 0  # rows of the current window already handed out
        # The next window is read in a thread while this one trains (hub reads wait on the network; a
        # window is a pure function of its start, so prefetching changes no batch). Two windows at most.
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(1, thread_name_prefix="stream-prefetch") if prefetch else None
        self._prefetched: tuple[_Position, Any] | None = None

    # -- the TrainLoader interface -----------------------------------------------------------------------------

    @property
    def micro_batch_size(self) -> int:
        """Sequences per batch."""
        return self._micro_batch_size

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        # The next window is read now if need be: records skipped at an epoch's end (held out, or another
        # rank's) leave the stream's position short of it, and only reading on tells which epoch comes next.
        return self._current_window().start.epoch

    def _current_window(self) -> _Window:
        """The window the next row comes from, read when the last one is used up."""
        if self._window is None or self._handed == len(self._window.order):
            self._window = self._take_window(self._next)
            self._next = self._window.end
            self._handed = 0
            if self._pool is not None:
                self._prefetched = (self._next, self._pool.submit(self._read_window, self._next))
        return self._window

    def _take_window(self, start: _Position) -> _Window:
        """The window at `start`: the prefetched one when it is that window, else read now."""
        if self._prefetched is not None:
            at, future = self._prefetched
            self._prefetched = None
            if at == start:
                return future.result()
            future.cancel()
        return self._read_window(start)

    def __iter__(self) -> StreamingLoader:
        return self

    def __next__(self) -> Batch:
        parts: list[Batch] = []
        needed = self._micro_batch_size
        while needed:
            window = self._current_window()
            take = window.order[self._handed : self._handed + needed]
            parts.append(window.rows.batch(take))
            self._handed += len(take)
            needed -= len(take)
        batch = parts[0] if len(parts) == 1 else _concat_batches(parts)
        if self._device.type == "cuda":  # pinned host memory makes the copy truly asynchronous
            return batch.pin_memory().to(self._device, non_blocking=True)
        return batch.to(self._device)

    def state_dict(self) -> dict:
        """The position of the next batch (JSON-able)."""
        if self._window is not None and self._handed < len(self._window.order):
            start, handed = self._window.start, self._handed
        else:
            start, handed = self._next, 0
        return {
            "version": _STATE_VERSION,
            "streaming": True,
            "epoch": start.epoch,
            "shard": start.shard,
            "row": start.row,
            "rows_handed_out": handed,
            "buffer_documents": self.buffer_documents,
            "num_shards": len(self._shards),
            "seed": self._seed,
            "rank": self._rank,
            "world_size": self._world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from `state` (from `state_dict()`): the next batch is the one that was next then."""
        if state.get("version") != _STATE_VERSION or not state.get("streaming"):
            raise EngineConfigError(
                "data loader state is not from a streaming loader of this version (data.streaming changed since "
                "the checkpoint?); set data.streaming back, or start the data stream afresh"
            )
        identity = {
            "seed": self._seed,
            "rank": self._rank,
            "world_size": self._world_size,
            "num_shards": len(self._shards),
            "buffer_documents": self.buffer_documents,
        }
        changed = [f"{k} {state.get(k)} -> {v}" for k, v in identity.items() if state.get(k) != v]
        start = _Position(int(state["epoch"]), int(state["shard"]), int(state["row"]))
        handed = int(state["rows_handed_out"])
        if changed:
            # Other shards or windows: the saved position names other rows; restart the saved epoch.
            logger.warning(
                "data loader state is from a different setup (%s): continuing at the start of epoch %d, but not "
                "with the exact batches the interrupted run would have seen",
                ", ".join(changed), start.epoch,
            )  # fmt: skip
            start, handed = _Position(start.epoch, 0, 0), 0
        self._window = None
        self._next = start
        self._handed = 0
        if handed:
            self._window = self._read_window(start)
            self._next = self._window.end
            self._handed = min(handed, len(self._window.order))

    # -- reading -----------------------------------------------------------------------------------------------

    def _shard_order(self, epoch: int) -> np.ndarray:
        # Per-rank shards are shuffled per rank; shared shards in one order, so row-modulo splits agree.
        tags = [self._seed, self._rank if self._sharded else 0, 3, epoch]
        return np.random.default_rng(tags).permutation(len(self._shards))

    def _contents_from(self, start: _Position) -> Iterator[tuple[_Position, Any]]:
        """(position of the record after it, content) of this rank's training records from `start`, endlessly."""
        epoch, shard, row = start.epoch, start.shard, start.row
        while True:
            order = self._shard_order(epoch)
            while shard < len(order):
                path = self._shards[order[shard]]
                for number, fields in parquet_rows(path, row):
                    following = _Position(epoch, shard, number + 1)
                    if not self._sharded and number % self._world_size != self._rank:
                        continue
                    record = Record(fields, f"{path} row {number}")
                    if self._format is None:
                        self._format = detect_format(self._ds, self._index, record)
                    content = extract(self._ds, self._index, self._format, record)
                    if is_held_out(content, self._seed, self._held_out_fraction):
                        continue
                    yield following, content
                shard, row = shard + 1, 0
            # Epoch ends are window ends too, so epochs hold the same windows whatever came before.
            yield _Position(epoch + 1, 0, 0), None
            epoch, shard, row = epoch + 1, 0, 0

    def _read_window(self, start: _Position) -> _Window:
        """The packed rows of the window of documents that starts at `start`."""
        contents: list[Any] = []
        window_start, end, epoch_ends = start, start, 0
        for end, content in self._contents_from(start):
            if content is None:
                if contents:
                    break
                # Nothing left of this epoch from `start`: the window starts with the next epoch.
                window_start, epoch_ends = end, epoch_ends + 1
                if epoch_ends > 1:
                    raise EngineConfigError(
                        f"rank {self._rank} of {self._world_size} has no training records in "
                        f"{self._source_key} = {self._source!r}: add data, use fewer ranks "
                        "or lower data.held_out_fraction"
                    )
                continue
            contents.append(content)
            self.max_buffered_documents = max(self.max_buffered_documents, len(contents))
            if len(contents) == self.buffer_documents:
                break
        docs = self._encoder.encode(self._format or "text", contents)
        del contents
        rows = build_rows(docs, self._seq_len, self._pad_id, self._packing, self._document_masking)
        tags = [self._seed, self._rank, 4, window_start.epoch, window_start.shard, window_start.row]
        order = np.random.default_rng(tags).permutation(len(rows.lengths))
        return _Window(window_start, self._past_epoch_end(end), rows, order)

    def _rows_in(self, shard_index: int) -> int:
        if shard_index not in self._row_counts:
            self._row_counts[shard_index] = parquet_num_rows(self._shards[shard_index])
        return self._row_counts[shard_index]

    def _past_epoch_end(self, position: _Position) -> _Position:
        """`position`, moved to the next epoch's start when no rows of its epoch follow it."""
        order = self._shard_order(position.epoch)
        shard, row = position.shard, position.row
        while shard < len(order) and row >= self._rows_in(int(order[shard])):
            shard, row = shard + 1, 0
        return _Position(position.epoch + 1, 0, 0) if shard == len(order) else _Position(position.epoch, shard, row)


def _concat_batches(parts: list[Batch]) -> Batch:
    pads = [p.pad_mask for p in parts]
    return Batch(
        torch.cat([p.input_ids for p in parts]),
        torch.cat([p.labels for p in parts]),
        torch.cat([p.position_ids for p in parts]),
        pad_mask=None if any(p is None for p in pads) else torch.cat(pads),
        causal=all(p.causal for p in parts),
    )


class MixedStreamingLoader:
    """Several streamed datasets mixed by data.sampling_probs: each micro-batch comes whole from one dataset.

    Which dataset the i-th micro-batch of a rank comes from is drawn from a generator seeded by (seed, rank, i),
    so the mix is reproducible and a resumed run draws exactly what the uninterrupted one would: the state is
    the draw count plus each dataset's own stream position. Mixing per micro-batch (not per document) keeps
    each dataset's packing and bounded window intact; over a run the share of micro-batches from each dataset
    converges to its probability.
    """

    def __init__(self, loaders: list[StreamingLoader], probs: list[float], *, seed: int, rank: int) -> None:
        if len(loaders) != len(probs) or not loaders:
            raise EngineConfigError("one sampling probability per streamed dataset is needed")
        total = float(sum(probs))
        if total <= 0 or any(p < 0 for p in probs):
            raise EngineConfigError(f"data.sampling_probs {probs} must be non-negative with a positive sum")
        self._loaders = loaders
        self._probs = np.asarray(probs, dtype=np.float64) / total
        self._seed, self._rank = seed, rank
        self._draws = 0
        self.counts = [0] * len(loaders)  # micro-batches taken from each dataset (this process)

    @property
    def micro_batch_size(self) -> int:
        return self._loaders[0].micro_batch_size

    @property
    def epoch(self) -> int:
        """Epochs every dataset has completed at least (the smallest epoch among them)."""
        return min(loader.epoch for loader in self._loaders)

    def _choice(self, draw: int) -> int:
        rng = np.random.default_rng([self._seed, self._rank, draw, 0x6D6978])
        return int(rng.choice(len(self._loaders), p=self._probs))

    def __iter__(self) -> MixedStreamingLoader:
        return self

    def __next__(self) -> Batch:
        index = self._choice(self._draws)
        batch = next(self._loaders[index])
        self._draws += 1
        self.counts[index] += 1
        return batch

    def state_dict(self) -> dict:
        return {
            "version": _STATE_VERSION,
            "streaming": True,
            "mixed": True,
            "draws": self._draws,
            "probs": [float(p) for p in self._probs],
            "datasets": [loader.state_dict() for loader in self._loaders],
        }

    def load_state_dict(self, state: dict) -> None:
        if not state.get("mixed") or len(state.get("datasets", [])) != len(self._loaders):
            raise EngineConfigError(
                "data loader state is not from a mix of the same number of streamed datasets (data.datasets "
                "changed since the checkpoint?); restore the datasets, or start the data stream afresh"
            )
        if not np.allclose(state["probs"], self._probs):
            logger.warning(
                "data.sampling_probs changed since the checkpoint (%s -> %s): each dataset continues where it was, "
                "drawn with the new probabilities",
                state["probs"], [float(p) for p in self._probs],
            )  # fmt: skip
        self._draws = int(state["draws"])
        for loader, sub in zip(self._loaders, state["datasets"], strict=True):
            loader.load_state_dict(sub)


def build_streaming_loader(
    data: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    job: str,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device,
    buffer_documents: int = BUFFER_DOCUMENTS,
) -> StreamingLoader | MixedStreamingLoader:
    """This rank's endless, resumable stream of packed micro-batches read from parquet shards in bounded memory.

    One dataset: its stream. Several: a MixedStreamingLoader drawing from each by data.sampling_probs
    (equal shares when unset).
    """
    for index, ds in enumerate(data.datasets):
        if ds.task is not None:
            raise EngineConfigError(
                f"data.streaming reads parquet shards (data.datasets[{index}].path or .hub), not the built-in task "
                f"data.datasets[{index}].task; set data.streaming = false for built-in tasks"
            )
    loaders = [
        StreamingLoader(
            ds,
            tokenizer,
            job=job,
            seq_len=data.seq_len,
            packing=data.packing,
            document_masking=data.document_masking,
            held_out_fraction=data.held_out_fraction,
            micro_batch_size=micro_batch_size,
            rank=rank,
            world_size=world_size,
            # each dataset gets its own shard order and window shuffle
            seed=seed if index == 0 else seed + 7919 * index,
            device=device,
            buffer_documents=buffer_documents,
            index=index,
        )
        for index, ds in enumerate(data.datasets)
    ]
    if len(loaders) == 1:
        return loaders[0]
    probs = data.sampling_probs or [1.0 / len(loaders)] * len(loaders)
    return MixedStreamingLoader(loaders, probs, seed=seed, rank=rank)
