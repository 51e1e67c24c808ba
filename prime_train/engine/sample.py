"""Load a trained model to sample from or evaluate: a run's final/, one of its checkpoints, an HF directory, an
adapter.

`prime-train generate`, `chat` and `eval` read a model through `load_model`:

- a run directory: its final/ (the HF export), or with `step` its checkpoints/step-N converted on the fly by
  export.dcp_to_hf into a temporary directory (removed after loading; the checkpoint is only read);
- an HF model directory (config.json and weights);
- a directory of a LoRA adapter in PEFT's format (adapter_config.json), or an export whose weights were not
  merged (final/ holding adapter/ only): the base named in adapter_config.json with the adapter on it (peft).

Sampling is transformers' `generate`: temperature and top-p, stopping at the tokenizer's eos.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from prime_train.contract import read_json
from prime_train.engine.metrics import EngineConfigError
from prime_train.rundir import RunDir, list_checkpoints

ADAPTER_CONFIG = "adapter_config.json"


class ModelSourceError(EngineConfigError):
    """What the user named is not a model this can load (exit 78); the message says what it holds instead."""


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    source: str  # what was loaded, in words: the directory, or the checkpoint it was converted from
    run_dir: Path | None = None  # the run it came from, when one was named
    notes: list[str] = field(default_factory=list)


def _is_run_dir(path: Path) -> bool:
    return any(os.path.lexists(path / name) for name in ("config.toml", "checkpoints", "progress.json", "events.jsonl"))


def _run_config(run_dir: Path) -> dict:
    import tomllib

    try:
        return tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}


def _has_weights(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _from_adapter(adapter_dir: Path) -> tuple[Any, Any]:
    """The base model adapter_config.json names, with the adapter on it (peft), and the tokenizer beside it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = (read_json(adapter_dir / ADAPTER_CONFIG) or {}).get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ModelSourceError(
            f"{adapter_dir / ADAPTER_CONFIG} names no base model (base_model_name_or_path): the adapter of a run whose "
            "base was random-initialised cannot be loaded alone; use the run's merged final/ or `--step N`"
        )
    model = AutoModelForCausalLM.from_pretrained(base)
    model = PeftModel.from_pretrained(model, str(adapter_dir))
    tok_dir = adapter_dir.parent if (adapter_dir.parent / "tokenizer_config.json").is_file() else base
    return model, AutoTokenizer.from_pretrained(tok_dir)


def _from_hf_dir(path: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _load_dir(path: Path) -> tuple[Any, Any]:
    """An HF model directory, an adapter directory, or an export holding adapter/ only."""
    if _has_weights(path):
        return _from_hf_dir(path)
    if (path / ADAPTER_CONFIG).is_file():
        return _from_adapter(path)
    if (path / "adapter" / ADAPTER_CONFIG).is_file():
        return _from_adapter(path / "adapter")
    raise ModelSourceError(
        f"{path} holds no model: neither config.json with *.safetensors (an HF model) nor {ADAPTER_CONFIG} (a "
        "LoRA adapter); pass a run directory, its final/, or an exported model directory"
    )


def _checkpoint_dir(run_dir: Path, step: int) -> Path:
    rd = RunDir.of_run(run_dir, _run_config(run_dir))
    found = {c.step: c.path for c in list_checkpoints(rd.checkpoints_dir)}
    if step not in found:
        have = ", ".join(map(str, sorted(found))) or "none"
        raise ModelSourceError(f"--step {step}: {run_dir} has no whole checkpoint step-{step} (whole ones: {have})")
    return found[step]


def load_model(source: str | os.PathLike[str], step: int | None = None) -> LoadedModel:
    """The model and tokenizer `source` names (see the module docstring), in eval mode on the CPU or one GPU."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load of a tiny model is noise; the command says what it loaded
    path = Path(source)
    if not path.exists():
        raise ModelSourceError(f"{path} does not exist: pass a run directory or a model directory")
    if not path.is_dir():
        raise ModelSourceError(f"{path} is not a directory: pass a run directory or a model directory")
    run_dir = path if _is_run_dir(path) else None
    if step is not None:
        if run_dir is None:
            raise ModelSourceError(f"--step {step} needs a run directory; {path} is not one")
        ckpt = _checkpoint_dir(run_dir, step)
        from prime_train.engine.export import dcp_to_hf

        with tempfile.TemporaryDirectory(prefix="prime-train-step-") as tmp:
            out = Path(tmp) / "model"
            try:
                dcp_to_hf(ckpt, out, config_path=run_dir / "config.toml")
            except ValueError as exc:  # not a checkpoint this can convert: the message says why
                raise ModelSourceError(str(exc)) from None
            model, tokenizer = _load_dir(out)
        loaded = LoadedModel(model, tokenizer, f"{ckpt} (converted)", run_dir)
    elif run_dir is not None:
        final = RunDir(run_dir).final_dir
        if not final.is_dir():
            have = ", ".join(
                str(c.step) for c in list_checkpoints(RunDir.of_run(run_dir, _run_config(run_dir)).checkpoints_dir)
            )
            raise ModelSourceError(
                f"{run_dir} has no final/ (the run has not finished); pass --step N to use a checkpoint "
                f"(whole ones: {have or 'none'})"
            )
        loaded = LoadedModel(*_load_dir(final), str(final), run_dir)
    else:
        loaded = LoadedModel(*_load_dir(path), str(path))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded.model.to(device).eval()
    return loaded


@dataclass
class Sampling:
    """How to sample: temperature 0 is greedy decoding; top_p applies when sampling."""

    max_new_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 1.0
    seed: int | None = None


def prompt_text(tokenizer, messages: list[dict[str, str]], *, raw: bool) -> str:
    """The text the model continues: the chat template over `messages` when the tokenizer has one (and not `raw`),
    else the last user message as it is."""
    if not raw and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return messages[-1]["content"]


@torch.no_grad()
def generate(loaded: LoadedModel, text: str, sampling: Sampling) -> str:
    """The model's continuation of `text`, up to eos or max_new_tokens, special tokens left out."""
    tok, model = loaded.tokenizer, loaded.model
    if sampling.seed is not None:
        torch.manual_seed(sampling.seed)
    inputs = tok(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    greedy = sampling.temperature <= 0
    kwargs: dict[str, Any] = {"do_sample": not greedy}
    if not greedy:
        kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
    else:  # a generation_config's sampling values would only warn under greedy decoding
        kwargs.update(temperature=None, top_p=None, top_k=None)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    out = model.generate(
        **inputs, max_new_tokens=sampling.max_new_tokens, eos_token_id=stop_ids(loaded), pad_token_id=pad, **kwargs
    )
    return tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def stop_ids(loaded: LoadedModel) -> list[int]:
    """The token ids that end a reply: the tokenizer's eos, the generation config's, and a chat template's end of
    turn (ChatML's <|im_end|>) when the vocabulary has one."""
    tok = loaded.tokenizer
    ids = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    configured = getattr(getattr(loaded.model, "generation_config", None), "eos_token_id", None)
    ids.update([configured] if isinstance(configured, int) else configured or [])
    end_of_turn = tok.convert_tokens_to_ids("<|im_end|>") if getattr(tok, "chat_template", None) else None
    if isinstance(end_of_turn, int) and end_of_turn != tok.unk_token_id:
        ids.add(end_of_turn)
    return sorted(ids)
