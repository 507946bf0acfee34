"""End to end: SIGTERM drains in a way clients can see — 503s while the socket stays
open, running requests finish, and those the drain window cuts short end with an error
event and `[DONE]`, never a cut connection."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.server_proc import Server, start_server
from tests.bystander import ENGINE_THREADS, Bystander, Conn, error_of
from tests.conftest import MODEL

pytestmark = pytest.mark.e2e


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for srv in started:
        srv.stop()


def _start(started: list[Server], tmp_path: Path, drain_s: int) -> Server:
    args = [*ENGINE_THREADS, "--n-ctx", "4096", "--n-seq-max", "4", "--drain-seconds", str(drain_s)]
    srv = start_server(args, tmp_path / f"server-{len(started)}.log")
    started.append(srv)
    return srv


def test_sigterm_answers_503_while_running_streams_finish(
    make_server: list[Server], tmp_path: Path
) -> None:
    srv = _start(make_server, tmp_path, 60)
    watcher = Bystander(srv, max_tokens=96)
    watcher.alone()
    with Conn(srv) as conn:
        status, _ = conn.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 1})
        assert status == 200

        def bad() -> None:
            srv.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while httpx.get(srv.url + "/health", timeout=5).status_code == 200:
                assert time.monotonic() < deadline, "/health never turned 503"
                time.sleep(0.02)  # polling a condition, bounded by the deadline
            # the socket is still open: a new request is told to go elsewhere
            hi = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            r = httpx.post(srv.base_url + "/chat/completions", json=hi)
            err = error_of(r.status_code, r.json(), 503)
            assert err["type"] == "server_error"
            err = error_of(*conn.post("/v1/completions", {"model": MODEL, "prompt": "a"}), 503)

        watcher.beside(bad)  # the running stream completed, identical, without a long pause
        assert srv.proc.wait(60) in (0, -signal.SIGTERM)
        assert "Traceback" not in srv.log()


def test_streams_the_drain_window_cuts_end_with_an_error_event_and_done(
    make_server: list[Server], tmp_path: Path
) -> None:
    srv = _start(make_server, tmp_path, 1)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a long story."}],
            "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip

    async def main() -> tuple[list[bytes], bytes]:
        async with httpx.AsyncClient(timeout=120) as h:
            plain = asyncio.ensure_future(h.post(
                srv.base_url + "/completions",
                json={"model": MODEL, "prompt": "Once", "max_tokens": 2000, "ignore_eos": True},
            ))  # fmt: skip
            frames: list[bytes] = []
            async with h.stream("POST", srv.base_url + "/chat/completions", json=body) as r:
                assert r.status_code == 200
                buf = b""
                async for chunk in r.aiter_bytes():
                    if not frames and not buf:
                        srv.proc.send_signal(signal.SIGTERM)
                    buf += chunk
                    *done, buf = buf.split(b"\n\n")
                    frames += done
            resp = await plain
            assert resp.status_code == 503, resp.text
            return frames, resp.content

    frames, plain_body = asyncio.run(main())
    assert frames[-1] == b"data: [DONE]"
    err = json.loads(frames[-2][len(b"data: ") :])["error"]
    assert err["type"] == "server_error" and "shut down" in err["message"]
    assert len(frames) > 3  # tokens streamed before the window closed
    assert json.loads(plain_body)["error"]["code"] == "unavailable"
    assert srv.proc.wait(60) in (0, -signal.SIGTERM)
