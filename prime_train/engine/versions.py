"""The installed torch's (major, minor) version: what the engine's version gates compare (a local build's suffix,
"+cu130" or "+cpu", left out)."""

from __future__ import annotations

import torch


def torch_minor() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)
