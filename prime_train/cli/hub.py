"""`prime-train download | push`: the Hugging Face Hub both ways (integrations/hub.py, through huggingface_hub)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag
from prime_train.cli.errors import BAD_INPUT, CliError


def download(
    model: Annotated[str, typer.Argument(help="A model id on the hub: Qwen/Qwen2.5-0.5B-Instruct.")],
    revision: Annotated[Optional[str], typer.Option("--revision", help="A branch, tag or commit.")] = None,
    everything: Annotated[
        bool, typer.Option("--all", help="Every file of the repository, not only what the engine reads.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Download a model into the Hugging Face cache, where `prime-train run` and transformers find it.

    Only what the engine reads (safetensors, configs, tokenizer, chat template) unless --all; progress bars on
    stderr. A gated or private model needs a token (`hf auth login`, or HF_TOKEN), never printed. Exit 0, 78 when
    the hub cannot be reached (offline, HF_HUB_OFFLINE), the model does not exist or the token may not read it.

    Examples:

      prime-train download Qwen/Qwen2.5-0.5B-Instruct

      prime-train download meta-llama/Llama-3.1-8B-Instruct --revision main --json
    """
    from prime_train.integrations.hub import HubRefused
    from prime_train.integrations.hub import download as fetch

    if "/" not in model.strip("/") and Path(model).exists():
        raise CliError(f"{model} is a local path: download takes a hub id (owner/name)", BAD_INPUT)
    try:
        path = fetch(model, revision=revision, everything=everything)
    except HubRefused as exc:
        raise CliError(exc, BAD_INPUT) from None
    output.done(as_json, {"model": model, "path": str(path)}, f"{model} to {path}", label="downloaded")


def push(
    run_dir: Annotated[Path, typer.Argument(help="A finished run directory (its final/ is uploaded).")],
    repo: Annotated[str, typer.Option("--repo", help="The hub repository: <user or organisation>/<name>.")],
    private: Annotated[bool, typer.Option("--private", help="Create the repository private.")] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show the files and the model card; upload nothing.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Upload a run's final/ to the Hugging Face Hub with a generated model card (its config and last eval metrics).

    The repository is created when missing; everything goes in one commit. The token is huggingface_hub's own
    (`hf auth login`, or HF_TOKEN) and is never printed. Exit 0, 78 when the run has no final/, there is no
    token, or the hub cannot be reached or refuses.

    Examples:

      prime-train push runs/tiny-sft --repo me/tiny-reverse --dry-run

      prime-train push runs/qwen2.5-0.5b-sft --repo me/qwen-sft --private
    """
    from prime_train.integrations.hub import HubRefused, upload_plan
    from prime_train.integrations.hub import push as upload

    try:
        plan = upload_plan(run_dir, repo, private=private)
        if dry_run:
            output.emit({"dry_run": True, **plan.to_dict()}, as_json, lambda console: _show_plan(plan))
            return
        token = _token()
        url = upload(plan, token=token)
    except HubRefused as exc:
        raise CliError(exc, BAD_INPUT) from None
    for note in plan.notes:
        output.note(note)
    output.done(as_json, {"repo_id": repo, "url": url, "files": len(plan.files) + 1}, url, label="pushed")


def _token() -> str:
    """huggingface_hub's token (HF_TOKEN, or the file `hf auth login` wrote); 78 when there is none."""
    from huggingface_hub import get_token

    token = get_token()
    if not token:
        raise CliError(
            "no Hugging Face token: run `hf auth login` or set HF_TOKEN (a token with write access)", BAD_INPUT
        )
    return token


def _show_plan(plan) -> None:
    from prime_train.kit.bounded import size_text

    output.say(f"would upload to {plan.repo_id}{' (private)' if plan.private else ''}:")
    for f in plan.files:
        output.say(f"  {f['path']}  {size_text(f['bytes'])}")
    output.say("  README.md  (the model card below)")
    output.document(plan.card)
