"""Secrets in every form (issue 26): a secret holding a backslash or a quote, printed escaped (a repr, JSON, URL
encoding), is masked wherever the redactor masks; the job's own output is masked in its log as it is written (a
secret split across two reads included), so `diagnose` later, without the variables set, shows none; the log is
capped at logging.max_log_mb, keeping its head and tail; lint, the engine's progress.json and the SkyPilot task
never hold a value; the SkyPilot setup quotes the path it installs from. Real subprocesses, the real CLI."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
import tomli_w

from prime_train.config.loader import load_config
from prime_train.config.schema import Config
from prime_train.kit.redact import REDACTED, Redactor, redact
from prime_train.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
# No shape any rule knows; a quote and a backslash, so that every escaped form differs from the value.
DB = 'Qx7"vault\\Kp29-zeta'  # job.env DB_PASSWORD
ANALYTICS = "an\\alytics'Wq81-pass"  # only in the environment prime-train runs in: ANALYTICS_PASS
FRAGMENTS = ("Kp29", "Wq81")  # a part of each value: any leak, whole or in part, in any form, holds one


def forms(value: str) -> list[str]:
    return [value, json.dumps(value)[1:-1], repr(value)[1:-1], quote(value, safe=""), quote_plus(value)]


def assert_no_secret(text: str, where: str) -> None:
    leaked = [f for f in FRAGMENTS if f in text]
    assert not leaked, f"{where} leaks {leaked}:\n{text[-3000:]}"


def cli(*args: str, env: dict[str, str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("DB_PASSWORD", "ANALYTICS_PASS")}
    return subprocess.run(
        [sys.executable, "-m", "prime_train", *args],
        cwd=cwd,
        env={**clean, "COLUMNS": "200", "NO_COLOR": "1", **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---------------------------------------------------------------- the redactor


@pytest.mark.parametrize("form", range(5), ids=["raw", "json", "repr", "url", "url-plus"])
def test_a_known_secret_is_masked_in_each_escaped_form(form):
    value = forms(DB)[form]
    line = f"connect failed: {value} (retrying)"
    assert Redactor([DB])(line) == f"connect failed: {REDACTED} (retrying)"


def test_escaped_forms_inside_json_inside_json_and_lowercase_percent_escapes_are_masked():
    redactor = Redactor([DB, ANALYTICS])
    doubled = json.dumps(json.dumps({"password": DB, "other": ANALYTICS}))
    assert_no_secret(redactor(doubled), "JSON of JSON")
    assert_no_secret(redactor(quote(DB, safe="").lower()), "lowercase URL encoding")
    assert_no_secret(redactor(shlex.quote(ANALYTICS)), "shell quoting")
    # the secret's neighbours stay
    assert redactor(f"user=admin pw={repr(DB)[1:-1]} host=db").startswith("user=admin pw=")


def test_a_secret_named_in_json_is_masked_past_its_escaped_quote():
    # by name alone, without the value being known: `"api_key": "Qx7\"vault..."` must not leave `vault...` behind
    text = json.dumps({"api_key": DB, "step": 3})
    assert redact(text) == json.dumps({"api_key": REDACTED, "step": 3})


# ---------------------------------------------------------------- a real run of a job that prints them escaped

JOB = r"""
import json, os, sys, time
from urllib.parse import quote
pw, other = os.environ["DB_PASSWORD"], os.environ["ANALYTICS_PASS"]
print("step 1", flush=True)
print("repr:", repr(pw), repr(other), flush=True)
print("json:", json.dumps({"db": pw, "analytics": other}), flush=True)
print("url: postgres://db/x?password=" + quote(pw, safe=""), flush=True)
# one line, two writes far apart: the supervisor reads it in two pieces
half = len(pw) // 2
sys.stdout.write("split: " + pw[:half]); sys.stdout.flush(); time.sleep(0.3)
sys.stdout.write(pw[half:] + " end\n"); sys.stdout.flush()
raise RuntimeError(f"login failed for {pw!r} and {other!r}")
"""


@pytest.fixture(scope="module")
def escaped_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forms")
    (tmp / "job.py").write_text(JOB)
    config = {
        "run": {"name": "forms", "output_dir": str(tmp / "runs")},
        "job": {
            "command": [sys.executable, str(tmp / "job.py")],
            "env": {"DB_PASSWORD": DB},
            "progress_regex": r"step (\d+)",
        },
        "supervisor": {"max_restarts": 0, "poll_interval_s": 0.2, "term_grace_s": 5, "startup_timeout_s": 60},
    }
    path = tmp / "forms.toml"
    path.write_text(tomli_w.dumps(config))
    result = cli("run", str(path), env={"ANALYTICS_PASS": ANALYTICS}, cwd=tmp)
    return tmp, RunDir(tmp / "runs" / "forms"), result


def test_the_console_shows_the_escaped_secrets_masked(escaped_run):
    _, _, result = escaped_run
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "login failed for" in output and REDACTED in output, output
    assert_no_secret(output, "the console of `prime-train run`")


def test_events_and_supervisor_json_hold_no_escaped_secret(escaped_run):
    _, run, _ = escaped_run
    for path in (run.events_path, run.supervisor_path, run.config_path):
        assert_no_secret(path.read_text(), path.name)
    failure = json.loads(run.supervisor_path.read_text())["last_failure"]
    assert any("login failed for" in line and REDACTED in line for line in failure["evidence"]), failure


def test_the_captured_log_is_masked_as_written_even_a_secret_split_across_reads(escaped_run):
    _, run, _ = escaped_run
    log = (run.attempt_logs(1) / "job.log").read_text()
    assert_no_secret(log, "logs/attempt-1/job.log")
    assert f"split: {REDACTED} end\n" in log
    assert "step 1\n" in log and "RuntimeError: login failed for" in log  # the rest as the job wrote it


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_status_and_diagnose_without_the_variables_show_no_secret(escaped_run, as_json):
    tmp, run, _ = escaped_run
    flag = ["--json"] if as_json else []
    status = cli("status", str(run.root), *flag, env={}, cwd=tmp)
    assert status.returncode == 0, status.stderr
    assert_no_secret(status.stdout + status.stderr, "status")
    # run later, in a shell that has none of the job's variables: only what the log file holds can be shown
    diagnose = cli("diagnose", str(run.root), *flag, env={}, cwd=tmp)
    assert "login failed for" in diagnose.stdout, diagnose.stdout + diagnose.stderr
    assert_no_secret(diagnose.stdout + diagnose.stderr, "diagnose")


# ---------------------------------------------------------------- captured logs, directly


def _child(tmp_path: Path, code: str, **kw):
    from prime_train.kit.process import ChildProcess, ProcessSpec

    lines: list[str] = []
    spec = ProcessSpec("job", [sys.executable, "-c", code], env=kw.pop("env", {}), role="job")
    child = ChildProcess(spec, tmp_path / "job.log", on_line=lambda _p, line, _n: lines.append(line), **kw)
    child.start()
    child.popen.wait(timeout=60)
    child.join_output(timeout=30)
    return child, lines


def test_a_child_masks_the_secrets_its_own_environment_names_without_being_told(tmp_path):
    code = (
        "import os, sys, time\n"
        "v = os.environ['SERVICE_TOKEN']\n"
        "sys.stdout.write('token ' + v[:5]); sys.stdout.flush(); time.sleep(0.2)\n"
        "print(v[5:] + ' ok', repr(v), flush=True)\n"
    )
    child, _ = _child(tmp_path, code, env={"SERVICE_TOKEN": DB})
    log = child.log_path.read_text()
    assert log == f"token {REDACTED} ok '{REDACTED}'\n"


def test_a_secret_in_a_long_line_without_newline_is_masked_across_the_cut():
    import tempfile

    from prime_train.kit.process import HOLD_BYTES, _LogFile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "job.log"
        log = _LogFile(path, Redactor([DB]), None)
        log.write(b"x" * HOLD_BYTES + DB[:6].encode())  # too long to hold whole: written in part
        log.write(DB[6:].encode() + b" tail")
        log.close()
        data = path.read_bytes()
    assert data == b"x" * HOLD_BYTES + REDACTED.encode() + b" tail"


CHATTY = (
    "import sys\n"
    "print('FIRST LINE of the job', flush=True)\n"
    "for i in range(60000):\n"  # ~4 MB
    "    sys.stdout.write(f'line {i:06d} ' + 'x' * 56 + '\\n')\n"
    "sys.stdout.write('Traceback (most recent call last):\\nRuntimeError: the final error\\n')\n"
)


def test_a_chatty_job_s_log_is_capped_keeping_its_head_and_its_tail(tmp_path):
    from prime_train.kit.process import log_cap_bytes

    cfg = Config.model_validate({"logging": {"max_log_mb": 0.5}})
    cap = log_cap_bytes(cfg.logging.max_log_mb)
    assert cap == 512 * 1024
    child, lines = _child(tmp_path, CHATTY, max_log_bytes=cap)
    data = child.log_path.read_bytes()
    assert len(data) <= cap
    text = data.decode()
    assert text.startswith("FIRST LINE of the job\nline 000000 ")
    assert text.endswith("Traceback (most recent call last):\nRuntimeError: the final error\n")
    notes = [line for line in text.splitlines() if line.startswith("[prime-train]")]
    assert len(notes) == 1 and "dropped here" in notes[0] and "logging.max_log_mb = 0.5" in notes[0], notes
    assert child.log_bytes_dropped > 3 * 2**20
    # whole lines on both sides of the note: the head ends at a line end, the tail starts at a line start
    after = text.split(notes[0] + "\n", 1)[1]
    assert after.startswith("line ") and len(after.split("\n", 1)[0]) == len("line 000000 ") + 56
    # the line callback (the log scanner) saw the final error; a line it missed only because it fell behind the
    # pump (a loaded machine) is counted as dropped, never lost silently
    assert lines[-1] == "RuntimeError: the final error"
    assert len(lines) + child.lines_dropped == 60003 and len(set(lines)) == len(lines)


def test_max_log_mb_is_a_documented_config_field_and_zero_means_no_cap():
    from prime_train.kit.process import log_cap_bytes

    field = Config.model_fields["logging"].annotation.model_fields["max_log_mb"]
    assert field.description and field.default > 0
    assert log_cap_bytes(0) is None and log_cap_bytes(0.001) == 65536  # a floor that fits a head, note and tail
    with pytest.raises(ValueError):
        Config.model_validate({"logging": {"max_log_mb": -1}})


# ---------------------------------------------------------------- lint, the engine, SkyPilot


def test_lint_masks_credentials_in_a_dataset_path(tmp_path, monkeypatch):
    from prime_train.validator.lint import lint_files

    aws = 'wJalr\\XUtn"FEMI-Kp29-MDENG'
    hf = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", aws)
    path = tmp_path / "lint.toml"
    path.write_text(tomli_w.dumps({"data": {"datasets": [{"path": f"s3data/{aws}/{hf}/train.jsonl"}]}}))
    problems, _ = lint_files([str(path)])
    messages = " ".join(p.message for p in problems)
    assert "data.datasets[0].path" in messages and REDACTED in messages, messages
    assert "Kp29" not in messages and hf not in messages, messages


def test_the_engine_writes_no_secret_into_progress_json(tmp_path):
    """A dataset path holding the job's HF_TOKEN: the engine's configuration error, which becomes progress.json's
    `reason`, shows the path masked."""
    config = tomllib.loads((REPO / "prime_train" / "configs" / "tiny-sft.toml").read_text())
    config["run"].update(output_dir=str(tmp_path / "runs"), name="eng")
    config["data"]["datasets"] = [{"path": f"{tmp_path}/data/{DB}/train.jsonl"}]
    config["logging"] = {"tensorboard": False}
    path = tmp_path / "eng.toml"
    path.write_text(tomli_w.dumps(config))
    env = {**os.environ, "HF_TOKEN": DB, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "prime_train.engine.train", "--config", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 78, result.stderr[-3000:]
    progress = json.loads((tmp_path / "runs" / "eng" / "progress.json").read_text())
    assert "data.datasets[0].path" in progress["reason"] and REDACTED in progress["reason"], progress
    assert_no_secret(json.dumps(progress), "progress.json")
    assert_no_secret(result.stdout + result.stderr, "the engine's output")


SPOT = """
[run]
name = "demo"
[ckpt]
interval = 100
[spot]
accelerators = "H100:8"
clouds = ["gcp", "aws"]
"""


def test_run_spot_dry_run_passes_secret_env_values_by_reference(tmp_path):
    (tmp_path / "spot.toml").write_text(SPOT)
    args = ["--spot.env.DB_PASSWORD", DB, f"--job.env.HF_TOKEN={ANALYTICS}", "--train.max_steps", "50"]
    result = cli("run", "--spot", "--dry-run", "spot.toml", *args, env={}, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert_no_secret(result.stdout + result.stderr, "run --spot --dry-run")
    import yaml

    task = yaml.safe_load(result.stdout)
    assert "DB_PASSWORD" not in task["envs"]
    assert task["secrets"]["DB_PASSWORD"] is None and task["secrets"]["PRIME_TRAIN_SECRET_JOB_ENV_HF_TOKEN"] is None
    assert '--spot.env.DB_PASSWORD "$DB_PASSWORD"' in task["run"]
    assert '--job.env.HF_TOKEN="$PRIME_TRAIN_SECRET_JOB_ENV_HF_TOKEN" --train.max_steps 50' in task["run"]


def test_spot_launch_hands_the_config_s_secret_values_to_skypilot_through_its_environment(tmp_path, monkeypatch):
    """A stand-in SkyPilot interpreter records what it was given: the values arrive in its environment under the
    task's secret names, never in the request (the task JSON) it reads."""
    from prime_train.integrations import skypilot as sp

    (tmp_path / "spot.toml").write_text(SPOT)
    cfg = load_config([str(tmp_path / "spot.toml")], ["--spot.env.DB_PASSWORD", DB])
    task = sp.task_from_config(
        cfg, config_files=[str(tmp_path / "spot.toml")], overrides=["--spot.env.DB_PASSWORD", DB]
    )
    assert "Kp29" not in json.dumps(task) and "Kp29" not in sp.render_yaml(task)
    seen = tmp_path / "seen.json"
    fake = tmp_path / "python"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "request = sys.stdin.read()\n"
        f"json.dump({{'request': request, 'db': os.environ.get('DB_PASSWORD')}}, open({str(seen)!r}, 'w'))\n"
        "json.dump({'ok': True, 'job_ids': [7]}, open(os.environ['PRIME_TRAIN_SKY_RESULT'], 'w'))\n"
    )
    fake.chmod(0o755)
    monkeypatch.delenv("DB_PASSWORD", raising=False)
    result = sp.launch(task, str(fake), stream=lambda line: None)
    assert result["job_ids"] == [7] and "DB_PASSWORD" not in result["missing_secrets"]
    got = json.loads(seen.read_text())
    assert got["db"] == DB and "Kp29" not in got["request"]
    assert json.loads(got["request"])["task"]["secrets"]["DB_PASSWORD"] is None


def test_spot_setup_quotes_the_source_path_it_installs_from(tmp_path, monkeypatch):
    from prime_train.integrations import skypilot as sp

    workdir = tmp_path / "wd"
    tree = workdir / 'my "src" $HOME `id` \\ dir'  # quotes, a dollar, a backtick, a backslash and spaces
    tree.mkdir(parents=True)
    monkeypatch.setattr(sp, "source_tree", lambda: tree)
    (workdir / "spot.toml").write_text(SPOT + f"workdir = {json.dumps(str(workdir))}\n")
    cfg = load_config([str(workdir / "spot.toml")])
    task = sp.task_from_config(cfg, config_files=[str(workdir / "spot.toml")], overrides=[])
    home = tmp_path / "home"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = bin_dir / "pip.json"
    (bin_dir / "pip").write_text(
        f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n"
    )
    (bin_dir / "pip").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(home)}
    proc = subprocess.run(["bash", "-c", task["setup"]], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    argv = json.loads(record.read_text())
    assert argv[-1] == f"{home}/sky_workdir/{tree.name}[engine,s3]"


def test_a_link_planted_at_a_process_log_is_not_written_through(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    (tmp_path / "job.log").symlink_to(victim)
    child, lines = _child(tmp_path, "print('hello', flush=True)")
    assert victim.read_text() == "keep me\n"
    assert lines == ["hello"] and child.log_bytes_lost == len("hello\n")  # the pipe drained, the loss counted


def test_prime_train_run_caps_the_job_s_log_at_logging_max_log_mb_and_masks_config_secrets(tmp_path):
    """The supervisor hands its own redactor and the configured cap to every child it starts: a secret that only
    the config holds (a [job] env value the job never prints from its environment) is masked in the log too."""
    (tmp_path / "job.py").write_text(
        CHATTY.replace("print('FIRST LINE of the job', flush=True)", "print('FIRST LINE', sys.argv[1], flush=True)")
    )
    config = {
        "run": {"name": "capped", "output_dir": str(tmp_path / "runs")},
        "logging": {"max_log_mb": 0.25},
        "job": {"command": [sys.executable, str(tmp_path / "job.py"), DB], "env": {"DB_PASSWORD": DB}},
        "supervisor": {"max_restarts": 0, "poll_interval_s": 0.2, "term_grace_s": 5},
    }
    (tmp_path / "capped.toml").write_text(tomli_w.dumps(config))
    result = cli("run", str(tmp_path / "capped.toml"), env={}, cwd=tmp_path)
    log = (RunDir(tmp_path / "runs" / "capped").attempt_logs(1) / "job.log").read_bytes()
    assert len(log) <= 256 * 1024, (len(log), result.stderr[-2000:])
    text = log.decode()
    assert text.startswith(f"FIRST LINE {REDACTED}\n"), text[:200]
    assert "dropped here" in text and text.endswith("RuntimeError: the final error\n")
    assert_no_secret(text, "the capped log")
