"""Running `prime-train run` again on a run directory: what it means, decided before anything launches.

- A run that is not finished resumes from its newest whole checkpoint, as after a crash: that is the point of
  re-running a stopped or preempted run.
- A finished run is not trained again unasked: re-running the same command says where its result is and exits 0.
  Finished means the embedded job's heartbeat says `done` (it writes that after the final export, under `run`
  and `train` alike); for an external command, the supervisor's own record (supervisor.json) says `done`.
- `--resume` continues a finished run: the one meaningful case is a raised `train.max_steps`. A finished engine
  run already at its `train.max_steps` has nothing to continue, and is left alone.
- A config that differs from the run's own (its config.toml) is said key by key (`key: old -> new`) and recorded
  in events.jsonl (`config_changed`). Resuming a stopped run keeps the run's values, so a plain re-run never
  changes a run's schedule half way; `--resume` applies the new ones (`config_drift`).
- `--fresh` starts over in the same directory: the old run's outputs are moved, never deleted, to
  `previous/<UTC time>/` (checkpoints, metrics, heartbeat, final/, TensorBoard, the W&B id); events.jsonl and
  logs/ stay, so the directory's history is whole and the new attempts are numbered after the old ones.
  The move is journaled: `.set-aside.json` in the run directory names the destination and what moves before the
  first rename, and goes once the last is done; a run directory that still holds one was interrupted part way
  (kill -9, a power loss) and the next `run` or `train` finishes the move (`finish_set_aside`) before it decides
  anything. The heartbeat moves first, so a half-moved run never reads as finished.
"""

from __future__ import annotations

import contextlib
import os
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_train.config.diff import Change, diff
from prime_train.config.loader import MASK, to_toml_dict
from prime_train.config.schema import Config
from prime_train.contract import (
    Phase,
    SupervisorState,
    fsync_dir,
    read_heartbeat,
    read_json,
    read_regular,
    write_json_atomic,
)
from prime_train.retention import newest_external_checkpoint
from prime_train.rundir import RunDir, list_checkpoints, newest_checkpoint

# The old run's outputs, moved aside by --fresh; what remains (events.jsonl, logs/, gpu.jsonl) is history.
# The heartbeat first: it is what says "finished", and a move cut short after it can never read as a finished run.
OLD_RUN_OUTPUTS = (
    "progress.json",
    "checkpoints",
    "weights",
    "final",
    "metrics.jsonl",
    "tensorboard",
    "wandb_id.json",  # a fresh run is a new W&B run: W&B drops steps lower than a resumed run's last
)
PREVIOUS_DIR = "previous"
# the keys that say where the run directory is (Config.run_dir): a resumed run keeps its own values but these
PLACE_KEYS = ("run.output_dir", "run.name")
# --fresh's journal in the run directory: {"dest": "<folder in previous/>", "moving": [names], "started": time},
# written before the first rename and removed after the last (see finish_set_aside)
SET_ASIDE_JOURNAL = ".set-aside.json"


class RerunRefused(Exception):
    """--fresh cannot set the old run aside safely; the message says what to do instead."""


@dataclass(frozen=True)
class Finished:
    """A run directory whose job completed: the step it reached and where its exported model is."""

    step: int | None
    final_dir: Path | None
    reason: str | None = None  # why it ended before train.max_steps (early stopping), when it did


@dataclass(frozen=True)
class Rerun:
    """What `prime-train run` does with an existing run directory: launch or not, and what to say first."""

    launch: bool
    message: str | None = None


@dataclass(frozen=True)
class ConfigDrift:
    """How the config asked for now differs from the run directory's config.toml, and which one the run uses."""

    changes: list[Change]
    kept: bool  # True: the run's own values (cfg is its config.toml's); False: the new ones apply
    cfg: Config  # the config to run

    def describe(self) -> str:
        listed = "; ".join(f"{c.key}: {_shown(c.old)} -> {_shown(c.new)}" for c in self.changes)
        if self.kept:
            return (
                f"this config differs from the run's own (config.toml): {listed}. Resuming with the run's values; "
                "--resume applies the new ones, --fresh starts over"
            )
        return f"--resume with a changed config, the new values apply: {listed}"

    def event_fields(self) -> dict[str, Any]:
        changes = [{"key": c.key, "old": c.old, "new": c.new} for c in self.changes]
        return {"changes": changes, "kept_run_values": self.kept}


def _shown(value: Any) -> str:
    return "(unset)" if value is None else repr(value) if isinstance(value, str) else str(value)


def config_drift(cfg: Config, *, fresh: bool, resume: bool) -> ConfigDrift | None:
    """None when the run directory has no config.toml or it resolves to the same config (secrets aside: they are
    `***` in the file). Otherwise the changes, and the config to run: the run's own while a stopped run resumes
    without --resume, the new one with --resume (or for a run with nothing to resume from)."""
    if fresh:
        return None
    from prime_train.launch import masked_run_config

    layout = cfg.layout
    try:
        stored = tomllib.loads(read_regular(layout.config_path).decode("utf-8"))
    except (OSError, ValueError):
        return None  # no earlier config (a new run), or one that is not TOML: nothing to compare with
    new = tomllib.loads(masked_run_config(cfg).text)
    # where the directory is, this command found it: one moved or copied since its config.toml was written is this
    # run in its new place, never a reason to train in the old one
    changes = [c for c in diff(stored, new) if MASK not in f"{c.old}{c.new}" and c.key not in PLACE_KEYS]
    if not changes:
        return None
    resumable = (
        read_heartbeat(layout.progress_path) is not None or newest_checkpoint(layout.checkpoints_dir) is not None
    )
    if resume or not resumable or finished_run(cfg) is not None:
        return ConfigDrift(changes, kept=False, cfg=cfg)
    if isinstance(stored.get("run"), dict):
        stored["run"].update(output_dir=cfg.run.output_dir, name=cfg.run.name)
    try:
        kept = Config.model_validate(_unmasked(stored, to_toml_dict(cfg)))
    except ValueError:  # written by another version of prime-train: the new config it is, said
        return ConfigDrift(changes, kept=False, cfg=cfg)
    return ConfigDrift(changes, kept=True, cfg=kept)


def _unmasked(stored: Any, current: Any) -> Any:
    """`stored` with each `***` it holds replaced by the value at the same place in `current` (the secrets)."""
    if isinstance(stored, dict):
        here = current if isinstance(current, dict) else {}
        return {k: _unmasked(v, here.get(k)) for k, v in stored.items()}
    if isinstance(stored, list):
        here = current if isinstance(current, list) else []
        return [_unmasked(v, here[i] if i < len(here) else None) for i, v in enumerate(stored)]
    if isinstance(stored, str) and MASK in stored and current is not None:
        return current
    return stored


def finished_run(cfg: Config) -> Finished | None:
    """The finished run in cfg's run directory, or None when there is none (never run, or stopped part way)."""
    run_dir = cfg.layout
    if os.path.lexists(run_dir.root / SET_ASIDE_JOURNAL):
        return None  # a --fresh cut short: the run it set aside is not this directory's any more
    final = run_dir.final_dir if (run_dir.final_dir / "config.json").is_file() else None
    if cfg.job.command:
        state = read_json(run_dir.supervisor_path) or {}
        if state.get("state") != SupervisorState.DONE:
            return None
        step = state.get("step")
        return Finished(step if isinstance(step, int) else None, final)
    hb = read_heartbeat(run_dir.progress_path)
    if hb is None or hb.phase is not Phase.DONE:
        return None
    return Finished(hb.step, final, hb.reason)


def plan_rerun(cfg: Config, *, fresh: bool, resume: bool) -> Rerun:
    """Launch or not, given what the run directory holds and what was asked (--fresh, --resume, or neither)."""
    if fresh:
        _check_fresh(cfg)
        return Rerun(True)
    done = finished_run(cfg)
    if done is None:
        return Rerun(True)  # never run, or stopped part way: resume from the newest whole checkpoint, as ever
    at = f"step {done.step}" if done.step is not None else "its last step"
    where = f"; its model is in {done.final_dir}" if done.final_dir is not None else ""
    why = f", {done.reason}" if done.reason else ""
    said = f"run {cfg.run.name} is finished (at {at}{why}){where}"
    if cfg.job.command:
        # an external job's step count is its own business: --resume starts it again with its resume_args
        if resume:
            return Rerun(True, f"{said}; --resume: starting the job again")
        return Rerun(False, f"{said}. Nothing to do: --fresh starts over, --resume starts the job again")
    target = cfg.train.max_steps
    if done.step is None or target > done.step:
        if resume:
            return Rerun(True, f"{said}; --resume: training on to train.max_steps = {target}{_retrained(cfg, done)}")
        # a raised train.max_steps: likely meant, but training on is asked for, never implied by a re-run
        return Rerun(
            False,
            f"{said}. This config asks for train.max_steps = {target}: --resume trains on to it, --fresh starts over",
        )
    if resume:
        return Rerun(
            False,
            f"{said}; train.max_steps = {target} is not beyond it, so there is nothing to resume: "
            "raise --train.max_steps to train on",
        )
    return Rerun(
        False, f"{said}. Nothing to do: --fresh starts over; --resume trains on (with a higher train.max_steps)"
    )


def _retrained(cfg: Config, done: Finished) -> str:
    """What --resume of a finished run trains again: the steps after its newest checkpoint, when that is not its
    last step (a run that ended with ckpt.resumable_final_save off, or before it was on by default)."""
    if done.step is None:
        return ""
    newest = newest_checkpoint(cfg.layout.checkpoints_dir)
    start = newest.step if newest is not None else 0
    if start >= done.step:
        return ""
    where = f"step-{start}, its newest checkpoint" if newest is not None else "step 0: it has no checkpoint"
    return (
        f". It has no checkpoint at its last step (ckpt.resumable_final_save was off), so it resumes from {where}, "
        f"and steps {start + 1}-{done.step} are trained again"
    )


def _check_fresh(cfg: Config) -> None:
    """Refuse --fresh where old checkpoints outside the run directory would be resumed from all the same."""
    if cfg.ckpt.remote and not cfg.job.command:
        raise RerunRefused(
            f"--fresh: ckpt.remote = {cfg.ckpt.remote!r} still holds the old run's checkpoints, and a run with none "
            "here restores the newest from there; give the new run its own ckpt.remote prefix or run.name"
        )
    layout = cfg.layout
    moved_dir = layout.root / "checkpoints"  # what set_aside moves (OLD_RUN_OUTPUTS)
    kept = layout.checkpoints_dir
    if not cfg.job.command and os.path.abspath(kept) != os.path.abspath(moved_dir) and list_checkpoints(kept):
        raise RerunRefused(
            f"--fresh: ckpt.dir = {cfg.ckpt.dir!r} still holds the old run's checkpoints, which --fresh does not "
            "move (only the run directory's own outputs), and the new run would resume from them; give it its own "
            "ckpt.dir, or move them away"
        )
    job = cfg.job
    if (
        job.command
        and job.checkpoint_dir
        and job.resume_args
        and newest_external_checkpoint(Path(job.checkpoint_dir), job.checkpoint_pattern) is not None
    ):
        raise RerunRefused(
            f"--fresh: job.checkpoint_dir = {job.checkpoint_dir!r} holds the job's own checkpoints, which "
            "job.resume_args would resume from; move them away (prime-train does not touch that directory)"
        )


def set_aside(
    run_dir: RunDir,
    now: float | None = None,
    *,
    record: Callable[[Path, list[str]], None] | None = None,
) -> tuple[Path, list[str]] | None:
    """Move the old run's outputs into previous/<UTC time>/; returns that folder and what moved (None: nothing).

    Renames within the run directory: instant and free whatever the checkpoints weigh, and nothing is lost.
    `record(dest, names)` is told first (events.jsonl), then the journal is written, then the renames run: a
    process killed part way leaves the journal, and the next start finishes the move (finish_set_aside).
    """
    unfinished = finish_set_aside(run_dir)  # an earlier --fresh cut short: its move is finished first
    present = [name for name in OLD_RUN_OUTPUTS if os.path.lexists(run_dir.root / name)]
    if not present:
        return unfinished
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    dest = run_dir.root / PREVIOUS_DIR / stamp
    n = 1
    while dest.exists():  # two --fresh starts within one second
        n += 1
        dest = run_dir.root / PREVIOUS_DIR / f"{stamp}-{n}"
    if record is not None:
        record(dest, present)
    journal = run_dir.root / SET_ASIDE_JOURNAL
    write_json_atomic(journal, {"dest": dest.name, "moving": present, "started": time.time()})
    _move(run_dir, dest, present)
    return dest, present


def finish_set_aside(run_dir: RunDir) -> tuple[Path, list[str]] | None:
    """Finish a --fresh that was cut short (its journal is still in the run directory): move what it had not
    moved yet into the folder it named, then drop the journal. Returns that folder and everything the set-aside
    moved (None: no journal). Call it while owning the run directory, before anything reads what the run holds.

    Raises OSError when a rename fails (the journal stays: the next start tries again), ValueError when the
    journal names something it never writes (a destination outside previous/, a name that is not an output).
    """
    journal = run_dir.root / SET_ASIDE_JOURNAL
    if not os.path.lexists(journal):
        return None
    if journal.is_symlink() or not journal.is_file():
        raise ValueError(f"{journal} is not the file --fresh writes: remove it by hand")
    note = read_json(journal)
    if note is None:
        # written atomically, so never half a file; unreadable all the same (a disk error): nothing moved yet
        with contextlib.suppress(FileNotFoundError):
            journal.unlink()
        fsync_dir(run_dir.root)
        return None
    dest_name, moving = note.get("dest"), note.get("moving")
    if (
        not isinstance(dest_name, str)
        or not dest_name
        or dest_name in (".", "..")
        or "/" in dest_name
        or os.sep in dest_name
        or not isinstance(moving, list)
        or not all(isinstance(m, str) and m in OLD_RUN_OUTPUTS for m in moving)
    ):
        raise ValueError(f"{journal} does not read as --fresh's journal: remove it by hand")
    dest = run_dir.root / PREVIOUS_DIR / dest_name
    _move(run_dir, dest, [m for m in moving if os.path.lexists(run_dir.root / m)])
    return dest, list(moving)


def _move(run_dir: RunDir, dest: Path, names: list[str]) -> None:
    """Rename `names` from the run directory into `dest` (made if missing), then drop the journal, durably."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in names:
        target = dest / name
        if os.path.lexists(target):
            # moved before an interruption, and something made an empty one since: the moved one is the old run's
            source = run_dir.root / name
            if source.is_dir() and not source.is_symlink() and not any(source.iterdir()):
                source.rmdir()
                continue
            raise OSError(f"--fresh: {source} and {target} both exist; move one of them away by hand")
        os.rename(run_dir.root / name, target)
    fsync_dir(dest)
    fsync_dir(dest.parent)
    with contextlib.suppress(FileNotFoundError):
        (run_dir.root / SET_ASIDE_JOURNAL).unlink()
    fsync_dir(run_dir.root)


def describe_set_aside(dest: Path, moved: list[str]) -> str:
    """What --fresh moved, and what the old checkpoints weigh where they are now (the user decides to delete)."""
    ckpts = list_checkpoints(dest / "checkpoints")
    note = ""
    if ckpts:
        size = sum(f.stat().st_size for c in ckpts for f in c.path.rglob("*") if f.is_file())
        newest = newest_checkpoint(dest / "checkpoints")
        assert newest is not None
        note = f" ({len(ckpts)} checkpoint(s) up to step-{newest.step}, {size / 1e9:.2f} GB: delete them when unneeded)"
    return f"--fresh: starting over; the old run's {', '.join(moved)} moved to {dest}{note}"
