"""`ckpt to-hf` for a LoRA run's checkpoint: the merged model and the adapter in PEFT's format, as the run exports.

A LoRA checkpoint holds the adapters (and their optimizer state), never the frozen base: the base is what the run's
config.toml builds at every start (model.path, or the random init seeded with run.seed). `lora_checkpoint_to_hf`
builds it again exactly as the job does (set_seed(run.seed), then load_model_and_tokenizer: the same model code, the
same RNG stream, on the CPU as the job builds it), puts the adapters on it with the run's [lora] settings, checks them
against the checkpoint's meta.json identity and its DCP metadata (names and shapes), loads the adapter tensors through
safe_dcp's restricted reader, and writes with export_hf (handed in by its caller), as the run's own final/ is written.

What cannot be checked: that model.path holds today what it held when the run trained (a re-exported base makes
another merged model), and, for a random init, that torch and transformers are the versions the run used (their
initialisers give other numbers across versions).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from prime_train.contract import read_json
from prime_train.engine import safe_dcp
from prime_train.engine.checkpoint import META_FILE
from prime_train.engine.lora import adapter_identity, apply_lora, comparable_identity, describe_identity, is_adapter_key


def _refuse(step_dir: Path, why: str) -> ValueError:
    return ValueError(f"cannot convert the LoRA checkpoint {step_dir} to HF format: {why}. Nothing was written.")


def _run_config(step_dir: Path, config_path: str | os.PathLike[str] | None):
    """The run's resolved config: `config_path`, else config.toml of the run directory above checkpoints/."""
    from prime_train.config.loader import ConfigError, load_config

    path = Path(config_path) if config_path is not None else step_dir.parent.parent / "config.toml"
    if not path.is_file():
        raise _refuse(
            step_dir,
            f"the run's config.toml, which says how the frozen base is built, is not at {path} (pass the run "
            "directory's config.toml with --config when its checkpoints live elsewhere)",
        )
    try:
        cfg = load_config([path])
    except ConfigError as exc:
        raise _refuse(step_dir, f"the run's config {path} does not load:\n{exc}") from None
    if not cfg.lora.enabled:
        raise _refuse(step_dir, f"the run's config {path} has no [lora] (lora.rank = 0), yet the checkpoint holds one")
    if cfg.run.job == "reward":
        # its checkpoint holds the score head beside the adapters, and its base is a classifier, not a causal LM
        raise _refuse(
            step_dir,
            f"the run's config {path} is a reward model's (run.job = 'reward') trained with LoRA, which this "
            "conversion does not build yet; the run's own final/ is the merged classifier (or resume the run with "
            "train.max_steps at this step to export it)",
        )
    return cfg, path


def _check_identity(step_dir: Path, saved: Any, built: dict[str, Any], config_path: Path) -> None:
    """The checkpoint's meta.json identity must be the one the run's [lora] builds (rank, alpha, targets)."""
    if not isinstance(saved, dict):
        raise _refuse(step_dir, f"its {META_FILE} names no LoRA adapter (no 'lora': rank, alpha, target_modules)")
    try:
        same = comparable_identity(saved) == comparable_identity(built) and bool(saved.get("fan_in_fan_out")) == bool(
            built.get("fan_in_fan_out")
        )
    except (KeyError, TypeError, ValueError):
        raise _refuse(step_dir, f"its {META_FILE}'s 'lora' is not rank, alpha and target_modules: {saved!r}") from None
    if not same:
        raise _refuse(
            step_dir,
            f"its {META_FILE} says it was saved with {describe_identity(saved)}, and the run's config "
            f"{config_path} builds {describe_identity(built)}; the adapter is merged only with the settings it was "
            "trained with",
        )


def _check_tensors(step_dir: Path, metadata, template: dict[str, Any]) -> None:
    """The checkpoint's adapter tensors must be the model's, by name and shape, before anything is loaded."""
    saved = {
        key.removeprefix("model."): item
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and is_adapter_key(key)
    }
    missing, unexpected = sorted(set(template) - set(saved)), sorted(set(saved) - set(template))
    shapes = [
        name
        for name in sorted(set(template) & set(saved))
        if not isinstance(saved[name], TensorStorageMetadata) or tuple(saved[name].size) != tuple(template[name].shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} adapter weights of its identity are not in it (e.g. {missing[0]})")
    if unexpected:
        problems.append(f"{len(unexpected)} of its adapter weights are not of its identity (e.g. {unexpected[0]})")
    if shapes:
        problems.append(f"{len(shapes)} have another shape than its identity gives (e.g. {shapes[0]})")
    if problems:
        why = "; ".join(problems)
        raise _refuse(step_dir, f"its adapter weights do not match its {META_FILE}'s lora identity: {why}")


def lora_checkpoint_to_hf(
    step_dir: Path,
    out_dir: str | os.PathLike[str],
    metadata,
    *,
    config_path: str | os.PathLike[str] | None = None,
    adapter_only: bool = False,
    overwrite: bool = False,
    max_shard_size: int | str = "2GB",
    write: Callable[..., Path],
) -> Path:
    """Write a LoRA checkpoint (`step_dir`, whose DCP `metadata` dcp_to_hf read) as the run's export with `write`
    (export.export_hf, handed in by dcp_to_hf so this module does not import its caller): out_dir the
    merged model, out_dir/adapter/ PEFT's adapter (`adapter_only`: that alone). ValueError (ExportRefused for
    out_dir) before anything is written when the base cannot be built as the run built it or the checkpoint's
    adapter is not what its meta.json and the run's config say."""
    from prime_train.engine import parallel
    from prime_train.engine.model import load_model_and_tokenizer

    cfg, config_path = _run_config(step_dir, config_path)
    if adapter_only and not cfg.model.path:
        raise _refuse(
            step_dir,
            "--adapter-only on a random-initialised model: the adapter's base exists nowhere but in this run "
            "(lora.merge_on_export = false is refused for the same reason); leave --adapter-only off for the merged "
            "model",
        )
    meta = read_json(step_dir / META_FILE) or {}
    # the job's own order: seed, then the model on the CPU (a random init draws the same numbers), then the adapters
    parallel.set_seed(cfg.run.seed, 0)
    tokenizer, model = load_model_and_tokenizer(cfg)
    device = "cuda" if cfg.lora.quantize == "nf4" else "cpu"
    model = apply_lora(model, cfg.lora, device=device, strategy="none").to(device)
    _check_identity(step_dir, meta.get("lora"), adapter_identity(model), config_path)
    # TrainState's "model" entry of a LoRA run (lora.checkpoint_state): the adapters alone, under the model's names
    template = {
        name: tensor
        for name, tensor in get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True)).items()
        if is_adapter_key(name)
    }
    _check_tensors(step_dir, metadata, template)
    state = {"model": template}
    safe_dcp.load(state, step_dir, no_dist=True)
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=False))
    model.eval()
    out = write(
        model, tokenizer, out_dir, rank=0, max_shard_size=max_shard_size, merge=not adapter_only, adapter=True,
        base_model=cfg.model.path, overwrite=overwrite, own_run=False, source=str(step_dir),
    )  # fmt: skip
    assert out is not None  # rank 0
    return out
