"""What a checkpoint holds of a run (TrainState): the model's and optimizer's state dicts as DCP saves them, the
scheduler, the data loader's position (and a self-paced curriculum's score table), every rank's RNG states, in
fp16 the loss scaler, and a job's own tables (dpo.precompute_reference's log-probs of the training pairs).

Small states whose shape can change travel as one opaque blob each (`_pack`): torch.save'd plain data that
`torch.load(weights_only=True)` reads back, so nothing in a checkpoint is unpickled as code."""

from __future__ import annotations

import io
import json
import random
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from prime_train.engine.lora import checkpoint_state, load_checkpoint_state


def _pack(obj: Any) -> bytes:
    """An opaque leaf for DCP: DCP flattens nested dicts and only loads keys a fresh template has,
    so small states whose shape can change (scheduler, RNG) travel as one blob."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)


def _rng_state() -> dict[str, Any]:
    """This process's RNG states in types `torch.load(weights_only=True)` accepts."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (np_state[0], np_state[1].tolist(), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


SCORES_KEY = "curriculum/scores"  # the self-paced curriculum's per-row scores (engine/curriculum.py SelfPaced)


class TrainState(Stateful):
    """What a checkpoint holds: model, optimizer, scheduler, per-rank data-loader and RNG state, step, tokens.

    `adapter_only` (a LoRA run): the model and optimizer entries hold the adapters and their optimizer state alone
    (engine/lora.py checkpoint_state); the frozen base is built again at every start, never saved.

    `data_rank`: the replica whose loader state this rank holds (a pipeline's ranks share one). `flat_optim` (pipeline
    stages): param groups saved per parameter name, so the stages' disjoint groups do not collide under one key."""

    def __init__(self, model, optimizer, scheduler, dataloader, *, rank: int, adapter_only: bool = False,
                 data_rank: int | None = None, flat_optim: bool = False):  # fmt: skip
        self.model = model
        self.adapter_only = adapter_only and optimizer is not None
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.dataloader = dataloader
        self.rank = rank
        self.data_rank = rank if data_rank is None else data_rank
        self.options = StateDictOptions(flatten_optimizer_state_dict=flat_optim)
        self.step = 0
        self.tokens_seen = 0
        self.scaler = None  # fp16's loss scaler (engine/precision.py): its scale resumes with the run
        self.judges = None  # early stopping and the best checkpoint (engine/best.py): what they have seen
        self.ewc = None  # continual.ewc_lambda (engine/continual.py): the starting weights and their Fisher
        # tensors the same on every rank that a job keeps with its checkpoints (DCP writes each once, a load fills
        # them in place): dpo.precompute_reference's log-probs of the training pairs
        self.tables: dict[str, torch.Tensor] = {}

    def _score_table(self) -> torch.Tensor | None:
        """data.curriculum = 'self_paced': the loader's per-row scores, a snapshot (an async save writes it later)."""
        table = getattr(self.dataloader, "score_table", None)
        return table() if callable(table) else None

    @property
    def dataloader_key(self) -> str:
        return f"dataloader/rank{self.data_rank}"

    @property
    def rng_key(self) -> str:
        return f"rng/rank{self.rank}"

    def state_dict(self) -> dict[str, Any]:
        """The DCP state dict; model and optimizer entries are sharded as the model is (plain, DDP, FSDP2)."""
        sd: dict[str, Any] = {}
        if self.adapter_only:
            sd["model"], sd["optim"] = checkpoint_state(self.model, self.optimizer)
        elif self.optimizer is not None:
            sd["model"], sd["optim"] = get_state_dict(self.model, self.optimizer, options=self.options)
        else:
            sd["model"] = get_model_state_dict(self.model)
        if self.scheduler is not None:
            sd["scheduler"] = _pack(self.scheduler.state_dict())
        if self.dataloader is not None:
            # JSON, one leaf: a fresh loader's state may not have the saved one's keys yet
            sd[self.dataloader_key] = json.dumps(self.dataloader.state_dict())
            if (table := self._score_table()) is not None:
                sd[SCORES_KEY] = table  # the same on every rank: DCP writes it once
        # ranks draw different dropout masks and data, so each keeps its own RNG under its own key
        sd[self.rng_key] = _pack(_rng_state())
        sd.update(self.tables)
        if self.scaler is not None and self.scaler.enabled:
            sd["loss_scaler"] = _pack(self.scaler.state_dict())
        if self.ewc is not None:
            sd["ewc"] = self.ewc.state_dict()
        if self.judges is not None and (judged := self.judges.state_dict()):
            sd["judges"] = json.dumps(judged)
        sd["step"] = self.step
        sd["tokens_seen"] = self.tokens_seen
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a loaded state dict; keys missing from it (another world size's ranks) are left as they are."""
        if self.adapter_only and "optim" in state_dict:
            load_checkpoint_state(self.model, self.optimizer, state_dict["model"], state_dict["optim"])
        elif self.optimizer is not None and "optim" in state_dict:
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=state_dict["model"],
                optim_state_dict=state_dict["optim"],
                options=self.options,
            )
        else:
            set_model_state_dict(self.model, state_dict["model"])
        if self.scheduler is not None and "scheduler" in state_dict:
            configured = list(self.scheduler.base_lrs)
            self.scheduler.load_state_dict(_unpack(state_dict["scheduler"]))
            lrs = self.scheduler.get_last_lr()
            if hasattr(self.scheduler, "lr_lambdas") and len(configured) == len(self.scheduler.base_lrs):
                # train.lr is this start's, not the checkpoint's: a resume with a changed lr (a sweep's PBT explore,
                # a hand-tuned restart) trains at it, at the same point of the schedule
                self.scheduler.base_lrs = configured
                epoch = self.scheduler.last_epoch
                lrs = [base * f(epoch) for base, f in zip(configured, self.scheduler.lr_lambdas, strict=True)]
                self.scheduler._last_lr = lrs  # what get_last_lr() reports (torch keeps no public setter)
            groups = self.optimizer.param_groups if self.optimizer is not None else []
            for group, lr in zip(groups, lrs[: len(groups)], strict=True):
                group["lr"] = lr  # what the groups hold, unless Checkpointer.load kept this start's (another layout)
        if self.dataloader is not None and self.dataloader_key in state_dict:
            self.dataloader.load_state_dict(json.loads(state_dict[self.dataloader_key]))
        if self.dataloader is not None and SCORES_KEY in state_dict:
            self.dataloader.load_score_table(state_dict[SCORES_KEY])
        for key, table in self.tables.items():
            if key in state_dict and state_dict[key] is not table:
                table.copy_(state_dict[key])
        if self.rng_key in state_dict:
            _set_rng_state(_unpack(state_dict[self.rng_key]))
        if self.scaler is not None and "loss_scaler" in state_dict:
            self.scaler.load_state_dict(_unpack(state_dict["loss_scaler"]))
        if self.ewc is not None and "ewc" in state_dict:
            self.ewc.loaded()  # DCP loaded the tensors in place
        if self.judges is not None and isinstance(state_dict.get("judges"), str):
            self.judges.load_state_dict(json.loads(state_dict["judges"]))
        self.step = int(state_dict.get("step", self.step))
        self.tokens_seen = int(state_dict.get("tokens_seen", self.tokens_seen))
