"""The embedded SFT / pretraining job: `python -m prime_train.engine.train --config RUN/config.toml`.

Run alone, or under torchrun for several processes. It reads the resolved config the caller
wrote and speaks to the supervisor only through the run directory (prime_train/contract.py):
progress.json, metrics.jsonl, checkpoints/step-N, final/. The loop around the step (resume,
heartbeat, stopping, saves, export, exit codes) is the shared one in engine/loop.py; this module
supplies the batch source, the step and the evaluation.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from prime_train.config.schema import Config
from prime_train.engine import parallel
from prime_train.engine.data import build_eval_batches, build_train_loader, held_out_examples
from prime_train.engine.evaluate import row_losses, token_losses
from prime_train.engine.loop import TrainingJob, main
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import flops_per_token, num_parameters, peak_flops

logger = logging.getLogger("prime_train.engine")
SAMPLES = 3  # held-out prompts of own data answered at each eval, logged beside their expected completions


class SFTJob(TrainingJob):
    """Supervised fine-tuning (loss on completions) and pretraining (loss on every token) over packed batches."""

    job_name = "sft"
    loss_scaling = True
    supports_tensor_parallel = True
    supports_pipeline = True
    eval_keys = (
        "eval_loss", "eval_exact_match", "eval_mc_accuracy", "eval_env_reward", "eval_env_pass_rate",
        "eval_previous_loss", "eval_previous_exact_match",
    )  # fmt: skip

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.job_name = cfg.run.job
        self.num_params = num_parameters(self.model)
        # with LoRA the frozen base's weights get no gradient: ~4N rather than 6N (model.flops_per_token)
        adapters = self.trainable_params if cfg.lora.enabled else None
        self.flops_per_token = flops_per_token(self.hf_config, cfg.data.seq_len, adapter_params=adapters)
        self.peak_flops = peak_flops(self.device_name)  # FLOP/s per device, None when unknown (never a guess)
        common = self._data_args()
        self.eval_batches = build_eval_batches(
            cfg.data, self.tokenizer, max_batches=cfg.train.eval_batches, cache=self.row_cache(), **common
        )
        self.eval_examples = held_out_examples(cfg.data, cfg.run.seed, 64)
        if self.pipeline is not None and (self.eval_examples or self._env or cfg.train.mc_eval_path):
            # generation needs the whole model on one rank; the held-out loss still runs through the pipeline
            logger.info(
                "distributed.pp_size = %d: generated-answer evaluations (exact match, train.eval_environment, "
                "train.mc_eval_path) are skipped under pipeline parallelism; eval_loss is computed",
                cfg.distributed.pp_size,
            )
            self.eval_examples, self._env = [], None
        self._continual_setup(common)

    def _continual_setup(self, common: dict) -> None:
        """continual.previous: its held-out eval (what is forgotten), and EWC's state in the checkpoint."""
        from prime_train.engine.continual import ElasticWeights

        cfg = self.cfg
        self.previous_data = None
        self.ewc: ElasticWeights | None = None
        if not cfg.continual.previous:
            return
        if self.pipeline is not None:
            raise EngineConfigError(
                "continual.previous is not supported with distributed.pp_size > 1: train the new data without "
                "a pipeline, or unset continual.previous"
            )
        self.previous_data = cfg.data.model_copy(update={"datasets": cfg.continual.previous, "sampling_probs": None})
        self.previous_eval_batches = build_eval_batches(
            self.previous_data, self.tokenizer, max_batches=cfg.train.eval_batches, **common
        )
        self.previous_examples = held_out_examples(self.previous_data, cfg.run.seed, 64)
        if cfg.continual.ewc_lambda > 0:
            self.ewc = ElasticWeights(self.model, cfg.continual.ewc_lambda)
            self.state.ewc = self.ewc

    def before_training(self) -> None:
        super().before_training()
        if self.ewc is not None and not self.ewc.ready:
            if self.state.step > 0:
                logger.warning(
                    "EWC: the checkpoint resumed from holds no EWC state; estimating it at step %d's weights, not "
                    "at the run's start", self.state.step,
                )  # fmt: skip
            previous = build_train_loader(
                self.previous_data, self.tokenizer, device=torch.device("cpu"), **self._data_args()
            )
            self.ewc.estimate(self.model, previous, self.cfg.continual.fisher_batches, self._autocast, self.dist.device)

    def configure(self) -> None:
        """The environment train.eval_environment names, if any: greedy answers scored by its reward at each eval."""
        cfg = self.cfg
        if cfg.data.curriculum == "self_paced" and cfg.distributed.pp_size > 1:
            raise EngineConfigError(
                "data.curriculum = 'self_paced' needs each row's loss on every rank, which a pipeline's last stage "
                "alone has: use 'length' or 'difficulty' with distributed.pp_size > 1"
            )
        self._env = None
        self._env_prompts: list = []
        if cfg.train.eval_environment:
            from prime_train.environments import load_environment

            try:
                self._env = load_environment(cfg.train.eval_environment, {})
            except (ValueError, ImportError) as exc:
                raise EngineConfigError(f"train.eval_environment: {exc}") from None
            self._env_prompts = self._env.prompts("eval", cfg.rl.eval_prompts or 64, cfg.run.seed)

    def _data_args(self) -> dict:
        return dict(
            job=self.cfg.run.job,
            micro_batch_size=self.cfg.train.micro_batch_size,
            # the data-parallel replica, not the process: a tensor-parallel group or a pipeline reads one stream
            rank=self.dist.dp_rank,
            world_size=self.dist.dp_size,
            seed=self.cfg.run.seed,
        )

    def build_batch_source(self):
        # batches stay on the host: train_step counts their tokens there, then copies them (no device-to-host sync)
        continual = self.cfg.continual
        return build_train_loader(
            self.cfg.data, self.tokenizer, device=torch.device("cpu"), replayed=continual.previous,
            replay=continual.replay, global_batch_size=self.cfg.train.global_batch_size,
            max_steps=self.cfg.train.max_steps, cache=self.row_cache(), **self._data_args(),
        )  # fmt: skip

    # ------------------------------------------------------------------ one step

    def _global_batch(self) -> int:
        from prime_train.engine.schedule import batch_size_at

        return batch_size_at(self.state.tokens_seen, self.cfg.train, self.cfg.data.seq_len, self.dist.dp_size)

    def train_step(self) -> dict[str, float | torch.Tensor]:
        """One optimizer step over a global batch with gradient accumulation; returns its metrics.

        No host sync in it: token counts come from the host batches before they are copied, and the loss and
        gradient norm stay on the device (0-dim tensors in the returned dict) until the loop's metrics buffer reads
        them on a logging step (engine/metrics.py), together with every step buffered since.
        """
        cfg, dist, timer = self.cfg, self.dist, self.timer
        accum = self._global_batch() // (cfg.train.micro_batch_size * dist.dp_size)
        with timer("data"):
            batches = [next(self.batches) for _ in range(accum)]
        # data.curriculum = 'self_paced' while its schedule lasts: the rows drawn, whose losses update the scores
        paced = self.batches.take_handed() if hasattr(self.batches, "take_handed") else None
        row_sums: list[torch.Tensor] = []
        # normalise by the labelled tokens of the whole global batch, so the loss and its gradient do not
        # depend on how the batch is split over ranks and micro-steps; counted on the host copies (no sync)
        local = [sum(int((b.labels[:, 1:] != -100).sum()) for b in batches), sum(b.num_tokens for b in batches)]
        # every rank of a tensor-parallel group or a pipeline holds the same batches: the sum over all ranks counts
        # each of them model_parallel_size times (exactly, so the division is exact too)
        copies = parallel.model_parallel_size(dist)
        with timer("communication"):
            global_labels, step_tokens = (n // copies for n in parallel.all_reduce_host_ints(local, dist))
        global_labels = max(1, global_labels)
        # DDP and FSDP average gradients over the data-parallel ranks; scale back up so the result is a global mean
        scale = dist.dp_size / global_labels
        loss_sum = torch.zeros((), dtype=torch.float32, device=dist.device)
        router: list[torch.Tensor] = []  # an MoE's router-loss terms, inside each part (engine/hf_head.py)
        for i, batch in enumerate(batches):
            with timer("data"):
                batch = _to_device(batch, dist.device)
            if self.pipeline is not None:
                with timer("forward"), self._autocast():  # forward and backward interleave in the schedule
                    part = self.pipeline.step(batch, scale)
            else:
                with parallel.grad_sync(self.model, enabled=i == accum - 1), self._autocast():
                    with timer("forward"):
                        if paced is None:
                            part, _ = token_losses(
                                self.model, batch.input_ids, batch.positions, batch.labels, router=router
                            )
                        else:  # the same forward, with each row's loss kept
                            part, rows = row_losses(
                                self.model, batch.input_ids, batch.positions, batch.labels, router=router
                            )
                            row_sums.append(rows)
                    with timer("backward"):
                        self.scaler.scale(part * scale).backward()
            loss_sum += part.detach().float()
        if self.pipeline is not None:
            with timer("communication"):
                self.pipeline.reduce_gradients()  # over the pipelines' replicas, when there are several
        with timer("optimizer"):
            self.scaler.unscale_(self.optimizer)  # fp16: clip and report the true gradients
            if self.ewc is not None:
                self.ewc.add_gradient()  # EWC's penalty enters as its gradient (engine/continual.py)
            grad_norm = self.clip_grad_norm()
            if not self.scaler.step(self.optimizer):
                grad_norm = torch.zeros_like(grad_norm)  # an overflow skipped the step: nothing was applied
            self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        sums = loss_sum.reshape(1)
        if router:  # the loss reported is the tokens' loss; the router's term is its own metric
            router_sum = torch.stack(router).sum().float()
            sums = torch.stack([loss_sum - router_sum, router_sum])
        with timer("communication"):
            parallel.all_reduce_(sums, dist)  # one collective, enqueued on the device under NCCL: no wait here
        loss_sum = sums[0]
        if paced is not None:
            self._pace(*paced, row_sums, batches)
        self.state.step += 1
        self.state.tokens_seen += step_tokens
        out: dict[str, float | torch.Tensor] = {
            # a tensor-parallel group's ranks each hold the whole loss; of a pipeline's, its last stage's (tp) ranks
            "loss": loss_sum / (global_labels * (cfg.distributed.tp_size if self.pipeline is not None else copies)),
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.state.tokens_seen,
            "global_batch": accum * cfg.train.micro_batch_size * dist.dp_size,
            **self.scaler.metrics(),
        }
        if router:
            out["router_loss"] = sums[1] / global_labels  # an MoE's: coef x its load-balancing loss
        if self.ewc is not None:
            out["ewc_penalty"] = self._ewc_penalty()
        if dist.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(dist.device) / 2**30  # allocator stats: no sync
        return out

    def _pace(self, positions, rows, row_sums: list[torch.Tensor], batches: list) -> None:
        """data.curriculum = 'self_paced': every rank folds the whole global batch's per-row mean losses into its
        scores, in the same order, so all ranks draw the next step's rows from the same table."""
        labelled = torch.cat([(b.labels[:, 1:] != -100).sum(1) for b in batches]).double()  # host batches: no sync
        losses = torch.cat(row_sums).double().cpu() / labelled  # the step's one wait for the device; 0/0: not scored
        local = torch.stack([torch.from_numpy(positions).double(), torch.from_numpy(rows).double(), losses], dim=1)
        with self.timer("communication"):
            every = parallel.all_gather_host(local, self.dist).reshape(-1, 3).numpy()
        self.batches.self_paced.observe(every[:, 0].astype(np.int64), every[:, 1].astype(np.int64), every[:, 2])

    def _ewc_penalty(self) -> torch.Tensor:
        """EWC's penalty over the whole model, whatever holds its parameters (DDP copies, FSDP/HSDP shards, tensor
        parallel cuts, pipeline stages): one all-reduce of each rank's share, no host sync."""
        holders = self.dist.world_size // self.cfg.distributed.pp_size  # the ranks holding this rank's stage
        local = self.ewc.local_penalty(holders).to(self.dist.device)
        return parallel.all_reduce_sum(local.reshape(1), self.dist)[0]

    def throughput(self, tokens: int, seconds: float) -> dict[str, float]:
        out = super().throughput(tokens, seconds)
        if self.peak_flops and "tokens_per_s" in out:
            out["mfu"] = out["tokens_per_s"] * self.flops_per_token / (self.peak_flops * self.dist.world_size)
        return out

    def log_fields(self, m: dict) -> list[str]:
        parts = [
            f"loss {m['loss']:.4f}",
            f"lr {m['lr']:.2e}",
            f"grad {m['grad_norm']:.3f}",
            f"{m['tokens_per_s'] / 1e3:.1f}k tok/s",
        ]
        if "router_loss" in m:
            parts.insert(1, f"router {m['router_loss']:.4f}")
        if "mfu" in m:
            parts.append(f"mfu {m['mfu']:.1%}")
        return parts

    def profile_extra(self, profiled: list[dict]) -> dict:
        return {"mfu": profiled[-1].get("mfu"), "strategy": self.strategy, "num_params": self.num_params}

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        from prime_train.engine.evaluate import eval_loss, exact_match, multiple_choice
        from prime_train.tasks import get_task

        out = {}
        if self.eval_batches and self.pipeline is not None:
            out = self.pipeline.eval_loss(self.eval_batches, self._autocast, self.cfg.train.micro_batch_size)
        elif self.eval_batches:
            out = eval_loss(self.model, self.eval_batches, self.dist, self._autocast)
        if self.eval_examples:
            task = get_task(next(d.task for d in self.cfg.data.datasets if d.task))
            acc, samples = exact_match(
                self.model, self.tokenizer, self.eval_examples, task.score, self.dist, self._autocast
            )
            out["eval_exact_match"] = acc
            for prompt, answer, output in samples:
                logger.info("  sample %r -> %r (expected %r)", prompt, output, answer)
            self.metrics.log_text(
                self.state.step, "samples", "\n".join(f"{p!r} -> {o!r} ({a!r})" for p, a, o in samples)
            )
        elif self.eval_batches and self.pipeline is None:
            self._log_own_data_samples()
        if self.previous_data is not None:
            out.update(self._previous_eval())
        if self._env is not None:
            out.update(self._environment_eval())
        if self.cfg.train.mc_eval_path and self.pipeline is None:
            out["eval_mc_accuracy"] = multiple_choice(
                self.model, self.tokenizer, self.cfg.train.mc_eval_path, self.dist, self._autocast
            )
        return out

    def _previous_eval(self) -> dict[str, float]:
        """continual.previous's held-out loss and exact match: what the new data makes the model forget."""
        from prime_train.engine.evaluate import eval_loss, exact_match
        from prime_train.tasks import get_task

        out = {}
        if self.previous_eval_batches:
            measured = eval_loss(self.model, self.previous_eval_batches, self.dist, self._autocast)
            out["eval_previous_loss"] = measured.get("eval_loss", float("nan"))
        if self.previous_examples:
            task = get_task(next(d.task for d in self.cfg.continual.previous if d.task))
            out["eval_previous_exact_match"], _ = exact_match(
                self.model, self.tokenizer, self.previous_examples, task.score, self.dist, self._autocast
            )
        return out

    def _log_own_data_samples(self) -> None:
        """Greedy answers to a few held-out prompts of the run's own data (prompt_completion, chat) beside the
        completions the data holds: what the model says, not only its loss. Every rank decodes (a sharded model
        needs all of them), only when every rank has the samples."""
        from prime_train.engine.evaluate import greedy_complete, held_out_completions
        from prime_train.engine.parallel import all_reduce_sum

        pairs = held_out_completions(self.eval_batches, limit=SAMPLES)
        ready = all_reduce_sum(torch.tensor([float(len(pairs) == SAMPLES)]), self.dist)
        if int(ready.item()) != self.dist.world_size:
            return
        outputs = greedy_complete(
            self.model, self.tokenizer, [p for p, _ in pairs], self.dist, self._autocast, max_new_tokens=48
        )
        decode = self.tokenizer.decode
        shown = [
            (decode(p, skip_special_tokens=True)[-200:], decode(e, skip_special_tokens=True), o)
            for (p, e), o in zip(pairs, outputs, strict=True)
        ]
        for prompt, expected, output in shown:
            logger.info("  sample %r -> %r (expected %r)", prompt, output, expected)
        self.metrics.log_text(self.state.step, "samples", "\n".join(f"{p!r} -> {o!r} ({e!r})" for p, e, o in shown))

    def _environment_eval(self) -> dict[str, float]:
        """Greedy answers to an environment's held-out prompts, scored by its reward (as RL evaluates)."""
        from prime_train.engine.evaluate import greedy_complete

        outputs = greedy_complete(
            self.model, self.tokenizer, [p.text for p in self._env_prompts], self.dist, self._autocast,
            max_new_tokens=self.cfg.rl.max_tokens,
        )  # fmt: skip
        rewards = [self._env.reward(p, o) for p, o in zip(self._env_prompts, outputs, strict=True)]
        return {
            "eval_env_reward": sum(rewards) / len(rewards),
            "eval_env_pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
        }


def _to_device(batch, device: torch.device):
    """The batch on `device`; from pinned memory on CUDA, so the copy is asynchronous to the host."""
    if device.type != "cuda":
        return batch
    return batch.pin_memory().to(device, non_blocking=True)


if __name__ == "__main__":
    main(SFTJob)
