"""The embedded DPO job: `python -m prime_train.engine.dpo --config RUN/config.toml` (run.job = "dpo").

Direct preference optimisation on {prompt, chosen, rejected} pairs (engine/preference.py): the policy learns to
raise the log-probability of each chosen answer over the rejected one, measured against a frozen reference (the
starting weights). With the margin m = (log πθ(chosen) - log πref(chosen)) - (log πθ(rejected) - log πref(rejected))
(log-probs summed over the completion's tokens), the loss of a pair is, by dpo.loss_type:

- "sigmoid" (DPO): -(1 - ε) log σ(β m) - ε log σ(-β m), ε = dpo.label_smoothing (conservative DPO);
- "ipo": (m - 1 / (2β))²;
- "hinge" (SLiC): max(0, 1 - β m).

The reference is one of three, none of them a second copy where it can be avoided:
- without LoRA, a frozen deep copy of the starting weights, made before the model is wrapped (as GRPO's KL anchor);
- with LoRA, the policy itself with its adapters switched off (the frozen base; engine/lora.py adapters_disabled);
- with dpo.precompute_reference, the reference's log-probs of every training and held-out pair, computed in one pass
  at start-up, before any checkpoint is loaded, so from the starting weights, and kept with the pairs; no reference
  model is held while training. The training pairs' values are saved with every checkpoint (16 bytes a pair, with
  the digest of the pairs they belong to in its meta.json) and a resume reads them back instead of a forward over
  every pair: exactly the values of the first start. A checkpoint without them (saved before they were, or of other
  pairs: the data changed) has them computed again from the starting weights, before it loads. The held-out
  pairs' (train.eval_batches batches a rank) are computed again at every start.

Each step logs loss, rewards_chosen and rewards_rejected (β times each side's log-ratio to the reference, the implicit
rewards, means over the step's pairs), reward_margin (their difference) and reward_accuracy (the fraction of pairs
whose chosen reward is the higher). The eval logs eval_preference_accuracy and eval_preference_margin on the held-out
pairs, eval_loss (the SFT loss per token of the held-out chosen completions, to see the model's language not drift)
and, for built-in tasks, eval_exact_match of greedy answers, as SFT evaluates. At step 0 the policy is the reference,
so every margin is 0 and eval_preference_accuracy 0 (a tie is not a win).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from prime_train.config.schema import Config
from prime_train.contract import Phase
from prime_train.engine import parallel
from prime_train.engine.loop import TrainingJob, main
from prime_train.engine.lora import adapters_disabled
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.preference import (
    PairBatch,
    PairLoader,
    build_eval_pairs,
    build_pair_loader,
    reference_of_batches,
    reference_of_rows,
    sequence_logprobs,
)

logger = logging.getLogger("prime_train.engine")

LOSS_TYPES = ("sigmoid", "ipo", "hinge")
# dpo.precompute_reference: the training pairs' reference log-probs [N, 2] in a checkpoint, and the digest of the pairs
# they belong to in its meta.json
REFERENCE_KEY = "reference/logps"
REFERENCE_META = "reference_pairs"


def preference_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair losses [B], and the implicit rewards of chosen and rejected [B] (detached): β · (policy - reference)."""
    margin = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * margin) - label_smoothing * F.logsigmoid(-beta * margin)
    elif loss_type == "ipo":
        losses = (margin - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * margin)
    else:
        raise EngineConfigError(f"dpo.loss_type must be one of {', '.join(LOSS_TYPES)}, got {loss_type!r}")
    rewards_chosen = beta * (policy_chosen - ref_chosen).detach()
    rewards_rejected = beta * (policy_rejected - ref_rejected).detach()
    return losses, rewards_chosen, rewards_rejected


class DPOJob(TrainingJob):
    """DPO on preference pairs against a frozen reference: the batch source is pair batches, the step the DPO loss."""

    job_name = "dpo"
    eval_keys = ("eval_preference_accuracy", "eval_preference_margin", "eval_loss", "eval_exact_match")

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        from prime_train.engine.data import held_out_examples

        self.eval_pairs = build_eval_pairs(
            cfg.data, self.tokenizer, micro_batch_size=cfg.train.micro_batch_size, rank=self.dist.rank,
            world_size=self.dist.world_size, seed=cfg.run.seed, max_batches=cfg.train.eval_batches,
            cache=self.row_cache(),
        )  # fmt: skip
        self.eval_examples = held_out_examples(cfg.data, cfg.run.seed, 64)
        self._reference_source: Path | None = None  # the checkpoint the training pairs' reference values came from
        self._eval_reference_done = False
        if cfg.dpo.precompute_reference:
            # computed or read when fit() resumes, before a checkpoint loads: the model holds the starting weights
            self.checkpointer.meta_fields[REFERENCE_META] = self.batches.rows.digest()
            self.checkpointer.before_load = self._reference_before_load

    def configure(self) -> None:
        self.reference = None

    def prepare_model(self, model) -> None:
        cfg = self.cfg
        if not cfg.lora.enabled and not cfg.dpo.precompute_reference:
            # the starting weights, before the model is wrapped or sharded; with LoRA the reference is the policy with
            # its adapters off, and precomputed log-probs need no model at all
            self.reference = copy.deepcopy(model).to(self.dist.device).eval().requires_grad_(False)

    def build_batch_source(self) -> PairLoader:
        cfg = self.cfg
        return build_pair_loader(
            cfg.data, self.tokenizer, micro_batch_size=cfg.train.micro_batch_size, rank=self.dist.rank,
            world_size=self.dist.world_size, seed=cfg.run.seed, device=torch.device("cpu"), cache=self.row_cache(),
        )  # fmt: skip

    # ------------------------------------------------------------------ the reference

    def _saved_reference_fits(self, path: Path, meta: dict[str, Any] | None) -> bool:
        """Whether checkpoint `path` holds reference log-probs of exactly these training pairs."""
        from prime_train.engine import safe_dcp

        if not isinstance(meta, dict) or meta.get(REFERENCE_META) != self.checkpointer.meta_fields[REFERENCE_META]:
            return False
        fits = None
        if self.dist.rank == 0:  # every rank decides alike: they all compute, or none does
            try:
                saved = safe_dcp.read_metadata(path).state_dict_metadata.get(REFERENCE_KEY)
                fits = tuple(getattr(saved, "size", ())) == (len(self.batches.rows), 2)
            except Exception:  # verified already: loading will say what is wrong
                fits = False
        return bool(self.checkpointer.from_rank0(fits))

    def _reference_before_load(self, path: Path | None, meta: dict[str, Any] | None, touched: bool) -> None:
        """dpo.precompute_reference, called by the checkpointer before it loads `path` (None: a fresh start): the
        held-out pairs' values computed now, from the starting weights; the training pairs' read with the
        checkpoint when it holds those of these pairs, else computed now too."""
        rows = self.batches.rows
        was_training = self.model.training
        self.model.eval()
        try:
            if not self._eval_reference_done:
                self._beat(None, Phase.STARTUP)
                reference_of_batches(self.eval_pairs, self._reference_logprobs)
                self._eval_reference_done = True
            self.state.tables.pop(REFERENCE_KEY, None)  # a load fills it only from a checkpoint of these pairs
            if path is not None and self._saved_reference_fits(path, meta):
                rows.ref_logps = np.full((len(rows), 2), np.nan)
                self.state.tables[REFERENCE_KEY] = torch.from_numpy(rows.ref_logps)  # the load fills it in place
                self._reference_source = path
            elif touched:
                raise RuntimeError(
                    f"{path} holds no reference log-probs of these pairs, and a failed load of a later checkpoint "
                    "left the model part loaded: this start cannot compute them from the starting weights; the next "
                    "start will, before it loads"
                )
            else:
                self._beat(None, Phase.STARTUP)
                reference_of_rows(rows, self.cfg.train.micro_batch_size, self._reference_logprobs)
                self._reference_source = None
        finally:
            self.model.train(was_training)

    def resume(self) -> None:
        super().resume()
        if not self.cfg.dpo.precompute_reference:
            return
        rows, source = self.batches.rows, self._reference_source
        self.state.tables[REFERENCE_KEY] = torch.from_numpy(rows.ref_logps)  # saved with every checkpoint from here
        if source is None:
            logger.info("reference log-probs precomputed for %d pairs; no reference model held", len(rows))
        elif not np.isfinite(rows.ref_logps).all():
            raise EngineConfigError(
                f"{source} holds reference log-probs ({REFERENCE_KEY}) that are not finite numbers: resume from an "
                "earlier checkpoint (ckpt.resume = 'step-N') or start over with --fresh"
            )
        else:
            logger.info(
                "reference log-probs of %d pairs read from checkpoint %s; no reference model held", len(rows),
                source.name,
            )  # fmt: skip

    def _reference_logprobs(self, batch: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference's summed completion log-probs of `batch` (chosen, rejected): precomputed, the frozen copy,
        the policy with its adapters off (LoRA), or the policy itself while it still holds the starting weights."""
        device = self.dist.device
        if batch.ref_logps is not None:
            ref = batch.ref_logps.to(device)
            return ref[: batch.num_pairs], ref[batch.num_pairs :]
        batch = batch.to(device)
        with torch.no_grad():
            if self.reference is not None:
                return sequence_logprobs(self.reference, batch, self._autocast)
            if self.cfg.lora.enabled:
                with adapters_disabled(self.model):
                    return sequence_logprobs(self.model, batch, self._autocast)
            return sequence_logprobs(self.model, batch, self._autocast)  # precomputing: not trained yet

    # ------------------------------------------------------------------ one step

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over global_batch_size pairs, accumulated micro-batch by micro-batch; the loss is the
        mean over the step's pairs on every rank. No host sync: the metrics stay on the device."""
        from prime_train.engine.schedule import batch_size_at

        cfg, dist, timer, dpo = self.cfg, self.dist, self.timer, self.cfg.dpo
        global_pairs = batch_size_at(self.state.tokens_seen, cfg.train, cfg.data.seq_len, dist.world_size)
        accum = max(1, global_pairs // (cfg.train.micro_batch_size * dist.world_size))
        with timer("data"):
            batches = [next(self.batches) for _ in range(accum)]
        local = [sum(b.num_pairs for b in batches), sum(b.num_tokens for b in batches)]
        with timer("communication"):
            global_pairs, step_tokens = parallel.all_reduce_host_ints(local, dist)
        scale = dist.world_size / max(1, global_pairs)  # DDP/FSDP average gradients over ranks: a global mean
        # loss, rewards_chosen, rewards_rejected, wins (chosen reward higher), summed over this rank's pairs
        sums = torch.zeros(4, dtype=torch.float32, device=dist.device)
        router: list[torch.Tensor] = []  # an MoE's router-loss terms (engine/hf_head.py), each weighted by its pairs
        for i, batch in enumerate(batches):
            with timer("data"):
                batch = batch.to(dist.device, non_blocking=dist.device.type == "cuda")
            with timer("forward"):
                ref_chosen, ref_rejected = self._reference_logprobs(batch)
            with parallel.grad_sync(self.model, enabled=i == accum - 1):
                with timer("forward"):
                    terms: list[torch.Tensor] = []
                    chosen, rejected = sequence_logprobs(self.model, batch, self._autocast, router=terms)
                    losses, r_chosen, r_rejected = preference_loss(
                        chosen, rejected, ref_chosen, ref_rejected, beta=dpo.beta, loss_type=dpo.loss_type,
                        label_smoothing=dpo.label_smoothing,
                    )  # fmt: skip
                    objective = losses.sum()
                    if terms:  # weighted by the micro-batch's pairs, as the pairs' losses are summed
                        objective = objective + terms[0] * batch.num_pairs
                        router.append(terms[0].detach() * batch.num_pairs)
                with timer("backward"):
                    (objective * scale).backward()
            wins = (r_chosen > r_rejected).float()
            sums += torch.stack([losses.detach().sum(), r_chosen.sum(), r_rejected.sum(), wins.sum()])
        with timer("optimizer"):
            grad_norm = self.clip_grad_norm()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if router:
            sums = torch.cat([sums, torch.stack(router).sum().reshape(1)])
        with timer("communication"):
            parallel.all_reduce_(sums, dist)
        self.state.step += 1
        self.state.tokens_seen += step_tokens
        mean = sums / max(1, global_pairs)
        out: dict[str, Any] = {
            "loss": mean[0],
            "rewards_chosen": mean[1],
            "rewards_rejected": mean[2],
            "reward_margin": mean[1] - mean[2],
            "reward_accuracy": mean[3],
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": self.state.tokens_seen,
            "global_batch": global_pairs,
        }
        if router:
            out["router_loss"] = mean[4]  # an MoE's: coef x its load-balancing loss, pair-weighted
        if dist.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(dist.device) / 2**30
        return out

    def log_fields(self, m: dict) -> list[str]:
        return [
            f"loss {m['loss']:.4f}",
            *([f"router {m['router_loss']:.4f}"] if "router_loss" in m else []),
            f"margin {m['reward_margin']:.3f}",
            f"acc {m['reward_accuracy']:.3f}",
            f"lr {m['lr']:.2e}",
            f"grad {m['grad_norm']:.3f}",
            f"{m['tokens_per_s'] / 1e3:.1f}k tok/s",
        ]

    # ------------------------------------------------------------------ evaluation

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out pairs: the fraction whose implicit reward ranks chosen first, the mean margin β · m, and the SFT
        loss per token of the chosen completions; greedy exact match for built-in tasks."""
        from prime_train.engine.evaluate import exact_match
        from prime_train.tasks import get_task

        dist, beta = self.dist, self.cfg.dpo.beta
        # wins, margin sum, pairs, chosen NLL sum, chosen tokens
        totals = torch.zeros(5, dtype=torch.float64)
        was_training = self.model.training
        self.model.eval()
        for batch in self.eval_pairs:
            on_device = batch.to(dist.device)
            ref_chosen, ref_rejected = self._reference_logprobs(on_device)
            chosen, rejected = sequence_logprobs(self.model, on_device, self._autocast)
            margin = (beta * ((chosen - ref_chosen) - (rejected - ref_rejected))).double().cpu()
            counted = batch.counted if batch.counted is not None else torch.ones(batch.num_pairs, dtype=torch.bool)
            weight = counted.double()
            tokens = (batch.labels[: batch.num_pairs, 1:] != -100).sum(-1).double()
            totals += torch.stack([
                ((margin > 0).double() * weight).sum(), (margin * weight).sum(), weight.sum(),
                (-chosen.double().cpu() * weight).sum(), (tokens * weight).sum(),
            ])  # fmt: skip
        self.model.train(was_training)
        totals = parallel.all_reduce_sum(totals, dist)
        out: dict[str, float] = {}
        if totals[2] > 0:
            out["eval_preference_accuracy"] = float(totals[0] / totals[2])
            out["eval_preference_margin"] = float(totals[1] / totals[2])
        if totals[4] > 0:
            out["eval_loss"] = float(totals[3] / totals[4])
        if self.eval_examples:
            task = get_task(next(d.task for d in self.cfg.data.datasets if d.task))
            out["eval_exact_match"], _ = exact_match(
                self.model, self.tokenizer, self.eval_examples, task.score, dist, self._autocast
            )
        return out

    def close(self) -> None:
        super().close()
        self.reference = None


if __name__ == "__main__":
    main(DPOJob)
