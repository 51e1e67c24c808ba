"""LoRA / QLoRA ([lora]) before a launch: lint's checks of the config, and preflight's of the machine that trains.

The engine (engine/lora.py) refuses what cannot run only once the job has started; these say it first, in the
engine's own words where they overlap (`LoraConfig.unavailable`). Lint knows the config and this machine's
packages: peft (and for lora.quantize = "nf4" bitsandbytes) must import here, nf4 cannot run sharded (FSDP, HSDP),
target_modules must name linear layers of the model when its shape is known, and an adapter exported alone needs a
base someone can load. Preflight adds what only the training machine knows: whether CUDA is usable there (the cuda
check, from the GPU inventory or its replay). Never imports peft, bitsandbytes or torch: find_spec only.
"""

from __future__ import annotations

import importlib.util

from prime_train.config.loader import Problem, Sources
from prime_train.config.schema import Config
from prime_train.validator.checks import FAIL, PASS, CheckResult
from prime_train.validator.model_shape import model_shape
from prime_train.validator.param_count import AdapterCount, count_adapters, count_parameters

LORA_INSTALL = "pip install 'prime-train[lora]'"


def installed(module: str) -> bool:
    """Whether `module` can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, a module whose __spec__ is None
        return False


def missing_peft(cfg: Config) -> str | None:
    """Why lora.rank > 0 cannot run here for want of peft, or None."""
    if installed("peft"):
        return None
    return f"lora.rank = {cfg.lora.rank} needs the peft package, which is not installed: {LORA_INSTALL}"


def adapters(cfg: Config) -> AdapterCount | None:
    """The adapters [lora] puts on the run's model, when its shape is known here (no download); else None."""
    hf, _ = model_shape(cfg)
    if hf is None or not cfg.lora.enabled:
        return None
    try:
        return count_adapters(hf, cfg.lora.rank, cfg.lora.target_modules, cfg.lora.target_parameters)
    except (KeyError, TypeError, ValueError):
        return None


def unmatched_targets(ad: AdapterCount) -> str | None:
    """Why lora.target_modules cannot be applied (entries naming no linear layer of a model the counter mirrors)."""
    if not ad.unmatched or not (ad.exact or not ad.adapted):
        return None
    shown = ", ".join(repr(t) for t in ad.unmatched)
    return (
        f"lora.target_modules: {shown} {'matches' if len(ad.unmatched) == 1 else 'match'} no linear layer in the "
        f"decoder blocks of the model; its linear layers are: {', '.join(ad.linear_names)} (an entry names the "
        "layers whose name is it or ends in '.<entry>'), or use 'all-linear'"
    )


# ---------------------------------------------------------------- lint


def lora_problems(cfg: Config, sources: Sources, *, spot: bool = False) -> list[Problem]:
    """Lint's [lora] checks. Packages missing here are errors, except for a config that runs on spot nodes, where
    they are the nodes' to have: a warning then."""
    lora = cfg.lora
    if not lora.enabled or cfg.job.command:
        return []
    problems = []
    here = "warning" if spot else "error"
    nodes = " on this machine (the spot nodes must install it too)" if spot else ""
    if why := missing_peft(cfg):
        problems.append(sources.problem(("lora", "rank"), here, why.replace("not installed", "not installed" + nodes)))
    if lora.quantize == "nf4":
        dist = cfg.distributed
        # one process shards nothing, and the engine trains it unwrapped whatever the strategy says
        strategy = "none" if dist.nproc_per_node == 1 and dist.nnodes == 1 else dist.strategy
        if why := lora.unavailable(strategy=strategy, cuda=True, bitsandbytes=True):
            problems.append(sources.problem(("lora", "quantize"), "error", why))
        elif not installed("bitsandbytes"):
            why = lora.unavailable(strategy=strategy, cuda=True, bitsandbytes=False) or ""
            problems.append(
                sources.problem(("lora", "quantize"), here, why.replace("not installed", "not installed" + nodes))
            )
    if not lora.merge_on_export and cfg.model.path is None:
        problems.append(
            sources.problem(
                ("lora", "merge_on_export"),
                "warning",
                "lora.merge_on_export = false with a random-initialised model (model.path unset): final/ will hold "
                "the adapter alone, and its base exists only inside this run, so no one can load it; set "
                "lora.merge_on_export = true, or start from a model.path",
            )
        )
    ad = adapters(cfg)
    if ad is not None and (why := unmatched_targets(ad)):
        problems.append(sources.problem(("lora", "target_modules"), "error", why))
    if ad is not None and (why := ad.expert_problem()):
        problems.append(sources.problem(("lora", "target_parameters"), "error", why))
    return problems


# ---------------------------------------------------------------- preflight


def check_lora(cfg: Config, cuda: CheckResult, strategy: str) -> CheckResult | None:
    """Preflight's "lora" check (None when LoRA is off): peft importable, and for nf4 a usable CUDA GPU (the cuda
    check's verdict), bitsandbytes and an unsharded `strategy` (resolved: 'none', 'ddp', 'fsdp' or 'hsdp')."""
    lora = cfg.lora
    if not lora.enabled or cfg.job.command:
        return None
    found: list[tuple[str, str]] = []  # (why, fix)
    if why := missing_peft(cfg):
        found.append((why, LORA_INSTALL))
    cuda_ok = bool(cuda.details.get("gpu_run")) and cuda.status == PASS
    if why := lora.unavailable(strategy=strategy, cuda=cuda_ok, bitsandbytes=installed("bitsandbytes")):
        fix = "set lora.quantize = 'none' (LoRA on the base as it is)"
        if not cuda_ok:
            fix = "run on a CUDA GPU (see the cuda check), or " + fix
        elif not installed("bitsandbytes"):
            fix = "pip install 'prime-train[qlora]', or " + fix
        found.append((why, fix))
    ad = adapters(cfg)
    if ad is not None and (why := unmatched_targets(ad)):
        found.append((why, "name layers the message lists in lora.target_modules"))
    if ad is not None and (why := ad.expert_problem()):
        found.append((why, "name expert tensors the message lists in lora.target_parameters, or leave it empty"))
    details: dict = {"rank": lora.rank, "quantize": lora.quantize, "strategy": strategy}
    hf, _ = model_shape(cfg)
    if ad is not None and hf is not None:
        total = count_parameters(hf) + ad.trainable
        details.update(trainable_params=ad.trainable, total_params=total, trainable_fraction=ad.trainable / total)
    if found:
        return CheckResult("lora", FAIL, "; ".join(w for w, _ in found), "; ".join(f for _, f in found), details)
    what = f"rank {lora.rank}, alpha {lora.scale_alpha:g}" + (", rsLoRA" if lora.rslora else "")
    what += ", base in NF4" if lora.quantize == "nf4" else ""
    if "total_params" in details:
        what += (
            f": {details['trainable_params']:,} trainable of {details['total_params']:,} parameters "
            f"({100 * details['trainable_fraction']:.3f} %)"
        )
    return CheckResult("lora", PASS, what, None, details)
