"""The Hugging Face Hub both ways: `prime-train download MODEL` and `prime-train push RUN --repo ID`.

huggingface_hub does the work: `snapshot_download` fetches into the cache `from_pretrained` (the engine) reads,
with its own progress bars; `HfApi.create_repo` and `create_commit` publish a run's final/ with a model card made
here from the run's config.toml (already written with secret values as ***, and redacted again) and its last eval
metrics. The token is huggingface_hub's own (HF_TOKEN, or `hf auth login`'s file): it is passed to the library,
never printed or written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_train.kit import bounded
from prime_train.kit.redact import Redactor
from prime_train.rundir import RunDir

# what the engine reads of a model: weights in safetensors, configs, the tokenizer, a chat template
ENGINE_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*")
CARD_FILE = "README.md"


class HubRefused(ValueError):
    """The hub cannot do what was asked (offline, no token, no such repository, no access): exit 78."""


def download(model: str, *, revision: str | None = None, everything: bool = False) -> Path:
    """Fetch `model` into the Hugging Face cache (what the engine loads from) and return its snapshot directory.

    Only what the engine reads unless `everything` (no .bin/.pth duplicates, no GGUF)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        path = snapshot_download(model, revision=revision, allow_patterns=None if everything else list(ENGINE_PATTERNS))
    except GatedRepoError:
        raise HubRefused(
            f"{model} is gated: accept its licence on the hub with your account, then `hf auth login` (or set HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise HubRefused(
            f"{model}: no such model on the hub, or it is private and this token cannot read it (`hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise HubRefused(f"{model}: no revision {revision!r}") from None
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:
        raise HubRefused(_offline(model, exc)) from None
    except HfHubHTTPError as exc:
        raise HubRefused(f"{model}: the hub refused the download ({_first_line(exc)})") from None
    except Exception as exc:
        if network_error(exc):
            raise HubRefused(_offline(model, exc)) from None
        raise
    return Path(path)


def network_error(exc: BaseException) -> bool:
    """A failure to reach the hub at all (no DNS, refused, timed out): the HTTP client's transport errors (httpx, or
    the httpx2 huggingface_hub 2 bundles) and the OS's."""
    top = type(exc).__module__.split(".")[0]
    return isinstance(exc, OSError) or top.startswith(("httpx", "httpcore", "requests", "urllib3"))


def _offline(what: str, exc: Exception) -> str:
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return f"{what}: the hub cannot be reached (HF_HUB_OFFLINE is set); unset it, where there is network"
    return (
        f"{what}: the hub cannot be reached ({_first_line(exc)}); run this where there is network, or check the "
        "proxies and HF_ENDPOINT"
    )


def _first_line(exc: BaseException) -> str:
    return Redactor.from_environment()(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


# ---------------------------------------------------------------- push


@dataclass
class UploadPlan:
    """What `push` sends: every file of final/ (path in the repo, bytes) and the model card, to `repo_id`."""

    repo_id: str
    source: Path
    files: list[dict[str, Any]]
    card: str
    private: bool = False
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"repo_id": self.repo_id, "source": str(self.source), "files": self.files, "card": self.card,
                "private": self.private}  # fmt: skip


def last_eval_metrics(metrics_path: Path, notes: list[str]) -> dict[str, Any]:
    """The newest eval record of metrics.jsonl: its step and every eval_* value, {} when the run logged none."""
    for record in bounded.records_from_end(metrics_path, notes, contains=(b'"eval_',)):
        values = {
            k: v for k, v in record.items() if k.startswith("eval_") and isinstance(v, int | float) and v == v
        }  # v == v: NaN is left out
        if values:
            return {"step": record.get("step"), **values}
    return {}


# the config sections a model card shows: what made the model (the supervisor's, the spot launcher's are not)
CARD_SECTIONS = {"run", "model", "lora", "data", "train", "distributed", "rl", "dpo"}


def card_config(text: str, config: dict[str, Any]) -> str:
    """config.toml's text cut to the sections CARD_SECTIONS names that this run uses (lora with a rank, rl for an RL
    job, dpo for DPO), each as it is written there."""
    run = config.get("run") if isinstance(config.get("run"), dict) else {}
    job = run.get("job")
    lora = config.get("lora")
    used = set(CARD_SECTIONS)
    used -= set() if isinstance(lora, dict) and lora.get("rank") else {"lora"}
    used -= set() if job in ("rl", "ppo") else {"rl"}
    used -= set() if job == "dpo" else {"dpo"}
    kept, keep = [], True
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("[") and not stripped.startswith("[ ") and "=" not in stripped.split("]")[0]:
            keep = stripped.strip("[]").split(".")[0].strip() in used
        if keep:
            kept.append(line)
    return "\n".join(kept).strip()


def model_card(run_dir: Path, repo_id: str, notes: list[str]) -> str:
    """A model card: front matter (library, base model, tags), what the run trained, its last eval, its config."""
    import tomllib

    rd = RunDir(run_dir)
    text = bounded.read_text(rd.config_path, bounded.MAX_TEXT_BYTES, notes) or ""
    text = Redactor.from_environment().mask_values(text)  # config.toml holds *** already; the environment's values
    try:
        config = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        config = {}
    run, model = config.get("run", {}), config.get("model", {})
    job = run.get("job", "sft") if isinstance(run, dict) else "sft"
    base = model.get("path") if isinstance(model, dict) else None
    hub_base = isinstance(base, str) and base.count("/") == 1 and not os.path.exists(base)
    lora = isinstance(config.get("lora"), dict) and bool(config["lora"].get("rank"))
    front = ["---", "library_name: transformers", "tags:", "- prime-train", f"- {job}"]
    front += ["- lora"] if lora else []
    front += [f"base_model: {base}"] if hub_base else []
    metrics = last_eval_metrics(rd.metrics_path, notes)
    lines = [*front, "---", "", f"# {repo_id.split('/')[-1]}", ""]
    how = f"run.job = {job}{', LoRA' if lora else ''}"
    lines.append(
        f"Trained with prime-train ({how})" + (f" from [{base}](https://huggingface.co/{base})." if hub_base else ".")
    )
    lines += ["", "## Evaluation", ""]
    if metrics:
        lines += [f"At step {metrics.get('step')}:", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k.removeprefix('eval_')} | {v:.4g} |" for k, v in metrics.items() if k != "step"]
    else:
        lines.append("The run logged no evaluation.")
    lines += ["", "## Training config", "", "```toml", card_config(text, config), "```", ""]
    return "\n".join(lines)


def upload_plan(run_dir: Path, repo_id: str, *, private: bool = False) -> UploadPlan:
    """The files of the run's final/ and its model card, for `repo_id`; HubRefused when there is no final/."""
    final = RunDir(run_dir).final_dir
    if not final.is_dir() or final.is_symlink():
        raise HubRefused(f"{run_dir} has no final/ export to push (the run has not finished, or it is not a run)")
    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise HubRefused(f"--repo {repo_id!r}: name it as <user or organisation>/<model name>")
    files = []
    for path in sorted(final.rglob("*")):
        if path.is_symlink():
            raise HubRefused(f"{path} is a symbolic link: prime-train uploads only the files its export wrote")
        if path.is_file() and not path.name.startswith("."):  # .prime-train-export.json is ours, not the model's
            files.append({"path": path.relative_to(final).as_posix(), "bytes": path.stat().st_size})
    notes: list[str] = []
    card = model_card(Path(run_dir), repo_id, notes)
    if any(f["path"] == CARD_FILE for f in files):
        notes.append(f"final/{CARD_FILE} is replaced by the generated model card")
        files = [f for f in files if f["path"] != CARD_FILE]
    return UploadPlan(repo_id, final, files, card, private, notes)


def push(plan: UploadPlan, *, token: str | None = None) -> str:
    """Create the repository if needed and upload the plan in one commit; the commit's URL."""
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token)
    operations = [CommitOperationAdd(f["path"], str(plan.source / f["path"])) for f in plan.files]
    operations.append(CommitOperationAdd(CARD_FILE, plan.card.encode()))
    try:
        api.create_repo(plan.repo_id, private=plan.private, exist_ok=True, repo_type="model")
        info = api.create_commit(plan.repo_id, operations, commit_message="Upload model trained with prime-train")
    except OfflineModeIsEnabled as exc:
        raise HubRefused(_offline(plan.repo_id, exc)) from None
    except (HfHubHTTPError, ValueError) as exc:  # ValueError: the hub found the card's metadata invalid
        raise HubRefused(f"{plan.repo_id}: the hub refused the upload ({_first_line(exc)})") from None
    except Exception as exc:
        if network_error(exc):
            raise HubRefused(_offline(plan.repo_id, exc)) from None
        raise
    return str(getattr(info, "commit_url", "") or f"{plan.repo_id}")
