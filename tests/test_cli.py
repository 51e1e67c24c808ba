"""The `prime-train` command line: what --help advertises exists, every command shows examples, and
`config show`, `config diff` and `--version` print what they promise with the documented exit codes."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import re
import subprocess
import sys
import textwrap
import tomllib
import typing
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import typer
from enginetools import REPO, WIDE, run_cli
from typer.models import ParameterInfo
from typer.testing import CliRunner

from prime_train import __version__
from prime_train.cli import app
from prime_train.config.loader import load_config, to_toml_dict
from prime_train.contract import ExitCode

FSDP = REPO / "configs" / "examples" / "fsdp-2proc-cpu.toml"
DDP = REPO / "configs" / "examples" / "ddp-2proc-cpu.toml"
CONFIG_ERROR = ExitCode.CONFIG  # DESIGN.md: a configuration error, never retried


def invoke(*args: str):
    """Run the CLI in-process (fast) on a wide terminal so help and tables do not wrap."""
    return CliRunner().invoke(app, list(args), env=WIDE)


def registered(group: typer.Typer, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Callable]]:
    """(command path, function) for every leaf command, groups expanded."""
    for info in group.registered_commands:
        yield (*path, info.name or info.callback.__name__.replace("_", "-")), info.callback
    for sub in group.registered_groups:
        yield from registered(sub.typer_instance, (*path, sub.name))


def listed_commands(help_text: str) -> list[str]:
    """Command names in the 'Commands:' section of a --help screen (click's plain help)."""
    section = help_text.split("\nCommands:\n", 1)[1]
    return re.findall(r"^  (\S+)(?:\s{2,}|$)", section, flags=re.MULTILINE)


def defines(module: str, name: str) -> bool:
    """Whether `module` has a top-level `name` (or a submodule of that name), read without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return False
    if spec.submodule_search_locations and importlib.util.find_spec(f"{module}.{name}"):
        return True
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return True
        if isinstance(node, ast.ImportFrom | ast.Import) and any((a.asname or a.name) == name for a in node.names):
            return True
    return False


LEAVES = list(registered(app))
GROUPS = [(sub.name, sub.typer_instance) for sub in app.registered_groups]


# ---------------------------------------------------------------- help


def test_help_lists_exactly_the_registered_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    top = [info.name or info.callback.__name__.replace("_", "-") for info in app.registered_commands]
    top += [sub.name for sub in app.registered_groups]
    assert sorted(listed_commands(result.stdout)) == sorted(top)


@pytest.mark.parametrize(("name", "group"), GROUPS, ids=[name for name, _ in GROUPS])
def test_group_help_lists_exactly_its_subcommands(name, group):
    result = invoke(name, "--help")
    assert result.exit_code == 0
    assert sorted(listed_commands(result.stdout)) == sorted(" ".join(path) for path, _ in registered(group))


@pytest.mark.parametrize(("path", "function"), LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_every_listed_command_has_its_implementation(path, function):
    # commands import their implementation lazily (to keep --help fast), so --help alone would still
    # work for a command whose module was never written: check each lazy import names real code
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    imports = [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("prime_train")
        for alias in node.names
    ]
    missing = [f"{module}.{name}" for module, name in imports if not defines(module, name)]
    assert not missing, f"`prime-train {' '.join(path)}` is listed but calls code that does not exist: {missing}"


@pytest.mark.parametrize(("path", "function"), LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_every_command_help_has_an_examples_section(path, function):
    result = invoke(*path, "--help")
    assert result.exit_code == 0, result.output
    assert "Examples" in result.stdout
    after = result.stdout.split("Examples", 1)[1]
    assert f"prime-train {' '.join(path)}" in after, "the examples should show the command itself"


@pytest.mark.parametrize(("path", "function"), LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_every_example_in_help_is_shown_whole_on_a_narrow_terminal(path, function):
    # click rewraps paragraphs: `--prices my-prices.toml` came out as `my-` and `prices.toml` on two lines
    examples = [
        line.strip() for line in (inspect.getdoc(function) or "").splitlines() if line.startswith("  prime-train")
    ]
    shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "60"}).stdout
    for example in examples:
        assert example in shown, (example, shown)


# Rich reads "[word]" as markup and drops it; help texts are literal, so every such bracket must survive.
RICH_TAG = re.compile(r"\[[a-z#/@][^\[\]]*\]")


def raw_help(function: Callable) -> str:
    """The help a command's source gives: its docstring and the help of each of its parameters."""
    texts = [inspect.getdoc(function) or ""]
    for hint in typing.get_type_hints(function, include_extras=True).values():
        texts += [m.help for m in getattr(hint, "__metadata__", ()) if isinstance(m, ParameterInfo) and m.help]
    return "\n".join(texts)


def help_screens() -> Iterator[tuple[tuple[str, ...], str]]:
    """(command path, the help text its --help screen shows) for the root, every group and every command."""

    def walk(group: typer.Typer, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], str]]:
        summaries = [group.info.help or ""]
        for info in group.registered_commands:
            yield (*path, info.name or info.callback.__name__.replace("_", "-")), raw_help(info.callback)
            summaries.append((inspect.getdoc(info.callback) or "").split("\n\n")[0])
        for sub in group.registered_groups:
            yield from walk(sub.typer_instance, (*path, sub.name))
            summaries.append(sub.typer_instance.info.help or "")
        yield path, "\n".join(summaries)

    yield from walk(app, ())


SCREENS = list(help_screens())


@pytest.mark.parametrize(("path", "text"), SCREENS, ids=[" ".join(p) or "prime-train" for p, _ in SCREENS])
def test_help_shows_bracketed_words_as_written(path, text):
    result = invoke(*path, "--help")
    assert result.exit_code == 0, result.output
    for literal in RICH_TAG.findall(text):
        assert literal in result.stdout, f"`prime-train {' '.join(path)} --help` lost {literal}"


def test_the_help_check_sees_the_brackets_rich_would_eat():
    found = {literal for _, text in SCREENS for literal in RICH_TAG.findall(text)}
    assert {"[spot]", "[aws,gcp]"} <= found


# what other commands need: the engine, the supervisor, tracking, object storage, tables
LAZY = (
    "torch",
    "transformers",
    "wandb",
    "mlflow",
    "clearml",
    "neptune",
    "boto3",
    "rich.table",
    "prime_train.engine",
    "prime_train.resilience.supervisor",
)


def test_lint_leaves_every_other_commands_imports_for_later():
    # bench/cli_startup.py times this; here the rule is pinned: lint loads what lint needs and nothing else
    probe = (
        "import sys\n"
        "sys.argv = ['prime-train', 'lint', 'configs/examples/fsdp-2proc-cpu.toml']\n"
        "from prime_train.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print('LOADED=' + ','.join(m for m in sys.modules if m.startswith({LAZY!r})))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    [loaded] = [line for line in result.stdout.splitlines() if line.startswith("LOADED=")]
    assert loaded == "LOADED=", result.stderr


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["run", "--no-such-flag"], ["--no-such-flag"]])
def test_help_and_a_usage_error_never_import_rich_help(argv):
    # typer's rich help (rich_utils, rich's markdown) was 0.3 s of --help's 0.5 s; bench/cli_startup.py times it
    probe = (
        "import sys\n"
        f"sys.argv = ['prime-train', *{argv!r}]\n"
        "from prime_train.cli import main\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        "print('LOADED=' + ','.join(m for m in ('typer.rich_utils', 'rich.markdown', 'prime_train.config.schema')"
        " if m in sys.modules), 'CODE=%s' % code)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    [loaded] = [line for line in result.stdout.splitlines() if line.startswith("LOADED=")]
    assert loaded == f"LOADED= CODE={0 if '--help' in argv else 78}", result.stderr
    if "--help" in argv:
        assert ("<bool>" not in result.stdout and "--json" in result.stdout) or argv == ["--help"], result.stdout
    else:
        assert "no such option: --no-such-flag" in result.stderr.lower(), result.stderr


@pytest.mark.parametrize("name", ["tiny-sft.toml", "tiny-rl.toml"])
def test_the_configs_copy_of_a_default_is_a_file_equal_to_the_packaged_one(name):
    # a link into the package would make an edit of the "copy" change what `prime-train run` runs by default
    copy, packaged = REPO / "configs" / name, REPO / "prime_train" / "configs" / name
    assert not copy.is_symlink() and not packaged.is_symlink()
    assert copy.read_bytes() == packaged.read_bytes(), f"configs/{name} and prime_train/configs/{name} differ"


def test_version_prints_the_package_version():
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout == f"prime-train {__version__}\n"


# ---------------------------------------------------------------- config show


def test_config_show_prints_toml_that_parses_and_reloads_to_the_same_config(tmp_path):
    result = run_cli("config", "show", str(FSDP), "--train.lr", "1e-4", "--run.name", "shown")
    assert result.returncode == 0, result.stderr
    shown = tomllib.loads(result.stdout)
    assert shown["train"]["lr"] == 1e-4
    assert shown["distributed"]["strategy"] == "fsdp"
    copy = tmp_path / "shown.toml"
    copy.write_text(result.stdout)
    assert load_config([copy]) == load_config([FSDP], ["--train.lr", "1e-4", "--run.name", "shown"])


def test_config_show_without_files_prints_what_run_runs_without_files_and_every_key():
    from prime_train.cli.common import default_config

    result = invoke("config", "show")
    assert result.exit_code == 0, result.output
    assert tomllib.loads(result.stdout) == to_toml_dict(load_config([default_config()]))
    # the keys TOML cannot hold unset are there as comments, each in its own table
    model = result.stdout.split("[model]\n", 1)[1].split("\n[", 1)[0]
    for key in ("path", "tokenizer"):
        assert f"# {key} =   (unset)" in model, model
    dataset = result.stdout.split("[[data.datasets]]\n", 1)[1].split("\n[", 1)[0]
    assert "# path =   (unset)" in dataset and "# hub =   (unset)" in dataset, dataset


def test_config_show_of_a_broken_config_exits_with_the_config_error_code(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nlerning_rate = 3e-4\n")
    result = run_cli("config", "show", str(bad), cwd=tmp_path)
    assert result.returncode == CONFIG_ERROR
    assert f"{bad}:2:1: error: unknown key `lerning_rate` in [train]; did you mean `lr`?" in result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr


# ---------------------------------------------------------------- config diff


@pytest.fixture
def two_configs(tmp_path) -> tuple[Path, Path]:
    a = tmp_path / "a.toml"
    a.write_text('[train]\nlr = 1e-3\n[[data.datasets]]\ntask = "sorting"\n[[data.datasets]]\ntask = "arithmetic"\n')
    b = tmp_path / "b.toml"
    b.write_text('[train]\nlr = 2e-3\n[model]\npath = "Qwen/Qwen2.5-0.5B"\n[[data.datasets]]\ntask = "sorting"\n')
    return a, b


def test_config_diff_of_a_config_with_itself_exits_zero():
    result = invoke("config", "diff", str(DDP), str(DDP))
    assert result.exit_code == 0
    assert "same" in result.stdout


def test_config_diff_table_shows_changed_added_and_removed_rows_and_exits_one(two_configs):
    a, b = two_configs
    result = invoke("config", "diff", str(a), str(b))
    assert result.exit_code == 1
    rows = {line.split("│")[1].strip(): line for line in result.stdout.splitlines() if line.count("│") >= 4}
    assert "changed" in rows["train.lr"]
    assert "0.001" in rows["train.lr"]
    assert "0.002" in rows["train.lr"]
    assert "added" in rows["model.path"]
    assert "'Qwen/Qwen2.5-0.5B'" in rows["model.path"]
    assert "removed" in rows["data.datasets[1].task"]
    assert "'arithmetic'" in rows["data.datasets[1].task"]


def test_config_diff_as_json_lists_each_change(two_configs):
    a, b = two_configs
    result = invoke("config", "diff", "--json", str(a), str(b))
    assert result.exit_code == 1
    changes = {c["key"]: c for c in json.loads(result.stdout)}
    assert (changes["train.lr"]["kind"], changes["train.lr"]["old"], changes["train.lr"]["new"]) == (
        "changed",
        1e-3,
        2e-3,
    )
    assert changes["model.path"]["kind"] == "added"
    assert changes["data.datasets[1].task"]["kind"] == "removed"
    same = invoke("config", "diff", "--json", str(a), str(a))
    assert (same.exit_code, json.loads(same.stdout)) == (0, [])


def test_config_diff_of_a_broken_config_exits_with_the_config_error_code(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[train]\nscheduler = "cosin"\n')
    result = run_cli("config", "diff", str(DDP), str(bad), cwd=tmp_path)
    assert result.returncode == CONFIG_ERROR
    assert "did you mean 'cosine'?" in result.stderr
    assert "Traceback" not in result.stderr


def test_lint_and_config_diff_take_json_and_still_the_old_format_flag(two_configs):
    a, b = two_configs
    for new, old in (
        (["lint", "--json", str(a), str(b)], ["lint", "--format", "json", str(a), str(b)]),
        (["lint", str(a)], ["lint", "--format", "text", str(a)]),
        (["config", "diff", "--json", str(a), str(b)], ["config", "diff", "--format", "json", str(a), str(b)]),
        (["config", "diff", str(a), str(b)], ["config", "diff", "--format", "table", str(a), str(b)]),
    ):
        with_new, with_old = invoke(*new), invoke(*old)
        assert (with_old.exit_code, with_old.stdout) == (with_new.exit_code, with_new.stdout)
    assert json.loads(invoke("lint", "--json", str(a)).stdout) == []
    assert "--format" not in invoke("lint", "--help").stdout, "the old spelling works but is not advertised"


# ---------------------------------------------------------------- usage mistakes


@pytest.mark.parametrize(
    "args",
    [["lint"], ["lint", "--format", "yaml", str(DDP)], ["config", "diff", str(DDP)], ["no-such-command"]],
    ids=["lint-without-files", "lint-unknown-format", "diff-one-file", "unknown-command"],
)
def test_usage_mistakes_exit_with_the_bad_input_code_and_a_message_not_a_traceback(args):
    result = invoke(*args)
    assert result.exit_code == ExitCode.CONFIG
    assert "Traceback" not in result.output
    assert "Error" in result.output or "error" in result.output


def test_url_values_in_overrides_keep_their_double_slash(tmp_path):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "prime_train", "config", "show", "--ckpt.remote", "s3://bucket/runs/x",
         "--ckpt.remote_endpoint_url", "http://127.0.0.1:9000"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert 'remote = "s3://bucket/runs/x"' in result.stdout
    assert 'remote_endpoint_url = "http://127.0.0.1:9000"' in result.stdout


def test_config_diff_piped_at_80_columns_shows_whole_keys_and_whole_headers():
    result = CliRunner().invoke(
        app, ["config", "diff", str(REPO / "configs" / "tiny-sft.toml"), str(DDP)], env={"COLUMNS": "80"}
    )
    assert result.exit_code == ExitCode.FAILED, result.output
    assert "│ data.datasets[0].task" in result.stdout and "…" not in result.stdout, result.stdout
    table = [line for line in result.stdout.splitlines() if line[:1] in "┏┃┡│└"]
    assert max(len(line) for line in table) <= 80


def test_the_readme_rl_demo_trains_its_own_60_step_sft_model_first():
    # after the 300-step quickstart, `run configs/tiny-rl.toml` started at reward 1.0 and showed nothing
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    block = readme.split("Then RL:", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0].strip()
    sft, rl = (part.split() for part in block.split(" && "))
    assert sft[:2] == ["prime-train", "run"] and "configs/" not in " ".join(sft)  # the default SFT job
    name, steps = sft[sft.index("--run.name") + 1], int(sft[sft.index("--train.max_steps") + 1])
    assert steps == 60 and name != "tiny-sft"  # not the quickstart's finished run, which would not train again
    assert rl[:3] == ["prime-train", "run", "configs/tiny-rl.toml"]
    assert rl[rl.index("--model.path") + 1] == f"runs/{name}/final"


def test_the_readme_states_the_own_data_formats_and_points_at_the_jsonl_example():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    own = readme.split("Your own data:", 1)[1].split("\n## ", 1)[0]
    assert "configs/examples/sft-jsonl.toml" in own and "configs/examples/data/spell-numbers.jsonl" in own
    assert (REPO / "configs/examples/data/spell-numbers.jsonl").is_file()
    for fmt in ("prompt_completion", "chat", "text", "preference"):
        assert f"| `{fmt}` |" in own, fmt
