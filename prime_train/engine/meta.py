"""The meta-learning job: `python -m prime_train.engine.meta --config RUN/config.toml` (run.job = "meta").

Reptile (Nichol, Achiam and Schulman, 2018, "On First-Order Meta-Learning Algorithms"), first order: each entry of
data.datasets is one task. A meta step samples meta.tasks_per_step tasks (with replacement, from run.seed and the
step, so a resumed run samples the same ones); for each, a copy of the weights θ takes meta.inner_steps steps of plain
fine-tuning on that task alone (one micro-batch of train.micro_batch_size sequences a step, a fresh Adam or SGD at
meta.inner_lr), ending at θ'_τ; then the weights move toward the mean of the adapted weights:

    θ ← θ + ε · (mean_τ θ'_τ − θ),   ε = meta.outer_lr scaled by train.scheduler's schedule.

The move is taken as a gradient step: the job's optimizer is SGD (no momentum, no weight decay) at meta.outer_lr, its
learning rate scheduled as any job's, and the meta-gradient handed to it is θ − mean θ'. The loop around it is the one
loop's: checkpoints hold θ, the outer optimizer and schedule, every task's loader position and the RNG; a resumed run
trains on as the uninterrupted one would. MAML's second-order update is not built: through torch.func it would need
the inner steps' graph kept for every task (memory ∝ inner_steps), and first-order Reptile matched it in the paper.

The eval measures what meta-learning is for, few-shot adaptation to a task it never trained on (meta.eval_task, a
built-in task not among data.datasets): from the current θ, meta.adapt_steps steps of the same fine-tuning on it, and
its held-out loss before (eval_adapt_loss_start) and after (eval_adapt_loss); with meta.adapt_target_loss, the steps
that took to bring the loss there (eval_adapt_steps_to_target). eval_loss is the held-out loss of the training tasks
at θ. `adaptation_curve` is the same measurement for any model, for comparing with a plain multi-task SFT model.
"""

from __future__ import annotations

import copy
import logging
import os
import random
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from prime_train.config.schema import Config, DataConfig, DatasetConfig
from prime_train.engine.data import build_eval_batches, build_train_loader
from prime_train.engine.evaluate import eval_loss, token_losses
from prime_train.engine.loop import TrainingJob, main
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.packing import Batch

logger = logging.getLogger("prime_train.engine")

# examples generated for meta.eval_task: its adaptation stream and held-out batches
EVAL_TASK_EXAMPLES = 4000


def task_name(index: int, ds: DatasetConfig) -> str:
    """A task's name in logs and the checkpoint: its position and what it is."""
    return f"{index}:{ds.task or ds.path or ds.hub}"


class TaskStreams:
    """One resumable training stream per task; `state_dict` holds every stream's position (a checkpoint's loader)."""

    def __init__(self, streams: dict[str, Iterator[Batch]]):
        self.streams = streams
        self.names = list(streams)

    def next(self, name: str) -> Batch:
        return next(self.streams[name])

    def state_dict(self) -> dict[str, Any]:
        return {name: stream.state_dict() for name, stream in self.streams.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, stream in self.streams.items():
            if name in state:
                stream.load_state_dict(state[name])


def inner_optimizer(params: list[nn.Parameter], kind: str, lr: float, cfg: Config) -> torch.optim.Optimizer:
    """The inner steps' optimizer, fresh for each task: Adam with [train]'s betas and eps, or plain SGD."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    return torch.optim.Adam(params, lr=lr, betas=(cfg.train.beta1, cfg.train.beta2), eps=cfg.train.eps)


def fine_tune_step(model: nn.Module, batch: Batch, optimizer: torch.optim.Optimizer, device: torch.device) -> float:
    """One step of plain fine-tuning on one micro-batch: mean loss per labelled token; returns that loss."""
    batch = batch.to(device)
    loss_sum, count = token_losses(model, batch.input_ids, batch.position_ids, batch.labels)
    loss = loss_sum / count.clamp(min=1)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def load_weights(dst: nn.Module, src: nn.Module) -> None:
    """Copy `src`'s parameters into `dst` (same architecture), in place."""
    with torch.no_grad():
        for d, s in zip(dst.parameters(), src.parameters(), strict=True):
            d.copy_(s)


def reptile_update(meta: nn.Module, mean_adapted: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Move `meta` toward `mean_adapted`, the mean of the task-adapted weights (one tensor per parameter), through
    `optimizer` (SGD at ε: θ + ε(mean θ' − θ)): the meta-gradient θ − mean θ' goes in each parameter's .grad.
    Returns the meta-gradient's norm."""
    grads = []
    for p, mean in zip(meta.parameters(), mean_adapted, strict=True):
        p.grad = (p.detach() - mean).to(p.dtype)
        grads.append(p.grad)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def adaptation_curve(
    model: nn.Module,
    next_batch: Callable[[], Batch],
    eval_batches: list[Batch],
    steps: int,
    make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    dist,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
    *,
    every_step: bool = True,
) -> list[float]:
    """Held-out loss of `eval_batches` before and after each of `steps` fine-tuning steps of `model` (in place) on
    `next_batch()`'s batches (only the first and the last when every_step is off). One process: `dist` is its
    DistInfo."""
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    losses = [eval_loss(model, eval_batches, dist, autocast)["eval_loss"]]
    was_training = model.training
    model.train()
    for step in range(1, steps + 1):
        with autocast():
            fine_tune_step(model, next_batch(), optimizer, dist.device)
        if every_step or step == steps:
            losses.append(eval_loss(model, eval_batches, dist, autocast)["eval_loss"])
    model.train(was_training)
    return losses


def steps_to_reach(losses: list[float], target: float) -> int:
    """The first step (0: before any) whose loss is at most `target`; len(losses) when none is."""
    return next((step for step, loss in enumerate(losses) if loss <= target), len(losses))


def single_task(data: DataConfig, ds: DatasetConfig) -> DataConfig:
    """`data` with `ds` as its only dataset (one task's stream and held-out rows)."""
    return data.model_copy(update={"datasets": [ds], "sampling_probs": None})


class MetaJob(TrainingJob):
    """Reptile over the tasks of data.datasets; the eval adapts to meta.eval_task (see the module's docstring)."""

    job_name = "meta"
    eval_keys = ("eval_loss", "eval_adapt_loss_start", "eval_adapt_loss", "eval_adapt_steps_to_target")

    def configure(self) -> None:
        cfg = self.cfg
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise EngineConfigError(
                "run.job = 'meta' runs in one process (its inner loops adapt a private copy of the weights); set "
                "distributed.nproc_per_node = 1"
            )
        if len(cfg.data.datasets) < 2:
            raise EngineConfigError("run.job = 'meta' needs at least two tasks: list them as [[data.datasets]]")

    def make_optimizer(self) -> torch.optim.Optimizer:
        # the outer optimizer: SGD at ε, so that a step is exactly Reptile's move (reptile_update)
        return torch.optim.SGD(self.model.parameters(), lr=self.cfg.meta.outer_lr)

    def _data_args(self) -> dict:
        cfg = self.cfg
        return dict(job="sft", micro_batch_size=cfg.train.micro_batch_size, rank=0, world_size=1, seed=cfg.run.seed)

    def build_batch_source(self) -> TaskStreams:
        cfg = self.cfg
        streams = {
            task_name(i, ds): build_train_loader(
                single_task(cfg.data, ds), self.tokenizer, device=torch.device("cpu"), **self._data_args()
            )
            for i, ds in enumerate(cfg.data.datasets)
        }
        return TaskStreams(streams)

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        # the inner loops' weights: one private copy, loaded from θ before each task
        self.fast = copy.deepcopy(self.model)
        self.eval_batches = build_eval_batches(
            cfg.data, self.tokenizer, max_batches=cfg.train.eval_batches, **self._data_args()
        )
        self.adapt_stream, self.adapt_eval = None, []
        if cfg.meta.eval_task is not None:
            data = single_task(cfg.data, DatasetConfig(task=cfg.meta.eval_task, num_examples=EVAL_TASK_EXAMPLES))
            self.adapt_stream = build_train_loader(
                data, self.tokenizer, device=torch.device("cpu"), **self._data_args()
            )
            self.adapt_start = self.adapt_stream.state_dict()  # every eval adapts on the same batches
            self.adapt_eval = build_eval_batches(
                data, self.tokenizer, max_batches=cfg.train.eval_batches, **self._data_args()
            )

    # ------------------------------------------------------------------ one meta step

    def sampled_tasks(self, step: int) -> list[str]:
        """The tasks of meta step `step` (from 0): drawn from run.seed and the step alone, so a resume draws them
        again."""
        rng = random.Random(self.cfg.run.seed * 1_000_003 + step)
        return [rng.choice(self.batches.names) for _ in range(self.cfg.meta.tasks_per_step)]

    def train_step(self) -> dict[str, Any]:
        """One meta step: adapt a copy of θ to each sampled task, then move θ toward the adapted weights."""
        cfg, meta, device = self.cfg, self.cfg.meta, self.dist.device
        tasks = self.sampled_tasks(self.state.step)
        # the mean of the adapted weights, summed task by task: one copy of the weights however many tasks
        mean = [torch.zeros_like(p, dtype=torch.float32) for p in self.model.parameters()]
        first, last, tokens = [], [], 0
        for name in tasks:
            load_weights(self.fast, self.model)
            optimizer = inner_optimizer(list(self.fast.parameters()), meta.inner_optimizer, meta.inner_lr, cfg)
            losses = []
            for _ in range(meta.inner_steps):
                with self.timer("data"):
                    batch = self.batches.next(name)
                tokens += batch.num_tokens
                with self.timer("forward"), self._autocast():
                    losses.append(fine_tune_step(self.fast, batch, optimizer, device))
            first.append(losses[0])
            last.append(losses[-1])
            with torch.no_grad():
                for total, p in zip(mean, self.fast.parameters(), strict=True):
                    total.add_(p, alpha=1.0 / len(tasks))
        with self.timer("optimizer"):
            meta_grad_norm = reptile_update(self.model, mean, self.optimizer)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        self.state.step += 1
        self.state.tokens_seen += tokens
        return {
            "loss": sum(first) / len(first),  # the tasks' loss at θ, before adapting: what meta-training lowers
            "adapted_loss": sum(last) / len(last),
            "lr": lr,
            "grad_norm": meta_grad_norm,
            "tokens": self.state.tokens_seen,
            "global_batch": len(tasks) * meta.inner_steps * cfg.train.micro_batch_size,
        }

    def log_fields(self, m: dict[str, Any]) -> list[str]:
        return [
            f"loss {m['loss']:.4f}",
            f"adapted {m['adapted_loss']:.4f}",
            f"outer lr {m['lr']:.2e}",
            f"meta grad {m['grad_norm']:.3f}",
        ]

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        """The training tasks' held-out loss at θ; with meta.eval_task, few-shot adaptation to it from θ."""
        out = eval_loss(self.model, self.eval_batches, self.dist, self._autocast) if self.eval_batches else {}
        if self.adapt_stream is None or not self.adapt_eval:
            return out
        meta = self.cfg.meta
        self.adapt_stream.load_state_dict(self.adapt_start)
        load_weights(self.fast, self.model)
        losses = adaptation_curve(
            self.fast,
            lambda: next(self.adapt_stream),
            self.adapt_eval,
            meta.adapt_steps,
            lambda params: inner_optimizer(params, meta.inner_optimizer, meta.inner_lr, self.cfg),
            self.dist,
            self._autocast,
            every_step=meta.adapt_target_loss is not None,
        )
        out["eval_adapt_loss_start"] = losses[0]
        out["eval_adapt_loss"] = losses[-1]
        if meta.adapt_target_loss is not None:
            out["eval_adapt_steps_to_target"] = float(steps_to_reach(losses, meta.adapt_target_loss))
        return out


if __name__ == "__main__":
    main(MetaJob)
