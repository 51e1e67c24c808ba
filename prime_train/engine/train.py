"""The embedded SFT / pretraining job: `python -m prime_train.engine.train --config RUN/config.toml`.

Run alone, or under torchrun for several processes. It reads the resolved config the caller
wrote, and speaks to the supervisor only through the run directory (DESIGN.md): progress.json
each step, metrics.jsonl, checkpoints/step-N, final/. Exit codes: 0 done, 75 checkpointed and
stopped on SIGTERM, 78 configuration error, anything else a crash.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import time

import torch

from prime_train.config.loader import ConfigError, load_config
from prime_train.config.schema import Config
from prime_train.rundir import RunDir, newest_checkpoint

logger = logging.getLogger("prime_train.engine")

EXIT_OK, EXIT_PREEMPTED, EXIT_CONFIG = 0, 75, 78


class StopFlag:
    """Set by SIGTERM/SIGINT: finish the step, save, exit 75."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name = ""

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name


def setup_logging(cfg: Config, rank: int) -> None:
    # per-rank chatter stays out of the console: other ranks log warnings and errors only
    level = getattr(logging, cfg.logging.level.upper()) if rank == 0 else logging.WARNING
    fmt = (
        "%(asctime)s %(levelname)s %(message)s" if rank == 0 else f"%(asctime)s [rank{rank}] %(levelname)s %(message)s"
    )
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    for noisy in ("transformers", "torch.distributed", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:  # transformers' own tqdm bars ("Writing model shards") would interleave with our log lines
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


def start_job(cfg: Config):
    """The start of every embedded job: join the process group, log from rank 0, create the run directory, seed."""
    from prime_train.engine import parallel

    run_dir = RunDir(cfg.run_dir)
    dist = parallel.init_distributed(cfg.distributed)
    setup_logging(cfg, dist.rank)
    if dist.is_rank0:
        run_dir.create()
    parallel.set_seed(cfg.run.seed, dist.rank)
    return run_dir, dist


def load_model_and_tokenizer(cfg: Config):
    """Tokenizer and model on the CPU; one that cannot be loaded is a configuration error (never retried)."""
    from prime_train.engine.metrics import EngineConfigError
    from prime_train.engine.model import build_model
    from prime_train.engine.tokenizer import load_tokenizer, padded_vocab_size

    try:
        tokenizer = load_tokenizer(cfg.model)
        model = build_model(cfg.model, padded_vocab_size(tokenizer, cfg.model.vocab_multiple))
    except (OSError, ValueError) as exc:
        key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
        raise EngineConfigError(f"{key}: cannot load {getattr(cfg.model, key.split('.')[1])!r}: {exc}") from None
    return tokenizer, model


class Trainer:
    """Composes model, data, optimizer, schedule, checkpointer and metrics; `train_step` is one optimizer step."""

    def __init__(self, cfg: Config):
        from prime_train.engine import parallel
        from prime_train.engine.checkpoint import Checkpointer, TrainState
        from prime_train.engine.data import build_eval_batches, build_train_loader, held_out_examples
        from prime_train.engine.metrics import EngineConfigError, MetricsLogger
        from prime_train.engine.model import flops_per_token, num_parameters, peak_flops
        from prime_train.engine.optim import build_optimizer
        from prime_train.engine.schedule import build_scheduler

        self.cfg = cfg
        self.run_dir, self.dist = start_job(cfg)
        self.strategy = parallel.resolve_strategy(cfg.distributed, self.dist.world_size)
        self._autocast = lambda: parallel.autocast(cfg.train.precision, self.dist.device)

        self.tokenizer, model = load_model_and_tokenizer(cfg)
        self.hf_config = model.config
        self.num_params = num_parameters(model)
        self.flops_per_token = flops_per_token(model.config, cfg.data.seq_len)
        model.to(self.dist.device)
        self.model = parallel.parallelize(model, cfg, self.dist)
        self.optimizer = build_optimizer(self.model, cfg.train, self.dist.device)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)

        common = dict(
            job=cfg.run.job,
            micro_batch_size=cfg.train.micro_batch_size,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            seed=cfg.run.seed,
        )
        self.loader = build_train_loader(cfg.data, self.tokenizer, device=self.dist.device, **common)
        self.eval_batches = build_eval_batches(cfg.data, self.tokenizer, max_batches=cfg.train.eval_batches, **common)
        self.eval_examples = held_out_examples(cfg.data, cfg.run.seed, 64)

        self.state = TrainState(self.model, self.optimizer, self.scheduler, self.loader, rank=self.dist.rank)
        self.checkpointer = Checkpointer(self.run_dir, cfg.ckpt, rank=self.dist.rank, world_size=self.dist.world_size)
        self.checkpointer.set_hf_assets(self.hf_config, self.tokenizer)
        self.metrics = MetricsLogger(self.run_dir, cfg, enabled=self.dist.is_rank0)
        device_name = torch.cuda.get_device_name(self.dist.device) if self.dist.device.type == "cuda" else "cpu"
        self.peak_flops = peak_flops(device_name)  # FLOP/s per device, None when unknown (never a guess)
        self.stop = StopFlag()
        from prime_train.engine.profiling import NullTimer, ProfileSession, profile_request

        request = profile_request()
        self.profile = (
            ProfileSession(self.run_dir.root, *request, device=self.dist.device, rank=self.dist.rank, job=cfg.run.job)
            if request
            else None
        )
        self.timer = self.profile.timer if self.profile else NullTimer()
        self._last_loss: float | None = None
        self._env = None
        self._env_prompts: list = []
        if cfg.train.eval_environment:
            from prime_train.rl.environments import load_environment

            try:
                self._env = load_environment(cfg.train.eval_environment, {})
            except (ValueError, ImportError) as exc:
                raise EngineConfigError(f"train.eval_environment: {exc}") from None
            self._env_prompts = self._env.prompts("eval", cfg.rl.eval_prompts or 64, cfg.run.seed)
        logger.info(
            "model %s: %.2fM parameters, strategy %s over %d process(es) on %s",
            self.hf_config.model_type,
            self.num_params / 1e6,
            self.strategy,
            self.dist.world_size,
            device_name,
        )

    # ------------------------------------------------------------------ steps

    def _global_batch(self) -> int:
        from prime_train.engine.schedule import batch_size_at

        return batch_size_at(self.state.tokens_seen, self.cfg.train, self.cfg.data.seq_len, self.dist.world_size)

    def train_step(self) -> dict[str, float]:
        """One optimizer step over a global batch with gradient accumulation; returns its metrics."""
        from prime_train.engine import parallel

        cfg, dist = self.cfg, self.dist
        timer = self.timer
        accum = self._global_batch() // (cfg.train.micro_batch_size * dist.world_size)
        with timer("data"):
            batches = [next(self.loader) for _ in range(accum)]
        # normalise by the labelled tokens of the whole global batch, so the loss and its gradient do not
        # depend on how the batch is split over ranks and micro-steps
        local_tokens = sum(int((b.labels[:, 1:] != -100).sum()) for b in batches)
        with timer("communication"):
            global_tokens = max(1.0, float(parallel.all_reduce_sum(torch.tensor([float(local_tokens)]), dist)[0]))
        from prime_train.engine.evaluate import token_losses

        loss_sum = torch.zeros((), dtype=torch.float64)
        tokens = 0
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            with timer("data"):
                ids = batch.input_ids.to(dist.device, non_blocking=True)
                pos = batch.position_ids.to(dist.device, non_blocking=True)
                labels = batch.labels.to(dist.device, non_blocking=True)
            with parallel.grad_sync(self.model, enabled=i == accum - 1), self._autocast():
                with timer("forward"):
                    part, _ = token_losses(self.model, ids, pos, labels)
                # DDP and FSDP average gradients over ranks; scale back up so the result is a global sum
                with timer("backward"):
                    (part * (dist.world_size / global_tokens)).backward()
            loss_sum += part.detach().double().cpu()
            tokens += batch.num_tokens
        with timer("optimizer"):
            grad_norm = self._clip_gradients()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if dist.device.type == "cuda":
            torch.cuda.synchronize(dist.device)
        step_time = time.perf_counter() - t0
        with timer("communication"):
            reduced = parallel.all_reduce_sum(torch.tensor([float(loss_sum), float(tokens)], dtype=torch.float64), dist)
        loss = float(reduced[0]) / global_tokens
        step_tokens = int(reduced[1])
        self.state.step += 1
        self.state.tokens_seen += step_tokens
        out = {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": step_tokens / step_time,
            "step_time_s": step_time,
            "tokens": self.state.tokens_seen,
            "global_batch": accum * cfg.train.micro_batch_size * dist.world_size,
        }
        if self.peak_flops:
            out["mfu"] = out["tokens_per_s"] * self.flops_per_token / (self.peak_flops * dist.world_size)
        if dist.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(dist.device) / 2**30
        return out

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.train.grad_clip if self.cfg.train.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=self.dist.device.type == "cuda")
        if hasattr(norm, "full_tensor"):  # FSDP2 returns a DTensor
            norm = norm.full_tensor()
        return float(norm)

    def param_norm(self) -> float:
        from prime_train.engine import parallel

        local = torch.zeros((), dtype=torch.float64)
        for p in self.model.parameters():
            data = p.to_local() if hasattr(p, "to_local") else p
            local += data.detach().double().pow(2).sum().cpu()
        if self.strategy in ("fsdp", "hsdp"):
            # shards are disjoint within a shard group but repeated across replicas; the full tensor is exact
            local = parallel.all_reduce_sum(local.reshape(1), self.dist)[0] / parallel.replica_count(
                self.dist, self.cfg
            )
        return float(local.sqrt())

    def evaluate(self, final: bool = False) -> dict[str, float]:
        from prime_train.engine.evaluate import eval_loss, exact_match, multiple_choice
        from prime_train.engine.tasks import get_task

        out = eval_loss(self.model, self.eval_batches, self.dist, self._autocast) if self.eval_batches else {}
        if self.eval_examples:
            task_name = next(d.task for d in self.cfg.data.datasets if d.task)
            task = get_task(task_name)
            acc, samples = exact_match(
                self.model, self.tokenizer, self.eval_examples, task.score, self.dist, self._autocast
            )
            out["eval_exact_match"] = acc
            for prompt, answer, output in samples:
                logger.info("  sample %r -> %r (expected %r)", prompt, output, answer)
            self.metrics.log_text(
                self.state.step, "samples", "\n".join(f"{p!r} -> {o!r} ({a!r})" for p, a, o in samples)
            )
        if self.cfg.train.eval_environment:
            out.update(self._environment_eval())
        if self.cfg.train.mc_eval_path:
            out["eval_mc_accuracy"] = multiple_choice(
                self.model, self.tokenizer, self.cfg.train.mc_eval_path, self.dist, self._autocast
            )
        return out

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

    # ------------------------------------------------------------------ the loop

    def resume(self) -> None:
        path = self.checkpointer.resolve_resume()
        if path is not None:
            self.metrics.heartbeat(self.state.step, phase="loading")
            self.checkpointer.load(self.state, path)
            logger.info("resumed from %s at step %d", path, self.state.step)

    def save(self, *, final: bool = False) -> None:
        self.metrics.heartbeat(self.state.step, phase="saving", tokens=self.state.tokens_seen)
        self.checkpointer.save(self.state, self.state.step, final=final)

    def fit(self) -> int:
        cfg = self.cfg
        self.stop.install()
        if self.profile is not None:
            return self.profile_fit()
        self.resume()
        if self.dist.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dist.device)
        self.metrics.heartbeat(self.state.step, phase="training", tokens=self.state.tokens_seen)
        start_step, t_start = self.state.step, time.time()
        if self.state.step == 0:
            # a baseline at step 0 so curves and "did it learn" have a starting point
            self.metrics.log(0, self.evaluate())
        while self.state.step < cfg.train.max_steps:
            if self._stop_agreed():
                return self._stop_and_save()
            m = self.train_step()
            self._last_loss = m["loss"]
            step = self.state.step
            self.checkpointer.poll()
            if step % cfg.logging.log_interval == 0 or step == cfg.train.max_steps:
                m["param_norm"] = self.param_norm()
            if step % cfg.train.eval_interval == 0 or step == cfg.train.max_steps:
                self.metrics.heartbeat(step, phase="eval", tokens=self.state.tokens_seen, loss=m["loss"])
                m.update(self.evaluate())
            self.metrics.log(step, m)
            self.metrics.heartbeat(
                step,
                phase="training",
                tokens=self.state.tokens_seen,
                loss=m["loss"],
                tokens_per_s=m["tokens_per_s"],
                step_time_s=m["step_time_s"],
            )
            if step % cfg.logging.log_interval == 0 or step == cfg.train.max_steps or step == start_step + 1:
                self._log_line(step, m, t_start, start_step)
            if step % cfg.ckpt.interval == 0 and step < cfg.train.max_steps:
                self.save()
        self.checkpointer.wait()
        if cfg.ckpt.resumable_final_save and self._newest_saved_step() != self.state.step:
            self.save(final=True)
        if cfg.ckpt.export_final:
            self.metrics.heartbeat(self.state.step, phase="exporting", tokens=self.state.tokens_seen)
            from prime_train.engine.export import export_hf

            export_hf(self.model, self.tokenizer, self.run_dir.final_dir, rank=self.dist.rank)
        self.metrics.heartbeat(self.state.step, phase="done", tokens=self.state.tokens_seen, loss=self._last_loss)
        return EXIT_OK

    def profile_fit(self) -> int:
        """`prime-train profile`: warmup steps, profiled steps, one timed checkpoint save; no eval, no export."""
        from prime_train.engine.profiling import run_profiled

        run_profiled(
            self,
            tokens_of=lambda m: m["tokens_per_s"] * m["step_time_s"],
            heartbeat_of=lambda m: {"tokens": self.state.tokens_seen, "loss": m["loss"]},
            extra_of=lambda profiled: {
                "mfu": profiled[-1].get("mfu"),
                "strategy": self.strategy,
                "num_params": self.num_params,
            },
        )
        return EXIT_OK

    def _newest_saved_step(self) -> int | None:
        newest = newest_checkpoint(self.run_dir.checkpoints_dir)
        return newest.step if newest else None

    def _stop_agreed(self) -> bool:
        """All ranks stop at the same step: a signal seen by any rank stops every rank."""
        from prime_train.engine import parallel

        flag = torch.tensor([1.0 if self.stop.requested else 0.0])
        return bool(parallel.all_reduce_sum(flag, self.dist)[0] > 0)

    def _stop_and_save(self) -> int:
        logger.warning(
            "stop requested (%s): saving a checkpoint at step %d and exiting 75",
            self.stop.signal_name or "peer rank",
            self.state.step,
        )
        self.checkpointer.wait()
        if self.state.step > 0 and self._newest_saved_step() != self.state.step:
            self.save(final=True)
        self.metrics.heartbeat(
            self.state.step, phase="stopped", tokens=self.state.tokens_seen, exit_code=EXIT_PREEMPTED
        )
        return EXIT_PREEMPTED

    def _log_line(self, step: int, m: dict, t_start: float, start_step: int) -> None:
        done = step - start_step
        elapsed = time.time() - t_start
        eta = elapsed / max(1, done) * (self.cfg.train.max_steps - step)
        parts = [
            f"step {step}/{self.cfg.train.max_steps}",
            f"loss {m['loss']:.4f}",
            f"lr {m['lr']:.2e}",
            f"grad {m['grad_norm']:.3f}",
            f"{m['tokens_per_s'] / 1e3:.1f}k tok/s",
        ]
        if "mfu" in m:
            parts.append(f"mfu {m['mfu']:.1%}")
        for key in ("eval_loss", "eval_exact_match", "eval_mc_accuracy"):
            if key in m and not math.isnan(m[key]):
                parts.append(f"{key} {m[key]:.4f}")
        parts.append(f"eta {eta:.0f}s")
        logger.info(" | ".join(parts))

    def close(self) -> None:
        close_job(self)


def close_job(job, *models: str) -> None:
    """The end of every embedded job: flush checkpoints and metrics, drop the model wrappers, leave the group.

    `models` names further attributes holding modules (RL's reference model) that go with the wrappers.
    """
    import gc

    from prime_train.engine import parallel

    job.checkpointer.close()
    job.metrics.close()
    # drop the DDP/FSDP wrappers before the process group goes, or gloo may abort at exit
    job.state = job.optimizer = job.scheduler = job.model = None
    for name in models:
        setattr(job, name, None)
    gc.collect()
    parallel.destroy_distributed()


def _record_exit(cfg: Config, code: int, reason: str) -> None:
    """Leave the verdict in progress.json: torchrun turns every worker failure into exit 1."""
    from prime_train.rundir import write_json_atomic

    if int(os.environ.get("RANK", "0")) == 0:
        run_dir = RunDir(cfg.run_dir)
        run_dir.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(
            run_dir.progress_path,
            {
                "step": None,
                "phase": "failed",
                "exit_code": code,
                "reason": reason,
                "time": time.time(),
                "pid": os.getpid(),
            },
        )


def run(config_path: str) -> int:
    """Load the resolved config and train; returns the process exit code."""
    from prime_train.engine.metrics import EngineConfigError

    try:
        cfg = load_config([config_path])
    except ConfigError as exc:
        print(f"config error:\n{exc}", file=sys.stderr)
        return EXIT_CONFIG
    trainer = None
    try:
        if cfg.run.job == "rl":
            from prime_train.engine.rl import RLTrainer

            trainer = RLTrainer(cfg)
        else:
            trainer = Trainer(cfg)
        return trainer.fit()
    except (EngineConfigError, ConfigError) as exc:
        logger.error("configuration error: %s", exc)
        print(f"configuration error: {exc}", file=sys.stderr)
        _record_exit(cfg, EXIT_CONFIG, str(exc))
        return EXIT_CONFIG
    finally:
        if trainer is not None:
            trainer.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prime_train.engine.train", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved run config (TOML)")
    args = parser.parse_args(argv)
    code = run(args.config)
    # everything is flushed and closed by now; skipping interpreter teardown avoids c10d's destructors
    # aborting a finished run (gloo, "terminate called without an active exception")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
