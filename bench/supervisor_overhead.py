"""What supervision costs and how fast it reacts.

    python bench/supervisor_overhead.py [--steps 100] [--repeats 2]

1. wall time of the tiny run under `prime-train run` against the engine alone
   (`python -m prime_train.engine.train --config …`), alternating, as a ratio (goal ≤ 1.03);
2. the supervisor's own CPU use while it supervises (goal < 2 % of a core), measured in this
   process with time.process_time() (children are not counted);
3. seconds from a crash to the restarted process (with zero backoff, so it is the supervisor's own
   latency), and from a hang's start (SIGSTOP) to its detection, minus the stall timeout.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from prime_train.config.loader import dump_toml, load_config
from prime_train.contract import read_json
from prime_train.kit.events import read_events
from prime_train.resilience.supervisor import Observer, Supervisor, SupervisorOptions

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "prime_train" / "configs" / "tiny-sft.toml"
JOB = REPO / "tests" / "jobs" / "counter_job.py"


def tiny(out: str, name: str, steps: int):
    return load_config(
        [TINY],
        [
            f"--run.output_dir={out}",
            f"--run.name={name}",
            f"--train.max_steps={steps}",
            "--logging.tensorboard=false",
            "--train.eval_interval=100000",
            "--ckpt.export_final=false",
        ],
    )


def engine_alone(out: str, steps: int) -> float:
    cfg = tiny(out, "alone", steps)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(dump_toml(cfg))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "prime_train.engine.train", "--config", str(run_dir / "config.toml")],
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - t0


def supervised(out: str, steps: int) -> tuple[float, float]:
    cfg = tiny(out, "supervised", steps)
    cpu0, t0 = time.process_time(), time.perf_counter()
    code = Supervisor(cfg, Observer(), SupervisorOptions()).run()
    wall = time.perf_counter() - t0
    assert code == 0, code
    return wall, (time.process_time() - cpu0) / wall


def job_cfg(out: str, *args: str, **sup):
    ckpt, progress = Path(out) / "ckpt", Path(out) / "progress.json"
    from prime_train.config.schema import Config

    return Config.model_validate(
        {
            "run": {"name": "job", "output_dir": out},
            "job": {
                "command": [sys.executable, str(JOB), "--ckpt-dir", str(ckpt), "--progress", str(progress), *args],
                "checkpoint_dir": str(ckpt),
                "progress_file": str(progress),
                "resume_args": ["--resume-step", "{step}"],
            },
            "supervisor": {"poll_interval_s": 0.2, "backoff_initial_s": 0.0, "term_grace_s": 5, **sup},
        }
    )


def crash_to_restart(out: str) -> float:
    sup = Supervisor(job_cfg(out, "--steps", "10", "--crash-once-at", "3"), Observer(), SupervisorOptions())
    assert sup.run() == 0
    events = read_events(sup.run_dir.events_path)
    exited = next(e["time"] for e in events if e["event"] == "process_exited")
    restarted = [e["time"] for e in events if e["event"] == "process_started"][1]
    return restarted - exited


def hang_detection(out: str, stall: float) -> float:
    cfg = job_cfg(out, "--steps", "60", "--step-time", "0.05", stall_timeout_s=stall)
    sup = Supervisor(cfg, Observer(), SupervisorOptions())
    stopped = {}

    def freeze():
        while True:
            hb = read_json(Path(cfg.job.progress_file))
            if hb and hb.get("step", 0) >= 5 and sup.children:
                os.kill(sup.children[0].pid, signal.SIGSTOP)
                stopped["t"] = time.time()
                return
            time.sleep(0.01)

    threading.Thread(target=freeze, daemon=True).start()
    assert sup.run() == 0
    hang = next(e["time"] for e in read_events(sup.run_dir.events_path) if e["event"] == "hang_detected")
    return hang - stopped["t"] - stall


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    console = Console()
    alone, under, cpu = [], [], []
    with console.status("timing the tiny run alone and supervised…"):
        for _i in range(args.repeats):
            with tempfile.TemporaryDirectory() as out:
                alone.append(engine_alone(out, args.steps))
            with tempfile.TemporaryDirectory() as out:
                wall, share = supervised(out, args.steps)
                under.append(wall)
                cpu.append(share)
    with console.status("crash and hang reaction times…"):
        with tempfile.TemporaryDirectory() as out:
            restart = crash_to_restart(out)
        with tempfile.TemporaryDirectory() as out:
            detect = hang_detection(out, stall=2.0)
    table = Table(title=f"supervision overhead (tiny run, {args.steps} steps, {args.repeats} repeats)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("goal", justify="right")
    ratio = statistics.median(under) / statistics.median(alone)
    table.add_row("engine alone, median wall", f"{statistics.median(alone):.2f} s", "")
    table.add_row("under prime-train run, median wall", f"{statistics.median(under):.2f} s", "")
    table.add_row("ratio supervised / alone", f"{ratio:.3f}", "≤ 1.03")
    table.add_row("supervisor CPU, share of one core", f"{statistics.median(cpu):.2%}", "< 2 %")
    table.add_row("crash → restarted process (zero backoff)", f"{restart:.2f} s", "")
    table.add_row("hang detection beyond stall_timeout_s", f"{detect:.2f} s", "")
    console.print(table)


if __name__ == "__main__":
    main()
