"""RL environments: a dataset of prompts and a reward function, behind one small protocol.

Four sources, chosen by `rl.environment`:
- a built-in generated task (reverse-text, arithmetic, sorting), no download;
- "reward-model": a built-in task's prompts, rewarded by a learned reward model (RewardModelEnvironment);
- a user module, "pkg.module:load_environment", called with `rl.env_args`;
- a `verifiers` environment, "verifiers:<env id>", adapted to the protocol (see VerifiersEnvironment).

Rewards are asked for a whole batch at once through `score_batch`: an environment with a `reward_batch` method
scores the batch in one call (the reward model, in padded batches), the others one completion at a time.

Torch-free: lint loads environments to tokenise their prompts (the reward model loads only when it first scores).
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import importlib
import inspect
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from prime_train import tasks
from prime_train.reward_scorer import DEVICES, RewardModelError, RewardScorer, check_reward_model

SPLITS = ("train", "eval")
# Fraction of a built-in task's prompt space (by content) that only ever appears in the eval split.
DEFAULT_EVAL_FRACTION = 0.1
# A split of a small task (arithmetic has 200 distinct prompts) runs out of new prompts; past this many
# draws per requested prompt the eval split stops looking for distinct ones and repeats what it has.
_MAX_DRAWS_PER_PROMPT = 50


class EnvironmentLoadError(ValueError):
    """`rl.environment` or `rl.env_args` does not give a usable environment; the message says what to change."""


@dataclass(frozen=True)
class Prompt:
    """One prompt of an environment: the text sent to the policy, its reference answer, and free-form data."""

    text: str
    answer: str | None = None
    info: dict = field(default_factory=dict, hash=False, compare=False)


@runtime_checkable
class Environment(Protocol):
    """Prompts to roll out and a reward for each completion."""

    name: str
    uses_tools: bool

    def prompts(self, split: str, n: int, seed: int) -> list[Prompt]:
        """`n` prompts of `split` ("train" or "eval"): deterministic in (split, n, seed); splits disjoint."""
        ...

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The completion's reward, in [0, 1] (a reward model's score is unbounded)."""
        ...


def score_batch(env: Environment, prompts: list[Prompt], completions: list[str]) -> list[float]:
    """The reward of each completion of its prompt: `env.reward_batch` where the environment has one (one call for
    the batch), else `env.reward` one by one."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    batch = getattr(env, "reward_batch", None)
    if callable(batch):
        rewards = [float(r) for r in batch(prompts, completions)]
        if len(rewards) != len(completions):
            raise ValueError(f"{env.name}: reward_batch gave {len(rewards)} rewards for {len(completions)} completions")
        return rewards
    return [env.reward(p, c) for p, c in zip(prompts, completions, strict=True)]


def passes(env: Environment, prompt: Prompt, completion: str, reward: float) -> bool:
    """Whether a completion counts towards the pass rate: `env.passed` where the environment has one (a reward
    model's score says nothing of right or wrong: the task's exact match does), else a reward of 1 or more."""
    passed = getattr(env, "passed", None)
    return bool(passed(prompt, completion)) if callable(passed) else reward >= 1.0


def prepare(env: Environment) -> None:
    """Load what scoring needs before the first rollout (`env.prepare`, where the environment has one): a reward
    model that does not load is then a configuration error before training starts, not a failed step."""
    ready = getattr(env, "prepare", None)
    if callable(ready):
        ready()


# ---------------------------------------------------------------- rewards of the built-ins


def similarity_reward(answer: str, completion: str) -> float:
    """1.0 for an exact answer, else difflib's character-level ratio 2·matches/(len(a)+len(b)), in [0, 1).

    Partial credit gives GRPO a signal from a policy that is not yet right: groups of all-zero rewards
    have zero advantage and teach nothing. The ratio is symmetric in length, so padding an answer with
    extra characters costs as much as leaving characters out.
    """
    got = tasks.extract_answer(completion)
    if got == answer:
        return 1.0
    # SequenceMatcher's ratio is 1.0 only for equal strings, so every inexact answer stays below 1.0.
    return difflib.SequenceMatcher(None, got, answer, autojunk=False).ratio()


def positional_reward(answer: str, completion: str) -> float:
    """1.0 for an exact answer, else the share of positions that hold the right character, over the longer length.

    Each character earns credit only in its place, and the longer of the two strings is the denominator, so a
    stop before the end earns no more than a wrong character in its place: trying the next character never
    costs reward. difflib's ratio (similarity_reward) pays a right prefix that stops early more than the same
    prefix with one wrong character after it, and GRPO from a half-trained model learnt to cut its answers short
    under it (sampled reward up, exact answers down; measured on the CPU, issue 16).
    """
    got = tasks.extract_answer(completion)
    if got == answer:
        return 1.0
    # equal strings are the only ones with every position right, so every inexact answer stays below 1.0
    return sum(a == b for a, b in zip(got, answer, strict=False)) / max(len(got), len(answer), 1)


def exact_reward(answer: str, completion: str) -> float:
    """1.0 for the exact answer, else 0.0 (env_args partial_credit = false)."""
    return 1.0 if tasks.extract_answer(completion) == answer else 0.0


def arithmetic_reward(answer: str, completion: str) -> float:
    """1.0 for the exact number; an integer off by d earns 0.5·max(0, 1 − d/10); anything else 0.

    Credit by numeric distance points a weak policy towards the right number rather than rewarding any
    digits (every answer of a one-digit problem has one or two digits, so digit-count credit would teach
    nothing); capped at 0.5 so a right answer always beats every near miss.
    """
    got = tasks.extract_answer(completion)
    if got == answer:
        return 1.0
    try:
        distance = abs(int(got) - int(answer))
    except ValueError:
        return 0.0
    return 0.5 * max(0.0, 1.0 - distance / 10.0)


_REWARDS: dict[str, Callable[[str, str], float]] = {
    "arithmetic": arithmetic_reward,
    "reverse-text": positional_reward,
    "sorting": positional_reward,
}
# Keyword arguments each built-in task's constructor takes (rl.env_args beyond eval_fraction).
_TASK_CLASSES: dict[str, type[tasks.Task]] = {
    "arithmetic": tasks.ArithmeticTask,
    "reverse-text": tasks.ReverseTextTask,
    "sorting": tasks.SortingTask,
}


# what `rl.environment` may name without a module: the tasks, and the reward model over a task's prompts
BUILTIN_ENVIRONMENTS = (*sorted(_TASK_CLASSES), "reward-model")


def _in_eval_split(text: str, eval_fraction: float) -> bool:
    """A prompt's split from its content alone: never in both splits, and the same eval set for every seed."""
    digest = hashlib.sha256(f"prime-train-rl-split:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


def _check_task_args(name: str, task_args: dict[str, Any]) -> None:
    """EnvironmentLoadError unless each of a built-in task's arguments has its default's type and the ranges are
    non-empty: rl.env_args come from a config, and a string where a count belongs would fail only when the first
    prompt is generated (in lint's token-budget check, or at step 1)."""
    params = inspect.signature(_TASK_CLASSES[name].__init__).parameters
    for key, value in task_args.items():
        default = params[key].default if key in params else None
        if isinstance(default, int) and not isinstance(default, bool):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EnvironmentLoadError(f"rl.env_args.{key} must be a whole number >= 1, got {value!r}")
        elif isinstance(default, str) and (not isinstance(value, str) or not value):
            raise EnvironmentLoadError(f"rl.env_args.{key} must be a non-empty string, got {value!r}")
    for low in [k for k in params if k.startswith("min_")]:
        high = "max_" + low[4:]
        lo = task_args.get(low, params[low].default)
        hi = task_args.get(high, params[high].default) if high in params else None
        if hi is not None and lo > hi:
            raise EnvironmentLoadError(f"rl.env_args.{low} ({lo}) must not exceed rl.env_args.{high} ({hi})")


class BuiltinEnvironment:
    """A generated task from prime_train.tasks as an environment."""

    uses_tools = False

    def __init__(
        self, name: str, eval_fraction: float = DEFAULT_EVAL_FRACTION, partial_credit: bool = True, **task_args: Any
    ) -> None:
        number = isinstance(eval_fraction, (int, float)) and not isinstance(eval_fraction, bool)
        if not number or not 0.0 < eval_fraction < 1.0:
            raise EnvironmentLoadError(f"rl.env_args.eval_fraction must be a number in (0, 1), got {eval_fraction!r}")
        if not isinstance(partial_credit, bool):
            raise EnvironmentLoadError(f"rl.env_args.partial_credit must be true or false, got {partial_credit!r}")
        _check_task_args(name, task_args)
        try:
            self.task = _TASK_CLASSES[name](**task_args)
        except TypeError:
            accepted = [p for p in inspect.signature(_TASK_CLASSES[name].__init__).parameters if p != "self"]
            raise EnvironmentLoadError(
                f"rl.env_args {sorted(task_args)} not accepted by the built-in environment {name!r}; "
                f"it takes: {', '.join([*accepted, 'eval_fraction', 'partial_credit'])}"
            ) from None
        self.name = name
        self.eval_fraction = eval_fraction
        # exact match only: a harder signal to find from a weak policy, but one nothing can game
        self._reward = _REWARDS[name] if partial_credit else exact_reward

    def prompts(self, split: str, n: int, seed: int) -> list[Prompt]:
        """`n` prompts of `split`; train prompts may repeat, eval prompts are distinct while the task has enough."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        want_eval = split == "eval"
        # A string seed is stable across processes; the split is part of it so train and eval draw independently.
        rng = random.Random(f"rl:{self.name}:{split}:{seed}")
        out: list[Prompt] = []
        seen: set[str] = set()
        draws = 0
        while len(out) < n:
            draws += 1
            example = self.task.generate(rng)
            if _in_eval_split(example.prompt, self.eval_fraction) != want_eval:
                continue
            if want_eval and example.prompt in seen and draws <= _MAX_DRAWS_PER_PROMPT * n:
                continue
            seen.add(example.prompt)
            out.append(Prompt(example.prompt, example.answer, {"task": self.name}))
        return out

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The task's reward (exact match 1.0, partial credit below it unless partial_credit = false)."""
        if prompt.answer is None:
            raise ValueError(f"prompt {prompt.text!r} of environment {self.name!r} has no answer to score against")
        return self._reward(prompt.answer, completion)

    def graded(self, prompt: Prompt, completion: str) -> float:
        """The task's partial credit whatever rl.env_args.partial_credit says: how close a wrong answer is (what
        `prime-train sample-pairs --graded-gap` orders two wrong samples by)."""
        if prompt.answer is None:
            raise ValueError(f"prompt {prompt.text!r} of environment {self.name!r} has no answer to score against")
        return _REWARDS[self.name](prompt.answer, completion)


# ---------------------------------------------------------------- a learned reward


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise EnvironmentLoadError(f"rl.env_args.{key} must be a number >= 0, got {value!r}")
    return float(value)


class RewardModelEnvironment:
    """A built-in task's prompts, rewarded by a reward model: model_weight · score + rule_weight · the task's reward.

    `path`: the reward model's directory (a reward run's final/; reward_scorer.py says what it must hold), checked
    when the environment is built, loaded by `prepare` or the first score, then kept in the trainer's process on
    `device` ("auto": this rank's GPU when CUDA is available, else the CPU). `task`: the built-in task whose prompts
    (and held-out eval prompts) are used, with its own rl.env_args (min_letters, partial_credit, ...). The pass rate
    is the task's exact match, whatever the weights.
    """

    uses_tools = False
    name = "reward-model"

    def __init__(
        self,
        path: str | None = None,
        task: str = "reverse-text",
        model_weight: float = 1.0,
        rule_weight: float = 0.0,
        device: str = "auto",
        batch_size: int = 64,
        **task_args: Any,
    ) -> None:
        if not isinstance(path, str) or not path:
            raise EnvironmentLoadError(
                "rl.environment = 'reward-model' needs rl.env_args.path: the reward model's directory (a reward "
                "run's final/)"
            )
        if task not in _TASK_CLASSES:
            raise EnvironmentLoadError(
                f"rl.env_args.task = {task!r} is not a built-in task ({', '.join(sorted(_TASK_CLASSES))})"
            )
        self.model_weight = _number("model_weight", model_weight)
        self.rule_weight = _number("rule_weight", rule_weight)
        if self.model_weight == 0 and self.rule_weight == 0:
            raise EnvironmentLoadError("rl.env_args.model_weight and rule_weight are both 0: every reward would be 0")
        if device not in DEVICES:
            raise EnvironmentLoadError(f"rl.env_args.device must be one of {', '.join(DEVICES)}, got {device!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise EnvironmentLoadError(f"rl.env_args.batch_size must be a whole number >= 1, got {batch_size!r}")
        accepted = [p for p in inspect.signature(_TASK_CLASSES[task].__init__).parameters if p != "self"]
        accepted += ["eval_fraction", "partial_credit"]
        unknown = sorted(set(task_args) - set(accepted))
        if unknown:
            raise EnvironmentLoadError(
                f"rl.env_args {unknown} not accepted by the reward-model environment; it takes: path, task, "
                f"model_weight, rule_weight, device, batch_size, and the {task} task's {', '.join(accepted)}"
            )
        self.rule = BuiltinEnvironment(task, **task_args)
        try:
            check_reward_model(path)
        except RewardModelError as exc:
            raise EnvironmentLoadError(f"rl.env_args.path = {path!r} {exc}") from None
        self.path = path
        self.scorer = RewardScorer(path, device=device, batch_size=batch_size)

    def prompts(self, split: str, n: int, seed: int) -> list[Prompt]:
        """The task's prompts: the same train and eval splits as `rl.environment = <task>` gives."""
        return self.rule.prompts(split, n, seed)

    def prepare(self) -> None:
        """Load the reward model now (the trainer calls this before its first rollout)."""
        try:
            self.scorer.load()
        except RewardModelError as exc:
            raise EnvironmentLoadError(f"rl.env_args.path = {self.path!r} {exc}") from None

    def reward_batch(self, prompts: list[Prompt], completions: list[str]) -> list[float]:
        """model_weight · the reward model's score + rule_weight · the task's reward, for the batch in one pass."""
        scores = [0.0] * len(completions)
        if self.model_weight:
            self.prepare()
            scores = self.scorer.score([(p.text, c) for p, c in zip(prompts, completions, strict=True)])
        rules = [0.0] * len(completions)
        if self.rule_weight:
            rules = [self.rule.reward(p, c) for p, c in zip(prompts, completions, strict=True)]
        return [self.model_weight * s + self.rule_weight * r for s, r in zip(scores, rules, strict=True)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        """One completion's reward (reward_batch of one)."""
        return self.reward_batch([prompt], [completion])[0]

    def passed(self, prompt: Prompt, completion: str) -> bool:
        """The task's exact match: the pass rate means the same as the rule environment's."""
        return tasks.extract_answer(completion) == prompt.answer


# ---------------------------------------------------------------- user modules


_PROTOCOL_ATTRIBUTES = ("name", "uses_tools", "prompts", "reward")


def check_environment(env: Any, source: str) -> Environment:
    """`env` when it has the Environment protocol's attributes, else an EnvironmentLoadError naming rl.environment."""
    missing = [a for a in _PROTOCOL_ATTRIBUTES if not hasattr(env, a)]
    not_callable = [a for a in ("prompts", "reward") if hasattr(env, a) and not callable(getattr(env, a))]
    if missing or not_callable:
        why = []
        if missing:
            why.append(f"missing {', '.join(missing)}")
        if not_callable:
            why.append(f"not callable: {', '.join(not_callable)}")
        raise EnvironmentLoadError(
            f"rl.environment = {source!r} returned a {type(env).__name__} ({'; '.join(why)}); it must return an "
            "object with name, uses_tools, prompts(split, n, seed) and reward(prompt, completion) "
            "(see prime_train.environments.Environment)"
        )
    return env


def _load_user_environment(spec: str, env_args: dict) -> Environment:
    module_name, _, func_name = spec.partition(":")
    if not module_name or not func_name:
        raise EnvironmentLoadError(
            f"rl.environment = {spec!r}: a user environment is 'pkg.module:function' (both parts needed)"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EnvironmentLoadError(
            f"rl.environment = {spec!r}: cannot import {module_name!r} ({type(exc).__name__}: {exc}); install the "
            "package or add its directory to PYTHONPATH"
        ) from exc
    loader = getattr(module, func_name, None)
    if not callable(loader):
        raise EnvironmentLoadError(f"rl.environment = {spec!r}: module {module_name!r} has no function {func_name!r}")
    try:
        env = loader(**env_args)
    except TypeError as exc:
        raise EnvironmentLoadError(
            f"rl.environment = {spec!r}: {func_name}() refused rl.env_args {sorted(env_args)} ({exc})"
        ) from exc
    return check_environment(env, spec)


# ---------------------------------------------------------------- verifiers


def _run(awaitable: Any) -> Any:
    """Result of a coroutine from synchronous code (a verifiers rubric is async); plain values pass through."""
    if not inspect.isawaitable(awaitable):
        return awaitable
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(awaitable)
    # Called from inside an event loop: run it on a fresh loop in a worker thread instead of nesting.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, awaitable).result()


def render_messages(messages: list[dict]) -> str:
    """Chat messages as plain text: each message's content, blank-line separated (roles are left to the template)."""
    parts = []
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(str(content))
    return "\n\n".join(parts)


class VerifiersEnvironment:
    """A `verifiers` environment as an Environment.

    Written for the `verifiers.load_environment(env_id, **env_args)` API of verifiers 0.1.x-0.3.x and tested
    against 0.3.1: the environment's `dataset` / `eval_dataset` are HF datasets with a `prompt` column (chat
    messages, or a string for completion environments) or a `question` column, plus `answer` and `info`.
    Its rubric is async and scores one rollout two ways: up to 0.2.x `score_rollout(prompt, completion,
    answer, state, task=…, info=…)` returns a RolloutScore with `.reward`; in 0.3.x `score_rollout(state)`
    reads prompt/completion/answer from the state and writes `state["reward"]`. verifiers 0.4.0 moved
    everything to `verifiers.v1` (tasksets, harnesses); that API is refused with a clear message.
    """

    def __init__(self, env_id: str, vf_env: Any) -> None:
        self.name = f"verifiers:{env_id}"
        self.vf_env = vf_env
        self.rubric = getattr(vf_env, "rubric", None)
        if self.rubric is None or not hasattr(self.rubric, "score_rollout"):
            raise EnvironmentLoadError(f"rl.environment = {self.name!r}: the environment has no rubric.score_rollout")
        self.chat = getattr(vf_env, "message_type", "chat") == "chat"
        # Multi-turn tool environments carry their tools (oai_tools / tools); they call tools between turns.
        self.uses_tools = bool(getattr(vf_env, "oai_tools", None) or getattr(vf_env, "tools", None))

    def _rows(self, split: str) -> list[dict]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        train = getattr(self.vf_env, "dataset", None)
        evaluation = getattr(self.vf_env, "eval_dataset", None)
        if train is None and evaluation is None:
            raise EnvironmentLoadError(f"rl.environment = {self.name!r}: the environment has no dataset")
        if train is not None and evaluation is not None:
            return list(train if split == "train" else evaluation)
        # One dataset only: split it by content the way the built-ins do, so the halves never overlap.
        rows = list(train if train is not None else evaluation)
        return [r for r in rows if _in_eval_split(repr(r.get("prompt", r.get("question"))), 0.1) == (split == "eval")]

    def _prompt(self, row: dict) -> Prompt:
        raw = row.get("prompt")
        if raw is None and row.get("question") is not None:
            raw = [{"role": "user", "content": str(row["question"])}] if self.chat else str(row["question"])
        if raw is None:
            raise EnvironmentLoadError(f"rl.environment = {self.name!r}: a dataset row has neither prompt nor question")
        text = render_messages(raw) if isinstance(raw, list) else str(raw)
        answer = row.get("answer")
        info = {"prompt": raw, "task": row.get("task", "default"), "info": row.get("info") or {}}
        return Prompt(text, None if answer is None else str(answer), info)

    def prompts(self, split: str, n: int, seed: int) -> list[Prompt]:
        """`n` rows of the split in a seeded order (cycled when the split is smaller than `n`)."""
        rows = self._rows(split)
        if not rows:
            raise EnvironmentLoadError(f"rl.environment = {self.name!r}: the {split} split has no rows")
        order = list(range(len(rows)))
        random.Random(f"rl:{self.name}:{split}:{seed}").shuffle(order)
        return [self._prompt(rows[order[i % len(order)]]) for i in range(n)]

    def reward(self, prompt: Prompt, completion: str) -> float:
        """The rubric's reward of `completion`, clamped to [0, 1]."""
        raw = prompt.info.get("prompt", prompt.text)
        messages = [{"role": "assistant", "content": completion}] if self.chat else completion
        fields = {"prompt": raw, "completion": messages, "answer": prompt.answer or "", "info": prompt.info["info"]}
        if "prompt" in inspect.signature(self.rubric.score_rollout).parameters:  # verifiers <= 0.2
            result = _run(self.rubric.score_rollout(state={}, task=prompt.info["task"], **fields))
            value = float(getattr(result, "reward", result))
        else:  # verifiers 0.3: the rubric reads the rollout from its state and writes the reward into it
            state = self._state(prompt, fields)
            _run(self.rubric.score_rollout(state))
            value = float(state.get("reward") or 0.0)
        return 0.0 if math.isnan(value) else min(1.0, max(0.0, value))

    def _state(self, prompt: Prompt, fields: dict) -> Any:
        import verifiers

        state_cls = getattr(verifiers, "State", None)
        task = {**fields, "task": prompt.info["task"]}
        state = state_cls.for_task(task) if hasattr(state_cls, "for_task") else dict(task)
        state.update(fields)
        return state


def _load_verifiers_environment(env_id: str, env_args: dict) -> Environment:
    try:
        import verifiers
    except ImportError:
        raise EnvironmentLoadError(
            f"rl.environment = 'verifiers:{env_id}' needs the verifiers package: pip install 'verifiers<0.4'"
        ) from None
    if not hasattr(verifiers, "load_environment"):
        version = getattr(verifiers, "__version__", "?")
        raise EnvironmentLoadError(
            f"rl.environment = 'verifiers:{env_id}': verifiers {version} has the 0.4 API (verifiers.v1 tasksets), "
            "which this adapter does not speak; pip install 'verifiers<0.4', or wrap the environment in a "
            "'pkg.module:load_environment' of your own"
        )
    try:
        vf_env = verifiers.load_environment(env_id, **env_args)
    except Exception as exc:  # verifiers raises whatever the environment's module raises
        raise EnvironmentLoadError(
            f"rl.environment = 'verifiers:{env_id}': verifiers could not load it ({type(exc).__name__}: {exc}); "
            f"install it first (`prime env install …` or pip) and check rl.env_args"
        ) from exc
    return VerifiersEnvironment(env_id, vf_env)


# ---------------------------------------------------------------- entry point


def load_environment(name: str, env_args: dict | None = None) -> Environment:
    """The environment `rl.environment` names, built with `rl.env_args`."""
    env_args = dict(env_args or {})
    if name in _TASK_CLASSES:
        return BuiltinEnvironment(name, **env_args)
    if name == RewardModelEnvironment.name:
        return RewardModelEnvironment(**env_args)
    if name.startswith("verifiers:"):
        return _load_verifiers_environment(name.removeprefix("verifiers:"), env_args)
    if ":" in name:
        return _load_user_environment(name, env_args)
    raise EnvironmentLoadError(
        f"rl.environment = {name!r} is not a built-in environment ({', '.join(BUILTIN_ENVIRONMENTS)}), "
        "a user module 'pkg.module:load_environment' or 'verifiers:<env id>'"
    )
