"""Checkpoints in object storage: whole step-N directories as verified archives in an S3 bucket.

A spot instance takes its local disk with it, so every whole checkpoint is also copied to a bucket
(`ckpt.remote = "s3://bucket/prefix"`, any S3-compatible store through `ckpt.remote_endpoint_url`).
Layout under the prefix:
```
<prefix>/checkpoints/step-<N>.tar.zst        the whole step-N directory (or .tar.gz)
<prefix>/checkpoints/step-<N>.manifest.json  sha256 and size of every file, and of the archive
<prefix>/progress.json                       the run's heartbeat, copied every heartbeat_interval_s
<prefix>/spot-recoveries.json                SkyPilot recoveries counted by `spot recovery-gate` (recovery_gate)
```
The manifest is written last and deleted first. So, as with step-N on disk, a checkpoint is whole in
the bucket exactly when its manifest is there: an archive without one is an upload that did not
finish (or a deletion that did not), and is never restored.

Credentials come only from boto3's standard chain (environment, ~/.aws, instance role), never from a
run config, and they never reach a message: every error is described by its S3 error code and
scrubbed of the credential values in use before it leaves this module.

The archives themselves (writing, verified extraction, tar-slip refusal) are checkpoint_archive.py's;
this module is the bucket: keys, transfers, listing, retention and the heartbeat. boto3 and zstandard
are imported lazily: the supervisor and `prime-train lint` import this module without them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from prime_train.contract import Event, ExitCode, fsync_dir, read_json, write_json_atomic
from prime_train.integrations.checkpoint_archive import (
    ARCHIVE_SUFFIXES,
    STAGING_PREFIX,
    CorruptCheckpoint,
    StorageError,
    UnsafeArchive,
    extract_archive,
    remove_stale_staging,
    sha256_file,
    write_archive,
    zstandard_module,
)
from prime_train.kit.redact import REDACTED, redact
from prime_train.retention import safe_remove_checkpoint, select_for_deletion
from prime_train.rundir import newest_checkpoint

logger = logging.getLogger("prime_train.storage")

MANIFEST_FORMAT = 1
# S3 allows at most 10,000 parts per upload, each >= 5 MiB (except the last)
MIN_PART_BYTES = 5 * 1024 * 1024
MAX_PARTS = 10_000
DEFAULT_PART_BYTES = 64 * 1024 * 1024

_KEY_RE = re.compile(r"^step-(\d+)(\.manifest\.json|\.tar\.zst|\.tar\.gz)$")
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9._\-]{1,61}[a-z0-9]$")


class EventSink(Protocol):
    """What restore reports to: kit.events.EventLog fits."""

    def emit(self, event: str, **fields: Any) -> Any: ...


@dataclass(frozen=True)
class RemoteCheckpoint:
    """A whole checkpoint in the bucket (its manifest is present)."""

    step: int
    archive_key: str
    manifest_key: str
    archive_bytes: int | None = None


def parse_remote(url: str) -> tuple[str, str]:
    """("bucket", "prefix") of "s3://bucket/prefix"; the prefix has no leading or trailing slash."""
    if not isinstance(url, str) or not url.startswith("s3://"):
        raise ValueError(f"ckpt.remote {url!r} must look like s3://bucket/prefix")
    rest = url[len("s3://") :]
    if any(c in rest for c in "?#") or any(c.isspace() for c in rest):
        raise ValueError(f"ckpt.remote {url!r}: no spaces, '?' or '#' allowed in a bucket URL")
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise ValueError(f"ckpt.remote {url!r} names no bucket (expected s3://bucket/prefix)")
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise ValueError(
            f"ckpt.remote {url!r}: {bucket!r} is not a valid bucket name "
            "(3-63 characters: lowercase letters, digits, '.', '-', '_')"
        )
    prefix = prefix.strip("/")
    parts = prefix.split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"ckpt.remote {url!r}: the prefix {prefix!r} has an empty, '.' or '..' part")
    return bucket, prefix


# ---------------------------------------------------------------- the store


class CheckpointStore:
    """Whole checkpoints and the heartbeat of one run under s3://bucket/prefix.

    Thread-safe for one upload and one heartbeat at a time (boto3 clients may be shared by threads).
    """

    def __init__(
        self,
        url: str,
        *,
        endpoint_url: str | None = None,
        compression: str = "zstd",
        client: Any = None,
        staging_dir: str | os.PathLike[str] | None = None,
        part_bytes: int = DEFAULT_PART_BYTES,
        multipart_threshold: int | None = None,
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 120.0,
        max_attempts: int = 5,
    ):
        if compression not in ARCHIVE_SUFFIXES:
            raise ValueError(f"ckpt.remote_compression must be 'zstd' or 'gzip', got {compression!r}")
        if part_bytes < MIN_PART_BYTES:
            raise ValueError(f"part_bytes must be at least {MIN_PART_BYTES} (S3's smallest part), got {part_bytes}")
        self.url = url
        self.bucket, self.prefix = parse_remote(url)
        self.endpoint_url = endpoint_url
        self.notes: list[str] = []
        if compression == "zstd" and zstandard_module() is None:
            note = "the zstandard package is not installed: uploading gzip archives (pip install zstandard)"
            self.notes.append(note)
            logger.warning(note)
            compression = "gzip"
        self.compression = compression
        self.staging_dir = Path(staging_dir) if staging_dir is not None else None
        self.part_bytes = part_bytes
        self.multipart_threshold = multipart_threshold if multipart_threshold is not None else part_bytes
        self._session = None
        if client is None:
            client = self._make_client(connect_timeout_s, read_timeout_s, max_attempts)
        self.client = client

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"CheckpointStore({self.url!r}{endpoint})"

    def _make_client(self, connect_timeout_s: float, read_timeout_s: float, max_attempts: int) -> Any:
        try:
            import boto3
            from botocore.config import Config as BotoConfig
        except ImportError:
            raise StorageError(
                "ckpt.remote needs boto3 (and zstandard for zstd archives): pip install 'prime-train[s3]'"
            ) from None
        s3_options: dict[str, Any] = {}
        if self.endpoint_url:
            # MinIO and most S3-compatible stores only route path-style requests; R2 and GCS accept them too
            s3_options["addressing_style"] = "path"
        config = BotoConfig(
            connect_timeout=connect_timeout_s,
            read_timeout=read_timeout_s,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            s3=s3_options or None,
            # boto3 >= 1.36 adds CRC checksums to every upload (aws-chunked trailers) and asks for them on downloads;
            # R2, MinIO and GCS reject those requests. Only operations that require a checksum send one; the
            # archives carry their own sha256 in the manifest, which the download verifies anyway.
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        # the standard chain only: environment, shared files, instance role; never the run config
        self._session = boto3.session.Session()
        try:
            return self._session.client("s3", endpoint_url=self.endpoint_url, config=config)
        except Exception as exc:
            raise StorageError(self._explain(exc, "cannot create an S3 client for")) from None

    # ------------------------------------------------------------ keys

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    @property
    def checkpoints_prefix(self) -> str:
        return self._key("checkpoints/")

    def archive_key(self, step: int, compression: str | None = None) -> str:
        return self.checkpoints_prefix + f"step-{step}{ARCHIVE_SUFFIXES[compression or self.compression]}"

    def manifest_key(self, step: int) -> str:
        return self.checkpoints_prefix + f"step-{step}.manifest.json"

    @property
    def heartbeat_key(self) -> str:
        return self._key("progress.json")

    @property
    def recoveries_key(self) -> str:
        return self._key(RECOVERIES_FILE)

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    # ------------------------------------------------------------ errors without credentials

    def _secrets(self) -> list[str]:
        values = [os.environ.get(k, "") for k in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID")]
        if self._session is not None:
            with contextlib.suppress(Exception):
                creds = self._session.get_credentials()
                if creds is not None:
                    frozen = creds.get_frozen_credentials()
                    values += [frozen.secret_key or "", frozen.token or "", frozen.access_key or ""]
        # long first, so a secret containing a shorter one is replaced whole
        return sorted({v for v in values if len(v) >= 6}, key=len, reverse=True)

    def scrub(self, text: str) -> str:
        """`text` without the credential values in use and without anything else that looks secret."""
        for value in self._secrets():
            text = text.replace(value, REDACTED)
        return redact(text)

    def _explain(self, exc: BaseException, doing: str, key: str | None = None) -> str:
        """A one-line description of a boto/OS error: the S3 error code and message, what to check."""
        where = f" {self._where(key)}" if key is not None else f" s3://{self.bucket}"
        if self.endpoint_url:
            where += f" (endpoint {self.endpoint_url})"
        name = type(exc).__name__
        detail = f"{name}: {exc}"
        hint = ""
        response = getattr(exc, "response", None)
        if isinstance(response, dict) and "Error" in response:
            err = response.get("Error") or {}
            code = str(err.get("Code", "?"))
            message = str(err.get("Message", "")).strip()
            # the message alone: S3's error documents may echo a canonical request, never shown here
            detail = f"{code}: {message}" if message else code
            hint = {
                "NoSuchBucket": f"the bucket {self.bucket!r} does not exist (create it, or fix ckpt.remote)",
                "AccessDenied": "the credentials in use may not read/write this bucket and prefix",
                "403": "the credentials in use may not read/write this bucket and prefix",
                "InvalidAccessKeyId": "the access key is not known to this endpoint (check the AWS credentials)",
                "SignatureDoesNotMatch": "the secret key does not match the access key (check the AWS credentials)",
                "ExpiredToken": "the session credentials expired; refresh them",
            }.get(code, "")
        elif name in ("NoCredentialsError", "PartialCredentialsError"):
            detail = "no usable AWS credentials found"
            hint = (
                "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a profile in ~/.aws/credentials "
                "(AWS_PROFILE), or run with an instance role"
            )
        elif name in ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError"):
            hint = "the endpoint did not answer; check ckpt.remote_endpoint_url and the network"
        text = f"{doing}{where}: {detail}" + (f" — {hint}" if hint else "")
        return self.scrub(text.replace("\n", " "))

    def _fail(self, exc: BaseException, doing: str, key: str | None = None) -> StorageError:
        return StorageError(self._explain(exc, doing, key))

    # ------------------------------------------------------------ upload

    def upload(self, step_dir: str | os.PathLike[str], step: int) -> dict[str, Any]:
        """Archive the whole checkpoint directory, upload it, then its manifest; return what was sent.

        The archive is streamed through the compressor into a temp file (never the whole checkpoint in
        memory); big ones go up in parts. A file that vanishes or changes size while being read (disk
        retention deleting the directory) fails the upload instead of producing a short archive.
        """
        step_dir = Path(step_dir)
        started = time.monotonic()
        if not step_dir.is_dir() or step_dir.is_symlink():
            raise FileNotFoundError(f"checkpoint directory {step_dir} does not exist (or is a symlink)")
        staging = self.staging_dir or step_dir.parent
        staging.mkdir(parents=True, exist_ok=True)
        compression = self.compression
        suffix = ARCHIVE_SUFFIXES[compression]
        fd, tmp_name = tempfile.mkstemp(dir=staging, prefix=f"{STAGING_PREFIX}step-{step}-", suffix=suffix)
        tmp = Path(tmp_name)
        archive_key = self.archive_key(step, compression)
        manifest_key = self.manifest_key(step)
        try:
            with os.fdopen(fd, "wb") as raw:
                files, archive_sha, archive_bytes = write_archive(step_dir, raw, compression)
            if not files:
                raise StorageError(f"checkpoint directory {step_dir} holds no files; refusing to upload it")
            manifest = {
                "format": MANIFEST_FORMAT,
                "step": step,
                "archive": PurePosixPath(archive_key).name,
                "compression": compression,
                "archive_sha256": archive_sha,
                "archive_bytes": archive_bytes,
                "files": files,
                "created": time.time(),
                "host": socket.gethostname(),
            }
            # a manifest from an earlier upload of this step must not vouch for the new archive
            self._delete_key(manifest_key)
            self._put_file(tmp, archive_key, archive_bytes)
            self._check_size(archive_key, archive_bytes)
            body = json.dumps(manifest, indent=1, sort_keys=True).encode()
            try:
                self.client.put_object(Bucket=self.bucket, Key=manifest_key, Body=body, ContentType="application/json")
            except Exception as exc:
                raise self._fail(exc, "cannot write the manifest", manifest_key) from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        return {
            "step": step,
            "archive_key": archive_key,
            "manifest_key": manifest_key,
            "bytes": archive_bytes,
            "raw_bytes": sum(f["bytes"] for f in files.values()),
            "files": len(files),
            "compression": compression,
            "sha256": archive_sha,
            "seconds": round(time.monotonic() - started, 3),
        }

    def _transfer_config(self, size: int) -> Any:
        from boto3.s3.transfer import TransferConfig

        part = max(self.part_bytes, math.ceil(size / (MAX_PARTS - 100)))
        return TransferConfig(
            multipart_threshold=self.multipart_threshold, multipart_chunksize=part, max_concurrency=4, use_threads=True
        )

    def _put_file(self, path: Path, key: str, size: int) -> None:
        try:
            self.client.upload_file(str(path), self.bucket, key, Config=self._transfer_config(size))
        except Exception as exc:
            raise self._fail(exc, "cannot upload the archive to", key) from None

    def _check_size(self, key: str, size: int) -> None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            raise self._fail(exc, "cannot check the uploaded archive", key) from None
        if int(head.get("ContentLength", -1)) != size:
            raise StorageError(
                f"{self._where(key)} holds {head.get('ContentLength')} bytes after the upload, expected {size}"
            )

    def _delete_key(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=key)
        except Exception as exc:
            raise self._fail(exc, "cannot delete", key) from None

    # ------------------------------------------------------------ list

    def _list_keys(self) -> dict[str, int]:
        """Every object under <prefix>/checkpoints/ (name relative to it -> size)."""
        out: dict[str, int] = {}
        prefix = self.checkpoints_prefix
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
            for page in pages:
                for obj in page.get("Contents", []) or []:
                    out[obj["Key"][len(prefix) :]] = int(obj.get("Size", 0))
        except Exception as exc:
            raise self._fail(exc, "cannot list", prefix) from None
        return out

    def _scan(self) -> tuple[list[RemoteCheckpoint], dict[int, list[str]]]:
        """Whole checkpoints (manifest and archive both present), and the archives of all steps."""
        manifests: set[int] = set()
        archives: dict[int, list[str]] = {}
        keys = self._list_keys()
        for name in keys:
            m = _KEY_RE.match(name)
            if not m:
                continue
            step = int(m.group(1))
            if m.group(2) == ".manifest.json":
                manifests.add(step)
            else:
                archives.setdefault(step, []).append(name)
        whole: list[RemoteCheckpoint] = []
        for step in sorted(manifests):
            names = archives.get(step)
            if not names:
                continue  # a manifest whose archive is gone: not restorable, so not whole
            # with both suffixes present (compression changed), download() follows the manifest
            name = sorted(names, key=lambda n: n != PurePosixPath(self.archive_key(step)).name)[0]
            whole.append(
                RemoteCheckpoint(step, self.checkpoints_prefix + name, self.manifest_key(step), keys.get(name))
            )
        return whole, archives

    def list_remote(self) -> list[RemoteCheckpoint]:
        """Whole checkpoints in the bucket, oldest first; archives without a manifest are left out."""
        return self._scan()[0]

    # ------------------------------------------------------------ download

    def _get_manifest(self, step: int) -> dict[str, Any]:
        key = self.manifest_key(step)
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as exc:
            raise self._fail(exc, "cannot read the manifest", key) from None
        try:
            manifest = json.loads(body)
        except ValueError:
            raise CorruptCheckpoint(step, PurePosixPath(key).name, "the manifest is not valid JSON") from None
        ok = (
            isinstance(manifest, dict)
            and manifest.get("step") == step
            and isinstance(manifest.get("files"), dict)
            and isinstance(manifest.get("archive_sha256"), str)
            and manifest.get("compression") in ARCHIVE_SUFFIXES
            and isinstance(manifest.get("archive"), str)
            and _KEY_RE.match(manifest["archive"])
        )
        if not ok:
            raise CorruptCheckpoint(step, PurePosixPath(key).name, "the manifest lacks fields or names another step")
        for name, entry in manifest["files"].items():
            if not (
                isinstance(entry, dict) and isinstance(entry.get("sha256"), str) and isinstance(entry.get("bytes"), int)
            ):
                raise CorruptCheckpoint(step, name, "its manifest entry has no sha256/bytes")
        return manifest

    def download(self, step: int, dest_ckpt_dir: str | os.PathLike[str]) -> Path:
        """Fetch step-N into dest_ckpt_dir/step-N, verified file by file; only a whole one is renamed in.

        Raises CorruptCheckpoint (naming the step and the file) when the archive or any file differs
        from the manifest or the archive is unsafe; StorageError when the bucket cannot be read.
        """
        dest = Path(dest_ckpt_dir)
        dest.mkdir(parents=True, exist_ok=True)
        final = dest / f"step-{step}"
        if final.exists() or final.is_symlink():
            raise StorageError(f"{final} already exists; not overwriting a local checkpoint with the remote one")
        manifest = self._get_manifest(step)
        archive_key = self.checkpoints_prefix + manifest["archive"]
        compression = manifest["compression"]
        fd, tmp_name = tempfile.mkstemp(
            dir=dest, prefix=f"{STAGING_PREFIX}step-{step}-", suffix=ARCHIVE_SUFFIXES[compression]
        )
        os.close(fd)
        archive = Path(tmp_name)
        work = dest / f"step-{step}.tmp"
        try:
            try:
                self.client.download_file(
                    self.bucket,
                    archive_key,
                    str(archive),
                    Config=self._transfer_config(manifest.get("archive_bytes", 0)),
                )
            except Exception as exc:
                raise self._fail(exc, "cannot download", archive_key) from None
            if sha256_file(archive) != manifest["archive_sha256"]:
                raise CorruptCheckpoint(step, manifest["archive"], "sha256 differs from the manifest")
            if work.exists() or work.is_symlink():
                safe_remove_checkpoint(work, dest)
            work.mkdir()
            extract_archive(archive, work, step, manifest)
            fsync_dir(work)
            os.rename(work, final)  # the commit point, as for a local save
            fsync_dir(dest)
        except BaseException:
            if work.exists() or work.is_symlink():
                with contextlib.suppress(OSError, ValueError):
                    safe_remove_checkpoint(work, dest)
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                archive.unlink()
        return final

    def restore_newest(self, dest_ckpt_dir: str | os.PathLike[str], events: EventSink | None = None) -> int | None:
        """Download the newest whole remote checkpoint; a corrupt one is reported and the one before tried.

        Returns the step restored, or None when the bucket holds no usable checkpoint. An unreachable
        bucket raises StorageError: starting from scratch then would quietly throw the run's progress away.
        """
        dest = Path(dest_ckpt_dir)
        remove_stale_staging(dest)
        for ckpt in reversed(self.list_remote()):
            started = time.monotonic()
            try:
                path = self.download(ckpt.step, dest)
            except CorruptCheckpoint as exc:
                logger.warning("%s; trying an older one", exc)
                if events is not None:
                    events.emit(
                        Event.REMOTE_CHECKPOINT_CORRUPT, step=exc.step, file=exc.file, reason=exc.detail,
                        unsafe=isinstance(exc, UnsafeArchive),
                    )  # fmt: skip
                continue
            if events is not None:
                events.emit(
                    Event.REMOTE_CHECKPOINT_RESTORED, step=ckpt.step, path=str(path), bytes=ckpt.archive_bytes,
                    seconds=round(time.monotonic() - started, 2), source=self._where(ckpt.archive_key),
                )  # fmt: skip
            return ckpt.step
        return None

    # ------------------------------------------------------------ retention

    def apply_retention(self, keep_last: int | None, keep_every: int | None) -> list[int]:
        """Delete remote checkpoints the disk policy would delete; return their steps.

        Never the newest whole one. The manifest goes first, so a deletion cut short leaves an archive
        that reads as incomplete, never a manifest pointing at nothing. Archives without a manifest
        older than the newest whole checkpoint (uploads that died) are removed too.
        """
        whole, archives = self._scan()
        if not whole:
            return []
        by_step = {c.step: c for c in whole}
        doomed = select_for_deletion(list(by_step), keep_last, keep_every)
        for step in doomed:
            self._delete_key(by_step[step].manifest_key)
            for name in archives.get(step, []):
                self._delete_key(self.checkpoints_prefix + name)
        newest = whole[-1].step
        for step, names in archives.items():
            if step < newest and step not in by_step:
                for name in names:
                    self._delete_key(self.checkpoints_prefix + name)
        return doomed

    # ------------------------------------------------------------ heartbeat

    def put_heartbeat(self, progress_json_path: str | os.PathLike[str]) -> bool:
        """Copy progress.json to <prefix>/progress.json with the upload time; False when there is none yet."""
        progress = read_json(progress_json_path)
        if progress is None:
            return False
        record = dict(progress)
        record["uploaded_at"] = time.time()
        body = json.dumps(record).encode()
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self.heartbeat_key, Body=body, ContentType="application/json"
            )
        except Exception as exc:
            raise self._fail(exc, "cannot write the heartbeat", self.heartbeat_key) from None
        return True

    def get_heartbeat(self) -> dict[str, Any] | None:
        """The last heartbeat in the bucket, or None when there is none (or it is unreadable)."""
        return self._get_json(self.heartbeat_key, "the heartbeat")

    def get_recoveries(self) -> dict[str, Any] | None:
        """The recovery count `recovery_gate` keeps, or None when there is none yet."""
        return self._get_json(self.recoveries_key, "the recovery count")

    def newest_step(self) -> int | None:
        """The step of the newest whole checkpoint in the bucket (what recovery_gate calls progress)."""
        whole = self.list_remote()
        return whole[-1].step if whole else None

    def put_recoveries(self, record: dict[str, Any]) -> None:
        try:
            self.client.put_object(
                Bucket=self.bucket, Key=self.recoveries_key, Body=json.dumps(record).encode(),
                ContentType="application/json",
            )  # fmt: skip
        except Exception as exc:
            raise self._fail(exc, "cannot write the recovery count", self.recoveries_key) from None

    def _get_json(self, key: str, what: str) -> dict[str, Any] | None:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except Exception as exc:
            code = str(((getattr(exc, "response", None) or {}).get("Error") or {}).get("Code", ""))
            if code in ("NoSuchKey", "404"):
                return None
            raise self._fail(exc, f"cannot read {what}", key) from None
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return obj if isinstance(obj, dict) else None


# ---------------------------------------------------------------- capping SkyPilot's recoveries

RECOVERY_HISTORY = 50  # recoveries kept in the record, newest last
RECOVERIES_FILE = "spot-recoveries.json"


class RecoveryRecords(Protocol):
    """Where recovery_gate keeps its count and judges progress: the bucket, or a checkpoint directory."""

    url: str

    def get_recoveries(self) -> dict[str, Any] | None: ...

    def put_recoveries(self, record: dict[str, Any]) -> None: ...

    def newest_step(self) -> int | None: ...


class DirectoryRecoveries:
    """recovery_gate's count in a checkpoint directory every node mounts (spot.ckpt_mount: a bucket SkyPilot mounts at
    ckpt.dir), beside the step-N checkpoints it judges progress by. A multi-node job has no ckpt.remote to count in."""

    def __init__(self, ckpt_dir: str | os.PathLike[str]):
        self.path = Path(ckpt_dir)
        self.url = str(self.path)

    def get_recoveries(self) -> dict[str, Any] | None:
        record = read_json(self.path / RECOVERIES_FILE)
        return record if isinstance(record, dict) else None

    def put_recoveries(self, record: dict[str, Any]) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self.path / RECOVERIES_FILE, record)
        except OSError as exc:
            raise StorageError(f"cannot write the recovery count in {self.path}: {exc}") from None

    def newest_step(self) -> int | None:
        newest = newest_checkpoint(self.path)
        return newest.step if newest else None


def recovery_gate(
    store: RecoveryRecords,
    *,
    task_id: str,
    max_recoveries: int,
    exit_code: int | None = None,
    recover_codes: tuple[int, ...] | list[int] = (),
    count: bool = True,
    now: float | None = None,
) -> str | None:
    """Why the job must stop instead of being recovered again, or None to go on. The count lives in the bucket, or
    in the shared checkpoint directory (DirectoryRecoveries).

    SkyPilot recovers a job that exits with one of `recover_codes` (75: checkpointed and stopped on a preemption
    notice) without limit; a job that exits 75 for another reason would be recovered forever. So every recovery
    is counted in <prefix>/spot-recoveries.json, per managed job (`task_id`: SKYPILOT_TASK_ID, stable across its
    recoveries; a new launch starts a new count). A recovery that brought a new whole checkpoint to the bucket is
    progress and resets the count in a row; more than `max_recoveries` in a row without one stop the job.

    Before the run (`exit_code` None) it only reads: a job that already gave up stops again at once (SkyPilot
    restarts a failed job up to max_restarts_on_errors times). After it, the node that `count`s (rank 0: one count
    per recovery, not one per node) records the exit.
    """
    record = store.get_recoveries()
    if record is not None and record.get("task_id") != task_id:
        record = None  # an earlier managed job's count
    if exit_code is None:
        return str(record["gave_up"]) if record and record.get("gave_up") else None
    if exit_code not in recover_codes or not count:
        return None
    newest = store.newest_step()
    record = record or {"task_id": task_id, "recoveries": 0, "in_a_row": 0, "newest_step": None, "history": []}
    progress = newest is not None and newest != record.get("newest_step")
    record["in_a_row"] = 0 if progress else int(record.get("in_a_row") or 0) + 1
    record["recoveries"] = int(record.get("recoveries") or 0) + 1
    record["newest_step"] = newest
    now = time.time() if now is None else now
    record["history"] = [*(record.get("history") or []), {"time": now, "exit_code": exit_code, "newest_step": newest}]
    record["history"] = record["history"][-RECOVERY_HISTORY:]
    why = None
    if record["in_a_row"] > max_recoveries:
        why = (
            f"spot.max_recoveries ({max_recoveries}) reached: the job exited {exit_code} {record['in_a_row']} times in "
            f"a row without a new checkpoint in {store.url} (newest: {'none' if newest is None else f'step {newest}'}"
            f"); instead of another recovery (SkyPilot recovers exit {exit_code} without limit) it stops with exit "
            f"{int(ExitCode.FAILED)}. Find out why it keeps exiting {exit_code} (`prime-train spot logs`), then "
            "launch it again"
        )
        record["gave_up"], record["gave_up_at"] = why, now
    store.put_recoveries(record)
    return why


__all__ = [
    "CheckpointStore",
    "CorruptCheckpoint",
    "DirectoryRecoveries",
    "RemoteCheckpoint",
    "StorageError",
    "UnsafeArchive",
    "parse_remote",
    "recovery_gate",
    "remove_stale_staging",
]
