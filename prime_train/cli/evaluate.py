"""`prime-train eval`: evaluate a trained model as its job evaluates (engine/model_eval.py), or with lm-eval-harness."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Annotated, Optional

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag, split_overrides
from prime_train.cli.errors import BAD_INPUT, CliError
from prime_train.cli.generate import Source, Step, _load

LM_EVAL_EXTRA = "pip install 'prime-train[lm-eval]'"


def evaluate(
    ctx: typer.Context,
    source: Source,
    config: Annotated[
        Optional[list[str]],
        typer.Argument(
            help="Config files naming the data (data.datasets, train.mc_eval_path, train.eval_environment); "
            "default: the run's config.toml."
        ),
    ] = None,
    step: Step = None,
    examples: Annotated[int, typer.Option("--examples", min=1, help="Held-out task examples for exact match.")] = 64,
    environment: Annotated[
        Optional[str],
        typer.Option("--environment", help="Also score an RL environment's eval prompts (as rl.environment)."),
    ] = None,
    tasks: Annotated[
        Optional[str],
        typer.Option(
            "--tasks", help="lm-evaluation-harness tasks, comma-separated (hellaswag,arc_easy): needs lm_eval."
        ),
    ] = None,
    limit: Annotated[
        Optional[int], typer.Option("--limit", min=1, help="lm-eval: at most this many items a task.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Evaluate a trained model: held-out loss, exact match, multiple choice, RL reward; or lm-eval's tasks.

    Held-out loss and perplexity, exact match on the built-in tasks, the multiple-choice eval (train.mc_eval_path),
    an RL environment's mean reward and pass rate (--environment, or the config's). The data comes from CONFIG (with
    `--section.key value` overrides), else from the run's config.toml. With --tasks the harness runs instead (it
    must be installed: pip install 'prime-train[lm-eval]'; its datasets come through the Hugging Face cache). Exit
    0, 78 for a SOURCE that is not a model, a config that does not lint, or --tasks without the harness.

    Examples:

      prime-train eval runs/tiny-sft

      prime-train eval runs/tiny-sft --step 200 --json

      prime-train eval exported/ my.toml --train.mc_eval_path data/mc.jsonl

      prime-train eval exported/ --tasks hellaswag,arc_easy --limit 200
    """
    if tasks is not None:
        names = [t.strip() for t in tasks.split(",") if t.strip()]
        if not names:
            raise CliError("--tasks names no task: pass e.g. --tasks hellaswag,arc_easy", BAD_INPUT)
        if importlib.util.find_spec("lm_eval") is None:
            raise CliError(f"--tasks needs lm-evaluation-harness (the lm_eval module): {LM_EVAL_EXTRA}", BAD_INPUT)
    if not source.is_dir():
        what = "does not exist" if not source.exists() else "is not a directory"
        raise CliError(f"{source} {what}: pass a run directory or a model directory", BAD_INPUT)
    cfg = _config(source, config, ctx.args)
    loaded = _load(source, step)
    if tasks is not None:
        from prime_train.engine.model_eval import lm_eval_tasks

        doc = {"model": loaded.source, "lm_eval": lm_eval_tasks(loaded, names, limit=limit)}
    else:
        from prime_train.engine.metrics import EngineConfigError
        from prime_train.engine.model_eval import evaluate_model

        try:
            doc = {"model": loaded.source, **evaluate_model(loaded, cfg, examples=examples, environment=environment)}
        except (EngineConfigError, ValueError) as exc:  # data or an environment the config names that does not load
            raise CliError(exc, BAD_INPUT) from None
    output.emit(doc, as_json, lambda console: _render(doc))


def _config(source: Path, files: list[str] | None, extra: list[str]):
    """The config the evaluation reads its data from: FILES and overrides, else the run's config.toml."""
    from prime_train.cli.common import load

    paths, overrides = split_overrides(files, extra)
    if not paths:
        run_config = source / "config.toml"
        if not run_config.is_file():
            raise CliError(
                f"{source} has no config.toml: pass a config naming the data to evaluate on "
                "(e.g. `prime-train eval MODEL_DIR prime_train/configs/tiny-sft.toml`)",
                BAD_INPUT,
            )
        paths = [str(run_config)]
    return load(paths, overrides)


def _render(doc: dict) -> None:
    output.say(f"model: {doc['model']}", stderr=True)
    if "lm_eval" in doc:
        for task, values in doc["lm_eval"].items():
            output.say(f"{task}: " + ", ".join(f"{k} {v:.4g}" for k, v in values.items()))
        return
    for key, value in doc["metrics"].items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        output.say(f"{key.removeprefix('eval_')}: {shown}")
    for s in doc["samples"]:
        output.say(f"  {s['prompt']!r} -> {s['output']!r} (expected {s['expected']!r})", stderr=True)
