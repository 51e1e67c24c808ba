"""The native GPT-2 (model.arch = "gpt2"): nanoGPT's model family on the engine's training path.

Token and learned position embeddings, pre-LayerNorm blocks, causal self-attention through SDPA (is_causal: the
flash kernel on GPU), a GELU MLP, a final LayerNorm and lm_head tied to the token embedding. Modules and
parameters are named and shaped as transformers' GPT2LMHeadModel names them (its Conv1D layers, weight stored
input x output, are transformers' own class), so the state_dict IS the HF state dict: DCP checkpoints hold HF's
keys, `to_hf` hands the same parameters to a GPT2LMHeadModel for save_pretrained, and GPT-2 weights from the hub
load strictly. What it adds over transformers' class is what llama.py adds for Llama: document masking for
packed rows, no cache or output plumbing, a forward dynamo traces whole, and the loss fused with lm_head
(engine/loss.py). Dropout is not implemented: a config with dropout is trained by transformers' model
(`supports` says why), as is one with cross-attention or per-layer attention scaling.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from prime_train.engine.llama import AttentionBackend, DecoderForward, decoder_mask

# transformers' names of the GELUs GPT-2 configs use -> F.gelu's approximation
_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


def supports(config, max_seq_len: int | None = None) -> str | None:
    """None when the native GPT-2 computes what transformers' GPT2LMHeadModel does for `config`, else why not."""
    if getattr(config, "model_type", None) != "gpt2":
        return f"model_type {getattr(config, 'model_type', None)!r} is not gpt2"
    dropout = {k: getattr(config, k, 0.0) for k in ("attn_pdrop", "resid_pdrop", "embd_pdrop")}
    if any(dropout.values()):
        return f"dropout ({', '.join(f'{k} {v}' for k, v in dropout.items() if v)}); the native GPT-2 has none"
    if config.activation_function not in _GELU:
        return f"activation_function {config.activation_function!r}"
    for flag in ("add_cross_attention", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if getattr(config, flag, False):
            return f"{flag} = True"
    if not getattr(config, "scale_attn_weights", True):
        return "scale_attn_weights = False"
    if max_seq_len is not None and max_seq_len > config.n_positions:
        return f"sequences of {max_seq_len} tokens and {config.n_positions} learned positions"
    return None


class Attention(nn.Module):
    """Multi-head causal self-attention: one qkv projection (c_attn), SDPA, the output projection (c_proj)."""

    def __init__(self, config):
        super().__init__()
        self.num_heads = config.n_head
        self.c_attn = Conv1D(3 * config.n_embd, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, mask) -> torch.Tensor:
        """x: (B, T, hidden); mask: None (causal), a bool tensor or a BlockMask."""
        batch, length, hidden = x.shape
        # (B, T, 3, heads, head_dim) -> three (B, heads, T, head_dim)
        qkv = self.c_attn(x).view(batch, length, 3, self.num_heads, hidden // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif isinstance(mask, torch.Tensor):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            from torch.nn.attention.flex_attention import flex_attention

            y = flex_attention(q, k, v, block_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(batch, length, hidden))


class MLP(nn.Module):
    """c_proj(gelu(c_fc(x))), 4 x hidden wide unless the config says n_inner."""

    def __init__(self, config):
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = Conv1D(inner, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, inner)
        self.approximate = _GELU[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP."""
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Block(nn.Module):
    """Pre-LayerNorm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); the unit FSDP shards and AC recomputes."""

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, mask) -> torch.Tensor:
        """One block."""
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    """Embeddings, blocks and final norm: HF's `transformer.` submodule."""

    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)


class NativeGPT2(DecoderForward, nn.Module):
    """GPT-2 as transformers' GPT2LMHeadModel names it, with the native decoder's forward and fused loss."""

    def __init__(self, config, *, max_seq_len: int | None = None, attention: AttentionBackend = "sdpa"):
        super().__init__()
        if (reason := supports(config, max_seq_len)) is not None:
            raise ValueError(f"the native GPT-2 cannot run this {type(config).__name__}: {reason}")
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', not {attention!r}")
        self.config = config
        self.attention = attention
        self.max_seq_len = max_seq_len or config.n_positions
        self.transformer = Transformer(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.transformer.wte.weight

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """Nothing to rebuild: positions are learned parameters (the native Llama's call, for the callers of both)."""

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2's initialisation as transformers and nanoGPT do it: normal(0, initializer_range), zero biases, unit
        LayerNorms, and the residual projections (c_proj) at std / sqrt(2 * layers)."""
        std = self.config.initializer_range
        for name, module in self.named_modules():
            if isinstance(module, Conv1D | nn.Linear | nn.Embedding):
                scale = (2 * self.config.n_layer) ** -0.5 if name.endswith("c_proj") else 1.0
                module.weight.normal_(0.0, std * scale, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(1.0)
                module.bias.zero_()

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding table (as on an HF model)."""
        return self.transformer.wte

    def get_output_embeddings(self) -> nn.Linear:
        """The output projection (as on an HF model)."""
        return self.lm_head

    def _mask(self, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None):
        return decoder_mask(self.attention, position_ids, attention_mask)

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states (B, T, hidden), before lm_head."""
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        mask = self._mask(position_ids, attention_mask)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(position_ids)
        for block in self.transformer.h:
            x = block(x, mask)
        return self.transformer.ln_f(x)


def from_config(config, *, max_seq_len: int | None = None, seed: int | None = None) -> NativeGPT2:
    """A random-initialised native GPT-2 of `config`, fp32 on the CPU."""
    model = NativeGPT2(config, max_seq_len=max_seq_len)
    model.init_weights(torch.Generator().manual_seed(seed) if seed is not None else None)
    return model
