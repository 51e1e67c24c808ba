"""The shipped table of common GPUs (data/gpus.json): memory, bf16 peak, the names people call them by.

The one GPU table of every command: the memory calculator gives a verdict per GPU of it, the cost calculator
prices its GPUs, the init wizard sizes a run for one, and lint checks the GPU a [spot] table asks for against
it; all look GPUs up here by any of their names, or by an accelerator string ('H100:8', parsed by
config/accelerators.py). An unknown name is a bad setting like any other the calculators get: a
MemoryInputError, which names the GPUs known. A GPU missing here can be added to data/gpus.json (one line).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prime_train.config.accelerators import parse_accelerators
from prime_train.validator.memory_inputs import GIB, MIB, MemoryInputError

if TYPE_CHECKING:
    from prime_train.config.schema import Config

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
    bf16: bool = True  # bf16 arithmetic at all: Turing and older (T4, V100) have none, and train in fp32

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB

    @property
    def accelerator_name(self) -> str:
        """Its name as an accelerator string takes it (no spaces: 'A100-80GB', not 'A100 80GB')."""
        return next((n for n in (self.name, *self.aliases) if " " not in n), self.name.replace(" ", "-"))


@dataclass(frozen=True)
class GpuTable:
    """The GPUs of one table file, and when its figures were last checked against their sources."""

    checked: str
    source: str
    gpus: tuple[GpuSpec, ...]

    def names(self) -> list[str]:
        return [g.name for g in self.gpus]

    def find(self, name: str) -> GpuSpec:
        """The GPU called `name` (its table name or an alias, in any case, spaces or dashes; or an accelerator
        string such as 'H100:8', whose name part counts); else a clear error."""
        gpu = self.get(name)
        if gpu is None:
            raise MemoryInputError(
                f"unknown GPU {_gpu_name(name)!r}; known GPUs: {', '.join(self.names())} (a GPU missing from the table "
                f"can be added to {DATA_DIR / 'gpus.json'})"
            )
        return gpu

    def get(self, name: str) -> GpuSpec | None:
        """The GPU called `name` as `find` reads names, or None."""
        wanted = _norm_gpu(_gpu_name(name))
        for gpu in self.gpus:
            if wanted in {_norm_gpu(n) for n in (gpu.name, *gpu.aliases)}:
                return gpu
        return None


def _gpu_name(text: str) -> str:
    """The GPU's name in a name or an accelerator string ('H100:8' -> 'H100'), parsed as config/accelerators.py does."""
    if ":" not in text:
        return text
    try:
        return parse_accelerators(text).name or text
    except ValueError as exc:
        raise MemoryInputError(str(exc)) from None


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
                bf16=bool(entry.get("bf16", True)),
            )
        )
    return GpuTable(checked=data["checked"], source=data.get("source", ""), gpus=tuple(gpus))


def spot_gpu_problems(cfg: Config) -> list[tuple[tuple[str, ...], str, str]]:
    """Lint's word on the GPU a [spot] table rents, as (key path, severity, message): one the GPU table does not
    know gets a warning, since `memory` and `cost` cannot judge it. (A malformed string is lint_spot's to report.)"""
    try:
        accelerators = parse_accelerators(cfg.spot.accelerators)
    except ValueError:
        return []
    if accelerators.name is None or load_gpus().get(accelerators.name) is not None:
        return []
    return [
        (
            ("spot", "accelerators"),
            "warning",
            f"spot.accelerators {cfg.spot.accelerators!r}: {accelerators.name} is not in prime-train's GPU table, so "
            f"`prime-train memory` and `cost` cannot judge it (SkyPilot may still offer it: `sky show-gpus "
            f"{accelerators.name}`); add it to {DATA_DIR / 'gpus.json'}, or use one of: "
            + ", ".join(g.accelerator_name for g in load_gpus().gpus),
        )
    ]
