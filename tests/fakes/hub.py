"""A local Hugging Face Hub endpoint that real huggingface_hub talks to over real HTTP.

Routes (as huggingface_hub 2.4 calls them, see its hf_api.py / file_download.py):
- `GET /api/models/{org}/{name}/revision/{rev}` → repo info JSON (`id`, `sha`, `siblings`)
- `GET /api/models/{org}/{name}/tree/{rev}?recursive=…` → file entries (`type`, `oid`, `size`,
  `path`, `lfs{oid,size,pointerSize}`), paginated with a `Link: <…>; rel="next"` header
- `HEAD|GET /{org}/{name}/resolve/{rev}/{path}` → small files served directly with `ETag`
  (git blob sha1) and `X-Repo-Commit`; LFS files answered 302 to the CDN host (`localhost`
  instead of `127.0.0.1`, so the client does not follow it on HEAD, like the real CDN) with
  `X-Linked-Etag` (sha256), `X-Linked-Size`, `X-Repo-Commit`
- `GET /lfs/{sha256}` on the CDN host → the bytes, honouring `Range: bytes=N-` (206 +
  Content-Range) for resumed downloads
Unknown repo → 404 with `X-Error-Code: RepoNotFound`; unknown revision → 404
`RevisionNotFound`; a repo with `token` set answers 401 without `Authorization: Bearer <token>`.
Fault injection: `drop_after[path] = n` closes the connection after n body bytes (once per
entry), `corrupt[path] = True` flips the last byte of the served body, `fail_status[path] = 500`
answers the file's bytes with that HTTP error.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlparse

from flash_common.digest import sha256_file

PAGE = 1000  # the Hub's page size for tree listings


@dataclass
class RepoFileData:
    path: str
    source: Path  # where the bytes live on this machine
    size: int
    lfs: bool
    sha256: str | None
    git_sha1: str


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, dict[str, RepoFileData]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)
    token: str | None = None




def _git_sha1(path: Path) -> str:
    data = path.read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.drop_after: dict[str, int] = {}
        self.corrupt: dict[str, bool] = {}
        self.fail_status: dict[str, int] = {}  # path → an HTTP error status its bytes are answered with
        self.requests: list[tuple[str, str, dict]] = []
        self.throttle_bps: float | None = None  # slow the CDN down (to interrupt a download mid-file)
        self._server: ThreadingHTTPServer | None = None
        self.port = 0

    # -- content -------------------------------------------------------------------------
    def add_dir(self, repo_id: str, directory: Path, commit: str, ref: str | None = "main",
                lfs_min: int = 1024, token: str | None = None) -> None:
        """Publish every file of `directory` (following links) as one commit of `repo_id`."""
        repo = self.repos.setdefault(repo_id, Repo(repo_id))
        repo.token = token if token is not None else repo.token
        files = {}
        for p in sorted(Path(directory).iterdir()):
            if p.name.startswith(".") or not p.is_file():
                continue
            size = p.stat().st_size
            lfs = p.suffix == ".safetensors" or size >= lfs_min
            files[p.name] = RepoFileData(p.name, p.resolve(), size, lfs, sha256_file(p) if lfs else None,
                                         _git_sha1(p) if not lfs or size < (1 << 26) else "0" * 40)
        repo.commits[commit] = files
        if ref:
            repo.refs[ref] = commit

    # -- server --------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def cdn(self) -> str:
        return f"http://localhost:{self.port}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_HEAD(self):
                hub._handle(self, head=True)

            def do_GET(self):
                hub._handle(self, head=False)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    # -- request handling ------------------------------------------------------------------
    def _send_json(self, h, obj, status=200, extra=None, head=False):
        body = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        for k, v in (extra or {}).items():
            h.send_header(k, v)
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def _error(self, h, status, code, message, head=False):
        self._send_json(h, {"error": message}, status, {"X-Error-Code": code, "X-Error-Message": message}, head)

    def _resolve(self, repo: Repo, rev: str) -> str | None:
        if rev in repo.commits:
            return rev
        return repo.refs.get(rev)

    def _authorized(self, h, repo: Repo) -> bool:
        return repo.token is None or h.headers.get("Authorization") == f"Bearer {repo.token}"

    def _handle(self, h, head: bool):
        url = urlparse(h.path)
        parts = [unquote(p) for p in url.path.split("/") if p]
        query = parse_qs(url.query)
        self.requests.append((h.command, url.path, dict(h.headers)))
        if parts[:1] == ["lfs"] and len(parts) == 2:
            return self._serve_lfs(h, parts[1], head)
        if parts[:2] == ["api", "models"] and len(parts) >= 6:
            repo_id, kind, rev = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
            repo = self.repos.get(repo_id)
            if repo is None:
                return self._error(h, 404, "RepoNotFound", f"Repository Not Found for url: {h.path}", head)
            if not self._authorized(h, repo):
                return self._error(h, 401, "GatedRepo", "Access to this repo is restricted", head)
            commit = self._resolve(repo, rev)
            if commit is None:
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            files = repo.commits[commit]
            if kind == "revision":
                return self._send_json(h, {"id": repo_id, "modelId": repo_id, "sha": commit, "private": False,
                                           "siblings": [{"rfilename": n} for n in sorted(files)]}, head=head)
            if kind == "tree":
                entries = [self._tree_entry(f) for f in sorted(files.values(), key=lambda f: f.path)]
                start = int(query.get("cursor", ["0"])[0])
                page = entries[start:start + PAGE]
                extra = {}
                if start + PAGE < len(entries):
                    nxt = f"{self.endpoint}/api/models/{repo_id}/tree/{rev}?recursive=True&cursor={start + PAGE}"
                    extra["Link"] = f'<{nxt}>; rel="next"'
                return self._send_json(h, page, extra=extra, head=head)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, rev, path = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
            repo = self.repos.get(repo_id)
            if repo is None:
                return self._error(h, 404, "RepoNotFound", "Repository Not Found", head)
            if not self._authorized(h, repo):
                return self._error(h, 401, "GatedRepo", "Access to this repo is restricted", head)
            commit = self._resolve(repo, rev)
            if commit is None:
                return self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
            f = repo.commits[commit].get(path)
            if f is None:
                return self._error(h, 404, "EntryNotFound", f"{path} does not exist at {rev}", head)
            common = {"X-Repo-Commit": commit}
            if f.lfs:
                h.send_response(302)
                for k, v in {**common, "X-Linked-Etag": f'"{f.sha256}"', "X-Linked-Size": str(f.size),
                             "ETag": f'"{f.git_sha1}"', "Location": f"{self.cdn}/lfs/{f.sha256}",
                             "Content-Length": "0"}.items():
                    h.send_header(k, v)
                h.end_headers()
                return
            return self._serve_bytes(h, f, head, {**common, "ETag": f'"{f.git_sha1}"'})
        return self._error(h, 404, "NotFound", f"no route for {url.path}", head)

    @staticmethod
    def _tree_entry(f: RepoFileData) -> dict:
        e = {"type": "file", "oid": f.git_sha1, "size": f.size if not f.lfs else 134, "path": f.path}
        if f.lfs:
            e["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
        return e

    def _serve_lfs(self, h, sha: str, head: bool):
        for repo in self.repos.values():
            for files in repo.commits.values():
                for f in files.values():
                    if f.lfs and f.sha256 == sha:
                        return self._serve_bytes(h, f, head, {"ETag": f'"{sha}"'})
        return self._error(h, 404, "EntryNotFound", "no such LFS object", head)

    def _serve_bytes(self, h, f: RepoFileData, head: bool, headers: dict):
        if f.path in self.fail_status:
            return self._error(h, self.fail_status[f.path], "InjectedFailure", f"injected failure for {f.path}", head)
        start, status = 0, 200
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes="):
            first = rng[len("bytes="):].split("-")[0]
            start = int(first or 0)
            if start >= f.size:
                h.send_response(416)
                h.send_header("Content-Range", f"bytes */{f.size}")
                h.send_header("Content-Length", "0")
                h.end_headers()
                return
            status = 206
        h.send_response(status)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("Content-Length", str(f.size - start))
        if status == 206:
            h.send_header("Content-Range", f"bytes {start}-{f.size - 1}/{f.size}")
        h.end_headers()
        if head:
            return
        limit = self.drop_after.pop(f.path, None)
        sent = 0
        with open(f.source, "rb") as src:
            src.seek(start)
            while True:
                chunk = src.read(1 << 16 if self.throttle_bps else 1 << 20)
                if not chunk:
                    break
                if self.corrupt.get(f.path) and start + sent + len(chunk) == f.size:
                    chunk = chunk[:-1] + bytes([chunk[-1] ^ 0xFF])  # same size, valid header: only a hash sees it
                if limit is not None and sent + len(chunk) > limit:
                    h.wfile.write(chunk[: max(0, limit - sent)])
                    h.wfile.flush()
                    h.close_connection = True
                    try:
                        h.connection.shutdown(2)
                    except OSError:
                        pass
                    return
                h.wfile.write(chunk)
                sent += len(chunk)
                if self.throttle_bps:
                    import time

                    time.sleep(len(chunk) / self.throttle_bps)
