"""Can a dataset's records be read with its format and *_field keys? Answered before the engine starts.

The rule is engine/records.py's (`detect_format`, then the fields `extract` reads), mirrored here because the
validator stays torch-free and may not import the engine (docs/architecture.md); tests pin both to the same
answers. Lint applies it to a built-in task's records, whose fields are fixed, and to the first record of a local
dataset (.jsonl, .txt, .parquet). Without the second, a completion_field naming no field of the file passed lint
and the run stopped at start-up with exit 78 (found by tests/test_fuzz_config.py).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from typing import Any

# The jobs that train on preference pairs (engine/preference.py PREFERENCE_JOBS), mirrored; a test pins them equal
PREFERENCE_JOBS = ("dpo", "reward")
# The fields of a built-in task's records (engine/records.py task_record), mirrored; a test pins them equal
TASK_FIELDS = frozenset({"prompt", "completion"})
# A field whose value lint does not know (a parquet column: only its name is read)
UNKNOWN = object()
# The files the engine reads (engine/records.py LOCAL_SUFFIXES), mirrored; a test pins them equal
DATA_SUFFIXES = (".txt", ".jsonl", ".parquet")
# Lines of a .jsonl file read to find its first record (blank lines are skipped, as the engine skips them)
MAX_BLANK_LINES = 1000


def record_format(ds, fields: Mapping[str, Any]) -> str | None:
    """The format the engine reads a record `fields` as (engine/records.py detect_format), None when 'auto' cannot
    tell."""
    if ds.format != "auto":
        return ds.format
    if ds.chosen_field in fields and ds.rejected_field in fields:
        return "preference"
    if ds.messages_field in fields:
        return "chat"
    if ds.prompt_field in fields and ds.completion_field in fields:
        return "prompt_completion"
    if ds.text_field in fields:
        return "text"
    return None


def format_problem(ds, fields: Mapping[str, Any], source: str) -> tuple[str, str] | None:
    """(key, why) when a record `fields` (name -> value, or UNKNOWN) cannot be read with the dataset `ds`'s format
    and *_field keys, else None. `source` names the record in the message: "task 'x''s records", "data.jsonl:1"."""
    have = ", ".join(repr(f) for f in sorted(fields)) or "no fields"
    fmt = record_format(ds, fields)
    if fmt is None:
        return "format", (
            f"= 'auto' cannot tell the format of {source} (fields {have}) from prompt_field {ds.prompt_field!r}, "
            f"completion_field {ds.completion_field!r}, text_field {ds.text_field!r} and messages_field "
            f"{ds.messages_field!r}; set the *_field keys to the names the records use"
        )
    if fmt == "chat":
        if ds.messages_field in fields:
            value = fields[ds.messages_field]
            if value is UNKNOWN or _is_messages(value):
                return None
            return "messages_field", (
                f"= {ds.messages_field!r}: in {source} it is not a non-empty list of {{role, content}} messages"
            )
        if {"prompt", "completion"} <= fields.keys() or (ds.prompt_field in fields and ds.completion_field in fields):
            return "format", f"= 'chat', but {source} gives prompt/completion records; use 'prompt_completion'"
        return "messages_field", f"= {ds.messages_field!r}: {source} has no such field (it has {have})"
    if fmt == "preference":
        return _preference_problem(ds, fields, source, have)
    wanted = [("text_field", ds.text_field)] if fmt == "text" else [
        ("prompt_field", ds.prompt_field), ("completion_field", ds.completion_field)
    ]  # fmt: skip
    for key, field in wanted:
        if field not in fields:
            return key, f"= {field!r}: {source} has no such field (it has {have})"
        if fields[field] is not UNKNOWN and not isinstance(fields[field], str):
            return key, f"= {field!r}: in {source} it holds a {type(fields[field]).__name__}, not text"
    return None


def _preference_problem(ds, fields: Mapping[str, Any], source: str, have: str) -> tuple[str, str] | None:
    """A preference record's rule (engine/preference.py extract_pair): prompt, chosen and rejected each text or chat
    messages, chosen and rejected different."""
    for key in ("prompt_field", "chosen_field", "rejected_field"):
        name = getattr(ds, key)
        if name not in fields:
            return key, f"= {name!r}: {source} has no such field (it has {have})"
        value = fields[name]
        if value is not UNKNOWN and not isinstance(value, str) and not _is_messages(value):
            return key, f"= {name!r}: in {source} it holds a {type(value).__name__}, not text or chat messages"
    chosen, rejected = fields[ds.chosen_field], fields[ds.rejected_field]
    if chosen is not UNKNOWN and chosen == rejected:
        return (
            "chosen_field",
            f"= {ds.chosen_field!r}: in {source} it equals {ds.rejected_field!r}, so the pair prefers nothing",
        )
    return None


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(m, dict) and all(isinstance(m.get(k), str) for k in ("role", "content")) for m in value)
    )


def first_data_file(expanded: str) -> str | None:
    """The first data file the engine would read of a resolved dataset path (a file, a directory or a glob), in
    sorted order; None when there is none (lint's path rule says why)."""
    if any(ch in expanded for ch in "*?["):
        files = sorted(
            p for p in glob.glob(expanded, recursive=True) if p.endswith(DATA_SUFFIXES) and os.path.isfile(p)
        )
        return files[0] if files else None
    if os.path.isdir(expanded):
        for root, dirs, names in os.walk(expanded):
            dirs.sort()
            for name in sorted(names):
                if name[0] != "." and name.endswith(DATA_SUFFIXES):
                    return os.path.join(root, name)
        return None
    return expanded if os.path.isfile(expanded) and expanded.endswith(DATA_SUFFIXES) else None


def first_record(path: str, text_field: str) -> tuple[str, Mapping[str, Any]] | None:
    """(where, fields) of the first record of the data file `path` (a parquet file's values are UNKNOWN: only its
    schema is read), or None when lint cannot tell cheaply (bad JSON, an empty file, parquet without pyarrow): the
    engine reads the file at start-up and names the line."""
    try:
        if path.endswith(".txt"):
            return f"{path}:1", {text_field: ""}  # a paragraph of plain text, under text_field
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as handle:
                for number, line in enumerate(handle, start=1):
                    if number > MAX_BLANK_LINES:
                        return None
                    if line.strip():
                        record = json.loads(line)
                        return (f"{path}:{number}", record) if isinstance(record, dict) else None
            return None
        import pyarrow.parquet as pq

        return f"{path} row 0", dict.fromkeys(pq.read_schema(path).names, UNKNOWN)
    except (OSError, ValueError, ImportError):  # json's errors and pyarrow's ArrowInvalid are ValueErrors
        return None


# Records of a preference dataset's .jsonl files lint reads looking for a pair the engine would refuse (a missing
# part, chosen equal to rejected); past it the engine checks the rest at start-up, naming the line
MAX_PREFERENCE_RECORDS = 200_000


def data_files(expanded: str) -> list[str]:
    """Every data file the engine reads of a resolved dataset path, in its order (engine/records.py)."""
    if any(ch in expanded for ch in "*?["):
        return sorted(p for p in glob.glob(expanded, recursive=True) if p.endswith(DATA_SUFFIXES) and os.path.isfile(p))
    if os.path.isdir(expanded):
        return sorted(
            os.path.join(root, name)
            for root, _, names in os.walk(expanded)
            for name in names
            if name[0] != "." and name.endswith(DATA_SUFFIXES)
        )
    return [expanded] if os.path.isfile(expanded) and expanded.endswith(DATA_SUFFIXES) else []


def preference_problem(ds, expanded: str) -> tuple[str, str] | None:
    """(key, why) of the first record of a preference dataset's .jsonl files, after the very first one (lint's
    first-record rule judges that), that is not a usable pair: a part missing or of the wrong type, or chosen equal
    to rejected. `why` names the record's file:line. Parquet files are left to the engine."""
    pairs = ds.model_copy(update={"format": "preference"})
    seen = 0
    for path in data_files(expanded):
        if not path.endswith(".jsonl"):
            continue
        try:
            with open(path, encoding="utf-8") as handle:
                for number, line in enumerate(handle, start=1):
                    if not line.strip():
                        continue
                    seen += 1
                    if seen == 1:
                        continue
                    if seen > MAX_PREFERENCE_RECORDS:
                        return None
                    try:
                        record = json.loads(line)
                    except ValueError:
                        return "path", f"= {ds.path!r}: {path}:{number} is not valid JSON"
                    if not isinstance(record, dict):
                        return "path", f"= {ds.path!r}: {path}:{number} is not a JSON object"
                    if found := format_problem(pairs, record, f"{path}:{number}"):
                        return found
        except (OSError, UnicodeDecodeError):
            return None  # the engine names what is wrong with the file
    return None
