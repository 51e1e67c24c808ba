"""The built-in byte-level vocabulary: ids 0-255 are the bytes, then the special tokens, in this order.

The engine builds its tokenizer from these (engine/tokenizer.py); the supervisor side counts with
them without loading any tokenizer library (preflight's vocabulary check, the RL token budget).
Standard library only.
"""

from __future__ import annotations

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
NUM_BYTES = 256
BYTE_VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)  # len(tokenizer), before padding to model.vocab_multiple
# The special tokens' ids: a model's config.json and generation_config.json must name these, or generate() and
# vLLM stop on an id the tokenizer never emits and run on past the answer
PAD_TOKEN_ID = NUM_BYTES + SPECIAL_TOKENS.index(PAD_TOKEN)
BOS_TOKEN_ID = NUM_BYTES + SPECIAL_TOKENS.index(BOS_TOKEN)
EOS_TOKEN_ID = NUM_BYTES + SPECIAL_TOKENS.index(EOS_TOKEN)

# ChatML: the format vLLM and most chat tooling expect; the generation prompt opens an assistant turn.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
