"""Preference pairs for the dpo and reward jobs: {prompt, chosen, rejected} records to resumable pair batches.

A pair comes from a local .jsonl/.parquet record (format "preference", or "auto" when the record has the chosen and
rejected fields) or from a built-in task: the task's right answer is `chosen` and a corrupted one `rejected`
(`corrupt_answer`: for reverse-text the word not reversed or two of its letters swapped, for arithmetic a near
miss, for sorting the sorted digits with two swapped), drawn from run.seed, so every preference job runs on the CPU
with nothing to download. A record's prompt is a string or chat messages; chosen and rejected are strings or the
assistant message(s) that follow the prompt. Records are read by engine/records.py (files, file:line in every error)
and tokenized by engine/documents.py's Encoder, as SFT records are: prompt tokens masked out of the loss, the
completion and its eos labelled. Pairs longer than data.seq_len keep the end of the prompt and the start of the
completions (the same prompt cut on both sides).

Held-out pairs are chosen as SFT chooses held-out records, by a hash of the content and the seed; for a built-in
task the content hashed is the SFT record's (prompt, answer), so a DPO run on an SFT model of the same task and seed
evaluates on the examples SFT held out. Every rank reads all pairs; rank r takes positions r, r + world_size, ... of
one seeded order per epoch, through the SFT loader's own order and resumable loader (engine/data.py), whose
state_dict (epoch, index) goes into the checkpoint the same way.

A micro-batch of B pairs is one PairBatch of 2B rows: rows [0, B) the chosen sequences, rows [B, 2B) the rejected
ones of the same pairs, right-padded to the longest row. `sequence_logprobs` sums each row's completion-token
log-probs.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F

from prime_train import tasks
from prime_train.engine.data import TrainLoader, _BatchesAt, _check_data_config, _EpochOrder
from prime_train.engine.documents import Document, Encoder
from prime_train.engine.hf_head import collect_router_loss
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import chunked_head
from prime_train.engine.packing import IGNORE_INDEX, PackingStats
from prime_train.engine.records import Record, dataset_key, detect_format, is_held_out, read_records
from prime_train.engine.row_cache import RowCache, rows_key

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import AbstractContextManager

    from transformers import PreTrainedTokenizerBase

    from prime_train.config.schema import DataConfig, DatasetConfig

logger = logging.getLogger("prime_train.engine.data")

PREFERENCE_FORMAT = "preference"
PREFERENCE_JOBS = ("dpo", "reward")

Messages = list[dict[str, str]]


# ----------------------------------------------------------------------------------------------------------------
# Records to pairs
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """One preference pair: the prompt (text or chat messages) and two answers to it, the preferred one first.

    chosen/rejected are text, or the assistant message(s) after the prompt when the pair is chat."""

    prompt: str | Messages
    chosen: str | Messages
    rejected: str | Messages
    where: str  # file:line, file row N, task T example N

    @property
    def is_chat(self) -> bool:
        return any(isinstance(part, list) for part in (self.prompt, self.chosen, self.rejected))

    def content(self) -> Any:
        """What the held-out hash reads (JSON-able)."""
        return [self.prompt, self.chosen, self.rejected]


def _messages(record: Record, key: str, name: str, value: Any) -> Messages:
    if not value:
        raise EngineConfigError(f"{record.where}: field {name!r} is an empty list; give at least one message")
    for number, message in enumerate(value):
        for part in ("role", "content"):
            if not isinstance(message, dict) or not isinstance(message.get(part), str):
                raise EngineConfigError(
                    f"{record.where}: {name}[{number}].{part} is missing or not a string (chat messages are "
                    f"{{role, content}} objects; {key} names the field)"
                )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _part(ds: DatasetConfig, index: int, record: Record, which: str) -> str | Messages:
    name = getattr(ds, f"{which}_field")
    key = dataset_key(index, f"{which}_field")
    if name not in record.fields:
        have = ", ".join(repr(f) for f in sorted(record.fields)) or "no fields"
        raise EngineConfigError(
            f"{record.where}: preference record has no field {name!r} (it has {have}); add it, or set {key} to the "
            "field that holds it"
        )
    value = record.fields[name]
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return _messages(record, key, name, value)
    raise EngineConfigError(
        f"{record.where}: field {name!r} must be a string or a list of chat messages, got {type(value).__name__}"
    )


def extract_pair(ds: DatasetConfig, index: int, record: Record) -> Pair:
    """The pair a preference record holds, validated: every part present, chosen and rejected different."""
    prompt, chosen, rejected = (_part(ds, index, record, which) for which in ("prompt", "chosen", "rejected"))
    if chosen == rejected:
        raise EngineConfigError(
            f"{record.where}: {ds.chosen_field!r} and {ds.rejected_field!r} are the same, so the pair prefers "
            "nothing; fix or remove the record"
        )
    return Pair(prompt, chosen, rejected, record.where)


def corrupt_answer(task: str, example: tasks.Example, rng: random.Random) -> str:
    """A wrong answer to a built-in task's example, near the right one (a hard negative), drawn from `rng`."""
    answer = example.answer
    if task == "arithmetic":
        return str(int(answer) + rng.choice((-2, -1, 1, 2)))
    candidates = []
    if task == "reverse-text":
        candidates.append(example.prompt.removeprefix("reverse ").removesuffix("="))  # the word not reversed
    swaps = [i for i in range(len(answer) - 1) if answer[i] != answer[i + 1]]
    if swaps:
        i = rng.choice(swaps)
        candidates.append(answer[:i] + answer[i + 1] + answer[i] + answer[i + 2 :])
    rng.shuffle(candidates)
    for candidate in candidates:
        if candidate != answer:
            return candidate
    # every character the same (a palindrome of one letter, "111"): change the first one
    alphabet = "0123456789" if task == "sorting" else "abcdefghijklmnopqrstuvwxyz"
    return alphabet[(alphabet.index(answer[0]) + 1) % len(alphabet)] + answer[1:] if answer[0] in alphabet else "?"


def task_pairs(task: str, num_examples: int, seed: int) -> list[tuple[Pair, tuple[str, str]]]:
    """The pairs of a built-in task and, for each, the content the SFT split hashes (its prompt and answer)."""
    rng = random.Random(f"{task}:{seed}:rejected")
    out = []
    for number, example in enumerate(tasks.generate_examples(task, num_examples, seed)):
        rejected = corrupt_answer(task, example, rng)
        pair = Pair(example.prompt, example.answer, rejected, f"task {task} example {number}")
        out.append((pair, (example.prompt, example.answer)))
    return out


def check_preference_format(ds: DatasetConfig, index: int, fmt: str, where: str) -> None:
    """A preference job's dataset must hold preference records (or be a built-in task)."""
    if fmt != PREFERENCE_FORMAT:
        raise EngineConfigError(
            f"{dataset_key(index, 'format')}: {where} reads as {fmt!r} records, but the dpo and reward jobs train on "
            f"preference pairs: give {{{ds.prompt_field}, {ds.chosen_field}, {ds.rejected_field}}} records with "
            "format 'preference' (or 'auto'), or a built-in task"
        )


def read_pairs(data: DataConfig, seed: int, *, held_out: bool) -> list[list[Pair]]:
    """Every dataset's training pairs (or its held-out ones), in file order; every rank reads them all."""
    _check_data_config(data)
    if data.streaming:
        raise EngineConfigError("data.streaming: preference pairs are read whole at start; set it to false")
    out = []
    for index, ds in enumerate(data.datasets):
        kept = []
        if ds.task is not None:
            for pair, content in task_pairs(ds.task, ds.num_examples, seed):
                if is_held_out(content, seed, data.held_out_fraction) == held_out:
                    kept.append(pair)
        else:
            records, _ = read_records(ds, index, seed, 0, 1, split_by_rank=False)
            fmt = None
            for record in records:
                if fmt is None:
                    fmt = detect_format(ds, index, record)
                    check_preference_format(ds, index, fmt, record.where)
                pair = extract_pair(ds, index, record)
                if is_held_out(pair.content(), seed, data.held_out_fraction) == held_out:
                    kept.append(pair)
        out.append(kept)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Pairs to token sequences
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TokenPair:
    """A pair as token ids: chosen and rejected sequences (prompt included), each with its loss mask."""

    chosen: Document
    rejected: Document


def _as_messages(part: str | Messages, role: str) -> Messages:
    return [{"role": role, "content": part}] if isinstance(part, str) else part


def _prompt_length(doc: Document) -> int:
    """Tokens before the first labelled one."""
    return next((i for i, learn in enumerate(doc.loss) if learn), len(doc.ids))


def _cut(doc: Document, start: int, end: int) -> Document:
    return Document(doc.ids[start:end], doc.loss[start:end])


class PairEncoder:
    """Tokenizes pairs with the SFT Encoder (string pairs as prompt_completion documents, chat pairs through the chat
    template) and truncates them to seq_len."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> None:
        self.encoder = Encoder(tokenizer, "sft")
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.truncated_tokens = 0

    def encode(self, pairs: list[Pair]) -> list[TokenPair]:
        plain = [i for i, p in enumerate(pairs) if not p.is_chat]
        chat = [i for i, p in enumerate(pairs) if p.is_chat]
        docs: dict[int, tuple[Document, Document]] = {}
        for side in (0, 1):
            answers = [(pairs[i].prompt, (pairs[i].chosen, pairs[i].rejected)[side]) for i in plain]
            for i, doc in zip(plain, self.encoder.encode("prompt_completion", answers), strict=True):
                docs[i] = (*docs.get(i, ()), doc)  # type: ignore[assignment]
        for i in chat:
            docs[i] = self._chat_pair(pairs[i])  # type: ignore[assignment]
        return [self._truncate(*docs[i]) for i in range(len(pairs))]

    def _chat_pair(self, pair: Pair) -> tuple[Document, Document]:
        prompt = _as_messages(pair.prompt, "user")
        chosen, rejected = (
            self.encoder.encode("chat", [prompt + _as_messages(side, "assistant")])[0]
            for side in (pair.chosen, pair.rejected)
        )
        # assistant turns inside the prompt are context, not the answer compared: no loss on the prompt's tokens
        text = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        prompt_ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        for doc in (chosen, rejected):
            if doc.ids[: len(prompt_ids)] == prompt_ids:
                doc.loss[: len(prompt_ids)] = [False] * len(prompt_ids)
        return chosen, rejected

    def _truncate(self, chosen: Document, rejected: Document) -> TokenPair:
        """Both sides within seq_len: the prompt cut from its start (the same cut on both sides, so they share the
        prompt's end), then each completion from its end; at least half of seq_len stays for the completions."""
        limit = self.seq_len
        if max(len(chosen.ids), len(rejected.ids)) <= limit:
            return TokenPair(chosen, rejected)
        prompt = min(_prompt_length(chosen), _prompt_length(rejected))
        longest = max(len(chosen.ids), len(rejected.ids)) - prompt
        keep = min(prompt, max(limit - longest, limit // 2))
        start = prompt - keep
        cut = [_cut(doc, start, start + limit) for doc in (chosen, rejected)]
        self.truncated_tokens += len(chosen.ids) + len(rejected.ids) - sum(len(d.ids) for d in cut)
        return TokenPair(*cut)


# ----------------------------------------------------------------------------------------------------------------
# Pair batches and the resumable loader
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class PairBatch:
    """B pairs as 2B rows: [0, B) chosen, [B, 2B) rejected, right-padded; every tensor [2B, T] long (pad_mask bool).

    labels follow the HF convention (aligned with input_ids, -100 on the prompt and the padding). `ref_logps` [2B]
    float32: the reference's summed completion log-probs of each row when they were precomputed, else None.
    `counted` [B] bool: False for pairs an eval batch repeats only to keep the ranks in step (None: all count)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    pad_mask: torch.Tensor
    ref_logps: torch.Tensor | None = None
    counted: torch.Tensor | None = None

    @property
    def num_pairs(self) -> int:
        return self.input_ids.shape[0] // 2

    @property
    def num_tokens(self) -> int:
        """Tokens that are not padding (both sides)."""
        return self.input_ids.numel() - int(self.pad_mask.sum())

    @property
    def num_loss_tokens(self) -> int:
        """Labelled tokens (both sides)."""
        return int((self.labels != IGNORE_INDEX).sum())

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> PairBatch:
        return PairBatch(
            fn(self.input_ids), fn(self.labels), fn(self.position_ids), fn(self.pad_mask),
            ref_logps=None if self.ref_logps is None else fn(self.ref_logps),
            counted=None if self.counted is None else fn(self.counted),
        )  # fmt: skip

    def to(self, device: torch.device, non_blocking: bool = False) -> PairBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PairBatch:
        return self._map(lambda t: t.pin_memory())


def collate_pairs(pairs: list[TokenPair], pad_id: int, ref_logps: np.ndarray | None = None) -> PairBatch:
    """One PairBatch of `pairs`; `ref_logps` [B, 2] (chosen, rejected) when precomputed."""
    docs = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    width = max(len(d.ids) for d in docs)
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(docs), width), IGNORE_INDEX, dtype=torch.long)
    pad = torch.ones((len(docs), width), dtype=torch.bool)
    for row, doc in enumerate(docs):
        n = len(doc.ids)
        ids[row, :n] = torch.tensor(doc.ids)
        labels[row, :n] = torch.where(torch.tensor(doc.loss), ids[row, :n], IGNORE_INDEX)
        pad[row, :n] = False
    positions = torch.arange(width).expand(len(docs), width).clone()
    ref = None
    if ref_logps is not None:
        ref = torch.from_numpy(np.concatenate([ref_logps[:, 0], ref_logps[:, 1]]).astype(np.float32))
    return PairBatch(ids, labels, positions, pad, ref_logps=ref)


class PairRows:
    """A rank's tokenized training pairs; `batch(indices)` is what the SFT loader's dataset asks of packed rows."""

    def __init__(self, pairs: list[TokenPair], pad_id: int, stats: PackingStats) -> None:
        self.pairs = pairs
        self.pad_id = pad_id
        self.stats = stats
        self.lengths = [max(len(p.chosen.ids), len(p.rejected.ids)) for p in pairs]
        # [N, 2] summed completion log-probs of (chosen, rejected) under the reference, once precomputed
        self.ref_logps: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.pairs)

    def digest(self) -> str:
        """What the pairs are, token by token and in order: reference log-probs saved for other pairs are not theirs."""
        h = hashlib.sha256()
        for pair in self.pairs:
            for doc in (pair.chosen, pair.rejected):
                h.update(np.asarray(doc.ids, dtype=np.int64).tobytes() + b"|")
                h.update(np.asarray(doc.loss, dtype=np.bool_).tobytes() + b";")
        return h.hexdigest()

    def batch(self, indices: np.ndarray) -> PairBatch:
        ref = None if self.ref_logps is None else self.ref_logps[indices]
        return collate_pairs([self.pairs[i] for i in indices], self.pad_id, ref)


class PairLoader(TrainLoader):
    """Endless pair micro-batches for one rank, resumable from `state_dict()` (the SFT loader, over pairs)."""

    @property
    def rows(self) -> PairRows:
        """The pairs it reads (every rank holds all of them)."""
        return self._dataset.rows  # type: ignore[return-value]


def _pair_stats(tokens: list[TokenPair], truncated: int) -> PackingStats:
    real = sum(len(p.chosen.ids) + len(p.rejected.ids) for p in tokens)
    return PackingStats(len(tokens), 2 * len(tokens), real, truncated, 1.0)


@dataclass
class TokenizedPairs:
    """What tokenizing a job's pairs gives: the pairs, how many each dataset gave, the tokens truncation cut."""

    tokens: list[TokenPair]
    sizes: list[int]
    truncated: int

    def arrays(self) -> dict[str, np.ndarray]:
        """As the row cache stores them: every sequence's ids and loss flags end to end (chosen, rejected, chosen,
        ...), their lengths, the datasets' sizes and the truncated count."""
        docs = [doc for tp in self.tokens for doc in (tp.chosen, tp.rejected)]
        return {
            "ids": np.concatenate([np.asarray(d.ids, dtype=np.int32) for d in docs] or [np.zeros(0, np.int32)]),
            "loss": np.concatenate([np.asarray(d.loss, dtype=np.bool_) for d in docs] or [np.zeros(0, np.bool_)]),
            "lengths": np.array([len(d.ids) for d in docs], dtype=np.int32),
            "sizes": np.array(self.sizes, dtype=np.int64),
            "truncated": np.array([self.truncated], dtype=np.int64),
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], *, seq_len: int, vocab: int) -> TokenizedPairs:
        """The pairs these arrays hold; ValueError naming the first thing that is not as `arrays()` writes it."""
        dtypes = {"ids": np.int32, "loss": np.bool_, "lengths": np.int32, "sizes": np.int64, "truncated": np.int64}
        if set(arrays) != set(dtypes):
            raise ValueError(f"arrays {sorted(set(arrays) ^ set(dtypes))} differ from what a preference job stores")
        for name, dtype in dtypes.items():
            if arrays[name].dtype != dtype or arrays[name].ndim != 1:
                raise ValueError(f"{name} is not a vector of {np.dtype(dtype)}")
        ids, loss, lengths, sizes = arrays["ids"], arrays["loss"], arrays["lengths"], arrays["sizes"]
        if len(lengths) % 2 or (len(lengths) and (lengths.min() < 0 or lengths.max() > seq_len)):
            raise ValueError(f"lengths is not pairs of sequences of 0..{seq_len} tokens")
        if len(ids) != int(lengths.sum(dtype=np.int64)) or len(loss) != len(ids):
            raise ValueError("ids and loss do not hold the tokens lengths counts")
        if len(ids) and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"ids holds token ids outside the tokenizer's {vocab}")
        if (sizes < 0).any() or int(sizes.sum()) != len(lengths) // 2 or arrays["truncated"].shape != (1,):
            raise ValueError("sizes does not count the pairs, or truncated is not one count")
        bounds = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist()
        # views into the two arrays, not lists: a pair is only ever collated (collate_pairs) or hashed from here
        docs = [Document(ids[a:b], loss[a:b]) for a, b in itertools.pairwise(bounds)]  # type: ignore[arg-type]
        tokens = [TokenPair(docs[i], docs[i + 1]) for i in range(0, len(docs), 2)]
        return cls(tokens, sizes.tolist(), int(arrays["truncated"][0]))


def _cached_pairs(
    cache: RowCache | None, part: str, data: DataConfig, encoder: PairEncoder, seed: int,
    build: Callable[[], TokenizedPairs],
) -> TokenizedPairs:  # fmt: skip
    """`build()`'s pairs, or those an earlier start of the run built from the same inputs (every rank holds all)."""
    if cache is None:
        return build()
    key = rows_key(
        data, data.datasets, encoder.encoder, seed=seed, rank=0, world_size=1, shared=True,
        held_out=part == "pairs-eval",
    )  # fmt: skip
    vocab = len(encoder.tokenizer)
    return cache.cached(
        part, key, build, to_arrays=TokenizedPairs.arrays,
        from_arrays=lambda arrays: TokenizedPairs.from_arrays(arrays, seq_len=data.seq_len, vocab=vocab),
    )  # fmt: skip


def build_pair_loader(
    data: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    device: torch.device,
    cache: RowCache | None = None,
) -> PairLoader:
    """This rank's endless, resumable stream of training pair batches (micro_batch_size pairs each); with `cache`,
    the tokenized pairs are kept between starts (row_cache.py)."""
    if micro_batch_size < 1:
        raise EngineConfigError(f"train.micro_batch_size must be at least 1, got {micro_batch_size}")
    encoder = PairEncoder(tokenizer, data.seq_len)

    def build() -> TokenizedPairs:
        per_dataset = read_pairs(data, seed, held_out=False)
        tokens = [tp for pairs in per_dataset for tp in encoder.encode(pairs)]
        return TokenizedPairs(tokens, [len(p) for p in per_dataset], encoder.truncated_tokens)

    got = _cached_pairs(cache, "pairs", data, encoder, seed, build)
    tokens = got.tokens
    if len(tokens) < world_size:
        raise EngineConfigError(
            f"rank {rank} of {world_size} has no training pairs: the datasets are too small for this many ranks or "
            "data.held_out_fraction leaves nothing; add data or lower data.held_out_fraction"
        )
    rows = PairRows(tokens, tokenizer.pad_token_id, _pair_stats(tokens, got.truncated))
    logger.info(
        "rank %d: %d training pairs, %d tokens, %d truncated tokens",
        rank, len(tokens), rows.stats.num_tokens, got.truncated,
    )  # fmt: skip
    order = _EpochOrder(got.sizes, data.sampling_probs, seed, 0)
    return PairLoader(
        _BatchesAt(rows, order, micro_batch_size, world_size, rank),  # type: ignore[arg-type]
        num_workers=0,  # a batch is a few small tensors built from lists: workers only add IPC
        device=device,
        stats=rows.stats,
        seed=seed,
        rank=rank,
        world_size=world_size,
    )


def build_eval_pairs(
    data: DataConfig,
    tokenizer: PreTrainedTokenizerBase,
    *,
    micro_batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    max_batches: int,
    cache: RowCache | None = None,
) -> list[PairBatch]:
    """Fixed held-out pair batches for this rank; every rank gets the same count (collectives stay paired), a rank
    whose share ran out repeats pairs with `counted` False. With `cache`, the tokenized pairs are kept between
    starts."""
    encoder = PairEncoder(tokenizer, data.seq_len)

    def build() -> TokenizedPairs:
        pairs = [p for group in read_pairs(data, seed, held_out=True) for p in group]
        return TokenizedPairs(encoder.encode(pairs), [len(pairs)], encoder.truncated_tokens)

    tokens = _cached_pairs(cache, "pairs-eval", data, encoder, seed, build).tokens
    total = len(tokens)
    if total == 0 or max_batches < 1:
        return []
    num_batches = min(max_batches, math.ceil(total / (world_size * micro_batch_size)))
    mine = list(range(rank, total, world_size))
    batches = []
    for number in range(num_batches):
        picked = mine[number * micro_batch_size : (number + 1) * micro_batch_size]
        counted = [True] * len(picked)
        if not picked:
            picked, counted = [mine[0] if mine else 0], [False]
        batch = collate_pairs([tokens[i] for i in picked], tokenizer.pad_token_id)
        batch.counted = torch.tensor(counted)
        batches.append(batch)
    return batches


# ----------------------------------------------------------------------------------------------------------------
# Log-probs
# ----------------------------------------------------------------------------------------------------------------


def sequence_logprobs(
    model, batch: PairBatch, autocast: Callable[[], AbstractContextManager], router: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected): each row's summed log-probs of its labelled (completion) tokens, [B] fp32 each.

    One forward over the 2B rows; gradients flow when grad is enabled. The native model, and transformers' models
    given its head (engine/hf_head.py), give each label's log-probability chunk by chunk (engine/loss.py: never the
    whole logits, whose fp32 copy alone is rows x seq_len x vocab x 4 bytes: 8 GiB for 8 rows of 2048 tokens at
    Llama 3's vocabulary); other transformers' models give logits, whose cross-entropy is taken at the labelled
    positions as evaluate.token_losses takes it. An MoE with its router loss on (engine/hf_head.py) gives that
    term (coef x aux, with its gradient) to `router` when it is given."""
    if chunked_head(model):
        with autocast():
            out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, labels=batch.labels,
                        token_log_probs=True)  # fmt: skip
        sums = out.log_probs.sum(-1)
        collect_router_loss(out, router)
    else:
        with autocast():
            logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids).logits
        targets = batch.labels[:, 1:]
        nll = F.cross_entropy(
            logits[:, :-1].float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=IGNORE_INDEX,
            reduction="none",
        )  # fmt: skip
        sums = -nll.view(targets.shape).sum(-1)
    half = batch.num_pairs
    return sums[:half], sums[half:]


def compute_reference(
    batches: Iterator[PairBatch], logprobs: Callable[[PairBatch], tuple[torch.Tensor, torch.Tensor]]
) -> np.ndarray:
    """[N, 2] (chosen, rejected) reference log-probs of every pair of `batches`, in order."""
    parts = []
    with torch.no_grad():
        for batch in batches:
            chosen, rejected = logprobs(batch)
            parts.append(torch.stack([chosen, rejected], dim=1).double().cpu().numpy())
    return np.concatenate(parts) if parts else np.zeros((0, 2))


def reference_of_rows(
    rows: PairRows, micro_batch_size: int, logprobs: Callable[[PairBatch], tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Fill in the reference log-probs of every training pair (`rows.ref_logps`): one pass, after which no reference
    model need be held. Every rank makes the same calls (FSDP stays in step)."""
    order = np.argsort(rows.lengths, kind="stable")  # similar lengths together: less padding
    chunks = [order[i : i + micro_batch_size] for i in range(0, len(order), micro_batch_size)]
    values = compute_reference((rows.batch(c) for c in chunks), logprobs)
    ref = np.zeros((len(rows), 2))
    ref[order] = values
    rows.ref_logps = ref


def reference_of_batches(
    batches: list[PairBatch], logprobs: Callable[[PairBatch], tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Fill in each held-out batch's reference log-probs (`batch.ref_logps`)."""
    for batch in batches:
        logp = compute_reference(iter([batch]), logprobs)
        batch.ref_logps = torch.from_numpy(np.concatenate([logp[:, 0], logp[:, 1]]).astype(np.float32))
