"""The [rl] section: environments, rollouts, GRPO's and PPO's loss keys (re-exported by config/schema.py)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from prime_train.config.section import Section


class RLConfig(Section):
    environment: str = Field(
        "reverse-text",
        description="A built-in environment (reverse-text, arithmetic, sorting; 'reward-model': a task's prompts "
        "scored by the reward model at rl.env_args.path), 'pkg.module:load_environment', or 'verifiers:<env id>'.",
    )
    env_args: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Keyword arguments for the environment's loader."
    )
    prompts_per_step: int = Field(8, ge=1, description="Prompts per optimizer step.")
    group_size: int = Field(
        8,
        ge=1,
        description="Completions sampled per prompt; GRPO's advantages compare them within the group (2 or more). "
        "PPO may sample one.",
    )
    max_tokens: int = Field(16, ge=1, description="Longest completion, in tokens.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling of rollouts.")
    max_async_level: int = Field(1, ge=0, description="Rollouts may come from a policy at most this many steps old.")
    clip_eps: float = Field(0.2, gt=0, description="PPO-style ratio clipping of the policy-gradient loss.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of a KL penalty to the initial (reference) model.")
    clip_eps_high: float | None = Field(
        None,
        gt=0,
        description="Upper clip of the ratio, 1 + clip_eps_high (DAPO's clip-higher uses 0.28); unset: clip_eps.",
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group",
        description="Advantage = reward - its group's mean, divided by the group's reward std (GRPO), the batch's "
        "('batch'), or nothing ('none', Dr. GRPO).",
    )
    loss_norm: Literal["token", "sequence", "constant"] = Field(
        "token",
        description="How token losses are averaged: over the batch's tokens ('token', DAPO), per completion then "
        "over completions ('sequence', GRPO), or over completions x max_tokens ('constant', Dr. GRPO).",
    )
    drop_zero_variance_groups: bool = Field(
        False,
        description="Leave out of the loss the groups whose completions all scored the same (DAPO's dynamic "
        "sampling, without refilling): their advantage is zero, they would only dilute the average.",
    )
    mask_truncated: bool = Field(
        False,
        description="Leave out of the loss completions cut off by max_tokens (DAPO's overlong filtering).",
    )
    optimizer_steps: int = Field(
        1,
        ge=1,
        description="Optimizer steps per rollout batch: the batch is split into this many mini-batches, each "
        "one step (the ratio and its clip matter from the second on). The LR schedule counts rollout batches.",
    )
    budget_margin_tokens: int = Field(
        8, ge=0, description="Tokens kept free between prompt + max_tokens and inference.max_model_len."
    )
    tool_executor: Literal["local", "remote"] = Field(
        "local", description="Where a tool-calling environment runs its tools."
    )
    eval_prompts: int = Field(64, ge=0, description="Held-out prompts for the mean-reward eval.")
    algorithm: Literal["grpo", "ppo"] = Field(
        "grpo",
        description="'grpo': advantages from each prompt's group of completions; 'ppo': a learned value head and "
        "GAE advantages per token (rl.gamma, rl.gae_lambda), with a clipped value loss.",
    )
    gamma: float = Field(1.0, ge=0, le=1, description="PPO: discount of future rewards per token.")
    # 1, as verl's PPO: every token of a completion gets its whole reward minus its value (at 0.95 the first token of
    # a 16-token runaway answer gets 0.46 of the blame of its last). On the tiny task PPO at lr 2e-3 collapsed into
    # one repeated letter on 2 of 2 seeds at 0.95 and on neither at 1.0 (README's PPO section)
    gae_lambda: float = Field(1.0, ge=0, le=1, description="PPO: GAE's lambda (1: Monte Carlo returns, 0: TD).")
    value_clip: float | None = Field(
        0.2, gt=0, description="PPO: clip each new value to this distance of the rollout's value; unset: no clip."
    )
    vf_coef: float = Field(0.1, ge=0, description="PPO: weight of the value loss beside the policy loss.")

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _none_is_a_name(cls, value: Any) -> Any:
        # `--rl.scale_rewards none` reads as null on the command line: here it is the name of Dr. GRPO's choice
        return "none" if value is None else value
