"""Tokenizers for the engine: a byte-level one built locally, or a model's own from disk or the hub.

The byte-level tokenizer needs no download, covers any UTF-8 text exactly (one token per byte) and
is saved beside the model in HF format, so transformers and vLLM load it like any other tokenizer.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from prime_train.config.schema import ModelConfig

from prime_train.vocab import (
    BOS_TOKEN,
    CHATML_TEMPLATE,
    EOS_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    NUM_BYTES,
    PAD_TOKEN,
    SPECIAL_TOKENS,
)

logger = logging.getLogger(__name__)


def _byte_to_char() -> dict[int, str]:
    """Map each byte to the printable character the ByteLevel pre-tokenizer uses for it."""
    # Printable Latin-1 bytes stand for themselves; the rest (controls, space, soft hyphen) are moved
    # to code points from 256 up, in byte order. This is the alphabet tokenizers' ByteLevel emits.
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1))
    printable |= set(range(ord("®"), ord("ÿ") + 1))
    mapping: dict[int, str] = {}
    shifted = 0
    for byte in range(NUM_BYTES):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(NUM_BYTES + shifted)
            shifted += 1
    return mapping


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (ids 0-255 are the bytes, then the special tokens) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = _byte_to_char()
    if set(byte_chars.values()) != set(pre_tokenizers.ByteLevel.alphabet()):
        raise RuntimeError("the tokenizers ByteLevel alphabet changed; the byte tokenizer cannot be built")
    # BPE without merges over the byte alphabet: exactly one token per byte, and token id == byte value.
    vocab = {byte_chars[byte]: byte for byte in range(NUM_BYTES)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, and no prefix space, so decode(encode(text)) == text.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


# a sentence any real tokenizer encodes to known tokens
_PROBE = "The quick brown fox jumps over the lazy dog 0123456789."


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerFast:
    """The tokenizer of `cfg`: `model.tokenizer`, else the model at `model.path`, else the byte tokenizer."""
    if cfg.tokenizer is not None:
        source, key = cfg.tokenizer, "model.tokenizer"
    elif cfg.path is not None:
        source, key = cfg.path, "model.path"
    else:
        return build_byte_tokenizer()

    looks_local = source.startswith(("/", ".", "~")) or os.path.exists(source)
    if looks_local and not os.path.isdir(os.path.expanduser(source)):
        raise ValueError(
            f"{key} = {source!r}: no such directory. Point it at a directory holding tokenizer.json "
            "(a previous run's final/ works), or unset it."
        )

    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(os.path.expanduser(source) if looks_local else source)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{key} = {source!r}: could not load a tokenizer ({type(exc).__name__}: {str(exc).splitlines()[0]}). "
            f"Point {key} at a local directory holding tokenizer.json, or go online (and log in) for a hub id; "
            "unset both model.tokenizer and model.path to use the built-in byte tokenizer."
        ) from exc
    probe = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    if not probe or all(i == tokenizer.unk_token_id for i in probe):
        # transformers builds some families' tokenizer classes with no vocabulary when the directory has no
        # tokenizer files (a model saved by save_pretrained alone): every text would become nothing, or <unk>
        raise ValueError(
            f"{key} = {source!r}: the tokenizer transformers built from it has {len(tokenizer)} entries and "
            f"encodes text to {'nothing' if not probe else 'unknown tokens only'}: it holds no "
            "tokenizer files (tokenizer.json, tokenizer.model, vocab.json and merges.txt). Save the model's "
            "tokenizer beside it (tokenizer.save_pretrained), or point model.tokenizer at one."
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"{key} = {source!r}: the tokenizer has neither a pad nor an eos token, so sequences cannot be "
                "padded or ended; use a tokenizer that defines eos_token."
            )
        # Pads never reach the loss (labels are -100 there), so reusing eos is safe.
        tokenizer.pad_token = tokenizer.eos_token
        logger.info("tokenizer %s has no pad token; using eos %r for padding", source, tokenizer.eos_token)
    return tokenizer


def padded_vocab_size(tokenizer: PreTrainedTokenizerFast, multiple: int) -> int:
    """len(tokenizer) rounded up to a multiple of `multiple` (embedding tables like aligned sizes)."""
    if multiple < 1:
        raise ValueError(f"model.vocab_multiple must be at least 1, got {multiple}")
    size = len(tokenizer)
    return -(-size // multiple) * multiple
