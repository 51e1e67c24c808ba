"""The CLI's one error handler and one print path: a user's mistake is `error: <message>` and an exit code, a bug is
one line and a saved traceback, and brackets in paths and messages are printed as written (never eaten as markup)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prime_train.cli import app, common
from prime_train.cli.errors import USER_ERRORS, CliError, user_error_code
from prime_train.contract import ExitCode

REPO = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env=WIDE)


# ---------------------------------------------------------------- brackets survive


def test_the_engine_hint_keeps_its_extra_in_brackets(monkeypatch):
    monkeypatch.setattr(common, "ENGINE_MODULES", ("torch", "no_such_module_for_this_test"))
    result = invoke("train", "--train.max_steps", "1")
    assert result.exit_code == ExitCode.CONFIG
    assert "error: the embedded engine needs no_such_module_for_this_test: pip install 'prime-train[engine]'" in (
        result.stderr
    )


def test_a_config_path_with_brackets_is_printed_as_written(tmp_path):
    bad = tmp_path / "run[x].toml"
    bad.write_text("[train]\nlerning_rate = 3e-4\n")
    result = invoke("config", "show", str(bad))
    assert result.exit_code == ExitCode.CONFIG
    assert f"{bad}:2:1: error: unknown key `lerning_rate` in [train]; did you mean `lr`?" in result.stderr


def test_init_names_an_existing_file_with_brackets_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run[x].toml").write_text("keep me\n")
    result = invoke("init", "-o", "run[x].toml")
    assert result.exit_code == ExitCode.CONFIG
    assert "error: run[x].toml exists; pass --force to overwrite it" in result.stderr
    assert (tmp_path / "run[x].toml").read_text() == "keep me\n"


def test_profile_of_an_external_job_names_the_job_table(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text('[job]\ncommand = ["python", "train.py"]\n')
    result = invoke("profile", str(cfg))
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "error: profile runs the embedded engine; [job].command is set" in result.stderr


def test_status_shows_a_failure_message_with_brackets_as_written(tmp_path):
    from prime_train.contract import write_json_atomic
    from prime_train.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.create()
    failure = {"kind": "config_error", "message": "[job].command: no such file [rank0]"}
    write_json_atomic(run.supervisor_path, {"state": "failed", "attempt": 1, "last_failure": failure})
    result = invoke("status", str(run.root))
    assert result.exit_code == 0, result.output
    assert "config_error: [job].command: no such file [rank0]" in result.stdout


# ---------------------------------------------------------------- the error handler


def test_a_file_the_user_names_that_cannot_be_written_is_an_error_not_a_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("init", "-o", "no-such-dir/run.toml", "--yes")
    assert result.exit_code == ExitCode.CONFIG  # bad input: a path the user named
    assert result.stderr.strip().splitlines()[-1] == "error: no-such-dir/run.toml: No such file or directory"
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_a_bug_is_one_line_naming_the_saved_traceback(tmp_path, monkeypatch):
    import tempfile

    import prime_train.validator.lint as lint

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(lint, "lint_files", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = invoke("lint", str(REPO / "configs" / "tiny-sft.toml"))
    assert result.exit_code == ExitCode.FAILED
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: unexpected KeyError: 'boom'; this is a bug in prime-train")
    [saved] = tmp_path.glob("prime-train-error-*.txt")
    assert str(saved) in line
    assert "Traceback" in saved.read_text() and "KeyError: 'boom'" in saved.read_text()


def test_a_bug_in_a_real_process_prints_no_traceback(tmp_path):
    code = textwrap.dedent(
        """
        import sys
        import prime_train.validator.lint as lint
        def broken(*args, **kwargs):
            raise RuntimeError("boom")
        lint.lint_files = broken
        sys.argv = ["prime-train", "lint", "configs/tiny-sft.toml"]
        from prime_train.cli import main
        main()
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "TMPDIR": str(tmp_path)},
    )  # fmt: skip
    assert result.returncode == ExitCode.FAILED
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: unexpected RuntimeError: boom;")
    assert len(list(tmp_path.glob("prime-train-error-*.txt"))) == 1


def _user_errors() -> list[tuple[BaseException, int]]:
    from prime_train.integrations.monitor import MonitorConfigError
    from prime_train.integrations.skypilot import SkyPilotError, SkyPilotNotFound
    from prime_train.resilience.profile import ProfileFailed
    from prime_train.resilience.status import NoLogs, NotARunDir
    from prime_train.validator.cost import CostInputError
    from prime_train.validator.memory import MemoryInputError
    from prime_train.validator.models import ModelConfigNotFound

    return [
        (MemoryInputError("unknown GPU 'Z80'"), ExitCode.CONFIG),
        (CostInputError("mfu = 2: must be a fraction"), ExitCode.CONFIG),
        (ModelConfigNotFound("no config.json"), ExitCode.CONFIG),
        (SkyPilotNotFound("spot install first"), ExitCode.CONFIG),
        (SkyPilotError("launch failed"), ExitCode.FAILED),
        (MonitorConfigError("no bucket"), ExitCode.CONFIG),
        (NotARunDir("runs/x holds no run"), ExitCode.CONFIG),
        (NoLogs("no logs at runs/x/logs/latest"), ExitCode.CONFIG),
        (ProfileFailed("preflight failed", ExitCode.PREEMPTED), ExitCode.PREEMPTED),
        (CliError("bad answer", 2), 2),
        (FileNotFoundError(2, "No such file or directory", "x.toml"), ExitCode.CONFIG),
    ]


def test_each_error_our_modules_raise_for_user_input_has_its_exit_code():
    cases = _user_errors()
    for exc, code in cases:
        assert user_error_code(exc) == code, type(exc).__name__
    mapped = {type(exc).__name__ for exc, _ in cases}
    assert set(USER_ERRORS) <= mapped, "every class the handler knows by name exists and is tested here"


@pytest.mark.parametrize(
    "exc", [KeyError("x"), ValueError("x"), TypeError("x"), FileNotFoundError("no filename: ours, not theirs")]
)
def test_other_exceptions_are_bugs(exc):
    assert user_error_code(exc) is None


def test_the_cli_writes_no_exit_code_as_a_number():
    # 75 and 78 are ExitCode.PREEMPTED and ExitCode.CONFIG (prime_train/contract.py); a literal drifts
    found = []
    for path in sorted((REPO / "prime_train" / "cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and type(node.value) is int and node.value in (75, 78):
                found.append(f"{path.name}:{node.lineno}")
    assert not found, found


# ---------------------------------------------------------------- one convention for every command


def _leaves():
    """(command path, click command) of every leaf command, as `prime-train` builds them."""
    import typer.main

    def walk(command, path=()):
        subs = getattr(command, "commands", None)
        if subs:
            for name, sub in subs.items():
                yield from walk(sub, (*path, name))
        else:
            yield path, command

    return list(walk(typer.main.get_command(app)))


# commands whose stdout is a stream that is not theirs: the engine's own output, SkyPilot's log stream
STREAMING = {("train",), ("spot", "logs")}


def test_every_command_takes_json_and_lint_keeps_format_only_as_a_hidden_alias():
    missing = [" ".join(p) for p, c in _leaves() if p not in STREAMING and "--json" not in _opts(c)]
    assert not missing, f"without --json: {missing}"
    assert "--format" not in invoke("lint", "--help").stdout


def _opts(command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)}


def test_the_deprecated_format_flag_still_works_and_says_so_on_stderr():
    config = str(REPO / "configs" / "tiny-sft.toml")
    old, new = invoke("lint", "--format", "json", config), invoke("lint", "--json", config)
    assert (old.exit_code, old.stdout) == (new.exit_code, new.stdout) == (0, "[]\n")
    assert "--format json is deprecated" in old.stderr and "use --json" in old.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["status", "no-such-run", "--json"],
        ["verify-model", "./no-such-model", "--json"],
        ["memory", "no-such.toml", "--json"],
        ["config", "diff", "no-such.toml", "no-such.toml", "--json"],
        ["logs", "no-such-run", "--json"],
        ["lint", "--json"],
        ["status", "--json", "--no-such-flag"],
    ],
    ids=["status", "verify-model", "memory", "config-diff", "logs", "usage-missing-argument", "usage-unknown-flag"],
)
def test_an_error_with_json_is_one_json_document_on_stdout_and_the_bad_input_code(args):
    result = invoke(*args)
    assert result.exit_code == ExitCode.CONFIG, result.output
    document = json.loads(result.stdout)
    assert document["ok"] is False and document["exit_code"] == ExitCode.CONFIG and document["error"]


def test_a_misspelled_flag_on_run_gets_did_you_mean():
    result = invoke("run", "--skpi-preflight")
    assert result.exit_code == ExitCode.CONFIG
    assert "no such option: --skpi-preflight; did you mean --skip-preflight?" in result.stderr


def test_an_override_value_that_looks_like_a_flag_is_still_a_value(tmp_path):
    result = invoke("config", "show", "--train.lr", "-1e-3", "--run.name", "-x")
    assert result.exit_code == ExitCode.CONFIG  # a negative lr is refused by the schema, not taken for a flag
    assert "`train.lr`: input should be greater than 0" in result.stderr and "no such option" not in result.stderr


@pytest.mark.parametrize(
    ("args", "near"),
    [
        (["lint", "configs/tiny-sf.toml"], "did you mean configs/tiny-sft.toml"),
        (["config", "show", "confgs/tiny-sft.toml"], "did you mean configs/tiny-sft.toml"),
        (["diagnose", "tests/data/log"], "did you mean tests/data/logs"),
    ],
    ids=["a-file", "a-directory-on-the-way", "diagnose"],
)
def test_an_error_about_a_missing_file_suggests_the_names_near_it(args, near, monkeypatch):
    monkeypatch.chdir(REPO)
    result = invoke(*args)
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert near in (result.stdout if args[0] == "lint" else result.stderr), result.output  # lint's findings: stdout


def test_quiet_and_verbose_are_taken_after_the_command_too():
    config = str(REPO / "configs" / "tiny-sft.toml")
    assert invoke("lint", config).stdout == "ok: 1 file(s), no problems\n"
    for args in (["lint", config, "-q"], ["-q", "lint", config], ["lint", "--quiet", config]):
        result = invoke(*args)
        assert (result.exit_code, result.stdout) == (0, ""), (args, result.output)


def test_verbose_prints_a_bugs_traceback_as_well(tmp_path, monkeypatch):
    import tempfile

    import prime_train.validator.lint as lint

    def broken(*args, **kwargs):
        raise KeyError("boom")

    monkeypatch.setattr(lint, "lint_files", broken)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = invoke("lint", str(REPO / "configs" / "tiny-sft.toml"), "-v")
    assert result.exit_code == ExitCode.FAILED
    assert "Traceback (most recent call last)" in result.stderr and "KeyError: 'boom'" in result.stderr


def test_the_readme_exit_code_table_is_the_one_in_the_code():
    from prime_train.cli.errors import EXIT_CODES

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    for code, meaning in EXIT_CODES.items():
        assert f"| {code} | {meaning} |" in readme, code


def test_a_pipe_whose_reader_went_away_ends_quietly_not_as_a_bug(tmp_path, monkeypatch, capsys):
    """`prime-train memory --help | head -40`: head exits, click's echo of the help's next part raises BrokenPipeError
    inside the command (seen: "unexpected BrokenPipeError ... this is a bug in prime-train", with a traceback file
    whose last frame is click's `echo` in `show_help`). The reader's choice is not a bug: the command ends with 1
    and says nothing, as click ends one whose pipe breaks outside a command. (A real `| head` is a race: whether
    the write that fails comes inside the command or in the flush at exit depends on when head exits.)"""
    import tempfile

    import typer

    from prime_train.cli import errors

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(typer.Exit) as ended:
        errors.handle(BrokenPipeError(32, "Broken pipe"))
    assert ended.value.exit_code == ExitCode.FAILED
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    assert not list(tmp_path.glob("prime-train-error-*"))


# ---------------------------------------------------------------- brackets in every help screen and error


def test_every_help_screen_and_usage_error_keeps_bracketed_text():
    for path, _ in _leaves():
        # the help texts themselves: tests/test_cli.py::test_help_shows_bracketed_words_as_written
        bad = invoke(*path, "--no-such[engine]")
        assert "--no-such[engine]" in bad.output, (path, bad.output)


def test_error_messages_keep_brackets_in_paths_and_values(tmp_path):
    weird = tmp_path / "runs[x]"
    for args in (["status", str(weird)], ["logs", str(weird)], ["diagnose", str(weird)], ["lint", str(weird)]):
        result = invoke(*args)
        assert result.exit_code == ExitCode.CONFIG, args
        said = result.stdout if args[0] == "lint" else result.stderr  # lint's findings are its result: stdout
        assert str(weird) in said, (args, result.output)


def test_the_run_summary_keeps_a_run_name_with_brackets():
    from rich.console import Console

    from prime_train.config.schema import Config
    from prime_train.resilience.console import summary_table

    class Sup:  # the two things summary_table reads of a Supervisor, as data
        cfg = Config.model_validate({"run": {"name": "sft[v2]"}})
        state = "done"
        attempts: tuple = ()

        def mean_step_time(self):
            return None

    console = Console(width=80, record=True, color_system=None)
    console.print(summary_table(Sup()))
    assert "run sft[v2]: done" in console.export_text()


def test_a_model_path_with_brackets_is_shown_as_written_by_verify_model_and_memory(tmp_path):
    import shutil

    model = tmp_path / "[x]"
    shutil.copytree(REPO / "tests" / "data" / "model_configs" / "Qwen2.5-7B-Instruct", model)
    verified = invoke("verify-model", str(model), "--job", "sft")
    assert verified.exit_code == 0, verified.output
    assert "[x]: usable for sft" in verified.stdout and f"local directory {model}" in verified.stdout
    assert "yes (since 0.3.0)  [shipped table" in verified.stdout  # where the vLLM verdict comes from, in brackets
    memory = invoke("memory", "--model", str(model))
    assert memory.exit_code == 0, memory.output
    assert f"{model}/config.json: 7.616B params" in memory.stdout
