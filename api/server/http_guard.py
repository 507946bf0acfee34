"""uvicorn's HTTP/1.1 protocol (httptools), with the bounds a public server needs.

uvicorn holds a connection that never sends a request forever, waits on a request's
headers forever (slowloris), accepts connections until file descriptors run out, and
frames a streamed response to an HTTP/1.0 client with chunked encoding, which HTTP/1.0
does not have. Here:
- a connection must send a request's headers within `header_timeout_s` of opening, of
  starting that request, or of sending anything while no request is in flight (a stray
  CRLF, the rest of a body refused early): else 408, or a close when no request began;
- a request's line and headers are at most `max_header_bytes` (431), counted as the bytes
  arrive (httptools hands a header over only once it is complete);
- at most `max_connections` are open: a new one aborts the connection idle the longest
  (no request in flight), or, when every one is busy, is refused with a 503;
- a response without a length to an HTTP/1.0 client is delimited by closing the
  connection, not by chunks;
- uvicorn's own replies to malformed HTTP carry an OpenAI error body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api.server.limits import ConnectionLimits
from api.server.wire import ENCODER, ErrorBody, ErrorDetail

LINGER_S = 2.0  # after a refusal, unread bytes are dropped this long before closing
_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large",
            503: b"Service Unavailable"}  # fmt: skip


def _error_reply(status: int, message: str, code: str) -> bytes:
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = ENCODER.encode(ErrorBody(ErrorDetail(message, kind, None, code)))
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, _REASONS[status], len(body))
    )
    return head + body


def guarded_protocol(limits: ConnectionLimits) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn's `http=` option, bound to these limits."""

    class Guarded(GuardedHttpProtocol):
        pass

    Guarded.limits = limits
    return Guarded


class GuardedHttpProtocol(HttpToolsProtocol):
    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._header_bytes = 0  # raw bytes received inside the current request's headers
        self._parsed_header_bytes = 0  # its line and headers as parsed
        self._in_headers = False
        self._refused = False
        self._idle_since = time.monotonic()

    # ---- connection ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()
        if self._num_open() > self.limits.max_connections and not self._make_room():
            self._refuse(503, "too many open connections; retry shortly", "too_many_connections")

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    @property
    def is_idle(self) -> bool:
        """No request in flight: between requests, or still sending one's headers."""
        return not self.pipeline and (self.cycle is None or self.cycle.response_complete)

    def _num_open(self) -> int:
        """Connections not already on their way out (a closed transport lingers in the set
        until its buffer drains, which a peer that stopped reading never lets happen)."""
        return sum(not c.transport.is_closing() for c in self.connections)

    def _make_room(self) -> bool:
        """Abort the connection idle the longest; False when every other one is busy."""
        idle = [c for c in self.connections
                if c is not self and isinstance(c, GuardedHttpProtocol)
                and not c.transport.is_closing() and c.is_idle]  # fmt: skip
        if not idle:
            return False
        min(idle, key=lambda c: c._idle_since).transport.abort()  # idle: nothing to lose
        return True

    def _refuse(self, status: int, message: str, code: str) -> None:
        if self._refused:
            return
        self._refused = True
        self._cancel_header_timer()
        if self.transport.is_closing():
            return
        if not self.is_idle:  # never write inside another response's bytes (pipelining)
            self.transport.close()
            return
        # A lingering close: the peer may still be sending (a header that never ends);
        # closing with its bytes unread would reset the connection and lose the reply.
        self.transport.write(_error_reply(status, message, code))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, msg, "invalid_http")

    # ---- header deadline -------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(
            self.limits.header_timeout_s, self._header_timeout
        )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._in_headers:
            self._refuse(408, "the request headers did not arrive in time", "request_timeout")
        elif self.is_idle and not self.transport.is_closing():
            self.transport.close()  # bytes but no request: nothing to answer

    # ---- parser callbacks ------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.is_idle and self._header_timer is None:
            self._arm_header_timer()  # uvicorn just dropped its keep-alive timer
        super().data_received(data)
        if self._in_headers:  # still inside a request's headers: count what they hold
            self._count_header_bytes(len(data))

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        self._header_bytes = 0
        self._parsed_header_bytes = 0
        self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        self._parsed_header_bytes += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._parsed_header_bytes += len(name) + len(value) + 4
        self._count_header_bytes(0)  # headers that came whole in one read
        super().on_header(name, value)

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if max(self._header_bytes, self._parsed_header_bytes) > self.limits.max_header_bytes:
            self._refuse(
                431, f"request headers over {self.limits.max_header_bytes} bytes",
                "headers_too_large",
            )  # fmt: skip

    def on_headers_complete(self) -> None:
        if self._refused:
            return
        self._in_headers = False
        self._cancel_header_timer()
        super().on_headers_complete()
        if self.scope.get("http_version") == "1.0" and self.cycle is not None:
            _close_delimited(self.cycle)

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            super().on_message_complete()

    def on_response_complete(self) -> None:
        self._idle_since = time.monotonic()
        super().on_response_complete()


def _close_delimited(cycle: Any) -> None:
    """Frame this HTTP/1.0 response's body by closing the connection when it has no
    Content-Length: uvicorn would send chunks, which an HTTP/1.0 client shows as garbage.
    (uvicorn already closes HTTP/1.0 connections after the response.)"""
    send: Callable[[Any], Awaitable[None]] = cycle.send
    unbounded = 1 << 62

    async def send_close_delimited(message: Any) -> None:
        if message["type"] == "http.response.start":
            names = {name.lower() for name, _ in message.get("headers", [])}
            if b"content-length" not in names and b"transfer-encoding" not in names:
                cycle.chunked_encoding = False
                cycle.expected_content_length = unbounded
        elif cycle.expected_content_length >= unbounded // 2 and not message.get(
            "more_body", False
        ):
            cycle.expected_content_length = len(message.get("body", b""))
        await send(message)

    cycle.send = send_close_delimited
