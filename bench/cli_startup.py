"""How long `prime-train` takes to start, against a bare interpreter.

    python bench/cli_startup.py [--runs 10] [--config configs/examples/ddp-2proc-cpu.toml] [--imports 15]

Runs `prime-train --help`, a mistyped flag (`prime-train run --no-such-flag`, exit 78) and
`prime-train lint CONFIG` in fresh subprocesses, together with `python -c pass` measured the same
way as the baseline, and prints the median, min and max wall time of each and its ratio to the
baseline. The goal is a median under 0.3 s for each command, so that lint is cheap in a pre-commit
hook and --help and a usage error feel instant. With --imports N it also lists
the N slowest imports of `lint` (python -X importtime) to show where the time goes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
GOAL_S = 0.3


def prime_train_argv() -> list[str]:
    """The installed console script next to this interpreter, as users run it; else `python -m prime_train`."""
    script = Path(sys.executable).parent / "prime-train"
    return [str(script)] if script.exists() else [sys.executable, "-m", "prime_train"]


# the exit code each command must end with; any other aborts the benchmark
EXPECTED_EXIT = {"prime-train run --no-such-flag": 78}


def time_once(argv: list[str], expected: int = 0) -> tuple[float, float]:
    """(wall, CPU) seconds of one run of argv in a fresh process; a non-zero exit aborts the benchmark.

    CPU time (user + system of the child) barely moves when other jobs share the machine, so it
    says what the command costs even when the wall time is inflated by a busy neighbour.
    """
    start = time.perf_counter()
    child = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != expected:
        raise SystemExit(f"{' '.join(argv)} exited {child.returncode}; run it by hand to see why")
    return wall, usage.ru_utime + usage.ru_stime


def measure(commands: dict[str, list[str]], runs: int) -> dict[str, list[tuple[float, float]]]:
    """Round-robin the commands so drift in machine load hits each of them alike."""
    for name, argv in commands.items():
        time_once(argv, EXPECTED_EXIT.get(name, 0))  # warm the page cache and write .pyc files before timing
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, argv in commands.items():
            times[name].append(time_once(argv, EXPECTED_EXIT.get(name, 0)))
    return times


def slowest_imports(argv_tail: list[str], top: int) -> list[tuple[float, str]]:
    """The `top` imports of `prime-train ARGV_TAIL` with the largest cumulative time, in seconds."""
    code = f"import sys; sys.argv = ['prime-train', *{argv_tail!r}]\nfrom prime_train.cli import main\nmain()"
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code], cwd=REPO, capture_output=True, text=True, check=False
    )
    rows = []
    for line in result.stderr.splitlines():
        # "import time: self [us] | cumulative | imported package"
        parts = line.removeprefix("import time:").split("|")
        if len(parts) == 3 and parts[1].strip().isdigit():
            rows.append((int(parts[1]) / 1e6, parts[2].rstrip()))
    return sorted(rows, reverse=True)[:top]


def main() -> None:
    """Measure and print the startup table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10, help="timed runs of each command (default 10)")
    parser.add_argument(
        "--config", default="configs/examples/ddp-2proc-cpu.toml", help="config to lint, relative to the repo"
    )
    parser.add_argument("--imports", type=int, default=0, metavar="N", help="also list the N slowest imports of lint")
    args = parser.parse_args()

    cli = prime_train_argv()
    commands = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "prime-train --help": [*cli, "--help"],
        "prime-train run --no-such-flag": [*cli, "run", "--no-such-flag"],
        f"prime-train lint {args.config}": [*cli, "lint", args.config],
    }
    os.environ.setdefault("COLUMNS", "100")  # rich sizes --help to the terminal; keep the work the same
    times = measure(commands, args.runs)
    baseline = statistics.median(wall for wall, _ in times["python -c pass"])

    console = Console()
    table = Table(title=f"CLI startup, {args.runs} runs each ({' '.join(cli)})")
    table.add_column("command", style="bold")
    for column in ("median s", "min s", "max s", "median CPU s", "× python -c pass", f"median < {GOAL_S} s"):
        table.add_column(column, justify="right")
    for name, runs in times.items():
        samples = [wall for wall, _ in runs]
        median = statistics.median(samples)
        is_baseline = name == "python -c pass"
        verdict = "" if is_baseline else ("[green]yes[/green]" if median < GOAL_S else "[red]no[/red]")
        table.add_row(
            name,
            f"{median:.3f}",
            f"{min(samples):.3f}",
            f"{max(samples):.3f}",
            f"{statistics.median(cpu for _, cpu in runs):.3f}",
            "1.0" if is_baseline else f"{median / baseline:.1f}",
            verdict,
        )
    console.print(table)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    console.print(f"python {sys.version.split()[0]} · {os.cpu_count()} CPUs · load average {load:.1f} · {sys.platform}")

    if args.imports:
        imports = Table(title=f"slowest imports of `prime-train lint {args.config}` (cumulative)")
        imports.add_column("seconds", justify="right")
        imports.add_column("module")
        for seconds, module in slowest_imports(["lint", args.config], args.imports):
            imports.add_row(f"{seconds:.3f}", module)
        console.print(imports)


if __name__ == "__main__":
    main()
