"""The GRPO objective: log-probabilities of completions under the policy and the clipped surrogate loss.

Pure tensor math, used by the GRPO job (rl/train.py) on batches from rl/rollouts.py. The variants people
run are options of one loss (rl.loss_norm, rl.clip_eps_high; advantages in rl/rollouts.py):
- GRPO (Shao et al. 2024, DeepSeekMath): a completion's token losses averaged, then completions averaged
  (`loss_norm = "sequence"`): a token of a short completion weighs more than one of a long completion.
- DAPO (Yu et al. 2025): every token of the batch weighs the same (`"token"`), the upper clip raised
  (`clip_eps_high` 0.28 against 0.2) so unlikely tokens with a positive advantage can still grow.
- Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"): a constant denominator, samples x
  rl.max_tokens (`"constant"`), so neither length nor the batch's token count rescales a token's gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from prime_train.engine.model import chunked_head
from prime_train.rl.ppo import final_hidden_states
from prime_train.rl.rollouts import Sample

LOSS_NORMS = ("token", "sequence", "constant")


@dataclass
class CompletionScores:
    """What one forward of the policy gives on a batch of samples, each [B, T] over completion tokens."""

    logp: torch.Tensor  # log-probability of each sampled token (sampling temperature applied)
    mask: torch.Tensor  # 1 on each row's completion tokens
    entropy: torch.Tensor | None = None  # of the tempered distribution at each token (nats, no gradient)
    values: torch.Tensor | None = None  # PPO: the value head's V_t, read where token t is predicted
    # an MoE with its router loss on (engine/hf_head.py): coef x its load-balancing loss over the forward, with its
    # gradient, for the step's objective to add
    router_loss: torch.Tensor | None = None


def completion_logprobs(model, samples: list[Sample], device, temperature: float, pad_id: int, *, entropy=False):
    """Log-probabilities of each sample's completion tokens under `model` (sampling temperature applied).

    Returns a [B, T] tensor of logprobs aligned to completion tokens and a [B, T] mask, and with
    `entropy=True` also the [B, T] entropy (nats, no gradient) of the tempered distribution at each token.
    """
    scores = score_completions(model, samples, device, temperature, pad_id, entropy=entropy)
    return (scores.logp, scores.mask, scores.entropy) if entropy else (scores.logp, scores.mask)


def score_completions(
    model, samples: list[Sample], device, temperature: float, pad_id: int, *, entropy=False, value_head=None
) -> CompletionScores:
    """completion_logprobs' forward, and with a `value_head` (rl/ppo.py) each token's value from the same forward's
    final hidden states."""
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for row, x in enumerate(seqs):
        ids[row, : len(x)] = torch.tensor(x)
    ids = ids.to(device)
    positions = torch.arange(width, device=device).expand(len(seqs), width)
    token_entropy = token_values = router_loss = None
    if chunked_head(model):
        # chunk by chunk (engine/loss.py): never the whole logits, rows x width x vocab x 4 bytes in fp32, and their
        # log-softmax and entropy as much again
        out = model(
            input_ids=ids, position_ids=positions, labels=ids, token_log_probs=True,
            temperature=temperature if temperature > 0 else 1.0, return_entropy=entropy,
        )  # fmt: skip
        logp = out.log_probs[:, :-1]  # position t predicts token t+1
        if entropy:
            token_entropy = out.entropy[:, :-1]
        hidden = [out.hidden_states]
        router_loss = getattr(out, "router_loss", None)
    else:
        with final_hidden_states(model) if value_head is not None else contextlib.nullcontext([]) as hidden:
            logits = model(input_ids=ids, position_ids=positions).logits[:, :-1].float()
        if temperature > 0:
            logits = logits / temperature
        all_logp = torch.log_softmax(logits, dim=-1)
        logp = all_logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # predicts token t+1
        if entropy:
            with torch.no_grad():
                token_entropy = -(all_logp.exp() * all_logp).sum(-1)
    if value_head is not None:
        token_values = value_head(hidden[-1][:, :-1])  # the state before token t+1, where its logprob comes from
    comp_width = max(len(s.completion_ids) for s in samples)
    mask = torch.zeros((len(seqs), comp_width), device=device)

    def completion_part(per_position: torch.Tensor | None) -> torch.Tensor | None:
        if per_position is None:
            return None
        out = torch.zeros((len(seqs), comp_width), device=device, dtype=per_position.dtype)
        for row, s in enumerate(samples):
            start = len(s.prompt_ids) - 1
            out[row, : len(s.completion_ids)] = per_position[row, start : start + len(s.completion_ids)]
        return out

    for row, s in enumerate(samples):
        mask[row, : len(s.completion_ids)] = 1.0
    return CompletionScores(
        completion_part(logp), mask, completion_part(token_entropy), completion_part(token_values), router_loss
    )


def token_weights(mask, loss_norm: str, *, tokens: float, samples: float, max_tokens: int):
    """Each completion token's weight in the loss, so that the weighted sum is the batch's loss.

    `tokens` and `samples` are the whole batch's counts (over every rank); `mask` is this chunk's [B, T] mask.
    "token": 1/tokens; "sequence": 1/(the completion's length x samples); "constant": 1/(samples x max_tokens).
    """
    if loss_norm == "token":
        return mask / max(1.0, tokens)
    if loss_norm == "sequence":
        lengths = mask.sum(-1, keepdim=True).clamp(min=1.0)
        return mask / lengths / max(1.0, samples)
    if loss_norm == "constant":
        return mask / (max(1.0, samples) * max_tokens)
    raise ValueError(f"rl.loss_norm must be one of {LOSS_NORMS}, got {loss_norm!r}")


def grpo_loss(
    new_logp, old_logp, mask, advantages, clip_eps: float, ref_logp=None, kl_coef: float = 0.0, *,
    clip_eps_high: float | None = None, weights=None,
):  # fmt: skip
    """Clipped surrogate on completion tokens, summed with `weights` (default: the mask, so the caller divides).

    `advantages`: one per completion [B] (GRPO), or one per completion token [B, T] (PPO's GAE).

    The ratio is clipped to [1 - clip_eps, 1 + clip_eps_high] (clip_eps_high None: clip_eps). Returns the loss,
    and the masked sums of the KL estimate and of the clipped-token indicator (for metrics).
    """
    high = clip_eps if clip_eps_high is None else clip_eps_high
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages[:, None] if advantages.dim() == 1 else advantages  # per completion, or per token (PPO)
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + high) * adv)
    per_token = -surrogate
    kl = torch.zeros_like(per_token)
    if ref_logp is not None and kl_coef > 0:
        diff = ref_logp - new_logp
        kl = torch.exp(diff) - diff - 1  # k3 estimator: unbiased, always >= 0
        per_token = per_token + kl_coef * kl
    # a token counts as clipped where the clip took its gradient away: beyond the bound in the advantage's direction
    clipped = ((ratio > 1 + high) & (adv > 0)) | ((ratio < 1 - clip_eps) & (adv < 0))
    w = mask if weights is None else weights
    return (per_token * w).sum(), (kl * mask).sum(), (clipped.float() * mask).sum()
