"""Log-surfacing throughput: LogScanner's lines/s and MB/s on normal and hostile logs of growing size.

Linear time shows as a flat lines/s column: each size is 4x the one before, so a quadratic
scanner would lose 4x per row. Two logs:

- normal: a training run's mix (engine step lines, NCCL INFO, vLLM request and stats lines, tqdm
  redraws, warnings) with an incident (a traceback, CUDA OOM, a NaN loss) every 5000 lines;
- hostile: `[0001ab] Traceback (most recent call last):` on every line, each under its own prefix,
  so each opens a traceback that never closes (quadratic before 0.3: 2.5 s for 5k lines, 22 s for 20k).

Then the same hostile output from a real job, unsupervised and through ChildProcess + LogScanner
as `prime-train run` reads it: the job's time should not change (its output never waits on the scanner).

    python bench/logscan_throughput.py [--sizes 5000 20000 80000] [--repeat 3] [--job-lines 60000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from prime_train.kit.process import ChildProcess, ProcessSpec
from prime_train.resilience.logscan import MAX_OPEN_TRACEBACKS, LogScanner, scan_log

BACKGROUND = [
    "12:00:{s:02d} INFO step {i}/200000 | loss 2.{i:04d} | lr 3.00e-04 | grad 0.4{s:02d} | 41.2k tok/s | eta {i}s",
    "gpu-node-1:5512:5590 [0] NCCL INFO Channel {s:02d}/02 :    0   1",
    '(APIServer pid=88) INFO:     127.0.0.1:{i} - "POST /v1/chat/completions HTTP/1.1" 200 OK',
    "(APIServer pid=88) INFO 11-21 09:05:{s:02d} [loggers.py:127] Engine 000: Avg prompt throughput: "
    "5120.3 tokens/s, Running: 8 reqs, GPU KV cache usage: 4.1%",
    "Map:  41%|████      | {i}/48112 [00:01<00:01, 17342.11 examples/s]\rMap: 100%|██████████| 48112/48112",
    "/root/venv/lib/python3.11/site-packages/torch/utils/checkpoint.py:87: UserWarning: None of the inputs "
    "have requires_grad=True. Gradients will be None",
    "  warnings.warn(",
    "09:00:14 INFO saved checkpoint step-{i} in 3.4s; tokenizer: Qwen/Qwen2.5-0.5B max_tokens=256",
]
INCIDENT = [
    "Traceback (most recent call last):",
    '  File "/root/prime-train/prime_train/engine/train.py", line 231, in train_step',
    "    loss.backward()",
    "RuntimeError: CUDA error: out of memory",
    "12:00:00 INFO step 1/200000 | loss nan | grad nan",
]
HOSTILE_JOB = (
    "import sys\nfor i in range({n}):\n    sys.stdout.write(f'[{{i:06x}}] Traceback (most recent call last):\\n')\n"
)


def _write_normal(path: Path, num_lines: int) -> int:
    """A realistic mixed log of `num_lines` lines; returns how many findings it should produce."""
    expected = 0
    with open(path, "w", encoding="utf-8") as f:
        i = 0
        while i < num_lines:
            if i % 5000 == 4999:
                f.write("\n".join(INCIDENT) + "\n")
                i += len(INCIDENT)
                expected += 2  # the OOM line and the NaN loss line
                continue
            f.write(BACKGROUND[i % len(BACKGROUND)].format(i=i, s=i % 60) + "\n")
            i += 1
    return expected


def _write_hostile(path: Path, num_lines: int) -> int:
    """Lines that each open a traceback; returns the findings expected: the open tracebacks reported at the end."""
    with open(path, "w", encoding="utf-8") as f:
        for i in range(num_lines):
            f.write(f"[{i:06x}] Traceback (most recent call last):\n")
    return MAX_OPEN_TRACEBACKS


def _best_of(repeat: int, fn: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _scan_table(sizes: list[int], repeat: int) -> None:
    print(f"{'log':<9}{'lines':>8}{'MB':>8}{'seconds':>10}{'lines/s':>12}{'MB/s':>8}  fatal findings")
    with tempfile.TemporaryDirectory() as tmp:
        for name, write in (("normal", _write_normal), ("hostile", _write_hostile)):
            for n in sizes:
                path = Path(tmp) / f"{name}-{n}.log"
                expected = write(path, n)
                mb = path.stat().st_size / 1e6
                seconds = _best_of(repeat, lambda path=path: scan_log(path))
                scanner = scan_log(path)
                # fatal ones, shown and suppressed together: the per-pattern cap hides repeats, it does not miss them
                found = sum(f.severity == "fatal" for f in scanner.findings) + sum(scanner.suppressed.values())
                print(
                    f"{name:<9}{n:>8,}{mb:>8.2f}{seconds:>10.3f}{n / seconds:>12,.0f}{mb / seconds:>8.1f}"
                    f"  {found} (planted {expected})"
                )


def _job_seconds(code: str, supervised: bool, tmp: Path) -> tuple[float, int]:
    """Wall time of the job from start to exit, and the lines the scanner saw."""
    if not supervised:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], stdout=subprocess.DEVNULL, check=True)
        return time.perf_counter() - t0, 0
    scanner = LogScanner("job")
    seen = [0]

    def on_line(process: str, line: str, line_no: int) -> None:
        seen[0] += 1
        scanner.feed(line, line_no)

    child = ChildProcess(ProcessSpec("job", [sys.executable, "-c", code]), tmp / "job.log", on_line=on_line)
    t0 = time.perf_counter()
    child.start()
    assert child.popen is not None
    child.popen.wait()
    seconds = time.perf_counter() - t0
    child.join_output(timeout=120)
    return seconds, seen[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[5_000, 20_000, 80_000])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--job-lines", type=int, default=60_000)
    args = parser.parse_args()

    _scan_table(args.sizes, args.repeat)
    code = HOSTILE_JOB.format(n=args.job_lines)
    with tempfile.TemporaryDirectory() as tmp:
        alone, _ = _job_seconds(code, supervised=False, tmp=Path(tmp))
        supervised, seen = _job_seconds(code, supervised=True, tmp=Path(tmp))
    print(
        f"job printing {args.job_lines:,} hostile lines: {alone:.2f} s unsupervised, {supervised:.2f} s through "
        f"ChildProcess + LogScanner ({seen:,} lines scanned, the rest dropped from the scanner's queue, all logged)"
    )


if __name__ == "__main__":
    main()
