"""What DPO's and GRPO's per-token log-probs cost on the output projection: the whole logits against the chunks.

    python bench/logprobs.py                                # 8 rows x 512 tokens, hidden 512, vocab 32,768
    python bench/logprobs.py --vocab 128256 --seq 256       # Llama 3's vocabulary
    python bench/logprobs.py --vocab 128256 --seq 1024 --also-chunk 1024   # the default chunk against 1024 tokens
    python bench/logprobs.py --device cuda --vocab 128256 --seq 2048 --hidden 4096   # on a GPU, bf16

Both sides take final hidden states and lm_head's weight and give each label's log-probability (temperature 0.9,
a quarter of the labels ignored, as prompt tokens are), then backward with a different upstream gradient per token
(a DPO pair's weight, a GRPO token's advantage):

- whole: what transformers' models are run with: the logits, their fp32 copy, log_softmax, gather (rl/grpo.py's
  and engine/preference.py's path for a model that is not native);
- chunked: engine/loss.py chunked_token_log_probs, the native model's path: one chunk of logits at a time, each
  chunk's logits formed again in backward; chunks of --chunk tokens, by default the engine's (loss.chunk_tokens:
  1024, fewer above a 64k vocabulary);
- chunked-N (with --also-chunk N): the same with chunks of N tokens.

Printed per side, in one process: the median wall time of forward + backward over --rounds, and the most tensor
memory held at once (torch.profiler's memory timeline on the CPU; torch.cuda.max_memory_allocated above what was
allocated before on a GPU, where the tensors are bf16), then each chunked side / whole. The two sides'
log-probs and gradients are checked to agree first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from prime_train.engine.loss import chunk_tokens, chunked_token_log_probs

TEMPERATURE = 0.9


def whole(hidden, weight, labels):
    logits = (hidden @ weight.T).float() / TEMPERATURE
    all_logp = torch.log_softmax(logits, dim=-1)
    valid = labels != -100
    return torch.where(valid, all_logp.gather(-1, torch.where(valid, labels, 0)[..., None]).squeeze(-1), 0.0)


def chunked(hidden, weight, labels, chunk_size: int):
    return chunked_token_log_probs(hidden, weight, labels, temperature=TEMPERATURE, chunk_size=chunk_size)[0]


def step(side, hidden, weight, labels, upstream):
    hidden.grad = weight.grad = None
    logp = side(hidden, weight, labels)
    (logp * upstream).sum().backward()
    return logp.detach(), hidden.grad, weight.grad


def peak_mib(fn, device: torch.device) -> float:
    """The most tensor memory held at once while `fn()` ran, in MiB: on a GPU above what was held before it."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = os.path.join(tmp, "timeline.json")
        prof.export_memory_timeline(path, device="cpu")
        with open(path) as f:
            _, sizes = json.load(f)
    return max(sum(s) for s in sizes) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=None, help="tokens a chunk (default: the engine's, chunk_tokens)")
    parser.add_argument("--also-chunk", type=int, default=None, help="one more chunked side, chunks of this many")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    hidden = torch.randn(args.rows, args.seq, args.hidden, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden, device=device) * args.hidden**-0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, args.vocab, (args.rows, args.seq), device=device)
    labels[:, : args.seq // 4] = -100
    upstream = torch.randn(args.rows, args.seq, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    chunk = chunk_tokens(args.vocab) if args.chunk is None else args.chunk
    sides = {"whole": whole, "chunked": lambda h, w, y: chunked(h, w, y, chunk)}
    if args.also_chunk:
        sides[f"chunked-{args.also_chunk}"] = lambda h, w, y: chunked(h, w, y, args.also_chunk)

    want = step(whole, hidden, weight, labels, upstream)
    tolerance = {"atol": 1e-4, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for name in list(sides)[1:]:
        for a, b in zip(step(sides[name], hidden, weight, labels, upstream), want, strict=True):
            torch.testing.assert_close(a.float(), b.float(), **tolerance)
    tokens = args.rows * args.seq
    print(
        f"{args.rows} rows x {args.seq} tokens, hidden {args.hidden}, vocab {args.vocab:,}, chunks of {chunk}: "
        f"{dtype}, {device}: whole fp32 logits {tokens * args.vocab * 4 / 2**20:,.0f} MiB a copy; values and gradients "
        "agree"
    )
    figures = {}
    for name, side in sides.items():
        times = []
        for _ in range(args.rounds):
            sync()
            start = time.perf_counter()
            step(side, hidden, weight, labels, upstream)
            sync()
            times.append(time.perf_counter() - start)
        peak = peak_mib(lambda side=side: step(side, hidden, weight, labels, upstream), device)
        figures[name] = (statistics.median(times), peak)
        print(f"  {name:13s} forward + backward {figures[name][0] * 1000:8.1f} ms   peak tensor memory {peak:8.1f} MiB")
    t_whole, m_whole = figures.pop("whole")
    for name, (t_chunk, m_chunk) in figures.items():
        print(f"  {name} / whole: time {t_chunk / t_whole:.2f}x, peak memory {m_chunk / m_whole:.2f}x")


if __name__ == "__main__":
    main()
