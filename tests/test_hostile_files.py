"""Read-only commands on huge or hostile files stay bounded: `status`, `logs`, `lint` and `diagnose` read and render
within fixed limits of memory and time (issue 26), and say what they left out. Also the end-of-run table's "time
lost", which is the wall time the failure threw away.

Each command runs in a fresh interpreter; its peak memory is its own (os.wait4), asserted under 200 MB. The time
limit is a hang guard only. Files over 100 MB are sparse: they take no disk, but a reader that reads them whole
still holds every byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

from prime_train.config.schema import Config
from prime_train.contract import ExitCode
from prime_train.kit import bounded
from prime_train.kit.failures import Failure, FailureKind
from prime_train.resilience import logscan
from prime_train.resilience.console import summary_table
from prime_train.resilience.supervisor import Attempt
from prime_train.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "200", "TERMINAL_WIDTH": "200", "NO_COLOR": "1"}
MAX_RSS = 200 * 2**20
HANG_GUARD_S = 30
BIG = 50_000_000  # the 50 MB event line, written for real: a sparse file cannot hold valid JSON
SPARSE = 400_000_000


@dataclass
class Ran:
    code: int
    stdout: str
    stderr: str
    max_rss: int  # bytes


# Runs the command and reports its peak memory. A process forked from pytest would report pytest's own memory as
# its peak (Linux keeps a process's high-water mark across exec), so the command is started from this small one.
MEASURE = """
import json, os, subprocess, sys, threading
proc = subprocess.Popen(sys.argv[3:], stdout=open(sys.argv[1] + ".out", "wb"), stderr=open(sys.argv[1] + ".err", "wb"))
timer = threading.Timer(float(sys.argv[2]), proc.kill)
timer.start()
_, status, usage = os.wait4(proc.pid, 0)
timer.cancel()
proc.returncode = code = os.waitstatus_to_exitcode(status)
json.dump({"code": code, "max_rss": usage.ru_maxrss * 1024}, open(sys.argv[1], "w"))
"""


def run_measured(tmp_path: Path, *args: str) -> Ran:
    """`prime-train ARGS` in a fresh interpreter; its exit code, output and its own peak memory."""
    result = tmp_path / "measured.json"
    command = [sys.executable, "-m", "prime_train", *args]
    measure = [sys.executable, "-c", MEASURE, str(result), str(HANG_GUARD_S), *command]
    subprocess.run(measure, check=True, env={**os.environ, **WIDE}, cwd=REPO, timeout=HANG_GUARD_S + 30)
    got = json.loads(result.read_text())
    out, err = (Path(f"{result}.{s}").read_text(errors="replace") for s in ("out", "err"))
    ran = Ran(got["code"], out, err, got["max_rss"])
    assert ran.code != -9, f"prime-train {' '.join(args)} was killed after {HANG_GUARD_S} s (a hang guard)"
    assert ran.max_rss < MAX_RSS, f"prime-train {' '.join(args)} peaked at {ran.max_rss / 2**20:.0f} MB"
    return ran


def sparse(path: Path, head: bytes, size: int, tail: bytes = b"") -> None:
    """`head`, then NUL bytes that take no disk, up to `size`, then `tail`."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
        f.seek(0, os.SEEK_END)
        f.write(tail)


@pytest.fixture(scope="module")
def big_event_run(tmp_path_factory) -> Path:
    """A run whose events.jsonl holds one failure event of 50 MB between ordinary ones."""
    run = RunDir(tmp_path_factory.mktemp("hostile") / "run")
    run.create()
    run.supervisor_path.write_text(json.dumps({"state": "failed", "pid": 0, "attempt": 1, "restarts": 0}))
    with open(run.events_path, "w") as f:
        f.write(json.dumps({"time": 1.0, "event": "attempt_started", "attempt": 1}) + "\n")
        f.write(json.dumps({"time": 2.0, "event": "failure", "kind": "crash", "message": "x" * BIG}) + "\n")
        f.write(json.dumps({"time": 3.0, "event": "attempt_ended", "attempt": 1}) + "\n")
    return run.root


# ---------------------------------------------------------------- status


def test_status_on_a_50_mb_event_line_skips_it_with_a_note(big_event_run, tmp_path):
    ran = run_measured(tmp_path, "status", str(big_event_run))
    assert ran.code == 0, ran.stderr
    assert "failed" in ran.stdout
    assert "attempt_started" in ran.stdout and "attempt_ended" in ran.stdout  # the events around it still show
    assert "a line of 47.7 MiB skipped" in ran.stdout
    ran = run_measured(tmp_path, "status", str(big_event_run), "--json")
    doc = json.loads(ran.stdout)
    assert [e["event"] for e in doc["recent_events"]] == ["attempt_started", "attempt_ended"]
    assert any("skipped" in note for note in doc["notes"])


def test_status_cuts_a_long_message_before_rich_lays_it_out(tmp_path):
    """A failure message of 5 MB (just under what one file may hold): 27 s in rich's folding before."""
    run = RunDir(tmp_path / "run")
    run.create()
    failure = {"kind": "crash", "message": "y" * 3_000_000}
    run.supervisor_path.write_text(json.dumps({"state": "failed", "pid": 0, "last_failure": failure}))
    run.events_path.write_text(json.dumps({"time": 1.0, "event": "z" * 900_000}) + "\n")
    ran = run_measured(tmp_path, "status", str(run.root))
    assert ran.code == 0, ran.stderr
    assert "more characters]" in ran.stdout
    assert len(ran.stdout) < 20_000


def test_status_on_absurdly_big_supervisor_progress_metrics_and_config_files(tmp_path):
    run = RunDir(tmp_path / "run")
    run.create()
    sparse(run.supervisor_path, b'{"state": "running", "note": "', SPARSE, b'"}')
    sparse(run.progress_path, b'{"step": 3, "phase": "step", "reason": "', SPARSE, b'"}')
    sparse(run.config_path, b'[run]\nname = "', SPARSE, b'"\n')
    rows = [json.dumps({"step": s, "time": 1.0, "reward": 0.5, "loss": 1.0}) + "\n" for s in (1, 2)]
    sparse(run.metrics_path, "".join(rows).encode() + b'{"step": 3, "reward": "', SPARSE, b'"}\n')
    with open(run.metrics_path, "a") as f:
        f.write(json.dumps({"step": 4, "time": 2.0, "reward": 0.75, "loss": 1.0}) + "\n")
    ran = run_measured(tmp_path, "status", str(run.root), "--json")
    assert ran.code == 0, ran.stderr
    doc = json.loads(ran.stdout)
    assert doc["state"] == "unknown" and doc["step"] is None  # neither file was read
    assert doc["rl"]["reward"]["latest"] == 0.75  # the rows around the huge one were
    notes = "\n".join(doc["notes"])
    for name in ("supervisor.json", "progress.json", "config.toml"):
        assert f"{name}: not read: 381.5 MiB, over the" in notes, notes
    assert "metrics.jsonl: a line of over 32.0 MiB skipped" in notes  # read no further than the file's head
    assert run_measured(tmp_path, "status", str(run.root)).code == 0


@pytest.mark.parametrize("name", ["progress.json", "supervisor.json", "events.jsonl", "metrics.jsonl", "config.toml"])
def test_a_fifo_at_a_file_the_run_directory_holds_is_not_waited_on(tmp_path, name):
    # the trial: a named pipe planted at progress.json hung `status` forever in open(), waiting for a writer
    run = RunDir(tmp_path / "run")
    run.create()
    run.supervisor_path.write_text(json.dumps({"state": "failed", "pid": 0, "attempt": 1, "restarts": 0}))
    run.events_path.write_text(json.dumps({"time": 1.0, "event": "attempt_started", "attempt": 1}) + "\n")
    run.progress_path.write_text(json.dumps({"step": 3, "phase": "failed"}))
    folder = run.attempt_logs(1)
    folder.mkdir(parents=True)
    (folder / "trainer.log").write_text("a line\n")
    (run.logs_dir / "latest").symlink_to("attempt-1")
    (run.root / name).unlink(missing_ok=True)
    os.mkfifo(run.root / name)
    for args in (("status", str(run.root), "--json"), ("status", str(run.root)), ("logs", str(run.root))):
        ran = run_measured(tmp_path, *args)  # fails at its hang guard when a reader waits on the pipe
        assert ran.code == 0 and "Traceback" not in ran.stderr, (args, ran.stderr)
    os.mkfifo(folder / "worker.log")
    for lines in ("20", "0"):  # from the end, and every line
        assert run_measured(tmp_path, "logs", str(run.root), "--process", "worker", "-n", lines).code in (0, 1)
    # the readers the supervisor and the engine share: an unreadable file reads as missing
    from prime_train.contract import read_json, read_jsonl

    assert read_json(run.root / name) is None and read_jsonl(run.root / name) == []
    assert bounded.read_json(run.root / name) is None and bounded.read_text(run.root / name) is None


# ---------------------------------------------------------------- logs


@pytest.fixture(scope="module")
def one_line_log_run(tmp_path_factory) -> Path:
    """A run whose trainer.log is one line of 400 MB between two short ones."""
    run = RunDir(tmp_path_factory.mktemp("hostile") / "run")
    run.create()
    folder = run.attempt_logs(1)
    folder.mkdir(parents=True)
    (run.logs_dir / "latest").symlink_to("attempt-1")
    sparse(folder / "trainer.log", b"first line\nthe long one starts", SPARSE, b"and ends here\nlast line\n")
    return run.root


def test_logs_tail_of_a_400_mb_line_reads_from_the_end_within_bounds(one_line_log_run, tmp_path):
    ran = run_measured(tmp_path, "logs", str(one_line_log_run))
    assert ran.code == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[-1] == "last line"
    assert lines[0].startswith("[prime-train: earlier output not read: only the last 64 MiB]")
    assert lines[0].endswith("and ends here")
    assert len(ran.stdout) < 200_000
    doc = json.loads(run_measured(tmp_path, "logs", str(one_line_log_run), "--json").stdout)
    assert doc["files"][0]["lines"][-1] == "last line"


def test_logs_of_every_line_cuts_an_over_long_one(one_line_log_run, tmp_path):
    ran = run_measured(tmp_path, "logs", str(one_line_log_run), "-n", "0")
    assert ran.code == 0, ran.stderr
    lines = ran.stdout.splitlines()
    assert lines[0] == "first line" and lines[-1] == "last line" and len(lines) == 3
    assert lines[1].startswith("the long one starts")
    assert lines[1].endswith(" … [prime-train: line of 381.5 MiB cut to its first 64 KiB]")


def test_logs_follow_cuts_an_over_long_line(tmp_path, monkeypatch, capsys):
    from prime_train.resilience import status

    log = tmp_path / "job.log"
    log.write_bytes(b"short\n" + b"w" * 300_000 + b"\nafter\n")
    monkeypatch.setattr(status, "owner_alive", lambda rd: False)
    with open(log, "rb") as fh:
        assert status._follow(fh, RunDir(tmp_path), 0.01) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "short" and out[2] == "after"
    assert out[1] == "w" * 65536 + " … [prime-train: line of 293.0 KiB cut to its first 64 KiB]"


# ---------------------------------------------------------------- lint and every command that reads a config


@pytest.fixture(scope="module")
def big_config(tmp_path_factory) -> Path:
    """A valid TOML file of 3 MB (an array): parsing it is slow; the real one was 100 MB (90 s, 1.17 GB)."""
    path = tmp_path_factory.mktemp("hostile") / "big.toml"
    path.write_text("[data]\nx = [" + "1, " * 1_000_000 + "]\n")
    return path


def test_lint_refuses_a_config_over_1_mib_before_parsing_it(big_config, tmp_path):
    ran = run_measured(tmp_path, "lint", str(big_config))
    assert ran.code == ExitCode.CONFIG
    assert f"config file {big_config} is 2.9 MiB, over the 1 MiB limit for a config" in ran.stdout + ran.stderr
    assert "Traceback" not in ran.stderr + ran.stdout
    huge = tmp_path / "huge.toml"
    sparse(huge, b"[data]\nx = [", SPARSE, b"]\n")
    ran = run_measured(tmp_path, "lint", str(huge))
    assert ran.code == ExitCode.CONFIG and "is 381.5 MiB, over the 1 MiB limit" in ran.stdout + ran.stderr


@pytest.mark.parametrize("command", [["run"], ["config", "show"], ["preflight"], ["memory"]])
def test_every_command_reading_a_config_refuses_a_huge_one(big_config, command):
    from typer.testing import CliRunner

    from prime_train.cli import app

    result = CliRunner().invoke(app, [*command, str(big_config)], env=WIDE)
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert "over the 1 MiB limit for a config" in result.stderr


def test_a_config_under_the_limit_and_a_pipe_still_load(tmp_path):
    from prime_train.config.loader import ConfigError, load_config

    path = tmp_path / "ok.toml"
    path.write_bytes(b'[run]\r\nname = "crlf"\r\n')  # universal newlines, as before
    assert load_config([path]).run.name == "crlf"
    read, write = os.pipe()
    with os.fdopen(write, "wb") as w:
        w.write(b'[run]\nname = "piped"\n')
    assert load_config([f"/dev/fd/{read}"]).run.name == "piped"
    os.close(read)
    read, write = os.pipe()
    threading.Thread(target=lambda: os.write(write, b"#" * (2**20 + 10)) and os.close(write), daemon=True).start()
    with pytest.raises(ConfigError, match="is over the 1 MiB limit for a config"):
        load_config([f"/dev/fd/{read}"])
    os.close(read)


# ---------------------------------------------------------------- diagnose


def test_diagnose_scans_a_huge_log_at_its_head_and_end_with_true_line_numbers(tmp_path, monkeypatch, capsys):
    from prime_train.resilience.diagnose import diagnose_command

    monkeypatch.setattr(logscan, "SCAN_HEAD_BYTES", 4096)
    monkeypatch.setattr(logscan, "SCAN_TAIL_BYTES", 4096)
    filler = "".join(f"step {i} loss 1.0\n" for i in range(2000))  # ~35 KB, 2000 lines
    lines = ["starting", *filler.splitlines(), "torch.OutOfMemoryError: CUDA out of memory."]
    lines += [*filler.splitlines(), "RuntimeError: NCCL error: unhandled system error"]
    log = tmp_path / "trainer.log"
    log.write_text("\n".join(lines) + "\n")
    notes: list[str] = []
    found = logscan.scan_log(log, notes=notes).findings
    assert [f.line for f in found] == [len(lines)]  # the end's line numbered as in the file; the middle left out
    assert len(notes) == 1 and "not scanned (only its first 0 MiB and last 0 MiB are)" in notes[0]
    assert diagnose_command([str(log)], as_json=False) == 1
    assert "not scanned" in capsys.readouterr().err


# ---------------------------------------------------------------- the readers themselves


@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_lines_from_the_end_match_a_plain_split(tmp_path, monkeypatch, chunk):
    import random

    monkeypatch.setattr(bounded, "CHUNK", chunk)
    rng = random.Random(chunk)
    for trial in range(300):
        data = bytes(rng.choice(b"ab\n\n") for _ in range(rng.randint(0, 40)))
        path = tmp_path / f"f{trial}"
        path.write_bytes(data)
        max_line = rng.randint(1, 8)
        want, offset = [], 0
        for part in data.split(b"\n"):
            if part:
                want.append((part[-max_line:], len(part), offset))
            offset += len(part) + 1
        with open(path, "rb") as fh:
            got = [(x.data, x.length, x.start) for x in bounded.lines_from_end(fh, max_line=max_line)]
        assert got == want[::-1], data
        n = rng.randint(1, 6)
        expected = [line.decode() + "\n" if len(line) <= max_line else None for line in data.splitlines()][-n:]
        got_tail = bounded.tail_lines(path, n, max_line=max_line)
        assert len(got_tail) == len(expected), data
        for g, e in zip(got_tail, expected, strict=True):
            assert g == e if e is not None else "cut to its first" in g


def test_json_lines_are_read_from_both_ends_when_big(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": i}) + "\n" for i in range(1000)))  # 13 KB
    notes: list[str] = []
    steps = [r["step"] for r in bounded.records(path, notes, budget=2000)]
    assert steps[0] == 0 and steps[-1] == 999 and len(steps) < 200
    assert steps == sorted(steps) and "only its first and last" in notes[0]
    assert [r["step"] for r in bounded.records_from_end(path, budget=10**6)][:3] == [999, 998, 997]


# ---------------------------------------------------------------- the attempt table's "time lost"


def _table_text(sup) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(summary_table(sup))
    return console.export_text()


def _row(text: str, attempt: int) -> list[str]:
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if cells and cells[0] == str(attempt):
            return cells
    raise AssertionError(f"no row for attempt {attempt} in\n{text}")


def test_time_lost_is_the_wall_time_of_the_steps_after_the_checkpoint(tmp_path):
    """Attempt 1 saved at step 4, then trained steps 5 and 6 (30 s each) and crashed 2 s into step 7: 62 s lost.
    The engine's step_time_s (compute only, 0.25 s) times two steps said 0 s."""
    t0 = 1_700_000_000.0
    cfg = Config.model_validate({"run": {"name": "t", "output_dir": str(tmp_path)}})
    run = RunDir(tmp_path / "t")
    run.create()
    (run.checkpoints_dir / "step-4").mkdir(parents=True)
    rows = [{"step": s, "time": t0 + 30 * s, "loss": 1.0, "step_time_s": 0.25} for s in range(1, 7)]
    run.metrics_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run.events_path.write_text(
        json.dumps({"time": t0, "event": "attempt_started", "attempt": 1, "resume_from": 0}) + "\n"
        + json.dumps({"time": t0 + 182, "event": "failure", "kind": "crash"}) + "\n"
        + json.dumps({"time": t0 + 185, "event": "attempt_started", "attempt": 2, "resume_from": 4}) + "\n"
    )  # fmt: skip
    crash = Failure(FailureKind.CRASH, "killed")
    first = Attempt(1, t0, t0 + 182, 1, crash, 1, 6, 0, checkpoint_step_at_end=4)
    second = Attempt(2, t0 + 185, t0 + 400, 0, None, 5, 10, 4, checkpoint_step_at_end=10)
    # attempt 3: crashed in start-up before any step of its own: all of it was lost
    third = Attempt(3, t0 + 500, t0 + 545, 1, crash, None, None, 10, checkpoint_step_at_end=10)

    class Sup:
        state = "failed"

        def __init__(self):
            self.cfg, self.run_dir, self.attempts = cfg, run, [first, second, third]

        def mean_step_time(self):
            return 0.25

    text = _table_text(Sup())
    assert _row(text, 1)[-1] == "1m02s", text
    assert _row(text, 2)[-1] == "-"
    assert _row(text, 3)[-1] == "45s"


def test_time_lost_of_an_external_job_reads_its_checkpoint_time(tmp_path):
    """No metrics.jsonl (an external job): when its checkpoint was written tells where the lost work began."""
    t0 = time.time() - 1000
    ckpts = tmp_path / "ckpts"
    (ckpts / "ckpt_0008").mkdir(parents=True)
    os.utime(ckpts / "ckpt_0008", (t0 + 100, t0 + 100))
    job = {"command": ["python", "train.py"], "checkpoint_dir": str(ckpts), "checkpoint_pattern": r"ckpt_(\d+)$"}
    cfg = Config.model_validate({"run": {"name": "x", "output_dir": str(tmp_path)}, "job": job})
    crash = Failure(FailureKind.CRASH, "killed")

    class Sup:
        state = "failed"

        def __init__(self):
            self.cfg, self.run_dir = cfg, RunDir(tmp_path / "x")
            self.attempts = [Attempt(1, t0, t0 + 130, 1, crash, 1, 9, 0, checkpoint_step_at_end=8)]

        def mean_step_time(self):
            return None

    assert _row(_table_text(Sup()), 1)[-1] == "30s"
