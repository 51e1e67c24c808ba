"""The HF config dict of the model a run trains, read from the run config without loading anything.

A random-initialised model's shape is in [model] itself (its vocabulary is the tokenizer's length,
padded as the engine pads it); a pretrained one's is its config.json, in model.path or already in the
local HF cache. Preflight's disk and memory checks, the memory and cost calculators, the init wizard
and the RL token budget all start from this; no network, no torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from prime_train.config.schema import Config
from prime_train.validator.param_count import count_parameters
from prime_train.vocab import BYTE_VOCAB_SIZE


def _tokenizer_size(cfg: Config) -> int | None:
    """len(tokenizer) of a random-initialised model's tokenizer, when it can be known without loading it."""
    if cfg.model.tokenizer is None:
        return BYTE_VOCAB_SIZE
    path = Path(os.path.expanduser(cfg.model.tokenizer)) / "tokenizer.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ids = set((data.get("model") or {}).get("vocab", {}).values()) | {t["id"] for t in data.get("added_tokens", [])}
    return max(ids) + 1 if ids else None


def _hub_config_path(repo_id: str) -> str | None:
    """config.json of a hub model if it is already in the local HF cache (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, "config.json")
    except Exception:  # not installed, or not a valid repo id
        return None
    return found if isinstance(found, str) else None


def model_shape(cfg: Config) -> tuple[dict[str, Any] | None, str]:
    """The HF config dict of the model the run trains, and where it came from (or why it is unknown)."""
    m = cfg.model
    if m.path is None:
        size = _tokenizer_size(cfg)
        if size is None:
            return None, f"the vocabulary of model.tokenizer {m.tokenizer!r} is unknown (no local tokenizer.json)"
        hf = {
            "model_type": m.arch,
            "hidden_size": m.hidden_size,
            "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_kv_heads or m.num_heads,
            "intermediate_size": m.intermediate_size or 4 * m.hidden_size,
            "vocab_size": -(-size // m.vocab_multiple) * m.vocab_multiple,
            "tie_word_embeddings": m.tie_embeddings,
        }
        return hf, f"random-initialised {m.arch}"
    local = Path(os.path.expanduser(m.path)) / "config.json"
    # os.path.isfile, not Path.is_file: a name the filesystem refuses (too long) is no local file, not an OSError
    path = str(local) if os.path.isfile(local) else _hub_config_path(m.path)
    if path is None:
        from prime_train.validator.registry import shipped_config

        shipped = shipped_config(m.path)  # a registry model: its shape is known before the download
        if shipped is not None:
            return shipped, f"{m.path} (prime-train's shipped config.json; not downloaded yet)"
        return None, f"model.path {m.path!r} has no local config.json (not downloaded yet)"
    try:
        hf = json.loads(Path(path).read_text(encoding="utf-8"))
        count_parameters(hf)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, f"{path} does not describe a decoder this estimate knows ({type(exc).__name__}: {exc})"
    return hf, path
