"""Parquet shards of a Hugging Face hub dataset, read in place over HTTP range requests (data.streaming).

FineWeb-style datasets are folders of parquet shards on the hub. Streaming them needs no download
of whole shards: a parquet file is read by its footer and then row group by row group, and each of
those is one HTTP range request. So a hub shard is named here as `hub://<repo>@<revision>/<path>`
and opened as a seekable file whose reads are range requests; everything else (parquet rows in
records.py; shard order, rank split, windows, resume in streaming.py) is the local-parquet code, unchanged.

Standard library HTTP with bounded timeouts and a few retries. The endpoint is HF_ENDPOINT (default
https://huggingface.co), the token HF_TOKEN or huggingface_hub's saved login; the token is sent to
the hub only, never along a redirect to another host (the hub redirects file reads to its CDN).
"""

from __future__ import annotations

import io
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

SCHEME = "hub://"
TIMEOUT_S = 60.0
RETRIES = 4
BLOCK_BYTES = 8 << 20  # reads are buffered in blocks this large: one range request per block


class HubError(ValueError):
    """The hub could not be listed or read; the message names the dataset (never the token)."""


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _token() -> str | None:
    token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if token:
        return token
    try:
        from huggingface_hub import get_token

        return get_token()
    except Exception:  # not installed, or no login
        return None


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None  # redirects are followed by hand, so the token stays with the hub's own host


_OPENER = urllib.request.build_opener(_NoRedirect)


def _request(url: str, *, method: str = "GET", headers: dict[str, str] | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, body) of a request, following redirects; the Authorization header only to the hub."""
    hub_host = urllib.parse.urlsplit(endpoint()).netloc
    token = _token()
    for attempt in range(RETRIES):
        current = url
        try:
            for _ in range(8):
                sent = dict(headers or {})
                if token and urllib.parse.urlsplit(current).netloc == hub_host:
                    sent["Authorization"] = f"Bearer {token}"
                req = urllib.request.Request(current, method=method, headers=sent)
                try:
                    with _OPENER.open(req, timeout=TIMEOUT_S) as resp:
                        return resp.status, dict(resp.headers), resp.read() if method != "HEAD" else b""
                except urllib.error.HTTPError as exc:
                    if exc.code in (301, 302, 303, 307, 308) and exc.headers.get("Location"):
                        current = urllib.parse.urljoin(current, exc.headers["Location"])
                        continue
                    if exc.code in (429, 500, 502, 503, 504) and attempt < RETRIES - 1:
                        raise ConnectionError(f"HTTP {exc.code}") from None
                    return exc.code, dict(exc.headers or {}), exc.read() or b""
            raise HubError(f"too many redirects reading {url}")
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as exc:
            if attempt == RETRIES - 1:
                raise HubError(f"cannot reach {url.split('?')[0]}: {getattr(exc, 'reason', exc)}") from None
            time.sleep(min(8.0, 0.5 * 2**attempt))
    raise AssertionError("unreachable")


def _split_matches(path: str, split: str) -> bool:
    parts = path.split("/")
    name = parts[-1]
    return split in parts[:-1] or name.startswith((f"{split}-", f"{split}_", f"{split}.")) or f"/{split}/" in path


def list_parquet(repo: str, split: str = "train", revision: str = "main", *, key: str = "hub") -> list[str]:
    """`hub://` names of the split's parquet shards in a hub dataset, sorted; a clear error when there are none."""
    url = f"{endpoint()}/api/datasets/{repo}/tree/{urllib.parse.quote(revision, safe='')}?recursive=true&expand=false"
    files: list[str] = []
    while url:
        status, headers, body = _request(url)
        if status == 401 or status == 403:
            raise HubError(f"{key} = {repo!r}: the hub refused access ({status}); log in (huggingface-cli login) "
                           "or set HF_TOKEN, and accept the dataset's terms on its page if it is gated")  # fmt: skip
        if status == 404:
            raise HubError(f"{key} = {repo!r}: no such dataset (or revision {revision!r}) on {endpoint()}")
        if status != 200:
            raise HubError(f"{key} = {repo!r}: listing its files failed with HTTP {status}")
        try:
            entries: list[dict[str, Any]] = json.loads(body)
        except json.JSONDecodeError:
            raise HubError(f"{key} = {repo!r}: the hub's file listing was not JSON") from None
        files += [e["path"] for e in entries if e.get("type") == "file" and e["path"].endswith(".parquet")]
        url = _next_link(headers.get("Link") or headers.get("link") or "")
    if not files:
        raise HubError(
            f"{key} = {repo!r} has no .parquet files; stream parquet datasets (FineWeb-style), or load this one "
            "with data.streaming = false"
        )
    chosen = [f for f in files if _split_matches(f, split)]
    if not chosen and split == "train":
        chosen = files  # a dataset with one split often names no split at all (data/CC-MAIN-…/000.parquet)
    if not chosen:
        dirs = sorted({f.rsplit("/", 1)[0] for f in files if "/" in f})[:8]
        raise HubError(f"{key} = {repo!r}: no parquet shards for split {split!r}; its folders: {', '.join(dirs)}")
    rev = urllib.parse.quote(revision, safe="")  # a revision may hold '/' (refs/convert/parquet)
    return [f"{SCHEME}{repo}@{rev}/{f}" for f in sorted(chosen)]


def _next_link(header: str) -> str | None:
    for part in header.split(","):
        if 'rel="next"' in part:
            return part.split(";")[0].strip().strip("<>")
    return None


def is_hub(path: str) -> bool:
    return path.startswith(SCHEME)


def resolve_url(name: str) -> str:
    """The download URL of a `hub://<repo>@<quoted revision>/<path>` name."""
    repo, _, rest = name[len(SCHEME) :].partition("@")
    revision, _, path = rest.partition("/")
    if not repo or not revision or not path:
        raise HubError(f"{name}: not a hub shard name (hub://<repo>@<revision>/<path>)")
    return f"{endpoint()}/datasets/{repo}/resolve/{revision}/{urllib.parse.quote(path)}"


class RangeFile(io.RawIOBase):
    """A read-only, seekable remote file: each read is one HTTP range request (wrap it in a BufferedReader)."""

    def __init__(self, url: str, name: str):
        self.url, self.name = url, name
        self._pos = 0
        status, headers, _ = _request(url, method="HEAD")
        if status != 200:
            raise HubError(f"{name}: HTTP {status} when opening it")
        lowered = {k.lower(): v for k, v in headers.items()}
        size = lowered.get("x-linked-size") or lowered.get("content-length")
        if size is None:
            raise HubError(f"{name}: the hub did not say its size")
        self.size = int(size)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        want = min(len(buffer), self.size - self._pos)
        if want <= 0:
            return 0
        status, _, body = _request(self.url, headers={"Range": f"bytes={self._pos}-{self._pos + want - 1}"})
        if status == 200:  # a server that ignores Range sends the whole file
            body = body[self._pos : self._pos + want]
        elif status != 206:
            raise HubError(f"{self.name}: HTTP {status} reading bytes {self._pos}-{self._pos + want - 1}")
        n = len(body)
        buffer[:n] = body
        self._pos += n
        return n


def open_source(path: str):
    """What pyarrow should open: a local path as is, a hub shard as a buffered range-reading file."""
    if not is_hub(path):
        return path
    return io.BufferedReader(RangeFile(resolve_url(path), path), buffer_size=BLOCK_BYTES)
