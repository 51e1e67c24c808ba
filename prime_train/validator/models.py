"""`prime-train verify-model`: will this model work for this job, answered from its config before any launch.

A model that vLLM cannot serve, a vision-language checkpoint picked for text RL, a chat template without tools
for a tool-calling environment, or a model too big for the GPUs is otherwise found after a long download and a
longer launch. Everything here reads JSON files (config.json, tokenizer_config.json, the chat template) and
never loads weights or imports torch: it runs on a laptop and in CI.

This module turns the facts into a verdict and prints it; the facts come from its neighbours:
model_files.py reads the files (local directory, HF cache or hub), param_count.py counts the parameters,
vllm_compat.py answers what vLLM serving asks (architecture, vision-language or not, tool-call parser),
and registry.py adds what is known of tested models.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

# ModelConfigNotFound is verify_model's error (raised by find_model_files): its callers import it from here
from prime_train.validator.model_files import ModelConfigNotFound, ModelFiles, find_model_files  # noqa: F401
from prime_train.validator.param_count import ParameterCount, count_adapters, count_model_parameters, text_config
from prime_train.validator.registry import lookup
from prime_train.validator.vllm_compat import (
    VllmSupport,
    installed_vllm_archs,
    is_multimodal,
    suggest_tool_parser,
    template_mentions_tools,
    text_only_advice,
    text_only_sibling,
    vllm_support,
)

# run.job's values, and "ppo" for the rl job with rl.algorithm = "ppo"
Job = Literal["sft", "rl", "pretrain", "ppo", "dpo", "reward", "meta"]
JOBS: tuple[str, ...] = ("sft", "rl", "pretrain", "ppo", "dpo", "reward", "meta")
RL_JOBS = ("rl", "ppo")  # rollouts from vLLM workers

# Full fine-tuning with AdamW in mixed precision: bf16 weights (2) + bf16 gradients (2) + fp32 master weights (4)
# + fp32 first and second moments (8). Activations, the KV cache and framework buffers come on top.
TRAIN_BYTES_PER_PARAM = 16
TRAIN_MEMORY_ASSUMPTION = (
    "16 bytes/parameter: full fine-tuning with AdamW in mixed precision (bf16 weights and gradients, fp32 master "
    "weights and two fp32 moments), before activations; sharding (FSDP) divides it across GPUs"
)
SERVE_MEMORY_ASSUMPTION = "weights only, in the dtype vLLM serves them; the KV cache and activations come on top"
# LoRA's offer when the full fine-tuning does not fit: adapters of this rank on every linear layer of the blocks
LORA_RANK = 16
LORA_MEMORY_ASSUMPTION = (
    f"LoRA rank {LORA_RANK} on every linear layer of the decoder blocks, on one GPU: the frozen base as the engine "
    "holds it (fp32, 4 bytes/parameter; QLoRA: its linear weights in NF4, about 0.52 bytes) and the adapters' weights, "
    "gradients and AdamW states (16 bytes/parameter), before activations"
)
DEFAULT_TRAIN_GPU = "H100"
# What the other jobs add to (or take from) the states above (validator/memory_breakdown.py counts them part by part)
REFERENCE_BYTES_PER_PARAM = 4  # DPO's frozen reference: the starting weights copied as the engine holds them, fp32
HEAD_BYTES_PER_PARAM = 16  # a head trained in full: weight, gradient, AdamW's two moments (fp32 master weights)
JOB_MEMORY_ASSUMPTIONS = {
    "dpo": "dpo: plus a frozen reference, a copy of the starting weights as the engine holds them (fp32, 4 bytes/"
    "parameter), whole on every GPU: it is copied before the model is sharded; none with LoRA (the base with the "
    "adapters off) or dpo.precompute_reference; each pair is two sequences, so activations double",
    "reward": "reward: an untied lm_head is dropped for a Linear(hidden, 1) score head trained in full (with LoRA "
    "too); each pair is two sequences, so activations double",
    "ppo": "ppo: plus a Linear(hidden, 1) value head trained in full (16 bytes/parameter)",
    "meta": "meta (Reptile): plus the inner loops' copy of the weights with its gradients and Adam's two moments, and "
    "the mean of the adapted weights (fp32, 4 + 4 + 8 + 4 bytes/parameter); the outer step is SGD, no moments",
}
# Reptile's inner copy (weights, gradients, Adam's moments, the mean of the adapted weights; fp32) and the outer SGD,
# which keeps no moments (the 8 bytes of AdamW's in TRAIN_BYTES_PER_PARAM)
META_INNER_BYTES_PER_PARAM = 20
META_OUTER_MOMENTS_BYTES_PER_PARAM = 8

DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float8_e4m3fn": 1, "float8": 1}
# MXFP4: 4-bit values plus one shared 8-bit exponent per block of 32.
MXFP4_BYTES_PER_PARAM = (4 + 8 / 32) / 8


# ---------------------------------------------------------------- the report


@dataclass
class ModelReport:
    """What verify-model found: the facts, then problems (not usable for the job) and warnings (look first)."""

    name: str
    job: str
    source: str
    model_id: str
    architecture: str | None
    model_type: str | None
    num_parameters: int | None  # None: config.json lacks what a count needs (the report says which field)
    active_parameters: int | None
    parameter_count_exact: bool
    parameter_parts: dict[str, int]
    vllm_supported: bool | None
    vllm_min_version: str | None
    vllm_source: str
    multimodal: bool
    text_only_sibling: str | None
    chat_template_tools: bool | None
    tool_call_parser: str | None
    max_model_len: int | None
    rope_scaling: dict[str, Any] | None
    dtype: str | None
    serve_dtype: str
    serve_memory_bytes: int | None
    train_memory_bytes: int | None
    known_issues: list[dict[str, Any]]
    tested: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # LoRA (rank LORA_RANK, all linear layers): what trains and the memory before activations, base in fp32 or NF4
    lora_trainable_parameters: int | None = None
    lora_train_memory_bytes: int | None = None
    qlora_train_memory_bytes: int | None = None
    train_gpu: dict[str, Any] | None = None  # the GPUs the training figures are held against, and the verdicts
    # what the job adds to full fine-tuning's states (dpo's reference, a head) or takes away (a reward model's lm_head)
    job_memory_parts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Usable for the job: no problem found (warnings do not count)."""
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        """The `--json` object: stable keys, JSON-native values."""
        data = asdict(self)
        tool_note = None
        for note in self.notes:
            if note.startswith("tool calling:"):
                tool_note = note.removeprefix("tool calling:").strip()
        data["tool_calling"] = {
            "chat_template_tools": data.pop("chat_template_tools"),
            "parser": data.pop("tool_call_parser"),
            "note": tool_note,
        }
        data["memory_assumptions"] = {
            "serve": SERVE_MEMORY_ASSUMPTION,
            "train": TRAIN_MEMORY_ASSUMPTION,
            "lora": LORA_MEMORY_ASSUMPTION,
            **({"job": JOB_MEMORY_ASSUMPTIONS[self.job]} if self.job in JOB_MEMORY_ASSUMPTIONS else {}),
        }
        data["ok"] = self.ok
        return data


def _dtype_of(hf: dict[str, Any], text: dict[str, Any]) -> str | None:
    for source in (hf, text):
        for key in ("dtype", "torch_dtype"):
            value = source.get(key)
            if isinstance(value, str):
                return value.removeprefix("torch.")
    return None


def serve_memory(count: ParameterCount, hf: dict[str, Any], dtype: str | None) -> tuple[int, str, list[str]]:
    """Bytes of weights vLLM loads, the dtype it serves in, and how the figure was made."""
    notes: list[str] = []
    serve_dtype = dtype or "bfloat16"
    if dtype is None:
        notes.append("config.json names no dtype: bfloat16 assumed")
    if serve_dtype in ("float32", "float"):
        serve_dtype = "bfloat16"  # vLLM's --dtype auto serves fp32 checkpoints in 16 bits
        notes.append("fp32 checkpoint: vLLM's --dtype auto serves it in 16 bits")
    base = DTYPE_BYTES.get(serve_dtype, 2)
    parts = count.parts
    quant = hf.get("quantization_config") if isinstance(hf.get("quantization_config"), dict) else None
    method = str((quant or {}).get("quant_method") or "").lower()
    if not method:
        return count.total * base, serve_dtype, notes
    if method == "mxfp4":
        experts = parts["experts"]
        total = experts * MXFP4_BYTES_PER_PARAM + (count.total - experts) * base
        notes.append("MXFP4 experts (4.25 bits per weight), the rest in 16 bits")
        return int(total), f"mxfp4 experts + {serve_dtype}", notes
    linear = parts["attention"] + parts["mlp"] + parts["experts"] + parts["shared_experts"]
    bits = 8 if method in ("fp8", "fbgemm_fp8") else int((quant or {}).get("bits") or 4)
    notes.append(f"{method} quantized: linear layers at {bits} bits, the rest in 16 bits (scales not counted)")
    return int(linear * bits / 8 + (count.total - linear) * base), f"{method} + {serve_dtype}", notes


@dataclass
class _Findings:
    """What the checks found, each list in the order they found it."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def verify_model(
    name_or_path: str, *, job: str = "rl", offline: bool | None = None, gpu: str | None = None
) -> ModelReport:
    """Read a model's config and answer: can this job use it, and what will it cost in memory?

    `gpu` ('H100', 'A100-80GB:4'; default one H100) is what the training memory is held against: when full
    fine-tuning's states do not fit it, the report offers LoRA with its figure (a warning: the model stays usable).

    Raises ModelConfigNotFound when config.json cannot be read (CLI exit 2). A config.json that lacks what a
    parameter count needs (an unknown architecture without intermediate_size, say) still gets its report: the
    architecture, vLLM support and templates, with the size and memory figures left out and a warning saying why.
    Never downloads weights.
    """
    if job not in JOBS:
        raise ValueError(f"job must be one of {', '.join(JOBS)}, not {job!r}")
    train_gpus = _train_gpus(gpu or DEFAULT_TRAIN_GPU)
    files = find_model_files(name_or_path, offline=offline)
    hf = files.config
    architectures = hf.get("architectures") or []
    architecture = str(architectures[0]) if architectures else None
    model_type = hf.get("model_type")
    found = _Findings()

    count = _parameter_count(hf, files.model_id, found)
    text = _text_fields(hf)
    dtype = _dtype_of(hf, text)
    serve_bytes: int | None = None
    serve_dtype = dtype or "bfloat16"
    if count is not None:
        serve_bytes, serve_dtype, serve_notes = serve_memory(count, hf, dtype)
        found.notes.extend(serve_notes)
    support = _vllm_serving(architecture, job, found)
    multimodal, sibling = _vision_language(hf, architecture, model_type, files.model_id, job, found)
    template_tools, parser = _tool_calling(files, job, found)
    max_len, rope = _context(text, found)
    tested = lookup(files.model_id)
    _versions(tested, support, found)
    job_parts = job_memory(hf, count.total, job) if count is not None else {}
    lora = _training_fit(count, hf, train_gpus, found, job_parts) if count is not None else {}

    return ModelReport(
        name=name_or_path,
        job=job,
        source=files.source,
        model_id=files.model_id,
        architecture=architecture,
        model_type=str(model_type) if model_type is not None else None,
        num_parameters=count.total if count else None,
        active_parameters=count.active if count and count.moe else None,
        parameter_count_exact=bool(count and count.exact),
        parameter_parts={k: v for k, v in count.parts.items() if v} if count else {},
        vllm_supported=support.supported,
        vllm_min_version=support.min_version,
        vllm_source=support.source,
        multimodal=multimodal,
        text_only_sibling=sibling,
        chat_template_tools=template_tools,
        tool_call_parser=parser,
        max_model_len=max_len,
        rope_scaling=rope,
        dtype=dtype,
        serve_dtype=serve_dtype,
        serve_memory_bytes=serve_bytes,
        train_memory_bytes=count.total * TRAIN_BYTES_PER_PARAM + sum(job_parts.values()) if count else None,
        known_issues=list((tested or {}).get("known_issues") or []),
        tested=tested,
        problems=found.problems,
        warnings=found.warnings,
        notes=found.notes,
        job_memory_parts=job_parts,
        **lora,
    )


def job_memory(hf: dict[str, Any], num_params: int, job: str) -> dict[str, int]:
    """Bytes the job adds to full fine-tuning's 16 B/param (negative: what it drops), by part (JOB_MEMORY_ASSUMPTIONS):
    dpo's reference, a reward model's score head in place of an untied lm_head, PPO's value head, Reptile's inner
    copy."""
    text = text_config(hf)
    h = int(text["hidden_size"])
    parts: dict[str, int] = {}
    if job == "dpo":
        parts["reference weights"] = num_params * REFERENCE_BYTES_PER_PARAM
    elif job == "reward":
        parts["score head"] = h * HEAD_BYTES_PER_PARAM
        if not text.get("tie_word_embeddings", True):
            parts["lm_head dropped"] = -int(text["vocab_size"]) * h * TRAIN_BYTES_PER_PARAM
    elif job == "ppo":
        parts["value head"] = (h + 1) * HEAD_BYTES_PER_PARAM
    elif job == "meta":
        parts["inner copy"] = num_params * META_INNER_BYTES_PER_PARAM
        parts["outer SGD: no moments"] = -num_params * META_OUTER_MOMENTS_BYTES_PER_PARAM
    return parts


def _train_gpus(gpu: str) -> tuple[Any, int]:
    """The GPU spec and count `gpu` ('H100', 'H100:8') names; ValueError for one the GPU table does not know."""
    from prime_train.config.accelerators import parse_accelerators
    from prime_train.validator.gpus import load_gpus
    from prime_train.validator.memory_inputs import MemoryInputError

    accelerators = parse_accelerators(gpu, what="--gpu")
    if accelerators.is_cpu:
        raise ValueError("--gpu names a GPU type, optionally with a count: 'H100' or 'H100:8'")
    n = accelerators.whole_count("training takes whole GPUs", what="--gpu")
    try:
        return load_gpus().find(accelerators.name), n
    except MemoryInputError as exc:
        raise ValueError(f"--gpu {gpu!r}: {exc}") from None


def _training_fit(
    count: ParameterCount, hf: dict[str, Any], gpus: tuple[Any, int], found: _Findings, job_parts: dict[str, int]
) -> dict[str, Any]:
    """The LoRA figures, and a warning offering LoRA when full fine-tuning's states (16 B/param, sharded over the
    GPUs, plus what the job adds: `job_parts`, whole on every GPU) do not fit one of the `gpus` (spec, count). With
    LoRA the job keeps its heads but holds no reference (the base with the adapters off is one)."""
    from prime_train.validator.memory_breakdown import NF4_BYTES_PER_PARAM

    spec, n = gpus
    ad = count_adapters(hf, LORA_RANK)
    heads = sum(v for k, v in job_parts.items() if k.endswith("head"))
    lora = count.total * 4 + ad.trainable * TRAIN_BYTES_PER_PARAM + heads
    qlora = (count.total - ad.linear_params) * 4 + ad.linear_params * NF4_BYTES_PER_PARAM
    qlora += ad.trainable * TRAIN_BYTES_PER_PARAM + heads
    dropped = job_parts.get("lm_head dropped", 0)
    full = (count.total * TRAIN_BYTES_PER_PARAM + dropped) / n + sum(job_parts.values()) - dropped
    cap = spec.memory_bytes
    verdict = {"gpu": spec.name, "count": n, "memory_bytes": cap, "full_fits": full <= cap, "lora_fits": lora <= cap,
               "qlora_fits": qlora <= cap}  # fmt: skip
    if full > cap:
        where = f"{n} × {spec.name}" if n > 1 else f"one {spec.name}"
        shard = f" sharded over {n} GPUs" if n > 1 else ""
        extra = " and dpo's reference" if "reference weights" in job_parts else ""
        offer = (
            f"full fine-tuning needs about {human_bytes(full)} a GPU before activations (16 B/param{shard}{extra}), "
            f"more than the {human_bytes(cap)} of {where}. LoRA trains adapters only: --lora.rank {LORA_RANK} "
            f"({ad.trainable:,} trainable) needs about {human_bytes(lora)} on one GPU"
        )
        if lora <= cap:
            offer += f", which fits (QLoRA, --lora.quantize nf4 on CUDA: about {human_bytes(qlora)})"
        elif qlora <= cap:
            offer += f"; with its base in 4 bits (QLoRA: --lora.quantize nf4, CUDA) {human_bytes(qlora)}, which fits"
        else:
            offer += f" (QLoRA about {human_bytes(qlora)}): neither fits; shard over more GPUs with fsdp"
        found.warnings.append(offer + "; `prime-train memory` adds the activations")
    return {
        "lora_trainable_parameters": ad.trainable,
        "lora_train_memory_bytes": int(lora),
        "qlora_train_memory_bytes": int(qlora),
        "train_gpu": verdict,
    }


def _parameter_count(hf: dict[str, Any], model_id: str, found: _Findings) -> ParameterCount | None:
    """The model's parameter count, or None (with a warning) when config.json lacks what a count needs."""
    try:
        count = count_model_parameters(hf)
    except (KeyError, TypeError, ValueError) as exc:
        missing = f"it lacks {exc}" if isinstance(exc, KeyError) else str(exc)
        found.warnings.append(
            f"parameter count unknown: config.json of {model_id} does not give what a count needs ({missing}; "
            "is it a transformers decoder?), so the size and memory figures are left out"
        )
        return None
    found.notes.extend(count.notes)
    if not count.exact:
        found.warnings.append("parameter count is an estimate: " + "; ".join(count.notes or ["family not mirrored"]))
    return count


def _vllm_serving(architecture: str | None, job: str, found: _Findings) -> VllmSupport:
    """Whether vLLM serves the architecture: a problem for RL, which needs it for rollouts; a note for the others."""
    support = vllm_support(architecture, installed=installed_vllm_archs())
    if support.detail and support.supported is not False:
        found.notes.append(f"vLLM: {support.detail}")
    if job in RL_JOBS:
        if support.supported is False:
            found.problems.append(
                f"vLLM does not serve {architecture} ({support.source}): {support.detail}; RL rollouts need a model "
                "vLLM can serve"
            )
        elif support.supported is None:
            found.warnings.append(f"vLLM support unknown: {support.detail}")
    elif support.supported is False:
        found.notes.append(f"vLLM does not serve {architecture}: fine for {job}, but it cannot be an RL policy")
    return support


def _vision_language(
    hf: dict[str, Any], architecture: str | None, model_type: Any, model_id: str, job: str, found: _Findings
) -> tuple[bool, str | None]:
    """Whether the model is vision-language (a problem for a text job), and its text-only sibling when one is known."""
    multimodal = is_multimodal(hf, architecture)
    sibling = text_only_sibling(model_id) if multimodal else None
    if multimodal:
        found.problems.append(
            f"{architecture} is a vision-language model, the wrong class for a text {job} job: "
            f"{text_only_advice(sibling, model_type)}; the vision tower costs memory and the training engine loads "
            "causal LMs"
        )
    return multimodal, sibling


def _tool_calling(files: ModelFiles, job: str, found: _Findings) -> tuple[bool, str | None]:
    """Whether the chat template renders tools and which vLLM tool-call parser fits; RL is warned of what is missing."""
    template_tools = template_mentions_tools(files.chat_template)
    parser, parser_note = suggest_tool_parser(files.config, files.model_id)
    if parser_note:
        found.notes.append(f"tool calling: {parser_note}")
    if files.tokenizer_config is None:
        found.warnings.append("no tokenizer_config.json found: the chat template could not be checked")
    elif job in RL_JOBS:
        if files.chat_template is None:
            found.warnings.append("the tokenizer has no chat template: chat environments cannot format prompts")
        elif not template_tools:
            found.warnings.append(
                "the chat template does not render `tools`: tool-calling environments will not work without a "
                "custom template"
            )
        elif parser is None:
            found.warnings.append("the template renders tools but no vLLM --tool-call-parser is known for this family")
    return template_tools, parser


def _context(text: dict[str, Any], found: _Findings) -> tuple[int | None, dict[str, Any] | None]:
    """The model's context length and rope scaling; a note on the positions YaRN stretches it to."""
    rope = text.get("rope_scaling") or text.get("rope_parameters")
    rope = rope if isinstance(rope, dict) and rope else None
    max_len = text.get("max_position_embeddings")
    max_len = int(max_len) if isinstance(max_len, int | float) and not isinstance(max_len, bool) else None
    if rope and str(rope.get("rope_type") or rope.get("type")) == "yarn" and rope.get("factor"):
        base = rope.get("original_max_position_embeddings") or max_len
        if base:
            found.notes.append(
                f"YaRN rope scaling: {int(base)} × {rope['factor']} = {int(base * rope['factor'])} positions"
            )
    return max_len, rope


def _versions(tested: dict[str, Any] | None, support: VllmSupport, found: _Findings) -> None:
    """The vLLM and transformers versions the registry names, and a warning when the installed vLLM is older than
    the architecture needs."""
    if tested and tested.get("vllm_version"):
        found.notes.append(
            f"registry: needs vLLM {tested['vllm_version']}, transformers {tested.get('transformers_version')}"
        )
    if support.installed_version and support.min_version and _older(support.installed_version, support.min_version):
        found.warnings.append(f"installed vllm {support.installed_version} is older than {support.min_version}")


def _text_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's fields (text_config of a VL model), or the config itself when they cannot be split."""
    try:
        return text_config(hf)
    except (KeyError, TypeError, ValueError):
        return hf


def _older(version: str, minimum: str) -> bool:
    def parts(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", v.split("+")[0])[:3])

    return parts(version) < parts(minimum)


# ---------------------------------------------------------------- output


def human_count(n: int | None) -> str:
    """7615616512 -> '7.62 B (7,615,616,512)'."""
    if n is None:
        return "-"
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6)):
        if n >= size:
            return f"{n / size:.2f} {unit} ({n:,})"
    return f"{n:,}"


def human_bytes(n: float | None) -> str:
    """Binary units, as GPU memory is sold and reported (nvidia-smi, torch)."""
    if n is None:
        return "unknown"
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


def render_report(report: ModelReport, console: Any) -> None:
    """A table of the facts, then problems, warnings and known issues, for a person deciding on a model."""
    from rich.markup import escape  # paths, ids and messages are text: "runs/[x]/final" keeps its "[x]"
    from rich.table import Table

    def yes_no(value: bool | None, unknown: str = "unknown") -> str:
        return unknown if value is None else ("yes" if value else "no")

    table = Table(title=escape(f"{report.model_id} for {report.job}"), show_header=False, title_justify="left")
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    table.add_row("source", escape(report.source))
    table.add_row("architecture", escape(f"{report.architecture or '-'} ({report.model_type or '-'})"))
    exactness = "" if report.parameter_count_exact or report.num_parameters is None else " ~est."
    count = "unknown" if report.num_parameters is None else human_count(report.num_parameters)
    table.add_row("parameters", escape(count + exactness))
    if report.active_parameters is not None:
        table.add_row("active per token", escape(human_count(report.active_parameters)))
    vllm = yes_no(report.vllm_supported)
    if report.vllm_min_version:
        vllm += f" (since {report.vllm_min_version})"
    table.add_row("vLLM serves it", escape(f"{vllm}  [{report.vllm_source}]"))
    multimodal = yes_no(report.multimodal)
    if report.text_only_sibling:
        multimodal += f" → text-only: {report.text_only_sibling}"
    table.add_row("vision-language", escape(multimodal))
    table.add_row("chat template has tools", escape(yes_no(report.chat_template_tools, "no template")))
    table.add_row("--tool-call-parser", escape(report.tool_call_parser or "-"))
    context = str(report.max_model_len or "-")
    if report.rope_scaling:
        kind = report.rope_scaling.get("rope_type") or report.rope_scaling.get("type")
        context += f" (rope scaling: {kind}, factor {report.rope_scaling.get('factor', '-')})"
    table.add_row("context (max_position_embeddings)", escape(context))
    table.add_row("dtype", escape(f"{report.dtype or 'not set'} (served as {report.serve_dtype})"))
    serve, train = report.serve_memory_bytes, report.train_memory_bytes
    table.add_row("memory to serve", escape(human_bytes(serve) + (" (weights only)" if serve is not None else "")))
    how = (
        " (16 B/param, full AdamW"
        + "".join(
            f"; {name} {'-' if b < 0 else '+'}{human_bytes(abs(b))}" for name, b in report.job_memory_parts.items()
        )
        + ")"
    )
    table.add_row("memory to train", escape(human_bytes(train) + (how if train is not None else "")))
    if report.lora_train_memory_bytes is not None and report.num_parameters:
        share = 100 * (report.lora_trainable_parameters or 0) / report.num_parameters
        table.add_row(
            f"with LoRA (rank {LORA_RANK})",
            escape(
                f"{human_bytes(report.lora_train_memory_bytes)} ({report.lora_trainable_parameters:,} trainable, "
                f"{share:.2f} %); QLoRA {human_bytes(report.qlora_train_memory_bytes)}"
            ),
        )
    tested = report.tested
    table.add_row(
        "registry", escape(f"{tested['model_id']} (checked {tested.get('tested_on')})" if tested else "not listed")
    )
    console.print(table)
    for note in report.notes:
        console.print(f"[dim]note: {escape(note)}[/dim]")
    for issue in report.known_issues:
        source = f" ({issue['source']})" if issue.get("source") else ""
        console.print(f"[cyan]known issue:[/cyan] {escape(str(issue.get('issue')) + source)}")
    for warning in report.warnings:
        console.print(f"[yellow]warning:[/yellow] {escape(warning)}")
    for problem in report.problems:
        console.print(f"[red]problem:[/red] {escape(problem)}")
    verdict = "[green]usable[/green]" if report.ok else "[red]not usable[/red]"
    console.print(f"{escape(report.model_id)}: {verdict} for {report.job}")
