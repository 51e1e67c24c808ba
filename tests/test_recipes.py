"""The shipped recipes (`prime-train init --list | --recipe`): each lints without an error and fits its stated GPUs
by the memory calculator, read with the published shape of its model (tests/data/model_configs: nothing is
downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prime_train.validator.recipes import RECIPES, RECIPES_DIR

REPO = Path(__file__).resolve().parents[1]
SHAPES = REPO / "tests" / "data" / "model_configs"
# each recipe's model: the directory of its config.json (an Instruct model has its base model's shape)
SHAPE_OF = {
    "Qwen/Qwen2.5-0.5B-Instruct": "Qwen2.5-0.5B-Instruct",
    "Qwen/Qwen2.5-1.5B-Instruct": "Qwen2.5-1.5B-Instruct",
    "meta-llama/Llama-3.1-8B-Instruct": "Llama-3.1-8B",
}


def invoke(*args: str, cwd: Path | None = None):
    from prime_train.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"})


def test_every_recipe_file_is_listed_and_every_listed_recipe_is_shipped():
    assert sorted(p.stem for p in RECIPES_DIR.glob("*.toml")) == sorted(r.name for r in RECIPES)
    assert {r.model for r in RECIPES} >= {"Qwen/Qwen2.5-0.5B-Instruct", "meta-llama/Llama-3.1-8B-Instruct"}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_recipe_lints_clean_and_fits_its_stated_gpus(recipe, monkeypatch, tmp_path):
    from prime_train.validator.lint import lint_files
    from prime_train.validator.memory import estimate, inputs_from_config

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # run.output_dir = "runs" is checked where the run would start
    problems, cfg = lint_files([str(recipe.path)], [])
    assert [p.message for p in problems if p.severity == "error"] == [] and cfg is not None
    # the GPUs the config uses are the GPUs the recipe states
    inference_gpus = cfg.inference.num_workers * cfg.inference.gpus_per_worker if cfg.run.job == "rl" else 0
    assert cfg.distributed.nproc_per_node * cfg.distributed.nnodes + inference_gpus == recipe.num_gpus
    shape = SHAPES / SHAPE_OF[recipe.model] / "config.json"
    report = estimate(inputs_from_config(cfg, model=str(shape), gpus=[recipe.gpu]))
    (verdict,) = report.gpus
    assert verdict.gpu == recipe.gpu and verdict.trainer_fits and not verdict.tight, verdict
    if cfg.run.job == "rl":  # the rollout server on its own GPU
        assert verdict.inference_verdict == "fits"


def test_init_lists_the_recipes_and_copies_one(tmp_path):
    listed = invoke("init", "--list", "--json")
    assert listed.exit_code == 0, listed.output
    assert [r["name"] for r in json.loads(listed.stdout)["recipes"]] == [r.name for r in RECIPES]
    out = tmp_path / "mine.toml"
    copied = invoke("init", "--recipe", RECIPES[1].name, "-o", str(out))
    assert copied.exit_code == 0, copied.output
    assert out.read_bytes() == RECIPES[1].path.read_bytes() and not out.is_symlink()
    assert invoke("init", "--recipe", RECIPES[1].name, "-o", str(out)).exit_code == 78  # exists: --force
    wrong = invoke("init", "--recipe", "llama3.1-8b-lora", "-o", str(tmp_path / "x.toml"))
    assert wrong.exit_code == 78 and "did you mean llama3.1-8b-lora-1gpu" in wrong.output
