"""Curriculum learning (data.curriculum): difficulty buckets, the pacing schedule, the loader that follows it and
resumes exactly, the self-paced scores (and their resume through a real checkpoint), and lint's checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from enginetools import losses_by_step, run_train

from prime_train.config.schema import DataConfig, DatasetConfig
from prime_train.engine.curriculum import BUCKETS, EMA_NEW, Curriculum, SelfPaced, buckets, content_difficulty
from prime_train.engine.data import build_train_loader
from prime_train.engine.errors import EngineConfigError
from prime_train.engine.safe_dcp import read_metadata
from prime_train.engine.train_state import SCORES_KEY, TrainState
from prime_train.validator.lint import lint_files


def test_buckets_group_equal_difficulties_and_quantiles_past_sixteen_values():
    assert buckets([3, 5, 3, 4, 5]) == [[0, 2], [3], [1, 4]]
    many = buckets([float(i) for i in range(100)])
    assert len(many) == BUCKETS and sorted(i for g in many for i in g) == list(range(100))
    assert max(many[0]) < min(many[-1])  # easiest first


def test_the_pool_grows_from_the_start_fraction_to_all_rows_over_the_horizon():
    difficulty = np.repeat(np.arange(10.0), 10)  # 100 rows, ten levels
    c = Curriculum(difficulty, start=0.2, horizon=1000, seed=0)
    assert c.fraction(0) == 0.2 and c.fraction(500) == pytest.approx(0.6) and c.fraction(5000) == 1.0
    slow = Curriculum(difficulty, start=0.2, horizon=10**6, seed=0)  # its pool stays at 20% over 50 positions
    early = [difficulty[slow.row(g)] for g in range(50)]
    assert max(early) <= 1.0 and min(early) == 0.0  # the easiest 20% of the rows: levels 0 and 1
    late = {difficulty[c.row(g)] for g in range(900, 1000)}
    assert max(late) >= 8.0
    assert [c.row(g) for g in range(20)] == [Curriculum(difficulty, 0.2, 1000, 0).row(g) for g in range(20)]


def test_difficulty_comes_from_the_field_or_the_tasks_answer_and_a_bad_value_names_the_record():
    assert content_difficulty(("reverse abcd=", "dcba"), {}, "task", None, task=True) == 4.0
    assert content_difficulty(("q", "a"), {"level": 7}, "f.jsonl:3", "level", task=False) == 7.0
    with pytest.raises(EngineConfigError, match=r"f\.jsonl:3: data\.difficulty_field 'level'"):
        content_difficulty(("q", "a"), {"level": "hard"}, "f.jsonl:3", "level", task=False)


def _loader(byte_tokenizer, curriculum: str):
    data = DataConfig(
        datasets=[DatasetConfig(task="reverse-text", num_examples=600)], seq_len=32, packing=False,
        curriculum=curriculum, curriculum_start=0.25, curriculum_steps=10,
    )  # fmt: skip
    return build_train_loader(
        data, byte_tokenizer, job="sft", micro_batch_size=4, rank=0, world_size=1, seed=7,
        device=torch.device("cpu"), global_batch_size=8, max_steps=40,
    )  # fmt: skip


def _answer_lengths(batch) -> list[int]:
    return [int(((row != -100).sum()) - 1) for row in batch.labels]  # labelled tokens: the answer and its eos


def test_a_difficulty_curriculum_on_the_built_in_task_starts_with_the_shortest_words_and_resumes_exactly(
    byte_tokenizer,
):
    loader = _loader(byte_tokenizer, "difficulty")
    first = [n for _ in range(4) for n in _answer_lengths(next(loader))]
    assert set(first) <= {3, 4} and 3 in first  # the easiest quarter: 3- and 4-letter words (3..6 in the task)
    plain = [n for _ in range(4) for n in _answer_lengths(next(_loader(byte_tokenizer, "none")))]
    assert max(plain) > 4  # without a curriculum the longer words come at once
    state = loader.state_dict()
    expected = [next(loader).input_ids for _ in range(30)]  # through the end of the 80-sequence schedule and after
    again = _loader(byte_tokenizer, "difficulty")
    again.load_state_dict(json.loads(json.dumps(state)))
    assert all(torch.equal(a, next(again).input_ids) for a in expected)


def test_lint_refuses_a_difficulty_curriculum_without_a_field_for_own_data(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[data]\ncurriculum = "difficulty"\n\n[[data.datasets]]\npath = "{tmp_path / "d.jsonl"}"\n')
    problems, _ = lint_files([str(cfg)])
    assert [(p.line, p.key, p.severity) for p in problems] == [(2, "data.curriculum", "error")]
    assert "needs data.difficulty_field" in problems[0].message


@pytest.mark.parametrize("job", ["rl", "dpo", "reward", "meta"])
@pytest.mark.parametrize("curriculum", ["length", "difficulty", "self_paced"])
def test_lint_refuses_a_curriculum_for_a_job_that_reads_no_packed_rows(tmp_path, job, curriculum):
    """Only the sft and pretrain jobs order their rows by a curriculum; the others would run without one, silently."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[run]\njob = "{job}"\n\n[data]\ncurriculum = "{curriculum}"\n')
    problems, _ = lint_files([str(cfg)])
    errors = [(p.line, p.key, p.message) for p in problems if p.severity == "error" and p.key == "data.curriculum"]
    # streamed data of its own, no difficulty field: still the one mistake, not what the curriculum would need
    streamed = tmp_path / "s.toml"
    streamed.write_text(f'[run]\njob = "{job}"\n\n[data]\ncurriculum = "{curriculum}"\nstreaming = true\n\n'
                        f'[[data.datasets]]\npath = "{tmp_path / "d.jsonl"}"\n')  # fmt: skip
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
    again = [p for p in lint_files([str(streamed)])[0] if p.key == "data.curriculum"]
    assert [(p.line, p.severity) for p in again] == [(5, "error")] and "reads its data another way" in again[0].message
    assert len(errors) == 1 and errors[0][0] == 5, problems
    assert f"the {job} job reads its data another way" in errors[0][2] and "data.curriculum = 'none'" in errors[0][2]


def test_self_paced_starts_in_the_length_order_then_ranks_rows_by_their_recent_loss():
    prior = np.repeat(np.arange(5.0), 2)  # 10 rows, two of each length 0..4
    length_order = list(Curriculum(prior, 0.2, 100, 0).sorted_rows)
    paced = SelfPaced(prior, start=0.2, horizon=100, seed=0)
    assert list(paced.ranked()) == length_order  # nothing seen: the length curriculum
    # a step's per-row losses; position 10 came twice (a tensor-parallel group's copies) and counts once, a row
    # with no labelled token (NaN) is not scored
    paced.observe(np.array([10, 10, 12, 13]), np.array([9, 9, 0, 4]), np.array([0.5, 100.0, 3.0, np.nan]))
    assert paced.scores[9] == 0.5 and paced.scores[0] == 3.0 and np.isnan(paced.scores[4])
    # unseen rows: their length bucket's mean (row 8 as row 9, row 1 as row 0), else the mean of all seen (1.75)
    assert list(paced.estimates()) == [3.0, 3.0, 1.75, 1.75, 1.75, 1.75, 1.75, 1.75, 0.5, 0.5]
    ranked = list(paced.ranked())
    assert set(ranked[:2]) == {8, 9} and set(ranked[-2:]) == {0, 1}  # the longest rows now come first
    assert ranked[2:-2] == [r for r in length_order if r in range(2, 8)]  # equal estimates keep the length order
    paced.observe(np.array([20]), np.array([9]), np.array([1.5]))
    assert paced.scores[9] == pytest.approx((1 - EMA_NEW) * 0.5 + EMA_NEW * 1.5)
    assert {paced.row(g) for g in range(3)} <= set(paced.ranked()[:2])  # the pool near 20%: the two easiest rows


def _paced_loader(byte_tokenizer, curriculum="self_paced", **data):
    data = DataConfig(
        datasets=[DatasetConfig(task="reverse-text", num_examples=600)], seq_len=32, packing=False,
        curriculum=curriculum, curriculum_start=0.25, curriculum_steps=10, **data,
    )  # fmt: skip
    return build_train_loader(
        data, byte_tokenizer, job="sft", micro_batch_size=4, rank=0, world_size=1, seed=7,
        device=torch.device("cpu"), global_batch_size=8, max_steps=40,
    )  # fmt: skip


def _paced_steps(loader, steps: int) -> list:
    """Draw `steps` optimizer steps of 2 micro-batches, reporting each step's per-row losses as the train step does:
    here a made-up loss that favours long words (10 - the answer's length)."""
    drawn = []
    for _ in range(steps):
        batches = [next(loader), next(loader)]
        drawn += batches
        if (handed := loader.take_handed()) is not None:
            losses = [10.0 - n for b in batches for n in _answer_lengths(b)]
            loader.self_paced.observe(*handed, np.asarray(losses))
    return drawn


def test_self_paced_loader_follows_the_losses_and_resumes_exactly_from_its_score_table(byte_tokenizer):
    loader = _paced_loader(byte_tokenizer)
    _paced_steps(loader, 4)
    state, table = loader.state_dict(), TrainState(torch.nn.Linear(1, 1), None, None, loader, rank=0).state_dict()
    table = table[SCORES_KEY]
    assert int((~torch.isnan(table)).sum()) > 10  # rows scored so far
    expected = _paced_steps(loader, 12)  # the rest of the 10-step schedule and 6 steps of ordinary epochs
    # the losses favour long words, so the self-paced draw leans to them where the length curriculum cannot
    paced = [n for b in expected[:12] for n in _answer_lengths(b)]
    length = _paced_loader(byte_tokenizer, "length")
    by_length = [n for b in _paced_steps(length, 16)[8:20] for n in _answer_lengths(b)]
    assert np.mean(paced) > np.mean(by_length) + 0.3, (paced, by_length)
    again = _paced_loader(byte_tokenizer)
    again.load_state_dict(json.loads(json.dumps(state)))
    again.load_score_table(table)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(expected, _paced_steps(again, 12), strict=True))
    blank = _paced_loader(byte_tokenizer)  # the same position without the scores draws other rows
    blank.load_state_dict(state)
    assert not all(
        torch.equal(a.input_ids, b.input_ids) for a, b in zip(expected, _paced_steps(blank, 12), strict=True)
    )


def test_self_paced_loader_refuses_loader_workers_and_rows_split_over_the_ranks(byte_tokenizer, tmp_path):
    with pytest.raises(EngineConfigError, match=r"set data\.num_workers = 0, not 2"):
        _paced_loader(byte_tokenizer, num_workers=2)
    for i in range(2):  # two files for two ranks: each rank reads its own file, so the rows are not shared
        (tmp_path / f"part-{i}.jsonl").write_text("".join(f'{{"text": "doc {i} {j}"}}\n' for j in range(40)))
    data = DataConfig(
        datasets=[DatasetConfig(path=str(tmp_path / "part-*.jsonl"))], seq_len=32, curriculum="self_paced",
        held_out_fraction=0.0,
    )  # fmt: skip
    with pytest.raises(EngineConfigError, match="needs rows every rank shares"):
        build_train_loader(
            data, byte_tokenizer, job="pretrain", micro_batch_size=2, rank=0, world_size=2, seed=0,
            device=torch.device("cpu"), max_steps=10,
        )  # fmt: skip


def _self_paced_run(tmp_path, name: str, procs: int, **extra):
    overrides = {
        "train.max_steps": 8, "ckpt.interval": 4, "logging.log_interval": 1, "data.datasets.0.num_examples": 600,
        "data.curriculum": "self_paced", "data.curriculum_steps": 8, "distributed.nproc_per_node": procs, **extra,
    }  # fmt: skip
    result = run_train(tmp_path, name, **overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return losses_by_step(tmp_path / name)


@pytest.mark.slow  # two 2-process runs of the engine, ~45 s on two loaded cores
def test_a_self_paced_run_on_two_ranks_resumed_from_its_checkpoint_trains_on_exactly_as_the_uninterrupted_one(
    tmp_path,
):
    # every rank gathers the global batch's per-row losses (gloo) and holds the same table; DCP writes it once
    procs = 2
    straight = _self_paced_run(tmp_path, "straight", procs)
    step4 = tmp_path / "straight" / "checkpoints" / "step-4"
    assert SCORES_KEY in read_metadata(step4).state_dict_metadata  # the score table went into the checkpoint
    resumed = _self_paced_run(tmp_path, "resumed", procs, **{"ckpt.resume": str(step4)})
    assert [resumed[s] for s in range(5, 9)] == [straight[s] for s in range(5, 9)]
