"""One known failure as data: its wording (regex phrases, each with where it comes from), its kind and its hint.

patterns.py and patterns_env.py hold the tables of them; logscan.LogScanner runs them. Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prime_train.kit.failures import FailureKind

FATAL = "fatal"
WARNING = "warning"


@dataclass(frozen=True)
class Pattern:
    """One known failure or warning: how to spot its line, what it means and what to do about it."""

    name: str
    regex: re.Pattern[str]
    kind: FailureKind | None  # None: a warning only, never the cause of a death
    severity: str  # FATAL or WARNING
    hint: str  # what to do, one line; names the config key where there is one
    # Substrings (case-sensitive), one of which every line the regex matches contains. All
    # patterns' needles together make one gate regex: most lines contain none of them, and
    # those lines never reach the per-pattern regexes. Empty: the regex runs on every line.
    needles: tuple[str, ...] = ()
    # Where each phrase of the regex comes from (which program prints it, which versions): the
    # reason the phrase is here, and where to look when its wording changes.
    sources: tuple[str, ...] = ()
    # Whether a match may span a wrapped line (see logscan._wrapped). Off for key-value patterns: the end of
    # one line glued to the next would make new keys ("Best loss: inf" + "val_loss = inf").
    wraps: bool = True

    def search(self, line: str) -> bool:
        """Whether `line` shows this pattern."""
        for needle in self.needles:
            if needle in line:
                return self.regex.search(line) is not None
        return not self.needles and self.regex.search(line) is not None


def pattern(
    name: str,
    kind: FailureKind | None,
    hint: str,
    needles: tuple[str, ...],
    *phrases: tuple[str, str],
    wraps: bool = True,
) -> Pattern:
    """A Pattern from (regex, source) phrases; the regex matches any of them."""
    regex = re.compile("|".join(f"(?:{rx})" for rx, _ in phrases))
    severity = FATAL if kind is not None else WARNING
    return Pattern(name, regex, kind, severity, hint, needles, tuple(source for _, source in phrases), wraps)
