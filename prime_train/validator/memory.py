"""`prime-train memory`: what one GPU holds while a run trains (and serves) its model, part by part.

Preflight has a quick fit check; this is the thorough calculator behind it. Everything is arithmetic on the
model's HF config dict (no torch, no download of weights), so it answers in milliseconds on a laptop.

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
recomputes the attention scores (drops the score-matrix term; nothing to drop with SDPA/flash), ``full`` keeps
only each layer's input and rebuilds one layer's activations at a time in backward. Outside the layers: the
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

import json
import math
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prime_train.validator.preflight import count_parameters

if TYPE_CHECKING:
    from rich.console import Console

    from prime_train.config.schema import Config

GIB = 1 << 30
MIB = 1 << 20

STRATEGIES = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
PRECISIONS = ("bf16", "fp32")
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
CHECKPOINTING = ("none", "selective", "full")
ATTENTION = ("sdpa", "flash", "eager")
KV_CACHE_DTYPES = {"auto": None, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp32": 4}
INFERENCE_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}

ZERO_FAMILY = ("zero1", "zero2", "zero3")

# optimizer states per parameter besides master weights: AdamW's m and v, 8-bit AdamW's quantised m and v,
# SGD's momentum buffer
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adamw8bit": 2, "sgd": 4}
MASTER_BYTES = 4
RUNTIME_OVERHEAD_BYTES = GIB
TIGHT_FRACTION = 0.10  # headroom under this fraction of the GPU's memory is flagged as tight
VLLM_BLOCK_TOKENS = 16
VLLM_MAX_BATCHED_TOKENS = 8192
LOSS_BYTES_PER_VOCAB = 12  # fp32: saved log-softmax + its incoming gradient + the logits' gradient

DATA_DIR = Path(__file__).parent / "data"


class MemoryInputError(ValueError):
    """A setting the calculator cannot work with; the message names the flag or key."""


# ---------------------------------------------------------------- model shape


@dataclass(frozen=True)
class ModelShape:
    """What the calculator needs from an HF config dict, with its defaults filled in."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_width: int  # per token: intermediate size, or routed experts' width × experts per token (+ shared)
    experts: int
    vocab: int
    tied: bool
    attention_dropout: float
    num_params: int
    layer_params: int
    root_params: int  # embeddings, final norm and an untied lm_head: FSDP's root unit

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "model config") -> ModelShape:
        if "hidden_size" not in hf and isinstance(hf.get("text_config"), dict):
            hf = hf["text_config"]  # a vision-language model: its language model is what trains
        try:
            num_params = count_parameters(hf)
            h, layers, heads = int(hf["hidden_size"]), int(hf["num_hidden_layers"]), int(hf["num_attention_heads"])
            vocab = int(hf["vocab_size"])
        except KeyError as exc:
            raise MemoryInputError(
                f"{source} has no {exc.args[0]!r}: not a decoder config this calculator knows"
            ) from None
        except (TypeError, ValueError) as exc:
            raise MemoryInputError(f"{source} is not a decoder config this calculator knows: {exc}") from None
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = int(hf.get("head_dim") or h // heads)
        experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
        if experts:
            per_token = int(hf.get("num_experts_per_tok") or 2)
            width = per_token * int(hf.get("moe_intermediate_size") or hf["intermediate_size"])
            width += int(hf.get("shared_expert_intermediate_size") or 0)
        else:
            width = int(hf["intermediate_size"])
        tied = bool(hf.get("tie_word_embeddings", True))
        root = vocab * h * (1 if tied else 2) + h
        return cls(
            hidden=h,
            layers=layers,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            mlp_width=width,
            experts=experts,
            vocab=vocab,
            tied=tied,
            attention_dropout=float(hf.get("attention_dropout") or 0.0),
            num_params=num_params,
            layer_params=(num_params - root) // layers,
            root_params=root,
        )


def resolve_model(spec: dict[str, Any] | str) -> tuple[dict[str, Any], str]:
    """An HF config dict and where it came from: a dict, a config.json file, a model directory, or a hub id.

    A hub id is looked up in the local HF cache first and downloaded (config.json only) when it is not there.
    """
    if isinstance(spec, dict):
        return spec, "model config dict"
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise MemoryInputError(f"model {spec!r}: the directory has no config.json")
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8")), str(path)
        except (OSError, ValueError) as exc:
            raise MemoryInputError(f"model {spec!r}: cannot read {path}: {exc}") from None
    if spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise MemoryInputError(f"model {spec!r} is neither a config.json, a model directory nor a hub id")
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        raise MemoryInputError(
            f"model {spec!r} looks like a hub id but huggingface_hub is not installed; pass a config.json"
        ) from None
    cached = try_to_load_from_cache(spec, "config.json")
    found = cached if isinstance(cached, str) else None
    if found is None:
        try:
            found = hf_hub_download(spec, "config.json")
        except Exception as exc:  # offline, gated, unknown repo: all say the same to the user
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise MemoryInputError(
                f"model {spec!r}: config.json is not in the local HF cache and could not be downloaded ({first}); "
                "pass the path of its config.json instead"
            ) from None
    return json.loads(Path(found).read_text(encoding="utf-8")), f"{spec} ({found})"


# ---------------------------------------------------------------- GPU table


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    nominal_gb: float
    bf16_tflops: float | None
    aliases: tuple[str, ...] = ()
    note: str = ""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


@dataclass(frozen=True)
class GpuTable:
    checked: str
    source: str
    gpus: tuple[GpuSpec, ...]

    def names(self) -> list[str]:
        return [g.name for g in self.gpus]

    def find(self, name: str) -> GpuSpec:
        """The GPU called `name` (its table name or an alias, in any case, spaces or dashes); else a clear error."""
        wanted = _norm_gpu(name)
        for gpu in self.gpus:
            if wanted in {_norm_gpu(n) for n in (gpu.name, *gpu.aliases)}:
                return gpu
        raise MemoryInputError(f"unknown GPU {name!r}; known GPUs: {', '.join(self.names())}")


def _norm_gpu(name: str) -> str:
    text = name.upper().replace("NVIDIA", "").replace("AMD", "").replace("INSTINCT", "").replace("GEFORCE", "")
    return "".join(ch for ch in text if ch.isalnum())


def load_gpus(path: str | os.PathLike[str] | None = None) -> GpuTable:
    """The shipped table of common GPUs (data/gpus.json), or another file of the same form."""
    file = Path(path) if path else DATA_DIR / "gpus.json"
    data = json.loads(file.read_text(encoding="utf-8"))
    gpus = []
    for entry in data["gpus"]:
        gpus.append(
            GpuSpec(
                name=entry["name"],
                memory_bytes=int(entry["memory_mib"]) * MIB,
                nominal_gb=float(entry["nominal_gb"]),
                bf16_tflops=entry.get("bf16_tflops"),
                aliases=tuple(entry.get("aliases", ())),
                note=entry.get("note", ""),
            )
        )
    return GpuTable(checked=data["checked"], source=data.get("source", ""), gpus=tuple(gpus))


# ---------------------------------------------------------------- inputs


@dataclass
class MemoryInputs:
    """Everything the estimate depends on; build it from flags or with `inputs_from_config`."""

    model: dict[str, Any]
    model_source: str = "model config dict"
    seq_len: int = 2048
    micro_batch: int = 1
    gpus_per_node: int = 1
    num_nodes: int = 1
    strategy: str = "none"
    precision: str = "bf16"
    optimizer: str = "adamw"
    activation_checkpointing: str = "none"
    attention: str = "sdpa"
    hsdp_shard_size: int | None = None
    # inference (vLLM); off unless max_model_len is set
    max_model_len: int | None = None
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    inference_dtype: str = "bf16"
    tensor_parallel: int = 1
    colocate: bool = False
    gpus: list[str] | None = None  # the GPUs to give verdicts for; None: the whole table

    def __post_init__(self) -> None:
        choices = {
            "strategy": STRATEGIES,
            "precision": PRECISIONS,
            "optimizer": OPTIMIZERS,
            "activation_checkpointing": CHECKPOINTING,
            "attention": ATTENTION,
            "kv_cache_dtype": tuple(KV_CACHE_DTYPES),
            "inference_dtype": tuple(INFERENCE_DTYPES),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise MemoryInputError(f"{key} = {getattr(self, key)!r}: must be one of {', '.join(allowed)}")
        for key in ("seq_len", "micro_batch", "gpus_per_node", "num_nodes", "max_num_seqs", "tensor_parallel"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise MemoryInputError(f"{key} = {value!r}: must be a whole number ≥ 1")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise MemoryInputError(f"max_model_len = {self.max_model_len!r}: must be ≥ 1")
        if self.hsdp_shard_size is not None and self.hsdp_shard_size < 1:
            raise MemoryInputError(f"hsdp_shard_size = {self.hsdp_shard_size!r}: must be ≥ 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise MemoryInputError(
                f"gpu_memory_utilization = {self.gpu_memory_utilization!r}: must be in (0, 1], a fraction of the GPU"
            )

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def shard_group(self) -> int:
        """GPUs the sharded states are spread over."""
        if self.strategy == "hsdp":
            return min(self.hsdp_shard_size or self.gpus_per_node, self.world_size)
        if self.strategy in ("zero1", "zero2", "zero3", "fsdp"):
            return self.world_size
        return 1


def inputs_from_config(cfg: Config, **overrides: Any) -> MemoryInputs:
    """MemoryInputs for a run config, as the embedded engine would run it on GPUs; `overrides` win.

    GPUs per node come from ``distributed.nproc_per_node`` (1 when unset: this plans a run, it does not look
    at the GPUs of this machine); ``precision = "auto"`` is bf16, what it means on a GPU. Inference settings
    are filled in for RL runs, whose rollout workers they describe.
    """
    from prime_train.validator.preflight import model_shape

    names = {f.name for f in fields(MemoryInputs)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise MemoryInputError(f"unknown memory setting(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    if "model" in overrides:
        hf, source = resolve_model(overrides.pop("model"))
    else:
        hf, source = model_shape(cfg)
        if hf is None:
            raise MemoryInputError(f"the model's shape is unknown: {source}")
    gpus_per_node = overrides.get("gpus_per_node") or cfg.distributed.nproc_per_node or 1
    nodes = overrides.get("num_nodes") or cfg.distributed.nnodes
    strategy = cfg.distributed.strategy
    if strategy == "auto":
        strategy = "ddp" if gpus_per_node * nodes > 1 else "none"
    attention = {"flash_attention_2": "flash"}.get(cfg.model.attn_implementation, cfg.model.attn_implementation)
    values: dict[str, Any] = {
        "model": hf,
        "model_source": overrides.pop("model_source", source),
        "seq_len": cfg.data.seq_len,
        "micro_batch": cfg.train.micro_batch_size,
        "gpus_per_node": gpus_per_node,
        "num_nodes": nodes,
        "strategy": strategy,
        "precision": "fp32" if cfg.train.precision == "fp32" else "bf16",
        "activation_checkpointing": "full" if cfg.model.activation_checkpointing else "none",
        "attention": attention,
        "hsdp_shard_size": cfg.distributed.hsdp_shard_size,
    }
    if cfg.run.job == "rl" and not cfg.job.command:
        inf = cfg.inference
        values.update(
            max_model_len=inf.max_model_len,
            max_num_seqs=inf.max_num_seqs,
            gpu_memory_utilization=inf.gpu_memory_utilization,
            tensor_parallel=inf.gpus_per_worker,
            colocate=inf.colocate,
        )
    values.update(overrides)
    return MemoryInputs(**values)


def inputs_from_flags(model: dict[str, Any] | str, **settings: Any) -> MemoryInputs:
    """MemoryInputs without a run config: `model` is a config dict, a config.json, a model directory or a hub id;
    `settings` are MemoryInputs fields (those left None keep their defaults)."""
    hf, source = resolve_model(model)
    names = {f.name for f in fields(MemoryInputs)} - {"model", "model_source"}
    unknown = sorted(set(settings) - names)
    if unknown:
        raise MemoryInputError(f"unknown memory setting(s): {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    return MemoryInputs(model=hf, model_source=source, **{k: v for k, v in settings.items() if v is not None})


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
        return self.get("gradients")

    @property
    def optimizer_states(self) -> int:
        return self.get("optimizer states")

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


def _activation_bytes_per_token(inputs: MemoryInputs, m: ModelShape) -> dict[str, float]:
    """Bytes one token leaves behind for backward: one decoder layer's, split into its terms, and the rest."""
    bf16 = inputs.precision == "bf16"
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
        "layer_input": h * (4 if (autocast or not bf16) else a),  # the residual stream's dtype
        "final_norm": norm,
        "indices": 8,
        "logits": LOSS_BYTES_PER_VOCAB * m.vocab,
    }


def trainer_memory(inputs: MemoryInputs, m: ModelShape, *, micro_batch: int | None = None) -> TrainerMemory:
    """Per-GPU bytes of a training process, part by part (see the module docstring for every rule)."""
    mb = micro_batch if micro_batch is not None else inputs.micro_batch
    n = inputs.shard_group
    strat = inputs.strategy
    per = bytes_per_param(strat, inputs.precision, inputs.optimizer)
    p = m.num_params
    shard_w = n if strat in ("zero3", "fsdp", "hsdp") else 1
    shard_g = n if strat in ("zero2", "zero3", "fsdp", "hsdp") else 1
    shard_o = n if strat in ("zero1", "zero2", "zero3", "fsdp", "hsdp") else 1
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
        w = 2 if inputs.precision == "bf16" else 4
        # FSDP2 keeps the root unit (embeddings, final norm, lm_head) gathered from forward to the end of backward,
        # gathers a decoder layer while prefetching the next, and holds one unit's unsharded gradient
        unit = max(m.layer_params, m.root_params)
        gathered = (m.root_params + 2 * m.layer_params + unit) * w
        parts.append(Part("gathered units", gathered, "root unit + 2 decoder layers unsharded, one unit's gradient"))

    act = _activation_bytes_per_token(inputs, m)
    tokens = mb * inputs.seq_len
    layer = act["norms"] + act["attention"] + act["scores"] + act["mlp"]
    ckpt = inputs.activation_checkpointing
    if ckpt == "full":
        per_token = m.layers * act["layer_input"] + layer
        how = f"{m.layers} layer inputs + one layer recomputed"
    elif ckpt == "selective":
        per_token = m.layers * (layer - act["scores"])
        how = f"{m.layers} layers, attention scores recomputed"
    else:
        per_token = m.layers * layer
        how = f"{m.layers} layers"
    per_token += act["final_norm"] + act["indices"]
    parts.append(
        Part(
            "activations",
            int(tokens * per_token),
            f"{mb} × {inputs.seq_len} tokens × {per_token / 1024:,.1f} KiB; {how}",
        )
    )
    parts.append(Part("logits and loss", int(tokens * act["logits"]), f"tokens × vocab {m.vocab:,} × 12 B (fp32 loss)"))
    parts.append(Part("runtime", RUNTIME_OVERHEAD_BYTES, "CUDA context, cuBLAS workspaces, NCCL buffers"))
    return TrainerMemory(
        parts=parts,
        bytes_per_param={k: float(v) for k, v in per.items()},
        shard_group=n,
        per_micro_batch_bytes=int(inputs.seq_len * (per_token + act["logits"])),
    )


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


# ---------------------------------------------------------------- verdicts per GPU


@dataclass
class GpuVerdict:
    gpu: str
    memory_bytes: int
    trainer_need_bytes: int
    trainer_fits: bool
    trainer_headroom_bytes: int  # negative: the shortfall
    max_micro_batch: int
    tight: bool
    # inference alone on this GPU
    kv_available_bytes: int | None = None
    full_length_seqs: int | None = None
    inference_verdict: str | None = None  # fits | limited | fails
    # trainer and vLLM sharing this GPU
    colocation: dict[str, Any] | None = None

    @property
    def headroom_gib(self) -> float:
        return self.trainer_headroom_bytes / GIB

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["memory_gib"] = round(self.memory_bytes / GIB, 2)
        out["trainer_need_gib"] = round(self.trainer_need_bytes / GIB, 2)
        out["trainer_headroom_gib"] = round(self.headroom_gib, 2)
        return out


def _colocation(
    inputs: MemoryInputs, m: ModelShape, gpu: GpuSpec, trainer: TrainerMemory, inf: InferenceMemory
) -> dict[str, Any]:
    """How to split one GPU between the trainer and vLLM: the utilisation, micro-batch and max_num_seqs that fit."""
    cap = gpu.memory_bytes
    one_seq = inf.fixed_bytes + inf.kv_bytes_per_sequence
    min_trainer = trainer_memory(inputs, m, micro_batch=1).total
    if min_trainer + one_seq > cap:
        return {
            "fits": False,
            "need_bytes": min_trainer + one_seq,
            "reason": f"micro-batch 1 ({min_trainer / GIB:.1f} GiB) and one full-length sequence in vLLM "
            f"({one_seq / GIB:.1f} GiB) need {(min_trainer + one_seq) / GIB:.1f} GiB",
        }
    # give the trainer what it needs at the configured micro-batch and vLLM the rest
    trainer_need = trainer.total
    util_for_rest = math.floor((cap - trainer_need) / cap * 100) / 100
    seqs_at_split = max(0, int((util_for_rest * cap - inf.fixed_bytes) // inf.kv_bytes_per_sequence))
    # or give vLLM what max_num_seqs full-length sequences need and the trainer the rest
    util_for_seqs = math.ceil((inf.fixed_bytes + inf.kv_needed_bytes) / cap * 100) / 100
    mb_at_seqs = max_micro_batch(inputs, m, (1 - util_for_seqs) * cap) if util_for_seqs < 1 else 0
    fits = trainer_need + inf.fixed_bytes + inf.kv_needed_bytes <= cap
    if fits:
        # both fit as configured: split the spare memory, so neither side runs at its very edge
        spare = cap - trainer_need - inf.fixed_bytes - inf.kv_needed_bytes
        recommended = math.floor((inf.fixed_bytes + inf.kv_needed_bytes + spare / 2) / cap * 100) / 100
    else:
        recommended = util_for_rest if seqs_at_split >= 1 else util_for_seqs
    return {
        "fits": fits,
        "recommended_gpu_memory_utilization": recommended,
        "max_num_seqs_at_recommended": max(0, int((recommended * cap - inf.fixed_bytes) // inf.kv_bytes_per_sequence)),
        "max_micro_batch_at_recommended": max_micro_batch(inputs, m, (1 - recommended) * cap),
        "trainer_first": {"gpu_memory_utilization": util_for_rest, "max_num_seqs": seqs_at_split},
        "inference_first": {"gpu_memory_utilization": util_for_seqs, "max_micro_batch": mb_at_seqs},
    }


def gpu_verdicts(
    inputs: MemoryInputs, m: ModelShape, trainer: TrainerMemory, inf: InferenceMemory | None, table: GpuTable
) -> list[GpuVerdict]:
    gpus = [table.find(name) for name in inputs.gpus] if inputs.gpus is not None else list(table.gpus)
    out = []
    for gpu in gpus:
        cap = gpu.memory_bytes
        headroom = cap - trainer.total
        verdict = GpuVerdict(
            gpu=gpu.name,
            memory_bytes=cap,
            trainer_need_bytes=trainer.total,
            trainer_fits=headroom >= 0,
            trainer_headroom_bytes=headroom,
            max_micro_batch=max_micro_batch(inputs, m, cap),
            tight=0 <= headroom < TIGHT_FRACTION * cap,
        )
        if inf is not None:
            available = int(inf.gpu_memory_utilization * cap) - inf.fixed_bytes
            seqs = max(0, available // inf.kv_bytes_per_sequence) if available > 0 else 0
            verdict.kv_available_bytes = available
            verdict.full_length_seqs = int(seqs)
            verdict.inference_verdict = "fits" if seqs >= inf.max_num_seqs else "limited" if seqs >= 1 else "fails"
            if inputs.colocate:
                verdict.colocation = _colocation(inputs, m, gpu, trainer, inf)
        out.append(verdict)
    return out


# ---------------------------------------------------------------- the report


@dataclass
class MemoryReport:
    inputs: MemoryInputs
    shape: ModelShape
    trainer: TrainerMemory
    inference: InferenceMemory | None
    gpus: list[GpuVerdict]
    gpu_table_checked: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        settings = {k: v for k, v in asdict(self.inputs).items() if k != "model"}
        return {
            "model": {"source": self.inputs.model_source, **asdict(self.shape)},
            "settings": settings,
            "trainer": self.trainer.to_dict(),
            "inference": self.inference.to_dict() if self.inference else None,
            "gpus": [g.to_dict() for g in self.gpus],
            "gpu_table_checked": self.gpu_table_checked,
            "notes": self.notes,
        }


def estimate(params: MemoryInputs, *, gpu_table: GpuTable | None = None) -> MemoryReport:
    """The whole estimate: trainer memory per GPU, inference memory, and a verdict for each GPU."""
    shape = ModelShape.from_hf(params.model, params.model_source)
    if params.strategy == "hsdp" and params.world_size % params.shard_group:
        raise MemoryInputError(
            f"hsdp_shard_size = {params.shard_group} does not divide the {params.world_size} GPUs of the job"
        )
    table = gpu_table or load_gpus()
    trainer = trainer_memory(params, shape)
    inf = inference_memory(params, shape)
    notes = []
    if params.strategy in ZERO_FAMILY and params.precision == "bf16":
        notes.append("ZeRO family: bf16 weights and gradients, fp32 master weights inside the optimizer states")
    if params.strategy in ("none", "ddp") and params.precision == "bf16":
        notes.append("none/ddp in bf16: fp32 weights under autocast, as the embedded engine runs them")
    if params.activation_checkpointing == "selective" and params.attention != "eager":
        notes.append("selective checkpointing saves nothing with SDPA/flash attention: they keep no score matrix")
    if params.world_size == 1 and params.strategy not in ("none",):
        notes.append(f"strategy {params.strategy} on one GPU shards nothing")
    if inf is not None and params.colocate:
        notes.append(
            "colocated: vLLM takes gpu_memory_utilization × the GPU and the trainer gets the rest; start vLLM "
            "first, since it refuses to start when less than that fraction is free"
        )
    return MemoryReport(
        inputs=params,
        shape=shape,
        trainer=trainer,
        inference=inf,
        gpus=gpu_verdicts(params, shape, trainer, inf, table),
        gpu_table_checked=table.checked,
        notes=notes,
    )


def with_overrides(params: MemoryInputs, **changes: Any) -> MemoryInputs:
    """A copy of `params` with some settings changed (validated again)."""
    return replace(params, **changes)


# ---------------------------------------------------------------- rendering


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:,.2f}"


def render_memory(report: MemoryReport, console: Console) -> None:
    """Rich tables: the per-GPU breakdown, a verdict per GPU, and the inference and colocation figures."""
    from rich.table import Table

    p, m = report.inputs, report.shape
    console.print(
        f"[bold]{p.model_source}[/]: {m.num_params / 1e9:,.3f}B params, {m.layers} layers, hidden {m.hidden}, "
        f"{m.heads} heads ({m.kv_heads} kv), vocab {m.vocab:,}"
    )
    console.print(
        f"training: {p.strategy} over {p.world_size} GPU(s) ({p.gpus_per_node}/node × {p.num_nodes}), "
        f"{p.precision}, {p.optimizer}, micro-batch {p.micro_batch} × seq {p.seq_len}, "
        f"checkpointing {p.activation_checkpointing}, attention {p.attention}"
    )
    parts = Table(title="Trainer memory per GPU", title_justify="left")
    parts.add_column("part")
    parts.add_column("GiB", justify="right")
    parts.add_column("how")
    for part in report.trainer.parts:
        parts.add_row(part.name, _gib(part.bytes), part.how)
    parts.add_row("[bold]total[/]", f"[bold]{_gib(report.trainer.total)}[/]", "")
    console.print(parts)

    verdicts = Table(title=f"Fit per GPU (table checked {report.gpu_table_checked})", title_justify="left")
    for col, justify in (("GPU", "left"), ("memory GiB", "right"), ("trainer", "left"), ("headroom GiB", "right"),
                         ("max micro-batch", "right")):  # fmt: skip
        verdicts.add_column(col, justify=justify)  # type: ignore[arg-type]
    inf = report.inference
    if inf is not None:
        verdicts.add_column("vLLM full-length seqs", justify="right")
    for g in report.gpus:
        fit = "[yellow]tight[/]" if g.tight else "[green]fits[/]" if g.trainer_fits else "[red]does not fit[/]"
        row = [g.gpu, f"{g.memory_bytes / GIB:,.1f}", fit, f"{g.headroom_gib:+,.2f}", str(g.max_micro_batch)]
        if inf is not None:
            colour = {"fits": "green", "limited": "yellow", "fails": "red"}[g.inference_verdict or "fails"]
            row.append(f"[{colour}]{g.full_length_seqs} / {inf.max_num_seqs}[/]")
        verdicts.add_row(*row)
    console.print(verdicts)

    if inf is not None:
        console.print(
            f"vLLM: weights {_gib(inf.weights_bytes)} GiB (TP {inf.tensor_parallel}), profiling forward "
            f"{_gib(inf.activation_bytes)} GiB, runtime {_gib(inf.runtime_bytes)} GiB; KV cache "
            f"{inf.kv_bytes_per_token / 1024:,.1f} KiB/token = {_gib(inf.kv_bytes_per_sequence)} GiB per "
            f"{inf.max_model_len}-token sequence; {inf.max_num_seqs} sequences need {_gib(inf.kv_needed_bytes)} GiB "
            f"at gpu_memory_utilization {inf.gpu_memory_utilization}"
        )
        colocated = [g for g in report.gpus if g.colocation]
        if colocated:
            table = Table(title="Trainer and vLLM on one GPU", title_justify="left")
            for col in ("GPU", "both fit", "gpu_memory_utilization", "max_num_seqs", "max micro-batch"):
                table.add_column(col)
            for g in colocated:
                c = g.colocation or {}
                if "recommended_gpu_memory_utilization" not in c:
                    table.add_row(g.gpu, "[red]no[/]", f"needs {c['need_bytes'] / GIB:,.1f} GiB", "", "")
                    continue
                table.add_row(
                    g.gpu,
                    "[green]yes[/]" if c["fits"] else "[yellow]not as configured[/]",
                    f"{c['recommended_gpu_memory_utilization']:.2f}",
                    str(c["max_num_seqs_at_recommended"]),
                    str(c["max_micro_batch_at_recommended"]),
                )
            console.print(table)
    for note in report.notes:
        console.print(f"[dim]note: {note}[/]")
