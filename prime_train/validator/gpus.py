"""The shipped table of common GPUs (data/gpus.json): memory, bf16 peak, the names people call them by.

The memory calculator gives a verdict per GPU of it, the cost calculator prices its GPUs, and the init
wizard sizes a run for one; all three look GPUs up here by any of their names. An unknown name is a bad
setting like any other the calculators get: a MemoryInputError, which names the GPUs known.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from prime_train.validator.memory_inputs import GIB, MIB, MemoryInputError

DATA_DIR = Path(__file__).parent / "data"  # the validator's shipped tables: gpus.json, prices.json, ...


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model: its memory as nvidia-smi (rocm-smi) reports it, the size it is sold as, its dense bf16 peak."""

    name: str
    memory_bytes: int
    nominal_gb: float
    bf16_tflops: float | None
    aliases: tuple[str, ...] = ()
    note: str = ""

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


@dataclass(frozen=True)
class GpuTable:
    """The GPUs of one table file, and when its figures were last checked against their sources."""

    checked: str
    source: str
    gpus: tuple[GpuSpec, ...]

    def names(self) -> list[str]:
        return [g.name for g in self.gpus]

    def find(self, name: str) -> GpuSpec:
        """The GPU called `name` (its table name or an alias, in any case, spaces or dashes); else a clear error."""
        wanted = _norm_gpu(name)
        for gpu in self.gpus:
            if wanted in {_norm_gpu(n) for n in (gpu.name, *gpu.aliases)}:
                return gpu
        raise MemoryInputError(f"unknown GPU {name!r}; known GPUs: {', '.join(self.names())}")


def _norm_gpu(name: str) -> str:
    text = name.upper().replace("NVIDIA", "").replace("AMD", "").replace("INSTINCT", "").replace("GEFORCE", "")
    return "".join(ch for ch in text if ch.isalnum())


def load_gpus(path: str | os.PathLike[str] | None = None) -> GpuTable:
    """The shipped table of common GPUs (data/gpus.json), or another file of the same form."""
    file = Path(path) if path else DATA_DIR / "gpus.json"
    data = json.loads(file.read_text(encoding="utf-8"))
    gpus = []
    for entry in data["gpus"]:
        gpus.append(
            GpuSpec(
                name=entry["name"],
                memory_bytes=int(entry["memory_mib"]) * MIB,
                nominal_gb=float(entry["nominal_gb"]),
                bf16_tflops=entry.get("bf16_tflops"),
                aliases=tuple(entry.get("aliases", ())),
                note=entry.get("note", ""),
            )
        )
    return GpuTable(checked=data["checked"], source=data.get("source", ""), gpus=tuple(gpus))
