"""The model: a transformers causal LM, loaded from a path or random-initialised, and what it costs per token."""

from __future__ import annotations

import inspect
import logging
import os
import re

import torch
from torch import nn

from prime_train.config.schema import Config, ModelConfig
from prime_train.engine.metrics import EngineConfigError
from prime_train.vocab import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID

logger = logging.getLogger("prime_train.engine")

# Dense (no sparsity) bf16 tensor-core TFLOP/s per device, from the vendors' datasheets.
PEAK_TFLOPS_BF16: dict[str, float] = {
    "H100 SXM": 989,
    "H100 PCIe": 756,
    "H200": 989,
    "A100": 312,
    "L40S": 362,
    "B200": 2250,
}

# torch.cuda.get_device_name() strings -> a key above. Word boundaries keep "GH200", "GB200", "A10" and
# "L40" from matching a different chip; H100 NVL and H200 NVL are slower parts and stay unknown.
_DEVICE_PATTERNS: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"\bH100\b.*\bPCIE\b"), "H100 PCIe"),
    (re.compile(r"\bH100\b.*\b(SXM|HBM3)"), "H100 SXM"),
    (re.compile(r"\bH200\b(?!.*\bNVL\b)"), "H200"),
    (re.compile(r"\bA100\b"), "A100"),
    (re.compile(r"\bL40S\b"), "L40S"),
    (re.compile(r"\bB200\b"), "B200"),
]


def build_model(
    cfg: ModelConfig, vocab_size: int, *, device: str | torch.device = "cpu", for_training: bool = False
) -> nn.Module:
    """The causal LM of `cfg` with fp32 weights on `device`: loaded from `cfg.path`, else random-initialised.

    for_training=True gives the model the training step runs: the native decoder (engine/llama.py) where
    model.implementation resolves to it, else transformers' model. The default gives transformers' model always:
    callers that decode with HF's KV cache (the embedded RL worker, rl/generation.py) or use HF's API need it.
    """
    if cfg.attn_implementation == "flash_attention_2" and not torch.cuda.is_available():
        raise EngineConfigError(
            "model.attn_implementation = 'flash_attention_2' needs a CUDA GPU and the flash-attn package; "
            "use 'sdpa' on this machine"
        )
    try:
        if cfg.path:
            model = _load_pretrained(cfg, vocab_size)
        else:
            hf_config = _random_config(cfg, vocab_size)
            # the native one filled directly, with transformers' numbers: its model code is never imported
            native = for_training and resolve_implementation(cfg, hf_config) == "native"
            model = _random_native(cfg, hf_config) if native else _random_init(cfg, hf_config)
    except ImportError as exc:
        # transformers refuses an attention implementation whose package is missing (flash_attention_2 without
        # flash-attn): the config asks for something this environment cannot do, and a retry would fail again
        raise EngineConfigError(
            f"model.attn_implementation = {cfg.attn_implementation!r} cannot be used here: {_first_line(exc)}; "
            "install its package (pip install flash-attn) or use 'sdpa'"
        ) from None
    # Training forwards need no KV cache. Left on, transformers fills a DynamicCache on every forward: it
    # keeps each layer's K/V alive (undoing activation checkpointing's savings), is appended to again when
    # a checkpointed layer recomputes, and makes torch.compile fall back to eager at the cache update.
    # generate() reads generation_config.use_cache instead, so exported models still decode with a cache.
    model.config.use_cache = False
    if for_training and cfg.path and resolve_implementation(cfg, model.config) == "native":
        model = _to_native(model)
    if for_training and not is_native(model):
        from prime_train.engine.hf_head import fuse_head

        fuse_head(model)  # the loss and log-probs one chunk of logits at a time, where its head allows
    return model.to(device)


def resolve_implementation(cfg: ModelConfig, hf_config) -> str:
    """'native' or 'hf': the model code model.implementation selects for `hf_config` (logs why for 'auto')."""
    reason = native_supports(hf_config)
    if cfg.implementation == "hf":
        return "hf"
    if cfg.attn_implementation != "sdpa":
        # the native model always runs SDPA (flash on GPU for unpacked rows): a transformers kernel asked for by
        # name is a request for transformers' model
        if cfg.implementation == "native":
            raise EngineConfigError(
                f"model.attn_implementation = {cfg.attn_implementation!r} is a transformers kernel and "
                "model.implementation = 'native' runs its own SDPA attention; set one of them back ('sdpa' / 'auto')"
            )
        logger.info("model.implementation = 'auto': transformers' model, for attn_implementation %r",
                    cfg.attn_implementation)  # fmt: skip
        return "hf"
    if reason is None:
        return "native"
    if cfg.implementation == "native":
        raise EngineConfigError(
            f"model.implementation = 'native' cannot run {hf_config.model_type!r}: {reason}; "
            "set model.implementation = 'auto' or 'hf' to train it with transformers' model"
        )
    logger.info("model.implementation = 'auto': transformers' model, as the native one cannot run it (%s)", reason)
    return "hf"


def native_supports(hf_config) -> str | None:
    """None when a native model (engine/llama.py, engine/gpt2.py for GPT-2) computes what transformers does for
    `hf_config`, else why not."""
    if getattr(hf_config, "model_type", None) == "gpt2":
        from prime_train.engine import gpt2

        return gpt2.supports(hf_config)
    from prime_train.engine.llama import supports

    return supports(hf_config)


def _to_native(hf_model: nn.Module) -> nn.Module:
    """The native decoder holding `hf_model`'s own weights (the same Parameter objects: no copy, same names)."""
    config = hf_model.config
    with torch.device("meta"):
        native = native_class(config)(config)
    # keep_vars: the Parameters themselves, so nothing is copied and the HF model can be dropped
    native.load_state_dict(hf_model.state_dict(keep_vars=True), strict=True, assign=True)
    embedding = native.get_input_embeddings()
    if config.tie_word_embeddings:
        native.lm_head.weight = embedding.weight  # assign=True gave them separate Parameters
    native.reset_rope(embedding.weight.device)
    logger.info("training the native %s decoder (engine/%s.py)", config.model_type,
                "gpt2" if config.model_type == "gpt2" else "llama")  # fmt: skip
    return native


def native_class(config) -> type[nn.Module]:
    """The native decoder class for a config native_supports accepts."""
    if config.model_type == "gpt2":
        from prime_train.engine.gpt2 import NativeGPT2

        return NativeGPT2
    from prime_train.engine.llama import NativeCausalLM

    return NativeCausalLM


def is_native(model: nn.Module) -> bool:
    """Whether `model` (or the model inside DDP / torch.compile wrappers) is a native decoder."""
    from prime_train.engine.gpt2 import NativeGPT2
    from prime_train.engine.llama import NativeCausalLM

    return isinstance(_unwrap(model), NativeCausalLM | NativeGPT2)


def chunked_head(model: nn.Module) -> bool:
    """Whether `model`'s forward takes labels to a chunked loss or chunked log-probs (engine/loss.py) and never
    forms the whole logits for them: a native decoder, or transformers' model given that head (engine/hf_head.py)."""
    from prime_train.engine.hf_head import has_fused_head

    return is_native(model) or has_fused_head(_unwrap(model))


def last_logits_only(model: nn.Module) -> dict[str, int]:
    """The forward argument that makes `model` project only the last position onto the vocabulary (what decoding
    reads), where the model takes it: transformers' `logits_to_keep`, which the native decoders take too."""
    inner = _unwrap(model)
    if is_native(inner) or "logits_to_keep" in inspect.signature(type(inner).forward).parameters:
        return {"logits_to_keep": 1}
    return {}


def _load_pretrained(cfg: ModelConfig, vocab_size: int):
    from transformers import AutoModelForCausalLM

    path = os.path.expanduser(cfg.path)
    if path.startswith(("/", ".")) and not os.path.exists(path):
        # transformers would report this as a malformed hub id
        raise EngineConfigError(f"model.path {cfg.path!r} does not exist; point it at a model directory or a hub id")
    try:
        # fp32 master weights whatever the checkpoint's dtype: bf16 compute comes from autocast / FSDP
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=cfg.attn_implementation
        )
    except OSError as exc:
        raise EngineConfigError(
            f"model.path {cfg.path!r} could not be loaded: {_first_line(exc)}. Give a local directory with "
            "config.json and weights, make the hub id reachable (network, HF_TOKEN, or a copy in the HF cache "
            "when HF_HUB_OFFLINE=1), or unset model.path to train a random-initialised model."
        ) from None
    except ValueError as exc:
        if "attention implementation" in str(exc):
            # Gemma 2 and others refuse SDPA (its attention logits are soft-capped): name the key to change
            raise EngineConfigError(
                f"model.attn_implementation = {cfg.attn_implementation!r} cannot load model.path {cfg.path!r}: "
                f"{_first_line(exc)}; set model.attn_implementation = 'eager'"
            ) from None
        # transformers raises ValueError for a config it has no causal-LM class for (e.g. an encoder)
        raise EngineConfigError(f"model.path {cfg.path!r} is not a causal LM transformers can train: {exc}") from None
    rows = model.get_input_embeddings().weight.shape[0]
    if vocab_size > rows:
        # the tokenizer (padded to model.vocab_multiple) has ids past the embedding table: grow it
        logger.info("resizing embeddings from %d to %d rows to fit the tokenizer", rows, vocab_size)
        model.resize_token_embeddings(vocab_size, mean_resizing=False)
    logger.info("loaded %s from %s", type(model).__name__, cfg.path)
    return model


def _random_config(cfg: ModelConfig, vocab_size: int):
    """The transformers config of the random-initialised model `cfg` describes (model.arch and its shape keys)."""
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gpt2": GPT2Config}[cfg.arch]
    # the built-in byte tokenizer's special tokens (the config classes default to other ids: Llama's eos is 2);
    # a model.tokenizer of one's own gets its ids written at export, from the tokenizer itself
    token_ids = (
        {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": PAD_TOKEN_ID}
        if cfg.tokenizer is None
        else {}
    )
    # a vocabulary too small for them (a bare model built for a test of its own) names no special tokens at all,
    # rather than ids the embedding cannot hold
    token_ids = {k: (v if v < vocab_size else None) for k, v in token_ids.items()}
    shape = {
        "vocab_size": vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
    }
    if cfg.arch == "gpt2":
        # nanoGPT's GPT-2 for pretraining from scratch: exact GELU, no dropout, a 4x MLP unless asked otherwise
        family = {"n_inner": cfg.intermediate_size, "activation_function": "gelu"}
        family |= dict.fromkeys(("attn_pdrop", "resid_pdrop", "embd_pdrop"), 0.0)
    else:
        family = {
            "intermediate_size": cfg.intermediate_size or 4 * cfg.hidden_size,
            "num_key_value_heads": cfg.num_kv_heads or cfg.num_heads,
        }
    hf_config = config_class(**token_ids, **shape, **family)
    # what transformers' from_config records on the config it builds from, so both models below export alike
    hf_config.dtype = torch.float32
    hf_config._attn_implementation = cfg.attn_implementation
    return hf_config


# Both are initialised on the CPU from the caller's torch seed: every rank (and a GPU run) gets the same weights,
# which FSDP2 relies on since fully_shard keeps each rank's own slice without broadcasting.


def _random_native(cfg: ModelConfig, hf_config) -> nn.Module:
    from prime_train.engine.hf_init import random_native

    model = random_native(native_class(hf_config), hf_config)
    logger.info(
        "random-initialised the native %s decoder: %d layers, hidden %d, vocab %d",
        hf_config.model_type,
        cfg.num_layers,
        cfg.hidden_size,
        hf_config.vocab_size,
    )
    return model


def _random_init(cfg: ModelConfig, hf_config):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(
        hf_config, dtype=torch.float32, attn_implementation=cfg.attn_implementation
    )
    logger.info(
        "random-initialised %s: %d layers, hidden %d, vocab %d",
        type(model).__name__,
        cfg.num_layers,
        cfg.hidden_size,
        hf_config.vocab_size,
    )
    return model


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unwrap(model: nn.Module) -> nn.Module:
    # DDP keeps the model in .module; torch.compile(model) in ._orig_mod
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks, the unit FSDP shards and activation checkpointing recomputes."""
    model = _unwrap(model)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(layers, nn.ModuleList):
        return layers
    candidates = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not candidates:
        raise ValueError(f"{type(model).__name__} has no nn.ModuleList of decoder layers to shard or checkpoint")
    return max(candidates, key=len)


def num_parameters(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameters of `model`, tied weights counted once; FSDP2 shards count at their full size."""
    # .parameters() already skips a tied weight's second appearance; DTensor.numel() is the global size
    params = {id(p): p for p in model.parameters()}
    if exclude_embeddings:
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                params.pop(id(module.weight), None)
    return sum(p.numel() for p in params.values())


def flops_per_token(model_config, seq_len: int, *, adapter_params: int | None = None) -> float:
    """Training FLOPs per token (forward + backward) of the model a transformers config describes.

    `adapter_params` (a LoRA run: the adapters' parameter count): the base is frozen, so its weights need no
    gradient: 4N for its matmuls (forward, and the gradient of each activation the adapters' gradients flow back
    through) plus 6 per adapter parameter, instead of 6N."""
    # A meta-device model counts the parameters of any architecture exactly, allocates nothing and
    # leaves the torch RNG alone. The native decoder holds the same parameters as transformers' model where it
    # runs the config, and needs none of transformers' model code imported (a second of a trainer's start-up).
    with torch.device("meta"):
        if native_supports(model_config) is None:
            meta = native_class(model_config)(model_config)
        else:
            from transformers import AutoModelForCausalLM

            meta = AutoModelForCausalLM.from_config(model_config)
    n_non_embedding = num_parameters(meta, exclude_embeddings=True)
    output = meta.get_output_embeddings()
    if output is not None and output.weight is meta.get_input_embeddings().weight:
        # a tied lm_head is still a hidden x vocab matmul per token: its compute counts even though its
        # parameters were excluded with the embedding table
        n_non_embedding += output.weight.numel()
    layers = model_config.num_hidden_layers
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    # 6N for the matmuls with weights (2 forward + 4 backward FLOPs per parameter, Kaplan et al. 2020,
    # "Scaling Laws for Neural Language Models", section 2.1) plus 12·L·H·Q·T for the attention scores and
    # their weighted sum (PaLM, Chowdhery et al. 2022, appendix B), H·Q = heads × head_dim, T = seq_len.
    attention = 12.0 * layers * heads * head_dim * seq_len
    if adapter_params is not None:
        return 4.0 * n_non_embedding + 6.0 * adapter_params + attention
    return 6.0 * n_non_embedding + attention


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s (not TFLOP/s) of a device named like torch.cuda.get_device_name(); None if unknown."""
    name = device_name.upper()
    for pattern, key in _DEVICE_PATTERNS:
        if pattern.search(name):
            return PEAK_TFLOPS_BF16[key] * 1e12
    return None


def mfu(
    tokens_per_s: float, flops_per_token: float, peak_flops_per_device: float | None, num_devices: int
) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the devices' peak; None when the peak is unknown."""
    if not peak_flops_per_device or num_devices < 1:
        return None
    return tokens_per_s * flops_per_token / (peak_flops_per_device * num_devices)


def load_model_and_tokenizer(cfg: Config):
    """Tokenizer and model on the CPU; one that cannot be loaded is a configuration error (never retried)."""
    from prime_train.engine.tokenizer import load_tokenizer, padded_vocab_size

    try:
        tokenizer = load_tokenizer(cfg.model)
        model = build_model(cfg.model, padded_vocab_size(tokenizer, cfg.model.vocab_multiple), for_training=True)
    except (OSError, ValueError) as exc:
        key = "model.tokenizer" if cfg.model.tokenizer else "model.path"
        raise EngineConfigError(f"{key}: cannot load {getattr(cfg.model, key.split('.')[1])!r}: {exc}") from None
    # from_pretrained hands models back in eval mode: training mode turns on what a model does only while it
    # trains (its config's dropout, peft's lora_dropout, an MoE router's jitter and load-balancing loss)
    model.train()
    _router_loss(cfg, model)
    return tokenizer, model


# the jobs whose objective the router loss joins (engine/train.py's step, engine/dpo.py's, rl/train.py's); the
# reward model has no causal LM head
ROUTER_LOSS_JOBS = ("sft", "pretrain", "dpo", "rl")


def _router_loss(cfg: Config, model: nn.Module) -> None:
    """Give an MoE model its router's load-balancing loss where model.router_aux_loss_coef, or unset, its
    config.json (output_router_logits, router_aux_loss_coef) asks for it; refuse an explicit weight the run would
    not apply."""
    from prime_train.engine.hf_head import ROUTED_MODEL_TYPES, has_fused_head, set_router_loss

    explicit = cfg.model.router_aux_loss_coef
    hf_config = model.config
    model_type = getattr(hf_config, "model_type", None)
    if explicit is None:
        if not getattr(hf_config, "output_router_logits", False):
            return
        coef, source = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0), "its config.json"
    else:
        coef, source = explicit, f"model.router_aux_loss_coef = {explicit}"
    if not coef:
        return
    why = None
    if model_type not in ROUTED_MODEL_TYPES:
        why = f"{model_type!r} is not an MoE whose router loss the engine adds ({', '.join(ROUTED_MODEL_TYPES)})"
    elif cfg.run.job not in ROUTER_LOSS_JOBS:
        why = f"the {cfg.run.job} job's objective does not take it ({', '.join(ROUTER_LOSS_JOBS)} do)"
    elif not has_fused_head(model):
        why = "the model did not take the chunked head (see the log above)"
    if why is None:
        set_router_loss(model, coef)
        logger.info("the router's load-balancing loss joins the loss with weight %g (%s)", coef, source)
    elif explicit is not None:
        raise EngineConfigError(f"model.router_aux_loss_coef = {explicit}: {why}; unset it")
    else:
        logger.warning("%s asks for the router's load-balancing loss (output_router_logits), not added: %s",
                       source, why)  # fmt: skip
