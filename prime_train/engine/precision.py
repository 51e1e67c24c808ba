"""Reduced precision beyond bf16: fp16 with dynamic loss scaling, and float8 linear layers through torchao.

fp16 has five exponent bits: small gradients underflow to zero unless the loss is scaled up before backward and the
gradients scaled back down before the optimizer sees them. `LossScaler` wraps torch's dynamic scaler for that:
`torch.amp.GradScaler` where every rank holds whole gradients (one process, DDP: an overflow is the same on every
rank), FSDP2's `ShardedGradScaler` where each rank holds a shard (FSDP, HSDP: it all-reduces the overflow flag, so
that every rank skips the same steps and keeps the same scale). A step whose gradients hold an inf or a NaN is
skipped: the optimizer does not step, the scale halves, and `overflow_steps` counts it. The learning-rate schedule
advances on a skipped step as on any other, as in torch's own recipe (the step number is the schedule's clock).

float8 (`train.float8`) swaps the decoder's nn.Linear layers for torchao's Float8Linear before the model is wrapped
or sharded: matmuls in float8 with dynamic per-tensor scales, weights and optimizer states as they were. It needs a
CUDA GPU of compute capability 8.9 or newer (float8 tensor cores); anywhere else `float8_unavailable` says why.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
from torch import nn

from prime_train.engine.metrics import EngineConfigError

logger = logging.getLogger("prime_train.engine")

FLOAT8_INSTALL = "pip install 'prime-train[float8]'"
FLOAT8_MIN_CAPABILITY = (8, 9)
# torchao's float8 matmul (torch._scaled_mm) needs both dims of every weight to be multiples of 16
FLOAT8_DIM_MULTIPLE = 16


class LossScaler:
    """Dynamic loss scaling for fp16 training; every method is a pass-through when the run is not fp16."""

    def __init__(self, enabled: bool, *, sharded: bool, device: torch.device, init_scale: float = 2.0**16):
        self.enabled = enabled
        self.overflow_steps = 0
        self._scaler: Any = None
        if not enabled:
            return
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            self._scaler = ShardedGradScaler(device=device.type, init_scale=init_scale)
        else:
            self._scaler = torch.amp.GradScaler(device.type, init_scale=init_scale)

    @classmethod
    def for_run(cls, precision: str, strategy: str, device: torch.device, init_scale: float = 2.0**16) -> LossScaler:
        """The scaler train.precision asks for under the data-parallel `strategy`, from train.loss_scale_init."""
        return cls(precision == "fp16", sharded=strategy in ("fsdp", "hsdp"), device=device, init_scale=init_scale)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss multiplied by the current scale, for backward."""
        return self._scaler.scale(loss) if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale in place (before clipping) and note whether any overflowed."""
        if self.enabled:
            self._scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer unless the gradients overflowed, then adjust the scale; returns whether it stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        before = self._scaler.get_scale()
        self._scaler.step(optimizer)
        self._scaler.update()
        # the scale only ever falls on an overflow (backoff), and a skipped step is exactly an overflow
        stepped = self._scaler.get_scale() >= before
        if not stepped:
            self.overflow_steps += 1
            logger.warning("fp16: gradients overflowed, step skipped; loss scale now %g", self._scaler.get_scale())
        return stepped

    def metrics(self) -> dict[str, float]:
        """The fields a step adds to its metrics under fp16: the scale in effect next, and overflows so far."""
        if not self.enabled:
            return {}
        return {"loss_scale": float(self._scaler.get_scale()), "overflow_steps": float(self.overflow_steps)}

    def state_dict(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        return {"scaler": self._scaler.state_dict(), "overflow_steps": self.overflow_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.enabled and state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])
            self.overflow_steps = int(state.get("overflow_steps", 0))


# ---------------------------------------------------------------- float8


def float8_unavailable(device: torch.device) -> str | None:
    """Why train.float8 cannot run on `device`, or None when it can. The device first: on a machine that cannot run
    it, installing torchao would not help."""
    if device.type != "cuda":
        return "train.float8 = true needs a CUDA GPU of compute capability 8.9+ (Ada, Hopper or newer); none is here"
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_MIN_CAPABILITY:
        major, minor = capability
        return (
            f"train.float8 = true needs compute capability 8.9+ for float8 matmuls; "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
        )
    if importlib.util.find_spec("torchao") is None:
        return f"train.float8 = true needs torchao, which is not installed: {FLOAT8_INSTALL}"
    return None


def float8_eligible(module: nn.Module, fqn: str) -> bool:
    """Whether torchao converts this module: a decoder Linear (never lm_head) whose dims are multiples of 16."""
    if not isinstance(module, nn.Linear) or fqn.split(".")[-1] == "lm_head":
        return False
    return module.in_features % FLOAT8_DIM_MULTIPLE == 0 and module.out_features % FLOAT8_DIM_MULTIPLE == 0


def apply_float8(model: nn.Module, device: torch.device) -> int:
    """Convert the eligible linear layers to float8 training in place, before any wrapping; returns how many."""
    if why := float8_unavailable(device):
        raise EngineConfigError(f"{why}; set train.float8 = false")
    from torchao.float8 import convert_to_float8_training

    linears = [fqn for fqn, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    convert_to_float8_training(model, module_filter_fn=float8_eligible)
    converted = sum(type(mod).__name__ == "Float8Linear" for mod in model.modules())
    logger.info("Applied float8 training to %d of %d linear layers", converted, len(linears))
    return converted
