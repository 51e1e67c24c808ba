"""Quantization-aware training (train.qat) through torchao's QAT API.

torchao's `QATConfig(base_config, step="prepare")` swaps each chosen nn.Linear for its FakeQuantizedLinear: the
forward quantizes and dequantizes the weight (and, for a dynamic-activation scheme, the input) as the quantized model
will, so training learns weights that survive the rounding; the backward passes straight through. The swapped layers
keep their `weight` parameter under the same name, so checkpoints (DCP), resume and the HF export of final/ are those of
any run: final/ holds the trained full-precision weights.

At export the convert step is applied to that model: `quantize_(model, base_config)`, which is what torchao's
`QATConfig(step="convert")` does once it has swapped the fake-quantized layers back to nn.Linear. The converted model
goes to final/quantized/: its weights as torchao's tensor subclasses flattened into safetensors by torchao's own
safetensors support, and a config.json whose `quantization_config` is transformers' TorchAoConfig of the scheme, so
`AutoModelForCausalLM.from_pretrained("final/quantized")` loads the quantized model.

Schemes (the layers: the decoder's linear layers whose input width is a multiple of the group size; lm_head and the
embeddings stay as they are):
- int8_dynamic_act_int4_weight: int4 weights, symmetric, per group of GROUP_SIZE; int8 activations, asymmetric, per
  token, quantized at run time (torchao's Int8DynamicActivationIntxWeightConfig); its kernels run on the CPU;
- int4_weight_only: int4 weights per group (Int4WeightOnlyConfig), activations in bf16; the converted layers run on
  torchao's CUDA int4 kernels (the mslk package), so this scheme needs a CUDA GPU.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import torch
from torch import nn

from prime_train.engine.metrics import EngineConfigError

logger = logging.getLogger("prime_train.engine")

SCHEMES = ("int8_dynamic_act_int4_weight", "int4_weight_only")
GROUP_SIZE = 32  # weights quantized in groups of this many input features
QUANTIZED_DIR = "quantized"  # final/quantized/: the converted model
QAT_INSTALL = "pip install 'prime-train[qat]'"


def qat_unavailable(scheme: str, device: torch.device) -> str | None:
    """Why train.qat = `scheme` cannot run here (on `device`), or None when it can."""
    if scheme == "none":
        return None
    if importlib.util.find_spec("torchao") is None:
        return f"train.qat = {scheme!r} needs torchao, which is not installed: {QAT_INSTALL}"
    if scheme == "int4_weight_only":
        if device.type != "cuda":
            return (
                "train.qat = 'int4_weight_only' converts to torchao's int4 CUDA kernels, which need a CUDA GPU; none "
                "is here. On the CPU use 'int8_dynamic_act_int4_weight'"
            )
        if importlib.util.find_spec("mslk") is None:
            return "train.qat = 'int4_weight_only' needs torchao's int4 kernels, the mslk package: pip install mslk"
    return None


def base_config(scheme: str):
    """torchao's post-training quantization config of `scheme`: what the prepare step fakes and convert applies."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationIntxWeightConfig, PerGroup

    if scheme == "int8_dynamic_act_int4_weight":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP_SIZE))
    if scheme == "int4_weight_only":
        return Int4WeightOnlyConfig(group_size=GROUP_SIZE)
    raise ValueError(f"train.qat must be one of none, {', '.join(SCHEMES)}; got {scheme!r}")


def qat_eligible(module: nn.Module, fqn: str) -> bool:
    """Whether a layer is quantized: a linear layer of the decoder (never lm_head) whose input width the groups
    divide."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "lm_head":
        return False
    return module.in_features % GROUP_SIZE == 0


def apply_qat(model: nn.Module, scheme: str, device: torch.device) -> int:
    """torchao's prepare step in place, before the model moves or is wrapped; returns how many layers it swapped."""
    if why := qat_unavailable(scheme, device):
        raise EngineConfigError(f"{why}; set train.qat = 'none'")
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedLinear, QATConfig

    linears = sum(isinstance(m, nn.Linear) for m in model.modules())
    quantize_(model, QATConfig(base_config(scheme), step="prepare"), filter_fn=qat_eligible)
    swapped = sum(isinstance(m, FakeQuantizedLinear) for m in model.modules())
    if swapped == 0:
        raise EngineConfigError(
            f"train.qat = {scheme!r}: no linear layer has an input width divisible by {GROUP_SIZE}; "
            "set train.qat = 'none' or widen the model"
        )
    logger.info("Applied QAT (%s, fake-quantized) to %d of %d linear layers", scheme, swapped, linears)
    return swapped


def convert(model: nn.Module, scheme: str) -> nn.Module:
    """The convert step on a model with plain linear layers: the eligible ones quantized in place, as torchao's tensor
    subclasses."""
    from torchao.quantization import quantize_

    quantize_(model, base_config(scheme), filter_fn=qat_eligible)
    return model


def write_quantized(model_dir: Path, scheme: str, tokenizer=None) -> Path:
    """model_dir/quantized/: the HF model in model_dir (the QAT-trained weights) converted to `scheme`, in
    safetensors with torchao's metadata and a config.json transformers loads it back from."""
    from safetensors.torch import save_file
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict
    from transformers import AutoModelForCausalLM, TorchAoConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    convert(model, scheme)
    out = Path(model_dir) / QUANTIZED_DIR
    out.mkdir()
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # written once, as the embedding, as save_pretrained writes a tied head
    tensors, metadata = flatten_tensor_state_dict(state)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata=metadata)
    model.config.quantization_config = TorchAoConfig(quant_type=base_config(scheme))
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    with open(out / "qat.json", "w") as f:
        json.dump({"scheme": scheme, "group_size": GROUP_SIZE, "trained_with": "torchao QATConfig"}, f)
    logger.info("exported the %s-converted model as %s/ of the export", scheme, QUANTIZED_DIR)
    return out
