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
