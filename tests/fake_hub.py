"""A local server speaking the Hugging Face hub's file API (what `huggingface_hub` asks of
HF_ENDPOINT to fetch a file): `HEAD|GET /{repo}/resolve/{revision}/{file}` with the
commit, the SHA-256 ETag and size of a large file, and byte ranges for resuming. It can
break a transfer half-way once, serve bytes that do not match their SHA-256, and records
every request."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Hub:
    repo: str
    files: dict[str, bytes]
    cut_once: set[str] = field(default_factory=set)  # first GET: half the body, then closed
    corrupt: set[str] = field(default_factory=set)  # the bytes served are not the ones hashed
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, file, Range
    url: str = ""

    def gets(self, name: str) -> list[str | None]:
        """The Range header of each GET of `name`."""
        return [r for m, f, r in self.requests if m == "GET" and f == name]


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    prefix = f"/{hub.repo}/resolve/"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # quiet
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _serve(self, body: bool) -> None:
            name = self.path.removeprefix(prefix).split("/", 1)[-1].split("?")[0]
            rng = self.headers.get("Range")
            hub.requests.append(("GET" if body else "HEAD", name, rng))
            data = hub.files.get(name) if self.path.startswith(prefix) else None
            if data is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            sha = hashlib.sha256(data).hexdigest()
            if name in hub.corrupt:
                data = bytes(b ^ 0xFF for b in data)
            start = int(rng.removeprefix("bytes=").split("-")[0]) if rng else 0
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{sha}"')
            self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            if not body:
                return
            if name in hub.cut_once:  # a transfer that breaks half-way
                hub.cut_once.discard(name)
                self.wfile.write(data[start : start + (len(data) - start) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.close()
                return
            self.wfile.write(data[start:])

    return Handler


@contextmanager
def serve(hub: Hub) -> Iterator[Hub]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    hub.url = f"http://127.0.0.1:{srv.server_address[1]}"
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield hub
    finally:
        srv.shutdown()
        srv.server_close()
