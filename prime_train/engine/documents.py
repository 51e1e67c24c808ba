"""Record contents to token documents: ids, and which of them the loss is taken on.

A document is one record's tokens ending with eos. Text documents learn every token; a
prompt_completion document only its completion; a chat document only its assistant turns, found by
rendering the chat template on growing prefixes. Pretraining learns every token of any format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prime_train.engine.metrics import EngineConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Records tokenized per call: large enough for the Rust tokenizer's threads, small enough for memory.
_TOKENIZE_CHUNK = 2048


@dataclass
class Document:
    """Token ids of one record, eos last, and per token whether the loss is taken on it (lists; a preference pair
    read back from the row cache holds numpy views instead)."""

    ids: list[int]
    loss: list[bool]


class Encoder:
    """Turns extracted record contents into documents for one tokenizer and job."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, job: str) -> None:
        if job not in ("sft", "pretrain"):
            raise EngineConfigError(f"run.job must be 'sft' or 'pretrain', got {job!r}")
        if tokenizer.eos_token_id is None:
            raise EngineConfigError("the tokenizer has no eos token; documents must end with one (set model.tokenizer)")
        self.tokenizer = tokenizer
        self.job = job
        self.eos = tokenizer.eos_token_id
        # Whatever the tokenizer's post-processor puts before text (a bos for Llama-style tokenizers)
        # starts every non-chat document; chat templates write their own.
        probe = "a"
        plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
        full = tokenizer(probe, add_special_tokens=True)["input_ids"]
        cut = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        self.prefix = list(full[:cut])

    def prompt_ids(self, prompt: str) -> list[int]:
        """Token ids a prompt_completion document starts with, for prompting with `prompt` alone."""
        return self.prefix + self._encode([prompt])[0]

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if (backend := self._backend()) is not None:
            return [encoding.ids for encoding in backend.encode_batch(texts, add_special_tokens=False)]
        return list(self.tokenizer(texts, add_special_tokens=False)["input_ids"])

    def _backend(self):
        """The fast tokenizer's Rust backend when calling it gives exactly the ids `tokenizer(texts)` gives, else
        None. transformers' call adds only a conversion of each encoding (a third of the time of tokenizing the
        default job's documents) after setting the backend to no truncation, no padding and the tokenizer's
        split_special_tokens, as the probe in __init__ left it; a subclass with its own encoding keeps its call."""
        from transformers import PreTrainedTokenizerFast

        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        fast = PreTrainedTokenizerFast
        if backend is None or (type(tok)._encode_plus, type(tok).__call__) != (fast._encode_plus, fast.__call__):
            return None
        if backend.truncation is not None or backend.padding is not None:
            return None
        if backend.encode_special_tokens != bool(getattr(tok, "split_special_tokens", False)):
            return None
        return backend

    def _finish(self, ids: list[int], loss: list[bool]) -> Document:
        if not ids or ids[-1] != self.eos:
            # The eos is learned wherever the token before it is: after a completion, not after a prompt.
            ids.append(self.eos)
            loss.append(loss[-1] if loss else True)
        if self.job == "pretrain":
            loss = [True] * len(ids)
        return Document(ids, loss)

    def encode(self, fmt: str, contents: list[Any]) -> list[Document]:
        """Documents of `contents`, all of format `fmt`."""
        docs: list[Document] = []
        for start in range(0, len(contents), _TOKENIZE_CHUNK):
            chunk = contents[start : start + _TOKENIZE_CHUNK]
            if fmt == "text":
                for ids in self._encode(chunk):
                    docs.append(self._finish(self.prefix + ids, [True] * (len(self.prefix) + len(ids))))
            elif fmt == "prompt_completion":
                # Prompt and completion are tokenized apart so the prompt's tokens are exactly those an
                # exact-match eval or a rollout feeds the model when it prompts with `prompt` alone.
                prompts = self._encode([p for p, _ in chunk])
                completions = self._encode([c for _, c in chunk])
                for p, c in zip(prompts, completions, strict=True):
                    p = self.prefix + p
                    docs.append(self._finish(p + c, [False] * len(p) + [True] * len(c)))
            else:
                docs.extend(self._encode_chat(messages) for messages in chunk)
        return docs

    def _encode_chat(self, messages: list[dict[str, str]]) -> Document:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise EngineConfigError(
                "a chat-format dataset needs a tokenizer with a chat template; set model.tokenizer to one that "
                "has one, or convert the records to prompt/completion"
            )
        text = tok.apply_chat_template(messages, tokenize=False)
        # Assistant turns are found by rendering growing prefixes: the characters a turn adds after the
        # generation prompt are the ones the model must produce.
        spans: list[tuple[int, int]] = []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = tok.apply_chat_template(messages[:turn], tokenize=False, add_generation_prompt=True)
            through = tok.apply_chat_template(messages[: turn + 1], tokenize=False)
            if not (through.startswith(before) and text.startswith(through)):
                raise EngineConfigError(
                    "the tokenizer's chat template rewrites earlier turns (it is not prefix-stable), so assistant "
                    "tokens cannot be located; use a different model.tokenizer or prompt/completion records"
                )
            spans.append((len(before), len(through)))
        encoded = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        starts = [begin for begin, _ in encoded["offset_mapping"]]
        loss = [any(lo <= s < hi for lo, hi in spans) for s in starts]
        return self._finish(ids, loss)
