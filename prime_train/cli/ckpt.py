"""`prime-train ckpt to-hf`: turn a training checkpoint into a model that transformers and vLLM load."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag
from prime_train.cli.errors import BAD_INPUT, CliError

ckpt_app = typer.Typer(help="Work with checkpoints.", no_args_is_help=True)


@ckpt_app.command("to-hf")
def ckpt_to_hf(
    step_dir: Annotated[Path, typer.Argument(help="A whole DCP checkpoint: <run>/checkpoints/step-N.")],
    out: Annotated[
        Path,
        typer.Argument(help="Output directory for the HF model (safetensors, config, tokenizer): new or empty."),
    ],
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Replace OUT when it holds an earlier export of prime-train.")
    ] = False,
    adapter_only: Annotated[
        bool,
        typer.Option("--adapter-only", help="A LoRA run's checkpoint: write OUT/adapter (PEFT's format) alone."),
    ] = False,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="A LoRA run's checkpoint: the run's config.toml, which builds the frozen base; default: the run "
            "directory's above checkpoints/.",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Convert a DCP checkpoint to HF format, loadable by transformers and vLLM.

    OUT must be new or empty, or an earlier export of prime-train (it holds .prime-train-export.json) with
    --overwrite; a directory of anything else, a run directory, its checkpoints or a checkpoint is never
    written into or over. Exit 0 when written, 78 (bad input) when the checkpoint is missing or not one
    prime-train wrote, or OUT is refused (nothing is written).

    A LoRA run's checkpoint holds the adapter alone: the frozen base is built again as the run builds it (its
    config.toml's model.path, or the random init of run.seed), and OUT is written as the run's final/ is: the
    merged model, with OUT/adapter/ the adapter in PEFT's format (--adapter-only: that alone). A checkpoint whose
    meta.json adapter (rank, alpha, targets) is not the one its run's [lora] builds, or whose weights are not of
    it, is refused (78).

    Examples:

      prime-train ckpt to-hf runs/tiny-sft/checkpoints/step-200 exported/

      prime-train ckpt to-hf runs/tiny-sft/checkpoints/step-300 exported/ --overwrite

      prime-train ckpt to-hf runs/tiny-lora/checkpoints/step-50 exported/ --adapter-only
    """
    from prime_train.engine.export import dcp_to_hf

    try:
        dcp_to_hf(step_dir, out, overwrite=overwrite, adapter_only=adapter_only, config_path=config)
    except (FileNotFoundError, ValueError) as exc:  # what the user pointed at is not a checkpoint
        raise CliError(exc, BAD_INPUT) from None
    output.done(as_json, {"checkpoint": str(step_dir), "out": str(out)}, str(out), label="wrote")


def _checkpoints_dir(run_dir: Path) -> Path:
    """Where a run's checkpoints are (its config's ckpt.dir, else checkpoints/); 78 for a directory that holds no
    run."""
    from prime_train.resilience.status import NotARunDir, _run_config, check_run_dir
    from prime_train.rundir import RunDir

    try:
        check_run_dir(run_dir)
    except NotARunDir as exc:
        raise CliError(exc, BAD_INPUT) from None
    return RunDir.of_run(run_dir, _run_config(run_dir / "config.toml")).checkpoints_dir


@ckpt_app.command("list")
def ckpt_list(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (<output_dir>/<name>).")],
    verify: Annotated[
        bool,
        typer.Option(
            "--verify", help="Check each whole checkpoint against its DCP metadata and manifest (reads every byte)."
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """List a run's checkpoints: whole, partial (step-N.tmp) and quarantined, with step, size, time, verified.

    Without --verify a whole checkpoint's `verified` is unknown (null): checking reads all of it. Exit 0, 78 when
    RUN_DIR holds no run.

    Examples:

      prime-train ckpt list runs/tiny-sft

      prime-train ckpt list runs/tiny-sft --verify --json
    """
    from prime_train.retention import checkpoint_inventory

    ckpt_dir = _checkpoints_dir(run_dir)
    rows = checkpoint_inventory(ckpt_dir)
    for row in rows:
        row["verified"], row["problem"] = None, None
        if verify and row["kind"] == "whole":
            from prime_train.engine.verify import verify_checkpoint  # the engine's check: it reads DCP metadata

            row["problem"] = verify_checkpoint(Path(row["path"]))
            row["verified"] = row["problem"] is None
    doc = {"run_dir": str(run_dir), "checkpoints_dir": str(ckpt_dir), "checkpoints": rows}
    output.emit(doc, as_json, lambda console: _render_list(doc, console))


def _render_list(doc: dict, console) -> None:
    from rich.table import Table

    from prime_train.cli.runs import size, when

    if not doc["checkpoints"]:
        output.say(f"no checkpoints in {doc['checkpoints_dir']}")
        return
    table = Table(title=output.literal(doc["checkpoints_dir"]))
    for column in ("step", "kind", "size", "time", "verified", "note"):
        table.add_column(column)
    for r in doc["checkpoints"]:
        verified = {None: "-", True: "yes", False: "NO"}[r["verified"]]
        note = r.get("problem") or r.get("reason") or (f"being written by {r['writer']}" if r.get("writer") else "")
        cells = (str(r["step"]), r["kind"], size(r["bytes"]), when(r["time"]), verified, note or "")
        table.add_row(*(output.literal(output.clip(c, 300)) for c in cells))
    console.print(table)


@ckpt_app.command("rm")
def ckpt_rm(
    run_dir: Annotated[Path, typer.Argument(help="A run directory (<output_dir>/<name>).")],
    step: Annotated[int, typer.Argument(min=0, help="The step whose checkpoint (step-N or step-N.tmp) to delete.")],
    as_json: JsonFlag = False,
) -> None:
    """Delete one checkpoint of a run, by the retention rules.

    Never the newest whole checkpoint (a resume starts there), never a quarantined one (step-N.corrupt, kept for
    inspection), never a step-N.tmp a live process is writing, never through a symbolic link or outside the run's
    checkpoint directory. Exit 0 when deleted, 78 when refused or there is no such step (nothing is deleted).

    Examples:

      prime-train ckpt rm runs/tiny-sft 100

      prime-train ckpt rm runs/tiny-sft 100 --json
    """
    from prime_train.retention import remove_step

    ckpt_dir = _checkpoints_dir(run_dir)
    try:
        removed = remove_step(ckpt_dir, step)
    except (OSError, ValueError) as exc:  # RemovalRefused is a ValueError; so are safe_remove_checkpoint's refusals
        raise CliError(exc, BAD_INPUT) from None
    names = ", ".join(p.name for p in removed)
    output.done(as_json, {"removed": [str(p) for p in removed]}, f"{names} from {ckpt_dir}", label="deleted")
