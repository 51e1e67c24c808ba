"""`prime-train init`: ask what the run is, show the config the wizard writes (validator/wizard.py), save it.

Every question is also a flag; without a terminal (CI, scripts) nothing is asked and the unanswered
questions take their defaults.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional, TypeVar

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag
from prime_train.cli.errors import BAD_INPUT, CliError
from prime_train.contract import ExitCode

if TYPE_CHECKING:
    from prime_train.config.loader import Problem
    from prime_train.validator.wizard import Answers

T = TypeVar("T")


def init(
    output_path: Annotated[Path, typer.Option("--output", "-o", help="Where to write the config.")] = Path(
        "prime-train.toml"
    ),
    job: Annotated[
        Optional[str], typer.Option(help="sft, pretrain, rl (GRPO), ppo (rl with PPO), dpo or reward (a reward model).")
    ] = None,
    model: Annotated[Optional[str], typer.Option(help="'tiny' (random-initialised, CPU), an HF id or a path.")] = None,
    hardware: Annotated[
        Optional[str], typer.Option(help="'cpu' or '<GPU>:<count>', e.g. H100:8 (whole GPUs: one process each).")
    ] = None,
    nodes: Annotated[Optional[int], typer.Option(min=1, help="Nodes.")] = None,
    name: Annotated[Optional[str], typer.Option(help="Run name.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(min=8, help="Tokens per sequence.")] = None,
    max_steps: Annotated[Optional[int], typer.Option(min=1, help="Optimizer steps.")] = None,
    environment: Annotated[Optional[str], typer.Option(help="RL environment.")] = None,
    dataset: Annotated[
        Optional[str], typer.Option(help="SFT/pretrain data or dpo/reward preference pairs: file, directory or glob.")
    ] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Save without asking.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing file.")] = False,
    list_recipes: Annotated[
        bool, typer.Option("--list", help="List the shipped recipes (real models on stated GPUs) and exit.")
    ] = False,
    recipe: Annotated[
        Optional[str], typer.Option("--recipe", help="Copy the shipped recipe NAME (see --list).")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Write a lint-clean run config by answering a few questions (job, model, hardware), or copy a shipped recipe.

    Every question is also a flag; without a terminal nothing is asked and defaults fill the rest. --list shows the
    recipes (each lint-clean and inside the memory check for its GPUs); --recipe NAME copies one to --output.

    Examples:

      prime-train init

      prime-train init --job rl --model Qwen/Qwen2.5-1.5B-Instruct --hardware H100:8 -o rl.toml --yes

      prime-train init --job dpo --dataset data/pairs.jsonl -o dpo.toml

      prime-train init --list

      prime-train init --recipe llama3.1-8b-lora-1gpu -o llama-lora.toml
    """
    if list_recipes or recipe is not None:
        _recipe(list_recipes, recipe, output_path, force=force, as_json=as_json)
        return
    from prime_train.validator.wizard import build_config

    interactive = sys.stdin.isatty() and not yes and not as_json  # a script reading JSON answers nothing
    _check_writable(output_path)  # before any question: an answer given for a file that cannot be saved is wasted
    a = _answers(interactive, job, model, hardware, nodes, environment)
    a.name, a.seq_len, a.max_steps, a.dataset = name, seq_len, max_steps, dataset
    try:
        text = build_config(a)
    except ValueError as exc:  # an answer that names nothing usable: the message says which and why
        raise CliError(exc, BAD_INPUT) from None
    problems = _lint_generated(text, output_path)

    if not as_json:  # with --json the config is in the document
        _show(text)
    for note in a.notes:
        output.note(note)
    if problems:
        output.problems(problems)
        if any(p.severity == "error" for p in problems):
            raise CliError("not saved: the generated config does not lint (a bug: please report it)")
    if output_path.exists() and not force:
        raise CliError(f"{output_path} exists; pass --force to overwrite it", BAD_INPUT)
    if interactive and not typer.confirm(f"Save to {output_path}?", default=True):
        raise typer.Exit(ExitCode.FAILED)
    try:
        output_path.write_text(text)
    except OSError as exc:
        raise _cannot_write(output_path, exc) from None
    output.done(
        as_json, {"saved": str(output_path), "config": text, "notes": list(a.notes)},
        f"{output_path}; next: prime-train preflight {output_path}", label="saved",
    )  # fmt: skip


def _recipe(list_recipes: bool, name: str | None, output_path: Path, *, force: bool, as_json: bool) -> None:
    """`init --list` (the recipes) or `init --recipe NAME` (copy one to `output_path`)."""
    from prime_train.contract import replace_file_atomic
    from prime_train.validator.recipes import RECIPES, find_recipe

    if list_recipes:
        rows = [r.to_dict() for r in RECIPES]
        if as_json:
            output.print_json({"recipes": rows})
            return
        for r in RECIPES:
            output.say(f"{r.name:<24} {r.hardware:<13} {r.model}: {r.summary}")
        output.say("copy one: prime-train init --recipe NAME -o my-run.toml", stderr=True)
        return
    try:
        chosen = find_recipe(str(name))
    except ValueError as exc:
        raise CliError(exc, BAD_INPUT) from None
    if os.path.lexists(output_path) and not force:
        raise CliError(f"{output_path} exists; pass --force to overwrite it", BAD_INPUT)
    _check_writable(output_path)
    try:
        replace_file_atomic(output_path, chosen.path.read_bytes(), mode=0o644)  # a link at the path is replaced
    except OSError as exc:
        raise _cannot_write(output_path, exc) from None
    output.done(
        as_json, {"saved": str(output_path), "recipe": chosen.to_dict()},
        f"{output_path} ({chosen.name}: {chosen.model} on {chosen.hardware}); next: prime-train preflight "
        f"{output_path}", label="saved",
    )  # fmt: skip


def _answers(
    interactive: bool,
    job: str | None,
    model: str | None,
    hardware: str | None,
    nodes: int | None,
    environment: str | None,
) -> Answers:
    """The wizard's answers: each flag as given, else the user's answer on a terminal, else the default."""
    from prime_train.validator.wizard import JOBS, RL_JOBS, Answers

    a = Answers()

    def ask(value: T | None, prompt: str, default: T) -> T:
        if value is not None:
            return value
        if not interactive:
            return default
        return typer.prompt(prompt, default=default, type=type(default))

    a.job = ask(job, f"Job ({', '.join(JOBS)})", a.job)
    a.model = ask(model, "Model ('tiny', an HF id or a local path)", a.model)
    a.hardware = ask(hardware, "Hardware ('cpu' or GPU:count, e.g. H100:8)", a.hardware)
    a.nodes = ask(nodes, "Nodes", a.nodes)
    if a.job in RL_JOBS:
        a.environment = ask(environment, "RL environment", a.environment)
    return a


def _lint_generated(text: str, output_path: Path) -> list[Problem]:
    """Lint's problems of the generated config, said of `output_path`; one about a directory this machine cannot
    write is a warning."""
    import tempfile

    from prime_train.validator.wizard import check_text

    with tempfile.TemporaryDirectory() as tmp:
        problems = check_text(text, Path(tmp) / output_path.name)
    for p in problems:
        p.file = str(output_path)
    # lint also checks this machine: a run.output_dir (or ckpt.dir) it cannot write from here is about where
    # `prime-train run` is started, not a mistake in the generated config. Said as a warning; the config is saved.
    for p in problems:
        if p.severity == "error" and p.key in _PACKAGE_KEYS and "not installed" in p.message:
            p.severity = "warning"
            p.message += " (on this machine: install it where the run starts)"
        if p.severity == "error" and p.key in _MACHINE_KEYS and "cannot be written" in p.message:
            p.severity = "warning"
            p.message = (
                f"{p.message.removesuffix('; choose another')} from this directory: start `prime-train run` where it "
                "can be written, or choose another"
            )
    return problems


# lint's problems about this machine rather than the config (a directory it cannot write from here)
_MACHINE_KEYS = ("run.output_dir", "ckpt.dir")
# ... and the packages a [lora] the wizard wrote needs (peft, bitsandbytes), missing here but not where it trains
_PACKAGE_KEYS = ("lora.rank", "lora.quantize")


def _cannot_write(path: Path, exc: OSError) -> CliError:
    """What init says when `path` cannot be written: that it cannot, where, and what to do (on the line before), then
    the error every command gives for a path the user named, `error: <path>: <the OS's reason>` (78)."""
    import os

    try:
        where = os.path.abspath(path.parent)
    except OSError:  # the working directory itself is gone
        where = str(path.parent)
    output.warning(f"cannot write the config to {path} in {where}: run init where you can write, or pass -o PATH")
    return CliError(f"{path}: {exc.strerror or exc}", BAD_INPUT)


def _check_writable(path: Path) -> None:
    """CliError (78) when `path` cannot be written: a file made (then removed) beside it, the file itself left as it
    is. A user's mistake to fix (the directory, -o), never "the generated config does not lint"."""
    import os
    import tempfile

    if path.is_dir():
        raise CliError(f"cannot write {path}: it is a directory; pass -o with a file name", BAD_INPUT)
    try:
        fd, probe = tempfile.mkstemp(prefix=".prime-train-init-", dir=path.parent)
    except OSError as exc:
        raise _cannot_write(path, exc) from None
    os.close(fd)
    os.unlink(probe)
    if path.exists() and not os.access(path, os.W_OK):
        raise _cannot_write(path, PermissionError(13, "Permission denied"))


def _show(text: str) -> None:
    """The config about to be saved: highlighted TOML on a terminal, the text itself otherwise (tests, pipes)."""
    console = output.console()
    if console.is_terminal:
        from rich.syntax import Syntax

        console.print(Syntax(text, "toml", line_numbers=False, word_wrap=True))
    else:
        output.document(text)
