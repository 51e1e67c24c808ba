"""On-policy preference pairs: a model's own samples of an environment's prompts, labelled by the environment's rule.

A reward model trained on fixed pairs is gamed by the policy RL trains against it: the policy finds an answer the
model never saw a label for (docs/rlhf.md). Iterated reward modelling closes that gap round by round: sample the
policy, label its samples with the rule the task is judged by, and train the reward model again with those pairs
among its own. `sample_pairs` is that step; `prime-train sample-pairs` runs it.

Samples come from the embedded rollout worker's engine (rl/generation.py), built from the run config as the RL
job's worker is, at the config's rl.temperature, rl.top_p and rl.max_tokens, seeded from run.seed: drawn as
the RL run's rollouts are drawn. Each prompt is one of the environment's train
prompts (never its held-out eval prompts, which the pass rate is measured on). A sample passes when the environment's
rule says so (environments.passes: the task's exact match for the built-ins and the reward-model environment). For
each prompt, `chosen` is the reference answer (or, where the environment has none, a passing sample) and every
distinct failing sample is a `rejected`: one {prompt, chosen, rejected} record each, the preference format the dpo
and reward jobs read (engine/preference.py).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prime_train import tasks
from prime_train.contract import replace_file_atomic
from prime_train.environments import (
    BuiltinEnvironment,
    Environment,
    EnvironmentLoadError,
    Prompt,
    load_environment,
    passes,
)

if TYPE_CHECKING:
    from prime_train.config.schema import Config

logger = logging.getLogger("prime_train.rl.pairs")

# how long one batch of samples may take on the slowest machine before the engine is presumed stuck
_SAMPLE_TIMEOUT_S = 3600.0


@dataclass
class PairSummary:
    """What a sample_pairs call did: counts and the commonest failing answers (what the policy gets wrong)."""

    prompts: int
    samples: int
    passed: int
    pairs: int
    prompts_without_chosen: int
    common_failures: list[tuple[str, int]] = field(default_factory=list)
    graded_pairs: int = 0  # of `pairs`: two wrong samples ordered by the graded rule

    @property
    def pass_rate(self) -> float:
        return self.passed / max(1, self.samples)

    def to_dict(self) -> dict:
        return {
            "prompts": self.prompts,
            "samples": self.samples,
            "pass_rate": round(self.pass_rate, 4),
            "pairs": self.pairs,
            "prompts_without_chosen": self.prompts_without_chosen,
            "graded_pairs": self.graded_pairs,
            "common_failures": [{"answer": a, "count": n} for a, n in self.common_failures],
        }


def rule_passes(env: Environment, prompt: Prompt, completion: str) -> bool:
    """The environment's verdict on a completion: its `passed` where it has one (the reward-model environment judges
    by the task's exact match, never by the learned score), else a reward of 1 or more."""
    if callable(getattr(env, "passed", None)):
        return passes(env, prompt, completion, 0.0)
    return passes(env, prompt, completion, env.reward(prompt, completion))


def graded_rule(env: Environment) -> Callable[[Prompt, str], float]:
    """The environment's graded rule: its built-in task's partial credit (even where rl.env_args.partial_credit
    turns it off for the RL reward), for the reward-model environment its task's, never the learned score.
    EnvironmentLoadError when there is none."""
    rule = getattr(env, "rule", None)  # the reward-model environment's built-in task
    if isinstance(rule, BuiltinEnvironment):
        return rule.graded
    if isinstance(env, BuiltinEnvironment):
        return env.graded
    raise EnvironmentLoadError(
        f"--graded-gap: rl.environment {getattr(env, 'name', env)!r} has no graded rule to order two wrong samples by "
        "(the built-in tasks and the reward-model environment have one); leave --graded-gap at 0"
    )


def _graded(
    prompt: Prompt, failing: list[str], grade: Callable[[Prompt, str], float], gap: float
) -> list[dict[str, str]]:
    """Pairs of two failing samples whose graded rule differs by `gap` or more, the closer one chosen."""
    graded = [(grade(prompt, c), c) for c in failing]
    return [
        {"prompt": prompt.text, "chosen": better, "rejected": worse}
        for high, better in graded
        for low, worse in graded
        if high - low >= gap
    ]


def label_pairs(
    env: Environment, prompts: list[Prompt], completions: list[list[str]], *, graded_gap: float = 0.0
) -> tuple[list[dict[str, str]], PairSummary]:
    """The {prompt, chosen, rejected} records of `completions[i]` (the samples of `prompts[i]`), and the summary.

    chosen is the prompt's reference answer, else its first passing sample; each distinct failing sample (as
    sampled: the reward model scores the whole completion) is one record's rejected. A prompt with no chosen gives
    no record. With `graded_gap` > 0, two distinct failing samples of a prompt whose graded rule (graded_rule: the
    task's partial credit) differs by at least that much are a pair too, the closer one chosen: a reward model
    that has seen only right-against-wrong ranks wrong answers among themselves at random, and a policy that is
    mostly wrong learns from exactly that ranking (docs/rlhf.md)."""
    grade = graded_rule(env) if graded_gap > 0 else None
    records: list[dict[str, str]] = []
    failures: Counter[str] = Counter()
    samples = passed = without = graded_pairs = 0
    for prompt, group in zip(prompts, completions, strict=True):
        verdicts = [rule_passes(env, prompt, c) for c in group]
        samples += len(group)
        passed += sum(verdicts)
        chosen = prompt.answer
        if chosen is None:
            chosen = next((c for c, ok in zip(group, verdicts, strict=True) if ok), None)
        failing: list[str] = []
        for completion, ok in zip(group, verdicts, strict=True):
            if ok or completion in failing or completion == chosen:
                continue
            failing.append(completion)
            failures[tasks.extract_answer(completion)] += 1
            if chosen is not None:
                records.append({"prompt": prompt.text, "chosen": chosen, "rejected": completion})
        if chosen is None:
            without += 1
        if grade is not None:
            among = _graded(prompt, failing, grade, graded_gap)
            graded_pairs += len(among)
            records.extend(among)
    summary = PairSummary(len(prompts), samples, passed, len(records), without, failures.most_common(5), graded_pairs)
    return records, summary


def sample_completions(cfg: Config, prompts: list[Prompt], samples: int) -> list[list[str]]:
    """`samples` completions of each prompt from cfg.model.path, as the RL job's embedded worker samples them."""
    from prime_train.rl.generation import Job, SamplingParams
    from prime_train.rl.worker import build_engine, context_limits, prompt_token_ids

    rl = cfg.rl
    engine = build_engine(cfg, published=False)
    ids = prompt_token_ids(engine, [p.text for p in prompts])
    params = SamplingParams(rl.max_tokens, rl.temperature, rl.top_p, cfg.run.seed, [], None)
    job = Job(ids, samples, params, context_limits(engine, ids, rl.max_tokens))
    engine.start()
    try:
        engine.submit(job)
        if not job.done.wait(_SAMPLE_TIMEOUT_S):
            raise TimeoutError(f"sampling {len(job.sequences)} completions took over {_SAMPLE_TIMEOUT_S:.0f} s")
    finally:
        engine.stop(timeout_s=60.0)
    if job.error:
        raise RuntimeError(job.error)
    out: list[list[str]] = [[] for _ in prompts]
    for seq in job.sequences:
        out[seq.prompt_index].append(seq.text)
    return out


def write_pairs(path: Path, records: list[dict[str, str]]) -> None:
    """The records as JSONL at `path`, replaced whole (a link at `path` is replaced, never written through)."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    replace_file_atomic(path, text.encode("utf-8"), mode=0o644)


def sample_pairs(cfg: Config, out: Path, *, num_prompts: int, samples: int, graded_gap: float = 0.0) -> PairSummary:
    """Sample cfg.model.path on `num_prompts` train prompts of cfg.rl.environment, `samples` each, label them by the
    environment's rule (label_pairs, with `graded_gap`) and write the pairs to `out` (JSONL).
    EnvironmentLoadError / EngineConfigError on bad input, before any sampling."""
    env = load_environment(cfg.rl.environment, cfg.rl.env_args)
    if graded_gap > 0:
        graded_rule(env)  # refused before the model loads
    prompts = env.prompts("train", num_prompts, cfg.run.seed)
    completions = sample_completions(cfg, prompts, samples)
    records, summary = label_pairs(env, prompts, completions, graded_gap=graded_gap)
    write_pairs(out, records)
    logger.info("%d pairs of %d samples (pass rate %.3f): %s", summary.pairs, summary.samples, summary.pass_rate, out)
    return summary
