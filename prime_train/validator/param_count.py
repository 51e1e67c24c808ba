"""Parameters of a model counted from its config.json, family by family, without building it.

Exact for the families whose module layout it mirrors (the same shapes transformers builds, checked
against meta-device models in tests/test_verify_model.py); any other architecture gets a Llama-shaped
estimate, flagged as such. Preflight's disk and memory estimates, the memory and cost calculators and
`prime-train verify-model` all count with this one counter, so they never disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from prime_train.config.methods import target_names

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


# No model comes near these (Llama-3.1-405B: 126 layers, hidden 16384; DeepSeek-V3: 256 experts); a config.json
# past them is broken or hostile, and would make the estimates meaningless.
MAX_LAYERS = 100_000
MAX_DIMENSION = 1 << 24


def _num(cfg: dict[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{key} = {value!r} is not a number")
    if not (isinstance(value, int) or math.isfinite(value)) or not 0 <= value <= MAX_DIMENSION * MAX_DIMENSION:
        raise TypeError(f"{key} = {value!r} is not a size a model has")
    return int(value)


def _layers(cfg: dict[str, Any]) -> int:
    layers = _num(cfg, "num_hidden_layers")
    if layers > MAX_LAYERS:
        raise TypeError(f"num_hidden_layers = {layers} is not a layer count a model has (at most {MAX_LAYERS:,})")
    return layers


# Fields a family's config.json may hold under another name: transformers 5 saves Qwen3-MoE's expert count as
# num_local_experts (its attribute_map's target), where the hub's files and the counter say num_experts
_SAVED_AS = {"qwen3_moe": {"num_experts": "num_local_experts"}}


def _aliased(fields: dict[str, Any], text_type: str) -> dict[str, Any]:
    renamed = {ours: fields[saved] for ours, saved in _SAVED_AS.get(text_type, {}).items()
               if ours not in fields and saved in fields}  # fmt: skip
    return {**fields, **renamed} if renamed else fields


def split_config(hf: dict[str, Any]) -> tuple[dict[str, Any], str, str]:
    """The language model's fields (with transformers' defaults filled in), its model_type, and the outer one."""
    if not isinstance(hf, dict):
        raise TypeError("config.json does not hold a JSON object")
    outer = str(hf.get("model_type") or "llama")
    nested = hf.get("text_config")
    if isinstance(nested, dict):
        text_type = str(nested.get("model_type") or _TEXT_TYPE_OF.get(outer, outer))
        text = {**_DEFAULTS.get(text_type, {}), **_aliased(nested, text_type)}
        if "tie_word_embeddings" in hf:  # the outer model owns the lm_head
            text["tie_word_embeddings"] = hf["tie_word_embeddings"]
        elif outer == "gemma3":
            text.setdefault("tie_word_embeddings", True)
    else:
        text_type = _TEXT_TYPE_OF.get(outer, outer)
        text = {**_DEFAULTS.get(text_type, {}), **_aliased(hf, text_type)}
    return text, text_type, outer


def text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's config fields, defaults filled in (for callers that need layers, heads, context)."""
    return split_config(hf)[0]


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
    width: int = 0  # one expert's intermediate size


def _is_routed(cfg: dict[str, Any], text_type: str) -> bool:
    return text_type in ("mixtral", "gpt_oss") or (
        text_type not in EXACT_TEXT_TYPES and bool(cfg.get("num_local_experts"))
    )


def _moe_layer_count(cfg: dict[str, Any], text_type: str, layers: int) -> int:
    """How many of the `layers` decoder layers have routed experts instead of a dense MLP (by formula: a hostile
    config.json can claim any number of layers, and counting them one by one would never end)."""
    if _is_routed(cfg, text_type):
        return layers
    if text_type in ("qwen2_moe", "qwen3_moe"):
        if not _num(cfg, "num_experts", 0):
            return 0
        step = _num(cfg, "decoder_sparse_step", 1)
        if step < 1:
            raise TypeError(f"decoder_sparse_step = {step} is not a layer interval (at least 1)")
        dense = cfg.get("mlp_only_layers") or []
        dense = {x for x in dense if isinstance(x, int) and 0 <= x < layers} if isinstance(dense, list) else set()
        # every step-th layer is sparse (layer + 1 a multiple of step), unless listed as dense
        return layers // step - sum(1 for x in dense if (x + 1) % step == 0)
    if text_type == "deepseek_v3":
        return max(0, layers - _num(cfg, "first_k_dense_replace", 0))
    return 0


def _moe_block(cfg: dict[str, Any], text_type: str, h: int) -> _MoE:
    """The routed-expert block every sparse layer of this family has."""
    if _is_routed(cfg, text_type):
        experts = _num(cfg, "num_local_experts")
        width = _num(cfg, "intermediate_size")
        top_k = _num(cfg, "num_experts_per_tok", _num(cfg, "experts_per_token", 2))
        if text_type == "gpt_oss":  # experts and router carry biases
            return _MoE(experts, top_k, 3 * h * width + 2 * width + h, experts * h + experts, 0, width)
        return _MoE(experts, top_k, 3 * h * width, experts * h, 0, width)
    if text_type in ("qwen2_moe", "qwen3_moe"):
        experts = _num(cfg, "num_experts", 0)
        width = _num(cfg, "moe_intermediate_size")
        shared = 0
        if text_type == "qwen2_moe":
            shared = 3 * h * _num(cfg, "shared_expert_intermediate_size") + h  # shared expert and its gate
        return _MoE(experts, _num(cfg, "num_experts_per_tok"), 3 * h * width, experts * h, shared, width)
    experts, width = _num(cfg, "n_routed_experts"), _num(cfg, "moe_intermediate_size")  # deepseek_v3
    shared = 3 * h * width * _num(cfg, "n_shared_experts", 0)
    return _MoE(experts, _num(cfg, "num_experts_per_tok"), 3 * h * width, experts * h, shared, width)


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
    cfg, text_type, outer = split_config(hf)
    exact = text_type in EXACT_TEXT_TYPES
    notes: list[str] = []
    h, layers = _num(cfg, "hidden_size"), _layers(cfg)
    vocab = _num(cfg, "vocab_size")
    parts = dict.fromkeys(
        ("embedding", "lm_head", "attention", "mlp", "experts", "router", "shared_experts", "norms", "vision"), 0
    )
    parts["embedding"] = vocab * h
    if not cfg.get("tie_word_embeddings", False):
        parts["lm_head"] = vocab * h
    attention = _attention(cfg, text_type, h)
    norms_per_layer = (4 if text_type in _FOUR_NORM_TYPES else 2) * h
    parts["attention"] = layers * attention
    parts["norms"] = layers * norms_per_layer
    sparse = _moe_layer_count(cfg, text_type, layers)
    if layers - sparse:
        width = _num(cfg, "intermediate_size")
        mlp = 3 * h * width + ((2 * width + h) if text_type == "llama" and cfg.get("mlp_bias") else 0)
        parts["mlp"] = (layers - sparse) * mlp
    inactive = 0
    moe = sparse > 0
    if moe:
        block = _moe_block(cfg, text_type, h)
        parts["experts"] = sparse * block.experts * block.per_expert
        parts["router"] = sparse * block.router
        parts["shared_experts"] = sparse * block.shared
        inactive = sparse * (block.experts - min(block.top_k, block.experts)) * block.per_expert
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


def count_parameters(hf: dict[str, Any]) -> int:
    """Total parameters of the model an HF config dict describes (see `count_model_parameters`)."""
    return count_model_parameters(hf).total


# ---------------------------------------------------------------- LoRA adapters

# What lora.target_modules = "all-linear" means (config/schema.py LORA_ALL_LINEAR): every linear layer of the blocks.
ALL_LINEAR = "all-linear"
# Vision-language outer types: the engine's decoder blocks there are not (only) the language model's.
_VL_TYPES = frozenset(_VISION_COUNTED | {"qwen2_vl", "qwen2_5_vl"})


@dataclass(frozen=True)
class Linear:
    """One linear layer of a decoder block: its name inside the block, its sizes, and in how many blocks it is; or
    one fused expert tensor (`experts` > 1: one in x out weight an expert, all in one tensor)."""

    name: str
    fan_in: int
    fan_out: int
    blocks: int
    experts: int = 1

    @property
    def params(self) -> int:
        return self.fan_in * self.fan_out * self.blocks * self.experts


def _mlp_linears(prefix: str, h: int, width: int, blocks: int) -> list[Linear]:
    return [
        Linear(f"{prefix}.gate_proj", h, width, blocks),
        Linear(f"{prefix}.up_proj", h, width, blocks),
        Linear(f"{prefix}.down_proj", width, h, blocks),
    ]


def _attention_linears(cfg: dict[str, Any], text_type: str, h: int, layers: int) -> list[Linear]:
    heads = _num(cfg, "num_attention_heads")
    if text_type == "deepseek_v3":  # multi-head latent attention
        rope, nope, v = _num(cfg, "qk_rope_head_dim"), _num(cfg, "qk_nope_head_dim"), _num(cfg, "v_head_dim")
        kv_rank, q_rank = _num(cfg, "kv_lora_rank"), cfg.get("q_lora_rank")
        q = [Linear("self_attn.q_proj", h, heads * (nope + rope), layers)]
        if q_rank:
            q_rank = _num(cfg, "q_lora_rank")
            q = [Linear("self_attn.q_a_proj", h, q_rank, layers),
                 Linear("self_attn.q_b_proj", q_rank, heads * (nope + rope), layers)]  # fmt: skip
        return [
            *q,
            Linear("self_attn.kv_a_proj_with_mqa", h, kv_rank + rope, layers),
            Linear("self_attn.kv_b_proj", kv_rank, heads * (nope + v), layers),
            Linear("self_attn.o_proj", heads * v, h, layers),
        ]
    head_dim = _num(cfg, "head_dim", h // heads)
    q, kv = heads * head_dim, _num(cfg, "num_key_value_heads", heads) * head_dim
    if text_type == "phi3":  # fused q/k/v
        return [Linear("self_attn.qkv_proj", h, q + 2 * kv, layers), Linear("self_attn.o_proj", q, h, layers)]
    return [
        Linear("self_attn.q_proj", h, q, layers),
        Linear("self_attn.k_proj", h, kv, layers),
        Linear("self_attn.v_proj", h, kv, layers),
        Linear("self_attn.o_proj", q, h, layers),
    ]


def decoder_linears(hf: dict[str, Any]) -> list[Linear]:
    """The nn.Linear layers inside the decoder blocks of the model `hf` describes, as transformers 5 builds them:
    what LoRA's "all-linear" adapts and NF4 quantizes. Routed experts (fused tensors) and routers are not nn.Linear
    there, so mixture-of-experts blocks contribute their attention, shared experts and dense layers only."""
    cfg, text_type, _ = split_config(hf)
    h, layers = _num(cfg, "hidden_size"), _layers(cfg)
    out = _attention_linears(cfg, text_type, h, layers)
    sparse = _moe_layer_count(cfg, text_type, layers)
    if layers - sparse:
        if text_type == "phi3":  # fused gate/up
            width = _num(cfg, "intermediate_size")
            out += [Linear("mlp.gate_up_proj", h, 2 * width, layers), Linear("mlp.down_proj", width, h, layers)]
        else:
            out += _mlp_linears("mlp", h, _num(cfg, "intermediate_size"), layers - sparse)
    if sparse and text_type == "qwen2_moe":
        out += _mlp_linears("mlp.shared_expert", h, _num(cfg, "shared_expert_intermediate_size"), sparse)
        out.append(Linear("mlp.shared_expert_gate", h, 1, sparse))
    elif sparse and text_type == "deepseek_v3" and _num(cfg, "n_shared_experts", 0):
        width = _num(cfg, "moe_intermediate_size") * _num(cfg, "n_shared_experts")
        out += _mlp_linears("mlp.shared_experts", h, width, sparse)
    return out


def decoder_expert_tensors(hf: dict[str, Any]) -> list[Linear]:
    """The routed experts' fused tensors of the decoder blocks as transformers 5 builds them (Mixtral, Qwen2-MoE,
    Qwen3-MoE, GPT-OSS, DeepSeek-V3: `mlp.experts.gate_up_proj`, hidden -> 2 x width, and `mlp.experts.down_proj`,
    width -> hidden, one 3-D tensor each holding every expert): what lora.target_parameters may adapt. Empty for
    a dense model and for families the counter does not mirror."""
    cfg, text_type, _ = split_config(hf)
    if text_type not in EXACT_TEXT_TYPES:
        return []
    h, layers = _num(cfg, "hidden_size"), _layers(cfg)
    sparse = _moe_layer_count(cfg, text_type, layers)
    if not sparse:
        return []
    block = _moe_block(cfg, text_type, h)
    return [
        Linear("mlp.experts.down_proj", block.width, h, sparse, block.experts),
        Linear("mlp.experts.gate_up_proj", h, 2 * block.width, sparse, block.experts),
    ]


@dataclass
class AdapterCount:
    """LoRA's adapters on a model: B (out × r) @ A (r × in) beside each targeted linear layer of every block."""

    rank: int
    trainable: int  # the adapters' parameters: rank × (in + out) summed over the adapted layers
    adapted: list[Linear]
    linear_params: int  # every linear weight of the decoder blocks (what lora.quantize = "nf4" holds in 4 bits)
    linear_names: list[str]  # the distinct names an entry of target_modules can end with
    unmatched: list[str]  # target_modules entries that name no linear layer
    exact: bool
    notes: list[str] = field(default_factory=list)
    # lora.target_parameters: the fused expert tensors adapted (each expert its own r x (in + out) pair, in trainable),
    # the names an entry can end with, and the entries that name none
    experts: list[Linear] = field(default_factory=list)
    expert_names: list[str] = field(default_factory=list)
    unmatched_experts: list[str] = field(default_factory=list)

    def expert_problem(self) -> str | None:
        """Why lora.target_parameters cannot be applied (entries naming no fused expert tensor of a model the counter
        mirrors: a dense model has none), as the engine says it at start-up; None when it can, or is not known."""
        if not self.unmatched_experts or not self.exact:
            return None
        shown = ", ".join(repr(t) for t in self.unmatched_experts)
        if not self.expert_names:
            return (
                f"lora.target_parameters: {shown}: the model has no fused expert tensors in its decoder blocks (it is "
                "not a mixture-of-experts model); leave lora.target_parameters empty and name linear layers in "
                "lora.target_modules"
            )
        return (
            f"lora.target_parameters: {shown} {'matches' if len(self.unmatched_experts) == 1 else 'match'} no fused "
            f"expert tensor in the decoder blocks of the model; its expert tensors are: {', '.join(self.expert_names)}"
        )

    @property
    def per_block(self) -> list[Linear]:
        """The adapted layers of one block (a block of the most common kind)."""
        most = max((lin.blocks for lin in self.adapted), default=0)
        return [lin for lin in self.adapted if lin.blocks == most]


def _named(entries: list[str], layers: list[Linear]) -> tuple[list[Linear], list[str]]:
    """The layers some entry names (config.methods.target_names, the engine's rule), and the entries that name
    none."""
    hit = [lin for lin in layers if any(target_names(e, lin.name) for e in entries)]
    return hit, [e for e in entries if not any(target_names(e, lin.name) for lin in layers)]


def count_adapters(
    hf: dict[str, Any], rank: int, targets: str | list[str] = ALL_LINEAR, parameters: list[str] | tuple[str, ...] = ()
) -> AdapterCount:
    """The adapters `lora.rank`, `lora.target_modules` and `lora.target_parameters` (`parameters`) put on the model
    `hf` describes (engine/lora.py's rule: an entry names the layers, or fused expert tensors, whose name is it or
    ends in '.<entry>'; 'all-linear' every linear layer of the blocks)."""
    _, text_type, outer = split_config(hf)
    linears = decoder_linears(hf)
    if targets == ALL_LINEAR:
        adapted, unmatched = linears, []
    else:
        adapted, unmatched = _named(list(targets), linears)
    notes = []
    exact = text_type in EXACT_TEXT_TYPES and outer not in _VL_TYPES
    if outer in _VL_TYPES:
        notes.append(f"{outer}: the language model's linear layers only (the vision tower's are not counted)")
    elif text_type not in EXACT_TEXT_TYPES:
        notes.append(f"model_type {text_type!r} is not one the counter mirrors: Llama-shaped linear layers assumed")
    tensors = decoder_expert_tensors(hf) if parameters else []
    experts, unmatched_experts = _named(list(parameters), tensors)
    return AdapterCount(
        rank=rank,
        trainable=sum(rank * (lin.fan_in + lin.fan_out) * lin.blocks * lin.experts for lin in adapted + experts),
        adapted=adapted,
        linear_params=sum(lin.params for lin in linears),
        linear_names=sorted({lin.name.rsplit(".", 1)[-1] for lin in linears}),
        unmatched=unmatched,
        exact=exact,
        notes=notes,
        experts=experts,
        expert_names=sorted({t.name.rsplit(".", 1)[-1] for t in tensors}),
        unmatched_experts=unmatched_experts,
    )
