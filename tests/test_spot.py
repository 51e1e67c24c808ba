"""`run --spot`: the SkyPilot task prime-train generates, checked by running its scripts and by SkyPilot itself."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from enginetools import free_port

from prime_train.config.loader import load_config
from prime_train.integrations import skypilot as sp
from prime_train.integrations.spot_lint import lint_spot

SECRET = "wandb-secret-value-0123456789abcdef"


def _existing_sky_python() -> str | None:
    """A SkyPilot interpreter already here: PRIME_TRAIN_SKY_PYTHON, the managed venv, or the test cache."""
    named = os.environ.get(sp.SKY_PYTHON_ENV)
    if named:
        return named
    for prefix in (sp.managed_venv_dir(), TEST_CACHE):
        py = prefix / "bin" / "python"
        if py.is_file():
            return str(py)
    return None


TEST_CACHE = Path.home() / ".cache" / "prime-train-tests" / "skypilot"
_FOUND = _existing_sky_python()
# installing SkyPilot from PyPI takes a while: only then is a test that needs it slow
needs_sky = pytest.mark.slow if _FOUND is None else (lambda f: f)


@pytest.fixture(scope="module")
def sky_python() -> str:
    return _FOUND or str(sp.install_skypilot(TEST_CACHE))


def _config(tmp_path: Path, text: str) -> tuple[str, object]:
    path = tmp_path / "spot.toml"
    path.write_text(text)
    return str(path), load_config([str(path)])


TWO_NODES = """
[run]
name = "demo"
[distributed]
nnodes = 2
[ckpt]
dir = "/tmp/prime-train-tests/shared-ckpt/demo"   # several nodes: a directory every node mounts (lint)
[spot]
accelerators = "H100:8"
clouds = ["gcp", "aws"]
num_nodes = 2
env = { NCCL_DEBUG = "WARN" }
setup = ["nvidia-smi"]
"""


ONE_NODE = """
[run]
name = "demo"
[ckpt]
interval = 100
[spot]
accelerators = "H100:8"
clouds = ["gcp", "aws"]
"""


def _fake_prime_train(bin_dir: Path, exit_code: int, *, sleep_until_term: bool = False) -> Path:
    """A `prime-train` on PATH whose `run` records its argv (one JSON line a call) and exits `exit_code` (the real
    one would start training); `spot recovery-gate` is the real command. With `sleep_until_term`, `run` waits for
    SIGTERM and records it, as the supervisor checkpoints and exits 75 on one."""
    record = bin_dir / "argv.jsonl"
    script = bin_dir / "prime-train"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, signal, sys, time\n"
        "if sys.argv[1:3] == ['spot', 'recovery-gate']:\n"
        "    os.execv(sys.executable, [sys.executable, '-m', 'prime_train', *sys.argv[1:]])\n"
        f"def note(what):\n    with open({str(record)!r}, 'a') as f:\n        f.write(json.dumps(what) + '\\n')\n"
        "note(sys.argv[1:])\n"
        f"if {sleep_until_term}:\n"
        f"    signal.signal(signal.SIGTERM, lambda *a: (note('SIGTERM'), sys.exit({exit_code})))\n"
        "    time.sleep(60)\n"
        f"sys.exit({exit_code})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return record


def _calls(record: Path) -> list:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_two_node_task_runs_prime_train_with_skypilot_rendezvous(tmp_path):
    cfg_path, cfg = _config(tmp_path, TWO_NODES)
    task = sp.task_from_config(cfg, config_files=[cfg_path], overrides=["--train.max_steps", "50"])
    assert task["num_nodes"] == 2
    res = task["resources"]
    assert res["use_spot"] is True and res["accelerators"] == "H100:8"
    assert res["any_of"] == [{"infra": "aws"}, {"infra": "gcp"}]
    assert res["job_recovery"]["recover_on_exit_codes"] == [75]
    assert res["job_recovery"]["strategy"] == "EAGER_NEXT_REGION"
    assert task["envs"]["NCCL_DEBUG"] == "WARN"
    assert "nvidia-smi" in task["setup"] and '"$HOME/.prime-train/src[engine,s3]"' in task["setup"]
    # the config reaches the nodes through file_mounts (no workdir given), and so does prime-train's source
    (remote, local), *_ = task["file_mounts"].items()
    assert local == str(Path(cfg_path).resolve()) and remote.startswith(sp.REMOTE_CONFIG_DIR)
    assert task["file_mounts"][sp.REMOTE_SOURCE_DIR] == str(sp.source_tree())

    # run the node script as SkyPilot would on the second node, with the config where the file mount puts it;
    # the job's exit code must come back
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = _fake_prime_train(bin_dir, exit_code=75)
    home = tmp_path / "home"
    shipped = home / remote[2:]
    shipped.parent.mkdir(parents=True)
    shipped.write_text(Path(cfg_path).read_text())
    env = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(home),
        "SKYPILOT_NODE_IPS": "10.1.2.3\n10.1.2.4\n",
        "SKYPILOT_NUM_NODES": "2",
        "SKYPILOT_NODE_RANK": "1",
    }
    proc = subprocess.run(["bash", "-c", task["run"]], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 75, proc.stderr
    [argv] = _calls(record)
    assert argv[0] == "run"
    assert argv[1] == str(home / remote[2:])
    assert argv[2:4] == ["--train.max_steps", "50"]

    # the arguments mean what they should to prime-train's own config loader
    node_cfg = load_config([argv[1]], argv[2:])
    assert node_cfg.distributed.nnodes == 2
    assert node_cfg.distributed.node_rank == 1
    assert node_cfg.distributed.rdzv_endpoint == "10.1.2.3:29500"
    assert node_cfg.train.max_steps == 50


def test_configs_inside_workdir_keep_their_relative_path(tmp_path):
    (tmp_path / "configs").mkdir()
    cfg_path = tmp_path / "configs" / "a.toml"
    cfg_path.write_text(f'[spot]\nworkdir = "{tmp_path}"\nclouds = ["aws"]\n')
    cfg = load_config([str(cfg_path)])
    task = sp.task_from_config(cfg, config_files=[str(cfg_path)], overrides=[])
    assert list(task.get("file_mounts", {})) == [sp.REMOTE_SOURCE_DIR], "only prime-train's source is mounted"
    assert task["workdir"] == str(tmp_path.resolve())
    assert task["resources"]["infra"] == "aws"
    assert "prime-train run configs/a.toml" in task["run"]


def test_no_secret_value_in_the_task(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.setenv("HF_TOKEN", "hf_" + "x" * 34)
    cfg_path, cfg = _config(tmp_path, TWO_NODES)
    task = sp.task_from_config(cfg, config_files=[cfg_path], overrides=[])
    text = sp.render_yaml(task)
    assert SECRET not in text and "hf_" + "x" * 34 not in text
    assert yaml.safe_load(text)["secrets"] == {
        "AWS_ACCESS_KEY_ID": None,
        "AWS_SECRET_ACCESS_KEY": None,
        "HF_TOKEN": None,
        "WANDB_API_KEY": None,
    }
    assert "WANDB_API_KEY" not in task["envs"]


def test_scrub_hides_listed_secret_values_and_token_shapes(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    line = f"\x1b[31mlaunch failed: key={SECRET} token hf_{'a' * 34}\x1b[0m"
    out = sp.scrub(line, ["WANDB_API_KEY"])
    assert SECRET not in out and "hf_" + "a" * 34 not in out and "\x1b" not in out
    assert out.startswith("launch failed")


GOLDEN_CONFIG = """
[run]
name = "golden"
[ckpt]
remote = "s3://b/p"
[spot]
accelerators = "A100-80GB:4"
infra = "aws/us-east-1"
disk_size_gb = 100
secrets = ["WANDB_API_KEY"]
env = { B = "2", A = "x y" }
install = "prime-train[engine,s3] @ git+https://example.org/pt@v0.1.0"
"""


def test_rendered_yaml_is_stable_and_matches_the_golden_text(tmp_path):
    cfg_path, cfg = _config(tmp_path, GOLDEN_CONFIG)
    task = sp.task_from_config(cfg, config_files=[cfg_path], overrides=["--train.lr", "3e-4"])
    first = sp.render_yaml(task)
    again = sp.render_yaml(sp.task_from_config(cfg, config_files=[cfg_path], overrides=["--train.lr", "3e-4"]))
    assert first == again
    local = str(Path(cfg_path).resolve())
    golden = (
        'name: "golden"\n'
        "resources:\n"
        '  accelerators: "A100-80GB:4"\n'
        "  use_spot: true\n"
        '  infra: "aws/us-east-1"\n'
        "  disk_size: 100\n"
        "  job_recovery:\n"
        '    strategy: "EAGER_NEXT_REGION"\n'
        "    max_restarts_on_errors: 3\n"
        "    recover_on_exit_codes: [75]\n"
        "num_nodes: 1\n"
        "file_mounts:\n"
        f'  ~/.prime-train/configs/0-spot.toml: "{local}"\n'
        "envs:\n"
        '  A: "x y"\n'
        '  B: "2"\n'
        '  PYTHONUNBUFFERED: "1"\n'
        "secrets:\n"
        "  WANDB_API_KEY: null\n"
        "setup: |\n"
        "  set -euo pipefail\n"
        "  pip install --disable-pip-version-check 'prime-train[engine,s3] @ git+https://example.org/pt@v0.1.0'\n"
        "run: |\n"
        "  set -uo pipefail\n"
        "  # rendezvous on the first node SkyPilot lists; node count and rank come from SkyPilot too\n"
        '  MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n1)"\n'
        "  # SkyPilot recovers recover_on_exit_codes without limit: the gate counts recoveries in the bucket\n"
        "  prime-train spot recovery-gate ~/.prime-train/configs/0-spot.toml --train.lr 3e-4 || exit $?\n"
        "  prime-train run ~/.prime-train/configs/0-spot.toml --train.lr 3e-4 \\\n"
        '    --distributed.nnodes "$SKYPILOT_NUM_NODES" \\\n'
        '    --distributed.node_rank "$SKYPILOT_NODE_RANK" \\\n'
        '    --distributed.rdzv_endpoint "$MASTER_ADDR:29500" &\n'
        "  child=$!\n"
        "  trapped=0\n"
        "  trap 'trapped=1; kill -TERM \"$child\" 2>/dev/null' TERM INT\n"
        '  wait "$child"; code=$?\n'
        '  while [ "$trapped" = 1 ]; do trapped=0; wait "$child"; code=$?; done\n'
        '  exec prime-train spot recovery-gate ~/.prime-train/configs/0-spot.toml --train.lr 3e-4 --exited "$code"\n'
    )
    assert first == golden
    assert yaml.safe_load(first) == task


def test_yaml_round_trips_awkward_values(tmp_path):
    cfg_path, cfg = _config(tmp_path, TWO_NODES)
    task = sp.task_from_config(cfg, config_files=[cfg_path], overrides=[])
    task["envs"] = {"YES": "no", "QUOTE": 'say "hi"\tnow', "MULTI": "a\n  b\n\n", "EMPTY": "", "NUM": "007"}
    task["extra"] = {"nested": [{"a": 1, "b": [1, 2]}, "x", []], "empty": {}}
    assert yaml.safe_load(sp.render_yaml(task)) == task


@needs_sky
def test_skypilot_accepts_the_task_and_rejects_an_unknown_field(tmp_path, sky_python):
    cfg_path, cfg = _config(tmp_path, TWO_NODES)
    task = sp.task_from_config(cfg, config_files=[cfg_path], overrides=["--train.max_steps", "5"])
    assert sp.validate_task(task, sky_python) == []
    bad = dict(task)
    bad["resource"] = bad.pop("resources")
    errors = sp.validate_task(bad, sky_python)
    assert len(errors) == 1 and "did you mean 'resources'" in errors[0]
    worse = json.loads(json.dumps(task))
    worse["resources"]["job_recovery"]["recover_on_exit_codes"] = [75, 300]
    assert sp.validate_task(worse, sky_python)  # exit codes are 0..255


def test_an_interpreter_without_skypilot_is_a_clear_error():
    # this test environment deliberately has no SkyPilot (click conflict with wandb)
    assert subprocess.run([sys.executable, "-c", "import sky"], capture_output=True).returncode != 0
    errors = sp.validate_task({"name": "x"}, sys.executable)
    assert len(errors) == 1
    assert "cannot import sky" in errors[0] and "prime-train spot install" in errors[0]


def test_find_sky_python_order(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv(sp.SKY_PYTHON_ENV, raising=False)
    assert sp.managed_venv_dir() == tmp_path / "data" / "prime-train" / "skypilot"
    assert sp.find_sky_python(required=False) is None
    with pytest.raises(sp.SkyPilotNotFound, match="prime-train spot install"):
        sp.find_sky_python()
    managed = sp.managed_venv_dir() / "bin" / "python"
    managed.parent.mkdir(parents=True)
    managed.symlink_to(sys.executable)
    assert sp.find_sky_python() == str(managed)
    monkeypatch.setenv(sp.SKY_PYTHON_ENV, str(tmp_path / "nope"))
    with pytest.raises(sp.SkyPilotNotFound, match=sp.SKY_PYTHON_ENV):
        sp.find_sky_python()
    monkeypatch.setenv(sp.SKY_PYTHON_ENV, sys.executable)
    assert sp.find_sky_python() == sys.executable


def _keys(problems, severity):
    return [(".".join(map(str, k)), m) for k, s, m in problems if s == severity]


GOOD = """
[distributed]
nnodes = 2
[ckpt]
dir = "/checkpoints/demo"
[spot]
accelerators = "H100:8"
clouds = ["aws", "gcp"]
num_nodes = 2
ckpt_mount = "s3://bucket/x"
"""


def test_lint_spot_passes_a_sound_config(tmp_path):
    _, cfg = _config(tmp_path, GOOD)
    assert lint_spot(cfg) == []


@pytest.mark.parametrize(
    ("extra", "severity", "key", "words"),
    [
        ('clouds = ["lambda"]\nnum_nodes = 1', "error", "spot.clouds", "Lambda Cloud has no spot"),
        ('clouds = ["lambda", "aws"]\nnum_nodes = 1', "warning", "spot.clouds", "only use aws"),
        ('infra = "lambda/us-east-1"\nclouds = []\nnum_nodes = 1', "error", "spot.infra", "no spot"),
        ('clouds = ["runpod"]', "error", "spot.clouds", "multi-node"),
        ('clouds = ["vast", "runpod"]', "error", "spot.clouds", "multi-node"),
        ('clouds = ["vast", "gcp"]', "warning", "spot.clouds", "only use gcp"),
        ('accelerators = "H100x8"', "error", "spot.accelerators", "did you mean 'H100:8'"),
        ('accelerators = "H100,A100"', "error", "spot.accelerators", "NAME:COUNT"),
        ('accelerators = "H100:0.5"', "error", "spot.accelerators", "whole number"),
        ('accelerators = "H100:"', "error", "spot.accelerators", "NAME:COUNT"),
        ("recover_on_exit_codes = [1]", "warning", "spot.recover_on_exit_codes", "75"),
        ('env = { WANDB_API_KEY = "x" }', "error", "spot.env.WANDB_API_KEY", "both spot.env and spot.secrets"),
        ('env = { MY_TOKEN = "x" }', "warning", "spot.env.MY_TOKEN", "looks like a credential"),
        ('secrets = ["BAD-NAME"]', "error", "spot.secrets", "not an environment variable name"),
        ("num_nodes = 3", "warning", "spot.num_nodes", "distributed.nnodes = 3"),
    ],
)
def test_lint_spot_known_limits(tmp_path, extra, severity, key, words):
    # later keys in a TOML table may not repeat: rebuild [spot] with the case's keys replacing GOOD's
    base = dict(line.split(" = ", 1) for line in GOOD.split("[spot]\n")[1].strip().splitlines())
    base.update(dict(line.split(" = ", 1) for line in extra.splitlines()))
    text = GOOD.split("[spot]\n")[0] + "[spot]\n" + "\n".join(f"{k} = {v}" for k, v in base.items()) + "\n"
    _, cfg = _config(tmp_path, text)
    found = _keys(lint_spot(cfg), severity)
    assert any(k == key and words in m for k, m in found), found
    # the value of a variable is never in a message
    assert all('"x"' not in m for _, m in found)


def test_several_spot_nodes_share_checkpoints_through_a_bucket_mounted_at_ckpt_dir(tmp_path):
    # ckpt.remote uploads one node's run directory; above one node the checkpoint lives in ckpt.dir on every node
    _, unmounted = _config(tmp_path, GOOD.replace('ckpt_mount = "s3://bucket/x"\n', ""))
    warnings = _keys(lint_spot(unmounted), "warning")
    assert any(k == "spot.ckpt_mount" and "a recovery replaces every node" in m for k, m in warnings), warnings
    assert not any(k == "ckpt.remote" for k, _ in warnings)
    _, on_demand = _config(tmp_path, GOOD.replace('ckpt_mount = "s3://bucket/x"\n', "use_spot = false\n"))
    # nothing is preempted: a filesystem of the cluster's own is fine
    assert not [k for k, _ in _keys(lint_spot(on_demand), "warning") if k in ("spot.ckpt_mount", "ckpt.remote")]
    # the mount needs a place on the nodes
    _, nowhere = _config(tmp_path, GOOD.replace('dir = "/checkpoints/demo"\n', ""))
    assert any(k == "ckpt.dir" and "unset" in m for k, m in _keys(lint_spot(nowhere), "error"))
    with pytest.raises(sp.SpotConfigError, match=r"set ckpt\.dir to where the nodes should see it"):
        sp.task_from_config(nowhere, config_files=[], overrides=[])
    _, relative = _config(tmp_path, GOOD.replace("/checkpoints/demo", "ckpts"))
    assert any(k == "ckpt.dir" and "not an absolute path" in m for k, m in _keys(lint_spot(relative), "error"))
    # the whole lint: the mount point is on the nodes, so it is not asked to be writable here
    path, _ = _config(tmp_path, GOOD)
    result = subprocess.run([sys.executable, "-m", "prime_train", "lint", path, "--json"], capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    problems = json.loads(result.stdout)
    assert not [p for p in problems if p.get("severity") == "error"], problems


@pytest.mark.parametrize("url", ["/mnt/bucket", "s3://", "ftp://host/x", "bucket/x"])
def test_a_ckpt_mount_that_is_no_bucket_url_is_refused_naming_the_key(tmp_path, url):
    with pytest.raises(Exception, match=r"spot\.ckpt_mount"):
        _config(tmp_path, GOOD.replace("s3://bucket/x", url))


@needs_sky
def test_skypilot_mounts_the_checkpoint_bucket_at_ckpt_dir_on_every_node(tmp_path, sky_python):
    cfg_path, cfg = _config(tmp_path, GOOD)
    task = sp.task_from_config(cfg, config_files=[cfg_path], overrides=[])
    assert task["num_nodes"] == 2
    assert task["file_mounts"]["/checkpoints/demo"] == {"source": "s3://bucket/x", "mode": "MOUNT_CACHED"}
    assert sp.validate_task(task, sky_python) == []
    wrong = json.loads(json.dumps(task))
    wrong["file_mounts"]["/checkpoints/demo"]["mode"] = "MOUNT_LATER"
    assert sp.validate_task(wrong, sky_python)  # SkyPilot's own schema judges the mount


def test_lint_spot_warns_without_a_bucket_and_on_gpu_count(tmp_path):
    _, cfg = _config(tmp_path, '[distributed]\nnproc_per_node = 4\n[spot]\naccelerators = "A100:8"\n')
    warnings = _keys(lint_spot(cfg), "warning")
    assert any(k == "ckpt.remote" and "preempted" in m for k, m in warnings)
    assert any(k == "distributed.nproc_per_node" and "8 GPU" in m for k, m in warnings)
    _, on_demand = _config(tmp_path, '[spot]\nuse_spot = false\nclouds = ["lambda"]\n')
    assert not any(k == "ckpt.remote" for k, _ in _keys(lint_spot(on_demand), "warning"))
    assert _keys(lint_spot(on_demand), "error") == []


@pytest.mark.slow
def test_sdk_calls_against_a_real_local_api_server(tmp_path, monkeypatch, sky_python):
    """status / cancel / launch through SkyPilot's real client and a private local API server.

    No cloud credentials and no internet here: launch must fail with a clear message that holds no
    secret value. The API server is SkyPilot's own, started on demand in a private HOME and port.
    """
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SKYPILOT_API_SERVER_LOCAL_PORT", str(free_port()))
    monkeypatch.delenv("SKYPILOT_API_SERVER_ENDPOINT", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    sky_cli = str(Path(sky_python).parent / "sky")
    try:
        assert sp.spot_status("prime-train-test-none", sky_python) is None
        assert sp.spot_cancel("prime-train-test-none", sky_python) is False
        cfg_path, cfg = _config(tmp_path, TWO_NODES)
        task = sp.task_from_config(cfg, config_files=[cfg_path], overrides=[])
        lines: list[str] = []
        with pytest.raises(sp.SkyPilotError) as err:
            sp.launch(task, sky_python, stream=lines.append, timeout_s=300)
        message = str(err.value)
        assert message and SECRET not in message and all(SECRET not in line for line in lines)
        dry = sp.launch(task, sky_python, dry_run=True)
        assert dry["job_ids"] == [] and "HF_TOKEN" in dry["missing_secrets"] and SECRET not in dry["yaml"]
    finally:
        subprocess.run([sky_cli, "api", "stop"], capture_output=True, timeout=120)


# ---------------------------------------------------------------- what to rent, what to install, signals, limits


def test_run_spot_without_a_spot_table_refuses_with_a_table_to_copy(tmp_path):
    """No [spot] is no request for 8 × H100 spot nodes: refused with a [spot] table that, pasted in, works."""
    from enginetools import TINY, run_cli

    config = tmp_path / "run.toml"
    config.write_text(TINY.read_text())
    refused = run_cli("run", "--spot", "--dry-run", str(config), cwd=tmp_path)
    assert refused.returncode == 78, refused.stdout + refused.stderr
    assert "needs a [spot] table" in refused.stderr and "8 × H100" in refused.stderr
    assert sp.SPOT_SNIPPET.strip() in refused.stderr, "the table is printed whole, brackets and all"
    assert "name:" not in refused.stdout, "no task was built"
    config.write_text(TINY.read_text() + "\n" + sp.SPOT_SNIPPET)
    accepted = run_cli("run", "--spot", "--dry-run", str(config), cwd=tmp_path)
    assert accepted.returncode == 0, accepted.stdout + accepted.stderr
    assert 'accelerators: "H100:8"' in accepted.stdout
    config.write_text(TINY.read_text())
    overridden = run_cli("run", "--spot", "--dry-run", str(config), "--spot.accelerators", "A100-80GB:4", cwd=tmp_path)
    assert overridden.returncode == 0 and 'accelerators: "A100-80GB:4"' in overridden.stdout, overridden.stderr


def test_setup_installs_this_source_tree_where_the_file_mount_puts_it(tmp_path):
    """prime-train is not on the package index: the setup pip-installs this checkout, synced to the node. Run the
    setup as a node would, with the mount in place and a pip that checks the path with pip itself (dry run)."""
    cfg_path, cfg = _config(tmp_path, TWO_NODES)
    task = sp.task_from_config(cfg, config_files=[cfg_path], overrides=[])
    assert "prime-train[engine,s3]'" not in task["setup"], "nothing is installed from the package index"
    home = tmp_path / "home"
    mounted = home / sp.REMOTE_SOURCE_DIR.removeprefix("~/")
    mounted.parent.mkdir(parents=True)
    mounted.symlink_to(task["file_mounts"][sp.REMOTE_SOURCE_DIR])  # what SkyPilot's file mount leaves there
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = bin_dir / "pip.jsonl"
    (bin_dir / "pip").write_text(
        f"#!{sys.executable}\nimport json, subprocess, sys\n"
        f"open({str(record)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        "sys.exit(subprocess.call([sys.executable, '-m', 'pip', *sys.argv[1:], '--dry-run', '--no-deps', "
        "'--no-index', '--no-build-isolation']))\n"
    )
    (bin_dir / "pip").chmod(0o755)
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(home)}
    proc = subprocess.run(["bash", "-c", task["setup"]], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Would install prime-train-" in proc.stdout
    [argv] = _calls(record)
    assert argv[-1] == f"{mounted}[engine,s3]"


def test_without_a_source_tree_spot_install_must_say_what_to_install(tmp_path, monkeypatch):
    cfg_path, cfg = _config(tmp_path, TWO_NODES)
    monkeypatch.setattr(sp, "source_tree", lambda: None)  # prime-train installed from a wheel
    with pytest.raises(sp.SpotConfigError, match=r"set spot\.install"):
        sp.task_from_config(cfg, config_files=[cfg_path], overrides=[])
    cfg_path, cfg = _config(tmp_path, TWO_NODES + 'install = "prime-train[engine,s3] @ git+https://h/pt@v1"\n')
    task = sp.task_from_config(cfg, config_files=[cfg_path], overrides=[])
    assert "pip install --disable-pip-version-check 'prime-train[engine,s3] @ git+https://h/pt@v1'" in task["setup"]
    assert sp.REMOTE_SOURCE_DIR not in task["file_mounts"]


def test_sigterm_to_the_node_script_reaches_prime_train_run_and_its_exit_code_comes_back(tmp_path):
    """`prime-train run` is no longer exec'd (its exit code goes through the gate): the script forwards SIGTERM,
    waits for the checkpoint-and-stop, and exits with the run's 75."""
    import signal
    import time

    cfg_path, cfg = _config(tmp_path, TWO_NODES)
    task = sp.task_from_config(cfg, config_files=[cfg_path], overrides=[])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = _fake_prime_train(bin_dir, exit_code=75, sleep_until_term=True)
    home = tmp_path / "home"
    remote = next(k for k in task["file_mounts"] if k.startswith(sp.REMOTE_CONFIG_DIR))
    (home / remote[2:]).parent.mkdir(parents=True)
    (home / remote[2:]).write_text(Path(cfg_path).read_text())
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(home), "SKYPILOT_NODE_IPS": "10.0.0.1",
           "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_RANK": "0"}  # fmt: skip
    proc = subprocess.Popen(["bash", "-c", task["run"]], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip
    deadline = time.monotonic() + 30
    while not _calls(record) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _calls(record), "prime-train run never started"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, out + err
    assert _calls(record)[-1] == "SIGTERM"


def test_lint_spot_guards_the_recovery_limit(tmp_path):
    # the recovery count lives in the bucket (one node here: above one, lint refuses ckpt.remote)
    bucket = ONE_NODE.replace("[ckpt]\n", '[ckpt]\nremote = "s3://bucket/demo"\n')
    _, cfg = _config(tmp_path, bucket + "recover_on_exit_codes = [75, 1]\n")
    [(key, severity, message)] = [p for p in lint_spot(cfg) if "holds 1" in p[2]]
    assert key == ("spot", "recover_on_exit_codes") and severity == "error" and "without limit" in message
    _, no_bucket = _config(tmp_path, ONE_NODE)
    assert any(k == ("spot", "max_recoveries") and "not enforced without ckpt.remote" in m
               for k, _, m in lint_spot(no_bucket))  # fmt: skip
    _, sound = _config(tmp_path, bucket)
    assert not any(k == ("spot", "max_recoveries") for k, _, _ in lint_spot(sound))
