"""Build the starlette app explicitly: routes, error handlers by class, a lifespan that
loads the model (api.server.loading), starts the engine loop and drains it on shutdown.

The one server module that imports the protocols: it mounts their routes, and hands the
key check the envelope each path answers in (tests/test_layering.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.protocols.anthropic.routes import messages, messages_count_tokens
from api.protocols.anthropic.wire import error_response_for
from api.protocols.llama.routes import detokenize, tokenize
from api.protocols.openai.routes import chat_completions, completions, list_models, responses
from api.protocols.openapi import openapi_json
from api.server.auth import BearerAuth, KeySet
from api.server.errors import (
    APIError,
    MethodNotAllowed,
    RouteNotFound,
    handle_api_error,
)
from api.server.experts import expert_counts as expert_counts_route
from api.server.experts import experts as experts_route
from api.server.http_status import StatusCounter
from api.server.http_status import count as count_status
from api.server.liveness import livez
from api.server.loading import load_model, model_bytes, serving_state
from api.server.metrics.registry import CONTENT_TYPE
from api.server.state import ServerSettings, ServerState, server_state
from engine.errors import ModelLoadCancelled
from engine.load_progress import LoadProgress
from engine.model import Model
from engine.runner import Engine

log = logging.getLogger(__name__)


async def health(request: Request) -> Response:
    """200 while serving; 503 while the model loads (the server listens first) and while
    it drains: what a load balancer, Kubernetes or a container HEALTHCHECK needs."""
    state: ServerState | None = request.app.state.server
    if state is None:
        progress = round(request.app.state.loading.fraction, 3)
        return JSONResponse({"status": "loading", "progress": progress}, status_code=503)
    if not state.loop.is_running or state.draining:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


# While the model loads (minutes for a large one) /metrics answers, so that Prometheus sees
# the process up and a loading server does not look like a dead one (OneGpuDown).
LOADING_METRICS = (
    "# HELP onegpu_loading 1 while the model loads: the server listens before it serves\n"
    "# TYPE onegpu_loading gauge\nonegpu_loading 1.0\n"
    "# HELP onegpu_load_progress Share of the weights' bytes loaded\n"
    "# TYPE onegpu_load_progress gauge\nonegpu_load_progress {:.4f}\n"
)


async def metrics(request: Request) -> Response:
    if request.app.state.server is None:
        text = LOADING_METRICS.format(request.app.state.loading.fraction)
        return Response(text.encode(), media_type=CONTENT_TYPE)
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    path = request.url.path  # (the answer is in the envelope of the path's API)
    if exc.status_code == 405:
        resp = error_response_for(path, MethodNotAllowed("method not allowed"))
        resp.headers.update(exc.headers or {})  # Allow: the methods the route takes
        return resp
    if exc.status_code == 404:
        return error_response_for(path, RouteNotFound("no such route"))
    return error_response_for(path, APIError(str(exc.detail)))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error", exc_info=exc)
    count_status(request.scope, 500)  # (Starlette answers this outside every middleware)
    return error_response_for(request.url.path, APIError("internal server error"))


PICKS_SAVE_S = 300.0  # how often a server saves its sampled pick counts (and at the end)


def _save_picks(state: ServerState) -> None:
    """The telemetry's counts into the state dir (engine.pick_store); a failure is logged,
    never fatal: the counts only tune the next start."""
    assert state.picks is not None and state.model.tap is not None
    try:
        state.picks.save(state.model.tap.counts.copy())
    except OSError as e:
        log.warning("could not save the router pick counts to %s: %s", state.picks.path, e)


async def _save_picks_every(state: ServerState, every_s: float) -> None:
    while not state.draining:
        await asyncio.sleep(every_s)
        await anyio.to_thread.run_sync(_save_picks, state)


def build_app(settings: ServerSettings) -> Starlette:
    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # The model loads after the server listens (a big one takes minutes): until then
        # /health says "loading" and the API 503s, rather than connections being refused.
        loaded: list[tuple[Model, list[Engine]]] = []

        async def load() -> None:
            progress = app.state.loading
            try:
                model, engines, placement = await anyio.to_thread.run_sync(
                    load_model, settings, progress
                )
                loaded.append((model, engines))
                state = serving_state(settings, model, engines, placement)
                state.loop.start()
            except ModelLoadCancelled as e:  # a stop signal came first: not a failure
                log.info("%s: stopping", e)
                return
            except Exception as e:
                log.error("could not load the model: %s", e)
                app.state.load_error = e
                app.state.stop()  # the server stops listening; api.server.serve exits 1
                return
            app.state.server = state
            log.info("serving %s (max_model_len=%d)", state.model_name, state.max_model_len)
            if state.picks is not None:
                saving.append(asyncio.create_task(_save_picks_every(state, PICKS_SAVE_S)))

        loading = asyncio.create_task(load())
        saving: list[asyncio.Task[None]] = []
        try:
            yield
        finally:
            await loading  # (a stop signal during the load cancelled it: api.server.serve)
            for task in saving:
                task.cancel()
            state: ServerState | None = app.state.server
            if state is not None:
                state.draining = True
                await state.loop.stop(drain_s=settings.drain_s)
                if state.picks is not None:
                    _save_picks(state)
            for model, engines in loaded:
                for engine in engines:
                    engine.close()
                model.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/livez", livez, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/experts", experts_route, methods=["GET"]),
        Route("/experts/counts", expert_counts_route, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            APIError: handle_api_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    app.state.server = None  # (until the model has loaded)
    app.state.load_error = None
    app.state.loading = LoadProgress(model_bytes(settings))  # api.server.serve may cancel it
    app.state.stop = lambda: None  # api.server.serve: ends the HTTP server (a failed load)
    keys = KeySet(settings.api_keys)
    if keys:
        app.add_middleware(
            BearerAuth, keys=keys, protect_metrics=settings.protect_metrics,
            error_for=error_response_for,
        )  # fmt: skip
    app.add_middleware(StatusCounter)  # outermost: refused keys are counted too
    return app
