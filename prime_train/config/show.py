"""`prime-train config show`: the resolved config as TOML with every key, the unset ones as comments.

TOML has no null, so a key whose value is unset (model.path, model.tokenizer, a dataset's path or hub id) is
absent from the resolved text; here each is written back as a comment in its own table, with what unset means,
so the screen lists every key a run reads.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from prime_train.config.schema import Config

_HEADER = re.compile(r"^(\[\[?)([^\[\]]+)\]\]?\s*$")


def _unset(model: BaseModel, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], str, str]]:
    """(table path, key, description) of every field of `model` (and of its tables) whose value is None."""
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        if value is None:
            yield path, name, (field.description or "").split(". ")[0].rstrip(".")
        elif isinstance(value, BaseModel):
            yield from _unset(value, (*path, name))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, BaseModel):
                    yield from _unset(item, (*path, name, i))


def _comment(key: str, description: str) -> str:
    return f"# {key} =   (unset){f': {description}' if description else ''}"


def with_unset_keys(text: str, cfg: Config) -> str:
    """`text` (the resolved config's TOML, as dump_toml writes it) with each unset key of `cfg` as a comment at the
    end of its table; a whole table that is unset is written as a commented header with its keys."""
    pending: dict[tuple[Any, ...], list[str]] = {}
    for path, key, description in _unset(cfg):
        pending.setdefault(path, []).append(_comment(key, description))
    out: list[str] = []
    current: tuple[Any, ...] = ()
    counts: dict[str, int] = {}

    def close_table() -> None:
        lines = pending.pop(current, [])
        if lines:
            while out and not out[-1].strip():  # the comments go right under the table's last key
                out.pop()
            out.extend([*lines, ""])

    for line in text.splitlines():
        header = _HEADER.match(line)
        if header:
            close_table()
            dotted = header.group(2).strip()
            parts: tuple[Any, ...] = tuple(dotted.split("."))
            if header.group(1) == "[[":
                counts[dotted] = counts.get(dotted, -1) + 1
                parts = (*parts, counts[dotted])
            current = parts
        out.append(line)
    close_table()
    for path, lines in pending.items():  # tables that are not in the text at all
        name = ".".join(str(p) for p in path if not isinstance(p, int))
        out.extend(["", f"# [{name}]", *lines])
    return "\n".join(out).rstrip("\n") + "\n"
