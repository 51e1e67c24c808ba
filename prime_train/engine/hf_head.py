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

An MoE family's router loss (Switch Transformer's load balancing, transformers' `load_balancing_loss_func`, which
transformers adds to the loss when `output_router_logits` is on) is added by the fused forward once
`set_router_loss` gives the model its weight, in a training-mode forward with gradients on: to the loss, weighted by
the labelled tokens of the forward, so under the engine's global-token normalisation each micro-batch's router loss
counts as its tokens do (`loss_reduction = "mean"` without `num_items_in_batch` gives transformers' loss +
coef * aux exactly), the output's `router_loss` then the term added, without gradient, for the trainer's metrics;
with `token_log_probs` there is no loss to add it to, and `router_loss` is coef * aux with its gradient, for the
caller's objective (DPO's, engine/dpo.py).

Not fused, and left to transformers' whole logits: a model whose `lm_head` has a bias, and any family not listed
below; tests check each listed family's fused loss, log-probs, entropy and every gradient against transformers' own
logits.
"""

from __future__ import annotations

import inspect
import logging
import sys
import types
from typing import Any

import torch
from torch import nn

from prime_train.engine.llama import DecoderForward, head_output

logger = logging.getLogger("prime_train.engine.model")

# transformers families whose causal LM forward is `lm_head(base(...).last_hidden_state)` and the plain loss
# (Gemma 2 and Gemma 3 soft-cap their logits by final_logit_softcapping, which the chunked loss applies too;
# Cohere's and Granite's scale them, and the MoE ones add their router loss, below)
FUSED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "starcoder2", "smollm3",
    "cohere", "cohere2", "granite", "mixtral", "qwen2_moe", "qwen3_moe",
)  # fmt: skip
# the families whose head multiplies the logits by config.logit_scale, and those that divide them by
# config.logits_scaling
_MULTIPLIED = ("cohere", "cohere2")
_DIVIDED = ("granite",)
# the MoE families whose router loss the fused forward adds (their modules' load_balancing_loss_func, their
# num_experts and num_experts_per_tok)
ROUTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_FLAG = "_prime_train_fused_head"
_ROUTER = "_prime_train_router_loss_coef"
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
    coef = getattr(self, _ROUTER, 0.0)
    routed = bool(coef) and self.training and torch.is_grad_enabled()  # not a reference's or an eval's forward
    if routed:
        kwargs["output_router_logits"] = True
    base = getattr(self, self.base_model_prefix)(input_ids=input_ids, **kwargs)
    softcap = getattr(self.config, "final_logit_softcapping", None)
    out = head_output(
        base.last_hidden_state, self.get_output_embeddings(), labels, **head, softcap=softcap,
        logit_scale=logit_scale(self.config),
    )  # fmt: skip
    if not routed:
        return out
    aux = sys.modules[type(self).__module__].load_balancing_loss_func(
        base.router_logits, self.num_experts, self.num_experts_per_tok, kwargs.get("attention_mask")
    )
    if head["token_log_probs"]:
        return out._replace(router_loss=coef * aux)  # no loss to add it to: the caller's objective adds it (DPO)
    labelled = (labels[:, 1:] != -100).sum()
    term = coef * aux * labelled  # a sum over the labelled tokens, as the loss is
    if head["loss_reduction"] == "mean":
        items = head["num_items_in_batch"]
        term = term / (labelled.clamp(min=1) if items is None else items)
    return out._replace(loss=out.loss + term, router_loss=term.detach())


def collect_router_loss(out, router: list | None) -> None:
    """Append `out`'s router-loss term (CausalLMOutput.router_loss) to `router` when both are there: the engine's
    loss and log-prob callers hand it to their step this way."""
    if router is not None and getattr(out, "router_loss", None) is not None:
        router.append(out.router_loss)


def set_router_loss(model: nn.Module, coef: float) -> None:
    """Have `model`'s fused forward add its router's load-balancing loss times `coef` to the training loss (0:
    not). `model` is an MoE of ROUTED_MODEL_TYPES given the chunked head."""
    if getattr(model.config, "model_type", None) not in ROUTED_MODEL_TYPES or not has_fused_head(model):
        raise ValueError(f"{type(model).__name__} has no router loss the fused forward adds")
    setattr(model, _ROUTER, float(coef))


def logit_scale(config) -> float | None:
    """What a listed family's head multiplies its logits by (None: nothing)."""
    if config.model_type in _MULTIPLIED:
        return config.logit_scale
    if config.model_type in _DIVIDED:
        return 1 / config.logits_scaling
    return None
