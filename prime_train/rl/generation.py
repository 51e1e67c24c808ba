"""The embedded rollout worker's generation engine: one thread that batches every request's sequences.

A real HF causal LM decodes left-padded batches of up to inference.max_num_seqs sequences with a KV
cache (n samples of a prompt are n sequences). Each sequence samples from its own seeded generator,
so batch composition cannot change what a seeded request gets. Token logprobs are
log_softmax(logits / temperature) over the whole vocabulary at the sampled token (temperature 0
decodes greedily and reports temperature-1 logprobs): the policy the trainer recomputes. Top-p only
narrows what is sampled, not the reported logprob. Weight reloads run on the generation thread
between batches, all or nothing. The HTTP side is rl/worker.py.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

from prime_train.rundir import RunDir

logger = logging.getLogger("prime_train.rl.worker")

WEIGHTS_FILE = "model.safetensors"


class RequestError(Exception):
    """A request the worker refuses; becomes an OpenAI-style error response with `status`."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.err_type = err_type


def unavailable(message: str) -> RequestError:
    """A 503: the worker cannot serve the request now; a client should retry elsewhere or later."""
    return RequestError(message, HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailable")


def prompt_too_long_message(max_model_len: int, prompt_tokens: int) -> str:
    """vLLM 0.30+'s refusal of a prompt longer than the context, word for word (the client and logs match it)."""
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
        f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt."
    )


def max_tokens_too_large_message(max_tokens: int, max_model_len: int) -> str:
    """vLLM 0.30+'s refusal of a max_tokens longer than the whole context."""
    return (
        f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
        "Please request fewer output tokens."
    )


# vLLM 0.30+ when the prompt fills the whole context: max_tokens is clamped to the room left, 0, and refused
NO_ROOM_MESSAGE = "max_tokens must be at least 1, got 0."


# ---------------------------------------------------------------- requests and sequences


@dataclass
class SamplingParams:
    """How one request samples; shared by its sequences."""

    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    logprobs: int | None


@dataclass
class Sequence:
    """One sample of one prompt: the unit a batch is made of."""

    job: Job
    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    max_tokens: int = 0  # the request's max_tokens, clamped to the room the context leaves after this prompt
    generator: Any = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None


class Job:
    """One HTTP request's sequences; done when every sequence has finished or the job was cancelled."""

    def __init__(self, prompts: list[list[int]], n: int, params: SamplingParams, limits: list[int] | None = None):
        self.prompts = prompts
        self.n = n
        self.params = params
        limits = limits or [params.max_tokens] * len(prompts)
        self.sequences = [Sequence(self, i, j, ids, limits[i]) for i, ids in enumerate(prompts) for j in range(n)]
        self.remaining = len(self.sequences)
        self.done = threading.Event()
        self.cancelled = False
        self.error: str | None = None


# ---------------------------------------------------------------- the engine


def _cache_keyword(model) -> str:
    """The name of the key-value cache in the model's forward and its output: transformers 5.2x renamed
    `past_key_values` to `cache` (the old name warns on every call and is removed in 5.40); earlier 5.x has only the
    old one."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Engine:
    """The model, its tokenizer and the one generation thread that batches every request."""

    def __init__(self, model, tokenizer, *, max_model_len: int, max_num_seqs: int, device, served_name: str):
        self.model = model
        self._cache_key = _cache_keyword(model)  # the model is loaded once; new weights are copied into it
        from prime_train.engine.model import last_logits_only

        # the prefill projects the last prompt position alone onto the vocabulary, not every one
        self._last_logits = last_logits_only(model)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.device = device
        self.served_name = served_name
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_id = tokenizer.eos_token_id
        self.weights_step = 0
        self.forward_passes = 0
        self.batches = 0
        self.sequences_served = 0
        self.requests = 0
        self.busy_s = 0.0
        self._pending: collections.deque[Sequence] = collections.deque()
        self._controls: collections.deque[tuple[Any, dict]] = collections.deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="generation", daemon=True)

    def start(self) -> None:
        """Start the generation thread."""
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        """Finish the batch in progress, refuse what is still queued, and stop the generation thread."""
        with self._cond:
            self._stopping = True
            while self._pending:
                seq = self._pending.popleft()
                seq.job.error = "the worker is shutting down"
                seq.job.done.set()
            self._cond.notify_all()
        self._thread.join(timeout_s)

    # -- called from HTTP handler threads

    def submit(self, job: Job) -> None:
        """Queue a job's sequences for the generation thread."""
        with self._cond:
            if self._stopping:
                raise unavailable("the worker is shutting down")
            self.requests += 1
            self._pending.extend(job.sequences)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Drop a job whose client gave up: queued sequences are removed, running ones stop at the next token."""
        with self._cond:
            job.cancelled = True
            self._pending = collections.deque(s for s in self._pending if s.job is not job)

    def run_control(self, fn, timeout_s: float, **kwargs) -> Any:
        """Run `fn(**kwargs)` on the generation thread between batches and return its result."""
        box: dict[str, Any] = {"done": threading.Event()}
        with self._cond:
            if self._stopping:
                raise unavailable("the worker is shutting down")
            self._controls.append((fn, {"kwargs": kwargs, "box": box}))
            self._cond.notify_all()
        if not box["done"].wait(timeout_s):
            raise unavailable(f"the worker did not get to it within {timeout_s:.0f} s (inference.request_timeout_s)")
        if "error" in box:
            raise box["error"]
        return box["result"]

    def queued_sequences(self) -> int:
        """Sequences waiting for a batch."""
        with self._cond:
            return len(self._pending)

    def counters(self) -> dict[str, float]:
        """What GET /metrics reports; forward_passes counts model forwards (one per decoded position of a batch),
        busy_s the seconds spent generating."""
        names = ("forward_passes", "batches", "sequences_served", "requests", "weights_step", "busy_s")
        return {**{name: getattr(self, name) for name in names}, "queued_sequences": self.queued_sequences()}

    # -- the generation thread

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._controls or self._stopping):
                    self._cond.wait()
                if self._controls:
                    fn, spec = self._controls.popleft()
                    batch = None
                elif self._pending:
                    fn, spec = None, None
                    batch = [self._pending.popleft() for _ in range(min(self.max_num_seqs, len(self._pending)))]
                else:
                    return  # stopping with nothing left to do
            if fn is not None:
                box = spec["box"]
                try:
                    box["result"] = fn(**spec["kwargs"])
                except Exception as exc:  # handed to the waiting handler, which answers with it
                    box["error"] = exc
                box["done"].set()
                continue
            try:
                self._generate(batch)
            except Exception as exc:
                logger.exception("generation failed for a batch of %d sequences", len(batch))
                for seq in batch:
                    seq.job.error = f"generation failed: {type(exc).__name__}: {exc}"
                    seq.job.done.set()

    def _generate(self, batch: list[Sequence]) -> None:
        import torch

        started = time.perf_counter()
        batch = [s for s in batch if not s.job.cancelled]
        if not batch:
            return
        for seq in batch:
            seq.generator = _make_generator(seq, self.device)
        width = max(len(s.prompt_ids) for s in batch)
        rows, masks = [], []
        for seq in batch:
            pad = width - len(seq.prompt_ids)
            rows.append([self.pad_id] * pad + seq.prompt_ids)
            masks.append([0] * pad + [1] * len(seq.prompt_ids))
        input_ids = torch.tensor(rows, device=self.device)
        attention_mask = torch.tensor(masks, device=self.device)
        # left padding: each sequence's first real token sits at position 0, as it would alone
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        longest = max(s.max_tokens for s in batch)
        cache = None
        active = [True] * len(batch)
        generated = 0
        with torch.inference_mode(), _autocast(self.device):
            for _ in range(longest):
                out = self.model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    position_ids=position_ids,
                    use_cache=True,
                    **{self._cache_key: cache},
                    **self._last_logits,
                )
                self.forward_passes += 1
                cache = out[self._cache_key]
                logits = out.logits[:, -1, :].float()
                next_ids = []
                for row, seq in enumerate(batch):
                    if not active[row] or seq.job.cancelled:
                        active[row] = False
                        next_ids.append(self.pad_id)
                        continue
                    token, logprob, top = _sample(logits[row], seq.job.params, seq.generator)
                    seq.token_ids.append(token)
                    seq.logprobs.append(logprob)
                    if top is not None:
                        seq.top_logprobs.append(top)
                    generated += 1
                    next_ids.append(token)
                    if self._finished(seq):
                        active[row] = False
                if not any(active):
                    break
                input_ids = torch.tensor(next_ids, device=self.device).unsqueeze(1)
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(batch), 1)], dim=1)
                position_ids = position_ids[:, -1:] + 1
        for seq in batch:
            if seq.finish_reason is None:
                seq.finish_reason = "length"
            if seq.finish_reason == "length":
                seq.text = self._decode(seq)
            with self._cond:
                seq.job.remaining -= 1
                if seq.job.remaining == 0:
                    seq.job.done.set()
        self.batches += 1
        self.sequences_served += len(batch)
        self.busy_s += time.perf_counter() - started
        logger.info("batch: %d sequences, %d tokens, %.2f s", len(batch), generated, time.perf_counter() - started)

    def _finished(self, seq: Sequence) -> bool:
        params = seq.job.params
        if self.eos_id is not None and seq.token_ids[-1] == self.eos_id:
            seq.finish_reason = "stop"
            seq.text = self._decode(seq)
            return True
        if params.stop:
            text = self._decode(seq)
            cut = min((text.find(s) for s in params.stop if s and s in text), default=-1)
            if cut >= 0:
                seq.text, seq.finish_reason = text[:cut], "stop"
                return True
        if len(seq.token_ids) >= seq.max_tokens:
            seq.finish_reason = "length"
            return True
        return False

    def _decode(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.token_ids, skip_special_tokens=True)

    # -- weights

    def load_weights(self, path: str, step: int) -> int:
        """Replace the live weights with the safetensors in `path` (an HF model directory); all or nothing."""
        import torch

        state = read_safetensors_dir(path)
        live = self.model.state_dict()
        tied = _tied_names(self.model)
        missing = [k for k in live if k not in state and k not in tied]
        unexpected = [k for k in state if k not in live]
        if missing and unexpected:
            # a checkpoint in the layout transformers saves, not the one it runs (an MoE's experts: one tensor per
            # expert on disk, fused in memory): its own loading converts them
            state = _converted(type(self.model), path) or state
            missing = [k for k in live if k not in state and k not in tied]
            unexpected = [k for k in state if k not in live]
        mismatched = [
            f"{k}: {tuple(state[k].shape)} vs {tuple(live[k].shape)}"
            for k in state
            if k in live and state[k].shape != live[k].shape
        ]
        problems = []
        if missing:
            problems.append(f"missing {len(missing)} tensors (e.g. {missing[0]})")
        if unexpected:
            problems.append(f"{len(unexpected)} tensors this model does not have (e.g. {unexpected[0]})")
        if mismatched:
            problems.append(f"shape mismatch ({mismatched[0]})")
        if problems:  # the wording rl/client.py WEIGHTS_MISMATCH_MARKER knows: a restart does not retry it
            raise RequestError(f"{path} does not fit the served model: {'; '.join(problems)}; nothing was loaded")
        with torch.no_grad():
            for name, tensor in state.items():
                live[name].copy_(tensor.to(dtype=live[name].dtype))
        self.weights_step = step
        logger.info("loaded weights of step %d from %s", step, path)
        return step


def read_safetensors_dir(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every tensor in the safetensors files of an HF model directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise RequestError(f"weights path {str(root)!r} is not a directory")
    files = sorted(root.glob("*.safetensors"))  # one model.safetensors, or the shards of a large model
    if not files:
        raise RequestError(f"no {WEIGHTS_FILE} in {root}")
    state: dict[str, Any] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise RequestError(f"could not read {file}: {exc}") from None
    return state


def _converted(model_class, path: str) -> dict[str, Any] | None:
    """The state dict transformers' from_pretrained makes of the checkpoint at `path` (its weight conversions
    applied), on the CPU; None when it cannot load it."""
    try:
        return model_class.from_pretrained(path, dtype="auto").state_dict()
    except (OSError, ValueError, RuntimeError) as exc:
        logger.warning("%s: transformers could not load it either: %s", path, exc)
        return None


def _tied_names(model) -> set[str]:
    # save_pretrained writes a tied weight once; the live state_dict lists it under both names
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied.add(name)
        else:
            seen[id(tensor)] = name
    return tied


def _make_generator(seq: Sequence, device):
    import random

    import torch

    seed = seq.job.params.seed
    if seed is None:
        value = random.getrandbits(63)
    else:
        # each sample of each prompt gets its own stream, so batch composition cannot change the result. Sample j
        # of a seeded prompt draws with seed + j, as vLLM's n samples do; prompt i of a request is seeded as if sent
        # alone with seed + i*n (vLLM would give every prompt of a request the same seed), so a split of the
        # prompts over several requests (RolloutPool) samples the same tokens
        value = (seed + seq.prompt_index * seq.job.n + seq.sample_index) % (1 << 63)
    gen = torch.Generator(device=device)
    gen.manual_seed(value)
    return gen


def _sample(logits, params: SamplingParams, generator) -> tuple[int, float, dict[int, float] | None]:
    import torch

    temperature = params.temperature
    logprobs = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
    if temperature <= 0:
        token = int(torch.argmax(logprobs))
    else:
        probs = logprobs.exp()
        if params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        token = int(torch.multinomial(probs, 1, generator=generator))
    top = None
    if params.logprobs:
        values, ids = torch.topk(logprobs, min(params.logprobs, logprobs.numel()))
        top = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    return token, float(logprobs[token]), top


def _autocast(device):
    import contextlib

    import torch

    if getattr(device, "type", str(device)).startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def latest_published_weights(run_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Published weights directories of a run, newest first, as (step, path).

    A directory named step-<N> is whole: the trainer writes step-<N>.tmp and renames it (export_hf).
    """
    root = RunDir(run_dir).weights_dir
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = [
        (int(e.name[5:]), root / e.name)
        for e in entries
        if e.name.startswith("step-") and e.name[5:].isdigit() and e.is_dir()
    ]
    return sorted(found, reverse=True)
