"""SWEEP.toml: the `[sweep]` section, its search space and its lint (file:line like a run config's).

```toml
[sweep]
base = "configs/tiny-sft.toml"   # the run config each trial starts from, relative to this file
name = "lr-search"               # the sweep directory is <output_dir>/<name>
metric = "eval_loss"             # a key of metrics.jsonl
trials = 12
sampler = "tpe"                  # grid | random | tpe | cmaes | pbt
pruner = "hyperband"             # none | median | hyperband
[sweep.overrides]                # run-config keys set for every trial, as --section.key on the command line
"train.max_steps" = 200
[sweep.space]
"train.lr" = { low = 1e-4, high = 1e-2, log = true }
"train.warmup_steps" = { choices = [5, 20, 50] }
```
"""

from __future__ import annotations

import importlib.util
import math
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prime_train.config.loader import (
    ConfigError,
    KeyPath,
    Problem,
    Sources,
    _first_unknown,
    _override_path,
    _unwrap,
    dotted,
    leaf_annotation,
    read_toml,
    suggest,
    unknown_key_message,
)
from prime_train.config.schema import Config

Scalar = bool | int | float | str
SWEEP_RECORD = "sweep.json"  # in the sweep directory: what `prime-train status SWEEP_DIR` reads (sweep/record.py)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ParamSpec(_Strict):
    """One dimension of the search: a range (`low`, `high`, `log`, `step`) or a list of `choices`."""

    low: int | float | None = Field(None, description="Smallest value of a range.")
    high: int | float | None = Field(None, description="Largest value of a range.")
    log: bool = Field(False, description="Sample the range on a log scale.")
    step: int | float | None = Field(None, gt=0, description="Only multiples of this above `low`.")
    choices: list[Scalar] | None = Field(None, description="The values to choose from, instead of a range.")


class PBTSpec(_Strict):
    interval: int = Field(100, ge=1, description="Steps between exploit/explore rounds.")
    quantile: float = Field(0.25, gt=0, le=0.5, description="Share of the population that copies a better trial.")
    factors: list[float] = Field([0.8, 1.2], min_length=1, description="What explore multiplies a value by.")


class SweepSection(_Strict):
    base: str = Field(description="The run config every trial starts from (relative to SWEEP.toml).")
    name: str = Field("sweep", min_length=1, pattern=r"^[A-Za-z0-9._-]+$", description="The sweep's name.")
    output_dir: str = Field("sweeps", description="Where the sweep directory <output_dir>/<name> goes.")
    metric: str = Field("eval_loss", min_length=1, description="The metrics.jsonl key a trial is judged by.")
    direction: Literal["minimize", "maximize"] = "minimize"
    report: Literal["last", "best"] = Field("last", description="A trial's value: its metric's last or best value.")
    trials: int = Field(10, ge=1, le=100_000, description="Trials in the study, over every sweep process.")
    parallel: int = Field(1, ge=1, le=256, description="Trials at once in this process (PBT: the population).")
    sampler: Literal["grid", "random", "tpe", "cmaes", "pbt"] = "tpe"
    pruner: Literal["none", "median", "hyperband"] = "median"
    seed: int | None = Field(None, description="The sampler's seed.")
    overrides: dict[str, Scalar] = Field(default_factory=dict, description="Run-config keys set for every trial.")
    space: dict[str, ParamSpec] = Field(min_length=1, description="The parameters searched: run-config keys.")
    pbt: PBTSpec = Field(default_factory=PBTSpec)


class _SweepFile(_Strict):
    sweep: SweepSection


def as_override(value: Any) -> str:
    """A value as `--section.key` takes it on the command line."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def is_int_key(key: str) -> bool:
    """Whether the run-config key holds an integer (a range over it is sampled as integers)."""
    return _unwrap(leaf_annotation(_override_path(key))) is int


@dataclass
class SweepSpec:
    """A loaded SWEEP.toml."""

    section: SweepSection
    path: Path
    sources: Sources
    cli_overrides: list[str]

    @property
    def base_path(self) -> Path:
        base = Path(self.section.base).expanduser()
        return base if base.is_absolute() else (self.path.parent / base)

    @property
    def sweep_dir(self) -> Path:
        out = Path(self.section.output_dir).expanduser()
        return (out if out.is_absolute() else Path.cwd() / out).resolve() / self.section.name

    def run_overrides(self, params: dict[str, Any] | None = None) -> list[str]:
        """Every trial's overrides (SWEEP.toml's, then the command line's), then the trial's parameters."""
        out: list[str] = []
        for key, value in self.section.overrides.items():
            out += [f"--{key}", as_override(value)]
        out += self.cli_overrides
        for key, value in (params or {}).items():
            out += [f"--{key}", as_override(value)]
        return out

    def trial_config(self, params: dict[str, Any], run_name: str, extra: list[str] | None = None) -> Config:
        """The run config of one trial: the base, the overrides, its parameters (then `extra`), its run directory in
        the sweep's."""
        from prime_train.validator.lint import load_checked

        where = ["--run.name", run_name, "--run.output_dir", str(self.sweep_dir)]
        return load_checked([str(self.base_path)], self.run_overrides(params) + (extra or []) + where)


def _schema_problems(exc: ValidationError, sources: Sources) -> list[Problem]:
    problems = []
    for err in exc.errors(include_url=False):
        path: KeyPath = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            parent = _SweepFile
            for part in path[:-1]:
                field = parent.model_fields.get(str(part)) if isinstance(parent, type) else None
                inner = _unwrap(field.annotation) if field else None
                if typing.get_origin(inner) is dict:
                    inner = typing.get_args(inner)[1]
                parent = inner
            fields = list(parent.model_fields) if isinstance(parent, type) and issubclass(parent, BaseModel) else []
            hint = suggest(str(path[-1]), fields)
            todo = f"did you mean `{hint}`?" if hint else f"keys there are: {', '.join(fields)}"
            message = f"unknown key `{path[-1]}` in [{dotted(path[:-1])}]; {todo}"
        elif err["type"] == "missing":
            message = f"`{dotted(path)}` is required; add it"
        else:
            message = f"`{dotted(path)}`: {err['msg'][:1].lower() + err['msg'][1:]}, got {err.get('input')!r}"
        problems.append(sources.problem(path, "error", message))
    return problems


def load_spec(path: str | Path, cli_overrides: list[str] | None = None) -> tuple[SweepSpec | None, list[Problem]]:
    """Read and check SWEEP.toml: the spec (None when its schema is broken) and every problem, positioned."""
    data, positions = read_toml(path)  # a missing or malformed file raises ConfigError
    sources = Sources(positions, [str(path)])
    if "sweep" not in data:
        return None, [Problem(str(path), 0, 0, "sweep", "error", f"{path} has no [sweep] section")]
    try:
        section = _SweepFile.model_validate({"sweep": data["sweep"]}).sweep
    except ValidationError as exc:
        return None, _schema_problems(exc, sources)
    extra = [k for k in data if k != "sweep"]
    problems = [sources.problem((k,), "error", f"unknown section [{k}]; SWEEP.toml holds [sweep]") for k in extra]
    spec = SweepSpec(section, Path(path).resolve(), sources, list(cli_overrides or []))
    return spec, problems + sweep_problems(spec)


def is_sweep_dir(path: Path) -> bool:
    return (path / SWEEP_RECORD).is_file()


def is_sweep_file(path: str | Path) -> bool:
    """Whether a file is a SWEEP.toml (it has a [sweep] table); a file that does not parse is not."""
    try:
        data, _ = read_toml(path)
    except ConfigError:
        return False
    return isinstance(data.get("sweep"), dict)


def load_checked_spec(path: str | Path, cli_overrides: list[str] | None = None) -> SweepSpec:
    """A spec to run: its errors raise ConfigError (exit 78); warnings pass."""
    spec, problems = load_spec(path, cli_overrides)
    errors = [p for p in problems if p.severity == "error"]
    if spec is None or errors:
        raise ConfigError(errors or problems)
    return spec


# ---------------------------------------------------------------- lint


def sweep_problems(spec: SweepSpec) -> list[Problem]:
    """What is wrong with a schema-valid [sweep]: parameters that are no run-config keys, empty ranges, a grid the
    trials cannot cover, a sampler that is not installed, and the base config with the extremes of the space."""
    s, src = spec.section, spec.sources
    problems: list[Problem] = []
    for key, param in s.space.items():
        where = ("sweep", "space", key)
        problems += [src.problem(where, sev, msg) for sev, msg in _param_problems(key, param)]
    for key in s.overrides:
        bad = _first_unknown(_override_path(key))
        if bad is not None:
            msg = f"[sweep.overrides] `{key}`: {unknown_key_message(_override_path(key)[: bad + 1])}"
            problems.append(src.problem(("sweep", "overrides", key), "error", msg))
    problems += _sampler_problems(spec)
    if not problems:
        problems += _base_problems(spec)
    return problems


def _param_problems(key: str, p: ParamSpec) -> list[tuple[str, str]]:
    path = _override_path(key)
    bad = _first_unknown(path)
    if len(path) < 2 or bad is not None:
        known = unknown_key_message(path[: (bad if bad is not None else 0) + 1])
        return [("error", f"[sweep.space] `{key}` is no run-config key: {known}")]
    if p.choices is not None:
        if p.low is not None or p.high is not None:
            return [("error", f"`{key}`: give either choices or low/high, not both")]
        return [("error", f"`{key}`: choices is empty; list at least one value")] if not p.choices else []
    if p.low is None or p.high is None:
        return [("error", f"`{key}`: a range needs low and high (or give choices)")]
    if not (math.isfinite(p.low) and math.isfinite(p.high)) or p.low >= p.high:
        return [("error", f"`{key}`: the range is empty: low = {p.low} must be below high = {p.high}")]
    if p.log and p.low <= 0:
        return [("error", f"`{key}`: a log range needs low > 0, got {p.low}")]
    if p.log and p.step is not None:
        return [("error", f"`{key}`: log and step do not go together; drop one")]
    if is_int_key(key) and not all(float(v).is_integer() for v in (p.low, p.high, p.step or 1)):
        return [("error", f"`{key}` is an integer key: low, high and step must be integers")]
    if p.step is not None and p.step > p.high - p.low:
        return [("warning", f"`{key}`: step {p.step} is wider than the range: only low = {p.low} is ever tried")]
    return []


def grid_points(key: str, p: ParamSpec) -> list[Any] | None:
    """The values a grid search tries for a parameter, or None when the range is continuous."""
    if p.choices is not None:
        return list(p.choices)
    if p.low is None or p.high is None:
        return None
    step = p.step if p.step is not None else (1 if is_int_key(key) else None)
    if step is None or p.log:
        return None
    count = math.floor((p.high - p.low) / step + 1e-9) + 1
    if count > 100_000:
        return None
    as_int = is_int_key(key)
    return [int(p.low + i * step) if as_int else p.low + i * step for i in range(count)]


def _sampler_problems(spec: SweepSpec) -> list[Problem]:
    s, src = spec.section, spec.sources
    out: list[Problem] = []
    if s.sampler == "grid":
        size = 1
        for key, p in s.space.items():
            points = grid_points(key, p)
            if points is None:
                msg = f"`{key}`: a grid needs choices or a linear range with a step (an integer key: step 1 is implied)"
                out.append(src.problem(("sweep", "space", key), "error", msg))
                continue
            size *= max(1, len(points))
        if not out and size > s.trials:
            msg = f"the grid has {size} points but trials = {s.trials}: only {s.trials} of them would run"
            out.append(src.problem(("sweep", "trials"), "error", msg + "; raise trials or shrink the space"))
    if s.sampler == "cmaes" and importlib.util.find_spec("cmaes") is None:
        msg = "sampler = 'cmaes' needs the cmaes package: pip install 'prime-train[sweep-cmaes]'"
        out.append(src.problem(("sweep", "sampler"), "error", msg))
    if s.sampler == "pbt" and s.parallel < 2:
        msg = "PBT needs a population: parallel is its size, at least 2"
        out.append(src.problem(("sweep", "parallel"), "error", msg))
    if s.sampler == "pbt" and s.pruner != "none":
        out.append(src.problem(("sweep", "pruner"), "warning", "PBT replaces pruning: the pruner is not used"))
    return out


def _base_problems(spec: SweepSpec) -> list[Problem]:
    """The base config with the overrides and the space at its low and high ends, linted as a run config is."""
    from prime_train.validator.lint import lint_files

    s, src = spec.section, spec.sources
    if not spec.base_path.is_file():
        return [src.problem(("sweep", "base"), "error", f"base = {s.base!r}: {spec.base_path} does not exist")]
    ends: list[dict[str, Any]] = [{}, {}]
    for key, p in s.space.items():
        lo, hi = (p.choices[0], p.choices[-1]) if p.choices else (p.low, p.high)
        ends[0][key], ends[1][key] = lo, hi
    found: dict[str, Problem] = {}  # by message: both ends often say the same
    for params in ends:
        problems, cfg = lint_files([str(spec.base_path)], spec.run_overrides(params))
        for p in problems:
            if p.severity != "error":
                continue
            if p.key in s.space:
                msg = f"`{p.key}` = {params[p.key]!r} (an end of the space) fails the run config: {p.message}"
                p = src.problem(("sweep", "space", p.key), "error", msg)
            found.setdefault(p.message, p)
        if cfg is None:
            continue
        if cfg.ckpt.dir:
            msg = f"the base sets ckpt.dir = {cfg.ckpt.dir!r}: every trial would save into it; unset it for a sweep"
            found.setdefault(msg, src.problem(("sweep", "base"), "error", msg))
        if s.sampler == "pbt" and s.pbt.interval % cfg.train.eval_interval:
            msg = (
                f"pbt.interval = {s.pbt.interval} is no multiple of train.eval_interval = {cfg.train.eval_interval}: "
                f"rounds would be judged by an older {s.metric}"
            )
            found.setdefault(msg, src.problem(("sweep", "pbt", "interval"), "warning", msg))
    return list(found.values())
