"""A fake Hugging Face Hub on 127.0.0.1 for the download tests: no internet needed.

It serves the endpoints huggingface_hub 2.x calls for a model repo:

    GET  /api/models/{repo}[/revision/{rev}][?blobs=true]   model_info (siblings with size, blobId, lfs)
    GET  /api/models/{repo}/tree/{rev}[/{path}]             list_repo_tree
    POST /api/models/{repo}/paths-info/{rev}                get_paths_info
    HEAD /{repo}/resolve/{rev}/{path}                       ETag, X-Repo-Commit, X-Linked-Size/-Etag, Content-Length
    GET  /{repo}/resolve/{rev}/{path}                       the bytes, with Range support (206)

Files ending in .safetensors are served as LFS files (ETag = sha256), the others as plain git blobs
(ETag = git blob sha1). Faults are injected per test: a dropped connection mid-file, a slow file, a file
missing on the server, metadata that misstates a file (size, sha256), a private repo (401 without the right
token), a gated repo (403). Every request is logged.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


def git_blob_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def is_lfs(path: str) -> bool:
    return path.endswith(".safetensors")


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]]  # commit sha -> {path: bytes}
    refs: dict[str, str]  # branch or tag -> commit sha
    token: str | None = None  # private: requests must carry "Bearer {token}"
    gated: bool = False  # file downloads answer 403 GatedRepo
    hidden: set[str] = field(default_factory=set)  # listed in the metadata, 404 on resolve
    announced: dict[str, dict[str, object]] = field(default_factory=dict)  # path -> {"size"/"sha256": what
    # the metadata says instead of the truth}; the file itself is served as it is

    def commit_of(self, rev: str) -> str | None:
        if rev in self.commits:
            return rev
        return self.refs.get(rev)


@dataclass
class Logged:
    method: str
    path: str
    range: str | None
    status: int
    body_bytes: int


class FakeHub:
    """A threaded HTTP server standing in for the Hub. Use as a context manager; `url` is its endpoint."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.log: list[Logged] = []
        self.drop_after: dict[str, int] = {}  # repo path -> bytes sent before the next GET is cut off (once)
        self.bytes_per_s: dict[str, float] = {}  # repo path -> how fast its GETs send (64-byte pieces)
        self.sent: dict[str, int] = {}  # repo path -> bytes of its last slow GET sent so far
        self.api_body: bytes | None = None  # when set, every /api/ answer: 200 with this body (a proxy's page)
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05})

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def add_repo(self, repo_id: str, commits: dict[str, dict[str, bytes]], refs: dict[str, str]) -> Repo:
        self.repos[repo_id] = Repo(commits=commits, refs=refs)
        return self.repos[repo_id]

    def record(self, entry: Logged) -> None:
        with self._lock:
            self.log.append(entry)

    def gets(self, path_suffix: str) -> list[Logged]:
        """Logged GETs of one file (any revision)."""
        with self._lock:
            return [e for e in self.log if e.method == "GET" and e.path.endswith("/" + path_suffix)]


def _file_entry(path: str, data: bytes, *, tree: bool, announced: dict | None = None) -> dict:
    """One file as /api/models/... describes it: model_info siblings (tree=False) or tree entries (tree=True);
    `announced` replaces its true size and sha256."""
    oid = git_blob_sha1(data)
    said = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} | (announced or {})
    entry: dict = {"size": said["size"]}
    if tree:
        entry |= {"type": "file", "path": path, "oid": oid}
    else:
        entry |= {"rfilename": path, "blobId": oid}
    if is_lfs(path):
        key = "oid" if tree else "sha256"
        entry["lfs"] = {key: said["sha256"], "size": said["size"], "pointerSize": 134}
    return entry


def _make_handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # keep pytest output clean
            pass

        # --- plumbing ---

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            if "Content-Length" not in (headers or {}):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
            hub.record(Logged(self.command, urlsplit(self.path).path, self.headers.get("Range"), status, len(body)))

        def _json(self, data: object) -> None:
            self._send(200, json.dumps(data).encode(), {"Content-Type": "application/json"})

        def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
            headers = {"X-Error-Message": message, "Content-Type": "application/json"}
            if code:
                headers["X-Error-Code"] = code
            if commit:
                headers["X-Repo-Commit"] = commit
            self._send(status, json.dumps({"error": message}).encode(), headers)

        def _repo(self, repo_id: str, *, files: bool) -> Repo | None:
            """The repo if this request may see it; otherwise answers the error and returns None."""
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", "Repository not found")
                return None
            auth = self.headers.get("Authorization")
            if repo.token is not None and auth != f"Bearer {repo.token}":
                if auth:
                    self._error(401, "", "Invalid credentials in Authorization header")
                else:
                    self._error(401, "RepoNotFound", "Invalid username or password.")
                return None
            if repo.gated and files:
                self._error(403, "GatedRepo", f"Access to model {repo_id} is restricted")
                return None
            return repo

        # --- routes ---

        def do_HEAD(self) -> None:
            self._route()

        def do_GET(self) -> None:
            self._route()

        def do_POST(self) -> None:
            self._route()

        def _route(self) -> None:
            url = urlsplit(self.path)
            parts = [unquote(p) for p in url.path.split("/")[1:]]
            query = parse_qs(url.query)
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api(parts[2] + "/" + parts[3], parts[4:], query)
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]))
            self._error(404, "", f"no route for {url.path}")

        def _api(self, repo_id: str, rest: list[str], query: dict[str, list[str]]) -> None:
            if hub.api_body is not None:
                return self._send(200, hub.api_body, {"Content-Type": "text/html"})
            repo = self._repo(repo_id, files=False)
            if repo is None:
                return
            kind, rev = (rest[0], rest[1]) if len(rest) >= 2 else ("revision", "main")
            commit = repo.commit_of(rev)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            files = repo.commits[commit]
            if kind == "revision":
                blobs = query.get("blobs", ["false"])[0].lower() == "true"
                siblings = [
                    _file_entry(p, d, tree=False, announced=repo.announced.get(p)) if blobs else {"rfilename": p}
                    for p, d in files.items()
                ]
                return self._json(
                    {
                        "id": repo_id,
                        "sha": commit,
                        "private": repo.token is not None,
                        "gated": "auto" if repo.gated else False,
                        "siblings": siblings,
                    }
                )
            if kind == "tree":
                prefix = "/".join(rest[2:])
                entries = [
                    _file_entry(p, d, tree=True, announced=repo.announced.get(p))
                    for p, d in files.items()
                    if p.startswith(prefix)
                ]
                return self._json(entries)
            if kind == "paths-info":
                length = int(self.headers.get("Content-Length", "0"))
                form = parse_qs(self.rfile.read(length).decode())
                wanted = set(form.get("paths", []))
                return self._json(
                    [
                        _file_entry(p, d, tree=True, announced=repo.announced.get(p))
                        for p, d in files.items()
                        if p in wanted
                    ]
                )
            self._error(404, "", f"unknown api {kind}")

        def _resolve(self, repo_id: str, rev: str, path: str) -> None:
            repo = self._repo(repo_id, files=True)
            if repo is None:
                return
            commit = repo.commit_of(rev)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            data = repo.commits[commit].get(path)
            if data is None or path in repo.hidden:
                return self._error(404, "EntryNotFound", f"{path} does not exist on {rev}", commit)
            etag = hashlib.sha256(data).hexdigest() if is_lfs(path) else git_blob_sha1(data)
            headers = {"ETag": f'"{etag}"', "X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
            if is_lfs(path):
                headers |= {"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))}
            start, status = 0, 200
            rng = self.headers.get("Range")
            if rng and rng.startswith("bytes="):
                first, _, last = rng[len("bytes=") :].partition("-")
                start = int(first)
                end = int(last) + 1 if last else len(data)
                if start >= len(data):
                    return self._error(416, "", f"range {rng} outside {len(data)} bytes")
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(data)}"
                data, status = data[start:end], 206
            cut = hub.drop_after.pop(path, None) if self.command == "GET" else None
            rate = hub.bytes_per_s.get(path) if self.command == "GET" else None
            if rate is not None:
                return self._send_slowly(path, status, data, headers, rate)
            if cut is None:
                return self._send(status, data, headers)
            # send the headers and part of the body, then drop the connection, as a network fault would
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data[:cut])
            self.wfile.flush()
            hub.record(Logged("GET", urlsplit(self.path).path, rng, status, cut))
            self.close_connection = True
            self.connection.shutdown(2)

        def _send_slowly(self, path: str, status: int, data: bytes, headers: dict[str, str], rate: float) -> None:
            """The body of `path` in 64-byte pieces at `rate` bytes/s, until sent or the client goes away;
            hub.sent[path] counts them."""
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            sent = 0
            try:
                for start in range(0, len(data), 64):
                    self.wfile.write(data[start : start + 64])
                    self.wfile.flush()
                    sent = hub.sent[path] = min(start + 64, len(data))
                    time.sleep(64 / rate)
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True
            hub.record(Logged("GET", urlsplit(self.path).path, self.headers.get("Range"), status, sent))

    return Handler


def point_huggingface_hub_at(hub: FakeHub, home: Path, monkeypatch) -> None:
    """Send huggingface_hub to `hub`, with its cache and token under `home`, no token and no hf-xet.
    huggingface_hub reads HF_ENDPOINT and HF_HOME once, at import: its `constants` are patched too."""
    import huggingface_hub.constants as hf_constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(hf_constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(
        hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    )


def tiny_checkpoint(seed: int) -> dict[str, bytes]:
    """A small published-style checkpoint: two safetensors shards with real names and dtypes, the index,
    config.json and a tokenizer file. Different seeds give different bytes (for revision tests)."""
    import torch
    from safetensors.torch import save

    g = torch.Generator().manual_seed(seed)
    shards = {
        "model-00001-of-00002.safetensors": {
            "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
            "layers.0.attn.wq_a.weight": torch.randn(48, 32, generator=g).to(torch.float8_e4m3fn),
            "layers.0.attn.wq_a.scale": torch.ones(2, 1).to(torch.float8_e8m0fnu),
            "layers.0.attn.attn_sink": torch.randn(4, generator=g),
        },
        "model-00002-of-00002.safetensors": {
            "layers.0.ffn.experts.0.w1.weight": torch.randint(-128, 127, (16, 16), generator=g, dtype=torch.int8),
            "layers.0.ffn.experts.0.w1.scale": torch.ones(16, 1).to(torch.float8_e8m0fnu),
            "norm.weight": torch.ones(32, dtype=torch.bfloat16),
            "head.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        },
    }
    files = {name: save(tensors, metadata={"format": "pt"}) for name, tensors in shards.items()}
    weight_map = {t: name for name, tensors in shards.items() for t in sorted(tensors)}
    total = sum(len(b) for b in files.values())
    files["model.safetensors.index.json"] = json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2
    ).encode()
    files["config.json"] = json.dumps({"model_type": "deepseek_v4", "seed": seed}).encode()
    files["tokenizer.json"] = json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}}}).encode()
    return files


def published_checkpoint(seed: int, workdir: Path) -> dict[str, bytes]:
    """The files a Hub repo would hold: `dsv41-convert make-tiny` output where that command exists, works and
    stays small, else `tiny_checkpoint(seed)`."""
    from typer.testing import CliRunner

    from dsv41_convert.cli import app

    names = {c.name or (c.callback.__name__ if c.callback else "") for c in app.registered_commands}
    if "make-tiny" in names:
        out = workdir / f"tiny-{seed}"
        result = CliRunner().invoke(app, ["make-tiny", str(out), "--seed", str(seed)])
        paths = sorted(p for p in out.rglob("*") if p.is_file()) if out.is_dir() else []
        if result.exit_code == 0 and any(p.suffix == ".safetensors" for p in paths):
            if sum(p.stat().st_size for p in paths) < 64 * 1024 * 1024:
                return {p.relative_to(out).as_posix(): p.read_bytes() for p in paths}
    return tiny_checkpoint(seed)
