"""The result of one check before a launch: pass, warn or fail, a message, and for a fail the fix.

Preflight's checks and the RL token-budget checks (rl/budget.py) both return these, so they live
apart from either: a check can be written without importing the other side's runner.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

PASS, WARN, FAIL = "pass", "warn", "fail"

Status = Literal["pass", "warn", "fail"]


@dataclass
class CheckResult:
    """One check's verdict; `fix` names a config key or a command, `details` carries its figures for --json."""

    name: str
    status: Status
    message: str
    fix: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
