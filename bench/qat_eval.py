"""Quantization-aware training against post-training quantization, on a built-in task's held-out data.

    python bench/qat_eval.py --qat RUNS/qat/final --plain RUNS/plain/final [--scheme int8_dynamic_act_int4_weight]
        [--task reverse-text] [--examples 200]

--qat is the final/ of a run with train.qat = SCHEME (its final/quantized/ the converted model), --plain the final/ of
the same run without QAT. Each model is evaluated on the task's held-out sequences (mean loss per completion token,
data.seq_len 128, the engine's own eval batches) and greedy exact match on held-out prompts (the engine's exact_match):

- plain, full precision: the plain run's weights as trained;
- PTQ: the plain run's weights quantized after training with the same scheme (engine/qat.convert, torchao quantize_);
- QAT before convert: the QAT run's weights through torchao's fake quantization (the model training saw);
- QAT after convert: final/quantized/ loaded by transformers' from_pretrained (torchao's quantized tensors).
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_train.config.schema import DataConfig, DatasetConfig
from prime_train.engine.data import build_eval_batches, held_out_examples
from prime_train.engine.evaluate import eval_loss, exact_match
from prime_train.engine.parallel import DistInfo
from prime_train.engine.qat import QUANTIZED_DIR, apply_qat, convert
from prime_train.tasks import get_task

DIST = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), backend="gloo")


def no_autocast():
    return torch.autocast("cpu", enabled=False)


def measure(model, tokenizer, data: DataConfig, task: str, seed: int, examples: int) -> dict[str, float]:
    batches = build_eval_batches(data, tokenizer, job="sft", micro_batch_size=16, rank=0, world_size=1, seed=seed,
                                 max_batches=8)  # fmt: skip
    held_out = held_out_examples(data, seed, examples)
    model.eval()
    loss = eval_loss(model, batches, DIST, no_autocast)["eval_loss"]
    match, _ = exact_match(model, tokenizer, held_out, get_task(task).score, DIST, no_autocast)
    return {"eval_loss": round(loss, 4), "exact_match": round(match, 4), "examples": len(held_out)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--qat", required=True)
    parser.add_argument("--plain", required=True)
    parser.add_argument("--scheme", default="int8_dynamic_act_int4_weight")
    parser.add_argument("--task", default="reverse-text")
    parser.add_argument("--num-examples", type=int, default=20000, help="data.datasets[0].num_examples of the runs")
    parser.add_argument("--examples", type=int, default=200, help="held-out prompts answered for exact match")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = DataConfig(seq_len=128, datasets=[DatasetConfig(task=args.task, num_examples=args.num_examples)])
    tokenizer = AutoTokenizer.from_pretrained(args.plain)

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    rows = {}
    rows["plain, full precision"] = load(args.plain)
    rows["PTQ (plain run converted)"] = convert(load(args.plain), args.scheme)
    fake = load(args.qat)
    apply_qat(fake, args.scheme, torch.device("cpu"))
    rows["QAT before convert (fake-quantized)"] = fake
    rows["QAT after convert (final/quantized)"] = load(f"{args.qat}/{QUANTIZED_DIR}")
    for name, model in rows.items():
        print(json.dumps({"model": name, **measure(model, tokenizer, data, args.task, args.seed, args.examples)}))


if __name__ == "__main__":
    main()
