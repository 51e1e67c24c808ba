"""`prime-train data inspect`: a few records as the SFT/pretraining job sees them, and what packing makes of them.

The records are read, extracted and tokenized by the job's own code (data.py's reader, documents.Encoder) and
packed by packing.build_rows, so what is shown is what trains: the token ids, which of them take the loss (the
loss mask, as spans of text), packing efficiency, a histogram of document lengths against data.seq_len, and
warnings a user should see before a long run (documents cut at seq_len, records with nothing to learn).
"""

from __future__ import annotations

from typing import Any

from prime_train.config.schema import Config
from prime_train.engine.data import _check_data_config, _dataset_contents
from prime_train.engine.documents import Document, Encoder
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.packing import build_rows
from prime_train.engine.tokenizer import load_tokenizer

HISTOGRAM_BINS = 8
# the marker form of the loss mask (--json, no colour): the tokens the loss is taken on, between these
TRAINED_OPEN, TRAINED_CLOSE = "[[", "]]"


def segments(tokenizer, doc: Document) -> list[dict[str, Any]]:
    """The document's text in runs of tokens that do or do not take the loss: [{"text", "trained", "tokens"}]."""
    out: list[dict[str, Any]] = []
    start = 0
    for i in range(1, len(doc.ids) + 1):
        if i == len(doc.ids) or doc.loss[i] != doc.loss[start]:
            ids = doc.ids[start:i]
            out.append({"text": tokenizer.decode(ids, skip_special_tokens=False), "trained": doc.loss[start],
                        "tokens": len(ids)})  # fmt: skip
            start = i
    return out


def marked(parts: list[dict[str, Any]]) -> str:
    """The loss mask in plain text: trained spans between [[ and ]]."""
    return "".join(f"{TRAINED_OPEN}{p['text']}{TRAINED_CLOSE}" if p["trained"] else p["text"] for p in parts)


def histogram(lengths: list[int], seq_len: int) -> list[dict[str, int]]:
    """Document lengths in HISTOGRAM_BINS equal bins up to seq_len, and one bin for those longer (cut)."""
    width = max(1, -(-seq_len // HISTOGRAM_BINS))
    bins = [{"from": i * width + 1, "to": min(seq_len, (i + 1) * width), "count": 0} for i in range(HISTOGRAM_BINS)]
    bins = [b for b in bins if b["from"] <= b["to"]]
    over = {"from": seq_len + 1, "to": max([seq_len + 1, *lengths]), "count": 0}
    for n in lengths:
        if n > seq_len:
            over["count"] += 1
        else:
            bins[min(len(bins) - 1, (n - 1) // width)]["count"] += 1
    return [*bins, over] if over["count"] else bins


def _warnings(docs: list[Document], seq_len: int, job: str, names: list[str]) -> list[str]:
    out = []
    cut = [len(d.ids) for d in docs if len(d.ids) > seq_len]
    if cut:
        lost = sum(n - seq_len for n in cut)
        out.append(
            f"{len(cut)} of {len(docs)} documents are longer than data.seq_len = {seq_len} (up to {max(cut)} tokens): "
            f"{lost} tokens are cut off and never trained on; raise data.seq_len or shorten the records"
        )
    if job == "sft":
        # the eos after a completion takes the loss; a completion of its own tokens needs more than that one
        empty = sum(1 for d in docs if sum(d.loss) <= 1)
        if empty:
            out.append(
                f"{empty} of {len(docs)} records have an empty completion (nothing but the end-of-sequence token is "
                f"trained) in {', '.join(names)}: check the completion field or the chat's assistant turns"
            )
    return out


def inspect_data(cfg: Config, n: int = 3, limit: int = 2000) -> dict[str, Any]:
    """The first `n` training records of each dataset as documents, and packing's statistics over the first `limit`
    records of each (the training split of rank 0 of one process, as data.py reads it)."""
    if cfg.run.job not in ("sft", "pretrain"):
        raise EngineConfigError(f"data inspect reads SFT and pretraining data; run.job is {cfg.run.job!r}")
    if not cfg.data.datasets:
        raise EngineConfigError("data.datasets is empty: there is nothing to inspect")
    _check_data_config(cfg.data)
    tokenizer = load_tokenizer(cfg.model)
    encoder = Encoder(tokenizer, cfg.run.job)
    docs: list[Document] = []
    records: list[dict[str, Any]] = []
    names = []
    for index, ds in enumerate(cfg.data.datasets):
        name = ds.task or ds.path or ds.hub or f"data.datasets.{index}"
        names.append(str(name))
        fmt, contents = _dataset_contents(
            ds, index, cfg.run.seed, cfg.data.held_out_fraction, 0, 1, held_out=False, keep_all=True, limit=limit,
            streaming=cfg.data.streaming,
        )  # fmt: skip
        encoded = encoder.encode(fmt, contents)
        docs.extend(encoded)
        for doc in encoded[:n]:
            parts = segments(tokenizer, doc)
            records.append({
                "dataset": str(name), "format": fmt, "num_tokens": len(doc.ids), "num_trained": sum(doc.loss),
                "ids": doc.ids, "segments": parts, "marked": marked(parts),
            })  # fmt: skip
    stats = build_rows(docs, cfg.data.seq_len, tokenizer.pad_token_id, cfg.data.packing).stats
    lengths = [len(d.ids) for d in docs]
    return {
        "job": cfg.run.job,
        "seq_len": cfg.data.seq_len,
        "packing": cfg.data.packing,
        "records": records,
        "read": {"documents": len(docs), "limit_per_dataset": limit},
        "packing_stats": {
            "documents": stats.num_documents,
            "sequences": stats.num_sequences,
            "tokens": stats.num_tokens,
            "truncated_tokens": stats.num_truncated_tokens,
            "efficiency": stats.efficiency,
            "trained_tokens": sum(sum(d.loss[: cfg.data.seq_len]) for d in docs),  # what is left after the cut
        },
        "lengths": {
            "min": min(lengths, default=0),
            "max": max(lengths, default=0),
            "mean": sum(lengths) / len(lengths) if lengths else 0.0,
        },
        "histogram": histogram(lengths, cfg.data.seq_len),
        "warnings": _warnings(docs, cfg.data.seq_len, cfg.run.job, names),
    }
