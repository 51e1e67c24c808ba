"""Streaming a hub dataset's parquet shards by HTTP range requests, against a hub served on 127.0.0.1.

The server speaks the two hub endpoints the reader uses, as huggingface_hub reads them: the paginated tree
listing (`Link: <...>; rel="next"`, entries with type, path, size and oid) and file reads that redirect, as for
an LFS file, to a CDN host on another port (another origin) which answers range requests; HF_ENDPOINT points
the reader at it.
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.parse
from pathlib import Path

import pytest
import torch
from test_streaming import config, streaming, tok, write_shards  # noqa: F401 (tok is a fixture)

from prime_train.config.schema import DataConfig, DatasetConfig
from prime_train.engine import hub_files
from prime_train.engine.data import build_eval_batches

TOKEN = "hf_pt_test_token_Qx81"
REPO = "test-org/web-text"


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


def _serve(handler) -> tuple[_Server, str]:
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A hub whose dataset REPO holds the files under tmp_path/repo; returns its state (requests seen)."""
    root = tmp_path / "repo"
    state = {"auth_at_hub": [], "auth_at_cdn": [], "range_bytes": 0, "full_reads": 0, "root": root}

    class Cdn(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _file(self) -> Path | None:
            path = root / urllib.parse.unquote(self.path.split("/cdn/", 1)[1].split("?")[0])
            return path if path.is_file() else None

        def do_HEAD(self):
            state["auth_at_cdn"].append(self.headers.get("Authorization"))
            f = self._file()
            self.send_response(200 if f else 404)
            self.send_header("Content-Length", str(f.stat().st_size if f else 0))
            self.end_headers()

        def do_GET(self):
            state["auth_at_cdn"].append(self.headers.get("Authorization"))
            f = self._file()
            data = f.read_bytes() if f else b""
            rng = self.headers.get("Range")
            if rng:
                a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
                body = data[a : b + 1]
                state["range_bytes"] += len(body)
                self.send_response(206)
            else:
                body = data
                state["full_reads"] += 1
                self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    cdn, cdn_url = _serve(Cdn)

    class Hub(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, code, body=b"", headers=()):
            self.send_response(code)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            if "/datasets/" in self.path:  # huggingface_hub's own calls (its agent-harness registry) are not ours
                state["auth_at_hub"].append(self.headers.get("Authorization"))
            url = urllib.parse.urlsplit(self.path)
            tree = f"/api/datasets/{REPO}/tree/main"
            if url.path == tree:
                files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
                page = int(urllib.parse.parse_qs(url.query).get("page", ["0"])[0])
                chunk = files[page * 2 : page * 2 + 2]  # two entries a page: the reader must follow Link
                entries = [{"type": "file", "path": f, "size": (root / f).stat().st_size, "oid": "x"} for f in chunk]
                headers = []
                if page * 2 + 2 < len(files):
                    headers.append(("Link", f'<{hub_url}{tree}?recursive=true&page={page + 1}>; rel="next"'))
                return self._send(200, json.dumps(entries).encode(), headers)
            prefix = f"/datasets/{REPO}/resolve/main/"
            if url.path.startswith(prefix):
                # an LFS file, as the hub serves one: a redirect to its CDN that carries the file's size, etag and
                # commit (the X-Linked-* and X-Repo-Commit headers huggingface_hub's get_hf_file_metadata reads)
                name = urllib.parse.unquote(url.path[len(prefix) :])
                f = root / name
                if not f.is_file():
                    return self._send(404, headers=[("X-Error-Code", "EntryNotFound")])
                return self._send(302, headers=[
                    ("Location", f"{cdn_url}/cdn/{url.path[len(prefix) :]}?X-Amz-Signature=signed"),
                    ("X-Linked-Size", str(f.stat().st_size)), ("X-Linked-Etag", f'"{f.stat().st_mtime_ns}"'),
                    ("X-Repo-Commit", "0123456789abcdef0123456789abcdef01234567"), ("ETag", '"pointer"'),
                ])  # fmt: skip
            if url.path.startswith("/api/datasets/"):
                return self._send(404, b'{"error": "Repository not found"}')
            self._send(404)

    server, hub_url = _serve(Hub)
    monkeypatch.setenv("HF_ENDPOINT", hub_url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    yield state
    server.shutdown()
    cdn.shutdown()


def _finish(*loaders) -> None:
    """Let each loader's prefetch of its next window end while the hub still answers: the loader has no close(),
    and a read still in flight when the test's servers go would retry against nothing until the process exits."""
    for loader in loaders:
        if getattr(loader, "_pool", None) is not None:
            loader._pool.shutdown(wait=True)


def test_listing_follows_pages_and_picks_the_split(hub, tmp_path):
    root = hub["root"]
    write_shards(root / "data" / "train", 3, 10)
    write_shards(root / "data" / "test", 1, 10)
    (root / "README.md").write_text("a dataset card")
    train = hub_files.list_parquet(REPO, "train")
    assert [n.rsplit("/", 2)[-2:] for n in train] == [["train", f"shard-00{i}.parquet"] for i in range(3)]
    assert len(hub_files.list_parquet(REPO, "test")) == 1
    with pytest.raises(ValueError, match="split 'validation'"):
        hub_files.list_parquet(REPO, "validation")
    with pytest.raises(ValueError, match="no such dataset"):
        hub_files.list_parquet("test-org/missing")
    assert hub["auth_at_hub"] and all(a == f"Bearer {TOKEN}" for a in hub["auth_at_hub"])


def test_hub_stream_yields_the_batches_the_same_local_shards_do(hub, tok, tmp_path):  # noqa: F811
    local = write_shards(hub["root"] / "data", 4, 120)
    from_hub = streaming(tok, DataConfig(datasets=[DatasetConfig(hub=REPO)], seq_len=128, held_out_fraction=0.1,
                                         streaming=True), mbs=3, buffer=40, world_size=2, rank=1)  # fmt: skip
    from_disk = streaming(tok, config(local), mbs=3, buffer=40, world_size=2, rank=1)
    for _ in range(25):
        a, b = next(from_hub), next(from_disk)
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    _finish(from_hub)
    # the token went to the hub only, never along the redirect to the CDN; reads were ranges, never whole files
    assert hub["auth_at_cdn"] and not any(hub["auth_at_cdn"])
    assert hub["range_bytes"] > 0 and hub["full_reads"] == 0


def test_a_resumed_hub_stream_continues_exactly(hub, tok):  # noqa: F811
    write_shards(hub["root"] / "data", 2, 150)
    data = DataConfig(datasets=[DatasetConfig(hub=REPO)], seq_len=128, streaming=True)
    run = streaming(tok, data, mbs=2, buffer=30)
    states, batches = [], []
    for _ in range(40):
        states.append(json.loads(json.dumps(run.state_dict())))
        batches.append(next(run))
    resumed = streaming(tok, data, mbs=2, buffer=30)
    resumed.load_state_dict(states[23])
    for expected in batches[23:35]:
        assert torch.equal(next(resumed).input_ids, expected.input_ids)
    _finish(run, resumed)


def test_streamed_hub_eval_reads_held_out_records_without_the_datasets_package(hub, tok, monkeypatch):  # noqa: F811
    import sys

    write_shards(hub["root"] / "data", 2, 200, kind="text")
    monkeypatch.setitem(sys.modules, "datasets", None)  # the eval must not need it
    data = DataConfig(datasets=[DatasetConfig(hub=REPO)], seq_len=128, streaming=True, held_out_fraction=0.2)
    batches = build_eval_batches(data, tok, job="pretrain", micro_batch_size=4, rank=0, world_size=1, seed=0,
                                 max_batches=3)  # fmt: skip
    assert len(batches) == 3 and all(b.input_ids.shape == (4, 128) for b in batches)


def test_hf_hub_offline_is_honoured_without_touching_the_network(hub, tmp_path):
    """HF_HUB_OFFLINE=1 means no request at all (huggingface_hub's own rule, which the reader now goes through):
    listing a hub dataset says so, and the hub sees nothing. huggingface_hub reads it at import: a fresh process."""
    import os
    import subprocess
    import sys

    write_shards(hub["root"] / "data", 1, 10)
    script = (
        "from prime_train.engine import hub_files\n"
        f"try:\n    hub_files.list_parquet({REPO!r})\nexcept hub_files.HubError as e:\n    print('ERR', e)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert run.stdout.startswith("ERR hub = 'test-org/web-text': HF_HUB_OFFLINE is set"), run.stdout + run.stderr
    assert hub["auth_at_hub"] == [], "no request reached the hub"
