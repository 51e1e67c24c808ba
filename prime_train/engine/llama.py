"""A native decoder for the families the engine trains: Llama (with Llama 3.1 rope scaling), Qwen2/2.5, Qwen3, Mistral.

Built from a transformers config and named like transformers' own classes, so its state_dict IS the HF state
dict: HF safetensors load into it strictly, DCP checkpoints of either model hold the same keys, and `to_hf`
hands the very same parameters to a transformers model for save_pretrained and generate. What it adds over the
HF classes is what a training step needs and they do not give: RoPE as a precomputed table, SDPA with
is_causal (the flash kernel on GPU) for plain rows, document masking for packed rows, no cache or output
plumbing, a forward dynamo traces whole, and the loss fused with lm_head (engine/loss.py).

Attention masks, from what forward is given:
- neither position_ids nor attention_mask: causal, through SDPA's is_causal (no mask tensor at all);
- position_ids: packed rows, a document starts wherever the position does not follow the one before (it
  restarts at 0); tokens attend causally within their own document only;
- attention_mask (1 real, 0 padding; left-padded batches in greedy evaluation): the same, and no query sees a
  padding key.
The masked cases use a dense boolean B x 1 x T x T mask by default (the reference; SDPA's memory-efficient
kernel on GPU); `attention="flex"` gives the same masks to FlexAttention as a block mask instead, which skips
the masked blocks (worth it under torch.compile on GPU, where FlexAttention becomes a fused kernel). On the CPU,
torch 2.13's FlexAttention runs forward only (its backward raises NotImplementedError there): use "sdpa" to train.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from prime_train.engine.loss import chunked_cross_entropy, chunked_token_log_probs

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# rope types whose frequencies do not depend on the sequence length: one table serves every step
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
AttentionBackend = Literal["sdpa", "flex"]


class CausalLMOutput(NamedTuple):
    """What forward returns: logits (None when labels were given: the fused loss never forms them) and loss; with
    return_token_losses, each label position's loss ([B, T] fp32, no gradient, 0 where ignored). With
    token_log_probs, no loss but each label position's log-probability ([B, T] fp32, with gradient, 0 where
    ignored), with return_entropy each position's entropy (no gradient), and the final hidden states.
    router_loss: an MoE's router-loss term (engine/hf_head.py), else None: with a loss, what was added to it (no
    gradient); with token_log_probs, coef x aux with its gradient, for the caller's objective to add."""

    logits: torch.Tensor | None
    loss: torch.Tensor | None
    token_losses: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    router_loss: torch.Tensor | None = None


def head_output(
    hidden: torch.Tensor,
    lm_head: nn.Linear,
    labels: torch.Tensor | None,
    *,
    num_items_in_batch: torch.Tensor | int | None,
    loss_reduction: Literal["mean", "sum"],
    loss_chunk_size: int | None,
    return_token_losses: bool,
    token_log_probs: bool,
    temperature: float,
    return_entropy: bool,
    logits_to_keep: int = 0,
    softcap: float | None = None,
    logit_scale: float | None = None,
) -> CausalLMOutput:
    """What the native decoders' forward returns from their final hidden states: the logits (of the last
    `logits_to_keep` positions only when it is not 0, as transformers' argument), the fused loss, or each label's
    log-probability (engine/loss.py), never the whole logits when labels are given. `logit_scale`: the logits are
    multiplied by it (Cohere's logit_scale, 1 / Granite's logits_scaling); `softcap`: then they are
    softcap * tanh(logits / softcap) (Gemma 2). Both come from transformers' heads through engine/hf_head.py; the
    native decoders have neither."""
    head_input = hidden if logit_scale is None else hidden * logit_scale  # scale * (h W^T) = (scale * h) W^T
    if labels is None:
        logits = lm_head(head_input[:, -logits_to_keep:] if logits_to_keep else head_input)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return CausalLMOutput(logits=logits, loss=None)
    # position t predicts label t + 1; the last position of each row has no target
    targets = F.pad(labels[:, 1:], (0, 1), value=-100)
    weight = lm_head.weight
    if isinstance(weight, DTensor):
        # tensor parallel replicates lm_head (engine/tensor_parallel.py): each rank computes the whole loss, and
        # the weight's gradient comes back as the Replicate DTensor it is
        weight = weight.to_local()
    if token_log_probs:
        log_probs, entropy = chunked_token_log_probs(
            head_input,
            weight,
            targets,
            temperature=temperature,
            chunk_size=loss_chunk_size,
            entropy=return_entropy,
            softcap=softcap,
        )
        return CausalLMOutput(logits=None, loss=None, log_probs=log_probs, entropy=entropy, hidden_states=hidden)
    per_token = torch.zeros(targets.numel(), dtype=torch.float32, device=hidden.device) if return_token_losses else None
    loss = chunked_cross_entropy(
        head_input,
        weight,
        targets,
        num_items=num_items_in_batch,
        reduction=loss_reduction,
        chunk_size=loss_chunk_size,
        per_token=per_token,
        softcap=softcap,
    )
    return CausalLMOutput(
        logits=None, loss=loss, token_losses=None if per_token is None else per_token.view(targets.shape)
    )


class DecoderForward:
    """The forward the native decoders share: their own `hidden_states`, then `head_output` on their lm_head."""

    lm_head: nn.Linear

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        num_items_in_batch: torch.Tensor | int | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        loss_chunk_size: int | None = None,
        return_token_losses: bool = False,
        token_log_probs: bool = False,
        temperature: float = 1.0,
        return_entropy: bool = False,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput:
        """Logits (of the last `logits_to_keep` positions, when not 0), or with `labels` (unshifted, -100 ignored,
        as HF takes them) the next-token loss and no logits.

        The loss is the mean over labelled tokens, divided by `num_items_in_batch` when given (HF's name: the count
        of the whole batch, for gradient accumulation), or the sum with loss_reduction="sum". With
        `token_log_probs`, no loss: each label's log-probability under softmax(logits / temperature), chunked as
        the loss is (DPO's sequence sums, GRPO's token ratios). `loss_chunk_size`: tokens a chunk of either,
        engine/loss.py chunk_tokens(vocab) when None.
        """
        hidden = self.hidden_states(input_ids, position_ids, attention_mask)
        return head_output(
            hidden, self.lm_head, labels, num_items_in_batch=num_items_in_batch, loss_reduction=loss_reduction,
            loss_chunk_size=loss_chunk_size, return_token_losses=return_token_losses,
            token_log_probs=token_log_probs, temperature=temperature, return_entropy=return_entropy,
            logits_to_keep=logits_to_keep,
        )  # fmt: skip


def _rope_parameters(config) -> dict:
    # transformers 5 keeps rope_theta and the scaling in config.rope_parameters; 4.x had rope_theta / rope_scaling
    params = getattr(config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params = dict(params)
    params.setdefault("rope_type", params.get("type", "default"))
    return params


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _sliding_window(config) -> int | None:
    """The attention window the config actually applies to some layer, else None."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if config.model_type == "mistral":  # Mistral applies its window to every layer whenever it is set
        return window
    layer_types = getattr(config, "layer_types", None) or []
    return window if "sliding_attention" in layer_types else None


def supports(config, max_seq_len: int | None = None) -> str | None:
    """None when the native model computes what transformers computes for `config`; else the reason it does not.

    max_seq_len: the longest sequence the run trains on; a sliding window at least that long never masks anything.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    rope_type = _rope_parameters(config)["rope_type"]
    if rope_type not in _STATIC_ROPE_TYPES:
        return f"rope type {rope_type!r} is not supported (only {', '.join(_STATIC_ROPE_TYPES)})"
    if _rope_parameters(config).get("partial_rotary_factor", 1.0) != 1.0:
        return "partial rotary embeddings are not supported"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not supported (only silu)"
    if getattr(config, "attention_dropout", 0.0):
        return f"attention_dropout {config.attention_dropout} is not supported (only 0)"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return f"pretraining_tp {config.pretraining_tp} is not supported (only 1)"
    window = _sliding_window(config)
    longest = max_seq_len or config.max_position_embeddings
    if window is not None and window < longest:
        return f"sliding-window attention (window {window} < sequence length {longest}) is not supported"
    if config.num_attention_heads % config.num_key_value_heads:
        return "num_attention_heads is not a multiple of num_key_value_heads"
    return None


class RMSNorm(nn.Module):
    """RMSNorm normalised in fp32 and scaled in the input's dtype, as the HF Llama family does it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise the last dim of x."""
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _inverse_frequencies(config) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies and the cos/sin scale, computed on the CPU in fp32."""
    params = _rope_parameters(config)
    if params["rope_type"] == "default":
        dim = _head_dim(config)
        return 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0
    # the scaled variants (llama3, yarn, linear) come from transformers' own functions: the table then equals
    # the one the HF model builds, by construction rather than by a copy that could drift
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with torch.device("cpu"):
        inv_freq, scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


def rope_table(config, length: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position below `length`, (length, head_dim) each, fp32, halves duplicated as in HF."""
    inv_freq, scale = _inverse_frequencies(config)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * scale).to(device), (angles.sin() * scale).to(device)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Per token, the index of its document in the row: a document starts where a position does not follow on."""
    starts = torch.diff(position_ids, dim=-1, prepend=position_ids[:, :1] - 1) != 1
    return starts.cumsum(-1)


def dense_attention_mask(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean (B, 1, T, T) mask, True where query t may see key s: causal, same document, key not padding.

    Every query also sees itself, so a padding query has one key and SDPA never softmaxes an empty row
    (whose NaN would reach real tokens through the values of the next layer).
    """
    docs = document_ids(position_ids)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    mask = (docs[:, :, None] == docs[:, None, :]) & causal
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, :]
    mask = mask | torch.eye(length, dtype=torch.bool, device=position_ids.device)
    return mask[:, None]


def flex_block_mask(position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
    """The same mask as dense_attention_mask, as a FlexAttention BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = document_ids(position_ids)
    valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(docs, dtype=torch.bool)

    def mask_mod(b, h, q, k):
        return ((docs[b, q] == docs[b, k]) & (k <= q) & valid[b, k]) | (q == k)

    batch, length = position_ids.shape
    return create_block_mask(mask_mod, batch, None, length, length, device=position_ids.device)


def decoder_mask(attention: str, position_ids: torch.Tensor | None, attention_mask: torch.Tensor | None):
    """The mask a native decoder (this Llama, engine/gpt2.py) attends with: None for plain causal attention, else
    the packed documents' (and the padding's) as a flex BlockMask or a dense mask, per `attention`."""
    if position_ids is None and attention_mask is None:
        return None
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if attention == "flex":
        return flex_block_mask(position_ids, attention_mask)
    return dense_attention_mask(position_ids, attention_mask)


class Attention(nn.Module):
    """Grouped-query attention with RoPE; optional qkv bias (Qwen2) and per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, config):
        super().__init__()
        self.head_dim = _head_dim(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        hidden = config.hidden_size
        qkv_bias = config.model_type == "qwen2" or getattr(config, "attention_bias", False)
        out_bias = config.model_type != "qwen2" and getattr(config, "attention_bias", False)
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=out_bias)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask) -> torch.Tensor:
        """x: (B, T, hidden); cos/sin: (T, D) or (B, T, D); mask: None (causal), a bool tensor or a BlockMask."""
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, -1, self.head_dim)
        k = self.k_proj(x).view(batch, length, -1, self.head_dim)
        v = self.v_proj(x).view(batch, length, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cos.dim() == 3:  # per-row positions: broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        grouped = self.num_heads != self.num_kv_heads
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        elif isinstance(mask, torch.Tensor):
            # SDPA's masked kernels do not all take enable_gqa (on GPU the memory-efficient one falls back to
            # math): repeat the KV heads instead, head i reading KV head i // group as in HF
            if grouped:
                group = self.num_heads // self.num_kv_heads
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            from torch.nn.attention.flex_attention import flex_attention

            y = flex_attention(q, k, v, block_mask=mask, enable_gqa=grouped)
        return self.o_proj(y.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); the unit FSDP shards and checkpointing recomputes."""

    def __init__(self, config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask) -> torch.Tensor:
        """One block."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Embeddings, blocks and final norm: HF's `model.` submodule."""

    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class NativeCausalLM(DecoderForward, nn.Module):
    """The causal LM of an HF config (see supports()), parameter for parameter named as transformers names it."""

    def __init__(self, config, *, max_seq_len: int | None = None, attention: AttentionBackend = "sdpa"):
        """max_seq_len: length of the RoPE table (default config.max_position_embeddings); positions must stay below.

        attention: "sdpa" (dense boolean masks for packed or padded rows) or "flex" (FlexAttention block masks;
        forward only on the CPU).
        """
        super().__init__()
        reason = supports(config, max_seq_len)
        if reason is not None:
            raise ValueError(f"the native model cannot run this {type(config).__name__}: {reason}")
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', not {attention!r}")
        self.config = config
        self.attention = attention
        self.max_seq_len = max_seq_len or config.max_position_embeddings
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # non-persistent: derived from the config, so they stay out of the state dict (HF's keys exactly)
        cos, sin = rope_table(config, self.max_seq_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def reset_rope(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE table (after building on the meta device, or to move it)."""
        device = device if device is not None else self.model.embed_tokens.weight.device
        self.rope_cos, self.rope_sin = rope_table(self.config, self.max_seq_len, device)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Random initialisation as HF's: normal(0, initializer_range) for matrices, zero biases, unit norms."""
        std = getattr(self.config, "initializer_range", 0.02)
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)

    def get_input_embeddings(self) -> nn.Embedding:
        """The token embedding table (as on an HF model)."""
        return self.model.embed_tokens

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
            # left padding: each row's first real token at position 0, as it would be alone
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        if position_ids is None:
            cos, sin = self.rope_cos[: input_ids.shape[1]], self.rope_sin[: input_ids.shape[1]]
        else:
            cos, sin = self.rope_cos[position_ids], self.rope_sin[position_ids]
        mask = self._mask(position_ids, attention_mask)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask)
        return self.model.norm(x)


def from_config(
    config, *, max_seq_len: int | None = None, attention: AttentionBackend = "sdpa", seed: int | None = None
):
    """A random-initialised native model of `config`, fp32 on the CPU (HF's initialisation scheme, not its numbers)."""
    model = NativeCausalLM(config, max_seq_len=max_seq_len, attention=attention)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    model.init_weights(generator)
    return model


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json")


def from_pretrained(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_seq_len: int | None = None,
    attention: AttentionBackend = "sdpa",
) -> NativeCausalLM:
    """Load an HF model directory (config.json + safetensors) into a native model, every key matched strictly."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    path = Path(path)
    config = AutoConfig.from_pretrained(path)
    # built on meta, then the loaded tensors become the parameters: no random init, no second copy
    with torch.device("meta"):
        model = NativeCausalLM(config, max_seq_len=max_seq_len, attention=attention)
    state_dict: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        state_dict.update(load_file(file, device=str(device)))
    state_dict = {name: tensor.to(dtype) for name, tensor in state_dict.items()}
    if config.tie_word_embeddings:
        # HF writes a tied weight once, under the embedding's name
        state_dict.setdefault("lm_head.weight", state_dict["model.embed_tokens.weight"])
    model.load_state_dict(state_dict, strict=True, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight  # assign=True gave them separate Parameters
    model.reset_rope(device)
    return model


def to_hf(model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None):
    """A transformers model of the same config holding the native model's own parameters (no copy).

    save_pretrained, generate and vLLM-compatible export then work on it; training either one moves both.
    state_dict: full tensors to hold instead (an FSDP2 model's gathered state dict at export); they are not copied.
    """
    from transformers import AutoModelForCausalLM

    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    if state_dict is None:
        # keep_vars: the Parameter objects themselves, so both models share them (tied ones stay one Parameter)
        state_dict = model.state_dict(keep_vars=True)
    embedding = state_dict[next(k for k in ("model.embed_tokens.weight", "transformer.wte.weight") if k in state_dict)]
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(model.config, dtype=embedding.dtype)
    hf.load_state_dict(state_dict, strict=True, assign=True)
    # HF's own non-persistent buffers (the rotary inverse frequencies) were made on meta: build them for real
    # (GPT-2 has none: its positions are parameters)
    if (rotary := getattr(getattr(hf, "model", None), "rotary_emb", None)) is not None:
        hf.model.rotary_emb = type(rotary)(config=hf.config).to(embedding.device)
    left = [name for name, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"to_hf left tensors on the meta device: {left[:5]}")
    hf.train(model.training)
    return hf
