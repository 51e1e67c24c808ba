"""On-policy preference pairs (rl/pairs.py, `prime-train sample-pairs`): a model's samples of an environment's train
prompts, labelled by the environment's rule, written as {prompt, chosen, rejected} records the reward job reads.

The sampled model is a random 2-layer Llama saved with the engine's byte tokenizer, as an SFT run's final/ is: its
samples are nearly all wrong, which is what the file format and the labels are checked on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from enginetools import TINY_RL, run_cli, tiny_llama

from prime_train.config.schema import DataConfig
from prime_train.engine.preference import read_pairs
from prime_train.environments import EnvironmentLoadError, Prompt, load_environment, positional_reward
from prime_train.rl.pairs import label_pairs
from prime_train.tasks import extract_answer
from prime_train.validator.lint import lint_files
from prime_train.vocab import PAD_TOKEN_ID

REVERSE = load_environment("reverse-text", {"partial_credit": False})


def test_each_distinct_failing_sample_is_rejected_against_the_reference_answer():
    abc, xyz = Prompt("reverse abc=", "cba"), Prompt("reverse xyz=", "zyx")
    samples = [["cba", "", "", "abc", "cba\nreverse", "cb"], ["zyx", "zyx"]]
    records, summary = label_pairs(REVERSE, [abc, xyz], samples)
    # the answer ends at a newline: "cba\nreverse" passes; the empty answer sampled twice is one pair
    assert records == [
        {"prompt": "reverse abc=", "chosen": "cba", "rejected": ""},
        {"prompt": "reverse abc=", "chosen": "cba", "rejected": "abc"},
        {"prompt": "reverse abc=", "chosen": "cba", "rejected": "cb"},
    ]
    assert (summary.prompts, summary.samples, summary.passed, summary.pairs) == (2, 8, 4, 3)
    assert summary.pass_rate == 0.5 and summary.common_failures == [("", 1), ("abc", 1), ("cb", 1)]


class _Judged:
    """An environment whose prompts have no reference answer and whose reward is a learned score: labels must come
    from its `passed` rule alone."""

    name, uses_tools = "judged", False

    def prompts(self, split, n, seed):
        return [Prompt(f"q{i}") for i in range(n)]

    def reward(self, prompt, completion):
        raise AssertionError("a learned score must never label a pair")

    def passed(self, prompt, completion):
        return completion.startswith("good")


def test_without_a_reference_a_passing_sample_is_chosen_and_the_rule_not_the_score_labels():
    q0, q1 = _Judged().prompts("train", 2, 0)
    records, summary = label_pairs(_Judged(), [q0, q1], [["bad", "good 1", "good 2", "worse"], ["bad", "worse"]])
    assert records == [
        {"prompt": "q0", "chosen": "good 1", "rejected": "bad"},
        {"prompt": "q0", "chosen": "good 1", "rejected": "worse"},
    ]
    assert summary.prompts_without_chosen == 1 and summary.passed == 2


def test_graded_pairs_order_two_wrong_samples_by_the_tasks_partial_credit():
    """--graded-gap: beside right-against-wrong, two wrong samples whose partial credit (positional: right letters in
    their places over the longer length) differs by the gap or more are a pair, the closer one chosen. The task's
    credit is used even with rl.env_args.partial_credit = false (the RL reward stays exact)."""
    abc = Prompt("reverse abc=", "cba")
    samples = [["cbx", "xxx", "", "cb", "cbx", "cba"]]  # credits 2/3, 0, 0, 2/3; a repeat; a pass
    plain, _ = label_pairs(REVERSE, [abc], samples)
    graded, summary = label_pairs(REVERSE, [abc], samples, graded_gap=0.3)
    assert graded[: len(plain)] == plain and [r["rejected"] for r in plain] == ["cbx", "xxx", "", "cb"]
    assert [(r["chosen"], r["rejected"]) for r in graded[len(plain) :]] == [
        ("cbx", "xxx"), ("cbx", ""), ("cb", "xxx"), ("cb", ""),
    ]  # fmt: skip
    assert summary.graded_pairs == 4 and summary.pairs == 8 and summary.to_dict()["graded_pairs"] == 4
    # a gap above every difference gives no graded pair; an environment with no graded rule is refused
    assert label_pairs(REVERSE, [abc], samples, graded_gap=0.7)[1].graded_pairs == 0
    with pytest.raises(EnvironmentLoadError, match="--graded-gap"):
        label_pairs(_Judged(), [Prompt("q0")], [["bad", "worse"]], graded_gap=0.3)


@pytest.fixture(scope="module")
def random_policy(tmp_path_factory) -> Path:
    """A random 2-layer Llama and the engine's byte tokenizer, saved as an SFT run's final/."""
    from prime_train.engine.tokenizer import build_byte_tokenizer

    out = tmp_path_factory.mktemp("policy")
    tiny_llama(vocab_size=320, max_position_embeddings=128, pad_token_id=PAD_TOKEN_ID).save_pretrained(out)
    build_byte_tokenizer().save_pretrained(out)
    return out


def _sample(policy: Path, out: Path, *extra: str):
    return run_cli(
        "sample-pairs", str(TINY_RL), "--model.path", str(policy), "--out", str(out), "--prompts", "12",
        "--samples", "4", "--rl.env_args.min_letters", "3", "--rl.env_args.max_letters", "3", *extra,
    )  # fmt: skip


def test_sampled_pairs_are_labelled_by_the_rule_and_read_by_lint_and_the_reward_job(tmp_path, random_policy):
    out = tmp_path / "pairs.jsonl"
    result = _sample(random_policy, out, "--json", "--graded-gap", "0.3")
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout)
    assert "graded_pairs" in summary  # how many depends on what the random model samples
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert summary["prompts"] == 12 and summary["samples"] == 48 and summary["pairs"] == len(records) > 0
    train = {p.text for p in load_environment("reverse-text", {"min_letters": 3, "max_letters": 3}).prompts(
        "train", 12, 1234
    )}  # fmt: skip
    graded = 0
    for record in records:
        word = record["prompt"].removeprefix("reverse ").removesuffix("=")
        assert record["prompt"] in train and extract_answer(record["rejected"]) != record["chosen"]
        if record["chosen"] != word[::-1]:  # a graded pair: two wrong samples, the closer one chosen
            graded += 1
            credit = [positional_reward(word[::-1], record[side]) for side in ("chosen", "rejected")]
            assert credit[0] - credit[1] >= 0.3, (record, credit)
    assert graded == summary["graded_pairs"]
    config = tmp_path / "reward.toml"
    config.write_text(f'[run]\njob = "reward"\noutput_dir = "{tmp_path}"\n\n[[data.datasets]]\npath = "{out}"\n')
    assert [p for p in lint_files([str(config)])[0] if p.severity == "error"] == []
    data = DataConfig(held_out_fraction=0.0, datasets=[{"path": str(out)}])
    assert len(read_pairs(data, seed=0, held_out=False)[0]) == len(records)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (("--model.path", "{tmp}/no-model"), "model.path"),
        (("--rl.environment", "reward-model"), "rl.env_args.path"),
        (("--out", "{tmp}/missing-dir/pairs.jsonl"), "missing-dir does not exist"),
        (("--out", "{tmp}/taken.jsonl"), "taken.jsonl: already exists"),
    ],
    ids=["no-model", "no-reward-model-path", "no-out-dir", "out-exists"],
)
def test_bad_input_exits_78_naming_the_key_or_path_and_writes_nothing(tmp_path, random_policy, args, says):
    taken = tmp_path / "taken.jsonl"
    taken.write_text("mine\n")
    out = tmp_path / "pairs.jsonl"
    result = _sample(random_policy, out, *(a.format(tmp=tmp_path) for a in args))
    assert result.returncode == 78, result.stdout + result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr
    assert not out.exists() and taken.read_text() == "mine\n"
