"""The embedded rollout worker: a real HF model behind vLLM's OpenAI-compatible HTTP, for CPU runs.

`python -m prime_train.rl.worker --config RUN/config.toml --index I` serves on
inference.host:inference.base_port + I. vLLM is the other backend (rl/vllm_server.py); this worker speaks
the same completions wire format and treats the context as vLLM 0.30+ does (max_tokens clamped to the room
the prompt leaves, with vLLM's words for what it refuses), so the trainer cannot tell them apart. Its weight
route is its own (/update_weights below; the client speaks vLLM's dev-mode routes to vLLM). The batching
generation engine behind it is rl/generation.py.

Endpoints: GET /health ("ok" once the model is loaded, 503 before), GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, POST /update_weights {"path", "step"}, GET /weights_step, and GET /metrics:
JSON counters {"forward_passes", "batches", "sequences_served", "requests", "weights_step", "busy_s",
"queued_sequences"}, where forward_passes counts model forwards (one per generated token position of a batch)
and busy_s the seconds spent generating.

Published weights: the trainer exports HF weights to <run_dir>/weights/step-<N> (written as .tmp, renamed
when whole); a worker starts from the newest one that loads, so a restarted worker serves the current policy.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import signal
import sys
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prime_train.contract import ExitCode
from prime_train.engine.lifeline import watch_supervisor
from prime_train.rl.generation import (
    NO_ROOM_MESSAGE,
    Engine,
    Job,
    RequestError,
    SamplingParams,
    Sequence,
    latest_published_weights,
    max_tokens_too_large_message,
    prompt_too_long_message,
    unavailable,
)

logger = logging.getLogger("prime_train.rl.worker")

MAX_BODY_BYTES = 8 << 20  # a batch of token-id prompts is well under this; a bigger body is a client bug
SOCKET_TIMEOUT_S = 30.0  # a client that stalls mid-request or mid-response loses its connection


# ---------------------------------------------------------------- the OpenAI wire format


def _int_field(body: dict, key: str, default: int | None, minimum: int | None = None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{key}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise RequestError(f"'{key}' must be at least {minimum}, got {value}")
    return value


def _float_field(body: dict, key: str, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{key}' must be a number, got {value!r}")
    return float(value)


def parse_sampling(body: dict, *, chat: bool) -> tuple[int, SamplingParams]:
    """n and the sampling parameters of a request body, checked."""
    n = _int_field(body, "n", 1, minimum=1)
    max_tokens = body.get("max_completion_tokens") if chat else None
    max_tokens = _int_field({"max_tokens": max_tokens or body.get("max_tokens", 16)}, "max_tokens", 16, minimum=1)
    temperature = _float_field(body, "temperature", 1.0)
    top_p = _float_field(body, "top_p", 1.0)
    if temperature < 0:
        raise RequestError(f"'temperature' must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p}")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise RequestError("'stop' must be a string or a list of strings")
    if chat:
        logprobs = (_int_field(body, "top_logprobs", 0, minimum=0) or 0) if body.get("logprobs") else None
    else:
        logprobs = _int_field(body, "logprobs", None, minimum=0)
    seed = _int_field(body, "seed", None)
    return n, SamplingParams(max_tokens, temperature, top_p, seed, stop, logprobs)


def prompt_token_ids(engine: Engine, prompt: Any) -> list[list[int]]:
    """The token ids of a completions `prompt`: a string, a list of strings, a token list or token lists."""
    tok = engine.tokenizer
    if isinstance(prompt, str):
        prompts = [tok.encode(prompt, add_special_tokens=True)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        prompts = [tok.encode(p, add_special_tokens=True) for p in prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = [list(p) for p in prompt]
        if not all(p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompts):
            raise RequestError("'prompt' token lists must be non-empty lists of integers")
    else:
        raise RequestError("'prompt' must be a string, a list of strings, a list of token ids, or a list of those")
    vocab = engine.model.get_input_embeddings().weight.shape[0]
    for ids in prompts:
        if not ids:
            raise RequestError("a prompt has no tokens; send at least one")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is out of range for a vocabulary of {vocab}")
    return prompts


def context_limits(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[int]:
    """Each prompt's max_tokens, clamped to the room the context leaves, as vLLM 0.30+ does; refuses (and logs)
    what vLLM refuses: max_tokens over the whole context, a prompt that leaves no room for a single token."""
    limit = engine.max_model_len
    if max_tokens > limit:
        message = max_tokens_too_large_message(max_tokens, limit)
    else:
        longest = max(len(ids) for ids in prompts)
        if longest > limit:
            message = prompt_too_long_message(limit, longest)
        elif longest == limit:
            message = NO_ROOM_MESSAGE
        else:
            return [min(max_tokens, limit - len(ids)) for ids in prompts]
    logger.warning("refused a request: %s", message)
    raise RequestError(message)


def _logprobs_block(engine: Engine, seq: Sequence, chat: bool) -> dict:
    decode = engine.tokenizer.decode
    pieces = [decode([t]) for t in seq.token_ids]
    tops = seq.top_logprobs or [{} for _ in pieces]
    if chat:
        content = [
            {"token": p, "logprob": lp, "top_logprobs": [{"token": decode([k]), "logprob": v} for k, v in top.items()]}
            for p, lp, top in zip(pieces, seq.logprobs, tops, strict=True)
        ]
        return {"content": content}
    offsets = [sum(len(p) for p in pieces[:i]) for i in range(len(pieces))]
    top = [{decode([t]): lp for t, lp in d.items()} for d in seq.top_logprobs] if seq.top_logprobs else None
    return {"tokens": pieces, "token_logprobs": list(seq.logprobs), "top_logprobs": top, "text_offset": offsets}


def response_body(engine: Engine, job: Job, body: dict, *, chat: bool) -> dict:
    """A finished job as an OpenAI text_completion or chat.completion object (choices prompt-major, n each)."""
    token_ids = bool(body.get("return_token_ids"))
    choices = []
    for index, seq in enumerate(job.sequences):
        choice: dict[str, Any] = {"index": index, "finish_reason": seq.finish_reason}
        if chat:
            choice["message"] = {"role": "assistant", "content": seq.text}
        else:
            choice["text"] = seq.text
        wants_logprobs = job.params.logprobs is not None
        choice["logprobs"] = _logprobs_block(engine, seq, chat) if wants_logprobs else None
        if token_ids and not chat:
            choice["prompt_token_ids"] = list(seq.prompt_ids)
        if token_ids:
            choice["token_ids"] = list(seq.token_ids)
        choices.append(choice)
    prompt_tokens = sum(len(p) for p in job.prompts)
    completion_tokens = sum(len(s.token_ids) for s in job.sequences)
    response = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": engine.served_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
    if token_ids and chat:
        response["prompt_token_ids"] = list(job.prompts[0])
    return response


def chat_prompt_ids(engine: Engine, messages: Any) -> list[int]:
    """The tokens of `messages` rendered by the tokenizer's chat template with a generation prompt."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content}")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RequestError("each message must be an object with string 'role' and 'content'")
    if not engine.tokenizer.chat_template:
        raise RequestError("the served tokenizer has no chat template; use /v1/completions")
    text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # the template already placed any special tokens it wants
    return engine.tokenizer.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- HTTP


class WorkerServer(ThreadingHTTPServer):
    """The HTTP server; holds the engine once it is loaded."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, *, request_timeout_s: float, index: int):
        super().__init__(address, Handler)
        self.engine: Engine | None = None
        self.request_timeout_s = request_timeout_s
        self.index = index
        self._in_flight = 0
        self._idle = threading.Condition()

    def track(self, delta: int) -> None:
        """Count requests being answered, so a shutdown can wait for their responses to go out."""
        with self._idle:
            self._in_flight += delta
            self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is being answered; False if some still are after `timeout_s`."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout_s)


class Handler(BaseHTTPRequestHandler):
    server: WorkerServer
    timeout = SOCKET_TIMEOUT_S
    server_version = "prime-train-inference"

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s %s", self.address_string(), format % args)

    # -- plumbing

    def _send(self, status: int, obj: Any) -> None:
        # a str goes out as text (/health, as vLLM answers it), anything else as JSON
        text = isinstance(obj, str)
        data = (obj if text else json.dumps(obj)).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "text/plain; charset=utf-8" if text else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, err: RequestError) -> None:
        self._send(
            int(err.status),
            {"error": {"message": str(err), "type": err.err_type, "param": None, "code": int(err.status)}},
        )

    def _read_json(self) -> dict:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestError("a JSON body with a Content-Length header is required", HTTPStatus.LENGTH_REQUIRED)
        if int(length) > MAX_BODY_BYTES:
            raise RequestError(
                f"request body of {length} bytes is over the {MAX_BODY_BYTES}-byte limit; "
                "send fewer prompts per request",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
        raw = self.rfile.read(int(length))
        try:
            body = json.loads(raw)
        except ValueError as exc:
            raise RequestError(f"the body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        return body

    def _engine(self) -> Engine:
        engine = self.server.engine
        if engine is None:
            raise unavailable("the model is still loading")
        return engine

    # -- routes

    def do_GET(self) -> None:
        try:
            path = self.path.split("?", 1)[0]
            if path == "/health":
                self._send(*((503, "loading") if self.server.engine is None else (200, "ok")))
            elif path == "/v1/models":
                engine = self._engine()
                card = {
                    "id": engine.served_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "prime-train",
                    "max_model_len": engine.max_model_len,
                }
                self._send(200, {"object": "list", "data": [card]})
            elif path == "/weights_step":
                self._send(200, {"step": self._engine().weights_step})
            elif path == "/metrics":
                self._send(200, self._engine().counters())
            else:
                raise RequestError(f"no route GET {path}", HTTPStatus.NOT_FOUND, "NotFoundError")
        except RequestError as err:
            self._send_error(err)

    def do_POST(self) -> None:
        self.server.track(+1)
        try:
            self._post()
        finally:
            self.server.track(-1)

    def _post(self) -> None:
        try:
            path = self.path.split("?", 1)[0]
            if path not in ("/v1/completions", "/v1/chat/completions", "/update_weights"):
                raise RequestError(f"no route POST {path}", HTTPStatus.NOT_FOUND, "NotFoundError")
            body = self._read_json()
            engine = self._engine()
            if path == "/update_weights":
                self._update_weights(engine, body)
                return
            chat = path == "/v1/chat/completions"
            model = body.get("model")
            if model is not None and model != engine.served_name:
                raise RequestError(f"The model `{model}` does not exist.", HTTPStatus.NOT_FOUND, "NotFoundError")
            if body.get("stream"):
                raise RequestError("'stream' is not supported by the embedded worker; send stream=false")
            n, params = parse_sampling(body, chat=chat)
            prompts = (
                [chat_prompt_ids(engine, body.get("messages"))]
                if chat
                else prompt_token_ids(engine, body.get("prompt"))
            )
            job = Job(prompts, n, params, context_limits(engine, prompts, params.max_tokens))
            engine.submit(job)
            if not job.done.wait(self.server.request_timeout_s):
                engine.cancel(job)
                raise unavailable(
                    f"the request did not finish within {self.server.request_timeout_s:.0f} s "
                    "(inference.request_timeout_s); the worker is overloaded or the request is too large"
                )
            if job.error:
                raise unavailable(job.error)
            self._send(200, response_body(engine, job, body, chat=chat))
        except RequestError as err:
            self._send_error(err)
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("client went away before the answer")

    def _update_weights(self, engine: Engine, body: dict) -> None:
        path = body.get("path")
        step = body.get("step")
        if not isinstance(path, str) or not path:
            raise RequestError("'path' must name a directory holding model.safetensors")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise RequestError(f"'step' must be a non-negative integer, got {step!r}")
        try:
            done = engine.run_control(engine.load_weights, self.server.request_timeout_s, path=path, step=step)
        except RequestError as err:
            logger.warning("refused /update_weights: %s", err)
            raise
        self._send(200, {"step": done})


# ---------------------------------------------------------------- startup


def build_engine(cfg, *, device=None, published: bool = True) -> Engine:
    """Load the tokenizer and model of `cfg` into an Engine: the run's newest published weights over model.path's
    when `published` (a worker of a running RL job), model.path's alone when not."""
    import torch

    from prime_train.engine.metrics import EngineConfigError
    from prime_train.engine.model import build_model
    from prime_train.engine.tokenizer import load_tokenizer, padded_vocab_size

    if cfg.model.path is None and cfg.inference.max_model_len > cfg.model.max_position_embeddings:
        raise EngineConfigError(
            f"inference.max_model_len ({cfg.inference.max_model_len}) is longer than the model's context "
            f"(model.max_position_embeddings = {cfg.model.max_position_embeddings}); lower inference.max_model_len"
        )
    device = device or torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        tokenizer = load_tokenizer(cfg.model)
    except ValueError as exc:
        raise EngineConfigError(str(exc)) from None
    # the same seed as the trainer, so a random-initialised worker starts from the trainer's weights
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model, padded_vocab_size(tokenizer, cfg.model.vocab_multiple), device=device)
    model.eval()
    served = cfg.model.path or cfg.run.name
    engine = Engine(
        model,
        tokenizer,
        max_model_len=cfg.inference.max_model_len,
        max_num_seqs=cfg.inference.max_num_seqs,
        device=device,
        served_name=served,
    )
    for step, path in latest_published_weights(cfg.run_dir) if published else []:
        try:
            engine.load_weights(str(path), step)
            break
        except RequestError as exc:  # e.g. removed by the trainer's retention while we read it
            logger.warning("ignoring published weights of step %d: %s", step, exc)
    return engine


def serve(cfg, index: int, *, stop_event: threading.Event | None = None) -> int:
    """Bind worker `index`, load the model, serve until SIGTERM/SIGINT or `stop_event`; returns the exit code."""
    stop = stop_event or threading.Event()
    host, port = cfg.inference.host, cfg.inference.base_port + index
    # bind first: /health answers 503 while the model loads, and a taken port fails before the slow part
    server = _bind(host, port, cfg.inference.request_timeout_s, index)
    server_thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, daemon=True)
    server_thread.start()
    try:
        engine = build_engine(cfg)
        engine.start()
        server.engine = engine
        bound_host, bound_port = server.server_address[:2]
        logger.info("worker %d serving %s on %s:%d", index, engine.served_name, bound_host, bound_port)
        stop.wait()
        logger.info("worker %d stopping: finishing the batch in progress", index)
        server.shutdown()  # stops accepting; handlers already running still answer
        engine.stop(timeout_s=cfg.inference.request_timeout_s)
        if not server.wait_idle(SOCKET_TIMEOUT_S):
            logger.warning("worker %d exiting with responses still unsent", index)
        return ExitCode.OK
    finally:
        server.shutdown()
        server.server_close()


# How long a worker retries a port that is in use before it calls it taken: long enough for a process of this run
# that is exiting (a restarted worker's previous life) to let it go, short enough to fail in seconds.
BIND_RETRY_S = 3.0


def _bind(host: str, port: int, request_timeout_s: float, index: int) -> WorkerServer:
    """The worker's server, bound to host:port; OSError(EADDRINUSE) when the port stays taken for BIND_RETRY_S."""
    deadline = time.monotonic() + BIND_RETRY_S
    while True:
        try:
            return WorkerServer((host, port), request_timeout_s=request_timeout_s, index=index)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                raise
        time.sleep(0.25)


def _setup_logging(level: str) -> None:
    fmt = "%(asctime)s %(levelname)s %(message)s"
    logging.basicConfig(level=level.upper(), format=fmt, datefmt="%H:%M:%S", stream=sys.stdout, force=True)
    # torchao's and torch's pytree import-time warnings: noise, as in the trainer (engine/loop.py's setup_logging)
    for noisy in ("transformers", "urllib3", "torchao", "torch.utils._pytree"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def run(config_path: str, index: int) -> int:
    """Load the config and serve worker `index`; returns the process exit code."""
    from prime_train.config.loader import ConfigError, load_config
    from prime_train.engine.metrics import EngineConfigError

    try:
        cfg = load_config([config_path])
    except ConfigError as exc:
        print(f"config error:\n{exc}", file=sys.stderr)
        return ExitCode.CONFIG
    _setup_logging(cfg.logging.level)
    if index < 0 or index >= cfg.inference.num_workers:
        logger.error("--index %d is outside inference.num_workers = %d", index, cfg.inference.num_workers)
        return ExitCode.CONFIG
    stop = threading.Event()

    def _on_signal(signum, frame) -> None:
        logger.info("received %s", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)

    # a worker never outlives `prime-train run`: after a kill -9 of it, the next run would find the port taken
    watch_supervisor(lambda reason: stop.set())  # the lifeline logs the reason
    try:
        return serve(cfg, index, stop_event=stop)
    except EngineConfigError as exc:
        logger.error("configuration error: %s", exc)
        return ExitCode.CONFIG
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        from prime_train.rl.workers import port_holder

        port = cfg.inference.base_port + index
        holder = port_holder(port) or "another process"
        # a configuration error, never retried: the port stayed taken past BIND_RETRY_S (so not by this worker's
        # previous life), and a restart would find it taken again. The words are the ones `diagnose` knows.
        logger.error(
            "cannot listen on %s:%d: address already in use, held by %s; stop it, or set inference.base_port to a "
            "free range (worker %d listens on base_port + %d)",
            cfg.inference.host, port, holder, index, index,
        )  # fmt: skip
        return ExitCode.CONFIG


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prime_train.rl.worker", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved run config (TOML)")
    parser.add_argument("--index", type=int, default=0, help="worker index: listens on inference.base_port + index")
    args = parser.parse_args(argv)
    code = run(args.config, args.index)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


if __name__ == "__main__":
    main()
