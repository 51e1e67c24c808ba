"""The SkyPilot task as YAML text, the same bytes for the same task, without a YAML library.

`run --spot --dry-run` prints it and users diff it between runs, so key order and quoting are fixed:
the task's keys in SkyPilot's documented order, strings as JSON strings (valid double-quoted YAML
scalars), multi-line scripts as block literals where that is safe. SkyPilot's own parser reads it
back (tests/test_spot.py), and PyYAML round-trips awkward values.
"""

from __future__ import annotations

import json
import re
from typing import Any

_TOP_ORDER = ("name", "resources", "num_nodes", "workdir", "file_mounts", "envs", "secrets", "setup", "run")
_PLAIN_KEY = re.compile(r"^[A-Za-z_~][A-Za-z0-9_.\-/~]*$")
_YAML_WORDS = {"y", "n", "yes", "no", "on", "off", "true", "false", "null", "~"}


def _key(k: str) -> str:
    return k if _PLAIN_KEY.match(k) and k.lower() not in _YAML_WORDS else json.dumps(k, ensure_ascii=False)


def _scalar(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    return json.dumps(str(v), ensure_ascii=False)  # a JSON string is a valid double-quoted YAML scalar


def _block_literal_ok(s: str) -> bool:
    return (
        s.endswith("\n")
        and not s.endswith("\n\n")
        and not s[:1].isspace()
        and all(ch == "\n" or ch == "\t" or ch >= " " for ch in s)
        and not any(line.endswith((" ", "\t")) for line in s.splitlines())
    )


def _emit(value: Any, indent: int, out: list[str], lead: str) -> None:
    """Append `value` introduced by `lead` (a key or a list dash, itself indented by `indent`)."""
    child = indent + 2
    if isinstance(value, dict):
        if not value:
            out.append(f"{lead} {{}}")
            return
        out.append(lead)
        for k, v in value.items():
            _emit(v, child, out, f"{' ' * child}{_key(str(k))}:")
        return
    if isinstance(value, list | tuple):
        if not value:
            out.append(f"{lead} []")
            return
        if all(not isinstance(v, dict | list | tuple) for v in value):
            out.append(f"{lead} [{', '.join(_scalar(v) for v in value)}]")
            return
        out.append(lead)
        for item in value:
            if isinstance(item, dict) and item:
                for j, (k, v) in enumerate(item.items()):
                    _emit(v, child + 2, out, f"{' ' * child}{'- ' if j == 0 else '  '}{_key(str(k))}:")
            else:
                _emit(item, child + 2, out, f"{' ' * child}-")
        return
    if isinstance(value, str) and "\n" in value and _block_literal_ok(value):
        out.append(f"{lead} |")
        out.extend(f"{' ' * child}{line}" if line else "" for line in value[:-1].split("\n"))
        return
    out.append(f"{lead} {_scalar(value)}")


def render_yaml(task: dict[str, Any]) -> str:
    """The task as YAML, the same bytes for the same task: `run --spot --dry-run` output can be diffed."""
    ordered = {k: task[k] for k in _TOP_ORDER if k in task}
    ordered.update({k: task[k] for k in sorted(task) if k not in ordered})
    out: list[str] = []
    for k, v in ordered.items():
        _emit(v, 0, out, f"{_key(k)}:")
    return "\n".join(out) + "\n"
