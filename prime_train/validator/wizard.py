"""The config `prime-train init` writes: from a few answers (job, model, hardware), a lint-clean run config
whose comments explain each choice.

It lives beside lint, the memory tables and the model checks because it is built from them: a GPU's
memory decides sharding, a model's config.json its size, and `check_text` runs the same lint as
`prime-train lint`, so the wizard never writes a config that lint rejects. Asking the questions (and
not asking them without a terminal) is the CLI's part (prime_train/cli/init.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# what init offers: run.job's values, and "ppo" for the rl job with rl.algorithm = "ppo"
JOBS = ("sft", "pretrain", "rl", "ppo", "dpo", "reward", "meta")
RL_JOBS = ("rl", "ppo")
PAIR_JOBS = ("dpo", "reward")  # trained on preference pairs: batch sizes count pairs, two sequences each
ENVIRONMENTS = ("reverse-text", "arithmetic", "sorting")
TINY = "tiny"


@dataclass
class Answers:
    """What the user told us (or the defaults)."""

    job: str = "sft"
    model: str = TINY  # 'tiny' (random-initialised, CPU) or an HF id / local directory
    hardware: str = "cpu"  # 'cpu' or '<GPU>:<count>', e.g. 'H100:8'
    nodes: int = 1
    name: str | None = None
    seq_len: int | None = None
    max_steps: int | None = None
    environment: str = "reverse-text"
    dataset: str | None = None  # local file/dir/glob for sft/pretrain/dpo/reward; unset: a built-in task
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Hardware:
    """One node of the run: `count` GPUs called `gpu` (None: the CPU, one process), each one's memory and bf16."""

    gpu: str | None
    count: int
    memory_gib: float | None
    bf16: bool = False

    @property
    def is_gpu(self) -> bool:
        return self.gpu is not None


def parse_hardware(text: str) -> Hardware:
    """'cpu', 'H100', 'H100:8', 'A100-80GB:4' -> Hardware, the GPU looked up in the one GPU table (validator/gpus.py).

    A GPU the table does not know is refused, as `prime-train memory` and `cost` refuse it: the config's sharding
    and precision are chosen from the GPU's memory and bf16 support, which would otherwise be guesses.
    """
    from prime_train.config.accelerators import parse_accelerators
    from prime_train.validator.gpus import load_gpus
    from prime_train.validator.memory_inputs import MemoryInputError

    accelerators = parse_accelerators(text, what="hardware")
    if accelerators.is_cpu:
        return Hardware(None, 1, None)
    # the config gets one training process per GPU (distributed.nproc_per_node), so a shared GPU cannot be one
    count = accelerators.whole_count("the run starts one training process per GPU", what="hardware")
    try:
        spec = load_gpus().find(accelerators.name)
    except MemoryInputError as exc:
        raise ValueError(f"hardware {text!r}: {exc}") from None
    return Hardware(accelerators.name, count, spec.memory_bytes / 2**30, spec.bf16)


def _model_shape(model: str) -> tuple[dict[str, Any] | None, int | None]:
    """The HF config of a local or cached model, and its parameter count (None when unknown offline)."""
    if model == TINY:
        return None, None
    from prime_train.config.schema import Config
    from prime_train.validator.model_shape import model_shape
    from prime_train.validator.param_count import count_parameters

    hf, _ = model_shape(Config.model_validate({"model": {"path": model}}))
    if hf is None:
        return None, None
    try:
        return hf, count_parameters(hf)
    except (KeyError, TypeError, ValueError):
        return hf, None


def run_job(job: str) -> str:
    """run.job of an init job: 'ppo' is the rl job with rl.algorithm = "ppo"."""
    return "rl" if job == "ppo" else job


# completions per RL prompt: a step trains on rl.prompts_per_step × this many
_GROUP_SIZE = 8
# LoRA's rank when the whole model does not fit the GPUs, and the share of one GPU a colocated RL trainer gets
LORA_RANK = 16
_COLOCATED_TRAINER_SHARE = 0.6
_HEADROOM = 0.10  # memory.TIGHT_FRACTION: a plan that leaves less of the GPU free is tight


@dataclass(frozen=True)
class _LoraChoice:
    """Full fine-tuning does not fit the GPUs: what it needs, what LoRA (and QLoRA) need, per GPU, in bytes."""

    full: int
    lora: int
    qlora: int | None  # None: not with a sharded strategy
    capacity: float
    gpu: str

    def fits(self, need: float | None) -> bool:
        """Whether `need` bytes fit a GPU with the headroom `prime-train memory` asks for (under it: tight)."""
        return need is not None and need <= (1 - _HEADROOM) * self.capacity

    @property
    def quantize(self) -> bool:
        """Whether only QLoRA fits (the config then says lora.quantize = "nf4")."""
        return not self.fits(self.lora) and self.fits(self.qlora)


@dataclass(frozen=True)
class _Plan:
    """The answers and what follows from them, for the config's sections to write down."""

    a: Answers
    hw: Hardware
    name: str
    params: int | None  # None: unknown here
    big: bool  # 1B parameters or more
    max_len: int  # the model's context
    seq_len: int
    inference_gpus: int  # a node's GPUs that serve RL rollouts
    trainer_gpus: int  # a node's GPUs that train
    world: int  # training processes over all nodes
    micro: int
    global_batch: int
    strategy: str
    strategy_why: str
    lora: _LoraChoice | None  # set when the whole model does not fit the GPUs but LoRA's adapters do


def build_config(a: Answers) -> str:
    """The TOML text of the run, with a comment on each choice."""
    plan = _plan(a)
    sections = (
        _run_lines,
        _model_lines,
        _lora_lines,
        _dpo_lines,
        _meta_lines,
        _data_lines,
        _train_lines,
        _distributed_lines,
        _ckpt_lines,
        _rl_lines,
        _supervisor_lines,
    )
    return "\n".join(line for section in sections for line in section(plan)) + "\n"


def _plan(a: Answers) -> _Plan:
    """The choices the answers decide (ValueError for an answer that names nothing usable); notes go to `a`."""
    if a.job not in JOBS:
        raise ValueError(f"job {a.job!r}: choose one of {', '.join(JOBS)}")
    if a.nodes < 1:
        raise ValueError("nodes must be at least 1")
    hw = parse_hardware(a.hardware)
    if a.model == TINY and hw.is_gpu:
        a.notes.append("the tiny model on a GPU is a smoke test; name a real model for a real run")
    if a.job not in ("sft", "pretrain", "meta") and a.model == TINY:
        a.notes.append(
            f"{a.job} starts from the tiny SFT run's model: run `prime-train run` (the tiny SFT default) first"
        )
    hf, params = _model_shape(a.model)
    # RL on several GPUs: a quarter of a node's GPUs serve rollouts (one vLLM worker each), the rest train
    inference_gpus = max(1, hw.count // 4) if a.job in RL_JOBS and hw.is_gpu and hw.count > 1 else 0
    trainer_gpus = hw.count - inference_gpus
    if a.job == "meta" and (trainer_gpus > 1 or a.nodes > 1):  # Reptile runs in one process (engine/meta.py)
        a.notes.append("meta: Reptile runs in one process, so the config uses one GPU of one node")
        trainer_gpus, a.nodes = 1, 1
    world = trainer_gpus * a.nodes
    name = a.name or (f"tiny-{a.job}" if a.model == TINY else f"{a.model.rstrip('/').split('/')[-1].lower()}-{a.job}")
    name = name.replace("/", "-")
    if a.model == TINY:
        max_len = 512
    else:
        max_len = int(hf.get("max_position_embeddings", 4096)) if hf else 4096
    big = params is not None and params >= 1e9
    seq_len = a.seq_len or (128 if a.model == TINY else min(4096, max_len))
    if seq_len > max_len:
        raise ValueError(f"seq_len {seq_len} is longer than the model's context ({max_len})")
    micro, global_batch = _batch_sizes(a.job, hw, big, world)
    strategy, why = _strategy(a, hw, params, big, world)
    lora = _lora_choice(a, hw, hf, strategy, world, seq_len, micro, big)
    return _Plan(
        a=a,
        hw=hw,
        name=name,
        params=params,
        big=big,
        max_len=max_len,
        seq_len=seq_len,
        inference_gpus=inference_gpus,
        trainer_gpus=trainer_gpus,
        world=world,
        micro=micro,
        global_batch=global_batch,
        strategy=strategy,
        strategy_why=why,
        lora=lora,
    )


def _strategy(a: Answers, hw: Hardware, params: int | None, big: bool, world: int) -> tuple[str, str]:
    """The data-parallel strategy the model's size and the GPUs' memory call for, and why."""
    if world == 1:
        return "none", "one process"
    if big or (hw.memory_gib is not None and params is not None and params * 16 / 2**30 > 0.5 * hw.memory_gib):
        if a.nodes > 1:
            return "hsdp", "FSDP inside each node, replicas across nodes: less cross-node traffic"
        return "fsdp", "shards weights, gradients and optimizer states: the full states do not fit one GPU"
    if params is None and a.model != TINY:  # never "fits" beside "size unknown"
        return (
            "ddp",
            'replicate the model and all-reduce gradients; its size is unknown here: "fsdp" if it does not fit',
        )
    return "ddp", "the model fits one GPU: replicate it and all-reduce gradients"


def _lora_choice(
    a: Answers, hw: Hardware, hf: dict[str, Any] | None, strategy: str, world: int, seq_len: int, micro: int, big: bool
) -> _LoraChoice | None:
    """LoRA's figures when training the whole model would not fit the GPUs (the memory calculator, with the
    config's settings); None when it fits, or when the model or the GPU is not known here."""
    from dataclasses import replace

    from prime_train.validator.memory_breakdown import trainer_memory
    from prime_train.validator.memory_inputs import MemoryInputError, MemoryInputs, ModelShape

    if a.model == TINY or hf is None or not hw.is_gpu or hw.memory_gib is None:
        return None
    from prime_train.validator.memory_inputs import job_settings

    capacity = hw.memory_gib * 2**30 * (_COLOCATED_TRAINER_SHARE if a.job in RL_JOBS and world == 1 else 1.0)
    try:
        # the job as written: dpo holds its reference (precompute_reference = false), ppo its value head
        inputs = MemoryInputs(
            model=hf, seq_len=seq_len, micro_batch=micro, gpus_per_node=world // a.nodes, num_nodes=a.nodes,
            strategy=strategy, precision="bf16" if hw.bf16 else "fp32",
            activation_checkpointing="full" if big else "none", gpus=[], **job_settings(a.job),
        )  # fmt: skip
        shape = ModelShape.from_hf(hf)
        full = trainer_memory(inputs, shape).total
        if full <= (1 - _HEADROOM) * capacity:
            return None
        lora = trainer_memory(replace(inputs, lora_rank=LORA_RANK), shape).total
        qlora = None
        if strategy not in ("fsdp", "hsdp"):
            qlora = trainer_memory(replace(inputs, lora_rank=LORA_RANK, lora_quantize="nf4"), shape).total
    except MemoryInputError:
        return None
    return _LoraChoice(full, lora, qlora, capacity, str(hw.gpu))


def _batch_sizes(job: str, hw: Hardware, big: bool, world: int) -> tuple[int, int]:
    """The micro-batch of one process and the global batch: about 64 sequences, whole micro-batches on every
    process, for RL whole groups of completions, and for the preference jobs pairs (two sequences each)."""
    per_sample = 2 if job in PAIR_JOBS else 1
    micro = (16 if not hw.is_gpu else (4 if big else 8)) // per_sample
    per_step = micro * world
    global_batch = per_step * max(1, math.ceil(64 / per_sample / per_step))
    if job in RL_JOBS:  # one step trains on prompts_per_step × group_size completions
        while global_batch % _GROUP_SIZE:
            global_batch += per_step
    return micro, global_batch


def _run_lines(p: _Plan) -> list[str]:
    """The header saying what to do with the file, and [run]."""
    return [
        "# Written by `prime-train init`. Check it with `prime-train lint` and `prime-train preflight`,",
        "# estimate memory with `prime-train memory` and cost with `prime-train cost`, then `prime-train run`.",
        "",
        "[run]",
        f'name = "{p.name}"',
        'output_dir = "runs"',
        "seed = 1234",
        f'job = "{run_job(p.a.job)}"',
        "",
    ]


def _model_lines(p: _Plan) -> list[str]:
    """[model]: the tiny model (for RL, the tiny SFT run's), or the named one with its size."""
    a = p.a
    lines = ["[model]"]
    if a.model == TINY and a.job in RL_JOBS:
        lines += [
            'path = "runs/tiny-sft/final"   # the tiny SFT run\'s model: RL from a random model has no reward to learn',
        ]
    elif a.model == TINY and a.job in PAIR_JOBS:
        lines += [
            'path = "runs/tiny-sft/final"   # the tiny SFT run\'s model: preferences refine a model that answers',
        ]
    elif a.model == TINY:
        lines += ["# a random-initialised Llama-shaped model with the built-in byte tokenizer: no download"]
    else:
        lines += [f'path = "{a.model}"']
        if p.params is not None:
            lines.append(f"# {p.params / 1e9:.2f}B parameters (from its config.json)")
        else:
            lines.append("# size unknown here (no local config.json): memory advice below is generic")
    if p.big:
        lines += [
            "activation_checkpointing = true   # recompute layer activations: models of 1B+ rarely fit without it"
        ]
    return lines


def _lora_lines(p: _Plan) -> list[str]:
    """[lora] when the whole model does not fit the GPUs but LoRA's adapters do (a note when neither does)."""
    c = p.lora
    if c is None:
        return []
    gib = 2**30
    shared = p.a.job in RL_JOBS and p.world == 1  # vLLM takes the rest of the one GPU
    where = f"the {c.capacity / gib:.0f} GiB {f'one {c.gpu} leaves the trainer' if shared else f'of one {c.gpu}'}"
    if not c.fits(c.lora) and not c.quantize:
        p.a.notes.append(
            f"full fine-tuning needs about {c.full / gib:.0f} GiB a GPU and LoRA (rank {LORA_RANK}) "
            f"{c.lora / gib:.0f} GiB, more than {where}: shard over more GPUs or nodes than {p.hw.count} × {c.gpu}"
        )
        return []
    lora_need = c.qlora if c.quantize and c.qlora is not None else c.lora
    p.a.notes.append(
        f"full fine-tuning needs about {c.full / gib:.0f} GiB a GPU, more than {where}: the config trains LoRA "
        f"adapters (rank {LORA_RANK}{', base in NF4' if c.quantize else ''}), about {lora_need / gib:.0f} GiB"
    )
    lines = [
        "",
        "[lora]",
        f"# full fine-tuning needs about {c.full / gib:.0f} GiB a GPU (`prime-train memory`), more than {where}:",
        f"# train LoRA adapters only, about {lora_need / gib:.0f} GiB; the base stays frozen, final/ holds the merged",
        "# model and final/adapter/ the adapter alone",
        f"rank = {LORA_RANK}   # adapters on every linear layer of the decoder blocks; alpha = 2 × rank",
    ]
    if c.quantize:
        lines.append("quantize = \"nf4\"   # QLoRA: the frozen base in 4 bits (CUDA; pip install 'prime-train[qlora]')")
    elif c.qlora is not None:
        lines.append(
            f'# quantize = "nf4"   # QLoRA: the frozen base in 4 bits, about {c.qlora / gib:.0f} GiB '
            "(CUDA; pip install 'prime-train[qlora]')"
        )
    return lines


def _data_lines(p: _Plan) -> list[str]:
    """[data]: the sequence length, and for the jobs that train on a dataset the dataset (a built-in task when none
    is given; for dpo and reward its preference pairs)."""
    a = p.a
    lines = ["", "[data]", f"seq_len = {p.seq_len}"]
    pairs = a.job in PAIR_JOBS
    if a.job not in RL_JOBS:
        if a.dataset:
            lines += ["[[data.datasets]]", f'path = "{a.dataset}"']
            if pairs:
                lines.append('format = "preference"   # records {prompt, chosen, rejected}: strings or chat messages')
        elif a.job == "meta":
            lines += [
                "# Reptile's tasks, one [[data.datasets]] each (built-in here; your datasets work the same way):",
                "[[data.datasets]]",
                'task = "arithmetic"',
                "[[data.datasets]]",
                'task = "sorting"',
            ]
        elif pairs:
            lines += [
                "# a built-in task's preference pairs so the config runs as is (chosen: the right answer, rejected:",
                "# a corrupted one); replace with your {prompt, chosen, rejected} records:",
                '# [[data.datasets]]  path = "data/pairs.jsonl"  format = "preference"',
                "[[data.datasets]]",
                'task = "reverse-text"',
            ]
        else:
            lines += [
                "# a built-in generated task so the config runs as is; replace with your data:",
                '# [[data.datasets]]  path = "data/*.parquet"   (or .jsonl / .txt; hub = "org/name" online)',
                "[[data.datasets]]",
                'task = "reverse-text"',
            ]
    return lines


# learning rates: the tiny model's, and a pretrained model's per job (full fine-tuning; LoRA takes 10×)
_TINY_LR = {"dpo": 1e-3, "reward": 1e-3}
_PRETRAINED_LR = {"rl": 1e-6, "ppo": 1e-6, "dpo": 5e-7}


def _meta_lines(p: _Plan) -> list[str]:
    """[meta] for a meta-learning job: Reptile's inner and outer steps, and the held-out task the eval adapts to."""
    if p.a.job != "meta":
        return []
    # with the built-in tasks, the third is held out: the eval adapts to it from the meta-learned weights
    held_out = [] if p.a.dataset else ['eval_task = "reverse-text"   # held out: the eval adapts to it']
    return [
        "",
        "[meta]",
        "inner_steps = 5   # fine-tuning steps on one task before the meta update",
        "inner_lr = 1e-3",
        "outer_lr = 1.0   # how far the weights move toward the adapted ones (scaled by train.scheduler)",
        "tasks_per_step = 1",
        *held_out,
    ]


def _dpo_lines(p: _Plan) -> list[str]:
    """[dpo] for a DPO job: beta, the loss, and where the reference comes from."""
    if p.a.job != "dpo":
        return []
    if _writes_lora(p):
        ref = "# with LoRA the reference is the base with the adapters switched off: no second copy either way"
    else:
        ref = "# the reference is a frozen copy of the starting weights, held beside the model (`prime-train memory`)"
    return [
        "",
        "[dpo]",
        "beta = 0.1   # how far the policy may move from the reference: higher keeps it closer",
        'loss_type = "sigmoid"   # DPO\'s loss; "ipo" and "hinge" are the others',
        ref,
        "precompute_reference = false   # true: its log-probs of every pair computed once before training, none held",
    ]


def _train_lines(p: _Plan) -> list[str]:
    """[train]: steps, batch sizes, learning rate and precision."""
    a = p.a
    max_steps = a.max_steps or (300 if a.model == TINY else 1000)
    precision = "bf16" if p.hw.bf16 else "fp32"
    lr = _TINY_LR.get(a.job, 3e-3) if a.model == TINY else _PRETRAINED_LR.get(a.job, 1e-5)
    lr_why = "tiny models learn fast" if a.model == TINY else "fine-tuning a pretrained model"
    if _writes_lora(p):
        lr, lr_why = lr * 10, "LoRA's adapters take about 10× the full fine-tuning rate"
    unit = "preference pairs (2 sequences each)" if a.job in PAIR_JOBS else "sequences"
    lines = [
        "",
        "[train]",
        f"max_steps = {max_steps}",
        f"global_batch_size = {p.global_batch}   # {unit} per optimizer step, over all {p.world} process(es)",
        f"micro_batch_size = {p.micro}   # per forward/backward; lower it first if memory runs out",
        f"lr = {lr:g}   # {lr_why}",
        f'precision = "{precision}"   # {_precision_why(p.hw)}',
    ]
    if a.job in RL_JOBS:
        lines += ['scheduler = "constant"', "warmup_steps = 0"]
    lines += ["eval_interval = 100" if a.model != TINY else "eval_interval = 50"]
    return lines


def _distributed_lines(p: _Plan) -> list[str]:
    """[distributed]: the strategy the model's size and the GPUs' memory call for, and the processes."""
    a, hw = p.a, p.hw
    lines = ["", "[distributed]"]
    lines.append(f'strategy = "{p.strategy}"   # {p.strategy_why}')
    if hw.is_gpu:
        lines.append(f"nproc_per_node = {p.trainer_gpus}")
    if a.nodes > 1:
        lines.append(f"nnodes = {a.nodes}   # rendezvous from SKYPILOT_NODE_IPS / SKYPILOT_NODE_RANK on SkyPilot")
    return lines


def _ckpt_lines(p: _Plan) -> list[str]:
    """[ckpt]: how often, how many kept, and with several nodes a directory they all mount."""
    interval = 50 if p.a.model == TINY else 200
    lines = [
        "",
        "[ckpt]",
        f"interval = {interval}",
        "keep_last = 3   # the newest whole checkpoint is never deleted",
    ]
    if p.a.nodes > 1:
        # DCP writes each rank's shards where it runs: with node-local disks no node would hold a whole checkpoint
        lines.append(
            f'dir = "~/prime-train-checkpoints/{p.name}"   # several nodes: a directory EVERY node mounts (NFS home, '
            "a shared volume or a bucket mount); change it to yours"
        )
    return lines


def _rl_lines(p: _Plan) -> list[str]:
    """[rl] and [inference] for an RL job (none for the others): the environment, the groups, the rollout workers."""
    a, hw = p.a, p.hw
    if a.job not in RL_JOBS:
        return []
    if a.environment not in ENVIRONMENTS and ":" not in a.environment:
        raise ValueError(
            f"environment {a.environment!r}: a built-in ({', '.join(ENVIRONMENTS)}), 'pkg.module:load_environment' "
            "or 'verifiers:<id>'"
        )
    model_len = min(p.max_len, 512 if a.model == TINY else 4096)
    lines = [
        "",
        "[rl]",
        f'environment = "{a.environment}"',
        f"prompts_per_step = {p.global_batch // _GROUP_SIZE}   # × group_size = train.global_batch_size",
        f"group_size = {_GROUP_SIZE}   # completions per prompt; "
        + ("PPO's advantages come from its value head" if a.job == "ppo" else
           "advantages are normalised within each group"),
        f"max_tokens = {16 if a.model == TINY else 1024}",
        "max_async_level = 1   # rollouts at most one step off-policy",
        *_ppo_lines(p),
        "",
        "[inference]",
    ]  # fmt: skip
    if not hw.is_gpu:
        lines += ['backend = "embedded"   # the CPU worker: same OpenAI-compatible HTTP as vLLM']
    elif p.world == 1:
        lines += [
            'backend = "vllm"',
            "colocate = true   # one GPU: vLLM and the trainer share it",
            "gpu_memory_utilization = 0.4   # leave the trainer the rest; `prime-train memory` refines the split",
        ]
    else:
        lines += [
            'backend = "vllm"',
            f"num_workers = {p.inference_gpus}   # {p.inference_gpus} of the {hw.count} GPUs a node has serve "
            f"rollouts, {p.trainer_gpus} train",
            "gpus_per_worker = 1",
        ]
    lines += [f"max_model_len = {model_len}   # prompt + max_tokens must fit: lint checks the token budget"]
    return lines


def _ppo_lines(p: _Plan) -> list[str]:
    """rl's PPO keys: the algorithm, GAE and the value loss; the KL penalty offered in a comment with what it holds."""
    if p.a.job != "ppo":
        return []
    held = "the base with the adapters off" if _writes_lora(p) else "a frozen copy of the starting weights, held"
    return [
        'algorithm = "ppo"   # a value head on the policy\'s trunk; GAE advantages per token',
        "gamma = 1.0   # no discount within a completion",
        "gae_lambda = 1.0   # 1: Monte Carlo returns (the whole reward on every token), 0: one-step TD",
        "value_clip = 0.2",
        "vf_coef = 0.1   # the value loss's weight beside the policy loss",
        f"# kl_coef = 0.05   # a KL penalty to the starting model ({held})",
    ]


def _supervisor_lines(p: _Plan) -> list[str]:
    """[supervisor] and [logging]."""
    return [
        "",
        "[supervisor]",
        "max_restarts = 3",
        "",
        "[logging]",
        f"log_interval = {10 if p.a.model == TINY else 20}",
    ]


def _writes_lora(p: _Plan) -> bool:
    """Whether the config gets a [lora] section (_lora_lines)."""
    c = p.lora
    return c is not None and (c.fits(c.lora) or c.quantize)


def _precision_why(hw: Hardware) -> str:
    if hw.bf16:
        return "bf16 autocast on GPUs"
    return f"the {hw.gpu} has no bf16: fp32" if hw.is_gpu else "the CPU trains in fp32"


def check_text(text: str, path: Path) -> list:
    """Every lint problem (errors and warnings) of the generated text, as `prime-train lint` reports them."""
    from prime_train.validator.lint import lint_files

    path.write_text(text)
    problems, _ = lint_files([str(path)], [])
    return problems
