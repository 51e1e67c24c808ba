"""A profiled run: a few real steps of the job under the supervisor, timed by the engine, for `prime-train profile`
and `prime-train cost --measure` (the CLI renders the summary: prime_train/cli/run.py).

The job runs in its own run directory, `<output_dir>/<name>-profile`, so the real run's checkpoints,
metrics and resume state are never touched. The supervisor starts it exactly as `prime-train run`
would (torchrun for several processes, inference workers for RL); the engine sees
PRIME_TRAIN_PROFILE and times its phases (prime_train/engine/profiling.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from prime_train.config.schema import Config
from prime_train.contract import ExitCode

MARKER = ".prime-train-profile"


def profile_config(cfg: Config, warmup: int, steps: int) -> Config:
    """The run config of a profile: its own run directory, fresh start, no restarts, no export."""
    data = cfg.model_dump()
    data["run"]["name"] = f"{cfg.run.name}-profile"
    data["train"]["max_steps"] = warmup + steps
    data["ckpt"].update(resume="never", export_final=False, resumable_final_save=False, remote=None)
    data["ckpt"]["interval"] = max(cfg.ckpt.interval, warmup + steps + 1)  # only the timed save
    data["supervisor"]["max_restarts"] = 0
    return Config.model_validate(data)


def _clear_previous(root: Path) -> None:
    """Remove an earlier profile's directory: only one this command made (it carries the marker).

    Anything else at that path (a run of that name, a directory of the user's, a symlink, a file) is refused with
    ProfileFailed (exit 78), untouched: the profile would run in it, and the next profile would delete it.
    """
    if not os.path.lexists(root):
        return
    marker = root / MARKER
    if root.is_dir() and not root.is_symlink():
        if marker.is_file() and not marker.is_symlink():
            shutil.rmtree(root)
            return
        if not any(root.iterdir()):
            return
    raise ProfileFailed(
        f"{root} exists and is not a profile's directory (it has no {MARKER}): nothing was changed. "
        "A profile runs in <run.output_dir>/<run.name>-profile: give the run another run.name, or move that away.",
        ExitCode.CONFIG,
    )


def run_profile(pcfg: Config, *, warmup: int, steps: int, observer) -> tuple[int, dict | None, Path]:
    """Run a profile config (from `profile_config`) under the supervisor; returns (exit code, summary or None,
    profile run directory)."""
    from prime_train.contract import ENV_PROFILE, read_json
    from prime_train.resilience.supervisor import Supervisor, SupervisorOptions
    from prime_train.rundir import RunDir

    root = Path(pcfg.run_dir)
    _clear_previous(root)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).write_text("made by prime-train profile; removed by the next one\n")
    previous = os.environ.get(ENV_PROFILE)
    os.environ[ENV_PROFILE] = f"{warmup},{steps}"
    try:
        sup = Supervisor(pcfg, observer, SupervisorOptions())
        code = sup.run()
    finally:
        if previous is None:
            os.environ.pop(ENV_PROFILE, None)
        else:
            os.environ[ENV_PROFILE] = previous
    return code, read_json(RunDir(root).profile_summary_path), root


class ProfileFailed(RuntimeError):
    """The profile could not run or wrote no summary; `code` is the exit code to end with."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def profile(cfg: Config, *, warmup: int, steps: int, console, preflight: bool = True) -> tuple[int, dict]:
    """`prime-train profile` and `cost --measure`: (preflight,) the profiled run with a live status line, its summary.

    Raises ProfileFailed when preflight fails or the job wrote no summary.
    """
    from prime_train.resilience.console import ConsoleObserver

    pcfg = profile_config(cfg, warmup, steps)
    if preflight:
        from prime_train.validator.preflight import preflight_command

        code = preflight_command(pcfg, as_json=False, quiet_pass=True, stderr=console.stderr)
        if code != 0:
            raise ProfileFailed("preflight failed: fix the above first", code)
    with ConsoleObserver(console) as observer:
        code, summary, root = run_profile(pcfg, warmup=warmup, steps=steps, observer=observer)
    if summary is None:
        raise ProfileFailed(
            f"the profiled job wrote no summary (exit {code}); see {root}/logs/latest", code or ExitCode.FAILED
        )
    return code, summary
