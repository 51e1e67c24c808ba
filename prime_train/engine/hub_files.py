"""Parquet shards of a Hugging Face hub dataset, read in place over HTTP range requests (data.streaming).

FineWeb-style datasets are folders of parquet shards on the hub. Streaming them needs no download
of whole shards: a parquet file is read by its footer and then row group by row group, and each of
those is one HTTP range request. So a hub shard is named here as `hub://<repo>@<revision>/<path>`
and opened as a seekable file whose reads are range requests; everything else (parquet rows in
records.py; shard order, rank split, windows, resume in streaming.py) is the local-parquet code, unchanged.

huggingface_hub does the hub's part: the listing (`HfApi.list_repo_tree`: pagination, errors), the file's
URL (`hf_hub_url`) and size (`get_hf_file_metadata`, which follows no redirect off the hub), the token
(HF_TOKEN or the saved login), retries with backoff (`http_backoff`) and the HTTP client. What it does
not give is a range read of a repository file: `hf_hub_download` fetches whole files, and `HfFileSystem`
reads ranges but resolves every path through further API calls (repo info, paths-info) and ranges a
CDN URL signed once per open, which expires while a long stream reads a shard. So each read here is one
GET of the file's hub URL with a Range header through huggingface_hub's own client, which follows the
hub's redirect to its CDN and, like every HTTP client it has used (requests, httpx), drops the
Authorization header on a redirect to another origin: the token goes to the hub only.
The endpoint is HF_ENDPOINT as set now (huggingface_hub reads it once, at import).
"""

from __future__ import annotations

import io
import os
import urllib.parse
from typing import Any

SCHEME = "hub://"
TIMEOUT_S = 60.0
BLOCK_BYTES = 8 << 20  # reads are buffered in blocks this large: one range request per block


class HubError(ValueError):
    """The hub could not be listed or read; the message names the dataset (never the token)."""


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _why(exc: BaseException) -> str:
    """A hub error in one line, without a URL's query string (a signed URL) or the token."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split("?")[0]


def _split_matches(path: str, split: str) -> bool:
    parts = path.split("/")
    name = parts[-1]
    return split in parts[:-1] or name.startswith((f"{split}-", f"{split}_", f"{split}.")) or f"/{split}/" in path


def list_parquet(repo: str, split: str = "train", revision: str = "main", *, key: str = "hub") -> list[str]:
    """`hub://` names of the split's parquet shards in a hub dataset, sorted; a clear error when there are none."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.hf_api import RepoFile

    refused = (f"{key} = {repo!r}: the hub refused access ({{}}); log in (hf auth login) or set HF_TOKEN, and accept "
               "the dataset's terms on its page if it is gated")  # fmt: skip
    try:
        tree = HfApi(endpoint=endpoint()).list_repo_tree(repo, repo_type="dataset", revision=revision, recursive=True)
        files = [e.path for e in tree if isinstance(e, RepoFile) and e.path.endswith(".parquet")]
    except GatedRepoError:
        raise HubError(refused.format("gated")) from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise HubError(f"{key} = {repo!r}: no such dataset (or revision {revision!r}) on {endpoint()}") from None
    except OfflineModeIsEnabled:
        raise HubError(f"{key} = {repo!r}: HF_HUB_OFFLINE is set, and streaming reads the hub") from None
    except HfHubHTTPError as exc:
        status = _status(exc)
        if status in (401, 403):
            raise HubError(refused.format(status)) from None
        if status == 404:
            raise HubError(f"{key} = {repo!r}: no such dataset (or revision {revision!r}) on {endpoint()}") from None
        raise HubError(f"{key} = {repo!r}: listing its files failed with HTTP {status}: {_why(exc)}") from None
    except Exception as exc:  # DNS, refused, timeouts after huggingface_hub's retries; a listing that is not JSON
        raise HubError(f"{key} = {repo!r}: cannot list it on {endpoint()}: {type(exc).__name__}: {_why(exc)}") from None
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


def is_hub(path: str) -> bool:
    return path.startswith(SCHEME)


def resolve_url(name: str) -> str:
    """The hub URL of a `hub://<repo>@<quoted revision>/<path>` name (huggingface_hub's hf_hub_url)."""
    from huggingface_hub import hf_hub_url

    repo, _, rest = name[len(SCHEME) :].partition("@")
    revision, _, path = rest.partition("/")
    if not repo or not revision or not path:
        raise HubError(f"{name}: not a hub shard name (hub://<repo>@<revision>/<path>)")
    return hf_hub_url(repo, path, repo_type="dataset", revision=urllib.parse.unquote(revision), endpoint=endpoint())


class RangeFile(io.RawIOBase):
    """A read-only, seekable remote file: each read is one HTTP range request (wrap it in a BufferedReader)."""

    def __init__(self, url: str, name: str):
        from huggingface_hub import get_hf_file_metadata

        self.url, self.name = url, name
        self._pos = 0
        try:
            size = get_hf_file_metadata(url, timeout=TIMEOUT_S).size
        except Exception as exc:
            raise HubError(f"{name}: cannot open it ({_status(exc) or type(exc).__name__}: {_why(exc)})") from None
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

    def readinto(self, buffer: Any) -> int:
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status, http_backoff

        want = min(len(buffer), self.size - self._pos)
        if want <= 0:
            return 0
        span = f"bytes={self._pos}-{self._pos + want - 1}"
        try:
            # the hub URL each time: its redirect gives a freshly signed CDN URL, and the client drops the token there
            response = http_backoff("GET", self.url, headers={**build_hf_headers(), "Range": span}, timeout=TIMEOUT_S)
            hf_raise_for_status(response)
        except Exception as exc:
            raise HubError(f"{self.name}: reading {span} failed ({_status(exc) or type(exc).__name__}: "
                           f"{_why(exc)})") from None  # fmt: skip
        body = response.content
        if response.status_code == 200:  # a server that ignores Range sends the whole file
            body = body[self._pos : self._pos + want]
        elif response.status_code != 206:
            raise HubError(f"{self.name}: HTTP {response.status_code} reading {span}")
        n = len(body)
        buffer[:n] = body
        self._pos += n
        return n


def open_source(path: str):
    """What pyarrow should open: a local path as is, a hub shard as a buffered range-reading file."""
    if not is_hub(path):
        return path
    return io.BufferedReader(RangeFile(resolve_url(path), path), buffer_size=BLOCK_BYTES)
