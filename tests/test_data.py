"""The data pipeline: sources, formats, packing, masking, sharding, mixing, held-out split and resume."""

from __future__ import annotations

import itertools
import json
import logging
import math
import random
from collections import Counter

import pytest
import torch

from prime_train.config.schema import DataConfig, DatasetConfig
from prime_train.engine.data import build_eval_batches, build_train_loader, encode_prompt, held_out_examples
from prime_train.engine.packing import IGNORE_INDEX, Batch, pack_best_fit
from prime_train.engine.tokenizer import build_byte_tokenizer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def loader(tok, data: DataConfig, *, job="sft", mbs=4, rank=0, world_size=1, seed=0):
    return build_train_loader(
        data, tok, job=job, micro_batch_size=mbs, rank=rank, world_size=world_size, seed=seed, device=CPU
    )


def task_data(n=400, task="arithmetic", **kwargs) -> DataConfig:
    return DataConfig(datasets=[DatasetConfig(task=task, num_examples=n)], **kwargs)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def documents(batch: Batch, tok) -> list[str]:
    """The decoded documents of a batch (each ending with its eos), padding left out."""
    docs = []
    for ids, pos, pad in zip(batch.input_ids, batch.position_ids, batch.pad_mask, strict=True):
        real = int((~pad).sum())
        starts = [i for i in range(real) if pos[i] == 0] + [real]
        docs += [tok.decode(ids[a:b].tolist()) for a, b in itertools.pairwise(starts)]
    return docs


def one_epoch(train_loader, tok) -> list[str]:
    """Every document of the loader's next epoch, read one row at a time."""
    assert train_loader.micro_batch_size == 1
    rows = train_loader.state_dict()["rank_sequences"]
    return [doc for _ in range(rows) for doc in documents(next(train_loader), tok)]


def same_batches(a: list[Batch], b: list[Batch]) -> bool:
    return all(
        torch.equal(x.input_ids, y.input_ids)
        and torch.equal(x.labels, y.labels)
        and torch.equal(x.position_ids, y.position_ids)
        for x, y in zip(a, b, strict=True)
    )


# ---- packing --------------------------------------------------------------------------------------------------


def test_best_fit_puts_every_document_in_one_bin_within_capacity():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(2000)] + [150, 300]
    bins = pack_best_fit(lengths, 128)
    placed = sorted(i for b in bins for i in b)
    assert placed == list(range(len(lengths)))
    loads = [sum(min(lengths[i], 128) for i in b) for b in bins]
    assert max(loads) <= 128
    # any best-fit packing leaves at most one bin at most half full (else its items would have fit earlier)
    assert sum(load <= 64 for load in loads) <= 1
    assert len(bins) <= math.ceil(sum(min(n, 128) for n in lengths) / 128) * 1.05 + 1


def test_default_data_packs_above_97_percent_without_truncation(tok, caplog):
    caplog.set_level(logging.INFO, logger="prime_train.engine.data")
    train = loader(tok, DataConfig(), mbs=16, seed=1234)
    # arithmetic documents are 6-10 tokens: best fit fills 128-token rows nearly exactly (measured 99.1%)
    assert train.stats.efficiency > 0.97
    assert train.stats.num_truncated_tokens == 0
    summary = [r.getMessage() for r in caplog.records if r.name == "prime_train.engine.data"]
    assert len(summary) == 1
    assert "documents" in summary[0] and "truncated tokens" in summary[0] and "packing efficiency" in summary[0]


def test_one_document_a_row_is_explained_when_no_two_fit(tok, tmp_path):
    # the trial: "391 documents, 391 sequences, packing efficiency 55.7%" with packing on, and no word why
    records = [{"prompt": f"Spell out {n}: ", "completion": "x" * 40} for n in range(100, 140)]
    data = DataConfig(seq_len=96, held_out_fraction=0.0, datasets=[
        DatasetConfig(path=write_jsonl(tmp_path / "d.jsonl", records), format="prompt_completion")])  # fmt: skip
    stats = loader(tok, data).stats
    assert stats.num_sequences == stats.num_documents == 40 and stats.efficiency < 0.7
    line = stats.describe()
    assert "one document a row, as they average 56 tokens, over half of data.seq_len = 96" in line, line
    # documents that share rows are not explained away
    assert "one document a row" not in loader(tok, DataConfig(), mbs=16, seed=1234).stats.describe()


def test_documents_are_never_split_across_rows(tok):
    train = loader(tok, task_data(300), mbs=1)
    docs = one_epoch(train, tok)
    assert len(docs) == train.stats.num_documents
    assert all(doc.count("=") == 1 and doc.endswith("<|eos|>") and doc.count("<|eos|>") == 1 for doc in docs)


def test_a_document_longer_than_seq_len_is_truncated_and_counted(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"text": "x" * 50}, {"text": "short"}])
    train = loader(tok, DataConfig(datasets=[DatasetConfig(path=path)], seq_len=16, held_out_fraction=0.0), mbs=1)
    assert train.stats.num_truncated_tokens == 51 - 16  # 50 bytes + eos
    docs = one_epoch(train, tok)
    assert sorted(docs) == sorted(["x" * 16, "short<|eos|>"])


def test_without_packing_each_row_holds_one_padded_document(tok):
    train = loader(tok, task_data(100, packing=False), mbs=8)
    batch = next(train)
    for ids, pos, pad in zip(batch.input_ids, batch.position_ids, batch.pad_mask, strict=True):
        real = int((~pad).sum())
        assert pos[:real].tolist() == list(range(real))
        assert ids[real - 1] == tok.eos_token_id and (ids[real:] == tok.pad_token_id).all()
    assert batch.num_tokens == int((~batch.pad_mask).sum()) < batch.input_ids.numel()


# ---- labels and positions ---------------------------------------------------------------------------------------


def test_sft_labels_only_the_completion_and_eos(tok):
    batch = next(loader(tok, task_data(200), job="sft", mbs=2))
    for ids, labels, pos, pad in zip(batch.input_ids, batch.labels, batch.position_ids, batch.pad_mask, strict=True):
        real = int((~pad).sum())
        assert (labels[real:] == IGNORE_INDEX).all()
        starts = [i for i in range(real) if pos[i] == 0] + [real]
        for a, b in itertools.pairwise(starts):
            text = tok.decode(ids[a:b].tolist())
            prompt_len = text.index("=") + 1
            assert (labels[a : a + prompt_len] == IGNORE_INDEX).all()
            assert labels[a + prompt_len : b].tolist() == ids[a + prompt_len : b].tolist()
            assert labels[b - 1] == tok.eos_token_id
    assert batch.num_loss_tokens == int((batch.labels != IGNORE_INDEX).sum())


def test_pretrain_labels_every_token_but_document_starts_and_padding(tok):
    batch = next(loader(tok, task_data(200), job="pretrain", mbs=2))
    expected = torch.where((batch.position_ids == 0) | batch.pad_mask, IGNORE_INDEX, batch.input_ids)
    assert torch.equal(batch.labels, expected)


def test_position_ids_restart_at_zero_at_each_document(tok):
    batch = next(loader(tok, task_data(200), mbs=2))
    for ids, pos, pad in zip(batch.input_ids, batch.position_ids, batch.pad_mask, strict=True):
        real = int((~pad).sum())
        eos_at = [i for i in range(real) if ids[i] == tok.eos_token_id]
        assert [i for i in range(real) if pos[i] == 0] == [0, *[i + 1 for i in eos_at[:-1]]]
        assert all(pos[i] == pos[i - 1] + 1 for i in range(1, real) if pos[i] != 0)
        # padding is its own segment, positions from 0, so no document attends to it
        assert pos[real:].tolist() == list(range(len(pos) - real))


def test_a_packed_row_gives_each_document_the_logits_it_gets_alone(tok):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.masking_utils import find_packed_sequence_indices

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128
    )
    model = LlamaForCausalLM(config).eval()
    batch = next(loader(tok, task_data(300, task="reverse-text"), mbs=2))
    segments = find_packed_sequence_indices(batch.position_ids)
    assert segments is not None and int(segments[0, -1]) >= 3  # transformers sees several documents
    with torch.no_grad():
        # use_cache=False: with a cache transformers skips packed-sequence detection and documents see each other
        packed = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
        for row in range(2):
            real = int((~batch.pad_mask[row]).sum())
            starts = [i for i in range(real) if batch.position_ids[row, i] == 0] + [real]
            for a, b in itertools.pairwise(starts):
                alone = model(input_ids=batch.input_ids[row : row + 1, a:b], use_cache=False).logits[0]
                torch.testing.assert_close(packed[row, a:b], alone, atol=1e-5, rtol=0)


def test_rows_of_one_document_each_attend_plainly_causally_and_get_the_document_masks_logits(tok):
    from transformers import LlamaConfig

    from prime_train.engine import llama

    packed = next(loader(tok, task_data(300, task="reverse-text"), mbs=2))
    assert not packed.causal and packed.positions is packed.position_ids  # several documents a row
    batch = next(loader(tok, task_data(300, task="reverse-text", packing=False), mbs=4))
    assert batch.causal and batch.positions is None  # one document a row, then padding
    assert batch.to(CPU).causal
    config = LlamaConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=128)  # fmt: skip
    torch.manual_seed(0)
    model = llama.from_config(config, max_seq_len=128).eval()
    with torch.no_grad():
        masked = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        plain = model(input_ids=batch.input_ids, position_ids=batch.positions).logits
    real = ~batch.pad_mask
    torch.testing.assert_close(plain[real], masked[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("job", ["pretrain", "sft"])
def test_document_masking_off_makes_each_row_one_stream_that_predicts_every_documents_first_token(tok, job):
    masked = next(loader(tok, task_data(200), job=job, mbs=2))
    batch = next(loader(tok, task_data(200, document_masking=False), job=job, mbs=2))
    assert torch.equal(batch.input_ids, masked.input_ids)  # the same rows, packed the same way
    assert batch.causal and not masked.causal
    for pos, pad in zip(batch.position_ids, batch.pad_mask, strict=True):
        real = int((~pad).sum())
        assert pos[:real].tolist() == list(range(real))
    starts = (masked.position_ids == 0) & ~masked.pad_mask
    starts[:, 0] = False  # a row's own first token has nothing before it either way
    if job == "pretrain":
        assert torch.equal(batch.labels[starts], batch.input_ids[starts])  # predicted from the document before
    assert (masked.labels[starts] == IGNORE_INDEX).all()
    assert torch.equal(batch.labels[~starts], masked.labels[~starts])


# ---- sources and formats ----------------------------------------------------------------------------------------


def test_jsonl_line_with_bad_json_is_reported_with_file_and_line(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "also ok"}\n{"text": broken}\n')
    with pytest.raises(ValueError, match=rf"{path}:4: not valid JSON"):
        loader(tok, DataConfig(datasets=[DatasetConfig(path=str(path))]))


def test_jsonl_record_missing_a_field_names_file_line_and_field(tok, tmp_path):
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}] * 3 + [{"prompt": "c"}])
    with pytest.raises(ValueError, match=rf"{path}:4: record has no field 'completion'.*completion_field"):
        loader(tok, DataConfig(datasets=[DatasetConfig(path=path)]))


def test_parquet_prompt_completion_source_trains_and_bad_rows_name_the_row(tok, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    good = tmp_path / "good.parquet"
    rows = [{"question": f"q{i}?", "response": f"a{i}"} for i in range(40)]
    pq.write_table(pa.Table.from_pylist(rows), good)
    ds = DatasetConfig(path=str(good), prompt_field="question", completion_field="response")
    train = loader(tok, DataConfig(datasets=[ds], held_out_fraction=0.0), mbs=1)
    assert sorted(one_epoch(train, tok)) == sorted(f"q{i}?a{i}<|eos|>" for i in range(40))

    bad = tmp_path / "bad.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"question": "q", "response": "a"}, {"question": "q2", "response": None}]), bad
    )
    ds = DatasetConfig(path=str(bad), prompt_field="question", completion_field="response")
    with pytest.raises(ValueError, match=rf"{bad} row 1: field 'response' must be a string"):
        loader(tok, DataConfig(datasets=[ds]))


def test_txt_source_gives_one_document_per_paragraph(tok, tmp_path):
    (tmp_path / "a.txt").write_text("first para\nstill first\n\n\nsecond para\n")
    (tmp_path / "b.txt").write_text("a file without blank lines\nis one document")
    data = DataConfig(datasets=[DatasetConfig(path=str(tmp_path))], held_out_fraction=0.0)
    docs = one_epoch(loader(tok, data, job="pretrain", mbs=1), tok)
    assert sorted(docs) == sorted(
        [
            "first para\nstill first<|eos|>",
            "second para<|eos|>",
            "a file without blank lines\nis one document<|eos|>",
        ]
    )


def test_auto_format_that_cannot_be_detected_asks_for_the_format_key(tok, tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl", [{"body": "hello"}])
    with pytest.raises(ValueError, match=r"x\.jsonl:1: cannot tell the record format.*data\.datasets\[0\]\.format"):
        loader(tok, DataConfig(datasets=[DatasetConfig(path=path)]))


def test_missing_path_names_the_config_key(tok, tmp_path):
    with pytest.raises(ValueError, match=r"data\.datasets\[0\]\.path = .*no such file or directory"):
        loader(tok, DataConfig(datasets=[DatasetConfig(path=str(tmp_path / "nope.jsonl"))]))


def test_chat_records_take_loss_on_assistant_turns_only(tok, tmp_path):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    data = DataConfig(datasets=[DatasetConfig(path=path)], held_out_fraction=0.0)
    batch = next(loader(tok, data, job="sft", mbs=1))
    real = int((~batch.pad_mask[0]).sum())
    ids, labels = batch.input_ids[0, :real], batch.labels[0, :real]
    assert tok.decode(ids.tolist()) == tok.apply_chat_template(messages, tokenize=False) + "<|eos|>"
    trained = "".join(tok.decode([int(t)]) for t, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX)
    assert trained == "hello<|im_end|>\nciao<|im_end|>\n<|eos|>"


def test_hub_source_without_the_datasets_package_says_what_it_needs(tok, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as on an install without it
    with pytest.raises(ValueError, match=r"data\.datasets\[0\]\.hub = 'org/set'.*pip install datasets.*network"):
        loader(tok, DataConfig(datasets=[DatasetConfig(hub="org/set")]))


def test_hub_stream_gives_each_rank_its_own_records(tok, tmp_path, caplog):
    pytest.importorskip("datasets")
    # a local folder stands in for a hub id: datasets streams it the same way, offline
    for shard in range(3):
        write_jsonl(tmp_path / f"part-{shard}.jsonl", [{"text": f"shard {shard} doc {i}"} for i in range(30)])
    data = DataConfig(datasets=[DatasetConfig(hub=str(tmp_path))], held_out_fraction=0.0)
    caplog.set_level(logging.WARNING, logger="prime_train.engine.records")
    shards = [set(one_epoch(loader(tok, data, mbs=1, rank=r, world_size=2), tok)) for r in range(2)]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == 90
    assert any("3 shards, which 2 ranks do not divide" in r.getMessage() for r in caplog.records)


def test_documents_start_with_the_bos_a_tokenizer_adds_and_prompts_encode_the_same(tok):
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = build_byte_tokenizer().backend_tokenizer
    backend.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 257)])
    with_bos = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>"
    )
    batch = next(loader(with_bos, task_data(50, held_out_fraction=0.0), mbs=1))
    doc = documents(batch, with_bos)[0]
    prompt = doc.removeprefix("<|bos|>").split("=")[0] + "="
    assert doc.startswith("<|bos|>") and doc.count("<|bos|>") == 1
    assert encode_prompt(with_bos, prompt) == [257, *prompt.encode()]
    assert batch.input_ids[0, : len(prompt) + 1].tolist() == encode_prompt(with_bos, prompt)
    assert encode_prompt(tok, prompt) == list(prompt.encode())  # the byte tokenizer adds nothing


def test_documents_tokenize_through_the_fast_backend_to_exactly_the_ids_the_tokenizer_call_gives():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from prime_train.engine.documents import Encoder

    texts = ["reverse hello=olleh", "caf\u00e9 \u2603 <|eos|> tail", "", "  two  spaces", "12+34=46<|pad|>"] * 3
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    special = ["<|eos|>", "<|pad|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(texts * 10, trainer)
    split = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|eos|>", pad_token="<|pad|>", split_special_tokens=True
    )

    class OwnEncoding(PreTrainedTokenizerFast):
        def _encode_plus(self, *args, **kwargs):
            return super()._encode_plus(*args, **kwargs)

    own = OwnEncoding(tokenizer_object=Tokenizer.from_str(bpe.to_str()), eos_token="<|eos|>", pad_token="<|pad|>")
    for name, tokenizer, fast in (("byte", build_byte_tokenizer(), True), ("bpe, special tokens split", split, True),
                                  ("a subclass's own encoding", own, False)):  # fmt: skip
        encoder = Encoder(tokenizer, "sft")
        assert (encoder._backend() is not None) == fast, name
        assert encoder._encode(texts) == tokenizer(texts, add_special_tokens=False)["input_ids"], name
    # the special token is one id unless the tokenizer splits it
    assert Encoder(split, "sft")._encode(["<|eos|>"]) != [[split.eos_token_id]]
    # a backend left truncating by someone else's call is not used: the ids stay whole, as the tokenizer's call gives
    encoder = Encoder(split, "sft")
    split.backend_tokenizer.enable_truncation(2)
    assert encoder._backend() is None
    assert encoder._encode(texts) == split(texts, add_special_tokens=False)["input_ids"]
    assert max(map(len, encoder._encode(texts))) > 2


def test_sampling_probs_must_match_the_datasets(tok):
    two = [DatasetConfig(task="arithmetic", num_examples=50), DatasetConfig(task="sorting", num_examples=50)]
    with pytest.raises(ValueError, match=r"data\.sampling_probs has 1 values for 2 datasets"):
        loader(tok, DataConfig(datasets=two, sampling_probs=[1.0]))
    with pytest.raises(ValueError, match=r"data\.sampling_probs .* sum to 1"):
        loader(tok, DataConfig(datasets=two, sampling_probs=[0.5, 0.6]))


# ---- held-out split -----------------------------------------------------------------------------------------------


def test_held_out_documents_never_appear_in_training(tok):
    data = task_data(3000, held_out_fraction=0.1)
    train_docs = set(one_epoch(loader(tok, data, mbs=1, seed=5), tok))
    held_out = held_out_examples(data, seed=5, n=1000)
    assert len(held_out) > 10 and len({e.prompt for e in held_out}) == len(held_out)
    assert not {f"{e.prompt}{e.answer}<|eos|>" for e in held_out} & train_docs
    eval_docs = {d for b in build_eval_batches(data, tok, job="sft", micro_batch_size=4, rank=0, world_size=1,
                                               seed=5, max_batches=100) for d in documents(b, tok)}  # fmt: skip
    assert eval_docs and not eval_docs & train_docs
    assert {f"{e.prompt}{e.answer}<|eos|>" for e in held_out} == eval_docs


@pytest.mark.parametrize("n", [1, 5, 64, 10_000])
def test_the_exact_match_examples_are_the_first_n_of_all_held_out_ones_interleaved(n):
    """held_out_examples stops generating a dataset once it has n of them: the same examples as taking n of all."""
    from prime_train import tasks
    from prime_train.engine.records import is_held_out, task_record

    sizes = {"arithmetic": 3000, "sorting": 400, "reverse-text": 1500}
    data = DataConfig(datasets=[DatasetConfig(task=t, num_examples=k) for t, k in sizes.items()], held_out_fraction=0.1)
    groups = []
    for task, k in sizes.items():  # every held-out example of each, as the whole list was built before
        seen, kept = set(), []
        for ex in tasks.generate_examples(task, k, 2):
            record = task_record(ex)
            if ex.prompt not in seen and is_held_out((record["prompt"], record["completion"]), 2, 0.1):
                seen.add(ex.prompt)
                kept.append(ex)
        groups.append(kept)
    everything = [g[i] for i in range(max(map(len, groups))) for g in groups if i < len(g)]
    assert held_out_examples(data, 2, n) == everything[:n]


def test_eval_batches_are_fixed_and_as_many_on_every_rank(tok):
    data = task_data(2000)
    kwargs = dict(job="sft", micro_batch_size=4, world_size=3, seed=1, max_batches=5)
    per_rank = [build_eval_batches(data, tok, rank=r, **kwargs) for r in range(3)]
    assert len({len(b) for b in per_rank}) == 1 and len(per_rank[0]) >= 1
    assert same_batches(per_rank[1], build_eval_batches(data, tok, rank=1, **kwargs))
    assert build_eval_batches(task_data(200, held_out_fraction=0.0), tok, rank=0, **kwargs) == []


# ---- sharding, epochs, mixing ------------------------------------------------------------------------------------


def test_rank_shards_are_disjoint_and_cover_every_training_document(tok, tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": f"document number {i}"} for i in range(300)])
    data = DataConfig(datasets=[DatasetConfig(path=path)], held_out_fraction=0.1)
    shards = [one_epoch(loader(tok, data, mbs=1, rank=r, world_size=3), tok) for r in range(3)]
    everything = [d for shard in shards for d in shard]
    assert len(everything) == len(set(everything))
    single = set(one_epoch(loader(tok, data, mbs=1, world_size=1), tok))
    assert set(everything) == single and 250 < len(single) < 300
    assert all(len(shard) > 80 for shard in shards)


def test_whole_files_go_to_ranks_when_the_file_count_divides_the_world_size(tok, tmp_path, caplog):
    for f in range(4):
        write_jsonl(tmp_path / f"part-{f}.jsonl", [{"text": f"file {f} doc {i}"} for i in range(20)])
    data = DataConfig(datasets=[DatasetConfig(path=str(tmp_path / "*.jsonl"))], held_out_fraction=0.0)
    shards = [one_epoch(loader(tok, data, mbs=1, rank=r, world_size=2), tok) for r in range(2)]
    assert {d.split()[1] for d in shards[0]} == {"0", "2"} and {d.split()[1] for d in shards[1]} == {"1", "3"}

    # three files over two ranks: a warning, then every rank reads every file and keeps alternate records
    (tmp_path / "part-3.jsonl").unlink()
    caplog.set_level(logging.WARNING, logger="prime_train.engine.records")
    shards = [one_epoch(loader(tok, data, mbs=1, rank=r, world_size=2), tok) for r in range(2)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "3 files, which 2 ranks do not divide" in warnings[0].getMessage()
    assert not set(shards[0]) & set(shards[1]) and len(shards[0]) + len(shards[1]) == 60
    assert {d.split()[1] for d in shards[0]} == {"0", "1", "2"}


def test_each_epoch_reads_the_same_rows_in_a_new_order(tok):
    train = loader(tok, task_data(600), mbs=1)
    first = [next(train).input_ids for _ in range(train.state_dict()["num_sequences"])]
    assert train.epoch == 1
    second = [next(train).input_ids for _ in range(len(first))]
    key = lambda rows: sorted(tuple(r.flatten().tolist()) for r in rows)  # noqa: E731
    assert key(first) == key(second)
    assert [r.tolist() for r in first] != [r.tolist() for r in second]


def test_sampling_probs_set_each_datasets_share_of_sequences(tok, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"text": f"A{i:03d}" + "a" * 20} for i in range(200)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"text": f"B{i:03d}" + "b" * 20} for i in range(200)])
    data = DataConfig(
        datasets=[DatasetConfig(path=a), DatasetConfig(path=b)], sampling_probs=[0.8, 0.2], seq_len=32,
        held_out_fraction=0.0,
    )  # fmt: skip
    train = loader(tok, data, mbs=1)
    rows = train.state_dict()["num_sequences"]
    assert rows == 400  # one 25-token document per 32-token row

    def share_of_a(num_rows):
        return Counter(documents(next(train), tok)[0][0] for _ in range(num_rows))["A"] / num_rows

    # whole epochs hold exact quotas (largest remainder of 0.8 x 400); B is down-sampled, A repeats
    assert share_of_a(rows) == 0.8 and share_of_a(rows) == 0.8
    # a window that is not an epoch is a shuffled draw: 4 standard deviations of a binomial share
    window = 150
    assert abs(share_of_a(window) - 0.8) < 4 * math.sqrt(0.8 * 0.2 / window)


def test_sampling_probs_unset_mixes_in_proportion_to_size(tok):
    data = DataConfig(
        datasets=[DatasetConfig(task="arithmetic", num_examples=900), DatasetConfig(task="sorting", num_examples=300)],
        held_out_fraction=0.0,
    )
    train = loader(tok, data, mbs=1)
    docs = one_epoch(train, tok)
    counts = Counter("sort" if d.startswith("sort") else "arith" for d in docs)
    assert counts == {"arith": 900, "sort": 300}  # every document exactly once per epoch


# ---- resume --------------------------------------------------------------------------------------------------------


def test_resume_mid_epoch_yields_the_batches_of_an_uninterrupted_run(tok):
    data = task_data(3000)
    reference = loader(tok, data, mbs=4, seed=3)
    stop = reference.state_dict()["num_sequences"] // 4 // 2  # half way through the first epoch
    expected = [next(reference) for _ in range(stop + 20)]
    interrupted = loader(tok, data, mbs=4, seed=3)
    for _ in range(stop):
        next(interrupted)
    state = json.loads(json.dumps(interrupted.state_dict()))
    resumed = loader(tok, data, mbs=4, seed=3)
    resumed.load_state_dict(state)
    assert resumed.epoch == interrupted.epoch == 0
    assert same_batches([next(resumed) for _ in range(20)], expected[stop:])


def test_resume_across_an_epoch_boundary_with_workers_and_prefetch(tok):
    data = task_data(300, num_workers=2)
    reference = loader(tok, data, mbs=3, seed=9)
    rows = reference.state_dict()["num_sequences"]
    per_epoch = rows / 3
    total = int(per_epoch * 2) + 4
    expected = [next(reference) for _ in range(total)]
    stop = int(per_epoch) - 1  # a few batches before the first epoch ends
    interrupted = loader(tok, data, mbs=3, seed=9)
    interrupted.prefetch = True  # the CUDA look-ahead, exercised on CPU
    for _ in range(stop):
        next(interrupted)
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert state["epoch"] == 0
    resumed = loader(tok, data, mbs=3, seed=9)
    resumed.load_state_dict(state)
    got = [next(resumed) for _ in range(total - stop)]
    assert resumed.epoch == 2
    assert same_batches(got, expected[stop:])
    # loading a state again on a running loader rewinds it (the workers are reused)
    resumed.load_state_dict(state)
    assert same_batches([next(resumed) for _ in range(3)], expected[stop : stop + 3])


def test_global_batch_is_the_same_rows_whatever_the_world_size(tok):
    data = task_data(n=2000, task="reverse-text")
    one = loader(tok, data, mbs=4, world_size=1)
    alone = [next(one) for _ in range(4)]  # two steps of 8 sequences (accumulation 2)
    ranks = [loader(tok, data, mbs=4, rank=r, world_size=2) for r in range(2)]
    for step in range(2):
        expected = sorted(tuple(row) for b in alone[2 * step : 2 * step + 2] for row in b.input_ids.tolist())
        got = sorted(tuple(row) for r in ranks for row in next(r).input_ids.tolist())
        assert got == expected, f"step {step}: the two ranks' rows are not the single process's global batch"
