"""A local stand-in for the Hugging Face Hub's model download API (no hub is reachable here): enough of it for
huggingface_hub's own auth_check, model_info, snapshot_download and transformers' from_pretrained.

It serves one folder per repository, answers like the Hub does (2.3.0's `hf_raise_for_status` reads X-Error-Code:
RepoNotFound, GatedRepo; `get_hf_file_metadata` reads X-Repo-Commit, ETag / X-Linked-Etag, X-Linked-Size), and
`slow` seconds per 64 KB make a download last long enough to show progress.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

SHA = "0123456789abcdef0123456789abcdef01234567"
CHUNK = 64 * 1024


def _blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubStandIn:
    def __init__(self, repos: dict[str, Path], gated: tuple[str, ...] = (), slow: float = 0.0):
        self.repos, self.gated, self.slow = repos, gated, slow
        self.requests: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str) -> dict[str, bytes]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
                self.send_response(status)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header(
                    "Content-Length",
                    str(len(body)) if not (headers or {}).get("Content-Length") else headers["Content-Length"],
                )
                self.end_headers()
                if not head and body:
                    for i in range(0, len(body), CHUNK):
                        self.wfile.write(body[i : i + CHUNK])
                        if hub.slow:
                            time.sleep(hub.slow)

            def _json(self, obj, status=200):
                self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json"})

            def _error(self, status: int, code: str, message: str):
                self._send(
                    status,
                    json.dumps({"error": message}).encode(),
                    {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message},
                )

            def _repo(self, parts: list[str]):
                repo = "/".join(parts[:2])
                if repo not in hub.repos and repo not in hub.gated:
                    self._error(404, "RepoNotFound", f"Repository Not Found for url: {self.path}.")
                    return None
                if repo in hub.gated:
                    self._error(
                        403,
                        "GatedRepo",
                        f"Access to model {repo} is restricted. You must have access to it "
                        "and be authenticated to access it. Please log in.",
                    )
                    return None
                return repo

            def _entry(self, name: str, data: bytes) -> dict:
                entry = {"type": "file", "path": name, "size": len(data), "oid": _blob(data)}
                if name.endswith(".safetensors"):
                    entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
                return entry

            def do_GET(self, head: bool = False):
                hub.requests.append(f"{'HEAD' if head else 'GET'} {self.path}")
                path = unquote(urlparse(self.path).path)
                parts = [p for p in path.split("/") if p]
                if parts[:2] == ["api", "models"]:
                    repo = self._repo(parts[2:])
                    if repo is None:
                        return
                    rest = parts[4:]
                    if rest[:1] == ["auth-check"]:
                        return self._json({})
                    files = hub.files(repo)
                    if rest[:1] == ["revision"] or not rest:
                        siblings = []
                        for name, data in files.items():
                            e = self._entry(name, data)
                            s = {"rfilename": name, "size": e["size"], "blobId": e["oid"]}
                            if "lfs" in e:
                                s["lfs"] = {"size": e["size"], "sha256": e["lfs"]["oid"], "pointerSize": 134}
                            siblings.append(s)
                        return self._json(
                            {"id": repo, "modelId": repo, "sha": SHA, "private": False, "siblings": siblings}
                        )
                    if rest[:1] == ["tree"]:
                        return self._json([self._entry(n, d) for n, d in files.items()])
                    return self._error(404, "EntryNotFound", "no such API")
                # /{org}/{name}/resolve/{revision}/{file}
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo = self._repo(parts)
                    if repo is None:
                        return
                    name = "/".join(parts[4:])
                    data = hub.files(repo).get(name)
                    if data is None:
                        return self._error(404, "EntryNotFound", f"{name} not found")
                    e = self._entry(name, data)
                    etag = e["lfs"]["oid"] if "lfs" in e else e["oid"]
                    headers = {
                        "X-Repo-Commit": SHA,
                        "ETag": f'"{etag}"',
                        "Content-Length": str(len(data)),
                        "Content-Type": "application/octet-stream",
                    }
                    if "lfs" in e:
                        headers.update({"X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
                    return self._send(200, data, headers, head=head)
                self._error(404, "EntryNotFound", "no such path")

            def do_HEAD(self):
                self.do_GET(head=True)

        return Handler
