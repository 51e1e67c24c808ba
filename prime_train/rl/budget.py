"""Token budgets and RL gotchas, checked by lint and preflight before anything launches.

A rollout whose prompt + max_tokens exceeds the server's max_model_len used to be refused by vLLM (up to
0.11: in a GRPO loop, a trainer waiting at "0/8 rollouts" for hours); vLLM 0.30+ (and the embedded worker)
instead clamps max_tokens to the room the prompt leaves, so those completions are silently cut short, and
refuses only a prompt that leaves no room at all. Either way the budget is wrong: here the environment's
train prompts are tokenised with the run's tokenizer (a sample, 99th-percentile length) and the sum is
compared with inference.max_model_len up front. Lint also names the flags of inference.extra_args that the
supported vLLM (0.30+) no longer has.

Torch-free and fast: the byte tokenizer is counted as UTF-8 bytes, a local tokenizer.json is read with
`tokenizers` (no transformers import), and nothing here runs unless run.job == "rl".
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from prime_train.config.schema import Config

if TYPE_CHECKING:
    from prime_train.config.loader import Problem, Sources

Severity = Literal["error", "warning"]
Finding = tuple[Severity, str, str]  # (severity, message, dotted config key)
TokenCounter = Callable[[str], int]

SAMPLE_PROMPTS = 512
PERCENTILE = 0.99
# Slack under min(500 tokens, 10 % of max_model_len) is a warning. The 10 % rule governs short contexts
# (the tiny config's 512 would otherwise always warn: 500 tokens is 98 % of it), the 500-token floor long
# ones (10 % of 128k is far more headroom than a chat template or tokenizer drift can eat).
WARN_SLACK_TOKENS = 500
WARN_SLACK_FRACTION = 0.10

# Remote tool executor: an assumed 0.5 s round trip per tool call (a sandbox service across a region:
# request, container exec, response) against milliseconds for a local subprocess; one call per rollout
# is a lower bound, multi-turn rollouts make several.
REMOTE_TOOL_ROUND_TRIP_S = 0.5
# Colocated trainer: fp32 master weights 4 + gradients 4 + Adam moments 8 bytes per parameter, plus the
# CUDA context and workspaces; GPU memory when NVML cannot tell us (an 80 GB A100/H100).
TRAINER_BYTES_PER_PARAM = 16
TRAINER_OVERHEAD_BYTES = 2 << 30
ASSUMED_GPU_MEMORY_BYTES = 80e9
# vLLM environment variables that do nothing from a version on: (name, first version ignoring it, why).
DEAD_VLLM_VARIABLES = (("VLLM_USE_V1", (0, 11), "V1 is the only engine since vLLM 0.11 and the variable was removed"),)


# ---------------------------------------------------------------- tokenising prompts


def _byte_count(text: str) -> int:
    # The built-in byte tokenizer maps each UTF-8 byte to one token and adds no special tokens.
    return len(text.encode("utf-8"))


def _tokenizer_json(source: str) -> Path | None:
    """tokenizer.json of a local directory, or of a hub id already in the HF cache (never downloads)."""
    local = Path(os.path.expanduser(source))
    try:
        if local.is_dir():
            found = local / "tokenizer.json"
            return found if found.is_file() else None
    except OSError:  # a name the filesystem refuses (too long, bad bytes): not a local directory
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "tokenizer.json")
    except Exception:  # not installed, or not a valid repo id
        return None
    return Path(cached) if isinstance(cached, str) else None


def token_counter(cfg: Config) -> tuple[TokenCounter | None, str]:
    """A function counting a prompt's tokens with the run's tokenizer, and its description (or why there is none)."""
    m = cfg.model
    source, key = (m.tokenizer, "model.tokenizer") if m.tokenizer else (m.path, "model.path")
    if source is None:
        return _byte_count, "the byte tokenizer"
    path = _tokenizer_json(source)
    if path is None:
        return None, f"{key} = {source!r} has no local tokenizer.json (not downloaded, or a slow-only tokenizer)"
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        return None, f"{path} could not be read ({type(exc).__name__}: {str(exc).splitlines()[0]})"
    return (lambda text: len(tok.encode(text, add_special_tokens=True).ids)), str(path)


def _as_counter(tokenizer: Any) -> TokenCounter:
    """A counter from a callable, a `tokenizers.Tokenizer` or a transformers tokenizer."""
    if hasattr(tokenizer, "encode"):

        def count(text: str) -> int:
            ids = tokenizer.encode(text)
            return len(getattr(ids, "ids", ids))

        return count
    return tokenizer


def percentile(values: list[int], q: float) -> int:
    """The nearest-rank q-th percentile (the smallest value with at least q of the values at or below it)."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q * len(ranked)) - 1)]


# ---------------------------------------------------------------- token budget


def _pending_local_model(cfg: Config) -> bool:
    """model.tokenizer/path names a local directory that does not exist yet (an earlier run's final/, say)."""
    source = cfg.model.tokenizer or cfg.model.path
    if source is None:
        return False
    # a hub id is "org/name"; more slashes, or a leading ./ / ~, is a filesystem path
    looks_local = source.startswith(("/", ".", "~")) or source.count("/") > 1
    return looks_local and not os.path.exists(os.path.expanduser(source))


def check_token_budget(cfg: Config, tokenizer: Any = None, *, pending_ok: bool = False) -> list[Finding]:
    """Problems of p99 prompt length + rl.max_tokens + rl.budget_margin_tokens against inference.max_model_len.

    `pending_ok`: say nothing when the tokenizer is a local directory not written yet (lint of a config that
    starts from an earlier run's output; preflight, run when it exists, checks it).
    """
    if cfg.run.job != "rl" or cfg.job.command:
        return []
    from prime_train.environments import EnvironmentLoadError, load_environment

    try:
        env = load_environment(cfg.rl.environment, cfg.rl.env_args)
        prompts = env.prompts("train", SAMPLE_PROMPTS, cfg.run.seed)
    except EnvironmentLoadError as exc:
        # at the line of the key the message names: an argument's, or the environment's
        return [("error", str(exc), "rl.env_args" if str(exc).startswith("rl.env_args") else "rl.environment")]
    if tokenizer is not None:
        count, described = _as_counter(tokenizer), "the given tokenizer"
    else:
        count, described = token_counter(cfg)
    if count is None:
        if pending_ok and _pending_local_model(cfg):
            return []
        return [
            (
                "warning",
                f"token budget not checked: {described}; run `prime-train preflight` where the tokenizer is "
                "available, or point model.tokenizer at a local directory",
                "inference.max_model_len",
            )
        ]
    if not prompts:
        return []
    p99 = percentile([count(p.text) for p in prompts], PERCENTILE)
    rl, limit = cfg.rl, cfg.inference.max_model_len
    total = p99 + rl.max_tokens + rl.budget_margin_tokens
    sum_text = (
        f"rl.max_tokens ({rl.max_tokens}) + p99 prompt length ({p99}, {len(prompts)} {env.name} prompts, "
        f"{described}) + margin ({rl.budget_margin_tokens}) = {total}"
    )
    if total > limit:
        return [
            (
                "error",
                f"{sum_text} exceeds inference.max_model_len ({limit}): raise inference.max_model_len or lower "
                "rl.max_tokens (vLLM 0.30+ cuts the longest prompts' completions short: it clamps max_tokens to the "
                "room left, and refuses prompts that leave none)",
                "rl.max_tokens",
            )
        ]
    slack = limit - total
    threshold = min(WARN_SLACK_TOKENS, WARN_SLACK_FRACTION * limit)
    if slack < threshold:
        return [
            (
                "warning",
                f"{sum_text} leaves {slack} of inference.max_model_len ({limit}) free, under "
                f"min({WARN_SLACK_TOKENS} tokens, {WARN_SLACK_FRACTION:.0%}) = {threshold:g}: longer prompts than "
                "the sample get their completions cut short; raise inference.max_model_len or lower rl.max_tokens",
                "inference.max_model_len",
            )
        ]
    return []


# ---------------------------------------------------------------- gotchas


def check_vllm_args(cfg: Config) -> list[Finding]:
    """Flags in inference.extra_args that vLLM removed since 0.11: the supported vLLM (0.30+) refuses to start."""
    if cfg.run.job != "rl" or cfg.job.command or cfg.inference.backend == "embedded":
        return []
    from prime_train.rl.vllm_server import SUPPORTED_FROM, gone_flags  # torch-free

    since = ".".join(map(str, SUPPORTED_FROM))
    return [
        ("warning", f"inference.extra_args has {flag}, which vLLM no longer has ({why}); vLLM {since}+ stops at "
                    "start with 'unrecognized arguments': remove it", "inference.extra_args")
        for flag, why in gone_flags(cfg.inference.extra_args)
    ]  # fmt: skip


def _vllm_version() -> tuple[int, ...] | None:
    from prime_train.rl.vllm_server import installed_vllm  # torch-free: parses package metadata only

    return installed_vllm()


def check_gotchas(
    cfg: Config,
    *,
    environ: dict[str, str] | None = None,
    gpu_memory_bytes: float | None = None,
    vllm_version: tuple[int, ...] | None = None,
    uses_tools: bool | None = None,
    num_params: int | None = None,
    colocated: bool | None = None,
) -> list[Finding]:
    """Warnings for RL setups that run but waste hours.

    The caller (preflight) measures what this machine has: `gpu_memory_bytes` of one GPU, the model's
    `num_params`, and whether inference shares the trainer's GPUs (`colocated`, by default
    inference.colocate); without a parameter count the colocation check is skipped. The other arguments
    replace live probes (tests, replays).
    """
    if cfg.run.job != "rl" or cfg.job.command:
        return []
    findings: list[Finding] = []
    if cfg.rl.tool_executor == "remote":
        findings += _remote_tool_findings(cfg, uses_tools)
    if cfg.inference.colocate if colocated is None else colocated:
        findings += _colocation_findings(cfg, gpu_memory_bytes, num_params)
    findings += check_vllm_args(cfg)
    findings += _dead_variable_findings(environ, vllm_version)
    return findings


def _remote_tool_findings(cfg: Config, uses_tools: bool | None) -> list[Finding]:
    """A remote tool executor with a tool-calling environment: each tool call waits on a round trip."""
    rl = cfg.rl
    if uses_tools is None:
        from prime_train.environments import EnvironmentLoadError, load_environment

        try:
            uses_tools = bool(load_environment(rl.environment, rl.env_args).uses_tools)
        except EnvironmentLoadError:
            uses_tools = False  # the budget check reports the load error itself
    if not uses_tools:
        return []
    rollouts = rl.prompts_per_step * rl.group_size
    added = rollouts * REMOTE_TOOL_ROUND_TRIP_S
    return [
        (
            "warning",
            f"rl.tool_executor = 'remote' with the tool-calling environment {rl.environment!r}: latency-bound, "
            f"about {added:.0f} s added per step ({rl.prompts_per_step} prompts × {rl.group_size} completions "
            f"× {REMOTE_TOOL_ROUND_TRIP_S} s assumed round trip per tool call, one call each, as the worst "
            "case when calls are not overlapped); set rl.tool_executor = 'local'",
            "rl.tool_executor",
        )
    ]


def _colocation_findings(cfg: Config, gpu_memory_bytes: float | None, num_params: int | None) -> list[Finding]:
    """Inference sharing the trainer's GPU leaves the trainer too little of it (skipped without a parameter count)."""
    if num_params is None:
        return []
    inf = cfg.inference
    measured = gpu_memory_bytes
    gpu_mem = measured or ASSUMED_GPU_MEMORY_BYTES
    need = num_params * TRAINER_BYTES_PER_PARAM + TRAINER_OVERHEAD_BYTES
    room = (1.0 - inf.gpu_memory_utilization) * gpu_mem
    if need <= room:
        return []
    where = f"{gpu_mem / 1e9:.0f} GB GPU" + ("" if measured else " (assumed: NVML unavailable)")
    # round down to 0.05 so the suggestion leaves at least the estimate free
    suggested = math.floor((1.0 - need / gpu_mem) * 20) / 20
    advice = (
        f"set inference.gpu_memory_utilization = {suggested:.2f}"
        if suggested >= 0.1
        else "the trainer alone needs most of the GPU: set inference.colocate = false"
    )
    return [
        (
            "warning",
            f"inference shares the trainer's GPU with inference.gpu_memory_utilization = "
            f"{inf.gpu_memory_utilization} "
            f"leaves {room / 1e9:.1f} GB of a {where} to the trainer, which needs about "
            f"{need / 1e9:.1f} GB ({num_params / 1e6:,.1f}M params × {TRAINER_BYTES_PER_PARAM} bytes for "
            f"fp32 weights, gradients and Adam, + {TRAINER_OVERHEAD_BYTES / 2**30:.0f} GiB runtime); "
            f"{advice}",
            "inference.gpu_memory_utilization",
        )
    ]


def _dead_variable_findings(environ: dict[str, str] | None, vllm_version: tuple[int, ...] | None) -> list[Finding]:
    """vLLM environment variables set here that the installed vLLM (or none) no longer reads."""
    env = os.environ if environ is None else environ
    installed = vllm_version if vllm_version is not None else _vllm_version()
    findings: list[Finding] = []
    for name, since, why in DEAD_VLLM_VARIABLES:
        # Only the name is ever printed: a value in the environment may be anything, even a secret.
        if name in env and (installed is None or installed >= since):
            version = "vLLM is not installed" if installed is None else f"vLLM {'.'.join(map(str, installed))}"
            findings.append(
                (
                    "warning",
                    f"{name} is set but does nothing ({version}; {why}); unset it so it does not mislead",
                    "inference.backend",
                )
            )
    return findings


# ---------------------------------------------------------------- the algorithm's own keys


def group_size_problem(rl) -> str | None:
    """GRPO's advantage compares a prompt's completions with each other: one completion has nothing to compare
    with. PPO's baseline is its value head, so one completion per prompt is enough."""
    if rl.algorithm == "grpo" and rl.group_size < 2:
        return (
            f"rl.group_size = {rl.group_size}: GRPO's advantages compare the completions of one prompt with each "
            "other, so it needs 2 or more (8 is usual); raise rl.group_size, or set rl.algorithm = 'ppo', whose value "
            "head is the baseline"
        )
    return None


def check_algorithm(cfg: Config) -> list[Finding]:
    """rl.group_size against rl.algorithm, and GRPO's advantage keys set for a PPO run, where they do nothing."""
    rl = cfg.rl
    if (problem := group_size_problem(rl)) is not None:
        return [("error", problem, "rl.group_size")]
    if rl.algorithm != "ppo":
        return []
    findings: list[Finding] = []
    if rl.drop_zero_variance_groups:
        findings.append((
            "warning",
            "rl.drop_zero_variance_groups does nothing with rl.algorithm = 'ppo': PPO's advantages come from the "
            "value head, so a group whose completions all scored alike still has them; every completion is learnt "
            "from",
            "rl.drop_zero_variance_groups",
        ))  # fmt: skip
    if "scale_rewards" in rl.model_fields_set and rl.scale_rewards != "group":
        findings.append((
            "warning",
            f"rl.scale_rewards = {rl.scale_rewards!r} does nothing with rl.algorithm = 'ppo': PPO whitens its GAE "
            "advantages over the batch's tokens",
            "rl.scale_rewards",
        ))  # fmt: skip
    return findings


# ---------------------------------------------------------------- wiring into lint and preflight


def _key_path(key: str) -> tuple[str, ...]:
    return tuple(key.split("."))


def lint_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """The algorithm, token-budget and vLLM-flag findings as lint Problems at their config keys (none unless
    run.job == 'rl')."""
    if cfg.run.job != "rl":
        return []
    findings = check_algorithm(cfg) + check_token_budget(cfg, pending_ok=True) + check_vllm_args(cfg)
    return [sources.problem(_key_path(key), sev, msg) for sev, msg, key in findings]
