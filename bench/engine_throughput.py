"""Engine throughput against a plain hand-written PyTorch loop: same model, batches and optimizer.

    python bench/engine_throughput.py [--steps 30] [--rounds 3] [--micro 16] [--seq 128]

Both run in this process, alternating in rounds so background load hits them alike. The engine's
figure includes everything its train_step does (global token normalisation, gradient clipping, LR
schedule, metrics); the plain loop does forward, backward, AdamW step. Goal: ratio >= 0.97.
On a GPU it also prints the engine's MFU.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from prime_train.config.schema import Config
from prime_train.engine.train import SFTJob


def build_trainer(out: str, args) -> SFTJob:
    cfg = Config.model_validate(
        {
            "run": {"name": "bench", "output_dir": out},
            "train": {
                "max_steps": 10_000,
                "micro_batch_size": args.micro,
                "global_batch_size": args.micro * args.accum,
                "eval_interval": 10_000,
            },
            "data": {"seq_len": args.seq, "datasets": [{"task": "arithmetic", "num_examples": 20000}]},
            "ckpt": {"interval": 10_000, "export_final": False},
            "logging": {"tensorboard": False},
        }
    )
    return SFTJob(cfg)


def plain_loop_steps(model, optimizer, batches, steps: int, accum: int, device) -> tuple[float, int]:
    """The baseline: mean loss per micro-batch, backward, clip, step — nothing else."""
    tokens = 0
    t0 = time.perf_counter()
    it = iter(batches)
    for _ in range(steps):
        for _ in range(accum):
            b = next(it)
            logits = model(input_ids=b.input_ids.to(device), position_ids=b.position_ids.to(device)).logits
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.size(-1)), b.labels[:, 1:].reshape(-1).to(device), ignore_index=-100
            )
            (loss / accum).backward()
            tokens += b.num_tokens
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, tokens


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args()
    console = Console()
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(out, args)
        device = trainer.dist.device
        # the baseline trains its own copy of the same architecture with the same optimizer settings
        from prime_train.engine.model import build_model
        from prime_train.engine.optim import build_optimizer
        from prime_train.engine.tokenizer import padded_vocab_size

        base_model = build_model(trainer.cfg.model, padded_vocab_size(trainer.tokenizer, 64)).to(device)
        base_opt = build_optimizer(base_model, trainer.cfg.train, device)
        batches = [next(trainer.batches) for _ in range(args.steps * args.accum * (args.rounds + 1))]

        # warm-up both
        for _ in range(3):
            trainer.train_step()
        plain_loop_steps(base_model, base_opt, batches, 3, args.accum, device)

        engine_tps, plain_tps, mfu = [], [], []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            tokens = 0
            for _ in range(args.steps):
                m = trainer.train_step()
                tokens += int(m["global_batch"] * args.seq)
                if "mfu" in m:
                    mfu.append(m["mfu"])
            engine_time = time.perf_counter() - t0
            engine_tps.append(tokens / engine_time)
            plain_time, _plain_tokens = plain_loop_steps(base_model, base_opt, batches, args.steps, args.accum, device)
            plain_tps.append(args.steps * args.accum * args.micro * args.seq / plain_time)
        trainer.close()

    table = Table(title=f"engine vs plain loop ({device}, {args.rounds} rounds × {args.steps} steps)")
    table.add_column("loop")
    table.add_column("median tokens/s (padded)", justify="right")
    table.add_column("median step time", justify="right")
    per_step = args.accum * args.micro * args.seq
    for name, tps in (("plain PyTorch", plain_tps), ("prime-train engine", engine_tps)):
        med = statistics.median(tps)
        table.add_row(name, f"{med:,.0f}", f"{per_step / med * 1e3:.1f} ms")
    console.print(table)
    ratios = [e / p for e, p in zip(engine_tps, plain_tps, strict=True)]
    console.print("per-round ratios: " + ", ".join(f"{r:.3f}" for r in ratios))
    ratio = statistics.median(ratios)
    console.print(f"ratio engine / plain (median of rounds): [bold]{ratio:.3f}[/bold] (goal ≥ 0.97)")
    if mfu:
        console.print(f"engine MFU: {statistics.median(mfu):.1%}")


if __name__ == "__main__":
    main()
