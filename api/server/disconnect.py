"""Run a response while watching for the client to go away.

Starlette's own StreamingResponse notices a gone client only when a send fails (ASGI 2.4),
which can be a whole step later, and leaves the body generator to the garbage collector.
Here a listener awaits `http.disconnect` beside the work and cancels it at once, and
`on_close` always runs — that is where the request's sequences are aborted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send


async def run_until_disconnect(receive: Receive, work: Callable[[], Awaitable[None]]) -> bool:
    """Run `work`; cancel it if the client disconnects first. True when it completed."""
    completed = False
    async with anyio.create_task_group() as tg:

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        async def run() -> None:
            nonlocal completed
            try:
                await work()
                completed = True
            except OSError:  # the transport closed under a send
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(listen)
        tg.start_soon(run)
    return completed


KEEPALIVE = b": keep-alive\n\n"


class EventStreamResponse(Response):
    """Server-sent events from an async iterator of ready-encoded `data:` frames.

    A stream may be silent for long: a long prompt prefilling behind others, an answer held
    until a tool call's JSON closes. Clients and proxies drop a connection that sends nothing
    for their idle timeout (Codex CLI reconnects and asks again, nginx closes at 60 s), so
    after `keepalive` seconds without a frame a comment line goes out — every SSE parser
    skips comments, so the events a client reads are the same."""

    media_type = "text/event-stream"

    def __init__(
        self, frames: AsyncIterator[bytes], on_close: Callable[[], None], status_code: int = 200,
        keepalive: float = 15.0,
    ) -> None:  # fmt: skip
        self.frames = frames
        self.on_close = on_close
        self.status_code = status_code
        self.keepalive = keepalive
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            last = anyio.current_time()

            async def body(frame: bytes) -> None:
                nonlocal last
                last = anyio.current_time()
                await send({"type": "http.response.body", "body": frame, "more_body": True})

            async def beat() -> None:  # one task: a comment never splits a frame's send
                while True:
                    await anyio.sleep(max(0.0, last + self.keepalive - anyio.current_time()))
                    if anyio.current_time() - last >= self.keepalive:
                        async with lock:
                            await body(KEEPALIVE)

            lock = anyio.Lock()
            async with anyio.create_task_group() as tg:
                tg.start_soon(beat)
                async for frame in self.frames:
                    async with lock:
                        await body(frame)
                tg.cancel_scope.cancel()
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await run_until_disconnect(receive, stream)
        finally:
            self.on_close()
            aclose = getattr(self.frames, "aclose", None)
            if aclose is not None:
                await aclose()
