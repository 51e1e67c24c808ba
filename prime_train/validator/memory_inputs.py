"""What the memory calculator computes from: the model's shape and the run's settings, validated.

The shape comes from an HF config dict (given, in a config.json, a model directory, or a hub id's
config.json); the settings are plain fields with their allowed values. Every part of the calculator
(gpus.py, memory_breakdown.py, memory.py) imports its units and its one error from here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_train.validator.param_count import ALL_LINEAR, AdapterCount, count_adapters, count_parameters

GIB = 1 << 30
MIB = 1 << 20

STRATEGIES = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp", "hsdp")
PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adamw", "adamw8bit", "sgd")
CHECKPOINTING = ("none", "selective", "full")
ATTENTION = ("sdpa", "flash", "eager")
# "chunked": the fused lm_head + cross-entropy (engine/loss.py); "full": the logits whole, as transformers computes
# them; "auto": chunked where the engine's model has that head (the native model, or transformers' with it)
LOSSES = ("auto", "chunked", "full")
# The families the engine's model takes the chunked head for, whichever model runs them (the native decoder's,
# engine/llama.py SUPPORTED_MODEL_TYPES, are among transformers' in engine/hf_head.py FUSED_MODEL_TYPES), and the
# tokens per chunk of that loss (engine/loss.py chunk_tokens): mirrored, tests pin them equal
HF_CHUNKED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "starcoder2", "smollm3",
    "cohere", "cohere2", "granite", "mixtral", "qwen2_moe", "qwen3_moe",
)  # fmt: skip
LOSS_CHUNK_ENTRIES = 1024 * 65536


def loss_chunk_tokens(vocab: int) -> int:
    """Tokens a chunk of the chunked loss and log-probs: 1024, fewer above a 64k vocabulary."""
    return max(64, min(1024, LOSS_CHUNK_ENTRIES // max(1, vocab) // 64 * 64))


KV_CACHE_DTYPES = {"auto": None, "bf16": 2, "fp16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp32": 4}
INFERENCE_DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}

ZERO_FAMILY = ("zero1", "zero2", "zero3")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# run.job, and rl.algorithm for the rl job; dpo and reward train on preference pairs, two sequences (chosen and
# rejected) for each pair micro_batch_size counts
JOBS = ("sft", "pretrain", "rl", "dpo", "reward", "meta")
PAIR_JOBS = ("dpo", "reward")
RL_ALGORITHMS = ("grpo", "ppo")
# the jobs that can hold a frozen copy of the starting weights: DPO's reference, RL's KL anchor (rl.kl_coef > 0)
REFERENCE_JOBS = ("dpo", "rl")
# an MoE's router loss: the families and jobs the engine adds it for (engine/hf_head.py ROUTED_MODEL_TYPES,
# engine/model.py ROUTER_LOSS_JOBS: mirrored without importing torch, tests pin them equal; lint reads these)
ROUTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
ROUTER_LOSS_JOBS = ("sft", "pretrain", "dpo", "rl")
# lora.quantize: the frozen base as the run holds it, or its decoder blocks' linear weights in 4-bit NormalFloat
LORA_QUANTIZE = ("none", "nf4")


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
    loss: str = "auto"
    hsdp_shard_size: int | None = None
    # the engine's distributed.zero_stage on FSDP2 (strategy fsdp or hsdp): 1 and 2 keep the parameters gathered from
    # forward to backward, 3 (or None) frees them after forward; cpu_offload: FSDP2's CPUOffloadPolicy (also with
    # zero3): the sharded weights, gradients and optimizer states in host memory
    zero_stage: int | None = None
    cpu_offload: bool = False
    # train.float8: torchao's float8 linear layers (compute only: see memory_breakdown's docstring)
    float8: bool = False
    # distributed.tp_size, sequence_parallel, pp_size, pp_schedule, pp_microbatches (memory_parallel.py): the GPUs
    # form (pp, dp, tp); the data-parallel strategy shards over dp = GPUs / (tp × pp)
    tp_size: int = 1
    sequence_parallel: bool = False
    pp_size: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None  # unset: pp_size, as the engine
    # inference (vLLM); off unless max_model_len is set
    max_model_len: int | None = None
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    inference_dtype: str = "bf16"
    tensor_parallel: int = 1
    colocate: bool = False
    gpus: list[str] | None = None  # the GPUs to give verdicts for; None: the whole table
    # LoRA ([lora]): adapters of lora_rank on lora_targets train, the base is frozen (0: the whole model trains)
    lora_rank: int = 0
    lora_targets: str | list[str] = ALL_LINEAR
    lora_quantize: str = "none"
    lora_dropout: float = 0.0
    # lora.target_parameters: fused expert tensors that get an adapter each expert (engine/lora.py); each adapted
    # tensor is held again as W + B @ A from a layer's forward to its backward
    lora_target_parameters: tuple[str, ...] | list[str] = ()
    # the job ([run].job): dpo and reward hold two sequences a pair; rl's PPO trains a value head; `reference` is a
    # frozen copy of the starting weights (None: the job's default, dpo's reference; dpo.precompute_reference and
    # an rl run without rl.kl_coef hold none; with LoRA no job does: the base with its adapters off is the reference)
    job: str = "sft"
    rl_algorithm: str = "grpo"
    reference: bool | None = None
    # model.router_aux_loss_coef: an MoE's router loss (None: as its config.json's output_router_logits says)
    router_aux_loss_coef: float | None = None

    def __post_init__(self) -> None:
        choices = {
            "strategy": STRATEGIES,
            "precision": PRECISIONS,
            "optimizer": OPTIMIZERS,
            "activation_checkpointing": CHECKPOINTING,
            "attention": ATTENTION,
            "loss": LOSSES,
            "kv_cache_dtype": tuple(KV_CACHE_DTYPES),
            "inference_dtype": tuple(INFERENCE_DTYPES),
            "lora_quantize": LORA_QUANTIZE,
            "job": JOBS,
            "rl_algorithm": RL_ALGORITHMS,
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
        self._check_lora()
        self._check_sharding()
        self._check_model_parallel()
        if self.rl_algorithm != "grpo" and self.job != "rl":
            raise MemoryInputError(f"rl_algorithm = {self.rl_algorithm!r} is for job 'rl', not {self.job!r}")
        if self.reference and self.job not in REFERENCE_JOBS:
            raise MemoryInputError(f"reference: job {self.job!r} holds no reference model (only dpo and rl do)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise MemoryInputError(
                f"gpu_memory_utilization = {self.gpu_memory_utilization!r}: must be in (0, 1], a fraction of the GPU"
            )

    def _check_sharding(self) -> None:
        if self.zero_stage is not None and (self.zero_stage not in (1, 2, 3) or self.strategy not in ("fsdp", "hsdp")):
            raise MemoryInputError(
                f"zero_stage = {self.zero_stage!r}: the engine's ZeRO stages are 1, 2 or 3 on strategy fsdp or hsdp "
                f"(not {self.strategy!r}); for DeepSpeed's accounting use strategy zero1, zero2 or zero3"
            )
        if self.cpu_offload and self.strategy not in ("fsdp", "hsdp", "zero3"):
            raise MemoryInputError(
                f"cpu_offload with strategy {self.strategy!r}: offload moves sharded states, so it needs fsdp, hsdp "
                "or zero3"
            )

    def _check_model_parallel(self) -> None:
        """What the engine refuses with tensor or pipeline parallelism, refused here with the same key."""
        for key in ("tp_size", "pp_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MemoryInputError(f"{key} = {value!r}: must be a whole number ≥ 1")
        if self.pp_schedule not in PP_SCHEDULES:
            raise MemoryInputError(f"pp_schedule = {self.pp_schedule!r}: must be one of {', '.join(PP_SCHEDULES)}")
        if self.pp_microbatches is not None and self.pp_microbatches < 1:
            raise MemoryInputError(f"pp_microbatches = {self.pp_microbatches!r}: must be ≥ 1")
        if self.tp_size == 1 and self.pp_size == 1:
            return
        split = f"tp_size = {self.tp_size}, pp_size = {self.pp_size}"
        if self.world_size % (self.tp_size * self.pp_size):
            raise MemoryInputError(f"{split}: tp × pp must divide the {self.world_size} GPUs (gpus_per_node × nodes)")
        if self.lora_rank or self.job not in ("sft", "pretrain"):
            raise MemoryInputError(f"{split}: the engine splits full SFT and pretraining only (no LoRA, no "
                                   f"{self.job} job); set tp_size and pp_size to 1")  # fmt: skip
        if self.strategy in ("hsdp", *ZERO_FAMILY):
            raise MemoryInputError(f"{split} with strategy {self.strategy!r}: the engine shards beside tensor and "
                                   "pipeline parallelism with fsdp (and its zero_stage) only")  # fmt: skip
        if self.strategy == "ddp" and self.tp_size > 1 and self.dp_size > 1:
            raise MemoryInputError(f"{split} with strategy 'ddp': DDP cannot reduce tensor-parallel parameters; the "
                                   "engine runs fsdp over the data-parallel replicas")  # fmt: skip

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: the GPUs that hold the same layers and the same tensor shards."""
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def half(self) -> bool:
        """Whether the run computes in a 2-byte float (bf16 or fp16): both take the same bytes."""
        return self.precision in ("bf16", "fp16")

    @property
    def params_kept_gathered(self) -> bool:
        """FSDP2 with reshard_after_forward off (the engine's ZeRO stage 1 or 2): every layer stays unsharded from its
        forward to its backward, so at the start of backward the whole model is gathered."""
        return self.strategy in ("fsdp", "hsdp") and self.zero_stage in (1, 2)

    def _check_lora(self) -> None:
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise MemoryInputError(f"lora_rank = {self.lora_rank!r}: must be a whole number ≥ 0 (0: no LoRA)")
        if self.lora_quantize != "none" and not self.lora_rank:
            raise MemoryInputError(
                f"lora_quantize = {self.lora_quantize!r} quantizes the frozen base under LoRA adapters: set a LoRA rank"
            )
        if self.lora_quantize == "nf4" and self.strategy in ("fsdp", "hsdp") and self.world_size > 1:
            from prime_train.config.schema import LoraConfig

            nf4 = LoraConfig(rank=1, quantize="nf4")
            raise MemoryInputError(nf4.unavailable(strategy=self.strategy, cuda=True, bitsandbytes=True))
        if not 0 <= self.lora_dropout < 1:
            raise MemoryInputError(f"lora_dropout = {self.lora_dropout!r}: must be in [0, 1)")
        if self.lora_target_parameters and self.lora_dropout > 0:
            raise MemoryInputError("lora_dropout must be 0 with lora_target_parameters (peft refuses the two together)")

    @property
    def adapters(self) -> AdapterCount | None:
        """The LoRA adapters the run trains (None without LoRA); MemoryInputError when they cannot be counted."""
        if not self.lora_rank:
            return None
        try:
            return count_adapters(self.model, self.lora_rank, self.lora_targets, tuple(self.lora_target_parameters))
        except (KeyError, TypeError, ValueError) as exc:
            raise MemoryInputError(f"LoRA adapters not counted: {self.model_source} lacks {exc}") from None

    @property
    def holds_reference(self) -> bool:
        """Whether the trainer holds a frozen copy of the starting weights beside the model it trains."""
        wanted = self.reference if self.reference is not None else self.job == "dpo"
        return bool(wanted) and self.job in REFERENCE_JOBS and not self.lora_rank

    @property
    def sequences_per_sample(self) -> int:
        """Sequences one unit of micro_batch is: 2 for a preference pair (chosen and rejected), else 1."""
        return 2 if self.job in PAIR_JOBS else 1

    @property
    def router_loss(self) -> bool:
        """Whether the trainer adds an MoE's router loss (engine/model.py _router_loss): each layer's router logits
        and their fp32 softmax then live until the loss, past activation checkpointing."""
        hf = self._language_model
        if (
            self.job not in ROUTER_LOSS_JOBS
            or not isinstance(hf, dict)
            or hf.get("model_type") not in ROUTED_MODEL_TYPES
        ):
            return False
        if self.router_aux_loss_coef is not None:
            return self.router_aux_loss_coef > 0
        return bool(hf.get("output_router_logits") and hf.get("router_aux_loss_coef"))

    @property
    def value_head(self) -> bool:
        """Whether a value head trains beside the model (PPO)."""
        return self.job == "rl" and self.rl_algorithm == "ppo"

    @property
    def chunked_loss(self) -> bool:
        """Whether the trainer computes the loss in chunks of tokens (the native model, or transformers' given its
        head: engine/hf_head.py) or on whole logits."""
        if self.job == "reward":
            return False  # no vocabulary logits at all: a score head
        # dpo and rl take each token's log-prob chunk by chunk on the native model (engine/loss.py
        # chunked_token_log_probs), as sft's loss is: the same chunk, lm_head gradient and hidden states' gradient
        if self.loss != "auto":
            return self.loss == "chunked"
        hf = self._language_model
        return isinstance(hf, dict) and hf.get("model_type") in HF_CHUNKED_MODEL_TYPES

    @property
    def soft_capped(self) -> bool:
        """Whether the final logits are soft-capped (Gemma 2: final_logit_softcapping): the chunked loss then holds
        one more fp32 chunk buffer, the cap's slope."""
        hf = self._language_model
        return isinstance(hf, dict) and hf.get("final_logit_softcapping") is not None

    @property
    def _language_model(self) -> Any:
        """The config of the model that trains: a vision-language config's text_config (None when it has none)."""
        return self.model.get("text_config") if "hidden_size" not in self.model else self.model

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def shard_group(self) -> int:
        """GPUs the sharded states are spread over."""
        if self.strategy == "hsdp":
            return min(self.hsdp_shard_size or self.gpus_per_node, self.world_size)
        if self.strategy in ("zero1", "zero2", "zero3", "fsdp"):
            return self.dp_size  # with TP or PP, FSDP2 shards over the "dp" mesh dimension only
        return 1


def job_settings(job: str) -> dict[str, str]:
    """MemoryInputs' job fields for a job named as the CLI names them: run.job, or 'ppo' for rl with PPO."""
    if job == "ppo":
        return {"job": "rl", "rl_algorithm": "ppo"}
    if job not in JOBS:
        raise MemoryInputError(f"job {job!r}: must be one of {', '.join((*JOBS, 'ppo'))}")
    return {"job": job}
