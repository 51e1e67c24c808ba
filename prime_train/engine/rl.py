"""The embedded GRPO job: rollouts from OpenAI-compatible workers, group-normalised advantages,
a clipped policy-gradient loss on completion tokens, new weights to the workers every step.

Started by `python -m prime_train.engine.train` when run.job = "rl". The workers are separate
processes the supervisor runs ([inference]); this job only talks to them over HTTP with bounded
timeouts, and publishes weights through the run directory (weights/step-N, renamed when whole)
plus POST /update_weights.
"""

from __future__ import annotations

import logging
import math
import queue
import random
import shutil
import threading
import time
from dataclasses import dataclass

import torch

from prime_train.config.schema import Config

logger = logging.getLogger("prime_train.engine")


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]
    old_logprobs: list[float]
    reward: float
    advantage: float = 0.0


@dataclass
class RolloutBatch:
    samples: list[Sample]
    policy_step: int  # weights the workers had when the batch was requested
    seconds: float


class PromptCursor:
    """Deterministic, resumable order over the environment's train prompts (a data loader for RL)."""

    def __init__(self, prompts, seed: int, rank: int, world_size: int):
        self.prompts = prompts
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.position = 0

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list:
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


def group_advantages(rewards: list[float], group_size: int) -> list[float]:
    """(r - mean) / (std + eps) within each group of completions of one prompt."""
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start : start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / len(group))
        out.extend((r - mean) / (std + 1e-4) for r in group)
    return out


def completion_logprobs(model, samples: list[Sample], device, temperature: float, pad_id: int):
    """Log-probabilities of each sample's completion tokens under `model` (sampling temperature applied).

    Returns a [B, T] tensor of logprobs aligned to completion tokens and a [B, T] mask.
    """
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for row, x in enumerate(seqs):
        ids[row, : len(x)] = torch.tensor(x)
    ids = ids.to(device)
    positions = torch.arange(width, device=device).expand(len(seqs), width)
    logits = model(input_ids=ids, position_ids=positions).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # predicts token t+1
    comp_width = max(len(s.completion_ids) for s in samples)
    out = torch.zeros((len(seqs), comp_width), device=device)
    mask = torch.zeros((len(seqs), comp_width), device=device)
    for row, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        n = len(s.completion_ids)
        out[row, :n] = logp[row, start : start + n]
        mask[row, :n] = 1.0
    return out, mask


def grpo_loss(new_logp, old_logp, mask, advantages, clip_eps: float, ref_logp=None, kl_coef: float = 0.0):
    """Clipped surrogate on completion tokens; sum over tokens (the caller divides by the batch's tokens)."""
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    kl = torch.zeros_like(per_token)
    if ref_logp is not None and kl_coef > 0:
        diff = ref_logp - new_logp
        kl = torch.exp(diff) - diff - 1  # k3 estimator: unbiased, always >= 0
        per_token = per_token + kl_coef * kl
    clipped = ((ratio - 1).abs() > clip_eps).float()
    return (per_token * mask).sum(), (kl * mask).sum(), (clipped * mask).sum()


class RLTrainer:
    """GRPO over [inference] workers; shares model, checkpoint and metrics code with the SFT trainer."""

    def __init__(self, cfg: Config):
        from prime_train.engine import parallel
        from prime_train.engine.checkpoint import Checkpointer, TrainState
        from prime_train.engine.metrics import EngineConfigError, MetricsLogger
        from prime_train.engine.optim import build_optimizer
        from prime_train.engine.rollout_client import RolloutPool
        from prime_train.engine.schedule import build_scheduler
        from prime_train.engine.train import StopFlag, load_model_and_tokenizer, start_job
        from prime_train.rl.environments import load_environment

        self.cfg = cfg
        self.run_dir, self.dist = start_job(cfg)
        try:
            self.env = load_environment(cfg.rl.environment, dict(cfg.rl.env_args))
        except (ValueError, ImportError) as exc:
            raise EngineConfigError(f"rl.environment: {exc}") from None
        self.tokenizer, model = load_model_and_tokenizer(cfg)
        self.hf_config = model.config
        self.reference = None
        if cfg.rl.kl_coef > 0:
            import copy

            self.reference = copy.deepcopy(model).to(self.dist.device).eval().requires_grad_(False)
        model.to(self.dist.device)
        self.model = parallel.parallelize(model, cfg, self.dist)
        self.optimizer = build_optimizer(self.model, cfg.train, self.dist.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self._autocast = lambda: parallel.autocast(cfg.train.precision, self.dist.device)
        train_prompts = self.env.prompts("train", 20000, cfg.run.seed)
        self.eval_prompts = self.env.prompts("eval", cfg.rl.eval_prompts, cfg.run.seed) if cfg.rl.eval_prompts else []
        self.cursor = PromptCursor(train_prompts, cfg.run.seed, self.dist.rank, self.dist.world_size)
        self.state = TrainState(self.model, self.optimizer, self.scheduler, self.cursor, rank=self.dist.rank)
        self.checkpointer = Checkpointer(self.run_dir, cfg.ckpt, rank=self.dist.rank, world_size=self.dist.world_size)
        self.checkpointer.set_hf_assets(self.hf_config, self.tokenizer)
        self.metrics = MetricsLogger(self.run_dir, cfg, enabled=self.dist.is_rank0)
        inf = cfg.inference
        urls = [f"http://{inf.host}:{inf.base_port + i}" for i in range(inf.num_workers)]
        self.pool = RolloutPool(urls, inf.request_timeout_s)
        self.stop = StopFlag()
        self.weights_step = 0
        self._published: tuple[str, int] | None = None
        self._rollouts: queue.Queue = queue.Queue(maxsize=max(1, cfg.rl.max_async_level))
        self._rollout_error: BaseException | None = None
        self._rollout_thread: threading.Thread | None = None
        from prime_train.engine.profiling import NullTimer, ProfileSession, profile_request

        request = profile_request()
        self.profile = (
            ProfileSession(self.run_dir.root, *request, device=self.dist.device, rank=self.dist.rank, job="rl")
            if request
            else None
        )
        self.timer = self.profile.timer if self.profile else NullTimer()

    # ------------------------------------------------------------------ rollouts

    def _rollout(self, prompts) -> RolloutBatch:
        rl = self.cfg.rl
        t0 = time.time()
        policy_step = self.weights_step
        texts = [p.text for p in prompts]
        groups = self._complete_with_recovery(
            texts, n=rl.group_size, max_tokens=rl.max_tokens, temperature=rl.temperature, top_p=rl.top_p
        )
        samples = []
        for prompt, completions in zip(prompts, groups, strict=True):
            for c in completions:
                if not c.token_ids:
                    continue
                samples.append(
                    Sample(
                        list(c.prompt_token_ids), list(c.token_ids), list(c.logprobs), self.env.reward(prompt, c.text)
                    )
                )
        for s, a in zip(samples, group_advantages([s.reward for s in samples], rl.group_size), strict=True):
            s.advantage = a
        return RolloutBatch(samples, policy_step, time.time() - t0)

    def _complete_with_recovery(self, texts, **sampling):
        """Ask the pool; when no worker answers, wait for one to come back (the supervisor restarts dead
        workers), give it the current weights, and ask again. Bounded by inference.startup_timeout_s."""
        from prime_train.engine.rollout_client import WorkerUnavailable

        for attempt in range(3):
            try:
                return self.pool.complete(texts, **sampling)
            except WorkerUnavailable as exc:
                if attempt == 2:
                    raise
                logger.warning("no rollout worker answered (%s); waiting for one to come back", exc)
                self.pool.wait_healthy(self.cfg.inference.startup_timeout_s)
                if self._published is not None:
                    self.pool.update_weights(*self._published)
        raise AssertionError("unreachable")

    def _producer(self) -> None:
        """Rollouts for the next steps while the current one trains: at most max_async_level ahead."""
        try:
            while not self.stop.requested:
                prompts = self.cursor.take(self.cfg.rl.prompts_per_step)
                self._rollouts.put(self._rollout(prompts))
        except BaseException as exc:  # surfaced by the training loop
            self._rollout_error = exc
            self._rollouts.put(None)

    def next_batch(self) -> RolloutBatch:
        if self.cfg.rl.max_async_level == 0:
            return self._rollout(self.cursor.take(self.cfg.rl.prompts_per_step))
        if self._rollout_thread is None:
            self._rollout_thread = threading.Thread(target=self._producer, name="rollouts", daemon=True)
            self._rollout_thread.start()
        batch = self._rollouts.get(timeout=self.cfg.inference.request_timeout_s * 4)
        if batch is None:
            raise RuntimeError(f"rollouts failed: {self._rollout_error!r}") from self._rollout_error
        return batch

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict[str, float]:
        from prime_train.engine import parallel

        cfg, dist, timer = self.cfg, self.dist, self.timer
        with timer("rollout_wait"):
            batch = self.next_batch()
            lag = self.state.step - batch.policy_step
            while lag > cfg.rl.max_async_level:
                # rollouts from a policy older than rl.max_async_level are dropped, never trained on
                logger.warning(
                    "dropping rollouts %d steps off-policy (rl.max_async_level = %d)", lag, cfg.rl.max_async_level
                )
                batch = self.next_batch()
                lag = self.state.step - batch.policy_step
        samples = batch.samples
        tokens = sum(len(s.completion_ids) for s in samples)
        with timer("communication"):
            total = max(1.0, float(parallel.all_reduce_sum(torch.tensor([float(tokens)]), dist)[0]))
        loss_sum = kl_sum = clip_sum = 0.0
        mbs = cfg.train.micro_batch_size
        chunks = [samples[i : i + mbs] for i in range(0, len(samples), mbs)] or [[]]
        t0 = time.perf_counter()
        for i, chunk in enumerate(chunks):
            if not chunk:
                continue
            with parallel.grad_sync(self.model, enabled=i == len(chunks) - 1), self._autocast():
                with timer("forward"):
                    new_logp, mask = completion_logprobs(
                        self.model, chunk, dist.device, cfg.rl.temperature, self.tokenizer.pad_token_id
                    )
                    old = torch.zeros_like(new_logp)
                    for row, s in enumerate(chunk):
                        old[row, : len(s.old_logprobs)] = torch.tensor(s.old_logprobs[: new_logp.size(1)])
                    ref = None
                    if self.reference is not None:
                        with torch.no_grad():
                            ref, _ = completion_logprobs(
                                self.reference, chunk, dist.device, cfg.rl.temperature, self.tokenizer.pad_token_id
                            )
                    adv = torch.tensor([s.advantage for s in chunk], device=dist.device)
                    loss, kl, clipped = grpo_loss(new_logp, old, mask, adv, cfg.rl.clip_eps, ref, cfg.rl.kl_coef)
                with timer("backward"):
                    (loss * (dist.world_size / total)).backward()
            loss_sum += float(loss.detach())
            kl_sum += float(kl)
            clip_sum += float(clipped)
        with timer("optimizer"):
            params = [p for p in self.model.parameters() if p.grad is not None]
            max_norm = cfg.train.grad_clip if cfg.train.grad_clip is not None else float("inf")
            grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm) if params else torch.tensor(0.0)
            if hasattr(grad_norm, "full_tensor"):
                grad_norm = grad_norm.full_tensor()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        rewards = [s.reward for s in samples]
        with timer("communication"):
            reduced = parallel.all_reduce_sum(
                torch.tensor([loss_sum, kl_sum, clip_sum, sum(rewards), float(len(rewards))], dtype=torch.float64),
                dist,
            )
        self.state.step += 1
        self.state.tokens_seen += int(total)
        with timer("weight_sync"):
            self.publish_weights()
        n = max(1.0, float(reduced[4]))
        return {
            "loss": float(reduced[0]) / total,
            "reward": float(reduced[3]) / n,
            "reward_std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
            "kl": float(reduced[1]) / total,
            "clip_fraction": float(reduced[2]) / total,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "completion_tokens": int(total),
            "rollout_s": batch.seconds,
            "train_s": time.perf_counter() - t0,
            "off_policy_steps": lag,
        }

    def publish_weights(self) -> None:
        """Write HF weights to weights/step-N (renamed when whole) and tell every worker to load them."""
        from prime_train.engine.export import export_hf

        out = self.run_dir.root / "weights" / f"step-{self.state.step}"
        export_hf(self.model, self.tokenizer, out, rank=self.dist.rank)
        if self.dist.is_rank0:
            self._published = (str(out), self.state.step)
            self.pool.update_weights(str(out), self.state.step)
            # keep the two newest: a worker that restarts loads the newest, one in flight may read the other
            for old in sorted(out.parent.glob("step-*"), key=lambda p: int(p.name.split("-")[1].split(".")[0]))[:-2]:
                shutil.rmtree(old, ignore_errors=True)
        self.weights_step = self.state.step

    def evaluate(self) -> dict[str, float]:
        """Mean reward and pass rate (reward 1) of greedy completions on held-out prompts, through the workers."""
        if not self.eval_prompts or not self.dist.is_rank0:
            return {}
        groups = self._complete_with_recovery(
            [p.text for p in self.eval_prompts], n=1, max_tokens=self.cfg.rl.max_tokens, temperature=0.0, top_p=1.0
        )
        rewards = [self.env.reward(p, g[0].text) for p, g in zip(self.eval_prompts, groups, strict=True)]
        return {
            "eval_reward": sum(rewards) / len(rewards),
            "eval_pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
        }

    # ------------------------------------------------------------------ the loop

    def fit(self) -> int:
        from prime_train.engine.train import EXIT_OK, EXIT_PREEMPTED

        cfg = self.cfg
        self.stop.install()
        path = self.checkpointer.resolve_resume()
        if path is not None:
            self.metrics.heartbeat(self.state.step, phase="loading")
            self.checkpointer.load(self.state, path)
            logger.info("resumed from %s at step %d", path, self.state.step)
        self.metrics.heartbeat(self.state.step, phase="starting")
        self.pool.wait_healthy(cfg.inference.startup_timeout_s)
        self.publish_weights()  # workers start from the trainer's weights, also after a resume
        if self.profile is not None:
            return self.profile_fit()
        if self.state.step == 0:
            self.metrics.log(0, self.evaluate())
        t_start, start_step = time.time(), self.state.step
        last_loss = None
        while self.state.step < cfg.train.max_steps:
            if self.stop.requested:
                self.checkpointer.wait()
                self.checkpointer.save(self.state, self.state.step, final=True)
                self.metrics.heartbeat(self.state.step, phase="stopped", exit_code=EXIT_PREEMPTED)
                return EXIT_PREEMPTED
            m = self.train_step()
            step = self.state.step
            last_loss = m["loss"]
            self.checkpointer.poll()
            if step % cfg.train.eval_interval == 0 or step == cfg.train.max_steps:
                self.metrics.heartbeat(step, phase="eval", loss=m["loss"])
                m.update(self.evaluate())
            self.metrics.log(step, m)
            self.metrics.heartbeat(step, phase="training", loss=m["loss"], reward=m["reward"],
                                   step_time_s=m["rollout_s"] + m["train_s"])  # fmt: skip
            if step % cfg.logging.log_interval == 0 or step == start_step + 1 or step == cfg.train.max_steps:
                eta = (time.time() - t_start) / max(1, step - start_step) * (cfg.train.max_steps - step)
                extra = f" | eval_reward {m['eval_reward']:.3f}" if "eval_reward" in m else ""
                logger.info(
                    "step %d/%d | reward %.3f | loss %.4f | kl %.4f | rollout %.1fs train %.1fs%s | eta %.0fs",
                    step, cfg.train.max_steps, m["reward"], m["loss"], m["kl"],
                    m["rollout_s"], m["train_s"], extra, eta,
                )  # fmt: skip
            if step % cfg.ckpt.interval == 0 and step < cfg.train.max_steps:
                self.metrics.heartbeat(step, phase="saving")
                self.checkpointer.save(self.state, step)
        self.checkpointer.wait()
        if cfg.ckpt.export_final:
            from prime_train.engine.export import export_hf

            export_hf(self.model, self.tokenizer, self.run_dir.final_dir, rank=self.dist.rank)
        self.metrics.heartbeat(self.state.step, phase="done", loss=last_loss)
        return EXIT_OK

    def profile_fit(self) -> int:
        """`prime-train profile` for RL: rollout latency against trainer time, one timed checkpoint save."""
        from prime_train.engine.profiling import run_profiled
        from prime_train.engine.train import EXIT_OK

        run_profiled(
            self,
            tokens_of=lambda m: m["completion_tokens"],
            heartbeat_of=lambda m: {"loss": m["loss"], "reward": m["reward"]},
            extra_of=lambda profiled: {
                "rollout_latency_s": sum(m["rollout_s"] for m in profiled) / len(profiled),
                "max_async_level": self.cfg.rl.max_async_level,
            },
        )
        return EXIT_OK

    def save(self, *, final: bool = False) -> None:
        self.metrics.heartbeat(self.state.step, phase="saving")
        self.checkpointer.save(self.state, self.state.step, final=final)

    def close(self) -> None:
        from prime_train.engine.train import close_job

        self.stop.requested = True  # the rollout producer thread stops at its next batch
        close_job(self, "reference")
