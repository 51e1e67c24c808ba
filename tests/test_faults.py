"""Faults a run must survive or name (issue 14), on real processes: a damaged newest checkpoint, a diverged
loss, a full disk (a real tmpfs of a few MiB, mounted in a user and mount namespace), a stop during start-up,
and a second `prime-train run` into a run directory that has one behind it."""

from __future__ import annotations

import math
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from enginetools import TINY, WIDE, cli, env, kill_group, start, tiny_overrides, wait_for

from prime_train.contract import read_heartbeat, read_json
from prime_train.kit.events import read_events
from prime_train.rundir import RunDir

JOBS = Path(__file__).parent / "jobs"
FAST = {"data.datasets.0.num_examples": 400, "supervisor.poll_interval_s": 0.5, "supervisor.backoff_initial_s": 0.2}


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout, env={**env(), **WIDE})


def events(run_dir: Path, name: str | None = None) -> list[dict]:
    found = read_events(run_dir / "events.jsonl")
    return [e for e in found if name is None or e["event"] == name]


# ---------------------------------------------------------------- 14.3: a damaged newest checkpoint


def test_a_truncated_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(tmp_path):
    # no save at the last step: step-4 is the newest checkpoint, the one damaged below
    last = {"train.max_steps": 6, "ckpt.interval": 2, "ckpt.resumable_final_save": "false"}
    trained = run_cli("train", str(TINY), *tiny_overrides(tmp_path, "damaged", **FAST, **last))
    assert trained.returncode == 0, trained.stdout[-3000:]
    run_dir = tmp_path / "damaged"
    data = next((run_dir / "checkpoints" / "step-4").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])  # the disk filled, or a copy was cut short

    result = run_cli(  # --resume: the run is finished, a raised train.max_steps is trained on only when asked
        "run", str(TINY), "--resume",
        *tiny_overrides(tmp_path, "damaged", **FAST, **{**last, "train.max_steps": 8}),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:]
    assert len(events(run_dir, "attempt_started")) == 1 and not events(run_dir, "failure"), "no crash, no loop"
    [quarantined] = events(run_dir, "checkpoint_quarantined")
    assert quarantined["step"] == 4 and "is truncated" in quarantined["reason"]
    assert "checkpoint step-4 failed verification" in result.stdout
    assert (run_dir / "checkpoints" / "step-4.corrupt").is_dir()
    assert read_heartbeat(run_dir / "progress.json").resumed_from == 2
    assert re.search(r"│ 1\s+│ [^│]+│ 2 → 8\s+│ 0 ", result.stdout), result.stdout[-2000:]


# ---------------------------------------------------------------- 14.4: a loss that is no longer a number


def test_a_diverged_loss_ends_the_run_as_loss_not_finite_without_a_retry_or_a_traceback(tmp_path):
    result = run_cli("run", str(TINY), *tiny_overrides(tmp_path, "diverged", **FAST, **{
        "train.max_steps": 30, "train.lr": 100, "train.warmup_steps": 1, "supervisor.max_restarts": 3}))  # fmt: skip
    run_dir = tmp_path / "diverged"
    assert result.returncode == 1, result.stdout[-4000:]
    [failure] = events(run_dir, "failure")
    assert failure["kind"] == "loss_not_finite" and "not finite at step" in failure["message"]
    [decision] = events(run_dir, "decision")
    assert decision["restart"] is False and "diverge again" in decision["reason"]
    hb = read_json(run_dir / "progress.json")
    assert hb["phase"] == "failed" and hb["failure"] == "loss_not_finite" and hb["step"] < 30
    out = result.stdout + result.stderr
    assert "Traceback" not in out and "lower train.lr" in out.lower()
    assert "run diverged: failed" in out  # the summary table was printed, not a crash in the console
    assert not list((run_dir / "checkpoints").glob("step-*")), "nothing of the diverged weights was saved"


def test_run_file_readers_and_the_console_take_null_nan_and_bytes_that_are_not_utf8(tmp_path):
    from prime_train.engine.metrics import read_metrics
    from prime_train.resilience.console import final_results, status_line

    run_dir = RunDir(tmp_path / "run")
    run_dir.create()
    run_dir.metrics_path.write_bytes(
        b'{"step": 1, "loss": 2.5}\n'
        b'{"step": 2, "loss": null, "eval_loss": NaN}\n'
        b"\xff\xfe\x00 not json, not UTF-8\n"
        b'{"step": 3, "loss": Infinity, "eval_loss": null, "eval_exact_match": 0.5}\n'
        b"[1, 2]\n"
        b'{"step": 4, "lo'
    )
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert final_results(run_dir, written_since=0) == [
        "step 3: loss inf",
        "eval at step 3: eval_loss null, eval_exact_match 0.5000",
    ]
    run_dir.progress_path.write_bytes(b'{"step": 7, "phase": "step", "loss": NaN, "time": 1.0, "x": "\xff"}')
    hb = read_heartbeat(run_dir.progress_path)  # one stray byte does not hide the heartbeat
    assert hb.step == 7 and math.isnan(hb.loss)
    line = status_line({"attempt": 1, "step": 7, "max_steps": 10, "loss": float("nan"), "eta_s": float("nan"),
                        "tokens_per_s": None, "disk": None, "gpu": {"mean_utilization_pct": None}})  # fmt: skip
    assert "loss nan" in line and "eta -" in line


# ---------------------------------------------------------------- 14.5: a full disk


def _namespace_problem() -> str | None:
    """Why a tmpfs cannot be mounted in a user and mount namespace here, or None when it can."""
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a user namespace here (unprivileged user namespaces off?): {probe.stderr}"
    return None


NAMESPACE_PROBLEM = _namespace_problem()
needs_small_disk = pytest.mark.skipif(NAMESPACE_PROBLEM is not None, reason=str(NAMESPACE_PROBLEM))


def run_on_small_disk(tmp_path: Path, size: str, argv: list[str], timeout: float = 600) -> tuple[int, str, Path]:
    """Run `argv` with a real filesystem of `size` (tmpfs) mounted at tmp_path/disk, in a user and mount
    namespace of its own (no root needed); afterwards what is on it is copied to tmp_path/after. Returns the
    command's exit code, its output, and that copy."""
    disk, after = tmp_path / "disk", tmp_path / "after"
    disk.mkdir()
    after.mkdir()
    script = (
        f"mount -t tmpfs -o size={size} tmpfs {shlex.quote(str(disk))} || exit 99\n"
        f"{shlex.join(argv)}\n"
        'echo "exit=$?"\n'
        f"cp -a {shlex.quote(str(disk))}/. {shlex.quote(str(after))}/\n"
    )
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                            capture_output=True, text=True, timeout=timeout, env={**env(), **WIDE})  # fmt: skip
    code = re.findall(r"^exit=(\d+)$", result.stdout, re.M)
    assert code, result.stdout[-3000:] + result.stderr[-3000:]
    return int(code[-1]), result.stdout + result.stderr, after


@needs_small_disk
def test_the_supervisor_outlives_a_full_disk_under_its_own_files_and_writes_what_it_kept(tmp_path):
    from prime_train.config.loader import dump_toml
    from prime_train.config.schema import Config

    disk = tmp_path / "disk"
    job = [sys.executable, str(JOBS / "disk_filler.py"), "--filler", str(disk / "filler"),
           "--marker", str(tmp_path / "marker")]  # fmt: skip
    cfg = Config.model_validate({
        "run": {"name": "full", "output_dir": str(disk)},
        # the job's checkpoints (none) elsewhere: the disk watcher judges that disk, and only the supervisor's
        # own files (events, supervisor.json, logs) are on the full one
        "job": {"command": job, "checkpoint_dir": str(tmp_path / "ckpt")},
        "supervisor": {"max_restarts": 2, "poll_interval_s": 0.2, "backoff_initial_s": 0.5, "backoff_max_s": 1},
    })  # fmt: skip
    (tmp_path / "full.toml").write_text(dump_toml(cfg))
    code, out, after = run_on_small_disk(tmp_path, "2m", cli("run", str(tmp_path / "full.toml"), "--skip-preflight"))
    assert code == 0, out[-4000:]
    assert "Traceback" not in out
    run_dir = after / "full"
    # what the supervisor could not write while the disk was full, it kept and wrote once there was space
    failure = events(run_dir, "failure")
    assert len(failure) == 1 and failure[0]["exit_code"] == 3
    assert [e["attempt"] for e in events(run_dir, "attempt_started")] == [1, 2]
    assert events(run_dir, "run_finished")
    assert read_json(run_dir / "supervisor.json")["state"] == "done"


@needs_small_disk
def test_a_save_that_fills_the_disk_leaves_no_tmp_and_the_failure_says_what_is_left(tmp_path):
    disk = tmp_path / "disk"
    argv = cli("run", str(TINY), "--skip-preflight", *tiny_overrides(disk, "full", **FAST, **{
        "train.max_steps": 6, "ckpt.interval": 2, "ckpt.keep_last": 5, "supervisor.max_restarts": 1}))  # fmt: skip
    # one checkpoint of the tiny model is ~7.3 MB: step-2 fits in 12 MiB, step-4 does not
    code, out, after = run_on_small_disk(tmp_path, "12m", argv)
    assert code == 1, out[-4000:]
    run_dir = after / "full"
    failures = events(run_dir, "failure")
    assert len(failures) == 2 and {f["kind"] for f in failures} == {"disk_full"}
    assert re.search(r"free of 12\.0 MiB on .*; whole checkpoints left: step-2$", failures[-1]["message"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-2"]


def test_the_disk_full_statement_names_free_space_the_whole_checkpoints_and_what_is_set_aside(tmp_path):
    from prime_train.kit.ownership import disk_statement
    from prime_train.retention import quarantine_checkpoint

    ckpt = tmp_path / "checkpoints"
    for step in (2, 4):
        (ckpt / f"step-{step}").mkdir(parents=True)
        (ckpt / f"step-{step}" / ".metadata").write_bytes(b"m")
    (ckpt / "step-6.tmp").mkdir()  # an unfinished save is not left for anyone
    (ckpt / "step-4" / "__0_0.distcp").write_bytes(b"\0" * 3 * 1024 * 1024)
    quarantine_checkpoint(ckpt / "step-4", ckpt, "__0_0.distcp is truncated")
    statement = disk_statement(ckpt)
    assert re.fullmatch(
        rf"[0-9.]+ [KMGT]?i?B free of [0-9.]+ [KMGT]?i?B on {re.escape(str(ckpt))}; whole checkpoints left: step-2; "
        r"set aside as damaged, yours to delete once looked at: step-4\.corrupt \(3\.0 MiB\)",
        statement,
    ), statement
    assert disk_statement(tmp_path / "none").endswith("whole checkpoints left: none")


# ---------------------------------------------------------------- 14.11: what the console says


def test_sigterm_during_start_up_is_a_stop_and_no_earlier_final_is_announced(tmp_path):
    trained = run_cli(
        "train", str(TINY), *tiny_overrides(tmp_path, "early", **FAST, **{"train.max_steps": 4, "ckpt.interval": 2})
    )
    assert trained.returncode == 0 and (tmp_path / "early" / "final" / "config.json").exists()
    run_dir = tmp_path / "early"
    # --resume: the run is finished, and a raised train.max_steps is trained on only when asked (tests/test_rerun.py)
    proc = start([*cli("run", str(TINY), "--resume",
                       *tiny_overrides(tmp_path, "early", **FAST, **{"train.max_steps": 1000}))],
                 env={**env(), **WIDE})  # fmt: skip
    try:
        wait_for(lambda: events(run_dir, "process_started"), 120, "the trainer to be launched")
        proc.send_signal(signal.SIGTERM)  # the trainer is importing torch or building its model
        out, _ = proc.communicate(timeout=120)
    finally:
        kill_group(proc)
    assert proc.returncode == 75, out[-4000:]
    assert "crash" not in out and not events(run_dir, "failure"), out[-4000:]
    # on a loaded machine the signal can land after the resumed trainer's first step; either way it is a stop
    # that names where the next run resumes, never a crash
    assert (
        "before the attempt's first step: nothing new to checkpoint; the next run resumes from step-4" in out
        or re.search(r"stopped \(SIGTERM\) at step \d+; the next run resumes from step-\d+", out)
    ), out[-4000:]
    assert "model (HF format)" not in out, "final/ is from the earlier run, not this one"
    assert events(run_dir, "run_stopped")


def test_a_later_run_numbers_its_attempts_after_the_earlier_ones_and_its_table_starts_where_it_resumed(tmp_path):
    steps = {"ckpt.interval": 2}
    first = run_cli("run", str(TINY), *tiny_overrides(tmp_path, "again", **FAST, **steps, **{"train.max_steps": 4}))
    assert first.returncode == 0, first.stdout[-3000:]
    logs = tmp_path / "again" / "logs"
    before = (logs / "attempt-1" / "trainer.log").read_bytes()
    second = run_cli(
        "run", str(TINY), "--resume", *tiny_overrides(tmp_path, "again", **FAST, **steps, **{"train.max_steps": 6})
    )
    assert second.returncode == 0, second.stdout[-3000:]
    assert (logs / "attempt-1" / "trainer.log").read_bytes() == before, "a separate run appended to attempt-1"
    assert "resumed from" in (logs / "attempt-2" / "trainer.log").read_text()
    assert (logs / "latest").resolve() == (logs / "attempt-2").resolve()
    # the second run resumed from step-4, the first run's last (ckpt.resumable_final_save): 4 → 6, not 0 → 6
    assert re.search(r"│ 2\s+│ [^│]+│ 4 → 6\s+│ 0 ", second.stdout), second.stdout[-2000:]
    assert "model (HF format)" in second.stdout
