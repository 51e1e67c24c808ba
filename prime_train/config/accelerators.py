"""Accelerator strings, as SkyPilot writes them: "H100", "H100:8", "A100-80GB:4", "L4:0.5", and our "cpu".

One parser for every place that reads one (`[spot].accelerators`, `prime-train init --hardware`, `prime-train
cost`), so they agree on what a string means:

- `NAME` is one accelerator; `NAME:COUNT` is COUNT of them per node. The name is kept as written: SkyPilot and
  the GPU table (validator/data/gpus.json) both match names case-insensitively.
- COUNT is a positive number and may be fractional ("L4:0.5"), as in SkyPilot, where a fraction shares a GPU
  between tasks. A caller that needs whole devices (one training process per GPU, a GPU count to price) asks
  `Accelerators.whole_count`, which says why a fraction will not do.
- "cpu", in any case, is no accelerator at all (count 0); it takes no count.

Errors are ValueErrors that quote the string and name the part that is wrong. Standard library only: lint
parses these on laptops without torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CPU = "cpu"
# SkyPilot's accelerator names: "H100", "A100-80GB", "tpu-v5e-16", "RTX6000-Ada", "L40S"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.\-]*$")
_COUNT = re.compile(r"^[0-9]+(?:\.[0-9]+)?$")
# "H100x8" / "H100*8" is a valid-looking name that no cloud has: SkyPilot would say so only at launch
_COUNT_TYPO = re.compile(r"^(?P<name>[A-Za-z][A-Za-z0-9_.\-]*[0-9][A-Za-z0-9_.\-]*?)[xX*](?P<count>[0-9]+)$")
_FORM = "write NAME or NAME:COUNT, e.g. 'H100:8', or 'cpu'"


@dataclass(frozen=True)
class Accelerators:
    """`count` accelerators called `name` on each node; `name` None is CPU only (count 0)."""

    name: str | None
    count: int | float  # an int when whole: "H100:8.0" is 8

    @property
    def is_cpu(self) -> bool:
        """No accelerator: the string was 'cpu'."""
        return self.name is None

    def whole_count(self, why: str, *, what: str = "accelerators") -> int:
        """The count as whole devices (≥ 1), else a ValueError saying `why` whole ones are needed."""
        if self.is_cpu:
            raise ValueError(f"{what} {str(self)!r}: no GPU, but {why}")
        if isinstance(self.count, float):
            raise ValueError(
                f"{what} {str(self)!r}: {self.count:g} of a GPU, but {why}: give a whole number of GPUs, "
                f"e.g. '{self.name}:1'"
            )
        return self.count

    def __str__(self) -> str:
        if self.name is None:
            return CPU
        return f"{self.name}:{self.count:g}" if isinstance(self.count, float) else f"{self.name}:{self.count}"


def parse_accelerators(text: str, *, what: str = "accelerators") -> Accelerators:
    """Parse 'H100', 'H100:8', 'h100:0.5' or 'cpu'; `what` names the setting in error messages ('spot.accelerators')."""
    where = f"{what} {text!r}"
    value = text.strip()
    if not value:
        raise ValueError(f"{where}: empty; {_FORM}")
    name, colon, count_text = value.partition(":")
    if name.lower() == CPU:
        if colon:
            raise ValueError(f"{where}: 'cpu' takes no count; write just 'cpu'")
        return Accelerators(None, 0)
    if ":" in count_text:
        raise ValueError(f"{where}: more than one ':'; {_FORM}")
    if not name:
        raise ValueError(f"{where}: the name before ':' is empty; {_FORM}")
    if not colon and (typo := _COUNT_TYPO.match(name)):
        raise ValueError(f"{where}: not NAME or NAME:COUNT; did you mean '{typo['name']}:{typo['count']}'?")
    if not _NAME.match(name):
        raise ValueError(
            f"{where}: {name!r} is not an accelerator name (a letter, then letters, digits, '-', '_' or '.'); {_FORM}"
        )
    if not colon:
        return Accelerators(name, 1)
    if not count_text:
        raise ValueError(f"{where}: the count after ':' is empty; {_FORM}")
    if not _COUNT.match(count_text):
        raise ValueError(f"{where}: the count after ':' ({count_text!r}) is not a positive number, e.g. '{name}:8'")
    count = float(count_text)
    if count <= 0:
        raise ValueError(f"{where}: the count after ':' must be more than 0 (for no GPU write 'cpu')")
    return Accelerators(name, int(count) if count.is_integer() else count)
