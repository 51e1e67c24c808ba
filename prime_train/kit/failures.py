"""What went wrong, as data: a failure is classified once and the restart policy reads it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from prime_train.contract import JobFailure


class FailureKind(StrEnum):
    """What went wrong, as the supervisor classifies it; the kinds a job names itself are contract.JobFailure's."""

    CRASH = "crash"
    OUT_OF_MEMORY = "out_of_memory"  # GPU memory
    HOST_OUT_OF_MEMORY = "host_out_of_memory"  # the machine's RAM: the OOM killer, Ray's memory monitor
    NCCL_TIMEOUT = "nccl_timeout"
    RENDEZVOUS_TIMEOUT = (
        "rendezvous_timeout"  # the ranks never all met: a node did not start or cannot reach the endpoint
    )
    NCCL_ERROR = "nccl_error"  # NCCL failed outright: network, driver, or a peer rank that died
    HANG = "hang"
    GPU_BROKEN = "gpu_broken"
    CUDA_ERROR = "cuda_error"  # a kernel faulted (illegal memory access, misaligned address, launch failure)
    DEVICE_ASSERT = "device_assert"  # a kernel assertion: an index out of range, from the data
    LOSS_NOT_FINITE = JobFailure.LOSS_NOT_FINITE.value  # the loss or the gradients became NaN/inf: the run diverged
    INFERENCE_DIED = "inference_died"
    PREEMPTED = "preempted"
    CONFIG_ERROR = "config_error"
    DISK_FULL = "disk_full"
    NODE_LOST = JobFailure.NODE_LOST.value  # another node went silent: its trainer or its machine is gone
    KILLED_BY_SIGNAL = "killed_by_signal"  # a process died of SIGSEGV, SIGABRT, SIGBUS...: a crash in native code
    CHECKPOINT_MISMATCH = "checkpoint_mismatch"  # a state dict does not fit the model: keys or shapes differ
    HUB_UNAVAILABLE = "hub_unavailable"  # the Hugging Face hub timed out, rate-limited (429) or could not be reached
    DRIVER_ERROR = "driver_error"  # the NVIDIA driver or the GPU does not fit the installed CUDA build
    BROKEN_INSTALL = "broken_install"  # a missing module, an undefined symbol, a package version conflict at import
    COMPILE_ERROR = "compile_error"  # torch.compile (dynamo, inductor, Triton) failed to compile the model
    DTYPE_OR_DEVICE = "dtype_or_device"  # tensors on different devices, a dtype the GPU or the op does not take
    STORAGE_TRANSIENT = "storage_transient"  # object storage throttled (SlowDown), a stale NFS handle: passes
    STORAGE_ERROR = "storage_error"  # object storage refused: access denied, no such bucket, the clock skewed
    TRACKER_ERROR = "tracker_error"  # the experiment tracker (W&B) refused to start: no API key
    PORT_IN_USE = "port_in_use"  # a port the job binds is held by another process
    TOKENIZER_ERROR = "tokenizer_error"  # no chat template, a token id out of the vocabulary, vocab sizes that differ


@dataclass(frozen=True)
class Rule:
    """What a kind of failure means to a person and to the restart policy."""

    hint: str  # what to do about it, in one line
    # why a restart from the newest checkpoint cannot help (it fails the same way again); None: the kind is retried
    not_retried: str | None = None


# One rule a kind. A config error fails the same way every time; so do a device-side assert and a diverged loss.
# Everything else may be transient (or, like OOM, worth one more look after a restart).
RULES: dict[FailureKind, Rule] = {
    FailureKind.CRASH: Rule(
        "its output is in logs/attempt-<n>/ (`prime-train logs RUN_DIR`); the run resumes from the newest whole "
        "checkpoint"
    ),
    FailureKind.OUT_OF_MEMORY: Rule(
        "lower train.micro_batch_size or data.seq_len, or turn on model.activation_checkpointing"
    ),
    FailureKind.HOST_OUT_OF_MEMORY: Rule(
        "the machine ran out of RAM (not GPU memory): lower data.num_workers or train.micro_batch_size, or use a "
        "machine with more RAM (`dmesg -T | grep -i oom` confirms it)"
    ),
    FailureKind.NCCL_TIMEOUT: Rule(
        "a rank stalled in a collective: check the other ranks' logs and the network; raise distributed.timeout_s "
        "only if a step legitimately takes that long"
    ),
    FailureKind.RENDEZVOUS_TIMEOUT: Rule(
        "the ranks never all met at the rendezvous: a node did not start, or cannot reach distributed.rdzv_endpoint "
        "(firewall, wrong address); each node's `prime-train status` says whether it is up"
    ),
    FailureKind.NCCL_ERROR: Rule(
        "NCCL failed: if it says a remote process exited, another rank died first (its log has the cause); "
        "otherwise rerun with NCCL_DEBUG=INFO and check the network (NCCL_SOCKET_IFNAME, InfiniBand)"
    ),
    FailureKind.HANG: Rule("no step within supervisor.stall_timeout_s: py-spy dump the trainer next time to see where"),
    FailureKind.GPU_BROKEN: Rule(
        "a GPU failed (ECC, fallen off the bus) or shows 0 % utilisation and 0 MiB while the job is stuck: the node "
        "may need a reboot, or the job another node"
    ),
    FailureKind.CUDA_ERROR: Rule(
        "a CUDA kernel faulted (illegal memory access or similar): rerun with CUDA_LAUNCH_BLOCKING=1 to find the "
        "op; try another attention backend or kernel library version"
    ),
    FailureKind.DEVICE_ASSERT: Rule(
        "a CUDA kernel assertion, almost always a token id >= vocab size or a label out of range: check the "
        "tokenizer against the model's vocab_size and the labels (-100 to ignore)",
        not_retried="a resume replays the same batch, whose ids or labels are out of range",
    ),
    FailureKind.LOSS_NOT_FINITE: Rule(
        "the loss became NaN/inf: lower train.lr or lengthen the warmup, keep train.grad_clip set, prefer bf16 to "
        "fp16, check the data",
        not_retried="the same lr, precision and data diverge again",
    ),
    FailureKind.INFERENCE_DIED: Rule("an inference worker died; its last log lines are above"),
    FailureKind.PREEMPTED: Rule("the instance is going away; the job checkpointed and will resume"),
    FailureKind.CONFIG_ERROR: Rule(
        "fix the config (prime-train lint) and start again", not_retried="the config fails the same way every time"
    ),
    FailureKind.DISK_FULL: Rule("free disk or lower ckpt.keep_last / supervisor.max_disk_gb"),
    FailureKind.NODE_LOST: Rule(
        "another node stopped beating (its trainer, its supervisor or its machine is gone): its own log and "
        "`prime-train status` there say why; this node restarts and waits for it at the rendezvous for "
        "distributed.join_timeout_s"
    ),
    FailureKind.KILLED_BY_SIGNAL: Rule(
        "a process died of a signal (SIGSEGV, SIGABRT, SIGBUS) in native code: the rank's own error above the "
        "launcher's summary is the cause when there is one; the run resumes from the newest whole checkpoint"
    ),
    FailureKind.CHECKPOINT_MISMATCH: Rule(
        "the checkpoint does not fit the model (the line names the parameter and both shapes): resume with the "
        "model config it was saved with, or start from the model path instead of this checkpoint",
        not_retried="the same checkpoint fails to load into the same model again",
    ),
    FailureKind.HUB_UNAVAILABLE: Rule(
        "the Hugging Face hub timed out, rate-limited the download (429) or could not be reached: the run retries "
        "with backoff; set HF_TOKEN (higher limits), or download the model once and point model.path at it"
    ),
    FailureKind.DRIVER_ERROR: Rule(
        "the NVIDIA driver or the GPU does not fit the installed torch/CUDA build (driver too old, NVML "
        "mismatch after a driver upgrade: reboot, no kernel image for this GPU): fix the machine or the install",
        not_retried="the same driver and build fail the same way",
    ),
    FailureKind.BROKEN_INSTALL: Rule(
        "a package is missing or was built against another torch (the line names it): reinstall it for the "
        "installed torch (`pip install --force-reinstall PKG`), or pin the versions that fit",
        not_retried="the same environment fails to import the same way",
    ),
    FailureKind.COMPILE_ERROR: Rule(
        "torch.compile failed (dynamo, inductor or Triton): set train.compile = false to run eager, and report "
        "the error with the torch version",
        not_retried="the same model compiles the same way",
    ),
    FailureKind.DTYPE_OR_DEVICE: Rule(
        "tensors on different devices or a dtype the GPU or op does not take (bf16 needs compute capability 8.0+; "
        "fp16 weights cannot be unscaled): set train.precision to what the GPU supports, keep trained weights fp32",
        not_retried="the same code on the same GPU fails the same way",
    ),
    FailureKind.STORAGE_TRANSIENT: Rule(
        "the object store throttled requests (SlowDown, 503) or a shared filesystem dropped a handle (ESTALE): "
        "the run retries with backoff; spread the writes (fewer ranks writing, a longer ckpt.interval)"
    ),
    FailureKind.STORAGE_ERROR: Rule(
        "the object store refused the request (access denied, no such bucket, the clock too far off): check the "
        "bucket name, the credentials and the machine's clock (`timedatectl`)",
        not_retried="the same bucket and credentials are refused again",
    ),
    FailureKind.TRACKER_ERROR: Rule(
        "the experiment tracker refused to start (no W&B API key): export WANDB_API_KEY (list it in "
        "supervisor.required_env) or set WANDB_MODE=offline; tracker warnings alone never stop a healthy run",
        not_retried="without the key the tracker refuses again",
    ),
    FailureKind.PORT_IN_USE: Rule(
        "a port the job binds is held by another process (distributed.master_port, inference.base_port + i): "
        "`ss -ltnp 'sport = :PORT'` shows who holds it; the run retries with backoff in case it is freed"
    ),
    FailureKind.TOKENIZER_ERROR: Rule(
        "the tokenizer does not fit the data or the model (no chat template on a base model, token ids past the "
        "vocabulary, vocab sizes that differ): use the instruct model's tokenizer or set a chat template, and "
        "resize the embeddings after adding tokens",
        not_retried="the same tokenizer and data fail the same way",
    ),
}

# The rules read three ways: whether a restart can help, the hint a person reads, and the policy's reason.
RETRYABLE = {kind: rule.not_retried is None for kind, rule in RULES.items()}
WHY_NOT_RETRIED = {kind: rule.not_retried for kind, rule in RULES.items() if rule.not_retried is not None}
HINTS = {
    kind: rule.hint + (f"; not retried: {rule.not_retried}" if rule.not_retried else "") for kind, rule in RULES.items()
}


@dataclass
class Failure:
    kind: FailureKind
    message: str
    evidence: list[str] = field(default_factory=list)
    process: str | None = None
    step: int | None = None
    exit_code: int | None = None

    @property
    def retryable(self) -> bool:
        return RETRYABLE[self.kind]

    @property
    def hint(self) -> str:
        return HINTS[self.kind]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kind"] = str(self.kind)
        out["retryable"] = self.retryable
        return out
