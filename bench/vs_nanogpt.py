"""The engine's step against nanoGPT-style loops: same batches, same process, alternating within every round.

    python bench/vs_nanogpt.py                     # CPU: the tiny default shape, eager, CPU-time ratio
    python bench/vs_nanogpt.py --shape gpt2        # CUDA: GPT-2-124M shape, bf16, whole-model compile
    python bench/vs_nanogpt.py --sides engine,native   # only the engine and the native reference (the old bench)
    python bench/vs_nanogpt.py --sides gpt2,gpt2-bias,native-gpt2   # the engine's GPT-2 against both bench GPT-2s

Sides (--sides, a comma list; default all but gpt2-bias), each timed on the same batches, in an order that rotates
each round:
- engine: the engine's real loop body, `TrainingJob.run_step` (SFTJob.train_step, the buffered metrics, the
  timed heartbeat, the logging-step flush that writes metrics.jsonl) on the engine's own model.
- native ("nanoGPT-style" in the output): the loop nanoGPT's train.py writes (forward with the loss inside,
  backward, clip, AdamW fused on CUDA, one `.item()` per logging step) around a second native model
  (engine/llama.py: RMSNorm, RoPE, SwiGLU, the engine's attention kernel, the chunked loss fused with lm_head
  of engine/loss.py) with the engine's starting weights, compiled whole. engine / native isolates the engine's
  loop (its metrics, heartbeat, token counting, compile wrapping) from the model.
- native-full: the same loop and the same native model and weights, but the loss is the plain one: lm_head over
  every position (full logits), then F.cross_entropy. native-full / native isolates what the chunked fused loss
  costs or saves against the plain path.
- gpt2: the same loop around a GPT-2-architecture model written here: token + learned position embeddings,
  pre-LayerNorm blocks, causal self-attention through SDPA's is_causal, a 4x GELU MLP, final LayerNorm,
  lm_head tied to the token embedding, full logits then F.cross_entropy; bias-free, normal(0, 0.02) init as the
  native model's. Its rows are plain causal over the whole packed row, positions 0..T-1 (document starts are
  ignored, as nanoGPT trains on a stream). gpt2 / native-full isolates the architecture (LayerNorm and GELU
  against RMSNorm and SwiGLU, learned positions against RoPE, and, with --mask document, plain causal attention
  against document masking; --mask causal takes that last one out: the engine's data.document_masking = false).

- gpt2-bias: the gpt2 side's model with GPT-2's biases (nanoGPT's model default, bias=True: every Linear and
  LayerNorm has one, zero at the start); the rest as gpt2. gpt2-bias / gpt2 is what the biases cost; not in the
  default sides (on CUDA one more compile in the GPU check's slot), named when wanted.
- native-gpt2: the same loop around the engine's own GPT-2 (engine/gpt2.py, what model.arch = "gpt2" trains):
  transformers' GPT2LMHeadModel names and Conv1D layers, biases, exact GELU, learned positions, tied lm_head, the
  chunked fused loss; plain causal like the gpt2 side, at its hidden size, depth, heads, 4x MLP and vocabulary.
  native-gpt2 / gpt2 says whether the engine's GPT-2 is as fast as a GPT-2 written for speed (whose Linears and
  LayerNorms have no biases, as in nanoGPT's train.py: GPT-2's, which the engine's keeps for transformers'
  layout, are part of the gap); native-gpt2 / gpt2-bias compares the same architecture, biases on both sides;
  native-gpt2 / native (per FLOP) compares the two architectures on the engine's path. Both GPT-2 sides use the
  exact GELU (nanoGPT's nn.GELU; the native side's config says activation_function "gelu"), where GPT-2's own
  config says the tanh approximation, gelu_new.

Shapes: "tiny" is the tiny default (Llama, 2 layers, hidden 128, byte vocabulary 320), seq 256, micro-batch 16;
"gpt2" is GPT-2-124M as a Llama (12 layers, 12 heads, hidden 768, intermediate 2048, vocabulary 50304,
seq 1024, micro-batch 12, bf16) as in issue 17. The GPT-2 model takes the same hidden size, layers, heads and
vocabulary with a 4x MLP (768 -> 3072 at the gpt2 shape, where its parameter count is close to the Llama's; at
the tiny shape 128 -> 512, so its MLP is 2/3 of the SwiGLU's). On CPU the ratio is of process CPU time
(time.process_time: all threads, so background load on a shared machine counts less than in wall time); on
CUDA of wall time with the device synchronized at the ends of each side's turn. On CUDA it also counts the host
syncs of the engine's non-logging steps with torch.cuda.set_sync_debug_mode and fails when there is one.

Printed: parameters and training FLOPs per token of both models (6N + attention, as engine/model.py counts
them), warmup seconds per side (compile), each round's ms/step per side as it ends, then per side the median
ms/step, tokens/s and MFU (each model's own FLOPs per token; where the device's peak is known), and
ratio = reference time / engine time per round for each reference side (>= 1.0: the engine is as fast);
median, min and max printed.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import statistics
import tempfile
import time
import traceback
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GPT2Config

from prime_train.config.schema import Config
from prime_train.engine.gpt2 import NativeGPT2
from prime_train.engine.gpt2 import from_config as gpt2_from_config
from prime_train.engine.llama import CausalLMOutput, NativeCausalLM
from prime_train.engine.model import flops_per_token, num_parameters
from prime_train.engine.optim import param_groups
from prime_train.engine.train import SFTJob

SIDES = ("engine", "native", "native-full", "gpt2", "gpt2-bias", "native-gpt2")
DEFAULT_SIDES = tuple(side for side in SIDES if side != "gpt2-bias")
# the names printed; "nanoGPT-style" and "engine" are the lines the bench printed before it had more sides
LABELS = {
    "engine": "engine",
    "native": "nanoGPT-style",
    "native-full": "native-full-CE",
    "gpt2": "GPT-2 model",
    "gpt2-bias": "GPT-2 + biases",
    "native-gpt2": "native GPT-2",
}
NOTES = {
    "native": "native model, chunked fused loss",
    "native-full": "native model, full logits + F.cross_entropy",
    "gpt2": "GPT-2 architecture, full logits + F.cross_entropy, plain causal",
    "gpt2-bias": "the same with GPT-2's biases in every Linear and LayerNorm",
    "native-gpt2": "the engine's GPT-2 (model.arch = gpt2), chunked fused loss, plain causal",
}
# (side, reference): ratio = reference time / side time per round, and per FLOP (each model's own FLOPs per token)
PAIRS = (("native-gpt2", "gpt2"), ("native-gpt2", "gpt2-bias"), ("native-gpt2", "native"))

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
            "data": {
                "seq_len": shape["seq"],
                "datasets": [{"task": "reverse-text", "num_examples": 4000}],
                "document_masking": args.mask == "document",
            },
            "ckpt": {"interval": 10_000_000, "export_final": False},
            "logging": {"tensorboard": False, "log_interval": args.log_interval, "level": "warning"},
        }
    )
    return SFTJob(cfg)


def native_model(job: SFTJob, device: torch.device) -> NativeCausalLM:
    """A second native model with the engine's starting weights, its attention kernel and its mask."""
    model = NativeCausalLM(job.hf_config)
    model.load_state_dict(job.model.state_dict())
    model.to(device).reset_rope(device)
    model.attention = job.model.attention  # the engine's attention kernel (FlexAttention when compiled on CUDA)
    return model


def reference_model(job: SFTJob, device: torch.device) -> NativeCausalLM:
    """The native model, compiled whole as nanoGPT compiles its GPT."""
    model = native_model(job, device)
    return torch.compile(model) if job.cfg.train.compile else model


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain loss: mean F.cross_entropy of full logits against the labels shifted by one (-100 ignored).

    labels are unshifted as HF takes them (and as NativeCausalLM's forward does): position t predicts label t + 1,
    the last position has no target. Under autocast, F.cross_entropy runs in fp32 on the low-precision logits.
    """
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)


class NativeFullLogits(nn.Module):
    """The native model with the plain loss: hidden states, lm_head over every position, F.cross_entropy."""

    def __init__(self, model: NativeCausalLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids=None, labels=None) -> CausalLMOutput:
        """The same inputs as NativeCausalLM.forward; the loss from full logits."""
        logits = self.model.lm_head(self.model.hidden_states(input_ids, position_ids))
        return CausalLMOutput(logits=None, loss=next_token_loss(logits, labels))


class GPT2Block(nn.Module):
    """Pre-LayerNorm block: x + attention(ln(x)), then x + mlp(ln(x)); biases in the Linears and norms if `bias`."""

    def __init__(self, hidden: int, heads: int, bias: bool = False):
        super().__init__()
        self.heads = heads
        self.attn_norm = nn.LayerNorm(hidden, bias=bias)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.attn_out = nn.Linear(hidden, hidden, bias=bias)
        self.mlp_norm = nn.LayerNorm(hidden, bias=bias)
        self.mlp_in = nn.Linear(hidden, 4 * hidden, bias=bias)
        self.mlp_out = nn.Linear(4 * hidden, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One block over (B, T, hidden)."""
        batch, length, hidden = x.shape
        # (B, T, 3, heads, head_dim) -> three (B, heads, T, head_dim)
        qkv = self.qkv(self.attn_norm(x)).view(batch, length, 3, self.heads, hidden // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(y.transpose(1, 2).reshape(batch, length, hidden))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class GPT2(nn.Module):
    """A GPT-2-architecture causal LM: learned positions, LayerNorm, GELU MLP, tied lm_head, the plain loss.

    Every row is one causal stream at positions 0..T-1: position_ids are taken and ignored, so document starts
    in a packed row are not seen (nanoGPT trains on a stream).
    """

    def __init__(self, vocab: int, seq: int, hidden: int, layers: int, heads: int, seed: int = 0, bias: bool = False):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, hidden)
        self.position_embedding = nn.Embedding(seq, hidden)
        self.blocks = nn.ModuleList(GPT2Block(hidden, heads, bias) for _ in range(layers))
        self.final_norm = nn.LayerNorm(hidden, bias=bias)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.lm_head.weight = self.token_embedding.weight
        # the native model's rule: normal(0, 0.02) for every matrix, unit norms, zero biases
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear | nn.Embedding):
                    module.weight.normal_(0.0, 0.02, generator=generator)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    module.bias.zero_()

    def forward(self, input_ids, position_ids=None, labels=None) -> CausalLMOutput:
        """Loss of the rows input_ids against labels (unshifted, -100 ignored), from full logits."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.final_norm(x))
        return CausalLMOutput(logits=None, loss=next_token_loss(logits, labels))


def gpt2_model(job: SFTJob, seq: int, bias: bool = False) -> GPT2:
    """The GPT-2 model at the native model's hidden size, depth, heads and (padded) vocabulary, fp32 on the CPU."""
    c = job.hf_config
    return GPT2(c.vocab_size, seq, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, bias=bias)


def gpt2_flops_per_token(model: GPT2, seq: int) -> float:
    """Training FLOPs per token counted as engine/model.py flops_per_token counts the native model's.

    6N over the parameters outside the embedding tables, plus the tied lm_head (its matmul still runs), plus
    12 * layers * hidden * seq for the attention scores and their weighted sum (heads x head_dim = hidden).
    """
    n = num_parameters(model, exclude_embeddings=True) + model.lm_head.weight.numel()
    hidden = model.token_embedding.embedding_dim
    return 6.0 * n + 12.0 * len(model.blocks) * hidden * seq


def native_gpt2_model(job: SFTJob, seq: int) -> NativeGPT2:
    """The engine's GPT-2 at the bench GPT-2's shape (its weights are its own: biases, GPT-2's initialisation)."""
    c = job.hf_config
    config = GPT2Config(
        vocab_size=c.vocab_size, n_embd=c.hidden_size, n_layer=c.num_hidden_layers, n_head=c.num_attention_heads,
        n_positions=seq, activation_function="gelu", attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
    )  # fmt: skip
    model = gpt2_from_config(config, seed=0)
    plain_causal(model)
    return model


def plain_causal(model: NativeCausalLM) -> None:
    """Attend causally over the whole row, ignoring document starts (SDPA's is_causal: the flash kernel on GPU)."""

    def no_mask(position_ids, attention_mask):
        return None

    model._mask = no_mask


class Reference:
    """nanoGPT's train.py loop, reduced to its step: forward with loss, backward, clip, AdamW; .item() at logging."""

    def __init__(self, job: SFTJob, batches, log_interval: int, model: nn.Module | None = None):
        """model: a module called as NativeCausalLM is (input_ids, position_ids=, labels=) that returns a
        CausalLMOutput with the loss, already on the device and compiled as wanted; default reference_model."""
        self.device = job.dist.device
        self.model = reference_model(job, self.device) if model is None else model
        cuda = self.device.type == "cuda"
        train = job.cfg.train
        # nanoGPT's configure_optimizers: weights with dim >= 2 decay, the rest do not
        groups = param_groups(self.model, train.weight_decay)
        self.optimizer = torch.optim.AdamW(groups, lr=train.lr, betas=(train.beta1, train.beta2), fused=cuda)
        self.autocast = job._autocast
        self.batches = batches
        self.log_interval = log_interval
        self.step = 0
        self.loss: torch.Tensor | None = None  # the last step's loss, left on the device

    def run(self, steps: int) -> None:
        for _ in range(steps):
            b = next(self.batches)
            ids, labels = (t.to(self.device, non_blocking=True) for t in (b.input_ids, b.labels))
            # as the engine calls its model: no position_ids (plain causal) for rows that need no document mask
            pos = None if b.causal else b.position_ids.to(self.device, non_blocking=True)
            with self.autocast():
                loss = self.model(ids, position_ids=pos, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            self.loss = loss.detach()
            if self.step % self.log_interval == 0:
                loss.item()


def engine_steps(job: SFTJob, steps: int, syncs: list[tuple[int, str]] | None = None) -> None:
    """Run `steps` turns of the engine's loop body. With `syncs` (CUDA), every host sync of a non-logging step is
    appended to it as (step, the Python stack that asked for it)."""
    for _ in range(steps):
        logging_step = (job.state.step + 1) % job.cfg.logging.log_interval == 0
        if syncs is None or logging_step:
            stopped(job, job.run_step())
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
                code = job.run_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        syncs += [(job.state.step, stack) for stack in seen]
        stopped(job, code)


def stopped(job: SFTJob, code: int | None) -> None:
    """run_step returns an exit code where a run ends (a stop, a non-finite loss): its later steps would not train,
    so the bench ends there rather than time them."""
    if code is not None:
        raise SystemExit(f"the engine's loop ended at step {job.state.step} with exit code {code}: no timings")


def report_syncs(syncs: list[tuple[int, str]]) -> None:
    print(f"host syncs in non-logging engine steps: {len(syncs)}")
    by_stack: dict[str, list[int]] = {}
    for step, stack in syncs:
        by_stack.setdefault(stack, []).append(step)
    for stack, steps in by_stack.items():
        print(f"  at steps {steps}:\n{stack}")


def parse_sides(text: str) -> tuple[str, ...]:
    """--sides: a comma list of SIDES, returned in SIDES' order (the order of the printed lines)."""
    given = {side.strip() for side in text.split(",") if side.strip()}
    unknown = given - set(SIDES)
    if unknown or not given:
        raise argparse.ArgumentTypeError(f"sides are a comma list of {', '.join(SIDES)}; not {text!r}")
    return tuple(side for side in SIDES if side in given)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cuda = torch.cuda.is_available()
    p.add_argument("--shape", choices=sorted(SHAPES), default="gpt2" if cuda else "tiny")
    p.add_argument("--steps", type=int, default=20, help="steps per round and side")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=5, help="steps of each side before timing (compile, allocator)")
    p.add_argument("--log-interval", type=int, default=10)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=cuda, help="default: on with CUDA")
    p.add_argument("--batches", type=int, default=64, help="distinct micro-batches, cycled by every side")
    p.add_argument("--threads", type=int, default=1, help="CPU: torch threads (1: no spin-waiting threads in CPU time)")
    p.add_argument(
        "--mask", choices=("document", "causal"), default="document",
        help="document: packed rows as the engine trains them by default; causal: data.document_masking = false, "
        "each row one stream with plain causal attention, as nanoGPT trains (engine and native sides; the gpt2 "
        "side is always plain causal)",
    )  # fmt: skip
    p.add_argument(
        "--sides", type=parse_sides, default=DEFAULT_SIDES,
        help=f"comma list of the sides to run, of {','.join(SIDES)} (default: all but gpt2-bias; engine,native: the "
        "old bench)",
    )  # fmt: skip
    args = p.parse_args()
    if not cuda:
        torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    sides: tuple[str, ...] = args.sides
    torch.manual_seed(0)

    with tempfile.TemporaryDirectory() as out:
        job = build_job(out, shape, args)
        # the job installed the engine's stop flag (a signal finishes the step, saves a checkpoint, exits 75 from
        # a loop the bench does not run): a bench ends at once on a signal, as `timeout` expects
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        fixed = [next(job.batches) for _ in range(args.batches)]
        job.batches = itertools.cycle(fixed)  # train_step calls next() on it: the engine sees the same batches
        device = job.dist.device
        native_params = num_parameters(job.model)
        gpt2 = gpt2_model(job, shape["seq"])
        gpt2_params, gpt2_flops = num_parameters(gpt2), gpt2_flops_per_token(gpt2, shape["seq"])
        flops = {"engine": job.flops_per_token, "native": job.flops_per_token, "native-full": job.flops_per_token}
        flops["gpt2"] = gpt2_flops
        compiled = torch.compile if job.cfg.train.compile else (lambda model: model)
        # every reference side cycles the same batches from the start: all sides train on the same sequence
        references: dict[str, Reference] = {}
        if "native" in sides:
            references["native"] = Reference(job, itertools.cycle(fixed), args.log_interval)
        if "native-full" in sides:
            model = compiled(NativeFullLogits(native_model(job, device)))
            references["native-full"] = Reference(job, itertools.cycle(fixed), args.log_interval, model)
        if "gpt2" in sides:
            model = compiled(gpt2.to(device))
            references["gpt2"] = Reference(job, itertools.cycle(fixed), args.log_interval, model)
        else:
            del gpt2
        if "gpt2-bias" in sides:
            model = gpt2_model(job, shape["seq"], bias=True)
            flops["gpt2-bias"] = gpt2_flops_per_token(model, shape["seq"])
            model = compiled(model.to(device))
            references["gpt2-bias"] = Reference(job, itertools.cycle(fixed), args.log_interval, model)
        if "native-gpt2" in sides:
            model = native_gpt2_model(job, shape["seq"])
            flops["native-gpt2"] = flops_per_token(model.config, shape["seq"])
            references["native-gpt2"] = Reference(
                job, itertools.cycle(fixed), args.log_interval, compiled(model.to(device))
            )
        job.stop.startup = False

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize()

        def run(side: str, steps: int, syncs: list[tuple[int, str]] | None = None) -> None:
            if side == "engine":
                engine_steps(job, steps, syncs)
            else:
                references[side].run(steps)

        print(f"parameters: native (Llama) {native_params:,}, GPT-2 model {gpt2_params:,}; training GFLOP/token: "
              f"native {job.flops_per_token / 1e9:.4g}, GPT-2 model {gpt2_flops / 1e9:.4g}", flush=True)  # fmt: skip
        clock = time.perf_counter if cuda else time.process_time
        warm = []
        for side in sides:
            t0 = time.perf_counter()
            run(side, args.warmup)
            sync()
            warm.append(f"{side} {time.perf_counter() - t0:.1f} s")
        print(f"warmup ({args.warmup} steps each, wall time: compile included): {', '.join(warm)}", flush=True)
        if cuda:
            # the first switch to "warn" reports a sync of its own, attributed to set_sync_debug_mode (seen on an
            # H200, torch 2.11: once, at the first counted step, never again): switch once before counting
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.cuda.set_sync_debug_mode("warn")
                torch.cuda.set_sync_debug_mode("default")
        times: dict[str, list[float]] = {side: [] for side in sides}
        syncs: list[tuple[int, str]] | None = [] if cuda and "engine" in sides else None
        for r in range(args.rounds):
            # rotate which side goes first, so a slow spell of a shared machine does not favour one side
            # (with two sides: engine first in even rounds, the reference first in odd ones)
            order = sides[r % len(sides) :] + sides[: r % len(sides)]
            for side in order:
                sync()
                t0 = clock()
                run(side, args.steps, syncs)
                sync()
                times[side].append(clock() - t0)
            each = ", ".join(f"{side} {times[side][-1] / args.steps * 1e3:.2f}" for side in order)
            print(f"round {r + 1}/{args.rounds} ms/step in the order run: {each}", flush=True)
        job.close()

    tokens = shape["micro"] * shape["seq"]
    kind = "wall" if cuda else "CPU"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{args.shape} shape on {name}: {tokens} tokens a step, {args.rounds} rounds x {args.steps} steps, "
          f"compile {'on' if args.compile else 'off'}, {kind} time")  # fmt: skip
    # the reference first, then the engine (the bench's lines before it had more sides), then the new sides
    for side in sorted(sides, key=("native", "engine", "native-full", "gpt2", "gpt2-bias", "native-gpt2").index):
        ms = statistics.median(times[side]) / args.steps * 1e3
        line = f"  {LABELS[side]:14s} {ms:9.2f} ms/step  {tokens / ms * 1e3:12,.0f} tokens/s"
        if job.peak_flops:
            line += f"  MFU {tokens / ms * 1e3 * flops[side] / job.peak_flops:.1%}"
        if side in ("native-full", "gpt2", "gpt2-bias", "native-gpt2"):
            line += f"  ({NOTES[side]})"
        print(line)
    if "engine" in sides:
        for side in references:
            ratios = [ref / eng for ref, eng in zip(times[side], times["engine"], strict=True)]
            print(f"ratio engine speed / {LABELS[side]} ({kind} time): median {statistics.median(ratios):.3f}, "
                  f"min {min(ratios):.3f}, max {max(ratios):.3f}")  # fmt: skip
    for side, ref in PAIRS:
        if side in sides and ref in sides:
            ratios = [r / t for r, t in zip(times[ref], times[side], strict=True)]
            per_flop = statistics.median(ratios) * flops[side] / flops[ref]
            print(f"ratio {LABELS[side]} speed / {LABELS[ref]} ({kind} time): median {statistics.median(ratios):.3f}, "
                  f"min {min(ratios):.3f}, max {max(ratios):.3f}; per FLOP {per_flop:.3f}")  # fmt: skip
    if syncs is not None:
        report_syncs(syncs)
        assert not syncs, f"{len(syncs)} host syncs in the engine's non-logging steps"


if __name__ == "__main__":
    main()
