"""The engine's step against a nanoGPT-style loop: same model, same batches, same process, alternating rounds.

    python bench/vs_nanogpt.py                     # CPU: the tiny default shape, eager, CPU-time ratio
    python bench/vs_nanogpt.py --shape gpt2        # CUDA: GPT-2-124M shape, bf16, whole-model compile

The reference is written here the way nanoGPT's train.py writes it: the native model (engine/llama.py) compiled
whole, AdamW (fused on CUDA), forward with the loss inside, backward, clip, step, and one `.item()` per logging
step. The engine side is the engine's real loop body: `TrainingJob.run_step` (SFTJob.train_step, the buffered
metrics, the timed heartbeat, the logging-step flush that writes metrics.jsonl), fed the same batches. Both
start from the same weights.

Shapes: "tiny" is the tiny default (Llama, 2 layers, hidden 128, byte vocabulary 320), seq 256, micro-batch 16;
"gpt2" is GPT-2-124M as a Llama (12 layers, 12 heads, hidden 768, intermediate 2048, vocabulary 50304,
seq 1024, micro-batch 12, bf16) as in issue 17. On CPU the ratio is of process CPU time (time.process_time: all
threads, so background load on a shared machine counts less than in wall time); on CUDA of wall time with the
device synchronized at the ends of a round. On CUDA it also counts the host syncs of the engine's non-logging
steps with torch.cuda.set_sync_debug_mode and fails when there is one.

ratio = reference time / engine time per round (>= 1.0: the engine is as fast); median, min and max printed.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
import traceback
import warnings

import torch

from prime_train.config.schema import Config
from prime_train.engine.llama import NativeCausalLM
from prime_train.engine.optim import param_groups
from prime_train.engine.train import SFTJob

SHAPES = {
    "tiny": dict(model={}, seq=256, micro=16, vocab_multiple=64),
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
        vocab_multiple=50304,  # the byte vocabulary padded to nanoGPT's 50304 rows: GPT-2's lm_head cost
    ),
}


def build_job(out: str, shape: dict, args) -> SFTJob:
    cfg = Config.model_validate(
        {
            "run": {"name": "vs-nanogpt", "output_dir": out},
            "model": {**shape["model"], "vocab_multiple": shape["vocab_multiple"], "implementation": "native"},
            "train": {
                "max_steps": 10_000_000,
                "micro_batch_size": shape["micro"],
                "global_batch_size": shape["micro"],
                "eval_interval": 10_000_000,
                "compile": args.compile,
                "grad_clip": 1.0,
                "warmup_steps": 0,
            },
            "data": {"seq_len": shape["seq"], "datasets": [{"task": "reverse-text", "num_examples": 4000}]},
            "ckpt": {"interval": 10_000_000, "export_final": False},
            "logging": {"tensorboard": False, "log_interval": args.log_interval, "level": "warning"},
        }
    )
    return SFTJob(cfg)


def reference_model(job: SFTJob, device: torch.device) -> NativeCausalLM:
    """A second native model with the engine's starting weights, compiled whole as nanoGPT compiles its GPT."""
    model = NativeCausalLM(job.hf_config)
    model.load_state_dict(job.model.state_dict())
    model.to(device).reset_rope(device)
    model.attention = job.model.attention  # the engine's attention kernel (FlexAttention when compiled on CUDA)
    if job.model._mask.__name__ == "no_mask":
        plain_causal(model)
    return torch.compile(model) if job.cfg.train.compile else model


def plain_causal(model: NativeCausalLM) -> None:
    """Attend causally over the whole row, ignoring document starts (SDPA's is_causal: the flash kernel on GPU)."""

    def no_mask(position_ids, attention_mask):
        return None

    model._mask = no_mask


class Reference:
    """nanoGPT's train.py loop, reduced to its step: forward with loss, backward, clip, AdamW; .item() at logging."""

    def __init__(self, job: SFTJob, batches, log_interval: int):
        self.device = job.dist.device
        self.model = reference_model(job, self.device)
        cuda = self.device.type == "cuda"
        train = job.cfg.train
        # nanoGPT's configure_optimizers: weights with dim >= 2 decay, the rest do not
        groups = param_groups(self.model, train.weight_decay)
        self.optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), fused=cuda)
        self.autocast = job._autocast
        self.batches = batches
        self.log_interval = log_interval
        self.step = 0

    def run(self, steps: int) -> None:
        for _ in range(steps):
            b = next(self.batches)
            ids, pos, labels = (t.to(self.device, non_blocking=True) for t in (b.input_ids, b.position_ids, b.labels))
            with self.autocast():
                loss = self.model(ids, position_ids=pos, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            if self.step % self.log_interval == 0:
                loss.item()


def engine_steps(job: SFTJob, steps: int, syncs: list[tuple[int, str]] | None = None) -> None:
    """Run `steps` turns of the engine's loop body. With `syncs` (CUDA), every host sync of a non-logging step is
    appended to it as (step, the Python stack that asked for it)."""
    for _ in range(steps):
        logging_step = (job.state.step + 1) % job.cfg.logging.log_interval == 0
        if syncs is None or logging_step:
            job.run_step(0, 0.0)
            continue
        seen: list[str] = []

        def record(message, category, filename, lineno, file=None, line=None, seen=seen) -> None:
            if "synchroniz" in str(message):  # torch's "called a synchronizing CUDA operation"
                frames = [f for f in traceback.extract_stack(limit=16) if not f.filename.endswith("warnings.py")]
                seen.append("".join(traceback.format_list(frames[:-1])))

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record  # called where the op ran: the stack names the line that synced
            torch.cuda.set_sync_debug_mode("warn")
            try:
                job.run_step(0, 0.0)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs += [(job.state.step, stack) for stack in seen]


def report_syncs(syncs: list[tuple[int, str]]) -> None:
    print(f"host syncs in non-logging engine steps: {len(syncs)}")
    by_stack: dict[str, list[int]] = {}
    for step, stack in syncs:
        by_stack.setdefault(stack, []).append(step)
    for stack, steps in by_stack.items():
        print(f"  at steps {steps}:\n{stack}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt2" if cuda else "tiny")
    p.add_argument("--steps", type=int, default=20, help="steps per round and side")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5, help="steps of each side before timing (compile, allocator)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=cuda, help="default: on with CUDA")
    p.add_argument("--batches", type=int, default=64, help="distinct micro-batches, cycled by both sides")
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads (1: no spin-waiting threads in CPU time)")
    p.add_argument(
        "--mask", choices=("document", "causal"), default="document",
        help="document: packed rows as the engine trains them; causal: plain causal attention over the whole row, "
        "as nanoGPT trains on a stream (both sides; shows what document masking costs)",
    )  # fmt: skip
    args = p.parse_args()
    if not cuda:
        torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as out:
        job = build_job(out, shape, args)
        if args.mask == "causal":
            plain_causal(getattr(job.model, "_orig_mod", job.model))
        fixed = [next(job.batches) for _ in range(args.batches)]
        job.batches = itertools.cycle(fixed)  # train_step calls next() on it: the engine sees the same batches
        reference = Reference(job, itertools.cycle(fixed), args.log_interval)
        job.stop.startup = False

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        clock = time.perf_counter if cuda else time.process_time
        engine_steps(job, args.warmup)
        reference.run(args.warmup)
        sync()
        if cuda:
            # the first switch to "warn" reports a sync of its own, attributed to set_sync_debug_mode (seen on an
            # H200, torch 2.11: once, at the first counted step, never again): switch once before counting
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.cuda.set_sync_debug_mode("warn")
                torch.cuda.set_sync_debug_mode("default")
        engine_s, reference_s = [], []
        syncs: list[tuple[int, str]] | None = [] if cuda else None
        for r in range(args.rounds):
            # alternate which side goes first, so a slow spell of a shared machine does not favour one side
            order = ("engine", "reference") if r % 2 == 0 else ("reference", "engine")
            for side in order:
                sync()
                t0 = clock()
                if side == "engine":
                    engine_steps(job, args.steps, syncs)
                else:
                    reference.run(args.steps)
                sync()
                (engine_s if side == "engine" else reference_s).append(clock() - t0)
        job.close()

    tokens = shape["micro"] * shape["seq"]
    kind = "wall" if cuda else "CPU"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{args.shape} shape on {name}: {tokens} tokens a step, {args.rounds} rounds x {args.steps} steps, "
          f"compile {'on' if args.compile else 'off'}, {kind} time")  # fmt: skip
    for label, times in (("nanoGPT-style", reference_s), ("engine", engine_s)):
        ms = statistics.median(times) / args.steps * 1e3
        line = f"  {label:14s} {ms:9.2f} ms/step  {tokens / ms * 1e3:12,.0f} tokens/s"
        if job.peak_flops:
            line += f"  MFU {tokens / ms * 1e3 * job.flops_per_token / job.peak_flops:.1%}"
        print(line)
    ratios = [ref / eng for ref, eng in zip(reference_s, engine_s, strict=True)]
    print(f"ratio engine speed / nanoGPT-style ({kind} time): median {statistics.median(ratios):.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f}")  # fmt: skip
    if syncs is not None:
        report_syncs(syncs)
        assert not syncs, f"{len(syncs)} host syncs in the engine's non-logging steps"


if __name__ == "__main__":
    main()
