"""What went wrong, as data: a failure is classified once and the restart policy reads it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class FailureKind(StrEnum):
    CRASH = "crash"
    OUT_OF_MEMORY = "out_of_memory"  # GPU memory
    HOST_OUT_OF_MEMORY = "host_out_of_memory"  # the machine's RAM: the OOM killer, Ray's memory monitor
    NCCL_TIMEOUT = "nccl_timeout"
    NCCL_ERROR = "nccl_error"  # NCCL failed outright: network, driver, or a peer rank that died
    HANG = "hang"
    GPU_BROKEN = "gpu_broken"
    CUDA_ERROR = "cuda_error"  # a kernel faulted (illegal memory access, misaligned address, launch failure)
    DEVICE_ASSERT = "device_assert"  # a kernel assertion: an index out of range, from the data
    LOSS_NOT_FINITE = "loss_not_finite"  # the loss or the gradients became NaN/inf: the run diverged
    INFERENCE_DIED = "inference_died"
    PREEMPTED = "preempted"
    CONFIG_ERROR = "config_error"
    DISK_FULL = "disk_full"
    NODE_LOST = "node_lost"  # another node of a multi-node job went silent: its trainer or its machine is gone


# Whether a restart from the newest checkpoint can help. A config error fails the same way every
# time; so does a device-side assert (the resumed run replays the same batch, whose ids are out of
# range) and a diverged loss (the same lr and data diverge again). Everything else may be
# transient (or, like OOM, worth one more look after a restart).
RETRYABLE = {
    FailureKind.CRASH: True,
    FailureKind.OUT_OF_MEMORY: True,
    FailureKind.HOST_OUT_OF_MEMORY: True,
    FailureKind.NCCL_TIMEOUT: True,
    FailureKind.NCCL_ERROR: True,
    FailureKind.HANG: True,
    FailureKind.GPU_BROKEN: True,
    FailureKind.CUDA_ERROR: True,
    FailureKind.DEVICE_ASSERT: False,
    FailureKind.LOSS_NOT_FINITE: False,
    FailureKind.INFERENCE_DIED: True,
    FailureKind.PREEMPTED: True,
    FailureKind.CONFIG_ERROR: False,
    FailureKind.DISK_FULL: True,
    FailureKind.NODE_LOST: True,
}

HINTS = {
    FailureKind.CRASH: "its output is in logs/attempt-<n>/ (`prime-train logs RUN_DIR`); the run resumes from the "
    "newest whole checkpoint",
    FailureKind.OUT_OF_MEMORY: "lower train.micro_batch_size or data.seq_len, "
    "or turn on model.activation_checkpointing",
    FailureKind.HOST_OUT_OF_MEMORY: "the machine ran out of RAM (not GPU memory): lower data.num_workers or "
    "train.micro_batch_size, or use a machine with more RAM (`dmesg -T | grep -i oom` confirms it)",
    FailureKind.NCCL_TIMEOUT: "a rank stalled in a collective: check the other ranks' logs and the network; "
    "raise distributed.timeout_s only if a step legitimately takes that long",
    FailureKind.NCCL_ERROR: "NCCL failed: if it says a remote process exited, another rank died first (its log "
    "has the cause); otherwise rerun with NCCL_DEBUG=INFO and check the network (NCCL_SOCKET_IFNAME, InfiniBand)",
    FailureKind.HANG: "no step within supervisor.stall_timeout_s: py-spy dump the trainer next time to see where",
    FailureKind.GPU_BROKEN: "a GPU failed (ECC, fallen off the bus) or shows 0 % utilisation and 0 MiB while the "
    "job is stuck: the node may need a reboot, or the job another node",
    FailureKind.CUDA_ERROR: "a CUDA kernel faulted (illegal memory access or similar): rerun with "
    "CUDA_LAUNCH_BLOCKING=1 to find the op; try another attention backend or kernel library version",
    FailureKind.DEVICE_ASSERT: "a CUDA kernel assertion, almost always a token id >= vocab size or a label out of "
    "range: check the tokenizer against the model's vocab_size and the labels (-100 to ignore); not retried, "
    "as the resumed run replays the same batch",
    FailureKind.LOSS_NOT_FINITE: "the loss became NaN/inf: lower train.lr or lengthen the warmup, keep "
    "train.grad_clip set, prefer bf16 to fp16, check the data; not retried, as the same run diverges again",
    FailureKind.INFERENCE_DIED: "an inference worker died; its last log lines are above",
    FailureKind.PREEMPTED: "the instance is going away; the job checkpointed and will resume",
    FailureKind.CONFIG_ERROR: "fix the config (prime-train lint) and start again; retrying cannot help",
    FailureKind.DISK_FULL: "free disk or lower ckpt.keep_last / supervisor.max_disk_gb",
    FailureKind.NODE_LOST: "another node stopped beating (its trainer, its supervisor or its machine is gone): "
    "its own log and `prime-train status` there say why; this node restarts and waits for it at the rendezvous "
    "for distributed.join_timeout_s",
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
