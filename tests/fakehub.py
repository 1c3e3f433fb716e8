"""A small Hugging Face Hub on loopback, serving the endpoints huggingface_hub and tunepack call.

- ``GET /api/{models,datasets}/<repo>[/revision/<rev>]``: repository info (``sha``, ``gated``);
- ``GET /api/{models,datasets}/<repo>/tree/<rev>[/<path>]``: the recursive file listing with
  sizes, git blob ids and LFS sha256, as ``list_repo_tree`` and ``snapshot_download`` read it;
- ``HEAD``/``GET /[datasets/]<repo>/resolve/<rev>/<path>``: file bytes with ``ETag``,
  ``X-Repo-Commit``, ``X-Linked-Etag``/``X-Linked-Size`` (LFS) and byte ranges.

Uploads, as ``create_repo`` and ``create_commit`` (LFS "basic" transfer; run the client with
``HF_HUB_DISABLE_XET=1``) make them:

- ``POST /api/repos/create``: a new repository (private when ``visibility`` says so), 409 with its
  ``url`` when it exists;
- ``POST /api/models/<repo>/preupload/<rev>``: the upload mode of each file (LFS for weights and
  files over 10 MB) and the ``oid`` of the file already there;
- ``POST /<repo>.git/info/lfs/objects/batch``: an upload action per object the LFS store lacks,
  none for those it has (so a re-run after a kill sends nothing twice);
- ``PUT /lfs-upload/<oid>``: the object's bytes, refused unless their sha256 is the oid;
- ``POST /api/models/<repo>/commit/<rev>``: the NDJSON commit (regular files inline, LFS files by
  oid, deletions), applied all at once; 400 when it names an LFS object never uploaded.

Writes need a token in ``write_tokens`` (a read token gets 403). Tests may hold the next LFS
upload (``hold_uploads``) to kill the client mid-transfer, refuse the next ones
(``upload_errors``), and read ``commits``.

Access rules follow the real hub: a gated repository lists publicly but its files need a token
(401 ``GatedRepo`` without one), an unknown or private repository is 401 ``RepoNotFound`` without
a token and 404 with one, an unknown revision is 404 ``RevisionNotFound``, and a malformed token
is 401 "Invalid credentials in Authorization header". Tests can corrupt a file's bytes, hold it
part-way, or make its next requests fail with 503 (with a Retry-After if set), and read the
request log.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".parquet", ".arrow", ".bin", ".model")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    repo_id: str
    files: dict[str, bytes]
    repo_type: str = "model"
    gated: bool = False
    private: bool = False
    # Bytes served instead of a file's real content (its metadata still describes the real one).
    corrupt: dict[str, bytes] = field(default_factory=dict)
    # path -> offset in a response's body where serving stops until the test removes the entry: a
    # download that is mid-file for certain, however fast or slow the machine.
    hold_at: dict[str, int] = field(default_factory=dict)
    fail: dict[str, int] = field(default_factory=dict)  # path -> number of 503s still to answer
    retry_after: str | None = None  # the Retry-After header of those 503s, when set

    @property
    def commit(self) -> str:
        digest = hashlib.sha1(self.repo_id.encode())
        for path in sorted(self.files):
            digest.update(path.encode() + b"\0" + self.files[path])
        return digest.hexdigest()

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    def entry(self, path: str) -> dict:
        data = self.files[path]
        item = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": path}
        if self.is_lfs(path):
            item["lfs"] = {
                "oid": hashlib.sha256(data).hexdigest(),
                "size": len(data),
                "pointerSize": 134,
            }
        return item


class FakeHub:
    def __init__(
        self, tokens: tuple[str, ...] = (), write_tokens: tuple[str, ...] = (), port: int = 0
    ):
        self.repos: dict[tuple[str, str], Repo] = {}
        self.write_tokens = set(write_tokens)
        self.tokens = set(tokens) | self.write_tokens
        self.requests: list[dict] = []
        self.lfs: dict[str, bytes] = {}  # the LFS store: sha256 -> bytes
        self.commits: list[dict] = []  # one record per commit made through the API
        self.hold_uploads = threading.Event()  # set: LFS uploads are received, then held
        self.upload_held = threading.Event()  # set when an upload is being held
        self.upload_errors: list[int] = []  # statuses the next LFS uploads are answered with
        self._lock = threading.Lock()
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def add(self, repo: Repo) -> Repo:
        self.repos[(repo.repo_type, repo.repo_id)] = repo
        return repo

    def start(self) -> FakeHub:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def log(self, **entry) -> None:
        with self._lock:
            self.requests.append(entry)

    def gets(self, path: str) -> list[dict]:
        """The GET requests for one file (by repo path)."""
        return [r for r in self.requests if r["method"] == "GET" and r.get("file") == path]


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - quiet test output
        pass

    def do_GET(self):
        self._route(head=False)

    def do_HEAD(self):
        self._route(head=True)

    def do_POST(self):
        self._write("POST")

    def do_PUT(self):
        self._write("PUT")

    # --- uploads ----------------------------------------------------------------------------

    def _write(self, method: str) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
        self.hub.log(method=method, path=url.path, token=token, size=len(body))
        if method == "PUT" and parts[0] == "lfs-upload" and len(parts) == 2:
            return self._lfs_put(parts[1], body)
        if token is None or token not in self.hub.tokens:
            return self._error(401, None, "Invalid credentials in Authorization header")
        if token not in self.hub.write_tokens:
            return self._error(403, None, "You don't have the rights to write to this namespace")
        if parts == ["api", "repos", "create"]:
            return self._create(json.loads(body))
        if (
            len(parts) == 6
            and parts[:2] == ["api", "models"]
            and parts[4] in ("preupload", "commit")
        ):
            repo = self.hub.repos.get(("model", f"{parts[2]}/{parts[3]}"))
            if repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            if parts[5] != "main":
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {parts[5]}")
            if parts[4] == "preupload":
                return self._preupload(repo, json.loads(body))
            return self._commit(repo, body)
        if (
            len(parts) == 6
            and parts[1].endswith(".git")
            and parts[2:] == ["info", "lfs", "objects", "batch"]
        ):
            return self._batch(json.loads(body))
        self._error(404, None, "not found")

    def _create(self, payload: dict) -> None:
        repo_id = f"{payload['organization']}/{payload['name']}"
        url = f"{self.hub.url}/{repo_id}"
        if ("model", repo_id) in self.hub.repos:
            return self._json({"error": "You already created this model repo", "url": url}, 409)
        private = payload.get("visibility") == "private" or payload.get("private") is True
        self.hub.add(Repo(repo_id, {}, private=private))
        self._json({"url": url})

    def _preupload(self, repo: Repo, payload: dict) -> None:
        answers = []
        for item in payload["files"]:
            path, size = item["path"], item["size"]
            lfs = repo.is_lfs(path) or size > 10 * 1024 * 1024
            oid = None
            if path in repo.files:
                entry = repo.entry(path)
                oid = entry["lfs"]["oid"] if "lfs" in entry else entry["oid"]
            answers.append(
                {
                    "path": path,
                    "uploadMode": "lfs" if lfs else "regular",
                    "shouldIgnore": False,
                    "oid": oid,
                }
            )
        self._json({"files": answers})

    def _batch(self, payload: dict) -> None:
        objects = []
        for obj in payload["objects"]:
            answer = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.hub.lfs:
                href = f"{self.hub.url}/lfs-upload/{obj['oid']}"
                answer["actions"] = {"upload": {"href": href, "header": {}}}
            objects.append(answer)
        self._json({"transfer": "basic", "objects": objects})

    def _lfs_put(self, oid: str, body: bytes) -> None:
        if self.hub.upload_errors:
            return self._error(self.hub.upload_errors.pop(0), None, "upload refused")
        if self.hub.hold_uploads.is_set():
            self.hub.upload_held.set()
            while self.hub.hold_uploads.is_set():  # until the test lets go (or kills the client)
                time.sleep(0.05)
        if hashlib.sha256(body).hexdigest() != oid:
            return self._error(400, None, "the uploaded bytes do not match the oid")
        self.hub.lfs[oid] = body
        self._json({})

    def _commit(self, repo: Repo, body: bytes) -> None:
        files = dict(repo.files)
        header = {}
        for line in body.decode().splitlines():
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                header = value
            elif key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value["oid"] not in self.hub.lfs:
                    return self._error(400, None, f"LFS object {value['oid']} was not uploaded")
                files[value["path"]] = self.hub.lfs[value["oid"]]
            elif key == "deletedFile":
                files.pop(value["path"], None)
            else:
                return self._error(400, None, f"unknown commit line {key!r}")
        repo.files = files
        self.hub.commits.append({"repo": repo.repo_id, "summary": header.get("summary")})
        self._json(
            {
                "commitUrl": f"{self.hub.url}/{repo.repo_id}/commit/{repo.commit}",
                "commitOid": repo.commit,
                "pullRequestUrl": None,
            }
        )

    # --- routing ----------------------------------------------------------------------------

    def _route(self, head: bool) -> None:
        url = urlsplit(self.path)
        parts = [unquote(p) for p in url.path.strip("/").split("/")]
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip() if auth.startswith("Bearer ") else None
        entry = {
            "method": "HEAD" if head else "GET",
            "path": url.path,
            "token": token,
            "range": self.headers.get("Range"),
        }
        if parts[0] == "api" and len(parts) >= 4 and parts[1] in ("models", "datasets"):
            repo_type = parts[1][:-1]
            repo_key = (repo_type, f"{parts[2]}/{parts[3]}")
            rest = parts[4:]
            self.hub.log(**entry)
            repo = self._access(repo_key, token, listing=True)
            if repo is None:
                return
            if not rest or rest[0] == "revision":
                rev = rest[1] if len(rest) > 1 else "main"
                if self._revision(repo, rev):
                    self._json(self._info(repo))
                return
            if rest[0] == "tree" and len(rest) >= 2:
                if self._revision(repo, rest[1]):
                    prefix = "/".join(rest[2:])
                    recursive = parse_qs(url.query).get("recursive", ["false"])[0] == "true"
                    self._json(self._tree(repo, prefix, recursive))
                return
            return self._error(404, "EntryNotFound", "no such endpoint")
        repo_type = "model"
        if parts[0] == "datasets":
            repo_type, parts = "dataset", parts[1:]
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_key = (repo_type, f"{parts[0]}/{parts[1]}")
            path = "/".join(parts[4:])
            self.hub.log(**entry, file=path)
            repo = self._access(repo_key, token, listing=False)
            if repo is not None and self._revision(repo, parts[3]):
                self._file(repo, path, head)
            return
        self.hub.log(**entry)
        self._error(404, None, "not found")

    def _access(self, key: tuple[str, str], token: str | None, listing: bool) -> Repo | None:
        if token is not None and token not in self.hub.tokens:
            self._error(401, None, "Invalid credentials in Authorization header")
            return None
        repo = self.hub.repos.get(key)
        if repo is None or (repo.private and token is None):
            self._error(401 if token is None else 404, "RepoNotFound", "Repository not found")
            return None
        if repo.gated and token is None and not listing:
            self._error(401, "GatedRepo", f"Access to {key[0]} {key[1]} is restricted.")
            return None
        return repo

    def _revision(self, repo: Repo, rev: str) -> bool:
        if rev in ("main", repo.commit):
            return True
        self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return False

    # --- answers ----------------------------------------------------------------------------

    def _info(self, repo: Repo) -> dict:
        return {
            "id": repo.repo_id,
            "sha": repo.commit,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "siblings": [{"rfilename": p} for p in sorted(repo.files)],
        }

    def _tree(self, repo: Repo, prefix: str, recursive: bool) -> list[dict]:
        base = prefix + "/" if prefix else ""
        out, dirs = [], set()
        for path in sorted(repo.files):
            if not path.startswith(base):
                continue
            rel = path[len(base) :]
            if "/" in rel and not recursive:
                dirs.add(base + rel.split("/")[0])
                continue
            for i in range(1, rel.count("/") + 1):
                dirs.add(base + "/".join(rel.split("/")[:i]))
            out.append(repo.entry(path))
        folders = [{"type": "directory", "oid": "0" * 40, "path": d} for d in sorted(dirs)]
        return folders + out

    def _file(self, repo: Repo, path: str, head: bool) -> None:
        if path not in repo.files:
            return self._error(404, "EntryNotFound", f"{path} does not exist")
        if repo.fail.get(path, 0) > 0 and not head:
            repo.fail[path] -= 1
            extra = {"Retry-After": repo.retry_after} if repo.retry_after is not None else {}
            return self._error(503, None, "Service Unavailable", extra)
        data = repo.corrupt.get(path, repo.files[path])
        meta = repo.entry(path)
        etag = meta["lfs"]["oid"] if "lfs" in meta else meta["oid"]
        start = 0
        range_header = self.headers.get("Range", "")
        if range_header.startswith("bytes="):
            first, _, last = range_header[6:].partition("-")
            start = int(first)
            end = int(last) + 1 if last else len(data)
            body = data[start:end]
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{start + len(body) - 1}/{len(data)}")
        else:
            body = data
            self.send_response(200)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", repo.commit)
        if "lfs" in meta:
            self.send_header("X-Linked-Etag", f'"{etag}"')
            self.send_header("X-Linked-Size", str(len(repo.files[path])))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if head:
            return
        step = 16 * 1024
        try:
            for offset in range(0, len(body), step):
                if offset >= repo.hold_at.get(path, len(body)):
                    self.wfile.flush()
                    while path in repo.hold_at:  # until the test lets go (or kills the client)
                        time.sleep(0.05)
                self.wfile.write(body[offset : offset + step])
        except (BrokenPipeError, ConnectionResetError):
            pass

    def _json(self, data: object, status: int = 200) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(
        self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None
    ) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def main(argv: list[str] | None = None) -> None:
    """``python -m tests.fakehub --port 8900 --token hf_xxx``: the fake hub on loopback, for trying
    an ``hf://`` export by hand (docs/export.md); Ctrl-C stops it."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.fakehub", description=main.__doc__)
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--token", required=True, help="a token with write access")
    args = parser.parse_args(argv)
    hub = FakeHub(write_tokens=(args.token,), port=args.port)
    print(f"fake hub at {hub.url} (HF_ENDPOINT={hub.url})", flush=True)
    try:
        hub.server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
