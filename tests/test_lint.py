"""`prime-train lint`: the bad-config corpus, output formats, merging, overrides, shipped configs,
a light import footprint, and a property test that no config, however mangled, makes lint raise."""

from __future__ import annotations

import contextlib
import copy
import json
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import tomli_w
from enginetools import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prime_train.cli.errors import BAD_INPUT
from prime_train.config.loader import COMMAND_LINE, to_toml_dict
from prime_train.config.schema import Config
from prime_train.validator.lint import has_errors, lint_files

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
BAD_CONFIGS = TESTS / "bad_configs"
EXAMPLES = REPO / "configs" / "examples"
PROBLEM_KEYS = {"file", "line", "column", "key", "severity", "message"}

# Strings the operating system refuses or treats specially, for the fields lint looks up on disk.
NASTY_PATHS = {
    "name-too-long": "é" * 300,
    "nul-byte": "a\x00b",
    "under-proc": "/proc/x/y",
    "under-a-file": "/dev/null/x",
    "unknown-user-home": "~nobody_here/x",
    "glob-chars": "[*?",
    "very-deep": "runs/" + "d/" * 200,
}
PATH_FIELDS = [
    ("run", "output_dir"),
    ("data", "datasets", 0, "path"),
    ("ckpt", "resume"),
    ("train", "mc_eval_path"),
    ("model", "path"),
    ("job", "cwd"),
]
EXPECT = re.compile(
    r"^# expect: line=(?P<line>\d+) key=(?P<key>\S*)(?: severity=(?P<severity>error|warning))? "
    r"message~=(?P<message>.+)$"
)


@dataclass(frozen=True)
class Expectation:
    """What one file of tests/bad_configs/ must produce, read from its first line."""

    path: Path
    line: int
    key: str
    severity: str
    message: str

    @property
    def name(self) -> str:
        return self.path.stem


def read_expectation(path: Path) -> Expectation:
    first = path.read_text(encoding="utf-8").splitlines()[0]
    m = EXPECT.match(first)
    if m is None:
        raise AssertionError(f"{path.name}: first line must be `# expect: line=N key=K message~=TEXT`, got {first!r}")
    return Expectation(path, int(m["line"]), m["key"], m["severity"] or "error", m["message"])


BAD_CASES = [read_expectation(p) for p in sorted(BAD_CONFIGS.glob("*.toml"))]
# Through the real CLI in a subprocess: one of each kind (syntax, schema, cross-field error, warning).
CLI_CASES = {
    "syntax_duplicate_key",
    "unknown_key_suggests_lr",
    "output_dir_unwritable",
    "ckpt_interval_beyond_max_steps",
}


def shipped_configs() -> list[Path]:
    """Every runnable config the project ships: configs/ (any depth) and the package's embedded default."""
    found = [*REPO.glob("configs/**/*.toml"), *REPO.glob("prime_train/configs/*.toml")]
    return sorted(p for p in found if "data" not in p.relative_to(REPO).parts)


# ---------------------------------------------------------------- the bad-config corpus


def test_bad_config_corpus_covers_every_kind_of_mistake():
    names = {c.name for c in BAD_CASES}
    assert len(BAD_CASES) >= 24
    for required in [
        "syntax_unclosed_table_header",
        "syntax_bad_value",
        "syntax_duplicate_key",
        "unknown_section_suggests",
        "unknown_key_suggests_lr",
        "unknown_key_in_dataset",
        "wrong_type_string_for_int",
        "wrong_type_list_for_str",
        "wrong_type_table_for_scalar",
        "out_of_range_negative_lr",
        "out_of_range_held_out_fraction",
        "out_of_range_keep_last_zero",
        "out_of_range_port",
        "bad_literal_scheduler",
        "bad_literal_strategy",
        "dataset_without_source",
        "dataset_with_two_sources",
        "global_batch_not_multiple",
        "eval_interval_beyond_max_steps",
        "ckpt_interval_beyond_max_steps",
        "keep_last_one_with_async_save",
        "output_dir_unwritable",
        "missing_data_path",
        "sampling_probs_count_mismatch",
        "sampling_probs_sum_not_one",
        "seq_len_beyond_context",
        "hidden_not_divisible_by_heads",
        "empty_job_command",
        "run_name_with_slash",
        "strategy_none_with_two_processes",
        # accepted once, then failing at run time (issue 14)
        "seed_beyond_numpy_range",
        "progress_regex_invalid",
        "job_command_program_missing",
        "job_cwd_missing",
        "global_batch_absurd",
        "inference_ports_past_65535",
        "lr_infinite",
        "eps_nan",
        "poll_interval_infinite",
        "run_name_with_nul",
        "run_name_over_255_bytes",
        "model_layers_absurd",
    ]:
        assert required in names, f"tests/bad_configs/{required}.toml is missing"
    assert {c.severity for c in BAD_CASES} == {"error", "warning"}


@pytest.mark.parametrize("case", BAD_CASES, ids=lambda c: c.name)
def test_bad_config_reports_its_one_mistake_at_its_line(case: Expectation, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative output_dir and data paths resolve in a scratch directory
    problems, _ = lint_files([str(case.path)])
    assert [(p.file, p.line, p.key, p.severity) for p in problems] == [
        (str(case.path), case.line, case.key, case.severity)
    ], [p.format() for p in problems]
    assert case.message in problems[0].message
    # the exit code the CLI derives from them: errors fail; warnings fail only with --strict
    assert has_errors(problems) is (case.severity == "error")
    assert has_errors(problems, strict=True)


@pytest.mark.parametrize("case", [c for c in BAD_CASES if c.name in CLI_CASES], ids=lambda c: c.name)
def test_cli_exit_code_and_text_for_a_bad_config(case: Expectation, tmp_path):
    result = run_cli("lint", str(case.path), cwd=tmp_path)
    output = result.stdout + result.stderr
    assert "Traceback" not in output
    assert result.returncode == (BAD_INPUT if case.severity == "error" else 0), output
    # the findings are lint's result: on stdout, so `prime-train lint x.toml > out` keeps them
    assert f"{case.path}:{case.line}:" in result.stdout
    assert f"{case.severity}: " in result.stdout
    assert case.message in result.stdout
    strict = run_cli("lint", "--strict", str(case.path), cwd=tmp_path)
    assert strict.returncode == BAD_INPUT


def test_cli_lints_the_whole_corpus_in_one_call_as_json(tmp_path):
    result = run_cli("lint", "--json", *[str(c.path) for c in BAD_CASES], cwd=tmp_path)
    assert "Traceback" not in result.stdout + result.stderr
    assert result.returncode == BAD_INPUT
    reported = json.loads(result.stdout)
    by_file = {}
    for p in reported:
        by_file.setdefault(p["file"], []).append(p)
    for case in BAD_CASES:
        [p] = by_file[str(case.path)]
        assert (p["line"], p["key"], p["severity"]) == (case.line, case.key, case.severity), p
        assert case.message in p["message"]


# ---------------------------------------------------------------- formats, merging, overrides


def test_json_format_is_a_list_of_problems_with_exactly_the_documented_keys(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[train]\nlerning_rate = 3e-4\nscheduler = "cosin"\n')
    result = run_cli("lint", "--json", str(bad), cwd=tmp_path)
    assert result.returncode == BAD_INPUT
    problems = json.loads(result.stdout)
    assert isinstance(problems, list)
    assert len(problems) == 2
    for p in problems:
        assert set(p) == PROBLEM_KEYS
        assert isinstance(p["line"], int)
        assert isinstance(p["column"], int)
        assert p["severity"] in ("error", "warning")
    assert [(p["line"], p["key"]) for p in problems] == [(2, "train.lerning_rate"), (3, "train.scheduler")]


def test_json_format_of_a_clean_config_is_an_empty_list(tmp_path):
    result = run_cli("lint", "--json", str(EXAMPLES / "ddp-2proc-cpu.toml"), cwd=tmp_path)
    assert result.returncode == 0
    assert json.loads(result.stdout) == []


@pytest.fixture
def batch_split(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """Two files clean alone whose merge is wrong: 48 sequences cannot split over 2 ranks × 16."""
    monkeypatch.chdir(tmp_path)
    base = tmp_path / "base.toml"
    base.write_text("[train]\nmax_steps = 100\nglobal_batch_size = 48\nmicro_batch_size = 16\n")
    overlay = tmp_path / "two-ranks.toml"
    overlay.write_text('# scale out\n[distributed]\nstrategy = "ddp"\nnproc_per_node = 2\n')
    return base, overlay


def test_files_linted_separately_are_each_clean_but_merged_are_not(batch_split):
    base, overlay = batch_split
    assert lint_files([str(base)])[0] == []
    assert lint_files([str(overlay)])[0] == []
    problems, _ = lint_files([str(base), str(overlay)])
    assert [(p.file, p.line, p.key) for p in problems] == [(str(base), 3, "train.global_batch_size")]
    assert "2 = 32" in problems[0].message


def test_cli_merge_flag_lints_files_as_one_config(batch_split):
    base, overlay = batch_split
    apart = run_cli("lint", str(base), str(overlay), cwd=base.parent)
    assert apart.returncode == 0, apart.stderr
    assert "2 file(s), no problems" in apart.stdout
    merged = run_cli("lint", "--merge", str(base), str(overlay), cwd=base.parent)
    assert merged.returncode == BAD_INPUT
    assert f"{base}:3:1: error: train.global_batch_size (48)" in merged.stdout


def test_merged_problem_points_at_the_file_that_wrote_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.toml").write_text("[train]\nmax_steps = 100\n")
    (tmp_path / "b.toml").write_text("\n[train.schedule.warmup]\nsteps = 3\n")
    problems, _ = lint_files(["a.toml", "b.toml"])
    assert [(p.file, p.line, p.key) for p in problems] == [("b.toml", 2, "train.schedule")]


def test_overrides_on_lint_are_checked_like_file_values(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clean = str(EXAMPLES / "ddp-2proc-cpu.toml")
    assert lint_files([clean], ["--train.max_steps", "400"])[0] == []
    # the override makes eval_interval (50) and ckpt.interval (50) overshoot: warnings in the file
    problems, _ = lint_files([clean], ["--train.max_steps=30"])
    assert {(p.key, p.severity) for p in problems} == {("train.eval_interval", "warning"), ("ckpt.interval", "warning")}
    problems, _ = lint_files([clean], ["--train.lerning_rate", "3e-4"])
    assert [(p.file, p.key) for p in problems] == [(COMMAND_LINE, "train.lerning_rate")]
    assert "did you mean `lr`?" in problems[0].message
    problems, _ = lint_files([clean], ["--distributed.nproc_per_node", "3"])
    assert [p.key for p in problems] == ["train.global_batch_size"]


def test_cli_overrides_after_files_change_the_verdict(tmp_path):
    clean = str(EXAMPLES / "ddp-2proc-cpu.toml")
    assert run_cli("lint", "--strict", clean, "--train.max_steps", "400", cwd=tmp_path).returncode == 0
    warned = run_cli("lint", "--strict", clean, "--train.max_steps", "20", cwd=tmp_path)
    assert warned.returncode == BAD_INPUT
    assert "no evaluation will run" in warned.stdout
    unknown = run_cli("lint", clean, "--trian.max_steps", "20", cwd=tmp_path)
    assert unknown.returncode == BAD_INPUT
    assert "unknown section [trian]; did you mean [train]?" in unknown.stdout


# ---------------------------------------------------------------- shipped configs


def test_a_clean_example_config_exits_zero():
    result = run_cli("lint", "configs/examples/sft-jsonl.toml", cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert "ok: 1 file(s), no problems" in result.stdout


@pytest.mark.parametrize("path", shipped_configs(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_lints_clean(path: Path, monkeypatch):
    monkeypatch.chdir(REPO)  # shipped configs name data relative to the repository root
    problems, cfg = lint_files([str(path)])
    assert problems == [], [p.format() for p in problems]
    assert isinstance(cfg, Config)


def test_examples_folder_ships_the_documented_kinds():
    configs = {p.name: tomllib.loads(p.read_text()) for p in EXAMPLES.glob("*.toml")}
    strategies = {c.get("distributed", {}).get("strategy") for c in configs.values()}
    assert {"ddp", "fsdp"} <= strategies
    assert any(c.get("job", {}).get("command") for c in configs.values())
    jsonl = [ds["path"] for c in configs.values() for ds in c.get("data", {}).get("datasets", []) if "path" in ds]
    assert jsonl
    for path in jsonl:
        for line in (REPO / path).read_text().splitlines():
            assert set(json.loads(line)) == {"prompt", "completion"}


def test_pre_commit_hook_runs_lint_on_config_files():
    yaml = pytest.importorskip("yaml")
    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    [hook] = [h for h in hooks if h["id"] == "prime-train-lint"]
    assert hook["language"] == "python"
    assert hook["entry"] == "prime-train lint"
    files = re.compile(hook["files"])
    for path in [
        "configs/tiny-sft.toml",
        "configs/examples/fsdp-2proc-cpu.toml",
        "sub/configs/x.toml",
        "my.prime.toml",
    ]:
        assert files.search(path), path
    for path in ["pyproject.toml", "configs/examples/data/spell-numbers.jsonl", "ruff.toml", "configsx/a.toml"]:
        assert not files.search(path), path


@pytest.mark.parametrize("nasty", NASTY_PATHS.values(), ids=NASTY_PATHS.keys())
@pytest.mark.parametrize("field", PATH_FIELDS, ids=lambda f: ".".join(map(str, f)))
def test_lint_reports_paths_the_os_rejects_instead_of_raising(field, nasty, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    *parents, leaf = field
    config: dict[str, Any] = {"data": {"datasets": [{"task": "sorting"}]}}
    node: Any = config
    for part in parents:
        node = node[part] if isinstance(part, int) else node.setdefault(part, {})
    node[leaf] = nasty
    if leaf == "path" and parents[0] == "data":
        del node["task"]
    path = tmp_path / "nasty.toml"
    path.write_text(tomli_w.dumps(config))
    assert_only_problems(path)


def test_values_nested_deeper_than_python_recurses_are_a_problem_not_a_crash(tmp_path):
    path = tmp_path / "deep.toml"
    path.write_text("[train]\nx = " + "[" * 3000 + "]" * 3000 + "\n")
    problems, cfg = lint_files([str(path)])
    assert cfg is None
    assert [(p.line, p.severity) for p in problems] == [(2, "error")]
    assert "nested too deeply" in problems[0].message


# ---------------------------------------------------------------- import footprint

HEAVY = ("torch", "transformers", "numpy")
IMPORT_PROBE = """
import sys
sys.argv = ["prime-train", *{argv!r}]
from prime_train.cli import main
try:
    main()
except SystemExit:
    pass
print("HEAVY=" + ",".join(m for m in {heavy!r} if m in sys.modules))
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["lint", "configs/examples/fsdp-2proc-cpu.toml"],
        ["lint", "configs/examples/qwen2.5-7b-lora-1gpu.toml"],
        ["--help"],
    ],
    ids=["lint", "lint-lora", "help"],
)
def test_lint_and_help_import_neither_torch_transformers_nor_numpy(argv):
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE.format(argv=argv, heavy=HEAVY)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "Traceback" not in result.stderr, result.stderr
    [marker] = [line for line in result.stdout.splitlines() if line.startswith("HEAVY=")]
    assert marker == "HEAVY=", f"imported: {marker.removeprefix('HEAVY=')}"


# ---------------------------------------------------------------- property: lint never raises


def _base_configs() -> list[dict[str, Any]]:
    """Valid starting points: the defaults, the examples, the shipped tiny config."""
    bases = [to_toml_dict(Config())]
    bases += [tomllib.loads(p.read_text()) for p in shipped_configs()]
    return bases


BASES = _base_configs()

junk_keys = st.one_of(
    st.sampled_from(["lr", "max_steps", "datasets", "0", "", "run", "train", "ключ", "名前", "a.b", 'q"uote']),
    st.text(max_size=12),
)
junk_scalars = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=20),
    st.sampled_from(["/proc/x", "", "none", "auto", "cosin", "../..", "~/x", "*.jsonl", "a\x00b", "é" * 300]),
)
junk_values = st.recursive(
    junk_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(junk_keys, inner, max_size=3)),
    max_leaves=6,
)


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path in nested dicts and lists (list items by index)."""
    out = []
    if isinstance(node, dict):
        for k, v in node.items():
            out.append((*prefix, k))
            out.extend(_paths(v, (*prefix, k)))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.append((*prefix, i))
            out.extend(_paths(v, (*prefix, i)))
    return out


def _tables(node: Any) -> list[tuple]:
    """Key paths of every table in a config, the root included."""
    return [(), *(p for p in _paths(node) if isinstance(_get(node, p), dict))]


def _get(node: Any, path: tuple) -> Any:
    for part in path:
        node = node[part]
    return node


def _typo(name: str, data: st.DataObject) -> str:
    if not name:
        return "x"
    i = data.draw(st.integers(0, len(name) - 1))
    kind = data.draw(st.sampled_from(["drop", "double", "swap", "replace"]))
    if kind == "drop":
        return name[:i] + name[i + 1 :] or "x"
    if kind == "double":
        return name[:i] + name[i] + name[i:]
    if kind == "swap" and i + 1 < len(name):
        return name[:i] + name[i + 1] + name[i] + name[i + 2 :]
    return name[:i] + data.draw(st.characters()) + name[i + 1 :]


def mutate(config: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
    """Apply one to four random mistakes to a copy of a config."""
    out = copy.deepcopy(config)
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(
            st.sampled_from(
                ["rename", "retype", "drop_section", "insert", "swap_list_scalar", "junk_section", "nasty_path"]
            )
        )
        paths = _paths(out)
        if kind == "rename":
            keyed = [p for p in paths if isinstance(p[-1], str)]
            if keyed:
                path = data.draw(st.sampled_from(keyed))
                parent = _get(out, path[:-1])
                parent[_typo(path[-1], data)] = parent.pop(path[-1])
        elif kind == "retype" and paths:
            path = data.draw(st.sampled_from(paths))
            _get(out, path[:-1])[path[-1]] = data.draw(junk_values)
        elif kind == "drop_section" and out:
            del out[data.draw(st.sampled_from(sorted(out)))]
        elif kind == "insert":
            table = data.draw(st.sampled_from(_tables(out)))
            _get(out, table)[data.draw(junk_keys)] = data.draw(junk_values)
        elif kind == "swap_list_scalar" and paths:
            path = data.draw(st.sampled_from(paths))
            parent, value = _get(out, path[:-1]), _get(out, path)
            parent[path[-1]] = (value[0] if value else 0) if isinstance(value, list) else [value]
        elif kind == "nasty_path":
            *parents, leaf = data.draw(st.sampled_from(PATH_FIELDS))
            node: Any = out
            for part in parents:
                if isinstance(part, int):  # only into a dataset table the config already has
                    has_item = isinstance(node, list) and len(node) > part and isinstance(node[part], dict)
                    node = node[part] if has_item else None
                else:
                    node = node.setdefault(part, {}) if isinstance(node, dict) else None
                if node is None:
                    break
            if isinstance(node, dict):
                node[leaf] = data.draw(st.sampled_from(list(NASTY_PATHS.values())))
        elif kind == "junk_section":
            out[data.draw(junk_keys)] = data.draw(st.dictionaries(junk_keys, junk_values, max_size=4))
    return out


def assert_only_problems(path: Path, overrides: list[str] | None = None) -> None:
    """lint_files returns well-formed problems or a config; it never raises."""
    problems, cfg = lint_files([str(path)], overrides)
    text = path.read_text(encoding="utf-8", errors="replace")
    num_lines = max(1, text.count("\n") + (not text.endswith("\n")))
    for p in problems:
        assert p.severity in ("error", "warning")
        assert isinstance(p.message, str)
        assert p.message.strip()
        assert isinstance(p.key, str)
        assert p.file in (str(path), COMMAND_LINE)
        assert p.line >= 0
        assert p.column >= 0
        if p.file == str(path) and p.line:
            assert p.line <= num_lines, p.format()
        assert set(p.to_dict()) == PROBLEM_KEYS
    if not has_errors(problems):
        assert isinstance(cfg, Config)


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("lint-fuzz")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(base=st.sampled_from(BASES), data=st.data())
def test_lint_never_raises_on_mutated_configs(scratch, base, data):
    mutated = mutate(base, data)
    try:
        text = tomli_w.dumps(mutated)
    except (TypeError, ValueError):
        return  # tomli_w refuses some shapes (e.g. a NUL in a key); nothing to lint
    path = scratch / "mutated.toml"
    try:
        path.write_text(text, encoding="utf-8")
    except UnicodeEncodeError:
        return  # a lone surrogate the mutation drew: no UTF-8 file, so no config, can hold it
    overrides = []
    if data.draw(st.booleans()):
        key = data.draw(st.sampled_from([".".join(map(str, p)) for p in _paths(base)] + ["train", "x.y.z", "a..b"]))
        overrides = [f"--{key}", data.draw(st.text(max_size=12).filter(lambda s: not s.startswith("--")))]
    with contextlib.chdir(scratch):  # relative paths the mutations invent resolve in scratch
        assert_only_problems(path, overrides)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.sampled_from(BASES), data=st.data())
def test_lint_never_raises_on_damaged_toml_text(scratch, base, data):
    text = tomli_w.dumps(base)
    for _ in range(data.draw(st.integers(1, 5))):
        i = data.draw(st.integers(0, len(text)))
        junk = data.draw(st.one_of(st.text(max_size=6), st.sampled_from(["[", "]", '"', '"""', "=", "\n", "{", "[["])))
        cut = data.draw(st.integers(0, 4))
        text = text[:i] + junk + text[i + cut :]
    path = scratch / "damaged.toml"
    path.write_text(text, encoding="utf-8")
    with contextlib.chdir(scratch):
        assert_only_problems(path)


# ---------------------------------------------------------------- what lint accepted and the run then refused


@pytest.mark.parametrize(
    "name", ["job_command_program_missing", "job_cwd_missing", "progress_regex_invalid", "seed_beyond_numpy_range"]
)
def test_run_of_a_config_lint_refuses_exits_78_before_launching_anything(name, tmp_path):
    case = next(c for c in BAD_CASES if c.name == name)
    result = run_cli("run", str(case.path), cwd=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 78, output
    assert "Traceback" not in output and "unexpected" not in output, output
    assert f"{case.path}:{case.line}:" in result.stderr and case.message in result.stderr
    assert not (tmp_path / "runs").exists()  # refused before a run directory or a process


def test_job_program_is_looked_up_as_the_job_will_start_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "work" / "train.sh"
    script.parent.mkdir()
    script.write_text("#!/bin/sh\necho step 1\n")
    base = {"progress_regex": r"step (\d+)"}

    def job_problems(**job) -> list[str]:
        path = tmp_path / "job.toml"
        path.write_text(tomli_w.dumps({"job": {**base, **job}}))
        return [p.message for p in lint_files([str(path)])[0]]

    # relative to job.cwd, as subprocess resolves it; not executable until chmod
    assert "is not executable" in job_problems(command=["./train.sh"], cwd="work")[0]
    script.chmod(0o755)
    assert job_problems(command=["./train.sh"], cwd="work") == []
    assert "does not exist" in job_problems(command=["./train.sh"])[0]  # from here there is no ./train.sh
    # a bare name is searched on the job's own PATH when job.env sets one
    assert job_problems(command=["train.sh"], env={"PATH": str(script.parent)}) == []
    assert "not a program on PATH (job.env's PATH)" in job_problems(command=["sh"], env={"PATH": str(tmp_path)})[0]
    assert "`~` is not expanded" in job_problems(command=["sh"], cwd="~/no-such-dir-for-prime-train")[0]


# ---------------------------------------------------------------- every problem in one pass


def test_lint_reports_schema_and_cross_field_errors_in_one_pass(tmp_path, monkeypatch):
    # the story: three schema mistakes hid micro_batch_size > global_batch_size until they were fixed
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        '[train]\nlr = -1.0\nmax_steps = "ten"\nscheduler = "cosin"\nmicro_batch_size = 64\nglobal_batch_size = 32\n'
        "[data]\nseq_len = 4\n"
    )
    problems, loaded = lint_files([str(cfg)])
    assert loaded is None
    assert [(p.line, p.key) for p in problems] == [
        (2, "train.lr"), (3, "train.max_steps"), (4, "train.scheduler"), (6, "train.global_batch_size"),
        (8, "data.seq_len"),
    ]  # fmt: skip
    result = run_cli("lint", str(cfg), cwd=tmp_path)
    assert result.returncode == BAD_INPUT and len(result.stdout.strip().splitlines()) == 5, result.stdout


def test_a_table_rule_hidden_behind_a_field_error_of_the_same_table_is_reported_with_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "run.toml"
    # pydantic runs a dataset's "exactly one source" rule only once the dataset's own fields are valid
    cfg.write_text('[[data.datasets]]\ntask = "reverse-text"\npath = "x.jsonl"\nnum_examples = 0\n')
    problems, _ = lint_files([str(cfg)])
    assert [p.key for p in problems] == ["data.datasets[0]", "data.datasets[0].num_examples"], problems
    assert "exactly one of `task`, `path` or `hub` (got task, path)" in problems[0].message


def test_a_check_about_a_rejected_value_is_left_out_not_judged_against_its_default(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "run.toml"
    # global_batch_size is rejected; against its default (32) micro_batch_size 48 would look wrong, but nobody wrote 32
    cfg.write_text('[train]\nglobal_batch_size = "96"\nmicro_batch_size = 48\n')
    problems, _ = lint_files([str(cfg)])
    assert [p.key for p in problems] == ["train.global_batch_size"], [p.message for p in problems]


@pytest.mark.parametrize(
    ("dataset", "key", "said"),
    [
        ('completion_field = "answer"', "data.datasets[0].format", "cannot tell the format of task 'reverse-text'"),
        ('format = "prompt_completion"\nprompt_field = "question"', "data.datasets[0].prompt_field", "= 'question'"),
        ('format = "chat"', "data.datasets[0].format", "gives prompt/completion records"),
    ],
)
def test_a_task_dataset_whose_field_keys_miss_its_records_is_an_error_the_engine_would_raise(
    dataset, key, said, tmp_path, monkeypatch
):
    # found by the fuzz test: lint passed these and the engine stopped at its first record
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[[data.datasets]]\ntask = "reverse-text"\n{dataset}\n')
    problems, _ = lint_files([str(cfg)])
    assert [(p.key, p.severity) for p in problems] == [(key, "error")], problems
    assert said in problems[0].message
    cfg.write_text('[[data.datasets]]\ntask = "reverse-text"\nformat = "text"\ntext_field = "prompt"\n')
    assert lint_files([str(cfg)])[0] == [], "a field the records have is fine"


def test_ckpt_resume_must_name_a_whole_step_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "step-8").mkdir()
    whole = tmp_path / "step-12"
    whole.mkdir()
    (whole / ".metadata").write_bytes(b"x")
    cfg = tmp_path / "run.toml"
    for resume, said in [("model", "its name is not step-N"), ("step-8", "no DCP .metadata"), ("gone", "neither")]:
        cfg.write_text(f'[ckpt]\nresume = "{resume}"\n')
        problems, _ = lint_files([str(cfg)])
        assert [p.key for p in problems] == ["ckpt.resume"] and said in problems[0].message, problems
    cfg.write_text('[ckpt]\nresume = "step-12"\n')
    assert lint_files([str(cfg)])[0] == []


def test_lints_task_fields_mirror_the_records_the_engine_makes_of_a_task():
    from prime_train import tasks
    from prime_train.engine.records import task_record
    from prime_train.validator.lint import TASK_FIELDS

    for name in ("reverse-text", "arithmetic", "sorting"):
        [example] = tasks.generate_examples(name, 1, 0)
        assert set(task_record(example)) == TASK_FIELDS, name


# ---------------------------------------------------------------- several nodes: where checkpoints go


def test_several_nodes_with_checkpoints_in_each_run_directory_are_refused_until_ckpt_dir_is_shared(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    tiny = str(REPO / "prime_train" / "configs" / "tiny-sft.toml")
    nodes = ["--run.output_dir", str(tmp_path / "runs"), "--distributed.nnodes", "2"]
    nodes += ["--distributed.nproc_per_node", "1"]
    problems, _ = lint_files([tiny], nodes)
    assert [(p.key, p.severity) for p in problems] == [("distributed.nnodes", "error")], [p.format() for p in problems]
    assert "set ckpt.dir to a directory every node mounts" in problems[0].message
    # a bucket does not help: each node would upload its own run directory, which holds its own ranks' shards only
    problems, _ = lint_files([tiny], [*nodes, "--ckpt.remote", "s3://bucket/run"])
    assert [p.key for p in problems] == ["distributed.nnodes"], [p.format() for p in problems]
    assert "ckpt.remote uploads what the node holds" in problems[0].message
    assert lint_files([tiny], [*nodes, "--ckpt.dir", str(tmp_path / "shared")])[0] == []
    # one node keeps its checkpoints where it likes
    assert lint_files([tiny], ["--run.output_dir", str(tmp_path / "runs")])[0] == []

    inside = str(tmp_path / "runs" / "tiny-sft" / "ckpt")
    problems, _ = lint_files([tiny], [*nodes, "--run.name", "tiny-sft", "--ckpt.dir", inside])
    assert [p.key for p in problems] == ["ckpt.dir"] and "inside the run directory" in problems[0].message


def test_ckpt_dir_with_ckpt_remote_is_refused_as_nothing_would_be_uploaded(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = str(REPO / "prime_train" / "configs" / "tiny-sft.toml")
    args = ["--run.output_dir", str(tmp_path), "--ckpt.dir", str(tmp_path / "shared"), "--ckpt.remote", "s3://b/p"]
    problems, _ = lint_files([tiny], args)
    assert [(p.key, p.severity) for p in problems] == [("ckpt.remote", "error")], [p.format() for p in problems]


# ---------------------------------------------------------------- [lora]


def _without(monkeypatch, *modules: str) -> None:
    """Make `modules` look uninstalled to lint and preflight's [lora] checks (find_spec, never an import)."""
    from prime_train.validator import lora_checks

    real = lora_checks.installed
    monkeypatch.setattr(lora_checks, "installed", lambda m: m not in modules and real(m))


def test_lora_without_peft_is_an_error_naming_the_extra_and_a_warning_for_spot_nodes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = str(REPO / "prime_train" / "configs" / "tiny-sft.toml")
    out = ["--run.output_dir", str(tmp_path)]
    assert lint_files([tiny], [*out, "--lora.rank", "8"])[0] == []  # peft is installed here (the dev extra)
    _without(monkeypatch, "peft", "bitsandbytes")
    problems, _ = lint_files([tiny], [*out, "--lora.rank", "8"])
    assert [(p.key, p.severity) for p in problems] == [("lora.rank", "error")], [p.format() for p in problems]
    assert "lora.rank = 8 needs the peft package, which is not installed: pip install 'prime-train[lora]'" in (
        problems[0].message
    )
    assert lint_files([tiny], out)[0] == []  # LoRA off: nothing to install
    # QLoRA also names bitsandbytes, under lora.quantize
    problems, _ = lint_files([tiny], [*out, "--lora.rank", "8", "--lora.quantize", "nf4"])
    assert [p.key for p in problems] == ["lora.rank", "lora.quantize"]
    assert "needs the bitsandbytes package" in problems[1].message and "prime-train[qlora]" in problems[1].message
    # a config for spot nodes: they install what they need; this machine only warns
    problems, _ = lint_files([tiny], [*out, "--lora.rank", "8"], spot=True)
    problems = [p for p in problems if p.key.startswith("lora.")]  # SkyPilot's own findings aside
    assert [(p.key, p.severity) for p in problems] == [("lora.rank", "warning")]
    assert "not installed on this machine (the spot nodes must install it too)" in problems[0].message


def test_lint_cli_exits_78_for_lora_without_peft(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from prime_train.cli import app

    monkeypatch.chdir(tmp_path)
    _without(monkeypatch, "peft")
    tiny = str(REPO / "prime_train" / "configs" / "tiny-sft.toml")
    result = CliRunner().invoke(app, ["lint", tiny, "--lora.rank", "16"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert result.exit_code == BAD_INPUT
    assert "pip install 'prime-train[lora]'" in result.output and "lora.rank" in result.output


def test_nf4_with_fsdp_over_one_process_is_no_sharding_and_passes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from prime_train.validator import lora_checks

    monkeypatch.setattr(lora_checks, "installed", lambda m: True)  # bitsandbytes too, to see the strategy alone
    tiny = str(REPO / "prime_train" / "configs" / "tiny-sft.toml")
    nf4 = ["--run.output_dir", str(tmp_path), "--lora.rank", "8", "--lora.quantize", "nf4"]
    one = ["--distributed.strategy", "fsdp", "--distributed.nproc_per_node", "1"]
    assert lint_files([tiny], [*nf4, *one])[0] == []
    problems, _ = lint_files([tiny], [*nf4, "--distributed.strategy", "hsdp"])  # processes unknown: as many as GPUs
    assert [p.key for p in problems] == ["lora.quantize"] and "'hsdp'" in problems[0].message
    assert lint_files([tiny], [*nf4, "--distributed.strategy", "ddp"])[0] == []


def test_the_lora_example_is_one_80gb_gpu_with_an_8b_class_model():
    cfg = tomllib.loads((EXAMPLES / "qwen2.5-7b-lora-1gpu.toml").read_text())
    assert cfg["lora"]["rank"] == 16 and cfg["distributed"]["nproc_per_node"] == 1
    assert cfg["model"]["path"] == "Qwen/Qwen2.5-7B-Instruct"


def test_gemma2_under_sdpa_is_named_before_the_start_and_eager_lints_clean(tmp_path, monkeypatch):
    """transformers will not load Gemma 2 with SDPA: lint reads the model's config.json and names the key."""
    import shutil

    monkeypatch.chdir(REPO)
    model = tmp_path / "gemma-2-2b"
    model.mkdir()
    shutil.copy(REPO / "tests" / "data" / "model_configs" / "gemma-2-2b" / "config.json", model)
    clean = str(EXAMPLES / "sft-jsonl.toml")
    problems, _ = lint_files([clean], ["--model.path", str(model)])
    found = [p for p in problems if p.key == "model.attn_implementation"]
    assert [(p.severity, "set model.attn_implementation = 'eager'" in p.message) for p in found] == [("error", True)]
    problems, _ = lint_files([clean], ["--model.path", str(model), "--model.attn_implementation", "eager"])
    assert not [p for p in problems if p.key == "model.attn_implementation"]


def test_a_router_loss_weight_the_trainer_would_refuse_is_named_before_the_start(tmp_path, monkeypatch):
    """model.router_aux_loss_coef on a job without a token loss, or on a model without a router (config.json read
    locally): the errors engine/model.py gives at start-up, with the file's line, before it."""
    import shutil

    from prime_train.engine.hf_head import ROUTED_MODEL_TYPES
    from prime_train.engine.model import ROUTER_LOSS_JOBS
    from prime_train.validator import lint

    assert (lint.ROUTED_MODEL_TYPES, lint.ROUTER_LOSS_JOBS) == (ROUTED_MODEL_TYPES, ROUTER_LOSS_JOBS)
    monkeypatch.chdir(REPO)
    models = {}
    for name in ("Qwen3-30B-A3B", "Qwen3-8B"):
        models[name] = tmp_path / name
        models[name].mkdir()
        shutil.copy(REPO / "tests" / "data" / "model_configs" / name / "config.json", models[name])
    clean = str(EXAMPLES / "sft-jsonl.toml")

    def router_problems(*overrides: str) -> list[str]:
        problems, _ = lint_files([clean], list(overrides))
        return [p.message for p in problems if p.key == "model.router_aux_loss_coef" and p.severity == "error"]

    moe = ["--model.path", str(models["Qwen3-30B-A3B"])]
    assert router_problems(*moe, "--model.router_aux_loss_coef", "0.01") == []
    assert router_problems(*moe, "--model.router_aux_loss_coef", "0") == []
    assert router_problems(*moe, "--run.job", "pretrain", "--model.router_aux_loss_coef", "0.01") == []
    [dense] = router_problems("--model.path", str(models["Qwen3-8B"]), "--model.router_aux_loss_coef", "0.01")
    assert "'qwen3' is not an MoE whose router loss the engine adds" in dense
    assert router_problems(*moe, "--run.job", "dpo", "--model.router_aux_loss_coef", "0.01") == []
    [reward] = router_problems(*moe, "--run.job", "reward", "--model.router_aux_loss_coef", "0.01")
    assert "the reward job's objective does not take it" in reward
    [scratch] = router_problems("--model.router_aux_loss_coef", "0.01")  # the example has no model.path
    assert "random-initialised" in scratch


def test_a_model_inside_the_run_directory_or_a_run_directory_inside_the_model_is_an_error(tmp_path, monkeypatch):
    """The run writes checkpoints and final/ into its directory: a model.path there (a run's own final/, to train
    it further under the same name) would be replaced under the run; a run directory inside the model's would fill
    the model's directory with the run's files."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "sft" / "final").mkdir(parents=True)
    (tmp_path / "model").mkdir()
    config = tmp_path / "run.toml"
    config.write_text('[run]\nname = "sft"\noutput_dir = "runs"\n[model]\npath = "runs/sft/final"\n')

    def found(*overrides: str) -> list[tuple[str, str, int | None]]:
        problems, _ = lint_files([str(config)], list(overrides))
        return [(p.key, p.severity, p.line) for p in problems if p.key in ("model.path", "run.output_dir")]

    assert found() == [("model.path", "error", 5)]
    message = lint_files([str(config)])[0][0].message
    assert "is inside this run's directory runs/sft" in message and "use another run.name" in message
    assert found("--model.path", str(tmp_path / "runs" / "sft")) == [("model.path", "error", 0)]
    assert found("--run.output_dir", "model/runs", "--model.path", "./model") == [("run.output_dir", "error", 0)]
    assert found("--run.name", "sft2") == []  # another run's final/: the usual way to train on
    assert found("--model.path", "./model") == []
    assert found("--model.path", "Qwen/Qwen2.5-0.5B") == []  # a hub id is no directory here
