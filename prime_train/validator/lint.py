"""`prime-train lint`: every mistake in a run config, with file, line, key and what to do.

Schema errors come from the loader; this module adds the cross-field checks that a single
field cannot know (batch arithmetic, intervals, retention with async saves, paths).
Imports stay light: lint runs on laptops and in pre-commit hooks without torch.
"""

from __future__ import annotations

import glob
import math
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from prime_train.config.loader import ConfigError, Problem, Sources, load_raw, names_dropped, validate_all
from prime_train.config.schema import Config
from prime_train.rl.budget import lint_problems as token_budget_problems
from prime_train.tasks import read_multiple_choice
from prime_train.validator import data_fields
from prime_train.validator.data_fields import DATA_SUFFIXES, TASK_FIELDS
from prime_train.validator.lora_checks import lora_problems
from prime_train.validator.memory_inputs import ROUTED_MODEL_TYPES, ROUTER_LOSS_JOBS
from prime_train.validator.method_checks import method_problems
from prime_train.validator.model_shape import model_shape
from prime_train.validator.param_count import split_config
from prime_train.validator.pipeline_checks import pipeline_problems
from prime_train.validator.precision_checks import precision_problems
from prime_train.validator.tp_checks import tp_problems


def data_parallel_size(cfg: Config) -> int:
    """Ranks that split the global batch: every process (DDP, FSDP and HSDP all shard the batch), except that the
    ranks of a tensor-parallel group (distributed.tp_size) or of a pipeline (distributed.pp_size) share theirs."""
    nproc = cfg.distributed.nproc_per_node or 1
    return max(1, nproc * cfg.distributed.nnodes // (cfg.distributed.tp_size * cfg.distributed.pp_size))


def _writable_dir(path: Path) -> str | None:
    """Why `path` cannot hold a run directory, or None when it can (created later if missing)."""
    probe = path
    while not os.path.lexists(probe):
        if probe.parent == probe:
            return f"no existing parent of {path}"
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        # root passes os.access on pseudo-filesystems (/proc, /sys) where it still cannot create a
        # directory: try it (the probe directory is removed at once)
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".prime-train-lint-", dir=probe))
        except OSError as exc:
            return f"cannot create a directory in {probe} ({exc.strerror})"
    return None


def _resolve(path: str) -> str:
    """Relative data paths are read from the working directory, as the trainer will."""
    return os.path.expanduser(path)


# Entries looked at below a data directory before lint stops searching (and leaves the directory to the engine).
MAX_DATA_SCAN = 100_000

# the jobs whose data is packed rows: data.curriculum and data.document_masking act on those rows only
PACKED_ROW_JOBS = ("sft", "pretrain")


def _data_files_problem(path: str) -> str | None:
    """Why a dataset `path` gives the engine no data file, or None: the same rule as engine/records.py
    expand_local_path (a file of a known type, a directory or glob holding one), stopping at the first found."""
    where = f"{path!r}"
    expanded = _resolve(path)
    if any(ch in expanded for ch in "*?["):
        matches = (p for p in glob.iglob(expanded, recursive=True) if p.endswith(DATA_SUFFIXES) and os.path.isfile(p))
        if next(matches, None) is None:
            found = next(glob.iglob(expanded, recursive=True), None)
            if found is None:
                return f"{where} does not exist; check the path (relative paths are read from the directory you run in)"
            return f"{where} matches no {', '.join(DATA_SUFFIXES)} file"
        return None
    if os.path.isdir(expanded):
        seen = 0
        for _, _, names in os.walk(expanded):
            for name in names:
                if name[0] != "." and name.endswith(DATA_SUFFIXES):
                    return None
            seen += len(names)
            if seen > MAX_DATA_SCAN:
                return None
        return f"{where} is a directory with no {', '.join(DATA_SUFFIXES)} file in it"
    if os.path.isfile(expanded):
        return None if expanded.endswith(DATA_SUFFIXES) else f"{where}: use {', '.join(DATA_SUFFIXES)} files"
    return f"{where} does not exist; check the path (relative paths are read from the directory you run in)"


def _masking(cfg: Config) -> Callable[[str], str]:
    """A function that masks secrets in a message (this environment's credentials, the config's secret values,
    in any escaped form, and the known token shapes), built on its first use: most configs need none."""
    redactor = None

    def shown(message: str) -> str:
        nonlocal redactor
        if redactor is None:
            from prime_train.kit.redact import Redactor

            redactor = Redactor.for_run(cfg)
        return redactor(message)

    return shown


def _resume_problem(resume: str) -> str | None:
    """Why ckpt.resume (a path) names no whole checkpoint, or None: a step-N directory holding DCP's .metadata,
    what the engine resumes from (engine/checkpoint.py)."""
    path = Path(_resolve(resume))
    # os.path's checks, not Path's: they answer False for any OSError (a name too long, a NUL byte)
    if not os.path.isdir(path):
        return "is neither 'auto', 'never' nor an existing checkpoint directory"
    if not re.fullmatch(r"step-\d+", path.name):
        return "is not a whole checkpoint: its name is not step-N (point it at a step-N directory, or use 'auto')"
    if not os.path.isfile(path / ".metadata"):
        return "has no DCP .metadata file: the save never finished; point it at a whole step-N or use 'auto'"
    return None


def check_config(cfg: Config, sources: Sources, *, spot: bool = False) -> list[Problem]:
    """Cross-field checks on a valid config; SkyPilot's limits too when it has a [spot] table or `spot` is set."""
    rules = (
        _batch_problems,
        _schedule_problems,
        _keep_and_resume_problems,
        _judging_problems,
        _curriculum_problems,
        _data_problems,
        _context_problems,
        _output_dir_problems,
        _model_and_run_dir_problems,
        _distributed_problems,
        precision_problems,
        method_problems,
        _checkpoint_dir_problems,
        _supervisor_problems,
        _job_command_problems,
        _eval_environment_problems,
        _inference_port_problems,
        _job_progress_problems,
        _vllm_model_problems,
        _attention_problems,
        _router_loss_problems,
        _preference_problems,
        token_budget_problems,
        tp_problems,
        pipeline_problems,
    )
    problems = [problem for rule in rules for problem in rule(cfg, sources)]
    spot = spot or "spot" in cfg.model_fields_set  # a [spot] table: this config is meant for `run --spot`
    problems.extend(lora_problems(cfg, sources, spot=spot))
    if spot:
        problems.extend(spot_problems(cfg, sources))
    return problems


def _batch_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """The global batch splits into whole micro-batches on every rank, and a batch-size ramp is whole and grows."""
    problems = []
    t = cfg.train
    dp = data_parallel_size(cfg)
    per_step = t.micro_batch_size * dp
    if t.global_batch_size % per_step:
        lower = max(per_step, (t.global_batch_size // per_step) * per_step)
        problems.append(
            sources.problem(
                ("train", "global_batch_size"),
                "error",
                f"train.global_batch_size ({t.global_batch_size}) is not a multiple of micro_batch_size × "
                f"data-parallel size ({t.micro_batch_size} × {dp} = {per_step}); use {lower} or "
                f"{lower + per_step}, or change train.micro_batch_size",
            )
        )
    if t.batch_ramp_start is not None and t.batch_ramp_start > t.global_batch_size:
        problems.append(
            sources.problem(
                ("train", "batch_ramp_start"),
                "error",
                f"train.batch_ramp_start ({t.batch_ramp_start}) is above train.global_batch_size "
                f"({t.global_batch_size}); a ramp grows towards the global batch",
            )
        )
    if (t.batch_ramp_start is None) != (t.batch_ramp_tokens is None):
        missing = "batch_ramp_tokens" if t.batch_ramp_tokens is None else "batch_ramp_start"
        problems.append(
            sources.problem(
                ("train", missing),
                "error",
                f"a batch-size ramp needs both train.batch_ramp_start and train.batch_ramp_tokens; set train.{missing}",
            )
        )
    return problems


def _schedule_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """Warmup, evaluation and checkpoints each happen within train.max_steps."""
    problems = []
    t, ck = cfg.train, cfg.ckpt
    if t.warmup_steps >= t.max_steps and t.scheduler != "constant":
        problems.append(
            sources.problem(
                ("train", "warmup_steps"),
                "warning",
                f"train.warmup_steps ({t.warmup_steps}) ≥ train.max_steps ({t.max_steps}): the run never "
                "leaves warmup; lower warmup_steps",
            )
        )
    if t.eval_interval > t.max_steps:
        problems.append(
            sources.problem(
                ("train", "eval_interval"),
                "warning",
                f"train.eval_interval ({t.eval_interval}) is beyond train.max_steps ({t.max_steps}): "
                "no evaluation will run; lower it",
            )
        )
    if ck.interval > t.max_steps:
        problems.append(
            sources.problem(
                ("ckpt", "interval"),
                "warning",
                f"ckpt.interval ({ck.interval}) is beyond train.max_steps ({t.max_steps}): no checkpoint "
                "before the end, so a crash loses the whole run; lower it",
            )
        )
    return problems


def _keep_and_resume_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """Async saves keep a whole checkpoint while the next is written, and ckpt.resume names a whole one."""
    problems = []
    ck = cfg.ckpt
    if ck.async_save and ck.keep_last == 1:
        problems.append(
            sources.problem(
                ("ckpt", "keep_last"),
                "error",
                "ckpt.keep_last = 1 with ckpt.async_save: the only whole checkpoint would be deleted while "
                "the next is still being written; use keep_last ≥ 2 or async_save = false",
            )
        )
    if ck.async_writer == "process" and not ck.async_save:
        problems.append(
            sources.problem(
                ("ckpt", "async_writer"),
                "warning",
                "ckpt.async_writer = 'process' writes async saves, and ckpt.async_save is false: every save is "
                "synchronous, in the trainer; set ckpt.async_save = true or leave async_writer out",
            )
        )
    if ck.resume not in ("auto", "never"):
        why = _resume_problem(ck.resume)
        if why:
            problems.append(sources.problem(("ckpt", "resume"), "error", f"ckpt.resume {ck.resume!r} {why}"))
    return problems


def _judging_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """Early stopping and the best checkpoint judge evaluations: there must be some before the last step."""
    problems = []
    tr = cfg.train
    judged = [
        (("train", "early_stopping", "metric"), "train.early_stopping never ends the run early"),
        (("ckpt", "keep_best", "metric"), "ckpt.keep_best keeps the last step's checkpoint only"),
    ]
    for key, effect in judged:
        section = tr.early_stopping if key[0] == "train" else cfg.ckpt.keep_best
        # (an eval_interval beyond max_steps has its own warning above)
        if section.metric and tr.eval_interval == tr.max_steps:
            problems.append(
                sources.problem(
                    key,
                    "warning",
                    f"train.eval_interval = {tr.eval_interval} evaluates only at the last step "
                    f"(train.max_steps = {tr.max_steps}): {effect}; lower train.eval_interval",
                )
            )
    if cfg.ckpt.keep_best.export and not cfg.ckpt.keep_best.metric:
        problems.append(
            sources.problem(
                ("ckpt", "keep_best", "export"),
                "warning",
                "ckpt.keep_best.export without ckpt.keep_best.metric does nothing",
            )
        )
    return problems


def _curriculum_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """data.curriculum orders the sft and pretrain jobs' data held in memory; 'difficulty' needs a number per record
    or a built-in task."""
    data, found = cfg.data, []
    if data.curriculum != "none" and cfg.run.job not in PACKED_ROW_JOBS:
        # the rl job samples an environment's prompts; dpo, reward and meta read pairs or tasks, not packed rows.
        # The one mistake: what the curriculum would need of data it never orders is beside the point
        why = (
            f"data.curriculum = {data.curriculum!r} orders the packed rows of the sft and pretrain jobs; the "
            f"{cfg.run.job} job reads its data another way and would ignore it: set data.curriculum = 'none'"
        )
        return [sources.problem(("data", "curriculum"), "error", why)]
    if data.curriculum != "none" and data.streaming:
        why = "data.curriculum needs data that fits in memory: set data.streaming = false or data.curriculum = 'none'"
        found.append((("data", "curriculum"), "error", why))
    untasked = [i for i, ds in enumerate(data.datasets) if ds.task is None]
    if data.curriculum == "difficulty" and data.difficulty_field is None and untasked:
        why = (
            "data.curriculum = 'difficulty' needs data.difficulty_field (a numeric field of each record) for "
            f"data.datasets[{untasked[0]}], which is not a built-in task; or use data.curriculum = 'length'"
        )
        found.append((("data", "curriculum"), "error", why))
    if data.curriculum == "self_paced":
        found += _self_paced_problems(cfg)
    if data.curriculum_steps is not None and data.curriculum_steps > cfg.train.max_steps:
        why = (
            f"data.curriculum_steps = {data.curriculum_steps} is beyond train.max_steps = {cfg.train.max_steps}: "
            "the run ends before it sees all of its data"
        )
        found.append((("data", "curriculum_steps"), "warning", why))
    return [sources.problem(key, severity, why) for key, severity, why in found]


def _self_paced_problems(cfg: Config) -> list[tuple[tuple[str, ...], str, str]]:
    """'self_paced' scores rows by the losses of the sft/pretrain step's own forward, read in the training process."""
    found = []
    if cfg.distributed.pp_size > 1:
        why = (
            "data.curriculum = 'self_paced' needs each row's loss on every rank, which a pipeline's last stage alone "
            "has: use 'length' or 'difficulty' with distributed.pp_size > 1"
        )
        found.append((("data", "curriculum"), "error", why))
    if cfg.data.num_workers:
        why = (
            "data.curriculum = 'self_paced' draws batches in the training process from scores that change every "
            f"step: set data.num_workers = 0, not {cfg.data.num_workers}"
        )
        found.append((("data", "num_workers"), "error", why))
    return found


def _data_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """data.sampling_probs fit the datasets; each dataset and train.mc_eval_path hold what the engine will read."""
    problems = []
    d = cfg.data
    if not d.document_masking and cfg.run.job not in PACKED_ROW_JOBS:
        why = (
            "data.document_masking = false makes each packed row of the sft and pretrain jobs one stream; the "
            f"{cfg.run.job} job reads its data another way and would ignore it: remove the key"
        )
        problems.append(sources.problem(("data", "document_masking"), "error", why))
    if d.sampling_probs is not None:
        if len(d.sampling_probs) != len(d.datasets):
            problems.append(
                sources.problem(
                    ("data", "sampling_probs"),
                    "error",
                    f"data.sampling_probs has {len(d.sampling_probs)} values for {len(d.datasets)} datasets; "
                    "give one probability per [[data.datasets]]",
                )
            )
        elif any(p < 0 for p in d.sampling_probs) or not math.isclose(sum(d.sampling_probs), 1.0, abs_tol=1e-6):
            problems.append(
                sources.problem(
                    ("data", "sampling_probs"),
                    "error",
                    f"data.sampling_probs must be non-negative and sum to 1 (they sum to {sum(d.sampling_probs):g})",
                )
            )
    shown = _masking(cfg)  # a dataset path can hold a credential (a token in a URL, a key in a folder's name)
    for i, ds in enumerate(d.datasets):
        why = _data_files_problem(ds.path) if ds.path is not None else None
        if why:
            message = shown(f"data.datasets[{i}].path {why}")
            problems.append(sources.problem(("data", "datasets", i, "path"), "error", message))
        found = None
        if ds.task is not None:  # a built-in task's records: their fields are fixed (a preference job pairs them)
            if cfg.run.job not in data_fields.PREFERENCE_JOBS:
                found = data_fields.format_problem(ds, dict.fromkeys(TASK_FIELDS, ""), f"task {ds.task!r}'s records")
        elif ds.path is not None and not why and (first := data_fields.first_data_file(_resolve(ds.path))):
            record = data_fields.first_record(first, ds.text_field)  # None: the engine names what is wrong there
            found = record and data_fields.format_problem(ds, record[1], record[0])
        if found:
            key, why = found
            message = shown(f"data.datasets[{i}].{key} {why}")
            problems.append(sources.problem(("data", "datasets", i, key), "error", message))
    if cfg.train.mc_eval_path is not None:
        if not os.path.isfile(_resolve(cfg.train.mc_eval_path)):
            message = shown(f"train.mc_eval_path {cfg.train.mc_eval_path!r} is not a file")
            problems.append(sources.problem(("train", "mc_eval_path"), "error", message))
        else:
            try:
                read_multiple_choice(_resolve(cfg.train.mc_eval_path), limit=500)
            except ValueError as exc:
                problems.append(
                    sources.problem(("train", "mc_eval_path"), "error", shown(f"train.mc_eval_path: {exc}"))
                )
    return problems


def _preference_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """Preference records go with the dpo and reward jobs and those jobs with them (or a built-in task, which gives
    pairs); every pair of a preference .jsonl is whole and prefers something (file:line of the first that is not)."""
    if cfg.job.command:
        return []
    job, problems = cfg.run.job, []
    shown = _masking(cfg)
    for i, ds in enumerate(cfg.data.datasets):
        if ds.task is not None:
            continue
        fmt = ds.format
        first = data_fields.first_data_file(_resolve(ds.path)) if ds.path is not None else None
        if fmt == "auto" and first is not None and (record := data_fields.first_record(first, ds.text_field)):
            fmt = data_fields.record_format(ds, record[1]) or "auto"
        key = ("data", "datasets", i, "format")
        if fmt == "preference" and job not in data_fields.PREFERENCE_JOBS:
            why = "holds preference records" if ds.format == "auto" else "= 'preference'"
            message = (
                f"data.datasets[{i}] {why}, which train run.job 'dpo' or 'reward', not run.job {job!r}; set run.job, "
                "or give the records this job reads"
            )
            problems.append(sources.problem(key, "error", shown(message)))
        elif job in data_fields.PREFERENCE_JOBS and fmt not in ("preference", "auto"):
            message = (
                f"data.datasets[{i}].format reads {fmt!r} records, but run.job {job!r} trains on preference pairs: "
                f"give {{{ds.prompt_field}, {ds.chosen_field}, {ds.rejected_field}}} records (format 'preference' or "
                "'auto') or a built-in task (data.datasets[].task)"
            )
            problems.append(sources.problem(key, "error", shown(message)))
        elif (
            job in data_fields.PREFERENCE_JOBS
            and first is not None
            and (found := data_fields.preference_problem(ds, _resolve(ds.path or "")))
        ):
            name, why = found
            message = shown(f"data.datasets[{i}].{name} {why}")
            problems.append(sources.problem(("data", "datasets", i, name), "error", message))
    return problems


def _context_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """A random-initialised model's context holds data.seq_len."""
    d, m = cfg.data, cfg.model
    if m.path is None and d.seq_len > m.max_position_embeddings:
        return [
            sources.problem(
                ("data", "seq_len"),
                "error",
                f"data.seq_len ({d.seq_len}) exceeds model.max_position_embeddings ({m.max_position_embeddings}); "
                "shorten the sequences or enlarge the model's context",
            )
        ]
    return []


def _output_dir_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """run.output_dir can hold the run directory."""
    why = _writable_dir(Path(os.path.expanduser(cfg.run.output_dir)))
    if why:
        return [
            sources.problem(("run", "output_dir"), "error", f"run.output_dir cannot be written: {why}; choose another")
        ]
    return []


def _model_and_run_dir_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """model.path and the run directory apart: the run writes checkpoints, logs and final/ into its directory (and
    --fresh moves its old outputs aside), so a model inside it would change under the run (final/ is replaced at the
    end, and a LoRA resume rebuilds its frozen base from model.path), and a run directory inside the model's directory
    writes all that among the model's files."""
    path = cfg.model.path
    if path is None or cfg.job.command:
        return []
    if not cfg.model.local_path:  # a hub id
        return []
    model = Path(os.path.expanduser(path)).resolve()
    run_dir = Path(os.path.expanduser(cfg.run_dir)).resolve()
    if model == run_dir or run_dir in model.parents:
        where = "is this run's directory" if model == run_dir else f"is inside this run's directory {cfg.run_dir}"
        why = (
            f"model.path = {path!r} {where}: the run writes its checkpoints and final/ there (final/ is replaced at "
            "the end, --fresh moves the outputs aside, a LoRA resume rebuilds its base from model.path), so the model "
            "it starts from would change under it; copy the model out of the run directory, or use another run.name"
        )
        return [sources.problem(("model", "path"), "error", why)]
    if model in run_dir.parents:
        why = (
            f"the run directory {cfg.run_dir} is inside model.path = {path!r}: the run would write its checkpoints, "
            "logs and exports among the model's files; set run.output_dir outside the model's directory"
        )
        return [sources.problem(("run", "output_dir"), "error", why)]
    return []


def _distributed_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """The strategy suits the number of processes, and HSDP's shard size divides it."""
    problems = []
    dist, dp = cfg.distributed, data_parallel_size(cfg)
    if dist.strategy == "none" and dp > 1:
        problems.append(
            sources.problem(
                ("distributed", "strategy"),
                "error",
                f"distributed.strategy = 'none' with {dp} processes: each would train alone; use 'ddp' or 'fsdp'",
            )
        )
    if dist.strategy == "hsdp" and dist.hsdp_shard_size and dp % dist.hsdp_shard_size:
        problems.append(
            sources.problem(
                ("distributed", "hsdp_shard_size"),
                "error",
                f"distributed.hsdp_shard_size ({dist.hsdp_shard_size}) must divide the world size ({dp})",
            )
        )
    return problems


def _supervisor_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """The restart backoff grows, never shrinks."""
    sup = cfg.supervisor
    if sup.backoff_max_s < sup.backoff_initial_s:
        return [
            sources.problem(
                ("supervisor", "backoff_max_s"),
                "warning",
                f"supervisor.backoff_max_s ({sup.backoff_max_s}) is below backoff_initial_s ({sup.backoff_initial_s})",
            )
        ]
    return []


def _eval_environment_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """train.eval_environment loads, as the SFT job will load it."""
    if not cfg.train.eval_environment or cfg.job.command:
        return []
    from prime_train.environments import load_environment

    try:  # as the SFT job loads it (engine/train.py), which otherwise refuses it only after start-up
        load_environment(cfg.train.eval_environment, {})
    except (ValueError, ImportError) as exc:
        message = str(exc).replace("rl.environment = ", "", 1)
        return [sources.problem(("train", "eval_environment"), "error", f"train.eval_environment: {message}")]
    return []


def _inference_port_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """Every inference worker's port is a port."""
    inf = cfg.inference
    if inf.base_port + inf.num_workers - 1 > 65535:
        return [
            sources.problem(
                ("inference", "base_port"),
                "error",
                f"inference.base_port ({inf.base_port}) + {inf.num_workers} workers reaches port "
                f"{inf.base_port + inf.num_workers - 1}, past 65535 (worker i listens on base_port + i); "
                f"use a base_port of at most {65536 - inf.num_workers}",
            )
        ]
    return []


def _job_progress_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """An external job.command says how it reports progress, so hangs can be detected."""
    if cfg.job.command is not None and cfg.job.progress_file is None and cfg.job.progress_regex is None:
        return [
            sources.problem(
                ("job", "command"),
                "warning",
                "job.command has neither job.progress_file nor job.progress_regex: hangs cannot be detected; set one",
            )
        ]
    return []


def _vllm_model_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """RL on vLLM has a model vLLM can load (model.path), not a random-initialised one."""
    if cfg.run.job == "rl" and cfg.inference.backend == "vllm" and cfg.model.path is None and not cfg.job.command:
        return [
            sources.problem(
                ("inference", "backend"),
                "error",
                "inference.backend = 'vllm' serves a model directory or hub id, but model.path is unset (a "
                "random-initialised model exists only inside the trainer): set model.path, or use 'embedded'",
            )
        ]
    return []


# transformers families that refuse SDPA attention (`_supports_sdpa = False`): Gemma 2 soft-caps its attention logits
SDPA_REFUSED_MODEL_TYPES = ("gemma2",)


def _attention_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """A model transformers will not load under SDPA, named before the trainer starts (its shape read locally)."""
    if cfg.model.attn_implementation != "sdpa" or cfg.model.path is None or cfg.job.command:
        return []
    hf, _ = model_shape(cfg)
    if not isinstance(hf, dict):
        return []
    _, text_type, _ = split_config(hf)  # the language model's type, a vision-language config's too
    if text_type not in SDPA_REFUSED_MODEL_TYPES:
        return []
    return [
        sources.problem(
            ("model", "attn_implementation"),
            "error",
            f"model.attn_implementation = 'sdpa': transformers does not run {text_type!r} models with SDPA "
            "(their attention logits are soft-capped); set model.attn_implementation = 'eager'",
        )
    ]


def _router_loss_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """model.router_aux_loss_coef where the trainer would refuse it: a job without a token loss, a model without a
    router (its type read locally)."""
    coef = cfg.model.router_aux_loss_coef
    if not coef or cfg.job.command:
        return []
    why = None
    if cfg.run.job not in ROUTER_LOSS_JOBS:
        why = f"the {cfg.run.job} job's objective does not take it ({', '.join(ROUTER_LOSS_JOBS)} do)"
    elif cfg.model.path is None:
        why = "a random-initialised model (model.arch) has no router"
    else:
        hf, _ = model_shape(cfg)
        model_type = hf.get("model_type") if isinstance(hf, dict) else None
        if model_type is not None and model_type not in ROUTED_MODEL_TYPES:
            why = f"{model_type!r} is not an MoE whose router loss the engine adds ({', '.join(ROUTED_MODEL_TYPES)})"
    if why is None:
        return []
    return [sources.problem(("model", "router_aux_loss_coef"), "error", f"model.router_aux_loss_coef = {coef}: {why}")]


def _checkpoint_dir_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """Where checkpoints go with several nodes: DCP writes each rank's shards where that rank runs and the metadata on
    rank 0 only, so checkpoints in each node's run directory (a node-local disk) are never whole on any node."""
    ck, nnodes = cfg.ckpt, cfg.distributed.nnodes
    if not ck.dir:  # unset, or "": the run directory's checkpoints/, as the engine reads it
        if nnodes > 1 and not cfg.job.command:
            # ckpt.remote does not help: each node's supervisor would upload its own run directory's checkpoints/,
            # which hold that node's ranks' shards only (the engine's start-up probe stops such a run with 78)
            also = " (ckpt.remote uploads what the node holds, so it does not help)" if ck.remote else ""
            return [
                sources.problem(
                    ("distributed", "nnodes"),
                    "error",
                    f"distributed.nnodes = {nnodes} with checkpoints in each node's run directory{also}: every rank "
                    "writes its shards where it runs and rank 0 the metadata, so no node would hold a whole "
                    "checkpoint; set ckpt.dir to a directory every node mounts (NFS, a shared volume), outside "
                    "run.output_dir",
                )
            ]
        return []
    problems = []
    shared = Path(os.path.abspath(os.path.expanduser(ck.dir)))
    run_dir = Path(os.path.abspath(os.path.expanduser(cfg.run_dir)))
    if nnodes > 1 and (shared == run_dir or run_dir in shared.parents):
        problems.append(
            sources.problem(
                ("ckpt", "dir"),
                "error",
                f"ckpt.dir = {ck.dir!r} is inside the run directory {cfg.run_dir}, which is each node's own with "
                f"distributed.nnodes = {nnodes}: choose a directory every node mounts, outside run.output_dir",
            )
        )
    elif cfg.spot.ckpt_mount is None and (why := _writable_dir(shared)):  # a mount point is on the nodes, not here
        problems.append(sources.problem(("ckpt", "dir"), "error", f"ckpt.dir cannot be written: {why}; choose another"))
    if ck.remote is not None:
        problems.append(
            sources.problem(
                ("ckpt", "remote"),
                "error",
                "ckpt.remote uploads the run directory's checkpoints/, but ckpt.dir puts them elsewhere: nothing "
                "would be uploaded; unset one of them",
            )
        )
    return problems


def _job_command_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """job.cwd is a directory and job.command's program exists and runs, found as subprocess will find it: a
    relative path from job.cwd, a bare name on the job's PATH (job.env's, else this one); no `~` expansion."""
    job = cfg.job
    if not job.command:
        return []
    problems = []
    cwd_ok = job.cwd is None or os.path.isdir(job.cwd)
    if not cwd_ok:
        tilde = " (a `~` is not expanded here: write the full path)" if job.cwd.startswith("~") else ""
        problems.append(
            sources.problem(
                ("job", "cwd"),
                "error",
                f"job.cwd {job.cwd!r} is not a directory{tilde}; create it or fix the path (relative paths are "
                "from the directory you run in)",
            )
        )
    program = job.command[0]
    if os.sep in program:
        if not cwd_ok:
            return problems  # relative to a cwd that does not exist: reported above
        path = os.path.join(job.cwd or ".", program)
        why = None
        if not os.path.isfile(path):
            why = "does not exist" if not os.path.lexists(path) else "is not a file"
        elif not os.access(path, os.X_OK):
            why = f"is not executable (chmod +x {program}, or run it with its interpreter: ['python', {program!r}])"
        where = f" (from job.cwd {job.cwd!r})" if job.cwd and not os.path.isabs(program) else ""
    else:
        search = job.env.get("PATH", os.environ.get("PATH", os.defpath))
        why = None if shutil.which(program, path=search) else "is not a program on PATH"
        where = " (job.env's PATH)" if "PATH" in job.env else ""
    if why:
        problems.append(
            sources.problem(
                ("job", "command"),
                "error",
                f"job.command[0] {program!r} {why}{where}; the job could not start",
            )
        )
    return problems


def spot_problems(cfg: Config, sources: Sources) -> list[Problem]:
    """SkyPilot's known limits for this config (`run --spot` checks them whether or not [spot] was written)."""
    from prime_train.integrations.spot_lint import lint_spot
    from prime_train.validator.gpus import spot_gpu_problems

    found = [*lint_spot(cfg), *spot_gpu_problems(cfg)]  # SkyPilot's limits; the GPU against the one GPU table
    return [sources.problem(path, severity, message) for path, severity, message in found]


def lint_files(
    paths: list[str], overrides: list[str] | None = None, *, spot: bool = False
) -> tuple[list[Problem], Config | None]:
    """All problems of a config made of `paths` (merged in order) and overrides."""
    try:
        data, sources = load_raw(paths, overrides)
    except ConfigError as exc:  # a file that does not parse, an override that names nothing: nothing to check
        return exc.problems, None
    cfg, problems, dropped = validate_all(data, sources)
    if cfg is None:
        return problems, None
    checked = check_config(cfg, sources, spot=spot)
    if not problems:
        return checked, cfg
    # the cross-field checks ran on the config with the rejected values at their defaults: one pass shows every
    # mistake, but not one about a default the user never wrote
    checked = [p for p in checked if not names_dropped(p, dropped)]
    return sorted(problems + checked, key=Problem.sort_key), None


def has_errors(problems: list[Problem], strict: bool = False) -> bool:
    return any(p.severity == "error" or strict for p in problems)


def load_checked(paths: list[str], overrides: list[str] | None = None) -> Config:
    """Load a config for running: schema and cross-field errors raise ConfigError; warnings pass."""
    problems, cfg = lint_files(paths, overrides)
    errors = [p for p in problems if p.severity == "error"]
    if errors or cfg is None:
        raise ConfigError(errors or problems)
    return cfg
