"""The price table `prime-train cost` reads: data/prices.json, approximate list prices in USD per GPU-hour dated per
provider, and a user's TOML or JSON file of the same form (`prices_file`), which overrides it entry by entry and may
add providers. Every error names the file and the dotted key."""

from __future__ import annotations

import json
import math
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prime_train.validator.gpus import DATA_DIR, GpuTable, load_gpus
from prime_train.validator.memory_inputs import MemoryInputError

PRICE_KINDS = ("on_demand", "spot")


class CostInputError(MemoryInputError):
    """A cost question that cannot be answered as asked; the message says what to give instead."""


@dataclass(frozen=True)
class Price:
    provider: str
    gpu: str
    on_demand: float | None
    spot: float | None
    as_of: str
    source: str  # the shipped table or the user's file


@dataclass(frozen=True)
class PriceTable:
    as_of: str
    note: str
    currency: str
    prices: tuple[Price, ...]
    files: tuple[str, ...]

    def for_gpu(self, gpu: str) -> list[Price]:
        return [p for p in self.prices if p.gpu == gpu]

    def gpus(self) -> list[str]:
        return sorted({p.gpu for p in self.prices})


def _read_price_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CostInputError(f"prices file {path}: cannot read it: {exc.strerror or exc}") from None
    try:
        if path.suffix.lower() == ".toml":
            return tomllib.loads(text)
        return json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        kind = "TOML" if path.suffix.lower() == ".toml" else "JSON"
        raise CostInputError(f"prices file {path}: not valid {kind}: {exc}") from None


def _parse_prices(data: Any, where: str, gpus: GpuTable) -> tuple[dict[str, Any], list[Price]]:
    """Validate one price document; errors name the file and the dotted key."""
    if not isinstance(data, dict):
        raise CostInputError(f"{where}: the top level must be a table with a 'providers' key")
    allowed = {"as_of", "currency", "unit", "note", "providers"}
    for key in data:
        if key not in allowed:
            raise CostInputError(f"{where}: unknown key {key!r}; allowed: {', '.join(sorted(allowed))}")
    providers = data.get("providers")
    if not isinstance(providers, dict) or not providers:
        raise CostInputError(f"{where}: 'providers' must be a table of providers (e.g. [providers.aws.prices])")
    currency = data.get("currency", "USD")
    if currency != "USD":
        raise CostInputError(f"{where}: currency {currency!r}: prices must be in USD per GPU-hour")
    top_as_of = str(data.get("as_of", "unknown date"))
    out = []
    for provider, entry in providers.items():
        key = f"providers.{provider}"
        if not isinstance(entry, dict) or not isinstance(entry.get("prices"), dict):
            raise CostInputError(f"{where}: {key} must have a 'prices' table of GPU → {{on_demand, spot}}")
        unknown = set(entry) - {"as_of", "note", "prices"}
        if unknown:
            raise CostInputError(f"{where}: {key}.{sorted(unknown)[0]}: unknown key; allowed: as_of, note, prices")
        as_of = str(entry.get("as_of", top_as_of))
        for gpu_name, rates in entry["prices"].items():
            gkey = f"{key}.prices.{gpu_name}"
            try:
                gpu = gpus.find(gpu_name)
            except MemoryInputError:
                raise CostInputError(
                    f"{where}: {gkey}: unknown GPU {gpu_name!r}; known GPUs: {', '.join(gpus.names())}"
                ) from None
            if not isinstance(rates, dict):
                raise CostInputError(f"{where}: {gkey} must be a table like {{on_demand = 2.5, spot = 1.2}}")
            extra = set(rates) - set(PRICE_KINDS)
            if extra:
                raise CostInputError(f"{where}: {gkey}.{sorted(extra)[0]}: unknown key; allowed: on_demand, spot")
            values: dict[str, float | None] = {}
            for kind in PRICE_KINDS:
                value = rates.get(kind)
                ok = value is None or (
                    isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
                    and value >= 0
                )  # fmt: skip
                if not ok:
                    raise CostInputError(
                        f"{where}: {gkey}.{kind} = {value!r}: must be a number ≥ 0 (USD per GPU-hour), or left out"
                    )
                values[kind] = None if value is None else float(value)
            out.append(Price(provider, gpu.name, values["on_demand"], values["spot"], as_of, where))
    return data, out


def load_prices(prices_file: str | os.PathLike[str] | None = None, *, gpus: GpuTable | None = None) -> PriceTable:
    """The shipped price table, with the entries of `prices_file` (TOML or JSON) replacing or adding to it."""
    gpus = gpus or load_gpus()
    shipped = DATA_DIR / "prices.json"
    base, prices = _parse_prices(json.loads(shipped.read_text(encoding="utf-8")), str(shipped), gpus)
    by_key = {(p.provider, p.gpu): p for p in prices}
    files = [str(shipped)]
    as_of = str(base.get("as_of", "unknown date"))
    if prices_file is not None:
        path = Path(os.path.expanduser(str(prices_file)))
        data, user = _parse_prices(_read_price_file(path), str(path), gpus)
        for price in user:
            by_key[(price.provider, price.gpu)] = price
        files.append(str(path))
        as_of = str(data.get("as_of", as_of))
    return PriceTable(
        as_of=as_of,
        note=str(base.get("note", "")),
        currency="USD",
        prices=tuple(by_key.values()),
        files=tuple(files),
    )
