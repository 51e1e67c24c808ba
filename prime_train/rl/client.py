"""Clients of rollout workers (vLLM or the embedded worker) over their OpenAI-compatible HTTP.

Both backends serve /health, /v1/models and /v1/completions alike; they differ in how new weights are
loaded, and the client speaks each one's protocol (`backend`):

- 'embedded' (rl/worker.py): POST /update_weights {"path", "step"}; GET /weights_step {"step"};
- 'vllm' (vLLM's own dev-mode routes, rl/vllm_server.py): POST /pause?mode=wait, POST /collective_rpc
  prime_train_reload_weights(weights_path) (vLLM's reload_weights, through our worker extension), POST
  /reset_prefix_cache, POST /update_weight_version, POST /resume;
  GET /weight_info {"weight_version"}. A LoRA adapter directory (adapter_config.json, PEFT's format) is loaded
  instead with POST /v1/load_lora_adapter under a name of its own per step, the previous one unloaded, between the
  same /pause and /resume; completions then name the adapter (vLLM started with --enable-lora).

Every call has a timeout: a dead worker is a `WorkerUnavailable` within it, never a hang. A request that
can never fit the worker's max_model_len is a `ContextLengthError` carrying the worker's own message.
Standard library only (http.client), so the trainer needs no HTTP dependency.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import re
import threading
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prime_train.config.schema import Config

logger = logging.getLogger("prime_train.rl.client")

_TOKEN_ID_RE = re.compile(r"^token_id:(\d+)$")
DOWN_RECHECK_S = 5.0  # a worker that failed is health-checked again after this long, not on every call
BACKENDS = ("embedded", "vllm")
# A 400 whose message says the request cannot fit max_model_len, in the wordings vLLM has used: "maximum context
# length" (OpenAI's and vLLM's prompt checks, 0.4 to 0.33), "cannot be greater than max_model_len" (0.30+:
# max_tokens alone is longer than the context), "max_tokens must be at least 1, got 0" (0.30+: the prompt fills the
# whole context, so clamping left no room for a single token; we never send max_tokens 0 ourselves)
CONTEXT_LENGTH_MARKERS = (
    "maximum context length",
    "cannot be greater than max_model_len",
    "max_tokens must be at least 1, got 0",
)
# the embedded worker's refusal of weights whose tensors are not its model's (rl/generation.py load_weights): the
# trainer publishes the same weights after a restart, so a restart cannot help
WEIGHTS_MISMATCH_MARKER = "does not fit the served model"
RESET_TRIES = 20  # vLLM's reset_prefix_cache answers false while blocks are still held; after a pause none should be


def worker_url(cfg: Config, index: int) -> str:
    """The base URL of rollout worker `index`: inference.host on inference.base_port + index."""
    return f"http://{cfg.inference.host}:{cfg.inference.base_port + index}"


class ContextLengthError(ValueError):
    """The worker refused a request because prompt + max_tokens exceeds its max_model_len."""


class WorkerUnavailable(ConnectionError):
    """No answer from a worker within the timeout, a refused connection, or a worker saying 503."""


class WorkerError(RuntimeError):
    """A worker answered a request with an error other than the two above."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class WeightsMismatchError(WorkerError):
    """A worker refused the published weights: their tensors are not those of the model it serves."""


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    text: str
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    prompt_token_ids: list[int] = field(default_factory=list)


class WorkerClient:
    """One worker at `base_url` (http://host:port), spoken to with `backend`'s weight protocol."""

    def __init__(self, base_url: str, timeout_s: float, backend: str = "embedded"):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        parsed = urllib.parse.urlsplit(base_url if "://" in base_url else f"http://{base_url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"worker URL {base_url!r} must look like http://host:port")
        self.base_url = f"{parsed.scheme}://{parsed.netloc}"
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname
        self._port = parsed.port or (443 if self._https else 80)
        self.timeout_s = timeout_s
        self._model: str | None = None
        self._adapter: str | None = None  # the LoRA adapter vLLM serves our policy under (LoRA runs on vLLM)

    def __repr__(self) -> str:
        return f"WorkerClient({self.base_url!r})"

    def _request(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> tuple[int, bytes]:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        conn_class = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        # the timeout bounds every socket operation; the worker writes its answer in one piece
        conn = conn_class(self._host, self._port, timeout=timeout)
        data = None if body is None else json.dumps(body).encode("utf-8")
        headers = {"Content-Type": "application/json"} if data is not None else {}
        try:
            conn.request(method, path, body=data, headers=headers)
            response = conn.getresponse()
            return response.status, response.read()
        except TimeoutError:
            raise WorkerUnavailable(f"{self.base_url}{path}: no answer within {timeout:.1f} s") from None
        except (OSError, http.client.HTTPException) as exc:
            raise WorkerUnavailable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from None
        finally:
            conn.close()

    def _json(self, method: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        status, raw = self._request(method, path, body, timeout_s)
        try:
            obj = json.loads(raw) if raw else None
        except ValueError:
            obj = None
        if 200 <= status < 300:
            if obj is None:
                raise WorkerError(f"{self.base_url}{path}: answered {status} with no JSON", status)
            return obj
        self._fail(path, status, raw, obj)

    def _fail(self, path: str, status: int, raw: bytes, obj: Any) -> None:
        """Raise the error a non-2xx answer means (its JSON `obj`, or None)."""
        message = _error_message(obj) or raw.decode("utf-8", "replace")[:500] or f"HTTP {status}"
        if status == 400 and any(marker in message for marker in CONTEXT_LENGTH_MARKERS):
            raise ContextLengthError(message)
        if status == 400 and WEIGHTS_MISMATCH_MARKER in message:
            raise WeightsMismatchError(f"{self.base_url}{path}: {message}", status)
        if status == 503:
            raise WorkerUnavailable(f"{self.base_url}{path}: {message}")
        raise WorkerError(f"{self.base_url}{path}: HTTP {status}: {message}", status)

    def health(self, timeout_s: float | None = None) -> bool:
        """True when /health answers 200 within the timeout."""
        try:
            status, _ = self._request("GET", "/health", timeout_s=timeout_s)
        except WorkerUnavailable:
            return False
        return status == 200

    def model_name(self) -> str:
        """The served model name (from /v1/models), fetched once."""
        if self._model is None:
            data = self._json("GET", "/v1/models")
            try:
                self._model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise WorkerError(f"{self.base_url}/v1/models: no model listed", 200) from None
        return self._model

    def complete(
        self,
        prompts: list[str] | list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
    ) -> list[list[Completion]]:
        """`n` completions of each prompt, with their token ids and sampled-token logprobs."""
        if not prompts:
            return []
        body = {
            "model": self._adapter or self.model_name(),
            "prompt": prompts,
            "n": n,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "logprobs": 0,  # vLLM: 0 means the sampled token's logprob only
            "return_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed
        data = self._json("POST", "/v1/completions", body)
        out: list[list[Completion]] = [[] for _ in prompts]
        for choice in sorted(data.get("choices", []), key=lambda c: c["index"]):
            prompt_index = choice["index"] // n
            if prompt_index >= len(prompts):
                raise WorkerError(f"{self.base_url}: choice index {choice['index']} past the prompts sent", 200)
            out[prompt_index].append(_completion(choice))
        short = [i for i, group in enumerate(out) if len(group) != n]
        if short:
            raise WorkerError(f"{self.base_url}: prompt {short[0]} got {len(out[short[0]])} completions, not {n}", 200)
        return out

    def update_weights(self, path: str, step: int) -> float:
        """Make the worker serve the HF weights in directory `path` as the weights of `step`; returns the seconds
        it took (for vLLM: generation paused, in-flight requests finished, weights reloaded, prefix cache reset)."""
        t0 = time.perf_counter()
        if self.backend == "embedded":
            data = self._json("POST", "/update_weights", {"path": path, "step": step})
            if data.get("step") != step:
                raise WorkerError(f"{self.base_url}/update_weights answered {data!r}, expected step {step}", 200)
            return time.perf_counter() - t0
        if (Path(path) / "adapter_config.json").is_file():
            self._load_adapter(path, step)
            return time.perf_counter() - t0
        if not any(Path(path).glob("*.safetensors")):
            # vLLM's reload_weights takes a missing directory for a hub id and its engine dies of it: never send one
            raise WorkerError(f"{path} holds no *.safetensors; not sent to {self.base_url} (reload_weights)", 400)
        self._json("POST", "/pause?mode=wait")  # requests in flight finish on the old weights, new ones wait
        try:
            rpc = {"method": "prime_train_reload_weights", "kwargs": {"weights_path": path}}
            self._json("POST", "/collective_rpc", rpc)
            for _ in range(RESET_TRIES):
                # KV blocks cached for a prompt prefix were computed by the old weights: reusing them mixes policies
                if self._json("POST", "/reset_prefix_cache").get("success"):
                    break
                time.sleep(0.05)
            else:
                raise WorkerError(f"{self.base_url}/reset_prefix_cache kept answering false after a reload", 200)
            self._json("POST", "/update_weight_version", {"new_version": str(step)})
        finally:
            # a worker that died mid-update cannot resume: whatever failed above is the error to report
            with contextlib.suppress(WorkerUnavailable):
                self._json("POST", "/resume")
        return time.perf_counter() - t0

    def _load_adapter(self, path: str, step: int) -> None:
        """vLLM: serve the LoRA adapter in `path` (PEFT's format) as the policy of `step`, under a new name (vLLM
        keeps an adapter per name: a name of its own per load, so a worker that outlived a trainer restart never
        answers 'already loaded'), then unload the one before it; requests in flight finish on the old adapter. The
        prefix cache needs no reset: vLLM keys its cached blocks by the adapter's name too."""
        name = f"step-{step}-{uuid.uuid4().hex[:8]}"
        self._json("POST", "/pause?mode=wait")
        try:
            self._post_plain("/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            previous, self._adapter = self._adapter, name
            if previous is not None:
                # gone already on a worker that restarted since: nothing to unload there
                with contextlib.suppress(WorkerError):
                    self._post_plain("/v1/unload_lora_adapter", {"lora_name": previous})
            self._json("POST", "/update_weight_version", {"new_version": str(step)})
        finally:
            with contextlib.suppress(WorkerUnavailable):
                self._json("POST", "/resume")

    def _post_plain(self, path: str, body: Any) -> None:
        """A call whose success vLLM answers in plain text (its LoRA routes); an error is raised as `_json` does."""
        status, raw = self._request("POST", path, body)
        if not 200 <= status < 300:
            try:
                obj = json.loads(raw) if raw else None
            except ValueError:
                obj = None
            self._fail(path, status, raw, obj)

    def weights_step(self) -> int | None:
        """The step of the weights the worker serves: 0 = initial on the embedded worker, None = the model vLLM
        started with (no update since its start)."""
        if self.backend == "embedded":
            return int(self._json("GET", "/weights_step")["step"])
        version = self._json("GET", "/weight_info").get("weight_version")
        try:
            return int(version) if version is not None else None
        except (TypeError, ValueError):
            return None  # a version someone else set: not one of our steps


def _error_message(obj: Any) -> str | None:
    # vLLM has answered both {"error": {"message": ...}} and {"object": "error", "message": ...}
    if not isinstance(obj, dict):
        return None
    inner = obj.get("error")
    if isinstance(inner, dict) and isinstance(inner.get("message"), str):
        return inner["message"]
    if isinstance(obj.get("message"), str):
        return obj["message"]
    if isinstance(obj.get("detail"), str):
        return obj["detail"]
    return None


def _completion(choice: dict) -> Completion:
    logprobs = choice.get("logprobs") or {}
    token_logprobs = [float(x) for x in (logprobs.get("token_logprobs") or [])]
    token_ids = choice.get("token_ids")
    if token_ids is None:
        # vLLM without return_token_ids: with --return-tokens-as-token-ids the tokens read "token_id:<id>"
        matches = [_TOKEN_ID_RE.match(t) for t in logprobs.get("tokens") or []]
        if not matches or not all(matches):
            raise WorkerError("the worker returned no token ids (needs return_token_ids support)", 200)
        token_ids = [int(m.group(1)) for m in matches]
    return Completion(
        text=choice.get("text", ""),
        token_ids=[int(t) for t in token_ids],
        logprobs=token_logprobs,
        finish_reason=choice.get("finish_reason") or "length",
        prompt_token_ids=[int(t) for t in choice.get("prompt_token_ids") or []],
    )


@dataclass
class WeightLoad:
    """What `RolloutPool.update_weights` did: seconds per worker URL that loaded, and the URLs that did not answer."""

    seconds: dict[str, float] = field(default_factory=dict)
    unreachable: list[str] = field(default_factory=list)

    @property
    def wall_s(self) -> float:
        """The slowest worker's load: the loads run at the same time."""
        return max(self.seconds.values(), default=0.0)


class RolloutPool:
    """Several workers, used at once: the prompts of one call are split over the workers that answer.

    Seeding does not depend on the split: with `seed` s, sample j of prompt i is drawn with seed s + i*n + j
    (vLLM's own rule for the n samples of one seeded prompt), whichever worker serves it. A worker that fails
    is skipped (its share is retried on another) and asked again after DOWN_RECHECK_S; a worker that serves
    weights other than the newest `update_weights` gave (a restarted one) is given them before it is used.
    """

    def __init__(self, urls: list[str], timeout_s: float, backend: str = "embedded"):
        if not urls:
            raise ValueError("a RolloutPool needs at least one worker URL (inference.num_workers >= 1)")
        self.clients = [WorkerClient(url, timeout_s, backend) for url in urls]
        self.backend = backend
        self.timeout_s = timeout_s
        self._next = 0
        self._down_since: dict[int, float] = {}
        self._lock = threading.Lock()
        self._weights: tuple[str, int] | None = None
        self._weights_lock = threading.Lock()  # one load at a time: a stale step never overwrites a newer one

    def _order(self) -> list[int]:
        with self._lock:
            start = self._next
            self._next = (self._next + 1) % len(self.clients)
        return [(start + k) % len(self.clients) for k in range(len(self.clients))]

    def _usable(self, i: int) -> bool:
        with self._lock:
            since = self._down_since.get(i)
        if since is None:
            return True
        if time.monotonic() - since < DOWN_RECHECK_S:
            return False
        if self.clients[i].health(timeout_s=min(self.timeout_s, 5.0)):
            with self._lock:
                self._down_since.pop(i, None)
            logger.info("rollout worker %s answers again", self.clients[i].base_url)
            return True
        with self._lock:
            self._down_since[i] = time.monotonic()
        return False

    def _mark_down(self, i: int, exc: Exception) -> None:
        with self._lock:
            # once per outage: the concurrent requests of one step all fail on the same dead worker
            first = i not in self._down_since
            self._down_since[i] = time.monotonic()
        log = logger.warning if first else logger.debug
        log("rollout worker %s failed (%s); trying another", self.clients[i].base_url, exc)

    def _current(self, workers: list[int]) -> list[int]:
        """The workers of `workers` that serve the newest weights, after loading them where they do not."""
        with self._weights_lock:
            if self._weights is None:
                return workers
            path, step = self._weights
            ready = []
            for i in workers:
                client = self.clients[i]
                try:
                    served = client.weights_step()
                    if served != step:
                        seconds = client.update_weights(path, step)
                        logger.info("rollout worker %s served step %s: loaded step %d (%.2f s)",
                                    client.base_url, served, step, seconds)  # fmt: skip
                    ready.append(i)
                except WorkerUnavailable as exc:
                    self._mark_down(i, exc)
            return ready

    def complete(
        self,
        prompts: list[str] | list[list[int]],
        *,
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
    ) -> list[list[Completion]]:
        """As WorkerClient.complete, split over every worker that answers, at once; WorkerUnavailable when none does.

        The embedded worker gets its share as one request (it batches a request's sequences in order, so a share
        samples the same tokens whatever else it serves); vLLM gets one request per prompt (one seed per request,
        and its scheduler batches concurrent requests itself).
        """
        if not prompts:
            return []
        order = self._order()
        # workers marked down are tried last, so one that came back is still used when all else fails
        workers = self._current([i for i in order if self._usable(i)]) or order
        count = len(prompts)
        if self.backend == "vllm":
            units = [(p, p + 1, workers[p * len(workers) // count]) for p in range(count)]
        else:
            k = min(len(workers), count)
            units = [(w * count // k, (w + 1) * count // k, workers[w]) for w in range(k)]
        sampling = dict(n=n, max_tokens=max_tokens, temperature=temperature, top_p=top_p)
        out: list[list[Completion]] = [[] for _ in prompts]

        def run(start: int, stop: int, first: int) -> None:
            unit_seed = None if seed is None else seed + start * n
            failures: list[str] = []
            for i in [first, *(w for w in order if w != first)]:
                try:
                    out[start:stop] = self.clients[i].complete(prompts[start:stop], seed=unit_seed, **sampling)
                    with self._lock:
                        self._down_since.pop(i, None)  # it answers: its next failure is a new outage
                    return
                except WorkerUnavailable as exc:
                    self._mark_down(i, exc)
                    failures.append(str(exc))
            raise WorkerUnavailable(f"no rollout worker answered ({len(self.clients)} tried): " + "; ".join(failures))

        with ThreadPoolExecutor(max_workers=len(units), thread_name_prefix="rollout") as pool:
            futures = [pool.submit(run, *unit) for unit in units]
            for future in futures:
                future.result()  # the first failure, after every request has finished or failed
        return out

    def health(self, timeout_s: float | None = None) -> list[bool]:
        """The /health answer of each worker, in order."""
        return [c.health(timeout_s) for c in self.clients]

    def _probe(self, deadline: float) -> list[bool]:
        """One /health round (each probe bounded, so a wait overshoots its deadline by at most one round); a worker
        that answers is marked up."""
        healthy = self.health(timeout_s=min(5.0, max(0.5, deadline - time.monotonic())))
        with self._lock:
            for i, ok in enumerate(healthy):
                if ok:
                    self._down_since.pop(i, None)
        return healthy

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5) -> int:
        """Wait until at least one worker answers /health; returns how many do. WorkerUnavailable after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            healthy = self._probe(deadline)
            if any(healthy):
                return sum(healthy)
            if time.monotonic() >= deadline:
                urls = ", ".join(c.base_url for c in self.clients)
                raise WorkerUnavailable(
                    f"no rollout worker answered /health within {timeout_s:.0f} s ({urls}); "
                    "see the inference worker logs, or raise inference.startup_timeout_s"
                )
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    def wait_all_healthy(self, timeout_s: float, poll_s: float = 0.5) -> int:
        """Wait up to `timeout_s` for every worker to answer /health; returns how many do at the end (no error)."""
        deadline = time.monotonic() + timeout_s
        while True:
            healthy = self._probe(deadline)
            if all(healthy) or time.monotonic() >= deadline:
                return sum(healthy)
            time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))

    def update_weights(self, path: str, step: int) -> WeightLoad:
        """Load `path` as `step` on every worker at once; a worker that cannot be reached gets it when it answers
        again (see `complete`)."""
        result = WeightLoad()
        with self._weights_lock:
            self._weights = (path, step)

            def load(i: int) -> None:
                client = self.clients[i]
                try:
                    result.seconds[client.base_url] = client.update_weights(path, step)
                except WorkerUnavailable as exc:
                    self._mark_down(i, exc)
                    result.unreachable.append(client.base_url)

            with ThreadPoolExecutor(max_workers=len(self.clients), thread_name_prefix="weights") as pool:
                for future in [pool.submit(load, i) for i in range(len(self.clients))]:
                    future.result()
        return result
