"""`prime-train eval`: the training job's evaluations, run on a finished model in this one process.

Each is the function the job runs at every eval (engine/evaluate.py), on the data the config names: held-out
loss and perplexity over data.datasets' held-out split, greedy exact match on the built-in tasks' held-out
examples, the multiple-choice eval of train.mc_eval_path, and an RL environment's reward and pass rate on its
eval prompts. lm-evaluation-harness's tasks run through its own HFLM wrapper around the same model.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

from prime_train.config.schema import Config
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.parallel import DistInfo
from prime_train.engine.sample import LoadedModel


def _one_process(model) -> DistInfo:
    return DistInfo(
        rank=0, local_rank=0, world_size=1, local_world_size=1, device=next(model.parameters()).device, backend="none"
    )


def evaluate_model(
    loaded: LoadedModel, cfg: Config, *, examples: int = 64, environment: str | None = None
) -> dict[str, Any]:
    """The config's evaluations of `loaded`: metrics (eval_* as the job logs them) and a few greedy samples."""
    from prime_train.engine.data import build_eval_batches, held_out_examples
    from prime_train.engine.evaluate import eval_loss, exact_match, multiple_choice
    from prime_train.tasks import get_task

    model, tok = loaded.model, loaded.tokenizer
    dist, autocast = _one_process(model), contextlib.nullcontext
    metrics: dict[str, float] = {}
    samples: list[dict[str, str]] = []
    job = cfg.run.job if cfg.run.job in ("sft", "pretrain") else "sft"
    batches = build_eval_batches(
        cfg.data, tok, job=job, micro_batch_size=cfg.train.micro_batch_size, rank=0, world_size=1,
        seed=cfg.run.seed, max_batches=cfg.train.eval_batches,
    )  # fmt: skip
    if batches:
        metrics.update(eval_loss(model, batches, dist, autocast))
    held_out = held_out_examples(cfg.data, cfg.run.seed, examples)
    if held_out:
        task = get_task(next(d.task for d in cfg.data.datasets if d.task))
        acc, found = exact_match(model, tok, held_out, task.score, dist, autocast)
        metrics["eval_exact_match"] = acc
        metrics["eval_examples"] = len(held_out)
        samples = [{"prompt": p, "expected": a, "output": o} for p, a, o in found]
    if cfg.train.mc_eval_path:
        metrics["eval_mc_accuracy"] = multiple_choice(model, tok, cfg.train.mc_eval_path, dist, autocast)
    env_name = (
        environment or cfg.train.eval_environment or (cfg.rl.environment if cfg.run.job in ("rl", "ppo") else None)
    )
    if env_name:
        metrics.update(environment_eval(loaded, cfg, env_name, dist))
    return {"metrics": metrics, "samples": samples}


def environment_eval(loaded: LoadedModel, cfg: Config, name: str, dist: DistInfo) -> dict[str, float]:
    """Greedy answers to environment `name`'s eval prompts, scored by its reward: mean reward and pass rate."""
    from prime_train.engine.evaluate import greedy_complete
    from prime_train.environments import load_environment

    try:
        env = load_environment(name, cfg.rl.env_args if name == cfg.rl.environment else {})
    except (ValueError, ImportError) as exc:
        raise EngineConfigError(f"environment {name!r}: {exc}") from None
    prompts = env.prompts("eval", cfg.rl.eval_prompts or 64, cfg.run.seed)
    if not prompts:
        return {}
    outputs = greedy_complete(
        loaded.model, loaded.tokenizer, [p.text for p in prompts], dist, contextlib.nullcontext,
        max_new_tokens=cfg.rl.max_tokens,
    )  # fmt: skip
    rewards = [env.reward(p, o) for p, o in zip(prompts, outputs, strict=True)]
    return {
        "eval_env_reward": sum(rewards) / len(rewards),
        "eval_env_pass_rate": sum(r >= 1.0 for r in rewards) / len(rewards),
        "eval_env_prompts": len(rewards),
    }


def lm_eval_tasks(
    loaded: LoadedModel,
    tasks: list[str],
    *,
    limit: int | None,
    manager: Any,
    batch_size: int = 8,
) -> dict[str, Any]:
    """lm-evaluation-harness's `tasks` on the loaded model (its HFLM wrapper): each task's metrics as it reports
    them, the filter suffix `,none` left off. A task is a name from the harness's registry or the include paths of
    `manager` (lm_eval_task_manager), or a task YAML file (which may read a local dataset: `dataset_path: json`
    with `dataset_kwargs.data_files`). The harness reads hub datasets through the Hugging Face cache
    (HF_HUB_OFFLINE is respected)."""
    import yaml  # lm-eval's own dependency: a task file that does not parse raises its error
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=loaded.model, tokenizer=loaded.tokenizer, batch_size=batch_size)
    try:
        result = simple_evaluate(model=lm, tasks=tasks, limit=limit, task_manager=manager)
    except (KeyError, ValueError, FileNotFoundError, yaml.YAMLError) as exc:  # a task that does not build, no data
        raise EngineConfigError(f"lm-eval could not run --tasks {','.join(tasks)}: {exc}") from None
    out: dict[str, Any] = {}
    for task, values in (result or {}).get("results", {}).items():
        out[task] = {
            k.removesuffix(",none"): v
            for k, v in values.items()
            if isinstance(v, int | float) and not (isinstance(v, float) and math.isnan(v))
        }
    return out


def lm_eval_task_manager(tasks: list[str], include_paths: list[str]):
    """The harness's TaskManager for `tasks`: the include paths alone when they and the YAML files name every task
    (indexing the harness's thousands of built-in task files takes seconds), else the built-in tasks too;
    EngineConfigError naming a task found in neither. Needs no model: callers check the names before loading one."""
    from lm_eval.tasks import TaskManager

    names = [t for t in tasks if not t.endswith((".yaml", ".yml"))]
    manager = TaskManager(include_path=include_paths or None, include_defaults=False)
    if any(not manager.match_tasks([n]) for n in names):
        manager = TaskManager(include_path=include_paths or None)
    unknown = [n for n in names if not manager.match_tasks([n])]
    if unknown:
        where = f" nor in --include-path {', '.join(include_paths)}" if include_paths else ""
        raise EngineConfigError(
            f"--tasks {', '.join(unknown)}: no such task in lm-eval's registry{where} (`lm-eval ls tasks` lists them; "
            "a local task is a YAML file: --tasks ./my_task.yaml)"
        )
    return manager
