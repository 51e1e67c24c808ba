"""What lint knows of `[spot]`: SkyPilot's and the clouds' limits, checked without SkyPilot (laptops, pre-commit hooks).

`lint_spot` returns (key path, "error"|"warning", message) for validator/lint.py to attach to the config's lines.
"""

from __future__ import annotations

import re

from prime_train.config.accelerators import parse_accelerators
from prime_train.config.schema import Config
from prime_train.contract import ExitCode
from prime_train.kit.redact import is_secret_name

NO_SPOT = {"lambda": "Lambda Cloud has no spot instances", "kubernetes": "spot on Kubernetes needs spot-labelled nodes"}
NO_MULTI_NODE = {"runpod", "vast", "primeintellect"}
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _candidate_clouds(cfg: Config) -> list[str] | None:
    """Clouds the job may land on; None when any cloud with credentials may be used."""
    if cfg.spot.infra:
        cloud = cfg.spot.infra.split("/", 1)[0].lower()
        return ["kubernetes" if cloud == "k8s" else cloud]
    return list(dict.fromkeys(cfg.spot.clouds)) or None


def _limit(
    problems: list[tuple[tuple[str, ...], str, str]],
    key: tuple[str, ...],
    clouds: list[str],
    bad: list[str],
    what: str,
    because: str,
) -> None:
    if not bad:
        return
    if len(bad) == len(clouds):
        problems.append((key, "error", f"{what}: {because} ({', '.join(bad)})"))
    else:
        rest = [c for c in clouds if c not in bad]
        problems.append(
            (key, "warning", f"{what}: {because} ({', '.join(bad)}); SkyPilot will only use {', '.join(rest)}")
        )


def _gpus_per_node(text: str) -> tuple[int | None, str | None]:
    """The whole GPUs per node that spot.accelerators asks for, or the reason it asks for none that can train."""
    what = "spot.accelerators"
    try:
        accelerators = parse_accelerators(text, what=what)
        if accelerators.is_cpu:  # the task hands the string to SkyPilot, which has no accelerator called cpu
            return None, f"{what} {text!r}: a managed job asks SkyPilot for GPUs by name: name one, e.g. 'H100:8'"
        # SkyPilot allows a fraction of a GPU (shared by tasks); torchrun starts one training process per whole GPU
        return accelerators.whole_count("a training node runs one process per GPU", what=what), None
    except ValueError as exc:
        return None, str(exc)


def lint_spot(cfg: Config) -> list[tuple[tuple[str, ...], str, str]]:
    """Known limits of `[spot]` as (key path, "error"|"warning", message); key paths suit Sources.problem.

    Meant for configs that use spot (a [spot] table, or `run --spot`): the defaults alone would
    otherwise warn on every config.
    """
    return [
        *_accelerator_problems(cfg),
        *_cloud_problems(cfg),
        *_node_count_problems(cfg),
        *_checkpoint_problems(cfg),
        *_recovery_problems(cfg),
        *_secret_problems(cfg),
    ]


def _accelerator_problems(cfg: Config) -> list[tuple[tuple[str, ...], str, str]]:
    """spot.accelerators names whole GPUs, and distributed.nproc_per_node starts one process on each."""
    problems: list[tuple[tuple[str, ...], str, str]] = []
    gpus, problem = _gpus_per_node(cfg.spot.accelerators)
    if problem:
        problems.append((("spot", "accelerators"), "error", problem))
    nproc = cfg.distributed.nproc_per_node
    if gpus is not None and nproc is not None and nproc != gpus:
        problems.append(
            (
                ("distributed", "nproc_per_node"),
                "warning",
                f"distributed.nproc_per_node ({nproc}) differs from the {gpus} GPU(s) per node in spot.accelerators; "
                "unset it to use one process per GPU",
            )
        )
    return problems


def _cloud_problems(cfg: Config) -> list[tuple[tuple[str, ...], str, str]]:
    """The clouds the job may land on offer spot instances and multi-node clusters when the config asks for them."""
    spot = cfg.spot
    problems: list[tuple[tuple[str, ...], str, str]] = []
    clouds = _candidate_clouds(cfg)
    key_clouds = ("spot", "infra") if spot.infra else ("spot", "clouds")
    if clouds is not None:
        if spot.use_spot:
            bad = [c for c in clouds if c == "lambda"]
            _limit(problems, key_clouds, clouds, bad, "spot.use_spot = true", NO_SPOT["lambda"])
            if "kubernetes" in clouds:
                problems.append((key_clouds, "warning", f"spot.use_spot on kubernetes: {NO_SPOT['kubernetes']}"))
        if spot.num_nodes > 1:
            bad = [c for c in clouds if c in NO_MULTI_NODE]
            _limit(
                problems,
                key_clouds,
                clouds,
                bad,
                f"spot.num_nodes = {spot.num_nodes}",
                "SkyPilot cannot run multi-node clusters there",
            )
    if spot.infra and spot.clouds:
        problems.append((("spot", "clouds"), "warning", "spot.clouds is ignored because spot.infra is set"))
    return problems


def _node_count_problems(cfg: Config) -> list[tuple[tuple[str, ...], str, str]]:
    """spot.num_nodes and distributed.nnodes agree, so lint checks the batch arithmetic at the size the job runs."""
    spot = cfg.spot
    if spot.num_nodes != cfg.distributed.nnodes:
        return [
            (
                ("spot", "num_nodes"),
                "warning",
                f"spot.num_nodes ({spot.num_nodes}) differs from distributed.nnodes ({cfg.distributed.nnodes}); "
                f"the job runs on {spot.num_nodes} node(s): set distributed.nnodes = {spot.num_nodes} so lint "
                "checks the batch arithmetic at that size",
            )
        ]
    return []


def _recovery_problems(cfg: Config) -> list[tuple[tuple[str, ...], str, str]]:
    """spot.recover_on_exit_codes recovers a preempted job, never a failed one, and within spot.max_recoveries."""
    spot = cfg.spot
    problems: list[tuple[tuple[str, ...], str, str]] = []
    if ExitCode.PREEMPTED not in spot.recover_on_exit_codes:
        preempted = int(ExitCode.PREEMPTED)
        problems.append(
            (
                ("spot", "recover_on_exit_codes"),
                "warning",
                f"spot.recover_on_exit_codes lacks {preempted}: a job that checkpointed and stopped on a preemption "
                f"notice exits {preempted} and would count as an error instead of being recovered",
            )
        )
    recovered = sorted(set(spot.recover_on_exit_codes))
    if ExitCode.FAILED in recovered:
        problems.append(
            (
                ("spot", "recover_on_exit_codes"),
                "error",
                f"spot.recover_on_exit_codes holds {int(ExitCode.FAILED)}, the code a job ends with when its restarts "
                "are exhausted or spot.max_recoveries is reached: SkyPilot would recover it without limit",
            )
        )
    if recovered and cfg.ckpt.remote is None and spot.ckpt_mount is None:
        problems.append(
            (
                ("spot", "max_recoveries"),
                "warning",
                f"spot.max_recoveries is not enforced without ckpt.remote or spot.ckpt_mount (recoveries are "
                f"counted in the bucket): "
                f"SkyPilot recovers exit codes {recovered} without limit",
            )
        )
    return problems


def _secret_problems(cfg: Config) -> list[tuple[tuple[str, ...], str, str]]:
    """spot.secrets are environment variable names kept out of spot.env, and spot.env holds no credential."""
    spot = cfg.spot
    problems: list[tuple[tuple[str, ...], str, str]] = []
    for name in spot.secrets:
        if not _ENV_NAME.match(name):
            problems.append(
                (("spot", "secrets"), "error", f"spot.secrets: {name!r} is not an environment variable name")
            )
        elif name in spot.env:
            problems.append(
                (
                    ("spot", "env", name),
                    "error",
                    f"{name} is in both spot.env and spot.secrets: remove it from spot.env (its value would be "
                    "written to the task YAML)",
                )
            )
    for name in spot.env:
        if name not in spot.secrets and is_secret_name(name):
            problems.append(
                (
                    ("spot", "env", name),
                    "warning",
                    f"spot.env.{name} looks like a credential: it reaches the nodes as a SkyPilot secret, not in the "
                    "task YAML, but its value sits in this config file; list the name in spot.secrets instead and "
                    "export it where you launch",
                )
            )
    return problems


def ckpt_mount_problem(cfg: Config) -> str | None:
    """Why spot.ckpt_mount has nowhere to mount its bucket (ckpt.dir unset or relative), or None; lint's error and
    the task generator's refusal."""
    where = cfg.ckpt.dir
    if cfg.spot.ckpt_mount is None or (where and (where.startswith("/") or where.startswith("~/"))):
        return None
    return (
        f"spot.ckpt_mount mounts {cfg.spot.ckpt_mount} at ckpt.dir on every node, and ckpt.dir is "
        f"{'unset' if not where else repr(where) + ', not an absolute path'}: set ckpt.dir to where the nodes "
        f"should see it, e.g. ckpt.dir = '/checkpoints/{cfg.run.name}'"
    )


def _checkpoint_problems(cfg: Config) -> list[tuple[tuple[str, ...], str, str]]:
    """Where a recovered job finds its checkpoints: ckpt.remote (one node) or spot.ckpt_mount (any number)."""
    spot, ck = cfg.spot, cfg.ckpt
    if spot.ckpt_mount is not None:
        problem = ckpt_mount_problem(cfg)
        return [(("ckpt", "dir"), "error", problem)] if problem else []
    if not spot.use_spot:
        return []
    if spot.num_nodes > 1:
        # ckpt.remote uploads one node's run directory; above one node the checkpoint is in ckpt.dir, on every node
        return [(("spot", "ckpt_mount"), "warning", f"spot.num_nodes = {spot.num_nodes} on spot without "
                 "spot.ckpt_mount: a recovery replaces every node, and ckpt.dir goes with them unless it is a "
                 "filesystem that outlives them; set spot.ckpt_mount = 's3://bucket/prefix' (SkyPilot mounts it at "
                 "ckpt.dir on every node) so the recovered job resumes")]  # fmt: skip
    if ck.remote is None:
        return [(("ckpt", "remote"), "warning", "spot.use_spot without ckpt.remote: a preempted node takes its local "
                 "disk and checkpoints with it; set ckpt.remote = 's3://bucket/prefix' so the recovered job "
                 "resumes")]  # fmt: skip
    return []
