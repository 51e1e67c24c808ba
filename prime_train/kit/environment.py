"""The environment every process of a job gets from its owner: the one place it is built.

`prime-train run` gives it to each child of an attempt (resilience/plan.py); it is what the job reads of the
contract (docs/architecture.md "Environment"): the run directory, the attempt, the owner it must outlive no
longer than, and the real values of the secrets config.toml shows as ***.
"""

from __future__ import annotations

from collections.abc import Mapping

from prime_train.config.schema import Config
from prime_train.contract import ENV_ATTEMPT, ENV_RUN_DIR, ENV_SUPERVISOR, RunDir
from prime_train.kit.ownership import supervisor_token
from prime_train.kit.redact import Redactor


def job_environment(
    cfg: Config, run_dir: RunDir, attempt: int, *, redactor: Redactor, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """What every process of attempt `attempt` gets on top of the owner's own environment; `extra` last (a test's,
    a profiled run's PRIME_TRAIN_PROFILE)."""
    return {
        **redactor.masked_config(cfg).env,  # the real values of config.toml's ***, for the job
        "PYTHONUNBUFFERED": "1",
        ENV_RUN_DIR: str(run_dir.root),
        ENV_ATTEMPT: str(attempt),
        ENV_SUPERVISOR: supervisor_token(),  # the job stops when this process is gone (engine/lifeline.py)
        **(extra or {}),
    }
