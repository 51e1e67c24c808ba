"""Secrets out of everything the supervisor shows or stores: log lines, events, environments, config.toml.

Three kinds of rule. Token shapes that are secret wherever they appear (hf_…, sk-…, ghp_…, AKIA…, a
password in a URL, a Bearer token, a 40-hex key on a line about W&B). Values that are secret because of
the name in front of them in the same text (HF_TOKEN=…, "api_key": "…", --hf-token …); that name test
is deliberately narrow: `max_tokens=256`, `tokenizer: …` and `pad_token=<|endoftext|>` are ordinary
training-log text and must survive untouched. And values known to be secret wherever they appear,
with no name or shape beside them: a `Redactor` is built from the environment and the run's config,
collects every value whose variable, key or flag is named like a credential (KEY, TOKEN, SECRET,
PASSWORD, PASS, PWD, CREDENTIAL, AUTH, PRIVATE) and masks each occurrence, in any escaped form a program
prints it in (JSON, a repr, URL encoding, shell quoting: a secret holding `\\` or `"` never appears as itself
in a traceback). Every file the supervisor writes and every line it or `status`/`diagnose` prints goes
through one. The process logs under logs/ get the value rule as they are written (process.py); the shape
and name rules, too slow for every byte a chatty job prints, are applied where a log is shown.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prime_train.config.schema import Config

REDACTED = "[REDACTED]"

# Token shapes. The lookbehinds keep a shape from matching inside a longer word
# ("task-…" is not an "sk-" key, "ghp_" inside an identifier is not a GitHub token).
_SHAPES = [
    re.compile(r"(?<![A-Za-z0-9_])hf_[A-Za-z0-9]{30,}"),
    # OpenAI (sk-…, sk-proj-…) and Anthropic (sk-ant-…) keys
    re.compile(r"(?<![A-Za-z0-9_\-])sk-(?:ant-|proj-)?[A-Za-z0-9][A-Za-z0-9_\-]{19,}"),
    re.compile(r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})"),
    re.compile(r"(?<![A-Z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])"),
]

# A secret after a fixed lead-in; group "pre" is kept.
_AFTER = [
    re.compile(r"(?i)(?P<pre>\bBearer\s+)[A-Za-z0-9._~+/\-]{8,}=*"),
    re.compile(r"(?i)(?P<pre>\bAuthorization[\"']?\s*[:=]\s*[\"']?(?:Basic|Token)\s+)[^\s\"',]+"),
    # `wandb login [--relogin] [--host URL] KEY`: the key is the first long run after the flags
    re.compile(r"(?i)(?P<pre>\bwandb\s+login\b(?:\s+\S+)*?\s+[\"']?)[A-Za-z0-9_\-]{40,}(?=[\s\"']|$)"),
    # credentials inside a URL: scheme://user:password@host
    re.compile(r"(?P<pre>\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^/\s:@]+:)[^/\s@]+(?=@)"),
    # a W&B API key (40 hex digits) on a line that is about W&B: `wandb_key: …`, `--wandb-key …`, `wandb … key …`
    re.compile(r"(?i)(?P<pre>wandb.*?(?<![0-9a-f]))[0-9a-f]{40}(?![0-9a-f])"),
]

_KEYWORD = r"(?:token|secret|passw(?:or)?d|passphrase|api[_\-]?key|apikey|access[_\-]?key|private[_\-]?key)"

# NAME=value, NAME: value, "name": "value", 'name': 'value', ?access_token=value&… . The name must
# contain a keyword; is_secret_name() then decides, so that `max_tokens=256` is left alone.
_ASSIGNMENT = re.compile(
    rf"(?i)(?<![\w.\-])(?P<q>[\"']?)(?P<key>[\w.\-]*{_KEYWORD}[\w.\-]*)(?P=q)(?P<sep>\s*[:=]\s*)"
    # a quoted value up to its closing quote, past escaped quotes (`"pa\"ss"` in JSON or a repr)
    r"(?P<val>\[REDACTED\]|\"(?:[^\"\\]|\\.)*\"|'(?:[^'\\]|\\.)*'|[^\s\"',;&)}\]]+)"
)

# --hf-token VALUE, --api-key=VALUE, --wandb-api-key VALUE
_FLAG = re.compile(rf"(?i)(?<![\w\-])--(?P<key>[\w\-]*{_KEYWORD}[\w\-]*)(?P<sep>=|\s+)(?P<val>[^\s\"'\-][^\s\"']*)")

# Cheap gate: a line without any of these cannot hold anything the rules above redact.
_TRIGGERS = (
    "hf_", "sk-", "gh", "github_pat_", "akia", "asia", "bearer", "authorization", "wandb", "://",
    "token", "secret", "passw", "passphrase", "key",
)  # fmt: skip

# Values that say whether a secret is set without being one; hiding them hides the useful part.
_NOT_SECRET_VALUES = {
    "", "none", "null", "nil", "true", "false", "yes", "no", "0", "1", "set", "unset", "present", "missing",
    "required", "optional", "redacted", REDACTED.lower(), "<redacted>", "***", "<unset>", "<none>", "...",
}  # fmt: skip

# Name parts that make "token" mean a vocabulary item or a count rather than a credential.
_TOKEN_VOCAB_BEFORE = {
    "pad", "eos", "bos", "unk", "sep", "cls", "mask", "special", "start", "end", "stop", "image", "video",
    "audio", "vision", "tool", "think", "added", "decoder", "default", "im", "first", "last", "next", "per",
}  # fmt: skip
_TOKEN_COUNT_AFTER = {
    "id", "ids", "count", "counts", "len", "length", "limit", "limits", "budget", "num", "type", "types",
    "index", "idx", "usage", "per", "rate", "size", "level", "logprobs", "str",
}  # fmt: skip
_SECRET_JOINED = ("secret", "password", "passwd", "passphrase", "apikey", "accesskey", "privatekey")


def _name_parts(name: str) -> list[str]:
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", name)
    return [p for p in re.split(r"[_\-.\s]+", spaced.lower()) if p]


def is_secret_name(name: str) -> bool:
    """Whether a variable, key or flag called `name` holds a credential (HF_TOKEN yes, max_tokens no)."""
    parts = _name_parts(name)
    joined = "".join(parts)
    if any(word in joined for word in _SECRET_JOINED):
        return True
    for i, part in enumerate(parts):
        if part != "token":
            continue
        before = parts[i - 1] if i > 0 else ""
        after = parts[i + 1] if i + 1 < len(parts) else ""
        if before in _TOKEN_VOCAB_BEFORE or after in _TOKEN_COUNT_AFTER:
            continue
        return True
    return False


# The broad rule, for names chosen for a value (environment variables, keys of job.env or rl.env_args, flags):
# any of these as a whole part of the name. `is_secret_name` is the narrow one, for words in free log text.
_SECRET_PARTS = {
    "key", "keys", "secret", "secrets", "password", "passwords", "passwd", "pass", "pwd", "passphrase",
    "credential", "credentials", "creds", "auth", "apikey", "privatekey", "accesskey",
}  # fmt: skip
# PWD and OLDPWD are the shell's working directories; a public key is not a secret; SSH_AUTH_SOCK is a path.
_NEVER_SECRET_NAMES = {"pwd", "oldpwd"}
_NEVER_SECRET_PARTS = {"public", "pub", "sock", "socket"}
# `--no-auth`, `--disable-auth`: switches, whatever follows them is not their value
_SWITCH_PREFIXES = {"no", "disable", "enable", "skip"}
_FLAG_ITEM = re.compile(r"--?(?P<name>[A-Za-z][\w\-.]*)(?:=(?P<value>.*))?", re.DOTALL)


def looks_secret_name(name: str) -> bool:
    """Whether a name chosen for a value (an environment variable, a config key, a flag) says it is a credential.

    Broader than is_secret_name: KEY, SECRET, PASSWORD, PASS, PWD, CREDENTIAL, AUTH, PRIVATE (with another
    part: PRIVATE_PEM) as a whole part of the name, or a credential TOKEN (WANDB_KEY, DB_PASS, SSH_PRIVATE_PEM
    yes; PWD, SSH_AUTH_SOCK, PUBLIC_KEY, KEYBOARD, max_tokens no)."""
    if name.lower() in _NEVER_SECRET_NAMES:
        return False
    parts = _name_parts(name)
    if any(p in _NEVER_SECRET_PARTS for p in parts):
        return False
    if is_secret_name(name) or any(p in _SECRET_PARTS for p in parts):
        return True
    return "private" in parts and len(parts) > 1


def _is_secret_flag(name: str) -> bool:
    parts = _name_parts(name)
    return bool(parts) and parts[0] not in _SWITCH_PREFIXES and looks_secret_name(name)


def _is_placeholder(value: str) -> bool:
    bare = value.strip("\"'")
    return bare.lower() in _NOT_SECRET_VALUES or bare.startswith("$")


def _redact_assignment(m: re.Match[str]) -> str:
    value = m.group("val")
    if not is_secret_name(m.group("key")) or _is_placeholder(value):
        return m.group(0)
    quote = value[0] if value[:1] in ("'", '"') else ""
    return m.group(0)[: m.start("val") - m.start(0)] + quote + REDACTED + quote


def _redact_flag(m: re.Match[str]) -> str:
    if not is_secret_name(m.group("key")) or _is_placeholder(m.group("val")):
        return m.group(0)
    return m.group(0)[: m.start("val") - m.start(0)] + REDACTED


def redact(text: str) -> str:
    """`text` with API keys, tokens and passwords replaced by [REDACTED]; everything else unchanged."""
    low = text.lower()
    if not any(t in low for t in _TRIGGERS):
        return text
    for rx in _SHAPES:
        text = rx.sub(REDACTED, text)
    for rx in _AFTER:
        text = rx.sub(lambda m: m.group("pre") + REDACTED, text)
    text = _ASSIGNMENT.sub(_redact_assignment, text)
    text = _FLAG.sub(_redact_flag, text)
    return text


def redact_argv(argv: Sequence[str]) -> list[str]:
    """A copy of a command line with secrets hidden, including `--api-key VALUE` split over two items.

    Flags are names people chose for a value, so the broad rule applies: `--wandb_key VALUE` is hidden too."""
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next and not arg.startswith("-") and not _is_placeholder(arg):
            out.append(REDACTED)
            hide_next = False
            continue
        flag = _FLAG_ITEM.fullmatch(arg)
        # redact() sees one item at a time, so a flag and its value in separate items need this
        hide_next = flag is not None and flag.group("value") is None and _is_secret_flag(flag.group("name"))
        if (
            flag is not None
            and flag.group("value") is not None
            and _is_secret_flag(flag.group("name"))
            and not _is_placeholder(flag.group("value"))
        ):
            arg = arg[: flag.start("value")] + REDACTED
        out.append(redact(arg))
    return out


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` with credential variables hidden; other values pass through redact()."""
    out: dict[str, str] = {}
    for key, value in env.items():
        if is_secret_name(key) and not _is_placeholder(str(value)):
            out[key] = REDACTED
        else:
            out[key] = redact(value) if isinstance(value, str) else value
    return out


# ---------------------------------------------------------------- by value

# Shorter values would mask ordinary words and numbers everywhere (a 4-character value is in half of any log),
# and are too short to be a credential worth the name.
MIN_SECRET_CHARS = 6
_NUMBER = re.compile(r"[+-]?(?:\d[\d_]*\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def _worth_masking(value: str) -> bool:
    bare = value.strip()
    return (
        len(bare) >= MIN_SECRET_CHARS
        and not _is_placeholder(bare)
        and REDACTED not in bare
        and bare != "***"
        and not _NUMBER.fullmatch(bare)  # a number is not a credential, and masking it would hide steps and losses
    )


def _value_and_lines(value: str) -> list[str]:
    # a multi-line secret (a PEM key) reaches logs line by line
    return [value, *(line.strip() for line in value.splitlines()[1:] if line.strip())] if "\n" in value else [value]


def escaped_forms(value: str) -> set[str]:
    """`value` and the forms a program prints it in: JSON-escaped (also inside JSON again), a Python repr with
    either quote, URL-encoded (either case of hex digits, `+` or `%20` for a space) and shell-quoted. A secret
    holding a backslash or a quote leaks as one of these (a traceback shows its repr, a JSON log line escapes it),
    where the value itself never appears."""
    from urllib.parse import quote, quote_plus

    once = json.dumps(value)[1:-1]
    forms = {value, once, json.dumps(value, ensure_ascii=False)[1:-1], json.dumps(once)[1:-1], repr(value)[1:-1]}
    backslashed = value.replace("\\", "\\\\")
    forms |= {backslashed.replace("'", "\\'"), backslashed.replace('"', '\\"')}  # repr's, whichever quote it chose
    forms.add(value.encode("unicode_escape").decode("ascii"))
    for encoded in (quote(value, safe=""), quote(value), quote_plus(value, safe=""), quote_plus(value)):
        forms |= {encoded, re.sub(r"%[0-9A-F]{2}", lambda m: m.group(0).lower(), encoded)}
    forms.add(shlex.quote(value))
    return forms


# Characters every escaped form keeps as they are (JSON, repr, URL encoding, shell quoting): the longest run of them
# in a value is in each of its forms, so text without it cannot hold the value in any form (a cheap test first).
_KEPT_RUN = re.compile(r"[A-Za-z0-9_.~\-]+")
MIN_ANCHOR_CHARS = 4


def _anchor(value: str) -> str | None:
    run = max(_KEPT_RUN.findall(value), key=len, default="")
    return run if len(run) >= MIN_ANCHOR_CHARS else None


def find_secrets(text: str) -> list[str]:
    """The secret values the shape and name rules of `redact` find in `text` (what it would replace)."""
    low = text.lower()
    if not any(t in low for t in _TRIGGERS):
        return []
    found = [m.group(0) for rx in _SHAPES for m in rx.finditer(text)]
    found += [m.group(0)[len(m.group("pre")) :] for rx in _AFTER for m in rx.finditer(text)]
    for rx in (_ASSIGNMENT, _FLAG):
        for m in rx.finditer(text):
            value = m.group("val")
            if is_secret_name(m.group("key")) and not _is_placeholder(value):
                found.append(value.strip("\"'"))
    return found


def _argv_secrets(argv: Sequence[Any]) -> list[tuple[int, str]]:
    """(index, value) of each secret flag's value in a command line: `--hf-token VALUE` and `--hf-token=VALUE`."""
    out = []
    for i, arg in enumerate(argv):
        flag = _FLAG_ITEM.fullmatch(arg) if isinstance(arg, str) else None
        if flag is None or not _is_secret_flag(flag.group("name")):
            continue
        if flag.group("value") is not None:
            out.append((i, flag.group("value")))
        elif i + 1 < len(argv) and isinstance(argv[i + 1], str) and not argv[i + 1].startswith("-"):
            out.append((i + 1, argv[i + 1]))
    return out


def _config_secrets(node: Any) -> list[str]:
    """Secret values in a config's data: values of secret-named keys (job.env HF_TOKEN, rl.env_args api_key, a
    section field named like a credential), secret flags' values in lists of strings (job.command,
    inference.extra_args), and whatever the shape rules find in any string (a password in a URL)."""
    found: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, str) and looks_secret_name(str(key)):
                found.append(value)
            found += _config_secrets(value)
    elif isinstance(node, list):
        found += [value for _, value in _argv_secrets(node)]
        for item in node:
            found += _config_secrets(item)
    elif isinstance(node, str):
        found += find_secrets(node)
    return found


@dataclass
class MaskedConfig:
    """A run config as its run directory keeps it: TOML with every secret value as `***`, and what was masked."""

    text: str
    secrets: list[tuple[list[str | int], str]]  # (key path, real value) of each string that holds a `***`

    @property
    def env(self) -> dict[str, str]:
        """What a job process needs in its environment to read the real values back (config.loader restores them)."""
        from prime_train.config.loader import ENV_CONFIG_SECRETS

        return {ENV_CONFIG_SECRETS: json.dumps(self.secrets)} if self.secrets else {}


class Redactor:
    """Secrets out of text by shape and name (`redact`) and by value: every value known to be secret is masked
    wherever it appears, with no name or shape beside it (a W&B key in a traceback, a password echoed alone).

    Build one per run with `for_run` (the config and the environment) or, for a reader of a finished run,
    with `from_environment`; `Redactor()` redacts by shape and name only."""

    def __init__(self, values: Iterable[str] = ()):
        keep = {piece for value in values if isinstance(value, str) for piece in _value_and_lines(value)}
        # longest first: a value that contains another is masked whole
        self.values = tuple(sorted((v for v in keep if _worth_masking(v)), key=lambda v: (-len(v), v)))
        # what is masked: each value and its escaped forms (JSON, repr, URL-encoded, shell-quoted)
        forms = {form for value in self.values for form in escaped_forms(value)}
        self.forms = tuple(sorted(forms, key=lambda v: (-len(v), v)))
        self._rx = re.compile("|".join(map(re.escape, self.forms))) if self.forms else None
        anchors = [_anchor(v) for v in self.values]
        # None: some value has no anchor, every text is searched
        self._anchors = None if None in anchors else tuple(set(anchors))  # type: ignore[arg-type]
        self._anchor_bytes = tuple(a.encode() for a in self._anchors) if self._anchors is not None else None
        self.longest_form = max((len(f) for f in self.forms), default=0)

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Redactor:
        """Masks the values of this process's credential variables (HF_TOKEN, WANDB_API_KEY, DB_PASS, …)."""
        import os

        env = os.environ if env is None else env
        return cls(value for name, value in env.items() if looks_secret_name(name))

    @classmethod
    def for_run(cls, cfg: Config, env: Mapping[str, str] | None = None) -> Redactor:
        """Masks the environment's credential values and the run config's (see `masked_config`)."""
        from prime_train.config.loader import to_toml_dict

        return cls([*cls.from_environment(env).values, *_config_secrets(to_toml_dict(cfg))])

    @classmethod
    def for_process(cls, env: Mapping[str, str]) -> Redactor:
        """Masks what a job process started with `env` was given as secrets: the values of its credential
        variables, and the real values of config.toml's `***` the supervisor passes it (ENV_CONFIG_SECRETS)."""
        from prime_train.config.loader import ENV_CONFIG_SECRETS

        values = list(cls.from_environment(env).values)
        try:
            entries = json.loads(env.get(ENV_CONFIG_SECRETS) or "[]")
        except ValueError:
            entries = []
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, list) and len(entry) == 2 and isinstance(value := entry[1], str):
                # the stored string (`--hf-token=VALUE`, a URL with a password) and the secret inside it
                values += [value, *(v for _, v in _argv_secrets([value])), *find_secrets(value)]
        return cls(values)

    def might_hold_values(self, data: str | bytes) -> bool:
        """False when `data` cannot hold a known secret value in any form (a substring test per value, no regex)."""
        if self._rx is None:
            return False
        if isinstance(data, bytes):
            return self._anchor_bytes is None or any(a in data for a in self._anchor_bytes)
        return self._anchors is None or any(a in data for a in self._anchors)

    def matches(self, text: str) -> Iterator[re.Match[str]]:
        """Where `text` holds a known secret value, in any escaped form."""
        return self._rx.finditer(text) if self._rx is not None else iter(())

    def mask_values(self, text: str) -> str:
        """`text` with every known secret value, in any escaped form, replaced by [REDACTED] (no shape or name
        rules: fast enough for every byte a job prints)."""
        return self._rx.sub(REDACTED, text) if self._rx is not None and self.might_hold_values(text) else text

    def __call__(self, text: str) -> str:
        """`text` with every known secret value (in any escaped form) and every secret shape replaced by [REDACTED]."""
        return redact(self.mask_values(text))

    def value(self, obj: Any) -> Any:
        """A copy of `obj` (str, dict, list, tuple, dataclass, nested) with its strings redacted; keys are kept."""
        if isinstance(obj, str):
            return self(obj)
        if isinstance(obj, dict):
            return {k: self.value(v) for k, v in obj.items()}
        if isinstance(obj, list | tuple):
            return [self.value(v) for v in obj]
        if is_dataclass(obj) and not isinstance(obj, type):
            return replace(obj, **{f.name: self.value(getattr(obj, f.name)) for f in fields(obj) if f.init})
        return obj

    def argv(self, argv: Sequence[str]) -> list[str]:
        """A command line as it may be shown: secret flags' values and known secret values hidden."""
        return [self(arg) for arg in redact_argv(argv)]

    def masked_config(self, cfg: Config) -> MaskedConfig:
        """The config as TOML with every secret value as `***`: values of secret-named keys and secret flags,
        and every occurrence of a value this redactor knows. The real values stay in `secrets`, for the
        job's environment (`MaskedConfig.env`), never in the file."""
        import tomli_w

        from prime_train.config.loader import MASK, to_toml_dict

        masked: list[tuple[list[str | int], str]] = []

        def mask_string(value: str) -> str:
            return self._rx.sub(MASK, value) if self._rx is not None else value

        def walk(node: Any, path: list[str | int]) -> Any:
            if isinstance(node, dict):
                out = {}
                for key, value in node.items():
                    if isinstance(value, str) and looks_secret_name(str(key)) and _worth_masking(value):
                        masked.append(([*path, key], value))
                        out[key] = MASK
                    else:
                        out[key] = walk(value, [*path, key])
                return out
            if isinstance(node, list):
                flagged = {i: value for i, value in _argv_secrets(node) if _worth_masking(value)}
                items = []
                for i, item in enumerate(node):
                    if i in flagged:  # `VALUE` after `--hf-token`, or `--hf-token=VALUE`: the value part only
                        masked.append(([*path, i], item))
                        items.append(item[: len(item) - len(flagged[i])] + MASK)
                    else:
                        items.append(walk(item, [*path, i]))
                return items
            if isinstance(node, str):
                out_str = mask_string(node)
                if out_str != node:
                    masked.append((path, node))
                return out_str
            return node

        data = walk(to_toml_dict(cfg), [])
        return MaskedConfig(tomli_w.dumps(data), masked)
