"""HF-format export: safetensors + config + tokenizer that `from_pretrained` and vLLM load.

Files each kind of save writes:

checkpoints/step-N/  (a DCP checkpoint, by Checkpointer; resumable at any world size)
  .metadata                     DCP index of every tensor and object, written by rank 0
  __<rank>_<i>.distcp           each rank's shards of model, optimizer and its own RNG/data state
  meta.json                     step, tokens_seen, time, world_size, final; a LoRA run's adapter identity (lora:
                                rank, alpha, target_modules), which a resume must match; such a checkpoint holds
                                the adapters and their optimizer state, not the frozen base
  hf/config.json                the model's config, for offline conversion (dcp_to_hf)
  hf/tokenizer.json, hf/tokenizer_config.json, …   the tokenizer's own files

final/  (HF format, by export_hf at the end of training, or dcp_to_hf from a step-N)
  model.safetensors             the weights, when they fit in max_shard_size; otherwise
  model-0000i-of-0000n.safetensors + model.safetensors.index.json
  config.json
  generation_config.json        when the model has one
  tokenizer.json, tokenizer_config.json, …   the tokenizer files
  adapter/                      a LoRA run's adapter in PEFT's format (engine/lora.py): adapter_config.json and
                                adapter_model.safetensors; the weights above are then the merged model's
                                (W + alpha/r · B @ A), or absent with lora.merge_on_export = false

Both are written as <dir>.tmp and renamed when whole: a reader never sees half an export.

Every export holds EXPORT_MARKER (written first, into <dir>.tmp): the one proof that a directory is an export
of this tool. An export replaces only an earlier export (and `ckpt to-hf` only with --overwrite), never a
directory of anything else, a run directory, what a run directory holds besides final/ and weights/, or a
checkpoint (`check_export_target`); <dir>.tmp and <dir>.old are cleared only when they are exports too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from prime_train.contract import fsync_dir
from prime_train.engine import safe_dcp  # never torch's reader: it unpickles .metadata and bytes items unrestricted
from prime_train.engine.checkpoint import (
    DCP_METADATA_FILE,
    HF_ASSETS_DIR,
    MANIFEST_FILE,
    META_FILE,
    is_whole_checkpoint,
)
from prime_train.engine.llama import to_hf
from prime_train.engine.lora import (
    adapter_identity,
    dense_state_dict,
    expert_adapters,
    has_lora,
    has_quantized_base,
    is_adapter_key,
    merged_state_dict,
    save_peft_adapter,
)
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import is_native
from prime_train.rundir import QUARANTINE_RE, STEP_RE, TMP_RE, RunDir

logger = logging.getLogger("prime_train.engine.export")

# names the model writes itself; everything else in a checkpoint's hf/ belongs to the tokenizer
_MODEL_FILES = frozenset({"config.json", "generation_config.json"})
# where a LoRA run's export puts its adapter, in PEFT's format, inside the export directory
ADAPTER_DIR = "adapter"
# wrappers whose submodule name appears in parameter names but not in the state dict
_WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside DDP and torch.compile wrappers (FSDP2 wraps in place, so it stays)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


def _clean_name(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _restore_tied_aliases(model: torch.nn.Module, state_dict: dict[str, Any]) -> None:
    """Make tied parameters one tensor again in a gathered state dict.

    Gathering copies each name separately, so tied embeddings arrive as two equal tensors;
    transformers drops a tied duplicate only when both names share storage.
    """
    by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(_clean_name(name))
    for names in by_param.values():
        present = [n for n in names if n in state_dict]
        for alias in present[1:]:
            state_dict[alias] = state_dict[present[0]]


# in every export this tool writes: what lets a later export replace it (see the module docstring)
EXPORT_MARKER = ".prime-train-export.json"


class ExportRefused(EngineConfigError):
    """The output directory is not one an export may be written to or replace (exit 78, never retried)."""


def _run_dir_files(path: Path) -> list[str]:
    """The run-directory entries `path` holds (RunDir's names): a run directory has some of them."""
    rd = RunDir(path)
    entries = (rd.config_path, rd.lock_path, rd.supervisor_path, rd.events_path, rd.checkpoints_dir)
    return [e.name for e in entries if os.path.lexists(e)]


def _is_checkpoint(path: Path) -> bool:
    """A checkpoint directory, by what a save writes into it (named like one of a run's, or not)."""
    if not path.is_dir():
        return False
    ours = [(path / name).is_file() for name in (DCP_METADATA_FILE, META_FILE, MANIFEST_FILE)]
    named = STEP_RE.match(path.name) or TMP_RE.match(path.name) or QUARANTINE_RE.match(path.name)
    return any(ours) if named else ours[0] and any(ours[1:])


def _empty(path: Path) -> bool:
    with os.scandir(path) as entries:
        return next(entries, None) is None


def _protected(out: Path, *, own_run: bool) -> str | None:
    """Why nothing may be exported to `out` whatever is there, or None: it is (inside) a run directory's
    own files or a checkpoint. `own_run`: the engine exporting into its run directory's final/ or weights/."""
    resolved = Path(out).resolve()
    if files := _run_dir_files(resolved):
        return f"it is a run directory (it has {', '.join(files)})"
    for parent in resolved.parents:
        if _is_checkpoint(parent):
            return f"it is inside the checkpoint {parent}"
        if _run_dir_files(parent):
            # what the run writes itself, but for its exports' places: final/ (weights/ only for the run's own)
            rd = RunDir(parent)
            exports = {rd.final_dir.name, *([rd.weights_dir.name] if own_run else [])}
            reserved = {p.name for p in vars(rd).values() if isinstance(p, Path) and p.parent == rd.root} - exports
            top = resolved.relative_to(parent).parts[0]
            if top in reserved:
                return f"it is in {top} of the run directory {parent}, which only the run writes"
            break
    if _is_checkpoint(resolved):
        return "it is a checkpoint"
    return None


def _has_marker(path: Path) -> bool:
    marker = path / EXPORT_MARKER
    return marker.is_file() and not marker.is_symlink()


def _marker_cut_short(path: Path) -> bool:
    """A directory that holds nothing but the temporary file of an EXPORT_MARKER being written: an export killed in
    its first write (prime-train before the marker was written in place left these)."""
    prefix = f".{EXPORT_MARKER}."
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except OSError:
        return False
    return bool(entries) and all(
        e.name.startswith(prefix) and e.name.endswith(".tmp") and e.is_file(follow_symlinks=False) for e in entries
    )


def _older_export(path: Path) -> bool:
    """An HF export a prime-train before EXPORT_MARKER wrote: only files, config.json or safetensors among them."""
    try:
        with os.scandir(path) as it:
            entries = list(it)
    except OSError:
        return False
    if any(not e.is_file(follow_symlinks=False) for e in entries):
        return False
    return any(e.name == "config.json" or e.name.endswith(".safetensors") for e in entries)


def _replaceable(path: Path, *, own_run: bool) -> bool:
    """Whether `path` (which exists) is something an export may delete: an empty directory or an export (with
    `own_run`, also a symlink, which is unlinked, or an export an older prime-train wrote)."""
    if path.is_symlink():
        return own_run
    if not path.is_dir():
        return False
    if _has_marker(path) or _empty(path) or _marker_cut_short(path):
        return True
    return own_run and _older_export(path)


def check_export_target(out_dir: str | os.PathLike[str], *, overwrite: bool, own_run: bool = False) -> None:
    """Raise ExportRefused unless an export may be written to `out_dir` (see the module docstring).

    `overwrite`: an earlier export there may be replaced. `own_run`: the engine's own final/ or weights/step-N,
    whose earlier export it replaces (also one written before EXPORT_MARKER existed).
    """
    out = Path(out_dir)
    nothing = "nothing was written"
    elsewhere = "choose a new or empty output directory"
    why = _protected(out, own_run=own_run)
    if why is not None:
        raise ExportRefused(f"{out}: {why}; it is never written into or over, even with --overwrite: {elsewhere}.")
    if not os.path.lexists(out) or (own_run and _replaceable(out, own_run=True)):
        return
    if out.is_symlink() or not out.is_dir():
        kind = "a symbolic link" if out.is_symlink() else "a file"
        raise ExportRefused(f"{out} is {kind}, not a directory; {nothing}: {elsewhere}.")
    if _empty(out):
        return
    if not _has_marker(out):
        raise ExportRefused(
            f"{out} exists and is not an export of prime-train (it has no {EXPORT_MARKER}): {nothing}.\n"
            f"It is never replaced; {elsewhere}, or move this one away first."
        )
    if not overwrite:
        raise ExportRefused(
            f"{out} holds an earlier export: {nothing}. Pass --overwrite to replace it, or {elsewhere}."
        )


def _remove(path: Path) -> None:
    """Delete a file, a symlink (never its target) or a directory tree, if present."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (os.umask can only swap it)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_tree(path: Path) -> None:
    """fsync every file under `path`, and give each the mode open() would (0o666 less the umask): safetensors writes
    its files 0o600, which left model.safetensors unreadable to the group that can read config.json beside it."""
    mode = 0o666 & ~_umask()
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fchmod(f.fileno(), mode)
                os.fsync(f.fileno())


def align_special_tokens(model: torch.nn.Module, tokenizer) -> None:
    """Make the model's config and generation config name the tokenizer's bos/eos/pad ids.

    transformers' generate() and vLLM stop on the eos id of config.json / generation_config.json; one that is
    not the tokenizer's end token (a config class's default, Llama's 2) lets generation run on past the answer.
    """
    generation = getattr(model, "generation_config", None)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(tokenizer, name, None)
        if value is None:
            continue
        setattr(model.config, name, value)
        if generation is not None:
            setattr(generation, name, value)


def _write_hf_dir(
    model: torch.nn.Module,
    state_dict: dict[str, Any] | None,
    out_dir: Path,
    *,
    max_shard_size: int | str,
    tokenizer=None,
    tokenizer_files_from: Path | None = None,
    overwrite: bool = False,
    own_run: bool = False,
    source: str = "",
    write_model: bool = True,
    extra=None,
) -> Path:
    """Write an HF model directory as out_dir.tmp, then swap it in for out_dir (see check_export_target).

    write_model=False leaves the model's own files out (a LoRA export of its adapter alone); `extra(tmp)` writes more
    into the directory before it is swapped in (the adapter)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    old = out_dir.with_name(out_dir.name + ".old")
    if not os.path.lexists(out_dir) and old.is_dir() and not old.is_symlink() and _replaceable(old, own_run=own_run):
        # a crash between the two renames below: the last whole export is in .old
        os.rename(old, out_dir)
    check_export_target(out_dir, overwrite=overwrite, own_run=own_run)
    for leftover in (tmp, old):  # an earlier export's, never anything else that happens to have the name
        if os.path.lexists(leftover) and not _replaceable(leftover, own_run=own_run):
            raise ExportRefused(
                f"{leftover} is in the way of the export to {out_dir} and is not an export of prime-train; "
                "nothing was written. Move it away, or choose another directory."
            )
        _remove(leftover)
    tmp.mkdir(parents=True)
    # first, in place (the directory is new and ours; being there is the proof, not its content): a crash from here on
    # leaves a .tmp that is empty or holds the marker, which the next export knows as its own
    fd = os.open(tmp / EXPORT_MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump({"made_by": "prime-train", "kind": "hf-export", "source": source}, f)

    if tokenizer is not None and write_model:
        align_special_tokens(model, tokenizer)
    if write_model:
        model.save_pretrained(tmp, state_dict=state_dict, max_shard_size=max_shard_size)
    if extra is not None:
        extra(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if tokenizer_files_from is not None:
        for src in sorted(tokenizer_files_from.iterdir()):
            if src.is_file() and src.name not in _MODEL_FILES and src.name != EXPORT_MARKER:
                shutil.copy2(src, tmp / src.name)
    _fsync_tree(tmp)

    # the old export is replaced only now that the new one is whole; checked again, as the write took a while
    check_export_target(out_dir, overwrite=overwrite, own_run=own_run)
    if out_dir.exists() or out_dir.is_symlink():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    fsync_dir(out_dir.parent)
    _remove(old)
    return out_dir


def export_hf(
    model: torch.nn.Module,
    tokenizer,
    out_dir: str | os.PathLike[str],
    *,
    rank: int,
    max_shard_size: int | str = "2GB",
    merge: bool = True,
    adapter: bool = False,
    base_model: str | None = None,
    overwrite: bool = True,
    own_run: bool = True,
    source: str = "training",
    also=None,
) -> Path | None:
    """Write `model` (plain, DDP or FSDP2) and `tokenizer` to out_dir in HF format; every rank calls it.

    out_dir is the run's own final/ or weights/step-N: an earlier export there is replaced, anything else
    there is refused (ExportRefused). Returns out_dir on rank 0 and None elsewhere.

    A model with LoRA adapters (engine/lora.py): `merge` writes the merged model (each adapted weight W + alpha/r ·
    B @ A under its plain HF name) as out_dir's weights; `adapter` writes out_dir/adapter/ in PEFT's format, recorded
    against `base_model` (unset: the model config's name_or_path, i.e. model.path). The final export passes
    adapter=True, merge=lora.merge_on_export; RL's weights/step-N the defaults (merged only). Both are ignored for a
    model without adapters. `overwrite`, `own_run`, `source`: check_export_target's and the marker's; the defaults
    are the run's own export's, `ckpt to-hf` of a LoRA checkpoint (engine/lora_to_hf.py) passes its own. `also(tmp)`
    writes more into the export before it is swapped in (train.qat: the converted model, from the model written).
    """
    lora = has_lora(model)
    if lora and not (merge or adapter):
        raise ValueError("a LoRA export writes the merged model, the adapter, or both: merge and adapter are off")
    if lora and has_quantized_base(model):
        # QLoRA: one process or DDP (lora.quantize refuses FSDP), so rank 0 holds every weight; the 4-bit ones are
        # dequantized for the merge
        state_dict = dense_state_dict(model) if rank == 0 else {}
    else:
        # a collective: each rank contributes its shards, rank 0 receives the full tensors on CPU
        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    hf_model = unwrap_model(model)
    _restore_tied_aliases(hf_model, state_dict)
    write_adapter = None
    if lora:
        identity = adapter_identity(hf_model)
        if adapter:
            weights = {name: t for name, t in state_dict.items() if is_adapter_key(name)}
            lora_model = hf_model

            def write_adapter(tmp: Path) -> None:
                save_peft_adapter(lora_model, tmp / ADAPTER_DIR, base_model, state_dict=weights)

        state_dict = merged_state_dict(state_dict, identity, expert_adapters(hf_model)) if merge else {}
    write_model = merge or not lora
    if write_model and hasattr(hf_model, "export_model"):
        # a model of the engine's own that transformers writes as another class (engine/reward.py's native reward
        # model: a *ForSequenceClassification) gives the transformers model holding the gathered tensors
        hf_model = hf_model.export_model(state_dict)
    elif is_native(hf_model) and write_model:
        # the native decoder has HF's parameter names: a transformers model holding the gathered tensors writes
        # them with HF's own save_pretrained (config, generation config, sharding, tied weights written once)
        hf_model = to_hf(hf_model, state_dict)
        # build_model turned the KV cache off for training; generate() and vLLM decode the export with one
        hf_model.generation_config.use_cache = True
    num_tensors = len(state_dict)  # save_pretrained empties the dict as it writes
    out = _write_hf_dir(
        hf_model,
        state_dict if write_model else None,
        Path(out_dir),
        max_shard_size=max_shard_size,
        tokenizer=tokenizer,
        overwrite=overwrite,
        own_run=own_run,
        source=source,
        write_model=write_model,
        extra=_both(write_adapter, also),
    )
    if write_model:
        logger.info("exported HF model (%d tensors%s) to %s", num_tensors, ", LoRA merged" * lora, out)
    return out


def _both(first, second):
    """A writer calling `first(tmp)` then `second(tmp)`, either of them None."""
    if first is None or second is None:
        return first or second

    def write(tmp: Path) -> None:
        first(tmp)
        second(tmp)

    return write


def _checkpoint_dtype(metadata) -> torch.dtype:
    """The floating dtype the checkpoint's model weights were saved in."""
    for key, item in metadata.state_dict_metadata.items():
        if (
            key.startswith("model.")
            and isinstance(item, TensorStorageMetadata)
            and item.properties.dtype.is_floating_point
        ):
            return item.properties.dtype
    return torch.float32


def dcp_to_hf(
    step_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "2GB",
    overwrite: bool = False,
    adapter_only: bool = False,
    config_path: str | os.PathLike[str] | None = None,
) -> Path:
    """Convert one DCP checkpoint (step-N with hf/ assets) to an HF model directory, in this one process.

    out_dir must be missing, empty, or (with `overwrite`) an earlier export: ExportRefused otherwise, before the
    checkpoint is read. A LoRA run's checkpoint is written as the run exports (engine/lora_to_hf.py): out_dir the
    merged model on the base the run's config.toml builds (`config_path`, else the run directory's above
    checkpoints/), out_dir/adapter/ the adapter in PEFT's format; `adapter_only` writes the adapter alone.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    check_export_target(out_dir, overwrite=overwrite)
    step_dir = Path(step_dir)
    problem = is_whole_checkpoint(step_dir)
    hf_dir = step_dir / HF_ASSETS_DIR
    if problem is None and not (hf_dir / "config.json").is_file():
        problem = f"it has no {HF_ASSETS_DIR}/config.json (the saving run never called set_hf_assets)"
    if problem is not None:
        raise ValueError(
            f"cannot convert {step_dir} to HF format: {problem}. "
            f"Pass a whole step-N directory (with {DCP_METADATA_FILE} and {HF_ASSETS_DIR}/config.json)."
        )

    try:
        metadata = safe_dcp.read_metadata(step_dir)
    except Exception as e:  # garbage, truncated, or refused by the restricted unpickler: nothing of it ran
        raise ValueError(
            f"cannot convert {step_dir} to HF format: its {DCP_METADATA_FILE} does not load ({type(e).__name__}: {e})"
        ) from None
    if any(is_adapter_key(key) for key in metadata.state_dict_metadata):
        # a LoRA run's: the adapters alone; the frozen base is built again as the run builds it
        from prime_train.engine.lora_to_hf import lora_checkpoint_to_hf

        return lora_checkpoint_to_hf(
            step_dir, out_dir, metadata, config_path=config_path, adapter_only=adapter_only, overwrite=overwrite,
            max_shard_size=max_shard_size, write=export_hf,
        )  # fmt: skip
    if adapter_only:
        raise ValueError(
            f"cannot convert {step_dir} with --adapter-only: it is not a LoRA run's checkpoint (it holds no adapter)"
        )
    config = AutoConfig.from_pretrained(hf_dir)
    # a reward model's checkpoint names transformers' *ForSequenceClassification (engine/reward.py)
    classifier = any(name.endswith("ForSequenceClassification") for name in config.architectures or ())
    auto_class = AutoModelForSequenceClassification if classifier else AutoModelForCausalLM
    model = auto_class.from_config(config, dtype=_checkpoint_dtype(metadata))
    model.eval()
    # the same key scheme TrainState saved; only "model" is read, so optimizer shards, other
    # ranks' states and the saving world size do not matter
    state_dict = {"model": get_model_state_dict(model)}
    safe_dcp.load(state_dict, step_dir, no_dist=True)
    set_model_state_dict(model, state_dict["model"])
    try:
        from transformers import AutoTokenizer

        align_special_tokens(model, AutoTokenizer.from_pretrained(hf_dir))
    except (OSError, ValueError):  # no tokenizer files saved beside the config: keep the config's own ids
        logger.warning("no tokenizer in %s: special token ids kept as the checkpoint's config has them", hf_dir)
    out = _write_hf_dir(
        model,
        None,
        Path(out_dir),
        max_shard_size=max_shard_size,
        tokenizer_files_from=hf_dir,
        overwrite=overwrite,
        source=str(step_dir),
    )
    logger.info("converted %s to HF format in %s", step_dir, out)
    return out
