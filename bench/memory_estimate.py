"""The memory calculator against measurement, on the engine's own model and one real training step.

    python bench/memory_estimate.py [--hidden 512] [--layers 8] [--seq 512] [--micro 4]

On every device: the bytes of parameters, gradients and AdamW states after one step, measured
tensor by tensor, against `prime-train memory`'s figures (ratio estimate / measured). On a CUDA GPU
it also runs the step in bf16 autocast and compares the estimated per-GPU total (without the fixed
runtime allowance, which allocations do not see) with torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse

import torch
from rich.console import Console
from rich.table import Table

from prime_train.config.schema import Config
from prime_train.validator.memory import estimate, inputs_from_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro", type=int, default=4)
    args = parser.parse_args()

    from prime_train.engine.evaluate import token_losses
    from prime_train.engine.model import build_model
    from prime_train.engine.optim import build_optimizer

    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda" if on_gpu else "cpu")
    cfg = Config.model_validate(
        {
            "model": {"hidden_size": args.hidden, "num_layers": args.layers, "num_heads": max(1, args.hidden // 64),
                      "max_position_embeddings": max(512, args.seq)},
            "data": {"seq_len": args.seq},
            "train": {"micro_batch_size": args.micro, "global_batch_size": args.micro,
                      "precision": "bf16" if on_gpu else "fp32"},
        }
    )  # fmt: skip
    vocab = 320  # the byte tokenizer padded to a multiple of 64
    model = build_model(cfg.model, vocab).to(device)
    optimizer = build_optimizer(model, cfg.train, device)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    ids = torch.randint(0, 256, (args.micro, args.seq), device=device)
    pos = torch.arange(args.seq, device=device).expand(args.micro, -1)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else torch.autocast("cpu", enabled=False)
    with autocast:
        loss, _ = token_losses(model, ids, pos, ids.clone())
    loss.backward()
    optimizer.step()
    peak = torch.cuda.max_memory_allocated(device) if on_gpu else None

    measured = {
        "weights": sum(p.numel() * p.element_size() for p in model.parameters()),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None),
        "optimizer states": sum(
            t.numel() * t.element_size()
            for state in optimizer.state.values()
            for name, t in state.items()
            if torch.is_tensor(t) and name != "step"
        ),
    }
    hf = model.config.to_dict()
    report = estimate(inputs_from_config(cfg, model=hf, precision="bf16" if on_gpu else "fp32"))
    table = Table(
        title=f"memory estimate vs measurement ({device}, {sum(p.numel() for p in model.parameters()):,} params)"
    )
    for col in ("part", "estimated MiB", "measured MiB", "ratio"):
        table.add_column(col, justify="right" if col != "part" else "left")
    for part, real in measured.items():
        est = report.trainer.get(part)
        table.add_row(part, f"{est / 2**20:.2f}", f"{real / 2**20:.2f}", f"{est / real:.3f}")
    if peak is not None:
        est_total = report.trainer.total - report.trainer.get("runtime")
        table.add_row("peak allocated", f"{est_total / 2**20:.1f}", f"{peak / 2**20:.1f}", f"{est_total / peak:.3f}")
    Console().print(table)
    if peak is None:
        print("no CUDA GPU: the peak-allocation comparison (torch.cuda.max_memory_allocated) runs on a GPU only")


if __name__ == "__main__":
    main()
