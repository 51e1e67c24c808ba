"""The memory calculator's arithmetic: the bytes one GPU holds while a run trains (and serves) its model.

Everything is arithmetic on the model's shape and the run's settings (memory_inputs.py): no torch, no
weights, milliseconds on a laptop. memory.py turns these parts into a verdict per GPU.

Bytes per parameter, before sharding
------------------------------------
Two families of strategies keep their states differently, and the tables follow what each one really holds.

torch family (``none``, ``ddp``, ``fsdp``, ``hsdp``; the embedded engine): the parameters stay fp32 and are
the master weights; bf16 compute comes from autocast (none/ddp) or from FSDP2's bf16 gathers (fsdp/hsdp).

=========  =======================  ============  =====================================================
precision  weights                  gradients     optimizer states (adamw / adamw8bit / sgd+momentum)
=========  =======================  ============  =====================================================
fp32       4 (fp32 parameters)      4             8 (m, v fp32) / 2 (m, v one byte each) / 4 (momentum)
bf16       4 (fp32 parameters)      4 (fp32)      8 / 2 / 4
           + 2 bf16 copy (none/ddp:
           autocast keeps a cast of every weight alive until backward has used it)
=========  =======================  ============  =====================================================

ZeRO family (``zero1``, ``zero2``, ``zero3``; DeepSpeed-style, the ZeRO paper's accounting): a bf16 model with
fp32 master weights inside the optimizer.

=========  ========  =========  ============================================================
precision  weights   gradients  optimizer states (adamw / adamw8bit / sgd+momentum)
=========  ========  =========  ============================================================
fp32       4         4          8 / 2 / 4
bf16       2 (bf16)  2 (bf16)   12 = 4 master + 8 / 6 = 4 master + 2 / 8 = 4 master + 4
=========  ========  =========  ============================================================

So mixed-precision AdamW is 18 bytes a parameter in the engine with DDP (16 + autocast's 2-byte copy), 16 with
FSDP2 or ZeRO. AdamW's per-tensor ``step`` counters (one 4-byte scalar per parameter *tensor*) are left out:
they are below 0.01 % of the states of any real model. 8-bit AdamW's per-block scales are left out likewise.

Sharding over the data-parallel group (N = GPUs per node × nodes; HSDP shards within its shard group only):
``ddp`` nothing (plus DDP's gradient buckets: one more copy of the gradients, since the engine does not
use ``gradient_as_bucket_view``); ``zero1`` optimizer states / N; ``zero2`` + gradients / N; ``zero3``,
``fsdp`` + weights / N, plus the gathered units (the root module with the embeddings, and two decoder layers,
the current and the prefetched one) and one unit's unsharded gradient. ZeRO's communication buckets
(DeepSpeed's ``reduce_bucket_size``) come on top and are not modelled.

The engine's ZeRO stages (``distributed.zero_stage`` on FSDP2, strategy ``fsdp``/``hsdp``): stage 3 is ``fsdp`` as
above. Stages 2 and 1 (FSDP2 has no optimizer-only sharding, so 1 runs as 2) shard the states the same way but keep
every layer gathered from its forward to its backward: the gathered units become the whole model in the compute
dtype. ``cpu_offload`` (FSDP2's CPUOffloadPolicy) moves the sharded weights, gradients and optimizer states to host
memory (reported as ``host_bytes``); the gathered units, activations and logits stay on the GPU.

fp16 takes the bytes bf16 takes (2-byte compute, fp32 parameters and reduction; the loss scaler is a few scalars).
float8 (torchao's Float8Linear) changes no line: it keeps the parameters and optimizer states as they are, saves the
high-precision input and weight of each linear layer for backward (its float8 casts are transient, one layer's at a
time), so its gain is matmul speed, not memory.

LoRA (``lora.rank`` > 0)
------------------------
The base is frozen: its weights are held as the run holds every weight (fp32 in the engine, bf16 in the ZeRO
accounting), with no gradients and no optimizer states. With ``lora.quantize = "nf4"`` (QLoRA) every linear weight of
the decoder blocks is held in 4-bit NormalFloat instead, 0.516 B a parameter (4 bits, plus bitsandbytes' double-
quantized block constants: one byte per 64 weights, and 4 bytes per 256 blocks); embeddings, norms and lm_head stay
as they were. The adapters, r × (in + out) for each targeted linear layer (param_count.count_adapters, the count the
engine reports), take the table's bytes as any trained parameter: weights, gradients, optimizer states, sharded
alike. Under autocast (none/ddp in bf16) only the adapters' casts are cached; a frozen weight's cast is kept for
backward where it is used (every layer's without checkpointing, one layer's at a time with it; NF4 weights are
dequantized inside their matmul and keep none). Activations are the full model's less what only a frozen weight's
gradient needed (each norm's normalised value, the token ids, lm_head's input, and the input of a linear layer no
adapted layer reads too), plus A's r-wide output for each adapter (with ``lora.dropout``, also its mask, one byte on
CUDA, and its dropped input); selective checkpointing keeps every matmul output, so B's out-wide ones as well. The
first layer keeps a little less again when its first adapter comes late (down_proj only): not modelled.

Jobs (``run.job``)
------------------
sft and pretrain are the tables above. The others add to them:

- ``dpo``: a micro-batch of ``micro_batch_size`` pairs is twice as many sequences, the chosen and the rejected
  answer of each pair, so activations and logits are those of 2 × micro_batch_size sequences; the log-prob of each
  sequence is summed from its tokens' log-probs, taken chunk by chunk as the loss is (the chunk's logits formed
  again in backward) on the native model and transformers' families given its head, from the whole logits on
  other transformers' models. The reference
  is a frozen copy of the starting weights, held as the run holds its weights (``reference weights``: the weight
  bytes once more, whole on every GPU, since it is copied before the model is wrapped or sharded; no gradients, no
  optimizer states). ``dpo.precompute_reference`` holds none (its log-probs are computed in one pass before
  training), nor does LoRA (the reference is the base with the adapters switched off). The reference's forward runs
  without gradients before the policy's: what it allocates is freed before the policy's activations peak.
- ``reward``: pairs as in dpo; the model's lm_head (when untied) is replaced by a ``score head``, Linear(hidden, 1)
  without bias, trained in full (beside the adapters with LoRA); no vocabulary logits, one score per sequence.
- ``rl``: with ``rl.kl_coef`` > 0 and no LoRA, the KL anchor is a frozen copy of the starting weights, counted as
  dpo's reference; ``rl.algorithm = "ppo"`` adds a ``value head``, Linear(hidden, 1) with bias, in fp32 with its
  gradient and AdamW state (16 B a parameter), trained in full.

Activations
-----------
After Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (section 4),
who count the bytes each GPT layer keeps for backward: sbh(34 + 5as/h) at 16 bits (s sequence, b micro-batch,
h hidden, a heads). The same count is made here term by term for the Llama-family layer transformers runs
(RMSNorm, no dropout, SwiGLU MLP of width f, grouped-query attention with q = heads × head_dim and
kv = kv_heads × head_dim), per token, with A the activation bytes (2 bf16, 4 fp32):

- each of the two RMSNorms: its input and its normalised value in fp32 (transformers upcasts), 8h, plus
  its output in the compute dtype, hA (2hA in pure bf16, where the normalised value is also cast back);
- attention with SDPA or flash kernels: q, k, v and the output, (2q + 2kv)A, and the fp32 log-sum-exp,
  4·heads: no s × s score matrix (the paper's 5as/h term is gone);
- eager attention adds the score matrix, heads·s·(4 + A) (softmax in fp32 plus its cast), and keeps k and v
  repeated to all heads; with attention dropout the paper's mask and dropout output add heads·s·(1 + A);
- the SwiGLU MLP: gate and up outputs, the activation and the product, 4fA (mixture-of-experts: f times the
  experts each token goes to).

For the paper's own GPT layer this counting gives its 34sbh + 5as²b. Activation checkpointing: ``selective``
is the engine's op-level policy (engine/parallel.py): each layer keeps its input and the outputs of its matmuls
and attention kernel, (q + 2kv + 2h + 2f)A plus the attention output and its fp32 log-sum-exp, and recomputes the
norms, rotary and the MLP's activation and product. This is the paper's selective idea applied to what is cheap to
recompute rather than to the score matrix, which SDPA/flash never keeps. ``full`` keeps only each layer's input
and rebuilds one layer's activations at a time in backward. Outside the layers: the
final norm, and the logits: the loss is computed in fp32 (the engine and transformers both upcast), and at the
start of backward the saved log-softmax, its incoming gradient and the gradient of the logits coexist, 12
bytes per token per vocabulary entry. A fixed 1 GiB per GPU stands for the CUDA context, cuBLAS workspaces
and NCCL buffers; allocator fragmentation is not modelled (keep a margin: the verdicts flag under 10 %).

Inference (vLLM)
----------------
Weights in the serving dtype (bf16, 2 bytes a parameter) split over tensor parallelism; the KV cache holds
2 × layers × kv_heads × head_dim × dtype bytes per token (kv heads split over tensor-parallel ranks), in blocks
of 16 tokens. vLLM claims ``gpu_memory_utilization`` × the GPU's memory, takes weights, a profiled forward pass
(estimated from ``max_num_batched_tokens`` = 8192) and its runtime out of it, and gives the rest to the KV
cache; at least one ``max_model_len`` sequence must fit or it refuses to start.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

from prime_train.validator.memory_inputs import (
    GIB,
    INFERENCE_DTYPES,
    KV_CACHE_DTYPES,
    ZERO_FAMILY,
    MemoryInputs,
    ModelShape,
    loss_chunk_tokens,
)
from prime_train.validator.memory_parallel import (
    in_flight,
    microbatches,
    rank_layers,
    rank_shape,
    sequence_parallel_activations,
)
from prime_train.validator.param_count import AdapterCount

# optimizer states per parameter besides master weights: AdamW's m and v, 8-bit AdamW's quantised m and v,
# SGD's momentum buffer
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "sgd": 4}
MASTER_BYTES = 4
RUNTIME_OVERHEAD_BYTES = GIB
VLLM_BLOCK_TOKENS = 16
VLLM_MAX_BATCHED_TOKENS = 8192
LOSS_BYTES_PER_VOCAB = 12  # fp32: saved log-softmax + its incoming gradient + the logits' gradient
# bitsandbytes' NF4 (Linear4bit's defaults, which engine/lora.py uses): 4 bits a weight, one 8-bit absmax per block of
# 64 weights (double quantization, compress_statistics) and one fp32 constant per 256 of those blocks (QLoRA paper,
# Dettmers et al. 2023, section 3: 4 + 8/64 + 32/(64·256) = 4.127 bits)
NF4_BYTES_PER_PARAM = (4 + 8 / 64 + 32 / (64 * 256)) / 8
# The parts that are the parameters' own (what preflight calls the states), the rest being activations and runtime
STATE_PARTS = (
    "weights", "adapter weights", "gradients", "adapter gradients", "optimizer states", "adapter optimizer states",
    "bf16 weight copy", "DDP gradient buckets", "gathered units", "reference weights", "value head", "score head",
)  # fmt: skip
# PPO's value head (rl/ppo.py ValueHead): a Linear(hidden, 1) with its bias, in fp32 whatever the run's precision, with
# its gradient and its own AdamW's two moments
VALUE_HEAD_BYTES_PER_PARAM = 4 + 4 + 8


# ---------------------------------------------------------------- the trainer


@dataclass
class Part:
    """One line of the breakdown: bytes on one GPU and how they were counted."""

    name: str
    bytes: int
    how: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.bytes, "gib": round(self.bytes / GIB, 3), "how": self.how}


@dataclass
class TrainerMemory:
    parts: list[Part]
    bytes_per_param: dict[str, float]
    shard_group: int
    per_micro_batch_bytes: int  # how much one more sequence of micro-batch adds: the linear part
    host_bytes: int = 0  # what CPU offload keeps in each process's host memory instead
    # with pipeline parallelism: the rank these figures are for (the busiest) and every pipeline rank's total
    pp_rank: int | None = None
    rank_totals: list[int] | None = None
    trainable_params: int = 0  # what trains: every parameter, or with LoRA the adapters only
    total_params: int = 0  # the model's parameters, adapters included

    @property
    def trainable_fraction(self) -> float:
        return self.trainable_params / self.total_params if self.total_params else 1.0

    def get(self, name: str) -> int:
        for part in self.parts:
            if part.name == name:
                return part.bytes
        return 0

    @property
    def total(self) -> int:
        return sum(p.bytes for p in self.parts)

    @property
    def weights(self) -> int:
        return self.get("weights")

    @property
    def gradients(self) -> int:
        return self.get("gradients") + self.get("adapter gradients")

    @property
    def optimizer_states(self) -> int:
        return self.get("optimizer states") + self.get("adapter optimizer states")

    @property
    def states(self) -> int:
        """Everything but activations, logits and the runtime: what the parameters cost (STATE_PARTS)."""
        return sum(self.get(name) for name in STATE_PARTS)

    @property
    def activations(self) -> int:
        return self.get("activations")

    def to_dict(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total,
            "total_gib": round(self.total / GIB, 3),
            "parts": [p.to_dict() for p in self.parts],
            "bytes_per_param": self.bytes_per_param,
            "shard_group": self.shard_group,
            "host_bytes": self.host_bytes,
            "host_gib": round(self.host_bytes / GIB, 3),
            "trainable_params": self.trainable_params,
            "total_params": self.total_params,
            "trainable_fraction": round(self.trainable_fraction, 6),
            **({"pp_rank": self.pp_rank, "rank_totals": self.rank_totals} if self.rank_totals else {}),
        }


def bytes_per_param(strategy: str, precision: str, optimizer: str) -> dict[str, float]:
    """The module docstring's tables: bytes per parameter of each state before sharding."""
    states = OPTIMIZER_STATE_BYTES[optimizer]
    if precision == "fp32":
        return {"weights": 4, "bf16 weight copy": 0, "gradients": 4, "optimizer states": states}
    if strategy in ZERO_FAMILY:
        return {"weights": 2, "bf16 weight copy": 0, "gradients": 2, "optimizer states": MASTER_BYTES + states}
    copy = 2 if strategy in ("none", "ddp") else 0
    return {"weights": 4, "bf16 weight copy": copy, "gradients": 4, "optimizer states": states}


def _held_width(inputs: MemoryInputs) -> int:
    """Bytes a value takes in the dtype the model holds its weights and residual stream in: 4 in fp32 training and
    under autocast (fp32 weights, bf16 matmuls: one process, DDP), 2 with half-precision weights (FSDP2's mixed
    precision)."""
    autocast = inputs.half and inputs.strategy in ("none", "ddp")
    return 4 if (autocast or not inputs.half) else 2


def _activation_bytes_per_token(inputs: MemoryInputs, m: ModelShape) -> dict[str, float]:
    """Bytes one token leaves behind for backward: one decoder layer's, split into its terms, and the rest."""
    bf16 = inputs.half
    a = 2 if bf16 else 4
    autocast = bf16 and inputs.strategy in ("none", "ddp")  # fp32 weights, bf16 matmuls
    h, s = m.hidden, inputs.seq_len
    # RMSNorm: fp32 input and normalised value, then its output in the compute dtype (pure bf16 also keeps the
    # normalised value cast back to bf16)
    norm = 8 * h + (2 * h * a if bf16 and not autocast else h * a)
    if inputs.attention == "eager":
        qkv_out = (m.q_dim + 2 * m.q_dim + m.q_dim) * a  # k and v repeated to every query head
        scores = m.heads * s * (4 + (a if a < 4 else 0))
        if m.attention_dropout > 0:
            scores += m.heads * s * (1 + a)
    else:
        qkv_out = (2 * m.q_dim + 2 * m.kv_dim) * a + 4 * m.heads  # q, k, v, output, fp32 log-sum-exp
        scores = 0
    mlp = 4 * m.mlp_width * a + (4 * m.experts if m.experts else 0)  # gate, act, up, product; router logits
    return {
        "norms": 2 * norm,
        "attention": qkv_out,
        "scores": scores,
        "mlp": mlp,
        "layer_input": h * _held_width(inputs),  # the residual stream's dtype
        # selective checkpointing (engine/parallel.py): a layer's input, the outputs of its matmuls (q, k, v and
        # output projections, gate, up and down) and of its attention kernel (output and fp32 log-sum-exp; eager
        # attention's two bmm outputs instead, the score matrix among them)
        "selective": h * _held_width(inputs)
        + (m.q_dim + 2 * m.kv_dim + 2 * h + 2 * m.mlp_width) * a
        + (m.heads * s * a + m.q_dim * a if inputs.attention == "eager" else m.q_dim * a + 4 * m.heads),
        # an MoE's router loss: each layer's router logits (kept by transformers' recorder past checkpointing; without
        # it they are among "mlp") and the fp32 softmax its load-balancing loss saves for backward
        "router_logits": 4 * m.experts if inputs.router_loss else 0,
        "router_probs": 4 * m.experts if inputs.router_loss else 0,
        "final_norm": norm,
        "indices": 8,
        "logits": LOSS_BYTES_PER_VOCAB * m.vocab,
    }


def _state_parts(inputs: MemoryInputs, m: ModelShape, per: dict[str, float]) -> list[Part]:
    """Weights, gradients, optimizer states and their companions when the whole model trains."""
    n, strat, p = inputs.shard_group, inputs.strategy, m.num_params
    shard_w, shard_g, shard_o = _shards(inputs)
    over = f" / {n} GPUs" if n > 1 else ""
    parts = [
        Part("weights", math.ceil(p * per["weights"] / shard_w), f"{p:,} params × {per['weights']} B"
             + (over if shard_w > 1 else "")),
        Part("gradients", math.ceil(p * per["gradients"] / shard_g), f"× {per['gradients']} B"
             + (over if shard_g > 1 else "")),
        Part("optimizer states", math.ceil(p * per["optimizer states"] / shard_o),
             f"{inputs.optimizer}: × {per['optimizer states']} B" + (over if shard_o > 1 else "")),
    ]  # fmt: skip
    if per["bf16 weight copy"]:
        parts.append(Part("bf16 weight copy", p * 2, "autocast's cast of every weight, alive until backward"))
    if strat == "ddp" and inputs.world_size > 1:
        parts.append(Part("DDP gradient buckets", p * per["gradients"], "a second copy of the gradients"))
    if strat in ("zero3", "fsdp", "hsdp"):
        w = 2 if inputs.half else 4
        # FSDP2 keeps the root unit (embeddings, final norm, lm_head) gathered from forward to the end of backward,
        # gathers a decoder layer while prefetching the next, and holds one unit's unsharded gradient
        unit = max(m.layer_params, m.root_params)
        gathered = (m.root_params + 2 * m.layer_params + unit) * w
        how = "root unit + 2 decoder layers unsharded, one unit's gradient"
        if inputs.params_kept_gathered:
            gathered = (p + unit) * w
            how = f"ZeRO stage {inputs.zero_stage}: the whole model unsharded through backward, one unit's gradient"
        parts.append(Part("gathered units", gathered, how))
    return parts


def _shards(inputs: MemoryInputs) -> tuple[int, int, int]:
    """What the weights, the gradients and the optimizer states are divided by (ZeRO stages, FSDP, HSDP)."""
    n, strat = inputs.shard_group, inputs.strategy
    return (
        n if strat in ("zero3", "fsdp", "hsdp") else 1,
        n if strat in ("zero2", "zero3", "fsdp", "hsdp") else 1,
        n if strat in ("zero1", "zero2", "zero3", "fsdp", "hsdp") else 1,
    )


def _lora_state_parts(inputs: MemoryInputs, m: ModelShape, per: dict[str, float], ad: AdapterCount) -> list[Part]:
    """With LoRA: the frozen base (4-bit NF4 linear weights with lora.quantize = "nf4"), and the adapters' weights,
    gradients and optimizer states; the base has neither gradients nor optimizer states."""
    n, strat, p, a = inputs.shard_group, inputs.strategy, m.num_params, ad.trainable
    shard_w, shard_g, shard_o = _shards(inputs)
    over = f" / {n} GPUs" if n > 1 else ""
    nf4 = inputs.lora_quantize == "nf4"
    quantized = ad.linear_params if nf4 else 0
    base = (p - quantized) * per["weights"] + quantized * NF4_BYTES_PER_PARAM
    how = f"frozen base: {p:,} params × {per['weights']} B"
    if nf4:
        nf4_how = f"{quantized:,} in NF4 × {NF4_BYTES_PER_PARAM:.3f} B"
        how = f"frozen base: {nf4_how} + {p - quantized:,} × {per['weights']} B"
    parts = [
        Part("weights", math.ceil(base / shard_w), how + (over if shard_w > 1 else "")),
        Part("adapter weights", math.ceil(a * per["weights"] / shard_w),
             f"LoRA rank {ad.rank}: {a:,} params × {per['weights']} B" + (over if shard_w > 1 else "")),
        Part("adapter gradients", math.ceil(a * per["gradients"] / shard_g),
             f"adapters only: × {per['gradients']} B" + (over if shard_g > 1 else "")),
        Part("adapter optimizer states", math.ceil(a * per["optimizer states"] / shard_o),
             f"{inputs.optimizer}, adapters only: × {per['optimizer states']} B" + (over if shard_o > 1 else "")),
    ]  # fmt: skip
    if per["bf16 weight copy"]:
        # autocast caches the casts of weights that train (the adapters) until backward; a frozen weight's cast is
        # made at each use and kept only where backward needs it: every layer's without checkpointing, one layer's
        # at a time with it (recomputed); NF4 layers dequantize inside their matmul and keep only the 4-bit weight
        # the fused loss keeps no cast of lm_head, and a reward model has none
        lm_head = 0 if inputs.chunked_loss or inputs.job == "reward" else m.vocab * m.hidden
        if nf4:
            held, kept = lm_head + max((lin.fan_in * lin.fan_out for lin in ad.per_block), default=0), "one dequantized"
        elif inputs.activation_checkpointing == "none":
            held, kept = lm_head + ad.linear_params, "every frozen"
        else:
            held, kept = lm_head + ad.linear_params // max(1, m.layers), "one layer's frozen"
        parts.append(Part("bf16 weight copy", 2 * (a + held), f"casts of the adapters and of {kept} weight(s)"))
    if strat == "ddp" and inputs.world_size > 1:
        parts.append(Part("DDP gradient buckets", a * per["gradients"], "a second copy of the adapters' gradients"))
    if strat in ("zero3", "fsdp", "hsdp"):
        w = 2 if inputs.half else 4
        gathered = (m.root_params + 2 * m.layer_params) * w + math.ceil(a / max(1, m.layers)) * w
        if inputs.params_kept_gathered:
            gathered = (p + a) * w + math.ceil(a / max(1, m.layers)) * w
        parts.append(Part("gathered units", gathered, "root unit + 2 decoder layers unsharded, one layer's adapters' "
                                                      "gradient"))  # fmt: skip
    return parts


# What each linear layer of a block reads (LoRA's activations): the attention's input (the first norm's output), the
# MLP's input (the second norm's output), or the MLP's product; o_proj's input, the attention output, is kept anyway
_READS_ATTENTION_INPUT = ("q_proj", "k_proj", "v_proj", "qkv_proj", "q_a_proj", "kv_a_proj_with_mqa")
_READS_MLP_INPUT = ("gate_proj", "up_proj", "gate_up_proj", "shared_expert_gate")


@dataclass
class _LoraActivations:
    """How LoRA changes the bytes a token leaves for backward: in a decoder layer, in what selective checkpointing
    keeps of one, and outside the layers."""

    layer: float
    selective: float
    outside: float


def _lora_activations(inputs: MemoryInputs, m: ModelShape, ad: AdapterCount | None) -> _LoraActivations:
    """A frozen weight's gradient is never computed, so what only it needed is not kept: each norm's normalised
    value, the input of a linear layer without an adapter (unless an adapted one reads the same tensor), the token
    ids of the embedding, lm_head's input. Each adapter keeps A's r-wide output for B's gradient (with dropout, also
    its mask and its dropped input); selective checkpointing keeps every matmul output, B's out-wide one too."""
    if ad is None:
        return _LoraActivations(0.0, 0.0, 0.0)
    bf16 = inputs.half
    a = 2 if bf16 else 4
    h = m.hidden
    norm_weight_only = h * _held_width(inputs)  # the normalised value `weight *` keeps
    block = ad.per_block
    leaves = {lin.name.rsplit(".", 1)[-1] for lin in block}
    layer = len(block) * ad.rank * a - 2 * norm_weight_only
    if inputs.lora_dropout > 0:
        layer += sum(lin.fan_in for lin in block) * (1 + a)
    if not leaves & set(_READS_ATTENTION_INPUT):
        layer -= h * a
    if not leaves & set(_READS_MLP_INPUT):
        layer -= h * a
    if "down_proj" not in leaves:
        layer -= m.mlp_width * a
    selective = sum(ad.rank + lin.fan_out for lin in block) * a
    outside = -norm_weight_only - 8 - (0 if inputs.chunked_loss else h * a)
    return _LoraActivations(float(layer), float(selective), float(outside))


def expert_adapter_part(inputs: MemoryInputs, ad: AdapterCount) -> Part:
    """lora.target_parameters: peft runs an adapted expert tensor as W + scale · B @ A, built whole (every expert) in
    the layer's forward and kept for its backward, in the dtype the layer holds its weights in (fp32 under autocast,
    the gathered bf16 under FSDP2's mixed precision); its gradient, as large, exists once in the backward. Without
    activation checkpointing every sparse layer keeps its copies until the backward reaches it; with full or
    selective checkpointing (the sum is not among the ops selective keeps) one layer's are rebuilt at a time.
    Measured on the CPU by the saved tensors of a forward (tests/test_lora_experts.py)."""
    width = _held_width(inputs)
    per_layer = sum(t.fan_in * t.fan_out * t.experts for t in ad.experts)
    largest = max(t.fan_in * t.fan_out * t.experts for t in ad.experts)
    sparse = max(t.blocks for t in ad.experts)
    layers = sparse if inputs.activation_checkpointing == "none" else 1
    held = "every sparse layer's" if layers > 1 else "one layer's (checkpointing rebuilds them a layer at a time)"
    return Part(
        "expert adapters' merged weights",
        (layers * per_layer + largest) * width,
        f"W + B @ A of {', '.join(t.name.rsplit('.', 1)[-1] for t in ad.experts)}: {held} x "
        f"{per_layer * width / GIB:,.2f} GiB, and one tensor's gradient",
    )


def trainer_memory(inputs: MemoryInputs, m: ModelShape, *, micro_batch: int | None = None) -> TrainerMemory:
    """Per-GPU bytes of a training process, part by part (see the module docstring for every rule); with tensor or
    pipeline parallelism, the busiest rank's (memory_parallel.py)."""
    mb = micro_batch if micro_batch is not None else inputs.micro_batch
    if inputs.tp_size > 1 or inputs.pp_size > 1:
        return busiest_rank_memory(inputs, m, mb)
    m = job_shape(inputs, m)
    per = bytes_per_param(inputs.strategy, inputs.precision, inputs.optimizer)
    ad = inputs.adapters
    parts = _state_parts(inputs, m, per) if ad is None else _lora_state_parts(inputs, m, per, ad)
    host = 0
    if inputs.cpu_offload:
        parts, host = _offloaded(parts)
    parts += _job_parts(inputs, m, per)
    heads = sum(_head_params(inputs, m).values())

    act = _activation_bytes_per_token(inputs, m)
    lora = _lora_activations(inputs, m, ad)
    seqs = inputs.sequences_per_sample
    tokens = mb * seqs * inputs.seq_len
    per_token, how = layers_per_token(inputs, m.layers, act, lora)
    if ad is not None:
        how += "; frozen weights' own needs left out, the adapters' added"
    per_token += act["final_norm"] + act["indices"] + lora.outside
    parts.append(
        Part(
            "activations",
            int(tokens * per_token),
            f"{_sequences(mb, seqs)} × {inputs.seq_len} tokens × {per_token / 1024:,.1f} KiB; {how}",
        )
    )
    if ad is not None and ad.experts:
        parts.append(expert_adapter_part(inputs, ad))
    loss_part, per_token_loss = _loss_part(inputs, m, act, tokens)
    parts.append(loss_part)
    parts.append(Part("runtime", RUNTIME_OVERHEAD_BYTES, "CUDA context, cuBLAS workspaces, NCCL buffers"))
    return TrainerMemory(
        parts=parts,
        bytes_per_param={k: float(v) for k, v in per.items()},
        shard_group=inputs.shard_group,
        per_micro_batch_bytes=int(seqs * inputs.seq_len * (per_token + per_token_loss)),
        host_bytes=host,
        trainable_params=(ad.trainable if ad else m.num_params) + heads,
        total_params=m.num_params + (ad.trainable if ad else 0) + heads,
    )


def layers_per_token(
    inputs: MemoryInputs, layers: int, act: dict[str, float], lora: _LoraActivations | None = None
) -> tuple[float, str]:
    """Bytes a token leaves in `layers` decoder layers under the run's activation checkpointing, and how counted."""
    lora = lora or _LoraActivations(0.0, 0.0, 0.0)
    layer = act["norms"] + act["attention"] + act["scores"] + act["mlp"] + lora.layer
    ckpt = inputs.activation_checkpointing
    router = act["router_logits"] + act["router_probs"]
    routed = "; router logits and probabilities kept for the router loss" if router else ""
    if ckpt == "full":
        return layers * (act["layer_input"] + router) + layer, f"{layers} layer inputs + one layer recomputed{routed}"
    if ckpt == "selective":
        how = f"{layers} layers' inputs, matmul and attention outputs; the rest recomputed{routed}"
        return layers * (act["selective"] + lora.selective + router), how
    return layers * (layer + act["router_probs"]), f"{layers} layers{routed}"


# ---------------------------------------------------------------- tensor and pipeline parallel (memory_parallel.py)


def rank_memory(inputs: MemoryInputs, m: ModelShape, rank: int, layers: int, mb: int) -> TrainerMemory:
    """Per-GPU bytes of pipeline rank `rank` (any rank of its tensor-parallel group: they hold the same)."""
    p, n = inputs.pp_size, microbatches(inputs)
    first, last = rank == 0, rank == p - 1
    mr = rank_shape(inputs, m, rank, layers)
    per = bytes_per_param(inputs.strategy, inputs.precision, inputs.optimizer)
    parts = _state_parts(inputs, mr, per)
    if p > 1 or inputs.dp_size == 1:  # a pipeline averages in place; no replicas, no reduction
        parts = [part for part in parts if part.name != "DDP gradient buckets"]
    host = 0
    if inputs.cpu_offload:
        parts, host = _offloaded(parts)
    act = sequence_parallel_activations(inputs, mr, _activation_bytes_per_token(inputs, mr))
    kept, how = layers_per_token(inputs, layers, act)
    once = 0.0
    if inputs.activation_checkpointing == "full":  # one layer rebuilt at a time, for one microbatch
        once = act["norms"] + act["attention"] + act["scores"] + act["mlp"]
        kept -= once
    kept += (act["final_norm"] if last else 0) + (act["indices"] if first else 0)
    flight = in_flight(inputs, rank)
    rows = mb / n  # rows of one pipeline microbatch (the whole micro-batch without a pipeline)
    split = f", split over tp {inputs.tp_size}" + (" with sequence parallel" if inputs.sequence_parallel else "")
    where = f"{flight:g} of {n} pipeline microbatches in flight ({inputs.pp_schedule}); " if p > 1 else ""
    parts.append(Part(
        "activations", int(rows * inputs.seq_len * (flight * kept + once)),
        f"{where}{mb} × {inputs.seq_len} tokens; {how}{split if inputs.tp_size > 1 else ''}",
    ))  # fmt: skip
    loss_per_seq = 0.0
    if last:
        loss_flight = n if inputs.pp_schedule == "gpipe" or p == 1 else 1
        loss, per_token_loss = _loss_part(inputs, mr, act, int(rows * loss_flight * inputs.seq_len))
        parts.append(loss)
        loss_per_seq = per_token_loss * inputs.seq_len * loss_flight / n
    parts.append(Part("runtime", RUNTIME_OVERHEAD_BYTES, "CUDA context, cuBLAS workspaces, NCCL buffers"))
    return TrainerMemory(
        parts=parts,
        bytes_per_param={k: float(v) for k, v in per.items()},
        shard_group=inputs.shard_group,
        per_micro_batch_bytes=int(inputs.seq_len * (flight * kept + once) / n + loss_per_seq),
        host_bytes=host,
        trainable_params=m.num_params,
        total_params=m.num_params,
        pp_rank=rank if p > 1 else None,
    )


def busiest_rank_memory(inputs: MemoryInputs, m: ModelShape, mb: int) -> TrainerMemory:
    """The pipeline rank that needs the most memory, with every rank's total beside it."""
    ranks = [rank_memory(inputs, m, r, layers, mb) for r, layers in enumerate(rank_layers(inputs, m.layers))]
    busiest = max(ranks, key=lambda t: t.total)
    if inputs.pp_size > 1:
        busiest.rank_totals = [t.total for t in ranks]
    return busiest


# What FSDP2's CPUOffloadPolicy moves to host memory: the sharded states (the gathered units stay on the GPU)
OFFLOADED_PARTS = (
    "weights", "gradients", "optimizer states", "adapter weights", "adapter gradients", "adapter optimizer states",
)  # fmt: skip


def _offloaded(parts: list[Part]) -> tuple[list[Part], int]:
    """The parts with the sharded states moved to host memory, and those states' bytes."""
    host = sum(p.bytes for p in parts if p.name in OFFLOADED_PARTS)
    kept = [
        Part(p.name, 0, f"in host memory (CPU offload): {p.bytes / GIB:,.2f} GiB; {p.how}")
        if p.name in OFFLOADED_PARTS
        else p
        for p in parts
    ]
    return kept, host


def _sequences(mb: int, seqs: int) -> str:
    """The micro-batch in sequences: '4', or for preference pairs '4 pairs × 2 (chosen and rejected)'."""
    return f"{mb} pair{'s' if mb != 1 else ''} × 2 (chosen and rejected)" if seqs == 2 else str(mb)


def job_shape(inputs: MemoryInputs, m: ModelShape) -> ModelShape:
    """The model the job trains: a reward model drops an untied lm_head (its score head takes the place; a tied one
    is the embedding table, which stays)."""
    if inputs.job != "reward" or m.tied:
        return m
    lm_head = m.vocab * m.hidden
    return replace(m, num_params=m.num_params - lm_head, root_params=m.root_params - lm_head)


def _head_params(inputs: MemoryInputs, m: ModelShape) -> dict[str, int]:
    """The heads a job adds beside the decoder, trained in full with or without LoRA: PPO's value head (weight and
    bias) and a reward model's score head (weight only, as transformers' *ForSequenceClassification)."""
    heads = {}
    if inputs.value_head:
        heads["value head"] = m.hidden + 1
    if inputs.job == "reward":
        heads["score head"] = m.hidden
    return heads


def _job_parts(inputs: MemoryInputs, m: ModelShape, per: dict[str, float]) -> list[Part]:
    """What a job holds beside the model it trains: DPO's (or RL's KL) frozen reference, PPO's value head, a reward
    model's score head."""
    parts = []
    if inputs.holds_reference:
        why = "DPO's reference" if inputs.job == "dpo" else "the KL anchor, rl.kl_coef > 0"
        parts.append(Part(
            "reference weights", math.ceil(m.num_params * per["weights"]),
            f"{why}: a frozen copy of the starting weights, {m.num_params:,} params × {per['weights']} B, whole on "
            "every GPU (copied before wrapping); no gradients or optimizer states",
        ))  # fmt: skip
    if inputs.job == "meta":
        b = per["weights"] + per["gradients"] + per["optimizer states"] + per["weights"]
        parts.append(Part(
            "Reptile's inner copy", math.ceil(m.num_params * b),
            f"the copy the inner steps adapt, with its gradients and Adam's moments, and the mean of the adapted "
            f"weights: {m.num_params:,} params × {b:g} B (the outer SGD's moments, none, are counted as AdamW's)",
        ))  # fmt: skip
    heads = _head_params(inputs, m)
    if "value head" in heads:
        n = heads["value head"]
        parts.append(Part(
            "value head", n * VALUE_HEAD_BYTES_PER_PARAM,
            f"PPO: Linear({m.hidden}, 1), {n:,} params in fp32 × (4 weight + 4 gradient + 8 AdamW) B",
        ))  # fmt: skip
    if "score head" in heads:
        n, b = heads["score head"], per["weights"] + per["gradients"] + per["optimizer states"]
        parts.append(Part(
            "score head", math.ceil(n * b),
            f"Linear({m.hidden}, 1) in place of lm_head, trained in full: {n:,} params × {b:g} B",
        ))  # fmt: skip
    return parts


def _loss_part(inputs: MemoryInputs, m: ModelShape, act: dict[str, float], tokens: int) -> tuple[Part, float]:
    """The logits and the loss, and what one more token adds to them."""
    if inputs.job == "reward":
        # a score per sequence, read at its last token: no logits; backward starts from the final hidden states'
        # gradient (zero but at the scored tokens, yet a whole tensor)
        a = 2 if inputs.half else 4
        how = "no vocabulary logits: one score per sequence; the final hidden states' gradient"
        return Part("score and loss", int(tokens * m.hidden * a), how), m.hidden * a
    if inputs.chunked_loss:
        # engine/loss.py: a chunk's fp32 logits and gradient at a time, the hidden states' gradient kept for
        # backward, the lm_head's gradient summed in fp32 and kept in the weight's dtype; none for the frozen lm_head
        # of LoRA. A whole chunk is counted even when the batch has fewer tokens, so memory stays linear in the
        # micro-batch
        a = 2 if inputs.half else 4
        chunk_tokens = loss_chunk_tokens(m.vocab)
        # a soft cap's slope (Gemma 2) is one more fp32 chunk buffer
        per_entry = LOSS_BYTES_PER_VOCAB + (4 if inputs.soft_capped else 0)
        chunk = chunk_tokens * m.vocab * per_entry
        lm_head_grad = 0 if inputs.lora_rank else m.vocab * m.hidden * (4 + a)
        how = f"chunks of {chunk_tokens} tokens × vocab × {per_entry} B, " + (
            "hidden states' gradient (lm_head frozen)" if inputs.lora_rank else
            "lm_head's gradient in fp32, hidden states' gradient"
        )  # fmt: skip
        return Part("logits and loss", int(chunk + lm_head_grad + tokens * m.hidden * a), how), m.hidden * a
    how = f"tokens × vocab {m.vocab:,} × 12 B (fp32 loss on the whole logits)"
    return Part("logits and loss", int(tokens * act["logits"]), how), act["logits"]


def max_micro_batch(inputs: MemoryInputs, m: ModelShape, capacity: float) -> int:
    """Largest micro-batch whose trainer memory fits in `capacity` bytes (0: not even one sequence)."""
    base = trainer_memory(inputs, m, micro_batch=0)
    if base.per_micro_batch_bytes <= 0:
        return 0
    return max(0, int((capacity - base.total) // base.per_micro_batch_bytes))


# ---------------------------------------------------------------- inference


def kv_bytes_per_token(m: ModelShape, dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """KV-cache bytes one token takes on one GPU: 2 (K and V) × layers × kv_heads × head_dim × dtype bytes."""
    kv_heads = max(1, math.ceil(m.kv_heads / tensor_parallel))  # fewer kv heads than ranks: replicated
    return 2 * m.layers * kv_heads * m.head_dim * dtype_bytes


@dataclass
class InferenceMemory:
    weights_bytes: int
    activation_bytes: int
    runtime_bytes: int
    kv_bytes_per_token: int
    kv_bytes_per_sequence: int
    kv_needed_bytes: int
    max_model_len: int
    max_num_seqs: int
    gpu_memory_utilization: float
    tensor_parallel: int

    @property
    def fixed_bytes(self) -> int:
        """What vLLM takes before the KV cache."""
        return self.weights_bytes + self.activation_bytes + self.runtime_bytes

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["fixed_bytes"] = self.fixed_bytes
        return out


def inference_memory(inputs: MemoryInputs, m: ModelShape) -> InferenceMemory | None:
    if inputs.max_model_len is None:
        return None
    w = INFERENCE_DTYPES[inputs.inference_dtype]
    kv_dtype = KV_CACHE_DTYPES[inputs.kv_cache_dtype] or w
    tp = inputs.tensor_parallel
    per_token = kv_bytes_per_token(m, kv_dtype, tp)
    padded = math.ceil(inputs.max_model_len / VLLM_BLOCK_TOKENS) * VLLM_BLOCK_TOKENS
    per_seq = per_token * padded
    # the profiling forward: a batch of max_num_batched_tokens through one layer at a time (norm, q/k/v, MLP
    # gate/up/act), and fp32 logits and probabilities for one sampled token per sequence
    tokens = min(VLLM_MAX_BATCHED_TOKENS, inputs.max_num_seqs * inputs.max_model_len)
    per_layer_token = (2 * m.hidden + m.q_dim + 2 * m.kv_dim + 3 * m.mlp_width // tp) * w
    activations = tokens * per_layer_token + inputs.max_num_seqs * m.vocab * 8
    return InferenceMemory(
        weights_bytes=math.ceil(m.num_params * w / tp),
        activation_bytes=int(activations),
        runtime_bytes=RUNTIME_OVERHEAD_BYTES,
        kv_bytes_per_token=per_token,
        kv_bytes_per_sequence=per_seq,
        kv_needed_bytes=per_seq * inputs.max_num_seqs,
        max_model_len=inputs.max_model_len,
        max_num_seqs=inputs.max_num_seqs,
        gpu_memory_utilization=inputs.gpu_memory_utilization,
        tensor_parallel=tp,
    )
