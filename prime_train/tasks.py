"""Built-in generated tasks: training data with no download, and exact-match scoring for eval and RL.

Each task turns a seeded `random.Random` into a short prompt and its one right answer. Prompts stay
under 32 bytes so a ~1M-parameter model on CPU learns a task within a few hundred steps.
"""

from __future__ import annotations

import functools
import json
import random
import string
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# A completion's answer ends at the first newline or end-of-sequence marker. Decoded text may keep
# special tokens (`<|eos|>`, `<|im_end|>`, `</s>`); no built-in answer contains '<', so cutting there is safe.
_ANSWER_STOPS = ("\n", "<|", "</s>")


@dataclass(frozen=True)
class Example:
    """One task instance: the text the model sees and the answer it must produce."""

    prompt: str
    answer: str


def extract_answer(completion: str) -> str:
    """The answer part of a completion: text up to the first newline or eos marker, stripped."""
    end = len(completion)
    for stop in _ANSWER_STOPS:
        found = completion.find(stop)
        if found != -1:
            end = min(end, found)
    return completion[:end].strip()


class Task:
    """A generated task: `generate` makes an example, `score` grades a completion of its prompt."""

    name: str = ""

    def generate(self, rng: random.Random) -> Example:
        """A new example drawn from `rng`."""
        raise NotImplementedError

    def score(self, example: Example, completion: str) -> float:
        """1.0 when the completion's answer equals the example's answer exactly, else 0.0."""
        return 1.0 if extract_answer(completion) == example.answer else 0.0


class ArithmeticTask(Task):
    """Addition and subtraction of two one-digit numbers: '7+5=' -> '12', '3-8=' -> '-5'."""

    name = "arithmetic"

    # One-digit operands: a 0.5M-parameter model reaches ~0.9 exact match on unseen problems in 300 steps
    # of 32 x 128 tokens; with operands below 20 it was at 0.46 and still climbing (measured on CPU).
    def __init__(self, max_operand: int = 10) -> None:
        self.max_operand = max_operand

    def generate(self, rng: random.Random) -> Example:
        """A random `a+b=` or `a-b=` with operands in [0, max_operand)."""
        a = rng.randrange(self.max_operand)
        b = rng.randrange(self.max_operand)
        if rng.random() < 0.5:
            return Example(prompt=f"{a}+{b}=", answer=str(a + b))
        return Example(prompt=f"{a}-{b}=", answer=str(a - b))


class ReverseTextTask(Task):
    """Reverse a short lowercase word: 'reverse abcd=' -> 'dcba'."""

    name = "reverse-text"

    def __init__(self, min_letters: int = 3, max_letters: int = 6) -> None:
        self.min_letters = min_letters
        self.max_letters = max_letters

    def generate(self, rng: random.Random) -> Example:
        """A random lowercase word of min_letters..max_letters letters."""
        length = rng.randint(self.min_letters, self.max_letters)
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(length))
        return Example(prompt=f"reverse {word}=", answer=word[::-1])


class SortingTask(Task):
    """Sort a few digits: 'sort 3142=' -> '1234'."""

    name = "sorting"

    def __init__(self, min_items: int = 3, max_items: int = 6, alphabet: str = string.digits) -> None:
        self.min_items = min_items
        self.max_items = max_items
        self.alphabet = alphabet

    def generate(self, rng: random.Random) -> Example:
        """A random string of min_items..max_items characters of the alphabet, repeats allowed."""
        length = rng.randint(self.min_items, self.max_items)
        items = "".join(rng.choice(self.alphabet) for _ in range(length))
        return Example(prompt=f"sort {items}=", answer="".join(sorted(items)))


TASKS: dict[str, Task] = {task.name: task for task in (ArithmeticTask(), ReverseTextTask(), SortingTask())}


def get_task(name: str) -> Task:
    """The registered task called `name`."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; built-in tasks are: {', '.join(sorted(TASKS))}") from None


def generate_examples(name: str, n: int, seed: int) -> list[Example]:
    """`n` examples of task `name`, the same for the same (name, n, seed) on any machine."""
    return list(_examples(name, n, seed))


@functools.lru_cache(maxsize=8)
def _examples(name: str, n: int, seed: int) -> tuple[Example, ...]:
    """Generated once a process: a trainer reads a task's examples for its rows, its held-out loss and its exact
    match (three passes over the same 20k examples, ~0.2 s each on the default job)."""
    return tuple(iter_examples(name, n, seed))


def iter_examples(name: str, n: int, seed: int) -> Iterator[Example]:
    """generate_examples' examples one at a time: the first k of any n are the same, and cost only their own
    making (the exact-match eval needs its few held-out examples, not all n)."""
    task = get_task(name)
    # Seeding with a string is stable across processes (hash randomisation does not apply to it).
    rng = random.Random(f"{name}:{seed}")
    for _ in range(n):
        yield task.generate(rng)


def read_multiple_choice(path: str | Path, limit: int = 500) -> list[tuple[str, list[str], int]]:
    """The (context, endings, label) records of a HellaSwag-style JSONL file (train.mc_eval_path), at most `limit`.

    Raises ValueError naming the file and line of the first record that is not one: the engine's evaluation and
    lint both read it here, so a file lint accepts is one the evaluation can score."""
    items: list[tuple[str, list[str], int]] = []
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read as UTF-8 text ({exc.__class__.__name__})") from None
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            context, endings, label = record["context"], record["endings"], record["label"]
            if isinstance(label, str) and label.strip().isdigit():
                label = int(label)  # HF's hellaswag stores its labels as text ("0".."3")
            # an empty ending has no tokens to score (it would win with loss 0); a string is not a list of them
            if not isinstance(context, str) or not isinstance(endings, list) or not endings:
                raise ValueError("context must be a string and endings a non-empty list")
            if not all(isinstance(e, str) and e for e in endings):
                raise ValueError("every ending must be a non-empty string")
            if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
                raise ValueError(f"label {label!r} is not an index into the {len(endings)} endings")
            items.append((context, endings, label))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"{path}:{lineno}: a multiple-choice record needs context, endings, label ({exc})"
            ) from None
        if len(items) >= limit:
            break
    if not items:
        raise ValueError(f"{path}: holds no multiple-choice record")
    return items
