"""transformers' causal LMs given the native decoders' head: the loss and the log-probs one chunk at a time.

A transformers model (`model.implementation = "hf"`, or an architecture the native decoders do not cover: Gemma,
Gemma 2 and 3, Phi-3, OLMo 2...) forms the whole logits, tokens x vocab, then an fp32 copy for the loss: at Gemma
3's 262,144 entries and 8 rows of 2048 tokens, 8 GiB in bf16 and 16 GiB in fp32, before DPO's log-softmax or GRPO's
entropy. Where a family's forward is its base model, then `lm_head` (a Linear without bias), then the loss on those
logits unchanged, scaled (Cohere's `logit_scale`, Granite's `logits_scaling`: the hidden states are scaled instead,
as s (h W^T) = (s h) W^T) or soft-capped (Gemma 2's `final_logit_softcapping`, which the chunks apply), `fuse_head`
gives that model the forward of the native decoders (engine/llama.py head_output): with `labels`, its base model's
final hidden states go to engine/loss.py's chunked loss or log-probs and no logits are formed; without, transformers'
own forward runs (generation, logits for a value head's caller). The forward is set on the instance, inside the
module's call, so FSDP2's hooks gather lm_head's weight for it as for the native model, a deep copy (DPO's reference)
carries it, and peft's in-place adapters run inside the base model as before.

Not fused, and left to transformers' whole logits: a model whose `lm_head` has a bias, an MoE whose router loss is
added to the loss (`output_router_logits`), and any family not listed below; tests check each listed family's fused
loss, log-probs, entropy and every gradient against transformers' own logits.
"""

from __future__ import annotations

import inspect
import logging
import types
from typing import Any

from torch import nn

from prime_train.engine.llama import DecoderForward, head_output

logger = logging.getLogger("prime_train.engine.model")

# transformers families whose causal LM forward is `lm_head(base(...).last_hidden_state)` and the plain loss
# (the MoE ones while their router loss is off: output_router_logits, refused below, adds it to the loss; Gemma 2
# and Gemma 3 soft-cap their logits by final_logit_softcapping, which the chunked loss applies too; Cohere's and
# Granite's scale them, below)
FUSED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "starcoder2", "smollm3",
    "cohere", "cohere2", "granite", "mixtral", "qwen2_moe", "qwen3_moe",
)  # fmt: skip
# the families whose head multiplies the logits by config.logit_scale, and those that divide them by
# config.logits_scaling
_MULTIPLIED = ("cohere", "cohere2")
_DIVIDED = ("granite",)
_FLAG = "_prime_train_fused_head"
# the native forward's keyword-only arguments (what transformers' forward does not take) with the native defaults:
# the fused forward takes them as the native decoders do
_HEAD_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(DecoderForward.forward).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def fusable(model: nn.Module) -> str | None:
    """None when `fuse_head` can give `model` the chunked head, else why not."""
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        return "its router loss is added to the loss (output_router_logits)"
    model_type = getattr(config, "model_type", None)
    if model_type not in FUSED_MODEL_TYPES:
        return f"transformers' {model_type!r} head is not one the chunked loss is checked against"
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return "its lm_head is not a Linear without bias"
    if not isinstance(getattr(model, getattr(model, "base_model_prefix", ""), None), nn.Module):
        return "its base model is not where transformers keeps it"
    return None


def fuse_head(model: nn.Module) -> bool:
    """Give transformers' `model` the native decoders' head in place where `fusable` allows; whether it did."""
    reason = fusable(model)
    if reason is not None:
        logger.info("transformers' model keeps its whole logits: %s", reason)
        return False
    model.forward = types.MethodType(_forward, model)
    setattr(model, _FLAG, True)
    logger.info("transformers' %s takes its loss and log-probs one chunk of logits at a time (engine/hf_head.py)",
                type(model).__name__)  # fmt: skip
    return True


def has_fused_head(model: nn.Module) -> bool:
    """Whether `model` itself (not a DDP or torch.compile wrapper: engine/model.py chunked_head looks inside those)
    was given the chunked head by fuse_head."""
    return bool(getattr(model, _FLAG, False))


def _forward(self, input_ids=None, *args: Any, labels=None, **kwargs: Any):
    """transformers' forward without `labels`; with them, the base model's final hidden states into head_output."""
    if labels is None:
        return type(self).forward(self, input_ids, *args, **kwargs)
    if args:
        raise TypeError("with labels, pass the forward's arguments after input_ids by name")
    head = {name: kwargs.pop(name, default) for name, default in _HEAD_DEFAULTS.items()}
    hidden = getattr(self, self.base_model_prefix)(input_ids=input_ids, **kwargs).last_hidden_state
    softcap = getattr(self.config, "final_logit_softcapping", None)
    return head_output(
        hidden, self.get_output_embeddings(), labels, **head, softcap=softcap, logit_scale=logit_scale(self.config)
    )


def logit_scale(config) -> float | None:
    """What a listed family's head multiplies its logits by (None: nothing)."""
    if config.model_type in _MULTIPLIED:
        return config.logit_scale
    if config.model_type in _DIVIDED:
        return 1 / config.logits_scaling
    return None
