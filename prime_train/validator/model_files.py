"""A model's config.json and chat template, read from a local directory, the HF cache or the hub.

Never the weights: `verify-model` answers from these few JSON and template files. A hub id is looked
up in the local cache first; only online, and only then, are the files fetched, each with a short
timeout. Every way this can fail is a ModelConfigNotFound whose message says what to do.

Offline is found out in seconds, not after huggingface_hub's retries (five, with backoff: ~25 s per
file): HF_HUB_OFFLINE says so outright, and otherwise one HEAD request with a short timeout asks the
hub whether it answers at all before any download starts.
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUB_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 5.0  # the hub answers a HEAD in well under a second; five covers a slow link, not a dead one


class ModelConfigNotFound(Exception):
    """The model's config.json could not be read: no such directory, not cached while offline, not on the hub."""


@dataclass
class ModelFiles:
    """config.json and the tokenizer's chat template of a model, and where they came from."""

    config: dict[str, Any]
    tokenizer_config: dict[str, Any] | None
    chat_template: str | None
    source: str
    model_id: str


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1/true/yes/on), but now rather than at its import."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _hf_cache_dir() -> Path:
    """The hub cache as the environment says now (huggingface_hub reads HF_HOME once, at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(os.environ["HF_HUB_CACHE"]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(os.path.expanduser(home)) / "hub"


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelConfigNotFound(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ModelConfigNotFound(f"{what} {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigNotFound(f"{what} {path} does not hold a JSON object")
    return data


def _template_text(tokenizer_config: dict[str, Any] | None, extra: list[str]) -> str | None:
    """Every chat template of the model as one text: tokenizer_config's (a string or named list) and files."""
    pieces: list[str] = []
    template = (tokenizer_config or {}).get("chat_template")
    if isinstance(template, str):
        pieces.append(template)
    elif isinstance(template, list):
        pieces.extend(str(t.get("template", "")) for t in template if isinstance(t, dict))
    pieces.extend(extra)
    return "\n".join(pieces) if pieces else None


def _extra_templates(read: Any) -> list[str]:
    """chat_template.jinja / chat_template.json next to the tokenizer (newer checkpoints keep it there)."""
    found: list[str] = []
    jinja = read("chat_template.jinja")
    if jinja is not None:
        found.append(jinja)
    raw = read("chat_template.json")
    if raw is not None:
        try:
            data = json.loads(raw)
            if isinstance(data, dict) and isinstance(data.get("chat_template"), str):
                found.append(data["chat_template"])
        except ValueError:
            pass
    return found


def _from_directory(directory: Path) -> ModelFiles:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelConfigNotFound(f"{directory} has no config.json: point at the model directory (the one with it)")
    config = _read_json(config_path, "config")
    tok_path = directory / "tokenizer_config.json"
    tokenizer_config = _read_json(tok_path, "tokenizer config") if tok_path.is_file() else None

    def read(name: str) -> str | None:
        path = directory / name
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None

    template = _template_text(tokenizer_config, _extra_templates(read))
    return ModelFiles(config, tokenizer_config, template, f"local directory {directory}", directory.name)


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def _from_hub(repo_id: str, offline: bool) -> ModelFiles:
    try:
        import huggingface_hub
    except ImportError:
        raise ModelConfigNotFound(
            f"{repo_id!r} is not a local directory and huggingface_hub is not installed to look it up: pass the path "
            "of a model directory (one with config.json), or `pip install huggingface_hub`"
        ) from None
    cache = _hf_cache_dir()

    def cached(name: str) -> str | None:
        try:
            found = huggingface_hub.try_to_load_from_cache(repo_id, name, cache_dir=str(cache))
        except Exception:
            return None
        return found if isinstance(found, str) else None

    config_path = cached("config.json")
    if config_path is not None:
        source = f"Hugging Face cache {cache}"

        def read(name: str) -> str | None:
            path = cached(name)
            return Path(path).read_text(encoding="utf-8", errors="replace") if path else None

    elif offline:
        raise ModelConfigNotFound(
            f"{repo_id} is not in the local Hugging Face cache ({cache}) and the hub is offline (HF_HUB_OFFLINE is "
            "set): pass a local path to the model directory (the one with config.json), or fetch it once with "
            "network access"
        )
    else:
        endpoint = str(getattr(huggingface_hub.constants, "ENDPOINT", "https://huggingface.co"))
        why = hub_unreachable(f"{endpoint.rstrip('/')}/{repo_id}/resolve/main/config.json")
        if why is not None:
            raise ModelConfigNotFound(_offline_message(repo_id, cache, why))
        config_path = _hub_download(huggingface_hub, repo_id, "config.json", required=True, cache=cache)
        source = "Hugging Face hub"

        def read(name: str) -> str | None:
            path = _hub_download(huggingface_hub, repo_id, name, required=False, cache=cache)
            return Path(path).read_text(encoding="utf-8", errors="replace") if path else None

    assert config_path is not None
    config = _read_json(Path(config_path), "config")
    tok_raw = read("tokenizer_config.json")
    tokenizer_config: dict[str, Any] | None = None
    if tok_raw is not None:
        try:
            loaded = json.loads(tok_raw)
            tokenizer_config = loaded if isinstance(loaded, dict) else None
        except ValueError:
            tokenizer_config = None
    extra = [] if (tokenizer_config or {}).get("chat_template") else _extra_templates(read)
    return ModelFiles(config, tokenizer_config, _template_text(tokenizer_config, extra), source, repo_id)


def hub_model_unavailable(repo_id: str, filenames: tuple[str, ...] = ("config.json",)) -> str | None:
    """Why the hub model `repo_id` cannot be loaded here, or None: one of `filenames` is in the local HF cache, or
    the hub answers (HF_HUB_OFFLINE unset). Seconds at most (one HEAD request); nothing is downloaded."""
    try:
        import huggingface_hub
    except ImportError:
        return f"{repo_id!r} is not a local directory and huggingface_hub is not installed to look it up"
    cache = _hf_cache_dir()
    for name in filenames:
        try:
            if isinstance(huggingface_hub.try_to_load_from_cache(repo_id, name, cache_dir=str(cache)), str):
                return None
        except Exception:  # a malformed id: left to the lookup below
            continue
    if hub_offline():
        return (
            f"{repo_id} is not in the local Hugging Face cache ({cache}) and the hub is offline (HF_HUB_OFFLINE is "
            f"set): fetch it once with network access (`hf download {repo_id}`), or pass a local model directory"
        )
    endpoint = _endpoint_of_hub().rstrip("/")
    why = hub_unreachable(f"{endpoint}/{repo_id}/resolve/main/{filenames[0]}")
    return None if why is None else _offline_message(repo_id, cache, why)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # a redirect is an answer: the hub is there


def hub_unreachable(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the hub at `url` cannot be reached (no DNS, refused, no answer in `timeout_s`), or None when it answers.

    One HEAD request, without a token, through the proxies the environment names (as huggingface_hub's HTTP
    client uses them). Any HTTP status is an answer. Run on a thread so that a DNS lookup that hangs, which no
    socket timeout bounds, is bounded too.
    """
    result: list[str | None] = []
    silent = f"no answer within {timeout_s:g} s"

    def probe() -> None:
        opener = urllib.request.build_opener(_NoRedirect)
        try:
            with opener.open(urllib.request.Request(url, method="HEAD"), timeout=timeout_s):
                result.append(None)
        except urllib.error.HTTPError:
            result.append(None)  # 401, 404, a redirect: the hub answered
        except urllib.error.URLError as exc:
            reason = getattr(exc, "reason", exc)
            result.append(silent if isinstance(reason, TimeoutError) else str(reason))
        except TimeoutError:  # connected, and then nothing
            result.append(silent)
        except (OSError, ValueError) as exc:  # a connection reset, a malformed endpoint
            result.append(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)

    thread = threading.Thread(target=probe, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s + 1)
    return result[0] if result else silent


def _offline_message(repo_id: str, cache: Path, why: str) -> str:
    host = urllib.parse.urlsplit(_endpoint_of_hub()).netloc or "the hub"
    return (
        f"offline / hub unreachable: {host} did not answer ({why}), and {repo_id} is not in the local Hugging Face "
        f"cache ({cache}). Pass a local model directory (the one with config.json), fetch the model where there is "
        f"network (`hf download {repo_id}`) into this cache, or check the network and proxies (HF_ENDPOINT, "
        "HTTPS_PROXY); HF_HUB_OFFLINE=1 skips the hub"
    )


def _endpoint_of_hub() -> str:
    try:
        from huggingface_hub import constants

        return str(constants.ENDPOINT)
    except ImportError:
        return "https://huggingface.co"


def _hub_download(hub: Any, repo_id: str, filename: str, *, required: bool, cache: Path) -> str | None:
    """One file from the hub with a short timeout; a missing optional file is None, never an error."""
    from huggingface_hub import errors

    try:
        return hub.hf_hub_download(repo_id, filename, etag_timeout=HUB_TIMEOUT_S)
    except errors.GatedRepoError:
        if not required:
            return None
        raise ModelConfigNotFound(
            f"{repo_id} is a gated repository: accept its license on huggingface.co and provide a token (HF_TOKEN), "
            "or pass a local path to a downloaded copy"
        ) from None
    except errors.RepositoryNotFoundError:
        if not required:
            return None
        raise ModelConfigNotFound(
            f"{repo_id} was not found on the Hugging Face hub (a typo, or a private repository without a token): "
            "check the id, or pass a local path to the model directory"
        ) from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled) as exc:
        # huggingface_hub's "the hub did not answer and the cache has no copy" (a subclass of EntryNotFoundError
        # since 1.0: caught first, or it would read as a file missing from the repository)
        if not required:
            return None
        raise ModelConfigNotFound(_offline_message(repo_id, cache, type(exc).__name__)) from None
    except (errors.EntryNotFoundError, errors.RevisionNotFoundError):
        if not required:
            return None
        raise ModelConfigNotFound(f"{repo_id} has no {filename} on the hub: is it a transformers model?") from None
    except Exception as exc:  # a connection dropped mid-way, a timeout
        if not required:
            return None
        raise ModelConfigNotFound(
            f"could not fetch {filename} of {repo_id} from the hub ({type(exc).__name__}); pass a local path to the "
            "model directory, or set HF_HUB_OFFLINE=1 to use only the local cache"
        ) from None


def find_model_files(name_or_path: str, *, offline: bool | None = None) -> ModelFiles:
    """config.json and tokenizer files of a local directory, a cached hub model, or (online) the hub."""
    if offline is None:
        offline = hub_offline()
    name = name_or_path.strip()
    if not name:
        raise ModelConfigNotFound("no model given: pass a hub id (Qwen/Qwen2.5-0.5B-Instruct) or a local directory")
    path = Path(os.path.expanduser(name))
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if path.is_dir():
        return _from_directory(path)
    if path.exists():
        raise ModelConfigNotFound(f"{name} is a file, not a model directory with config.json")
    if _looks_like_path(name) or not _REPO_ID.match(name):
        raise ModelConfigNotFound(f"no directory {name}, and it is not a hub id (owner/name): check the path")
    try:
        return _from_hub(name, offline)
    except ModelConfigNotFound as exc:
        return _from_registry(name, exc)


def _from_registry(repo_id: str, why: ModelConfigNotFound) -> ModelFiles:
    """A registry model the hub and the cache cannot give: its config.json as prime-train ships it (no tokenizer
    files, so no chat template), else `why` raised again with what the registry knows of it."""
    from prime_train.validator.registry import describe_entry, lookup, shipped_config

    config = shipped_config(repo_id)
    entry = lookup(repo_id) if "/" in repo_id else None
    if config is None:
        if entry is None:
            raise why
        raise ModelConfigNotFound(f"{why}. {describe_entry(entry)}; its config.json is not shipped") from None
    first = str(why).split(":")[0]
    source = f"prime-train's shipped copy of its config.json (not read from the hub or the cache: {first})"
    return ModelFiles(config, None, None, source, repo_id)
