"""Preference pairs (engine/preference.py): records and built-in tasks to pair batches, the resumable loader, the
summed completion log-probs, and lint's rules for preference data with file:line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from enginetools import tiny_llama

from prime_train.config.schema import DataConfig, DatasetConfig
from prime_train.engine.data import held_out_examples
from prime_train.engine.evaluate import token_losses
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.preference import (
    PREFERENCE_JOBS,
    PairEncoder,
    build_eval_pairs,
    build_pair_loader,
    collate_pairs,
    extract_pair,
    read_pairs,
    sequence_logprobs,
    task_pairs,
)
from prime_train.engine.records import Record
from prime_train.validator import data_fields
from prime_train.validator.lint import lint_files

CPU = torch.device("cpu")


def _write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _data(path_or_task: str | Path, **ds) -> DataConfig:
    source = {"task": path_or_task} if isinstance(path_or_task, str) else {"path": str(path_or_task)}
    return DataConfig(seq_len=64, held_out_fraction=0.0, datasets=[{**source, **ds}])


def _text(tokenizer, ids: torch.Tensor) -> str:
    return tokenizer.decode([t for t in ids.tolist() if t != -100])


def _loader(data: DataConfig, tokenizer, mbs: int = 2, **kw):
    args = dict(micro_batch_size=mbs, rank=0, world_size=1, seed=7, device=CPU)
    return build_pair_loader(data, tokenizer, **{**args, **kw})


# ---------------------------------------------------------------- records to batches


def test_string_pairs_tokenize_with_the_prompt_masked_and_both_sides_in_one_batch(tmp_path, byte_tokenizer):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}])
    batch = next(_loader(_data(path), byte_tokenizer, mbs=1))
    assert batch.num_pairs == 1 and batch.input_ids.shape[0] == 2
    assert _text(byte_tokenizer, batch.input_ids[0]) == "2+2=4<|eos|>"
    assert _text(byte_tokenizer, batch.input_ids[1]) == "2+2=5<|eos|>"
    # the completion and its eos are labelled, the prompt is not
    assert _text(byte_tokenizer, batch.labels[0]) == "4<|eos|>" and _text(byte_tokenizer, batch.labels[1]) == "5<|eos|>"


def test_chat_pairs_learn_the_final_assistant_turn_only(tmp_path, byte_tokenizer):
    prompt = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "capital of France?"},
    ]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "Paris"}], "rejected": "Lyon"}
    path = _write_jsonl(tmp_path / "chat.jsonl", [record])
    batch = next(_loader(_data(path), byte_tokenizer, mbs=1))
    chosen, rejected = (_text(byte_tokenizer, batch.labels[row]) for row in (0, 1))
    # the earlier assistant turn is context: only the answer compared (and its end-of-turn) is labelled
    assert "Paris" in chosen and "hello" not in chosen and "Lyon" not in chosen
    assert "Lyon" in rejected and "hello" not in rejected
    full = byte_tokenizer.decode(batch.input_ids[0][~batch.pad_mask[0]].tolist())
    assert "capital of France?" in full and "hello" in full


def test_parquet_records_read_as_jsonl_ones(tmp_path, byte_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"q": ["a", "b"], "good": ["x", "y"], "bad": ["z", "w"]}), tmp_path / "p.parquet")
    data = _data(tmp_path / "p.parquet", format="preference", prompt_field="q", chosen_field="good",
                 rejected_field="bad")  # fmt: skip
    [pairs] = read_pairs(data, 0, held_out=False)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [("a", "x", "z"), ("b", "y", "w")]
    assert pairs[1].where.endswith("p.parquet row 1")


@pytest.mark.parametrize(
    ("record", "says"),
    [
        ({"prompt": "p", "chosen": "a"}, "has no field 'rejected'"),
        ({"chosen": "a", "rejected": "b"}, "has no field 'prompt'"),
        ({"prompt": "p", "chosen": "same", "rejected": "same"}, "'chosen' and 'rejected' are the same"),
        ({"prompt": "p", "chosen": 3, "rejected": "b"}, "must be a string or a list of chat messages"),
        ({"prompt": "p", "chosen": [{"role": "assistant"}], "rejected": "b"}, "chosen[0].content is missing"),
    ],
    ids=["no-rejected", "no-prompt", "chosen-is-rejected", "not-text", "bad-message"],
)
def test_the_engine_names_the_line_of_a_bad_pair(tmp_path, record, says):
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    path = _write_jsonl(tmp_path / "bad.jsonl", [good, good, record])
    with pytest.raises(EngineConfigError) as err:
        read_pairs(_data(path, format="preference"), 0, held_out=False)
    assert f"{path}:3" in str(err.value) and says in str(err.value)


def test_a_non_preference_file_is_refused_naming_the_format_key(tmp_path, byte_tokenizer):
    path = _write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(EngineConfigError, match=r"data\.datasets\[0\]\.format: .*'prompt_completion' records"):
        _loader(_data(path), byte_tokenizer)


def test_an_sft_job_refuses_preference_records(tmp_path, byte_tokenizer):
    from prime_train.engine.data import build_train_loader

    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    with pytest.raises(EngineConfigError, match=r"p\.jsonl:1: .*train run\.job 'dpo' or 'reward'"):
        build_train_loader(_data(path), byte_tokenizer, job="sft", micro_batch_size=1, rank=0, world_size=1,
                           seed=0, device=CPU)  # fmt: skip


def test_long_pairs_keep_the_prompt_end_and_the_completion_start(byte_tokenizer):
    from prime_train.engine.preference import Pair

    encoder = PairEncoder(byte_tokenizer, seq_len=16)
    pair = Pair("P" * 20 + "END=", "abcdefghijklmnopqrstuvwxyz", "ABC", "x:1")
    [tp] = encoder.encode([pair])
    chosen = byte_tokenizer.decode(tp.chosen.ids)
    rejected = byte_tokenizer.decode(tp.rejected.ids)
    assert len(tp.chosen.ids) == 16 and len(tp.rejected.ids) <= 16
    # half the window stays for the completions; the prompt keeps its end, on both sides alike
    assert chosen == "PPPPEND=abcdefgh" and rejected.startswith("PPPPEND=ABC")
    assert encoder.truncated_tokens > 0
    assert sum(tp.chosen.loss) == 8  # the completion's first 8 tokens, no prompt token


# ---------------------------------------------------------------- built-in tasks


@pytest.mark.parametrize("task", ["arithmetic", "reverse-text", "sorting"])
def test_task_pairs_prefer_the_right_answer_over_a_near_miss_deterministically(task):
    from prime_train.tasks import get_task

    pairs = task_pairs(task, 2000, 5)
    assert [(p.prompt, p.chosen, p.rejected) for p, _ in pairs] == [
        (p.prompt, p.chosen, p.rejected) for p, _ in task_pairs(task, 2000, 5)
    ]
    scorer = get_task(task)
    for pair, (prompt, answer) in pairs:
        assert pair.chosen == answer and pair.prompt == prompt and pair.rejected != answer
        from prime_train.tasks import Example

        assert scorer.score(Example(prompt, answer), pair.rejected) == 0.0
        assert abs(len(pair.rejected) - len(answer)) <= 1  # a near miss, not noise
    other_seed = [p.rejected for p, _ in task_pairs(task, 2000, 6)]
    assert other_seed != [p.rejected for p, _ in pairs]


def test_reverse_text_rejects_both_the_word_itself_and_a_swap():
    pairs = [p for p, _ in task_pairs("reverse-text", 500, 1)]
    unreversed = sum(p.rejected == p.prompt.removeprefix("reverse ").removesuffix("=") for p in pairs)
    assert 0.3 < unreversed / len(pairs) < 0.7


def test_held_out_task_pairs_are_the_examples_sft_holds_out(byte_tokenizer):
    data = DataConfig(seq_len=64, held_out_fraction=0.1, datasets=[{"task": "reverse-text", "num_examples": 1000}])
    held = {p.prompt for p in read_pairs(data, 3, held_out=True)[0]}
    train = {p.prompt for p in read_pairs(data, 3, held_out=False)[0]}
    assert 50 < len(held) < 150 and not held & train
    assert {e.prompt for e in held_out_examples(data, 3, 1000)} <= held


def test_eval_pairs_split_over_ranks_with_the_same_batch_count(byte_tokenizer):
    data = DataConfig(seq_len=64, held_out_fraction=0.1, datasets=[{"task": "sorting", "num_examples": 300}])
    per_rank = [
        build_eval_pairs(data, byte_tokenizer, micro_batch_size=4, rank=r, world_size=3, seed=0, max_batches=100)
        for r in range(3)
    ]
    assert len({len(b) for b in per_rank}) == 1
    counted = sum(int(batch.counted.sum()) for batches in per_rank for batch in batches)
    assert counted == len(read_pairs(data, 0, held_out=True)[0])


# ---------------------------------------------------------------- the loader: deterministic and resumable


def test_the_loader_resumes_from_its_state_to_the_exact_next_batch(byte_tokenizer):
    data = DataConfig(seq_len=64, held_out_fraction=0.05, datasets=[{"task": "reverse-text", "num_examples": 50}])
    straight = _loader(data, byte_tokenizer, mbs=4)
    first = [next(straight) for _ in range(30)]  # past an epoch of 47 pairs
    again = _loader(data, byte_tokenizer, mbs=4)
    for _ in range(17):
        next(again)
    state = json.loads(json.dumps(again.state_dict()))
    resumed = _loader(data, byte_tokenizer, mbs=4)
    resumed.load_state_dict(state)
    for expected in first[17:]:
        got = next(resumed)
        assert torch.equal(got.input_ids, expected.input_ids) and torch.equal(got.labels, expected.labels)
    assert state["epoch"] == 1


def test_ranks_read_disjoint_pairs_of_one_shared_order(byte_tokenizer):
    data = DataConfig(seq_len=64, held_out_fraction=0.0, datasets=[{"task": "sorting", "num_examples": 40}])
    one = _loader(data, byte_tokenizer, mbs=2)
    rows = [next(one) for _ in range(10)]
    single = [tuple(r.input_ids[i][~r.pad_mask[i]].tolist()) for r in rows for i in range(2)]
    split = []
    for rank in (0, 1):
        loader = _loader(data, byte_tokenizer, mbs=1, rank=rank, world_size=2)
        split.append([tuple(next(loader).input_ids[0].tolist()) for _ in range(10)])
    interleaved = [row for pair in zip(*split, strict=True) for row in pair]
    assert interleaved == single


# ---------------------------------------------------------------- log-probs


@pytest.mark.parametrize("native", [False, True], ids=["transformers", "native"])
def test_sequence_logprobs_are_minus_each_row_s_completion_loss(byte_tokenizer, native):
    from contextlib import nullcontext

    from prime_train.engine.llama import NativeCausalLM

    model = tiny_llama(vocab_size=len(byte_tokenizer))
    if native:  # the chunked log-probs (engine/loss.py), never the whole logits
        hf, model = model, NativeCausalLM(model.config)
        model.load_state_dict(hf.state_dict())
    pairs = [p for p, _ in task_pairs("reverse-text", 5, 0)]
    batch = collate_pairs(PairEncoder(byte_tokenizer, 64).encode(pairs), byte_tokenizer.pad_token_id)
    chosen, rejected = sequence_logprobs(model, batch, nullcontext)
    assert chosen.shape == rejected.shape == (5,)
    for row, value in enumerate(torch.cat([chosen, rejected])):
        real = ~batch.pad_mask[row]
        ids = batch.input_ids[row][real][None]
        loss, _ = token_losses(model, ids, torch.arange(ids.shape[1])[None], batch.labels[row][real][None])
        torch.testing.assert_close(value, -loss, rtol=1e-5, atol=1e-5)  # padding changes nothing
    # with gradients: a DPO-like weighting of each sequence reaches the weights as through the whole logits
    weights = torch.linspace(-1, 2, 10)
    (torch.cat([chosen, rejected]) * weights).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    if native:
        h_chosen, h_rejected = sequence_logprobs(hf, batch, nullcontext)
        torch.testing.assert_close(torch.cat([chosen, rejected]), torch.cat([h_chosen, h_rejected]).detach())
        (torch.cat([h_chosen, h_rejected]) * weights).sum().backward()
        grads = dict(hf.named_parameters())
        for name, param in model.named_parameters():
            torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("native", [False, True], ids=["transformers", "native"])
def test_sequence_logprobs_keep_no_tokens_x_vocab_tensor_for_backward_on_the_native_model(byte_tokenizer, native):
    # what memory_breakdown counts for dpo: chunked on the native model (nothing of tokens x vocab saved), the
    # whole logits on transformers' (the case that shows this check can see them)
    from contextlib import nullcontext

    from prime_train.engine.llama import NativeCausalLM

    model = tiny_llama(vocab_size=len(byte_tokenizer))
    if native:
        model = NativeCausalLM(model.config)
    vocab = model.config.vocab_size
    batch = collate_pairs(
        PairEncoder(byte_tokenizer, 64).encode([p for p, _ in task_pairs("reverse-text", 4, 0)]),
        byte_tokenizer.pad_token_id,
    )
    tokens = batch.input_ids.numel()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        chosen, rejected = sequence_logprobs(model, batch, nullcontext)
    (chosen - rejected).sum().backward()
    big = [tuple(t.shape) for t in saved if t.dim() and t.shape[-1] == vocab and t.numel() >= tokens * vocab // 2]
    assert bool(big) == (not native), big


# ---------------------------------------------------------------- lint


def _lint(tmp_path: Path, data_path: Path, job: str = "dpo", fmt: str | None = None):
    fmt_line = f'format = "{fmt}"\n' if fmt else ""
    config = tmp_path / "run.toml"
    config.write_text(
        f'[run]\njob = "{job}"\noutput_dir = "{tmp_path}"\n\n[[data.datasets]]\npath = "{data_path}"\n{fmt_line}'
    )
    return [p for p in lint_files([str(config)])[0] if p.severity == "error"]


@pytest.mark.parametrize(
    ("records", "line", "says"),
    [
        ([{"prompt": "p", "chosen": "a", "rejected": "b"}, {"prompt": "p", "chosen": "x", "rejected": "x"}], 2,
         "equals 'rejected'"),
        ([{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3 + [{"prompt": "p", "chosen": "a"}], 4,
         "has no such field"),
        ([{"prompt": "p", "chosen": "a", "rejected": "a"}], 1, "equals 'rejected'"),
        ([{"chosen": "a", "rejected": "b"}], 1, "has no such field"),
    ],
    ids=["chosen-is-rejected", "no-rejected", "first-record-equal", "first-record-no-prompt"],
)  # fmt: skip
def test_lint_names_the_file_and_line_of_a_bad_pair(tmp_path, records, line, says):
    path = _write_jsonl(tmp_path / "pairs.jsonl", records)
    problems = _lint(tmp_path, path, fmt="preference")
    assert len(problems) == 1, problems
    assert f"{path}:{line}" in problems[0].message and says in problems[0].message
    assert problems[0].message.startswith("data.datasets[0].")


def test_lint_passes_a_good_preference_file_with_auto_format(tmp_path):
    path = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}] * 3)
    assert _lint(tmp_path, path) == []


def test_lint_refuses_preference_records_for_another_job(tmp_path):
    path = _write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    for fmt in ("preference", None):
        [problem] = _lint(tmp_path, path, job="sft", fmt=fmt)
        assert "data.datasets[0]" in problem.message and "run.job 'dpo' or 'reward'" in problem.message
        assert problem.message.find("'sft'") > 0


@pytest.mark.parametrize("job", PREFERENCE_JOBS)
def test_lint_refuses_a_preference_job_on_sft_records(tmp_path, job):
    path = _write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "p", "completion": "c"}])
    [problem] = _lint(tmp_path, path, job=job)
    assert "data.datasets[0].format reads 'prompt_completion' records" in problem.message


def test_lint_passes_a_preference_job_on_a_built_in_task(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text(f'[run]\njob = "dpo"\noutput_dir = "{tmp_path}"\n\n[[data.datasets]]\ntask = "sorting"\n')
    assert [p for p in lint_files([str(config)])[0] if p.severity == "error"] == []


RECORDS = [
    {"prompt": "p", "chosen": "a", "rejected": "b"},
    {"prompt": "p", "chosen": "a", "rejected": "a"},
    {"prompt": "p", "chosen": "a"},
    {"prompt": 1, "chosen": "a", "rejected": "b"},
    {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "a"}],
     "rejected": "b"},
    {"prompt": "p", "chosen": [], "rejected": "b"},
    {"prompt": "p", "chosen": [{"role": "assistant"}], "rejected": "b"},
]  # fmt: skip


@pytest.mark.parametrize("record", RECORDS)
def test_lint_and_the_engine_judge_preference_records_alike(record):
    ds = DatasetConfig(path="x.jsonl", format="preference")
    try:
        extract_pair(ds, 0, Record(record, "x:1"))
        engine_ok = True
    except EngineConfigError:
        engine_ok = False
    assert (data_fields.format_problem(ds, record, "x:1") is None) == engine_ok
    assert data_fields.PREFERENCE_JOBS == PREFERENCE_JOBS


def test_reference_values_ride_with_their_pairs(byte_tokenizer):
    from prime_train.engine.preference import reference_of_batches, reference_of_rows

    data = DataConfig(seq_len=64, held_out_fraction=0.2, datasets=[{"task": "arithmetic", "num_examples": 60}])
    loader = _loader(data, byte_tokenizer, mbs=4)
    evals = build_eval_pairs(data, byte_tokenizer, micro_batch_size=4, rank=0, world_size=1, seed=7, max_batches=2)

    def fake(batch):  # a stand-in reference: each row's token count, so a value shows which row it came from
        counts = (~batch.pad_mask).sum(-1).float()
        return counts[: batch.num_pairs], counts[batch.num_pairs :] + 0.5

    reference_of_rows(loader.rows, 4, fake)
    reference_of_batches(evals, fake)
    batch = next(loader)
    torch.testing.assert_close(batch.ref_logps, (~batch.pad_mask).sum(-1).float() + torch.tensor([0.0] * 4 + [0.5] * 4))
    assert all(b.ref_logps is not None and b.ref_logps.shape == (2 * b.num_pairs,) for b in evals)
    assert np.isfinite(loader.rows.ref_logps).all()
