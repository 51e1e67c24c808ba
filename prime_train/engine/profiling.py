"""Where a step's time goes: phase timers, a torch.profiler window and the bottleneck verdict.

`prime-train profile CFG` runs the real job (under the supervisor, so RL workers start too) with
PRIME_TRAIN_PROFILE="<warmup>,<steps>" in its environment. The trainer then times each phase of
every step, records the last `steps` steps under torch.profiler (a Chrome trace per rank), times one
checkpoint save, and writes `profile/summary.json` in the run directory; the CLI reads it and names
the bottleneck. Without the variable the timer is a no-op and nothing here costs anything.

Phases: data (waiting for the next batch), forward, backward, optimizer (clip + step + zero_grad),
communication (the explicit all-reduces; DDP's bucketed all-reduce overlaps backward and is measured
from the trace), and for RL: rollout_wait (blocked on rollouts), weight_sync (export + /update_weights).
On CUDA each phase boundary synchronises the device, so the figures are real and the profiled run is
slightly slower than an unprofiled one (said in the output).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_train.contract import ENV_PROFILE, write_json_atomic
from prime_train.rundir import RunDir

logger = logging.getLogger("prime_train.engine.profiling")

COMM_EVENT = re.compile(r"gloo|nccl|all_?reduce|reduce_scatter|all_?gather|broadcast|c10d", re.IGNORECASE)


def profile_request() -> tuple[int, int] | None:
    """(warmup, steps) from PRIME_TRAIN_PROFILE, or None when not profiling."""
    raw = os.environ.get(ENV_PROFILE)
    if not raw:
        return None
    try:
        warmup, steps = (int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"{ENV_PROFILE}={raw!r}: expected '<warmup steps>,<profiled steps>'") from None
    if warmup < 0 or steps < 1:
        raise ValueError(f"{ENV_PROFILE}={raw!r}: warmup must be >= 0 and steps >= 1")
    return warmup, steps


class NullTimer:
    """The timer of an unprofiled run: every phase is a no-op context."""

    active = False

    def __call__(self, phase: str):
        return contextlib.nullcontext()

    def end_step(self) -> None:
        pass

    def reset(self) -> None:
        pass


@dataclass
class PhaseTimer:
    """Wall-clock seconds per phase per step; synchronises CUDA at each boundary so GPU work is counted."""

    device: Any = None
    active: bool = True
    steps: list[dict[str, float]] = field(default_factory=list)
    _current: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    _step_start: float = field(default_factory=time.perf_counter)

    def _sync(self) -> None:
        if self.device is not None and getattr(self.device, "type", "cpu") == "cuda":
            import torch

            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self._current[phase] += time.perf_counter() - t0

    def reset(self) -> None:
        """Start timing the next step from now (drop what happened since construction)."""
        self._current = defaultdict(float)
        self._step_start = time.perf_counter()

    def end_step(self) -> None:
        self._sync()
        now = time.perf_counter()
        record = dict(self._current)
        record["step"] = now - self._step_start
        self.steps.append(record)
        self._current = defaultdict(float)
        self._step_start = now


class NullProfile:
    """The profiler hooks of an unprofiled run: the training loop calls them, they do nothing."""

    active = False
    timer = NullTimer()

    def start(self) -> None:
        pass

    def after_step(self, metrics: dict[str, Any]) -> None:
        pass


class ProfileSession:
    """The profiler hooks of a profiled run, the training loop's profile mode: warmup steps, then `steps` under
    torch.profiler (the loop trains warmup + steps, train.max_steps of the profile's config, reading every step's
    metrics at once and evaluating nothing), then a timed checkpoint save and `finish`."""

    active = True

    def __init__(self, run_dir: RunDir, warmup: int, steps: int, *, device, rank: int, job: str):
        self.run_dir = run_dir
        self.dir = run_dir.profile_dir
        self.warmup, self.steps = warmup, steps
        self.device, self.rank, self.job = device, rank, job
        self.timer = PhaseTimer(device=device)
        self.rows: list[dict[str, Any]] = []  # every step's metrics, as the loop read them
        self._profiler = None
        self._done = 0
        self.dir.mkdir(parents=True, exist_ok=True)

    @property
    def profiled_rows(self) -> list[dict[str, Any]]:
        """The metrics of the steps under the profiler (all of them when there were no more than the warmup)."""
        return self.rows[self.warmup :] or self.rows

    def start(self) -> None:
        """Call just before the first step: the timer counts from here."""
        logger.info("profiling: %d warmup step(s), then %d step(s) under torch.profiler", self.warmup, self.steps)
        self.timer.reset()

    def after_step(self, metrics: dict[str, Any]) -> None:
        """Call after every optimizer step with its metrics; opens the torch.profiler window once warmup is over."""
        self.timer.end_step()
        self.rows.append(metrics)
        self._done += 1
        if self._profiler is not None:
            self._profiler.step()
        if self._done == self.warmup:
            self._start_profiler()

    def _start_profiler(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if getattr(self.device, "type", "cpu") == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities, record_shapes=False, with_stack=False)
        self._profiler.__enter__()

    def finish(self, *, world_size: int, tokens_per_step: float, checkpoint_s: float | None, extra: dict) -> dict:
        """Close the profiler, write the trace and (rank 0) profile/summary.json; returns the summary."""
        comm_s = 0.0
        trace: Path | None = None
        if self._profiler is not None:
            trace = self.dir / f"trace-rank{self.rank}.json"
            self._profiler.__exit__(None, None, None)
            comm_s = communication_seconds(self._profiler)
            self._profiler.export_chrome_trace(str(trace))
            self._profiler = None
        window = self.timer.steps[self.warmup :] or self.timer.steps
        summary = summarize(window, world_size=world_size, tokens_per_step=tokens_per_step, job=self.job)
        summary["communication_in_trace_s"] = comm_s / max(1, len(window))
        summary["checkpoint_save_s"] = checkpoint_s
        summary["trace"] = str(trace) if trace else None
        summary.update(extra)
        summary["bottleneck"] = diagnose(summary)
        if self.rank == 0:
            write_json_atomic(self.run_dir.profile_summary_path, summary)
        return summary


def communication_seconds(prof) -> float:
    """Seconds spent in collectives in a finished torch.profiler window (CPU-side and device-side events)."""
    total_us = 0.0
    for evt in prof.key_averages():
        if COMM_EVENT.search(evt.key):
            device_us = getattr(evt, "self_device_time_total", 0.0) or 0.0
            total_us += device_us or evt.self_cpu_time_total
    return total_us / 1e6


PHASES_SFT = ("data", "forward", "backward", "optimizer", "communication")
PHASES_RL = ("rollout_wait", "forward", "backward", "optimizer", "communication", "weight_sync")


def summarize(steps: list[dict[str, float]], *, world_size: int, tokens_per_step: float, job: str) -> dict:
    """Mean seconds per phase and per step over the profiled steps, and each phase's share of the step."""
    n = max(1, len(steps))
    phases = PHASES_RL if job == "rl" else PHASES_SFT
    mean = {p: sum(s.get(p, 0.0) for s in steps) / n for p in phases}
    step_s = sum(s.get("step", 0.0) for s in steps) / n
    mean["other"] = max(0.0, step_s - sum(mean.values()))
    return {
        "job": job,
        "profiled_steps": len(steps),
        "world_size": world_size,
        "step_s": step_s,
        "phases_s": mean,
        "shares": {p: (v / step_s if step_s else 0.0) for p, v in mean.items()},
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / step_s if step_s else 0.0,
    }


# A phase taking more than these shares of a step names the bottleneck.
DATA_BOUND = 0.20
COMM_BOUND = 0.25
ROLLOUT_BOUND = 0.50
CHECKPOINT_HEAVY = 0.10
# MFU a well-tuned dense model reaches in bf16 on an H100-class GPU: nanoGPT's train.py at GPT-2-124M shape ran
# ~38 % on an H100 (measured, FACTS.md), torchtitan reports ~40-50 % for Llama-3 8B. Below LOW_MFU_FRACTION of it
# a step is not where it should be, however much of it is forward and backward.
REACHABLE_MFU = 0.40
LOW_MFU_FRACTION = 0.75


def diagnose(summary: dict, ckpt_interval: int | None = None) -> dict:
    """The bottleneck, the numbers behind it, and what to change."""
    shares, phases = summary["shares"], summary["phases_s"]
    step_s = summary["step_s"]
    notes: list[str] = []
    interval = ckpt_interval or summary.get("ckpt_interval")
    if summary.get("checkpoint_save_s") and interval and step_s:
        cost = summary["checkpoint_save_s"] / (interval * step_s)
        if cost > CHECKPOINT_HEAVY:
            notes.append(
                f"a checkpoint save takes {summary['checkpoint_save_s']:.2f}s, {cost:.0%} of the {interval} steps "
                "between saves: raise ckpt.interval or keep ckpt.async_save on"
            )
    if summary["job"] == "rl" and shares.get("rollout_wait", 0) > ROLLOUT_BOUND:
        latency = summary.get("rollout_latency_s")
        train = step_s - phases.get("rollout_wait", 0)
        return {
            "kind": "latency-bound rollouts",
            "evidence": f"the trainer waits for rollouts {shares['rollout_wait']:.0%} of each step "
            f"({phases['rollout_wait']:.2f}s of {step_s:.2f}s; a rollout batch takes "
            f"{latency if latency is not None else float('nan'):.2f}s against {train:.2f}s of training)",
            "advice": "raise rl.max_async_level so rollouts overlap training, add inference workers "
            "(inference.num_workers), lower rl.max_tokens, or raise inference.max_num_seqs",
            "notes": notes,
        }
    if shares.get("data", 0) > DATA_BOUND:
        return {
            "kind": "data-bound",
            "evidence": f"waiting for batches is {shares['data']:.0%} of each step ({phases['data']:.3f}s of "
            f"{step_s:.3f}s)",
            "advice": "pre-tokenise the data, use local parquet shards instead of streaming over the network, "
            "or give the loader more CPU cores",
            "notes": notes,
        }
    comm = phases.get("communication", 0.0) + summary.get("communication_in_trace_s", 0.0)
    if summary["world_size"] > 1 and step_s and comm / step_s > COMM_BOUND:
        return {
            "kind": "communication-bound",
            "evidence": f"collectives take {comm:.3f}s a step, {comm / step_s:.0%} of {step_s:.3f}s "
            f"over {summary['world_size']} processes",
            "advice": "accumulate more micro-steps per optimizer step (fewer gradient syncs), raise "
            "distributed.bucket_cap_mb, use hsdp across nodes instead of fsdp, and check the interconnect "
            "(NCCL_DEBUG=INFO)",
            "notes": notes,
        }
    compute = sum(phases.get(p, 0.0) for p in ("forward", "backward", "optimizer"))
    share = f"forward, backward and optimizer are {compute / step_s if step_s else 0:.0%} of each step "
    share += f"({compute:.3f}s of {step_s:.3f}s)"
    mfu = summary.get("mfu")
    if mfu is None:
        return {
            "kind": "compute-bound",
            "evidence": f"{share}; MFU is unknown on this device (no dense bf16 peak known for it), so how far a "
            "step is from what the device can do is not known",
            "advice": "measure on the GPU you will rent; there, MFU says how close a step is to the device's peak",
            "notes": notes,
        }
    if mfu < LOW_MFU_FRACTION * REACHABLE_MFU:
        return {
            "kind": "under-utilised compute",
            "evidence": f"{share}, at MFU {mfu:.0%}: {mfu / REACHABLE_MFU:.0%} of the ~{REACHABLE_MFU:.0%} a "
            "well-tuned dense model reaches on this GPU in bf16",
            "advice": "the GPU waits on small kernels and the host: train.compile = true, a larger "
            "train.micro_batch_size (or longer data.seq_len) if memory allows, bf16 precision, and activation "
            "checkpointing only when memory needs it",
            "notes": notes,
        }
    return {
        "kind": "compute-bound",
        "evidence": f"{share}, at MFU {mfu:.0%}, near the ~{REACHABLE_MFU:.0%} a well-tuned dense model reaches",
        "advice": "this is where a step should be; more speed now comes from more GPUs or a smaller model",
        "notes": notes,
    }
