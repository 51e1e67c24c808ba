"""A reward model's directory, checked, and its scores of (prompt, completion) pairs: the model half of the
`reward-model` RL environment (environments.py).

The directory is a Hugging Face sequence-classification model with one output (num_labels = 1), as a reward run's
final/ is: config.json, safetensors weights and the tokenizer's files. `check_reward_model` reads config.json and
the file names alone (no torch: lint and preflight call it). `RewardScorer` loads the model when first asked (the
trainer asks once before training) and scores pairs in batches.

A pair is scored as the SFT document of a prompt/completion record is built (engine/documents.py): whatever the
tokenizer puts before text (a bos), the prompt's tokens, the completion's tokens, eos; prompt and completion are
tokenized apart. The score is the model's output at the last token that is not padding (HF's pooling).

Standard library at import; torch and transformers are imported when the model loads.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

# weights in these files load through pickle, which can run code: refused, only safetensors are read
PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DEVICES = ("auto", "cpu", "cuda")


class RewardModelError(ValueError):
    """The directory is not a reward model this environment can load; the message says what is wrong."""


def check_reward_model(path: str) -> dict[str, Any]:
    """The config.json of the reward model at `path`, or a RewardModelError saying why it is not one."""
    directory = Path(os.path.expanduser(path))
    # os.path's checks answer False for any OSError (a name too long, no permission)
    if not os.path.exists(directory):
        raise RewardModelError("no such directory (point it at a reward run's final/)")
    if not os.path.isdir(directory):
        raise RewardModelError("is a file, not a model directory (point it at a reward run's final/)")
    config_file = directory / "config.json"
    if not os.path.isfile(config_file):
        raise RewardModelError("has no config.json: not a Hugging Face model directory (a reward run's final/ is one)")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RewardModelError(f"config.json does not read as JSON ({exc})") from None
    if not isinstance(config, dict):
        raise RewardModelError("config.json is not a JSON object")
    architectures = config.get("architectures") or []
    if not any(isinstance(a, str) and a.endswith("ForSequenceClassification") for a in architectures):
        raise RewardModelError(
            f"is a {', '.join(map(str, architectures)) or 'model of no stated architecture'}, not a reward model: "
            "config.json's architectures must name a *ForSequenceClassification model (a reward run's final/)"
        )
    labels = config.get("id2label")
    num_labels = len(labels) if isinstance(labels, dict) else config.get("num_labels", 2)
    if num_labels != 1:
        raise RewardModelError(
            f"has num_labels = {num_labels} (config.json id2label); a reward model gives one score (num_labels = 1)"
        )
    _check_weights(directory)
    if not any(os.path.isfile(directory / name) for name in TOKENIZER_FILES):
        raise RewardModelError(
            "has no tokenizer files (tokenizer.json, tokenizer_config.json): completions are scored with the "
            "tokenizer the reward model was trained with"
        )
    return config


def _check_weights(directory: Path) -> None:
    names = [p.name for p in directory.iterdir() if p.is_file()]
    if any(n.endswith(".safetensors") for n in names):
        return
    pickled = sorted(n for n in names if n.endswith(PICKLE_WEIGHTS))
    if pickled:
        raise RewardModelError(
            f"holds its weights in {', '.join(pickled)} (pickle, which can run code when loaded) and no .safetensors; "
            "only safetensors are loaded: save it again with save_pretrained(..., safe_serialization=True)"
        )
    raise RewardModelError("has no weights (no .safetensors file)")


class RewardScorer:
    """Scores (prompt, completion) pairs with the reward model at `path`, `batch_size` sequences a forward pass.

    `device`: "cpu", "cuda" (this rank's GPU: LOCAL_RANK), or "auto" (the GPU where CUDA is available, else the CPU).
    """

    def __init__(self, path: str, *, device: str = "auto", batch_size: int = 64) -> None:
        self.path = os.path.expanduser(path)
        self.device_name = device
        self.batch_size = batch_size
        self.model: Any = None
        self.tokenizer: Any = None
        self.device: Any = None
        self.prefix: list[int] = []
        self._lock = threading.Lock()  # rollouts may be scored in their thread while the trainer evaluates

    def load(self) -> None:
        """Load the model and tokenizer (once); RewardModelError when they do not load."""
        with self._lock:
            if self.model is None:
                self._load()

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if self.device_name == "cpu" or (self.device_name == "auto" and not torch.cuda.is_available()):
            device, dtype = torch.device("cpu"), torch.float32
        else:
            device, dtype = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))), "auto"
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path)
            # use_safetensors: never fall back to a pickled checkpoint; no remote code
            model = AutoModelForSequenceClassification.from_pretrained(
                self.path, use_safetensors=True, dtype=dtype, trust_remote_code=False
            )
        except MemoryError:
            raise
        except Exception as exc:  # whatever a malformed file makes transformers or safetensors raise
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise RewardModelError(f"does not load ({type(exc).__name__}: {first})") from None
        if model.config.num_labels != 1:
            raise RewardModelError(f"has num_labels = {model.config.num_labels}; a reward model gives one score")
        if tokenizer.eos_token_id is None:
            raise RewardModelError("its tokenizer has no eos token, which ends every scored sequence")
        if model.config.pad_token_id is None:
            # HF pools at the last token that is not padding and refuses batches without a pad id; a reward run
            # sets one, a hub model may not: the tokenizer's, else eos (then pooling lands on the completion's end)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            model.config.pad_token_id = pad
        # whatever the tokenizer's post-processor puts before text (a bos), as engine/documents.py Encoder finds it
        plain = tokenizer("a", add_special_tokens=False)["input_ids"]
        full = tokenizer("a", add_special_tokens=True)["input_ids"]
        cut = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), 0)
        self.prefix = list(full[:cut])
        self.tokenizer, self.device = tokenizer, device
        self.model = model.to(device).eval().requires_grad_(False)

    def encode(self, prompt: str, completion: str) -> list[int]:
        """The token ids a pair is scored on: prefix, prompt, completion up to its first eos, eos."""
        tok = self.tokenizer
        if tok.eos_token and tok.eos_token in completion:
            completion = completion[: completion.index(tok.eos_token)]
        ids = tok([prompt, completion], add_special_tokens=False)["input_ids"]
        return [*self.prefix, *ids[0], *ids[1], tok.eos_token_id]

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """The reward model's score of each (prompt, completion), in order; padded batches of similar lengths."""
        import torch

        self.load()
        with self._lock:
            sequences = [self.encode(p, c) for p, c in pairs]
            # sorted by length, so a batch pads little; scattered back to the pairs' order
            order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
            scores = [0.0] * len(sequences)
            pad = self.model.config.pad_token_id
            with torch.no_grad():
                for start in range(0, len(order), self.batch_size):
                    chunk = order[start : start + self.batch_size]
                    width = max(len(sequences[i]) for i in chunk)
                    ids = torch.full((len(chunk), width), pad, dtype=torch.long)
                    mask = torch.zeros((len(chunk), width), dtype=torch.long)
                    for row, i in enumerate(chunk):
                        ids[row, : len(sequences[i])] = torch.tensor(sequences[i])
                        mask[row, : len(sequences[i])] = 1
                    logits = self.model(input_ids=ids.to(self.device), attention_mask=mask.to(self.device)).logits
                    for i, value in zip(chunk, logits[:, 0].float().tolist(), strict=True):
                        scores[i] = value
            return scores
