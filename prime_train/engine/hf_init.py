"""A native model random-initialised with the very numbers transformers' `from_config` draws, without its model code.

Importing transformers' modeling modules (modeling_llama pulls in generation, masking and loss utilities) costs a
trainer process about 1.3 s of start-up on a 2-core machine, every rank, every restart. The native decoders hold
the same parameters under the same names, so they can be filled directly. Doing so with the same numbers matters:
a run's first losses, every recorded loss in the tests, and what a user's seed meant yesterday stay as they were.

transformers 5 initialises a causal LM in two passes a model, each drawing from torch's default generator:
1. construction: each torch module's own reset (nn.Linear: kaiming-uniform weight, uniform bias; nn.Embedding:
   standard normal; GPT-2's Conv1D: normal(0, 0.02)), in construction order;
2. `post_init`, at the end of each PreTrainedModel's __init__: `_init_weights` on every module not yet initialised,
   children before parents: normal(0, initializer_range) matrices and zero biases, unit norms, the padding row of
   the token embedding zeroed (Llama, Qwen2), and GPT-2's residual projections (c_proj) drawn again at
   initializer_range / sqrt(2 * layers).
The inner model (`model` / `transformer`) runs both passes before the causal-LM wrapper constructs lm_head, so the
draws go: inner construction, inner init, lm_head construction, lm_head init; then lm_head is tied to the token
embedding if the config ties them. Only the order and shape of the draws matter, so this module replays them on the
native modules (built on the meta device, then given real storage), drawing into a scratch tensor where the
native lm_head already shares the embedding's weight. tests/test_native_engine.py checks the result, and the
generator's state after it, against transformers' own from_config for Llama, Qwen2 and GPT-2.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from prime_train.engine.llama import RMSNorm


def _is_conv1d(module: nn.Module) -> bool:
    # GPT-2's Conv1D (transformers.pytorch_utils), matched by name so Llama-only processes need not import it
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _construct(module: nn.Module) -> None:
    """The draws a module's own constructor makes (their values are overwritten by _init; only the draws count)."""
    if isinstance(module, nn.Linear):
        module.reset_parameters()
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight)
    elif _is_conv1d(module):
        nn.init.normal_(module.weight, std=0.02)


def _init(module: nn.Module, config, padding_idx: int | None) -> None:
    """transformers' _init_weights for one module (PreTrainedModel's, with GPT2PreTrainedModel's additions)."""
    std = config.initializer_range
    if isinstance(module, nn.Linear) or _is_conv1d(module):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if padding_idx is not None and module.weight.shape[0] > padding_idx:
            module.weight[padding_idx].zero_()
    elif isinstance(module, RMSNorm | nn.LayerNorm):
        nn.init.ones_(module.weight)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    if config.model_type == "gpt2" and hasattr(module, "c_proj"):
        # GPT-2's scaled residual projections, drawn after the Attention's / MLP's children were initialised
        nn.init.normal_(module.c_proj.weight, mean=0.0, std=std / math.sqrt(2 * config.n_layer))


def _post_order(module: nn.Module):
    for child in module.children():
        yield from _post_order(child)
    yield module


@torch.no_grad()
def init_as_transformers(model: nn.Module) -> None:
    """Fill a native model's parameters (NativeCausalLM or NativeGPT2, on the CPU) as transformers' from_config
    would for the same config and torch seed."""
    config = model.config
    inner = model.transformer if config.model_type == "gpt2" else model.model
    # Llama-family token embeddings are built with padding_idx = pad_token_id (GPT-2's without)
    padding_idx = None if config.model_type == "gpt2" else getattr(config, "pad_token_id", None)
    head = model.lm_head
    tied_to = head.weight if head.weight is model.get_input_embeddings().weight else None
    if tied_to is not None:
        # transformers builds lm_head with its own weight and draws into it before tying: draw into a scratch one
        head.weight = nn.Parameter(torch.empty_like(tied_to))
    for module in inner.modules():
        _construct(module)
    for module in _post_order(inner):
        _init(module, config, padding_idx)
    _construct(head)
    _init(head, config, padding_idx)
    if tied_to is not None:
        head.weight = tied_to


def random_native(native_class: type[nn.Module], config, *, max_seq_len: int | None = None) -> nn.Module:
    """The `native_class` model (NativeCausalLM or NativeGPT2) of `config`, fp32 on the CPU, random-initialised as
    transformers would from the current torch seed."""
    with torch.device("meta"):
        model = native_class(config, max_seq_len=max_seq_len)
    model.to_empty(device="cpu")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.get_input_embeddings().weight  # to_empty gave each its own storage
    init_as_transformers(model)
    model.reset_rope("cpu")
    return model
