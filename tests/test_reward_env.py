"""The reward-model environment: a learned reward over a built-in task's prompts, scored in batches in the trainer.

The reward models here are real HF LlamaForSequenceClassification models saved as a reward run's final/ is (config,
safetensors, the engine's byte tokenizer): a random one for the scoring checks, and one trained in the test on
reverse-text pairs (the right reversal over a corrupted one) for the GRPO run.
"""

from __future__ import annotations

import json
import random
import re
import string
import subprocess
from pathlib import Path

import pytest
import torch
from enginetools import TINY_RL, cli, env, free_port, metrics

from prime_train.environments import (
    EnvironmentLoadError,
    load_environment,
    passes,
    prepare,
    score_batch,
)
from prime_train.reward_scorer import RewardScorer
from prime_train.vocab import PAD_TOKEN_ID


def save_reward_model(model, out: Path) -> Path:
    """`model` and the engine's byte tokenizer in `out`, as a reward run exports final/ (safetensors only)."""
    from prime_train.engine.tokenizer import build_byte_tokenizer

    model.save_pretrained(out, safe_serialization=True)
    build_byte_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def random_reward_model(tmp_path_factory) -> Path:
    """A random 2-layer Llama with a one-output score head, pad id set: scores that differ between completions."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=320,
        max_position_embeddings=128, num_labels=1, pad_token_id=PAD_TOKEN_ID,
    )  # fmt: skip
    return save_reward_model(LlamaForSequenceClassification(config).eval(), tmp_path_factory.mktemp("rm-random"))


def corrupt(answer: str, rng: random.Random) -> str:
    """A wrong answer near the right one: the word unreversed, a letter changed, two swapped, one dropped or added,
    or the answer cut short (to nothing too: a reward model never shown an empty answer may prize it)."""
    while True:
        kind = rng.randrange(7)
        i = rng.randrange(len(answer))
        letter = rng.choice(string.ascii_lowercase)
        if kind == 0:
            wrong = answer[::-1]
        elif kind == 1:
            wrong = answer[:i] + letter + answer[i + 1 :]
        elif kind == 2 and i + 1 < len(answer):
            wrong = answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :]
        elif kind == 3:
            wrong = answer[:i] + answer[i + 1 :]
        elif kind == 4:
            wrong = answer[:i] + letter + answer[i:]
        elif kind == 5:
            wrong = answer[:i]
        else:
            wrong = answer + answer[-1] * rng.randint(1, 8)
        if wrong != answer:
            return wrong


def preference_pairs(n: int, seed: int, letters: tuple[int, int] = (3, 4)) -> list[tuple[str, str, str]]:
    """(prompt, chosen, rejected) reverse-text pairs: the right reversal over a corrupted one."""
    from prime_train.tasks import ReverseTextTask

    task, rng = ReverseTextTask(*letters), random.Random(f"pairs:{seed}")
    out = []
    for _ in range(n):
        example = task.generate(rng)
        out.append((example.prompt, example.answer, corrupt(example.answer, rng)))
    return out


def train_reward_model(scorer: RewardScorer, steps: int, batch: int = 32, lr: float = 1e-3) -> None:
    """Bradley-Terry on reverse-text pairs with plain torch, on the sequences the scorer scores."""
    model = scorer.model.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = model.config.pad_token_id
    for step in range(steps):
        pairs = preference_pairs(batch, seed=step)
        sequences = [scorer.encode(p, c) for p, c, _ in pairs] + [scorer.encode(p, r) for p, _, r in pairs]
        width = max(map(len, sequences))
        ids = torch.tensor([s + [pad] * (width - len(s)) for s in sequences])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences])
        scores = model(input_ids=ids, attention_mask=mask).logits[:, 0]
        loss = -torch.nn.functional.logsigmoid(scores[:batch] - scores[batch:]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().requires_grad_(False)


def pair_accuracy(scorer: RewardScorer, pairs: list[tuple[str, str, str]]) -> float:
    chosen = scorer.score([(p, c) for p, c, _ in pairs])
    rejected = scorer.score([(p, r) for p, _, r in pairs])
    return sum(c > r for c, r in zip(chosen, rejected, strict=True)) / len(pairs)


@pytest.fixture(scope="session")
def trained_reward_model(tmp_path_factory, half_trained_sft_model) -> Path:
    """A reward model on the 60-step SFT model's layers (RLHF's usual start) with a new score head, trained on
    reverse-text pairs for a few seconds; held-out pair accuracy is checked."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("rm-trained")
    model = LlamaForSequenceClassification.from_pretrained(
        half_trained_sft_model, num_labels=1, pad_token_id=PAD_TOKEN_ID, use_safetensors=True
    )
    save_reward_model(model, out)
    scorer = RewardScorer(str(out), device="cpu")
    scorer.load()
    train_reward_model(scorer, steps=150)
    scorer.model.save_pretrained(out, safe_serialization=True)
    return out


# ---------------------------------------------------------------- scoring


def reward_env(path: Path, **args):
    return load_environment("reward-model", {"path": str(path), "device": "cpu", **args})


COMPLETIONS = ["cba", "abc", "", "cbaaaaaaaaaaaa", "c<|eos|>junk after the end", "zz\nmore lines", "b", "cbba"]


def test_a_batch_scores_as_each_completion_alone_and_as_prompt_then_completion_then_eos(random_reward_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    env = reward_env(random_reward_model, batch_size=3)  # several padded batches of mixed lengths
    prompts = env.prompts("train", len(COMPLETIONS), seed=0)
    batched = score_batch(env, prompts, COMPLETIONS)
    alone = [env.reward(p, c) for p, c in zip(prompts, COMPLETIONS, strict=True)]
    assert batched == pytest.approx(alone, abs=1e-5)
    assert len({round(s, 4) for s in batched}) == len(batched)  # the completions are told apart
    # the text scored: prompt, then the completion up to its eos, then eos; the model's output at that eos
    tok = AutoTokenizer.from_pretrained(random_reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(random_reward_model, use_safetensors=True).eval()
    for prompt, completion, score in zip(prompts, COMPLETIONS, batched, strict=True):
        text = prompt.text + completion.split(tok.eos_token)[0]
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        assert score == pytest.approx(expected, abs=1e-5), (prompt.text, completion)


def test_the_reward_is_model_weight_times_the_score_plus_rule_weight_times_the_tasks_reward(random_reward_model):
    model_only = reward_env(random_reward_model, min_letters=3, max_letters=3)
    mixed = reward_env(random_reward_model, model_weight=0.5, rule_weight=2, min_letters=3, max_letters=3)
    rule_only = reward_env(random_reward_model, model_weight=0, rule_weight=1, min_letters=3, max_letters=3)
    rule = load_environment("reverse-text", {"min_letters": 3, "max_letters": 3})
    prompts = rule.prompts("train", 4, seed=1)
    assert mixed.prompts("train", 4, seed=1) == prompts  # the task's prompts, the same splits
    assert mixed.prompts("eval", 8, seed=1) == rule.prompts("eval", 8, seed=1)
    completions = [prompts[0].answer, prompts[1].answer[:2], "zzz", prompts[3].answer + "x"]
    scores = score_batch(model_only, prompts, completions)
    rules = [rule.reward(p, c) for p, c in zip(prompts, completions, strict=True)]
    assert rules[0] == 1.0 and 0 < rules[1] < 1  # partial credit by default, as the task's environment gives
    expected = [0.5 * s + 2 * r for s, r in zip(scores, rules, strict=True)]
    assert score_batch(mixed, prompts, completions) == pytest.approx(expected, abs=1e-5)
    assert score_batch(rule_only, prompts, completions) == rules
    # the pass rate is the task's exact match, whatever the reward model thinks
    assert [passes(mixed, p, c, 0.0) for p, c in zip(prompts, completions, strict=True)] == [True, False, False, False]


def test_rule_environments_are_scored_one_by_one_through_the_same_call():
    env = load_environment("reverse-text")
    prompts = env.prompts("train", 3, seed=0)
    completions = [prompts[0].answer, "x", prompts[2].answer[:-1]]
    one_by_one = [env.reward(p, c) for p, c in zip(prompts, completions, strict=True)]
    assert score_batch(env, prompts, completions) == one_by_one
    rewards = [1.0, 0.0, 0.99]
    assert [passes(env, p, c, r) for p, c, r in zip(prompts, completions, rewards, strict=True)] == [True, False, False]
    with pytest.raises(ValueError, match="3 prompts for 2 completions"):
        score_batch(env, prompts, completions[:2])


# ---------------------------------------------------------------- bad input


def _causal_lm_dir(path: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                         vocab_size=320)  # fmt: skip
    return save_reward_model(LlamaForCausalLM(config), path)


def _edit_config(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    return Path(shutil.copytree(src, dst))


BAD_REWARD_MODELS = {
    # name: (how to make it from a good copy at `p`, what the message says)
    "missing": (lambda p, good: p / "nothing-here", "no such directory"),
    "a file": (lambda p, good: (p.mkdir(), (p / "model.txt").write_text("x"))[0] or p / "model.txt", "is a file"),
    "no config": (lambda p, good: (_copy(good, p), (p / "config.json").unlink())[0], "has no config.json"),
    "config not json": (lambda p, good: (_copy(good, p), (p / "config.json").write_text("{"))[0], "as JSON"),
    "a causal LM": (lambda p, good: _causal_lm_dir(p), "LlamaForCausalLM, not a reward model"),
    "two labels": (
        lambda p, good: (_copy(good, p), _edit_config(p, id2label={"0": "bad", "1": "good"}))[0],
        "num_labels = 2",
    ),
    "pickle weights only": (
        lambda p, good: (
            _copy(good, p),
            (p / "model.safetensors").rename(p / "pytorch_model.bin"),
        )[0],
        "pytorch_model.bin (pickle",
    ),
    "no weights": (lambda p, good: (_copy(good, p), (p / "model.safetensors").unlink())[0], "has no weights"),
    "no tokenizer": (
        lambda p, good: (_copy(good, p), (p / "tokenizer.json").unlink(), (p / "tokenizer_config.json").unlink())[0],
        "has no tokenizer files",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_REWARD_MODELS))
def test_a_path_that_is_not_a_reward_model_is_refused_naming_the_path_and_why(case, random_reward_model, tmp_path):
    make, message = BAD_REWARD_MODELS[case]
    path = make(tmp_path / "rm", random_reward_model)
    with pytest.raises(EnvironmentLoadError) as raised:
        reward_env(path)
    assert f"rl.env_args.path = {str(path)!r}" in str(raised.value) and message in str(raised.value)


def test_the_environments_own_arguments_are_checked_before_the_model(random_reward_model):
    cases = {
        "needs rl.env_args.path": {},
        "rl.env_args.task = 'poetry' is not a built-in task": {"path": "x", "task": "poetry"},
        "rl.env_args.model_weight must be a number >= 0": {"path": "x", "model_weight": -1},
        "both 0": {"path": "x", "model_weight": 0},
        "rl.env_args.device must be one of auto, cpu, cuda": {"path": "x", "device": "tpu"},
        "rl.env_args.batch_size must be a whole number": {"path": "x", "batch_size": 0},
        "['pth'] not accepted by the reward-model environment": {"path": "x", "pth": "y"},
    }
    for message, args in cases.items():
        with pytest.raises(EnvironmentLoadError, match=re.escape(message)):
            load_environment("reward-model", args)
    # and the task's own arguments reach the task
    env = reward_env(random_reward_model, min_letters=5, max_letters=5, partial_credit=False)
    assert all(len(p.answer) == 5 for p in env.prompts("train", 20, seed=0))


def test_weights_that_do_not_load_are_a_load_error_before_training(random_reward_model, tmp_path):
    broken = _copy(random_reward_model, tmp_path / "rm")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    env = reward_env(broken)  # the files are all there: nothing is loaded yet (lint and preflight stay torch-free)
    with pytest.raises(EnvironmentLoadError, match=r"rl\.env_args\.path = .* does not load"):
        prepare(env)


def write_rl_config(tmp_path: Path, path: str) -> Path:
    config = tmp_path / "rl.toml"
    config.write_text(
        f'[run]\njob = "rl"\noutput_dir = "{tmp_path / "runs"}"\n\n[rl]\nenvironment = "reward-model"\n'
        f'env_args = {{ path = "{path}", min_letters = 3 }}\n'
    )
    return config


def test_lint_and_preflight_refuse_a_path_that_is_not_a_reward_model_at_its_line(tmp_path):
    from prime_train.config.loader import load_config
    from prime_train.validator.lint import lint_files
    from prime_train.validator.rl_checks import check_reward_model

    missing = tmp_path / "no-reward-model"
    config = write_rl_config(tmp_path, str(missing))
    problems, _ = lint_files([str(config)])
    [problem] = [p for p in problems if p.severity == "error"]
    assert (problem.key, problem.line) == ("rl.env_args", 7)
    assert f"rl.env_args.path = {str(missing)!r} no such directory" in problem.message
    check = check_reward_model(load_config([str(config)]), trainer_gpus=[])
    assert check.status == "fail" and "no such directory" in check.message


def test_preflight_says_where_a_good_reward_model_scores(tmp_path, random_reward_model):
    from prime_train.config.loader import load_config
    from prime_train.validator.rl_checks import check_reward_model

    cfg = load_config([str(write_rl_config(tmp_path, str(random_reward_model)))])
    check = check_reward_model(cfg, trainer_gpus=[])
    assert check.status == "pass", check.message
    assert "LlamaForSequenceClassification" in check.message and "on the CPU" in check.message
    assert "on the trainer's GPU" in check_reward_model(cfg, trainer_gpus=["0"]).message


# ---------------------------------------------------------------- GRPO against the learned reward


@pytest.mark.slow
def test_grpo_against_a_trained_reward_model_raises_its_reward(tmp_path, half_trained_sft_model, trained_reward_model):
    """The README's RL example on a small budget with rl.environment = "reward-model": the sampled reward (the reward
    model's score) rises, the pass rate logged is the task's exact match, and a held-out eval runs."""
    held_out = preference_pairs(200, seed=10**6)
    scorer = RewardScorer(str(trained_reward_model), device="cpu")
    assert pair_accuracy(scorer, held_out) >= 0.7  # a reward model that ranks the right answer first, mostly
    steps = 20
    overrides = {
        "run.output_dir": tmp_path, "run.name": "rm", "model.path": half_trained_sft_model,
        "inference.base_port": free_port(), "logging.tensorboard": "false", "supervisor.poll_interval_s": 0.5,
        "rl.environment": "reward-model", "rl.env_args.path": trained_reward_model, "rl.env_args.device": "cpu",
        "train.max_steps": steps, "rl.prompts_per_step": 16, "rl.env_args.min_letters": 3,
        "rl.env_args.max_letters": 3, "train.eval_interval": 10, "rl.eval_prompts": 32,
    }  # fmt: skip
    args = [arg for key, value in overrides.items() for arg in (f"--{key}", str(value))]
    result = subprocess.run(cli("run", str(TINY_RL), *args), env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    rows = {r["step"]: r for r in metrics(tmp_path / "rm") if "reward" in r}
    assert sorted(rows) == list(range(1, steps + 1))
    first = sum(rows[s]["reward"] for s in range(1, 6)) / 5
    last = sum(rows[s]["reward"] for s in range(steps - 4, steps + 1)) / 5
    assert last >= first + 0.1, (first, last)
    # the reward is the model's score, not the task's 0/1 exact match (whose mean would equal the pass rate at every
    # step); the pass rate is that exact match (the 60-step model is right about 40% of the time on 3-letter words)
    assert 0 < rows[1]["pass_rate"] < 1
    assert all(abs(r["reward"] - r["pass_rate"]) > 1e-6 for r in rows.values()), [
        (r["reward"], r["pass_rate"]) for r in rows.values()
    ]
    evals = [r for r in metrics(tmp_path / "rm") if "eval_pass_rate" in r]
    assert {r["step"] for r in evals} >= {0, steps} and all("eval_reward" in r for r in evals)


# ---------------------------------------------------------------- docs/rlhf.md's pipeline: the learned reward alone


def _cli_ok(*argv: str, timeout: float = 900) -> subprocess.CompletedProcess:
    result = subprocess.run(cli(*argv), env=env(), capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (argv[:2], result.stdout[-3000:] + result.stderr[-3000:])
    return result


@pytest.fixture(scope="module")
def closer_start_pipeline(tmp_path_factory) -> Path:
    """docs/rlhf.md's last section as its commands run it: a 90-step SFT model of the tiny default; its own graded
    mistakes on 1024 train prompts as pairs (sample-pairs); configs/examples/tiny-reward.toml on those and the
    built-in pairs, half and half; then GRPO from the SFT model against that reward model alone, KL 1.0. About five
    minutes on one core."""
    from enginetools import REPO, run_train

    out = tmp_path_factory.mktemp("rlhf")
    sft = run_train(out, "sft90", **{"train.max_steps": 90, "data.datasets.0.num_examples": 20000,
                                     "ckpt.interval": 1000})  # fmt: skip
    assert sft.returncode == 0, sft.stdout[-3000:] + sft.stderr[-3000:]
    model = out / "sft90" / "final"
    pairs = out / "sft90-pairs.jsonl"
    sampled = _cli_ok("sample-pairs", str(TINY_RL), "--model.path", str(model), "--out", str(pairs),
                      "--prompts", "1024", "--samples", "8", "--graded-gap", "0.25", "--json").stdout  # fmt: skip
    (out / "sampled.json").write_text(sampled)
    overlay = out / "rm90.toml"
    overlay.write_text(
        '[data]\nsampling_probs = [0.5, 0.5]\n[[data.datasets]]\ntask = "reverse-text"\nnum_examples = 20000\n'
        f"[[data.datasets]]\npath = {json.dumps(str(pairs))}\n"
    )
    _cli_ok("train", str(REPO / "configs" / "examples" / "tiny-reward.toml"), str(overlay), "--run.output_dir",
            str(out), "--run.name", "rm90", "--model.path", str(model), "--logging.tensorboard", "false",
            "--ckpt.interval", "1000")  # fmt: skip
    _cli_ok("run", str(TINY_RL), "--run.output_dir", str(out), "--run.name", "rl90", "--model.path", str(model),
            "--rl.environment", "reward-model", "--rl.env_args.path", str(out / "rm90" / "final"),
            "--rl.eval_prompts", "200", "--rl.scale_rewards", "group", "--train.lr", "2e-4", "--rl.kl_coef", "1.0",
            "--train.max_steps", "100", "--train.eval_interval", "20", "--inference.base_port", str(free_port()),
            "--logging.tensorboard", "false")  # fmt: skip
    return out


@pytest.mark.slow
def test_rl_against_the_learned_reward_alone_raises_its_score_and_the_exact_match_pass_rate(closer_start_pipeline):
    """Issue 29's last point. The policy never sees the task's rule: its reward is the reward model's score alone. The
    pass rate is the task's exact match of the greedy answer on the 200 held-out prompts, which neither the reward
    model's pairs nor the RL prompts come from. Measured (docs/rlhf.md): 0.805 -> 0.89 at step 100, score +0.9, KL
    under 0.18 nats; at KL 0.1 the same reward model is gamed to a pass rate of 0 within 30 steps."""
    out = closer_start_pipeline
    sampled = json.loads((out / "sampled.json").read_text())
    assert sampled["pairs"] >= 1000 and 0.5 < sampled["pass_rate"] < 0.9, sampled  # its own mistakes, labelled
    rm_evals = [r for r in metrics(out / "rm90") if "eval_preference_accuracy" in r]
    assert rm_evals[-1]["step"] == 1000 and rm_evals[-1]["eval_preference_accuracy"] >= 0.75, rm_evals[-1]
    rows = metrics(out / "rl90")
    evals = {r["step"]: r for r in rows if "eval_pass_rate" in r}
    assert sorted(evals) == [0, 20, 40, 60, 80, 100], sorted(evals)
    start, end = evals[0], evals[100]
    assert 0.6 < start["eval_pass_rate"] < 0.9, start  # room to learn, and answers right often enough to rank
    # the score the reward model gives the greedy answers rose, and the exact match with it: +0.085 on the machine the
    # recipe was chosen on, +0.03 (0.805 -> 0.835, the last three evals 0.82, 0.835, 0.835) with the same commands on
    # another whose float rounding differed from the SFT model on (its samples passed 0.7123 of the time, not 0.7125)
    assert end["eval_reward"] >= start["eval_reward"] + 0.4, (start, end)
    rates = [(s, r["eval_pass_rate"]) for s, r in evals.items()]
    assert end["eval_pass_rate"] >= start["eval_pass_rate"] + 0.02, rates
    assert sum(evals[s]["eval_pass_rate"] for s in (60, 80, 100)) / 3 >= start["eval_pass_rate"] + 0.01, rates
    assert min(r["eval_pass_rate"] for r in evals.values()) >= start["eval_pass_rate"] - 0.04  # never gamed on the way
    # near the start the reward model was trained on (one step's estimate is noisy: measured up to 0.5)
    kl = [r["kl"] for r in rows if "kl" in r]
    assert len(kl) == 100 and sum(kl[-20:]) / 20 < 0.25, kl[-20:]
