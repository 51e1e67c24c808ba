"""`run --spot`: the run as a SkyPilot managed job, and the calls that launch, watch and cancel it.

SkyPilot 0.14 pins `click<8.2` and wandb 0.31 needs `click>=8.2`, so SkyPilot usually lives in an
environment of its own. prime-train never imports `sky`: every call goes to a Python interpreter
that has it (`find_sky_python`), as a short script fed JSON on stdin that writes its answer as
JSON to a result file. The interpreter is, in order: this one when it can import `sky`; the one
named by PRIME_TRAIN_SKY_PYTHON; the managed venv `prime-train spot install` creates under
$XDG_DATA_HOME/prime-train/skypilot (default ~/.local/share/prime-train/skypilot). Running even
"this one" as a child process keeps SkyPilot's logging, threads and local API server out of the
CLI, and gives every call a timeout.

What the generated task does on each node: installs prime-train (this machine's source tree,
synced to the node by a file mount, since prime-train is not on the package index; or
`spot.install` when set), runs `spot.setup`, then `prime-train run <config files> <overrides>`
with the node count, node rank and rendezvous address taken from SkyPilot's SKYPILOT_NUM_NODES /
SKYPILOT_NODE_RANK / SKYPILOT_NODE_IPS. The supervisor exits 75 after a preemption notice and a
checkpoint; `recover_on_exit_codes` makes SkyPilot bring such a job back on a new node, where
`ckpt.remote` (uploaded with boto3 by prime-train itself, no bucket mount) provides the checkpoint
to resume from. SkyPilot recovers those exit codes without limit, so `prime-train spot
recovery-gate` runs before and after `prime-train run` on each node and counts them in the bucket
(storage.RecoveryCounter): past `spot.max_recoveries` in a row without a new checkpoint, the job
exits 1 instead, saying why.

Secrets: the task lists the names in `spot.secrets` with null values (SkyPilot's "value given at
launch" form). Their values are read from the environment by the SkyPilot process at launch and
handed to `sky.Task.from_yaml_config(..., secrets_overrides=...)`: never written to the YAML, to
argv, to our JSON, or printed. Every line of SkyPilot output we relay is scrubbed of them. A
secret value the config itself holds goes the same way, by reference: a spot.env entry named like
a credential (DB_PASSWORD) becomes a secret of that name, and an override with a secret value
(`--job.env.HF_TOKEN VALUE`, a password in a URL) reaches the nodes' `prime-train run` as
`"$PRIME_TRAIN_SECRET_<KEY>"`, a secret too; their values travel with the task (`SkyTask`) to the
SkyPilot process's environment only.

This module imports nothing heavy; what lint knows of [spot] is in spot_lint.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prime_train.config.schema import Config
from prime_train.integrations.task_yaml import render_yaml
from prime_train.kit.redact import REDACTED, looks_secret_name, redact

DEFAULT_SKYPILOT = "skypilot==0.14.1"
SKY_PYTHON_ENV = "PRIME_TRAIN_SKY_PYTHON"
# where config files outside the workdir are copied to on each node
REMOTE_CONFIG_DIR = "~/.prime-train/configs"
# where this machine's prime-train source tree is copied to on each node, to be pip-installed there
REMOTE_SOURCE_DIR = "~/.prime-train/src"
SKY_REMOTE_WORKDIR = "~/sky_workdir"  # where SkyPilot 0.14 syncs `workdir` (sky/skylet/constants.py)
SOURCE_EXTRAS = "engine,s3"
# what `run --spot` shows a config without a [spot] table: the least a managed job needs, to copy
SPOT_SNIPPET = """[spot]
accelerators = "H100:8"   # GPUs per node, as SkyPilot names them (`sky show-gpus`)
num_nodes = 1             # and distributed.nnodes to match
use_spot = true           # preemptible; the job resumes from ckpt.remote after a preemption
# clouds = ["aws", "gcp"] # empty: any cloud SkyPilot has credentials for
"""

# What SkyPilot 0.14.1 itself declares unsupported per cloud (its clouds/<cloud>.py
# _CLOUD_UNSUPPORTED_FEATURES). Kubernetes offers spot only where the cluster labels spot nodes.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class SkyPilotError(RuntimeError):
    """A SkyPilot call that did not do what was asked; the message says what to do."""


class SkyPilotNotFound(SkyPilotError):
    """No Python interpreter with SkyPilot could be found."""


class SpotConfigError(ValueError):
    """The config cannot become a managed job as it is; the message says what to add or set."""


# ---------------------------------------------------------------- the SkyPilot interpreter


def managed_venv_dir() -> Path:
    """The venv `prime-train spot install` manages (XDG data directory)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "prime-train" / "skypilot"


def _venv_python(prefix: Path) -> Path:
    return prefix / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def find_sky_python(*, required: bool = True) -> str | None:
    """The interpreter SkyPilot calls go to; raises SkyPilotNotFound (or returns None) when there is none."""
    if importlib.util.find_spec("sky") is not None:
        return sys.executable
    named = os.environ.get(SKY_PYTHON_ENV)
    if named:
        path = Path(named).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise SkyPilotNotFound(f"{SKY_PYTHON_ENV}={named} is not an executable Python interpreter")
        return str(path)
    managed = _venv_python(managed_venv_dir())
    if managed.is_file():
        return str(managed)
    if not required:
        return None
    raise SkyPilotNotFound(
        "SkyPilot is not installed for prime-train: run `prime-train spot install` (a venv of its own under "
        f"{managed_venv_dir()}), or set {SKY_PYTHON_ENV} to a Python that has skypilot"
    )


def install_skypilot(
    prefix: Path | None = None,
    version: str = DEFAULT_SKYPILOT,
    *,
    python: str | None = None,
    timeout_s: float = 1800,
) -> Path:
    """Create (or update) a venv holding SkyPilot and return its Python.

    A venv of its own because SkyPilot's click pin conflicts with wandb's. pip's output streams to
    our stdout/stderr so a slow install is visibly alive. `version` is any pip requirement
    ("skypilot[aws,gcp]==0.14.1" adds cloud extras, needed only when this machine runs SkyPilot's
    API server itself rather than talking to a remote one).
    """
    prefix = Path(prefix) if prefix is not None else managed_venv_dir()
    py = _venv_python(prefix)
    if not py.is_file():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        _run_streaming([python or sys.executable, "-m", "venv", str(prefix)], timeout_s, "creating the venv")
    _run_streaming(
        [str(py), "-m", "pip", "install", "--disable-pip-version-check", version], timeout_s, f"pip install {version}"
    )
    return py


def _run_streaming(argv: list[str], timeout_s: float, what: str) -> None:
    try:
        subprocess.run(argv, check=True, timeout=timeout_s)
    except subprocess.CalledProcessError as exc:
        raise SkyPilotError(f"{what} failed (exit code {exc.returncode}); pip's output is above") from None
    except subprocess.TimeoutExpired:
        raise SkyPilotError(f"{what} took longer than {timeout_s:.0f}s and was stopped") from None


# The script every call runs in the SkyPilot interpreter. Plain Python 3.8 syntax (SkyPilot's floor).
# It reads {"op": ..., ...} on stdin and writes {"ok": bool, ...} to $PRIME_TRAIN_SKY_RESULT.
_SKY_SCRIPT = r"""
import json, os, sys, time

def write(obj):
    with open(os.environ["PRIME_TRAIN_SKY_RESULT"], "w") as f:
        json.dump(obj, f, default=str)

def record(r):
    d = r.model_dump() if hasattr(r, "model_dump") else dict(r)
    keep = ("job_id", "task_id", "job_name", "status", "submitted_at", "start_at", "end_at",
            "last_recovered_at", "recovery_count", "failure_reason")
    out = {k: d.get(k) for k in keep}
    out["status"] = getattr(out["status"], "value", out["status"])
    return out

def queue(sky, name):
    fields = ["job_id", "task_id", "job_name", "status", "submitted_at", "start_at", "end_at",
              "last_recovered_at", "recovery_count", "failure_reason"]
    try:
        answer = sky.get(sky.jobs.queue_v2(refresh=False, skip_finished=False, fields=fields, name_match=name))
        records = answer[0]
    except sky.exceptions.ClusterNotUpError:
        return [], "the jobs controller is not up (no managed job has run yet)"
    return [record(r) for r in records if record(r).get("job_name") == name], None

def main():
    req = json.load(sys.stdin)
    try:
        import sky
    except Exception as exc:
        write({"ok": False, "kind": "NotInstalled", "error": "cannot import sky in %s: %s" % (sys.executable, exc)})
        return
    op = req["op"]
    try:
        if op == "version":
            result = {"version": sky.__version__}
        elif op == "validate":
            sky.Task.from_yaml_config(req["task"])
            result = {}
        elif op == "launch":
            cfg = req["task"]
            names = list((cfg.get("secrets") or {}).keys())
            overrides = [(n, os.environ[n]) for n in names if os.environ.get(n)]
            task = sky.Task.from_yaml_config(cfg, secrets_overrides=overrides or None)
            job_ids, _handle = sky.stream_and_get(sky.jobs.launch(task, name=req["name"]))
            result = {"job_ids": job_ids}
        elif op == "status":
            records, note = queue(sky, req["name"])
            result = {"records": records, "note": note, "now": time.time()}
        elif op == "logs":
            code = sky.jobs.tail_logs(name=req["name"], follow=req["follow"], tail=req.get("tail"),
                                      output_stream=sys.stdout)
            result = {"exit_code": code}
        elif op == "cancel":
            sky.get(sky.jobs.cancel(name=req["name"]))
            result = {}
        else:
            raise ValueError("unknown op %r" % op)
    except BaseException as exc:
        write({"ok": False, "kind": type(exc).__name__, "error": str(exc)})
        return
    result["ok"] = True
    write(result)

main()
"""


def _secret_values(names: list[str] | None, values: dict[str, str] | None = None) -> list[str]:
    """Values of the named variables, from `values` or our environment (what must never be shown)."""
    env = {**os.environ, **(values or {})}
    return [v for n in names or [] if len(v := env.get(n, "")) >= 4]


def scrub(text: str, secret_names: list[str] | None = None, values: dict[str, str] | None = None) -> str:
    """Text fit to show: ANSI colours removed, known token shapes and the listed variables' values hidden
    (`values`: those the config holds, else this environment's)."""
    text = redact(_ANSI.sub("", text))
    for value in sorted(_secret_values(secret_names, values), key=len, reverse=True):
        text = text.replace(value, REDACTED)
    return text


def call_sky(
    sky_python: str | None,
    request: dict[str, Any],
    *,
    timeout_s: float | None = 120,
    stream: Callable[[str], None] | None = None,
    secret_names: list[str] | None = None,
    secret_values: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run one request in the SkyPilot interpreter; its answer, or SkyPilotError with a clear message.

    Output of the child (SkyPilot's own progress lines) goes through `stream` line by line, scrubbed,
    when given; otherwise it is kept (scrubbed) to explain a failure. `secret_values` are set in the
    interpreter's environment (where the launch reads secrets from), never in the request.
    """
    python = sky_python or find_sky_python()
    fd, result_path = tempfile.mkstemp(prefix="prime-train-sky-", suffix=".json")
    os.close(fd)
    env = {**os.environ, **(secret_values or {}), "PRIME_TRAIN_SKY_RESULT": result_path, "PYTHONUNBUFFERED": "1"}
    captured: list[str] = []
    try:
        try:
            proc = subprocess.Popen(
                [python, "-c", _SKY_SCRIPT],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                env=env,
            )
        except OSError as exc:
            raise SkyPilotNotFound(f"cannot run the SkyPilot interpreter {python}: {exc.strerror}") from None
        timed_out = threading.Event()

        def _kill() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(timeout_s, _kill) if timeout_s else None
        if timer:
            timer.daemon = True
            timer.start()
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(request))
            proc.stdin.close()
            for line in proc.stdout:
                clean = scrub(line.rstrip("\n"), secret_names, secret_values)
                if stream is not None:
                    stream(clean)
                else:
                    captured.append(clean)
            proc.wait()
        finally:
            if timer:
                timer.cancel()
        if timed_out.is_set():
            raise SkyPilotError(f"SkyPilot did not answer `{request['op']}` within {timeout_s:.0f}s")
        try:
            answer = json.loads(Path(result_path).read_text() or "null")
        except (OSError, ValueError):
            answer = None
    finally:
        Path(result_path).unlink(missing_ok=True)
    if not isinstance(answer, dict):
        tail = "\n".join(captured[-15:])
        raise SkyPilotError(
            f"the SkyPilot interpreter {python} exited with code {proc.returncode} without an answer"
            + (f":\n{tail}" if tail else "")
        )
    if not answer.get("ok"):
        raise SkyPilotError(_explain(answer, python, secret_names, secret_values))
    return answer


def _explain(
    answer: dict[str, Any], python: str, secret_names: list[str] | None, values: dict[str, str] | None = None
) -> str:
    """SkyPilot's failure in words that say what to do (the common ones), scrubbed of secrets."""
    kind = str(answer.get("kind") or "Error")
    message = scrub(str(answer.get("error") or "").strip(), secret_names, values)
    low = message.lower()
    if kind == "NotInstalled":
        return f"{message}; run `prime-train spot install` or set {SKY_PYTHON_ENV}"
    if "ApiServerConnectionError" in kind or "could not connect to skypilot api server" in low:
        return (
            "cannot reach the SkyPilot API server: set SKYPILOT_API_SERVER_ENDPOINT (and, for a team server, "
            f"SKYPILOT_SERVICE_ACCOUNT_TOKEN) or run `sky api login` ({kind}: {message})"
        )
    if any(s in message for s in ("NameResolutionError", "ConnectionError", "Max retries exceeded")):
        return (
            "SkyPilot could not reach the network (its catalog on raw.githubusercontent.com, the clouds' APIs or "
            f"the API server): check connectivity and proxies ({kind}: {message})"
        )
    if kind in ("NoCloudAccessError", "NotSupportedError", "ResourcesUnavailableError") or any(
        s in low for s in ("no cloud access", "no cloud is enabled", "credentials", "sky check")
    ):
        return (
            "SkyPilot cannot use any cloud here (no credentials, or none fits the request): run "
            f"`{Path(python).parent / 'sky'} check` to see which clouds are enabled ({kind}: {message})"
        )
    return f"SkyPilot {kind}: {message}"


# ---------------------------------------------------------------- the task


def job_name(cfg: Config) -> str:
    return cfg.spot.name or cfg.run.name


def _remote_config_paths(cfg: Config, config_files: list[str]) -> tuple[list[str], dict[str, str]]:
    """Where each config file is on the nodes, and the file_mounts that put those outside the workdir there.

    Inside spot.workdir a file keeps its path relative to the workdir (SkyPilot syncs the workdir
    and runs the job in it); any other file is copied to REMOTE_CONFIG_DIR under a numbered name.
    """
    workdir = Path(cfg.spot.workdir).expanduser().resolve() if cfg.spot.workdir else None
    remote: list[str] = []
    mounts: dict[str, str] = {}
    for i, name in enumerate(config_files):
        local = Path(name).expanduser().resolve()
        if workdir is not None and local.is_relative_to(workdir):
            remote.append(local.relative_to(workdir).as_posix())
            continue
        target = f"{REMOTE_CONFIG_DIR}/{i}-{local.name}"
        mounts[target] = str(local)
        remote.append(target)
    return remote, mounts


def source_tree() -> Path | None:
    """The prime-train source tree this process runs from (a checkout: its pyproject.toml names prime-train), or
    None when prime-train was installed from a wheel, which leaves no tree to sync."""
    root = Path(__file__).resolve().parents[2]
    pyproject = root / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    return root if re.search(r'(?m)^name\s*=\s*"prime-train"\s*$', text) else None


def require_spot_section(cfg: Config) -> None:
    """Refuse a config that says nothing about what to rent: [spot]'s defaults are 8 × H100 spot nodes."""
    if "spot" in cfg.model_fields_set:
        return
    raise SpotConfigError(
        "run --spot needs a [spot] table saying what to rent, and this config has none (the defaults alone would "
        "rent 8 × H100 spot nodes with 256 GB disks). Add one to the config, e.g.\n\n"
        + SPOT_SNIPPET
        + "\nor give it as overrides (--spot.accelerators H100:8); `prime-train lint` then checks it against "
        "SkyPilot's limits"
    )


def _install_lines(cfg: Config) -> tuple[list[str], dict[str, str]]:
    """The setup commands that install prime-train on a node, and the file mounts they need."""
    if cfg.spot.install:
        return [f"pip install --disable-pip-version-check {shlex.quote(cfg.spot.install)}"], {}
    tree = source_tree()
    if tree is None:
        raise SpotConfigError(
            "spot.install is unset and this prime-train was installed from a wheel, not a source checkout, so there "
            "is no source tree to sync to the nodes (prime-train is not on the package index): set spot.install to "
            "what the nodes should pip-install, e.g. a git URL ('prime-train[engine,s3] @ git+https://github.com/"
            "prime-train/prime-train@v0.1.0') or a wheel you publish"
        )
    # SkyPilot syncs the tree as it syncs a workdir (.skyignore, else .gitignore: no .venv, no runs/); a tree
    # inside spot.workdir is already there, under SkyPilot's remote workdir
    workdir = Path(cfg.spot.workdir).expanduser().resolve() if cfg.spot.workdir else None
    mounts: dict[str, str] = {}
    if workdir is not None and tree.is_relative_to(workdir):
        remote = "/".join(p for p in (SKY_REMOTE_WORKDIR.removeprefix("~/"), tree.relative_to(workdir).as_posix())
                          if p not in ("", "."))  # fmt: skip
        how = "synced with spot.workdir"
    else:
        remote, mounts = REMOTE_SOURCE_DIR.removeprefix("~/"), {REMOTE_SOURCE_DIR: str(tree)}
        how = "synced to the node (file_mounts)"
    return [
        f"# this machine's prime-train source, {how}; the [engine] extra's torch is the CUDA build on a GPU node",
        f'pip install --disable-pip-version-check "$HOME/{_in_double_quotes(remote)}[{SOURCE_EXTRAS}]"',
    ], mounts


def _in_double_quotes(text: str) -> str:
    """`text` escaped for the inside of a double-quoted shell word: the path is the user's (a folder named
    `my "runs" $x`), and inside double quotes only $, `, " and \\ are special."""
    return re.sub(r'([$`"\\])', r"\\\1", text)


def _setup_script(install: list[str], cfg: Config) -> str:
    lines = ["set -euo pipefail", *install, *cfg.spot.setup]
    return "\n".join(lines) + "\n"


class _ShellWord(str):
    """An argument of the run script that is already shell text (a reference to a secret variable)."""


def _remote_arg(arg: str) -> str:
    if isinstance(arg, _ShellWord):
        return str(arg)
    # ~ in a remote config path must reach the shell unquoted to expand
    if arg.startswith("~/"):
        return "~/" + shlex.quote(arg[2:])
    return shlex.quote(arg)


class SkyTask(dict):
    """A SkyPilot task (the YAML-shaped dict) and the values of its `secrets` the config holds itself, which
    `launch` puts in the SkyPilot process's environment: they are never in the dict, so never in the YAML."""

    def __init__(self, task: dict[str, Any], secret_values: dict[str, str] | None = None):
        super().__init__(task)
        self.secret_values = dict(secret_values or {})


def _is_secret_value(key: str, value: str) -> bool:
    """Whether a config value must not be written into the task: a credential by its key's name, or by its shape."""
    bare = value.strip().strip("\"'")
    if len(bare) < 4 or bare.startswith("$") or bare in ("***", REDACTED):
        return False
    return looks_secret_name(key) or redact(value) != value


def _secret_env(env: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """spot.env split into what the task may show (envs) and the credentials it passes as secrets by name."""
    shown, secret = {}, {}
    for name, value in env.items():
        (secret if _is_secret_value(name, value) else shown)[name] = value
    return shown, secret


def _override_secrets(overrides: list[str]) -> tuple[list[str], dict[str, str]]:
    """The overrides as the nodes get them, each secret value replaced by a reference to a secret variable
    (`--spot.env.NAME "$NAME"`, `--job.env.HF_TOKEN "$PRIME_TRAIN_SECRET_JOB_ENV_HF_TOKEN"`), and those variables."""
    out: list[str] = []
    secrets: dict[str, str] = {}
    i = 0
    while i < len(overrides):
        token = overrides[i]
        key, eq, inline = token.partition("=")
        is_override = token.startswith("--") and "." in key
        value = inline if eq else overrides[i + 1] if is_override and i + 1 < len(overrides) else None
        names_only = key == "--spot.secrets"  # a list of variable names, not a value
        if not is_override or value is None or names_only or not _is_secret_value(key.rsplit(".", 1)[-1], value):
            out.append(token)
            i += 1
            continue
        dotted = key[2:]
        if dotted.startswith("spot.env.") and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", dotted[len("spot.env.") :]):
            name = dotted[len("spot.env.") :]  # spot.env's own variable on the node: the same value
        else:
            name = "PRIME_TRAIN_SECRET_" + re.sub(r"[^A-Za-z0-9]+", "_", dotted).strip("_").upper()
        secrets[name] = value
        if eq:
            out.append(_ShellWord(shlex.quote(f"{key}=") + f'"${name}"'))
            i += 1
        else:
            out += [token, _ShellWord(f'"${name}"')]
            i += 2
    return out, secrets


def _run_script(cfg: Config, remote_configs: list[str], overrides: list[str]) -> str:
    args = " ".join(_remote_arg(a) for a in [*remote_configs, *overrides])
    port = cfg.distributed.master_port
    # not `exec prime-train run`: its exit code goes through the recovery gate, so the script forwards SIGTERM
    # itself (wait returns early when a trapped signal arrives: wait again for the real exit code)
    return (
        "set -uo pipefail\n"
        "# rendezvous on the first node SkyPilot lists; node count and rank come from SkyPilot too\n"
        'MASTER_ADDR="$(echo "$SKYPILOT_NODE_IPS" | head -n1)"\n'
        "# SkyPilot recovers recover_on_exit_codes without limit: the gate counts recoveries in the bucket\n"
        f"prime-train spot recovery-gate {args} || exit $?\n"
        f"prime-train run {args} \\\n"
        '  --distributed.nnodes "$SKYPILOT_NUM_NODES" \\\n'
        '  --distributed.node_rank "$SKYPILOT_NODE_RANK" \\\n'
        f'  --distributed.rdzv_endpoint "$MASTER_ADDR:{port}" &\n'
        "child=$!\n"
        "trapped=0\n"
        "trap 'trapped=1; kill -TERM \"$child\" 2>/dev/null' TERM INT\n"
        'wait "$child"; code=$?\n'
        'while [ "$trapped" = 1 ]; do trapped=0; wait "$child"; code=$?; done\n'
        f'exec prime-train spot recovery-gate {args} --exited "$code"\n'
    )


def _ckpt_mount(cfg: Config) -> dict[str, Any]:
    """spot.ckpt_mount as a file mount: the bucket at ckpt.dir on every node, cached locally (SkyPilot's
    MOUNT_CACHED: a checkpoint is written at local disk speed and uploaded behind it)."""
    from prime_train.integrations.spot_lint import ckpt_mount_problem

    if cfg.spot.ckpt_mount is None:
        return {}
    if problem := ckpt_mount_problem(cfg):
        raise SpotConfigError(problem)
    return {cfg.ckpt.dir: {"source": cfg.spot.ckpt_mount, "mode": "MOUNT_CACHED"}}


def task_from_config(cfg: Config, *, config_files: list[str], overrides: list[str]) -> dict[str, Any]:
    """The SkyPilot task (as a YAML-shaped dict) that runs this config as a managed job.

    `config_files` and `overrides` are what the user gave `prime-train run --spot` (without
    `--spot`); each node runs `prime-train run` on the same files and overrides.
    """
    require_spot_section(cfg)
    spot = cfg.spot
    install, source_mounts = _install_lines(cfg)
    resources: dict[str, Any] = {"accelerators": spot.accelerators, "use_spot": spot.use_spot}
    if spot.infra:
        resources["infra"] = spot.infra
    elif len(spot.clouds) == 1:
        resources["infra"] = spot.clouds[0]
    elif spot.clouds:
        resources["any_of"] = [{"infra": c} for c in sorted(set(spot.clouds))]
    resources["disk_size"] = spot.disk_size_gb
    resources["job_recovery"] = {
        "strategy": spot.recovery_strategy,
        "max_restarts_on_errors": spot.max_restarts_on_errors,
        "recover_on_exit_codes": sorted(set(spot.recover_on_exit_codes)),
    }
    remote_configs, paths = _remote_config_paths(cfg, config_files)
    mounts: dict[str, Any] = {**paths, **source_mounts, **_ckpt_mount(cfg)}
    task: dict[str, Any] = {"name": job_name(cfg), "resources": resources, "num_nodes": spot.num_nodes}
    if spot.workdir:
        task["workdir"] = str(Path(spot.workdir).expanduser().resolve())
    if mounts:
        task["file_mounts"] = dict(sorted(mounts.items()))
    shown_env, secret_env = _secret_env(spot.env)  # a credential in spot.env is passed by name, as a secret
    forwarded, override_secrets = _override_secrets(overrides)
    secret_values = {**override_secrets, **secret_env}
    envs = {"PYTHONUNBUFFERED": "1", **shown_env}
    task["envs"] = dict(sorted(envs.items()))
    if spot.secrets or secret_values:
        task["secrets"] = dict.fromkeys(sorted({*spot.secrets, *secret_values}))
    task["setup"] = _setup_script(install, cfg)
    task["run"] = _run_script(cfg, remote_configs, forwarded)
    return SkyTask(task, secret_values)


# ---------------------------------------------------------------- SkyPilot calls


def validate_task(task: dict[str, Any], sky_python: str | None = None, *, timeout_s: float = 120) -> list[str]:
    """Errors SkyPilot's own schema finds in `task` (offline: `sky.Task.from_yaml_config`); [] when valid."""
    try:
        call_sky(sky_python, {"op": "validate", "task": task}, timeout_s=timeout_s)
    except SkyPilotNotFound:
        raise
    except SkyPilotError as exc:
        return [str(exc)]
    return []


def sky_version(sky_python: str | None = None) -> str:
    return str(call_sky(sky_python, {"op": "version"}, timeout_s=120)["version"])


def launch(
    task: dict[str, Any],
    sky_python: str | None = None,
    dry_run: bool = False,
    *,
    stream: Callable[[str], None] | None = None,
    timeout_s: float = 3600,
) -> dict[str, Any]:
    """Launch `task` as a SkyPilot managed job (or, with dry_run, only validate and render it).

    Returns {"name", "yaml", "job_ids", "missing_secrets"}. Secret names whose variable is unset or
    empty here are dropped from the launched task (their names are reported; SkyPilot would otherwise
    look them up in a secrets manager and fail).
    """
    name = str(task.get("name") or "prime-train")
    names = list((task.get("secrets") or {}).keys())
    values = {n: v for n, v in getattr(task, "secret_values", {}).items() if v}  # those the config holds
    missing = [n for n in names if not values.get(n) and not os.environ.get(n)]  # unset or empty (an unset CI secret)
    launched = dict(task)  # a plain dict: what goes to SkyPilot as JSON holds names only
    if task.get("secrets") is not None:
        kept = {n: None for n in names if n not in missing}
        if kept:
            launched["secrets"] = kept
        else:
            launched.pop("secrets")
    result: dict[str, Any] = {"name": name, "yaml": render_yaml(task), "job_ids": [], "missing_secrets": missing}
    errors = validate_task(launched, sky_python)
    if errors:
        raise SkyPilotError("SkyPilot rejects the generated task:\n" + "\n".join(errors))
    if dry_run:
        return result
    answer = call_sky(
        sky_python,
        {"op": "launch", "task": launched, "name": name},
        timeout_s=timeout_s,
        stream=stream or (lambda line: print(line, file=sys.stderr, flush=True)),
        secret_names=names,
        secret_values=values,
    )
    result["job_ids"] = list(answer.get("job_ids") or [])
    return result


FAILURE_STATUSES = ("FAILED", "FAILED_SETUP", "FAILED_PRECHECKS", "FAILED_NO_RESOURCE", "FAILED_CONTROLLER")


def spot_status(
    name: str, sky_python: str | None = None, *, recent_s: float = 86400, timeout_s: float = 180
) -> dict[str, Any] | None:
    """The newest managed job called `name`: status, times, recoveries; None when SkyPilot has none.

    `recent_failures` counts this name's jobs that ended in a failure status and were submitted in
    the last `recent_s` seconds: the monitor's brake against relaunching a job that keeps dying.
    """
    answer = call_sky(sky_python, {"op": "status", "name": name}, timeout_s=timeout_s)
    records = [r for r in answer.get("records") or [] if isinstance(r, dict)]
    if not records:
        return None
    newest = max(records, key=lambda r: (r.get("job_id") or 0, r.get("task_id") or 0))
    now = float(answer.get("now") or 0)
    recent = [
        r
        for r in records
        if r.get("status") in FAILURE_STATUSES and float(r.get("submitted_at") or 0) >= now - recent_s
    ]
    return {**newest, "status": str(newest.get("status") or ""), "recent_failures": len(recent), "jobs": len(records)}


def spot_logs(
    name: str,
    sky_python: str | None = None,
    *,
    follow: bool = False,
    tail: int | None = None,
    stream: Callable[[str], None] | None = None,
    secret_names: list[str] | None = None,
) -> int | None:
    """Print the managed job's logs (scrubbed) through `stream`; SkyPilot's exit code for the job."""
    answer = call_sky(
        sky_python,
        {"op": "logs", "name": name, "follow": follow, "tail": tail},
        timeout_s=None if follow else 600,
        stream=stream or (lambda line: print(line, flush=True)),
        secret_names=secret_names,
    )
    code = answer.get("exit_code")
    return int(code) if isinstance(code, int) else None


def spot_cancel(name: str, sky_python: str | None = None, *, timeout_s: float = 600) -> bool:
    """Cancel the managed job `name` (SkyPilot tears its cluster down); False when none was in progress."""
    try:
        call_sky(sky_python, {"op": "cancel", "name": name}, timeout_s=timeout_s)
    except SkyPilotError as exc:
        if "no in-progress managed job" in str(exc).lower():
            return False
        raise
    return True


def api_server_problem() -> str | None:
    """Why SkyPilot calls from here would see the wrong jobs, or None.

    On a throwaway CI runner SkyPilot would start a private local API server that knows none of
    the user's managed jobs: a monitor there must talk to the user's own API server.
    """
    if os.environ.get("GITHUB_ACTIONS") == "true" and not os.environ.get("SKYPILOT_API_SERVER_ENDPOINT"):
        return (
            "SKYPILOT_API_SERVER_ENDPOINT is not set: on a CI runner SkyPilot would start a private API server "
            "that knows none of your managed jobs; point it at your SkyPilot API server (a repository secret)"
        )
    return None
