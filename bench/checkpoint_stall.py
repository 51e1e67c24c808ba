"""How long a checkpoint save stops the training loop: the engine's async DCP save against its synchronous one.

    python bench/checkpoint_stall.py                       # CPU: the tiny default, then GPT-2-124M shape
    python bench/checkpoint_stall.py --shapes tiny --dry   # seconds: one save of each kind, the figures printed
    python bench/checkpoint_stall.py --shapes gpt2         # CUDA: GPT-2-124M shape in bf16 (scripts/gpu-check.sh)

For each shape one engine job (engine/train.py SFTJob, its Checkpointer, its TrainState) trains `--warmup` steps,
then, per round and per kind (sync, then each async writer of `--writers`: `thread`, a thread of the trainer, and
`process`, DCP's checkpoint process, ckpt.async_writer; the order rotated each round):
- the step times of `--steps` steps before the save (the baseline, median);
- blocking: the wall time `Checkpointer.save` held the loop (sync: the whole DCP save, the digest and the rename;
  async: the staging copy to host memory, after which DCP writes in the background);
- the dip: the mean step time of the `--after` steps right after the save, as a ratio to the baseline (async:
  the background write competes with the steps for CPU and memory bandwidth, and a thread writer for the GIL);
  the async save is then waited for and finalized (its remaining time is not the loop's);
- printed: median blocking of each kind, async / sync blocking (the issue asks <= 0.1), and the dip of each kind
  (the issue asks the async dip <= 5 %). On CUDA the device is synchronized around every timed step. The process
  writer's first save, which starts the process, is made once before the rounds and not timed.

On the H200 on 2026-11-29 (GPT-2-124M shape, torch 2.11, two rounds, thread writer only): blocking sync 4.42 s,
async 0.70 s (1.07 s, then 0.32 s), ratio 0.157; the next 10 steps +28 % and +20 % slower after an async save.

On a CPU the "device to host" staging copy is a host memcpy and the background writer shares the cores with the
steps: the CPU figures bound what a GPU run sees, they do not predict it. Times are wall time (time.perf_counter).
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import tempfile
import time

import torch

from prime_train.config.schema import Config
from prime_train.engine.checkpoint import Checkpointer
from prime_train.engine.model import num_parameters
from prime_train.engine.train import SFTJob

SHAPES = {
    "tiny": dict(model={}, seq=128, micro=16, vocab_multiple=64),
    "gpt2": dict(
        model={
            "hidden_size": 768,
            "num_layers": 12,
            "num_heads": 12,
            "intermediate_size": 2048,
            "max_position_embeddings": 1024,
            "tie_embeddings": True,
        },
        seq=1024,
        micro=12,
        vocab_multiple=50304,  # GPT-2's padded vocabulary: the checkpoint's size is GPT-2-124M's
        cpu_rows=True,
    ),
}


def build_job(out: str, shape: dict, args, cuda: bool) -> SFTJob:
    seq, micro = shape["seq"], shape["micro"]
    if not cuda and shape.get("cpu_rows"):  # CPU: fewer, shorter rows keep a 124M step within seconds; the
        seq, micro = args.cpu_seq, 1  # checkpoint (weights and AdamW state) is the same size
    cfg = Config.model_validate(
        {
            "run": {"name": "ckpt-stall", "output_dir": out},
            "model": {**shape["model"], "vocab_multiple": shape["vocab_multiple"], "implementation": "native"},
            "train": {
                "max_steps": 10_000_000,
                "micro_batch_size": micro,
                "global_batch_size": micro,
                "eval_interval": 10_000_000,
                "compile": cuda,
                "warmup_steps": 0,
            },
            "data": {"seq_len": seq, "datasets": [{"task": "reverse-text", "num_examples": 2000}]},
            "ckpt": {"interval": 10_000_000, "export_final": False, "async_save": True, "keep_last": 2},
            "logging": {"tensorboard": False, "log_interval": 10_000_000, "level": "warning"},
        }
    )
    return SFTJob(cfg)


def timed_steps(job: SFTJob, count: int, sync) -> list[float]:
    """The wall time of each of `count` training steps (the engine's train_step: forward, backward, optimizer)."""
    times = []
    for _ in range(count):
        sync()
        t0 = time.perf_counter()
        job.train_step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def one_save(job: SFTJob, saver: Checkpointer, kind: str, args, sync) -> dict[str, float]:
    """Steps, a save of `kind` ("sync", or async through the writer `saver` has), steps after it: blocking seconds
    and the step-time dip."""
    before = statistics.median(timed_steps(job, args.steps, sync))
    sync()
    t0 = time.perf_counter()
    saver.save(job.state, job.state.step, final=kind == "sync")  # final=True: the synchronous path
    blocking = time.perf_counter() - t0
    after = timed_steps(job, args.after, sync)
    t1 = time.perf_counter()
    saver.wait()  # the async write's remainder, off the clock of the steps above
    return {
        "blocking_s": blocking,
        "step_s": before,
        "dip": statistics.fmean(after) / before - 1.0,
        "left_s": time.perf_counter() - t1,
    }


def bench_shape(name: str, args, cuda: bool) -> dict[str, list[dict[str, float]]]:
    shape = SHAPES[name]
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    with tempfile.TemporaryDirectory() as out:
        job = build_job(out, shape, args, cuda)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the job installed the engine's stop flag: end at once
        signal.signal(signal.SIGINT, signal.default_int_handler)
        job.batches = itertools.cycle([next(job.batches) for _ in range(8)])
        job.stop.startup = False
        params = num_parameters(job.model)
        timed_steps(job, args.warmup, sync)
        print(f"{name}: {params:,} parameters, {job.cfg.data.seq_len * job.cfg.train.micro_batch_size} tokens a "
              f"step, warmed up {args.warmup} steps", flush=True)  # fmt: skip
        # one checkpointer per async writer, over the same run directory (a new step-N per save)
        savers = {"sync": job.checkpointer, "thread": job.checkpointer}
        if "process" in args.writers:  # the first save starts DCP's checkpoint process: a warm-up save, untimed
            savers["process"] = Checkpointer(job.run_dir, job.cfg.ckpt.model_copy(update={"async_writer": "process"}),
                                             rank=0, world_size=1)  # fmt: skip
            job.state.step += 1
            savers["process"].save(job.state, job.state.step)
            savers["process"].wait()
        kinds = ["sync", *args.writers]
        results: dict[str, list[dict[str, float]]] = {kind: [] for kind in kinds}
        for r in range(args.rounds):
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:  # rotated: each kind first in turn
                job.state.step += 1  # a new step-N per save: the checkpointer never saves one step twice
                res = one_save(job, savers[kind], kind, args, sync)
                results[kind].append(res)
                print(f"  round {r + 1} {kind:7s}: blocked {res['blocking_s'] * 1e3:9.1f} ms, step "
                      f"{res['step_s'] * 1e3:8.1f} ms, next {args.after} steps {res['dip']:+.1%}"
                      + (f", then {res['left_s']:.2f} s to finish" if kind != "sync" else ""), flush=True)  # fmt: skip
        if "process" in savers:
            savers["process"].close()
        job.close()
    return results


def report(name: str, results: dict[str, list[dict[str, float]]], after: int, device: str) -> None:
    blocking = {k: statistics.median(r["blocking_s"] for r in v) for k, v in results.items()}
    dips = {k: statistics.median(r["dip"] for r in v) for k, v in results.items()}
    print(f"{name} on {device}: save blocking (median) sync {blocking['sync']:.3f} s; step time over the next {after} "
          f"steps sync {dips['sync']:+.1%}")  # fmt: skip
    for kind in [k for k in results if k != "sync"]:
        ratio = blocking[kind] / blocking["sync"]
        print(f"  async, {kind} writer: blocking {blocking[kind]:.3f} s, ratio to sync {ratio:.3f} (issue 35 asks "
              f"<= 0.1); next {after} steps {dips[kind]:+.1%} (asks <= +5%)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--shapes", default="tiny,gpt2" if not cuda else "gpt2", help="comma list of tiny, gpt2")
    p.add_argument("--rounds", type=int, default=3, help="saves of each kind")
    p.add_argument("--steps", type=int, default=10, help="steps before each save (the baseline step time)")
    p.add_argument("--after", type=int, default=10, help="steps after each save (the dip)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu-seq", type=int, default=256, help="CPU: the gpt2 shape's rows (one of them a step)")
    p.add_argument("--writers", type=lambda text: [w for w in text.split(",") if w], default=["thread", "process"],
                   help="comma list of the async writers timed beside the synchronous save: thread, process "
                   "(ckpt.async_writer)")  # fmt: skip
    p.add_argument("--dry", action="store_true", help="one round of 2 steps each: checks the bench runs, no figures")
    args = p.parse_args()
    if args.dry:
        args.rounds, args.steps, args.after, args.warmup = 1, 2, 2, 1
    if unknown := set(args.writers) - {"thread", "process"}:
        raise SystemExit(f"--writers: {', '.join(sorted(unknown))} is not one of thread, process")
    device = torch.cuda.get_device_name() if cuda else "cpu"
    for name in args.shapes.split(","):
        if name not in SHAPES:
            raise SystemExit(f"--shapes: {name!r} is not one of {', '.join(SHAPES)}")
        report(name, bench_shape(name, args, cuda), args.after, device)


if __name__ == "__main__":
    main()
