"""A rollout worker on GPU: vLLM's OpenAI-compatible server with a route that loads the trainer's new weights.

`python -m prime_train.rl.vllm_server --config RUN/config.toml --index I` starts vLLM's own server
(`vllm serve`'s code path) on inference.base_port + I, with two routes added:

- POST /update_weights {"path", "step"}: every vLLM worker process loads the safetensors in `path`
  into its model in place (the trainer writes them to <run>/weights/step-N), the prefix cache is
  reset (its KV entries came from the old weights), and the answer is {"step": step};
- GET /weights_step: {"step": N}, the step of the weights being served.

The loading runs inside vLLM's workers through a worker extension (`WeightReloadExtension` below,
passed as --worker-extension-cls) and engine_client.collective_rpc, the way prime-rl and other RL
stacks extend vLLM. The trainer's client (rl/client.py) speaks the same protocol to this
server and to the embedded CPU worker.

Written for vLLM 0.10.2 to 0.11.x (V1 engine only; `VLLM_USE_V1` is gone from 0.11): the names used are
`vllm.entrypoints.openai.api_server.{router, run_server}`, `vllm.entrypoints.openai.cli_args.make_arg_parser`,
`FlexibleArgumentParser` (vllm.utils.argparse_utils from 0.11, vllm.utils before), the `--worker-extension-cls`
and `--return-token-ids`-style completion field `return_token_ids`, and `EngineClient.collective_rpc` /
`reset_prefix_cache`. Another vLLM version gets a warning at start, not a refusal.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prime_train.config.schema import Config
from prime_train.contract import ExitCode

logger = logging.getLogger("prime_train.rl.vllm_server")

TESTED_VLLM = ((0, 10, 2), (0, 12, 0))  # [from, to): the versions this server was written against
EXTENSION = "prime_train.rl.vllm_server.WeightReloadExtension"


def vllm_args(cfg: Config, index: int) -> list[str]:
    """`vllm serve` arguments of worker `index`, from the run config (a pure function: tested on CPU)."""
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
        "--gpu-memory-utilization", str(inf.gpu_memory_utilization),
        "--tensor-parallel-size", str(inf.gpus_per_worker),
        "--seed", str(cfg.run.seed + index),
        "--worker-extension-cls", EXTENSION,
    ]  # fmt: skip
    if m.tokenizer:
        args += ["--tokenizer", m.tokenizer]
    if inf.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", inf.tool_call_parser]
    return args + list(inf.extra_args)


def installed_vllm() -> tuple[int, ...] | None:
    from importlib import metadata

    try:
        raw = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None
    parts = []
    for piece in raw.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def version_warning(version: tuple[int, ...] | None) -> str | None:
    """A line to log when the installed vLLM is outside the range this server was written for."""
    if version is None:
        return "vllm is not installed: pip install vllm (it brings its own CUDA torch; GPU machines only)"
    lo, hi = TESTED_VLLM
    if not (lo <= version < hi):
        shown = ".".join(map(str, version))
        return (
            f"vLLM {shown} is outside the versions this server was written for ({'.'.join(map(str, lo))} to before "
            f"{'.'.join(map(str, hi))}); if /update_weights fails, pin vllm in that range"
        )
    return None


# ---------------------------------------------------------------- inside vLLM's worker processes


def iter_safetensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, Any]]:
    """(name, tensor) of every tensor in a directory of safetensors files (sharded or not), file by file."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


class WeightReloadExtension:
    """Mixed into each vLLM worker by --worker-extension-cls: methods callable through collective_rpc."""

    def prime_train_load_weights(self, path: str) -> int:
        """Load HF-named safetensors from `path` into the served model in place; returns tensors loaded."""
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        count = 0

        def counted():
            nonlocal count
            for item in iter_safetensors(path):
                count += 1
                yield item

        # vLLM models map HF names (and fused q/k/v, gate/up projections) in their own load_weights
        model.load_weights(weights=counted())
        return count


# ---------------------------------------------------------------- the HTTP routes


class WeightRoutes:
    """The two added routes over an engine client (vLLM's EngineClient, or anything with the same two calls)."""

    def __init__(self) -> None:
        self.step = 0

    async def update_weights(self, engine, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        path, step = body.get("path"), body.get("step")
        if not isinstance(path, str) or not isinstance(step, int):
            return 400, {"error": {"message": 'body must be {"path": str, "step": int}', "type": "BadRequest"}}
        if not Path(path).is_dir():
            return 400, {"error": {"message": f"weights directory {path} does not exist", "type": "BadRequest"}}
        await engine.collective_rpc("prime_train_load_weights", args=(path,))
        await engine.reset_prefix_cache()  # cached KV blocks were computed by the old weights
        self.step = step
        return 200, {"step": step}

    async def weights_step(self) -> tuple[int, dict[str, Any]]:
        return 200, {"step": self.step}


def _parser():
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before 0.11
        from vllm.utils import FlexibleArgumentParser
    from vllm.entrypoints.openai.cli_args import make_arg_parser

    return make_arg_parser(FlexibleArgumentParser(description="prime-train rollout worker (vLLM)"))


def serve(cfg: Config, index: int) -> None:
    """Run vLLM's OpenAI server with the weight routes; returns when the server stops."""
    import uvloop
    from fastapi import Request
    from fastapi.responses import JSONResponse
    from vllm.entrypoints.openai.api_server import router, run_server

    warning = version_warning(installed_vllm())
    if warning:
        logger.warning(warning)
    routes = WeightRoutes()

    @router.post("/update_weights")
    async def update_weights(request: Request):
        status, body = await routes.update_weights(request.app.state.engine_client, await request.json())
        return JSONResponse(body, status_code=status)

    @router.get("/weights_step")
    async def weights_step(request: Request):
        status, body = await routes.weights_step()
        return JSONResponse(body, status_code=status)

    args = _parser().parse_args(vllm_args(cfg, index))
    uvloop.run(run_server(args))


def main(argv: list[str] | None = None) -> None:
    from prime_train.config.loader import ConfigError, load_config

    parser = argparse.ArgumentParser(prog="python -m prime_train.rl.vllm_server", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved run config (TOML)")
    parser.add_argument("--index", type=int, default=0, help="worker index: listens on inference.base_port + index")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stdout)
    try:
        cfg = load_config([args.config])
        vllm_args(cfg, args.index)
    except (ConfigError, ValueError) as exc:
        print(f"configuration error: {exc}", file=sys.stderr)
        sys.exit(ExitCode.CONFIG)
    if installed_vllm() is None:
        print(f"configuration error: {version_warning(None)}", file=sys.stderr)
        sys.exit(ExitCode.CONFIG)
    serve(cfg, args.index)


if __name__ == "__main__":
    main()
