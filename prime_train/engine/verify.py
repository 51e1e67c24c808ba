"""Whether a checkpoint directory is whole and undamaged, read without running anything from it.

Each save writes manifest.json (every file with its size and CRC-32); `verify_checkpoint` checks a
checkpoint against its DCP `.metadata` (read by safe_dcp's restricted unpickler) and its manifest
before a resume. A checkpoint's files are its own: a symlink inside one, or a manifest entry that
names a path outside it, is a problem, never followed.
"""

from __future__ import annotations

import json
import os
import stat
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Any

from prime_train.engine import safe_dcp
from prime_train.rundir import STEP_RE

DCP_METADATA_FILE = ".metadata"
MANIFEST_FILE = "manifest.json"  # every file of the checkpoint: {"files": {relative path: {"bytes", "crc32"}}}


def _foreign_entry(path: Path) -> str | None:
    """A symlink or a non-regular file inside checkpoint `path` (relative name and what it is), or None."""
    for dirpath, dirnames, filenames in os.walk(path):  # os.walk never descends into a linked directory
        for name in dirnames + filenames:
            mode = os.lstat(os.path.join(dirpath, name)).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                what = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
                return f"{Path(dirpath, name).relative_to(path).as_posix()} is {what}"
    return None


def _inside_name(name: Any) -> bool:
    """Whether a manifest entry names a file inside the checkpoint (relative, no `..`)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        return False
    parts = PurePosixPath(name).parts
    return not name.startswith("/") and ".." not in parts


def is_whole_checkpoint(path: Path) -> str | None:
    """What makes `path` not a whole DCP checkpoint, or None when it is one."""
    if not path.exists():
        return "it does not exist"
    if not path.is_dir():
        return "it is not a directory"
    if not STEP_RE.match(path.name):
        suffix = " (an unfinished save)" if path.name.endswith(".tmp") else ""
        return f"its name is not step-N{suffix}"
    if not (path / DCP_METADATA_FILE).is_file():
        return f"it has no DCP {DCP_METADATA_FILE} file (the save did not finish)"
    return None


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)  # releases the GIL on large buffers: files are checksummed in parallel
    return f"{crc:08x}"


def digest_files(root: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Size and CRC-32 of each file, keyed by its path relative to `root` (the manifest's entries)."""
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(paths)))) as pool:
        crcs = list(pool.map(_crc32, paths))
    return {
        p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "crc32": c}
        for p, c in zip(paths, crcs, strict=True)
    }


def verify_checkpoint(path: Path) -> str | None:
    """What is wrong with checkpoint `path`, in words, or None when it is whole and undamaged.

    Checks that its DCP .metadata loads, that every file the metadata points into is present and long
    enough, and, when it has a manifest (saved by prime-train 0.4 and later), that every file matches
    the size and CRC-32 recorded at save time. The checksums read the whole checkpoint once.
    """
    path = Path(path)
    problem = is_whole_checkpoint(path)
    if problem is not None:
        return problem
    foreign = _foreign_entry(path)
    if foreign is not None:
        return f"{foreign}: a checkpoint holds only its own files, and none is read through a link"
    try:
        # never pickle.load: a planted .metadata is a "does not load" problem here, not code run by the trainer
        metadata = safe_dcp.read_metadata(path)
    except Exception as e:  # garbage, truncated, unreadable or refused
        return f"its DCP {DCP_METADATA_FILE} does not load ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():  # each a checked _StorageInfo (safe_dcp)
        name = info.relative_path
        needed[name] = max(needed.get(name, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name}, which its {DCP_METADATA_FILE} points into, is missing"
        if size < end:
            return f"{name} is truncated: {size} bytes, its {DCP_METADATA_FILE} needs {end}"
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_bytes())
    except FileNotFoundError:
        return None  # saved before manifests: the sizes above are all there is to check
    except (OSError, ValueError) as e:
        return f"its {MANIFEST_FILE} does not load ({type(e).__name__}: {e})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return f"its {MANIFEST_FILE} lists no files"
    present = []
    for name, rec in sorted(files.items()):
        if not _inside_name(name):
            return f"its {MANIFEST_FILE} names {name!r}, which is not a file inside the checkpoint"
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{name} is missing (the manifest lists it)"
        if not isinstance(rec, dict) or size != rec.get("bytes"):
            return f"{name} has {size} bytes; {(rec or {}).get('bytes')} were written"
        present.append(path / name)
    actual = digest_files(path, present)
    for name, rec in sorted(files.items()):
        if actual[name]["crc32"] != rec.get("crc32"):
            return f"{name} does not match its checksum (CRC-32 {actual[name]['crc32']}, {rec.get('crc32')} at save)"
    return None
