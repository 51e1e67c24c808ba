"""What a trainer's start costs in tokenizing, and what the row cache (engine/row_cache.py) leaves of it.

    python bench/row_cache.py                    # 50,000 two-turn chat records, seq_len 1024, the byte tokenizer
    python bench/row_cache.py --records 2000     # seconds
    python bench/row_cache.py --pairs            # preference pairs (dpo, reward): chat prompts, two answers

Writes the records to a temporary .jsonl, then, in one process, `--rounds` times each: the rows built as a
trainer without the cache builds them (read, tokenize with the chat template, pack), and the same rows read back
from the cache a first build wrote (with --pairs: a preference job's tokenized training pairs). Printed: the
median of each, their ratio, the per-record cost, the file's size and the most memory a cached read held at
once (tracemalloc: Python's and numpy's allocations). Wall time (time.perf_counter); the two are checked to
hold the same rows.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load

from prime_train.config.schema import DataConfig, DatasetConfig
from prime_train.engine.data import _rank_rows
from prime_train.engine.row_cache import RowCache
from prime_train.engine.tokenizer import build_byte_tokenizer
from prime_train.rundir import RunDir

WORDS = ["alpha", "beta", "gamma", "delta", "reverse", "sort", "number", "train", "model", "token"]


def peak_mib(fn) -> float:
    """The most memory Python and numpy held at once while `fn()` ran, above what was held before (tracemalloc)."""
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def write_chats(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            q = " ".join(rng.choice(WORDS) for _ in range(12))
            a = " ".join(rng.choice(WORDS) for _ in range(20))
            turns = [("user", q), ("assistant", a), ("user", q[::-1]), ("assistant", a[::-1])]
            f.write(json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}) + "\n")


def write_pairs(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            q, a, b = (" ".join(rng.choice(WORDS) for _ in range(k)) for k in (12, 20, 20))
            prompt = [
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
                {"role": "user", "content": q[::-1]},
            ]
            f.write(json.dumps({"prompt": prompt, "chosen": a[::-1], "rejected": b}) + "\n")


def build_pairs(data: DataConfig, tok, cache: RowCache | None):
    from prime_train.engine.preference import build_pair_loader

    return build_pair_loader(
        data, tok, micro_batch_size=4, rank=0, world_size=1, seed=0, device=torch.device("cpu"), cache=cache
    ).rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=50_000)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pairs", action="store_true", help="preference pairs, as the dpo and reward jobs read them")
    args = parser.parse_args()
    if args.pairs:
        return main_pairs(args)
    tok = build_byte_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_chats(root / "chat.jsonl", args.records)
        data = DataConfig(datasets=[DatasetConfig(path=str(root / "chat.jsonl"))], seq_len=args.seq_len)
        run_dir = RunDir(root / "run")
        cache = RowCache(run_dir, node_first=True)
        built = _rank_rows(data, tok, "sft", 0, 1, 0, None, cache)[0]  # writes the cache
        size = sum(p.stat().st_size for p in run_dir.cache_dir.iterdir())
        peak = peak_mib(lambda: _rank_rows(data, tok, "sft", 0, 1, 0, None, cache))
        whole = peak_mib(lambda: [load(p.read_bytes()) for p in run_dir.cache_dir.iterdir()])  # without the map
        build_s, read_s = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            _rank_rows(data, tok, "sft", 0, 1, 0)
            build_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            read = _rank_rows(data, tok, "sft", 0, 1, 0, None, cache)[0]
            read_s.append(time.perf_counter() - t)
        for a, b in zip(built, read, strict=True):
            assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("ids", "loss", "starts", "lengths"))
    build, read = statistics.median(build_s), statistics.median(read_s)
    print(f"{args.records} two-turn chat records, seq_len {args.seq_len}, byte tokenizer, {args.rounds} rounds")
    print(f"  build (read, tokenize, pack): {build:.2f} s ({1000 * build / args.records:.3f} ms a record)")
    print(f"  cached read:                  {read:.3f} s, file {size / 2**20:.1f} MiB, peak {peak:.1f} MiB held")
    print(
        f"  the file read whole, then parsed (no /proc/self/fd): peak {whole:.1f} MiB ({whole / peak:.2f}x the map's)"
    )
    print(f"  cached / build: {read / build:.4f} ({build / read:.0f}x faster a start, on every rank)")


def main_pairs(args: argparse.Namespace) -> None:
    tok = build_byte_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_pairs(root / "pairs.jsonl", args.records)
        data = DataConfig(datasets=[DatasetConfig(path=str(root / "pairs.jsonl"))], seq_len=args.seq_len)
        cache = RowCache(RunDir(root / "run"), node_first=True)
        digest = build_pairs(data, tok, cache).digest()  # writes the cache
        size = sum(p.stat().st_size for p in cache.dir.iterdir())
        peak = peak_mib(lambda: build_pairs(data, tok, cache))
        build_s, read_s = [], []
        for _ in range(args.rounds):
            t = time.perf_counter()
            build_pairs(data, tok, None)
            build_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            read = build_pairs(data, tok, cache)
            read_s.append(time.perf_counter() - t)
        assert read.digest() == digest
    build, read = statistics.median(build_s), statistics.median(read_s)
    print(f"{args.records} chat preference pairs, seq_len {args.seq_len}, byte tokenizer, {args.rounds} rounds")
    print(f"  build (read, tokenize both answers): {build:.2f} s ({1000 * build / args.records:.3f} ms a pair)")
    print(f"  cached read:                         {read:.3f} s, file {size / 2**20:.1f} MiB, peak {peak:.1f} MiB held")
    print(f"  cached / build: {read / build:.4f} ({build / read:.0f}x faster a start, on every rank)")


if __name__ == "__main__":
    main()
