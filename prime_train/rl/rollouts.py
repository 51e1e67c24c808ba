"""The GRPO job's batch source: prompts in a resumable order, rollouts from the workers, group advantages.

Torch-free. Rollouts for the next steps are requested in a background thread while the current
step trains, at most rl.max_async_level steps ahead. Each prompt's samples are seeded from the run seed
and the prompt's place in the cursor's order (run.seed * 1_000_003 + (position + i) * rl.group_size + j
for sample j of the batch's prompt i), whichever worker serves it, so a batch is the same whenever the
same weights sample it (a resumed run replays the steps it lost exactly when rl.max_async_level = 0 and
the embedded worker serves). The cursor's position is checkpointed with the rest of the train state.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from prime_train.config.schema import Config
from prime_train.environments import Environment, Prompt, passes, score_batch
from prime_train.rl.client import ContextLengthError, RolloutPool, WorkerUnavailable

logger = logging.getLogger("prime_train.rl")

# distinct train prompts drawn from an environment: more than any tiny run uses, few enough to build at once
TRAIN_PROMPTS = 20000


@dataclass
class Sample:
    """One completion of one prompt, with what the loss needs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]  # the worker's logprobs of the sampled tokens
    reward: float
    advantage: float = 0.0
    truncated: bool = False  # stopped by rl.max_tokens (or the context) before the model ended it
    group_std: float = 0.0  # the std of the rewards of this prompt's group: 0 when every completion scored the same
    passed: bool | None = None  # counts towards the pass rate (environments.passes); None: a reward of 1 or more


def sample_passed(sample: Sample) -> bool:
    """Whether `sample` counts towards the pass rate: as its environment said, else a reward of 1 or more."""
    return sample.reward >= 1.0 if sample.passed is None else sample.passed


@dataclass
class RolloutBatch:
    samples: list[Sample]
    policy_step: int  # the weights the workers had when the batch was requested
    seconds: float
    end_position: int  # the prompt cursor just after this batch's prompts
    clamped: int = 0  # completions cut short because prompt + rl.max_tokens did not fit inference.max_model_len


class PromptCursor:
    """Deterministic, resumable order over the environment's train prompts (a data loader for RL)."""

    def __init__(self, prompts: list[Prompt], seed: int, rank: int, world_size: int):
        self.prompts = prompts
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Prompt]:
        """This rank's share of the next n prompts of the shared order."""
        out = []
        for i in range(self.position, self.position + n):
            epoch, index = divmod(i, len(self.prompts))
            if i % self.world_size == self.rank:
                out.append(self.prompts[self._order(epoch)[index]])
        self.position += n
        return out

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state.get("position", 0))


SCALE_REWARDS = ("group", "batch", "none")


def _std(values: list[float]) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


def group_advantages(rewards: list[float], group_size: int, scale: str = "group") -> list[float]:
    """r - mean of its group (the completions of one prompt), divided by a std as `scale` says.

    "group": the group's std (GRPO): a group whose rewards differ by 0.01 gets advantages of +-1, as large as
    one that tells right from wrong. "batch": the whole batch's std, so groups keep their relative weight.
    "none": no division (Dr. GRPO): an advantage is in reward units.
    """
    if scale not in SCALE_REWARDS:
        raise ValueError(f"rl.scale_rewards must be one of {SCALE_REWARDS}, got {scale!r}")
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = _std(group) if scale == "group" else 1.0
        out.extend((r - mean) / (std + 1e-4) if scale == "group" else r - mean for r in group)
    if scale == "batch" and len(rewards) > 1:
        std = _std(rewards)
        out = [a / (std + 1e-4) for a in out]
    return out


class RolloutSource:
    """Batches of scored samples for the GRPO step, from the workers in `pool`.

    `policy_step()` tells which weights the workers serve now (the pool gives a worker that came back
    the current ones before using it). Checkpointed through state_dict/load_state_dict (the cursor).
    """

    def __init__(
        self,
        cfg: Config,
        env: Environment,
        pool: RolloutPool,
        *,
        rank: int,
        world_size: int,
        policy_step: Callable[[], int],
    ):
        self.cfg = cfg
        self.env = env
        self.pool = pool
        self.cursor = PromptCursor(env.prompts("train", TRAIN_PROMPTS, cfg.run.seed), cfg.run.seed, rank, world_size)
        self.policy_step = policy_step
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, cfg.rl.max_async_level))
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        self._consumed = 0  # cursor position after the last batch handed to the trainer

    def state_dict(self) -> dict:
        # batches produced ahead but not trained on are not part of the state: a resume samples them again
        return {"position": self._consumed}

    def load_state_dict(self, state: dict) -> None:
        self.cursor.load_state_dict(state)
        self._consumed = self.cursor.position

    def complete(self, texts: list[str], **sampling):
        """Ask the pool; when no worker answers, wait for one to come back (the supervisor restarts dead
        workers) and ask again: the pool loads the current weights into it first. Bounded by
        inference.startup_timeout_s."""
        for attempt in range(3):
            try:
                return self.pool.complete(texts, **sampling)
            except WorkerUnavailable as exc:
                if attempt == 2:
                    raise
                logger.warning("no rollout worker answered (%s); waiting for one to come back", exc)
                self.pool.wait_healthy(self.cfg.inference.startup_timeout_s)
        raise AssertionError("unreachable")

    def _rollout(self) -> RolloutBatch:
        rl = self.cfg.rl
        t0 = time.time()
        policy_step = self.policy_step()
        # the seeds follow the cursor, so the same prompts under the same weights sample the same tokens; prompt i
        # gets seed + i * group_size from the pool, so consecutive batches never share a seed
        seed = self.cfg.run.seed * 1_000_003 + self.cursor.position * rl.group_size
        prompts = self.cursor.take(rl.prompts_per_step)
        groups = self.complete(
            [p.text for p in prompts], n=rl.group_size, max_tokens=rl.max_tokens, temperature=rl.temperature,
            top_p=rl.top_p, seed=seed,
        )  # fmt: skip
        # vLLM 0.30+ (and the embedded worker) clamp max_tokens to the room the prompt leaves: count it
        clamped = sum(c.finish_reason == "length" and len(c.token_ids) < rl.max_tokens for g in groups for c in g)
        # the whole batch scored in one call (a reward model scores it in padded batches); empty completions dropped
        kept = [[c for c in completions if c.token_ids] for completions in groups]
        scored = [(p, c) for p, completions in zip(prompts, kept, strict=True) for c in completions]
        scores = iter(score_batch(self.env, [p for p, _ in scored], [c.text for _, c in scored]))
        samples = []
        for prompt, completions in zip(prompts, kept, strict=True):
            group = []
            for c in completions:
                reward = next(scores)
                ids, logprobs = list(c.token_ids), list(c.logprobs)
                truncated = c.finish_reason == "length"
                sample = Sample(list(c.prompt_token_ids), ids, logprobs, reward, truncated=truncated)
                sample.passed = passes(self.env, prompt, c.text, reward)
                group.append(sample)
            if group:
                # advantages within this prompt's own completions (an empty one dropped must not shift the groups)
                rewards = [s.reward for s in group]
                within = "group" if rl.scale_rewards == "group" else "none"  # "batch" divides below, once
                std = _std(rewards)
                for s, a in zip(group, group_advantages(rewards, len(group), within), strict=True):
                    s.advantage, s.group_std = a, std
                samples.extend(group)
        if rl.scale_rewards == "batch" and len(samples) > 1:
            std = _std([s.reward for s in samples])
            for s in samples:
                s.advantage /= std + 1e-4
        return RolloutBatch(samples, policy_step, time.time() - t0, self.cursor.position, clamped)

    def _produce(self) -> None:
        """Rollouts for the next steps while the current one trains: at most max_async_level ahead."""
        try:
            while not self._closed.is_set():
                batch = self._rollout()
                while not self._closed.is_set():
                    try:
                        self._queue.put(batch, timeout=0.5)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # surfaced by the training loop
            self._error = exc
            self._queue.put(None)

    def next_batch(self) -> RolloutBatch:
        if self.cfg.rl.max_async_level == 0:
            batch = self._rollout()
        else:
            if self._thread is None:
                self._thread = threading.Thread(target=self._produce, name="rollouts", daemon=True)
                self._thread.start()
            batch = self._queue.get(timeout=self.cfg.inference.request_timeout_s * 4)
            if batch is None:
                if isinstance(self._error, ContextLengthError):
                    raise self._error  # a configuration problem: the trainer says so and exits 78
                raise RuntimeError(f"rollouts failed: {self._error!r}") from self._error
        self._consumed = batch.end_position
        return batch

    def close(self) -> None:
        """Stop producing: the thread ends after the batch it is working on."""
        self._closed.set()
