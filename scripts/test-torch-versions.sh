#!/usr/bin/env bash
# The engine's version-sensitive tests (checkpoints, the native model, DDP/FSDP2, resume) on the oldest and the newest torch prime-train supports, each in
# a venv of its own beside the project (.venv-torch-<version>/). CI runs it after the main suite.
#   bash scripts/test-torch-versions.sh             # 2.11.0 (the floor in pyproject.toml) and 2.14.1
#   bash scripts/test-torch-versions.sh 2.12.0      # any versions you name
# torch 2.11 comes from the package index as a CUDA build (several GB) that runs on the CPU too.
set -euo pipefail
cd "$(dirname "$0")/.."
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.11.0 2.14.1)
for v in "${versions[@]}"; do
  venv=".venv-torch-$v"
  echo "== torch $v ($venv)"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$v"
  "$venv/bin/pip" install -q -e '.[dev]'
  "$venv/bin/python" -c "import torch; print('torch', torch.__version__)"
  # what changes between torch versions: DCP and async saves, the native model and its compile, DDP/FSDP2,
  # resume (FSDP2's sharded one; a kill during a save), SIGTERM's save, the classes a DCP .metadata pickles (the
  # restricted unpickler's allow-list, tests/test_checkpoint_hostile.py), the FSDP2 export (the one-process HF
  # export tests are version-blind), LoRA's frozen base under FSDP2 and its adapter-only checkpoints (test_lora.py).
  # The one-process kill-and-resume equality test (53 s) runs in the main suite, and so do the two whole runs started on
  # a planted checkpoint (50 s): what they add to the fast hostile-checkpoint tests here is the supervisor's, not torch's
  "$venv/bin/python" -m pytest -q -m "not slow" -p no:cacheprovider \
    tests/test_checkpoint.py tests/test_checkpoint_hostile.py tests/test_native_model.py \
    tests/test_engine.py tests/test_native_engine.py tests/test_export.py tests/test_lora.py \
    -k "not test_engine.py or ddp or fsdp or resume or sigterm" \
    --deselect tests/test_export.py::test_exported_model_names_the_tokenizers_end_token_and_generate_stops_there \
    --deselect tests/test_engine.py::test_resume_after_kill_matches_uninterrupted_run \
    --deselect tests/test_checkpoint_hostile.py::test_a_run_whose_only_checkpoint_carries_a_payload_starts_over_in_the_next_attempt_without_a_traceback \
    --deselect tests/test_checkpoint_hostile.py::test_a_run_whose_newest_checkpoint_carries_a_payload_resumes_from_the_one_before
  # tensor and pipeline parallel lean on DTensor and torch.distributed.pipelining, which change between versions:
  # their equal-to-one-process harness runs here, slow tests included (about 3 minutes on torch 2.14, less on 2.11,
  # where pipelines and sequence parallel are refused and those runs skip): every schedule class (1F1B, interleaved;
  # GPipe is the 1F1B class's other order), a DP x PP mesh, DCP checkpoints moving between a pipeline and one
  # process and between TP sizes. They run in the main suite on the README's torch only, as CI's 60 minutes do not
  # hold them twice more: the pipelines composed with FSDP2 or TP (4- and 8-rank runs of minutes each) and the
  # kill -9 runs (the kill and the restart are the supervisor's; what torch does in them, DCP's save and load, the
  # checkpoint-moving tests run here)
  "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py tests/test_pipeline.py \
    -k "not fsdp_shards and not pipeline_with_fsdp_resume and not pipeline_of_tensor_parallel and not replicated_pipelines \
 and not gpipe and not resume_after_kill"
done
