"""The before-you-pay commands and the spot commands through the real CLI: arguments, exit codes, JSON shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from prime_train.contract import ExitCode

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "data" / "model_configs"


def cli(*args: str, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prime_train", *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=cwd,
    )  # fmt: skip


def test_verify_model_json_and_exit_codes(tmp_path):
    ok = cli("verify-model", str(CONFIGS / "Qwen2.5-7B-Instruct"), "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["num_parameters"] == 7_615_616_512 and report["vllm_supported"] is True
    assert {"architecture", "multimodal", "tool_calling", "max_model_len"} <= set(report)
    vl = cli("verify-model", str(CONFIGS / "Qwen2.5-VL-7B-Instruct"), "--json")
    assert vl.returncode == 1 and json.loads(vl.stdout)["multimodal"] is True
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    missing = cli("verify-model", "no-such-org/no-such-model", env=env)
    assert missing.returncode == ExitCode.CONFIG and "path" in missing.stderr  # bad input


def test_models_list_shows_the_registry():
    result = cli("models", "list", "--json")
    assert result.returncode == 0, result.stderr
    assert "Qwen" in result.stdout and "vllm_version" in result.stdout
    table = cli("models", "list")
    assert table.returncode == 0 and "Qwen" in table.stdout


def test_memory_from_flags_and_from_a_config():
    flags = cli("memory", "--model", str(CONFIGS / "Llama-3.1-8B" / "config.json"), "--seq-len", "4096",
                "--gpus-per-node", "8", "--strategy", "fsdp", "--gpu", "H100", "--json")  # fmt: skip
    assert flags.returncode == 0, flags.stderr
    fsdp = json.loads(flags.stdout)
    plain = json.loads(
        cli(
            "memory",
            "--model",
            str(CONFIGS / "Llama-3.1-8B" / "config.json"),
            "--seq-len",
            "4096",
            "--gpu",
            "H100",
            "--json",
        ).stdout
    )
    assert json.dumps(fsdp) != json.dumps(plain)
    tiny = cli("memory", str(REPO / "configs" / "tiny-sft.toml"), "--json")
    assert tiny.returncode == 0, tiny.stderr
    bad = cli("memory", "--model", str(CONFIGS / "Llama-3.1-8B" / "config.json"), "--strategy", "zero9")
    assert bad.returncode == 78 and "zero9" in bad.stderr


def test_cost_with_a_given_step_time_and_a_price_file(tmp_path):
    prices = tmp_path / "p.toml"
    prices.write_text('[providers.mycloud]\nas_of = "2026-11-01"\n[providers.mycloud.prices]\n'
                      '"H100 SXM" = { on_demand = 2.0, spot = 1.0 }\n')  # fmt: skip
    result = cli("cost", str(REPO / "configs" / "tiny-sft.toml"), "--gpu", "H100", "--step-time", "36",
                 "--prices", str(prices), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    (row,) = json.loads(result.stdout)["rows"]
    mine = next(p for p in row["providers"] if p["provider"] == "mycloud")
    # 300 steps × 36 s = 3 GPU-hours on one GPU (± 10 %): $6 on demand and $3 spot at the user's prices
    assert row["gpu_hours"][1] == 3.0
    assert mine["on_demand_usd"][1] == 6.0 and mine["spot_usd"][1] == 3.0
    bad = cli("cost", "--gpu", "Z80")
    assert bad.returncode == 78 and "Z80" in bad.stderr


def test_run_spot_dry_run_prints_a_task_without_skypilot(tmp_path):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    env.pop("PRIME_TRAIN_SKY_PYTHON", None)
    result = cli("run", "--spot", "configs/examples/spot.toml", "--dry-run", env=env, cwd=REPO)
    if "checked with SkyPilot" in result.stderr:  # this interpreter has skypilot itself
        assert result.returncode == 0
    else:
        assert result.returncode == 0, result.stderr
        assert "spot install" in result.stderr
    assert "recover_on_exit_codes: [75]" in result.stdout and "num_nodes: 1" in result.stdout
    lambda_spot = cli("run", "--spot", "configs/examples/spot.toml", "--dry-run", "--spot.clouds", '["lambda"]',
                      env=env, cwd=REPO)  # fmt: skip
    assert lambda_spot.returncode == 78 and "lambda" in lambda_spot.stderr


def test_monitor_without_skypilot_exits_with_the_bad_input_code_and_says_how_to_install(tmp_path):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "xdg")}
    env.pop("PRIME_TRAIN_SKY_PYTHON", None)
    env.pop("GITHUB_ACTIONS", None)
    result = cli("monitor", "configs/examples/spot.toml", env=env, cwd=REPO)
    assert result.returncode == ExitCode.CONFIG and "spot install" in result.stderr


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# --measure prices the GPU it measured on; on a CPU it refuses up front (tests/test_cost.py)
@pytest.mark.gpu
@pytest.mark.skipif(not _cuda(), reason="--measure times this machine's GPU: needs one (-m gpu on a GPU machine)")
def test_cost_measures_the_step_time_with_a_short_profile(tmp_path):
    result = cli("cost", str(REPO / "configs" / "tiny-sft.toml"), "--measure", "--json",
                 "--run.output_dir", str(tmp_path), "--logging.tensorboard", "false")  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (row,) = json.loads(result.stdout)["rows"]
    assert row["basis"].startswith("measured") and row["step_time_s"][1] > 0
    assert "measured" in result.stderr and (tmp_path / "tiny-sft-profile" / "profile" / "summary.json").is_file()
    assert not (tmp_path / "tiny-sft" / "checkpoints").exists(), "the real run's directory is not touched"
