"""HF-format export: safetensors + config + tokenizer that `from_pretrained` and vLLM load.

Files each kind of save writes:

checkpoints/step-N/  (a DCP checkpoint, by Checkpointer; resumable at any world size)
  .metadata                     DCP index of every tensor and object, written by rank 0
  __<rank>_<i>.distcp           each rank's shards of model, optimizer and its own RNG/data state
  meta.json                     step, tokens_seen, time, world_size, final
  hf/config.json                the model's config, for offline conversion (dcp_to_hf)
  hf/tokenizer.json, hf/tokenizer_config.json, …   the tokenizer's own files

final/  (HF format, by export_hf at the end of training, or dcp_to_hf from a step-N)
  model.safetensors             the weights, when they fit in max_shard_size; otherwise
  model-0000i-of-0000n.safetensors + model.safetensors.index.json
  config.json
  generation_config.json        when the model has one
  tokenizer.json, tokenizer_config.json, …   the tokenizer files

Both are written as <dir>.tmp and renamed when whole: a reader never sees half an export.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from prime_train.contract import fsync_dir
from prime_train.engine.checkpoint import DCP_METADATA_FILE, HF_ASSETS_DIR, is_whole_checkpoint
from prime_train.engine.llama import to_hf
from prime_train.engine.model import is_native

logger = logging.getLogger("prime_train.engine.export")

# names the model writes itself; everything else in a checkpoint's hf/ belongs to the tokenizer
_MODEL_FILES = frozenset({"config.json", "generation_config.json"})
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


def _remove(path: Path) -> None:
    """Delete a file, a symlink (never its target) or a directory tree, if present."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


def _fsync_tree(path: Path) -> None:
    for dirpath, _, files in os.walk(path):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
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
) -> Path:
    """Write an HF model directory as out_dir.tmp, then swap it in for out_dir."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    old = out_dir.with_name(out_dir.name + ".old")
    if not out_dir.exists() and old.is_dir():
        # a crash between the two renames below: the last whole export is in .old
        os.rename(old, out_dir)
    _remove(tmp)
    _remove(old)
    tmp.mkdir(parents=True)

    if tokenizer is not None:
        align_special_tokens(model, tokenizer)
    model.save_pretrained(tmp, state_dict=state_dict, max_shard_size=max_shard_size)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if tokenizer_files_from is not None:
        for src in sorted(tokenizer_files_from.iterdir()):
            if src.is_file() and src.name not in _MODEL_FILES:
                shutil.copy2(src, tmp / src.name)
    _fsync_tree(tmp)

    # the old export is replaced only now that the new one is whole
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
) -> Path | None:
    """Write `model` (plain, DDP or FSDP2) and `tokenizer` to out_dir in HF format; every rank calls it.

    Returns out_dir on rank 0 and None elsewhere.
    """
    # a collective: each rank contributes its shards, rank 0 receives the full tensors on CPU
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank != 0:
        return None
    hf_model = unwrap_model(model)
    _restore_tied_aliases(hf_model, state_dict)
    if is_native(hf_model):
        # the native decoder has HF's parameter names: a transformers model holding the gathered tensors writes
        # them with HF's own save_pretrained (config, generation config, sharding, tied weights written once)
        hf_model = to_hf(hf_model, state_dict)
        # build_model turned the KV cache off for training; generate() and vLLM decode the export with one
        hf_model.generation_config.use_cache = True
    num_tensors = len(state_dict)  # save_pretrained empties the dict as it writes
    out = _write_hf_dir(hf_model, state_dict, Path(out_dir), max_shard_size=max_shard_size, tokenizer=tokenizer)
    logger.info("exported HF model (%d tensors) to %s", num_tensors, out)
    return out


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
) -> Path:
    """Convert one DCP checkpoint (step-N with hf/ assets) to an HF model directory, in this one process."""
    from transformers import AutoConfig, AutoModelForCausalLM

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

    metadata = dcp.FileSystemReader(step_dir).read_metadata()
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=_checkpoint_dtype(metadata))
    model.eval()
    # the same key scheme TrainState saved; only "model" is read, so optimizer shards, other
    # ranks' states and the saving world size do not matter
    state_dict = {"model": get_model_state_dict(model)}
    dcp.load(state_dict, checkpoint_id=step_dir, no_dist=True)
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
    )
    logger.info("converted %s to HF format in %s", step_dir, out)
    return out
