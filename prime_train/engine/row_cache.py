"""A run's tokenized, packed training rows, kept in its run directory between the starts of its trainer.

Every start of a trainer (the first, each restart after a failure or a preemption, on every rank) reads its
datasets, tokenizes and packs them again before its first step: half a second for the default job, 0.36 ms per
two-turn chat record with the byte tokenizer, so minutes per million records on every rank at every restart. The
rows are a function of what the key below hashes, so the first start writes them to
`<run>/cache/rows-<part>-<key>.safetensors` and every later start with the same inputs reads them back. The
held-out rows of the loss eval are kept the same way (`part` is `eval`): building them reads every record. The
dpo and reward jobs keep their tokenized preference pairs so (`pairs`, `pairs-eval`; engine/preference.py), every
sequence's ids and loss flags end to end with their lengths.

The key hashes the data config (all of it but data.cache_rows and data.num_workers), the datasets continual
learning replays, the job, the seed, the rank and world size where each rank reads its own shards (`part` is
`rank<r>` then, `all` where every rank packs the same rows), each local file's real path, size, inode, modification
and change time, the tokenizer (its fast backend serialised, its class, chat template, special tokens and the prefix the
encoder found), the versions of transformers and tokenizers, and prime-train's own source. Not cached: a hub
dataset (its content can change under the same name), and a tokenizer whose ids are not its fast backend's (nothing
exact and cheap identifies what it does).

A cache file is read as untrusted: safetensors (no pickle), opened without following a link, every array checked
(names, dtypes, shapes, ids within the vocabulary, lengths within a row); anything wrong is a warning and the rows
are built again. Writing is never needed: a failure (a full disk) is a warning, and rows that would take more than
a quarter of the free space are not written. A writer removes the files of its own part under other keys: what an
earlier config of this run left.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from prime_train.contract import open_regular, replace_file_atomic
from prime_train.engine.packing import PackedRows

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from prime_train.config.schema import DataConfig, DatasetConfig
    from prime_train.engine.documents import Encoder
    from prime_train.rundir import RunDir

logger = logging.getLogger("prime_train.engine.data")
T = TypeVar("T")  # what a job caches (RowCache.cached)

FORMAT = 1  # of the file: a change of what is stored changes every key
_FILE = r"rows-(?P<part>all|eval|pairs|pairs-eval|rank\d+)-(?P<key>[0-9a-f]{32})\.safetensors"  # RowCache.path's names
_NAME_RE = re.compile(rf"^{_FILE}$")
# replace_file_atomic's temporary name for one of them: removed by the next writer of its part when an hour old
_TMP_RE = re.compile(rf"^\.{_FILE}\.[0-9a-f]{{12}}\.tmp$")
STALE_TMP_S = 3600
_ARRAYS = ("ids", "loss", "starts", "lengths")
_DTYPES = {"ids": np.int32, "loss": np.bool_, "starts": np.bool_, "lengths": np.int32}


@functools.cache
def _code_digest() -> str:
    """prime-train's own source: records, tasks, documents and packing decide the rows, and an edited checkout keeps
    its version number."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _tokenizer_identity(encoder: Encoder) -> dict[str, Any] | None:
    """What decides the ids a tokenizer gives the encoder, or None when that cannot be told exactly."""
    import tokenizers
    import transformers

    backend = encoder._backend()
    if backend is None:
        return None
    tok: PreTrainedTokenizerBase = encoder.tokenizer
    return {
        "class": f"{type(tok).__module__}.{type(tok).__qualname__}",
        "backend": hashlib.sha256(backend.to_str().encode()).hexdigest(),
        "chat_template": tok.chat_template,
        "special": {k: str(v) for k, v in sorted(tok.special_tokens_map.items())},
        "eos": tok.eos_token_id,
        "pad": tok.pad_token_id,
        "vocab": len(tok),
        "prefix": encoder.prefix,
        "versions": [transformers.__version__, tokenizers.__version__],
    }


def _local_files(datasets: Sequence[DatasetConfig]) -> list[Any] | None:
    """(real path, size, inode, modification and change time) of each dataset's files; None when a dataset is read
    from the hub. The change time is set by the system on every write or utime: `cp -p`, `rsync -t` and `touch -r`
    put the modification time back, never it; the inode tells a file renamed over the old one."""
    from prime_train.engine.records import expand_local_path

    found: list[Any] = []
    for index, ds in enumerate(datasets):
        if ds.hub is not None:
            return None
        files = []
        for path in expand_local_path(ds.path, index) if ds.path else []:
            st = os.stat(path)
            files.append([os.path.realpath(path), st.st_size, st.st_ino, st.st_mtime_ns, st.st_ctime_ns])
        found.append(files)
    return found


def rows_key(
    data: DataConfig,
    datasets: Sequence[DatasetConfig],
    encoder: Encoder,
    *,
    seed: int,
    rank: int,
    world_size: int,
    shared: bool,
    held_out: bool = False,
) -> str | None:
    """The key of these rows (32 hex digits), or None when they are not cached; `held_out`: the eval's rows."""
    tokenizer = _tokenizer_identity(encoder)
    files = _local_files(datasets)
    if tokenizer is None or files is None:
        return None
    import prime_train

    whole = {
        "format": FORMAT,
        "version": prime_train.__version__,
        "code": _code_digest(),
        "data": data.model_dump(mode="json", exclude={"cache_rows", "num_workers"}),
        "datasets": [ds.model_dump(mode="json") for ds in datasets],
        "job": encoder.job,
        "seed": seed,
        "place": None if shared else [rank, world_size],
        "held_out": held_out,
        "files": files,
        "tokenizer": tokenizer,
    }
    return hashlib.sha256(json.dumps(whole, sort_keys=True).encode()).hexdigest()[:32]


class RowCache:
    """The cache of one run directory's training rows. Rows every rank shares are written by the first process of
    each node (`node_first`: its local rank 0); a rank's own rows by each process that builds them (the processes of
    one tensor-parallel group build the same, and each write replaces the file whole)."""

    def __init__(self, run_dir: RunDir, *, node_first: bool) -> None:
        self.run_dir = run_dir
        self.dir = run_dir.cache_dir
        self.node_first = node_first

    @staticmethod
    def part(shared: bool, rank: int) -> str:
        return "all" if shared else f"rank{rank}"

    def path(self, part: str, key: str) -> Path:
        return self.dir / f"rows-{part}-{key}.safetensors"

    def rows(
        self,
        part: str,
        key: str | None,
        build: Callable[[], tuple[list[PackedRows], np.ndarray | None]],
        *,
        num_datasets: int,
        seq_len: int,
        vocab: int,
        difficulty: bool,
    ) -> tuple[list[PackedRows], np.ndarray | None]:
        """The rows (one PackedRows a dataset) and their difficulty scores stored under `key`, else `build()`'s,
        written under `key` for the next start; `key` None (rows_key's "not cached"): `build()`'s alone."""
        return self.cached(
            part, key, build, to_arrays=lambda built: _rows_arrays(*built),
            from_arrays=lambda arrays: _check(arrays, num_datasets, seq_len, vocab, difficulty),
        )  # fmt: skip

    def cached(
        self,
        part: str,
        key: str | None,
        build: Callable[[], T],
        *,
        to_arrays: Callable[[T], dict[str, np.ndarray]],
        from_arrays: Callable[[dict[str, np.ndarray]], T],
    ) -> T:
        """What is stored under `key` (`from_arrays` of its arrays: ValueError when they are not what `to_arrays`
        writes), else `build()`'s, written under `key` for the next start; `key` None: `build()`'s alone."""
        if key is None:
            return build()
        arrays = self.load(part, key)
        if arrays is not None:
            try:
                found = from_arrays(arrays)
            except Exception as exc:  # a damaged or planted file is rebuilt, whatever it holds
                path = self.path(part, key)
                logger.warning("the cached rows %s are not usable (%s); tokenizing the data again", path, exc)
            else:
                logger.info("the tokenized rows from %s", self.path(part, key))
                return found
        built = build()
        self.save(part, key, to_arrays(built))
        return built

    # ---------------------------------------------------------------- read

    def load(self, part: str, key: str) -> dict[str, np.ndarray] | None:
        """The arrays stored under `key`, or None (missing, or not a safetensors file: said, then rebuilt)."""
        path = self.path(part, key)
        try:
            # a link refused; a FIFO planted there neither read nor waited on
            with open_regular(path, follow=False) as fd:
                try:
                    return _read_arrays(fd)
                except Exception as exc:  # a damaged or planted file is rebuilt, whatever it holds
                    logger.warning("the cached rows %s are not usable (%s); tokenizing the data again", path, exc)
                    return None
        except FileNotFoundError:
            return None
        except OSError as exc:
            logger.warning("the cached rows %s cannot be opened (%s); tokenizing the data again", path, exc)
            return None

    # ---------------------------------------------------------------- write

    def save(self, part: str, key: str, arrays: dict[str, np.ndarray]) -> None:
        """Write these arrays under `key`, and remove this part's files under other keys; failures are warnings."""
        if not part.startswith("rank") and not self.node_first:
            return  # every rank holds the same: each node's first process writes them
        size = sum(a.nbytes for a in arrays.values())
        path = self.path(part, key)
        try:
            self.run_dir.ensure_dir(self.dir)  # UnsafeLink (an OSError) where cache/ leads out of the run directory
            free = shutil.disk_usage(self.dir).free
            if size > free // 4:
                logger.warning(
                    "not caching the tokenized rows (%.1f GiB) in %s: they would take over a quarter of its %.1f GiB "
                    "free; every restart tokenizes the data again", size / 2**30, self.dir, free / 2**30,
                )  # fmt: skip
                return
            from safetensors.numpy import save

            replace_file_atomic(path, save(arrays), durable=False, mode=0o644)
        except OSError as exc:
            logger.warning("could not cache the tokenized rows in %s (%s); restarts tokenize the data again", path, exc)
            return
        self._remove_others(part, key)

    def _remove_others(self, part: str, key: str) -> None:
        """This part's files under other keys, and the temporary files of its writes killed part way (an hour old:
        a peer writing the same part now is not disturbed)."""
        try:
            entries = list(os.scandir(self.dir))
        except OSError:
            return
        for entry in entries:
            if (tmp := _TMP_RE.match(entry.name)) and tmp["part"] == part:
                with contextlib.suppress(OSError):
                    if time.time() - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                        os.unlink(entry.path)
                continue
            match = _NAME_RE.match(entry.name)
            if match and match["part"] == part and match["key"] != key:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)  # a link is removed itself, never what it points at


def _read_arrays(fd: int) -> dict[str, np.ndarray]:
    """The arrays of the safetensors file open at `fd`. Where the system names open files (/proc/self/fd: Linux),
    safetensors maps that very file and copies each array out once; elsewhere the file is read whole first (twice
    the rows' size in memory for a moment)."""
    from safetensors import safe_open
    from safetensors.numpy import load

    opened = f"/proc/self/fd/{fd}"
    if os.path.exists(opened):
        with safe_open(opened, framework="np") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
    with os.fdopen(os.dup(fd), "rb") as f:
        return load(f.read())


def _rows_arrays(parts: list[PackedRows], difficulty: np.ndarray | None) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for i, rows in enumerate(parts):
        for name in _ARRAYS:
            arrays[f"{name}.{i}"] = np.ascontiguousarray(getattr(rows, name), dtype=_DTYPES[name])
        arrays[f"counts.{i}"] = np.array([rows.num_documents, rows.num_truncated_tokens], dtype=np.int64)
    if difficulty is not None:
        arrays["difficulty"] = np.ascontiguousarray(difficulty, dtype=np.float64)
    return arrays


def _check(
    arrays: dict[str, np.ndarray], num_datasets: int, seq_len: int, vocab: int, difficulty: bool
) -> tuple[list[PackedRows], np.ndarray | None]:
    """The rows these arrays hold; ValueError naming the first thing that is not as this module writes it."""
    expected = {f"{name}.{i}" for i in range(num_datasets) for name in (*_ARRAYS, "counts")}
    expected |= {"difficulty"} & set(arrays) if difficulty else set()  # none where there are no rows
    if set(arrays) != expected:
        raise ValueError(f"arrays {sorted(set(arrays) ^ expected)} differ from what this run stores")
    parts, total = [], 0
    for i in range(num_datasets):
        got = {name: arrays[f"{name}.{i}"] for name in _ARRAYS}
        for name, array in got.items():
            if array.dtype != _DTYPES[name]:
                raise ValueError(f"{name}.{i} is {array.dtype}, not {np.dtype(_DTYPES[name])}")
        n = len(got["lengths"])
        if got["lengths"].ndim != 1 or any(got[name].shape != (n, seq_len) for name in ("ids", "loss", "starts")):
            raise ValueError(f"dataset {i}'s arrays are not {n} rows of {seq_len} tokens")
        if n and (got["ids"].min() < 0 or got["ids"].max() >= vocab):
            raise ValueError(f"ids.{i} holds token ids outside the tokenizer's {vocab}")
        if n and (got["lengths"].min() < 0 or got["lengths"].max() > seq_len):
            raise ValueError(f"lengths.{i} holds lengths outside 0..{seq_len}")
        counts = arrays[f"counts.{i}"]
        if counts.dtype != np.int64 or counts.shape != (2,) or counts.min() < 0:
            raise ValueError(f"counts.{i} is not two non-negative counts")
        parts.append(PackedRows(**got, num_documents=int(counts[0]), num_truncated_tokens=int(counts[1])))
        total += n
    scores = arrays.get("difficulty")
    if difficulty and total and scores is None:
        raise ValueError("the rows' difficulty scores are missing")
    if scores is not None and (scores.dtype != np.float64 or scores.shape != (total,) or not np.isfinite(scores).all()):
        raise ValueError(f"difficulty is not {total} finite scores")
    return parts, scores
