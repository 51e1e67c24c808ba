"""Curriculum learning (data.curriculum): difficulty buckets, the pacing schedule, the loader that follows it and
resumes exactly, and lint's checks."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from prime_train.config.schema import DataConfig, DatasetConfig
from prime_train.engine.curriculum import BUCKETS, Curriculum, buckets, content_difficulty
from prime_train.engine.data import build_train_loader
from prime_train.engine.errors import EngineConfigError
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
