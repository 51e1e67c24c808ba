"""Preflight's RL checks: the token budget, the RL gotchas, where the trainer and the workers go, the vLLM
environment the workers run from, and the reward model of the reward-model environment.

rl/budget.py works out the findings from what it is given; this module gives it what only this
machine knows (its GPUs, real or replayed, and the model's size) and turns the findings into
preflight checks. Nothing here runs unless run.job == "rl" with the embedded engine.
"""

from __future__ import annotations

import os
from pathlib import Path

from prime_train.config.schema import Config
from prime_train.environments import EnvironmentLoadError, RewardModelEnvironment, load_environment
from prime_train.kit.gpu import gpu_inventory, readings_of
from prime_train.launch import gpu_devices
from prime_train.reward_scorer import check_reward_model as reward_model_config
from prime_train.rl.budget import Finding, check_gotchas, check_token_budget
from prime_train.rl.vllm_server import CPU_MIN_HEAD_SIZE, no_environment_problem
from prime_train.rl.workers import GpuPlan, gpu_plan, resolve_backend, vllm_environment
from prime_train.validator.checks import FAIL, PASS, WARN, CheckResult
from prime_train.validator.model_shape import model_shape
from prime_train.validator.param_count import count_parameters


def rl_preflight_checks(cfg: Config) -> list[CheckResult]:
    """The "gpu placement", "token budget", "rl gotchas" and (vLLM workers) "vllm environment" checks; none unless
    run.job == 'rl'."""
    if cfg.run.job != "rl" or cfg.job.command:
        return []
    devices = gpu_devices()
    placement, plan = check_gpu_placement(cfg, devices)
    gpus = readings_of(gpu_inventory(), plan.trainer[:1]) if plan is not None and plan.trainer else []
    memory = gpus[0].memory_total_mib * 2**20 if gpus and gpus[0].memory_total_mib else None
    hf, _ = model_shape(cfg)
    gotchas = check_gotchas(
        cfg,
        gpu_memory_bytes=memory,
        num_params=count_parameters(hf) if hf is not None else None,
        colocated=plan.colocated if plan is not None else None,
    )
    checks = [
        placement,
        _as_check("token budget", check_token_budget(cfg), "prompt + rl.max_tokens fit inference.max_model_len"),
        _as_check("rl gotchas", gotchas, "no known RL gotcha"),
    ]
    # a backend that cannot resolve already failed "gpu placement", saying why
    if plan is not None and resolve_backend(cfg, len(plan.trainer)) == "vllm":
        checks.append(check_vllm_environment(cfg, hf, cpu=not plan.trainer))
    if cfg.rl.environment == RewardModelEnvironment.name:
        checks.append(check_reward_model(cfg, trainer_gpus=plan.trainer if plan is not None else devices))
    return checks


def check_reward_model(cfg: Config, trainer_gpus: list[str]) -> CheckResult:
    """rl.env_args.path is a reward model the trainer can load (checked from its files, nothing loaded), and where
    it will score: the trainer's process, on its GPU or the CPU."""
    try:
        env = load_environment(cfg.rl.environment, cfg.rl.env_args)
    except EnvironmentLoadError as exc:
        return CheckResult("reward model", FAIL, str(exc), "rl.env_args.path: a reward run's final/")
    assert isinstance(env, RewardModelEnvironment)
    config = reward_model_config(env.path)
    weights = sum(os.path.getsize(p) for p in Path(os.path.expanduser(env.path)).glob("*.safetensors"))
    device = env.scorer.device_name
    where = "the CPU" if device == "cpu" or (device == "auto" and not trainer_gpus) else "the trainer's GPU"
    message = (
        f"{env.path}: {', '.join(config['architectures'])}, one score, {weights / 2**20:.1f} MiB of safetensors; "
        f"scored in the trainer's process on {where}, {env.scorer.batch_size} sequences a pass "
        f"(reward = {env.model_weight:g} · model + {env.rule_weight:g} · {env.rule.name} rule)"
    )
    return CheckResult("reward model", PASS, message)


def check_vllm_environment(cfg: Config, hf: dict | None, *, cpu: bool) -> CheckResult:
    """The vLLM the workers would run (inference.python, or the installed venv): a supported version, and on
    the CPU a model whose attention heads vLLM's CPU kernels take."""
    env = vllm_environment(cfg)
    if env is None:
        return CheckResult("vllm environment", FAIL, no_environment_problem(), "prime-train inference install")
    if env.problem:
        return CheckResult("vllm environment", FAIL, env.problem, "inference.python")
    message = env.describe()
    if cpu and hf is not None:
        heads = int(hf.get("num_attention_heads") or 0)
        head_dim = int(hf.get("head_dim") or (int(hf.get("hidden_size") or 0) // heads if heads else 0))
        if 0 < head_dim < CPU_MIN_HEAD_SIZE:
            return CheckResult(
                "vllm environment", FAIL,
                f"{message}, but the model's head size is {head_dim} (hidden_size / num_attention_heads) and vLLM's "
                f"CPU attention needs {CPU_MIN_HEAD_SIZE} or more: it would die at the first rollout",
                "model.path (a model with larger heads), or inference.backend = 'embedded'",
            )  # fmt: skip
    return CheckResult("vllm environment", PASS, message)


def check_gpu_placement(cfg: Config, devices: list[str]) -> tuple[CheckResult, GpuPlan | None]:
    """Which GPUs the trainer and each rollout worker get on this machine, or why there is no placement."""
    n = cfg.inference.num_workers
    try:
        backend = resolve_backend(cfg, len(devices))
    except ValueError as exc:
        return CheckResult("gpu placement", FAIL, str(exc), "inference.backend"), None
    plan = gpu_plan(cfg, devices)
    workers = f"{n} {backend} worker{'s' if n != 1 else ''}"
    if not devices:
        return CheckResult("gpu placement", PASS, f"no GPU: the trainer and {workers} run on the CPU"), plan
    names = {str(r.index): r.name for r in gpu_inventory()}
    trainer = ", ".join(f"{d} ({names[d]})" if d in names else d for d in plan.trainer)
    if plan.colocated:
        message = f"trainer on GPU {trainer}; {workers} share it"
        if backend == "vllm":
            message += f" (vLLM within inference.gpu_memory_utilization = {cfg.inference.gpu_memory_utilization})"
        if plan.note:
            message += f" ({plan.note})"
    else:
        given = "; ".join(f"inference-{i} on GPU {','.join(d)}" for i, d in enumerate(plan.workers))
        message = f"{given}; trainer on GPU {trainer}"
    return CheckResult("gpu placement", PASS, message, details={"trainer": plan.trainer, "workers": plan.workers}), plan


def _as_check(name: str, findings: list[Finding], ok: str) -> CheckResult:
    if not findings:
        return CheckResult(name, PASS, ok)
    status = FAIL if any(sev == "error" for sev, _, _ in findings) else WARN
    message = "; ".join(msg for _, msg, _ in findings)
    keys = sorted({key for _, _, key in findings})
    return CheckResult(name, status, message, f"change {', '.join(keys)}", {"findings": [list(f) for f in findings]})
