"""`prime-train sample-pairs`: preference pairs from a model's own samples, labelled by the environment's rule."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag, RunConfigFiles, load_run_config, require_engine
from prime_train.cli.errors import BAD_INPUT, CliError


def sample_pairs(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    out: Annotated[
        Path, typer.Option("--out", help="The JSONL file of {prompt, chosen, rejected} records to write.")
    ] = Path("pairs.jsonl"),
    prompts: Annotated[int, typer.Option("--prompts", min=1, help="Train prompts of rl.environment to sample.")] = 512,
    samples: Annotated[int, typer.Option("--samples", min=1, help="Completions sampled for each prompt.")] = 8,
    graded_gap: Annotated[
        float,
        typer.Option(
            "--graded-gap",
            min=0.0,
            max=1.0,
            help="Also pair two wrong samples of a prompt whose graded rule (the task's partial credit) differs by "
            "at least this much, the closer one chosen; 0: only right against wrong.",
        ),
    ] = 0.0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT when it already exists.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """Sample a model on an RL environment's prompts and write its mistakes as preference pairs.

    The model is model.path (an SFT run's or an RL run's final/), sampled as the RL job's worker samples
    (rl.temperature, rl.top_p, rl.max_tokens, run.seed) on train prompts of rl.environment with its
    rl.env_args; never on the held-out prompts the pass rate is measured on. Each sample is judged by the
    environment's rule (the task's exact match, also for rl.environment = "reward-model"); every distinct
    failing sample becomes a record with the reference answer as chosen. Add OUT to a reward run's
    [[data.datasets]] beside the built-in pairs and train the reward model again: the policy's own
    mistakes are then labelled (docs/rlhf.md has the rounds, measured). With --graded-gap, two wrong
    samples are a pair too when the task's partial credit tells them apart, so the reward model learns
    which wrong answer is closer to right.

    Exit 0 when written, 78 when the config, the model or OUT is refused (nothing is written).

    Examples:

      prime-train sample-pairs configs/tiny-rl.toml --model.path runs/tiny-rl/final --out rl0-pairs.jsonl

      prime-train sample-pairs configs/tiny-rl.toml --model.path runs/tiny-rl/final --prompts 1024 --samples 4 --json

      prime-train sample-pairs configs/tiny-rl.toml --model.path runs/sft60/final --graded-gap 0.25
    """
    from prime_train.engine.metrics import EngineConfigError
    from prime_train.environments import EnvironmentLoadError
    from prime_train.rl.pairs import sample_pairs as sample

    cfg = load_run_config(files, ctx.args)
    require_engine(cfg)
    if os.path.lexists(out) and not overwrite:
        raise CliError(f"--out {out}: already exists; pass --overwrite to replace it, or name a new file", BAD_INPUT)
    if os.path.isdir(out):
        raise CliError(f"--out {out}: is a directory; name a .jsonl file", BAD_INPUT)
    if not os.path.isdir(out.parent if str(out.parent) else "."):
        raise CliError(f"--out {out}: its directory {out.parent} does not exist", BAD_INPUT)
    try:
        summary = sample(cfg, out, num_prompts=prompts, samples=samples, graded_gap=graded_gap)
    except (EngineConfigError, EnvironmentLoadError) as exc:
        raise CliError(exc, BAD_INPUT) from None
    data = {"out": str(out), **summary.to_dict()}

    def render(console) -> None:
        console.print(
            output.literal(
                f"wrote {summary.pairs} pairs to {out}: {summary.samples} samples of {summary.prompts} prompts, "
                f"pass rate {summary.pass_rate:.3f}"
            )
        )
        if summary.common_failures:
            common = ", ".join(f"{answer!r} x{n}" for answer, n in summary.common_failures)
            console.print(output.literal(f"commonest failing answers: {common}"))

    output.emit(data, as_json, render)
