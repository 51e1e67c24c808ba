"""Config loading: merging files, command-line overrides, where each key is written, the TOML round
trip of a resolved config, and the field-by-field diff."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import tomli_w
from hypothesis import given, settings
from hypothesis import strategies as st

from prime_train.config.diff import diff, flatten
from prime_train.config.loader import (
    COMMAND_LINE,
    ConfigError,
    dump_toml,
    load_config,
    load_raw,
    merge,
    parse_override_args,
    to_toml_dict,
)
from prime_train.config.schema import Config
from prime_train.config.source import scan_positions
from prime_train.validator.lint import lint_files

REPO = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def problems_of(exc: pytest.ExceptionInfo[ConfigError]) -> list[tuple[str, str]]:
    return [(p.key, p.message) for p in exc.value.problems]


# ---------------------------------------------------------------- merging


@pytest.fixture
def base_and_overlay(tmp_path) -> tuple[str, str]:
    base = write(
        tmp_path,
        "base.toml",
        """
[run]
name = "base"

[train]
max_steps = 100
lr = 1e-3
warmup_steps = 10

[data]
sampling_probs = [0.5, 0.5]

[[data.datasets]]
task = "arithmetic"

[[data.datasets]]
task = "sorting"

[supervisor]
required_env = ["HF_TOKEN", "WANDB_API_KEY"]
""",
    )
    overlay = write(
        tmp_path,
        "overlay.toml",
        """
[train]
lr = 3e-4

[[data.datasets]]
task = "reverse-text"

[supervisor]
required_env = ["S3_KEY"]
""",
    )
    return base, overlay


def test_tables_merge_key_by_key_across_files(base_and_overlay):
    cfg = load_config(list(base_and_overlay))
    assert cfg.run.name == "base"
    assert cfg.train.lr == 3e-4  # from the overlay
    assert cfg.train.max_steps == 100  # untouched keys of the same table survive
    assert cfg.train.warmup_steps == 10


def test_lists_and_arrays_of_tables_from_a_later_file_replace_earlier_ones(base_and_overlay):
    cfg = load_config(list(base_and_overlay))
    assert [d.task for d in cfg.data.datasets] == ["reverse-text"]  # replaced, not appended
    assert cfg.supervisor.required_env == ["S3_KEY"]


def test_merge_order_decides_which_value_wins(base_and_overlay):
    base, overlay = base_and_overlay
    assert load_config([overlay, base]).train.lr == 1e-3
    assert load_config([base, overlay]).train.lr == 3e-4


def test_merge_leaves_its_inputs_untouched():
    base = {"train": {"lr": 1.0, "max_steps": 5}, "data": {"datasets": [{"task": "sorting"}]}}
    overlay = {"train": {"lr": 2.0}, "data": {"datasets": [{"task": "arithmetic"}]}}
    snapshot = repr((base, overlay))
    merged = merge(base, overlay)
    assert merged == {"train": {"lr": 2.0, "max_steps": 5}, "data": {"datasets": [{"task": "arithmetic"}]}}
    assert repr((base, overlay)) == snapshot
    merged["data"]["datasets"][0]["task"] = "changed"
    assert overlay["data"]["datasets"][0]["task"] == "arithmetic"


def test_no_files_means_the_defaults():
    assert load_config([]) == Config()


# ---------------------------------------------------------------- overrides


@pytest.mark.parametrize("args", [["--train.lr", "3e-4"], ["--train.lr=3e-4"]], ids=["space", "equals"])
def test_override_value_after_a_space_or_an_equals_sign(args):
    assert load_config([], args).train.lr == 3e-4


def test_a_bare_flag_sets_a_boolean_true_and_false_needs_a_value():
    cfg = load_config([], ["--train.compile", "--ckpt.async_save", "false", "--model.tie_embeddings=false"])
    assert cfg.train.compile is True
    assert cfg.ckpt.async_save is False
    assert cfg.model.tie_embeddings is False


def test_a_bare_flag_on_a_number_is_an_error_not_the_number_one():
    with pytest.raises(ConfigError) as exc:
        load_config([], ["--train.max_steps", "--train.compile"])
    [(key, message)] = problems_of(exc)
    assert key == "train.max_steps"
    assert "valid integer" in message


def test_override_lists_are_read_as_toml(tmp_path):
    two = write(tmp_path, "two.toml", '[[data.datasets]]\ntask = "sorting"\n[[data.datasets]]\ntask = "arithmetic"\n')
    cfg = load_config([two], ["--data.sampling_probs", "[0.25,0.75]", "--supervisor.required_env", '["A", "B"]'])
    assert cfg.data.sampling_probs == [0.25, 0.75]
    assert cfg.supervisor.required_env == ["A", "B"]


def test_none_unsets_an_optional_field(tmp_path):
    path = write(tmp_path, "gqa.toml", "[model]\nnum_kv_heads = 2\n[train]\ngrad_clip = 1.0\n")
    assert load_config([path]).model.num_kv_heads == 2
    cfg = load_config([path], ["--model.num_kv_heads", "none", "--train.grad_clip=null"])
    assert cfg.model.num_kv_heads is None
    assert cfg.train.grad_clip is None


def test_none_names_the_choice_of_a_field_that_cannot_be_unset(tmp_path):
    # `--lora.quantize none` was read as unset and refused with "got None"
    path = write(
        tmp_path, "qlora.toml", '[lora]\nrank = 8\nquantize = "nf4"\n[model]\nactivation_checkpointing = "full"\n'
    )
    cfg = load_config([path], ["--lora.quantize", "none", "--model.activation_checkpointing", "None"])
    assert cfg.lora.quantize == "none"
    assert cfg.model.activation_checkpointing == "none"
    with pytest.raises(ConfigError) as exc:
        load_config([], ["--train.scheduler", "null"])
    [(key, message)] = problems_of(exc)
    assert key == "train.scheduler" and "'null'" in message


def test_text_fields_keep_what_was_typed_even_when_it_looks_like_a_number():
    cfg = load_config([], ["--run.name", "2024", "--ckpt.resume", "never", "--model.tokenizer", "true"])
    assert cfg.run.name == "2024"
    assert cfg.model.tokenizer == "true"


def test_override_sets_a_key_of_a_dict_field():
    cfg = load_config([], ["--job.env.HF_HOME", "/cache/hf", "--job.env.OMP_NUM_THREADS", "4"])
    assert cfg.job.env == {"HF_HOME": "/cache/hf", "OMP_NUM_THREADS": "4"}


def test_override_indexes_into_data_datasets(tmp_path):
    two = write(tmp_path, "two.toml", '[[data.datasets]]\ntask = "sorting"\n[[data.datasets]]\ntask = "arithmetic"\n')
    cfg = load_config([two], ["--data.datasets.1.num_examples", "50", "--data.datasets.0.task", "reverse-text"])
    assert [(d.task, d.num_examples) for d in cfg.data.datasets] == [("reverse-text", 20000), ("arithmetic", 50)]


def test_override_of_a_dataset_the_files_do_not_have_says_so(tmp_path):
    one = write(tmp_path, "one.toml", '[[data.datasets]]\ntask = "sorting"\n')
    with pytest.raises(ConfigError) as exc:
        load_config([one], ["--data.datasets.3.task", "arithmetic"])
    [(key, message)] = problems_of(exc)
    assert key == "data.datasets.3.task"
    assert "data.datasets has no item 3" in message


def test_overrides_beat_files_and_the_last_override_wins(tmp_path):
    path = write(tmp_path, "a.toml", "[train]\nmax_steps = 100\n")
    assert load_config([path], ["--train.max_steps", "7", "--train.max_steps=9"]).train.max_steps == 9


def test_unknown_override_key_names_the_key_and_suggests_one():
    with pytest.raises(ConfigError) as exc:
        load_config([], ["--train.lerning_rate", "3e-4"])
    [problem] = exc.value.problems
    assert (problem.file, problem.line, problem.key) == (COMMAND_LINE, 0, "train.lerning_rate")
    assert "--train.lerning_rate" in problem.message
    assert "did you mean `lr`?" in problem.message


def test_unknown_override_section_suggests_one():
    with pytest.raises(ConfigError) as exc:
        load_config([], ["--trainer.lr", "3e-4", "--ckpt.keep_last", "2"])
    [(key, message)] = problems_of(exc)
    assert key == "trainer.lr"
    assert "unknown section [trainer]; did you mean [train]?" in message


def test_every_bad_override_is_reported_at_once():
    with pytest.raises(ConfigError) as exc:
        load_config([], ["--trian.lr", "1", "--train.stepz", "3", "--train", "4"])
    assert [key for key, _ in problems_of(exc)] == ["trian.lr", "train.stepz", "train"]


def test_override_below_a_value_explains_it_is_not_a_table():
    with pytest.raises(ConfigError) as exc:
        load_config([], ["--train.lr.peak", "1"])
    [(_, message)] = problems_of(exc)
    assert "`train.lr` is a value, not a table" in message


def test_a_stray_positional_argument_is_an_error():
    with pytest.raises(ConfigError) as exc:
        parse_override_args(["--train.lr", "1", "oops", "2"])
    assert "unexpected argument 'oops'" in exc.value.problems[0].message


def test_negative_numbers_are_values_not_options():
    assert parse_override_args(["--train.lr", "-1e-3", "--run.seed", "-5"]) == [
        ("train.lr", "-1e-3"),
        ("run.seed", "-5"),
    ]


# ---------------------------------------------------------------- where keys are written

DOCUMENT = '''\
# a comment with [brackets] and key = value
run.name = "dotted"
run."output_dir" = "runs"

[train]
'lr' = 3e-4
"max_steps" = 100   # trailing comment [x]
"a.b" = 1

[model]
notes = """
[not.a.table]
fake = 1
"""
hidden_size = 64
raw = \'\'\'
num_heads = 2
\'\'\'
num_heads = 4

[supervisor]
required_env = [
  "A",   # [ a bracket in a comment
  "B]",
]
max_restarts = 2
inline = { deep = 1, other = "x" }

[[data.datasets]]
task = "sorting"

[[data.datasets]]
path = "x.jsonl"

[data]
seq_len = 64
'''


@pytest.mark.parametrize(
    ("path", "line", "column"),
    [
        (("run", "name"), 2, 1),
        (("run", "output_dir"), 3, 1),
        (("train",), 5, 1),
        (("train", "lr"), 6, 1),
        (("train", "max_steps"), 7, 1),
        (("train", "a.b"), 8, 1),
        (("model", "hidden_size"), 15, 1),
        (("model", "num_heads"), 19, 1),
        (("supervisor", "required_env"), 22, 1),
        (("supervisor", "max_restarts"), 26, 1),
        (("supervisor", "inline"), 27, 1),
        (("supervisor", "inline", "deep"), 27, 12),
        (("supervisor", "inline", "other"), 27, 22),
        (("data", "datasets"), 29, 1),
        (("data", "datasets", 0), 29, 1),
        (("data", "datasets", 0, "task"), 30, 1),
        (("data", "datasets", 1), 32, 1),
        (("data", "datasets", 1, "path"), 33, 1),
        (("data",), 35, 1),
        (("data", "seq_len"), 36, 1),
    ],
)
def test_scanner_places_each_key_on_its_line(path, line, column):
    positions = scan_positions(DOCUMENT, "doc.toml")
    assert (positions[path].line, positions[path].column) == (line, column)


def test_scanner_ignores_look_alikes_inside_strings_and_comments():
    positions = scan_positions(DOCUMENT, "doc.toml")
    assert ("not", "a", "table") not in positions
    assert ("model", "fake") not in positions
    assert ("brackets",) not in positions
    tomllib.loads(DOCUMENT)  # the document itself is valid TOML


def test_lint_reports_keys_after_multiline_values_on_their_own_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = DOCUMENT.replace("hidden_size = 64", "hiden_size = 64").replace("max_restarts = 2", "max_restart = 2")
    problems, _ = lint_files([write(tmp_path, "doc.toml", text)])
    unknown = [(p.line, p.key) for p in problems if "unknown key" in p.message]
    assert unknown == [
        (8, "train.a.b"),
        (11, "model.notes"),
        (15, "model.hiden_size"),
        (16, "model.raw"),
        (26, "supervisor.max_restart"),
        (27, "supervisor.inline"),
    ]


@settings(max_examples=100, deadline=None)
@given(keys=st.lists(st.text(max_size=8), min_size=1, max_size=8, unique=True))
def test_scanner_finds_every_key_tomli_w_writes_however_it_is_quoted(keys):
    table = {k: i for i, k in enumerate(keys)}
    text = tomli_w.dumps({"t": table, "arr": [{"k": 1}], "u": {k: {"x": 1} for k in keys[:2]}})
    assert tomllib.loads(text)["t"] == table
    positions = scan_positions(text, "gen.toml")
    lines = text.split("\n")
    for key in keys:
        written = lines[positions[("t", key)].line - 1]
        assert written.endswith(f"= {table[key]}"), (key, written)
    for key in keys[:2]:
        assert lines[positions[("u", key)].line - 1].startswith("[u.")


def test_syntax_error_at_the_end_of_a_file_without_a_newline_points_at_the_last_line(tmp_path):
    path = write(tmp_path, "eof.toml", "[train]\nmax_steps = 3\nlr = ")
    problems, _ = lint_files([path])
    assert [(p.line, p.key) for p in problems] == [(3, "")]
    assert "TOML syntax error" in problems[0].message


def test_a_value_from_the_command_line_is_reported_there(tmp_path):
    path = write(tmp_path, "a.toml", "[train]\nlr = 1e-3\n")
    _, sources = load_raw([path], ["--train.lr", "-1"])
    assert sources.locate(("train", "lr")) == (COMMAND_LINE, 0, 0)
    with pytest.raises(ConfigError) as exc:
        load_config([path], ["--train.lr", "-1"])
    [problem] = exc.value.problems
    assert (problem.file, problem.line, problem.key) == (COMMAND_LINE, 0, "train.lr")


# ---------------------------------------------------------------- the resolved config as TOML


def round_trip_sources() -> list[Path]:
    return sorted([*REPO.glob("configs/**/*.toml"), *REPO.glob("prime_train/configs/*.toml")])


@pytest.mark.parametrize("source", [None, *round_trip_sources()], ids=lambda p: p.name if p else "defaults")
def test_shown_config_reloads_to_the_same_config(source, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config([str(source)] if source else [])
    text = dump_toml(cfg)
    assert tomllib.loads(text) == to_toml_dict(cfg)
    again = load_config([write(tmp_path, "shown.toml", text)])
    assert again == cfg
    assert dump_toml(again) == text


def test_round_trip_keeps_unset_fields_unset_and_regexes_intact(tmp_path):
    cfg = load_config(
        [],
        ["--job.command", '["python", "t.py"]', "--job.progress_regex", r"step (\d+)", "--job.env.A", "b c"],
    )
    data = to_toml_dict(cfg)
    assert "path" not in data["model"]  # None is left out: TOML has no null
    again = load_config([write(tmp_path, "rt.toml", tomli_w.dumps(data))])
    assert again.model.path is None
    assert again.job.progress_regex == r"step (\d+)"
    assert again.job.env == {"A": "b c"}


# ---------------------------------------------------------------- diff


def test_diff_of_identical_configs_is_empty():
    assert diff(to_toml_dict(Config()), to_toml_dict(Config())) == []


def test_diff_names_changed_added_and_removed_fields(tmp_path):
    a = load_config(
        [write(tmp_path, "a.toml", '[[data.datasets]]\ntask = "sorting"\n[[data.datasets]]\ntask = "arithmetic"\n')]
    )
    b = load_config(
        [write(tmp_path, "b.toml", '[model]\npath = "Qwen/Qwen2.5-0.5B"\n[[data.datasets]]\ntask = "sorting"\n')],
        ["--train.lr", "1e-4"],
    )
    changes = {(c.key, c.kind): (c.old, c.new) for c in diff(to_toml_dict(a), to_toml_dict(b))}
    assert changes[("train.lr", "changed")] == (3e-3, 1e-4)
    assert changes[("model.path", "added")] == (None, "Qwen/Qwen2.5-0.5B")
    assert changes[("data.datasets[1].task", "removed")] == ("arithmetic", None)
    assert {kind for _, kind in changes} == {"changed", "added", "removed"}
    assert all(key.startswith(("train.", "model.", "data.datasets[1]")) for key, _ in changes)


def test_diff_lists_changes_in_the_first_configs_order_then_additions():
    a = {"run": {"name": "a"}, "train": {"lr": 1, "gone": 2}}
    b = {"train": {"lr": 2}, "run": {"name": "b"}, "new": {"x": 1}}
    assert [(c.key, c.kind) for c in diff(a, b)] == [
        ("run.name", "changed"),
        ("train.lr", "changed"),
        ("train.gone", "removed"),
        ("new.x", "added"),
    ]


def test_flatten_keeps_plain_lists_whole_and_indexes_lists_of_tables():
    assert flatten({"s": {"env": ["A", "B"], "ds": [{"t": 1}, {"t": 2}], "empty": {}}}) == {
        "s.env": ["A", "B"],
        "s.ds[0].t": 1,
        "s.ds[1].t": 2,
        "s.empty": {},
    }
