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
            "--tasks",
            help="lm-evaluation-harness tasks, comma-separated: registry names (hellaswag,arc_easy) or task YAML "
            "files (./my_task.yaml); needs lm_eval.",
        ),
    ] = None,
    include_path: Annotated[
        Optional[list[Path]],
        typer.Option("--include-path", help="lm-eval: a directory of task YAML files --tasks may name; repeatable."),
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
    must be installed: pip install 'prime-train[lm-eval]'): tasks of its registry, whose datasets come through the
    Hugging Face cache, or your own task YAML files (a local dataset: `dataset_path: json` with
    `dataset_kwargs: {data_files: {test: data.jsonl}}`), named as files or found in --include-path. Exit 0, 78 for
    a SOURCE that is not a model, a config that does not lint, a task the harness does not know, or --tasks without
    the harness.

    Examples:

      prime-train eval runs/tiny-sft

      prime-train eval runs/tiny-sft --step 200 --json

      prime-train eval exported/ my.toml --train.mc_eval_path data/mc.jsonl

      prime-train eval exported/ --tasks hellaswag,arc_easy --limit 200

      prime-train eval runs/tiny-sft --tasks ./my_task.yaml --json
    """
    names = _task_specs(tasks, include_path) if tasks is not None else []
    if not source.is_dir():
        what = "does not exist" if not source.exists() else "is not a directory"
        raise CliError(f"{source} {what}: pass a run directory or a model directory", BAD_INPUT)
    if tasks is not None:  # the harness's tasks name their own data: no config is read
        doc = _lm_eval(source, step, names, limit, include_path)
    else:
        from prime_train.engine.metrics import EngineConfigError
        from prime_train.engine.model_eval import evaluate_model

        cfg = _config(source, config, ctx.args)
        loaded = _load(source, step)
        try:
            doc = {"model": loaded.source, **evaluate_model(loaded, cfg, examples=examples, environment=environment)}
        except (EngineConfigError, ValueError) as exc:  # data or an environment the config names that does not load
            raise CliError(exc, BAD_INPUT) from None
    output.emit(doc, as_json, lambda console: _render(doc))


def _lm_eval(source: Path, step: int | None, names: list[str], limit: int | None, include_path: list[Path] | None):
    """The harness's tasks on the model at `source`: every task name is found in its index before the model loads
    (an unknown name costs seconds, not a model load first)."""
    from prime_train.engine.metrics import EngineConfigError
    from prime_train.engine.model_eval import lm_eval_task_manager, lm_eval_tasks

    try:
        manager = lm_eval_task_manager(names, [str(p.resolve()) for p in include_path or []])
        loaded = _load(source, step)
        return {"model": loaded.source, "lm_eval": lm_eval_tasks(loaded, names, limit=limit, manager=manager)}
    except EngineConfigError as exc:  # a task the harness does not know or cannot build
        raise CliError(exc, BAD_INPUT) from None


def _task_specs(tasks: str, include_path: list[Path] | None) -> list[str]:
    """--tasks as the harness takes it (a YAML file as its absolute path), checked before any model loads."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    if not names:
        raise CliError(
            "--tasks names no task: pass e.g. --tasks hellaswag,arc_easy or --tasks ./my_task.yaml", BAD_INPUT
        )
    if importlib.util.find_spec("lm_eval") is None:
        raise CliError(f"--tasks needs lm-evaluation-harness (the lm_eval module): {LM_EVAL_EXTRA}", BAD_INPUT)
    for directory in include_path or []:
        if not directory.is_dir():
            raise CliError(f"--include-path {directory}: not a directory of task YAML files", BAD_INPUT)
    specs = []
    for name in names:
        if name.endswith((".yaml", ".yml")):
            if not Path(name).is_file():
                raise CliError(f"--tasks {name}: no such task YAML file", BAD_INPUT)
            name = str(Path(name).resolve())
        specs.append(name)
    return specs


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
