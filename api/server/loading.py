"""The model loaded and the serving state built from it, for the app's lifespan
(api.server.app): the weights placed, the fast lane's engine (and the reproducible lane's,
and a side context), the schedulers and the engine loop, the metrics, the chat template
and what the pipeline reads of it once (reasoning, tool-call format, system turns)."""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import anyio

from api.pipeline.generic_tools import GENERIC, renders_system
from api.pipeline.lanes import FAST, REPRODUCIBLE, fingerprints
from api.pipeline.reasoning import template_reasons
from api.pipeline.rendering import renders_system_between
from api.pipeline.tool_calls import detect as detect_tool_format
from api.pipeline.tool_calls import renders_tools
from api.server.metrics.registry import Metrics
from api.server.state import ServerSettings, ServerState
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


def load_model(
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
    if model.ll.llama_supports_gpu_offload() and settings.engine.n_gpu_layers != 0:
        for engine in engines:  # the first request then pays no first-launch costs
            log.info("warmed up on the GPU in %.2f s", engine.warm_up())
    if progress.cancelled:
        for engine in engines:
            engine.close()
        model.close()
        raise ModelLoadCancelled("load cancelled before serving")
    t0 = time.perf_counter()
    _ = model.grammars.tokenizer  # (holds the GIL for a while: never while serving)
    log.info("grammar tokenizer ready in %.1f s", time.perf_counter() - t0)
    return model, engines, placement


def serving_state(
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


def model_bytes(settings: ServerSettings) -> int:
    """The model's files' size (every part of a split one); 0 where they cannot be read."""
    try:
        return sum(p.stat().st_size for p in split_parts(Path(settings.engine.model_path)))
    except OSError:
        return 0
