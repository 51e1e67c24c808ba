"""Mutated configs through lint and preflight, as an attacker or a tired user writes them.

1200 configs, made from the shipped ones by a seeded mutator (so every run checks the same ones): wrong
types, out-of-range and huge numbers, inf and NaN, unicode, NUL and control characters, path traversal,
unknown keys, and TOML text that is invalid or not UTF-8. Each goes through `lint_files` and
`run_preflight` in this process under a per-case timer. The rules:

- no exception escapes (a user's mistake is a problem with its key, never a traceback), and no case hangs;
- a config both accept is one the engine accepts too: its own config checks (strategy, HSDP groups, seed,
  data mixing and files, schedule, optimizer, model config, RL environment) run on every accepted case, and
  a sample of accepted mutants trains for real (`prime-train train --train.max_steps 1`, marked slow).

Preflight runs for real except the CUDA probe, which is asked once of the real subprocess and replayed:
there is no GPU here, and the probe takes seconds (preflight's own `gpu_probe` parameter).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from pydantic import BaseModel

from prime_train.config.loader import to_toml_dict
from prime_train.config.schema import Config
from prime_train.validator.lint import has_errors, lint_files
from prime_train.validator.preflight import FAIL, probe_gpus, run_preflight

REPO = Path(__file__).resolve().parents[1]
SEED = 14
NUM_CASES = 1200
CASE_TIMEOUT_S = 5.0
# 8 mutants, two at a time: about a minute on two idle cores (12 took 111 s; CI's time is tight, issue notes)
REAL_TRAIN_SAMPLE = 8

# Valid starting points: the defaults and every config the project ships that runs on a CPU machine.
BASE_FILES = [
    REPO / "prime_train" / "configs" / "tiny-sft.toml",
    REPO / "configs" / "tiny-rl.toml",
    *sorted((REPO / "configs" / "examples").glob("*.toml")),
]

HUGE_INTS = [2**31, 2**32 - 1, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**18, 10**30]
SMALL_INTS = [-1, 0, 1, 2, 3, 7, 8, 16, 65535, 65536]
FLOATS = [0.0, -0.0, 5e-324, 1e-300, 0.5, 1.0, 1.0000001, 1e300, math.inf, -math.inf, math.nan]
# Paths resolve from a sandbox two levels down: traversal stays inside the test's temporary directory. HOME is
# the sandbox too, so `~/x` does; `~nobody…` names no user and stays literal.
PATHS = [
    "", ".", "..", "../../escape", "./a/../../b", "/proc/x/y", "/dev/null/x", "~/x", "~nobody_here_prime_train/x",
    "*", "[*?", "a" * 300, "d/" * 300, "é" * 200, "runs\x00x", "nul\x00", "\x1b[31mred", "sub dir/with space",
    # things that exist but are not what the key wants (made in the sandbox by the `outcomes` fixture)
    "empty-dir", "config-only-model", "notes.md", "case-0.toml",
]  # fmt: skip
TEXTS = [
    "", " ", "x", "auto", "none", "true", "-1", "inf", "nan", "日本語", "🙂" * 20, "\u202ertl", "a\x00b",
    "\x01\x02\x7f", "x" * 256, "(", "step (\\d+", "(?P<step>\\d+)", ".*", "s3://", "s3://bucket/prefix",
    "https://user:pw@host/x", "H100:0", "a:b:c", "reverse-text", "sorting", "qwen2", "gloo", "nccl", "fsdp",
]  # fmt: skip
# Keys the engine opens or resolves at start-up.
PATH_LEAVES = [
    ("model", "path"), ("model", "tokenizer"), ("data", "datasets", 0, "path"), ("train", "mc_eval_path"),
    ("train", "eval_environment"), ("rl", "environment"), ("ckpt", "resume"), ("run", "output_dir"), ("run", "name"),
    ("job", "cwd"),
]  # fmt: skip
JUNK_TEXT = ["[", "]]", '"', "'''", "=", "\n[train]\n", "{", "= =", "\x00", "\\u", "key = ", "[[data.datasets]]\n"]


def _load_base(path: Path) -> dict[str, Any]:
    data = tomllib.loads(path.read_text())
    # the examples name their data relative to the repository: make those absolute for the sandbox
    for ds in data.get("data", {}).get("datasets", []):
        if "path" in ds and not os.path.isabs(ds["path"]):
            ds["path"] = str(REPO / ds["path"])
    return data


BASES = [to_toml_dict(Config()), *(_load_base(p) for p in BASE_FILES)]


def _leaves(node: Any, prefix: tuple = ()) -> Iterator[tuple]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*prefix, key))
    elif isinstance(node, list) and node and all(isinstance(v, dict) for v in node):
        for i, value in enumerate(node):
            yield from _leaves(value, (*prefix, i))
    else:
        yield prefix


def _schema_leaves(model: type[BaseModel] = Config, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    """(key path, a value of its type) of every field the schema has, the unset-by-default ones included."""
    for name, info in model.model_fields.items():
        annotation = info.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _schema_leaves(annotation, (*prefix, name))
        elif origin is list and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            yield from _schema_leaves(args[0], (*prefix, name, 0))
        elif info.default is not None and not callable(info.default_factory):
            yield (*prefix, name), info.default
        else:
            samples = {int: 1, float: 1.0, str: "x", bool: True, list: ["x"], dict: {}}
            yield (*prefix, name), args[0] if origin is typing.Literal else samples.get(origin or annotation, "x")


# every key the schema has: what the mutator may set even where a base leaves it out (model.path, job.cwd, ...)
SCHEMA_LEAVES = dict(_schema_leaves())


def _get(node: Any, path: tuple) -> Any:
    for part in path:
        node = node[part]
    return node


def _set(node: dict, path: tuple, value: Any) -> bool:
    for part in path[:-1]:
        if isinstance(node, dict):
            node = node.setdefault(part, {})
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return False
        if not isinstance(node, dict | list):
            return False
    if isinstance(node, dict):
        node[path[-1]] = value
        return True
    return False


def hostile_value(rng: random.Random, current: Any) -> Any:
    """A value for a leaf that holds `current`: mostly of its own kind at the edges, sometimes of another kind."""
    if rng.random() < 0.2:  # a different type altogether
        return rng.choice([rng.choice(SMALL_INTS), rng.choice(FLOATS), rng.choice(TEXTS), True, [], [1, "a"], {}])
    if isinstance(current, bool):
        return rng.choice([not current, 1, 0, "true"])
    if isinstance(current, int):
        return rng.choice([*HUGE_INTS, *SMALL_INTS, current * rng.choice([2, 3, 1000]), -current])
    if isinstance(current, float):
        return rng.choice([*FLOATS, current * rng.choice([1e6, 1e-6, -1.0])])
    if isinstance(current, str):
        return rng.choice(PATHS if rng.random() < 0.5 else TEXTS)
    if isinstance(current, list):
        inner = current[0] if current else rng.choice(TEXTS)
        return [hostile_value(rng, inner) for _ in range(rng.choice([0, 1, 3]))]
    return rng.choice(TEXTS)


@dataclass
class Case:
    number: int
    data: bytes  # the TOML file, possibly broken, possibly not UTF-8
    overrides: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)


def mutants(seed: int = SEED, count: int = NUM_CASES) -> Iterator[Case]:
    """`count` mutated configs, the same ones for the same seed."""
    rng = random.Random(seed)
    for number in range(count):
        config = copy.deepcopy(rng.choice(BASES))
        kinds = []
        overrides: list[str] = []
        if rng.random() < 0.25:
            # one path-like key the engine opens at start-up, alone: such configs often pass lint, so what the
            # engine then makes of them is tested
            kinds.append("path")
            path = rng.choice(PATH_LEAVES)
            if path[:2] == ("data", "datasets"):
                for source in ("task", "hub"):
                    _drop(config, (*path[:-1], source))
            _set(config, path, rng.choice(PATHS))
        for _ in range(rng.choice([1, 1, 2, 3]) if not kinds else 0):
            kind = rng.choices(["value", "drop", "unknown", "override"], weights=[7, 1, 1, 2])[0]
            kinds.append(kind)
            path = rng.choice(list(SCHEMA_LEAVES))
            try:
                current = _get(config, path)
            except (KeyError, IndexError, TypeError):
                current = SCHEMA_LEAVES[path]
            if kind == "value":
                _set(config, path, hostile_value(rng, current))
            elif kind == "drop" and path[0] in config:
                config.pop(path[0]) if len(path) == 1 else _drop(config, path)
            elif kind == "unknown":
                _set(config, (*path[:-1], rng.choice(["lr", "batch_size", "ключ", "x" * 40, "seed2"])), 1)
            elif kind == "override":
                value = hostile_value(rng, current)
                key = ".".join(str(p) for p in path)
                raw = value if isinstance(value, str) else _toml_literal(value)
                if not raw.startswith("--") and "\x00" not in raw:
                    overrides += [f"--{key}", raw]
        try:
            text = tomli_w.dumps(config).encode()
        except (TypeError, ValueError):  # tomli_w cannot write every value (NaN in an array is fine, None not)
            continue
        if rng.random() < 0.12:  # damage the text itself
            kinds.append("text")
            text = _damage(rng, text)
        yield Case(number, text, overrides, kinds)


def _drop(config: dict, path: tuple) -> None:
    with contextlib.suppress(KeyError, IndexError, TypeError):
        del _get(config, path[:-1])[path[-1]]


def _toml_literal(value: Any) -> str:
    """`value` as a command-line override writes it (TOML syntax; a table inline)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_literal(v)}" for k, v in value.items()) + "}"
    return tomli_w.dumps({"v": value}).split("=", 1)[1].strip()


def _damage(rng: random.Random, text: bytes) -> bytes:
    for _ in range(rng.choice([1, 2, 3])):
        at = rng.randrange(len(text) + 1)
        choice = rng.random()
        if choice < 0.3:
            text = text[:at]  # cut off
        elif choice < 0.55:
            text = text[:at] + rng.choice([b"\xff\xfe", b"\xc3\x28", b"\x80", b"\xed\xa0\x80"]) + text[at:]
        else:
            text = text[:at] + rng.choice(JUNK_TEXT).encode() + text[at + rng.randrange(4) :]
    return text


# ---------------------------------------------------------------- the engine's own view of an accepted config


def engine_rejection(cfg: Config) -> str | None:
    """What the engine's own config checks say against `cfg`, or None when they accept it.

    The checks the embedded job runs before its first step, each called as the job calls it: the data-parallel
    strategy and HSDP groups, seeding, data mixing and the data files, the LR schedule and batch ramp, AdamW's
    argument checks, the transformers config of a random-initialised model (or of a local model directory),
    the GPU-only settings, and the RL environment. Building the model is left to the real-train sample."""
    import torch
    import transformers

    from prime_train.engine import data as engine_data
    from prime_train.engine import parallel, records, schedule
    from prime_train.engine.metrics import EngineConfigError
    from prime_train.environments import load_environment
    from prime_train.launch import procs_per_node

    if cfg.job.command:
        return None  # an external command: the engine does not run
    try:
        nproc = procs_per_node(cfg, 0)
        world = nproc * cfg.distributed.nnodes
        strategy = parallel.resolve_strategy(cfg.distributed, world)
        if strategy == "hsdp":
            dist = parallel.DistInfo(0, 0, world, nproc, torch.device("cpu"), "gloo")
            parallel.hsdp_shard_size(dist, cfg.distributed.hsdp_shard_size)
        if cfg.distributed.backend == "nccl" or cfg.model.attn_implementation == "flash_attention_2":
            return "a GPU-only setting on a machine without CUDA (init_distributed / build_model refuse it)"
        parallel.set_seed(cfg.run.seed, 0)
        engine_data._check_data_config(cfg.data)
        for index, ds in enumerate(cfg.data.datasets):
            if ds.path is not None:
                records.expand_local_path(ds.path, index)
        for step in (0, 1, cfg.train.warmup_steps, cfg.train.max_steps):
            lr = schedule.lr_lambda(step, cfg.train)
            assert math.isfinite(lr) and lr >= 0, f"lr factor {lr} at step {step}"
        schedule.batch_size_at(0, cfg.train, cfg.data.seq_len, world)
        t = cfg.train
        torch.optim.AdamW(
            [torch.zeros(1, requires_grad=True)],
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            eps=t.eps,
            weight_decay=t.weight_decay,
        )
        m = cfg.model
        if m.path is None:
            config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[m.arch]
            config_class(
                vocab_size=256, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size or 4 * m.hidden_size,
                num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
                num_key_value_heads=m.num_kv_heads or m.num_heads, max_position_embeddings=m.max_position_embeddings,
            )  # fmt: skip
        elif os.path.isdir(os.path.expanduser(m.path)):
            transformers.AutoConfig.from_pretrained(os.path.expanduser(m.path))
        if cfg.run.job == "rl":
            load_environment(cfg.rl.environment, dict(cfg.rl.env_args))
        if cfg.train.eval_environment:
            load_environment(cfg.train.eval_environment, {})
    except (EngineConfigError, ValueError, OSError, AssertionError, KeyError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


# ---------------------------------------------------------------- running the cases


class CaseTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    def on_alarm(signum, frame):
        raise CaseTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@dataclass
class Outcome:
    case: Case
    path: Path
    accepted: bool = False
    config: Config | None = None
    crash: str | None = None  # an exception that escaped lint or preflight, or "hang"
    seconds: float = 0.0


def run_case(case: Case, sandbox: Path, gpu_probe) -> Outcome:
    path = sandbox / f"case-{case.number}.toml"
    path.write_bytes(case.data)
    outcome = Outcome(case, path)
    started = time.perf_counter()
    try:
        with time_limit(CASE_TIMEOUT_S):
            problems, cfg = lint_files([str(path)], case.overrides)
            if cfg is not None and not has_errors(problems):
                results = run_preflight(cfg, gpu_probe=gpu_probe)
                outcome.accepted = not any(r.status == FAIL for r in results)
                outcome.config = cfg
    except CaseTimeout:
        outcome.crash = f"hang: more than {CASE_TIMEOUT_S} s"
    except Exception as exc:  # the point of the test: nothing may escape
        outcome.crash = f"{type(exc).__name__}: {exc}"
    outcome.seconds = time.perf_counter() - started
    return outcome


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> list[Outcome]:
    root = tmp_path_factory.mktemp("fuzz")
    sandbox = root / "a" / "b"
    sandbox.mkdir(parents=True)
    (sandbox / "empty-dir").mkdir()
    (sandbox / "config-only-model").mkdir()
    (sandbox / "config-only-model" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (sandbox / "notes.md").write_text("not data\n")
    recorded = probe_gpus(1)  # the real probe, once: CUDA as this machine has it (none)
    patch = pytest.MonkeyPatch()
    patch.setenv("HOME", str(sandbox))
    patch.setenv("HF_HUB_OFFLINE", "1")  # hub ids that mutations invent are never fetched
    patch.setenv("CUDA_VISIBLE_DEVICES", "")
    try:
        with contextlib.chdir(sandbox):
            return [run_case(case, sandbox, lambda n: recorded) for case in mutants()]
    finally:
        patch.undo()


def test_fuzzer_makes_over_a_thousand_configs_of_every_kind_the_same_way_each_time():
    cases = list(mutants())
    assert len(cases) >= 1000
    kinds = {k for c in cases for k in c.kinds}
    assert kinds == {"value", "drop", "unknown", "override", "text", "path"}
    texts = b"".join(c.data for c in cases)
    needles = [b"inf", b"nan", b"\\u0000", b"../../escape", b"\xff\xfe", "日本語".encode(), b"18446744073709551616"]
    for needle in needles:
        assert needle in texts, needle
    assert [c.data for c in mutants()][:50] == [c.data for c in cases][:50]  # seeded: the same configs every run


def test_no_mutated_config_makes_lint_or_preflight_raise_or_hang(outcomes):
    crashes = [f"case {o.case.number} {o.case.kinds} {o.case.overrides}: {o.crash}" for o in outcomes if o.crash]
    assert not crashes, "\n".join(crashes[:20])
    slowest = max(outcomes, key=lambda o: o.seconds)
    assert slowest.seconds < CASE_TIMEOUT_S


def test_every_config_lint_and_preflight_accept_passes_the_engines_own_checks(outcomes):
    accepted = [o for o in outcomes if o.accepted]
    refused = [o for o in outcomes if not o.accepted and not o.crash]
    assert len(accepted) >= 100 and len(refused) >= 500, (len(accepted), len(refused))  # both sides exercised
    rejected = []
    with contextlib.chdir(accepted[0].path.parent):
        for o in accepted:
            why = engine_rejection(o.config)
            if why:
                rejected.append(f"{o.path.name} {o.case.overrides}: {why}")
    assert not rejected, "\n".join(rejected[:20])


@pytest.mark.parametrize("command", ["lint", "preflight"])
def test_the_cli_exits_with_a_code_and_never_a_traceback_on_mutants(outcomes, command):
    # in a subprocess, as a user runs it: the error handler's "unexpected" is a traceback in disguise
    sample = outcomes[:: len(outcomes) // 15][:15]
    for o in sample:
        result = subprocess.run(
            [sys.executable, "-m", "prime_train", command, str(o.path), *o.case.overrides],
            cwd=o.path.parent,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HOME": str(o.path.parent), "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""},
        )
        output = result.stdout + result.stderr
        assert "Traceback" not in output and "unexpected" not in output, output
        assert result.returncode in (0, 1, 78), output


def cheap_to_train(o: Outcome) -> bool:
    """A mutant the real-train sample can afford on two CPU cores: one process, a small model and batch."""
    cfg = o.config
    if cfg is None or cfg.job.command or cfg.run.job == "rl" or cfg.model.path is not None:
        return False
    m, t, d = cfg.model, cfg.train, cfg.data
    return (
        (cfg.distributed.nproc_per_node or 1) == 1
        and cfg.distributed.nnodes == 1
        and m.hidden_size <= 512
        and m.num_layers <= 8
        and t.global_batch_size * d.seq_len <= 1 << 16
        and d.seq_len <= 2048
        and sum(ds.num_examples for ds in d.datasets if ds.task) <= 40_000  # generated and tokenized at start-up
        and not t.compile
    )


@pytest.mark.slow  # ~15 s a run on two idle CPU cores (imports, data, one step, eval, export); minutes when busy
def test_a_sample_of_accepted_mutants_trains_a_step_for_real(outcomes):
    from concurrent.futures import ThreadPoolExecutor

    candidates = [o for o in outcomes if o.accepted and cheap_to_train(o)]
    assert len(candidates) >= REAL_TRAIN_SAMPLE, len(candidates)
    sample = random.Random(SEED).sample(candidates, REAL_TRAIN_SAMPLE)

    def train(o) -> str | None:
        # a copy of the sandbox of its own (the case's relative paths resolve the same), so two runs that name the
        # same run directory never meet
        sandbox = o.path.parent.parent.parent / f"real-{o.case.number}" / "a" / "b"
        # other cases' files stay behind, except one the mutant names as a path of its own (train.mc_eval_path =
        # 'case-0.toml' was accepted by lint where that file exists, and must exist for the run too)
        named = o.path.read_text() + " ".join(o.case.overrides)
        skip = lambda d, names: [n for n in names if n.startswith("case-") and n not in named]  # noqa: E731
        shutil.copytree(o.path.parent, sandbox, ignore=skip)
        path = shutil.copy(o.path, sandbox / o.path.name)
        result = subprocess.run(
            [sys.executable, "-m", "prime_train", "train", str(path), *o.case.overrides, "--train.max_steps", "1"],
            cwd=sandbox,
            capture_output=True,
            text=True,
            timeout=300,
            env={
                **os.environ,
                "HOME": str(sandbox),
                "HF_HUB_OFFLINE": "1",
                "CUDA_VISIBLE_DEVICES": "",
                "OMP_NUM_THREADS": "1",  # one intra-op thread each, two runs at a time: one a core
            },
        )
        if result.returncode != 0:
            return f"{o.path.name} {o.case.overrides}: exit {result.returncode}\n{result.stderr[-1500:]}"
        return None

    # each mutant has a directory of its own: two at a time halve the wall time on two cores
    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = [f for f in pool.map(train, sample) if f]
    assert not failed, "\n\n".join(failed)
