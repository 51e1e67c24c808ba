"""RL environments: built-in determinism, disjoint splits, rewards, user modules and the verifiers adapter."""

from __future__ import annotations

import importlib.util
import re
import sys
import textwrap

import pytest

from prime_train.environments import (
    BuiltinEnvironment,
    Environment,
    EnvironmentLoadError,
    Prompt,
    arithmetic_reward,
    load_environment,
    positional_reward,
    similarity_reward,
)

BUILTINS = ("reverse-text", "arithmetic", "sorting")


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_prompts_are_deterministic_per_seed_and_split(name):
    env = load_environment(name, {})
    assert isinstance(env, Environment)
    first = env.prompts("train", 64, seed=7)
    assert [p.text for p in first] == [p.text for p in load_environment(name, {}).prompts("train", 64, seed=7)]
    assert len(first) == 64
    assert [p.text for p in first] != [p.text for p in env.prompts("train", 64, seed=8)]


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_train_and_eval_prompts_never_share_content(name):
    env = load_environment(name, {})
    train = {p.text for seed in (0, 1, 2) for p in env.prompts("train", 2000, seed)}
    evaluation = {p.text for seed in (0, 1, 2) for p in env.prompts("eval", 64, seed)}
    assert evaluation and train
    assert not train & evaluation


def test_eval_prompts_are_distinct_while_the_task_has_enough():
    env = load_environment("reverse-text", {})
    prompts = env.prompts("eval", 200, seed=3)
    assert len({p.text for p in prompts}) == 200


def test_small_task_eval_split_repeats_rather_than_failing():
    # arithmetic has 200 distinct prompts; a 10 % eval split holds about 20 of them
    prompts = load_environment("arithmetic", {}).prompts("eval", 100, seed=0)
    assert len(prompts) == 100
    assert 5 < len({p.text for p in prompts}) < 60


@pytest.mark.parametrize("name", BUILTINS)
def test_exact_answer_earns_full_reward_and_garbage_earns_less(name):
    env = load_environment(name, {})
    for prompt in env.prompts("train", 20, seed=1):
        assert env.reward(prompt, prompt.answer + "\nmore text") == 1.0
        assert env.reward(prompt, prompt.answer + "<|eos|>") == 1.0
        assert 0.0 <= env.reward(prompt, "zz?") < 1.0


def test_similarity_reward_grows_as_the_answer_gets_closer():
    answer = "fedcba"
    attempts = ["xxxxxx", "fxxxxx", "fexxxx", "fedxxx", "fedcxx", "fedcbx", "fedcba"]
    rewards = [similarity_reward(answer, a) for a in attempts]
    assert rewards == sorted(rewards)
    assert len(set(rewards)) == len(rewards)
    assert rewards[0] == 0.0 and rewards[-1] == 1.0
    assert all(0.0 <= r < 1.0 for r in rewards[:-1])


def test_positional_reward_never_pays_stopping_early_more_than_trying_the_next_character():
    answer = "dzk"
    stopped, tried_wrong, tried_right = (positional_reward(answer, a) for a in ("dz", "dzq", "dzk"))
    assert stopped <= tried_wrong < tried_right == 1.0
    # difflib's ratio, the old reward of reverse-text, paid the early stop more: GRPO learnt to cut answers short
    assert similarity_reward(answer, "dz") > similarity_reward(answer, "dzq")
    assert positional_reward("rvwb", "rvwwbbb") < positional_reward("rvwb", "rvwx")  # rambling on costs credit
    assert positional_reward("abc", "") == 0.0 and positional_reward("abc", "cba") < 1.0


def test_partial_credit_off_rewards_only_the_exact_answer():
    env = load_environment("reverse-text", {"partial_credit": False})
    prompt = env.prompts("train", 1, seed=0)[0]
    assert env.reward(prompt, prompt.answer) == 1.0 and env.reward(prompt, prompt.answer[:-1]) == 0.0
    with pytest.raises(EnvironmentLoadError, match=r"rl\.env_args\.partial_credit"):
        load_environment("reverse-text", {"partial_credit": "yes"})


def test_arithmetic_reward_gives_numeric_partial_credit_below_an_exact_answer():
    assert arithmetic_reward("12", "12") == 1.0
    near, far = arithmetic_reward("12", "11"), arithmetic_reward("12", "5")
    assert 0.5 >= near > far > 0.0
    assert arithmetic_reward("12", "30") == 0.0
    assert arithmetic_reward("12", "twelve") == 0.0
    assert arithmetic_reward("-5", "-5") == 1.0


def test_builtin_env_args_reach_the_task_and_bad_ones_name_the_key():
    env = load_environment("arithmetic", {"max_operand": 3})
    assert all(int(ch) < 3 for p in env.prompts("train", 50, 0) for ch in p.text if ch.isdigit())
    with pytest.raises(EnvironmentLoadError, match=r"rl\.env_args .*max_operand"):
        load_environment("reverse-text", {"max_operand": 3})


@pytest.mark.parametrize(
    ("name", "args", "said"),
    [
        ("reverse-text", {"min_letters": "3"}, "rl.env_args.min_letters must be a whole number"),
        (
            "reverse-text",
            {"min_letters": 5, "max_letters": 4},
            "min_letters (5) must not exceed rl.env_args.max_letters",
        ),
        ("reverse-text", {"max_letters": 2}, "min_letters (3) must not exceed rl.env_args.max_letters (2)"),
        ("arithmetic", {"max_operand": 0}, "rl.env_args.max_operand must be a whole number >= 1"),
        ("sorting", {"alphabet": ""}, "rl.env_args.alphabet must be a non-empty string"),
        ("sorting", {"eval_fraction": "0.1"}, "rl.env_args.eval_fraction must be a number in (0, 1)"),
    ],
)
def test_builtin_env_args_of_the_wrong_type_or_range_name_the_key_before_any_prompt_is_made(name, args, said):
    """Found by lint's fuzz test once configs/tiny-rl.toml set min_letters: a string there passed the config and
    raised a TypeError inside random.randint when lint's token-budget check made the first prompt."""
    with pytest.raises(EnvironmentLoadError, match=re.escape(said)):
        load_environment(name, args)


def test_unknown_environment_name_lists_the_accepted_forms():
    with pytest.raises(EnvironmentLoadError, match=r"rl\.environment = 'reverse'.*pkg\.module:load_environment"):
        load_environment("reverse", {})


USER_MODULE = """
from prime_train.environments import Prompt


class Echo:
    name = "echo"
    uses_tools = True

    def __init__(self, word):
        self.word = word

    def prompts(self, split, n, seed):
        return [Prompt(f"say {self.word} {split} {i}", self.word, {}) for i in range(n)]

    def reward(self, prompt, completion):
        return 1.0 if completion.strip() == prompt.answer else 0.0


def load_environment(word="hi"):
    return Echo(word)


def load_broken(**kwargs):
    return object()
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_env_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_user_module_environment_is_loaded_with_env_args(user_module):
    env = load_environment(f"{user_module}:load_environment", {"word": "yo"})
    assert env.name == "echo" and env.uses_tools
    prompts = env.prompts("train", 3, 0)
    assert prompts[0] == Prompt("say yo train 0", "yo", {})
    assert env.reward(prompts[0], "yo") == 1.0


def test_user_module_returning_a_non_environment_names_rl_environment(user_module):
    with pytest.raises(EnvironmentLoadError, match=r"rl\.environment = .*load_broken.*missing name, uses_tools"):
        load_environment(f"{user_module}:load_broken", {})


def test_missing_user_module_or_function_names_rl_environment(user_module):
    with pytest.raises(EnvironmentLoadError, match=r"rl\.environment = 'no_such_pkg\.env:load'.*cannot import"):
        load_environment("no_such_pkg.env:load", {})
    with pytest.raises(EnvironmentLoadError, match=r"rl\.environment = .*has no function 'nope'"):
        load_environment(f"{user_module}:nope", {})
    with pytest.raises(EnvironmentLoadError, match=r"rl\.environment = .*refused rl\.env_args"):
        load_environment(f"{user_module}:load_environment", {"colour": "red"})


def test_builtin_environment_refuses_an_unknown_split():
    with pytest.raises(ValueError, match="split"):
        BuiltinEnvironment("sorting").prompts("test", 1, 0)


# ---------------------------------------------------------------- verifiers

HAS_LEGACY_VERIFIERS = importlib.util.find_spec("verifiers") is not None and hasattr(
    importlib.import_module("verifiers"), "load_environment"
)


@pytest.mark.skipif(importlib.util.find_spec("verifiers") is not None, reason="verifiers is installed")
def test_verifiers_environment_without_the_package_says_how_to_install_it():
    with pytest.raises(EnvironmentLoadError, match=r"pip install 'verifiers<0\.4'"):
        load_environment("verifiers:gsm8k", {})


VERIFIERS_MODULE = """
import verifiers as vf
from datasets import Dataset


def reversed_exactly(completion, answer, **kwargs):
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    return 1.0 if text.strip() == answer else 0.0


def load_environment(**kwargs):
    rows = [{"question": f"reverse {w}", "answer": w[::-1]} for w in ("abc", "hello", "xyz", "prime")]
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(rows),
        eval_dataset=Dataset.from_list([{"question": "reverse eval", "answer": "lave"}]),
        rubric=vf.Rubric(funcs=[reversed_exactly]),
    )
"""


@pytest.mark.skipif(
    not HAS_LEGACY_VERIFIERS, reason="needs verifiers<0.4 (pip install 'verifiers<0.4'); not in this venv"
)
def test_verifiers_environment_prompts_and_rubric_reward(tmp_path, monkeypatch):
    # verifiers.load_environment imports the module named by the env id: a tiny one defined here, no download
    (tmp_path / "tiny_reverse.py").write_text(textwrap.dedent(VERIFIERS_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    env = load_environment("verifiers:tiny_reverse", {})
    train = env.prompts("train", 4, seed=0)
    assert sorted(p.answer for p in train) == sorted(w[::-1] for w in ("abc", "hello", "xyz", "prime"))
    assert all("reverse" in p.text for p in train)
    assert [p.answer for p in env.prompts("eval", 2, 0)] == ["lave", "lave"]
    prompt = train[0]
    assert env.reward(prompt, prompt.answer) == 1.0
    assert env.reward(prompt, "wrong") == 0.0
