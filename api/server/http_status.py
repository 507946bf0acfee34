"""Every HTTP response's status code, by route, for /metrics (`onegpu_http_responses_total`):
what an alert on server errors reads. Pure ASGI around the whole app (refused keys
included); the catch-all error handler, which Starlette runs outside every middleware,
counts its 500s itself (`count`).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

ROUTES = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/health",
    "/livez", "/metrics", "/experts", "/openapi.json", "/v1/messages",
    "/v1/messages/count_tokens", "/tokenize", "/detokenize",
})  # fmt: skip


def route_of(path: str) -> str:
    """The route label: a served path, or `other` (unknown paths must not grow the series)."""
    return path if path in ROUTES else "other"


def count(scope: Scope, status: int) -> None:
    """Count one response, once the server serves (its metrics exist from then on)."""
    state = scope["app"].state.server
    if state is not None:
        state.metrics.requests.http_responses.labels(
            route=route_of(scope["path"]), code=str(status)
        ).inc()


class StatusCounter:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                count(scope, message["status"])
            await send(message)

        await self.app(scope, receive, counted)
