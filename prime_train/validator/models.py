"""`prime-train verify-model`: will this model work for this job, answered from its config before any launch.

A model that vLLM cannot serve, a vision-language checkpoint picked for text RL, a chat template without tools
for a tool-calling environment, or a model too big for the GPUs is otherwise found after a long download and a
longer launch. Everything here reads JSON files (config.json, tokenizer_config.json, the chat template) and
never loads weights or imports torch: it runs on a laptop and in CI.

The parameter counter is exact for the families whose module layout it mirrors (the same shapes transformers
builds, checked against meta-device models in the tests); other architectures get a Llama-shaped estimate,
flagged as such.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal

Job = Literal["sft", "rl", "pretrain"]
JOBS: tuple[str, ...] = ("sft", "rl", "pretrain")

# Full fine-tuning with AdamW in mixed precision: bf16 weights (2) + bf16 gradients (2) + fp32 master weights (4)
# + fp32 first and second moments (8). Activations, the KV cache and framework buffers come on top.
TRAIN_BYTES_PER_PARAM = 16
TRAIN_MEMORY_ASSUMPTION = (
    "16 bytes/parameter: full fine-tuning with AdamW in mixed precision (bf16 weights and gradients, fp32 master "
    "weights and two fp32 moments), before activations; sharding (FSDP) divides it across GPUs"
)
SERVE_MEMORY_ASSUMPTION = "weights only, in the dtype vLLM serves them; the KV cache and activations come on top"

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1, "float8": 1}
# MXFP4: 4-bit values plus one shared 8-bit exponent per block of 32.
MXFP4_BYTES_PER_PARAM = (4 + 8 / 32) / 8

HUB_TIMEOUT_S = 10.0
_DATA = "prime_train.validator.data"

# Field defaults of transformers' config classes (5.x), for the fields the counter reads. Hub config.json files
# leave out whatever equals the default (gemma-3-4b-it's text_config omits heads and vocabulary), so counting from
# the file alone needs them. None means "derived": num_key_value_heads = heads, head_dim = hidden / heads.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "tie_word_embeddings": False,
        "attention_bias": False, "mlp_bias": False, "max_position_embeddings": 2048,
    },
    "mistral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "tie_word_embeddings": False,
        "max_position_embeddings": 131072,
    },
    "mixtral": {
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "tie_word_embeddings": False,
        "max_position_embeddings": 131072, "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    "qwen2": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "tie_word_embeddings": False,
        "max_position_embeddings": 32768,
    },
    "qwen2_moe": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": None, "head_dim": None, "tie_word_embeddings": False,
        "max_position_embeddings": 32768, "num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True,
    },
    "qwen3": {
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": 128, "tie_word_embeddings": False,
        "attention_bias": False, "max_position_embeddings": 32768,
    },
    "qwen3_moe": {
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": None, "tie_word_embeddings": False,
        "attention_bias": False, "max_position_embeddings": 32768, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "decoder_sparse_step": 1, "mlp_only_layers": [],
    },
    "gemma": {
        "vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "tie_word_embeddings": True,
        "attention_bias": False, "max_position_embeddings": 8192,
    },
    "gemma2": {
        "vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True,
        "attention_bias": False, "max_position_embeddings": 8192,
    },
    "gemma3_text": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "tie_word_embeddings": True,
        "attention_bias": False, "max_position_embeddings": 131072,
    },
    "gpt_oss": {
        "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "num_hidden_layers": 36,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": False,
        "attention_bias": True, "max_position_embeddings": 131072, "num_local_experts": 128,
        "num_experts_per_tok": 4,
    },
    "phi3": {
        "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "tie_word_embeddings": False,
        "max_position_embeddings": 4096,
    },
    "deepseek_v3": {
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "tie_word_embeddings": False,
        "attention_bias": False, "max_position_embeddings": 4096, "n_routed_experts": 256, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "first_k_dense_replace": 3, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    },
}  # fmt: skip
# The Qwen-VL text stacks are Qwen2's layers with their own defaults (the 72B's sizes); the flat hub configs
# name the outer model type.
for _alias in ("qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"):
    _DEFAULTS[_alias] = {
        **_DEFAULTS["qwen2"], "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    }  # fmt: skip

# Families the counter mirrors exactly (transformers' module layout); anything else is a Llama-shaped estimate.
EXACT_TEXT_TYPES = frozenset(_DEFAULTS)
# Attention with biases on q, k and v but not on o.
_QKV_BIAS_TYPES = frozenset({"qwen2", "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl", "qwen2_5_vl_text"})
# Families that read config.attention_bias (bias on q, k, v and o when set).
_ATTENTION_BIAS_TYPES = frozenset({"llama", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text", "gpt_oss"})
# RMSNorm over each head's q and k.
_QK_NORM_TYPES = frozenset({"qwen3", "qwen3_moe", "gemma3_text"})
# Sandwich norms: input, post-attention, pre-feedforward, post-feedforward.
_FOUR_NORM_TYPES = frozenset({"gemma2", "gemma3_text"})
# The language model inside a vision-language config, when its text_config names no type.
_TEXT_TYPE_OF = {"gemma3": "gemma3_text", "qwen2_5_vl": "qwen2_5_vl_text", "qwen2_vl": "qwen2_vl_text"}
# Outer model types whose vision tower the counter sizes exactly.
_VISION_COUNTED = frozenset({"qwen2_5_vl", "qwen2_vl", "gemma3"})


class ModelConfigNotFound(Exception):
    """The model's config.json could not be read: no such directory, not cached while offline, not on the hub."""


# ---------------------------------------------------------------- parameter count


@dataclass
class ParameterCount:
    """Parameters of a model by part; `active` is what one token touches: everything but the experts it is not
    routed to, embeddings included (model cards sometimes leave the input embedding out: gpt-oss-20b's "3.6B")."""

    total: int
    active: int
    parts: dict[str, int]
    exact: bool
    moe: bool = False
    notes: list[str] = field(default_factory=list)


def _num(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{key} = {value!r} is not a number")
    return int(value)


def _split_config(hf: dict[str, Any]) -> tuple[dict[str, Any], str, str]:
    """The language model's fields (with transformers' defaults filled in), its model_type, and the outer one."""
    if not isinstance(hf, dict):
        raise TypeError("config.json does not hold a JSON object")
    outer = str(hf.get("model_type") or "llama")
    nested = hf.get("text_config")
    if isinstance(nested, dict):
        text_type = str(nested.get("model_type") or _TEXT_TYPE_OF.get(outer, outer))
        text = {**_DEFAULTS.get(text_type, {}), **nested}
        if "tie_word_embeddings" in hf:  # the outer model owns the lm_head
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        elif outer == "gemma3":
            text.setdefault("tie_word_embeddings", True)
    else:
        text_type = _TEXT_TYPE_OF.get(outer, outer)
        text = {**_DEFAULTS.get(text_type, {}), **hf}
    return text, text_type, outer


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config fields, defaults filled in (for callers that need layers, heads, context)."""
    return _split_config(hf)[0]


def _attention(cfg: dict[str, Any], text_type: str, h: int) -> int:
    heads = _num(cfg, "num_attention_heads")
    if text_type == "deepseek_v3":  # multi-head latent attention
        rope, nope, v = _num(cfg, "qk_rope_head_dim"), _num(cfg, "qk_nope_head_dim"), _num(cfg, "v_head_dim")
        kv_rank, q_rank, bias = _num(cfg, "kv_lora_rank"), cfg.get("q_lora_rank"), bool(cfg.get("attention_bias"))
        qk_head = nope + rope
        if q_rank:
            q = h * q_rank + (q_rank if bias else 0) + q_rank + q_rank * heads * qk_head  # down, norm, up
        else:
            q = h * heads * qk_head
        kv = h * (kv_rank + rope) + ((kv_rank + rope) if bias else 0) + kv_rank + kv_rank * heads * (nope + v)
        return q + kv + heads * v * h + (h if bias else 0)
    kv_heads = _num(cfg, "num_key_value_heads", heads)
    head_dim = _num(cfg, "head_dim", h // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    n = h * q + 2 * h * kv + q * h
    if text_type in _QKV_BIAS_TYPES or (text_type == "qwen2_moe" and cfg.get("qkv_bias", True)):
        n += q + 2 * kv
    elif (text_type in _ATTENTION_BIAS_TYPES or text_type not in EXACT_TEXT_TYPES) and cfg.get("attention_bias"):
        n += q + 2 * kv + h
    if text_type in _QK_NORM_TYPES:
        n += 2 * head_dim
    if text_type == "gpt_oss":
        n += heads  # attention sinks, one logit per head
    return n


@dataclass
class _MoE:
    experts: int
    top_k: int
    per_expert: int
    router: int
    shared: int


def _moe_layer(cfg: dict[str, Any], text_type: str, h: int, layer: int) -> _MoE | None:
    """The routed-expert block of `layer`, or None when the layer has a dense MLP."""
    if text_type in ("mixtral", "gpt_oss") or (text_type not in EXACT_TEXT_TYPES and cfg.get("num_local_experts")):
        experts = _num(cfg, "num_local_experts")
        width = _num(cfg, "intermediate_size")
        top_k = _num(cfg, "num_experts_per_tok", _num(cfg, "experts_per_token", 2))
        if text_type == "gpt_oss":  # experts and router carry biases
            return _MoE(experts, top_k, 3 * h * width + 2 * width + h, experts * h + experts, 0)
        return _MoE(experts, top_k, 3 * h * width, experts * h, 0)
    if text_type in ("qwen2_moe", "qwen3_moe"):
        experts = _num(cfg, "num_experts", 0)
        step = _num(cfg, "decoder_sparse_step", 1)
        if not experts or layer in (cfg.get("mlp_only_layers") or []) or (layer + 1) % step:
            return None
        width = _num(cfg, "moe_intermediate_size")
        shared = 0
        if text_type == "qwen2_moe":
            shared = 3 * h * _num(cfg, "shared_expert_intermediate_size") + h  # shared expert and its gate
        return _MoE(experts, _num(cfg, "num_experts_per_tok"), 3 * h * width, experts * h, shared)
    if text_type == "deepseek_v3":
        if layer < _num(cfg, "first_k_dense_replace", 0):
            return None
        experts, width = _num(cfg, "n_routed_experts"), _num(cfg, "moe_intermediate_size")
        shared = 3 * h * width * _num(cfg, "n_shared_experts", 0)
        return _MoE(experts, _num(cfg, "num_experts_per_tok"), 3 * h * width, experts * h, shared)
    return None


def _qwen_vl_vision(vision: dict[str, Any], outer: str) -> int:
    channels = _num(vision, "in_channels", _num(vision, "in_chans", 3))
    patch, temporal = _num(vision, "patch_size", 14), _num(vision, "temporal_patch_size", 2)
    merge = _num(vision, "spatial_merge_size", 2)
    depth = _num(vision, "depth", 32)
    if outer == "qwen2_5_vl":  # RMSNorm and a biased SwiGLU MLP per block
        d, width, out = _num(vision, "hidden_size"), _num(vision, "intermediate_size"), _num(vision, "out_hidden_size")
        block = 2 * d + (3 * d * d + 3 * d) + (d * d + d) + 3 * d * width + 2 * width + d
        merger_norm = d
    else:  # Qwen2-VL: LayerNorm and a biased GELU MLP of mlp_ratio × width
        d, out = _num(vision, "embed_dim", 1280), _num(vision, "hidden_size")
        width = int(d * float(vision.get("mlp_ratio") or 4))
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * width + width) + (width * d + d)
        merger_norm = 2 * d
    merged = d * merge * merge
    merger = merger_norm + merged * merged + merged + merged * out + out
    return channels * temporal * patch * patch * d + depth * block + merger


def _siglip_vision(vision: dict[str, Any], text_hidden: int) -> int:
    d, width = _num(vision, "hidden_size", 768), _num(vision, "intermediate_size", 3072)
    layers, patch = _num(vision, "num_hidden_layers", 12), _num(vision, "patch_size", 16)
    image, channels = _num(vision, "image_size", 224), _num(vision, "num_channels", 3)
    embeddings = channels * patch * patch * d + d + (image // patch) ** 2 * d
    layer = 2 * (2 * d) + 4 * (d * d + d) + (d * width + width) + (width * d + d)
    n = embeddings + layers * layer + 2 * d  # post-layernorm
    if vision.get("vision_use_head", True):  # attention-pooling head
        n += d + (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (d * width + width) + (width * d + d)
    return n + d * text_hidden + d  # Gemma 3's projector into the text width, and its RMSNorm


def count_model_parameters(hf: dict[str, Any]) -> ParameterCount:
    """Every parameter transformers would build from this config.json dict (tied embeddings counted once).

    Raises KeyError / TypeError when the config lacks what even an estimate needs (hidden size, layers, heads).
    """
    cfg, text_type, outer = _split_config(hf)
    exact = text_type in EXACT_TEXT_TYPES
    notes: list[str] = []
    h, layers = _num(cfg, "hidden_size"), _num(cfg, "num_hidden_layers")
    vocab = _num(cfg, "vocab_size")
    parts = dict.fromkeys(
        ("embedding", "lm_head", "attention", "mlp", "experts", "router", "shared_experts", "norms", "vision"), 0
    )
    parts["embedding"] = vocab * h
    if not cfg.get("tie_word_embeddings", False):
        parts["lm_head"] = vocab * h
    attention = _attention(cfg, text_type, h)
    norms_per_layer = (4 if text_type in _FOUR_NORM_TYPES else 2) * h
    inactive = 0
    moe = False
    for layer in range(layers):
        parts["attention"] += attention
        parts["norms"] += norms_per_layer
        block = _moe_layer(cfg, text_type, h, layer)
        if block is None:
            width = _num(cfg, "intermediate_size")
            parts["mlp"] += 3 * h * width + ((2 * width + h) if text_type == "llama" and cfg.get("mlp_bias") else 0)
        else:
            moe = True
            parts["experts"] += block.experts * block.per_expert
            parts["router"] += block.router
            parts["shared_experts"] += block.shared
            inactive += (block.experts - min(block.top_k, block.experts)) * block.per_expert
    parts["norms"] += h  # final norm
    vision = hf.get("vision_config")
    if isinstance(vision, dict):
        if outer in _VISION_COUNTED:
            parts["vision"] = _siglip_vision(vision, h) if outer == "gemma3" else _qwen_vl_vision(vision, outer)
        else:
            exact = False
            notes.append(f"the vision tower of {outer!r} is not counted: the total covers the language model only")
    if text_type == "deepseek_v3" and cfg.get("num_nextn_predict_layers"):
        notes.append("the multi-token-prediction layer(s) in the checkpoint are not counted (transformers skips them)")
    if not exact and text_type not in EXACT_TEXT_TYPES:
        notes.append(f"model_type {text_type!r} is not one the counter mirrors: a Llama-shaped estimate")
    total = sum(parts.values())
    return ParameterCount(total=total, active=total - inactive, parts=parts, exact=exact, moe=moe, notes=notes)


# ---------------------------------------------------------------- shipped tables


@functools.lru_cache(maxsize=1)
def load_vllm_table() -> dict[str, Any]:
    """The shipped architecture table: used when vllm itself is not importable."""
    text = resources.files(_DATA).joinpath("vllm_architectures.json").read_text(encoding="utf-8")
    return json.loads(text)


@dataclass
class VllmSupport:
    """Whether vLLM serves an architecture: True / False / None (unknown), from where, since which version."""

    supported: bool | None
    min_version: str | None
    source: str
    detail: str | None = None
    installed_version: str | None = None


def _installed_vllm_archs() -> tuple[str, set[str]] | None:
    """vLLM's own list of architectures, when vllm is importable; None otherwise (or when asking fails)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        # vLLM logs to stdout as it imports: keep `verify-model --json` output parseable
        with contextlib.redirect_stdout(sys.stderr):
            import vllm

            try:
                from vllm.model_executor.models import ModelRegistry
            except ImportError:
                from vllm import ModelRegistry  # type: ignore[no-redef]
            return str(getattr(vllm, "__version__", "?")), set(ModelRegistry.get_supported_archs())
    except Exception:  # a broken install, CUDA init at import, a moved API: fall back to the table
        return None


def vllm_support(architecture: str | None, *, installed: tuple[str, set[str]] | None = None) -> VllmSupport:
    """Does vLLM serve `architecture`? The installed vllm decides when there is one, else the shipped table."""
    table = load_vllm_table()
    entry = (table.get("architectures") or {}).get(architecture or "")
    removed = (table.get("removed") or {}).get(architecture or "")
    since = entry.get("since") if entry else None
    if installed is not None:
        version, archs = installed
        source = f"vllm {version} (installed)"
        if architecture in archs:
            return VllmSupport(True, since, source, installed_version=version)
        detail = f"{architecture} is not among the architectures vllm {version} registers"
        if removed:
            detail += f"; vLLM served it until {removed['last_version']}"
        return VllmSupport(False, since, source, detail, installed_version=version)
    source = f"shipped table (checked {table.get('checked')})"
    if entry:
        detail = None if entry.get("confirmed") else "first version recalled, not confirmed against a source"
        return VllmSupport(True, since, source, detail)
    if removed:
        return VllmSupport(
            False,
            removed.get("since"),
            source,
            f"vLLM served {architecture} until {removed['last_version']} and removed it; pin vllm<="
            f"{removed['last_version']} or pick another model",
        )
    return VllmSupport(
        None,
        None,
        source,
        f"{architecture or 'no architecture'} is not in the shipped table: vLLM may still serve it (natively if "
        "newer than the table, or through its Transformers backend); install vllm to ask its own registry",
    )


# ---------------------------------------------------------------- multimodal


# Vision-language checkpoints and the text-only model built on the same language stack.
_TEXT_SIBLINGS = {
    "qwen2.5-vl-3b-instruct": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5-vl-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5-vl-32b-instruct": "Qwen/Qwen2.5-32B-Instruct",
    "qwen2.5-vl-72b-instruct": "Qwen/Qwen2.5-72B-Instruct",
    "qwen2-vl-2b-instruct": "Qwen/Qwen2-1.5B-Instruct",
    "qwen2-vl-7b-instruct": "Qwen/Qwen2-7B-Instruct",
    "qwen2-vl-72b-instruct": "Qwen/Qwen2-72B-Instruct",
    "qwen3-vl-4b-instruct": "Qwen/Qwen3-4B-Instruct-2507",
    "qwen3-vl-4b-thinking": "Qwen/Qwen3-4B-Thinking-2507",
    "qwen3-vl-8b-instruct": "Qwen/Qwen3-8B",
    "qwen3-vl-8b-thinking": "Qwen/Qwen3-8B",
    "qwen3-vl-30b-a3b-instruct": "Qwen/Qwen3-30B-A3B-Instruct-2507",
    "qwen3-vl-30b-a3b-thinking": "Qwen/Qwen3-30B-A3B-Thinking-2507",
    "qwen3-vl-235b-a22b-instruct": "Qwen/Qwen3-235B-A22B-Instruct-2507",
    "qwen3-vl-235b-a22b-thinking": "Qwen/Qwen3-235B-A22B-Thinking-2507",
    "llama-3.2-11b-vision-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.2-11b-vision": "meta-llama/Llama-3.1-8B",
    "llama-3.2-90b-vision-instruct": "meta-llama/Llama-3.1-70B-Instruct",
    "llama-3.2-90b-vision": "meta-llama/Llama-3.1-70B",
    "llava-1.5-7b-hf": "lmsys/vicuna-7b-v1.5",
    "llava-1.5-13b-hf": "lmsys/vicuna-13b-v1.5",
    "mistral-small-3.1-24b-instruct-2503": "mistralai/Mistral-Small-24B-Instruct-2501",
    "phi-3-vision-128k-instruct": "microsoft/Phi-3-mini-128k-instruct",
}
# Families with no text-only checkpoint of the same size: what to do instead.
_NO_SIBLING_ADVICE = {
    "gemma3": (
        "Gemma 3 at 4B and above ships only as a vision-language checkpoint; google/gemma-3-1b-it is the text-only "
        "one, or accept the vision tower's memory and serve it with images disabled"
    ),
}


def is_multimodal(hf: dict[str, Any], architecture: str | None) -> bool:
    """A vision/audio-language checkpoint: an encoder config in config.json, or the table says so."""
    if any(isinstance(hf.get(key), dict) for key in ("vision_config", "audio_config", "vision_tower_config")):
        return True
    table = load_vllm_table()
    entry = (table.get("architectures") or {}).get(architecture or "") or (table.get("removed") or {}).get(
        architecture or ""
    )
    return bool(entry and entry.get("multimodal"))


def text_only_sibling(model_id: str | None) -> str | None:
    """The text-only model on the same language stack as the vision-language `model_id`, when one is known."""
    if not model_id:
        return None
    return _TEXT_SIBLINGS.get(model_id.rstrip("/").rsplit("/", 1)[-1].lower())


# ---------------------------------------------------------------- tool calling


_TOOLS_IN_TEMPLATE = re.compile(r"\btools\b")


def template_mentions_tools(template: str | None) -> bool | None:
    """Does the chat template render a `tools` list? None when there is no template to read."""
    if template is None:
        return None
    return bool(_TOOLS_IN_TEMPLATE.search(template))


def suggest_tool_parser(hf: dict[str, Any], model_id: str | None) -> tuple[str | None, str | None]:
    """The vLLM --tool-call-parser for this family, and a note when the choice has a condition."""
    cfg, text_type, outer = _split_config(hf)
    name = (model_id or "").lower()
    family = text_type.removesuffix("_text")
    if family.startswith(("qwen2", "qwen3")):
        if "coder" in name and family.startswith("qwen3"):
            return "qwen3_coder", None
        return "hermes", None
    if family == "llama":
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if (isinstance(rope, dict) and rope.get("rope_type") == "llama3") or cfg.get("vocab_size") == 128256:
            return "llama3_json", "vLLM's docs pair it with examples/tool_chat_template_llama3.1_json.jinja"
        return None, "Llama before 3.1 was not trained for tool calls"
    if family == "llama4" or outer == "llama4":
        return "llama4_pythonic", None
    if family in ("mistral", "mixtral") or outer in ("mistral3", "pixtral"):
        return "mistral", "meant for mistral_common tokenization (--tokenizer-mode mistral)"
    if family == "gpt_oss":
        return "openai", None
    if family in ("deepseek_v3", "deepseek_v32"):
        if "v3.1" in name:
            return "deepseek_v31", None
        return "deepseek_v3", None
    if family == "phi3" and "phi-4-mini" in name:
        return "phi4_mini_json", None
    if family.startswith("granite"):
        return "granite", None
    if family == "internlm2":
        return "internlm", None
    if family.startswith("gemma"):
        return None, "vLLM has no parser dedicated to Gemma 2/3; tool calls need a custom template"
    return None, None


# ---------------------------------------------------------------- reading the files


@dataclass
class ModelFiles:
    """config.json and the tokenizer's chat template of a model, and where they came from."""

    config: dict[str, Any]
    tokenizer_config: dict[str, Any] | None
    chat_template: str | None
    source: str
    model_id: str


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1/true/yes/on), but now rather than at its import."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hf_cache_dir() -> Path:
    """The hub cache as the environment says now (huggingface_hub reads HF_HOME once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(os.path.expanduser(home)) / "hub"


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelConfigNotFound(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ModelConfigNotFound(f"{what} {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigNotFound(f"{what} {path} does not hold a JSON object")
    return data


def _template_text(tokenizer_config: dict[str, Any] | None, extra: list[str]) -> str | None:
    """Every chat template of the model as one text: tokenizer_config's (a string or named list) and files."""
    pieces: list[str] = []
    template = (tokenizer_config or {}).get("chat_template")
    if isinstance(template, str):
        pieces.append(template)
    elif isinstance(template, list):
        pieces.extend(str(t.get("template", "")) for t in template if isinstance(t, dict))
    pieces.extend(extra)
    return "\n".join(pieces) if pieces else None


def _extra_templates(read: Any) -> list[str]:
    """chat_template.jinja / chat_template.json next to the tokenizer (newer checkpoints keep it there)."""
    found: list[str] = []
    jinja = read("chat_template.jinja")
    if jinja is not None:
        found.append(jinja)
    raw = read("chat_template.json")
    if raw is not None:
        try:
            data = json.loads(raw)
            if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
                found.append(data["chat_template"])
        except ValueError:
            pass
    return found


def _from_directory(directory: Path) -> ModelFiles:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelConfigNotFound(f"{directory} has no config.json: point at the model directory (the one with it)")
    config = _read_json(config_path, "config")
    tok_path = directory / "tokenizer_config.json"
    tokenizer_config = _read_json(tok_path, "tokenizer config") if tok_path.is_file() else None

    def read(name: str) -> str | None:
        path = directory / name
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None

    template = _template_text(tokenizer_config, _extra_templates(read))
    return ModelFiles(config, tokenizer_config, template, f"local directory {directory}", directory.name)


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _from_hub(repo_id: str, offline: bool) -> ModelFiles:
    try:
        import huggingface_hub
    except ImportError:
        raise ModelConfigNotFound(
            f"{repo_id!r} is not a local directory and huggingface_hub is not installed to look it up: pass the path "
            "of a model directory (one with config.json), or `pip install huggingface_hub`"
        ) from None
    cache = _hf_cache_dir()

    def cached(name: str) -> str | None:
        try:
            found = huggingface_hub.try_to_load_from_cache(repo_id, name, cache_dir=str(cache))
        except Exception:
            return None
        return found if isinstance(found, str) else None

    config_path = cached("config.json")
    if config_path is not None:
        source = f"Hugging Face cache {cache}"

        def read(name: str) -> str | None:
            path = cached(name)
            return Path(path).read_text(encoding="utf-8", errors="replace") if path else None

    elif offline:
        raise ModelConfigNotFound(
            f"{repo_id} is not in the local Hugging Face cache ({cache}) and the hub is offline (HF_HUB_OFFLINE is "
            "set): pass a local path to the model directory (the one with config.json), or fetch it once with "
            "network access"
        )
    else:
        config_path = _hub_download(huggingface_hub, repo_id, "config.json", required=True)
        source = "Hugging Face hub"

        def read(name: str) -> str | None:
            path = _hub_download(huggingface_hub, repo_id, name, required=False)
            return Path(path).read_text(encoding="utf-8", errors="replace") if path else None

    assert config_path is not None
    config = _read_json(Path(config_path), "config")
    tok_raw = read("tokenizer_config.json")
    tokenizer_config: dict[str, Any] | None = None
    if tok_raw is not None:
        try:
            loaded = json.loads(tok_raw)
            tokenizer_config = loaded if isinstance(loaded, dict) else None
        except ValueError:
            tokenizer_config = None
    extra = [] if (tokenizer_config or {}).get("chat_template") else _extra_templates(read)
    return ModelFiles(config, tokenizer_config, _template_text(tokenizer_config, extra), source, repo_id)


def _hub_download(hub: Any, repo_id: str, filename: str, *, required: bool) -> str | None:
    """One file from the hub with a short timeout; a missing optional file is None, never an error."""
    from huggingface_hub import errors

    try:
        return hub.hf_hub_download(repo_id, filename, etag_timeout=HUB_TIMEOUT_S)
    except errors.GatedRepoError:
        if not required:
            return None
        raise ModelConfigNotFound(
            f"{repo_id} is a gated repository: accept its license on huggingface.co and provide a token (HF_TOKEN), "
            "or pass a local path to a downloaded copy"
        ) from None
    except errors.RepositoryNotFoundError:
        if not required:
            return None
        raise ModelConfigNotFound(
            f"{repo_id} was not found on the Hugging Face hub (a typo, or a private repository without a token): "
            "check the id, or pass a local path to the model directory"
        ) from None
    except (errors.EntryNotFoundError, errors.RevisionNotFoundError):
        if not required:
            return None
        raise ModelConfigNotFound(f"{repo_id} has no {filename} on the hub: is it a transformers model?") from None
    except Exception as exc:  # network down, timeouts, offline mode forced by the library
        if not required:
            return None
        raise ModelConfigNotFound(
            f"could not fetch {filename} of {repo_id} from the hub ({type(exc).__name__}); pass a local path to the "
            "model directory, or set HF_HUB_OFFLINE=1 to use only the local cache"
        ) from None


def find_model_files(name_or_path: str, *, offline: bool | None = None) -> ModelFiles:
    """config.json and tokenizer files of a local directory, a cached hub model, or (online) the hub."""
    if offline is None:
        offline = hub_offline()
    name = name_or_path.strip()
    if not name:
        raise ModelConfigNotFound("no model given: pass a hub id (Qwen/Qwen2.5-0.5B-Instruct) or a local directory")
    path = Path(os.path.expanduser(name))
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir():
        return _from_directory(path)
    if path.exists():
        raise ModelConfigNotFound(f"{name} is a file, not a model directory with config.json")
    if _looks_like_path(name) or not _REPO_ID.match(name):
        raise ModelConfigNotFound(f"no directory {name}, and it is not a hub id (owner/name): check the path")
    return _from_hub(name, offline)


# ---------------------------------------------------------------- the report


@dataclass
class ModelReport:
    """What verify-model found: the facts, then problems (not usable for the job) and warnings (look first)."""

    name: str
    job: str
    source: str
    model_id: str
    architecture: str | None
    model_type: str | None
    num_parameters: int
    active_parameters: int | None
    parameter_count_exact: bool
    parameter_parts: dict[str, int]
    vllm_supported: bool | None
    vllm_min_version: str | None
    vllm_source: str
    multimodal: bool
    text_only_sibling: str | None
    chat_template_tools: bool | None
    tool_call_parser: str | None
    max_model_len: int | None
    rope_scaling: dict[str, Any] | None
    dtype: str | None
    serve_dtype: str
    serve_memory_bytes: int
    train_memory_bytes: int
    known_issues: list[dict[str, Any]]
    tested: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Usable for the job: no problem found (warnings do not count)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """The `--json` object: stable keys, JSON-native values."""
        data = asdict(self)
        tool_note = None
        for note in self.notes:
            if note.startswith("tool calling:"):
                tool_note = note.removeprefix("tool calling:").strip()
        data["tool_calling"] = {
            "chat_template_tools": data.pop("chat_template_tools"),
            "parser": data.pop("tool_call_parser"),
            "note": tool_note,
        }
        data["memory_assumptions"] = {"serve": SERVE_MEMORY_ASSUMPTION, "train": TRAIN_MEMORY_ASSUMPTION}
        data["ok"] = self.ok
        return data


def _dtype_of(hf: dict[str, Any], text: dict[str, Any]) -> str | None:
    for source in (hf, text):
        for key in ("dtype", "torch_dtype"):
            value = source.get(key)
            if isinstance(value, str):
                return value.removeprefix("torch.")
    return None


def serve_memory(count: ParameterCount, hf: dict[str, Any], dtype: str | None) -> tuple[int, str, list[str]]:
    """Bytes of weights vLLM loads, the dtype it serves in, and how the figure was made."""
    notes: list[str] = []
    serve_dtype = dtype or "bfloat16"
    if dtype is None:
        notes.append("config.json names no dtype: bfloat16 assumed")
    if serve_dtype in ("float32", "float"):
        serve_dtype = "bfloat16"  # vLLM's --dtype auto serves fp32 checkpoints in 16 bits
        notes.append("fp32 checkpoint: vLLM's --dtype auto serves it in 16 bits")
    base = DTYPE_BYTES.get(serve_dtype, 2)
    parts = count.parts
    quant = hf.get("quantization_config") if isinstance(hf.get("quantization_config"), dict) else None
    method = str((quant or {}).get("quant_method") or "").lower()
    if not method:
        return count.total * base, serve_dtype, notes
    if method == "mxfp4":
        experts = parts["experts"]
        total = experts * MXFP4_BYTES_PER_PARAM + (count.total - experts) * base
        notes.append("MXFP4 experts (4.25 bits per weight), the rest in 16 bits")
        return int(total), f"mxfp4 experts + {serve_dtype}", notes
    linear = parts["attention"] + parts["mlp"] + parts["experts"] + parts["shared_experts"]
    bits = 8 if method in ("fp8", "fbgemm_fp8") else int((quant or {}).get("bits") or 4)
    notes.append(f"{method} quantized: linear layers at {bits} bits, the rest in 16 bits (scales not counted)")
    return int(linear * bits / 8 + (count.total - linear) * base), f"{method} + {serve_dtype}", notes


def verify_model(name_or_path: str, *, job: str = "rl", offline: bool | None = None) -> ModelReport:
    """Read a model's config and answer: can this job use it, and what will it cost in memory?

    Raises ModelConfigNotFound when config.json cannot be read (CLI exit 2). Never downloads weights.
    """
    from prime_train.validator.registry import lookup

    if job not in JOBS:
        raise ValueError(f"job must be one of {', '.join(JOBS)}, not {job!r}")
    files = find_model_files(name_or_path, offline=offline)
    hf = files.config
    architectures = hf.get("architectures") or []
    architecture = str(architectures[0]) if architectures else None
    model_type = hf.get("model_type")
    problems: list[str] = []
    warnings: list[str] = []
    notes: list[str] = []

    try:
        count = count_model_parameters(hf)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelConfigNotFound(
            f"config.json of {files.model_id} lacks what a parameter count needs ({type(exc).__name__}: {exc}); is it "
            "a transformers decoder?"
        ) from None
    notes.extend(count.notes)
    if not count.exact:
        warnings.append("parameter count is an estimate: " + "; ".join(count.notes or ["family not mirrored"]))

    text = text_config(hf)
    dtype = _dtype_of(hf, text)
    serve_bytes, serve_dtype, serve_notes = serve_memory(count, hf, dtype)
    notes.extend(serve_notes)

    support = vllm_support(architecture, installed=_installed_vllm_archs())
    if support.detail and support.supported is not False:
        notes.append(f"vLLM: {support.detail}")
    if job == "rl":
        if support.supported is False:
            problems.append(
                f"vLLM does not serve {architecture} ({support.source}): {support.detail}; RL rollouts need a model "
                "vLLM can serve"
            )
        elif support.supported is None:
            warnings.append(f"vLLM support unknown: {support.detail}")
    elif support.supported is False:
        notes.append(f"vLLM does not serve {architecture}: fine for {job}, but it cannot be an RL policy")

    multimodal = is_multimodal(hf, architecture)
    sibling = text_only_sibling(files.model_id) if multimodal else None
    if multimodal:
        if sibling:
            instead = f"use the text-only {sibling} (same language model)"
        else:
            instead = _NO_SIBLING_ADVICE.get(str(model_type), "use a text-only (…ForCausalLM) model of the family")
        problems.append(
            f"{architecture} is a vision-language model, the wrong class for a text {job} job: {instead}; the vision "
            "tower costs memory and the training engine loads causal LMs"
        )

    template_tools = template_mentions_tools(files.chat_template)
    parser, parser_note = suggest_tool_parser(hf, files.model_id)
    if parser_note:
        notes.append(f"tool calling: {parser_note}")
    if files.tokenizer_config is None:
        warnings.append("no tokenizer_config.json found: the chat template could not be checked")
    elif job == "rl":
        if files.chat_template is None:
            warnings.append("the tokenizer has no chat template: chat environments cannot format prompts")
        elif not template_tools:
            warnings.append(
                "the chat template does not render `tools`: tool-calling environments will not work without a "
                "custom template"
            )
        elif parser is None:
            warnings.append("the template renders tools but no vLLM --tool-call-parser is known for this family")

    rope = text.get("rope_scaling") or text.get("rope_parameters")
    rope = rope if isinstance(rope, dict) and rope else None
    max_len = text.get("max_position_embeddings")
    max_len = int(max_len) if isinstance(max_len, int | float) and not isinstance(max_len, bool) else None
    if rope and str(rope.get("rope_type") or rope.get("type")) == "yarn" and rope.get("factor"):
        base = rope.get("original_max_position_embeddings") or max_len
        if base:
            notes.append(f"YaRN rope scaling: {int(base)} × {rope['factor']} = {int(base * rope['factor'])} positions")

    tested = lookup(files.model_id)
    known = list((tested or {}).get("known_issues") or [])
    if tested and tested.get("vllm_version"):
        notes.append(
            f"registry: needs vLLM {tested['vllm_version']}, transformers {tested.get('transformers_version')}"
        )
    if support.installed_version and support.min_version and _older(support.installed_version, support.min_version):
        warnings.append(f"installed vllm {support.installed_version} is older than {support.min_version}")

    return ModelReport(
        name=name_or_path,
        job=job,
        source=files.source,
        model_id=files.model_id,
        architecture=architecture,
        model_type=str(model_type) if model_type is not None else None,
        num_parameters=count.total,
        active_parameters=count.active if count.moe else None,
        parameter_count_exact=count.exact,
        parameter_parts={k: v for k, v in count.parts.items() if v},
        vllm_supported=support.supported,
        vllm_min_version=support.min_version,
        vllm_source=support.source,
        multimodal=multimodal,
        text_only_sibling=sibling,
        chat_template_tools=template_tools,
        tool_call_parser=parser,
        max_model_len=max_len,
        rope_scaling=rope,
        dtype=dtype,
        serve_dtype=serve_dtype,
        serve_memory_bytes=serve_bytes,
        train_memory_bytes=count.total * TRAIN_BYTES_PER_PARAM,
        known_issues=known,
        tested=tested,
        problems=problems,
        warnings=warnings,
        notes=notes,
    )


def _older(version: str, minimum: str) -> bool:
    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:3])

    return parts(version) < parts(minimum)


# ---------------------------------------------------------------- output


def human_count(n: int | None) -> str:
    """7615616512 -> '7.62 B (7,615,616,512)'."""
    if n is None:
        return "-"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,})"
    return f"{n:,}"


def human_bytes(n: float) -> str:
    """Binary units, as GPU memory is sold and reported (nvidia-smi, torch)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def render_report(report: ModelReport, console: Any) -> None:
    """A table of the facts, then problems, warnings and known issues, for a person deciding on a model."""
    from rich.table import Table

    def yes_no(value: bool | None, unknown: str = "unknown") -> str:
        return unknown if value is None else ("yes" if value else "no")

    table = Table(title=f"{report.model_id} for {report.job}", show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("source", report.source)
    table.add_row("architecture", f"{report.architecture or '-'} ({report.model_type or '-'})")
    table.add_row("parameters", human_count(report.num_parameters) + ("" if report.parameter_count_exact else " ~est."))
    if report.active_parameters is not None:
        table.add_row("active per token", human_count(report.active_parameters))
    vllm = yes_no(report.vllm_supported)
    if report.vllm_min_version:
        vllm += f" (since {report.vllm_min_version})"
    table.add_row("vLLM serves it", f"{vllm}  [{report.vllm_source}]")
    multimodal = yes_no(report.multimodal)
    if report.text_only_sibling:
        multimodal += f" → text-only: {report.text_only_sibling}"
    table.add_row("vision-language", multimodal)
    table.add_row("chat template has tools", yes_no(report.chat_template_tools, "no template"))
    table.add_row("--tool-call-parser", report.tool_call_parser or "-")
    context = str(report.max_model_len or "-")
    if report.rope_scaling:
        kind = report.rope_scaling.get("rope_type") or report.rope_scaling.get("type")
        context += f" (rope scaling: {kind}, factor {report.rope_scaling.get('factor', '-')})"
    table.add_row("context (max_position_embeddings)", context)
    table.add_row("dtype", f"{report.dtype or 'not set'} (served as {report.serve_dtype})")
    table.add_row("memory to serve", f"{human_bytes(report.serve_memory_bytes)} (weights only)")
    table.add_row("memory to train", f"{human_bytes(report.train_memory_bytes)} (16 B/param, full AdamW)")
    tested = report.tested
    table.add_row("registry", f"{tested['model_id']} (checked {tested.get('tested_on')})" if tested else "not listed")
    console.print(table)
    for note in report.notes:
        console.print(f"[dim]note: {note}[/dim]")
    for issue in report.known_issues:
        source = f" ({issue['source']})" if issue.get("source") else ""
        console.print(f"[cyan]known issue:[/cyan] {issue.get('issue')}{source}")
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {warning}")
    for problem in report.problems:
        console.print(f"[red]problem:[/red] {problem}")
    verdict = "[green]usable[/green]" if report.ok else "[red]not usable[/red]"
    console.print(f"{report.model_id}: {verdict} for {report.job}")
