"""Checkpoints in object storage, against moto's S3 server over HTTP (a real subprocess on 127.0.0.1).

Covers integrations/storage.py and checkpoint_archive.py (archive, manifest, verified download, tar-slip
refusal, retention, heartbeat) and resilience/backup.py (background uploads from the watcher, restore before start).
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from prime_train.contract import write_json_atomic
from prime_train.integrations.storage import (
    CheckpointStore,
    CorruptCheckpoint,
    StorageError,
    UnsafeArchive,
    parse_remote,
)
from prime_train.kit.events import EventLog, read_events
from prime_train.resilience.backup import BackupWatcher, restore_before_start
from prime_train.retention import safe_remove_checkpoint
from prime_train.rundir import list_checkpoints

boto3 = pytest.importorskip("boto3")

ACCESS_KEY = "AKIDPRIMETRAINTEST01"
SECRET = "pt-fake-secret-Zq8vN3xR7wL2kP5m"
MiB = 1024 * 1024


# ---------------------------------------------------------------- moto's S3 server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's S3 server as a real process on a free port; yields its URL."""
    port = _free_port()
    script = Path(sys.executable).parent / "moto_server"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "moto.server"]
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*argv, "-H", "127.0.0.1", "-p", str(port)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                urllib.request.urlopen(url + "/", timeout=2).close()
                break
            except urllib.error.HTTPError:
                break  # it answers: up
            except OSError:
                if time.time() > deadline:
                    raise RuntimeError("moto_server did not answer within 60 s") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(autouse=True)
def aws_env(monkeypatch, tmp_path):
    """Dummy credentials through the standard chain (environment), nothing from ~/.aws."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def bucket(s3_endpoint):
    name = f"pt-{uuid.uuid4().hex[:16]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=name)
    return name


@pytest.fixture
def s3(s3_endpoint):
    return boto3.client("s3", endpoint_url=s3_endpoint)


def make_store(endpoint: str, bucket: str, cls=CheckpointStore, **kw) -> CheckpointStore:
    kw.setdefault("part_bytes", 5 * MiB)
    kw.setdefault("multipart_threshold", 5 * MiB)
    return cls(f"s3://{bucket}/runs/exp1", endpoint_url=endpoint, **kw)


def make_checkpoint(ckpt_dir: Path, step: int, *, big: int = 64 * 1024) -> Path:
    """A checkpoint-shaped directory: DCP-like shard and metadata, meta.json, nested hf/ assets, an empty dir."""
    rng = random.Random(step)
    d = ckpt_dir / f"step-{step}"
    (d / "hf" / "tokenizer").mkdir(parents=True)
    (d / "empty").mkdir()
    (d / "__0_0.distcp").write_bytes(rng.randbytes(big))
    (d / ".metadata").write_bytes(rng.randbytes(3000))
    (d / "meta.json").write_text(json.dumps({"step": step, "tokens": step * 1000}))
    (d / "hf" / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    (d / "hf" / "tokenizer" / "vocab.txt").write_text("\n".join(f"tok{i}" for i in range(500)))
    return d


def tree(path: Path) -> dict[str, bytes | None]:
    """Relative path -> bytes (None for a directory) of everything below `path`."""
    out: dict[str, bytes | None] = {}
    for p in sorted(path.rglob("*")):
        out[p.relative_to(path).as_posix()] = None if p.is_dir() else p.read_bytes()
    return out


def poll_until(watcher: BackupWatcher, name: str, timeout: float = 60) -> list[dict]:
    """Poll like the supervisor does until an event called `name` comes back; return all events seen."""
    seen: list[dict] = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        seen += watcher.poll().records()
        if any(e["event"] == name for e in seen):
            return seen
        time.sleep(0.05)
    raise AssertionError(f"no {name!r} event within {timeout:.0f}s; saw {seen}")


class GatedStore(CheckpointStore):
    """The real store, but each upload waits for `gate`: an upload that is slow for as long as the test wants."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.gate = threading.Event()
        self.entered = threading.Event()

    def upload(self, step_dir, step):
        self.entered.set()
        if not self.gate.wait(60):
            raise TimeoutError("the test never opened the gate")
        return super().upload(step_dir, step)


# ---------------------------------------------------------------- parse_remote


def test_parse_remote_accepts_bucket_urls_and_names_the_problem_otherwise():
    assert parse_remote("s3://my-bucket/runs/a/") == ("my-bucket", "runs/a")
    assert parse_remote("s3://my.bucket") == ("my.bucket", "")
    for bad, words in [
        ("gs://bucket/x", "s3://bucket/prefix"),
        ("s3:///x", "no bucket"),
        ("s3://Bad_Bucket!/x", "not a valid bucket name"),
        ("s3://bucket/a//b", "empty"),
        ("s3://bucket/a/../b", "'..'"),
        ("s3://bucket/a?versionId=1", "'?'"),
    ]:
        with pytest.raises(ValueError, match=r"ckpt\.remote") as info:
            parse_remote(bad)
        assert words in str(info.value), (bad, str(info.value))


# ---------------------------------------------------------------- round trips


def test_upload_list_download_gives_identical_bytes_and_uses_multipart(s3_endpoint, bucket, s3, tmp_path):
    src = make_checkpoint(tmp_path / "a", 10, big=6 * MiB)  # random bytes: the archive stays > 5 MiB
    store = make_store(s3_endpoint, bucket)
    assert store.compression == "zstd"
    result = store.upload(src, 10)
    assert result["archive_key"] == "runs/exp1/checkpoints/step-10.tar.zst"
    assert result["files"] == 5 and result["bytes"] > 5 * MiB
    # the archive went up in parts: S3's ETag of a multipart object ends in -<parts>
    head = s3.head_object(Bucket=bucket, Key=result["archive_key"])
    assert head["ETag"].strip('"').endswith("-2"), head["ETag"]
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=result["manifest_key"])["Body"].read())
    expected_sha = hashlib.sha256((src / "hf" / "config.json").read_bytes()).hexdigest()
    assert manifest["files"]["hf/config.json"]["sha256"] == expected_sha
    assert manifest["archive_sha256"] == result["sha256"]
    # the temp archive next to the checkpoints is gone
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step-10"]

    remote = store.list_remote()
    assert [(r.step, r.archive_key, r.manifest_key) for r in remote] == [
        (10, result["archive_key"], result["manifest_key"])
    ]
    dest = tmp_path / "restored"
    path = store.download(10, dest)
    assert path == dest / "step-10"
    assert tree(path) == tree(src)
    assert (path / "empty").is_dir()
    assert [c.step for c in list_checkpoints(dest)] == [10]
    assert sorted(p.name for p in dest.iterdir()) == ["step-10"]  # no .tmp, no staging left
    with pytest.raises(StorageError, match="already exists"):
        store.download(10, dest)


def test_uploads_send_no_checksums_that_r2_minio_and_gcs_reject(s3_endpoint, bucket, tmp_path):
    """boto3 >= 1.36 adds CRC32 checksums (aws-chunked trailers on uploads) unless told "when_required"; R2, MinIO
    and GCS refuse such requests. The requests that reach moto here carry none, and the uploads succeed."""
    store = make_store(s3_endpoint, bucket)
    config = store.client.meta.config
    assert (config.request_checksum_calculation, config.response_checksum_validation) == ("when_required",) * 2
    sent: list[tuple[str, dict[str, str]]] = []

    def record(request, **_):
        sent.append((request.method, {k.lower(): str(v) for k, v in request.headers.items()}))

    store.client.meta.events.register("before-send.s3", record)
    src = make_checkpoint(tmp_path / "a", 3, big=6 * MiB)  # multipart: CreateMultipartUpload, UploadPart, Complete
    store.upload(src, 3)
    progress = tmp_path / "progress.json"
    write_json_atomic(progress, {"step": 3})
    assert store.put_heartbeat(progress)
    assert tree(store.download(3, tmp_path / "b")) == tree(src)
    uploads = [headers for method, headers in sent if method in ("PUT", "POST")]
    assert len(uploads) >= 4, sent
    for headers in uploads:
        flagged = {k: v for k, v in headers.items() if k.startswith(("x-amz-checksum-", "x-amz-sdk-checksum"))}
        assert not flagged, flagged
        assert "aws-chunked" not in headers.get("content-encoding", "")
        assert "TRAILER" not in headers.get("x-amz-content-sha256", "")
    downloads = [headers for method, headers in sent if method == "GET"]
    assert downloads and not any(h.get("x-amz-checksum-mode") for h in downloads)


def test_gzip_is_used_when_zstandard_is_missing(s3_endpoint, bucket, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # `import zstandard` now raises ImportError
    store = make_store(s3_endpoint, bucket, compression="zstd")
    assert store.compression == "gzip"
    assert any("zstandard" in n for n in store.notes)
    src = make_checkpoint(tmp_path / "a", 7)
    result = store.upload(src, 7)
    assert result["archive_key"].endswith("step-7.tar.gz")
    assert tree(store.download(7, tmp_path / "b")) == tree(src)


def test_heartbeat_round_trip(s3_endpoint, bucket, tmp_path):
    store = make_store(s3_endpoint, bucket)
    assert store.get_heartbeat() is None
    progress = tmp_path / "progress.json"
    assert store.put_heartbeat(progress) is False  # nothing written yet by the trainer
    before = time.time()
    write_json_atomic(progress, {"step": 42, "loss": 1.25, "phase": "training", "pid": 123})
    assert store.put_heartbeat(progress) is True
    hb = store.get_heartbeat()
    assert hb["step"] == 42 and hb["loss"] == 1.25 and hb["phase"] == "training"
    assert hb["uploaded_at"] >= before - 1
    write_json_atomic(progress, {"step": 43})
    store.put_heartbeat(progress)
    assert store.get_heartbeat()["step"] == 43


# ---------------------------------------------------------------- restore, corruption, incomplete uploads


def test_run_without_local_checkpoint_resumes_from_the_bucket(s3_endpoint, bucket, tmp_path):
    store = make_store(s3_endpoint, bucket)
    for step in (10, 20):
        store.upload(make_checkpoint(tmp_path / "old-machine", step), step)
    events = EventLog(tmp_path / "events.jsonl")
    fresh = tmp_path / "new-machine" / "checkpoints"  # does not exist yet
    assert restore_before_start(fresh, store, events) == 20
    assert tree(fresh / "step-20") == tree(tmp_path / "old-machine" / "step-20")
    assert [c.step for c in list_checkpoints(fresh)] == [20]
    restored = [e for e in read_events(events.path) if e["event"] == "remote_checkpoint_restored"]
    assert restored and restored[0]["step"] == 20

    # a machine that still has its own checkpoint keeps it and downloads nothing
    local = tmp_path / "same-machine"
    make_checkpoint(local, 5)
    assert restore_before_start(local, store, events) is None
    assert [c.step for c in list_checkpoints(local)] == [5]


def test_corrupt_archive_is_reported_and_the_previous_one_restored(s3_endpoint, bucket, s3, tmp_path):
    store = make_store(s3_endpoint, bucket)
    for step in (10, 20):
        store.upload(make_checkpoint(tmp_path / "src", step), step)
    key = store.archive_key(20)
    blob = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    middle = len(blob) // 2
    blob[middle : middle + 64] = bytes(b ^ 0xFF for b in blob[middle : middle + 64])
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(blob))

    with pytest.raises(CorruptCheckpoint) as info:
        store.download(20, tmp_path / "probe")
    assert info.value.step == 20 and "step-20" in str(info.value) and "step-20.tar.zst" in str(info.value)

    events = EventLog(tmp_path / "events.jsonl")
    dest = tmp_path / "dest"
    assert store.restore_newest(dest, events) == 10
    assert tree(dest / "step-10") == tree(tmp_path / "src" / "step-10")
    assert sorted(p.name for p in dest.iterdir()) == ["step-10"]  # no step-20, no step-20.tmp, no staging
    corrupt = [e for e in read_events(events.path) if e["event"] == "remote_checkpoint_corrupt"]
    assert [e["step"] for e in corrupt] == [20]


def test_a_file_that_differs_from_its_manifest_is_named(s3_endpoint, bucket, s3, tmp_path):
    store = make_store(s3_endpoint, bucket)
    store.upload(make_checkpoint(tmp_path / "src", 30), 30)
    key = store.manifest_key(30)
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    manifest["files"]["hf/tokenizer/vocab.txt"]["sha256"] = "0" * 64
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())
    with pytest.raises(CorruptCheckpoint) as info:
        store.download(30, tmp_path / "dest")
    assert info.value.step == 30 and info.value.file == "hf/tokenizer/vocab.txt"
    assert not (tmp_path / "dest" / "step-30").exists() and not (tmp_path / "dest" / "step-30.tmp").exists()

    # a file the manifest promises but the archive lacks
    manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    manifest["files"]["__1_0.distcp"] = {"sha256": "0" * 64, "bytes": 10}
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())
    with pytest.raises(CorruptCheckpoint) as info:
        store.download(30, tmp_path / "dest")
    assert info.value.file in ("__1_0.distcp", "hf/tokenizer/vocab.txt")


def test_archive_without_manifest_is_ignored(s3_endpoint, bucket, s3, tmp_path):
    store = make_store(s3_endpoint, bucket)
    store.upload(make_checkpoint(tmp_path / "src", 10), 10)
    # an upload that died before its manifest: the archive is there, newer, and must not be used
    s3.copy_object(
        Bucket=bucket, Key=store.archive_key(30), CopySource={"Bucket": bucket, "Key": store.archive_key(10)}
    )
    assert [r.step for r in store.list_remote()] == [10]
    assert store.restore_newest(tmp_path / "dest") == 10
    assert [c.step for c in list_checkpoints(tmp_path / "dest")] == [10]


def _put_crafted_archive(s3, store: CheckpointStore, bucket: str, step: int, members) -> None:
    """A gzip tar of `members` [(TarInfo, bytes|None)] with a manifest that matches it byte for byte."""
    buf = io.BytesIO()
    files = {}
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
            if data is not None:
                files[info.name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    blob = buf.getvalue()
    manifest = {
        "format": 1, "step": step, "archive": f"step-{step}.tar.gz", "compression": "gzip",
        "archive_sha256": hashlib.sha256(blob).hexdigest(), "archive_bytes": len(blob), "files": files,
    }  # fmt: skip
    s3.put_object(Bucket=bucket, Key=store.archive_key(step, "gzip"), Body=blob)
    s3.put_object(Bucket=bucket, Key=store.manifest_key(step), Body=json.dumps(manifest).encode())


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _link(name: str, target: str, kind: bytes) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


@pytest.mark.parametrize(
    "evil",
    [
        [_file("../evil.txt", b"owned")],
        [_file("sub/../../evil.txt", b"owned")],
        [_file("/tmp/pt-evil-absolute.txt", b"owned")],
        [_link("escape", "/etc", tarfile.SYMTYPE), _file("escape/evil.txt", b"owned")],
        [_link("hard", "/etc/passwd", tarfile.LNKTYPE)],
    ],
    ids=["dotdot", "nested-dotdot", "absolute", "symlink-out", "hardlink-out"],
)
def test_tar_slip_archive_is_refused(s3_endpoint, bucket, s3, tmp_path, evil):
    store = make_store(s3_endpoint, bucket)
    store.upload(make_checkpoint(tmp_path / "src", 10), 10)
    _put_crafted_archive(s3, store, bucket, 40, [_file("meta.json", b"{}"), *evil])
    dest = tmp_path / "run" / "checkpoints"
    with pytest.raises(UnsafeArchive) as info:
        store.download(40, dest)
    assert info.value.step == 40
    assert not (tmp_path / "run" / "evil.txt").exists() and not (tmp_path / "evil.txt").exists()
    assert not Path("/tmp/pt-evil-absolute.txt").exists()
    assert sorted(p.name for p in dest.iterdir()) == []
    # restore skips it as corrupt and takes the one before
    events = EventLog(tmp_path / "events.jsonl")
    assert store.restore_newest(dest, events) == 10
    corrupt = [e for e in read_events(events.path) if e["event"] == "remote_checkpoint_corrupt"]
    assert corrupt[0]["step"] == 40 and corrupt[0]["unsafe"] is True


# ---------------------------------------------------------------- retention


def test_retention_keeps_newest_n_and_keep_every(s3_endpoint, bucket, s3, tmp_path):
    store = make_store(s3_endpoint, bucket)
    for step in (10, 20, 30, 40, 50, 60):
        store.upload(make_checkpoint(tmp_path / "src", step, big=1024), step)
    # the leftover of an upload that died long ago
    s3.put_object(Bucket=bucket, Key=store.archive_key(5), Body=b"partial")
    assert store.apply_retention(keep_last=2, keep_every=30) == [10, 20, 40]
    assert [r.step for r in store.list_remote()] == [30, 50, 60]
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]}
    prefix = store.checkpoints_prefix
    assert keys == {prefix + f"step-{s}{ext}" for s in (30, 50, 60) for ext in (".tar.zst", ".manifest.json")}
    # keep_last=1 still never deletes the newest
    assert store.apply_retention(keep_last=1, keep_every=None) == [30, 50]
    assert [r.step for r in store.list_remote()] == [60]
    # unset keep_last keeps everything
    assert store.apply_retention(keep_last=None, keep_every=None) == []


# ---------------------------------------------------------------- the backup watcher


def test_watcher_uploads_in_the_background_and_poll_does_not_wait(s3_endpoint, bucket, tmp_path):
    ckpt = tmp_path / "run" / "checkpoints"
    progress = tmp_path / "run" / "progress.json"
    write_json_atomic(progress, {"step": 10, "phase": "training"})
    make_checkpoint(ckpt, 10)
    store = make_store(s3_endpoint, bucket, cls=GatedStore)
    watcher = BackupWatcher(
        ckpt, store, keep_last=1, keep_every=None, heartbeat_path=progress, heartbeat_interval_s=0.01
    )
    first = watcher.poll().records()
    assert [e["event"] for e in first] == ["checkpoint_upload_started"] and first[0]["step"] == 10
    assert store.entered.wait(30)
    # the upload is stuck behind the gate, and poll still comes back, reporting nothing new
    for _ in range(3):
        assert not [e for e in watcher.poll().records() if e["event"].startswith("checkpoint_upload")]
    assert watcher.uploading_step == 10 and store.list_remote() == []
    store.gate.set()
    events = poll_until(watcher, "checkpoint_uploaded")
    done = next(e for e in events if e["event"] == "checkpoint_uploaded")
    assert done["step"] == 10 and done["bytes"] > 0 and done["seconds"] >= 0
    assert [r.step for r in store.list_remote()] == [10] and watcher.uploaded_step == 10
    assert store.get_heartbeat()["step"] == 10

    # two newer checkpoints appear: the newest goes up, bucket retention (keep_last=1) prunes step 10
    make_checkpoint(ckpt, 20)
    make_checkpoint(ckpt, 30)
    events = poll_until(watcher, "remote_checkpoints_deleted")
    started = [e["step"] for e in events if e["event"] == "checkpoint_upload_started"]
    assert started == [30]
    assert [e["step"] for e in events if e["event"] == "checkpoint_uploaded"] == [30]
    deleted = next(e for e in events if e["event"] == "remote_checkpoints_deleted")
    assert deleted["steps"] == [10]
    assert [r.step for r in store.list_remote()] == [30]
    # nothing new locally: no further upload
    assert not [e for e in watcher.poll().records() if e["event"] == "checkpoint_upload_started"]


def test_checkpoint_deleted_locally_during_upload_is_skipped(s3_endpoint, bucket, tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoint(ckpt, 10)
    store = make_store(s3_endpoint, bucket, cls=GatedStore)
    watcher = BackupWatcher(ckpt, store, keep_last=2, keep_every=None, heartbeat_path=None, heartbeat_interval_s=60)
    assert [e["event"] for e in watcher.poll().records()] == ["checkpoint_upload_started"]
    assert store.entered.wait(30)
    safe_remove_checkpoint(ckpt / "step-10", ckpt)  # what disk retention does
    store.gate.set()
    events = poll_until(watcher, "checkpoint_upload_skipped")
    skipped = next(e for e in events if e["event"] == "checkpoint_upload_skipped")
    assert skipped["step"] == 10 and "deleted locally" in skipped["reason"]
    assert store.list_remote() == [] and watcher.uploading_step is None
    # the next checkpoint is uploaded normally
    make_checkpoint(ckpt, 20)
    assert [e["step"] for e in poll_until(watcher, "checkpoint_uploaded") if e["event"] == "checkpoint_uploaded"] == [
        20
    ]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_upload_failure_is_an_event_without_credentials(s3_endpoint, tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoint(ckpt, 10)
    clock = FakeClock()
    store = make_store(s3_endpoint, "pt-no-such-bucket-here")
    watcher = BackupWatcher(
        ckpt, store, keep_last=2, keep_every=None, heartbeat_path=None, heartbeat_interval_s=60,
        retry_initial_s=30, clock=clock,
    )  # fmt: skip
    events = poll_until(watcher, "checkpoint_upload_failed")
    failed = next(e for e in events if e["event"] == "checkpoint_upload_failed")
    assert failed["step"] == 10 and "NoSuchBucket" in failed["reason"], failed
    assert "pt-no-such-bucket-here" in failed["reason"] and failed["retry_in_s"] == 30
    log = EventLog(tmp_path / "events.jsonl")
    for e in events:
        log.emit(**e)
    text = log.path.read_text()
    assert "checkpoint_upload_failed" in text
    assert SECRET not in text and ACCESS_KEY not in text

    # backoff: no retry before its time, a retry after it
    assert not [e for e in watcher.poll().records() if e["event"] == "checkpoint_upload_started"]
    clock.now += 31
    assert [e["event"] for e in watcher.poll().records()][-1] == "checkpoint_upload_started"

    # an error that quotes a credential is scrubbed before it is shown
    message = store.scrub(f"signature check failed for {ACCESS_KEY} with secret {SECRET}")
    assert SECRET not in message and ACCESS_KEY not in message and "signature check failed" in message
    with pytest.raises(StorageError) as info:
        store.list_remote()
    assert SECRET not in str(info.value) and "NoSuchBucket" in str(info.value)


def test_flush_finishes_the_upload_in_flight_and_the_last_checkpoint(s3_endpoint, bucket, tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoint(ckpt, 10)
    store = make_store(s3_endpoint, bucket, cls=GatedStore)
    watcher = BackupWatcher(ckpt, store, keep_last=3, keep_every=None, heartbeat_path=None, heartbeat_interval_s=60)
    watcher.poll()
    assert store.entered.wait(30)
    unfinished = watcher.flush(0.2).records()  # the gate is shut: flush gives up after its bound, says so
    assert next(e for e in unfinished if e["event"] == "checkpoint_upload_unfinished")["step"] == 10
    # the trainer's SIGTERM save lands after the last poll; flush uploads it too
    make_checkpoint(ckpt, 15)
    store.gate.set()
    events = watcher.flush(60).records()
    assert [e["step"] for e in events if e["event"] == "checkpoint_uploaded"] == [10, 15]
    assert [r.step for r in store.list_remote()] == [10, 15]


def test_stale_staging_files_are_cleaned_and_step_dirs_untouched(s3_endpoint, bucket, tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_checkpoint(ckpt, 10)
    (ckpt / ".remote-step-9-abc.tar.zst").write_bytes(b"left by a killed upload")
    store = make_store(s3_endpoint, bucket)
    BackupWatcher(ckpt, store, keep_last=3, keep_every=None, heartbeat_path=None, heartbeat_interval_s=60)
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-10"]


# ---------------------------------------------------------------- a real engine resume from the bucket


def test_engine_resumes_from_a_checkpoint_restored_from_the_bucket(s3_endpoint, bucket, tmp_path):
    from enginetools import losses_by_step, run_train

    from prime_train.rundir import newest_checkpoint

    # no save at the last step: step-8 is the newest checkpoint
    first = run_train(
        tmp_path, "first", **{"train.max_steps": 10, "ckpt.interval": 4, "ckpt.resumable_final_save": "false"}
    )
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    newest = newest_checkpoint(tmp_path / "first" / "checkpoints")
    assert newest is not None and newest.step == 8, newest
    store = make_store(s3_endpoint, bucket)
    store.upload(newest.path, newest.step)
    shutil.rmtree(tmp_path / "first" / "checkpoints")  # the instance and its disk are gone

    # the same run on a new machine: an empty run directory, the bucket has step 8
    second_ckpt = tmp_path / "second" / "checkpoints"
    assert restore_before_start(second_ckpt, store) == 8
    second = run_train(tmp_path, "second", **{"train.max_steps": 12, "ckpt.interval": 4})
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resumed from" in second.stdout + second.stderr
    # it continued after step 8 rather than starting over, and matches the uninterrupted run's losses
    steps = sorted(losses_by_step(tmp_path / "second"))
    assert steps == [9, 10, 11, 12], steps
    before, after = losses_by_step(tmp_path / "first"), losses_by_step(tmp_path / "second")
    assert after[9] == before[9] and after[10] == before[10], (before, after)


def test_supervised_run_backs_up_and_a_new_machine_resumes_from_the_bucket(s3_endpoint, bucket, tmp_path):
    """`prime-train run` with ckpt.remote: checkpoints and the heartbeat reach the bucket; an empty run directory
    on another machine restores the newest one and resumes after it."""
    from enginetools import TINY, cli, env, losses_by_step, tiny_overrides

    remote = ["--ckpt.remote", f"s3://{bucket}/runs/sup", "--ckpt.remote_endpoint_url", s3_endpoint,
              "--ckpt.heartbeat_interval_s", "1", "--supervisor.poll_interval_s", "0.5"]  # fmt: skip

    def run(name: str, steps: int) -> subprocess.CompletedProcess:
        # no save at the last step: step-10 is the newest checkpoint the bucket holds
        last = {"train.max_steps": steps, "ckpt.interval": 10, "ckpt.resumable_final_save": "false"}
        args = tiny_overrides(tmp_path, name, **last)
        return subprocess.run(cli("run", str(TINY), *args, *remote), env=env(), capture_output=True, text=True,
                              timeout=600)  # fmt: skip

    first = run("a", 20)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    names = {ev["event"] for ev in read_events(tmp_path / "a" / "events.jsonl")}
    assert "checkpoint_uploaded" in names, names
    found = boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket, Prefix="runs/sup/")
    keys = {o["Key"] for o in found.get("Contents", [])}
    assert "runs/sup/checkpoints/step-10.manifest.json" in keys and "runs/sup/progress.json" in keys, keys
    assert SECRET not in (tmp_path / "a" / "events.jsonl").read_text()

    shutil.rmtree(tmp_path / "a")  # the instance and its disk are gone; the same run starts elsewhere
    second = run("a", 30)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "restored checkpoint step-10" in second.stdout + second.stderr
    assert sorted(losses_by_step(tmp_path / "a"))[0] == 11, "it resumed after step 10 instead of starting over"
