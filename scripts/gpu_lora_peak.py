"""LoRA and QLoRA on a Llama-3-8B-shaped decoder on one GPU: the measured peak memory beside `prime-train memory`'s.

    python scripts/gpu_lora_peak.py [--quantize none nf4] [--out DIR] [--timeout-s 240]

For each quantize setting it runs configs/examples/llama3-8b-shape-lora-1gpu.toml under the supervisor (`prime-train
run`: preflight, watchers, an adapter checkpoint at step 5, the final adapter export; the merged export is skipped,
it would write the 7B base again), samples the device's used memory through NVML every 0.2 s, and prints, per
setting: the calculator's per-GPU total and its parts, the allocator's peak (torch.cuda.max_memory_allocated, in
metrics.jsonl), NVML's peak over the process's start-up baseline, step time, MFU, loss, the checkpoint's size and
the wall time. A JSON line per setting goes to DIR/lora.json. Needs a CUDA GPU; nf4 needs bitsandbytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "examples" / "llama3-8b-shape-lora-1gpu.toml"


def prime_train(*args: str) -> list[str]:
    exe = shutil.which("prime-train")
    return [exe, *args] if exe else [sys.executable, "-m", "prime_train", *args]


def calculator(quantize: str) -> dict:
    out = subprocess.run(
        prime_train("memory", str(CONFIG), "--gpu", "H100", "--json", "--lora-quantize", quantize),
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(out.stdout)["trainer"]


class NvmlPeak:
    """The device's used memory, sampled in a thread: its baseline before the run and its peak during it."""

    def __init__(self, index: int = 0, period_s: float = 0.2):
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self._handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # no NVIDIA driver (a smoke run on a CPU machine): nothing to sample
            print(f"NVML unavailable ({exc}): no device memory samples")
            self._nvml = self._handle = None
        self.baseline = self.used()
        self.peak = self.baseline
        self._period = period_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def used(self) -> int:
        if self._nvml is None:
            return 0
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def _loop(self) -> None:
        while not self._stop.wait(self._period):
            self.peak = max(self.peak, self.used())

    def __enter__(self) -> NvmlPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def run(quantize: str, out: Path, timeout_s: float, extra: list[str]) -> dict:
    name = f"lora-8b-{quantize}"
    run_dir = out / name
    shutil.rmtree(run_dir, ignore_errors=True)
    args = ["--run.output_dir", str(out), "--run.name", name, "--lora.quantize", quantize,
            "--lora.merge_on_export", "false", "--logging.tensorboard", "false", *extra]  # fmt: skip
    t0 = time.monotonic()
    with NvmlPeak() as nvml:
        try:
            proc = subprocess.run(prime_train("run", str(CONFIG), *args), capture_output=True, text=True,
                                  timeout=timeout_s)  # fmt: skip
            rc, log = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            # TimeoutExpired holds what was read as bytes, even with text=True
            text = [b.decode(errors="replace") if isinstance(b, bytes) else (b or "") for b in (exc.stdout, exc.stderr)]
            rc, log = "timeout", "".join(text)
    wall = time.monotonic() - t0
    (out / f"{name}.log").write_text(log)
    rows = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r]
    timed = [r["step_time_s"] for r in rows if "step_time_s" in r]
    mfu = [r["mfu"] for r in rows if "mfu" in r]
    return {
        "quantize": quantize,
        "rc": rc,
        "wall_s": round(wall, 1),
        "steps": len(steps),
        "loss_first": steps[0]["loss"] if steps else None,
        "loss_last": steps[-1]["loss"] if steps else None,
        "peak_allocated_gib": max((r.get("peak_mem_gib", 0.0) for r in rows), default=None),
        "nvml_peak_over_baseline_gib": (nvml.peak - nvml.baseline) / 2**30,
        "step_time_s": timed[-1] if timed else None,
        "mfu": mfu[-1] if mfu else None,
        "checkpoint_mib": dir_bytes(run_dir / "checkpoints" / "step-5") / 2**20,
        "adapter_mib": dir_bytes(run_dir / "final" / "adapter") / 2**20,
        "log_tail": log[-1500:] if rc != 0 else "",
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quantize", nargs="+", default=["none", "nf4"], choices=["none", "nf4"])
    parser.add_argument("--out", type=Path, default=Path("/tmp/pt-lora"))
    parser.add_argument("--timeout-s", type=float, default=240.0)
    args, extra = parser.parse_known_args()  # the rest: config overrides for the runs (a small smoke run on a CPU)
    args.out.mkdir(parents=True, exist_ok=True)
    failed = False
    with open(args.out / "lora.json", "w") as sink:
        for quantize in args.quantize:
            predicted = calculator(quantize)
            result = run(quantize, args.out, args.timeout_s, extra)
            result["calculator_total_gib"] = predicted["total_gib"]
            result["calculator_parts_gib"] = {p["name"]: p["gib"] for p in predicted["parts"]}
            sink.write(json.dumps(result) + "\n")
            sink.flush()
            failed |= result["rc"] != 0
            print(
                f"== LoRA rank 16, Llama-3-8B-shaped blocks, base {quantize}: rc {result['rc']}, {result['wall_s']} s"
            )
            for part, gib in result["calculator_parts_gib"].items():
                print(f"   calculator {part:<26} {gib:7.2f} GiB")
            print(f"   calculator total                   {result['calculator_total_gib']:7.2f} GiB")
            peak = result["peak_allocated_gib"]
            if peak:
                print(f"   measured allocator peak            {peak:7.2f} GiB  "
                      f"(calculator / measured: {result['calculator_total_gib'] / peak:.3f})")  # fmt: skip
            print(f"   measured NVML peak over baseline   {result['nvml_peak_over_baseline_gib']:7.2f} GiB")
            print(f"   steps {result['steps']}, loss {result['loss_first']} -> {result['loss_last']}, "
                  f"step {result['step_time_s']} s, MFU {result['mfu']}")  # fmt: skip
            print(
                f"   checkpoint step-5 {result['checkpoint_mib']:.1f} MiB, "
                f"final/adapter {result['adapter_mib']:.1f} MiB"
            )
            if result["log_tail"]:
                print(result["log_tail"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
