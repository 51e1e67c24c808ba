"""Continual learning's Elastic Weight Consolidation (continual.ewc_lambda; Kirkpatrick et al. 2017).

A model trained on earlier data (continual.previous) is trained on new data; EWC holds each weight near its starting
value θ* in proportion to how much the earlier data's loss depends on it: the diagonal Fisher information F, estimated
at θ* from the squared gradients of the earlier data's loss over continual.fisher_batches micro-batches. The penalty
λ/2 · Σ F (θ - θ*)² enters as its gradient λ F (θ - θ*), added to each trained parameter's gradient after the
backward passes (and fp16's unscale), so it costs no extra forward or backward.

θ* and F live beside the parameters they belong to (sharded like them under FSDP2) and are part of every checkpoint
(TrainState.ewc): a resumed run keeps the anchor of its start, not of where it resumed. Replay (continual.replay)
needs nothing here: it is a mixing weight of the data loader (engine/data.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import torch

from prime_train.engine.evaluate import token_losses

logger = logging.getLogger("prime_train.engine")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class ElasticWeights:
    """θ* and the diagonal Fisher F of every trained parameter; the penalty's gradient and value."""

    def __init__(self, model: torch.nn.Module, strength: float):
        self.strength = strength
        self.params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.anchor = {name: torch.zeros_like(p, requires_grad=False) for name, p in self.params.items()}
        self.fisher = {name: torch.zeros_like(p, requires_grad=False) for name, p in self.params.items()}
        self.ready = False  # estimated, or loaded from a checkpoint

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        return {"anchor": self.anchor, "fisher": self.fisher}

    def loaded(self) -> None:
        self.ready = True

    @torch.no_grad()
    def _snapshot(self) -> None:
        for name, p in self.params.items():
            self.anchor[name].copy_(p.detach())

    def estimate(
        self,
        model: torch.nn.Module,
        batches: Iterator,
        count: int,
        autocast: Callable[[], AbstractContextManager],
        device: torch.device,
    ) -> None:
        """θ* = the weights now; F = the mean over `count` micro-batches of the squared gradient of their mean loss
        per labelled token (the empirical Fisher's diagonal at batch level). Every rank calls it (the backward
        passes of a wrapped model are collectives); gradients are left cleared."""
        self._snapshot()
        for f in self.fisher.values():
            f.zero_()
        model.zero_grad(set_to_none=True)
        for _ in range(count):
            batch = next(batches).to(device)
            with autocast():
                loss_sum, labelled = token_losses(model, batch.input_ids, batch.positions, batch.labels)
            (loss_sum / labelled.clamp(min=1)).backward()
            with torch.no_grad():
                for name, p in self.params.items():
                    if p.grad is not None:
                        self.fisher[name].add_(p.grad.detach().float().pow(2).to(self.fisher[name].dtype) / count)
            model.zero_grad(set_to_none=True)
        self.ready = True
        total = sum(float(_local(f).sum()) for f in self.fisher.values())
        logger.info(
            "EWC: Fisher information of continual.previous over %d micro-batches (local sum %.4g)", count, total
        )

    @torch.no_grad()
    def add_gradient(self) -> None:
        """grad += λ F (θ - θ*) for every trained parameter that has a gradient."""
        for name, p in self.params.items():
            if p.grad is not None:
                p.grad.add_(self.fisher[name] * (p.detach() - self.anchor[name]), alpha=self.strength)

    @torch.no_grad()
    def local_penalty(self, holders: int = 1) -> torch.Tensor:
        """This rank's share of λ/2 Σ F (θ - θ*)² (a 0-dim tensor on the device, no sync): summed over ranks, the
        whole model's penalty, each parameter counted once.

        holders: how many ranks hold this rank's parameters (its pipeline stage's), in shards or whole. A parameter
        (shard) held whole by k of them counts 1/k here: a DTensor's shards are distinct along the mesh dims it is
        Shard on (FSDP's, tensor parallel's column/row cuts) and copies along the rest (HSDP's replicas, a tensor
        parallel norm); a plain tensor (DDP) is a copy on every holder."""
        total = None
        for name, p in self.params.items():
            term = (_local(self.fisher[name]) * (_local(p.detach()) - _local(self.anchor[name])).pow(2)).sum()
            term = term / (holders // _distinct_shards(p))
            total = term if total is None else total + term
        if total is None:
            return torch.zeros(())
        return total.float() * (self.strength / 2)


def _distinct_shards(p: torch.Tensor) -> int:
    """Into how many different pieces a parameter is cut across the ranks holding it (1 unless a sharded DTensor)."""
    from torch.distributed.tensor import Shard

    placements = getattr(p, "placements", None)
    if placements is None:
        return 1
    return math.prod(p.device_mesh.size(d) for d, placement in enumerate(placements) if isinstance(placement, Shard))
