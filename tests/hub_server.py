"""A stand-in for the Hugging Face Hub (no hub is reachable here): the endpoints huggingface_hub calls,
served from a thread, for HF_ENDPOINT (or the `endpoint` colichat.models.hub takes).

    with HubServer({"test/tiny-GGUF": {"tiny-Q4_K_M.gguf": Path or bytes}}, gated={"test/closed"}) as hub:
        hub.url                       # http://127.0.0.1:PORT
        hub.requests                  # [(method, repo path or API path, Range header or None)], in order
        hub.cut["test/tiny-GGUF/tiny-Q4_K_M.gguf"] = n   # its next full GET ends (connection closed) after n bytes
        hub.announce["test/tiny-GGUF/tiny-Q4_K_M.gguf"] = n  # every GET of it: 200, n bytes announced, its
                                                           # bytes sent, the connection closed
        hub.portal = True             # every answer a captive portal's page (200, HTML)

    with SilentServer() as url: ...   # accepts connections, never answers

    GET  /api/models/OWNER/REPO/tree/REV?recursive=..  [{"type": "file", "path", "size", "oid", "lfs"}]
    HEAD /OWNER/REPO/resolve/REV/PATH                  200: X-Repo-Commit, ETag (the sha256), Content-Length
    GET  /OWNER/REPO/resolve/REV/PATH                  the file; with Range: bytes=A-[B], 206 and Content-Range
An unknown repository is 404 RepoNotFound (X-Error-Code), a file not in it 404 EntryNotFound, a file of a
gated repository 403 GatedRepo, as the hub answers (huggingface_hub's hf_raise_for_status reads them).
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TREE_RE = re.compile(r"^/api/models/([^/]+/[^/]+)/tree/[^/]+/?$")
RESOLVE_RE = re.compile(r"^/([^/]+/[^/]+)/resolve/[^/]+/(.+)$")
RANGE_RE = re.compile(r"^bytes=(\d+)-(\d*)$")


class HubServer:
    def __init__(self, repos: dict, gated=()):
        self.repos = {repo: {p: (Path(f).read_bytes() if isinstance(f, (str, Path)) else f) for p, f in files.items()}
                      for repo, files in repos.items()}
        self.gated = set(gated)
        self.requests: list[tuple[str, str, str | None]] = []
        self.cut: dict[str, int] = {}
        self.announce: dict[str, int] = {}
        self.portal = False

    def __enter__(self) -> HubServer:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def full_gets(self, path: str) -> int:
        """GETs of `path` (OWNER/REPO/FILE) from the start of the file: downloads, not a header's range."""
        return sum(1 for m, p, r in self.requests if m == "GET" and p == path and (r is None or r.startswith("bytes=0-")
                                                                                 and r.endswith("-")))


def _handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            self._answer(body=True)

        def do_HEAD(self):
            self._answer(body=False)

        def _error(self, status: int, code: str, repo: str | None = None) -> None:
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", code)
            if repo in hub.repos:
                self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            tree, resolve = TREE_RE.match(path), RESOLVE_RE.match(path)
            rng = self.headers.get("Range")
            if resolve:
                hub.requests.append((self.command, f"{resolve[1]}/{resolve[2]}", rng))
            else:
                hub.requests.append((self.command, path, rng))
            if hub.portal:
                page = b"<html><body>Sign in to the network to continue</body></html>"
                return self._send(200, page, {"Content-Type": "text/html"}, body)
            repo = (tree or resolve)[1] if (tree or resolve) else None
            if repo not in hub.repos:
                return self._error(404, "RepoNotFound")
            files = hub.repos[repo]
            if tree:
                listing = [{"type": "file", "path": p, "size": len(b), "oid": hashlib.sha1(b).hexdigest(),
                            "lfs": {"oid": hashlib.sha256(b).hexdigest(), "size": len(b), "pointerSize": 134}}
                           for p, b in files.items()]
                return self._send(200, json.dumps(listing).encode(), {"Content-Type": "application/json"}, body)
            if repo in hub.gated:
                return self._error(403, "GatedRepo", repo)
            data = files.get(resolve[2])
            if data is None:
                return self._error(404, "EntryNotFound", repo)
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
            if body and f"{repo}/{resolve[2]}" in hub.announce:
                return self._send_cut(data, headers, len(data), hub.announce[f"{repo}/{resolve[2]}"])
            m = RANGE_RE.match(rng) if rng else None
            if m and int(m[1]) >= len(data):
                return self._error(416, "RangeNotSatisfiable", repo)
            if m:
                a, b = int(m[1]), min(len(data) - 1, int(m[2]) if m[2] else len(data) - 1)
                headers["Content-Range"] = f"bytes {a}-{b}/{len(data)}"
                return self._send(206, data[a : b + 1], headers, body)
            key = f"{repo}/{resolve[2]}"
            if body and key in hub.cut:
                return self._send_cut(data, headers, hub.cut.pop(key))
            self._send(200, data, headers, body)

        def _send(self, status: int, data: bytes, headers: dict, body: bool) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if body:
                self.wfile.write(data)

        def _send_cut(self, data: bytes, headers: dict, n: int, announced: int | None = None) -> None:
            """The whole file announced (or `announced` bytes), `n` bytes of it sent, then the connection
            closed: a dropped download."""
            self.send_response(200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data) if announced is None else announced))
            self.end_headers()
            self.wfile.write(data[:n])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)

    return Handler


class SilentServer:
    """A server on loopback that accepts every connection, reads what is sent, and never answers."""

    def __enter__(self) -> str:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.held: list[socket.socket] = []
        self.running = True
        threading.Thread(target=self._accept, daemon=True).start()
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.sock.close()
        for conn in self.held:
            conn.close()
