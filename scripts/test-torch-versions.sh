#!/usr/bin/env bash
# The engine's version-sensitive tests (checkpoints, the native model, DDP/FSDP2, resume, tensor and pipeline
# parallel) on the oldest and the newest torch prime-train supports, each in a venv of its own beside the project
# (.venv-torch-<version>/). CI runs it after the main suite.
#   bash scripts/test-torch-versions.sh             # 2.11.0 (the floor in pyproject.toml) and 2.14.1
#   bash scripts/test-torch-versions.sh 2.12.0      # any versions you name
# torch 2.11 comes from the package index as a CUDA build (several GB) that runs on the CPU too.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.11.0 2.14.1)

install() {  # the venv of torch $1 with prime-train's dev extras; its pip output in .venv-torch-$1/install.log
  local venv=".venv-torch-$1"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  { "$venv/bin/pip" install -q "torch==$1" && "$venv/bin/pip" install -q -e '.[dev]'; } > "$venv/install.log" 2>&1 \
    || { cat "$venv/install.log"; echo "== installing torch $1 into $venv failed"; return 1; }
}

# What changes between torch versions, each file's part:
# - the engine: DCP and async saves, the native model and its compile, DDP/FSDP2, resume (FSDP2's sharded one; a
#   kill during a save), SIGTERM's save, the classes a DCP .metadata pickles (the restricted unpickler's allow-list,
#   test_checkpoint_hostile.py), the FSDP2 export (the one-process HF export tests are version-blind), LoRA's frozen
#   base under FSDP2 and its adapter-only checkpoints (test_lora.py); their fast tests only ("slow" left out).
# - tensor and pipeline parallel lean on DTensor and torch.distributed.pipelining: their equal-to-one-process harness,
#   slow runs included (on 2.11 pipelines and sequence parallel are refused and those runs skip): every schedule class
#   (1F1B, interleaved; GPipe is the 1F1B class's other order), a DP x PP mesh, DCP checkpoints moving between a
#   pipeline and one process and between TP sizes.
# Left to the main suite on the README's torch, as CI's 60 minutes do not hold them twice more: the one-process
# kill-and-resume equality test, the whole runs started on a planted checkpoint (what they add to the fast hostile
# tests is the supervisor's, not torch's), the pipelines composed with FSDP2 or TP (4- and 8-rank runs of minutes
# each) and the kill -9 runs of TP and PP (the kill and the restart are the supervisor's; DCP's save and load in them
# the checkpoint-moving tests run here).
ENGINE="not slow and (not test_engine.py or ddp or fsdp or resume or sigterm)"
PARALLEL="not fsdp_shards and not pipeline_with_fsdp_resume and not pipeline_of_tensor_parallel"
PARALLEL+=" and not replicated_pipelines and not gpipe and not resume_after_kill"
SELECT="((test_tensor_parallel.py or test_pipeline.py) and $PARALLEL)"
SELECT+=" or (not test_tensor_parallel.py and not test_pipeline.py and not test_async_writer.py and $ENGINE)"
# DCP's checkpoint process (ckpt.async_writer = 'process'): its executor and the private global the engine ends it
# through; the two-rank FSDP run (slow, about 45 s) only, the kill -9 run being the supervisor's
SELECT+=" or (test_async_writer.py and fsdp)"

install "${versions[0]}"
for i in "${!versions[@]}"; do
  v="${versions[$i]}"
  venv=".venv-torch-$v"
  next="${versions[$((i + 1))]:-}"
  pending=""
  if [ -n "$next" ]; then  # the next venv installs (the disk and about one core) while these tests run
    install "$next" &
    pending=$!
  fi
  echo "== torch $v ($venv)"
  "$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
  # one pytest run for both parts: its two workers share out every file, heaviest first (tests/conftest.py)
  "$venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_checkpoint.py tests/test_checkpoint_hostile.py tests/test_native_model.py \
    tests/test_engine.py tests/test_native_engine.py tests/test_export.py tests/test_lora.py \
    tests/test_tensor_parallel.py tests/test_pipeline.py tests/test_async_writer.py \
    -k "$SELECT" \
    --deselect tests/test_export.py::test_exported_model_names_the_tokenizers_end_token_and_generate_stops_there \
    --deselect tests/test_engine.py::test_resume_after_kill_matches_uninterrupted_run \
    --deselect tests/test_checkpoint_hostile.py::test_a_run_whose_only_checkpoint_carries_a_payload_starts_over_in_the_next_attempt_without_a_traceback \
    --deselect tests/test_checkpoint_hostile.py::test_a_run_whose_newest_checkpoint_carries_a_payload_resumes_from_the_one_before
  [ -z "$pending" ] || wait "$pending"
done
