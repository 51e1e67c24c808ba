#!/usr/bin/env bash
# The checks a lent GPU session runs, in order of value, each bounded so the whole fits one device call.
#
#   bash .gpu/run.sh bash scripts/gpu-check.sh        # on the GPU machine, after ../shared/gpu/prepare here
#
# Writes under $OUT (default /tmp/gpu-check): device.txt (the card, driver, torch), bench.log
# (bench/vs_nanogpt.py at GPT-2-124M shape, all its sides: the engine, the native model with the chunked and with
# the plain loss, a GPT-2-architecture model; ms/step, tokens/s, MFU, ratios, host syncs), pytest.log (`-m gpu`),
# runs.tgz (every test run directory's small files: events, gpu.jsonl NVML readings, logs; no weights).
# GPU_CHECK_BUDGET_S bounds the whole (default 540 s); the bench gets at most GPU_CHECK_BENCH_S (default 330 s:
# four models to compile, 40-60 s each), the tests what it leaves.
set -u
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
budget=${GPU_CHECK_BUDGET_S:-540}
t0=$(date +%s)
left() { echo $((budget - ($(date +%s) - t0))); }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv
  python3 -c "import torch, transformers, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda',
    torch.version.cuda, 'transformers', transformers.__version__, torch.cuda.get_device_name())"
  nproc
} 2>&1 | tee "$OUT/device.txt"

echo "== bench/vs_nanogpt.py --shape gpt2 ($(left) s left)"
bench_s=${GPU_CHECK_BENCH_S:-330}
((bench_s > $(left) - 15)) && bench_s=$(($(left) - 15))  # never past the budget (the tests then get nothing)
timeout -k 15 "$((bench_s > 1 ? bench_s : 1))" python3 bench/vs_nanogpt.py --shape gpt2 --rounds 5 --steps 20 2>&1 | tee "$OUT/bench.log"
echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"

echo "== pytest -m gpu ($(left) s left)"
# the bench above is the no-host-sync test's body; the rest run three at a time where pytest-xdist is installed
# (tiny models leave the card nearly idle, and each job's watcher then sees the others' processes, as on a shared GPU)
parallel=()
python3 -c "import xdist" 2>/dev/null && parallel=(-n 3)
tests_s=$(($(left) - 15))
if ((tests_s >= 30)); then  # `timeout 0` would mean no limit at all
  timeout "$tests_s" python3 -m pytest -m gpu -v -rA --durations=0 -p no:cacheprovider --basetemp /tmp/pt \
    --timeout 240 "${parallel[@]}" tests/test_gpu.py tests/test_cli_commands.py \
    --deselect tests/test_gpu.py::test_engine_steps_at_gpt2_shape_make_no_host_sync_between_logging_steps \
    2>&1 | tee "$OUT/pytest.log"
  echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"
else
  echo "pytest skipped: $tests_s s left of the budget" | tee "$OUT/pytest.log"
fi

tar czf "$OUT/runs.tgz" -C /tmp/pt --exclude='*.safetensors' --exclude='*.distcp' --exclude='*.bin' \
  --exclude='*.pt' --exclude='__pycache__' . 2>/dev/null
ls -la "$OUT"
