"""Forward + backward time per step of the native model (engine/llama.py) against transformers' own, same weights.

    python bench/native_vs_hf.py [--rounds 5] [--steps 10] [--micro 16] [--seq 128] [--threads 1] [--no-compile]

Default shape: the tiny default run's model (configs/tiny-sft.toml: Llama, hidden 128, 2 layers, 4 heads, MLP 512,
byte vocabulary padded to 320, tied embeddings) on micro-batches of 16 x 128 packed rows, as the engine feeds it.
HF computes the loss as the engine does today (logits, fp32 copy, F.cross_entropy); the native model takes the
labels and runs its fused chunked loss. Variants alternate within each round, so background load hits them alike;
the figure is CPU time (process_time, all threads) per step, median over rounds, with min-max. Compiled variants
compile the whole model (and, for the native one, its loss) with inductor; compile time is printed apart.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

from prime_train.engine.llama import NativeCausalLM


def tiny_default_config(vocab_size: int = 320) -> LlamaConfig:
    """The model of configs/tiny-sft.toml, as engine/model.py builds it."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        use_cache=False,
    )


def packed_batch(micro: int, seq: int, vocab: int, generator: torch.Generator):
    """Rows of documents 8-64 tokens long, positions restarting at each, the last position of a row unlabelled."""
    ids = torch.randint(0, vocab, (micro, seq), generator=generator)
    positions = torch.empty(micro, seq, dtype=torch.long)
    for row in range(micro):
        start = 0
        while start < seq:
            length = min(int(torch.randint(8, 65, (1,), generator=generator)), seq - start)
            positions[row, start : start + length] = torch.arange(length)
            start += length
    return ids, positions, ids.clone()


def hf_step(model, ids, positions, labels) -> None:
    logits = model(input_ids=ids, position_ids=positions).logits
    shift = logits[:, :-1].float()
    loss = F.cross_entropy(shift.reshape(-1, shift.size(-1)), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()


def native_step(model, ids, positions, labels) -> None:
    model(ids, position_ids=positions, labels=labels).loss.backward()


def timed(step, model, batch, steps: int) -> tuple[float, float]:
    """CPU seconds and wall seconds per step over `steps` steps."""
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(steps):
        step(model, *batch)
        model.zero_grad(set_to_none=True)
    return (time.process_time() - cpu) / steps, (time.perf_counter() - wall) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--micro", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: no spin-waiting in CPU time)")
    parser.add_argument("--no-compile", action="store_true", help="eager variants only")
    args = parser.parse_args()
    # on a shared machine, idle OpenMP threads spin and their spinning counts as process time
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    config = tiny_default_config()
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()
    native = NativeCausalLM(config).train()
    native.load_state_dict(hf.state_dict(), strict=True)
    batch = packed_batch(args.micro, args.seq, config.vocab_size, torch.Generator().manual_seed(1))

    variants = {"hf": (hf_step, hf), "native": (native_step, native)}
    if not args.no_compile:
        variants["hf compiled"] = (hf_step, torch.compile(hf))
        variants["native compiled"] = (native_step, torch.compile(native, fullgraph=True))
    for name, (step, model) in variants.items():
        start = time.perf_counter()
        timed(step, model, batch, 2)  # warm-up; for compiled variants this is the compile
        print(f"{name:>16}: warm-up {time.perf_counter() - start:.1f} s")

    cpu: dict[str, list[float]] = {name: [] for name in variants}
    wall: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (step, model) in variants.items():
            c, w = timed(step, model, batch, args.steps)
            cpu[name].append(c)
            wall[name].append(w)

    tokens = args.micro * args.seq
    print(
        f"\nforward+backward, {args.micro}x{args.seq} packed tokens, {args.rounds} rounds x {args.steps} steps, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(f"{'variant':>16}  {'CPU ms/step':>12}  {'min-max':>13}  {'wall ms/step':>12}  {'CPU tok/s':>10}")
    for name in variants:
        med = statistics.median(cpu[name])
        print(
            f"{name:>16}  {med * 1e3:12.2f}  {min(cpu[name]) * 1e3:6.2f}-{max(cpu[name]) * 1e3:<6.2f}  "
            f"{statistics.median(wall[name]) * 1e3:12.2f}  {tokens / med:10.0f}"
        )
    pairs = [("hf", "native")] + ([] if args.no_compile else [("hf compiled", "native compiled")])
    for slow, fast in pairs:
        ratios = [a / b for a, b in zip(cpu[slow], cpu[fast], strict=True)]
        print(
            f"{fast} is {statistics.median(ratios):.2f}x {slow} by CPU time "
            f"(per-round min-max {min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
