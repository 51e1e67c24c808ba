"""Secrets never leave the raw process logs: a real `prime-train run` of a job that prints its credentials
(some with a known shape, some with none) and crashes with them in its traceback, then `status` and
`diagnose` on what it left. The job gets the real values on every attempt; no file the supervisor writes and
no line prime-train prints has one. Real subprocesses, the real CLI, no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w

from prime_train.config.loader import ENV_CONFIG_SECRETS, MASK, load_config
from prime_train.config.schema import Config
from prime_train.contract import write_json_atomic
from prime_train.kit.redact import REDACTED, Redactor
from prime_train.rundir import RunDir

# No shape any rule knows: only their names (a flag, a job.env key, an environment variable) say they are secret.
WANDB = "0123456789abcdef0123456789abcdef01234567"  # a W&B key given as --wandb_key, printed alone
DB_PASSWORD = "correct-horse-battery"  # job.env DB_PASSWORD
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"  # job.env AWS_SECRET_ACCESS_KEY
ANALYTICS = "plain-analytics-pass-42"  # only in the environment prime-train runs in: ANALYTICS_PASS
# Shapes: a Hugging Face token in argv, a password inside a URL.
HF = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
PG = "pg-Pa55w0rd"
SECRETS = {"wandb": WANDB, "db": DB_PASSWORD, "aws": AWS_SECRET, "analytics": ANALYTICS, "hf": HF, "pg": PG}

JOB = f"""
import json, os, sys
record, *flags = sys.argv[1:]
seen = {{"attempt": os.environ["PRIME_TRAIN_ATTEMPT"], "argv": flags,
        "env": {{k: os.environ.get(k) for k in ("DB_PASSWORD", "AWS_SECRET_ACCESS_KEY", "ANALYTICS_PASS")}}}}
with open(record, "a") as f:
    f.write(json.dumps(seen) + "\\n")
print("step 1", flush=True)
key = flags[flags.index("--wandb_key") + 1]
print(f"connecting with {{key}}", flush=True)
print(f"database login {{os.environ['DB_PASSWORD']}} accepted", flush=True)
print(f"aws {{os.environ['AWS_SECRET_ACCESS_KEY']}}", flush=True)
print(f"analytics {{os.environ['ANALYTICS_PASS']}}", flush=True)
print(f"reading postgres://admin:{PG}@db:5432/runs", flush=True)
raise RuntimeError(f"auth failed for {{key}} and {{os.environ['DB_PASSWORD']}} at postgres://admin:{PG}@db")
"""


def cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prime_train", *args],
        cwd=cwd,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_no_secret(text: str, where: str) -> None:
    leaked = [name for name, value in SECRETS.items() if value in text]
    assert not leaked, f"{where} leaks {leaked}:\n{text}"


@pytest.fixture(scope="module")
def leaky_run(tmp_path_factory):
    """A supervised job that prints every secret and dies with them in its traceback, twice (one restart)."""
    tmp = tmp_path_factory.mktemp("secrets")
    job = tmp / "job.py"
    job.write_text(JOB)
    record = tmp / "seen.jsonl"
    config = {
        "run": {"name": "leaky", "output_dir": str(tmp / "runs")},
        "job": {
            "command": [sys.executable, str(job), str(record), "--wandb_key", WANDB, f"--hf-token={HF}"],
            "env": {"DB_PASSWORD": DB_PASSWORD, "AWS_SECRET_ACCESS_KEY": AWS_SECRET, "MODE": "plain-value"},
            "progress_regex": r"step (\d+)",
        },
        "supervisor": {
            "max_restarts": 1,
            "backoff_initial_s": 0.1,
            "backoff_max_s": 0.1,
            "poll_interval_s": 0.2,
            "term_grace_s": 5,
            "stall_timeout_s": 60,
            "startup_timeout_s": 60,
        },
    }
    path = tmp / "leaky.toml"
    path.write_text(tomli_w.dumps(config))
    env = {"ANALYTICS_PASS": ANALYTICS}
    result = cli("run", str(path), env=env, cwd=tmp)
    return tmp, RunDir(tmp / "runs" / "leaky"), result, record, env


def test_run_console_shows_the_failure_with_every_secret_masked(leaky_run):
    _, _, result, _, _ = leaky_run
    output = result.stdout + result.stderr
    assert result.returncode == 1, output  # restarts exhausted
    assert "RuntimeError: auth failed for [REDACTED] and [REDACTED] at postgres://admin:[REDACTED]@db" in output
    assert_no_secret(output, "the console of `prime-train run`")


def test_no_file_the_supervisor_writes_holds_a_secret(leaky_run):
    _, run, _, _, _ = leaky_run
    written = [p for p in run.root.rglob("*") if p.is_file() and run.logs_dir not in p.parents]
    names = {p.name for p in written}
    assert {"events.jsonl", "supervisor.json", "config.toml"} <= names, names
    for path in written:
        assert_no_secret(path.read_text(errors="replace"), str(path.relative_to(run.root)))
    failure = json.loads(run.supervisor_path.read_text())["last_failure"]
    assert failure["kind"] == "crash"
    assert any(REDACTED in line for line in failure["evidence"]), failure


def test_config_toml_keeps_secret_values_as_stars_and_the_rest_as_run(leaky_run):
    _, run, _, _, _ = leaky_run
    stored = tomllib.loads(run.config_path.read_text())
    job = stored["job"]
    assert job["env"] == {"DB_PASSWORD": MASK, "AWS_SECRET_ACCESS_KEY": MASK, "MODE": "plain-value"}
    assert job["command"][-3:] == ["--wandb_key", MASK, f"--hf-token={MASK}"]
    assert job["progress_regex"] == r"step (\d+)"


@pytest.mark.parametrize("as_json", [False, True])
def test_config_show_prints_secret_values_as_stars(leaky_run, as_json):
    tmp, _, _, _, env = leaky_run
    result = cli("config", "show", str(tmp / "leaky.toml"), *(["--json"] if as_json else []), env=env, cwd=tmp)
    assert result.returncode == 0, result.stderr
    assert_no_secret(result.stdout + result.stderr, "config show")
    shown = json.loads(result.stdout) if as_json else tomllib.loads(result.stdout)
    assert shown["job"]["env"] == {"DB_PASSWORD": MASK, "AWS_SECRET_ACCESS_KEY": MASK, "MODE": "plain-value"}
    assert shown["job"]["command"][-3:] == ["--wandb_key", MASK, f"--hf-token={MASK}"]


def test_every_attempt_of_the_job_gets_the_real_values(leaky_run):
    _, _, _, record, _ = leaky_run
    attempts = [json.loads(line) for line in record.read_text().splitlines()]
    assert [a["attempt"] for a in attempts] == ["1", "2"]  # the restart ran with what the file does not hold
    for seen in attempts:
        assert seen["argv"] == ["--wandb_key", WANDB, f"--hf-token={HF}"]
        assert seen["env"] == {"DB_PASSWORD": DB_PASSWORD, "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
                               "ANALYTICS_PASS": ANALYTICS}  # fmt: skip


def test_process_logs_mask_the_values_the_job_was_given_as_it_writes_them(leaky_run):
    _, run, _, _, _ = leaky_run
    log = (run.attempt_logs(1) / "job.log").read_text()
    # its environment's and its config's credentials (issue 26: `diagnose` later, without them set, reads this file)
    leaked = [name for name, value in SECRETS.items() if value in log and name != "pg"]
    assert not leaked, log
    assert "database login [REDACTED] accepted" in log and "step 1\n" in log
    # a value with a shape only, known to neither (a password in a URL in the job's own code), is masked where a
    # log is shown (status, diagnose: above), not in the file


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_status_of_the_run_shows_the_failure_masked(leaky_run, as_json):
    tmp, run, _, _, env = leaky_run
    result = cli("status", str(run.root), *(["--json"] if as_json else []), env=env, cwd=tmp)
    assert result.returncode == 0, result.stderr
    assert "crash" in result.stdout
    assert_no_secret(result.stdout + result.stderr, "status")


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_diagnose_of_the_raw_logs_masks_the_values_of_this_environments_credentials(leaky_run, as_json):
    tmp, run, _, _, env = leaky_run
    # the user's shell holds the credentials the job was given: diagnose knows them by name
    shell = {**env, "WANDB_API_KEY": WANDB, "DB_PASSWORD": DB_PASSWORD, "AWS_SECRET_ACCESS_KEY": AWS_SECRET}
    result = cli("diagnose", str(run.root), *(["--json"] if as_json else []), env=shell, cwd=tmp)
    assert result.returncode == 1, result.stderr  # the RuntimeError is fatal
    assert "auth failed for [REDACTED]" in result.stdout
    assert_no_secret(result.stdout + result.stderr, "diagnose")


def test_status_masks_secrets_in_files_an_older_prime_train_wrote_raw(tmp_path):
    run = RunDir(tmp_path / "old")
    run.create()
    evidence = [f"key {WANDB}", f"token {HF}", f"db postgres://admin:{PG}@db", f"password {DB_PASSWORD}"]
    failure = {"kind": "crash", "message": f"auth failed for {WANDB}", "evidence": evidence}
    write_json_atomic(run.supervisor_path, {"state": "failed", "last_failure": failure})
    run.events_path.write_text(json.dumps({"time": 1.0, "event": "failure", "message": f"uses {DB_PASSWORD}"}) + "\n")
    shell = {"WANDB_API_KEY": WANDB, "DB_PASSWORD": DB_PASSWORD}
    for extra in ([], ["--json"]):
        result = cli("status", str(run.root), *extra, env=shell, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert_no_secret(result.stdout, "status of raw files")
        assert REDACTED in result.stdout


def test_a_job_process_reads_the_real_values_of_a_masked_config_back(tmp_path):
    """The embedded engine and rollout workers read config.toml themselves: the supervisor passes them the real
    values in their environment, and the loader puts them back where the file holds ***."""
    cfg = Config.model_validate(
        {
            "rl": {"env_args": {"api_key": "judge-key-123456", "rounds": 3}},
            "inference": {"extra_args": ["--api-key", "served-key-7890", "--port", "8000"]},
            "model": {"path": f"https://trainer:{PG}@models.internal/qwen"},
        }
    )
    masked = Redactor.for_run(cfg, {}).masked_config(cfg)
    path = tmp_path / "config.toml"
    path.write_text(masked.text)
    for value in ("judge-key-123456", "served-key-7890", PG):
        assert value not in masked.text
    probe = (
        "import json, sys; from prime_train.config.loader import load_config; "
        "c = load_config([sys.argv[1]]); "
        "print(json.dumps([c.rl.env_args, c.inference.extra_args, c.model.path]))"
    )

    def read_back(env: dict[str, str]) -> list:
        out = subprocess.run(
            [sys.executable, "-c", probe, str(path)], env={**os.environ, **env}, capture_output=True, text=True
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    assert read_back(masked.env) == [cfg.rl.env_args, cfg.inference.extra_args, cfg.model.path]
    # without the supervisor's variable the file reads as stored: the values are nowhere but in its memory
    env_args, extra, model = read_back({ENV_CONFIG_SECRETS: ""})
    assert env_args["api_key"] == MASK and extra[1] == MASK and model == f"https://trainer:{MASK}@models.internal/qwen"


def test_an_override_or_an_edited_value_wins_over_what_the_supervisor_passed(tmp_path, monkeypatch):
    cfg = Config.model_validate({"job": {"command": ["sh", "--password", "hunter2-long"], "env": {"API_KEY": "k" * 9}}})
    masked = Redactor.for_run(cfg, {}).masked_config(cfg)
    path = tmp_path / "config.toml"
    path.write_text(masked.text.replace('API_KEY = "***"', 'API_KEY = "edited-by-hand"'))
    monkeypatch.setenv(ENV_CONFIG_SECRETS, masked.env[ENV_CONFIG_SECRETS])
    loaded = load_config([str(path)], ["--job.command", '["sh", "--password", "from-the-command-line"]'])
    assert loaded.job.env["API_KEY"] == "edited-by-hand"
    assert loaded.job.command == ["sh", "--password", "from-the-command-line"]


def test_events_and_console_lines_mask_values_known_only_by_their_variables_name(tmp_path):
    redactor = Redactor.for_run(Config(), {"SERVICE_PASSWORD": DB_PASSWORD, "PWD": str(tmp_path), "MAX_TOKENS": "77"})
    line = f"login {DB_PASSWORD} from {tmp_path} after 77 tries"
    # the shell's working directory and a count are not credentials: they stay
    assert redactor(line) == f"login {REDACTED} from {tmp_path} after 77 tries"
    assert redactor(f"x{DB_PASSWORD}y") == f"x{REDACTED}y"  # wherever it appears, inside other text too


def test_unsupervised_train_keeps_config_toml_masked_and_the_engine_still_starts(tmp_path):
    """`prime-train train` writes the run's config.toml too: masked, with the real values in its job's
    environment. The shell's DATASET_SECRET happens to equal the task's name, so config.toml holds the task as
    *** and the engine trains only if it reads the real value back."""
    from enginetools import TINY, cli, tiny_overrides
    from enginetools import env as engine_env

    served = "served-key-7890"
    overrides = tiny_overrides(tmp_path, "masked", **{"train.max_steps": 2, "ckpt.interval": 1000})
    result = subprocess.run(
        cli("train", str(TINY), *overrides, "--inference.extra_args", f'["--api-key", "{served}"]'),
        env={**engine_env(), "DATASET_SECRET": "reverse-text"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    stored = tomllib.loads((tmp_path / "masked" / "config.toml").read_text())
    assert stored["inference"]["extra_args"] == ["--api-key", MASK]
    assert stored["data"]["datasets"][0]["task"] == MASK
    assert (tmp_path / "masked" / "final").is_dir()
