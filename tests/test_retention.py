"""The run-directory contract (layout, atomic JSON, checkpoint listing) and retention with safe deletion."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prime_train import retention
from prime_train.contract import append_jsonl, read_json, write_json_atomic
from prime_train.retention import apply_retention, clean_stale_tmp, safe_remove_checkpoint, select_for_deletion
from prime_train.rundir import CheckpointInfo, RunDir, list_checkpoints, newest_checkpoint


def make_ckpt(ckpt_dir: Path, name: str) -> Path:
    path = ckpt_dir / name
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"meta")
    (path / "__0_0.distcp").write_bytes(b"x" * 16)
    return path


def make_outside(tmp_path: Path) -> Path:
    """A directory outside the checkpoints dir that no cleanup may touch."""
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "keep.bin").write_bytes(b"keep me")
    return outside


def names(ckpt_dir: Path) -> list[str]:
    return sorted(os.listdir(ckpt_dir))


# ---------------------------------------------------------------------- layout and JSON


def test_rundir_paths_follow_the_documented_layout_without_touching_disk(tmp_path):
    rd = RunDir(tmp_path / "runs" / "tiny")
    assert not rd.root.exists()
    assert rd.config_path == rd.root / "config.toml"
    assert rd.events_path == rd.root / "events.jsonl"
    assert rd.supervisor_path == rd.root / "supervisor.json"
    assert rd.progress_path == rd.root / "progress.json"
    assert rd.metrics_path == rd.root / "metrics.jsonl"
    assert rd.checkpoints_dir == rd.root / "checkpoints"
    assert rd.final_dir == rd.root / "final"
    assert rd.tensorboard_dir == rd.root / "tensorboard"
    assert rd.attempt_logs(3) == rd.root / "logs" / "attempt-3"
    assert rd.latest_logs == rd.logs_dir / "latest"
    assert rd.rank_logs(3) == rd.root / "logs" / "attempt-3" / "ranks"
    rd.create()
    assert rd.logs_dir.is_dir() and rd.checkpoints_dir.is_dir()
    rd.create()  # idempotent


def test_one_layout_puts_the_checkpoints_where_ckpt_dir_says_for_the_config_and_for_a_reader_of_config_toml(tmp_path):
    from prime_train.config.schema import Config

    shared = tmp_path / "shared"
    cfg = Config.model_validate({"run": {"name": "r", "output_dir": str(tmp_path)}, "ckpt": {"dir": str(shared)}})
    assert cfg.layout.root == tmp_path / "r" and cfg.layout.checkpoints_dir == shared
    assert RunDir.of_run(tmp_path / "r", {"ckpt": {"dir": str(shared)}}).checkpoints_dir == shared
    assert RunDir(tmp_path, ckpt_dir="~/c").checkpoints_dir == Path.home() / "c"
    for unset in ({}, {"ckpt": {"dir": ""}}, {"ckpt": {"dir": 3}}, {"ckpt": "x"}, None):  # a hostile config.toml too
        assert RunDir.of_run(tmp_path / "r", unset).checkpoints_dir == tmp_path / "r" / "checkpoints"
    cfg.layout.create()  # ckpt.dir is the job's to make; the run directory's own checkpoints/ is made as ever
    assert not shared.exists() and (tmp_path / "r" / "checkpoints").is_dir()


def test_write_json_atomic_replaces_the_file_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "progress.json"
    write_json_atomic(path, {"step": 1})
    write_json_atomic(path, {"step": 2, "loss": 0.5})
    assert json.loads(path.read_text()) == {"step": 2, "loss": 0.5}
    assert os.listdir(tmp_path) == ["progress.json"]


def test_write_json_atomic_keeps_the_old_file_when_serialising_fails(tmp_path):
    path = tmp_path / "supervisor.json"
    write_json_atomic(path, {"attempt": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"attempt": object()})
    assert read_json(path) == {"attempt": 1}
    assert os.listdir(tmp_path) == ["supervisor.json"]


def test_read_json_returns_none_for_missing_half_written_or_non_object_files(tmp_path):
    assert read_json(tmp_path / "missing.json") is None
    (tmp_path / "half.json").write_text('{"step": 4, "lo')
    assert read_json(tmp_path / "half.json") is None
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00")
    assert read_json(tmp_path / "binary.json") is None
    (tmp_path / "list.json").write_text("[1, 2]")
    assert read_json(tmp_path / "list.json") is None
    (tmp_path / "dir.json").mkdir()
    assert read_json(tmp_path / "dir.json") is None
    (tmp_path / "ok.json").write_text('{"step": 4}')
    assert read_json(tmp_path / "ok.json") == {"step": 4}


def test_append_jsonl_writes_one_parseable_line_per_object(tmp_path):
    path = tmp_path / "events.jsonl"
    append_jsonl(path, {"event": "start", "msg": "two\nlines"})
    append_jsonl(path, {"event": "exit", "code": 75})
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"event": "start", "msg": "two\nlines"},
        {"event": "exit", "code": 75},
    ]


# ---------------------------------------------------------------------- listing


def test_list_checkpoints_returns_only_real_step_directories_sorted_by_step(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for name in ("step-10", "step-2", "step-100"):
        make_ckpt(ckpt, name)
    make_ckpt(ckpt, "step-200.tmp")
    make_ckpt(ckpt, "step-x")
    (ckpt / "step-9").write_text("a file, not a checkpoint")
    (ckpt / "step-300").symlink_to(make_outside(tmp_path), target_is_directory=True)
    found = list_checkpoints(ckpt)
    assert found == [CheckpointInfo(s, ckpt / f"step-{s}") for s in (2, 10, 100)]
    assert list_checkpoints(tmp_path / "nope") == []


def test_newest_checkpoint_ignores_a_newer_unfinished_save(tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_ckpt(ckpt, "step-10")
    make_ckpt(ckpt, "step-20.tmp")
    assert newest_checkpoint(ckpt) == CheckpointInfo(10, ckpt / "step-10")
    assert newest_checkpoint(tmp_path / "empty") is None


# ---------------------------------------------------------------------- the retention policy


def test_select_for_deletion_keeps_the_newest_keep_last_and_returns_the_rest_oldest_first():
    assert select_for_deletion([5, 1, 4, 2, 3], keep_last=2, keep_every=None) == [1, 2, 3]


def test_select_for_deletion_keeps_multiples_of_keep_every_and_protected_steps():
    steps = [100, 200, 300, 400, 500, 600]
    assert select_for_deletion(steps, keep_last=1, keep_every=200) == [100, 300, 500]
    assert select_for_deletion(steps, keep_last=1, keep_every=200, protect=frozenset({300})) == [100, 500]


def test_select_for_deletion_with_keep_last_unset_deletes_nothing():
    assert select_for_deletion([1, 2, 3], keep_last=None, keep_every=None) == []
    assert select_for_deletion([], keep_last=1, keep_every=None) == []


def test_select_for_deletion_always_keeps_the_newest_step():
    assert select_for_deletion([1, 2, 3], keep_last=0, keep_every=None) == [1, 2]


@settings(deadline=None)  # a loaded CI machine must not turn slowness into a failure
@given(
    steps=st.lists(st.integers(0, 500), max_size=30),
    keep_last=st.none() | st.integers(0, 8),
    keep_every=st.none() | st.integers(1, 50),
    protect=st.frozensets(st.integers(0, 500), max_size=5),
)
def test_select_for_deletion_properties(steps, keep_last, keep_every, protect):
    doomed = select_for_deletion(steps, keep_last, keep_every, protect)
    assert doomed == sorted(set(doomed))
    assert set(doomed) <= set(steps)
    assert not set(doomed) & protect
    if steps:
        assert max(steps) not in doomed
        kept = sorted(set(steps) - set(doomed))
        if keep_last is not None:
            assert set(sorted(set(steps))[-keep_last:] if keep_last else []) <= set(kept)
        else:
            assert doomed == []
    if keep_every is not None:
        assert all(s % keep_every for s in doomed)


# ---------------------------------------------------------------------- deletion


def test_safe_remove_deletes_a_checkpoint_directory(tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_ckpt(ckpt, "step-3")
    make_ckpt(ckpt, "step-4.tmp")
    safe_remove_checkpoint(ckpt / "step-3", ckpt)
    safe_remove_checkpoint(ckpt / "step-4.tmp", ckpt)
    assert names(ckpt) == []
    safe_remove_checkpoint(ckpt / "step-3", ckpt)  # already gone: not an error


@pytest.mark.parametrize(
    "relative",
    ["precious", "step-1/inner", "../outside/step-1", "checkpoints", "notes", "step-1.bak"],
)
def test_safe_remove_refuses_paths_that_are_not_a_checkpoint_inside_the_directory(tmp_path, relative):
    ckpt = tmp_path / "checkpoints"
    make_ckpt(ckpt, "step-1")
    make_ckpt(ckpt / "step-1", "inner")
    make_ckpt(tmp_path / "outside", "step-1")
    (ckpt / "notes").mkdir()
    (ckpt / "step-1.bak").mkdir()
    make_outside(tmp_path)
    with pytest.raises(ValueError, match="refusing"):
        safe_remove_checkpoint(ckpt / relative, ckpt)
    assert (tmp_path / "outside" / "step-1" / ".metadata").exists()
    assert (ckpt / "step-1" / ".metadata").exists()
    assert (tmp_path / "precious" / "keep.bin").exists()


def test_safe_remove_refuses_a_step_directory_reached_through_a_symlinked_parent(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    elsewhere = tmp_path / "elsewhere"
    make_ckpt(elsewhere, "step-3")
    (ckpt / "alias").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="not directly inside"):
        safe_remove_checkpoint(ckpt / "alias" / "step-3", ckpt)
    assert (elsewhere / "step-3" / ".metadata").exists()


def test_safe_remove_unlinks_a_symlinked_checkpoint_but_never_its_target(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    outside = make_outside(tmp_path)
    (ckpt / "step-5").symlink_to(outside, target_is_directory=True)
    safe_remove_checkpoint(ckpt / "step-5", ckpt)
    assert not (ckpt / "step-5").is_symlink()
    assert (outside / "keep.bin").read_bytes() == b"keep me"


def test_safe_remove_does_not_follow_symlinks_inside_a_checkpoint(tmp_path):
    ckpt = tmp_path / "checkpoints"
    step = make_ckpt(ckpt, "step-3")
    outside = make_outside(tmp_path)
    (step / "weights").symlink_to(outside, target_is_directory=True)
    (step / "one.bin").symlink_to(outside / "keep.bin")
    safe_remove_checkpoint(step, ckpt)
    assert names(ckpt) == []
    assert (outside / "keep.bin").read_bytes() == b"keep me"


def test_safe_remove_refuses_a_file_named_like_a_checkpoint(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (ckpt / "step-9").write_text("not a directory")
    with pytest.raises(ValueError, match="a file"):
        safe_remove_checkpoint(ckpt / "step-9", ckpt)
    assert (ckpt / "step-9").read_text() == "not a directory"


def test_safe_remove_interrupted_mid_delete_never_leaves_a_partial_step_directory(tmp_path, monkeypatch):
    ckpt = tmp_path / "checkpoints"
    make_ckpt(ckpt, "step-1")
    make_ckpt(ckpt, "step-2")

    def crash(path, *args, **kwargs):
        raise OSError("killed mid-delete")

    monkeypatch.setattr(retention.shutil, "rmtree", crash)
    with pytest.raises(OSError):
        safe_remove_checkpoint(ckpt / "step-1", ckpt)
    assert [c.step for c in list_checkpoints(ckpt)] == [2]
    monkeypatch.undo()
    assert clean_stale_tmp(ckpt) == [ckpt / "step-1.tmp"]
    assert names(ckpt) == ["step-2"]


# ---------------------------------------------------------------------- retention and stale saves


def test_apply_retention_never_deletes_the_newest_whole_checkpoint_when_a_newer_save_is_unfinished(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for s in (1, 2, 3, 4):
        make_ckpt(ckpt, f"step-{s}")
    make_ckpt(ckpt, "step-5.tmp")
    removed = apply_retention(ckpt, keep_last=1, keep_every=None)
    assert removed == [ckpt / "step-1", ckpt / "step-2", ckpt / "step-3"]
    assert names(ckpt) == ["step-4", "step-5.tmp"]


def test_apply_retention_keeps_multiples_and_protected_steps(tmp_path):
    ckpt = tmp_path / "checkpoints"
    for s in (10, 20, 30, 40, 50):
        make_ckpt(ckpt, f"step-{s}")
    apply_retention(ckpt, keep_last=1, keep_every=20, protect=frozenset({30}))
    assert names(ckpt) == ["step-20", "step-30", "step-40", "step-50"]


def test_apply_retention_leaves_symlinks_files_and_their_targets_alone(tmp_path):
    ckpt = tmp_path / "checkpoints"
    outside = make_outside(tmp_path)
    (ckpt).mkdir()
    (ckpt / "step-1").symlink_to(outside, target_is_directory=True)
    (ckpt / "step-9").write_text("file")
    make_ckpt(ckpt, "step-2")
    make_ckpt(ckpt, "step-3")
    assert apply_retention(ckpt, keep_last=1, keep_every=None) == [ckpt / "step-2"]
    assert names(ckpt) == ["step-1", "step-3", "step-9"]
    assert (outside / "keep.bin").exists()


def test_clean_stale_tmp_removes_unfinished_saves_only(tmp_path):
    ckpt = tmp_path / "checkpoints"
    outside = make_outside(tmp_path)
    make_ckpt(ckpt, "step-2")
    make_ckpt(ckpt, "step-3.tmp")
    (ckpt / "step-4.tmp").symlink_to(outside, target_is_directory=True)
    (ckpt / "step-5.tmp").write_text("a file")
    removed = clean_stale_tmp(ckpt)
    assert sorted(removed) == [ckpt / "step-3.tmp", ckpt / "step-4.tmp"]
    assert names(ckpt) == ["step-2", "step-5.tmp"]
    assert (outside / "keep.bin").exists()
    assert clean_stale_tmp(tmp_path / "missing") == []


def test_process_start_time_read_without_psutil_is_psutils_create_time():
    import psutil

    from prime_train.contract import process_started_at, same_process_alive

    pid = os.getpid()
    assert abs(process_started_at(pid) - psutil.Process(pid).create_time()) < 0.02
    assert same_process_alive(pid, psutil.Process(pid).create_time())
    assert not same_process_alive(pid, psutil.Process(pid).create_time() - 30), "another process, same pid"


def test_a_tmp_is_being_written_while_its_owner_lives_and_stale_once_it_is_gone_or_its_pid_recycled(tmp_path):
    import socket
    import subprocess

    from prime_train.contract import process_started_at
    from prime_train.retention import TMP_OWNER_FILE, claim_tmp, tmp_writer

    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    mine = ckpt / "step-1.tmp"
    claim_tmp(mine)
    assert read_json(mine / TMP_OWNER_FILE)["pid"] == os.getpid()
    assert tmp_writer(mine) is None, "this process's own unfinished save is stale to itself"
    assert [p.name for p in ckpt.iterdir()] == ["step-1.tmp"], "no private name left behind"

    other = subprocess.Popen(["sleep", "600"])
    try:
        owner = {"pid": other.pid, "host": socket.gethostname(), "started_at": process_started_at(other.pid)}
        for name, fields, writer in [
            ("step-2.tmp", {}, f"pid {other.pid}, still running"),
            ("step-3.tmp", {"started_at": owner["started_at"] - 100}, None),  # the pid was recycled since
            ("step-4.tmp", {"host": "elsewhere"}, f"pid {other.pid} on elsewhere (another machine)"),
        ]:
            (ckpt / name).mkdir()
            write_json_atomic(ckpt / name / TMP_OWNER_FILE, {**owner, **fields})
            assert tmp_writer(ckpt / name) == writer, name
        assert sorted(p.name for p in clean_stale_tmp(ckpt)) == ["step-1.tmp", "step-3.tmp"]
        other.kill()
        other.wait()
        assert [p.name for p in clean_stale_tmp(ckpt)] == ["step-2.tmp"]
        assert names(ckpt) == ["step-4.tmp"]
    finally:
        other.kill()


def test_quarantine_renames_and_never_deletes_and_nothing_counts_or_cleans_a_quarantined_checkpoint(tmp_path):
    from prime_train.retention import list_quarantined, quarantine_checkpoint

    ckpt = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        make_ckpt(ckpt, f"step-{step}")
    first = quarantine_checkpoint(ckpt / "step-3", ckpt, "its .metadata does not load")
    make_ckpt(ckpt, "step-3")  # saved again later, and damaged again
    second = quarantine_checkpoint(ckpt / "step-3", ckpt, "__0_0.distcp is truncated")
    assert (first.name, second.name) == ("step-3.corrupt", "step-3.corrupt-2")
    assert (first / "__0_0.distcp").read_bytes() == b"x" * 16
    assert [(q["step"], q["reason"]) for q in list_quarantined(ckpt)] == [
        (3, "its .metadata does not load"),
        (3, "__0_0.distcp is truncated"),
    ]
    assert newest_checkpoint(ckpt).step == 2
    assert apply_retention(ckpt, keep_last=1, keep_every=None) == [ckpt / "step-1"]
    assert clean_stale_tmp(ckpt) == []
    assert names(ckpt) == ["step-2", "step-3.corrupt", "step-3.corrupt-2"]
    with pytest.raises(ValueError, match="not a step-N directory"):
        quarantine_checkpoint(first, ckpt, "again")


def test_read_jsonl_takes_torn_lines_non_objects_nan_null_and_bytes_that_are_not_utf8(tmp_path):
    from prime_train.contract import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"a": NaN, "b": null}\n\xff\xfe\n[1]\n"text"\n{"c": "\xe9"}\n{"d": 1')
    records = read_jsonl(path)
    assert len(records) == 2 and records[0]["b"] is None and records[0]["a"] != records[0]["a"]
    assert records[1] == {"c": "\ufffd"}
    assert read_jsonl(tmp_path / "missing.jsonl") == []


def test_contract_and_retention_never_import_torch():
    import subprocess
    import sys

    code = "import sys, prime_train.contract, prime_train.retention; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
