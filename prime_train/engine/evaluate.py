"""Evaluation: held-out loss and perplexity, greedy exact match, multiple choice, sample generations.

Every function is a collective when the model is sharded: all ranks call it with the same
number of forward passes (greedy decoding runs a fixed number of steps, never stopping early
on one rank while another still needs the model).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

import torch
import torch.nn.functional as F

from prime_train.engine.hf_head import collect_router_loss
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import chunked_head, last_logits_only
from prime_train.engine.parallel import DistInfo, all_reduce_sum


def token_losses(
    model, input_ids, position_ids, labels, router: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of next-token losses over labelled positions, and their count (labels use the HF convention). An MoE
    with its router loss on (engine/hf_head.py) adds that term to the sum; `router`, when given, receives it."""
    if chunked_head(model):
        # the fused, chunked loss: never the full fp32 logits
        out = model(input_ids=input_ids, position_ids=position_ids, labels=labels, loss_reduction="sum")
        collect_router_loss(out, router)
        return out.loss, (labels[:, 1:] != -100).sum()
    logits = model(input_ids=input_ids, position_ids=position_ids).logits
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    loss_sum = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss_sum, (shift_labels != -100).sum()


def row_losses(model, input_ids, position_ids, labels, router: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """As token_losses' sum, and each row's own sum of its losses ([B] fp32, no gradient), from the same forward."""
    if chunked_head(model):
        out = model(
            input_ids=input_ids, position_ids=position_ids, labels=labels, loss_reduction="sum",
            return_token_losses=True,
        )  # fmt: skip
        collect_router_loss(out, router)
        return out.loss, out.token_losses.sum(1)
    logits = model(input_ids=input_ids, position_ids=position_ids).logits
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    per_token = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.size(-1)), shift_labels.reshape(-1), ignore_index=-100, reduction="none"
    ).view(shift_labels.shape)
    return per_token.sum(), per_token.detach().sum(1)


@torch.no_grad()
def eval_loss(model, batches, dist: DistInfo, autocast: Callable[[], AbstractContextManager]) -> dict[str, float]:
    """Mean held-out loss per token across ranks, and its perplexity."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for batch in batches:
        batch = batch.to(dist.device)
        with autocast():
            loss_sum, count = token_losses(model, batch.input_ids, batch.positions, batch.labels)
        total += torch.tensor([loss_sum.item(), count.item()], dtype=torch.float64)
    total = all_reduce_sum(total, dist)
    model.train(was_training)
    if total[1] == 0:
        return {}
    loss = float(total[0] / total[1])
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 50.0))}


@torch.no_grad()
def greedy_complete(
    model,
    tokenizer,
    prompts: Sequence[str] | Sequence[list[int]],
    dist: DistInfo,
    autocast: Callable[[], AbstractContextManager],
    max_new_tokens: int = 16,
) -> list[str]:
    """Greedy completions of `prompts` (texts, or token ids as the data rendered them), decoded up to the first
    eos; a fixed number of forward passes."""
    if not prompts:
        return []
    was_training = model.training
    model.eval()
    encoded = [p if isinstance(p, list) else tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(len(e) for e in encoded)
    pad = tokenizer.pad_token_id
    # left-pad so every row's next token sits in the last column; positions count real tokens only
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros((len(encoded), width), dtype=torch.long)
    for row, e in enumerate(encoded):
        ids[row, width - len(e) :] = torch.tensor(e)
        mask[row, width - len(e) :] = 1
    ids, mask = ids.to(dist.device), mask.to(dist.device)
    out = []
    last = last_logits_only(model)  # only the last position is read: no rows x width x vocab logits
    for _ in range(max_new_tokens):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with autocast():
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, **last).logits
        nxt = logits[:, -1].argmax(-1)
        out.append(nxt)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones_like(nxt)[:, None]], dim=1)
    model.train(was_training)
    generated = torch.stack(out, dim=1).tolist()
    texts = []
    for row in generated:
        if tokenizer.eos_token_id in row:
            row = row[: row.index(tokenizer.eos_token_id)]
        texts.append(tokenizer.decode(row, skip_special_tokens=True))
    return texts


def held_out_completions(batches, limit: int = 3) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, expected completion ids) of the first `limit` held-out documents that have a prompt: the tokens
    before the first labelled one (a prompt_completion record's prompt, a chat record's turns up to the answer, as
    the data rendered them) and the labelled ones after. Plain text (loss on every token) has none."""
    found: list[tuple[list[int], list[int]]] = []
    for batch in batches:
        for ids, labels, positions in zip(
            batch.input_ids.tolist(), batch.labels.tolist(), batch.position_ids.tolist(), strict=True
        ):
            starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
            for begin, end in itertools.pairwise(starts):
                labelled = [i for i in range(begin, end) if labels[i] != -100]
                if labelled and labelled[0] - begin >= 2:  # a prompt of its own, not just the document's first token
                    found.append((ids[begin : labelled[0]], [ids[i] for i in labelled]))
                if len(found) >= limit:
                    return found
    return found


def exact_match(
    model, tokenizer, examples, score, dist: DistInfo, autocast, *, batch_size: int = 32, max_new_tokens: int = 16
) -> tuple[float, list[tuple[str, str, str]]]:
    """Mean score of greedy answers on `examples` split over ranks; also a few (prompt, answer, output) samples."""
    # split over data-parallel replicas: a tensor-parallel group answers the same prompts together (its sums then
    # count each answer once per rank of the group, in the numerator and the denominator alike)
    mine = list(examples)[dist.dp_rank :: dist.dp_size]
    # every rank runs the same number of batches so sharded models stay in lockstep
    per_rank = math.ceil(len(examples) / dist.dp_size)
    total = torch.zeros(2, dtype=torch.float64)
    samples: list[tuple[str, str, str]] = []
    for start in range(0, per_rank, batch_size):
        chunk = mine[start : start + batch_size]
        prompts = [e.prompt for e in chunk] or [examples[0].prompt]
        outputs = greedy_complete(model, tokenizer, prompts, dist, autocast, max_new_tokens)
        for example, output in zip(chunk, outputs, strict=False):
            total += torch.tensor([score(example, output), 1.0], dtype=torch.float64)
            if len(samples) < 3:
                samples.append((example.prompt, example.answer, output))
    total = all_reduce_sum(total, dist)
    return (float(total[0] / total[1]) if total[1] else float("nan")), samples


@torch.no_grad()
def multiple_choice(model, tokenizer, path: str | Path, dist: DistInfo, autocast, limit: int = 500) -> float:
    """HellaSwag-style accuracy: the ending with the lowest mean token loss given the context wins."""
    from prime_train.tasks import read_multiple_choice

    try:
        items = read_multiple_choice(path, limit)
    except ValueError as exc:
        raise EngineConfigError(f"train.mc_eval_path: {exc}") from None
    was_training = model.training
    model.eval()
    per_rank = math.ceil(len(items) / dist.dp_size)
    mine = items[dist.dp_rank :: dist.dp_size]
    total = torch.zeros(2, dtype=torch.float64)
    for i in range(per_rank):
        context, endings, label = mine[i] if i < len(mine) else items[0]
        ctx_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        losses = []
        for ending in endings:
            end_ids = tokenizer(ending, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([ctx_ids + end_ids], device=dist.device)
            labels = ids.clone()
            labels[:, : len(ctx_ids)] = -100
            positions = torch.arange(ids.size(1), device=dist.device)[None]
            with autocast():
                loss_sum, count = token_losses(model, ids, positions, labels)
            losses.append(loss_sum.item() / max(1, count.item()))
        if i < len(mine):
            total += torch.tensor([float(min(range(len(losses)), key=losses.__getitem__) == label), 1.0])
    model.train(was_training)
    total = all_reduce_sum(total, dist)
    return float(total[0] / total[1]) if total[1] else float("nan")


class Evaluator:
    """When a job evaluates, and the job's evaluation (`run`: its `eval_*` metrics; every rank calls it).

    A baseline before the first step of a run (step 0), every train.eval_interval steps and at the last step; never
    in a profile (`enabled` False), which times training steps alone.
    """

    def __init__(self, run: Callable[[], dict[str, float]], interval: int, max_steps: int, *, enabled: bool = True):
        self.run = run
        self.interval = interval
        self.max_steps = max_steps
        self.enabled = enabled

    def baseline_due(self, step: int) -> bool:
        """Whether a run starting at `step` first evaluates the model it starts from (a fresh run: step 0)."""
        return self.enabled and step == 0

    def due(self, step: int) -> bool:
        """Whether the step just trained, `step`, is evaluated."""
        return self.enabled and (step % self.interval == 0 or step == self.max_steps)
