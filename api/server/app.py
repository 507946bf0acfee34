"""Build the starlette app explicitly: routes, error handlers by class, a lifespan that
loads the model, starts the engine loop and drains it on shutdown."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from api.pipeline.generic_tools import GENERIC, renders_system
from api.pipeline.lanes import FAST, REPRODUCIBLE, fingerprints
from api.pipeline.reasoning import template_reasons
from api.pipeline.rendering import renders_system_between
from api.pipeline.tool_calls import detect as detect_tool_format
from api.pipeline.tool_calls import renders_tools
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
from api.server.metrics.registry import CONTENT_TYPE, Metrics
from api.server.state import ServerSettings, ServerState, server_state
from engine import moe_cache
from engine.chat_template import ChatTemplate
from engine.errors import ModelLoadCancelled
from engine.expert_telemetry import ExpertTelemetry
from engine.gguf_meta import split_parts
from engine.load_progress import LoadProgress
from engine.model import Model
from engine.pick_store import PickStore, counts_path
from engine.runner import Engine
from engine.sampling_defaults import resolve_defaults
from engine.side_prefill import SidePrefill
from engine.tensor_layout import Placement, describe
from scheduler.core import Scheduler, SchedulerConfig
from scheduler.loop import EngineLoop

log = logging.getLogger(__name__)

# The side context's threads: with experts in host RAM its prompt batches run on the GPU
# (their experts copied there), so it needs few; the decoders' steps need the cores (an
# H100 host, 4 decoders beside a 16K side prefill on 2 threads: 80 ms steps, 71 alone)
SIDE_THREADS = 2


def _load(
    settings: ServerSettings, progress: LoadProgress
) -> tuple[Model, list[Engine], Placement]:
    """The model, the fast lane's engine and, when configured, the reproducible lane's:
    its own context, one KV stream per slot (`kv_unified=false`), every sequence decoded
    alone (`solo`) — see api.pipeline.lanes. Also where the weights went. A `progress.cancel()`
    abandons it (`ModelLoadCancelled`) at the next tensor or step."""
    model = Model(settings.engine, progress)
    placement = describe(
        settings.engine, bool(model.ll.llama_supports_gpu_offload()), model.n_layer,
        model.n_expert,
    )  # fmt: skip
    for device, (nbytes, n) in placement.placed.items():
        log.info("weights on %s: %d tensors, %.2f GiB", device, n, nbytes / 2**30)
    engines = [Engine(model)]
    if settings.engine.side_prefill_ctx > 0:
        engines[0].side = SidePrefill(
            model, settings.engine.side_prefill_ctx, SIDE_THREADS, placement.kv_bytes_per_token
        )
    lanes = settings.lanes
    if lanes.slots > 0:
        ctx = model.open_context(
            n_ctx=lanes.slots * lanes.ctx, n_seq_max=lanes.slots, unified=False,
            device_greedy=False, n_ubatch=max(settings.engine.n_ubatch, lanes.chunk),
        )  # fmt: skip
        engines.append(Engine(model, ctx, solo=True))
    if progress.cancelled:
        for engine in engines:
            engine.close()
        model.close()
        raise ModelLoadCancelled("load cancelled before serving")
    t0 = time.perf_counter()
    _ = model.grammars.tokenizer  # (holds the GIL for a while: never while serving)
    log.info("grammar tokenizer ready in %.1f s", time.perf_counter() - t0)
    return model, engines, placement


def _state(
    settings: ServerSettings, model: Model, engines: list[Engine], placement: Placement
) -> ServerState:
    max_len = min(model.n_ctx, model.n_ctx_train or model.n_ctx)
    if settings.max_model_len:
        max_len = min(max_len, settings.max_model_len)
    budget = min(settings.max_num_batched_tokens or model.n_batch, model.n_batch)
    ubatch, tile = model.step_geometry()
    # Each cell of a swapped sequence: all layers' K and V (an f16 upper bound: sliding-
    # window layers keep fewer), plus llama.cpp's per-cell position and sequence record.
    cell_bytes = placement.kv_bytes_per_token + 12
    side = engines[0].side
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=model.n_seq_max,
            kv_capacity=model.n_ctx,
            max_num_batched_tokens=budget,
            max_waiting=settings.max_waiting,
            swap_cells=settings.swap_space // cell_bytes,
            kv_bytes_per_cell=cell_bytes,
            max_stall_s=None if settings.max_stall_ms is None else settings.max_stall_ms / 1000,
            stall_auto=settings.stall_auto,
            min_prefill_chunk=settings.min_prefill_chunk,
            ubatch=ubatch,
            attention_tile=tile,
            prefix_cache=model.n_cached_seqs > 0,
            max_cached_seqs=model.n_cached_seqs,
            sliding_window=model.n_swa,
            prompt_logprob_rows=settings.engine.prompt_logprob_rows,
            side_prefill_tokens=side.n_ctx - 1 if side is not None else 0,
        )
    )
    name = settings.served_model_name or Path(settings.engine.model_path).stem
    lanes = settings.lanes
    metrics = Metrics(name, (FAST, REPRODUCIBLE) if len(engines) > 1 else (FAST,))
    plan = settings.plan
    metrics.process.set_placement(
        placement.placed, {"gpu": plan.budgets.vram, "ram": plan.budgets.ram} if plan else None
    )
    metrics.process.set_weight_buffers(model.weight_buffers.by_buffer)
    experts = None
    picks = None
    if model.tap is not None and placement.experts is not None:
        experts = ExpertTelemetry(model.tap, placement.experts)
        metrics.add_expert_telemetry(experts.report)
        if settings.state_dir is not None:
            path = counts_path(settings.state_dir, settings.engine.model_path)
            picks = PickStore(path, model.n_layer, model.n_expert)
    if model.expert_cache_layers:
        # (read at scrape time from the event loop: counters the engine thread bumps)
        metrics.add_expert_cache(
            functools.partial(moe_cache.snapshot, model.main.ctx, model.n_layer),
            settings.engine.expert_cache_slots, model.expert_cache_layers,
        )  # fmt: skip
    loop = EngineLoop(scheduler, engines[0].step, on_stats=metrics.observe)
    if side is not None:
        side.on_done = functools.partial(loop.side_woke, FAST)
    repro_len = 0
    if len(engines) > 1:
        repro_len = min(lanes.ctx, model.n_ctx_train or lanes.ctx)
        # Fixed chunks, no time budget, never preempted: every request fits its own stream
        # (the API refuses longer ones), so the chunking is a function of the request alone.
        repro = Scheduler(
            SchedulerConfig(
                max_num_seqs=lanes.slots,
                kv_capacity=lanes.slots * lanes.ctx,
                max_num_batched_tokens=lanes.slots * lanes.chunk,
                max_waiting=settings.max_waiting,
                max_prefill_chunk=lanes.chunk,
                prompt_logprob_rows=settings.engine.prompt_logprob_rows,
            )
        )
        loop.add_lane(REPRODUCIBLE, repro, engines[1].step)
    template = ChatTemplate.resolve(
        settings.chat_template, model.chat_template(), model.bos_token, model.eos_token
    )
    tool_format = _tool_format(settings.tool_call_parser, template.source)
    log.info("tool calls: %s", tool_format or "off (--tool-call-parser none)")
    sampling = resolve_defaults(settings.sampling, model.meta_str)
    log.info("sampling defaults (a request's own fields win): %s", sampling.describe())
    return ServerState(
        settings=settings,
        model=model,
        loop=loop,
        metrics=metrics,
        template=template,
        model_name=name,
        max_model_len=max_len,
        repro_max_len=repro_len,
        fingerprints=fingerprints(settings.engine, lanes),
        created=int(time.time()),
        longest_token_bytes=model.longest_token_bytes(),
        prompt_workers=anyio.CapacityLimiter(settings.limits.prompt_workers),
        aliases=frozenset({name, Path(settings.engine.model_path).name}),
        experts=experts,
        picks=picks,
        reasoning=settings.reasoning_format != "none" and template_reasons(template.source),
        tool_format=tool_format,
        renders_tools=renders_tools(
            lambda tools: template.bind(tools=tools).render([{"role": "user", "content": "Hi"}])
        ),
        system_role=renders_system(template.render),
        system_between=renders_system_between(template.render),
        sampling_defaults=sampling,
    )


def _tool_format(parser: str, source: str) -> str | None:
    """The format named, or the template's (auto), else the generic one
    (api.pipeline.generic_tools)."""
    if parser == "none":
        return None
    if parser != "auto":
        return parser
    return detect_tool_format(source) or GENERIC


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


def _model_bytes(settings: ServerSettings) -> int:
    """The model's files' size (every part of a split one); 0 where they cannot be read."""
    try:
        return sum(p.stat().st_size for p in split_parts(Path(settings.engine.model_path)))
    except OSError:
        return 0


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
                    _load, settings, progress
                )
                loaded.append((model, engines))
                state = _state(settings, model, engines, placement)
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
    app.state.loading = LoadProgress(_model_bytes(settings))  # api.server.serve may cancel it
    app.state.stop = lambda: None  # api.server.serve: ends the HTTP server (a failed load)
    keys = KeySet(settings.api_keys)
    if keys:
        app.add_middleware(
            BearerAuth, keys=keys, protect_metrics=settings.protect_metrics,
            error_for=error_response_for,
        )  # fmt: skip
    app.add_middleware(StatusCounter)  # outermost: refused keys are counted too
    return app
