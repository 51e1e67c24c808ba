"""The GRPO objective: log-probabilities of completions under the policy and the clipped surrogate loss.

Pure tensor math, used by the GRPO job (rl/train.py) on batches from rl/rollouts.py.
"""

from __future__ import annotations

import torch

from prime_train.rl.rollouts import Sample


def completion_logprobs(model, samples: list[Sample], device, temperature: float, pad_id: int):
    """Log-probabilities of each sample's completion tokens under `model` (sampling temperature applied).

    Returns a [B, T] tensor of logprobs aligned to completion tokens and a [B, T] mask.
    """
    seqs = [s.prompt_ids + s.completion_ids for s in samples]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for row, x in enumerate(seqs):
        ids[row, : len(x)] = torch.tensor(x)
    ids = ids.to(device)
    positions = torch.arange(width, device=device).expand(len(seqs), width)
    logits = model(input_ids=ids, position_ids=positions).logits[:, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # predicts token t+1
    comp_width = max(len(s.completion_ids) for s in samples)
    out = torch.zeros((len(seqs), comp_width), device=device)
    mask = torch.zeros((len(seqs), comp_width), device=device)
    for row, s in enumerate(samples):
        start = len(s.prompt_ids) - 1
        n = len(s.completion_ids)
        out[row, :n] = logp[row, start : start + n]
        mask[row, :n] = 1.0
    return out, mask


def grpo_loss(new_logp, old_logp, mask, advantages, clip_eps: float, ref_logp=None, kl_coef: float = 0.0):
    """Clipped surrogate on completion tokens; sum over tokens (the caller divides by the batch's tokens)."""
    ratio = torch.exp(new_logp - old_logp)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    kl = torch.zeros_like(per_token)
    if ref_logp is not None and kl_coef > 0:
        diff = ref_logp - new_logp
        kl = torch.exp(diff) - diff - 1  # k3 estimator: unbiased, always >= 0
        per_token = per_token + kl_coef * kl
    clipped = ((ratio - 1).abs() > clip_eps).float()
    return (per_token * mask).sum(), (kl * mask).sum(), (clipped * mask).sum()
