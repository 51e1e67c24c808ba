"""`prime-train download | push`: huggingface_hub against a real HTTP server on 127.0.0.1 that answers the endpoints
`snapshot_download` (revision, tree, resolve) and `create_repo` / `create_commit` (repos/create, validate-yaml,
preupload, commit) call and records every request; and the refusals (offline, a closed port, no token, no final/) as
exit 78, the token never printed."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from enginetools import REPO, free_port
from typer.testing import CliRunner

TOKEN = "hf_" + "q" * 34  # the shape of a real token, so that a leak would be recognisable
SHA = "a" * 40
# the model the fake hub serves: what the engine reads, and a duplicate .bin it does not
HUB_FILES = {"config.json": b'{"model_type": "llama"}', "model.safetensors": b"\0" * 2048, "pytorch_model.bin": b"x"}


def invoke(*args: str, **env: str):
    from prime_train.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1", **env})


class FakeHub(BaseHTTPRequestHandler):
    """The hub's write API as huggingface_hub speaks it, every file answered as a regular (not LFS) upload."""

    requests: ClassVar[list[dict]] = []

    def log_message(self, *args) -> None:  # quiet
        pass

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send(self, body: bytes, headers: dict[str, str], *, head: bool) -> None:
        self.send_response(200)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _read(self, head: bool) -> None:
        """The read API snapshot_download uses: the revision, the file tree, each file (HEAD for its metadata)."""
        path = self.path.split("?")[0]
        self.requests.append({"method": self.command, "path": path})
        json_type = {"Content-Type": "application/json"}
        if path == "/api/models/me/tiny/revision/main":
            info = {"id": "me/tiny", "sha": SHA, "siblings": [{"rfilename": name} for name in HUB_FILES]}
            return self._send(json.dumps(info).encode(), json_type, head=head)
        if path == f"/api/models/me/tiny/tree/{SHA}":
            tree = [{"type": "file", "path": name, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                    for name, data in HUB_FILES.items()]  # fmt: skip
            return self._send(json.dumps(tree).encode(), json_type, head=head)
        name = path.removeprefix(f"/me/tiny/resolve/{SHA}/")
        if name in HUB_FILES:
            etag = f'"{hashlib.sha1(HUB_FILES[name]).hexdigest()}"'
            return self._send(HUB_FILES[name], {"X-Repo-Commit": SHA, "ETag": etag}, head=head)
        self.send_error(404)

    def do_GET(self) -> None:
        self._read(head=False)

    def do_HEAD(self) -> None:
        self._read(head=True)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        endpoint = f"http://127.0.0.1:{self.server.server_port}"
        if self.path == "/api/repos/create":
            self._reply({"url": f"{endpoint}/{json.loads(body)['organization']}/{json.loads(body)['name']}"})
        elif self.path == "/api/validate-yaml":  # the model card's front matter, checked before the commit
            self._reply({"errors": [], "warnings": []})
        elif "/preupload/" in self.path:
            files = json.loads(body)["files"]
            self._reply({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in files]})
        elif "/commit/" in self.path:
            self._reply({"commitUrl": f"{endpoint}/me/tiny/commit/{'0' * 40}", "commitOid": "0" * 40})
        else:
            self.send_error(404)


def hub_offline(monkeypatch, offline: bool) -> None:
    """HF_HUB_OFFLINE as a fresh process would see it: huggingface_hub reads it once, into its constants, at import
    (an earlier test of this process may have imported it offline)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


@pytest.fixture
def hub(monkeypatch):
    hub_offline(monkeypatch, False)
    FakeHub.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}", FakeHub.requests
    server.shutdown()
    server.server_close()


def finished_run(root: Path) -> Path:
    run = root / "tiny"
    (run / "final").mkdir(parents=True)
    (run / "config.toml").write_text('[run]\nname = "tiny"\njob = "sft"\n\n[train]\nlr = 0.003\n\n[spot]\nsetup = []\n')
    (run / "metrics.jsonl").write_text(json.dumps({"step": 120, "eval_loss": 0.15, "eval_exact_match": 0.94}) + "\n")
    (run / "final" / "config.json").write_text('{"model_type": "llama"}')
    (run / "final" / "model.safetensors").write_bytes(b"\x00" * 4096)
    (run / "final" / ".prime-train-export.json").write_text("{}")
    return run


def test_push_uploads_final_and_a_model_card_in_one_commit_to_the_hub_server(tmp_path, hub):
    endpoint, requests = hub
    run = finished_run(tmp_path)
    result = invoke("push", str(run), "--repo", "me/tiny", "--json", HF_ENDPOINT=endpoint, HF_TOKEN=TOKEN)
    assert result.exit_code == 0, result.output
    assert TOKEN not in result.output
    assert [r["path"].split("?")[0] for r in requests] == [
        "/api/repos/create", "/api/validate-yaml", "/api/models/me/tiny/preupload/main",
        "/api/models/me/tiny/commit/main",
    ]  # fmt: skip
    assert all(r["auth"] == f"Bearer {TOKEN}" for r in requests)
    lines = [json.loads(line) for line in requests[-1]["body"].splitlines()]
    files = {x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"}
    assert set(files) == {"config.json", "model.safetensors", "README.md"}  # not our export marker
    assert files["model.safetensors"] == b"\x00" * 4096
    card = files["README.md"].decode()
    assert "| exact_match | 0.94 |" in card and "lr = 0.003" in card and "[spot]" not in card
    assert json.loads(result.stdout)["url"].endswith("0" * 40)


def test_push_dry_run_shows_the_plan_and_sends_nothing(tmp_path, hub):
    endpoint, requests = hub
    result = invoke("push", str(finished_run(tmp_path)), "--repo", "me/tiny", "--dry-run", "--json",
                    HF_ENDPOINT=endpoint)  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["repo_id"] == "me/tiny" and [f["path"] for f in plan["files"]] == ["config.json", "model.safetensors"]
    assert "| loss | 0.15 |" in plan["card"] and "lr = 0.003" in plan["card"]
    assert requests == []


def test_push_and_download_refuse_cleanly_without_a_token_a_final_or_a_network(tmp_path, monkeypatch):
    from huggingface_hub import constants

    run = finished_run(tmp_path)
    # no token in the environment, nor in the file `hf auth login` writes (read where the library was told at import)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "hf" / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf" / "stored_tokens"))
    no_token = invoke("push", str(run), "--repo", "me/tiny", HF_TOKEN="")
    assert no_token.exit_code == 78 and "hf auth login" in no_token.output
    (run / "final" / "config.json").unlink()
    for p in (run / "final").iterdir():
        p.unlink()
    (run / "final").rmdir()
    no_final = invoke("push", str(run), "--repo", "me/tiny", HF_TOKEN=TOKEN)
    assert no_final.exit_code == 78 and "no final/" in no_final.output and TOKEN not in no_final.output
    hub_offline(monkeypatch, False)  # online, but nothing listens on the port
    closed = invoke("push", str(finished_run(tmp_path / "again")), "--repo", "me/tiny", HF_TOKEN=TOKEN,
                    HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")  # fmt: skip
    assert closed.exit_code == 78 and "cannot be reached" in closed.output and TOKEN not in closed.output
    hub_offline(monkeypatch, True)
    offline = invoke("download", "Qwen/Qwen2.5-0.5B-Instruct", HF_HOME=str(tmp_path / "hf"))
    assert offline.exit_code == 78 and "HF_HUB_OFFLINE" in offline.output and "Traceback" not in offline.output


def test_download_fetches_what_the_engine_reads_into_the_hub_cache(tmp_path, hub):
    endpoint, requests = hub
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    env.pop("HF_TOKEN", None)
    result = subprocess.run(
        [sys.executable, "-m", "prime_train", "download", "me/tiny", "--json"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    snapshot = Path(json.loads(result.stdout)["path"])
    assert snapshot == tmp_path / "hf" / "hub" / "models--me--tiny" / "snapshots" / SHA  # where from_pretrained looks
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "model.safetensors"]  # no .bin duplicate
    assert (snapshot / "model.safetensors").read_bytes() == HUB_FILES["model.safetensors"]
    assert ("GET", f"/me/tiny/resolve/{SHA}/model.safetensors") in [(r["method"], r["path"]) for r in requests]
