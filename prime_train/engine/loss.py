"""Causal-LM cross-entropy fused with the output projection, chunked over tokens.

The plain path (`lm_head` then `F.cross_entropy` on the logits) keeps a tokens x vocab logits tensor, its fp32
copy and the softmax for backward: at 8k tokens and a 128k vocabulary that is 4 GB per copy. Here the projection
and the loss run one chunk of tokens at a time and the gradients of the hidden states and of the weight are
computed in the same pass, so nothing of size tokens x vocab outlives a chunk: peak extra memory is about
chunk_size x vocab x 4 bytes (x2 while a chunk's gradient is formed), whatever the number of tokens. A chunk is
1024 tokens, fewer above a 64k vocabulary so that its fp32 logits stay within 256 MiB (chunk_tokens). The
matmul FLOPs equal the plain path's (logits forward, then the two gradient matmuls), none are recomputed.

When to use it: when tokens x vocab x 4 bytes is large against the memory left for activations (big vocabularies:
Llama 3's 128k, Qwen's 152k; long sequences). At a tiny vocabulary the plain path is as good and simpler.

Labels are already shifted (label t is the target of position t) and use the HF convention: `ignore_index`
(-100) marks positions without a loss. The mean is over a token count the caller may pass in: the engine counts
labelled tokens on the host before copying the batch, so dividing by them needs no device-to-host sync.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
CHUNK_ENTRIES = 1024 * 65536  # logits entries a chunk holds at most: 256 MiB in fp32


def chunk_tokens(vocab: int) -> int:
    """Tokens a chunk when the caller names none: 1024, or fewer where the vocabulary is larger than 64k, so that a
    chunk's fp32 logits stay within CHUNK_ENTRIES (512 at Llama 3's 128,256, 384 at Qwen's 151,936, 256 at 256k),
    a multiple of 64, at least 64. Fewer tokens a chunk means more, smaller matmuls; 512 x 128k is still a large one."""
    return max(64, min(1024, CHUNK_ENTRIES // max(1, vocab) // 64 * 64))


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    # what autocast would give F.linear here: the autocast dtype when it is on, else the tensors' own
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total (fp32) += a @ b: in fp32 into total itself (no product buffer, no second pass); in a half dtype the
    product, added with its cast done in the addition's kernel (no fp32 copy of it: 2 GiB at Llama 3 8B's lm_head)."""
    if a.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total += a @ b


def _chunk_target_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    ignore_index: int,
    softcap: float | None = None,
    slope: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """fp32 log_softmax(cap(hidden @ weight.T) / temperature) of one chunk, each row's value at its label (0 where
    ignored), the mask of the rows that count, and with `slope` (backward's) d cap(z) / dz, else None.

    cap(z) = softcap * tanh(z / softcap) where `softcap` is given (Gemma 2's final_logit_softcapping), else z."""
    logits = (hidden @ weight.T).float()
    cap_slope = None
    if softcap is not None:
        logits.div_(softcap).tanh_()
        if slope:
            cap_slope = 1.0 - logits.square()  # d(c tanh(z / c)) / dz = 1 - tanh^2: a second chunk buffer
        logits.mul_(softcap)
    if temperature != 1.0:
        logits.div_(temperature)
    log_probs = torch.log_softmax(logits, dim=-1)
    valid = labels != ignore_index
    picked = log_probs.gather(1, torch.where(valid, labels, 0)[:, None]).squeeze(1)
    return log_probs, torch.where(valid, picked, 0.0), valid, cap_slope


def _chunk_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    per_token: torch.Tensor | None = None,
    start: int = 0,
    softcap: float | None = None,
    slope: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Summed CE of one chunk, and what its gradient needs: the fp32 log-probabilities, the labels with ignored
    rows pointed at class 0, and the mask of the rows that count. With `per_token` (an fp32 buffer of every token's
    loss, empty when not wanted) the chunk's losses are written at `start`.

    One log_softmax pass over the chunk's logits gives both the loss (minus the targets' log-probabilities) and,
    exponentiated in place, the softmax of the gradient: fewer passes over chunk x vocab than logsumexp, a
    subtraction and an exp (what eager mode on CPU pays for; a compiled graph fuses either way)."""
    log_probs, picked, valid, cap_slope = _chunk_target_log_probs(
        hidden, weight, labels, 1.0, ignore_index, softcap, slope
    )
    losses = -picked
    if per_token is not None and per_token.numel():
        per_token[start : start + len(losses)] = losses.detach()
    return losses.sum(), log_probs, torch.where(valid, labels, 0), valid, cap_slope


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum_t CE(hidden_t @ weight.T, label_t) * scale, with both gradients formed chunk by chunk in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, chunk_size: int, ignore_index: int, per_token, softcap):
        dtype = _matmul_dtype(hidden, weight)
        want_weight = ctx.needs_input_grad[1]  # False for a frozen lm_head (LoRA): neither its matmul nor its buffer
        with torch.autocast(hidden.device.type, enabled=False):
            h_all, w = hidden.to(dtype), weight.to(dtype)
            grad_hidden = torch.empty_like(hidden)
            # the weight's gradient sums over every chunk: accumulate it in fp32 whatever the compute dtype
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], chunk_size):
                h = h_all[start : start + chunk_size]
                y = labels[start : start + chunk_size]
                part, grad_logits, safe, valid, cap_slope = _chunk_log_probs(
                    h, w, y, ignore_index, per_token, start, softcap, slope=True
                )
                total = total + part
                # d CE / d logits = softmax - onehot(label), zero on ignored rows, times the mean's scale: formed in
                # place over the log-probabilities, no further chunk x vocab buffer
                grad_logits.exp_()
                grad_logits.scatter_add_(1, safe[:, None], torch.full_like(safe[:, None], -1.0, dtype=torch.float32))
                grad_logits.mul_(torch.where(valid, scale, 0.0)[:, None])
                if cap_slope is not None:
                    grad_logits.mul_(cap_slope)  # through the soft cap to the projection's output
                grad_logits = grad_logits.to(dtype)
                grad_hidden[start : start + chunk_size] = (grad_logits @ w).to(hidden.dtype)
                if not want_weight:
                    continue
                _accumulate(grad_weight, grad_logits.T, h)
        ctx.want_weight = want_weight
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if want_weight else None)
        return total * scale

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_weight = grad_weight * grad_output if ctx.want_weight else None
        return grad_hidden * grad_output, grad_weight, None, None, None, None, None, None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_items: torch.Tensor | int | None = None,
    reduction: Literal["mean", "sum"] = "mean",
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    per_token: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Cross-entropy of `hidden @ weight.T` against `labels`, never holding more than one chunk of logits.

    hidden: (..., H) final hidden states; weight: (V, H) the output projection; labels: (...) shifted targets.
    reduction "mean" divides the sum by `num_items` (the labelled-token count, a host int or a device tensor; for a
    micro-batch of a larger batch pass the whole batch's count) or, when it is None, by this call's own count,
    computed on the device. "sum" returns the sum. The result is an fp32 scalar. `per_token` (fp32, one entry per
    label, no gradient): filled with each token's unscaled loss (0 where ignored) in the same pass, for callers that
    need per-sequence losses (data.curriculum = 'self_paced') without a second forward. `chunk_size`: tokens a chunk,
    chunk_tokens(vocab) when None. `softcap`: the logits are softcap * tanh(logits / softcap) (Gemma 2's final
    logits), and backward goes through it (one more chunk buffer, its slope).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    chunk_size = chunk_tokens(weight.shape[0]) if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    if reduction == "sum":
        scale = torch.ones((), dtype=torch.float32, device=hidden.device)
    elif num_items is None:
        scale = 1.0 / (labels != ignore_index).sum().clamp(min=1).float()
    else:
        scale = 1.0 / torch.as_tensor(num_items, dtype=torch.float32, device=hidden.device)
    if per_token is None:
        per_token = torch.empty(0, dtype=torch.float32, device=hidden.device)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _FusedLinearCrossEntropy.apply(
            hidden, weight, labels, scale, chunk_size, ignore_index, per_token, softcap
        )
    # evaluation: the loss alone, still one chunk of logits at a time
    dtype = _matmul_dtype(hidden, weight)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        for start in range(0, hidden.shape[0], chunk_size):
            part, *_ = _chunk_log_probs(
                hidden[start : start + chunk_size].to(dtype),
                weight.to(dtype),
                labels[start : start + chunk_size],
                ignore_index,
                per_token,
                start,
                softcap,
            )
            total = total + part
    return total * scale


def _token_log_probs(hidden, weight, labels, temperature: float, chunk_size: int, ignore_index: int, entropy, softcap):
    """Forward of chunked_token_log_probs: [N] fp32 log-probs; `entropy` (empty when not wanted) filled in place."""
    dtype = _matmul_dtype(hidden, weight)
    out = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    with torch.autocast(hidden.device.type, enabled=False):
        w = weight.to(dtype)
        for start in range(0, hidden.shape[0], chunk_size):
            log_probs, picked, _, _ = _chunk_target_log_probs(
                hidden[start : start + chunk_size].to(dtype), w, labels[start : start + chunk_size], temperature,
                ignore_index, softcap,
            )  # fmt: skip
            out[start : start + chunk_size] = picked
            if entropy.numel():
                entropy[start : start + chunk_size] = -(log_probs.exp() * log_probs).sum(-1)
    return out


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """log softmax(hidden_t @ weight.T / temperature)[label_t] for each t, one chunk of logits at a time.

    Unlike _FusedLinearCrossEntropy the gradient cannot be formed in forward: each token's upstream gradient
    (a DPO pair's sigmoid weight, a GRPO token's advantage) is known only in backward. Backward forms each chunk's
    logits again instead of keeping tokens x vocab from forward: one more chunk matmul, no full logits ever."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature: float, chunk_size: int, ignore_index: int, entropy, softcap):
        ctx.save_for_backward(hidden, weight, labels)
        ctx.dtype, ctx.temperature, ctx.chunk_size, ctx.ignore_index, ctx.softcap = (
            _matmul_dtype(hidden, weight), temperature, chunk_size, ignore_index, softcap,
        )  # fmt: skip
        return _token_log_probs(hidden, weight, labels, temperature, chunk_size, ignore_index, entropy, softcap)

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels = ctx.saved_tensors
        dtype, chunk_size = ctx.dtype, ctx.chunk_size
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # summed over every chunk in fp32 whatever the compute dtype; not formed at all for a frozen lm_head (LoRA)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for start in range(0, hidden.shape[0], chunk_size):
                h = hidden[start : start + chunk_size].to(dtype)
                grad, _, valid, cap_slope = _chunk_target_log_probs(
                    h, w, labels[start : start + chunk_size], ctx.temperature, ctx.ignore_index, ctx.softcap, True
                )
                # d logp[label] / d logits = (onehot(label) - softmax) / temperature, times the token's gradient:
                # formed in place over the chunk's log-probabilities
                g = torch.where(valid, grad_out[start : start + chunk_size].float(), 0.0) / ctx.temperature
                grad.exp_().mul_(-g[:, None])
                grad.scatter_add_(1, torch.where(valid, labels[start : start + chunk_size], 0)[:, None], g[:, None])
                if cap_slope is not None:
                    grad.mul_(cap_slope)  # through the soft cap to the projection's output
                grad = grad.to(dtype)
                if want_hidden:
                    grad_hidden[start : start + chunk_size] = (grad @ w).to(hidden.dtype)
                if want_weight:
                    _accumulate(grad_weight, grad.T, h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def chunked_token_log_probs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    ignore_index: int = IGNORE_INDEX,
    entropy: bool = False,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each label's log-probability under softmax(hidden @ weight.T / temperature), never holding more than one
    chunk of logits: what DPO sums per sequence and GRPO/PPO weigh per token.

    hidden: (..., H); weight: (V, H); labels: (...) shifted targets, `ignore_index` where none. Returns fp32
    log-probs shaped as labels (0 where ignored), differentiable in hidden and weight, and with `entropy` each
    position's entropy of the tempered distribution (fp32, no gradient), else None. `softcap` as in
    chunked_cross_entropy, applied before the temperature (transformers caps the logits, a sampler then tempers)."""
    chunk_size = chunk_tokens(weight.shape[0]) if chunk_size is None else chunk_size
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, not {temperature}")
    shape = labels.shape
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1)
    ent = torch.zeros(labels.shape[0] if entropy else 0, dtype=torch.float32, device=hidden.device)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        out = _ChunkedTokenLogProbs.apply(
            hidden, weight, labels, float(temperature), chunk_size, ignore_index, ent, softcap
        )
    else:
        out = _token_log_probs(hidden, weight, labels, float(temperature), chunk_size, ignore_index, ent, softcap)
    return out.view(shape), (ent.view(shape) if entropy else None)


def reference_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    num_items: torch.Tensor | int | None = None,
    reduction: Literal["mean", "sum"] = "mean",
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """The unchunked loss chunked_cross_entropy must equal: full logits, then F.cross_entropy."""
    logits = F.linear(hidden.reshape(-1, hidden.shape[-1]), weight).float()
    total = F.cross_entropy(logits, labels.reshape(-1), ignore_index=ignore_index, reduction="sum")
    if reduction == "sum":
        return total
    count = (labels != ignore_index).sum().clamp(min=1) if num_items is None else num_items
    return total / count
