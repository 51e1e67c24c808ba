"""A LoRA run's per-step weight update on vLLM: loading the adapter at run time against reloading the merged weights.

    python bench/lora_reload.py [--model DIR] [--rank 16] [--repeats 5] [--out DIR]

Without --model it first trains a tiny Qwen2 for a few SFT steps (hidden 128, 4 heads: vLLM's CPU attention needs
head sizes of 32 or more). It puts rank-`--rank` LoRA adapters on every linear layer of the decoder blocks (random
B, so they change the model), starts ONE vLLM worker as the supervisor does for a LoRA run (--enable-lora, runtime
LoRA updating), and in the same run, alternating, times both ways a step's policy reaches the worker:

- reference: the trainer's publish of the merged model (export_hf) and the worker's full reload
  (WorkerClient.update_weights on that directory: pause, collective_rpc reload_weights, prefix-cache reset, resume);
- adapter: the publish of the adapter alone (PEFT's format) and its load (pause, /v1/load_lora_adapter, unload of
  the previous one, resume).

Each is followed by one short completion naming what was loaded (the first request after a load pays what the
load left undone). Figures: median seconds of each, the bytes published, and adapter / reference ratios.
Needs the vLLM environment `prime-train inference install` makes (or --python).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def tiny_model(out: Path) -> Path:
    """A tiny Qwen2 after a few SFT steps, exported to out/bench/final."""
    args = ["--run.output_dir", str(out), "--run.name", "bench", "--model.arch", "qwen2", "--train.max_steps", "5",
            "--data.datasets.0.num_examples", "500", "--logging.tensorboard", "false"]  # fmt: skip
    cmd = [sys.executable, "-m", "prime_train", "train", str(REPO / "prime_train/configs/tiny-sft.toml"), *args]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        sys.exit(f"training the tiny model failed:\n{result.stdout[-3000:]}{result.stderr[-2000:]}")
    return out / "bench" / "final"


def start_worker(python: str, model: Path, root: Path, rank: int):
    """One vLLM worker started as the supervisor starts a LoRA run's; (process, client URL, start-up seconds)."""
    import socket

    from prime_train.config.loader import dump_toml
    from prime_train.config.schema import Config
    from prime_train.rl.client import WorkerClient
    from prime_train.rl.workers import gpu_plan, inference_specs

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = Config.model_validate({
        "run": {"name": "bench", "output_dir": str(root), "job": "rl"}, "model": {"path": str(model)},
        "lora": {"rank": rank},
        "inference": {"backend": "vllm", "python": python, "base_port": port, "max_model_len": 128},
    })  # fmt: skip
    (root / "config.toml").write_text(dump_toml(cfg))
    (spec,) = inference_specs(cfg, str(root / "config.toml"), gpu_plan(cfg, []))
    t0 = time.monotonic()
    log = open(root / "vllm.log", "w")  # noqa: SIM115 - open for the worker's life
    proc = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **spec.env},
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    while not WorkerClient(url, 5.0, "vllm").health(timeout_s=2.0):
        if proc.poll() is not None or time.monotonic() - t0 > 600:
            proc.kill()
            sys.exit(f"vLLM did not start:\n{(root / 'vllm.log').read_text()[-4000:]}")
        time.sleep(0.5)
    return proc, url, time.monotonic() - t0


def lora_model(model_dir: Path, rank: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from prime_train.config.schema import LoraConfig
    from prime_train.engine.lora import apply_lora

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    apply_lora(model, LoraConfig(rank=rank))
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def size_of(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors"))


def measure(model, tokenizer, client, root: Path, step: int, adapter: bool) -> tuple[float, float, float, int]:
    """One step's update one way: (publish s, load s, first completion s, bytes published)."""
    from prime_train.engine.export import ADAPTER_DIR, export_hf

    with torch.no_grad():  # a new policy each step, as training would give
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    out = root / f"{'adapter' if adapter else 'merged'}-{step}"
    t0 = time.perf_counter()
    export_hf(model, tokenizer, out, rank=0, merge=not adapter, adapter=adapter)
    publish = time.perf_counter() - t0
    path = out / ADAPTER_DIR if adapter else out
    load = client.update_weights(str(path), step)
    t0 = time.perf_counter()
    client.complete([[5, 6, 7, 8]], n=1, max_tokens=8, temperature=1.0, top_p=1.0, seed=step)
    return publish, load, time.perf_counter() - t0, size_of(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="an HF model directory vLLM can serve on this machine")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--python", help="the vLLM environment's Python (default: the managed one)")
    ap.add_argument("--out", type=Path, help="working directory (default: a temporary one)")
    a = ap.parse_args()
    from prime_train.rl.client import WorkerClient
    from prime_train.rl.vllm_server import find_vllm_python

    python = find_vllm_python(a.python)
    if python is None:
        sys.exit("no vLLM environment: `prime-train inference install` makes one")
    root = a.out or Path(tempfile.mkdtemp(prefix="lora-reload-"))
    root.mkdir(parents=True, exist_ok=True)
    model_dir = a.model or tiny_model(root / "sft")
    model, tokenizer = lora_model(model_dir, a.rank)
    proc, url, startup = start_worker(python, model_dir, root, a.rank)
    print(f"vLLM worker with --enable-lora up in {startup:.1f} s ({model_dir})")
    full, lora = WorkerClient(url, 300.0, "vllm"), WorkerClient(url, 300.0, "vllm")
    rows: dict[str, list[tuple]] = {"merged": [], "adapter": []}
    try:
        measure(model, tokenizer, full, root, 0, False)  # warm both paths once, untimed
        measure(model, tokenizer, lora, root, 0, True)
        for step in range(1, a.repeats + 1):
            rows["merged"].append(measure(model, tokenizer, full, root, step, False))
            rows["adapter"].append(measure(model, tokenizer, lora, root, step, True))
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # vLLM's engine process too: the worker runs in a session of its own
        proc.wait(30)
    med = {k: [statistics.median(col) for col in zip(*v, strict=True)] for k, v in rows.items()}
    print(f"median of {a.repeats} steps each, rank {a.rank}, one vLLM worker on this machine's CPU:")
    print(f"{'':28}{'publish s':>11}{'load s':>10}{'1st completion s':>18}{'publish+load s':>16}{'bytes':>12}")
    for name, label in (("merged", "merged weights (reference)"), ("adapter", "LoRA adapter")):
        p, lo, c, b = med[name]
        print(f"{label:28}{p:11.4f}{lo:10.4f}{c:18.4f}{p + lo:16.4f}{int(b):12,d}")
    (mp, ml, mc, mb), (ap_, al, ac, ab) = med["merged"], med["adapter"]
    print(f"adapter / reference: load {al / ml:.3f}x, publish+load {(ap_ + al) / (mp + ml):.3f}x, "
          f"first completion {ac / mc:.3f}x, bytes {ab / mb:.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
