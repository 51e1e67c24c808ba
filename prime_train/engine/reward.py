"""The reward model job: `python -m prime_train.engine.reward --config RUN/config.toml` (run.job = "reward").

A reward model is the causal LM's decoder under a scalar head, as transformers' *ForSequenceClassification with
num_labels = 1 builds it: `score`, a Linear(hidden, 1, bias=False), reads the final hidden state of each
sequence's last token that is not padding (the rightmost token whose id is not config.pad_token_id). The names are
transformers' own (`model.*`, `score.weight`), so a checkpoint holds the head with the decoder and final/ loads
with `AutoModelForSequenceClassification.from_pretrained`, scoring as the job scored.

- model.implementation native: `NativeRewardModel`, the engine's decoder (engine/llama.py) with `score` in place of
  lm_head; hf: transformers' own *ForSequenceClassification holding the loaded LM's decoder (no copy).
- The loss is Bradley-Terry's, -log sigmoid(r_chosen - r_rejected), averaged over the step's pairs; each pair's
  chosen and rejected sequences go through the model in one forward.
- With LoRA the adapters train and so does the head, whole: it stays outside peft (the job's `trained_in_full`),
  the optimizer takes it as any trainable parameter, and a checkpoint holds it with the adapters. final/ is always
  the merged model (a PEFT adapter alone would lack the head).
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from prime_train.config.schema import Config
from prime_train.engine import parallel
from prime_train.engine.llama import NativeCausalLM
from prime_train.engine.loop import TrainingJob, main
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.preference import build_eval_pairs, build_pair_loader

logger = logging.getLogger("prime_train.engine")

SCORE = "score"  # the head's name, as transformers' *ForSequenceClassification name it


class RewardOutput(NamedTuple):
    """What the native reward model's forward returns: one score per sequence, (B, 1), as HF's `logits`."""

    logits: torch.Tensor


def last_token_index(input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Each row's index of its rightmost token that is not `pad_token_id` (0 for a row of padding only): the token
    transformers' *ForSequenceClassification read the score at, for left and right padding alike."""
    not_pad = (input_ids != pad_token_id).to(torch.int32)
    positions = torch.arange(input_ids.shape[-1], device=input_ids.device, dtype=torch.int32)
    return (positions * not_pad).argmax(-1)


def pooled(hidden: torch.Tensor, input_ids: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """The hidden state (B, hidden) of each row's last token that is not padding."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, last_token_index(input_ids, pad_token_id).to(hidden.device)]


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, *, center_coefficient: float = 0.0, reduction: str = "mean"
) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected) per pair, its mean or sum; `center_coefficient` adds that times
    (r_chosen + r_rejected)² per pair, which keeps the rewards near zero (TRL's center_rewards_coefficient)."""
    losses = -F.logsigmoid(chosen - rejected)
    if center_coefficient:
        losses = losses + center_coefficient * (chosen + rejected).pow(2)
    if reduction == "sum":
        return losses.sum()
    if reduction != "mean":
        raise ValueError(f"reduction must be 'mean' or 'sum', not {reduction!r}")
    return losses.mean()


def classifier_config(config, pad_token_id: int | None):
    """A copy of a causal LM's config for its reward model: one label, the pad id the last token is found by, and
    transformers' *ForSequenceClassification class of the model type as its architecture."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES

    config = copy.deepcopy(config)
    config.num_labels = 1
    config.pad_token_id = pad_token_id
    name = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(config.model_type)
    if name is None:
        raise ValueError(f"transformers has no sequence-classification model for model type {config.model_type!r}")
    config.architectures = [name]
    return config


def _new_head(config, saved: torch.Tensor | None = None) -> nn.Linear:
    """The score head: `saved` (a reward model's own head) when given, else initialised as transformers initialises
    a Linear: normal(0, initializer_range)."""
    head = nn.Linear(config.hidden_size, 1, bias=False)
    with torch.no_grad():
        if saved is None:
            head.weight.normal_(0.0, getattr(config, "initializer_range", 0.02))
        elif tuple(saved.shape) != tuple(head.weight.shape):
            raise EngineConfigError(
                f"model.path: the reward model's {SCORE}.weight has shape {tuple(saved.shape)}, not "
                f"{tuple(head.weight.shape)} (one score from hidden size {config.hidden_size})"
            )
        else:
            head.weight.copy_(saved.to(head.weight.dtype))
    return head


def is_reward_model(config) -> bool:
    """Whether a loaded config is a reward model's (a reward run's final/: transformers' *ForSequenceClassification
    with one label) rather than a causal LM's."""
    named = any(str(a).endswith("ForSequenceClassification") for a in getattr(config, "architectures", None) or ())
    return named and getattr(config, "num_labels", 1) == 1


def saved_score_head(path: str) -> torch.Tensor:
    """`score.weight` of the reward model at `path` (a local directory or a hub id in the cache), read from its
    safetensors (one file or the shard its index names; never a pickle). A model loaded from there as a causal LM
    keeps the decoder and drops the head: this is the head, so a reward run can go on from a reward model."""
    import json

    from safetensors import safe_open
    from transformers.utils import cached_file

    key = f"{SCORE}.weight"
    path = os.path.expanduser(path)
    weights = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False)
    if weights is None:
        index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
        shard = json.loads(Path(index).read_text())["weight_map"].get(key) if index else None
        weights = cached_file(path, shard, _raise_exceptions_for_missing_entries=False) if shard else None
    if weights is None:
        raise EngineConfigError(f"model.path {path!r} names a reward model but has no safetensors holding {key}")
    with safe_open(weights, framework="pt") as f:
        names = f.keys()
        if key not in names:
            raise EngineConfigError(f"model.path {path!r} names a reward model but {weights} holds no {key}")
        return f.get_tensor(key).float()


class NativeRewardModel(NativeCausalLM):
    """The native decoder under a scalar head: the state dict of transformers' *ForSequenceClassification
    (`model.*` and `score.weight`), forward giving one score per sequence."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        del self.lm_head
        self.score = nn.Linear(config.hidden_size, 1, bias=False)

    def get_output_embeddings(self) -> None:
        """No vocabulary projection: the head is `score`."""
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> RewardOutput:
        """Scores (B, 1) at each row's last token that is not padding (config.pad_token_id)."""
        hidden = self.hidden_states(input_ids, position_ids, attention_mask)
        return RewardOutput(logits=self.score(pooled(hidden, input_ids, self.config.pad_token_id)))

    def export_model(self, state_dict: dict[str, torch.Tensor]) -> nn.Module:
        """transformers' *ForSequenceClassification of this config holding `state_dict` (the full tensors, not
        copied), for export.export_hf to save."""
        from transformers import AutoModelForSequenceClassification

        embedding = state_dict["model.embed_tokens.weight"]
        with torch.device("meta"):
            hf = AutoModelForSequenceClassification.from_config(self.config, dtype=embedding.dtype)
        hf.load_state_dict(state_dict, strict=True, assign=True)
        rotary = hf.model.rotary_emb  # a non-persistent buffer made on meta: build it for real
        hf.model.rotary_emb = type(rotary)(config=hf.config).to(embedding.device)
        left = [name for name, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(f"the reward model's export left tensors on the meta device: {left[:5]}")
        return hf.eval()


def reward_model_from(lm: nn.Module, pad_token_id: int | None, head_weight: torch.Tensor | None = None) -> nn.Module:
    """The reward model on `lm`'s decoder (its own parameters, not copied; lm_head dropped) with a score head, new or
    `head_weight`: NativeRewardModel for the native decoder, transformers' *ForSequenceClassification for a
    transformers LM."""
    config = classifier_config(lm.config, pad_token_id)
    head = _new_head(config, head_weight)
    if isinstance(lm, NativeCausalLM):
        with torch.device("meta"):
            model = NativeRewardModel(config, max_seq_len=lm.max_seq_len, attention=lm.attention)
        state = {k: v for k, v in lm.state_dict(keep_vars=True).items() if not k.startswith("lm_head.")}
        state[f"{SCORE}.weight"] = head.weight
        model.load_state_dict(state, strict=True, assign=True)
        model.reset_rope(model.model.embed_tokens.weight.device)
        return model
    from transformers import AutoModelForSequenceClassification

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.model = lm.model  # the loaded decoder itself
    model.score = head
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"the reward model was left with tensors on the meta device: {left[:5]}")
    return model


def sequence_rewards(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The reward of each row of right-padded `input_ids` (B,), in fp32: the head at its last non-pad token.

    No attention mask: with the padding on the right, causal attention keeps every real token from seeing it."""
    return model(input_ids=input_ids).logits[:, 0].float()


# ------------------------------------------------------------------------------------------------------------ the job


class RewardJob(TrainingJob):
    """A reward model on preference pairs: Bradley-Terry loss on the scores of each pair's chosen and rejected
    sequences; held-out pairs give the accuracy (chosen scored above rejected) and the mean margin.

    train.global_batch_size and micro_batch_size count pairs (two sequences each)."""

    job_name = "reward"
    # the mean score is logged as "mean_score", never "reward": `reward` in metrics.jsonl and the heartbeat is RL's
    # sampled reward, which the run summary and status read as an RL curve
    eval_keys = ("eval_preference_accuracy", "eval_preference_margin")
    trained_in_full = (SCORE,)

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.eval_batches = build_eval_pairs(
            cfg.data, self.tokenizer, max_batches=cfg.train.eval_batches, cache=self.row_cache(), **self._data_args()
        )

    def configure(self) -> None:
        if self.cfg.lora.enabled and not self.cfg.lora.merge_on_export:
            raise EngineConfigError(
                "lora.merge_on_export = false: a reward model's final/ is the merged model with its score head (an "
                "adapter alone would lack the head, which trains in full); set it to true"
            )

    def model_to_train(self, model) -> nn.Module:
        # the tokenizer's pad id (load_tokenizer gives one, eos when it has no pad) is what the pair batches pad
        # with, and what the head finds each sequence's last token by, here and in the export
        saved = None
        if self.cfg.model.path and is_reward_model(model.config):
            # a reward run's final/ as the start: its decoder loaded as the LM's, its head read here
            saved = saved_score_head(self.cfg.model.path)
            logger.info("going on from the reward model at %s: its score head with its decoder", self.cfg.model.path)
        return reward_model_from(model, self.tokenizer.pad_token_id, saved)

    def _data_args(self) -> dict:
        return dict(
            micro_batch_size=self.cfg.train.micro_batch_size,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
            seed=self.cfg.run.seed,
        )

    def build_batch_source(self):
        # on the host: train_step counts tokens there, then copies each batch over
        return build_pair_loader(
            self.cfg.data, self.tokenizer, device=torch.device("cpu"), cache=self.row_cache(), **self._data_args()
        )

    def train_step(self) -> dict[str, float | torch.Tensor]:
        """One optimizer step over global_batch_size pairs (gradient accumulation over micro-batches); the loss is
        the mean over the step's pairs on every rank, the metrics stay on the device until the loop reads them."""
        from prime_train.engine.schedule import batch_size_at

        cfg, dist, timer = self.cfg, self.dist, self.timer
        global_pairs = batch_size_at(self.state.tokens_seen, cfg.train, cfg.data.seq_len, dist.world_size)
        accum = global_pairs // (cfg.train.micro_batch_size * dist.world_size)
        with timer("data"):
            batches = [next(self.batches) for _ in range(accum)]
        local = [sum(b.num_pairs for b in batches), sum(b.num_tokens for b in batches)]
        with timer("communication"):
            pairs, step_tokens = parallel.all_reduce_host_ints(local, dist)
        scale = dist.world_size / max(1, pairs)  # DDP and FSDP average over ranks: a mean over every rank's pairs
        # loss, pairs ranked right, margin and reward sums over the step's pairs
        sums = torch.zeros(4, dtype=torch.float32, device=dist.device)
        for i, batch in enumerate(batches):
            with timer("data"):
                batch = batch.to(dist.device, non_blocking=True) if dist.device.type == "cuda" else batch
            with parallel.grad_sync(self.model, enabled=i == accum - 1):
                with timer("forward"), self._autocast():
                    rewards = sequence_rewards(self.model, batch.input_ids)
                chosen, rejected = rewards[: batch.num_pairs], rewards[batch.num_pairs :]
                loss = bradley_terry_loss(chosen, rejected, reduction="sum")
                with timer("backward"):
                    (loss * scale).backward()
            sums += pair_sums(loss, chosen, rejected)
        with timer("optimizer"):
            grad_norm = self.clip_grad_norm()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        with timer("communication"):
            parallel.all_reduce_(sums, dist)
        self.state.step += 1
        self.state.tokens_seen += step_tokens
        mean = sums / max(1, pairs)
        out: dict[str, float | torch.Tensor] = {
            "loss": mean[0],
            "accuracy": mean[1],
            "margin": mean[2],
            "mean_score": mean[3],
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.state.tokens_seen,
            "global_batch": pairs,
        }
        if dist.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(dist.device) / 2**30
        return out

    def log_fields(self, m: dict) -> list[str]:
        return [
            f"loss {m['loss']:.4f}",
            f"acc {m['accuracy']:.3f}",
            f"margin {m['margin']:.3f}",
            f"score {m['mean_score']:.3f}",
            f"lr {m['lr']:.2e}",
            f"grad {m['grad_norm']:.3f}",
        ]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out pairs: the fraction whose chosen side scores above the rejected one, the mean margin and loss."""
        if not self.eval_batches:
            return {}
        was_training = self.model.training
        self.model.eval()
        sums = torch.zeros(4, dtype=torch.float64)
        for batch in self.eval_batches:
            with self._autocast():
                rewards = sequence_rewards(self.model, batch.input_ids.to(self.dist.device)).cpu()
            chosen, rejected = rewards[: batch.num_pairs], rewards[batch.num_pairs :]
            keep = batch.counted if batch.counted is not None else torch.ones(batch.num_pairs, dtype=torch.bool)
            chosen, rejected = chosen[keep], rejected[keep]
            loss = bradley_terry_loss(chosen, rejected, reduction="sum")
            sums += torch.cat([pair_sums(loss, chosen, rejected)[:3].double(), torch.tensor([float(len(chosen))])])
        sums = parallel.all_reduce_sum(sums, self.dist)
        self.model.train(was_training)
        n = max(1.0, float(sums[3]))
        return {
            "eval_preference_accuracy": float(sums[1]) / n,
            "eval_preference_margin": float(sums[2]) / n,
            "eval_reward_loss": float(sums[0]) / n,
        }

    def export_final(self) -> None:
        """final/ as transformers' *ForSequenceClassification (num_labels 1): with LoRA the merged model, always."""
        from prime_train.engine.export import export_hf

        export_hf(self.model, self.tokenizer, self.run_dir.final_dir, rank=self.dist.rank, merge=True, adapter=False)


def pair_sums(loss: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """[loss, pairs ranked right, margin, mean reward of the pair] summed over the pairs (a summed `loss`)."""
    return torch.stack(
        [
            loss.detach(),
            (chosen > rejected).sum().float(),
            (chosen - rejected).detach().sum(),
            ((chosen + rejected) / 2).detach().sum(),
        ]
    )


if __name__ == "__main__":
    main(RewardJob)
