"""LoRA and QLoRA through peft, on the native decoder and on transformers' models alike.

`apply_lora` puts peft's LoRA layers into the model in place with `peft.inject_adapter_in_model`, not
`get_peft_model`: the native decoder (engine/llama.py) is a plain nn.Module, not a PreTrainedModel, and
`get_peft_model` would wrap either model in a PeftModel whose `base_model.model.` prefix moves the decoder layers
that parallelize, FSDP2 and activation checkpointing find at `model.model.layers`. Injected, the model keeps its
class, its forward and its layers; each targeted `nn.Linear` becomes peft's `lora.Linear` holding the frozen layer
as `base_layer` beside `lora_A` / `lora_B`, so the state dict names change from `...q_proj.weight` to
`...q_proj.base_layer.weight` plus `...q_proj.lora_A.default.weight` and `...q_proj.lora_B.default.weight`.

Apply it after build_model and before parallel.parallelize (activation checkpointing, compile, then DDP or FSDP2):
FSDP2 shards each decoder layer with its frozen base and its trainable adapters in one unit, which fully_shard
supports; the non-reentrant checkpoint wrapper gives the adapters their gradients although the frozen embedding's
output needs none. Every rank must call it with the same torch RNG state (lora_A is random-initialised), as the loop's
set_seed gives them: FSDP2 keeps each rank's own slice without broadcasting.

What leaves the process:
- checkpoints: the adapters and their optimizer state only (`checkpoint_state` / `load_checkpoint_state`, for
  TrainState); the base is what model.path (or the seed) gives again at every start. The adapter's
  identity (`adapter_identity`: rank, alpha, targets) goes into meta.json, and `check_resume_compatible` refuses a
  resume whose checkpoint was made with other settings before anything is loaded.
- export: `save_peft_adapter` writes PEFT's own format (adapter_config.json + adapter_model.safetensors, keys
  `base_model.model.<HF name>.lora_A.weight`) that `PeftModel.from_pretrained(base, dir)` loads; `merged_state_dict`
  folds W + (alpha / r) · B @ A into plain HF names for a merged model, written by export.export_hf.

QLoRA (lora.quantize = "nf4"): `quantize_base_nf4` swaps the decoder blocks' nn.Linear layers for bitsandbytes'
`Linear4bit` (NF4, bf16 compute) through its documented `Params4bit` API before the adapters go in; peft then puts
its bitsandbytes LoRA layer on them. CUDA only; `LoraConfig.unavailable` says why it cannot run elsewhere.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from prime_train.config.methods import adapter_scaling, target_names
from prime_train.config.schema import LORA_ALL_LINEAR, LoraConfig
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import decoder_layers

logger = logging.getLogger("prime_train.engine")

ADAPTER_NAME = "default"  # peft's name of the one adapter; it appears in the live model's parameter names
ADAPTER_CONFIG_FILE = "adapter_config.json"  # PEFT's file names (peft.utils.CONFIG_NAME / SAFETENSORS_WEIGHTS_NAME)
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# the prefix PeftModel puts before the base model's own names: PeftModel -> LoraModel (.base_model) -> model (.model)
PEFT_PREFIX = "base_model.model."
# wrappers whose submodule name shows in parameter names but not in state-dict keys
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def _linear_types() -> tuple[type, ...]:
    types: list[type] = [nn.Linear]
    try:  # GPT-2 style models keep their projections in transformers' Conv1D, which peft's LoRA also takes
        from transformers.pytorch_utils import Conv1D

        types.append(Conv1D)
    except ImportError:  # pragma: no cover - transformers is an engine dependency
        pass
    return tuple(types)


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP (`.module`) and torch.compile (`._orig_mod`); FSDP2 wraps in place."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def _clean(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    return [(_clean(name), m) for name, m in _unwrap(model).named_modules() if isinstance(m, LoraLayer)]


def has_lora(model: nn.Module) -> bool:
    """Whether `model` (or the model inside DDP / compile wrappers) has LoRA adapters in it."""
    return bool(getattr(_unwrap(model), "peft_config", None)) and bool(_lora_layers(model))


def is_adapter_key(name: str) -> bool:
    """Whether a state-dict key (or parameter name) is an adapter weight: lora_A / lora_B of some layer."""
    return ".lora_A." in name or ".lora_B." in name


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct names (last name component) of the linear layers inside the decoder blocks, sorted: what
    lora.target_modules may name and what 'all-linear' means for this model."""
    linear = _linear_types()
    names = set()
    for layer in decoder_layers(model):
        for name, module in layer.named_modules():
            if isinstance(module, linear) and name:
                names.add(_clean(name).rsplit(".", 1)[-1])
    return sorted(names)


def resolve_targets(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """The layer names LoRA is applied to: 'all-linear' resolved against the model, or the configured names, each
    checked to name at least one linear layer of a decoder block (EngineConfigError listing them otherwise)."""
    available = linear_module_names(model)
    if cfg.target_modules == LORA_ALL_LINEAR:
        if not available:
            raise EngineConfigError(
                f"lora.target_modules = {LORA_ALL_LINEAR!r}: {type(_unwrap(model)).__name__} has no linear layers in "
                "its decoder blocks to put adapters on"
            )
        return available
    linear = _linear_types()
    in_blocks = [
        _clean(name)
        for layer in decoder_layers(model)
        for name, module in layer.named_modules()
        if isinstance(module, linear) and name
    ]
    unmatched = [t for t in cfg.target_modules if not any(target_names(t, n) for n in in_blocks)]
    if unmatched:
        shown = ", ".join(repr(t) for t in unmatched)
        raise EngineConfigError(
            f"lora.target_modules: {shown} {'matches' if len(unmatched) == 1 else 'match'} no linear layer in the "
            f"decoder blocks of {type(_unwrap(model)).__name__}. Its linear layers are: {', '.join(available)} "
            f"(an entry names the layers whose name is it or ends in '.<entry>'), or use {LORA_ALL_LINEAR!r}"
        )
    return list(cfg.target_modules)


def _block_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The 3-D parameters of the decoder blocks (fused expert stacks: experts x out x in, or x in x out), named inside
    their block ('mlp.experts.gate_up_proj'), each name once."""
    seen: dict[str, torch.Tensor] = {}
    for layer in decoder_layers(model):
        for name, param in layer.named_parameters():
            if param.dim() == 3:
                seen.setdefault(_clean(name).replace(".base_layer", ""), param)
    return sorted(seen.items())


def expert_parameter_names(model: nn.Module) -> list[str]:
    """The distinct names (last name component) of the decoder blocks' fused expert tensors, sorted: what
    lora.target_parameters may name ('down_proj', 'gate_up_proj' for Qwen3-MoE)."""
    return sorted({name.rsplit(".", 1)[-1] for name, _ in _block_tensors(model)})


def resolve_target_parameters(model: nn.Module, cfg: LoraConfig) -> list[str]:
    """lora.target_parameters, each checked to name at least one fused expert tensor of a decoder block and nothing
    else of the model (EngineConfigError listing the model's expert tensors otherwise); sorted, as peft nests the
    wrappers of one module in its parameters' order whatever the list's."""
    if not cfg.target_parameters:
        return []
    model_type = type(_unwrap(model)).__name__
    experts = [name for name, _ in _block_tensors(model)]
    if not experts:
        raise EngineConfigError(
            f"lora.target_parameters = {cfg.target_parameters!r}: {model_type} has no fused expert tensors in its "
            "decoder blocks (it is not a mixture-of-experts model transformers runs with fused experts, such as "
            "Qwen3-MoE, Qwen2-MoE or Mixtral); leave lora.target_parameters empty and name linear layers in "
            "lora.target_modules"
        )

    # peft matches an entry against every parameter of the model by the same rule: one reaching a tensor that is not
    # an expert stack (a norm's weight, a router's) is refused here rather than adapted by surprise
    others = [_clean(n).replace(".base_layer", "") for n, p in _unwrap(model).named_parameters() if p.dim() != 3]
    problems = []
    for entry in cfg.target_parameters:
        if stray := next((n for n in others if target_names(entry, n) and not is_adapter_key(n)), None):
            problems.append(f"{entry!r} names {stray}, which is not a fused expert tensor")
        elif not any(target_names(entry, n) for n in experts):
            problems.append(f"{entry!r} matches no fused expert tensor in the decoder blocks")
    if problems:
        raise EngineConfigError(
            f"lora.target_parameters: {'; '.join(problems)} of {model_type}. Its expert tensors are: "
            f"{', '.join(expert_parameter_names(model))} (an entry names the tensors whose name is it or ends in "
            "'.<entry>')"
        )
    return sorted(cfg.target_parameters)


def _peft_config(
    cfg: LoraConfig,
    targets: list[str],
    *,
    parameters: list[str] | None = None,
    fan_in_fan_out: bool = False,
    lm_head: bool = True,
):
    from peft import LoraConfig as PeftLoraConfig

    # the adapters go into the decoder blocks only: lm_head is the native model's loss weight (engine/loss.py reads
    # it directly, so an adapter there would never be used) and, tied, the embedding too (a merge would change both)
    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.scale_alpha,
        use_rslora=cfg.rslora,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        target_parameters=parameters or None,
        exclude_modules=["lm_head"] if lm_head else None,  # a reward model has none (peft warns of a no-op)
        fan_in_fan_out=fan_in_fan_out,
        bias="none",
        task_type="CAUSAL_LM",
    )


def apply_lora(
    model: nn.Module,
    cfg: LoraConfig,
    *,
    device: torch.device | str | None = None,
    strategy: str = "none",
    train_in_full: tuple[str, ...] = (),
) -> nn.Module:
    """Put LoRA adapters into `model` (in place, returned) and freeze everything else but the modules
    `train_in_full` names (the reward job's score head: it trains whole, outside peft, as peft's modules_to_save
    would have it).

    Call it on every rank, after build_model and before parallel.parallelize. `device` (where the model will train)
    and `strategy` (parallel.resolve_strategy's) matter for lora.quantize = 'nf4' only: the base is quantized as it
    moves to the device. Raises EngineConfigError (exit 78), before the model is changed, for a target that names no
    linear layer (listing the model's), for nf4 where it cannot run, and for a model that already has adapters.
    """
    try:
        from peft import inject_adapter_in_model
    except ImportError:
        raise EngineConfigError(
            "lora.rank > 0 needs the peft package, which is not installed: pip install 'prime-train[lora]'"
        ) from None

    if not cfg.enabled:
        raise ValueError("apply_lora needs lora.rank > 0")
    if _unwrap(model) is not model or _is_fsdp(model):
        raise ValueError("apply LoRA to the bare model, before parallelize wraps or shards it")
    if has_lora(model):
        raise EngineConfigError("the model already has LoRA adapters (is model.path a PEFT adapter directory?)")
    targets = resolve_targets(model, cfg)
    parameters = resolve_target_parameters(model, cfg)
    if cfg.quantize == "nf4":
        if (reason := nf4_unavailable(strategy)) is not None:
            raise EngineConfigError(reason)
        quantize_base_nf4(model, device)
    # transformers' Conv1D (GPT-2 style) stores its weight as in x out: peft's fan_in_fan_out
    conv1d = [t for t in _linear_types() if t is not nn.Linear]
    fan_in_fan_out = any(isinstance(m, tuple(conv1d)) for layer in decoder_layers(model) for m in layer.modules())
    lm_head = any(name.rsplit(".", 1)[-1] == "lm_head" for name, _ in model.named_modules())
    peft_config = _peft_config(
        cfg, targets, parameters=parameters, fan_in_fan_out=fan_in_fan_out and bool(conv1d), lm_head=lm_head
    )
    with _targets_as_resolved():
        inject_adapter_in_model(peft_config, model, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_key(name) or any(name.startswith(m + ".") for m in train_in_full))
    trainable, total = trainable_parameters(model)
    logger.info(
        "LoRA rank %d, alpha %g%s on %s: %d trainable parameters of %d (%.3f%%)%s",
        cfg.rank,
        cfg.scale_alpha,
        f" (rsLoRA: scale alpha / sqrt(rank) = {cfg.scaling:g})" if cfg.rslora else "",
        ", ".join(targets + [f"{p} (each expert)" for p in parameters]),
        trainable,
        total,
        100.0 * trainable / max(total, 1),
        ", base in NF4" if cfg.quantize == "nf4" else "",
    )
    return model


@contextmanager
def _targets_as_resolved() -> Iterator[None]:
    """Within it peft puts adapters where its config says. On transformers 5, peft 0.21 first renames the transformers
    4 names of some MoE families' layers (DeepSeek-V3, Qwen3-MoE, GLM-4-MoE, OLMoE, Mixtral, ...): gate_proj, up_proj
    and down_proj become the fused expert tensors (gate_up_proj at twice the rank), gate the router's weight. That is
    for adapters trained on transformers 4; here it would move the adapters of a dense MLP layer (DeepSeek-V3's first
    layers, Qwen3-MoE's mlp_only_layers) onto every expert. The engine's targets are resolved against the transformers
    5 model it trains, so the renaming (gated by peft's own is_transformers_ge_v5 flag, read as it injects) is
    switched off while they go in."""
    try:
        from peft.tuners import tuners_utils
    except ImportError:  # pragma: no cover - apply_lora checked peft first
        yield
        return
    flag = getattr(tuners_utils, "is_transformers_ge_v5", None)
    if not flag:
        yield
        return
    tuners_utils.is_transformers_ge_v5 = False
    try:
        yield
    finally:
        tuners_utils.is_transformers_ge_v5 = flag


def _is_fsdp(model: nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, FSDPModule)


def trainable_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts of `model`; tied weights once, FSDP2 shards at their full size."""
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within it `model` computes as its frozen base (every adapter bypassed, nothing merged or copied): RL's KL
    reference for a LoRA run, without a second copy of the model. Plain, DDP, compiled (a recompile per state) or
    FSDP2."""
    layers = [layer for _, layer in _lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


# ---------------------------------------------------------------- identity and resume


def adapter_identity(model: nn.Module) -> dict[str, Any] | None:
    """What a checkpoint's adapter must agree on to be resumed: {'rank', 'alpha', 'target_modules'} (the resolved
    names, sorted), or None for a model without LoRA. JSON-ready, for the checkpoint's meta.json."""
    peft_config = (getattr(_unwrap(model), "peft_config", None) or {}).get(ADAPTER_NAME)
    if peft_config is None or not _lora_layers(model):
        return None
    identity = {
        "rank": int(peft_config.r),
        "alpha": float(peft_config.lora_alpha),
        "target_modules": sorted(peft_config.target_modules),
    }
    if peft_config.fan_in_fan_out:  # peft sets it for transformers' Conv1D layers (weights stored as in x out)
        identity["fan_in_fan_out"] = True
    if peft_config.use_rslora:  # left out when off, as target_parameters: older checkpoints compare equal
        identity["rslora"] = True
    if peft_config.target_parameters:  # left out when empty: checkpoints from before the key compare equal
        identity["target_parameters"] = sorted(peft_config.target_parameters)
    return identity


def describe_identity(identity: dict[str, Any] | None) -> str:
    if identity is None:
        return "no LoRA (the whole model trained)"
    experts = identity.get("target_parameters") or []
    return (
        f"LoRA rank {identity.get('rank')}, alpha {identity.get('alpha')}, "
        f"target_modules {', '.join(identity.get('target_modules') or [])}"
        + (f", target_parameters {', '.join(experts)}" if experts else "")
        + (", rsLoRA" if identity.get("rslora") else "")
    )


def check_resume_compatible(
    saved: dict[str, Any] | None, current: dict[str, Any] | None, *, checkpoint: str = "the checkpoint"
) -> None:
    """Raise EngineConfigError (exit 78, never retried) naming both settings when the checkpoint's adapter identity
    (`saved`, from its meta.json) is not this run's (`current`). Call it before loading anything: the checkpoint is
    left as it is, and nothing of the run is lost."""
    if comparable_identity(saved) == comparable_identity(current):
        return
    raise EngineConfigError(
        f"{checkpoint} was saved with {describe_identity(saved)}; this run has {describe_identity(current)}. "
        "A checkpoint holds the adapter it was trained with and does not load into another: resume with the "
        "[lora] settings it was saved with, or start a new run (another run.name, or ckpt.resume = 'never'). "
        "The checkpoint is kept as it is."
    )


def comparable_identity(identity: dict[str, Any] | None) -> tuple | None:
    if identity is None:
        return None
    return (
        int(identity["rank"]),
        float(identity["alpha"]),
        tuple(sorted(identity["target_modules"])),
        tuple(sorted(identity.get("target_parameters") or ())),
        bool(identity.get("rslora")),
    )


# ---------------------------------------------------------------- checkpoints


def checkpoint_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """TrainState's ("model", "optim") entries for a LoRA run: the adapters (and any module apply_lora left to train
    in full), sharded as the model is, and their optimizer state; nothing of the frozen base. (ignore_frozen_params
    alone keeps a tied lm_head: torch drops a frozen parameter under its first name only, and a tied embedding is the
    whole vocabulary table.)"""
    model_state, optim_state = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    trained = {_clean(name) for name, p in _unwrap(model).named_parameters() if p.requires_grad}
    return {name: t for name, t in model_state.items() if is_adapter_key(name) or name in trained}, optim_state


def load_checkpoint_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any], optim_state: dict[str, Any]
) -> None:
    """Apply what checkpoint_state saved (as DCP loaded it into checkpoint_state's template): the base is left as
    built. Check the checkpoint's adapter_identity first (check_resume_compatible)."""
    set_state_dict(
        model,
        optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=StateDictOptions(strict=False),  # the frozen base is not in it, by design
    )


# ---------------------------------------------------------------- adapter weights


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights only, whole, on the CPU of every rank, named as in the bare model (DDP's `module.`,
    compile's `_orig_mod.`, the checkpoint wrapper's and FSDP2's prefixes stripped), e.g.
    `model.layers.0.self_attn.q_proj.lora_A.default.weight`. A collective under FSDP2: every rank calls it."""
    options = StateDictOptions(full_state_dict=True, ignore_frozen_params=True)
    state = get_model_state_dict(model, options=options)
    return {name: tensor.detach().cpu() for name, tensor in state.items() if is_adapter_key(name)}


def load_adapter_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Load whole adapter weights (as adapter_state_dict gives them) into `model`, plain, DDP, compiled or FSDP2
    (each rank keeps its slice: every rank calls it with the whole tensors). Every adapter of the model must be in
    `state_dict` and nothing else: EngineConfigError names what differs, before anything is loaded."""
    expected = {_clean(name) for name, _ in _unwrap(model).named_parameters() if is_adapter_key(name)}
    given = set(state_dict)
    missing, unexpected = sorted(expected - given), sorted(given - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's adapter weights are missing (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"{len(unexpected)} are not adapters of this model (e.g. {unexpected[0]})")
        raise EngineConfigError(f"the adapter weights do not fit this model: {'; '.join(parts)}; nothing was loaded")
    set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=False))


def to_peft_names(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Adapter weights renamed as PEFT saves them: `base_model.model.<name>` without the adapter's name."""
    marker = f".{ADAPTER_NAME}."
    return {PEFT_PREFIX + name.replace(marker, ".", 1): t for name, t in state_dict.items() if is_adapter_key(name)}


def save_peft_adapter(
    model: nn.Module,
    out_dir: str | os.PathLike[str],
    base_model_name_or_path: str | None = None,
    *,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the adapter in PEFT's format into `out_dir` (created): adapter_config.json and adapter_model.safetensors,
    which `PeftModel.from_pretrained(<the base HF model>, out_dir)` loads.

    `state_dict`: the adapter weights (adapter_state_dict's names; a full state dict is filtered); unset, they are
    gathered here, a collective under FSDP2 (then every rank calls it, and only the caller's rank 0 should write:
    pass the gathered weights on rank 0 instead). `base_model_name_or_path`: recorded for PEFT's
    AutoPeftModelForCausalLM; unset, the model config's own name_or_path (model.path for a loaded model).
    """
    from safetensors.torch import save_file

    identity_model = _unwrap(model)
    peft_config = (getattr(identity_model, "peft_config", None) or {}).get(ADAPTER_NAME)
    if peft_config is None:
        raise ValueError("the model has no LoRA adapter to save")
    weights = to_peft_names(adapter_state_dict(model) if state_dict is None else state_dict)
    if not weights:
        raise ValueError("no adapter weights to save (the state dict has no lora_A / lora_B tensors)")
    config = copy.deepcopy(peft_config)
    config.inference_mode = True
    config.target_modules = sorted(config.target_modules)  # a set in memory; a stable list in the file
    if config.target_parameters:  # peft matches them sorted whatever the order; the file says them sorted too
        config.target_parameters = sorted(config.target_parameters)
    if base_model_name_or_path is None:
        hf_config = getattr(identity_model, "config", None)
        base_model_name_or_path = getattr(hf_config, "name_or_path", None) or None
    config.base_model_name_or_path = base_model_name_or_path
    if renamed := renamed_on_load(identity_model, sorted(config.target_modules)):
        logger.warning(
            "the adapter in %s adapts %s of dense layers; PeftModel.from_pretrained on transformers 5 (peft %s) reads "
            "those names of a %s model as transformers 4's expert layers and puts them on the fused experts instead, "
            "so what it loads is not the adapter trained here. The merged model (lora.merge_on_export) is.",
            out_dir,
            ", ".join(renamed),
            _peft_version(),
            getattr(getattr(identity_model, "config", None), "model_type", "?"),
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(out))
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in weights.items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    logger.info("wrote the LoRA adapter (%d tensors) in PEFT's format to %s", len(tensors), out)
    return out


def renamed_on_load(model: nn.Module, targets: list[str]) -> list[str]:
    """The entries of `targets` that peft renames when it loads an adapter for `model`'s family on transformers 5
    (see _targets_as_resolved): empty for most models, and wherever peft's table is not where 0.21 keeps it."""
    try:
        from peft.utils.transformers_weight_conversion import _MODEL_TO_CONVERSION_PATTERN, _MOE_TARGET_MODULE_MAPPING
    except ImportError:
        return []
    family = _MODEL_TO_CONVERSION_PATTERN.get(getattr(getattr(model, "config", None), "model_type", None))
    names = _MOE_TARGET_MODULE_MAPPING.get(family) or {}
    return [t for t in targets if any(target_names(n, t) for n in names)]


def _peft_version() -> str:
    import peft

    return getattr(peft, "__version__", "?")


def read_adapter_config(adapter_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """adapter_config.json of a PEFT adapter directory, as a dict."""
    return json.loads((Path(adapter_dir) / ADAPTER_CONFIG_FILE).read_text())


# ---------------------------------------------------------------- merging


def expert_adapters(model: nn.Module) -> dict[str, tuple[str, bool]]:
    """Where the fused expert tensors' adapters are (lora.target_parameters): for each adapted tensor's plain name
    (`model.layers.0.mlp.experts.gate_up_proj`), the name of the peft wrapper holding its lora_A / lora_B
    (`model.layers.0.mlp.experts.base_layer` when two tensors of one module are adapted: peft nests one wrapper a
    tensor) and whether the tensor is stored experts x out x in (True; transformers' Qwen and Mixtral experts) or
    experts x in x out (False). Read from the live model (plain, DDP, compiled or FSDP2: nothing is gathered)."""
    from peft.tuners.lora import ParamWrapper

    out: dict[str, tuple[str, bool]] = {}
    for name, layer in _lora_layers(model):
        if isinstance(layer, ParamWrapper):
            plain = f"{name.replace('.base_layer', '')}.{layer.parameter_name}"
            # peft's rule for a 3-D tensor: stored experts x out x in unless the module says it is transposed
            out[plain] = (name, not getattr(layer.get_base_layer(), "is_transposed", False))
    return out


def _expert_delta(a: torch.Tensor, b: torch.Tensor, rank: int, *, out_in: bool) -> torch.Tensor:
    """B @ A of a fused expert stack's adapter, in fp32, one product an expert, stacked as the tensor stores them.

    peft's layout: lora_A is (experts·r) x in, expert e's rows e·r to e·r + r; lora_B is out x (r·experts), expert
    e's columns e, e + experts, ... (the r·experts axis read as r x experts)."""
    experts = a.shape[0] // rank
    a_e = a.to(torch.float32).reshape(experts, rank, a.shape[1])  # e x r x in
    b_e = b.to(torch.float32).reshape(b.shape[0], rank, experts).permute(2, 0, 1)  # e x out x r
    delta = torch.bmm(b_e, a_e)  # e x out x in
    return delta if out_in else delta.transpose(1, 2)


def merged_state_dict(
    state_dict: dict[str, torch.Tensor],
    identity: dict[str, Any],
    experts: dict[str, tuple[str, bool]] | None = None,
) -> dict[str, torch.Tensor]:
    """A full state dict of a LoRA model (base_layer and lora_A / lora_B keys) as the plain model's: each adapted
    weight W replaced by W + (alpha / rank) · B @ A (computed in fp32, kept in W's dtype) under the layer's own name
    (`...q_proj.weight`), its bias likewise, the adapters dropped. `state_dict` is consumed: each entry leaves it as
    its counterpart is made, so a gathered model is not held twice; no tensor is changed in place (they may be the
    live model's own). `identity`: adapter_identity's (rank, alpha, and fan_in_fan_out for Conv1D weights).
    `experts`: expert_adapters' map of the model, for the fused expert tensors lora.target_parameters adapted (each
    expert's own update folded into its slice)."""
    rank = int(identity["rank"])
    scale = adapter_scaling(float(identity["alpha"]), rank, rslora=bool(identity.get("rslora")))
    transpose = bool(identity.get("fan_in_fan_out"))
    marker_a, marker_b = f".lora_A.{ADAPTER_NAME}.weight", f".lora_B.{ADAPTER_NAME}.weight"
    adapters = {name: state_dict.pop(name) for name in list(state_dict) if is_adapter_key(name)}
    experts = experts or {}
    out: dict[str, torch.Tensor] = {}
    merged: set[str] = set()  # the layers (or expert wrappers) whose adapters went into a weight
    for name in list(state_dict):
        tensor = state_dict.pop(name)
        if ".base_layer." not in name:
            out[name] = tensor
            continue
        plain = name.replace(".base_layer", "")
        if plain in experts:
            wrapper, out_in = experts[plain]
            a, b = adapters.get(wrapper + marker_a), adapters.get(wrapper + marker_b)
            if a is None or b is None:
                raise ValueError(f"{name} has no lora_A / lora_B beside it in the state dict")
            delta = _expert_delta(a, b, rank, out_in=out_in) * scale
            out[plain] = (tensor.to(torch.float32) + delta.to(tensor.device)).to(tensor.dtype)
            merged.add(wrapper)
            continue
        layer, _, leaf = name.partition(".base_layer.")
        if leaf != "weight":
            # a bias, or another tensor of a module whose expert tensors are adapted (GPT-OSS's expert biases): under
            # its plain name, without the base_layer of each wrapper around it
            out[plain] = tensor
            continue
        a, b = adapters.get(layer + marker_a), adapters.get(layer + marker_b)
        if a is None or b is None:
            raise ValueError(f"{name} has no lora_A / lora_B beside it in the state dict")
        delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
        out[plain] = (tensor.to(torch.float32) + (delta.T if transpose else delta).to(tensor.device)).to(tensor.dtype)
        merged.add(layer)
    # every adapter went into a weight: an expert tensor's, passed without `experts`, would otherwise be left out of
    # the merge in silence (its tensor copied as the base's)
    if unmerged := sorted({name.rsplit(".lora_", 1)[0] for name in adapters} - merged):
        raise ValueError(f"the adapters of {unmerged[0]} were not merged into any weight (an expert tensor's?)")
    return out


def merge_lora(model: nn.Module) -> nn.Module:
    """The bare model with every adapter folded into its base weight and peft's layers replaced by the plain ones
    again (in place; returned): the names, the state dict and the forward of the model before apply_lora. For an
    unsharded model (plain, or the one inside DDP / compile); under FSDP2 merge the gathered state dict instead
    (merged_state_dict, as export.export_hf does). The merged model's parameters all train again."""
    from peft.tuners.lora import LoraLayer
    from torch.distributed.tensor import DTensor

    bare = _unwrap(model)
    if any(isinstance(p, DTensor) for p in bare.parameters()):
        raise ValueError("merge_lora needs whole weights; under FSDP2 use merged_state_dict on the gathered state")
    for name, layer in _lora_layers(bare):
        if _is_quantized(layer.get_base_layer()):
            raise ValueError(f"{name} is quantized (nf4): merge its dequantized weights with merged_state_dict")
        layer.merge(adapter_names=[ADAPTER_NAME])
    for name, module in list(bare.named_modules()):
        # the outermost peft layer of a module only: the wrappers of a module's expert tensors are nested (each holds
        # the next as base_layer), and get_base_layer gives the module under all of them
        if isinstance(module, LoraLayer) and not name.endswith(".base_layer"):
            parent_name, _, child = name.rpartition(".")
            parent = bare.get_submodule(parent_name) if parent_name else bare
            setattr(parent, child, module.get_base_layer())
    if hasattr(bare, "peft_config"):
        del bare.peft_config
    for param in bare.parameters():
        param.requires_grad_(True)
    return model


# ---------------------------------------------------------------- QLoRA


def _is_quantized(module: nn.Module) -> bool:
    return type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")


def has_quantized_base(model: nn.Module) -> bool:
    """Whether some linear layer of `model` holds its weight in bitsandbytes' 4-bit format."""
    return any(_is_quantized(m) for m in _unwrap(model).modules())


def nf4_unavailable(strategy: str = "none") -> str | None:
    """Why lora.quantize = 'nf4' cannot run in this process (no CUDA, no bitsandbytes, a sharded strategy), or None."""
    return LoraConfig(rank=1, quantize="nf4").unavailable(
        strategy=strategy,
        cuda=torch.cuda.is_available(),
        bitsandbytes=importlib.util.find_spec("bitsandbytes") is not None,
    )


def quantize_base_nf4(model: nn.Module, device: torch.device | str | None) -> nn.Module:
    """Hold the decoder blocks' linear layers in 4-bit NF4 on `device` (a CUDA device), in place; returned.

    bitsandbytes' documented path: each nn.Linear becomes `bnb.nn.Linear4bit(quant_type='nf4', compute_dtype=bf16)`
    loaded with the layer's own state dict, and its `Params4bit` weight is quantized as it moves to the GPU (here, at
    once, so peft's LoRA layers find the quantized weight and its quant_state). Biases, norms, embeddings and lm_head
    stay as they are. Raises EngineConfigError when there is no CUDA GPU or no bitsandbytes (`nf4_unavailable`).
    """
    reason = nf4_unavailable()
    if reason is None and (device is None or torch.device(device).type != "cuda"):
        reason = f"lora.quantize = 'nf4' quantizes on a CUDA device and the model is to train on {device or 'the CPU'}"
    if reason is not None:
        raise EngineConfigError(reason)
    return _to_linear4bit(model, torch.device(device))


def _to_linear4bit(model: nn.Module, device: torch.device) -> nn.Module:
    import bitsandbytes as bnb

    count = 0
    for layer in decoder_layers(model):
        for name, module in list(layer.named_modules()):
            if type(module) is not nn.Linear:
                continue
            quantized = bnb.nn.Linear4bit(
                module.in_features,
                module.out_features,
                bias=module.bias is not None,
                compute_dtype=torch.bfloat16,
                quant_type="nf4",
            )
            # bitsandbytes' documented way in: the full-precision state dict into Linear4bit, then .to(cuda)
            quantized.load_state_dict(module.state_dict())
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, child, quantized.to(device))  # Params4bit quantizes as it moves to the GPU
            count += 1
    logger.info("quantized %d linear layers of the decoder blocks to NF4 on %s", count, device)
    return model


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict of an unsharded model on the CPU, bitsandbytes' 4-bit weights dequantized (their quantization
    state left out) and their biases in the weights' dtype again (Linear4bit casts them to its compute dtype): what
    merged_state_dict takes for a QLoRA model. Tied weights appear under both names."""
    out: dict[str, torch.Tensor] = {}
    for module_name, module in _unwrap(model).named_modules():
        prefix = _clean(module_name + ".") if module_name else ""
        quantized = _is_quantized(module)
        if quantized:
            import bitsandbytes as bnb

            state = module.weight.quant_state
            out[prefix + "weight"] = bnb.functional.dequantize_4bit(module.weight.data, state).to("cpu")
            if module.bias is not None:
                out[prefix + "bias"] = module.bias.detach().to("cpu", state.dtype)
            continue
        for name, param in module.named_parameters(recurse=False):
            out[prefix + name] = param.detach().to("cpu")
        for name, buffer in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                out[prefix + name] = buffer.detach().to("cpu")
    return out
