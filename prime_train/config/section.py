"""The base of every config section (what every key's value must be) and the bounds the sections share."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator
from pydantic_core import PydanticCustomError

# Integers past this do not fit the 64-bit integers TOML, torch and NumPy use.
INT64_MAX = 2**63 - 1
# The longest file name (one path component) Linux filesystems take, in bytes; and a bound on a run directory's
# path that leaves room below PATH_MAX (4096) for what the run writes inside it (checkpoints/step-N.tmp/...).
NAME_MAX = 255
RUN_DIR_MAX = 3800
# Upper bounds of durations: past them Python's waits overflow (threading.TIMEOUT_MAX, timedelta) or the setting
# means "never", which a timeout must not.
DAY_S = 86400.0
YEAR_S = 365 * DAY_S


def _check_values(value: Any) -> None:
    """No NUL character in any string (paths, argv and environment refuse it), no integer past 64 bits."""
    if isinstance(value, str):
        if "\x00" in value:
            raise PydanticCustomError(
                "nul_character",
                "must not contain a NUL character (\\x00): paths, command lines and environments cannot hold one",
            )
    elif isinstance(value, int) and not isinstance(value, bool):
        if not -INT64_MAX <= value <= INT64_MAX:
            raise PydanticCustomError("int_too_large", "must fit in 64 bits (at most 2**63 - 1)")
    elif isinstance(value, list | tuple):
        for item in value:
            _check_values(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_values(key)
            _check_values(item)


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are validated, floats are finite (an inf or
    NaN learning rate, timeout or interval is never meant), strings hold no NUL, integers fit in 64 bits."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _values_the_system_takes(cls, value: Any) -> Any:
        _check_values(value)
        return value
