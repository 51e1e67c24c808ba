"""One training loop for every embedded job: SFT, pretraining, DPO, the reward model, meta-learning, GRPO and PPO.

A job is a `TrainingJob` subclass that supplies its batch source (`build_batch_source`), one
optimizer step (`train_step`) and its evaluation (`evaluate`), and declares its console and heartbeat fields.
Everything around them is shared and lives here: joining the process group, loading the model and
tokenizer, building the optimizer, schedule, checkpointer and metrics, resuming, the heartbeat in every
phase (the job contract, prime_train/contract.py), cross-rank agreement on stopping, periodic and
resumable final saves, the final export, the profile mode and the exit code. `main(JobClass)` is the
process entry point each job module calls (`python -m prime_train.engine.train`, `python -m prime_train.rl.train`).

The loop's parts own their cadence: the metrics buffer says when a step is read and logged and checks it for
divergence (engine/metrics.py), the evaluator when it evaluates (engine/evaluate.py), the checkpointer when it saves
(engine/checkpoint.py), the stop agreement when the ranks agree on stopping (engine/stopping.py), and in a profile
(`prime-train profile`, PRIME_TRAIN_PROFILE) the profiler hooks time each step (engine/profiling.py). `run_step`
is one turn: the stop agreement, the step, and whatever is due after it.

With [lora] (lora.rank > 0) the loop puts peft's adapters into the model after the job's `prepare_model` and before
it is wrapped (engine/lora.py); only they train, checkpoints hold them and their optimizer state (TrainState's
adapter_only) with their settings in meta.json, which a resume must match (exit 78 otherwise), and the final export
writes the merged model and final/adapter/ in PEFT's format. Every job logs its trainable parameters at start and
in the first row of metrics.jsonl.

SIGTERM/SIGINT only set a flag; the step in progress finishes, every rank agrees to stop at the
same step, a checkpoint is saved synchronously and the process exits 75 (engine/checkpoint.py has
the full design). Before the first step there is nothing to save: a stop then ends start-up at once,
also with 75. The job does not outlive the process that started it: when that supervisor is gone
(engine/lifeline.py) the job stops the same way, and its last heartbeat says why. With several nodes, local rank 0
of each node writes the heartbeat into its node's run directory, beats for its node in the rendezvous store, and ends
the process at once (failure node_lost) when another node goes silent for distributed.peer_timeout_s. A loss or gradient
norm that is NaN or infinite ends the run at that step, before anything saves the diverged weights,
with a heartbeat naming the failure (`loss_not_finite`: not retried). See docs/architecture.md for
how the job meets the supervisor.

The steady state waits for the device only on logging steps. A step's loss and gradient norm stay on the
device; the loop buffers each step's metrics and reads them all at once on logging, eval and save steps and at
a stop (one sync), so a non-finite loss is seen up to logging.log_interval steps after it happened (the message
names the step it happened at, and no checkpoint is written in between). Tokens/s and MFU are wall clock between
those reads. progress.json is rewritten about once a second and at every phase change, renamed but not fsynced;
ranks agree on stopping every STOP_CHECK_S seconds' worth of steps; automatic GC is off and the young generation
is collected every GC_INTERVAL_STEPS steps, as torchtitan does.
"""

from __future__ import annotations

import argparse
import gc
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from typing import Any

import torch

from prime_train import cpu_share
from prime_train.config.loader import ConfigError, load_config
from prime_train.config.schema import Config
from prime_train.contract import (
    EVALUATION_S,
    FIRST_STEP_S,
    SAVE_S,
    ExitCode,
    Heartbeat,
    JobFailure,
    Phase,
    write_heartbeat,
    write_json_atomic,
)
from prime_train.engine import parallel, tensor_parallel
from prime_train.engine.best import Judges
from prime_train.engine.checkpoint import Checkpointer, StartOver, TrainState
from prime_train.engine.evaluate import Evaluator
from prime_train.engine.lifeline import PeerWatch, watch_peers, watch_supervisor
from prime_train.engine.lora import adapter_identity, apply_lora, trainable_parameters
from prime_train.engine.metrics import Divergence, EngineConfigError, HeartbeatWriter, MetricsBuffer, MetricsLogger
from prime_train.engine.model import load_model_and_tokenizer
from prime_train.engine.optim import build_optimizer
from prime_train.engine.pipeline import Pipeline, check_pipeline_config, with_pipeline_ranks
from prime_train.engine.precision import LossScaler
from prime_train.engine.profiling import NullProfile, ProfileSession, profile_request
from prime_train.engine.records import shown_path
from prime_train.engine.row_cache import RowCache
from prime_train.engine.schedule import build_scheduler
from prime_train.engine.stopping import StopAgreement, StopFlag, StopRequested
from prime_train.rundir import BEST_FILE

logger = logging.getLogger("prime_train.engine")

# gc.collect(1) every this many steps while automatic collection is off (torchtitan's default gc_freq).
GC_INTERVAL_STEPS = 50


def setup_logging(cfg: Config, rank: int) -> None:
    # per-rank chatter stays out of the console: other ranks log warnings and errors only
    level = getattr(logging, cfg.logging.level.upper()) if rank == 0 else logging.WARNING
    fmt = (
        "%(asctime)s %(levelname)s %(message)s" if rank == 0 else f"%(asctime)s [rank{rank}] %(levelname)s %(message)s"
    )
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    # torchao, which transformers imports whenever it is installed, warns at every start on a machine without its
    # GPU kernels ("Failed to load .../torchao/_C_mxfp8...so", "Detected no triton") and registers enums that torch's
    # pytree warns about: noise on every rank's console, none of it about the run (float8 and QAT fail in words of
    # their own when torchao cannot do what they ask)
    for noisy in ("transformers", "torch.distributed", "urllib3", "httpx", "torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:  # transformers' own tqdm bars ("Writing model shards") would interleave with our log lines
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass


class TrainingJob:
    """The shared parts of an embedded job and the loop that drives it; subclasses supply the job.

    A subclass implements `build_batch_source` (its data: a loader, a rollout source; checkpointed
    through `state_dict`/`load_state_dict`), `train_step` (one optimizer step, returning its metrics;
    it increments `self.state.step`), `evaluate`, declares `heartbeat_keys` and `eval_keys`, and may
    override the hooks below. Construction calls them in this order: `configure` (before the process
    group and the model), `prepare_model`, `build_batch_source`; a subclass's own `__init__` runs after
    all of it, with the model on its device.
    """

    job_name = "sft"
    # the step metrics progress.json carries (contract.Heartbeat's fields), as the job's step returns them
    heartbeat_keys: tuple[str, ...] = ("loss", "tokens_per_s", "step_time_s")
    # the evaluation's metrics the console line shows, when the evaluation returned them
    eval_keys: tuple[str, ...] = ("eval_loss",)
    # whether the job's step scales its loss through self.scaler (train.precision = "fp16" needs it)
    loss_scaling = False
    # whether the job's step reads batches and reduces counts per data-parallel replica (DistInfo.dp_rank/dp_size),
    # which distributed.tp_size > 1 needs: ranks of a tensor-parallel group share their batches
    supports_tensor_parallel = False

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.run_dir = cfg.layout
        # first: a stop during a long start-up (rendezvous, model load, resume) must end it, not kill it mid-write
        self.stop = StopFlag()
        self.stop.install()
        watch_supervisor(self.stop.supervisor_gone)
        self.resumed_from = 0
        self._lost_time: dict[str, float] = {}  # seconds of the last save, written on the next step's row
        self.failed = False  # set when the run ends failed: the trackers mark their run so
        self.configure()
        d = cfg.distributed
        self.dist = with_pipeline_ranks(parallel.init_distributed(d), d.pp_size, d.tp_size)
        setup_logging(cfg, self.dist.rank)
        self.cpu_share = cpu_share.from_environment()  # threads the launch chose, shared with other runs' trainers
        if cfg.distributed.tp_size > 1 and not self.supports_tensor_parallel:
            raise EngineConfigError(
                f"distributed.tp_size = {cfg.distributed.tp_size} is for run.job 'sft' and 'pretrain'; this "
                f"{self.job_name} job has no tensor-parallel step: set distributed.tp_size = 1 and shard with "
                "distributed.strategy = 'fsdp'"
            )
        # every node's supervisor reads its own run directory: local rank 0 of each node keeps the heartbeat there
        # (global rank 0's, on node 0, also writes the metrics and the export)
        self.beats = HeartbeatWriter(self.run_dir, cfg.train.max_steps, enabled=self.dist.local_rank == 0)
        if self.beats.enabled:
            self.run_dir.create()
        self.peers: PeerWatch | None = None
        if cfg.distributed.nnodes > 1 and self.beats.enabled:
            self.peers = self._watch_peers()
        parallel.set_seed(cfg.run.seed, self.dist.rank)
        # over the ranks that hold one pipeline stage (every rank without a pipeline), tensor-parallel groups included:
        # resolve_strategy counts the replicas from them, as parallelize does from the whole job
        self.strategy = parallel.resolve_strategy(cfg.distributed, self.dist.world_size // d.pp_size)
        if self.strategy in ("fsdp", "hsdp"):
            # FSDP2's mixed-precision policy already computes in bf16 (parallel.mixed_precision_policy): autocast on
            # top would only add casts of the already-bf16 parameters
            self._autocast = nullcontext
        else:
            self._autocast = lambda: parallel.autocast(cfg.train.precision, self.dist.device)

        self.tokenizer, model = load_model_and_tokenizer(cfg)
        model = self.model_to_train(model)
        self.hf_config = model.config
        self.prepare_model(model)
        self.lora_identity: dict[str, Any] | None = None
        if cfg.lora.enabled:
            # adapters into the bare model, before it moves and is wrapped or sharded; only they train from here
            # (and the job's trained_in_full modules, outside peft)
            model = apply_lora(
                model, cfg.lora, device=self.dist.device, strategy=self.strategy, train_in_full=self.trained_in_full
            )
            self.lora_identity = adapter_identity(model)
        # a pipeline moves only this rank's stages to the device
        self.pipeline: Pipeline | None = self._pipeline(model)
        self.model = self.pipeline.part if self.pipeline else parallel.parallelize(model, cfg, self.dist)
        self.optimizer = self.make_optimizer()
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.scaler = self._loss_scaler()
        self.batches = self.build_batch_source()
        self.state = TrainState(
            self.model, self.optimizer, self.scheduler, self.batches, rank=self.dist.rank,
            adapter_only=cfg.lora.enabled, data_rank=self.dist.dp_rank, flat_optim=self.pipeline is not None,
        )  # fmt: skip
        self.state.scaler = self.scaler
        self.checkpointer = Checkpointer(self.run_dir, cfg.ckpt, rank=self.dist.rank, world_size=self.dist.world_size)
        self.checkpointer.set_hf_assets(self.hf_config, self.tokenizer)
        self.checkpointer.lora_identity = self.lora_identity
        self.metrics = MetricsLogger(self.run_dir, cfg, enabled=self.dist.is_rank0)
        self._build_loop_parts()
        self.device_name = torch.cuda.get_device_name(self.dist.device) if self.dist.device.type == "cuda" else "cpu"
        self.trainable_params, self.total_params = trainable_parameters(self.model)
        if self.pipeline is not None:  # each rank holds its stages' part of the model
            counts = self.pipeline.sum_over_stages(torch.tensor([self.trainable_params, self.total_params]))
            self.trainable_params, self.total_params = (int(n) for n in counts.tolist())
        self._log_start()

    # whether the job's step runs through a Pipeline when distributed.pp_size > 1 (engine/pipeline.py)
    supports_pipeline = False

    def _pipeline(self, model) -> Pipeline | None:
        """This rank's stages of the model when distributed.pp_size > 1, else None (the model is parallelized)."""
        pp_size = self.cfg.distributed.pp_size
        if pp_size == 1:
            return None
        if not self.supports_pipeline:
            raise EngineConfigError(
                f"distributed.pp_size = {pp_size}: the {self.job_name} job does not run in a pipeline (SFT and "
                "pretraining do); set distributed.pp_size = 1"
            )
        check_pipeline_config(self.cfg, model, self.strategy)
        return Pipeline(model, self.cfg, self.dist, self.strategy)

    def _log_start(self) -> None:
        """The start-up line: the model, what of it trains, the strategy; with LoRA what a checkpoint holds."""
        trains = f"{self.trainable_params / 1e6:.3f}M ({self.trainable_fraction:.2%}) trainable"
        if self.lora_identity is not None:
            trains += f", LoRA rank {self.lora_identity['rank']}"
        logger.info(
            "%s job, model %s: %.2fM parameters, %s; strategy %s over %d process(es) on %s",
            self.job_name,
            self.hf_config.model_type,
            self.total_params / 1e6,
            trains,
            self.strategy,
            self.dist.world_size,
            self.device_name,
        )
        if self.lora_identity is not None:
            # a parameter's value and AdamW's two moments, in the parameters' own dtype
            per_param = 3 * next(self.model.parameters()).element_size()
            logger.info(
                "LoRA: a checkpoint holds the adapters and their optimizer state, about %.2f MB against about "
                "%.2f MB for the full weights; the frozen base is %s again at every start",
                self.trainable_params * per_param / 1e6,
                self.total_params * per_param / 1e6,
                f"loaded from {self.cfg.model.path}"
                if self.cfg.model.path
                else f"built from run.seed {self.cfg.run.seed}",
            )

    def _loss_scaler(self) -> LossScaler:
        """fp16's dynamic loss scaler (a pass-through in other precisions); only jobs whose step uses it allow fp16."""
        if self.cfg.train.precision == "fp16" and not self.loss_scaling:
            raise EngineConfigError(
                f"train.precision = 'fp16' needs loss scaling, which the {self.job_name} job does not do; "
                "use 'bf16' (or 'fp32' on GPUs without bf16)"
            )
        train = self.cfg.train
        return LossScaler.for_run(train.precision, self.strategy, self.dist.device, train.loss_scale_init)

    @property
    def trainable_fraction(self) -> float:
        """The share of the model's parameters the optimizer updates (1.0 without LoRA)."""
        return self.trainable_params / max(1, self.total_params)

    def parameter_counts(self) -> dict[str, Any]:
        """What of the model trains, for the first row of metrics.jsonl."""
        return {
            "total_params": self.total_params,
            "trainable_params": self.trainable_params,
            "trainable_fraction": self.trainable_fraction,
        }

    def _build_loop_parts(self) -> None:
        """The parts that own the loop's cadence; a profile (PRIME_TRAIN_PROFILE) reads every step, evaluates none."""
        cfg = self.cfg
        request = profile_request()
        self.profile: ProfileSession | NullProfile = (
            ProfileSession(self.run_dir, *request, device=self.dist.device, rank=self.dist.rank, job=self.job_name)
            if request
            else NullProfile()
        )
        self.timer = self.profile.timer
        self.stopping = StopAgreement(self.stop, self.dist)
        self._step_fields: dict[str, Any] = {}  # the newest step's heartbeat metrics (loss and when, reward)
        self.buffer = MetricsBuffer(
            self.metrics,
            interval=1 if self.profile.active else cfg.logging.log_interval,
            heartbeat_keys=self.heartbeat_keys,
            throughput=self.throughput,
            on_read=self.stopping.adapt,
            param_norms=not self.profile.active,
        )
        self.evaluator = Evaluator(
            self.evaluate, cfg.train.eval_interval, cfg.train.max_steps, enabled=not self.profile.active
        )
        self.judges = Judges(cfg.train.early_stopping, cfg.ckpt.keep_best)
        self.state.judges = self.judges

    def _watch_peers(self) -> PeerWatch:
        """Beat for this node and watch the others' in the rendezvous store: the static rendezvous's TCPStore,
        served by node 0's torchrun agent at the rendezvous endpoint, which torchrun hands the ranks as
        MASTER_ADDR/MASTER_PORT."""
        node = int(os.environ.get("GROUP_RANK", self.dist.rank // max(1, self.dist.local_world_size)))
        return watch_peers(
            self._node_lost,
            node=node,
            nnodes=self.cfg.distributed.nnodes,
            host=os.environ["MASTER_ADDR"],
            port=int(os.environ["MASTER_PORT"]),
            timeout_s=self.cfg.distributed.peer_timeout_s,
        )

    def _node_lost(self, reason: str) -> None:
        """Called from the peer lifeline's thread: another node is gone, so end this process now.

        The main thread may be blocked in a collective with the lost node for distributed.timeout_s; a flag it reads
        between steps would wait that long, so the thread itself leaves the verdict in the heartbeat (failure
        node_lost, which the supervisor retries) and exits. torchrun then ends the node's other ranks.
        """
        message = (
            f"{reason} (the bound: distributed.peer_timeout_s = {self.cfg.distributed.peer_timeout_s:g} s); "
            f"ending this attempt now instead of waiting out distributed.timeout_s = "
            f"{self.cfg.distributed.timeout_s} s in a collective"
        )
        logger.error("%s", message)
        try:
            state = getattr(self, "state", None)
            self._beat(
                state.step if state is not None else None,
                Phase.FAILED,
                exit_code=ExitCode.NODE_LOST,
                reason=message,
                failure=JobFailure.NODE_LOST,
            )
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(ExitCode.NODE_LOST)

    def _beat(self, step: int | None, phase: Phase, *, force: bool = True, **fields: Any) -> None:
        """progress.json in this node's run directory (local rank 0 of each node writes it)."""
        if isinstance(fields.get("reason"), str):  # a message can quote a dataset path, an URL, an env value
            fields["reason"] = shown_path(fields["reason"])
        self.beats.beat(step, phase, force=force, **fields)

    def finish_peers(self) -> None:
        """This node's ranks have ended the run together: its silence from now on is not a lost node."""
        if self.peers is not None:
            self.peers.finish()
            self.peers = None

    # ------------------------------------------------------------------ what a job supplies

    def configure(self) -> None:
        """Called first, before the process group and the model: the job's own parts that need neither (RL: the
        environment and the workers' pool), so that a bad setting is a configuration error before any model loads."""

    # modules (by name in the model) that train in full beside LoRA's adapters, kept outside peft: the reward job's
    # score head; a checkpoint of a LoRA run holds them with the adapters
    trained_in_full: tuple[str, ...] = ()

    def model_to_train(self, model):
        """The module the job trains, made from the loaded causal LM before anything else sees it (the reward job:
        its decoder under a scalar head); the causal LM itself by default."""
        return model

    def prepare_model(self, model) -> None:
        """Called with the loaded model before it moves to the device and is wrapped (RL copies its reference)."""

    def make_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the job's steps, over the built model: AdamW from [train] (meta: Reptile's outer SGD)."""
        return build_optimizer(self.model, self.cfg.train, self.dist.device)

    def row_cache(self) -> RowCache | None:
        """Where the job keeps its tokenized rows between starts (data.cache_rows; engine/row_cache.py)."""
        return RowCache(self.run_dir, node_first=self.dist.local_rank == 0) if self.cfg.data.cache_rows else None

    def build_batch_source(self):
        """The job's data: an iterator of batches or a rollout source, with state_dict/load_state_dict."""
        raise NotImplementedError

    def train_step(self) -> dict[str, Any]:
        """One optimizer step; increments self.state.step and returns the step's metrics (floats, or 0-dim device
        tensors the loop reads on logging steps: no host sync in the step)."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (`eval_*`); every rank calls it."""
        raise NotImplementedError

    def before_training(self) -> None:
        """After resume, before the first step (RL: wait for the workers, give them the current weights)."""

    def log_fields(self, m: dict[str, Any]) -> list[str]:
        """The job's parts of a console progress line."""
        return [f"loss {m['loss']:.4f}"]

    def throughput(self, tokens: int, seconds: float) -> dict[str, float]:
        """Metrics of the steps between two logging steps, from the wall clock: `tokens` trained in `seconds`."""
        if seconds <= 0 or tokens <= 0:
            return {}
        return {"tokens_per_s": tokens / seconds}

    def profile_tokens(self, m: dict[str, Any]) -> float:
        """Tokens one profiled step processed (for tokens/s in the profile summary)."""
        return m["tokens_per_s"] * m["step_time_s"]

    def profile_extra(self, profiled: list[dict[str, Any]]) -> dict[str, Any]:
        """The job's own fields of the profile summary, from the profiled steps' metrics."""
        return {}

    def close(self) -> None:
        """Flush checkpoints and metrics, drop the model wrappers, leave the process group."""
        self.checkpointer.close()
        self.metrics.close(failed=self.failed)
        if getattr(self, "cpu_share", None) is not None:
            self.cpu_share.release()
        # drop the DDP/FSDP wrappers before the process group goes, or gloo may abort at exit
        self.state = self.optimizer = self.scheduler = self.model = None
        gc.collect()
        parallel.destroy_distributed()

    # ------------------------------------------------------------------ the loop

    @property
    def phase(self) -> Phase:
        """What the job is doing now, as the heartbeat last said."""
        return self.beats.phase

    def heartbeat(self, phase: Phase, *, force: bool = True, **fields: Any) -> None:
        """Tell the supervisor what the job is doing now (local rank 0 writes progress.json).

        force=False (the steps' own heartbeat) writes only when the phase changes or about once a second.
        """
        tokens, resumed = self.state.tokens_seen, self.resumed_from
        # the last step's loss and reward on every heartbeat: between steps (an RL step's rollout wait) and when an
        # RL step says it is training again after its rollouts, with nothing of its own yet; none before the first
        fields = {**getattr(self, "_step_fields", {}), **fields}
        self._beat(self.state.step, phase, force=force, tokens=tokens, resumed_from=resumed, **fields)

    def fit(self) -> int:
        """Resume, train to train.max_steps, save and export; returns the exit code."""
        # GC as torchtitan controls it: automatic collections of the older generations stall a step for
        # tens of milliseconds at random; collect the young generation at a fixed interval instead
        gc.disable()
        gc.collect(1)
        try:
            self._start()
            while self.state.step < self.cfg.train.max_steps:
                if (code := self.run_step()) is not None:
                    return code
            return self._finish()
        finally:
            gc.enable()

    def _start(self) -> None:
        """Resume, get the job ready (RL: its workers), evaluate where a fresh run starts from, start the clock."""
        # no step yet: the one a resume starts from is known only once the checkpoint is loaded
        self._beat(None, Phase.STARTUP)
        self.resume()
        self.before_training()
        if self.dist.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.dist.device)
        # a fresh run's first row of metrics.jsonl says what of the model trains (a resume keeps its step-0 row)
        first = self.parameter_counts() if self.state.step == 0 else {}
        if self.evaluator.baseline_due(self.state.step):
            # a baseline at step 0 so curves and "did it learn" have a starting point
            self.heartbeat(Phase.EVAL)
            first.update(self.evaluator.run())
            self._judge(0, first)
        if first:
            self.metrics.log(0, first)
        self.stop.startup = False  # from here a stop finishes the step and saves
        # the first step of an attempt is part of start-up: CUDA and allocator warm-up, torch.compile
        self.heartbeat(Phase.COMPILE if self.cfg.train.compile else Phase.STARTUP)
        self.buffer.start(self.state.step, self.state.tokens_seen)
        self.profile.start()

    def run_step(self) -> int | None:
        """One turn of the training loop: the stop agreement, the step, and what is due after it.

        Returns an exit code when the run must end here (stopped, diverged), else None. Between logging steps it
        only buffers the step's metrics and writes the heartbeat when a second has passed: no host sync.
        """
        if self.stop.due_at(self.state.step) or self.stopping.agreed():
            return self._stop()
        m = self.train_step()
        step = self.state.step
        last = step == self.cfg.train.max_steps
        m.update(self._lost_time)  # the save before this step: its row says what it blocked (goodput)
        self._lost_time = {}
        self.buffer.record(step, m, tokens=self.state.tokens_seen)
        if step % GC_INTERVAL_STEPS == 0:
            gc.collect(1)
        self.checkpointer.poll()
        if self.cpu_share is not None and (threads := self.cpu_share.poll()) is not None:
            logger.info("CPU threads: %d (other runs of prime-train on this machine came or went)", threads)
            torch.set_num_threads(threads)
        logging_step = self.buffer.due(step, last=last)
        evaluating = self.evaluator.due(step)
        best, ending = False, None
        saving = self.checkpointer.due(step, last=last)
        if reading := logging_step or evaluating or saving:
            # every step since the last read, in one sync, checked before an eval or a save can use the weights
            if (diverged := self.buffer.flush(write=False)) is not None:
                return self._diverged(diverged)
            if self.buffer.param_norm_due(step, last=last):
                m["param_norm"] = self.param_norm()
            if step == self.buffer.first_step:  # compile and warm-up: goodput counts it apart from training
                m[FIRST_STEP_S] = m["step_time_s"]
            if evaluating:
                self.heartbeat(Phase.EVAL, loss=m.get("loss"), loss_step=step)
                eval_started = time.perf_counter()
                m.update(self.evaluator.run())
                m[EVALUATION_S] = time.perf_counter() - eval_started
                best, ending = self._judge(step, m)
                saving = saving or best
            self.buffer.write()
        self._step_fields = self.buffer.heartbeat(m)
        self.heartbeat(Phase.STEP, force=reading, **self._step_fields)
        if logging_step:
            self._log_line(step, m)
        if saving:
            save_started = time.perf_counter()
            self.save()
            self._lost_time[SAVE_S] = time.perf_counter() - save_started  # the blocking part of an async save
            if best:
                self._mark_best()
        if evaluating or saving:
            self.buffer.restart_window()  # tokens/s counts training time only
        self.profile.after_step(m)
        if ending is not None:
            logger.info("%s: the run ends at step %d", ending, step)
            return self._finish(reason=ending)
        return None

    def _finish(self, reason: str | None = None) -> int:
        """The run's end (train.max_steps, or `reason`: early stopping): the last save (a profile's timed one and its
        summary), the export; exit 0. An early end always saves its step, so that --resume can train on."""
        cfg = self.cfg
        self.checkpointer.wait()
        if self.profile.active:
            self._profile_summary()
        elif (cfg.ckpt.resumable_final_save or reason is not None) and not self.checkpointer.holds(self.state.step):
            self.save(final=True)
        if cfg.ckpt.export_final:
            self.heartbeat(Phase.EXPORT)
            self._load_best_for_export()
            self.export_final()
        fields = {"reason": reason} if reason is not None else {}
        self.heartbeat(Phase.DONE, loss=self.buffer.last_loss, **fields)
        return ExitCode.OK

    # ------------------------------------------------------------------ the loop's ends and parts

    def _judge(self, step: int, m: dict[str, Any]) -> tuple[bool, str | None]:
        """An eval's verdicts: whether it is the best so far and must be saved (ckpt.keep_best), and the reason to
        end the run here (train.early_stopping). Every rank sees the same reduced eval values and agrees."""
        best = self.judges.best.observe(step, m) if self.judges.best is not None else False
        ending = self.judges.early.observe(step, m) if self.judges.early is not None else None
        if best:
            logger.info(
                "best %s so far at step %d: %.6g", self.judges.best.watch.metric, step, self.judges.best.watch.best
            )
        return best, ending

    def _mark_best(self) -> None:
        """Retention keeps the best checkpoint from now on; checkpoints/best.json names it (rank 0 writes it)."""
        assert self.judges.best is not None
        record = self.judges.best.record()
        self.checkpointer.keep_steps = frozenset({record["step"]})
        if self.dist.is_rank0:
            write_json_atomic(self.checkpointer.ckpt_dir / BEST_FILE, record)

    def _load_best_for_export(self) -> None:
        """ckpt.keep_best.export: load the best checkpoint's weights so that final/ holds them (the last step's
        checkpoint, saved before, stays the one to resume from)."""
        keep = self.judges.best
        if keep is None or not keep.export or keep.watch.best_step in (None, self.state.step):
            return
        path = self.checkpointer.ckpt_dir / f"step-{keep.watch.best_step}"
        if (problem := self.checkpointer.problem_with(path)) is not None:
            logger.warning("final/ from the last step: the best checkpoint %s is not whole (%s)", path.name, problem)
            return
        step, tokens = self.state.step, self.state.tokens_seen
        logger.info("final/ from the best checkpoint, %s (%s %.6g)", path.name, keep.watch.metric, keep.watch.best)
        self.checkpointer.load(self.state, path)
        self.state.step, self.state.tokens_seen = step, tokens

    def export_final(self) -> None:
        """final/ in HF format (every rank calls it): with LoRA the merged model (unless lora.merge_on_export is off)
        and final/adapter/ in PEFT's format."""
        from prime_train.engine.export import export_hf

        lora = self.cfg.lora.enabled
        # under a pipeline rank 0 writes the whole model, gathered from the stages
        model = self.model if self.pipeline is None else self.pipeline.gathered_model()
        if model is None:
            return
        export_hf(
            model, self.tokenizer, self.run_dir.final_dir, rank=self.dist.rank,
            adapter=lora, merge=self.cfg.lora.merge_on_export or not lora, base_model=self.cfg.model.path,
            also=self._quantized_export(),
        )  # fmt: skip

    def _quantized_export(self):
        """train.qat: the writer of final/quantized/, the converted model (engine/qat.py); None without QAT."""
        scheme = self.cfg.train.qat
        if scheme == "none":
            return None
        from prime_train.engine.qat import write_quantized

        return lambda tmp: write_quantized(tmp, scheme, self.tokenizer)

    def resume(self) -> None:
        # resolves, verifies and loads; one that verifies but does not load is set aside and the one before it used
        path = self.checkpointer.resume(self.state)
        if path is not None:
            self.resumed_from = self.state.step
            logger.info("resumed from %s at step %d", path, self.state.step)
            if self.judges.best is not None and self.judges.best.watch.best_step is not None:
                self._mark_best()  # best.json as the checkpoint has it (a best saved after it did not finish)
        # metrics.jsonl then holds one row per step: the rows of the steps trained again after the checkpoint go
        self.metrics.rewind(self.state.step)

    def save(self, *, final: bool = False) -> None:
        """Save a checkpoint of the current step (every buffered step is in metrics.jsonl first)."""
        self.buffer.flush()  # metrics.jsonl holds every step up to the checkpoint's (the loop has read them already)
        self.heartbeat(Phase.SAVE)
        self.checkpointer.save(self.state, self.state.step, final=final)

    def param_norm(self) -> float:
        """The L2 norm of all parameters (the full tensor under FSDP: shards summed, replicas counted once)."""
        if self.cfg.distributed.tp_size > 1:  # every parameter a DTensor: replicated ones counted once by placement
            norm = tensor_parallel.parameter_norm(self.model)
            if self.pipeline is not None:  # this stage's; the stages' squares summed
                return float(self.pipeline.sum_over_stages(torch.tensor(norm * norm, dtype=torch.float64)).sqrt())
            return norm
        local = torch.zeros((), dtype=torch.float64)
        for p in self.model.parameters():
            data = p.to_local() if hasattr(p, "to_local") else p
            local += data.detach().double().pow(2).sum().cpu()
        if self.strategy in ("fsdp", "hsdp"):
            local = parallel.all_reduce_sum(local.reshape(1), self.dist)[0] / parallel.replica_count(
                self.dist, self.cfg
            )
        if self.pipeline is not None and self.strategy != "fsdp":  # each stage holds its own layers (under FSDP the
            local = self.pipeline.sum_over_stages(local)  # sum over every rank above already took every stage once)
        return float(local.sqrt())

    def clip_grad_norm(self) -> torch.Tensor:
        """Clip to train.grad_clip (no clipping when unset) and return the total gradient norm before clipping: a
        0-dim tensor on the device (no host sync)."""
        if self.pipeline is not None:  # the norm of every stage's gradients together
            return self.pipeline.clip_grad_norm(self.cfg.train.grad_clip)
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return torch.zeros((), device=self.dist.device)
        max_norm = self.cfg.train.grad_clip if self.cfg.train.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=self.dist.device.type == "cuda")
        if hasattr(norm, "full_tensor"):  # FSDP2 returns a DTensor
            norm = norm.full_tensor()
        return norm

    def _stop(self) -> int:
        """Every rank stops at this step: the buffered steps are read first, then a checkpoint is saved; exit 75."""
        if (diverged := self.buffer.flush()) is not None:
            return self._diverged(diverged)
        logger.warning(
            "stop requested (%s): saving a checkpoint at step %d and exiting 75", self.stop.describe(), self.state.step
        )
        self.checkpointer.wait()
        if self.state.step > 0 and not self.checkpointer.holds(self.state.step):
            self.save(final=True)
        self.heartbeat(Phase.STOPPED, exit_code=ExitCode.PREEMPTED, reason=self.stop.describe())
        return ExitCode.PREEMPTED

    def _diverged(self, diverged: Divergence) -> int:
        """End the run at a non-finite loss or gradient norm, saving nothing of the diverged weights.

        The values are reductions over every rank (train.py, rl/train.py), so every rank sees them and
        returns here at the same step without a collective of its own.
        """
        self.checkpointer.wait()  # a save in flight holds an earlier, finite state: let it finish
        newest = self.checkpointer.latest_step()
        where = f"the newest checkpoint, step-{newest}, is from before" if newest is not None else "no checkpoint"
        reason = (
            f"{diverged.describe()}: the run diverged; stopped without saving ({where}). "
            "Lower train.lr or lengthen the warmup, keep train.grad_clip set, prefer bf16 to fp16, check the data"
        )
        logger.error("%s", reason)
        self.heartbeat(Phase.FAILED, exit_code=ExitCode.FAILED, reason=reason, failure=JobFailure.LOSS_NOT_FINITE)
        return ExitCode.FAILED

    def _log_line(self, step: int, m: dict) -> None:
        max_steps = self.cfg.train.max_steps
        parts = [f"step {step}/{max_steps}", *self.log_fields(m)]
        for key in self.eval_keys:
            if isinstance(m.get(key), float) and not math.isnan(m[key]):
                parts.append(f"{key} {m[key]:.4f}")
        parts.append(f"eta {self.buffer.eta_s(step, max_steps):.0f}s")
        logger.info(" | ".join(parts))

    def _profile_summary(self) -> None:
        """A profile's end (`prime-train profile`): one timed checkpoint save, then profile/summary.json."""
        t0 = time.perf_counter()
        self.save()
        self.checkpointer.wait()
        checkpoint_s = time.perf_counter() - t0
        rows = self.profile.rows
        summary = self.profile.finish(
            world_size=self.dist.world_size,
            tokens_per_step=self.profile_tokens(rows[-1]),
            checkpoint_s=checkpoint_s,
            extra={
                "ckpt_interval": self.cfg.ckpt.interval,
                "device": str(self.dist.device),
                **self.profile_extra(self.profile.profiled_rows),
            },
        )
        logger.info("profile: %s", summary["bottleneck"]["kind"])


def _record_exit(cfg: Config, code: int, reason: str, phase: Phase = Phase.FAILED) -> None:
    """Leave the verdict in progress.json: torchrun turns every worker failure into exit 1."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # every node's supervisor reads its own run directory
        run_dir = cfg.layout
        run_dir.root.mkdir(parents=True, exist_ok=True)
        write_heartbeat(run_dir.progress_path, Heartbeat.now(None, phase, exit_code=code, reason=shown_path(reason)))


def run(job_class: type[TrainingJob], config_path: str) -> int:
    """Load the resolved config and train; returns the process exit code."""
    try:
        cfg = load_config([config_path])
    except ConfigError as exc:
        print(f"config error:\n{exc}", file=sys.stderr)
        return ExitCode.CONFIG
    job = None
    code: int = ExitCode.FAILED  # until fit returns: an exception ends the run failed
    try:
        job = job_class(cfg)
        code = job.fit()
        job.finish_peers()  # every rank left the loop together (done, stopped, diverged); not on an exception
        return code
    except StopRequested as exc:
        code = ExitCode.PREEMPTED  # a stop during start-up: not a failure
        logger.warning("%s; exiting 75", exc)
        _record_exit(cfg, ExitCode.PREEMPTED, str(exc), Phase.STOPPED)
        return ExitCode.PREEMPTED
    except StartOver as exc:  # said in words, not a traceback: the supervisor retries and the next start is clean
        logger.error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        _record_exit(cfg, ExitCode.FAILED, str(exc))
        return ExitCode.FAILED
    except (EngineConfigError, ConfigError) as exc:
        logger.error("configuration error: %s", exc)
        print(f"configuration error: {exc}", file=sys.stderr)
        _record_exit(cfg, ExitCode.CONFIG, str(exc))
        return ExitCode.CONFIG
    finally:
        if job is not None:
            job.failed = code not in (ExitCode.OK, ExitCode.PREEMPTED)
            job.close()


def main(job_class: type[TrainingJob], argv: list[str] | None = None) -> None:
    """The entry point of a job module: `python -m <module> --config RUN/config.toml`."""
    parser = argparse.ArgumentParser(prog=f"python -m {job_class.__module__}", description=job_class.__doc__)
    parser.add_argument("--config", required=True, help="resolved run config (TOML)")
    args = parser.parse_args(argv)
    code = run(job_class, args.config)
    # everything is flushed and closed by now; skipping interpreter teardown avoids c10d's destructors
    # aborting a finished run (gloo, "terminate called without an active exception")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))
