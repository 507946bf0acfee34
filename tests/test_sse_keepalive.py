"""A silent stream keeps its connection: a comment line after the keep-alive interval.

Clients with an idle timeout (Codex CLI's, a proxy's) drop a stream that sends nothing
while a long prompt prefills; an SSE comment is skipped by every parser, so it keeps the
connection without changing the events a client reads.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from api.server.disconnect import KEEPALIVE, EventStreamResponse

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def never_disconnects() -> dict[str, Any]:
    await anyio.sleep_forever()
    raise AssertionError


async def run(frames: AsyncIterator[bytes], keepalive: float, sent: list[bytes],
              on_body: Any = None) -> list[str]:  # fmt: skip
    closed: list[str] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append(message["body"])
            if on_body is not None:
                on_body(message["body"])

    response = EventStreamResponse(frames, on_close=lambda: closed.append("closed"),
                                   keepalive=keepalive)  # fmt: skip
    with anyio.fail_after(10):
        await response({"type": "http"}, never_disconnects, send)
    return closed


async def test_a_silent_stream_sends_comments_until_its_next_event() -> None:
    """The generator waits for a keep-alive to have gone out before its second event: the
    stream completes only if one did, and the events around it arrive whole and in order."""
    kept = anyio.Event()

    async def frames() -> AsyncIterator[bytes]:
        yield b"data: 1\n\n"
        await kept.wait()
        yield b"data: 2\n\n"

    sent: list[bytes] = []
    closed = await run(frames(), 0.05, sent, lambda b: b == KEEPALIVE and kept.set())
    assert sent[0] == b"data: 1\n\n"
    assert sent[-2:] == [b"data: 2\n\n", b""]
    middle = sent[1:-2]
    assert middle and all(b == KEEPALIVE for b in middle)
    assert KEEPALIVE.startswith(b":") and KEEPALIVE.endswith(b"\n\n")  # a comment, whole
    assert closed == ["closed"]


async def test_a_stream_that_keeps_talking_sends_no_comments() -> None:
    async def frames() -> AsyncIterator[bytes]:
        for i in range(50):
            yield f"data: {i}\n\n".encode()

    sent: list[bytes] = []
    await run(frames(), 60.0, sent)
    assert KEEPALIVE not in sent
    assert sent == [f"data: {i}\n\n".encode() for i in range(50)] + [b""]
