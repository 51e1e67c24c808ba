"""Reading DCP checkpoints without running code from them.

torch's own reader unpickles a checkpoint's `.metadata` with a plain `pickle.load`, and its default load
planner reads every non-tensor item (scheduler, RNG, data loader, step) with `torch.load(weights_only=False)`:
whoever can write a checkpoint directory could run code in the trainer on `run --resume` or in `ckpt to-hf`.
Everything here that reads a checkpoint goes through this module instead:

- `read_metadata` unpickles `.metadata` with an unpickler that resolves only the classes DCP's Metadata is
  made of (torch.distributed.checkpoint.metadata's dataclasses, the filesystem layer's `_StorageInfo`,
  torch.Size, dtypes and layouts, pathlib paths); any other global is refused with `UnsafeCheckpointError`
  before it is even imported. The list is what torch 2.11 to 2.14 write (read off real `.metadata` files),
  plus the older home of TensorProperties.
- `load` is `dcp.load` with `SafeFileSystemReader` (its metadata through `read_metadata`) and
  `SafeLoadPlanner` (bytes items through `torch.load(weights_only=True)`; tensors already are). The reader
  refuses to run with any other planner, so the unsafe default cannot come back by accident.
"""

from __future__ import annotations

import os
import pickle
import re
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo

DCP_METADATA_FILE = ".metadata"


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file that asks the unpickler for something a DCP checkpoint never holds."""


# (module, name) pairs a DCP .metadata may name, and nothing else
_METADATA_CLASSES = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        # where TensorProperties lived before DCP had its own (older checkpoints)
        ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
        ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a layout by its name, from a fixed table
        # StorageMeta.checkpoint_id: the path it was saved to (pathlib._local from Python 3.13)
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "PurePosixPath"),
        ("pathlib._local", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "complex"),
    }
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and "." not in name:
            value = getattr(torch, name, None)  # torch.float32, torch.strided, torch.contiguous_format
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise UnsafeCheckpointError(
            f"it asks for {module}.{name}, which a DCP {DCP_METADATA_FILE} never holds; refusing to unpickle it"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(f"a DCP {DCP_METADATA_FILE} holds no persistent ids; refusing to unpickle it")


def unpickle_metadata(f: BinaryIO) -> dcp_metadata.Metadata:
    """A DCP Metadata from the open file `f`, or UnsafeCheckpointError (code never runs) / UnpicklingError."""
    metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
    if not isinstance(metadata.state_dict_metadata, dict):
        raise UnsafeCheckpointError("its state_dict_metadata is not a dict")
    if metadata.storage_data is not None and not isinstance(metadata.storage_data, dict):
        raise UnsafeCheckpointError("its storage_data is not a dict")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(name, str):
            raise UnsafeCheckpointError(f"its storage_data holds a {type(info).__name__}, not a file location")
        parts = PurePosixPath(name).parts
        if not parts or name.startswith(("/", "\\")) or "\\" in name or ".." in parts or "\x00" in name:
            raise UnsafeCheckpointError(f"it points into {name!r}, which is not a file inside the checkpoint")
        for field in ("offset", "length"):
            value = getattr(info, field, None)
            if type(value) is not int or value < 0:
                raise UnsafeCheckpointError(f"its {field} into {name!r} is {value!r}, not a byte count")
    return metadata


def read_metadata(path: str | os.PathLike[str]) -> dcp_metadata.Metadata:
    """The DCP Metadata of checkpoint directory `path`, unpickled without running anything from it."""
    with open(Path(path) / DCP_METADATA_FILE, "rb") as f:
        return unpickle_metadata(f)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor items load with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:  # torch's text goes on to suggest weights_only=False: keep only why
            found = re.search(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)", str(e))
            detail = found.group(1).strip() if found else str(e).splitlines()[0]
            raise UnsafeCheckpointError(
                f"its item {read_item.dest_index.fqn!r} is not plain data ({detail}); refused, nothing of it was run"
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with `.metadata` read by the restricted unpickler; reads only for SafeLoadPlanner."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA_FILE if rank is None else f"__{rank}{DCP_METADATA_FILE}"
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "rb") as f:
            metadata = unpickle_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not isinstance(planner, SafeLoadPlanner):
            raise TypeError(f"SafeFileSystemReader reads only for a SafeLoadPlanner, not {type(planner).__name__}")
        return super().read_data(plan, planner)


# what a load that fails because the checkpoint does not fit this run's model says (a changed model or LoRA
# setting): a configuration error, never a reason to set the checkpoint aside
_MISMATCH_MESSAGES = (
    "Missing key in checkpoint state_dict",
    "Size mismatch between saved",
    "mismatch sizes",
    "Missing key(s) in state_dict",
    "Unexpected key(s) in state_dict",
    "size mismatch for",
)


DOES_NOT_LOAD = "it verifies but does not load"
_KINDS = ("other", "config", "checkpoint")  # gravest first


def load_failure(error: BaseException) -> tuple[str, str]:
    """(kind, why) of a failed checkpoint load. Kinds: 'checkpoint' (its content does not load: an item the safe
    loader refuses, bytes that are not what they should be), 'config' (it does not fit the model this config
    builds) and 'other' (not the checkpoint's doing: memory, I/O, the network)."""
    causes: list[BaseException] = [error]
    if isinstance(error, CheckpointException):  # DCP's wrapper of every rank's failure
        causes = [pair[0] if isinstance(pair, tuple) else pair for pair in error.failures.values()] or causes
    kinds = []
    for cause in causes:
        text = str(cause)
        if isinstance(cause, (MemoryError, OSError, torch.OutOfMemoryError, dist.DistError)):
            kinds.append(("other", cause))
        elif any(m in text for m in _MISMATCH_MESSAGES):
            kinds.append(("config", cause))
        else:
            kinds.append(("checkpoint", cause))
    kind, cause = min(kinds, key=lambda k: _KINDS.index(k[0]))
    lines = str(cause).strip().splitlines()
    why = f"{type(cause).__name__}: {lines[0] if lines else ''}"
    return kind, why if len(why) <= 400 else why[:397] + "..."


def worst_failure(verdicts: list[tuple[str, str] | None]) -> tuple[int, str, str] | None:
    """(rank, kind, why) of the gravest of every rank's `load_failure` (None where a rank loaded), or None."""
    failed = [(rank, *v) for rank, v in enumerate(verdicts) if v is not None]
    return min(failed, key=lambda f: _KINDS.index(f[1])) if failed else None


def load(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: Any = None,
    no_dist: bool = False,
) -> None:
    """`dcp.load` of checkpoint directory `path` into `state_dict`, without unpickling anything unsafe."""
    dcp.load(
        state_dict,
        storage_reader=SafeFileSystemReader(path),
        planner=SafeLoadPlanner(),
        process_group=process_group,
        no_dist=no_dist,
    )
