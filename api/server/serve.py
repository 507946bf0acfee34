"""Run the app under uvicorn with a shutdown clients can see.

uvicorn answers SIGTERM by closing its listening socket first, so during the drain new
requests got "connection refused", never the 503 that would send them elsewhere; and its
grace period cut running streams mid-token. Here the first SIGTERM (or SIGINT) only
starts the drain: /health turns 503 and new requests get a 503 OpenAI error while the
socket stays open; running requests finish for up to `--drain-seconds`; those still
running then get an error event and `[DONE]` (a 503 body when not streaming); only then
does uvicorn close the socket and exit. A second signal ends everything at once, as
cleanly. A signal while the model still loads abandons the load at its next tensor and
exits as a stop does, not as a failed load (a mapped file is first read in whole, which
a signal does not cut short: engine.load_progress).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import resource
import socket
import sys
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from api.server.http_guard import guarded_protocol
from api.server.state import ServerSettings, ServerState

log = logging.getLogger(__name__)
FLUSH_S = 5  # after the drain: how long uvicorn waits for the ended streams to flush


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: Starlette, drain_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.drain_s = drain_s
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._signals = 0  # counted in the handler itself: a second one may come first
        self._drain: asyncio.Future[None] | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._aloop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state: ServerState | None = getattr(self.app.state, "server", None)
        if state is None or self._aloop is None:  # not serving yet: nothing to drain
            self.app.state.loading.cancel()  # a load in progress stops at its next tensor
            super().handle_exit(sig, frame)
            return
        self._signals += 1
        if self._signals == 1:
            self._aloop.call_soon_threadsafe(self._start_drain, state, sig)
        else:  # a second signal: end every request now, then exit
            self._aloop.call_soon_threadsafe(self._end_now, state, sig)

    def _start_drain(self, state: ServerState, sig: int) -> None:
        state.draining = True
        self._drain = asyncio.ensure_future(self._drain_then_exit(state, sig))

    async def _drain_then_exit(self, state: ServerState, sig: int) -> None:
        state.draining = True
        log.info("draining: new requests get 503; running ones have %g s", self.drain_s)
        if not await state.loop.drain(self.drain_s):
            n = state.loop.end_all()
            log.warning("drain window passed: ended %d requests with an error", n)
        super().handle_exit(sig, None)

    def _end_now(self, state: ServerState, sig: int) -> None:
        state.draining = True
        n = state.loop.end_all()
        log.warning("second signal: ended %d requests with an error", n)
        super().handle_exit(sig, None)


def _raise_fd_limit(want: int) -> int:
    """Raise the soft file-descriptor limit toward `want` (+ room for the model's files
    and threads); returns the connections it allows."""
    reserve = 128
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want + reserve if hard == resource.RLIM_INFINITY else min(hard, want + reserve)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return max(1, min(want, soft - reserve))


def serve(app: Starlette, settings: ServerSettings, host: str, port: int, log_level: str) -> None:
    conns = settings.connections
    allowed = _raise_fd_limit(conns.max_connections)
    if allowed < conns.max_connections:
        log.warning(
            "--max-connections %d: the file-descriptor limit allows %d",
            conns.max_connections, allowed,
        )  # fmt: skip
        conns = type(conns)(allowed, conns.header_timeout_s, conns.keep_alive_s,
                            conns.max_header_bytes)  # fmt: skip
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=guarded_protocol(conns),
        timeout_keep_alive=int(max(1, conns.keep_alive_s)),
        timeout_graceful_shutdown=FLUSH_S,
    )
    server = DrainingServer(config, app, settings.drain_s)
    app.state.stop = lambda: setattr(server, "should_exit", True)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT it drained for
        server.run()
    if app.state.load_error is not None:  # it listened, the model did not load: a failure
        sys.exit(1)
