"""The embedded GRPO job: `python -m prime_train.rl.train --config RUN/config.toml` (run.job = "rl").

Rollouts come from OpenAI-compatible workers the supervisor runs ([inference]; rl/workers.py),
through the batch source in rl/rollouts.py; the step is a clipped policy-gradient loss on
completion tokens with group-normalised advantages (rl/grpo.py); after every step the new weights
are published to <run>/weights/step-N (renamed when whole) and the workers load them. The loop
around the step (resume, heartbeat, stopping, saves, export, exit codes) is the shared one in
engine/loop.py, the same as SFT's.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time

import torch

from prime_train.config.schema import Config
from prime_train.contract import Phase
from prime_train.engine import parallel
from prime_train.engine.loop import TrainingJob, main
from prime_train.engine.metrics import EngineConfigError
from prime_train.rl.client import RolloutPool, worker_url
from prime_train.rl.environments import load_environment
from prime_train.rl.grpo import completion_logprobs, grpo_loss
from prime_train.rl.rollouts import RolloutBatch, RolloutSource

logger = logging.getLogger("prime_train.rl")

# published weights kept: a restarting worker loads the newest, one in flight may still read the one before
KEEP_PUBLISHED = 2


class GRPOJob(TrainingJob):
    """GRPO over [inference] workers: the batch source is rollouts, the step is the clipped surrogate loss."""

    job_name = "rl"

    def __init__(self, cfg: Config):
        # the environment first: a bad rl.environment is a configuration error before any model is loaded
        try:
            self.env = load_environment(cfg.rl.environment, dict(cfg.rl.env_args))
        except (ValueError, ImportError) as exc:
            raise EngineConfigError(f"rl.environment: {exc}") from None
        self.reference = None
        self.weights_step = 0
        self._published: tuple[str, int] | None = None
        urls = [worker_url(cfg, i) for i in range(cfg.inference.num_workers)]
        self.pool = RolloutPool(urls, cfg.inference.request_timeout_s)
        super().__init__(cfg)
        self.eval_prompts = self.env.prompts("eval", cfg.rl.eval_prompts, cfg.run.seed) if cfg.rl.eval_prompts else []

    def prepare_model(self, model) -> None:
        if self.cfg.rl.kl_coef > 0:
            # the KL anchor is the model as loaded, before it is wrapped or sharded
            self.reference = copy.deepcopy(model).to(self.dist.device).eval().requires_grad_(False)

    def build_batch_source(self) -> RolloutSource:
        return RolloutSource(
            self.cfg, self.env, self.pool, rank=self.dist.rank, world_size=self.dist.world_size,
            policy_step=lambda: self.weights_step, republish=self._republish,
        )  # fmt: skip

    def before_training(self) -> None:
        """Wait for the workers and give them the trainer's weights (after a resume too)."""
        self.pool.wait_healthy(self.cfg.inference.startup_timeout_s)
        self.publish_weights()

    # ------------------------------------------------------------------ one step

    def _next_batch(self) -> tuple[RolloutBatch, int]:
        """The next batch of rollouts no more than rl.max_async_level steps off-policy, and its lag."""
        phase = self.phase
        self.heartbeat(Phase.ROLLOUT_WAIT)
        max_lag = self.cfg.rl.max_async_level
        with self.timer("rollout_wait"):
            batch = self.batches.next_batch()
            lag = self.state.step - batch.policy_step
            while lag > max_lag:
                # rollouts from a policy older than rl.max_async_level are dropped, never trained on
                logger.warning("dropping rollouts %d steps off-policy (rl.max_async_level = %d)", lag, max_lag)
                batch = self.batches.next_batch()
                lag = self.state.step - batch.policy_step
        self.heartbeat(phase)
        return batch, lag

    def train_step(self) -> dict[str, float]:
        cfg, dist, timer = self.cfg, self.dist, self.timer
        batch, lag = self._next_batch()
        samples = batch.samples
        tokens = sum(len(s.completion_ids) for s in samples)
        with timer("communication"):
            total = max(1.0, float(parallel.all_reduce_sum(torch.tensor([float(tokens)]), dist)[0]))
        loss_sum = kl_sum = clip_sum = 0.0
        mbs = cfg.train.micro_batch_size
        chunks = [samples[i : i + mbs] for i in range(0, len(samples), mbs)] or [[]]
        pad_id = self.tokenizer.pad_token_id
        t0 = time.perf_counter()
        for i, chunk in enumerate(chunks):
            if not chunk:
                continue
            with parallel.grad_sync(self.model, enabled=i == len(chunks) - 1), self._autocast():
                with timer("forward"):
                    new_logp, mask = completion_logprobs(self.model, chunk, dist.device, cfg.rl.temperature, pad_id)
                    old = torch.zeros_like(new_logp)
                    for row, s in enumerate(chunk):
                        old[row, : len(s.old_logprobs)] = torch.tensor(s.old_logprobs[: new_logp.size(1)])
                    ref = None
                    if self.reference is not None:
                        with torch.no_grad():
                            ref, _ = completion_logprobs(self.reference, chunk, dist.device, cfg.rl.temperature, pad_id)
                    adv = torch.tensor([s.advantage for s in chunk], device=dist.device)
                    loss, kl, clipped = grpo_loss(new_logp, old, mask, adv, cfg.rl.clip_eps, ref, cfg.rl.kl_coef)
                with timer("backward"):
                    (loss * (dist.world_size / total)).backward()
            loss_sum += float(loss.detach())
            kl_sum += float(kl)
            clip_sum += float(clipped)
        with timer("optimizer"):
            grad_norm = self.clip_gradients()
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
        train_s = time.perf_counter() - t0
        with timer("weight_sync"):
            self.publish_weights()
        n = max(1.0, float(reduced[4]))
        return {
            "loss": float(reduced[0]) / total,
            "reward": float(reduced[3]) / n,
            "reward_std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
            "kl": float(reduced[1]) / total,
            "clip_fraction": float(reduced[2]) / total,
            "grad_norm": grad_norm,
            "lr": lr,
            "completion_tokens": int(total),
            "rollout_s": batch.seconds,
            "train_s": train_s,
            "step_time_s": batch.seconds + train_s,
            "off_policy_steps": lag,
        }

    def log_fields(self, m: dict) -> list[str]:
        return [
            f"reward {m['reward']:.3f}",
            f"loss {m['loss']:.4f}",
            f"kl {m['kl']:.4f}",
            f"rollout {m['rollout_s']:.1f}s train {m['train_s']:.1f}s",
        ]

    # ------------------------------------------------------------------ weights for the workers

    def publish_weights(self) -> None:
        """Write HF weights to weights/step-N (renamed when whole) and tell every worker to load them."""
        from prime_train.engine.export import export_hf

        self.heartbeat(Phase.EXPORT)
        out = self.run_dir.published_weights(self.state.step)
        export_hf(self.model, self.tokenizer, out, rank=self.dist.rank)
        if self.dist.is_rank0:
            self._published = (str(out), self.state.step)
            self.pool.update_weights(str(out), self.state.step)
            self._prune_published()
        self.weights_step = self.state.step

    def _prune_published(self) -> None:
        """Keep the KEEP_PUBLISHED newest published weights up to this step; drop the rest.

        Weights newer than this step come from steps a failed attempt trained and lost: a worker that
        restarts loads the newest directory, so they must go, or it would serve a policy from the future.
        """
        step = self.state.step
        found = sorted((int(p.name[5:]), p) for p in self.run_dir.weights_dir.glob("step-*") if p.name[5:].isdigit())
        keep = {s for s, _ in found if s <= step}
        keep = set(sorted(keep)[-KEEP_PUBLISHED:])
        for s, path in found:
            if s not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def _republish(self) -> None:
        """A worker came back after a restart: give it the newest published weights."""
        if self._published is not None:
            self.pool.update_weights(*self._published)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        """Mean reward and pass rate (reward 1) of greedy completions on held-out prompts, through the workers."""
        if not self.eval_prompts or not self.dist.is_rank0:
            return {}
        groups = self.batches.complete(
            [p.text for p in self.eval_prompts], n=1, max_tokens=self.cfg.rl.max_tokens, temperature=0.0, top_p=1.0
        )
        rewards = [self.env.reward(p, g[0].text) for p, g in zip(self.eval_prompts, groups, strict=True)]
        return {
            "eval_reward": sum(rewards) / len(rewards),
            "eval_pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
        }

    # ------------------------------------------------------------------ profile and close

    def profile_tokens(self, m: dict) -> float:
        return m["completion_tokens"]

    def profile_extra(self, profiled: list[dict]) -> dict:
        return {
            "rollout_latency_s": sum(m["rollout_s"] for m in profiled) / len(profiled),
            "max_async_level": self.cfg.rl.max_async_level,
        }

    def close(self) -> None:
        self.batches.close()
        self.reference = None
        super().close()


if __name__ == "__main__":
    main(GRPOJob)
