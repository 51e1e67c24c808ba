"""Streaming parquet shards (data.streaming): same documents as data.py, rank split, exact resume, bounded memory."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from prime_train.config.schema import DataConfig, DatasetConfig
from prime_train.engine.data import build_train_loader
from prime_train.engine.packing import IGNORE_INDEX, Batch
from prime_train.engine.records import is_held_out, parquet_rows
from prime_train.engine.streaming import StreamingLoader, build_streaming_loader
from prime_train.engine.tokenizer import build_byte_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def write_shards(directory, num_shards: int, per_shard: int, *, kind: str = "prompt_completion") -> str:
    """Parquet shards of unique records, with small row groups so reads cross them."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for shard in range(num_shards):
        rows = []
        for row in range(per_shard):
            tag = f"s{shard}r{row}"
            words = " ".join(rng.choice(["ab", "cde", "fghi", "jk"]) for _ in range(rng.randint(1, 12)))
            if kind == "text":
                rows.append({"text": f"{tag} {words}"})
            else:
                rows.append({"prompt": f"{tag}: {words}?", "completion": words[::-1]})
        table = pa.Table.from_pylist(rows)
        pq.write_table(table, str(directory / f"shard-{shard:03d}.parquet"), row_group_size=97)
    return str(directory)


def config(path: str, **kwargs) -> DataConfig:
    kwargs = {"seq_len": 128, "held_out_fraction": 0.1, "streaming": True, **kwargs}
    return DataConfig(datasets=[DatasetConfig(path=path)], **kwargs)


def streaming(tok, data, *, mbs=4, rank=0, world_size=1, seed=0, buffer=64, job="sft") -> StreamingLoader:
    return build_streaming_loader(
        data,
        tok,
        job=job,
        micro_batch_size=mbs,
        rank=rank,
        world_size=world_size,
        seed=seed,
        device=CPU,
        buffer_documents=buffer,
    )


def documents(batch: Batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(ids, labels) of each document of a batch, padding left out."""
    docs = []
    for ids, labels, pos, pad in zip(batch.input_ids, batch.labels, batch.position_ids, batch.pad_mask, strict=True):
        real = int((~pad).sum())
        starts = [i for i in range(real) if pos[i] == 0] + [real]
        for a, b in itertools.pairwise(starts):
            docs.append((tuple(ids[a:b].tolist()), tuple(labels[a:b].tolist())))
    return docs


def one_epoch(loader) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Documents of the loader's first epoch (micro_batch_size 1, so no batch spans two epochs)."""
    assert loader.micro_batch_size == 1
    docs = []
    while loader.epoch == 0:
        docs += documents(next(loader))
    return docs


def test_one_epoch_streams_the_documents_and_labels_data_py_trains_on(tok, tmp_path):
    path = write_shards(tmp_path / "shards", 2, 300)
    stream_docs = one_epoch(streaming(tok, config(path), mbs=1, buffer=50))
    in_memory = build_train_loader(
        config(path, streaming=False), tok, job="sft", micro_batch_size=1, rank=0, world_size=1, seed=0, device=CPU
    )
    memory_docs = one_epoch(in_memory)
    assert len(stream_docs) > 400
    assert Counter(stream_docs) == Counter(memory_docs)
    # The prompt takes no loss, so every document starts with a run of -100 before its completion's labels.
    for ids, labels in stream_docs:
        assert labels[0] == IGNORE_INDEX and labels[-1] == ids[-1] == tok.eos_token_id


def test_batches_are_well_formed_and_positions_restart_at_each_document(tok, tmp_path):
    path = write_shards(tmp_path / "shards", 2, 200, kind="text")
    loader = streaming(tok, config(path), mbs=3, buffer=40, job="pretrain")
    for _ in range(30):
        batch = next(loader)
        assert batch.input_ids.shape == batch.labels.shape == batch.position_ids.shape == (3, 128)
        assert (batch.labels[batch.pad_mask] == IGNORE_INDEX).all()
        assert (batch.labels[batch.position_ids == 0] == IGNORE_INDEX).all()
        starts = batch.position_ids == 0
        # Pretraining takes loss on every real token except each document's first.
        assert ((batch.labels != IGNORE_INDEX) == (~batch.pad_mask & ~starts)).all()
        follows = batch.position_ids[:, 1:] == batch.position_ids[:, :-1] + 1
        assert (follows | starts[:, 1:]).all()


@pytest.mark.parametrize(("num_shards", "world_size"), [(4, 2), (4, 3)])
def test_ranks_read_disjoint_shares_that_cover_one_epoch(tok, tmp_path, num_shards, world_size):
    path = write_shards(tmp_path / "shards", num_shards, 150)
    whole = Counter(one_epoch(streaming(tok, config(path), mbs=1, buffer=64)))
    shares = [
        Counter(one_epoch(streaming(tok, config(path), mbs=1, rank=r, world_size=world_size, buffer=64)))
        for r in range(world_size)
    ]
    assert all(shares)
    for a in range(world_size):
        for b in range(a + 1, world_size):
            assert not (shares[a] & shares[b])
    assert sum(shares, Counter()) == whole


def test_resume_mid_window_and_across_epoch_boundary_matches_uninterrupted_run(tok, tmp_path):
    path = write_shards(tmp_path / "shards", 3, 60)
    data = config(path)
    uninterrupted = streaming(tok, data, mbs=3, buffer=25)
    states, batches, epochs = [], [], []
    for _ in range(60):
        states.append(json.loads(json.dumps(uninterrupted.state_dict())))
        epochs.append(uninterrupted.epoch)
        batches.append(next(uninterrupted))
    assert epochs[-1] >= 2  # the run crossed epoch boundaries
    boundary = epochs.index(1)
    for split in (1, 7, boundary - 1, boundary, boundary + 1, 45):
        resumed = streaming(tok, data, mbs=3, buffer=25)
        resumed.load_state_dict(states[split])
        assert resumed.epoch == epochs[split]
        for expected in batches[split : split + 12]:
            got = next(resumed)
            assert torch.equal(got.input_ids, expected.input_ids), split
            assert torch.equal(got.labels, expected.labels)
            assert torch.equal(got.position_ids, expected.position_ids)


def test_memory_holds_at_most_one_buffer_of_documents(tok, tmp_path):
    path = write_shards(tmp_path / "shards", 4, 1500, kind="text")
    loader = streaming(tok, config(path), mbs=1, buffer=64)
    docs = one_epoch(loader)
    assert len(docs) > 5000
    assert 0 < loader.max_buffered_documents <= 64
    assert loader._window is not None and len(loader._window.rows.lengths) <= 64


def test_held_out_records_never_stream_and_the_rest_all_do(tok, tmp_path):
    path = write_shards(tmp_path / "shards", 2, 250, kind="text")
    texts = [row["text"] for f in sorted((tmp_path / "shards").iterdir()) for row in pq.read_table(f).to_pylist()]
    held_out = {t for t in texts if is_held_out(t, 0, 0.3)}
    assert 0 < len(held_out) < len(texts)
    seen = {
        tok.decode(list(ids)[:-1]) for ids, _ in one_epoch(streaming(tok, config(path, held_out_fraction=0.3), mbs=1))
    }
    assert not seen & held_out
    assert seen == set(texts) - held_out


def test_data_streaming_dispatches_build_train_loader_to_the_streaming_loader(tok, tmp_path):
    path = write_shards(tmp_path / "shards", 1, 50)
    loader = build_train_loader(
        config(path), tok, job="sft", micro_batch_size=2, rank=0, world_size=1, seed=0, device=CPU
    )
    assert isinstance(loader, StreamingLoader)
    assert next(loader).input_ids.shape == (2, 128)


def test_streaming_a_task_or_non_parquet_is_an_error_naming_data_streaming(tok, tmp_path):
    with pytest.raises(ValueError, match=r"data\.streaming reads parquet shards.*data\.datasets\[0\]\.task"):
        streaming(tok, DataConfig(datasets=[DatasetConfig(task="sorting")], streaming=True))
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match=r"data\.streaming"):
        streaming(tok, config(str(jsonl)))


def _mix(tmp_path, probs):
    a = write_shards(tmp_path / "a", 2, 200, kind="text")
    b = write_shards(tmp_path / "b", 1, 300)  # prompt/completion records: a batch tells where it came from
    return DataConfig(
        datasets=[DatasetConfig(path=a), DatasetConfig(path=b)], sampling_probs=probs, seq_len=128, streaming=True
    )


def test_several_streamed_datasets_are_mixed_by_sampling_probs(tok, tmp_path):
    from prime_train.engine.streaming import MixedStreamingLoader

    loader = streaming(tok, _mix(tmp_path, [0.8, 0.2]), mbs=2, buffer=32)
    assert isinstance(loader, MixedStreamingLoader)
    sources = []
    for _ in range(400):
        batch = next(loader)
        # the prompt/completion records' prompts end in "?"; the text records have none
        text = tok.decode(batch.input_ids[~batch.pad_mask].tolist())
        sources.append(1 if "?" in text else 0)
    assert loader.counts == [sources.count(0), sources.count(1)]
    share = sources.count(0) / len(sources)
    assert 0.74 < share < 0.86, share  # 0.8 within sampling noise (sd 0.02 over 400 draws)
    # ranks draw their own sequences; the same rank and seed draw the same
    again = streaming(tok, _mix(tmp_path, [0.8, 0.2]), mbs=2, buffer=32)
    assert [torch.equal(next(again).input_ids, b) for b in [next(streaming(tok, _mix(tmp_path, [0.8, 0.2]),
            mbs=2, buffer=32)).input_ids]] == [True]  # fmt: skip


def test_a_mixed_stream_resumes_exactly(tok, tmp_path):
    data = _mix(tmp_path, [0.5, 0.5])
    run = streaming(tok, data, mbs=3, buffer=20)
    states, batches = [], []
    for _ in range(80):
        states.append(json.loads(json.dumps(run.state_dict())))
        batches.append(next(run))
    for split in (0, 13, 41, 70):
        resumed = streaming(tok, data, mbs=3, buffer=20)
        resumed.load_state_dict(states[split])
        for expected in batches[split : split + 10]:
            assert torch.equal(next(resumed).input_ids, expected.input_ids), split
    single = streaming(tok, config(data.datasets[0].path), mbs=3, buffer=20)
    with pytest.raises(ValueError, match="mix"):
        streaming(tok, data, mbs=3, buffer=20).load_state_dict(single.state_dict())


@pytest.mark.parametrize("first_row", [0, 5, 97, 100, 250, 290, 291, 299, 300])
def test_reading_a_shard_from_a_row_skips_whole_row_groups_and_yields_the_rest_in_order(tmp_path, first_row):
    path = str(tmp_path / "numbers.parquet")
    pq.write_table(pa.Table.from_pylist([{"x": i} for i in range(300)]), path, row_group_size=97)
    got = list(parquet_rows(path, first_row))
    assert [number for number, _ in got] == [fields["x"] for _, fields in got] == list(range(first_row, 300))


def test_streamed_eval_reads_only_the_held_out_documents_it_needs(tok, tmp_path):
    from prime_train.engine.data import build_eval_batches

    path = write_shards(tmp_path / "shards", 2, 3000)
    # a last shard no reader may reach: every record lacks its completion
    pq.write_table(pa.Table.from_pylist([{"prompt": f"bad {i}"} for i in range(50)]),
                   str(tmp_path / "shards" / "shard-999.parquet"))  # fmt: skip
    common = dict(job="sft", micro_batch_size=4, rank=0, world_size=1, seed=0, max_batches=2)
    batches = build_eval_batches(config(path), tok, **common)
    assert len(batches) == 2 and all(b.input_ids.shape == (4, 128) for b in batches)
    # the in-memory reader reads every held-out record, so it does reach the bad shard
    with pytest.raises(ValueError, match="completion"):
        build_eval_batches(config(path, streaming=False), tok, **common)


def test_the_next_window_is_read_ahead_and_changes_no_batch(tok, tmp_path):
    path = write_shards(tmp_path / "shards", 3, 80)
    ahead = streaming(tok, config(path), mbs=3, buffer=20)
    plain = streaming(tok, config(path), mbs=3, buffer=20)
    plain._pool = None  # read each window when it is needed
    for _ in range(60):  # many windows, across an epoch boundary
        a, b = next(ahead), next(plain)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert ahead._prefetched is not None and ahead._prefetched[0] == ahead._next
    assert plain._prefetched is None
