"""The trainer's tokenized rows kept in the run directory between starts (engine/row_cache.py)."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from prime_train.config.schema import DataConfig, DatasetConfig
from prime_train.engine.data import build_eval_batches, build_train_loader
from prime_train.engine.documents import Encoder
from prime_train.engine.row_cache import RowCache, rows_key
from prime_train.engine.tokenizer import build_byte_tokenizer
from prime_train.rundir import RunDir

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def build(tok, data, run_dir, *, rank=0, world_size=1, node_first=True, cache=True):
    return build_train_loader(
        data, tok, job="sft", micro_batch_size=4, rank=rank, world_size=world_size, seed=0, device=CPU,
        max_steps=20, cache=RowCache(run_dir, node_first=node_first) if cache else None,
    )  # fmt: skip


def batches(loader, n=12):
    return [next(loader) for _ in range(n)]


def same(a, b) -> bool:
    return all(
        torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
        and torch.equal(x.position_ids, y.position_ids) and torch.equal(x.pad_mask, y.pad_mask)
        for x, y in zip(a, b, strict=True)
    )  # fmt: skip


@pytest.fixture
def count_encoding(monkeypatch):
    """How many times documents were tokenized since the fixture was made."""
    calls = []
    real = Encoder.encode

    def counted(self, fmt, contents):
        calls.append(len(contents))
        return real(self, fmt, contents)

    monkeypatch.setattr(Encoder, "encode", counted)
    return calls


def cache_files(run_dir: RunDir) -> list[str]:
    return (
        sorted(n for n in os.listdir(run_dir.cache_dir) if n.endswith(".safetensors"))
        if run_dir.cache_dir.is_dir()
        else []
    )


def write_jsonl(path, n, word="abc") -> str:
    path.write_text("".join(json.dumps({"prompt": f"{word} {i}=", "completion": str(i)}) + "\n" for i in range(n)))
    return str(path)


@pytest.mark.parametrize("curriculum", ["none", "difficulty"])
def test_a_second_start_reads_the_cached_rows_without_tokenizing_and_gets_the_same_batches(
    tok, tmp_path, count_encoding, curriculum
):
    data = DataConfig(datasets=[DatasetConfig(task="arithmetic", num_examples=300)], curriculum=curriculum)
    run_dir = RunDir(tmp_path / "run")
    uncached = batches(build(tok, data, run_dir, cache=False))
    count_encoding.clear()
    first = build(tok, data, run_dir)
    assert count_encoding and len(cache_files(run_dir)) == 1
    count_encoding.clear()
    second = build(tok, data, run_dir)
    assert count_encoding == []  # nothing tokenized
    assert second.stats == first.stats
    assert same(batches(first), uncached) and same(batches(second), uncached)


def test_the_held_out_rows_are_cached_apart_from_the_training_rows_and_give_the_same_eval_batches(
    tok, tmp_path, count_encoding
):
    path = tmp_path / "records.jsonl"
    data = DataConfig(datasets=[DatasetConfig(path=write_jsonl(path, 400))], held_out_fraction=0.1)
    run_dir = RunDir(tmp_path / "run")

    def evals(cache, rank=0):
        return build_eval_batches(
            data, tok, job="sft", micro_batch_size=4, rank=rank, world_size=2, seed=0, max_batches=3,
            cache=RowCache(run_dir, node_first=rank == 0) if cache else None,
        )  # fmt: skip

    uncached = [evals(False, rank) for rank in (0, 1)]
    assert evals(True, rank=1) and cache_files(run_dir) == []  # not the node's first process: it does not write
    assert same(evals(True), uncached[0])
    build(tok, data, run_dir)
    assert [name.split("-")[1] for name in cache_files(run_dir)] == ["all", "eval"]
    count_encoding.clear()
    assert same(evals(True, 0), uncached[0]) and same(evals(True, 1), uncached[1])
    assert count_encoding == []


def test_changed_data_or_config_is_tokenized_again_and_the_old_rows_are_removed(tok, tmp_path, count_encoding):
    path = tmp_path / "records.jsonl"
    data = DataConfig(datasets=[DatasetConfig(path=write_jsonl(path, 200))], held_out_fraction=0.0)
    run_dir = RunDir(tmp_path / "run")
    build(tok, data, run_dir)
    old = cache_files(run_dir)
    write_jsonl(path, 200, word="xyz")  # same size, new content
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 1_000_000))
    count_encoding.clear()
    loader = build(tok, data, run_dir)
    assert count_encoding, "the edited file was not read again"
    assert "xyz" in tok.decode(next(loader).input_ids[0].tolist())
    assert len(cache_files(run_dir)) == 1 and cache_files(run_dir) != old
    count_encoding.clear()
    build(tok, data.model_copy(update={"seq_len": 64}), run_dir)  # a config that packs differently
    assert count_encoding and len(cache_files(run_dir)) == 1


@pytest.mark.parametrize("how", ["rewritten", "replaced"])
def test_new_content_under_the_old_size_and_modification_time_is_tokenized_again(tok, tmp_path, count_encoding, how):
    """`cp -p`, `rsync -t` and `touch -r` put back a file's modification time; size and mtime alone would keep the
    old rows for new records. The change time (which no user call sets) and the inode tell them apart."""
    path = tmp_path / "records.jsonl"
    data = DataConfig(datasets=[DatasetConfig(path=write_jsonl(path, 200))], held_out_fraction=0.0)
    run_dir = RunDir(tmp_path / "run")
    build(tok, data, run_dir)
    before = path.stat()
    if how == "rewritten":  # the same file written in place
        write_jsonl(path, 200, word="xyz")
    else:  # another file renamed over it, as an editor or rsync does
        write_jsonl(tmp_path / "new.jsonl", 200, word="xyz")
        os.replace(tmp_path / "new.jsonl", path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    count_encoding.clear()
    loader = build(tok, data, run_dir)
    assert count_encoding, "the new records were not read"
    assert "xyz" in tok.decode(next(loader).input_ids[0].tolist())


def test_a_write_killed_part_way_leaves_a_temporary_file_the_next_writer_removes_when_an_hour_old(tok, tmp_path):
    data = DataConfig(datasets=[DatasetConfig(task="sorting", num_examples=50)])
    run_dir = RunDir(tmp_path / "run")
    build(tok, data, run_dir)
    (name,) = cache_files(run_dir)
    old, fresh, other = (run_dir.cache_dir / f".{n}.{tag}.tmp" for n, tag in (
        (name, "a" * 12), (name, "b" * 12), (name.replace("rows-all-", "rows-eval-"), "c" * 12)))  # fmt: skip
    for path in (old, fresh, other):
        path.write_bytes(b"half a file")
    hours_ago = os.stat(old).st_mtime - 2 * 3600
    os.utime(old, (hours_ago, hours_ago))
    os.utime(other, (hours_ago, hours_ago))
    build(tok, data.model_copy(update={"seq_len": 64}), run_dir)  # another key: a write
    assert not old.exists() and fresh.exists()  # a peer's write in progress is left alone
    assert other.exists()  # another part's: its own writer's to remove


def test_each_rank_caches_its_own_shards_and_only_a_nodes_first_process_writes_shared_rows(
    tok, tmp_path, count_encoding
):
    folder = tmp_path / "shards"
    folder.mkdir()
    for i in range(2):
        write_jsonl(folder / f"part-{i}.jsonl", 100, word=f"shard{i}")
    sharded = DataConfig(datasets=[DatasetConfig(path=str(folder))], held_out_fraction=0.0)
    run_dir = RunDir(tmp_path / "run")
    for rank in (0, 1):
        build(tok, sharded, run_dir, rank=rank, world_size=2)
    assert [name.split("-")[1] for name in cache_files(run_dir)] == ["rank0", "rank1"]
    count_encoding.clear()
    one = next(build(tok, sharded, run_dir, rank=1, world_size=2))
    assert count_encoding == [] and "shard1" in tok.decode(one.input_ids[0].tolist())

    shared = DataConfig(datasets=[DatasetConfig(task="sorting", num_examples=100)])
    other = RunDir(tmp_path / "other")
    build(tok, shared, other, rank=1, world_size=2, node_first=False)
    assert cache_files(other) == []  # every rank builds the same rows: the node's first process writes them
    build(tok, shared, other, rank=0, world_size=2)
    count_encoding.clear()
    build(tok, shared, other, rank=1, world_size=2, node_first=False)
    assert count_encoding == [] and len(cache_files(other)) == 1


def _damage(run_dir: RunDir, how: str, tmp_path) -> None:
    from safetensors.numpy import load, save

    (path,) = run_dir.cache_dir.iterdir()
    if how == "garbage":
        path.write_bytes(b"\x00not a safetensors file" * 10)
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif how == "ids outside the vocabulary":
        arrays = load(path.read_bytes())
        arrays["ids.0"][0, 0] = 10**6
        path.write_bytes(save(arrays))
    elif how == "another shape":
        arrays = load(path.read_bytes())
        arrays["loss.0"] = arrays["loss.0"][:, :-1].copy()
        path.write_bytes(save(arrays))
    elif how == "a FIFO":
        path.unlink()
        os.mkfifo(path)
    elif how == "a symlink":
        elsewhere = tmp_path / "elsewhere.safetensors"
        os.replace(path, elsewhere)
        path.symlink_to(elsewhere)


@pytest.mark.parametrize(
    "how", ["garbage", "truncated", "ids outside the vocabulary", "another shape", "a symlink", "a FIFO"]
)
def test_a_damaged_or_planted_cache_file_is_said_and_the_rows_are_built_again(
    tok, tmp_path, count_encoding, caplog, how
):
    data = DataConfig(datasets=[DatasetConfig(task="reverse-text", num_examples=200)])
    run_dir = RunDir(tmp_path / "run")
    reference = batches(build(tok, data, run_dir))
    _damage(run_dir, how, tmp_path)
    target = (tmp_path / "elsewhere.safetensors").read_bytes() if how == "a symlink" else None
    count_encoding.clear()
    with caplog.at_level(logging.WARNING, logger="prime_train.engine.data"):
        again = batches(build(tok, data, run_dir))
    assert count_encoding, "the damaged cache was used"
    assert same(again, reference)
    assert any(
        "cached rows" in r.getMessage() and "tokenizing the data again" in r.getMessage() for r in caplog.records
    )
    (path,) = run_dir.cache_dir.iterdir()
    assert not path.is_symlink()  # rewritten whole in place of what was there
    if target is not None:
        assert (tmp_path / "elsewhere.safetensors").read_bytes() == target  # the link's target untouched
    count_encoding.clear()
    build(tok, data, run_dir)
    assert count_encoding == []  # the rewritten file is read back


def test_a_cache_directory_that_leads_out_of_the_run_directory_is_not_written(tok, tmp_path, caplog):
    data = DataConfig(datasets=[DatasetConfig(task="sorting", num_examples=100)])
    run_dir = RunDir(tmp_path / "run")
    run_dir.root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    run_dir.cache_dir.symlink_to(outside)
    with caplog.at_level(logging.WARNING, logger="prime_train.engine.data"):
        next(build(tok, data, run_dir))
    assert list(outside.iterdir()) == []
    assert any("could not cache the tokenized rows" in r.getMessage() for r in caplog.records)


def test_rows_are_not_cached_from_the_hub_or_through_a_tokenizer_whose_ids_are_not_its_backends(tok):
    from transformers import PreTrainedTokenizerFast

    class OwnEncoding(PreTrainedTokenizerFast):
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    task = DataConfig(datasets=[DatasetConfig(task="sorting", num_examples=10)])
    hub = DataConfig(datasets=[DatasetConfig(hub="someone/some-dataset")])
    own = OwnEncoding(tokenizer_object=tok.backend_tokenizer, eos_token=tok.eos_token, pad_token=tok.pad_token)
    place = dict(seed=0, rank=0, world_size=1, shared=True)
    assert rows_key(task, task.datasets, Encoder(tok, "sft"), **place) is not None
    assert rows_key(hub, hub.datasets, Encoder(tok, "sft"), **place) is None
    assert rows_key(task, task.datasets, Encoder(own, "sft"), **place) is None
    # what changes the rows changes the key; what does not, does not
    key = rows_key(task, task.datasets, Encoder(tok, "sft"), **place)
    assert rows_key(task, task.datasets, Encoder(tok, "pretrain"), **place) != key
    assert rows_key(task, task.datasets, Encoder(tok, "sft"), **{**place, "seed": 1}) != key
    workers = task.model_copy(update={"num_workers": 3, "cache_rows": False})
    assert rows_key(workers, task.datasets, Encoder(tok, "sft"), **{**place, "rank": 1, "world_size": 4}) == key


def test_the_key_is_the_same_in_another_process(tok, tmp_path):
    import subprocess
    import sys

    program = """
from prime_train.config.schema import DataConfig, DatasetConfig
from prime_train.engine.documents import Encoder
from prime_train.engine.row_cache import rows_key
from prime_train.engine.tokenizer import build_byte_tokenizer
data = DataConfig(datasets=[DatasetConfig(task="sorting", num_examples=10)])
print(rows_key(data, data.datasets, Encoder(build_byte_tokenizer(), "sft"), seed=0, rank=0, world_size=1,
               shared=True))
"""
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = DataConfig(datasets=[DatasetConfig(task="sorting", num_examples=10)])
    here = rows_key(data, data.datasets, Encoder(tok, "sft"), seed=0, rank=0, world_size=1, shared=True)
    assert done.stdout.strip() == here


def test_the_cache_stores_arrays_only(tok, tmp_path):
    from safetensors.numpy import load

    data = DataConfig(datasets=[DatasetConfig(task="sorting", num_examples=50)], curriculum="length")
    run_dir = RunDir(tmp_path / "run")
    build(tok, data, run_dir)
    (path,) = run_dir.cache_dir.iterdir()
    arrays = load(path.read_bytes())
    assert sorted(arrays) == ["counts.0", "difficulty", "ids.0", "lengths.0", "loss.0", "starts.0"]
    assert arrays["ids.0"].dtype == np.int32 and arrays["loss.0"].dtype == np.bool_


# ---------------------------------------------------------------- preference pairs (dpo, reward)


def _pair_data(tmp_path) -> DataConfig:
    """A built-in task's pairs, and a file of string and chat pairs, two of them cut by seq_len."""
    chat = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "?"},
    ]
    records = [
        {"prompt": f"q{i} " * (30 if i < 2 else 1), "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(40)
    ]
    records += [
        {"prompt": chat, "chosen": [{"role": "assistant", "content": f"a{i}"}], "rejected": f"b{i}"} for i in range(20)
    ]
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return DataConfig(
        seq_len=64, held_out_fraction=0.2,
        datasets=[DatasetConfig(task="arithmetic", num_examples=200), DatasetConfig(path=str(path))],
    )  # fmt: skip


def _pairs(tok, data, run_dir, *, cache=True):
    from prime_train.engine.preference import build_eval_pairs, build_pair_loader

    store = RowCache(run_dir, node_first=True) if cache else None
    common = dict(micro_batch_size=4, rank=0, world_size=1, seed=0)
    loader = build_pair_loader(data, tok, device=CPU, cache=store, **common)
    evals = build_eval_pairs(data, tok, max_batches=3, cache=store, **common)
    return loader, evals


def _same_pairs(a, b) -> bool:
    return all(
        torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
        and torch.equal(x.pad_mask, y.pad_mask) for x, y in zip(a, b, strict=True)
    )  # fmt: skip


def test_preference_pairs_are_cached_and_a_second_start_reads_them_without_tokenizing(tok, tmp_path, monkeypatch):
    from prime_train.engine.preference import PairEncoder

    calls = []
    real = PairEncoder.encode
    monkeypatch.setattr(PairEncoder, "encode", lambda self, pairs: calls.append(len(pairs)) or real(self, pairs))
    data = _pair_data(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    plain_loader, plain_evals = _pairs(tok, data, run_dir, cache=False)
    assert plain_loader.rows.stats.num_truncated_tokens > 0  # the long prompts were cut
    first_loader, _ = _pairs(tok, data, run_dir)
    assert [n.split("-")[1] for n in cache_files(run_dir)] == ["pairs", "pairs"]  # training, held-out (pairs-eval)
    assert any("pairs-eval" in n for n in cache_files(run_dir))
    calls.clear()
    loader, evals = _pairs(tok, data, run_dir)
    assert calls == [], "a second start tokenized its pairs again"
    assert loader.rows.digest() == plain_loader.rows.digest() == first_loader.rows.digest()
    assert loader.rows.stats == plain_loader.rows.stats
    assert _same_pairs([next(loader) for _ in range(10)], [next(plain_loader) for _ in range(10)])
    assert len(evals) == len(plain_evals) == 3 and _same_pairs(evals, plain_evals)
    # another seq_len is other pairs: tokenized again, and the old files go
    calls.clear()
    _pairs(tok, data.model_copy(update={"seq_len": 48}), run_dir)
    assert calls and len(cache_files(run_dir)) == 2


@pytest.mark.parametrize("how", ["ids outside the vocabulary", "lengths that do not add up", "an array too many"])
def test_damaged_cached_pairs_are_said_and_tokenized_again(tok, tmp_path, caplog, how):
    from safetensors.numpy import load, save

    data = _pair_data(tmp_path)
    run_dir = RunDir(tmp_path / "run")
    reference, _ = _pairs(tok, data, run_dir)
    [path] = [run_dir.cache_dir / n for n in cache_files(run_dir) if n.startswith("rows-pairs-") and "eval" not in n]
    arrays = load(path.read_bytes())
    if how == "ids outside the vocabulary":
        arrays["ids"][3] = len(tok) + 5
    elif how == "lengths that do not add up":
        arrays["lengths"][0] += 1
    else:
        arrays["extra"] = np.zeros(3, dtype=np.int64)
    path.write_bytes(save(arrays))
    with caplog.at_level(logging.WARNING, logger="prime_train.engine.data"):
        loader, _ = _pairs(tok, data, run_dir)
    assert any(f"cached rows {path}" in r.getMessage() and "tokenizing the data again" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert loader.rows.digest() == reference.rows.digest()
    assert "extra" not in load(path.read_bytes())  # rewritten as it should be


def test_the_rows_read_back_alike_where_the_system_cannot_name_the_open_file(tok, tmp_path, monkeypatch):
    """Linux maps the opened file through /proc/self/fd; elsewhere (macOS) the same descriptor is read whole."""
    import prime_train.engine.row_cache as row_cache

    data = DataConfig(datasets=[DatasetConfig(task="sorting", num_examples=100)])
    run_dir = RunDir(tmp_path / "run")
    reference = batches(build(tok, data, run_dir))
    (path,) = run_dir.cache_dir.iterdir()
    mapped = RowCache(run_dir, node_first=True).load("all", path.name.split("-")[2].split(".")[0])
    real_exists = os.path.exists
    monkeypatch.setattr(row_cache.os.path, "exists", lambda p: False if str(p).startswith("/proc/") else real_exists(p))
    read = RowCache(run_dir, node_first=True).load("all", path.name.split("-")[2].split(".")[0])
    assert mapped is not None and read is not None and mapped.keys() == read.keys()
    assert all(np.array_equal(mapped[k], read[k]) for k in mapped)
    assert same(batches(build(tok, data, run_dir)), reference)
