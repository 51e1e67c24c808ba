"""The known-failure library, second half: what kills a run from outside the training math.

Drivers and installs, torch.compile, dtypes and devices, checkpoints that do not fit, the Hugging
Face hub, object storage and shared filesystems, trackers, ports, tokenizers, and processes killed
by a signal. Each phrase was written from real logs pasted into public issue trackers (the excerpts
and their sources are tests/data/real_logs/); patterns.py splices these into its table. Torch-free.
"""

from __future__ import annotations

from prime_train.kit.failures import FailureKind
from prime_train.resilience.pattern import Pattern
from prime_train.resilience.pattern import pattern as _pattern

K = FailureKind
_COMPILE_OFF = "set train.compile = false to run eager (the workaround), and report the error with the torch version"

ENV_FATAL_PATTERNS: list[Pattern] = [
    _pattern(
        "cuda_unavailable",
        K.DRIVER_ERROR,
        "CUDA is not usable in this process: check nvidia-smi, CUDA_VISIBLE_DEVICES and that no leftover "
        "process holds the GPUs (`prime-train preflight` checks this before a run)",
        (
            "No CUDA GPUs",
            "driver version is insufficient",
            "busy or unavailable",
            "NVIDIA driver",
            "CUDA-capable",
            "failed lazily at initialization",
        ),
        (r"No CUDA GPUs are available|no CUDA-capable device is detected", "torch / CUDA runtime"),
        (r"CUDA call failed lazily at initialization", "torch DeferredCudaCallError (a bad CUDA_VISIBLE_DEVICES)"),
        (r"CUDA driver version is insufficient|Found no NVIDIA driver on your system", "CUDA runtime, torch"),
        (r"CUDA-capable device\(s\) is/are busy or unavailable", "CUDA runtime (exclusive compute mode)"),
    ),
    _pattern(
        "cuda_driver_mismatch",
        K.DRIVER_ERROR,
        "the NVIDIA driver does not fit: 'too old' means the installed torch wants a newer driver (update the "
        "driver, or install a torch built for an older CUDA); an NVML mismatch follows a driver upgrade without "
        "a reboot (reboot the node, or reload the nvidia kernel modules)",
        ("driver on your system is too old", "NVML: Driver/", "Driver/library version mismatch"),
        (r"NVIDIA driver on your system is too old", "torch._C._cuda_init (RuntimeError, AssertionError before 1.5)"),
        (r"(?i:failed to initialize NVML: Driver/library version mismatch)", "nvidia-smi, NVML"),
    ),
    _pattern(
        "cuda_no_kernel_image",
        K.DRIVER_ERROR,
        "the installed torch or kernel library was not built for this GPU's architecture: install a build that "
        "supports it (a newer CUDA wheel for H100/B200, or build the extension with TORCH_CUDA_ARCH_LIST set)",
        ("no kernel image",),
        (r"no kernel image is available for execution on the device", "CUDA error 209 (torch, vLLM, flash-attn)"),
    ),
    _pattern(
        "broken_install",
        K.BROKEN_INSTALL,
        "a package is missing or does not fit the installed torch (the line names it): an undefined symbol means "
        "an extension (flash-attn, vLLM) built for another torch, so reinstall it for this one; a version "
        "requirement names the versions that fit",
        (".so: undefined symbol", "No module named", "is required for a normal", "cannot import name"),
        (r"\.so(?:\.[\d.]+)?: undefined symbol: \w+", "the dynamic loader importing a C++/CUDA extension"),
        (r"(?:ModuleNotFoundError|ImportError): No module named '[\w.]+'", "Python's import system"),
        (r"is required for a normal functioning of this module, but found [\w.-]+==", "transformers' version check"),
        (r"ImportError: cannot import name '\w+' from '[\w.]+'", "Python: a name another version of a package has"),
    ),
    _pattern(
        "compile_error",
        K.COMPILE_ERROR,
        f"torch.compile failed to compile the model (dynamo, inductor or Triton): {_COMPILE_OFF}",
        ("BackendCompilerFailed", "CompilationError", "OutOfResources: out of", "CppCompileError", "InductorError: "),
        (r"BackendCompilerFailed: backend=\\?'\w+\\?' raised", "torch._dynamo (2.0+), the backend's error after it"),
        (r"triton\.compiler\.(?:errors\.)?CompilationError", "Triton compiling an inductor kernel"),
        (r"\bOutOfResources: out of resource: ", "Triton: a kernel config needs more shared memory than the GPU has"),
        (r"\bCppCompileError: C\+\+ compile error", "inductor's C++ backend (CPU) calling the compiler"),
        (r"torch\._inductor\.exc\.InductorError: ", "inductor (2.7+)"),
    ),
    _pattern(
        "dtype_or_device",
        K.DTYPE_OR_DEVICE,
        "tensors on different devices or a dtype the GPU or op does not take: bf16 needs compute capability 8.0+ "
        "(set train.precision = 'fp16' or 'fp32' on older GPUs), the fp16 loss scaler needs fp32 trainable "
        "weights, and a device mismatch is a bug in the code that made the tensor",
        (
            "Expected all tensors to be on the same device",
            "Bfloat16 is only supported",
            "does not support bfloat16",
            "unscale FP16 gradients",
            "expected scalar type",
        ),
        (r"Expected all tensors to be on the same device", "torch device check (1.10+)"),
        (r"Bfloat16 is only supported on GPUs with compute capability", "vLLM dtype check"),
        (r"Current CUDA Device does not support bfloat16", "torch.amp.autocast"),
        (r"Attempting to unscale FP16 gradients", "torch.amp.GradScaler with fp16 trainable weights"),
        (r"expected scalar type \w+ but found \w+", "torch kernels given mixed dtypes"),
    ),
    _pattern(
        "checkpoint_mismatch",
        K.CHECKPOINT_MISMATCH,
        "the checkpoint does not fit the model (the line names the parameter and both shapes, or the keys): load "
        "it into the model config it was saved with, or start from the model path instead",
        ("Error(s) in loading state_dict", "key(s) in state_dict", "size mismatch for", "Size mismatch between saved"),
        (r"Error\(s\) in loading state_dict for \w+", "torch load_state_dict(strict=True)"),
        (r"(?:Missing|Unexpected) key\(s\) in state_dict: ", "torch load_state_dict, one line per list"),
        (r"size mismatch for [\w.]+: copying a param with shape", "torch load_state_dict, one line per parameter"),
        (r"Size mismatch between saved torch\.Size\(\[[\d, ]*\]\) and current", "torch.distributed.checkpoint load"),
    ),
    _pattern(
        "hub_unavailable",
        K.HUB_UNAVAILABLE,
        "the Hugging Face hub could not be reached, timed out or rate-limited the download (429): transient, the "
        "run retries with backoff; set HF_TOKEN for higher limits, or download once and point model.path at it",
        ("429 Client Error", "HTTPSConnectionPool(host=", "LocalEntryNotFoundError", "locate the file on the Hub"),
        (
            # not another host's 429 (an OpenAI-compatible API in an environment): that line names its URL
            r"\b429 Client Error: Too Many Requests(?! for url: https?://(?!huggingface\.co|hf\.co))",
            "huggingface_hub HfHubHTTPError (requests' raise_for_status)",
        ),
        (
            r"(?:Timeout|ConnectionError|MaxRetryError)\w*: .{0,40}HTTPSConnectionPool\(host='[\w.-]*"
            r"(?:huggingface\.co|hf\.co)'",
            "requests / urllib3 under huggingface_hub (an exception line, not its retry warnings)",
        ),
        (r"\bLocalEntryNotFoundError\b|error happened while trying to locate the file on the Hub", "huggingface_hub"),
    ),
    _pattern(
        "hub_offline_mode",
        K.CONFIG_ERROR,
        "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set and the file is not in the local cache: download it "
        "first (`hf download REPO`) with the same HF_HOME, or unset offline mode; retrying cannot help",
        ("offline mode is enabled", "OfflineModeIsEnabled", "outgoing traffic has been disabled"),
        (r"offline mode is enabled|\bOfflineModeIsEnabled\b", "huggingface_hub >= 0.20 (HF_HUB_OFFLINE)"),
        (r"outgoing traffic has been disabled", "huggingface_hub / transformers cached_file in offline mode"),
    ),
    _pattern(
        "storage_throttled",
        K.STORAGE_TRANSIENT,
        "the object store throttled requests (SlowDown, 503) or an NFS mount dropped a file handle (ESTALE): "
        "transient, the run retries with backoff; write from fewer ranks at once or checkpoint less often",
        ("SlowDown", "Slow Down", "Stale file handle", "Stale NFS", "ESTALE", "BadDigest"),
        (r"\bSlowDown\b|\b503:? Slow Down\b", "S3 and S3-compatible stores (botocore, aws-sdk, urllib)"),
        (
            r"\[Errno 116\] Stale file handle|Stale NFS file handle|\bESTALE\b",
            "NFS client: a file changed on the server",
        ),
        (r"\bBadDigest\b", "S3: the upload arrived corrupted (checksum), to be sent again"),
    ),
    _pattern(
        "storage_refused",
        K.STORAGE_ERROR,
        "the object store refused the request: AccessDenied/403 means credentials or bucket policy, NoSuchBucket "
        "a wrong bucket name or region, RequestTimeTooSkewed a machine clock off by 15+ minutes (`timedatectl`)",
        ("when calling the", "RequestTimeTooSkewed"),
        (
            r"\((?:AccessDenied|NoSuchBucket|InvalidAccessKeyId|SignatureDoesNotMatch|RequestTimeTooSkewed|403)\) "
            r"when calling the \w+ operation",
            "botocore ClientError (boto3, the aws CLI)",
        ),
        (r"\bRequestTimeTooSkewed\b", "S3 error code in other SDKs (PHP, JavaScript)"),
    ),
    _pattern(
        "tracker_no_api_key",
        K.TRACKER_ERROR,
        "W&B has no API key in a non-interactive run: export WANDB_API_KEY (and list it in supervisor.required_env) "
        "or set WANDB_MODE=offline; the training itself was fine",
        ("api_key not configured",),
        (r"api_key not configured \(no-tty\)", "wandb.errors.UsageError from wandb.init / wandb.login"),
    ),
    _pattern(
        "address_in_use",
        K.PORT_IN_USE,
        "a port the job binds is taken (distributed.master_port, or inference.base_port + i for RL worker i): "
        "`ss -ltnp 'sport = :PORT'` shows who holds it; stop that process or pick another port",
        (
            "ddress already in use",
            "DDRESS ALREADY IN USE",
            "EADDRINUSE",
            "address in use",
            "failed to listen on any",
        ),
        (r"(?i:address already in use)|\bEADDRINUSE\b", "POSIX EADDRINUSE (Python, uvicorn, torch c10d)"),
        (r"cannot listen on \S+: address in use", "prime-train's embedded rollout worker, older wording"),
        (r"server socket has failed to listen on any\b", "torch c10d TCPStore (torchrun's [E socket.cpp] line)"),
    ),
    _pattern(
        "tokenizer_mismatch",
        K.TOKENIZER_ERROR,
        "the tokenizer does not fit: a base model has no chat template (use the instruct model's tokenizer or set "
        "one), token ids past the vocabulary come from another tokenizer or un-resized embeddings",
        ("chat_template is not set", "is out of vocabulary", "ocab size mismatch"),
        (r"chat_template is not set", "transformers apply_chat_template (4.43+: no default template)"),
        (r"Token id \d+ is out of vocabulary", "vLLM input processor"),
        (r"(?i:vocab size mismatch)", "llama.cpp convert, model and tokenizer vocab sizes differ"),
    ),
    _pattern(
        "native_crash",
        K.KILLED_BY_SIGNAL,
        "the process died of a signal in native code (segfault, abort, bus error): the rank's own error above "
        "the launcher's summary is the cause when there is one; after an NCCL timeout the watchdog aborts on purpose",
        (
            "Signal ",
            "Segmentation fault",
            "Fatal Python error",
            "exitcode",
            "<Signals.SIG",
            "by signal ",
            "with signal SIG",
            "bus error",
            "core dumped",
        ),
        (
            r"Signal (?:4 \(SIGILL\)|6 \(SIGABRT\)|7 \(SIGBUS\)|8 \(SIGFPE\)|11 \(SIGSEGV\)) received|"
            r"exitcode\s*:\s*-(?:4|6|7|8|11)\b",
            "torchrun's failure table and elastic agent",
        ),
        (r"\bSegmentation fault\b|Fatal Python error: ", "shells, CPython faulthandler"),
        (
            r"died with <Signals\.SIG(?:ABRT|SEGV|BUS|FPE|ILL): \d+>|"
            r"terminated with signal SIG(?:ABRT|SEGV|BUS|FPE|ILL)",
            "Python subprocess, torch.multiprocessing spawn",
        ),
        (r"interrupted by signal \d+: SIG(?:ABRT|SEGV|BUS|FPE|ILL)", "IDEs reporting a process's end"),
        (r"^\s*(?:\[\d+\]\s+\d+\s+)?bus error\b|\(core dumped\)", "zsh, bash: 'bus error', 'Aborted (core dumped)'"),
    ),
]

ENV_WARNING_PATTERNS: list[Pattern] = [
    _pattern(
        "tracker_network",
        None,
        "the tracker (W&B) could not reach its server and retries in the background: the run itself is fine and "
        "is never stopped for this; its metrics sync later (`wandb sync` after the run if they do not)",
        ("wandb: Network error", "wandb: ERROR Error uploading"),
        (r"wandb: Network error \(\w+\), entering retry loop", "wandb SDK retry loop"),
        (r"wandb: ERROR Error uploading ", "wandb file uploads (they are retried)"),
    ),
]
