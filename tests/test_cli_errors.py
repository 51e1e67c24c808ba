"""The CLI's one error handler and one print path: a user's mistake is `error: <message>` and an exit code, a bug is
one line and a saved traceback, and brackets in paths and messages are printed as written (never eaten as markup)."""

from __future__ import annotations

import ast
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
    assert result.exit_code == ExitCode.FAILED
    assert "error: run[x].toml exists; pass --force to overwrite it" in result.stderr
    assert (tmp_path / "run[x].toml").read_text() == "keep me\n"


def test_profile_of_an_external_job_names_the_job_table(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text('[job]\ncommand = ["python", "train.py"]\n')
    result = invoke("profile", str(cfg))
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "error: profile runs the embedded engine; [job].command is set" in result.stderr


def test_status_shows_a_failure_message_with_brackets_as_written(tmp_path):
    from prime_train.contract import RunDir, write_json_atomic

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
    assert result.exit_code == ExitCode.FAILED
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
    from prime_train.validator.cost import CostInputError
    from prime_train.validator.memory import MemoryInputError
    from prime_train.validator.models import ModelConfigNotFound

    return [
        (MemoryInputError("unknown GPU 'Z80'"), ExitCode.CONFIG),
        (CostInputError("mfu = 2: must be a fraction"), ExitCode.CONFIG),
        (ModelConfigNotFound("no config.json"), 2),
        (SkyPilotNotFound("spot install first"), 2),
        (SkyPilotError("launch failed"), ExitCode.FAILED),
        (MonitorConfigError("no bucket"), 2),
        (ProfileFailed("preflight failed", ExitCode.PREEMPTED), ExitCode.PREEMPTED),
        (CliError("bad answer", 2), 2),
        (FileNotFoundError(2, "No such file or directory", "x.toml"), ExitCode.FAILED),
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
