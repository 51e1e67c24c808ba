"""Few-shot adaptation to a held-out task: steps of plain fine-tuning from a Reptile model against from a plain
multi-task SFT model trained on the same tasks for the same number of sequences.

    python bench/meta_adaptation.py RUNS/reptile/final RUNS/sft-multi/final [--task reverse-text] [--steps 30]
        [--lr 1e-3] [--target 2.5]

Each model (an HF directory) is fine-tuned on the task's training stream for --steps steps (micro-batches of 16
packed sequences of 128 tokens, Adam at --lr with [train]'s default betas, fresh for each model: what the meta job's
eval does, engine/meta.adaptation_curve), and the task's held-out loss is measured before and after every step; the
same batches for every model. Printed: the loss curve at a few steps and the steps to bring it to --target.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_train.config.schema import Config, DataConfig, DatasetConfig
from prime_train.engine.data import build_eval_batches, build_train_loader
from prime_train.engine.meta import EVAL_TASK_EXAMPLES, adaptation_curve, inner_optimizer, steps_to_reach
from prime_train.engine.parallel import DistInfo

DIST = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="HF model directories (a run's final/)")
    parser.add_argument("--task", default="reverse-text")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--target", type=float, default=2.5)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    cfg = Config()
    data = DataConfig(seq_len=128, datasets=[DatasetConfig(task=args.task, num_examples=EVAL_TASK_EXAMPLES)])
    for path in args.models:
        torch.manual_seed(0)
        tokenizer = AutoTokenizer.from_pretrained(path)
        common = dict(job="sft", micro_batch_size=16, rank=0, world_size=1, seed=args.seed)
        stream = build_train_loader(data, tokenizer, device=torch.device("cpu"), **common)
        held_out = build_eval_batches(data, tokenizer, max_batches=2, **common)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        losses = adaptation_curve(
            model, lambda s=stream: next(s), held_out, args.steps,
            lambda params: inner_optimizer(params, "adam", args.lr, cfg), DIST,
        )  # fmt: skip
        shown = {step: round(losses[step], 3) for step in sorted({0, 5, 10, 20, args.steps}) if step < len(losses)}
        reached = steps_to_reach(losses, args.target)
        print(json.dumps({"model": path, "loss_at_step": shown, f"steps_to_{args.target}": reached}))
        print(json.dumps({"model": path, "curve": [round(x, 3) for x in losses]}))


if __name__ == "__main__":
    main()
