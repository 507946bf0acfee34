"""End to end: connections are bounded — in number, in how long they may sit idle or take
to send headers, in header size — and HTTP/1.0 clients get streams they can read."""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.server_proc import Server, free_port, start_process
from tests.bystander import ENGINE_THREADS, TIGHT_STALL, TIGHT_STALL_MS, Bystander, Conn
from tests.conftest import MODEL

pytestmark = pytest.mark.e2e
FD_LIMIT = 256  # the server's file descriptors: fewer than the connections a test opens


@pytest.fixture(scope="module")
def tight(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with few file descriptors (default --max-connections: it caps itself below
    the limit), the default header timeout (10 s) and a short keep-alive timeout. Its stall
    target is the bystander's tight one: the HTTP/1.0 request is served beside the stream."""
    port = free_port()
    cmd = ["prlimit", f"--nofile={FD_LIMIT}:{FD_LIMIT}", sys.executable, "-m", "api.server.cli",
           "serve", "--port", str(port), *ENGINE_THREADS, *TIGHT_STALL, "--n-ctx", "4096",
           "--n-seq-max", "4", "--keep-alive-timeout", "1"]  # fmt: skip
    srv = start_process(cmd, port, tmp_path_factory.mktemp("tight") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def watcher(tight: Server) -> Bystander:
    return Bystander(tight, stall_s=TIGHT_STALL_MS / 1000)


def _read_all(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything until the server closes the connection (or the timeout)."""
    s.settimeout(timeout_s)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def test_idle_connections_make_way_and_health_still_answers(
    tight: Server, watcher: Bystander
) -> None:
    """More idle connections than the server has file descriptors: the longest idle are
    closed to make room, so a health check (and the stream) still get through."""
    n_idle = 2 * FD_LIMIT

    def bad() -> None:
        idle = [socket.create_connection(("127.0.0.1", tight.port)) for _ in range(n_idle)]
        try:
            for _ in range(5):
                assert httpx.get(tight.url + "/health", timeout=5).status_code == 200
            closed = 0
            for s in idle[: n_idle - FD_LIMIT]:  # the oldest were closed to make room
                s.settimeout(1)
                with contextlib.suppress(TimeoutError):
                    closed += s.recv(1) == b""
            assert closed == n_idle - FD_LIMIT
        finally:
            for s in idle:
                s.close()
        with Conn(tight) as conn:
            conn.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1})
            conn.assert_still_serves()

    watcher.beside(bad)


def test_slow_or_silent_clients_are_timed_out(tight: Server, watcher: Bystander) -> None:
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"

    def bad() -> None:
        with socket.create_connection(("127.0.0.1", tight.port)) as silent, \
                socket.create_connection(("127.0.0.1", tight.port)) as slow, \
                socket.create_connection(("127.0.0.1", tight.port)) as stray:  # fmt: skip
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-")
            stray.sendall(health)
            stray.settimeout(10)
            got = b""
            while not got.endswith(b'{"status":"ok"}'):  # the whole response, then idle
                got += stray.recv(65536)
            assert got.startswith(b"HTTP/1.1 200")
            stray.sendall(b"\r\n")  # bytes, but no request: the keep-alive timer is gone
            reply = _read_all(slow, 30)  # headers never finish: 408 after --header-timeout
            assert reply.startswith(b"HTTP/1.1 408")
            err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
            assert err["code"] == "request_timeout"
            assert _read_all(silent, 30) == b""  # never sent a byte: closed, nothing to say
            assert _read_all(stray, 30) == b""
        with socket.create_connection(("127.0.0.1", tight.port)) as big:
            t0 = time.monotonic()  # one header that never ends: refused as it grows
            big.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000)
            assert _read_all(big, 30).startswith(b"HTTP/1.1 431")
            assert time.monotonic() - t0 < 5  # not at the header timeout
        with Conn(tight) as conn:
            conn.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1})
            conn.assert_still_serves()
            t0 = time.monotonic()
            assert conn.sock is not None
            conn.sock.settimeout(10)
            assert conn.sock.recv(1) == b""  # idle keep-alive: closed after --keep-alive-timeout
            assert time.monotonic() - t0 < 5

    watcher.beside(bad)


def test_http_1_0_streams_are_not_chunked(tight: Server, watcher: Bystander) -> None:
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8,
                       "temperature": 0, "stream": True}).encode()  # fmt: skip

    def bad() -> None:
        with socket.create_connection(("127.0.0.1", tight.port)) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            reply = _read_all(s, 60)
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        headers = head.lower()
        assert b"transfer-encoding" not in headers and b"connection: close" in headers
        frames = [f for f in payload.split(b"\n\n") if f]
        assert frames[-1] == b"data: [DONE]"
        texts = [json.loads(f[len(b"data: ") :])["choices"] for f in frames[:-1]]
        assert "".join(c[0]["text"] for c in texts if c)  # plain SSE frames, readable

    watcher.beside(bad)
