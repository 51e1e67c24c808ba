#!/usr/bin/env bash
# The checks a lent GPU session runs, in order of value, each bounded so the whole fits one device call.
#
#   bash .gpu/run.sh bash scripts/gpu-check.sh        # on the GPU machine, after ../shared/gpu/prepare here
#
# Writes under $OUT (default /tmp/gpu-check): device.txt (the card, driver, torch), lora.log and lora.json
# (scripts/gpu_lora_peak.py: LoRA and QLoRA on a Llama-3-8B-shaped decoder, measured peak memory beside the
# calculator's), bench.log
# (bench/vs_nanogpt.py at GPT-2-124M shape, all its sides: the engine, the native model with the chunked and with
# the plain loss, a GPT-2-architecture model; ms/step, tokens/s, MFU, ratios, host syncs), pytest.log (`-m gpu`),
# runs.tgz (every test run directory's small files: events, gpu.jsonl NVML readings, logs; no weights).
# GPU_CHECK_BUDGET_S bounds the whole (default 540 s); the bench gets at most GPU_CHECK_BENCH_S (default 330 s:
# four models to compile, 40-60 s each), the tests what it leaves. GPU_CHECK_PARTS picks the parts (default
# "lora bench tests"; a session that measured one already can leave it out).
#
# Issue 35's figures (speed), in one call: GPU_CHECK_PARTS="stall goodput gpt2 layers" (at most the 540 s budget;
# no tests), run in this order, each cut to what the budget leaves:
#   stall   bench/checkpoint_stall.py --shapes gpt2: async (thread and process writers) against sync DCP save of the
#           124M model, blocking and the step-time dip over the next 10 steps (stall.log; GPU_CHECK_STALL_S, default
#           150 s)
#   goodput scripts/goodput-kill9.sh: the default job (`prime-train run`) with one kill -9 of its trainer after the
#           step-100 checkpoint; its goodput line (goodput.log; GPU_CHECK_GOODPUT_S, default 70 s)
#   gpt2    bench/vs_nanogpt.py --shape gpt2 --sides native,native-full,gpt2,native-gpt2 --mask causal: the native
#           Llama (chunked loss and full logits), the bench's GPT-2 and the engine's GPT-2 (model.arch = "gpt2") at
#           GPT-2-124M shape, every row one causal
#           stream as nanoGPT trains (data.document_masking = false), tokens/s and ratios (gpt2.log;
#           GPU_CHECK_GPT2_S, default 200 s)
#   layers  scripts/gpu_layers_mfu.py: 2 Llama-3-8B-shaped layers, FSDP2 + selective AC + compile, bf16 then
#           float8, MFU and the float8 / bf16 ratio (layers.log, layers.json; GPU_CHECK_LAYERS_S, default 260 s)
# On the H200 on 2026-11-29 stall, goodput and gpt2 gave figures (README: the engine, goodput, async saves); layers
# timed out at 125 s a side with nothing kept. The next lent session, in one call of 590 s: GPU_CHECK_PARTS="layers
# stall" GPU_CHECK_BUDGET_S=570 GPU_CHECK_LAYERS_S=400 GPU_CHECK_STALL_S=150; then, warm, "gpt2 tests".
# Also on request: logprobs  bench/logprobs.py on the GPU: DPO's and GRPO's per-token log-probs at Llama 3's
#           vocabulary, 8 x 2048 tokens, hidden 4096, bf16: whole logits against chunks of the engine's 512
#           tokens and of 1024, time and peak memory (logprobs.log; GPU_CHECK_LOGPROBS_S, default 60 s)
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

parts=" ${GPU_CHECK_PARTS:-lora bench tests} "

if [[ $parts == *" lora "* ]]; then
  echo "== scripts/gpu_lora_peak.py ($(left) s left)"
  lora_s=${GPU_CHECK_LORA_S:-300}
  timeout -k 15 "$lora_s" python3 scripts/gpu_lora_peak.py --out /tmp/pt-lora --timeout-s $((lora_s / 2 - 10)) 2>&1 \
    | tee "$OUT/lora.log"
  echo "lora exit: ${PIPESTATUS[0]}" | tee -a "$OUT/lora.log"
  cp /tmp/pt-lora/lora.json "$OUT/" 2>/dev/null
fi

if [[ $parts == *" bench "* ]]; then
  echo "== bench/vs_nanogpt.py --shape gpt2 ($(left) s left)"
  bench_s=${GPU_CHECK_BENCH_S:-330}
  ((bench_s > $(left) - 15)) && bench_s=$(($(left) - 15))  # never past the budget (the tests then get nothing)
  timeout -k 15 "$((bench_s > 1 ? bench_s : 1))" python3 bench/vs_nanogpt.py --shape gpt2 --rounds 5 --steps 20 2>&1 | tee "$OUT/bench.log"
  echo "bench exit: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
fi

# run_part NAME SECONDS COMMAND...: COMMAND under a timeout of SECONDS (never past the budget), output in NAME.log
run_part() {
  local name=$1 part_s=$2
  shift 2
  ((part_s > $(left) - 15)) && part_s=$(($(left) - 15))
  echo "== $name: $* ($(left) s left, $part_s s for it)"
  timeout -k 15 "$((part_s > 1 ? part_s : 1))" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "$name exit: ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log"
}

if [[ $parts == *" stall "* ]]; then
  run_part stall "${GPU_CHECK_STALL_S:-150}" python3 bench/checkpoint_stall.py --shapes gpt2 --rounds 2 --steps 10 \
    --after 10 --writers thread,process
fi

if [[ $parts == *" goodput "* ]]; then
  run_part goodput "${GPU_CHECK_GOODPUT_S:-70}" bash scripts/goodput-kill9.sh "$(mktemp -d /tmp/pt-goodput.XXXXXX)" 100
fi

if [[ $parts == *" gpt2 "* ]]; then
  run_part gpt2 "${GPU_CHECK_GPT2_S:-200}" python3 bench/vs_nanogpt.py --shape gpt2 --rounds 5 --steps 20 \
    --sides native,native-full,gpt2,native-gpt2 --mask causal
fi

if [[ $parts == *" layers "* ]]; then
  layers_s=${GPU_CHECK_LAYERS_S:-260}
  run_part layers "$layers_s" python3 scripts/gpu_layers_mfu.py --out /tmp/pt-layers --layers 2 \
    --timeout-s $((layers_s / 2 - 10))
  cp /tmp/pt-layers/layers.json /tmp/pt-layers/*.log "$OUT/" 2>/dev/null
fi

if [[ $parts == *" logprobs "* ]]; then
  run_part logprobs "${GPU_CHECK_LOGPROBS_S:-60}" python3 bench/logprobs.py --device cuda --rows 8 --seq 2048 \
    --hidden 4096 --vocab 128256 --rounds 5 --also-chunk 1024
fi

echo "== pytest -m gpu ($(left) s left)"
# the bench above is the no-host-sync test's body; the rest run three at a time where pytest-xdist is installed
# (tiny models leave the card nearly idle, and each job's watcher then sees the others' processes, as on a shared GPU)
# (pyproject's addopts ask for `-n auto`, which needs pytest-xdist: without it they are replaced)
parallel=(-o "addopts=-ra --strict-markers")
python3 -c "import xdist" 2>/dev/null && parallel=(-n 3)
tests_s=$(($(left) - 15))
if [[ $parts != *" tests "* ]]; then
  echo "pytest not asked for (GPU_CHECK_PARTS)"  # no pytest.log: $OUT's files that come back are few (8)
elif ((tests_s >= 30)); then  # `timeout 0` would mean no limit at all
  timeout "$tests_s" python3 -m pytest -m gpu -v -rA --durations=0 -p no:cacheprovider --basetemp /tmp/pt \
    --timeout 240 "${parallel[@]}" tests/test_lora.py tests/test_gpu.py tests/test_zero_precision.py tests/test_cli_commands.py \
    --deselect tests/test_gpu.py::test_engine_steps_at_gpt2_shape_make_no_host_sync_between_logging_steps \
    2>&1 | tee "$OUT/pytest.log"
  echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest.log"
else
  echo "pytest skipped: $tests_s s left of the budget" | tee "$OUT/pytest.log"
fi

cp /tmp/pt-lora/*.log "$OUT/" 2>/dev/null  # the two LoRA runs' output (lora-8b-none.log, lora-8b-nf4.log)
[[ -d /tmp/pt ]] && tar czf "$OUT/runs.tgz" -C /tmp/pt --exclude='*.safetensors' --exclude='*.distcp' --exclude='*.bin' \
  --exclude='*.pt' --exclude='__pycache__' . 2>/dev/null
ls -la "$OUT"
