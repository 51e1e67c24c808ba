"""Where the training text comes from: records read from a built-in task, local files or the hub, as contents.

A record is one row of a dataset (a JSON line, a parquet row, a paragraph of a .txt file, a task
example), with where it came from for error messages. Its format (text, prompt_completion or chat; preference
records are engine/preference.py's)
is detected from its fields and its contents extracted and validated here; whether it is held out
for eval is a hash of those contents and the seed, so duplicates land on the same side and every
reader (the in-memory loader in data.py, the streaming one in streaming.py) splits alike.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prime_train import tasks
from prime_train.engine import hub_files
from prime_train.engine.metrics import EngineConfigError

if TYPE_CHECKING:
    from prime_train.config.schema import DatasetConfig

logger = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".txt", ".jsonl", ".parquet")
# Parquet rows decoded per read; a record batch is the only thing held besides the caller's buffer.
_READ_ROWS = 1024


@dataclass(frozen=True)
class Record:
    """One row of a dataset as read, before its format is known."""

    fields: dict[str, Any]
    where: str  # file:line, file row N, ... for error messages


# An environment variable holds a credential when one of these is a word of its name. The supervisor's rule is
# kit/redact.py's looks_secret_name, which the engine may not import; this short form errs toward masking.
_CREDENTIAL_WORDS = {
    "KEY", "KEYS", "TOKEN", "SECRET", "SECRETS", "PASSWORD", "PASSWD", "PASS", "PWD", "PASSPHRASE", "CREDENTIAL",
    "CREDENTIALS", "CREDS", "AUTH", "APIKEY",
}  # fmt: skip
_NOT_CREDENTIAL_WORDS = {"PUBLIC", "PUB", "SOCK", "SOCKET"}


def _secret_values() -> list[str]:
    """This process's secret values, longest first: its credential variables', and the real values of
    config.toml's `***` that the supervisor passed it (ENV_CONFIG_SECRETS)."""
    from prime_train.config.loader import ENV_CONFIG_SECRETS

    values = []
    for name, value in os.environ.items():
        words = set(re.split(r"[_\-.]+", name.upper()))
        if name.upper() not in ("PWD", "OLDPWD") and words & _CREDENTIAL_WORDS and not words & _NOT_CREDENTIAL_WORDS:
            values.append(value)
    try:
        entries = json.loads(os.environ.get(ENV_CONFIG_SECRETS) or "[]")
    except ValueError:
        entries = []
    values += [e[1] for e in entries if isinstance(e, list) and len(e) == 2 and isinstance(e[1], str)]
    return sorted({v for v in values if len(v.strip()) >= 6}, key=len, reverse=True)


def shown_path(path: str) -> str:
    """`path` as a message may show it (progress.json's `reason` gets the message): secret values masked.

    A dataset path can hold a credential (a token in a URL, a key in a folder's name); mask before any repr()."""
    for value in _secret_values():
        path = path.replace(value, "[REDACTED]")
    return path


def dataset_key(index: int, name: str) -> str:
    """The config key of field `name` of the `index`-th dataset, as error messages name it."""
    return f"data.datasets[{index}].{name}"


def expand_local_path(path: str, index: int) -> list[str]:
    """The data files a `path` names: the file itself, a directory's files, or a glob's matches, sorted."""
    expanded = os.path.expanduser(path)
    if any(ch in expanded for ch in "*?["):
        files = sorted(p for p in glob.glob(expanded, recursive=True) if os.path.isfile(p))
    elif os.path.isdir(expanded):
        walked = os.walk(expanded)
        files = sorted(os.path.join(root, name) for root, _, names in walked for name in names if name[0] != ".")
    elif os.path.isfile(expanded):
        if not expanded.endswith(LOCAL_SUFFIXES):
            raise EngineConfigError(
                f"{dataset_key(index, 'path')} = {shown_path(path)!r}: unsupported file type; use "
                f"{', '.join(LOCAL_SUFFIXES)} files"
            )
        return [expanded]
    else:
        raise EngineConfigError(f"{dataset_key(index, 'path')} = {shown_path(path)!r}: no such file or directory")
    files = [f for f in files if f.endswith(LOCAL_SUFFIXES)]
    if not files:
        raise EngineConfigError(
            f"{dataset_key(index, 'path')} = {shown_path(path)!r}: no {', '.join(LOCAL_SUFFIXES)} files there"
        )
    return files


def _read_txt(path: str, text_field: str) -> Iterator[Record]:
    # One document per blank-line-separated paragraph; a file without blank lines is one document.
    shown = shown_path(path)
    with open(path, encoding="utf-8") as handle:
        lines: list[str] = []
        start = 1
        for number, line in enumerate(handle, start=1):
            if line.strip():
                if not lines:
                    start = number
                lines.append(line)
            elif lines:
                yield Record({text_field: "".join(lines).rstrip("\n")}, f"{shown}:{start}")
                lines = []
        if lines:
            yield Record({text_field: "".join(lines).rstrip("\n")}, f"{shown}:{start}")


def _read_jsonl(path: str) -> Iterator[Record]:
    shown = shown_path(path)
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{shown}:{number}"
            try:
                fields = json.loads(line)
            except json.JSONDecodeError as exc:
                problem = f"not valid JSON ({exc.msg} at column {exc.colno})"
                raise EngineConfigError(f"{where}: {problem}; fix or remove the line") from None
            if not isinstance(fields, dict):
                raise EngineConfigError(f"{where}: expected a JSON object per line, got {type(fields).__name__}")
            yield Record(fields, where)


def _read_parquet(path: str) -> Iterator[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise EngineConfigError(f"{shown_path(path)}: reading parquet needs pyarrow (pip install pyarrow)") from exc
    shown = shown_path(path)
    row = 0
    for record_batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
        for fields in record_batch.to_pylist():
            yield Record(fields, f"{shown} row {row}")
            row += 1


def _read_local_file(path: str, ds: DatasetConfig, index: int) -> Iterator[Record]:
    if path.endswith(".txt"):
        if ds.format not in ("auto", "text"):
            raise EngineConfigError(
                f"{shown_path(path)}: .txt files hold plain text; set {dataset_key(index, 'format')} to 'text' or "
                "'auto'"
            )
        return _read_txt(path, ds.text_field)
    if path.endswith(".jsonl"):
        return _read_jsonl(path)
    return _read_parquet(path)


def _read_hub(ds: DatasetConfig, index: int, rank: int, world_size: int, *, split_by_rank: bool) -> Iterator[Record]:
    try:
        import datasets
        from datasets.distributed import split_dataset_by_node
    except ImportError as exc:
        raise EngineConfigError(
            f"{dataset_key(index, 'hub')} = {ds.hub!r} streams from the Hugging Face hub, which needs the `datasets` "
            "package (pip install datasets) and network access; or download the files and set "
            f"{dataset_key(index, 'path')} instead."
        ) from exc
    try:
        stream = datasets.load_dataset(ds.hub, split=ds.split, streaming=True)
    except Exception as exc:
        raise EngineConfigError(
            f"{dataset_key(index, 'hub')} = {ds.hub!r} (split {ds.split!r}) could not be opened: {exc}. Streaming "
            f"needs network access (and a login for gated sets); check the id and {dataset_key(index, 'split')}."
        ) from exc
    if split_by_rank and world_size > 1:
        num_shards = getattr(stream, "num_shards", None) or getattr(stream, "n_shards", 1)
        if num_shards % world_size and rank == 0:
            logger.warning(
                "%s = %r has %d shards, which %d ranks do not divide: every rank reads every shard and keeps "
                "one record in %d (slower than whole shards per rank, but no rank idles)",
                dataset_key(index, "hub"), ds.hub, num_shards, world_size, world_size,
            )  # fmt: skip
        # datasets gives whole shards to ranks when they divide, else one example in world_size.
        stream = split_dataset_by_node(stream, rank=rank, world_size=world_size)
    for number, fields in enumerate(stream):
        yield Record(dict(fields), f"{ds.hub} ({ds.split}) record {number}")


def _task_records(ds: DatasetConfig, seed: int) -> Iterator[Record]:
    assert ds.task is not None
    for number, example in enumerate(tasks.generate_examples(ds.task, ds.num_examples, seed)):
        yield Record(task_record(example), f"task {ds.task} example {number}")


def task_record(example: tasks.Example) -> dict[str, str]:
    """The prompt_completion record a built-in task example trains as (the document then ends with eos)."""
    # No newline after the answer: eos ends it, and greedy decoding of `prompt` stops there.
    return {"prompt": example.prompt, "completion": example.answer}


def _read_hub_shards(ds: DatasetConfig, index: int) -> Iterator[Record]:
    """Every record of a hub dataset's parquet shards in order, read by range requests (the streaming reader's)."""
    for path in hub_files.list_parquet(ds.hub or "", ds.split, key=dataset_key(index, "hub")):
        for number, fields in parquet_rows(path, 0):
            yield Record(fields, f"{path} row {number}")


def read_records(
    ds: DatasetConfig,
    index: int,
    seed: int,
    rank: int,
    world_size: int,
    *,
    split_by_rank: bool,
    streaming: bool = False,
) -> tuple[Iterator[Record], bool]:
    """The dataset's records and whether they are already this rank's share (whole shards)."""
    if ds.task is not None:
        return _task_records(ds, seed), False
    if ds.hub is not None and streaming and not split_by_rank:
        # held-out records of a streamed hub dataset: the same parquet reader as training, no `datasets` needed
        return _read_hub_shards(ds, index), False
    if ds.hub is not None:
        return _read_hub(ds, index, rank, world_size, split_by_rank=split_by_rank), split_by_rank
    assert ds.path is not None
    files = expand_local_path(ds.path, index)
    sharded = split_by_rank and world_size > 1 and len(files) > 1 and len(files) % world_size == 0
    if split_by_rank and world_size > 1 and len(files) > 1 and not sharded and rank == 0:
        logger.warning(
            "%s = %r has %d files, which %d ranks do not divide: every rank reads every file and keeps one "
            "record in %d (give it a multiple of %d files to read whole files per rank)",
            dataset_key(index, "path"), ds.path, len(files), world_size, world_size, world_size,
        )  # fmt: skip
    mine = files[rank::world_size] if sharded else files

    def records() -> Iterator[Record]:
        for path in mine:
            yield from _read_local_file(path, ds, index)

    return records(), sharded


def _parquet(path: str):
    """A ParquetFile of a local shard or of a hub shard read by range requests."""
    import pyarrow.parquet as pq

    return pq.ParquetFile(hub_files.open_source(path))


def parquet_num_rows(path: str) -> int:
    """Rows of a parquet file, from its footer alone."""
    return _parquet(path).metadata.num_rows


def parquet_rows(path: str, first_row: int) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number, fields) of a parquet file from `first_row` on, one record batch in memory at a time."""
    try:
        parquet = _parquet(path)
    except ImportError as exc:
        raise EngineConfigError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from exc
    # Whole row groups before `first_row` are skipped without being read.
    groups, group_start = [], 0
    for group in range(parquet.metadata.num_row_groups):
        count = parquet.metadata.row_group(group).num_rows
        if groups or group_start + count > first_row:
            groups.append(group)
        else:
            group_start += count
    if not groups:
        return
    number = group_start
    for record_batch in parquet.iter_batches(batch_size=_READ_ROWS, row_groups=groups):
        count = record_batch.num_rows
        if number + count > first_row:
            skip = max(0, first_row - number)
            for offset, fields in enumerate(record_batch.slice(skip).to_pylist()):
                yield number + skip + offset, fields
        number += count


# ----------------------------------------------------------------------------------------------------------------
# Formats, contents and the held-out split
# ----------------------------------------------------------------------------------------------------------------


def detect_format(ds: DatasetConfig, index: int, record: Record) -> str:
    if ds.format != "auto":
        return ds.format
    keys = record.fields.keys()
    if ds.chosen_field in keys and ds.rejected_field in keys:
        return "preference"
    if ds.messages_field in keys:
        return "chat"
    if ds.prompt_field in keys and ds.completion_field in keys:
        return "prompt_completion"
    if ds.text_field in keys:
        return "text"
    raise EngineConfigError(
        f"{record.where}: cannot tell the record format from its fields {sorted(keys)}; set "
        f"{dataset_key(index, 'format')} (text, prompt_completion, chat or preference) and the matching *_field key"
    )


def _string_field(record: Record, field: str, key: str, fmt: str) -> str:
    if field not in record.fields:
        raise EngineConfigError(
            f"{record.where}: record has no field {field!r} (format {fmt}); add it, or set {key} to the field "
            "that holds it"
        )
    value = record.fields[field]
    if not isinstance(value, str):
        raise EngineConfigError(f"{record.where}: field {field!r} must be a string, got {type(value).__name__}")
    return value


def extract(ds: DatasetConfig, index: int, fmt: str, record: Record) -> Any:
    """The parts of a record its format uses, validated: a str, a (prompt, completion) pair, or messages.

    Preference records are the dpo and reward jobs' (engine/preference.py extract_pair), not this job's."""
    if fmt == "preference":
        raise EngineConfigError(
            f"{record.where}: {dataset_key(index, 'format')}: preference records ({ds.chosen_field!r} and "
            f"{ds.rejected_field!r}) train run.job 'dpo' or 'reward'; this job reads text, prompt_completion or chat"
        )
    if fmt == "text":
        return _string_field(record, ds.text_field, dataset_key(index, "text_field"), fmt)
    if fmt == "prompt_completion":
        prompt = _string_field(record, ds.prompt_field, dataset_key(index, "prompt_field"), fmt)
        return prompt, _string_field(record, ds.completion_field, dataset_key(index, "completion_field"), fmt)
    if ds.messages_field not in record.fields:
        raise EngineConfigError(
            f"{record.where}: record has no field {ds.messages_field!r} (format chat); add it, or set "
            f"{dataset_key(index, 'messages_field')} to the field that holds the messages"
        )
    messages = record.fields[ds.messages_field]
    if not isinstance(messages, list) or not messages:
        raise EngineConfigError(f"{record.where}: field {ds.messages_field!r} must be a non-empty list of messages")
    for number, message in enumerate(messages):
        for part in ("role", "content"):
            if not isinstance(message, dict) or not isinstance(message.get(part), str):
                raise EngineConfigError(
                    f"{record.where}: {ds.messages_field}[{number}].{part} is missing or not a string "
                    "(chat messages are {role, content} objects)"
                )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def is_held_out(content: Any, seed: int, fraction: float) -> bool:
    """Whether a record is held out: a hash of its content, so duplicates land on the same side."""
    if fraction <= 0.0:
        return False
    text = json.dumps(content, ensure_ascii=False, sort_keys=True)
    digest = hashlib.blake2b(f"{seed}\x00{text}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction
