"""A checkpoint directory as one archive, verified on the way in and on the way out.

Writing streams a tar of the directory through zstd (or gzip) into a file, hashing every member and the
archive as they pass: one read of each checkpoint file, never the whole checkpoint in memory, and a file
that changes size while it is read fails the archive instead of shortening it. Extracting checks every
member against the manifest (sha256 and size), refuses what could land outside the checkpoint (tar-slip:
absolute paths, '..', links, devices), and bounds what it reads: the files' total must fit the disk before
anything is written, an extended header (pax, GNU long name) over MAX_HEADER_BYTES is refused before it is read
into memory, and the member count is bounded. Nothing here knows about buckets: storage.py moves these
archives to and from S3, and the error types of checkpoint storage are defined here, below it.

zstandard is imported lazily: without it, archives are gzip.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import io
import os
import re
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

CHUNK = 1 << 20  # bytes per read while hashing, archiving and extracting
ZSTD_LEVEL = 3  # fast; checkpoint weights compress little, so a higher level buys almost nothing
STAGING_PREFIX = ".remote-"  # temp archives in a checkpoint directory; never matches step-N / step-N.tmp
ARCHIVE_SUFFIXES = {"zstd": ".tar.zst", "gzip": ".tar.gz"}
MAX_HEADER_BYTES = 1 << 20  # a pax or GNU long-name header: ours hold a path and a few numbers
MAX_EXTRA_MEMBERS = 10_000  # members beyond the manifest's files: the directories between them
DISK_MARGIN_BYTES = 64 << 20  # left free on the disk after a restore, besides what its files need


class StorageError(RuntimeError):
    """The bucket could not be reached or used, or an archive not written or read; safe to show (no credentials)."""


class CorruptCheckpoint(StorageError):
    """A remote checkpoint whose archive or files do not match its manifest, or an unsafe archive."""

    def __init__(self, step: int, file: str, detail: str):
        self.step = step
        self.file = file
        self.detail = detail
        super().__init__(f"remote checkpoint step-{step} is corrupt: {file}: {detail}")


class UnsafeArchive(CorruptCheckpoint):
    """An archive member that would land outside the checkpoint (tar-slip), or a link or device."""


# ---------------------------------------------------------------- streams that hash what passes


class _HashingWriter(io.RawIOBase):
    """Writes to `raw` and hashes and counts every byte: the archive's sha256 without a second read."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        view = memoryview(b)
        self.sha.update(view)
        self.size += view.nbytes
        self.raw.write(view)
        return view.nbytes

    def flush(self) -> None:
        self.raw.flush()


class _HashingReader:
    """Reads from `raw` and hashes what tarfile copies into the archive: one read per file."""

    def __init__(self, raw: BinaryIO):
        self.raw = raw
        self.sha = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = self.raw.read(n)
        self.sha.update(data)
        self.size += len(data)
        return data


def sha256_file(path: Path) -> str:
    """The sha256 of a file, read a chunk at a time (checkpoint shards are tens of GB)."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha.update(chunk)
    return sha.hexdigest()


def zstandard_module():
    """The zstandard module, or None when it is not installed."""
    try:
        import zstandard
    except ImportError:
        return None
    return zstandard


def remove_stale_staging(directory: str | os.PathLike[str]) -> list[Path]:
    """Delete temp archives a killed upload or download left in `directory` (only our own names)."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    for entry in entries:
        if entry.name.startswith(STAGING_PREFIX) and entry.is_file(follow_symlinks=False):
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


# ---------------------------------------------------------------- writing


def write_archive(step_dir: Path, raw: BinaryIO, compression: str) -> tuple[dict[str, dict[str, Any]], str, int]:
    """Write `step_dir` as a compressed tar to `raw` and fsync it: ({member: {sha256, bytes}}, archive sha256, size)."""
    hashing = _HashingWriter(raw)
    files: dict[str, dict[str, Any]] = {}
    if compression == "zstd":
        zstd = zstandard_module()
        if zstd is None:  # uninstalled since the store chose zstd: unlikely, but say what is missing
            raise StorageError("zstd archives need the zstandard package (pip install zstandard)")
        compressed = zstd.ZstdCompressor(level=ZSTD_LEVEL).stream_writer(hashing, closefd=False)
    else:
        compressed = gzip.GzipFile(fileobj=hashing, mode="wb", compresslevel=6, mtime=0)
    try:
        with tarfile.open(fileobj=compressed, mode="w|", format=tarfile.PAX_FORMAT) as tar:
            for path, rel in _walk(step_dir):
                info = tar.gettarinfo(str(path), arcname=rel)
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                if info.isdir():
                    tar.addfile(info)
                    continue
                if not info.isreg():
                    raise StorageError(
                        f"{path} is not a regular file or directory (a link or device); a checkpoint "
                        "to upload must be self-contained"
                    )
                with open(path, "rb") as f:
                    reader = _HashingReader(f)
                    # tarfile copies exactly info.size bytes and raises if the file is shorter now
                    tar.addfile(info, reader)
                    if f.read(1):
                        raise OSError(f"{path} grew while it was archived")
                files[rel] = {"sha256": reader.sha.hexdigest(), "bytes": reader.size}
    finally:
        compressed.close()
    raw.flush()
    os.fsync(raw.fileno())
    return files, hashing.sha.hexdigest(), hashing.size


# ---------------------------------------------------------------- extracting


def extract_archive(archive: Path, work: Path, step: int, manifest: dict[str, Any]) -> None:
    """Unpack `archive` into the empty directory `work`, every member checked against the manifest of step `step`.

    Raises CorruptCheckpoint for a member that differs from (or is missing in) the manifest or an unreadable
    archive, UnsafeArchive for one that could escape `work`, StorageError when the disk fills up.
    """
    expected: dict[str, dict[str, Any]] = manifest["files"]
    seen: set[str] = set()
    compression = manifest["compression"]
    _check_room(work, step, sum(max(0, int(e["bytes"])) for e in expected.values()))
    members = 0
    with open(archive, "rb") as raw:
        if compression == "zstd":
            zstd = zstandard_module()
            if zstd is None:
                raise StorageError(f"remote checkpoint step-{step} is a zstd archive: install the zstandard package")
            stream: Any = zstd.ZstdDecompressor().stream_reader(raw, closefd=False)
        else:
            stream = gzip.GzipFile(fileobj=raw, mode="rb")
        try:
            with tarfile.open(fileobj=stream, mode="r|", tarinfo=_BoundedTarInfo) as tar:
                for member in tar:
                    members += 1
                    if members > len(expected) + MAX_EXTRA_MEMBERS:
                        raise UnsafeArchive(
                            step, member.name, f"more than {members - 1} members for {len(expected)} files"
                        )
                    name = _safe_member(member, work, step)
                    target = work.joinpath(*PurePosixPath(name).parts)
                    try:
                        if member.isdir():
                            target.mkdir(parents=True, exist_ok=True)
                            continue
                        entry = expected.get(name)
                        if entry is None:
                            raise CorruptCheckpoint(step, name, "in the archive but not in the manifest")
                        if member.size != entry["bytes"]:
                            raise CorruptCheckpoint(
                                step, name, f"{member.size} bytes in the archive, {entry['bytes']} in the manifest"
                            )
                        target.parent.mkdir(parents=True, exist_ok=True)
                        source = tar.extractfile(member)
                        if source is None:
                            raise UnsafeArchive(step, name, "not a regular file")
                        sha = hashlib.sha256()
                        with open(target, "xb") as out:
                            while chunk := source.read(CHUNK):
                                sha.update(chunk)
                                out.write(chunk)
                            out.flush()
                            os.fsync(out.fileno())
                    except (FileExistsError, NotADirectoryError, IsADirectoryError) as exc:
                        raise UnsafeArchive(step, name, f"clashes with another member ({exc.strerror})") from None
                    if sha.hexdigest() != entry["sha256"]:
                        raise CorruptCheckpoint(step, name, "sha256 differs from the manifest")
                    seen.add(name)
        except _HeaderTooLarge as exc:
            raise UnsafeArchive(step, manifest["archive"], str(exc)) from None
        except (tarfile.TarError, EOFError, gzip.BadGzipFile) as exc:
            raise CorruptCheckpoint(step, manifest["archive"], f"unreadable archive ({exc})") from None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise StorageError(f"no space left in {work.parent} to restore step-{step}") from None
            if exc.errno is None:  # raised by a decoder, not by the filesystem
                raise CorruptCheckpoint(step, manifest["archive"], f"unreadable archive ({exc})") from None
            raise
        except Exception as exc:
            if type(exc).__name__ == "ZstdError":
                raise CorruptCheckpoint(step, manifest["archive"], f"unreadable archive ({exc})") from None
            raise
        finally:
            stream.close()
    missing = sorted(set(expected) - seen)
    if missing:
        raise CorruptCheckpoint(step, missing[0], f"in the manifest but not in the archive ({len(missing)} missing)")


# ---------------------------------------------------------------- archive safety


class _HeaderTooLarge(tarfile.HeaderError):
    pass


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile's member header, refusing an extended header (pax, GNU long name or link) over MAX_HEADER_BYTES
    before tarfile reads it whole into memory."""

    def _proc_member(self, tarfile_obj):  # type: ignore[no-untyped-def]
        extended = (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE, tarfile.GNUTYPE_LONGNAME)
        if self.type in (*extended, tarfile.GNUTYPE_LONGLINK) and self.size > MAX_HEADER_BYTES:
            raise _HeaderTooLarge(f"an extended header of {self.size} bytes (at most {MAX_HEADER_BYTES} are read)")
        return super()._proc_member(tarfile_obj)


def _check_room(work: Path, step: int, needed: int) -> None:
    """StorageError, before anything is written, when the files of the manifest cannot fit the disk of `work`."""
    try:
        free = shutil.disk_usage(work).free
    except OSError:
        return  # cannot tell: extraction still stops at a full disk, with the same message
    if needed + DISK_MARGIN_BYTES > free:
        raise StorageError(
            f"no space left in {work.parent} to restore step-{step}: its files take {needed / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB are free"
        )


def _walk(root: Path) -> Iterator[tuple[Path, str]]:
    """(path, posix name relative to root) of every directory and file below root, sorted, top-down.

    Unlike a bare os.walk, an unreadable or vanished directory raises: a checkpoint deleted mid-walk
    must fail the upload, not yield a short archive that passes for whole.
    """

    def fail(exc: OSError) -> None:
        raise exc

    for current, dirs, files in os.walk(root, onerror=fail, followlinks=False):
        dirs.sort()
        base = Path(current)
        for name in dirs:
            path = base / name
            yield path, path.relative_to(root).as_posix()
        for name in sorted(files):
            path = base / name
            yield path, path.relative_to(root).as_posix()


def _safe_member(member: tarfile.TarInfo, work: Path, step: int) -> str:
    """The member's normalised name, or UnsafeArchive when it could escape `work` (tar-slip)."""
    name = member.name
    if not (member.isreg() or member.isdir()) or member.issparse():
        kind = "link" if (member.issym() or member.islnk()) else "special file"
        raise UnsafeArchive(step, name, f"a {kind}; checkpoints hold only files and directories")
    path = PurePosixPath(name)
    if path.is_absolute() or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise UnsafeArchive(step, name, "an absolute path")
    if any(part == ".." for part in path.parts) or "\\" in name or "\x00" in name:
        raise UnsafeArchive(step, name, "a path that leaves the checkpoint directory")
    data_filter = getattr(tarfile, "data_filter", None)
    if data_filter is not None:
        try:
            data_filter(member, str(work))
        except tarfile.TarError as exc:  # FilterError and its subclasses
            raise UnsafeArchive(step, name, f"refused by tarfile's data filter ({exc})") from None
    normal = path.as_posix()
    while normal.startswith("./"):
        normal = normal[2:]
    if normal in ("", "."):
        raise UnsafeArchive(step, name, "an empty name")
    target = os.path.realpath(work.joinpath(*PurePosixPath(normal).parts))
    if os.path.commonpath([target, os.path.realpath(work)]) != os.path.realpath(work):
        raise UnsafeArchive(step, name, "a path that leaves the checkpoint directory")
    return normal
