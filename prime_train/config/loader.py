"""Load run configs: TOML files merged in order, `--section.key value` overrides, validation.

Every mistake becomes a `Problem` with the file, line, column and key path, worded as what is
wrong and what to do. Nothing here raises a bare traceback for a user's mistake.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import tomllib
import types
import typing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from prime_train.config.schema import Config
from prime_train.config.source import KeyPath, Position, locate, scan_positions

COMMAND_LINE = "<command line>"

# How a run directory's config.toml stores a secret value (kit/redact.py decides which values are secret).
MASK = "***"
# Set by the supervisor for its job's processes: JSON [[key path, real value], ...] of each string that its
# config.toml holds masked, so the job reads the real values back while the file never has them.
ENV_CONFIG_SECRETS = "PRIME_TRAIN_CONFIG_SECRETS"


@dataclass
class Problem:
    file: str
    line: int
    column: int
    key: str
    severity: str  # "error" | "warning"
    message: str

    def format(self) -> str:
        where = self.file if self.line <= 0 else f"{self.file}:{self.line}:{self.column}"
        return f"{where}: {self.severity}: {self.message}"

    def sort_key(self) -> tuple[str, int, int]:
        return (self.file, self.line, self.column)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ConfigError(Exception):
    """A config that cannot be used; carries every problem found."""

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(p.format() for p in problems))


@dataclass
class Sources:
    """Which file and line each key of a merged config came from."""

    positions: dict[KeyPath, Position]
    files: list[str]

    def locate(self, path: KeyPath) -> tuple[str, int, int]:
        pos = locate(self.positions, path)
        if pos is not None:
            return pos.file, pos.line, pos.column
        return (self.files[-1] if self.files else COMMAND_LINE), 1 if self.files else 0, 1 if self.files else 0

    def problem(self, path: KeyPath, severity: str, message: str) -> Problem:
        file, line, col = self.locate(path)
        return Problem(file, line, col, dotted(path), severity, message)


def dotted(path: KeyPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# ---------------------------------------------------------------- schema navigation


def _unwrap(annotation: Any) -> Any:
    """Strip Optional/Union-with-None and return the inner annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _unwrap(args[0])
    return annotation


def model_at(path: KeyPath, root: type[BaseModel] = Config) -> type[BaseModel] | None:
    """The pydantic model that holds the keys under `path`, or None when `path` is not a table."""
    current: Any = root
    for part in path:
        if isinstance(part, int):
            if typing.get_origin(current) is list:
                current = _unwrap(typing.get_args(current)[0])
                continue
            return None
        if not (isinstance(current, type) and issubclass(current, BaseModel)):
            return None
        field = current.model_fields.get(part)
        if field is None:
            return None
        current = _unwrap(field.annotation)
        if typing.get_origin(current) is list:
            inner = _unwrap(typing.get_args(current)[0])
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                current = list[inner]  # keep the list so an index can follow
    if isinstance(current, type) and issubclass(current, BaseModel):
        return current
    return None


def leaf_annotation(path: KeyPath) -> Any:
    """The type of the field at `path` (for a key inside a dict field, the dict's value type); None if unknown."""
    if not path:
        return None
    model = model_at(path[:-1])
    if model is not None and isinstance(path[-1], str):
        field = model.model_fields.get(path[-1])
        return field.annotation if field else None
    parent = _unwrap(leaf_annotation(path[:-1]))
    if typing.get_origin(parent) is dict and isinstance(path[-1], str):
        return typing.get_args(parent)[1]
    return None


def _accepts_none(annotation: Any) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation)


# Names other trainers (HF Trainer, torchtitan, prime-rl, nanoGPT) use for the same setting.
KNOWN_ALIASES = {
    "learning_rate": "lr",
    "lerning_rate": "lr",
    "steps": "max_steps",
    "num_steps": "max_steps",
    "total_steps": "max_steps",
    "training_steps": "max_steps",
    "batch_size": "global_batch_size",
    "micro_batch": "micro_batch_size",
    "gradient_clipping": "grad_clip",
    "max_norm": "grad_clip",
    "max_grad_norm": "grad_clip",
    "warmup": "warmup_steps",
    "lr_scheduler": "scheduler",
    "save_interval": "interval",
    "checkpoint_interval": "interval",
    "keep_latest_k": "keep_last",
    "save_total_limit": "keep_last",
    "seq_length": "seq_len",
    "max_seq_len": "seq_len",
    "sequence_length": "seq_len",
    "model_name": "path",
    "name_or_path": "path",
    "model_path": "path",
    "output": "output_dir",
    "out_dir": "output_dir",
    "max_retries": "max_restarts",
    "stall_timeout": "stall_timeout_s",
    "checkpoint": "ckpt",
    "checkpointing": "ckpt",
    "optimizer": "train",
    "parallelism": "distributed",
    "wandb": "logging",
}


def suggest(name: str, choices: typing.Iterable[str]) -> str | None:
    choices = list(choices)
    alias = KNOWN_ALIASES.get(name)
    if alias in choices:
        return alias
    matches = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_message(path: KeyPath) -> str:
    parent, name = path[:-1], str(path[-1])
    model = model_at(parent)
    if model is None and parent:
        where = dotted(parent)
        if typing.get_origin(_unwrap(leaf_annotation(parent))) is list:
            return f"`{where}` is a list of tables; name an item to set `{name}`, e.g. {where}.0.{name}"
        return f"`{where}` is a value, not a table, so it has no key `{name}`; set `{where}` itself"
    fields = list(model.model_fields) if model else []
    hint = suggest(name, fields)
    if not parent:
        what = f"unknown section [{name}]"
        todo = f"did you mean [{hint}]?" if hint else f"sections are: {', '.join(fields)}"
    else:
        what = f"unknown key `{name}` in [{dotted(parent)}]"
        todo = f"did you mean `{hint}`?" if hint else f"keys there are: {', '.join(fields)}"
    return f"{what}; {todo}"


# ---------------------------------------------------------------- loading and merging


_TOML_POS = re.compile(r"\(at line (\d+), column (\d+)\)")


# A run config is a few KB; one over this is the wrong file (a dataset, a log) and parsing it would take minutes and
# gigabytes (tomllib on a 100 MB array: 1.2 GB): it is refused before it is parsed.
MAX_CONFIG_BYTES = 1 << 20


def _read_config_text(path: str | Path, name: str) -> str:
    """The text of a config file, read no further than MAX_CONFIG_BYTES (a pipe, `<(...)`, is read the same way)."""
    with open(path, "rb") as fh:
        data = fh.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            try:
                size = os.fstat(fh.fileno()).st_size
            except OSError:
                size = 0
            limit = f"the {MAX_CONFIG_BYTES >> 20} MiB limit for a config"
            what = f"{size / 2**20:.1f} MiB, over {limit}" if size > MAX_CONFIG_BYTES else f"over {limit}"
            message = f"config file {name} is {what} (a run config is a few KB); not read: is it the right file?"
            raise ConfigError([Problem(name, 0, 0, "", "error", message)])
    # as Path.read_text did: universal newlines (a \r\n file reads as \n)
    return data.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


def read_toml(path: str | Path) -> tuple[dict[str, Any], dict[KeyPath, Position]]:
    """Parse one TOML file; a syntax error, unreadable file or one too big to be a config becomes a ConfigError."""
    name = str(path)
    try:
        text = _read_config_text(path, name)
    except FileNotFoundError:
        near = near_paths(name)
        hint = f"; did you mean {' or '.join(near)}?" if near else ""
        raise ConfigError([Problem(name, 0, 0, "", "error", f"config file {name} does not exist{hint}")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem(name, 0, 0, "", "error", f"cannot read {name}: {exc}")]) from None
    try:
        data = tomllib.loads(text)
    except RecursionError:
        # tomllib recurses once per nesting level of arrays and inline tables and gives no position:
        # point at the line that opens the most of them
        lines = text.split("\n")
        line = 1 + max(range(len(lines)), key=lambda i: lines[i].count("[") + lines[i].count("{"))
        raise ConfigError(
            [Problem(name, line, 1, "", "error", "TOML syntax error: values nested too deeply; flatten them")]
        ) from None
    except tomllib.TOMLDecodeError as exc:
        msg = str(exc)
        m = _TOML_POS.search(msg)
        last_line = text.count("\n") + (not text.endswith("\n"))  # TOML lines end at \n only
        line, col = (int(m.group(1)), int(m.group(2))) if m else (max(1, last_line), 1)
        detail = _TOML_POS.sub("", msg).replace("(at end of document)", "at end of file").strip()
        raise ConfigError(
            [Problem(name, line, col, "", "error", f"TOML syntax error: {detail}; fix the syntax on this line")]
        ) from None
    return data, scan_positions(text, name)


def near_paths(path: str, limit: int = 3) -> list[str]:
    """Existing paths whose names are close to a missing `path`'s, in the nearest directory that exists
    (`configs/tiny-sf.toml` -> `configs/tiny-sft.toml`), written as `path` was (relative stays relative)."""
    given = Path(path)
    missing, rest = given, Path()
    while not missing.parent.is_dir() and missing.parent != missing.parent.parent:
        # the first missing part is the one to match; what follows it must then exist below the match
        missing, rest = missing.parent, Path(missing.name) / rest
    parent = missing.parent
    try:
        names = [entry.name for entry in parent.iterdir()]
    except OSError:
        return []
    near = []
    for name in difflib.get_close_matches(missing.name, names, n=limit, cutoff=0.6):
        candidate = parent / name / rest if str(rest) != "." else parent / name
        if candidate.exists():
            near.append(str(candidate))
    return near


def merge(base: dict[str, Any], overlay: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge overlay into a copy of base: tables merge, everything else is replaced."""
    out = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override_args(args: list[str]) -> list[tuple[str, str]]:
    """Turn ['--train.lr', '3e-4', '--train.compile', '--run.name=x'] into (key, raw value) pairs."""
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--") or len(token) <= 2:
            raise ConfigError(
                [
                    Problem(
                        COMMAND_LINE,
                        0,
                        0,
                        token,
                        "error",
                        f"unexpected argument {token!r}; overrides look like --section.key value",
                    )
                ]
            )
        body = token[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not (
            args[i + 1].startswith("--") and len(args[i + 1]) > 2 and not is_number(args[i + 1])
        ):
            key, raw = body, args[i + 1]
            i += 2
        else:
            key, raw = body, "true"
            i += 1
        pairs.append((key.replace("-", "_") if "." not in key else key, raw))
    return pairs


def is_number(text: str) -> bool:
    """Whether a command-line token is a number ("-1e-4" is a value, not a flag)."""
    try:
        float(text)
    except ValueError:
        return False
    return True


def coerce(raw: str) -> Any:
    """Read a command-line value as TOML (numbers, booleans, lists), else keep it as a string."""
    if raw.lower() in ("none", "null"):
        return None
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def coerce_for(path: KeyPath, raw: str) -> Any:
    """Read an override the way its field wants it: text fields keep the text as typed (`--run.name 2024`)."""
    annotation = leaf_annotation(path)
    if raw.lower() in ("none", "null"):
        # unset where the field can be unset; else the word itself, which a choice field may name
        # (--lora.quantize none, --model.activation_checkpointing none)
        return None if _accepts_none(annotation) else raw.lower()
    if _unwrap(annotation) is str:
        return raw
    return coerce(raw)


def _override_path(key: str) -> KeyPath:
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def _first_unknown(path: KeyPath) -> int | None:
    """Index of the first part of `path` the schema does not know, or None when all are known."""
    for n, part in enumerate(path):
        if isinstance(part, int):
            continue
        model = model_at(path[:n])
        if model is not None and part in model.model_fields:
            continue
        # a dict field (job.env) takes any key, but nothing below it
        if n == len(path) - 1 and typing.get_origin(_unwrap(leaf_annotation(path[:n]))) is dict:
            continue
        return n
    return None


def apply_overrides(
    data: dict[str, Any], pairs: list[tuple[str, str]], positions: dict[KeyPath, Position]
) -> dict[str, Any]:
    """Set each `section.key` to its coerced value; an unknown key is an error naming it."""
    out = copy.deepcopy(data)
    problems: list[Problem] = []
    for key, raw in pairs:
        path = _override_path(key)
        if len(path) < 2:
            problems.append(
                Problem(
                    COMMAND_LINE,
                    0,
                    0,
                    key,
                    "error",
                    f"--{key}: overrides name a section and a key, e.g. --train.max_steps 50",
                )
            )
            continue
        parent, leaf = path[:-1], path[-1]
        bad = _first_unknown(path)
        if bad is not None:
            problems.append(
                Problem(COMMAND_LINE, 0, 0, key, "error", f"--{key}: {unknown_key_message(path[: bad + 1])}")
            )
            continue
        node: Any = out
        for part in parent:
            if isinstance(part, int):
                if not isinstance(node, list) or part >= len(node):
                    where = dotted(parent[: parent.index(part)])
                    problems.append(
                        Problem(
                            COMMAND_LINE,
                            0,
                            0,
                            key,
                            "error",
                            f"--{key}: {where} has no item {part} in the config files; add it there first",
                        )
                    )
                    node = None
                    break
                node = node[part]
            else:
                node = node.setdefault(part, {}) if isinstance(node, dict) else None
            if node is None:
                break
        if node is None:
            continue
        if isinstance(node, dict):
            node[leaf] = coerce_for(path, raw)
            positions[path] = Position(COMMAND_LINE, 0, 0)
    if problems:
        raise ConfigError(problems)
    return out


def load_raw(paths: list[str | Path], overrides: list[str] | None = None) -> tuple[dict[str, Any], Sources]:
    """Read, merge and override: the raw dict a Config is validated from, with where each key came from."""
    data: dict[str, Any] = {}
    positions: dict[KeyPath, Position] = {}
    problems: list[Problem] = []
    for path in paths:
        try:
            part, pos = read_toml(path)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        data = merge(data, part)
        positions.update(pos)
    if problems:
        raise ConfigError(problems)
    restore_secrets(data)
    if overrides:
        data = apply_overrides(data, parse_override_args(overrides), positions)
    return data, Sources(positions, [str(p) for p in paths])


def restore_secrets(data: dict[str, Any], env: typing.Mapping[str, str] | None = None) -> None:
    """Put the real values back where a run directory's config.toml holds them masked (`***`), from what the
    supervisor passed its job in ENV_CONFIG_SECRETS; without that variable, nothing changes."""
    raw = (os.environ if env is None else env).get(ENV_CONFIG_SECRETS)
    if not raw:
        return
    try:
        entries = json.loads(raw)
    except ValueError:
        return
    for entry in entries if isinstance(entries, list) else []:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list) and entry[0]):
            continue
        (*parents, leaf), value = entry
        node: Any = data
        for part in parents:
            node = _child(node, part)
        # only a masked value is replaced: an override or an edited file wins over what the supervisor passed
        current = _child(node, leaf)
        if isinstance(current, str) and MASK in current and isinstance(value, str):
            node[leaf] = value


def _child(node: Any, part: Any) -> Any:
    if isinstance(node, dict) and isinstance(part, str):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and not isinstance(part, bool) and 0 <= part < len(node):
        return node[part]
    return None


# ---------------------------------------------------------------- validation


def _field_description(path: KeyPath) -> str | None:
    model = model_at(path[:-1])
    if model is None or not isinstance(path[-1], str):
        return None
    field = model.model_fields.get(path[-1])
    return field.description if field else None


_DOTTED_KEY = re.compile(r"\b[A-Za-z_]+(?:\.[A-Za-z_]+)+\b")


def _named_field(path: KeyPath, msg: str, sources: Sources) -> KeyPath:
    """A section-wide check's error belongs to the field its message names, preferably one written in a file."""
    model = model_at(path)
    if model is None:
        return path
    named = []
    for m in _DOTTED_KEY.finditer(msg):
        prefix, _, field = m.group().rpartition(".")
        if prefix == dotted(path) and field in model.model_fields:
            named.append((*path, field))
    written = [p for p in named if p in sources.positions]
    return (written or named or [path])[0]


def _type_hint(kind: str, path: KeyPath, given: Any) -> str:
    """What to write instead, for the mistakes that have an obvious fix."""
    if kind == "literal_error" and isinstance(given, str):
        annotation = _unwrap(leaf_annotation(path))
        if typing.get_origin(annotation) is typing.Literal:
            hint = suggest(given, [str(a) for a in typing.get_args(annotation)])
            if hint:
                return f"; did you mean {hint!r}?"
    quoted_scalar = isinstance(given, str) and not isinstance(coerce(given), str)
    if kind in ("int_type", "float_type", "bool_type") and quoted_scalar:
        return "; write numbers and booleans without quotes"
    return ""


def validation_problems(exc: ValidationError, sources: Sources) -> list[Problem]:
    """Word pydantic's errors for people: the key, what is wrong, what is expected."""
    problems: list[Problem] = []
    for err in exc.errors(include_url=False):
        path: KeyPath = tuple(err["loc"])
        kind = err["type"]
        key = dotted(path)
        if kind == "extra_forbidden":
            problems.append(sources.problem(path, "error", unknown_key_message(path)))
            continue
        if kind == "missing":
            desc = _field_description(path)
            problems.append(
                sources.problem(path, "error", f"`{key}` is required" + (f": {desc}" if desc else "") + "; add it")
            )
            continue
        msg = err["msg"]
        if kind == "value_error":
            msg = msg.removeprefix("Value error, ")
            problems.append(sources.problem(_named_field(path, msg, sources), "error", msg))
            continue
        given = err.get("input")
        desc = _field_description(path)
        text = f"`{key}`: {msg[:1].lower() + msg[1:]}, got {given!r}"
        if desc:
            text += f" ({desc})"
        text += _type_hint(kind, path, given)
        problems.append(sources.problem(path, "error", text))
    return problems


def validate(data: dict[str, Any], sources: Sources) -> Config:
    """Build a Config from merged raw data or raise ConfigError with every positioned problem (see validate_all)."""
    cfg, problems, _ = validate_all(data, sources)
    if cfg is None or problems:
        raise ConfigError(problems)
    return cfg


# Rounds of validate_all: each drops what the last one rejected; a config rarely needs more than two or three.
MAX_VALIDATION_ROUNDS = 8


def validate_all(data: dict[str, Any], sources: Sources) -> tuple[Config | None, list[Problem], dict[KeyPath, str]]:
    """Every schema problem of `data` in one pass: (the config with the rejected values replaced by defaults, or None
    when none can be built; the problems, sorted; the key paths that were dropped, with the kind of error each had).

    pydantic checks a section's cross-field rules (and the whole config's) only once its fields are valid, so one
    validation shows the first layer of mistakes and hides the rest. Each round drops what the last rejected and
    validates again; a problem of a later round that names a dropped key is left out (it would be about a default
    nobody wrote). The config returned lets lint's own cross-field checks run on what is left."""
    if not isinstance(data, dict):
        return None, [sources.problem((), "error", "a config is a TOML table of sections")], {}
    problems: list[Problem] = []
    seen: set[tuple[str, str]] = set()
    dropped: dict[KeyPath, str] = {}
    current = copy.deepcopy(data)
    for _ in range(MAX_VALIDATION_ROUNDS):
        try:
            # strict: TOML has real numbers and booleans, so `max_steps = true` or `compile = 1` is a mistake to
            # report, not a value to convert
            cfg = Config.model_validate(current, strict=True)
        except ValidationError as exc:
            for problem in validation_problems(exc, sources):
                if (problem.key, problem.message) not in seen and not names_dropped(problem, dropped):
                    seen.add((problem.key, problem.message))
                    problems.append(problem)
            progressed = False
            for err in exc.errors(include_url=False):
                target = _droppable(tuple(err["loc"]), err["type"])
                if target and _drop(current, target):
                    dropped[target] = err["type"]
                    progressed = True
            if not progressed:
                return None, sorted(problems, key=Problem.sort_key), dropped
            continue
        return cfg, sorted(problems, key=Problem.sort_key), dropped
    return None, sorted(problems, key=Problem.sort_key), dropped


def names_dropped(problem: Problem, dropped: dict[KeyPath, str]) -> bool:
    """Whether `problem` may be about a key validate_all dropped (its key or a key its message names), rather than
    about what the user wrote: a rule of the table that lost an unknown key (a typo of a key the rule wants), or
    one whose message names the dropped field."""
    for path, kind in dropped.items():
        key = dotted(path)
        if problem.key == key or problem.key.startswith((key + ".", key + "[")):
            return True
        if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", problem.message):
            return True
        holds_it = not problem.key or key.startswith((problem.key + ".", problem.key + "["))
        if holds_it and (kind == "extra_forbidden" or re.search(rf"\b{re.escape(str(path[-1]))}\b", problem.message)):
            return True
    return False


def _droppable(loc: KeyPath, kind: str) -> KeyPath | None:
    """What to drop so the next round gets past the error at `loc`: the key, a whole list it is in (items shift),
    or the table a missing key or a table-wide rule belongs to; None for the whole config's own rules."""
    if kind == "missing":
        loc = loc[:-1]
    if loc and isinstance(loc[-1], int):  # a whole item: removing it would shift the others, so the list goes
        loc = loc[: next(i for i, part in enumerate(loc) if isinstance(part, int))]
    # a dict field's key (job.env.X) or a value inside one: drop the field
    for n in range(1, len(loc)):
        if typing.get_origin(_unwrap(leaf_annotation(loc[:n]))) is dict:
            return loc[:n]
    return loc or None


def _drop(data: dict[str, Any], path: KeyPath) -> bool:
    """Remove `path` from the raw data; False when it is not there (nothing changed)."""
    node: Any = data
    for part in path[:-1]:
        node = _child(node, part)
    if isinstance(node, dict) and path[-1] in node:
        del node[path[-1]]
        return True
    return False


def load_config(paths: list[str | Path], overrides: list[str] | None = None) -> Config:
    """Load a run config from TOML files and overrides. No files: the defaults (the tiny CPU run)."""
    data, sources = load_raw(paths, overrides)
    return validate(data, sources)


def to_toml_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as TOML-ready data (None values are left out: TOML has no null)."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if v is not None}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(cfg.model_dump(mode="json"))


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML text (what `config show` prints and a run directory keeps)."""
    import tomli_w

    return tomli_w.dumps(to_toml_dict(cfg))
