"""Documents packed into rows of seq_len, and the Batch the trainer steps on.

Packing is best fit decreasing: the longest documents first, each into the fullest row it still fits
(a document longer than seq_len is truncated and fills a row alone). Labels follow the transformers
convention: aligned with input_ids (the model shifts them), -100 where no loss is taken, including each
document's first token. `position_ids` restart at 0 at each document (and at the padding), so
transformers builds a block-diagonal causal mask from them when no attention_mask is passed: packed
documents never see each other, provided the model is called with use_cache=False.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from prime_train.engine.documents import Document

IGNORE_INDEX = -100


@dataclass
class Batch:
    """One micro-batch for one rank; every tensor is [B, T] long (pad_mask: bool, True at padding)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    pad_mask: torch.Tensor | None = None
    # every row is one sequence from position 0 (then padding, if any): plain causal attention computes what the
    # document mask would, so the model is called without position_ids (SDPA's is_causal: the flash kernel on GPU,
    # no B x T x T mask). Known on the host when the batch is made: no device sync decides it.
    causal: bool = False

    @property
    def positions(self) -> torch.Tensor | None:
        """The position_ids to call the model with: None where plain causal attention is exact (`causal`)."""
        return None if self.causal else self.position_ids

    @property
    def num_tokens(self) -> int:
        """Tokens that are not padding."""
        total = self.input_ids.numel()
        return total if self.pad_mask is None else total - int(self.pad_mask.sum())

    @property
    def num_loss_tokens(self) -> int:
        """Tokens whose label is taken into the loss."""
        return int((self.labels != IGNORE_INDEX).sum())

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        """This batch on `device`."""
        return Batch(
            *(t.to(device, non_blocking=non_blocking) for t in (self.input_ids, self.labels, self.position_ids)),
            pad_mask=None if self.pad_mask is None else self.pad_mask.to(device, non_blocking=non_blocking),
            causal=self.causal,
        )

    def pin_memory(self) -> Batch:
        """This batch in page-locked memory (DataLoader calls it when pin_memory=True)."""
        return Batch(
            self.input_ids.pin_memory(),
            self.labels.pin_memory(),
            self.position_ids.pin_memory(),
            pad_mask=None if self.pad_mask is None else self.pad_mask.pin_memory(),
            causal=self.causal,
        )


@dataclass(frozen=True)
class PackingStats:
    """What packing made of one rank's documents."""

    num_documents: int
    num_sequences: int
    num_tokens: int
    num_truncated_tokens: int
    efficiency: float  # non-pad fraction of all positions
    seq_len: int = 0  # the rows' length (data.seq_len); 0 where unknown

    def describe(self) -> str:
        """One log line; when every row holds one document, why (packing is on, and nothing fits beside it)."""
        line = (
            f"{self.num_documents} documents, {self.num_sequences} sequences, {self.num_tokens} tokens, "
            f"{self.num_truncated_tokens} truncated tokens, packing efficiency {self.efficiency:.1%}"
        )
        mean = self.num_tokens / max(1, self.num_documents)
        if self.num_documents > 1 and self.num_sequences == self.num_documents and 2 * mean > self.seq_len > 0:
            line += (
                f": one document a row, as they average {mean:.0f} tokens, over half of data.seq_len = {self.seq_len}"
                ", so no two fit in a row and the rest is padding; a data.seq_len near the longest document (or "
                "several times it) wastes less"
            )
        return line


def pack_best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of document indices by best-fit decreasing; a document longer than `capacity` fills a bin alone."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    open_capacities: list[int] = []  # sorted, distinct free space of bins that still have some
    bins_with_capacity: dict[int, list[int]] = {}
    for doc in order:
        need = min(lengths[doc], capacity)
        slot = bisect.bisect_left(open_capacities, need)
        if slot < len(open_capacities):
            free = open_capacities[slot]
            target = bins_with_capacity[free].pop()
            if not bins_with_capacity[free]:
                del bins_with_capacity[free]
                open_capacities.pop(slot)
        else:
            free, target = capacity, len(bins)
            bins.append([])
        bins[target].append(doc)
        left = free - need
        if left > 0:
            if left not in bins_with_capacity:
                bisect.insort(open_capacities, left)
                bins_with_capacity[left] = []
            bins_with_capacity[left].append(target)
    return bins


@dataclass
class PackedRows:
    """Packed rows: token ids, which positions take loss, where documents (and the padding) start."""

    ids: np.ndarray  # [N, T] int32
    loss: np.ndarray  # [N, T] bool
    starts: np.ndarray  # [N, T] bool
    lengths: np.ndarray  # [N] int32, non-pad tokens per row
    num_documents: int
    num_truncated_tokens: int

    @property
    def stats(self) -> PackingStats:
        """What packing made of the documents."""
        num_tokens = int(self.lengths.sum())
        return PackingStats(
            num_documents=self.num_documents,
            num_sequences=len(self.lengths),
            num_tokens=num_tokens,
            num_truncated_tokens=self.num_truncated_tokens,
            efficiency=num_tokens / max(1, self.ids.size),
            seq_len=int(self.ids.shape[1]) if self.ids.ndim == 2 else 0,
        )

    def batch(self, rows: np.ndarray) -> Batch:
        """The Batch of these row indices."""
        ids, loss, starts = self.ids[rows], self.loss[rows], self.starts[rows]
        columns = np.arange(ids.shape[1])
        # The first token of a document has no previous token of its own document to be predicted from.
        labels = np.where(loss & ~starts, ids, IGNORE_INDEX)
        last_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)
        pad_mask = columns[None, :] >= self.lengths[rows][:, None]
        return Batch(
            torch.from_numpy(ids.astype(np.int64)),
            torch.from_numpy(labels.astype(np.int64)),
            torch.from_numpy((columns - last_start).astype(np.int64)),
            pad_mask=torch.from_numpy(pad_mask),
            # no document starts after a row's first token, but where its padding begins
            causal=not (starts[:, 1:] & ~pad_mask[:, 1:]).any(),
        )


def build_rows(
    docs: list[Document], seq_len: int, pad_id: int, packing: bool, document_masking: bool = True
) -> PackedRows:
    """Rows of seq_len. document_masking=False (data.document_masking): a row is one stream, as nanoGPT trains,
    no start marked inside it, so positions run 0..T-1 across its documents, each document's first token is
    predicted from the one before it, and the row attends plainly causally."""
    lengths = [len(doc.ids) for doc in docs]
    bins = pack_best_fit(lengths, seq_len) if packing else [[i] for i in range(len(docs))]
    ids = np.full((len(bins), seq_len), pad_id, dtype=np.int32)
    loss = np.zeros((len(bins), seq_len), dtype=bool)
    starts = np.zeros((len(bins), seq_len), dtype=bool)
    row_lengths = np.zeros(len(bins), dtype=np.int32)
    for row, members in enumerate(bins):
        offset = 0
        for doc in members:
            kept = min(lengths[doc], seq_len)
            ids[row, offset : offset + kept] = docs[doc].ids[:kept]
            loss[row, offset : offset + kept] = docs[doc].loss[:kept]
            starts[row, offset] = document_masking or offset == 0
            offset += kept
        row_lengths[row] = offset
        if offset < seq_len:
            # Padding is a segment of its own (positions from 0), so no document attends to it.
            starts[row, offset] = True
    truncated = sum(max(0, n - seq_len) for n in lengths)
    return PackedRows(ids, loss, starts, row_lengths, num_documents=len(docs), num_truncated_tokens=truncated)


def concat_rows(parts: list[PackedRows]) -> PackedRows:
    return PackedRows(
        *(np.concatenate([getattr(p, name) for p in parts]) for name in ("ids", "loss", "starts", "lengths")),
        num_documents=sum(p.num_documents for p in parts),
        num_truncated_tokens=sum(p.num_truncated_tokens for p in parts),
    )
