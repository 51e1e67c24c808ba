"""The tested-model registry: models people use for RL, the versions they need and their known issues.

`prime-train models list` shows it; `verify-model` attaches the matching entry to its report. The data is
data/tested_models.json, shipped with the package; its top-level note says who checked what (nobody ran these
models on a GPU for it: entries record versions and publicly reported issues, with sources).
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from typing import Any

REQUIRED_KEYS = ("model_id", "family", "vllm_version", "transformers_version", "tested_on", "known_issues")
_DATA = "prime_train.validator.data"
_FILE = "tested_models.json"
_CONFIGS_FILE = "model_configs.json"  # the hub's config.json of some registry models: their shapes offline


class RegistryError(ValueError):
    """The shipped registry file is malformed (a packaging or editing mistake, named precisely)."""


def _validate(doc: Any) -> dict[str, Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list):
        raise RegistryError(f"{_FILE}: expected an object with a `models` list")
    seen: set[str] = set()
    for index, entry in enumerate(doc["models"]):
        where = f"{_FILE}: models[{index}]"
        if not isinstance(entry, dict):
            raise RegistryError(f"{where} is not an object")
        missing = [key for key in REQUIRED_KEYS if key not in entry]
        if missing:
            raise RegistryError(f"{where} ({entry.get('model_id', '?')}) lacks {', '.join(missing)}")
        if not isinstance(entry["known_issues"], list):
            raise RegistryError(f"{where} ({entry['model_id']}): known_issues must be a list")
        key = str(entry["model_id"]).lower()
        if key in seen:
            raise RegistryError(f"{where}: {entry['model_id']} is listed twice")
        seen.add(key)
    return doc


@functools.lru_cache(maxsize=1)
def _load() -> dict[str, Any]:
    text = resources.files(_DATA).joinpath(_FILE).read_text(encoding="utf-8")
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise RegistryError(f"{_FILE} is not valid JSON: {exc}") from None
    return _validate(doc)


def load_registry() -> dict[str, Any]:
    """The whole registry ({"note", "models": [...]}), validated; a copy, so callers may change it freely."""
    return copy.deepcopy(_load())


def lookup(model_id: str | None) -> dict[str, Any] | None:
    """The entry for a hub id (case-insensitive), or for a bare name such as a local directory's ("Qwen3-8B")."""
    if not model_id:
        return None
    wanted = model_id.strip().rstrip("/").lower()
    bare = wanted.rsplit("/", 1)[-1]
    models = _load()["models"]
    for entry in models:
        if str(entry["model_id"]).lower() == wanted:
            return copy.deepcopy(entry)
    if "/" in wanted:  # an owner was given and did not match: a fork is not the tested model
        return None
    matches = [e for e in models if str(e["model_id"]).lower().rsplit("/", 1)[-1] == bare]
    return copy.deepcopy(matches[0]) if len(matches) == 1 else None


@functools.lru_cache(maxsize=1)
def _configs() -> dict[str, Any]:
    doc = json.loads(resources.files(_DATA).joinpath(_CONFIGS_FILE).read_text(encoding="utf-8"))
    return {str(k).lower(): v for k, v in doc["configs"].items()}


def shipped_config(model_id: str | None) -> dict[str, Any] | None:
    """The hub's config.json of a registry model as shipped with prime-train (data/model_configs.json): its shape
    without a download. Exact hub ids only (case-insensitive); None for any other."""
    if not model_id:
        return None
    found = _configs().get(model_id.strip().rstrip("/").lower())
    return copy.deepcopy(found) if found is not None else None


def describe_entry(entry: dict[str, Any]) -> str:
    """One line for a registry entry: what the registry knows of the model without its files."""
    issues = len(entry.get("known_issues") or [])
    return (
        f"{entry['model_id']} is in prime-train's tested-model registry: family {entry['family']}, vLLM "
        f"{entry['vllm_version']}, transformers {entry['transformers_version']}, {issues} known issue(s) "
        "(`prime-train models list`)"
    )


def models_json() -> dict[str, Any]:
    """The `prime-train models list --json` object: the note (who tested what) and every entry."""
    doc = load_registry()
    return {"note": doc.get("note"), "models": doc["models"]}


def render_models(console: Any) -> None:
    """A table of the registry for `prime-train models list`, with the note on what the entries mean."""
    from rich.table import Table

    doc = _load()
    table = Table(title="Tested models", title_justify="left")
    for column in ("model", "family", "vLLM", "transformers", "tool parser", "checked", "known issues"):
        table.add_column(column, overflow="fold")
    for entry in doc["models"]:
        issues = entry["known_issues"]
        table.add_row(
            str(entry["model_id"]),
            str(entry["family"]),
            str(entry["vllm_version"]),
            str(entry["transformers_version"]),
            str(entry.get("tool_call_parser") or "-"),
            str(entry["tested_on"]),
            str(len(issues)) if issues else "-",
        )
    console.print(table)
    if doc.get("note"):
        console.print(f"[dim]{doc['note']}[/dim]")
    console.print("[dim]`prime-train verify-model MODEL` shows a model's known issues in full.[/dim]")
