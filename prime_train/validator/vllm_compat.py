"""What serving a model with vLLM asks of it: an architecture vLLM registers, text only, a tool-call parser.

Answered from config.json and the chat template alone. vLLM's own registry decides when vllm is
importable; otherwise the shipped table (data/vllm_architectures.json, with the version each
architecture arrived in) does. `verify-model` turns these answers into problems and warnings per job.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
from dataclasses import dataclass
from importlib import resources
from typing import Any

from prime_train.validator.param_count import split_config

_DATA = "prime_train.validator.data"


# ---------------------------------------------------------------- architectures


@functools.lru_cache(maxsize=1)
def load_vllm_table() -> dict[str, Any]:
    """The shipped architecture table: used when vllm itself is not importable."""
    text = resources.files(_DATA).joinpath("vllm_architectures.json").read_text(encoding="utf-8")
    return json.loads(text)


@dataclass
class VllmSupport:
    """Whether vLLM serves an architecture: True / False / None (unknown), from where, since which version."""

    supported: bool | None
    min_version: str | None
    source: str
    detail: str | None = None
    installed_version: str | None = None


def installed_vllm_archs() -> tuple[str, set[str]] | None:
    """vLLM's own list of architectures, when vllm is importable; None otherwise (or when asking fails)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return None
    try:
        # vLLM logs to stdout as it imports: keep `verify-model --json` output parseable
        with contextlib.redirect_stdout(sys.stderr):
            import vllm

            try:
                from vllm.model_executor.models import ModelRegistry
            except ImportError:
                from vllm import ModelRegistry  # type: ignore[no-redef]
            return str(getattr(vllm, "__version__", "?")), set(ModelRegistry.get_supported_archs())
    except Exception:  # a broken install, CUDA init at import, a moved API: fall back to the table
        return None


def vllm_support(architecture: str | None, *, installed: tuple[str, set[str]] | None = None) -> VllmSupport:
    """Does vLLM serve `architecture`? The installed vllm decides when there is one, else the shipped table."""
    table = load_vllm_table()
    entry = (table.get("architectures") or {}).get(architecture or "")
    removed = (table.get("removed") or {}).get(architecture or "")
    since = entry.get("since") if entry else None
    if installed is not None:
        version, archs = installed
        source = f"vllm {version} (installed)"
        if architecture in archs:
            return VllmSupport(True, since, source, installed_version=version)
        detail = f"{architecture} is not among the architectures vllm {version} registers"
        if removed:
            detail += f"; vLLM served it until {removed['last_version']}"
        return VllmSupport(False, since, source, detail, installed_version=version)
    source = f"shipped table (checked {table.get('checked')})"
    if entry:
        detail = None if entry.get("confirmed") else "first version recalled, not confirmed against a source"
        return VllmSupport(True, since, source, detail)
    if removed:
        return VllmSupport(
            False,
            removed.get("since"),
            source,
            f"vLLM served {architecture} until {removed['last_version']} and removed it; pin vllm<="
            f"{removed['last_version']} or pick another model",
        )
    return VllmSupport(
        None,
        None,
        source,
        f"{architecture or 'no architecture'} is not in the shipped table: vLLM may still serve it (natively if "
        "newer than the table, or through its Transformers backend); install vllm to ask its own registry",
    )


# ---------------------------------------------------------------- multimodal


# Vision-language checkpoints and the text-only model built on the same language stack.
_TEXT_SIBLINGS = {
    "qwen2.5-vl-3b-instruct": "Qwen/Qwen2.5-3B-Instruct",
    "qwen2.5-vl-7b-instruct": "Qwen/Qwen2.5-7B-Instruct",
    "qwen2.5-vl-32b-instruct": "Qwen/Qwen2.5-32B-Instruct",
    "qwen2.5-vl-72b-instruct": "Qwen/Qwen2.5-72B-Instruct",
    "qwen2-vl-2b-instruct": "Qwen/Qwen2-1.5B-Instruct",
    "qwen2-vl-7b-instruct": "Qwen/Qwen2-7B-Instruct",
    "qwen2-vl-72b-instruct": "Qwen/Qwen2-72B-Instruct",
    "qwen3-vl-4b-instruct": "Qwen/Qwen3-4B-Instruct-2507",
    "qwen3-vl-4b-thinking": "Qwen/Qwen3-4B-Thinking-2507",
    "qwen3-vl-8b-instruct": "Qwen/Qwen3-8B",
    "qwen3-vl-8b-thinking": "Qwen/Qwen3-8B",
    "qwen3-vl-30b-a3b-instruct": "Qwen/Qwen3-30B-A3B-Instruct-2507",
    "qwen3-vl-30b-a3b-thinking": "Qwen/Qwen3-30B-A3B-Thinking-2507",
    "qwen3-vl-235b-a22b-instruct": "Qwen/Qwen3-235B-A22B-Instruct-2507",
    "qwen3-vl-235b-a22b-thinking": "Qwen/Qwen3-235B-A22B-Thinking-2507",
    "llama-3.2-11b-vision-instruct": "meta-llama/Llama-3.1-8B-Instruct",
    "llama-3.2-11b-vision": "meta-llama/Llama-3.1-8B",
    "llama-3.2-90b-vision-instruct": "meta-llama/Llama-3.1-70B-Instruct",
    "llama-3.2-90b-vision": "meta-llama/Llama-3.1-70B",
    "llava-1.5-7b-hf": "lmsys/vicuna-7b-v1.5",
    "llava-1.5-13b-hf": "lmsys/vicuna-13b-v1.5",
    "mistral-small-3.1-24b-instruct-2503": "mistralai/Mistral-Small-24B-Instruct-2501",
    "phi-3-vision-128k-instruct": "microsoft/Phi-3-mini-128k-instruct",
}
# Families with no text-only checkpoint of the same size: what to do instead.
_NO_SIBLING_ADVICE = {
    "gemma3": (
        "Gemma 3 at 4B and above ships only as a vision-language checkpoint; google/gemma-3-1b-it is the text-only "
        "one, or accept the vision tower's memory and serve it with images disabled"
    ),
}


def is_multimodal(hf: dict[str, Any], architecture: str | None) -> bool:
    """A vision/audio-language checkpoint: an encoder config in config.json, or the table says so."""
    if any(isinstance(hf.get(key), dict) for key in ("vision_config", "audio_config", "vision_tower_config")):
        return True
    table = load_vllm_table()
    entry = (table.get("architectures") or {}).get(architecture or "") or (table.get("removed") or {}).get(
        architecture or ""
    )
    return bool(entry and entry.get("multimodal"))


def text_only_sibling(model_id: str | None) -> str | None:
    """The text-only model on the same language stack as the vision-language `model_id`, when one is known."""
    if not model_id:
        return None
    return _TEXT_SIBLINGS.get(model_id.rstrip("/").rsplit("/", 1)[-1].lower())


def text_only_advice(sibling: str | None, model_type: str | None) -> str:
    """What to train instead of a vision-language checkpoint: its text-only sibling, or the family's way out."""
    if sibling:
        return f"use the text-only {sibling} (same language model)"
    return _NO_SIBLING_ADVICE.get(str(model_type), "use a text-only (…ForCausalLM) model of the family")


# ---------------------------------------------------------------- tool calling


_TOOLS_IN_TEMPLATE = re.compile(r"\btools\b")


def template_mentions_tools(template: str | None) -> bool | None:
    """Does the chat template render a `tools` list? None when there is no template to read."""
    if template is None:
        return None
    return bool(_TOOLS_IN_TEMPLATE.search(template))


def suggest_tool_parser(hf: dict[str, Any], model_id: str | None) -> tuple[str | None, str | None]:
    """The vLLM --tool-call-parser for this family, and a note when the choice has a condition."""
    cfg, text_type, outer = split_config(hf)
    name = (model_id or "").lower()
    family = text_type.removesuffix("_text")
    if family.startswith(("qwen2", "qwen3")):
        if "coder" in name and family.startswith("qwen3"):
            return "qwen3_coder", None
        return "hermes", None
    if family == "llama":
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        if (isinstance(rope, dict) and rope.get("rope_type") == "llama3") or cfg.get("vocab_size") == 128256:
            return "llama3_json", "vLLM's docs pair it with examples/tool_chat_template_llama3.1_json.jinja"
        return None, "Llama before 3.1 was not trained for tool calls"
    if family == "llama4" or outer == "llama4":
        return "llama4_pythonic", None
    if family in ("mistral", "mixtral") or outer in ("mistral3", "pixtral"):
        return "mistral", "meant for mistral_common tokenization (--tokenizer-mode mistral)"
    if family == "gpt_oss":
        return "openai", None
    if family in ("deepseek_v3", "deepseek_v32"):
        if "v3.1" in name:
            return "deepseek_v31", None
        return "deepseek_v3", None
    if family == "phi3" and "phi-4-mini" in name:
        return "phi4_mini_json", None
    if family.startswith("granite"):
        return "granite", None
    if family == "internlm2":
        return "internlm", None
    if family.startswith("gemma"):
        return None, "vLLM has no parser dedicated to Gemma 2/3; tool calls need a custom template"
    return None, None
