"""Before you pay: `prime-train verify-model`, `models list`, `memory` and `cost`.

Bad sizes, GPU names, strategies and price files raise `MemoryInputError` (cost's `CostInputError` is one);
the CLI's error handler prints them and exits 78, a configuration error.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag, RunConfigFiles, load_run_config, require_engine, split_overrides
from prime_train.cli.errors import BAD_INPUT, CliError
from prime_train.contract import ExitCode

models_app = typer.Typer(help="The tested-model registry shipped with prime-train.", no_args_is_help=True)


def verify_model(
    model: Annotated[str, typer.Argument(help="HF model id, HF cache entry or local directory with config.json.")],
    job: Annotated[
        str, typer.Option(help="The job it is for: sft, pretrain, rl, ppo (rl with PPO), dpo or reward.")
    ] = "rl",
    gpu: Annotated[
        Optional[str], typer.Option(help="GPU type[:count] to train on, for the memory verdict; default: one H100.")
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Can this model be used, before you pay: architecture, vLLM support, size, memory, tool calling.

    Reads config.json (and tokenizer_config.json) from a directory, the HF cache, or the hub when
    online. Exit 0 when usable for the job, 1 when not, 78 (bad input) when its config cannot be found.
    When full fine-tuning does not fit the GPUs (--gpu), it says what LoRA (--lora.rank 16) needs.

    Examples:

      prime-train verify-model Qwen/Qwen2.5-7B-Instruct

      prime-train verify-model runs/tiny-sft/final --job sft --json

      prime-train verify-model meta-llama/Llama-3.1-8B-Instruct --job sft --gpu A100-80GB

      prime-train verify-model Qwen/Qwen2.5-7B-Instruct --job dpo --gpu H100:8
    """
    from prime_train.validator.models import render_report
    from prime_train.validator.models import verify_model as verify

    try:  # ModelConfigNotFound is bad input, printed (as JSON too with --json) by the error handler
        report = verify(model, job=job, gpu=gpu)
    except ValueError as exc:  # a job or a model name that names nothing
        raise CliError(exc, BAD_INPUT) from None
    output.emit(report, as_json, lambda console: render_report(report, console))
    raise typer.Exit(ExitCode.OK if report.ok else ExitCode.FAILED)


@models_app.command("list")
def models_list(as_json: JsonFlag = False) -> None:
    """Models with the vLLM and transformers versions they were checked against, and their known issues.

    Examples:

      prime-train models list

      prime-train models list --json
    """
    from prime_train.validator.registry import models_json, render_models

    output.emit(models_json(), as_json, render_models)


STRATEGY_HELP = (
    "none, ddp, zero1, zero2, zero3, fsdp or hsdp; unset: none, or with --tp-size/--pp-size what the engine's 'auto' "
    "runs (fsdp beside tp, replicated pipelines beside pp alone)."
)


def memory(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    model: Annotated[Optional[str], typer.Option(help="Without a config: HF id, directory or config.json.")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sequence.")] = None,
    micro_batch: Annotated[Optional[int], typer.Option(help="Sequences per forward/backward per GPU.")] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option(help="GPUs (trainer processes) per node.")] = None,
    nodes: Annotated[Optional[int], typer.Option(help="Nodes.")] = None,
    strategy: Annotated[Optional[str], typer.Option(help=STRATEGY_HELP)] = None,
    precision: Annotated[Optional[str], typer.Option(help="bf16, fp16 or fp32.")] = None,
    zero_stage: Annotated[
        Optional[int], typer.Option(help="The engine's ZeRO stage on FSDP2 (1, 2 or 3; with --strategy fsdp or hsdp).")
    ] = None,
    cpu_offload: Annotated[
        Optional[bool], typer.Option(help="FSDP2 CPU offload: sharded states in host memory (fsdp, hsdp, zero3).")
    ] = None,
    float8: Annotated[Optional[bool], typer.Option(help="torchao float8 linear layers (train.float8).")] = None,
    tp_size: Annotated[Optional[int], typer.Option(min=1, help="Tensor-parallel ranks (distributed.tp_size).")] = None,
    sequence_parallel: Annotated[Optional[bool], typer.Option(help="With --tp-size: split the norms too.")] = None,
    pp_size: Annotated[Optional[int], typer.Option(min=1, help="Pipeline stages (distributed.pp_size).")] = None,
    pp_schedule: Annotated[Optional[str], typer.Option(help="gpipe, 1f1b or interleaved_1f1b.")] = None,
    pp_microbatches: Annotated[Optional[int], typer.Option(min=1, help="Pipeline microbatches (default: pp).")] = None,
    optimizer: Annotated[Optional[str], typer.Option(help="adamw, adamw8bit or sgd.")] = None,
    checkpointing: Annotated[
        Optional[str], typer.Option(help="Activation checkpointing: none, selective, full.")
    ] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="vLLM: longest sequence (turns on inference).")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(help="vLLM: sequences batched at once.")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(help="vLLM: its share of the GPU.")] = None,
    colocate: Annotated[Optional[bool], typer.Option(help="Trainer and vLLM on the same GPU.")] = None,
    gpu: Annotated[Optional[list[str]], typer.Option(help="GPUs to give a verdict for (repeatable).")] = None,
    lora_rank: Annotated[
        Optional[int], typer.Option(min=0, help="LoRA: train adapters of this rank only, the base frozen (0: off).")
    ] = None,
    lora_quantize: Annotated[Optional[str], typer.Option(help="LoRA: none, or nf4 for a 4-bit base (QLoRA).")] = None,
    job: Annotated[
        Optional[str], typer.Option(help="sft, pretrain, rl, ppo (rl with PPO), dpo or reward; default: the config's.")
    ] = None,
    reference: Annotated[
        Optional[bool],
        typer.Option(
            "--reference/--no-reference",
            help="dpo and rl: hold a frozen copy of the starting weights (dpo: yes unless dpo.precompute_reference; "
            "rl: when rl.kl_coef > 0). LoRA never holds one.",
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Will it fit: per-GPU memory of the trainer (and vLLM), and a verdict for each common GPU.

    Weights, gradients and optimizer states by precision, optimizer and sharding strategy;
    activations by sequence length, micro-batch and checkpointing (Korthikanti et al. 2022); the
    KV cache of vLLM; a recommended split when both share one GPU. With LoRA ([lora], or
    --lora-rank) the base is frozen: only the adapters have gradients and optimizer states,
    and with nf4 the base's linear weights take 4 bits. dpo and reward hold two sequences (chosen
    and rejected) for each pair of the micro-batch; dpo adds its frozen reference, ppo a value head,
    reward a score head in place of lm_head. Every estimate ends with the ZeRO stages side by side
    (0 to 3, and 3 with CPU offload): per GPU as this engine runs them on FSDP2, and as DeepSpeed
    accounts them.

    Examples:

      prime-train memory configs/tiny-sft.toml

      prime-train memory --model Qwen/Qwen2.5-7B-Instruct --seq-len 4096 --gpus-per-node 8 --strategy fsdp

      prime-train memory --model meta-llama/Llama-3.1-8B --gpus-per-node 8 --strategy fsdp --zero-stage 2

      prime-train memory --model meta-llama/Llama-3.1-8B --gpus-per-node 8 --tp-size 2 --pp-size 2 --strategy fsdp

      prime-train memory configs/tiny-rl.toml --colocate --gpu H100 --json

      prime-train memory --model meta-llama/Llama-3.1-8B --seq-len 4096 --lora-rank 16 --gpu H100

      prime-train memory --model Qwen/Qwen2.5-7B-Instruct --job dpo --checkpointing full --gpu H100
    """
    from prime_train.validator.memory import estimate, inputs_from_config, inputs_from_flags, render_memory
    from prime_train.validator.memory_inputs import job_settings

    paths, overrides = split_overrides(files, ctx.args)
    flags = {
        "seq_len": seq_len, "micro_batch": micro_batch, "gpus_per_node": gpus_per_node, "num_nodes": nodes,
        "strategy": strategy, "precision": precision, "optimizer": optimizer, "zero_stage": zero_stage,
        "cpu_offload": cpu_offload, "float8": float8, "tp_size": tp_size, "sequence_parallel": sequence_parallel,
        "pp_size": pp_size, "pp_schedule": pp_schedule, "pp_microbatches": pp_microbatches,
        "activation_checkpointing": checkpointing, "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
        "gpu_memory_utilization": gpu_memory_utilization, "colocate": colocate, "gpus": gpu,
        "lora_rank": lora_rank, "lora_quantize": lora_quantize, "reference": reference,
        **(job_settings(job) if job is not None else {}),
    }  # fmt: skip
    flags = {k: v for k, v in flags.items() if v is not None}
    if paths or overrides or model is None:  # a config (the tiny default when none), flags on top
        cfg = load_run_config(files, ctx.args)
        inputs = inputs_from_config(cfg, **({"model": model} if model else {}), **flags)
    else:
        inputs = inputs_from_flags(model, **flags)
    report = estimate(inputs)
    output.emit(report, as_json, lambda console: render_memory(report, console))


def cost(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    gpu: Annotated[
        Optional[str], typer.Option(help="One GPU type, or type:count ('H100:8'); default: every priced GPU.")
    ] = None,
    num_gpus: Annotated[Optional[int], typer.Option(help="GPUs in all; default: from the config.")] = None,
    step_time: Annotated[Optional[float], typer.Option(help="Measured seconds per step on those GPUs.")] = None,
    measure: Annotated[
        bool, typer.Option("--measure", help="Measure the step time here with a short profile.")
    ] = False,
    mfu: Annotated[float, typer.Option(help="Model FLOPs utilisation assumed when estimating.")] = 0.4,
    prices: Annotated[Optional[Path], typer.Option(help="TOML/JSON file overriding the shipped prices.")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Steps; default: train.max_steps.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """What will it cost: steps × step time × GPU price, as a range, spot and on-demand side by side.

    The step time is estimated from FLOPs per token at a stated MFU, or given (--step-time), or
    measured on this machine's GPU by a short profile run (--measure: priced as that GPU; a machine
    without one is refused before anything runs). Prices come from a shipped, dated table that
    --prices can override.

    Examples:

      prime-train cost configs/tiny-sft.toml --gpu H100

      prime-train cost my-run.toml --gpu H100:8 --mfu 0.35 --prices my-prices.toml --json
    """
    from prime_train.validator.cost import (
        duration,
        estimate_cost,
        gpu_to_measure,
        local_gpu_names,
        measured_on_cpu_error,
        render_cost,
    )

    cfg = load_run_config(files, ctx.args)
    here = local_gpu_names()
    if measure:
        if step_time is not None:
            raise typer.BadParameter("--measure and --step-time exclude each other", param_hint="--measure")
        measured_gpu = gpu_to_measure(gpu, here)  # before measuring: which GPU the step time will price
        require_engine(cfg)
        from prime_train.resilience.profile import profile

        _, summary = profile(cfg, warmup=1, steps=3, console=output.console(stderr=True), preflight=False)
        if not str(summary.get("device", "")).startswith("cuda"):
            raise measured_on_cpu_error(str(summary.get("device")))
        step_time = summary["step_s"]
        gpu = measured_gpu.name
        output.say(f"measured {duration(step_time)} per step on {gpu} ({summary['device']})", stderr=True)
    report = estimate_cost(
        cfg, gpu=gpu, num_gpus=num_gpus, step_time_s=step_time, mfu=mfu,
        prices_file=str(prices) if prices else None, steps=steps, here_gpus=here,
    )  # fmt: skip
    output.emit(report, as_json, lambda console: render_cost(report, console))
