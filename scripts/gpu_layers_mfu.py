"""MFU of Llama-3-8B-shaped layers on one GPU through the engine (`prime-train profile`): FSDP2, selective
activation checkpointing, whole-layer compile, bf16 then float8 (torchao) at the same shape; ratio float8 / bf16.

    python3 scripts/gpu_layers_mfu.py --out /tmp/pt-layers              # GPU (scripts/gpu-check.sh, part "layers")
    python3 scripts/gpu_layers_mfu.py --dry --out /tmp/pt-layers-dry    # CPU: a tiny shape, one step, bf16 only

Each side is one `prime-train profile --json` run (its own run directory, the supervisor, the engine's own MFU:
its FLOPs per token over the device's datasheet peak), a timeout of its own. The 8B layer: hidden 4096, 32 heads
on 8 KV heads, MLP 14336, vocabulary 128256 (the byte tokenizer padded to Llama 3's size, so lm_head costs what
it costs in the 8B), rows of 8192 tokens, one a step. The generated data packs short documents into each row:
attention is plain causal over each whole row (`data.document_masking = false`, as nanoGPT and torchtitan's MFU
figures train), which is what the MFU's FLOPs count. Prints one line per side and
writes layers.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAPE_8B = {
    "model.hidden_size": 4096,
    "model.num_heads": 32,
    "model.num_kv_heads": 8,
    "model.intermediate_size": 14336,
    "model.vocab_multiple": 128256,
    "model.max_position_embeddings": 8192,
    "data.seq_len": 8192,
    "train.micro_batch_size": 1,
    "train.global_batch_size": 1,
}
SHAPE_DRY = {"data.seq_len": 128, "train.micro_batch_size": 2, "train.global_batch_size": 2}


def side_args(out: Path, name: str, layers: int, float8: bool, dry: bool) -> list[str]:
    overrides = {
        **(SHAPE_DRY if dry else SHAPE_8B),
        "run.output_dir": str(out),
        "run.name": name,
        "model.num_layers": layers,
        "model.implementation": "native",
        "model.activation_checkpointing": "selective",
        "distributed.strategy": "fsdp",
        "train.compile": str(not dry).lower(),
        "train.float8": str(float8).lower(),
        "train.eval_interval": 1000,
        "logging.tensorboard": "false",
        "data.datasets.0.num_examples": 2000,
        # causal attention over whole rows: the MFU counts causal attention's FLOPs, as torchtitan's figures do (and
        # no FlexAttention to compile: on the H200 on 2026-11-29 each side ran out of its 125 s, why unseen then)
        "data.document_masking": "false",
    }
    return [arg for key, value in overrides.items() for arg in (f"--{key}", str(value))]


def profile(out: Path, name: str, layers: int, float8: bool, args) -> dict:
    cmd = [sys.executable, "-m", "prime_train", "profile", "--json", "--steps", str(args.steps),
           "--warmup", str(args.warmup), *side_args(out, name, layers, float8, args.dry)]  # fmt: skip
    t0 = time.time()
    log = out / f"{name}.log"  # stderr as it comes: a side cut by its timeout still says how far it got
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        try:
            stdout, _ = proc.communicate(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the supervisor and its trainer too
            proc.communicate()
            tail = log.read_text(errors="replace").strip().splitlines()[-6:]
            return {"side": name, "error": f"timed out after {args.timeout_s} s; its last lines: " + " | ".join(tail)}
    with log.open("a") as err:
        err.write(stdout)
    if proc.returncode != 0:
        return {"side": name, "error": f"exit {proc.returncode}: {log.read_text(errors='replace').strip()[-400:]}"}
    summary = json.loads(stdout)
    keep = ("device", "step_s", "tokens_per_s", "mfu", "bottleneck")
    return {"side": name, "wall_s": round(time.time() - t0, 1), **{k: summary.get(k) for k in keep}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("/tmp/pt-layers"))
    p.add_argument("--layers", type=int, default=2, help="decoder layers of the 8B shape (1-4 fit one H100)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="steps before the timed ones (compile)")
    p.add_argument("--timeout-s", type=int, default=150, help="per side")
    p.add_argument("--dry", action="store_true", help="CPU: a tiny shape, bf16 side only, no compile")
    args = p.parse_args()
    if args.dry:
        args.steps, args.warmup = 1, 1
    args.out.mkdir(parents=True, exist_ok=True)
    sides = [("bf16", False)] if args.dry else [("bf16", False), ("float8", True)]
    results = []
    for name, float8 in sides:
        res = profile(args.out, f"layers8b-{name}", args.layers, float8, args)
        results.append(res)
        if "error" in res:
            print(f"{name}: {res['error']}", flush=True)
            continue
        mfu = f"MFU {res['mfu']:.1%}" if res.get("mfu") is not None else "MFU unknown (no datasheet peak)"
        shape = "tiny (dry)" if args.dry else "Llama-3-8B"
        print(f"{name}: {args.layers} {shape} layers, FSDP2 + selective AC, on {res['device']}: "
              f"{res['step_s'] * 1e3:.1f} ms/step, {res['tokens_per_s']:,.0f} tokens/s, {mfu}", flush=True)  # fmt: skip
    ok = [r for r in results if "error" not in r]
    if len(ok) == 2:
        print(f"ratio float8 / bf16 tokens/s: {ok[1]['tokens_per_s'] / ok[0]['tokens_per_s']:.3f}")
    (args.out / "layers.json").write_text(json.dumps(results, indent=1))
    sys.exit(0 if len(ok) == len(results) else 1)


if __name__ == "__main__":
    main()
