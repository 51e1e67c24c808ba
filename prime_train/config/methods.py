"""The sections of training methods that change what a job trains: [lora] (adapters on a frozen base), [dpo] and
[meta] (Reptile meta-learning, run.job = "meta")."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from prime_train.config.section import Section

# What lora.target_modules = "all-linear" means: every linear layer inside the decoder blocks (attention and MLP:
# q/k/v/o_proj and gate/up/down_proj in the Llama and Qwen families), never lm_head or the embeddings.
LORA_ALL_LINEAR = "all-linear"


def _check_names(key: str, names: list[str], kind: str, examples: str, one: str) -> None:
    """lora.<key>'s entries are dotted names, each once (ValueError naming the key otherwise)."""
    for name in names:
        if not re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", name):
            raise ValueError(
                f"lora.{key} entry {name!r} is not a {kind} name (dotted words such as {examples}; no patterns)"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"lora.{key} names {one} twice")


def target_names(entry: str, name: str) -> bool:
    """Whether a LoRA target entry (lora.target_modules, lora.target_parameters) names the layer or tensor `name`:
    it is the name, or the name ends in '.<entry>' (peft's rule). The engine and the calculator both match by it."""
    return name == entry or name.endswith("." + entry)


def adapter_scaling(alpha: float, rank: int, *, rslora: bool = False) -> float:
    """LoRA's multiplier of B @ A: alpha / rank, or rank-stabilised alpha / sqrt(rank) (peft's rule for both)."""
    return alpha / (math.sqrt(rank) if rslora else rank)


class LoraConfig(Section):
    rank: int = Field(
        0,
        ge=0,
        le=4096,
        description="LoRA rank r: each targeted linear layer keeps its weight W frozen and trains B (out × r) @ A "
        "(r × in) beside it; only these adapters train and are checkpointed. 0: off (the whole model trains).",
    )
    alpha: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description="The adapter's output is scaled by alpha / rank. Unset: 2 × rank (a scale of 2).",
    )
    rslora: bool = Field(
        False,
        description="Rank-stabilised LoRA (Kalajdzievski 2023; peft's use_rslora): the adapter's output is scaled by "
        "alpha / sqrt(rank) instead of alpha / rank, so a higher rank keeps learning at the same lr.",
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input (the frozen path has none)."
    )
    target_modules: Literal["all-linear"] | list[str] = Field(
        LORA_ALL_LINEAR,
        description="Linear layers that get an adapter, by name (a list, or names separated by commas): a layer "
        "whose name is the entry or ends in '.<entry>' ('q_proj', 'self_attn.o_proj'). 'all-linear': every linear "
        "layer of attention and MLP in each decoder block (q/k/v/o_proj, gate/up/down_proj for Llama and Qwen); "
        "lm_head and the embeddings never.",
    )
    target_parameters: list[str] = Field(
        default_factory=list,
        description="Fused expert tensors of a mixture-of-experts model that get an adapter too, by name (a list, "
        "or names separated by commas): a 3-D parameter of the decoder blocks whose name is the entry or ends in "
        "'.<entry>' ('gate_up_proj', 'experts.down_proj'). transformers runs the routed experts of Qwen3-MoE, "
        "Qwen2-MoE and Mixtral as one tensor per projection, not linear layers, so target_modules never reaches "
        "them; each expert gets its own rank-r adapter (peft's target_parameters). Needs lora.dropout = 0. "
        "Empty: the experts stay frozen.",
    )
    quantize: Literal["none", "nf4"] = Field(
        "none",
        description="'nf4': QLoRA, the frozen linear layers of the decoder blocks held in 4-bit NormalFloat through "
        "bitsandbytes (CUDA only, one process or DDP; pip install 'prime-train[qlora]'). 'none': the base as trained.",
    )
    merge_on_export: bool = Field(
        True,
        description="At the end write final/ as a merged HF model (W + scale · B @ A) besides final/adapter/ in "
        "PEFT's format; false: final/adapter/ only (load it with PeftModel.from_pretrained on the base model).",
    )

    @field_validator("target_modules", mode="before")
    @classmethod
    def _names_from_text(cls, value: Any) -> Any:
        # one name, or several separated by commas, as `--lora.target_modules q_proj,v_proj` gives them
        if isinstance(value, str) and value != LORA_ALL_LINEAR:
            return [part.strip() for part in value.split(",")]
        return value

    @field_validator("target_modules", mode="after")
    @classmethod
    def _names(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, str):
            return value
        if value == [LORA_ALL_LINEAR]:
            return LORA_ALL_LINEAR
        if not value:
            raise ValueError(f"lora.target_modules is empty: name linear layers, or use {LORA_ALL_LINEAR!r}")
        if LORA_ALL_LINEAR in value:
            raise ValueError(f"{LORA_ALL_LINEAR!r} stands alone: it already names every linear layer")
        _check_names("target_modules", value, "module", "'q_proj' or 'self_attn.q_proj'", "a layer")
        return value

    @field_validator("target_parameters", mode="before")
    @classmethod
    def _parameters_from_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",")] if value.strip() else []
        return value

    @field_validator("target_parameters", mode="after")
    @classmethod
    def _parameter_names(cls, value: list[str]) -> list[str]:
        _check_names("target_parameters", value, "parameter", "'gate_up_proj' or 'experts.down_proj'", "a tensor")
        return value

    @model_validator(mode="after")
    def _expert_adapters_without_dropout(self) -> LoraConfig:
        if self.target_parameters and self.dropout > 0:
            # an expert tensor's adapter is folded into the weight (W + B @ A) for the forward, so there is no
            # adapter input to drop out; peft refuses the combination
            raise ValueError(
                f"lora.dropout = {self.dropout:g} cannot apply to lora.target_parameters (the experts' adapters are "
                "added to their weights, not run on the input): set lora.dropout = 0, or leave the experts out"
            )
        return self

    @model_validator(mode="after")
    def _quantize_needs_an_adapter(self) -> LoraConfig:
        if self.quantize != "none" and not self.rank:
            raise ValueError(
                f"lora.quantize = {self.quantize!r} quantizes the frozen base under LoRA adapters and needs "
                "lora.rank > 0; set a rank (16 is common) or lora.quantize = 'none'"
            )
        return self

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (rank > 0)."""
        return self.rank > 0

    @property
    def scale_alpha(self) -> float:
        """alpha as applied: the configured value, else 2 × rank."""
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    @property
    def scaling(self) -> float:
        """What the adapter's B @ A is multiplied by: alpha / rank, or alpha / sqrt(rank) with lora.rslora."""
        return adapter_scaling(self.scale_alpha, self.rank, rslora=self.rslora)

    def unavailable(self, *, strategy: str, cuda: bool, bitsandbytes: bool) -> str | None:
        """Why this [lora] cannot run under data-parallel `strategy` ('none', 'ddp', 'fsdp', 'hsdp', or 'auto'),
        where `cuda` (a usable CUDA GPU) and `bitsandbytes` (the package importable) hold; None when it can.

        Pure: lint and preflight pass what they know of the target machine, the engine what it sees; one wording for
        both, and the job exits 78 with it (a configuration error, never retried)."""
        if self.quantize != "nf4":
            return None
        if not cuda:
            return "lora.quantize = 'nf4' needs a CUDA GPU (bitsandbytes' 4-bit kernels) and none is usable here"
        if not bitsandbytes:
            return (
                "lora.quantize = 'nf4' needs the bitsandbytes package, which is not installed: "
                "pip install 'prime-train[qlora]'"
            )
        if strategy in ("fsdp", "hsdp"):
            return (
                f"lora.quantize = 'nf4' is not supported with distributed.strategy = {strategy!r} (4-bit weights are "
                "not sharded here): train on one GPU or with 'ddp', or set lora.quantize = 'none'"
            )
        return None


class DPOConfig(Section):
    beta: float = Field(
        0.1, gt=0, le=1e3, description="Strength of the implicit KL to the reference (DPO's beta; IPO's tau)."
    )
    loss_type: Literal["sigmoid", "ipo", "hinge"] = Field(
        "sigmoid",
        description="'sigmoid': DPO's -log sigmoid(beta · margin); 'ipo': (margin - 1/(2·beta))²; 'hinge': "
        "relu(1 - beta · margin) (SLiC). The margin is the policy's log-ratio of chosen over rejected minus the "
        "reference's.",
    )
    label_smoothing: float = Field(
        0.0, ge=0.0, lt=0.5, description="sigmoid only: the fraction of pairs assumed mislabelled (conservative DPO)."
    )
    precompute_reference: bool = Field(
        False,
        description="Compute the reference's log-probs of every pair in one pass before training and keep them, "
        "instead of holding the reference model during training (saves its memory). With LoRA the reference is "
        "the base with the adapters switched off either way (no second copy).",
    )


class MetaConfig(Section):
    inner_steps: int = Field(
        5,
        ge=1,
        le=10_000,
        description="Reptile: optimizer steps of plain fine-tuning on one task (one micro-batch each) before the "
        "meta update; 1 makes Reptile joint training on the tasks sampled.",
    )
    inner_lr: float = Field(
        1e-3, gt=0, le=10, description="Learning rate of the inner steps (and of the eval's adaptation)."
    )
    inner_optimizer: Literal["adam", "sgd"] = Field(
        "adam",
        description="The inner steps' optimizer, fresh for each task: 'adam' (torch Adam, train.beta1/beta2/eps) "
        "or 'sgd' (plain gradient descent).",
    )
    outer_lr: float = Field(
        1.0,
        gt=0,
        le=1,
        description="Reptile's meta step size: the weights move this fraction of the way toward the mean of the "
        "task-adapted weights (1: to it), scaled by train.scheduler's schedule (warmup and decay).",
    )
    tasks_per_step: int = Field(
        1,
        ge=1,
        le=1024,
        description="Tasks sampled (with replacement, seeded by run.seed and the step) per meta update.",
    )
    eval_task: Literal["arithmetic", "reverse-text", "sorting"] | None = Field(
        None,
        description="The held-out built-in task of the eval: from the current weights, meta.adapt_steps steps of "
        "fine-tuning on it, then its held-out loss; it must not be among data.datasets. Unset: no adaptation eval.",
    )
    adapt_steps: int = Field(
        20, ge=1, le=100_000, description="Fine-tuning steps of the eval's adaptation on meta.eval_task."
    )
    adapt_target_loss: float | None = Field(
        None,
        gt=0,
        description="The eval also reports the adaptation steps it took to bring meta.eval_task's held-out loss to "
        "this (eval_adapt_steps_to_target; adapt_steps + 1 when not reached). Unset: not measured.",
    )


def metric_direction(metric: str, direction: str) -> str:
    """'minimize' or 'maximize' for `metric`: an explicit direction, else a loss or perplexity goes down and
    everything else (accuracy, exact match, reward, pass rate) up."""
    if direction != "auto":
        return direction
    return "minimize" if re.search(r"loss|ppl|perplexity", metric) else "maximize"


class EarlyStoppingConfig(Section):
    metric: str | None = Field(
        None,
        description="An evaluation metric (a key the job writes at each eval: eval_loss, eval_exact_match, "
        "eval_preference_accuracy, eval_pass_rate, ...). Unset: no early stopping. The run ends as done, with a "
        "checkpoint and final/, after `patience` evaluations in a row without improvement.",
    )
    patience: int = Field(3, ge=1, le=1_000_000, description="Evaluations in a row without improvement before the end.")
    min_delta: float = Field(
        0.0, ge=0, description="An improvement smaller than this (in the metric's units) does not count."
    )
    direction: Literal["auto", "minimize", "maximize"] = Field(
        "auto", description="'auto': minimize losses and perplexities, maximize everything else."
    )


class KeepBestConfig(Section):
    metric: str | None = Field(
        None,
        description="An evaluation metric: each eval that improves on the best so far saves a checkpoint there "
        "and keeps it out of retention (checkpoints/best.json names it) until a better one comes. Unset: off.",
    )
    direction: Literal["auto", "minimize", "maximize"] = Field(
        "auto", description="'auto': minimize losses and perplexities, maximize everything else."
    )
    export: bool = Field(False, description="final/ holds the best checkpoint's weights instead of the last step's.")
