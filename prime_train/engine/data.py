"""Records to packed, sharded, resumable batches.

The pipeline, run once per rank at start: read each dataset's records (a built-in task, local
files, or a hub stream), drop the held-out ones (a hash of the record's content and the seed),
tokenize into documents that end with eos, and pack them by best fit into rows of seq_len. Data
split by shards (a hub stream, or files the ranks divide) is read as disjoint whole shards per
rank; everything else is packed whole and identically on every rank, and rank r reads positions
r, r + world_size, … of one shared order, so a step's global batch is the same rows whatever the
world size. The rows are read as an infinite stream of epochs, each a seeded permutation mixing
the datasets by `sampling_probs`; the position in that stream is the loader's whole state, so a
restored loader yields exactly the batches an uninterrupted one would.

Labels follow the transformers convention: aligned with input_ids (the model shifts them), -100
where no loss is taken. `position_ids` restart at 0 at each document so that transformers builds a
block-diagonal causal mask from them when no attention_mask is passed: packed documents never see
each other. Call the model with use_cache=False: with a cache (the default, even in training)
transformers skips that detection and packed documents attend to each other.
"""

from __future__ import annotations

import bisect
import glob
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from prime_train import tasks

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from prime_train.config.schema import DataConfig, DatasetConfig

logger = logging.getLogger("prime_train.engine.data")

IGNORE_INDEX = -100
LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
_STATE_VERSION = 1
# Records tokenized per call: large enough for the Rust tokenizer's threads, small enough for memory.
_TOKENIZE_CHUNK = 2048


@dataclass
class Batch:
    """One micro-batch for one rank; every tensor is [B, T] long (pad_mask: bool, True at padding)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    pad_mask: torch.Tensor | None = None

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
        )

    def pin_memory(self) -> Batch:
        """This batch in page-locked memory (DataLoader calls it when pin_memory=True)."""
        return Batch(
            self.input_ids.pin_memory(),
            self.labels.pin_memory(),
            self.position_ids.pin_memory(),
            pad_mask=None if self.pad_mask is None else self.pad_mask.pin_memory(),
        )


@dataclass(frozen=True)
class PackingStats:
    """What packing made of one rank's documents."""

    num_documents: int
    num_sequences: int
    num_tokens: int
    num_truncated_tokens: int
    efficiency: float  # non-pad fraction of all positions

    def describe(self) -> str:
        """One log line."""
        return (
            f"{self.num_documents} documents, {self.num_sequences} sequences, {self.num_tokens} tokens, "
            f"{self.num_truncated_tokens} truncated tokens, packing efficiency {self.efficiency:.1%}"
        )


# ----------------------------------------------------------------------------------------------------------------
# Reading records
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Record:
    fields: dict[str, Any]
    where: str  # file:line, file row N, ... for error messages


def _key(index: int, name: str) -> str:
    return f"data.datasets[{index}].{name}"


def _expand_local_path(path: str, index: int) -> list[str]:
    """The data files a `path` names: the file itself, a directory's files, or a glob's matches, sorted."""
    expanded = os.path.expanduser(path)
    if any(ch in expanded for ch in "*?["):
        files = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
    elif os.path.isdir(expanded):
        walked = os.walk(expanded)
        files = sorted(os.path.join(root, name) for root, _, names in walked for name in names if name[0] != ".")
    elif os.path.isfile(expanded):
        if not expanded.endswith(LOCAL_SUFFIXES):
            raise ValueError(
                f"{_key(index, 'path')} = {path!r}: unsupported file type; use {', '.join(LOCAL_SUFFIXES)} files"
            )
        return [expanded]
    else:
        raise ValueError(f"{_key(index, 'path')} = {path!r}: no such file or directory")
    files = [f for f in files if f.endswith(LOCAL_SUFFIXES)]
    if not files:
        raise ValueError(f"{_key(index, 'path')} = {path!r}: no {', '.join(LOCAL_SUFFIXES)} files there")
    return files


def _read_txt(path: str, text_field: str) -> Iterator[_Record]:
    # One document per blank-line-separated paragraph; a file without blank lines is one document.
    with open(path, encoding="utf-8") as handle:
        lines: list[str] = []
        start = 1
        for number, line in enumerate(handle, start=1):
            if line.strip():
                if not lines:
                    start = number
                lines.append(line)
            elif lines:
                yield _Record({text_field: "".join(lines).rstrip("\n")}, f"{path}:{start}")
                lines = []
        if lines:
            yield _Record({text_field: "".join(lines).rstrip("\n")}, f"{path}:{start}")


def _read_jsonl(path: str) -> Iterator[_Record]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as exc:
                problem = f"not valid JSON ({exc.msg} at column {exc.colno})"
                raise ValueError(f"{where}: {problem}; fix or remove the line") from None
            if not isinstance(fields, dict):
                raise ValueError(f"{where}: expected a JSON object per line, got {type(fields).__name__}")
            yield _Record(fields, where)


def _read_parquet(path: str) -> Iterator[_Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ValueError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from exc
    row = 0
    for record_batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for fields in record_batch.to_pylist():
            yield _Record(fields, f"{path} row {row}")
            row += 1


def _read_local_file(path: str, ds: DatasetConfig, index: int) -> Iterator[_Record]:
    if path.endswith(".txt"):
        if ds.format not in ("auto", "text"):
            raise ValueError(f"{path}: .txt files hold plain text; set {_key(index, 'format')} to 'text' or 'auto'")
        return _read_txt(path, ds.text_field)
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    return _read_parquet(path)


def _read_hub(ds: DatasetConfig, index: int, rank: int, world_size: int, *, split_by_rank: bool) -> Iterator[_Record]:
    try:
        import datasets
        from datasets.distributed import split_dataset_by_node
    except ImportError as exc:
        raise ValueError(
            f"{_key(index, 'hub')} = {ds.hub!r} streams from the Hugging Face hub, which needs the `datasets` "
            "package (pip install datasets) and network access; or download the files and set "
            f"{_key(index, 'path')} instead."
        ) from exc
    try:
        stream = datasets.load_dataset(ds.hub, split=ds.split, streaming=True)
    except Exception as exc:
        raise ValueError(
            f"{_key(index, 'hub')} = {ds.hub!r} (split {ds.split!r}) could not be opened: {exc}. Streaming needs "
            f"network access (and a login for gated sets); check the id and {_key(index, 'split')}."
        ) from exc
    if split_by_rank and world_size > 1:
        num_shards = getattr(stream, "num_shards", None) or getattr(stream, "n_shards", 1)
        if num_shards % world_size and rank == 0:
            logger.warning(
                "%s = %r has %d shards, which %d ranks do not divide: every rank reads every shard and keeps "
                "one record in %d (slower than whole shards per rank, but no rank idles)",
                _key(index, "hub"), ds.hub, num_shards, world_size, world_size,
            )  # fmt: skip
        # datasets gives whole shards to ranks when they divide, else one example in world_size.
        stream = split_dataset_by_node(stream, rank=rank, world_size=world_size)
    for number, fields in enumerate(stream):
        yield _Record(dict(fields), f"{ds.hub} ({ds.split}) record {number}")


def _task_records(ds: DatasetConfig, seed: int) -> Iterator[_Record]:
    assert ds.task is not None
    for number, example in enumerate(tasks.generate_examples(ds.task, ds.num_examples, seed)):
        yield _Record(task_record(example), f"task {ds.task} example {number}")


def task_record(example: tasks.Example) -> dict[str, str]:
    """The prompt_completion record a built-in task example trains as (the document then ends with eos)."""
    # No newline after the answer: eos ends it, and greedy decoding of `prompt` stops there.
    return {"prompt": example.prompt, "completion": example.answer}


def _read_hub_shards(ds: DatasetConfig, index: int) -> Iterator[_Record]:
    """Every record of a hub dataset's parquet shards in order, read by range requests (the streaming reader's)."""
    from prime_train.engine import hub_files
    from prime_train.engine.streaming import _rows_from

    for path in hub_files.list_parquet(ds.hub or "", ds.split, key=_key(index, "hub")):
        for number, fields in _rows_from(path, 0):
            yield _Record(fields, f"{path} row {number}")


def _read_records(
    ds: DatasetConfig,
    index: int,
    seed: int,
    rank: int,
    world_size: int,
    *,
    split_by_rank: bool,
    streaming: bool = False,
) -> tuple[Iterator[_Record], bool]:
    """The dataset's records and whether they are already this rank's share (whole shards)."""
    if ds.task is not None:
        return _task_records(ds, seed), False
    if ds.hub is not None and streaming and not split_by_rank:
        # held-out records of a streamed hub dataset: the same parquet reader as training, no `datasets` needed
        return _read_hub_shards(ds, index), False
    if ds.hub is not None:
        return _read_hub(ds, index, rank, world_size, split_by_rank=split_by_rank), split_by_rank
    assert ds.path is not None
    files = _expand_local_path(ds.path, index)
    sharded = split_by_rank and world_size > 1 and len(files) > 1 and len(files) % world_size == 0
    if split_by_rank and world_size > 1 and len(files) > 1 and not sharded and rank == 0:
        logger.warning(
            "%s = %r has %d files, which %d ranks do not divide: every rank reads every file and keeps one "
            "record in %d (give it a multiple of %d files to read whole files per rank)",
            _key(index, "path"), ds.path, len(files), world_size, world_size, world_size,
        )  # fmt: skip
    mine = files[rank::world_size] if sharded else files

    def records() -> Iterator[_Record]:
        for path in mine:
            yield from _read_local_file(path, ds, index)

    return records(), sharded


# ----------------------------------------------------------------------------------------------------------------
# Formats and tokenization
# ----------------------------------------------------------------------------------------------------------------


def _detect_format(ds: DatasetConfig, index: int, record: _Record) -> str:
    if ds.format != "auto":
        return ds.format
    keys = record.fields.keys()
    if ds.messages_field in keys:
        return "chat"
    if ds.prompt_field in keys and ds.completion_field in keys:
        return "prompt_completion"
    if ds.text_field in keys:
        return "text"
    raise ValueError(
        f"{record.where}: cannot tell the record format from its fields {sorted(keys)}; set "
        f"{_key(index, 'format')} (text, prompt_completion or chat) and the matching *_field key"
    )


def _string_field(record: _Record, field: str, key: str, fmt: str) -> str:
    if field not in record.fields:
        raise ValueError(
            f"{record.where}: record has no field {field!r} (format {fmt}); add it, or set {key} to the field "
            "that holds it"
        )
    value = record.fields[field]
    if not isinstance(value, str):
        raise ValueError(f"{record.where}: field {field!r} must be a string, got {type(value).__name__}")
    return value


def _extract(ds: DatasetConfig, index: int, fmt: str, record: _Record) -> Any:
    """The parts of a record its format uses, validated: a str, a (prompt, completion) pair, or messages."""
    if fmt == "text":
        return _string_field(record, ds.text_field, _key(index, "text_field"), fmt)
    if fmt == "prompt_completion":
        prompt = _string_field(record, ds.prompt_field, _key(index, "prompt_field"), fmt)
        return prompt, _string_field(record, ds.completion_field, _key(index, "completion_field"), fmt)
    if ds.messages_field not in record.fields:
        raise ValueError(
            f"{record.where}: record has no field {ds.messages_field!r} (format chat); add it, or set "
            f"{_key(index, 'messages_field')} to the field that holds the messages"
        )
    messages = record.fields[ds.messages_field]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{record.where}: field {ds.messages_field!r} must be a non-empty list of messages")
    for number, message in enumerate(messages):
        for part in ("role", "content"):
            if not isinstance(message, dict) or not isinstance(message.get(part), str):
                raise ValueError(
                    f"{record.where}: {ds.messages_field}[{number}].{part} is missing or not a string "
                    "(chat messages are {role, content} objects)"
                )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _is_held_out(content: Any, seed: int, fraction: float) -> bool:
    """Whether a record is held out: a hash of its content, so duplicates land on the same side."""
    if fraction <= 0.0:
        return False
    text = json.dumps(content, ensure_ascii=False, sort_keys=True)
    digest = hashlib.blake2b(f"{seed}\x00{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


@dataclass
class _Document:
    ids: list[int]
    loss: list[bool]


class _Encoder:
    """Turns extracted record contents into documents for one tokenizer and job."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, job: str) -> None:
        if job not in ("sft", "pretrain"):
            raise ValueError(f"run.job must be 'sft' or 'pretrain', got {job!r}")
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no eos token; documents must end with one (set model.tokenizer)")
        self.tokenizer = tokenizer
        self.job = job
        self.eos = tokenizer.eos_token_id
        # Whatever the tokenizer's post-processor puts before text (a bos for Llama-style tokenizers)
        # starts every non-chat document; chat templates write their own.
        probe = "a"
        plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
        full = tokenizer(probe, add_special_tokens=True)["input_ids"]
        cut = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        self.prefix = list(full[:cut])

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids a prompt_completion document starts with, for prompting with `prompt` alone."""
        return self.prefix + self._encode([prompt])[0]

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        return list(self.tokenizer(texts, add_special_tokens=False)["input_ids"])

    def _finish(self, ids: list[int], loss: list[bool]) -> _Document:
        if not ids or ids[-1] != self.eos:
            # The eos is learned wherever the token before it is: after a completion, not after a prompt.
            ids.append(self.eos)
            loss.append(loss[-1] if loss else True)
        if self.job == "pretrain":
            loss = [True] * len(ids)
        return _Document(ids, loss)

    def encode(self, fmt: str, contents: list[Any]) -> list[_Document]:
        """Documents of `contents`, all of format `fmt`."""
        docs: list[_Document] = []
        for start in range(0, len(contents), _TOKENIZE_CHUNK):
            chunk = contents[start : start + _TOKENIZE_CHUNK]
            if fmt == "text":
                for ids in self._encode(chunk):
                    docs.append(self._finish(self.prefix + ids, [True] * (len(self.prefix) + len(ids))))
            elif fmt == "prompt_completion":
                # Prompt and completion are tokenized apart so the prompt's tokens are exactly those an
                # exact-match eval or a rollout feeds the model when it prompts with `prompt` alone.
                prompts = self._encode([p for p, _ in chunk])
                completions = self._encode([c for _, c in chunk])
                for p, c in zip(prompts, completions, strict=True):
                    p = self.prefix + p
                    docs.append(self._finish(p + c, [False] * len(p) + [True] * len(c)))
            else:
                docs.extend(self._encode_chat(messages) for messages in chunk)
        return docs

    def _encode_chat(self, messages: list[dict[str, str]]) -> _Document:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(
                "a chat-format dataset needs a tokenizer with a chat template; set model.tokenizer to one that "
                "has one, or convert the records to prompt/completion"
            )
        text = tok.apply_chat_template(messages, tokenize=False)
        # Assistant turns are found by rendering growing prefixes: the characters a turn adds after the
        # generation prompt are the ones the model must produce.
        spans: list[tuple[int, int]] = []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = tok.apply_chat_template(messages[:turn], tokenize=False, add_generation_prompt=True)
            through = tok.apply_chat_template(messages[: turn + 1], tokenize=False)
            if not (through.startswith(before) and text.startswith(through)):
                raise ValueError(
                    "the tokenizer's chat template rewrites earlier turns (it is not prefix-stable), so assistant "
                    "tokens cannot be located; use a different model.tokenizer or prompt/completion records"
                )
            spans.append((len(before), len(through)))
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        starts = [begin for begin, _ in encoded["offset_mapping"]]
        loss = [any(lo <= s < hi for lo, hi in spans) for s in starts]
        return self._finish(ids, loss)


# ----------------------------------------------------------------------------------------------------------------
# Packing
# ----------------------------------------------------------------------------------------------------------------


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
class _Rows:
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
        )


def _build_rows(docs: list[_Document], seq_len: int, pad_id: int, packing: bool) -> _Rows:
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
            starts[row, offset] = True
            offset += kept
        row_lengths[row] = offset
        if offset < seq_len:
            # Padding is a segment of its own (positions from 0), so no document attends to it.
            starts[row, offset] = True
    truncated = sum(max(0, n - seq_len) for n in lengths)
    return _Rows(ids, loss, starts, row_lengths, num_documents=len(docs), num_truncated_tokens=truncated)


def _concat_rows(parts: list[_Rows]) -> _Rows:
    return _Rows(
        *(np.concatenate([getattr(p, name) for p in parts]) for name in ("ids", "loss", "starts", "lengths")),
        num_documents=sum(p.num_documents for p in parts),
        num_truncated_tokens=sum(p.num_truncated_tokens for p in parts),
    )


# ----------------------------------------------------------------------------------------------------------------
# From config to rows
# ----------------------------------------------------------------------------------------------------------------


def _check_data_config(data: DataConfig) -> None:
    probs = data.sampling_probs
    if probs is None:
        return
    if len(probs) != len(data.datasets):
        raise ValueError(
            f"data.sampling_probs has {len(probs)} values for {len(data.datasets)} datasets; give one per dataset"
        )
    if any(p < 0 for p in probs) or not math.isclose(sum(probs), 1.0, abs_tol=1e-6):
        raise ValueError(f"data.sampling_probs {probs} must be non-negative and sum to 1")


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
) -> tuple[str, list[Any]]:
    """(format, contents) of this rank's training records (all of them when `keep_all`), or of all
    held-out records when `held_out`; reading stops after `limit` contents when given."""
    # Held-out records are read from every shard by every rank, so all ranks agree on the eval set.
    records, sharded = _read_records(ds, index, seed, rank, world_size, split_by_rank=not held_out, streaming=streaming)
    fmt: str | None = None
    contents: list[Any] = []
    kept = 0
    for record in records:
        if fmt is None:
            fmt = _detect_format(ds, index, record)
        content = _extract(ds, index, fmt, record)
        if _is_held_out(content, seed, held_out_fraction) != held_out:
            continue
        if not held_out and not sharded and not keep_all:
            kept += 1
            if (kept - 1) % world_size != rank:
                continue
        contents.append(content)
        if limit is not None and len(contents) >= limit:
            break
    return fmt or "text", contents


def _splits_by_shard(ds: DatasetConfig, world_size: int) -> bool:
    """Whether ranks read disjoint whole shards of this dataset (a hub stream, or files the ranks divide)."""
    if world_size == 1 or ds.task is not None:
        return False
    if ds.hub is not None:
        return True
    files = _expand_local_path(ds.path or "", 0)
    return len(files) > 1 and len(files) % world_size == 0


def _rank_rows(
    data: DataConfig, tokenizer: PreTrainedTokenizerBase, job: str, rank: int, world_size: int, seed: int
) -> tuple[list[_Rows], bool]:
    """Packed training rows of each dataset, and whether they are the global rows every rank shares.

    Data that fits in memory and is not split by shards is packed whole on every rank, identically,
    and each rank reads every world_size-th row of one shared order: the global batch of a step is
    then the same rows whatever the world size, so 1 process and N processes train alike.
    """
    encoder = _Encoder(tokenizer, job)
    shared = not any(_splits_by_shard(ds, world_size) for ds in data.datasets)
    parts = []
    for index, ds in enumerate(data.datasets):
        fmt, contents = _dataset_contents(
            ds, index, seed, data.held_out_fraction, rank, world_size, held_out=False, keep_all=shared
        )
        parts.append(_build_rows(encoder.encode(fmt, contents), data.seq_len, tokenizer.pad_token_id, data.packing))
    return parts, shared


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
            raise ValueError("data.sampling_probs gives every non-empty dataset probability 0")
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
        self, rows: _Rows, order: _EpochOrder, micro_batch_size: int, stride: int = 1, offset: int = 0
    ) -> None:
        self.rows = rows
        self.order = order
        self.micro_batch_size = micro_batch_size
        # shared rows: this rank's p-th sequence is position p * stride + offset of the common order
        self.stride = stride
        self.offset = offset

    def __getitem__(self, position: int) -> Batch:
        length = self.order.length
        shared = (p * self.stride + self.offset for p in range(position, position + self.micro_batch_size))
        picked = [self.order.rows(g // length)[g % length] for g in shared]
        return self.rows.batch(np.asarray(picked, dtype=np.int64))


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
) -> TrainLoader:
    """This rank's endless, resumable stream of packed training micro-batches."""
    _check_data_config(data)
    if data.streaming:
        from prime_train.engine.streaming import build_streaming_loader

        return build_streaming_loader(  # type: ignore[return-value]
            data, tokenizer, job=job, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size,
            seed=seed, device=device,
        )  # fmt: skip
    if micro_batch_size < 1:
        raise ValueError(f"train.micro_batch_size must be at least 1, got {micro_batch_size}")
    parts, shared = _rank_rows(data, tokenizer, job, rank, world_size, seed)
    rows = _concat_rows(parts)
    order = _EpochOrder([len(p.lengths) for p in parts], data.sampling_probs, seed, 0 if shared else rank)
    if order.length < (world_size if shared else 1):
        raise ValueError(
            f"rank {rank} of {world_size} has no training sequences: the datasets are too small for this many "
            "ranks or data.held_out_fraction leaves nothing; add data or lower data.held_out_fraction"
        )
    logger.info("rank %d: %s", rank, rows.stats.describe())
    num_workers = _default_num_workers() if data.num_workers is None else data.num_workers
    return TrainLoader(
        _BatchesAt(rows, order, micro_batch_size, *((world_size, rank) if shared else (1, 0))),
        num_workers=num_workers,
        device=device,
        stats=rows.stats,
        seed=seed,
        rank=rank,
        world_size=world_size,
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
) -> list[Batch]:
    """Fixed held-out micro-batches for this rank; every rank gets the same count (collectives stay paired)."""
    _check_data_config(data)
    encoder = _Encoder(tokenizer, job)
    docs: list[_Document] = []
    # a streamed dataset may be web-scale: read only the first held-out documents the eval can use
    # (every rank reads the same ones, so the eval set still agrees across ranks)
    limit = max_batches * micro_batch_size * world_size * EVAL_DOCS_PER_ROW if data.streaming else None
    for index, ds in enumerate(data.datasets):
        fmt, contents = _dataset_contents(
            ds, index, seed, data.held_out_fraction, rank, world_size, held_out=True, limit=limit,
            streaming=data.streaming,
        )  # fmt: skip
        docs.extend(encoder.encode(fmt, contents))
    rows = _build_rows(docs, data.seq_len, tokenizer.pad_token_id, data.packing)
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
    return _Encoder(tokenizer, "sft").prompt_ids(prompt)


def held_out_examples(data: DataConfig, seed: int, n: int) -> list[tasks.Example]:
    """Up to `n` distinct held-out examples of the built-in task datasets, interleaved across them."""
    per_dataset: list[list[tasks.Example]] = []
    for ds in data.datasets:
        if ds.task is None:
            continue
        seen: set[str] = set()
        kept = []
        for example in tasks.generate_examples(ds.task, ds.num_examples, seed):
            record = task_record(example)
            content = (record["prompt"], record["completion"])
            if example.prompt not in seen and _is_held_out(content, seed, data.held_out_fraction):
                seen.add(example.prompt)
                kept.append(example)
        per_dataset.append(kept)
    interleaved = [ex for group in zip(*per_dataset, strict=False) for ex in group] if per_dataset else []
    longest = max((len(g) for g in per_dataset), default=0)
    # zip stops at the shortest list; take the rest of the longer ones in turn.
    for i in range(min((len(g) for g in per_dataset), default=0), longest):
        interleaved.extend(g[i] for g in per_dataset if i < len(g))
    return interleaved[:n]
