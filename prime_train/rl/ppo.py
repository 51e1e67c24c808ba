"""PPO's pieces beside the GRPO loss: the value head, GAE over completion tokens, the clipped value loss.

Pure tensor math and one small module, used by the PPO job (rl/train.py PPOJob) with rl.algorithm = "ppo".
The value head is a Linear(hidden, 1) on the policy's own final hidden states (the input of its output
projection): one trunk serves the policy and the value, so one forward gives a token's logprob and its value,
and there is no second model to hold, load or shard. It starts at zero (every value 0: the first advantages
are the discounted rewards themselves), trains in full beside the policy (with LoRA too, beside the adapters),
lives in the checkpoint (the job's train state) and is never part of an HF export (final/, weights/step-N),
which stays the policy alone.

A completion of n tokens is an episode of n actions: token t's value V_t is read at the position that predicts
it (where its logprob comes from), the sequence reward is paid on the last token and 0 elsewhere, and after the
last token the episode ends (V_n = 0). GAE (Schulman et al. 2016): delta_t = r_t + gamma V_{t+1} - V_t,
A_t = delta_t + gamma lambda A_{t+1}; returns R_t = A_t + V_t are the value's targets.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


class ValueHead(nn.Module):
    """A scalar value per position from the final hidden states, in float32; zero at start."""

    def __init__(self, hidden_size: int, device: torch.device | str | None = None):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1, device=device, dtype=torch.float32)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, T, hidden] (any float dtype) -> [B, T] float32, outside autocast: a value is a number, kept exact."""
        with torch.autocast(hidden.device.type, enabled=False):
            return self.proj(hidden.float()).squeeze(-1)


@contextlib.contextmanager
def final_hidden_states(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block, each forward of `model` appends its final hidden states [B, T, hidden] to the list yielded.

    They are the input of the output projection (get_output_embeddings(): HF's lm_head, the native decoder's),
    caught by a forward pre-hook, so the same forward gives logits and hidden states through DDP, FSDP and
    activation checkpointing alike, with the gradient path to the trunk intact.
    """
    from prime_train.engine.export import unwrap_model

    caught: list[torch.Tensor] = []
    head = unwrap_model(model).get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda _module, args: caught.append(args[0]))
    try:
        yield caught
    finally:
        handle.remove()


def gae(values: torch.Tensor, mask: torch.Tensor, rewards: torch.Tensor, gamma: float, lam: float):
    """Advantages and returns per completion token.

    `values` [B, T]: V_t of each completion token (0 where `mask` is 0); `mask` [B, T]: each row's completion
    tokens, from the first, padded at the end; `rewards` [B]: each completion's reward, paid on its last token.
    Returns (advantages, returns), both [B, T] and 0 off the mask.
    """
    mask = mask.to(values.dtype)
    values = values * mask
    lengths = mask.sum(-1).long()
    token_rewards = torch.zeros_like(values)
    rows = torch.arange(values.size(0), device=values.device)
    has = lengths > 0
    token_rewards[rows[has], lengths[has] - 1] = rewards.to(values.dtype)[has]
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    width = values.size(1)
    for t in reversed(range(width)):
        # past a row's last token the episode has ended: no next value, nothing carried back
        following = mask[:, t + 1] if t + 1 < width else torch.zeros_like(running)
        next_value = values[:, t + 1] * following if t + 1 < width else torch.zeros_like(running)
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * following * running
        advantages[:, t] = running * mask[:, t]
    return advantages, (advantages + values) * mask


def whiten(x: torch.Tensor, mask: torch.Tensor, total: torch.Tensor, total_sq: torch.Tensor, count: torch.Tensor):
    """`x` shifted to mean 0 and scaled to std 1 over the batch, from the batch's sums (every rank's) of x, x^2
    and the mask; 0 off the mask."""
    n = count.clamp(min=1.0)
    mean = total / n
    var = (total_sq / n - mean * mean).clamp(min=0.0)
    return (x - mean) / (var.sqrt() + 1e-8) * mask


def clipped_value_loss(values, old_values, returns, mask, clip: float | None):
    """Per token 0.5 max((V - R)^2, (clip(V, V_old - clip, V_old + clip) - R)^2) (no clip: 0.5 (V - R)^2),
    0 off the mask; and the indicator of the tokens where the clipped term was the larger (for metrics)."""
    loss = (values - returns) ** 2
    clipped = torch.zeros_like(loss)
    if clip is not None:
        bounded = old_values + torch.clamp(values - old_values, -clip, clip)
        loss_clipped = (bounded - returns) ** 2
        clipped = (loss_clipped > loss).to(loss.dtype)
        loss = torch.maximum(loss, loss_clipped)
    return 0.5 * loss * mask, clipped * mask


def explained_variance_from_sums(sums: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the batch's tokens, from the sums [n, sum R, sum R^2, sum (R-V), sum (R-V)^2]:
    1 when the values predict the returns, 0 when they do no better than the mean, negative when worse."""
    n, r, r2, d, d2 = sums.unbind()
    n = n.clamp(min=1.0)
    var_r = r2 / n - (r / n) ** 2
    var_d = d2 / n - (d / n) ** 2
    return torch.where(var_r > 1e-12, 1.0 - var_d / var_r.clamp(min=1e-12), torch.zeros_like(var_r))
