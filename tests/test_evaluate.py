"""The engine's evaluation functions against independent computations on real tiny Llama models (CPU, one process)."""

from __future__ import annotations

import json
import math
import re
import string

import pytest
import torch
import torch.nn.functional as F
from enginetools import tiny_llama as _tiny_llama

from prime_train.config.schema import DataConfig, DatasetConfig, DistributedConfig
from prime_train.engine import parallel
from prime_train.engine.data import build_eval_batches
from prime_train.engine.evaluate import eval_loss, exact_match, greedy_complete, multiple_choice
from prime_train.engine.metrics import EngineConfigError
from prime_train.tasks import Example, get_task
from prime_train.validator.lint import lint_files

VOCAB = 320  # the byte tokenizer's 261 tokens padded to a multiple of 64


@pytest.fixture(scope="module")
def tokenizer(byte_tokenizer):
    return byte_tokenizer


@pytest.fixture
def dist(monkeypatch):
    # no torchrun variables: init_distributed describes one process and joins no process group
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    info = parallel.init_distributed(DistributedConfig())
    assert info.world_size == 1 and not torch.distributed.is_initialized()
    return info


@pytest.fixture
def autocast(dist):
    return lambda: parallel.autocast("fp32", dist.device)


def tiny_llama(tokenizer, *, seed: int = 0, hidden: int = 32, initializer_range: float = 0.02):
    """The shared tiny Llama over the byte vocabulary, with the tokenizer's special tokens."""
    return _tiny_llama(
        seed, vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, initializer_range=initializer_range,
    )  # fmt: skip


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------- greedy decoding


@pytest.mark.parametrize("native", [False, True], ids=["transformers", "native"])
def test_greedy_complete_matches_generate_for_left_padded_batch(tokenizer, dist, autocast, native):
    # A wide init makes the continuation depend on the prompt; zeroing the output rows of every token but
    # ASCII letters, digits and eos makes greedy pick one of those (a row of zeros scores 0, below the best
    # of ~65 random logits), so the decoded text is the token sequence itself, not U+FFFD for stray bytes.
    model = tiny_llama(tokenizer, seed=0, initializer_range=0.2)
    allowed = [ord(c) for c in string.ascii_letters + string.digits + " +=-"] + [tokenizer.eos_token_id]
    with torch.no_grad():
        silenced = torch.ones(VOCAB, dtype=torch.bool)
        silenced[allowed] = False
        model.lm_head.weight[silenced] = 0.0
    prompts = ["7+5=", "reverse abcdef=", "x", "sort 31415926535=", "hello world, how are you?"]
    max_new_tokens = 12

    expected = []
    for prompt in prompts:
        ids = torch.tensor([ids_of(tokenizer, prompt)])
        new = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens
        )[0, ids.size(1) :].tolist()
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id)]
        expected.append(tokenizer.decode(new, skip_special_tokens=True))

    decoder = model
    if native:
        from prime_train.engine.llama import NativeCausalLM

        decoder = NativeCausalLM(model.config)
        decoder.load_state_dict(model.state_dict())
    # each step projects only the last position onto the vocabulary (logits_to_keep), not every one
    widths = []
    hook = decoder.lm_head.register_forward_hook(lambda _m, args, _out: widths.append(args[0].shape[1]))
    try:
        got = greedy_complete(decoder, tokenizer, prompts, dist, autocast, max_new_tokens=max_new_tokens)
    finally:
        hook.remove()
    assert got == expected
    assert widths == [1] * max_new_tokens
    # the comparison has teeth: prompts of five lengths, distinct continuations, one cut short by eos
    assert len(set(expected)) == len(prompts)
    assert any(len(text) < max_new_tokens for text in expected)


# ---------------------------------------------------------------- multiple choice


def mean_ending_loss(model, tokenizer, context: str, ending: str) -> float:
    """Mean negative log-likelihood of the ending's tokens, each predicted from everything before it."""
    ctx, end = ids_of(tokenizer, context), ids_of(tokenizer, ending)
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([ctx + end])).logits[0].float(), dim=-1)
    return -sum(float(logprobs[len(ctx) + i - 1, token]) for i, token in enumerate(end)) / len(end)


def test_multiple_choice_accuracy_equals_independent_loss_argmin(tokenizer, dist, autocast, tmp_path):
    model = tiny_llama(tokenizer, seed=1, initializer_range=0.2)
    # endings of different lengths, so a sum of losses would pick differently from a mean
    questions = [
        ("The cat sat on the", [" mat", " hat.", " moon tonight", " x"]),
        ("2+2=", ["4", "22", "five", "-1"]),
        ("reverse abc=", ["cba", "abc", "bca"]),
        ("Paris is in", [" France", " Spain", " the sea!"]),
        ("sort 321=", ["123", "321"]),
        ("Hello,", [" world", " there friend", "!!"]),
    ]
    best = [
        min(range(len(endings)), key=lambda e: mean_ending_loss(model, tokenizer, context, endings[e]))
        for context, endings in questions
    ]
    # the first four labels are the model's choice and the last two are not: accuracy 4/6 by construction
    labels = best[:4] + [(b + 1) % len(q[1]) for b, q in zip(best[4:], questions[4:], strict=True)]
    path = tmp_path / "mc.jsonl"
    lines = [
        json.dumps({"context": c, "endings": e, "label": lab}) for (c, e), lab in zip(questions, labels, strict=True)
    ]
    path.write_text("\n".join([*lines[:3], "", *lines[3:]]) + "\n")  # a blank line is skipped

    expected = sum(b == lab for b, lab in zip(best, labels, strict=True)) / len(questions)
    assert expected == pytest.approx(4 / 6)
    assert multiple_choice(model, tokenizer, path, dist, autocast) == pytest.approx(expected)
    assert not model.training


@pytest.mark.parametrize(
    "bad_line",
    [
        '{"context": "a", "endings": ["b", "c"]}',
        '{"context": "a", "endings": ["b"], "label": "x"}',
        "{not json",
        '{"context": "a", "endings": ["b", "c"], "label": 2}',
        '{"context": "a", "endings": [], "label": 0}',
        '{"context": "a", "endings": "bc", "label": 0}',
        '{"context": "a", "endings": ["b", ""], "label": 0}',
    ],
    ids=[
        "missing-label",
        "label-not-int",
        "not-json",
        "label-out-of-range",
        "no-endings",
        "endings-string",
        "empty-ending",
    ],
)
def test_multiple_choice_malformed_line_names_file_and_line(tokenizer, dist, autocast, tmp_path, bad_line):
    model = tiny_llama(tokenizer)
    path = tmp_path / "mc.jsonl"
    good = json.dumps({"context": "a", "endings": ["b", "c"], "label": 0})
    path.write_text(f"{good}\n\n{bad_line}\n{good}\n")
    with pytest.raises(EngineConfigError, match=re.escape(f"train.mc_eval_path: {path}:3:")):
        multiple_choice(model, tokenizer, path, dist, autocast)
    # lint reads the file the same way, and says so before a run starts
    cfg = tmp_path / "mc.toml"
    cfg.write_text(f'[train]\nmc_eval_path = "{path}"\n')
    problems, _ = lint_files([str(cfg)], [])
    assert [p.key for p in problems if p.severity == "error"] == ["train.mc_eval_path"]
    assert f"{path}:3: a multiple-choice record needs context, endings, label" in problems[0].message


def test_multiple_choice_takes_hellaswag_s_text_labels_and_refuses_a_file_with_no_record(tmp_path):
    from prime_train.tasks import read_multiple_choice

    path = tmp_path / "mc.jsonl"
    path.write_text(json.dumps({"context": "a", "endings": ["b", "c"], "label": "1"}) + "\n")
    assert read_multiple_choice(path) == [("a", ["b", "c"], 1)]
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no multiple-choice record"):
        read_multiple_choice(path)


# ---------------------------------------------------------------- exact match


def test_exact_match_scores_trained_answer_one_and_other_answer_zero(tokenizer, dist, autocast):
    model = tiny_llama(tokenizer, seed=2, hidden=64).train()
    prompt, answer = ids_of(tokenizer, "7+5="), ids_of(tokenizer, "12")
    ids = torch.tensor([prompt + answer + [tokenizer.eos_token_id]])
    labels = ids.clone()
    labels[:, : len(prompt)] = -100
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(40):
        loss = F.cross_entropy(model(input_ids=ids).logits[0, :-1], labels[0, 1:], ignore_index=-100)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()

    score = get_task("arithmetic").score
    right, wrong = Example("7+5=", "12"), Example("7+5=", "13")
    assert greedy_complete(model, tokenizer, ["7+5="], dist, autocast) == ["12"]
    assert exact_match(model, tokenizer, [right], score, dist, autocast)[0] == 1.0
    assert exact_match(model, tokenizer, [wrong], score, dist, autocast)[0] == 0.0
    # several batches: the mean is over examples, not over batches
    accuracy, samples = exact_match(
        model, tokenizer, [right, wrong, right, right, wrong], score, dist, autocast, batch_size=2
    )
    assert accuracy == pytest.approx(3 / 5)
    assert samples == [("7+5=", "12", "12"), ("7+5=", "13", "12"), ("7+5=", "12", "12")]


# ---------------------------------------------------------------- held-out loss


def test_eval_loss_is_mean_next_token_loss_over_labelled_positions(tokenizer, dist, autocast):
    model = tiny_llama(tokenizer, seed=3, initializer_range=0.2).train()
    data = DataConfig(datasets=[DatasetConfig(task="arithmetic", num_examples=400)], seq_len=32, held_out_fraction=0.2)
    batches = build_eval_batches(
        data, tokenizer, job="sft", micro_batch_size=4, rank=0, world_size=1, seed=0, max_batches=3
    )
    assert len(batches) == 3

    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model.eval()(input_ids=batch.input_ids, position_ids=batch.position_ids).logits.double()
            logprobs = torch.log_softmax(logits, dim=-1)
            for row, col in (batch.labels != -100).nonzero().tolist():
                if col == 0:  # nothing precedes the first token, so it is never predicted
                    continue
                total -= float(logprobs[row, col - 1, batch.labels[row, col]])
                count += 1
    model.train()
    # sft labels only completions: fewer labelled positions than tokens, or the masking is not exercised
    assert 0 < count < sum(b.num_tokens for b in batches)

    result = eval_loss(model, batches, dist, autocast)
    assert result["eval_loss"] == pytest.approx(total / count, rel=1e-5)
    assert result["eval_ppl"] == pytest.approx(math.exp(result["eval_loss"]), rel=1e-9)
    assert model.training  # eval_loss puts the model back in the mode it found it in


def test_held_out_completions_split_own_data_at_the_first_labelled_token(tokenizer, dist, autocast):
    # a run on own prompt/completion data logged no sample generations: these are its prompts and answers
    from prime_train.engine.evaluate import held_out_completions

    data = DataConfig(
        seq_len=96,
        held_out_fraction=0.5,
        datasets=[DatasetConfig(path="configs/examples/data/spell-numbers.jsonl", format="prompt_completion")],
    )
    batches = build_eval_batches(
        data, tokenizer, job="sft", micro_batch_size=4, rank=0, world_size=1, seed=0, max_batches=1
    )
    pairs = held_out_completions(batches, limit=3)
    assert len(pairs) == 3
    for prompt, expected in pairs:
        assert tokenizer.decode(prompt, skip_special_tokens=True).startswith("Spell out ")
        assert tokenizer.decode(prompt, skip_special_tokens=True).endswith(": ")
        assert any(w in tokenizer.decode(expected, skip_special_tokens=True) for w in ("hundred", "ty", "teen"))
    # the ids go to greedy decoding as they are, no re-tokenizing
    outputs = greedy_complete(tiny_llama(tokenizer), tokenizer, [p for p, _ in pairs], dist, autocast, 4)
    assert len(outputs) == 3 and all(isinstance(o, str) for o in outputs)
    # pretraining takes loss on every token: no prompt, no sample
    text = DataConfig(seq_len=64, held_out_fraction=0.5, datasets=[DatasetConfig(task="reverse-text")])
    plain = build_eval_batches(text, tokenizer, job="pretrain", micro_batch_size=4, rank=0, world_size=1, seed=0,
                               max_batches=1)  # fmt: skip
    assert held_out_completions(plain) == []
