"""lint reads the first record of a local dataset and judges its format and *_field keys as the engine will."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from prime_train.config.schema import DatasetConfig
from prime_train.engine.records import LOCAL_SUFFIXES, Record, detect_format, extract
from prime_train.validator import data_fields
from prime_train.validator.lint import lint_files

REPO = Path(__file__).resolve().parents[1]

RECORDS = [
    {"prompt": "p", "completion": "c"},
    {"question": "q", "answer": "a"},
    {"text": "t"},
    {"messages": [{"role": "user", "content": "hi"}]},
    {"prompt": "p", "completion": "c", "text": "t"},
    {"body": "b"},
    {},
    {"prompt": 1, "completion": "c"},
    {"text": None},
    {"messages": []},
    {"messages": [{"role": "user"}]},
]
KEYS = [
    {},
    {"format": "prompt_completion"},
    {"format": "text"},
    {"format": "chat"},
    {"prompt_field": "question", "completion_field": "answer"},
    {"format": "prompt_completion", "completion_field": "answer"},
    {"text_field": "body"},
    {"format": "text", "text_field": "body"},
    {"messages_field": "conversation"},
    {"format": "chat", "messages_field": "text"},
]


def _engine_accepts(ds: DatasetConfig, fields: dict) -> bool:
    from prime_train.engine.metrics import EngineConfigError

    try:
        extract(ds, 0, detect_format(ds, 0, Record(fields, "x:1")), Record(fields, "x:1"))
    except EngineConfigError:
        return False
    return True


@pytest.mark.parametrize(("keys", "record"), list(itertools.product(KEYS, RECORDS)))
def test_lint_and_the_engine_judge_every_format_and_field_key_alike(keys, record):
    """The mirror is pinned: the validator may not import the engine, so both rules meet here, over every format
    and a spread of records, including ones that fit none."""
    ds = DatasetConfig(path="x.jsonl", **keys)
    engine_ok = _engine_accepts(ds, record)
    lint_ok = data_fields.format_problem(ds, record, "x.jsonl:1") is None
    assert lint_ok == engine_ok, (keys, record)


def test_the_mirrored_constants_are_the_engines():
    assert data_fields.DATA_SUFFIXES == LOCAL_SUFFIXES


def _config(tmp_path: Path, data: str, dataset: str) -> Path:
    cfg = tmp_path / "run.toml"
    cfg.write_text(f"[[data.datasets]]\npath = {data!r}\n{dataset}\n")
    return cfg


def test_a_completion_field_the_jsonl_records_lack_is_a_lint_error_naming_the_file_and_line(tmp_path, monkeypatch):
    """The fuzz test's case: a completion_field of "\\x1b[31mred" passed lint, and the run stopped with exit 78 at
    start-up. lint now says so in a second, naming the key, the file's first record and the fields it has; the
    escape sequence is shown escaped, never sent to the terminal."""
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("\n" + json.dumps({"prompt": "Spell out 1: ", "completion": "one"}) + "\n")
    cfg = _config(tmp_path, str(data), 'format = "prompt_completion"\ncompletion_field = "\\u001b[31mred"')
    problems, _ = lint_files([str(cfg)])
    assert [(p.key, p.severity) for p in problems] == [("data.datasets[0].completion_field", "error")], problems
    message = problems[0].message
    assert f"{data}:2 has no such field" in message and "'completion', 'prompt'" in message
    assert "\x1b" not in message and "\\x1b[31mred" in message
    cfg.write_text(cfg.read_text().replace('"\\u001b[31mred"', '"completion"'))
    assert lint_files([str(cfg)])[0] == []


def test_auto_format_with_no_field_it_knows_names_the_format_key_and_the_fields_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "shards").mkdir()
    for name in ("b.jsonl", "a.jsonl"):  # the first file in sorted order is the one read
        fields = {"question": "q", "answer": "a"} if name == "a.jsonl" else {"prompt": "p", "completion": "c"}
        (tmp_path / "shards" / name).write_text(json.dumps(fields) + "\n")
    problems, _ = lint_files([str(_config(tmp_path, "shards", ""))])
    assert [p.key for p in problems] == ["data.datasets[0].format"], problems
    assert "a.jsonl:1" in problems[0].message and "'answer', 'question'" in problems[0].message
    fixed = _config(tmp_path, "shards", 'prompt_field = "question"\ncompletion_field = "answer"')
    assert lint_files([str(fixed)])[0] == []


def test_a_parquet_dataset_is_judged_by_its_schema(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.table({"content": ["some text"]}), tmp_path / "d.parquet")
    problems, _ = lint_files([str(_config(tmp_path, "d.parquet", 'format = "text"'))])
    assert [p.key for p in problems] == ["data.datasets[0].text_field"], problems
    assert "'content'" in problems[0].message
    assert lint_files([str(_config(tmp_path, "d.parquet", 'text_field = "content"'))])[0] == []


def test_what_lint_cannot_read_cheaply_is_left_to_the_engine(tmp_path, monkeypatch):
    """A line that is not JSON, or not an object, is the engine's to name at start-up (with its line): lint adds
    no second, vaguer error about the fields."""
    monkeypatch.chdir(tmp_path)
    for body in ("{not json\n", "[1, 2]\n", ""):
        (tmp_path / "d.jsonl").write_text(body)
        assert lint_files([str(_config(tmp_path, "d.jsonl", 'format = "text"'))])[0] == [], body


def test_the_shipped_jsonl_example_lints_clean(monkeypatch):
    monkeypatch.chdir(REPO)
    assert lint_files([str(REPO / "configs" / "examples" / "sft-jsonl.toml")])[0] == []
