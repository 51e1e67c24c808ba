"""Hostile checkpoints: nothing in a checkpoint directory, a bucket archive or published weights runs code.

Each test plants what an attacker (or a careless copy) would: a `.metadata` pickle that calls `exec`, a payload in
the `step` bytes item with the metadata and manifest made consistent so it passes verification, an archive that
bloats as it is read, pickled weight files for a vLLM reload. The payload writes a marker file when it runs; every
test asserts the marker never appears, and that a checkpoint that verifies but does not load is set aside like a
damaged one (the run falls back to the one before instead of crash-looping).
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import io
import json
import pickle
import re
import shutil
import tarfile
from pathlib import Path

import pytest
import torch
from enginetools import TINY, run_cli, tiny_llama, tiny_overrides
from test_checkpoint import BrokenTokenizer, build_state, make_checkpointer, steps_on_disk, train

from prime_train.config.schema import CkptConfig
from prime_train.contract import read_heartbeat, read_json
from prime_train.engine.checkpoint import MANIFEST_FILE, digest_files, verify_checkpoint
from prime_train.engine.metrics import EngineConfigError
from prime_train.integrations.checkpoint_archive import (
    StorageError,
    UnsafeArchive,
    extract_archive,
    write_archive,
)
from prime_train.kit.events import read_events
from prime_train.retention import list_quarantined
from prime_train.rundir import list_checkpoints

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Payload:
    """Unpickled, it runs `exec`, which writes `marker`: the proof that a load ran code from the checkpoint."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


def rewrite_manifest(step_dir: Path) -> None:
    """Make manifest.json agree with the files as they are now (what an attacker with write access does)."""
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    names = sorted(manifest["files"])
    manifest["files"] = digest_files(step_dir, [step_dir / n for n in names])
    (step_dir / MANIFEST_FILE).write_text(json.dumps(manifest))


def trusted_metadata(step_dir: Path):
    with open(step_dir / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own checkpoint, before anything is planted


def plant_metadata_payload(step_dir: Path, marker: Path) -> None:
    """A real .metadata with a payload in planner_data, and a manifest that matches it."""
    metadata = trusted_metadata(step_dir)
    metadata.planner_data = Payload(marker)
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(step_dir)


def plant_step_payload(step_dir: Path, marker: Path) -> None:
    """torch.save(payload) as the `step` bytes item: appended to its shard, pointed at by .metadata, in the manifest."""
    buf = io.BytesIO()
    torch.save(Payload(marker), buf)
    blob = buf.getvalue()
    metadata = trusted_metadata(step_dir)
    [key] = [k for k in metadata.storage_data if k.fqn == "step"]
    info = metadata.storage_data[key]
    shard = step_dir / info.relative_path
    offset = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(blob)
    metadata.storage_data[key] = dataclasses.replace(info, offset=offset, length=len(blob))
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(step_dir)


def two_checkpoints(root: Path):
    """Steps 2 and 4 of a tiny model; returns the checkpointer that wrote them."""
    ckpt = make_checkpointer(root, async_save=False, keep_last=5)
    state = build_state(seed=0)
    train(state, 2)
    ckpt.save(state, 2)
    train(state, 2)
    ckpt.save(state, 4)
    ckpt.close()
    return ckpt


# ---------------------------------------------------------------------- .metadata


def test_a_real_metadata_reads_the_same_through_the_restricted_unpickler(tmp_path):
    from prime_train.engine import safe_dcp

    ckpt = two_checkpoints(tmp_path / "run")
    step_dir = ckpt.ckpt_dir / "step-4"
    safe = safe_dcp.read_metadata(step_dir)
    plain = trusted_metadata(step_dir)
    assert safe.state_dict_metadata == plain.state_dict_metadata
    assert safe.storage_data == plain.storage_data
    assert safe.planner_data == plain.planner_data


def test_a_planted_metadata_fails_verification_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = two_checkpoints(tmp_path / "run")
    plant_metadata_payload(ckpt.ckpt_dir / "step-4", marker)

    problem = verify_checkpoint(ckpt.ckpt_dir / "step-4")
    assert not marker.exists(), "verifying the checkpoint ran the .metadata payload"
    assert problem is not None and re.search(r"\.metadata does not load \(UnsafeCheckpointError: .*exec", problem)

    fresh = make_checkpointer(tmp_path / "run", resume="auto")
    state = build_state(seed=1)
    assert fresh.resume(state) == fresh.ckpt_dir / "step-2"
    assert state.step == 2 and not marker.exists()
    [aside] = list_quarantined(fresh.ckpt_dir)
    assert aside["step"] == 4 and "does not load" in aside["reason"]


def test_the_loader_never_unpickles_metadata_unrestricted(tmp_path):
    """Even past verification (a file swapped after it), Checkpointer.load reads .metadata restricted."""
    marker = tmp_path / "pwned"
    ckpt = two_checkpoints(tmp_path / "run")
    plant_metadata_payload(ckpt.ckpt_dir / "step-4", marker)
    with pytest.raises(pickle.UnpicklingError, match="refusing to unpickle"):
        ckpt.load(build_state(seed=1), ckpt.ckpt_dir / "step-4")
    assert not marker.exists()


def test_ckpt_to_hf_refuses_a_planted_metadata_without_running_it(tmp_path):
    from prime_train.engine.export import dcp_to_hf

    marker = tmp_path / "pwned"
    ckpt = make_checkpointer(tmp_path / "run", async_save=False)
    model = tiny_llama(0)
    ckpt.set_hf_assets(model.config, None)
    state = build_state(seed=0, model=model)
    ckpt.save(state, 1)
    plant_metadata_payload(ckpt.ckpt_dir / "step-1", marker)
    with pytest.raises(ValueError, match=r"\.metadata does not load .*refusing to unpickle"):
        dcp_to_hf(ckpt.ckpt_dir / "step-1", tmp_path / "hf")
    assert not marker.exists()


def test_metadata_that_points_outside_the_checkpoint_is_refused(tmp_path):
    ckpt = two_checkpoints(tmp_path / "run")
    step_dir = ckpt.ckpt_dir / "step-4"
    metadata = trusted_metadata(step_dir)
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = dataclasses.replace(metadata.storage_data[key], relative_path="../../../etc/passwd")
    (step_dir / ".metadata").write_bytes(pickle.dumps(metadata))
    rewrite_manifest(step_dir)
    assert "not a file inside the checkpoint" in (verify_checkpoint(step_dir) or "")


# ---------------------------------------------------------------------- bytes items


def test_a_payload_in_the_step_item_does_not_run_and_the_checkpoint_is_set_aside(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = two_checkpoints(tmp_path / "run")
    plant_step_payload(ckpt.ckpt_dir / "step-4", marker)
    assert verify_checkpoint(ckpt.ckpt_dir / "step-4") is None  # consistent: only loading it can tell

    fresh = make_checkpointer(tmp_path / "run", resume="auto", keep_last=1)
    state = build_state(seed=1)
    assert fresh.resume(state) == fresh.ckpt_dir / "step-2"
    assert not marker.exists(), "loading the checkpoint ran the payload in its step item"
    assert state.step == 2 and fresh.latest_step() == 2
    [aside] = list_quarantined(fresh.ckpt_dir)
    assert aside["step"] == 4 and Path(aside["path"]).name == "step-4.corrupt"
    assert re.search(r"verifies but does not load .*'step' is not plain data .*exec", aside["reason"]), aside
    assert [name for name, _ in fresh.quarantined] == ["step-4"]
    assert steps_on_disk(fresh) == [2]


def test_the_job_hears_before_each_load_and_after_a_failed_one_that_the_model_is_part_loaded(tmp_path):
    """Checkpointer.before_load: a job that must act on the starting weights (DPO's precomputed reference) is called
    before each checkpoint loads, told when a failed load has touched the model; its meta.json fields are saved."""
    ckpt = make_checkpointer(tmp_path / "run", async_save=False, keep_last=5)
    ckpt.meta_fields = {"reference_pairs": "abc"}
    state = build_state(seed=0)
    for step in (2, 4):
        train(state, 2)
        ckpt.save(state, step)
    ckpt.close()
    plant_step_payload(ckpt.ckpt_dir / "step-4", tmp_path / "pwned")

    fresh = make_checkpointer(tmp_path / "run", resume="auto")
    calls = []
    fresh.before_load = lambda path, meta, touched: calls.append((path and path.name, meta and meta["step"], touched))
    assert fresh.resume(build_state(seed=1)) == fresh.ckpt_dir / "step-2"
    assert calls == [("step-4", 4, False), ("step-2", 2, True)]
    assert read_json(fresh.ckpt_dir / "step-2" / "meta.json")["reference_pairs"] == "abc"

    empty = make_checkpointer(tmp_path / "other", resume="auto")
    calls.clear()
    empty.before_load = lambda path, meta, touched: calls.append((path, meta, touched))
    assert empty.resume(build_state(seed=1)) is None and calls == [(None, None, False)]


def test_a_payload_in_the_only_checkpoint_stops_the_start_and_the_next_trains_from_step_0(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = make_checkpointer(tmp_path / "run", async_save=False)
    ckpt.save(build_state(seed=0), 3)
    plant_step_payload(ckpt.ckpt_dir / "step-3", marker)
    fresh = make_checkpointer(tmp_path / "run", resume="auto")
    with pytest.raises(RuntimeError, match=r"step-3 it verifies but does not load.*next one trains from step 0"):
        fresh.resume(build_state(seed=1))
    assert not marker.exists()
    assert [q["step"] for q in list_quarantined(fresh.ckpt_dir)] == [3]
    assert make_checkpointer(tmp_path / "run", resume="auto").resume(build_state(seed=1)) is None


def test_an_explicit_resume_path_that_does_not_load_is_a_configuration_error(tmp_path):
    marker = tmp_path / "pwned"
    ckpt = two_checkpoints(tmp_path / "run")
    plant_step_payload(ckpt.ckpt_dir / "step-4", marker)
    ckpt.cfg = CkptConfig(resume="step-4")
    with pytest.raises(EngineConfigError, match=r"ckpt\.resume = 'step-4'.*does not load"):
        ckpt.resume(build_state(seed=1))
    assert not marker.exists() and steps_on_disk(ckpt) == [2, 4]


def test_a_checkpoint_of_another_model_is_a_configuration_error_and_stays(tmp_path):
    two_checkpoints(tmp_path / "run")
    fresh = make_checkpointer(tmp_path / "run", resume="auto")
    with pytest.raises(EngineConfigError, match=r"does not fit the model this config builds"):
        fresh.resume(build_state(seed=1, model=tiny_llama(1, hidden_size=48)))
    assert steps_on_disk(fresh) == [2, 4] and list_quarantined(fresh.ckpt_dir) == []


FAST = {"data.datasets.0.num_examples": 400, "supervisor.poll_interval_s": 0.5, "supervisor.backoff_initial_s": 0.2}


def test_a_run_whose_newest_checkpoint_carries_a_payload_resumes_from_the_one_before(tmp_path):
    """The reported attack: `run --resume` ran the payload, then crash-looped on "resuming from step N"."""
    marker = tmp_path / "pwned"
    # no save at the last step: step-4 is the newest checkpoint, the one the payload goes into
    last = {"train.max_steps": 6, "ckpt.interval": 2, "ckpt.resumable_final_save": "false"}
    over = tiny_overrides(tmp_path, "hostile", **FAST, **last)
    trained = run_cli("train", str(TINY), *over, timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    run_dir = tmp_path / "hostile"
    steps = [c.step for c in list_checkpoints(run_dir / "checkpoints")]
    assert steps[-2:] == [2, 4], steps
    plant_step_payload(run_dir / "checkpoints" / "step-4", marker)

    over = tiny_overrides(tmp_path, "hostile", **FAST, **{**last, "train.max_steps": 8})
    result = run_cli("run", str(TINY), "--resume", *over, timeout=300)
    assert not marker.exists(), "the payload in step-4 ran"
    assert result.returncode == 0, result.stdout[-4000:]
    events = read_events(run_dir / "events.jsonl")
    assert [e["event"] for e in events].count("attempt_started") == 1, "no crash, no loop"
    assert [e["step"] for e in events if e["event"] == "checkpoint_quarantined"] == [4]
    [aside] = list_quarantined(run_dir / "checkpoints")  # the event may predate the note: read the note itself
    assert aside["step"] == 4 and "does not load" in aside["reason"], aside
    assert read_heartbeat(run_dir / "progress.json").resumed_from == 2


def test_a_run_whose_only_checkpoint_carries_a_payload_starts_over_in_the_next_attempt_without_a_traceback(tmp_path):
    """The model is half loaded when the only checkpoint fails to load: that start ends in words (exit 1, its reason
    in the heartbeat), and the supervisor's next attempt trains from step 0 to the end."""
    marker = tmp_path / "pwned"
    # no save at the last step: step-2 is the only checkpoint
    over = tiny_overrides(
        tmp_path, "only", **FAST, **{"train.max_steps": 3, "ckpt.interval": 2, "ckpt.resumable_final_save": "false"}
    )
    trained = run_cli("train", str(TINY), *over, timeout=300)
    assert trained.returncode == 0, trained.stdout[-3000:] + trained.stderr[-3000:]
    run_dir = tmp_path / "only"
    assert [c.step for c in list_checkpoints(run_dir / "checkpoints")] == [2]
    plant_step_payload(run_dir / "checkpoints" / "step-2", marker)

    over = tiny_overrides(tmp_path, "only", **FAST, **{"train.max_steps": 4, "ckpt.interval": 2})
    result = run_cli("run", str(TINY), "--resume", *over, timeout=300)
    assert not marker.exists(), "the payload in step-2 ran"
    assert result.returncode == 0, result.stdout[-4000:]
    events = read_events(run_dir / "events.jsonl")
    attempts = [e["attempt"] for e in events if e["event"] == "attempt_started"]
    assert len(attempts) == 2, attempts
    first = (run_dir / "logs" / f"attempt-{attempts[0]}" / "trainer.log").read_text()
    assert "next one trains from step 0" in first and "Traceback" not in first, first[-3000:]
    assert read_heartbeat(run_dir / "progress.json").step == 4


# ---------------------------------------------------------------------- the bucket's archives


def _archive(tmp_path: Path, members, *, pax=None) -> tuple[Path, dict]:
    """A gzip tar of [(TarInfo, bytes | None)] and a manifest that matches it."""
    buf = io.BytesIO()
    files = {}
    with tarfile.open(fileobj=buf, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if pax:
                info.pax_headers = pax
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
            if info.isreg():
                files[info.name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    path = tmp_path / "step-3.tar.gz"
    path.write_bytes(buf.getvalue())
    return path, {"step": 3, "archive": path.name, "compression": "gzip", "files": files}


def _member(name: str, data: bytes | None = None):
    info = tarfile.TarInfo(name)
    if data is None:
        info.type = tarfile.DIRTYPE
    else:
        info.size = len(data)
    return info, data


def test_an_archive_with_an_oversized_extended_header_is_refused_before_it_is_read(tmp_path):
    archive, manifest = _archive(tmp_path, [_member("meta.json", b"{}")], pax={"comment": "x" * (4 << 20)})
    (tmp_path / "work").mkdir()
    with pytest.raises(UnsafeArchive, match="extended header"):
        extract_archive(archive, tmp_path / "work", 3, manifest)


def test_an_archive_with_more_members_than_its_files_need_is_refused(tmp_path, monkeypatch):
    from prime_train.integrations import checkpoint_archive

    monkeypatch.setattr(checkpoint_archive, "MAX_EXTRA_MEMBERS", 3, raising=False)
    archive, manifest = _archive(tmp_path, [*(_member(f"d{i}") for i in range(5)), _member("meta.json", b"{}")])
    (tmp_path / "work").mkdir()
    with pytest.raises(UnsafeArchive, match="more than 4 members for 1 files"):
        extract_archive(archive, tmp_path / "work", 3, manifest)


def test_an_archive_larger_than_the_free_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    archive, manifest = _archive(tmp_path, [_member("meta.json", b"{}")])
    manifest["files"]["meta.json"]["bytes"] = 2
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=64 << 20))
    (tmp_path / "work").mkdir()
    with pytest.raises(StorageError, match=r"no space left .* to restore step-3"):
        extract_archive(archive, tmp_path / "work", 3, manifest)
    assert list((tmp_path / "work").iterdir()) == []


def test_a_checkpoint_restored_from_an_archive_gets_the_same_checks(tmp_path):
    """A bucket writer's archive of a hostile checkpoint: extracted whole, then set aside at resume, never run."""
    marker = tmp_path / "pwned"
    ckpt = two_checkpoints(tmp_path / "src")
    plant_step_payload(ckpt.ckpt_dir / "step-4", marker)
    with open(tmp_path / "step-4.tar.gz", "wb") as raw:
        files, sha, _ = write_archive(ckpt.ckpt_dir / "step-4", raw, "gzip")
    manifest = {"step": 4, "archive": "step-4.tar.gz", "compression": "gzip", "files": files, "archive_sha256": sha}
    dest = make_checkpointer(tmp_path / "dst", async_save=False)
    dest.save(build_state(seed=0), 2)
    work = dest.ckpt_dir / "step-4.tmp"
    work.mkdir()
    extract_archive(tmp_path / "step-4.tar.gz", work, 4, manifest)
    work.rename(dest.ckpt_dir / "step-4")

    fresh = make_checkpointer(tmp_path / "dst", resume="auto")
    assert fresh.resume(build_state(seed=1)) == fresh.ckpt_dir / "step-2"
    assert not marker.exists()
    assert [q["step"] for q in list_quarantined(fresh.ckpt_dir)] == [4]


# ---------------------------------------------------------------------- RL weight reloads


def test_a_vllm_reload_loads_safetensors_only(tmp_path):
    from prime_train.rl.vllm_ext.prime_train_vllm import WeightReload

    calls = []

    class Worker(WeightReload):
        def reload_weights(self, weights_path):
            calls.append(weights_path)
            raise AssertionError("reached vLLM's loader")

    weights = tmp_path / "weights" / "step-3"
    weights.mkdir(parents=True)
    (weights / "config.json").write_text("{}")
    with gzip.open(weights / "pytorch_model.bin", "wb") as f:
        pickle.dump(Payload(tmp_path / "pwned"), f)
    with pytest.raises(ValueError, match=r"pickled weight files \(pytorch_model\.bin\)"):
        Worker().prime_train_reload_weights(str(weights))
    (weights / "pytorch_model.bin").unlink()
    with pytest.raises(ValueError, match=r"no \.safetensors"):
        Worker().prime_train_reload_weights(str(weights))
    assert calls == []


# ---------------------------------------------------------------------- what a failed save says


@pytest.mark.parametrize("removed", ["step-1", "checkpoints"])
def test_a_failed_save_says_the_previous_checkpoint_is_gone_when_it_is(tmp_path, removed):
    ckpt = make_checkpointer(tmp_path / "run", async_save=False)
    state = build_state(seed=0)
    ckpt.save(state, 1)
    shutil.rmtree(ckpt.ckpt_dir / "step-1" if removed == "step-1" else ckpt.ckpt_dir)
    ckpt.set_hf_assets(None, BrokenTokenizer())
    with pytest.raises(
        RuntimeError, match=r"step-2 was not saved .*No space left.*step-1, the one before, is gone."
    ) as e:
        ckpt.save(state, 2)
    assert "intact" not in str(e.value)


@pytest.mark.parametrize("where", ["shard", "hf"])
def test_a_symlink_inside_a_checkpoint_fails_verification_and_is_never_read_through(tmp_path, where):
    ckpt = two_checkpoints(tmp_path / "run")
    step_dir = ckpt.ckpt_dir / "step-4"
    outside = tmp_path / "outside.bin"
    if where == "shard":
        shard = next(step_dir.glob("*.distcp"))
        outside.write_bytes(shard.read_bytes())  # the same bytes: only the link is wrong
        shard.unlink()
        shard.symlink_to(outside)
    else:
        (step_dir / "hf").mkdir(exist_ok=True)
        (step_dir / "hf" / "tokenizer.json").symlink_to("/etc/hostname")
    problem = verify_checkpoint(step_dir)
    assert problem is not None and "is a symbolic link" in problem, problem


@pytest.mark.parametrize("name", ["/dev/zero", "../../outside.bin"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_fails_verification_without_reading_it(tmp_path, name):
    """/dev/zero has size 0 and never ends: read, it would hang the resume."""
    ckpt = two_checkpoints(tmp_path / "run")
    step_dir = ckpt.ckpt_dir / "step-4"
    (tmp_path / "outside.bin").write_bytes(b"")
    manifest = json.loads((step_dir / MANIFEST_FILE).read_text())
    manifest["files"][name] = {"bytes": 0, "crc32": "00000000"}
    (step_dir / MANIFEST_FILE).write_text(json.dumps(manifest))
    problem = verify_checkpoint(step_dir)
    assert problem is not None and "not a file inside the checkpoint" in problem, problem
