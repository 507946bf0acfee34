"""Placement before serving: `one-gpu plan`, and the plan `one-gpu serve` applies.

The planner itself is pure (`engine.plan`); this module gathers its inputs — the GGUF's
header (`engine.gguf_meta`), the GPU's free memory and the host's available RAM
(`engine.devices`), the KV the server will reserve — and turns a plan into what the loader
takes: regexes of the tensors to keep in host RAM (llama.cpp's tensor buffer-type
overrides, `engine.placement`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec

from engine._capi import llama
from engine.config import SIDE_AUTO, EngineConfig
from engine.devices import available_ram, gpu_memory
from engine.gguf_meta import ModelMeta, read_meta
from engine.plan import (
    AUTO,
    Budgets,
    Plan,
    PlanDoesNotFit,
    PlanOptions,
    cpu_patterns,
    expert_layer,
    experts_in_ram,
    make_plan,
    parse_size,
    plan_from_json,
    reserves,
)

log = logging.getLogger(__name__)

# The side context's size where the placement asks for one and no size was given: prompts
# up to this long are prefilled beside the decoders; longer ones in chunks in their steps
SIDE_AUTO_TOKENS = 32768


class PlanRefused(Exception):
    """No server starts: the plan does not fit, or a saved plan does not match the model."""


@dataclass(frozen=True, slots=True)
class PlanRequest:
    vram_budget: str | None = None  # SIZE; None = the GPU's free memory
    ram_budget: str | None = None  # SIZE; None = MemAvailable, or less under a cgroup limit
    options: PlanOptions = field(default_factory=PlanOptions)  # KV, ubatch, contexts


def budgets(req: PlanRequest) -> Budgets:
    """The request's budgets, measured on this host where not given."""
    if req.vram_budget is not None:
        vram = parse_size(req.vram_budget)
    else:
        gpus = gpu_memory(llama())
        vram = gpus[0].free if gpus else 0
    if req.ram_budget is not None:
        ram = parse_size(req.ram_budget)
    else:
        host = available_ram()
        ram = host.available
        if host.capped:
            log.info("RAM budget: %s", host.source)
    return Budgets(vram=vram, ram=ram)


def plan_model(meta: ModelMeta, req: PlanRequest) -> Plan:
    """Plan `meta` for this host; raises `PlanDoesNotFit` with the numbers."""
    return make_plan(meta, budgets(req), req.options)


def plan_wide(meta: ModelMeta, req: PlanRequest, n_batch: int) -> Plan:
    """`plan_model`, with physical batches of a whole step (`n_batch` rows) where the plan
    leaves routed experts in host RAM and that still fits.

    Why: for a batch of 32 rows or more llama.cpp computes host-resident experts on the GPU,
    copying the experts the batch uses over PCIe for every physical batch: the copy, not
    the arithmetic, is a prompt step's cost (H100, a 30B-A3B model with every expert in
    RAM: 574 prompt tokens in two 512-row batches took 489 ms, ~0.2 s of it each copy). A
    physical batch as large as a step pays it once per step: larger compute buffers (the
    plan reserves them) for prompts that prefill up to 4x faster, and steps that carry
    several users' prompts at the price of one.
    """
    plan = plan_model(meta, req)
    if n_batch <= req.options.n_ubatch or not experts_in_ram(plan):
        return plan
    wide = replace(req, options=msgspec.structs.replace(req.options, n_ubatch=n_batch))
    try:
        return plan_model(meta, wide)
    except PlanDoesNotFit:
        log.info("experts in RAM, but %d-row batches do not fit: keeping %d", n_batch,
                 req.options.n_ubatch)  # fmt: skip
        return plan


def plan_for_serve(
    cfg: EngineConfig, req: PlanRequest, plan_file: Path | None, wide_batches: bool = False
) -> tuple[EngineConfig, Plan | None]:
    """Plan (or load a saved plan) and return the engine config that applies it, its load
    mode decided (`load_mode`) by where the placement leaves the weights."""
    on_gpu = cfg.n_gpu_layers != 0 and bool(llama().llama_supports_gpu_offload())
    cfg, plan = _placed(cfg, req, plan_file, wide_batches, on_gpu)
    layers_on_cpu = 0 < cfg.n_gpu_layers <= read_meta(cfg.model_path).n_layer
    return load_mode(cfg, on_gpu and (bool(cfg.cpu_tensors) or layers_on_cpu)), plan


def load_mode(cfg: EngineConfig, host_weights_on_gpu: bool) -> EngineConfig:
    """`cfg` with mapping decided: as given, or (None) read where a GPU computes with weights
    in host RAM — llama.cpp then keeps them in the GPU's page-locked host memory, and the
    copies every large batch makes of them go by DMA, not through the driver's staging of
    file-backed pages: a 16K prompt with every routed expert in RAM took 3.9 s to its first
    token read and 16.9 s mapped (H100, docs/benchmarks.md). Mapped elsewhere: the page
    cache shares the file and the load is lazy."""
    if cfg.use_mmap is not None:
        return cfg
    if host_weights_on_gpu:
        log.info("weights in host RAM on a GPU: the model is read into page-locked memory")
    return replace(cfg, use_mmap=not host_weights_on_gpu)


def _placed(
    cfg: EngineConfig,
    req: PlanRequest,
    plan_file: Path | None,
    wide_batches: bool,
    on_gpu: bool,
) -> tuple[EngineConfig, Plan | None]:
    """The placement: a plan made, loaded, or none (by hand).

    No plan when the operator placed tensors by hand (`--cpu-experts`/`--cpu-moe`), or when
    there is no GPU and no budget was given (everything is in host RAM anyway).
    `wide_batches` (no --n-ubatch given): on a GPU, with experts in host RAM, the physical
    batch is the step's (`plan_wide` says why). The side context (`side_context`) is
    sized here too: its KV and buffers are VRAM the plan reserves.
    """
    wide = wide_batches and on_gpu and cfg.n_batch > cfg.n_ubatch
    if plan_file is None and cfg.cpu_tensors:
        log.info("tensor placement by hand (%s): not planning", " | ".join(cfg.cpu_tensors))
        experts = _any_expert(read_meta(cfg.model_path), cfg.cpu_tensors)
        if wide and experts:
            cfg = _wide(cfg)
        return side_context(cfg, on_gpu and experts), None
    meta = read_meta(cfg.model_path)
    if 0 < cfg.n_gpu_layers <= meta.n_layer:
        log.info(
            "--n-gpu-layers %d keeps layers on the CPU by hand: not planning", cfg.n_gpu_layers
        )
        return side_context(cfg, False), None
    if plan_file is not None:
        plan = plan_from_json(plan_file.read_bytes())
        _check_saved(plan, meta, plan_file, cfg.model_path, req)
        if wide and experts_in_ram(plan) and plan.options.n_ubatch >= cfg.n_batch:
            cfg = _wide(cfg)  # (a plan saved with wide batches reserved their buffers)
        cfg = side_context(cfg, False)  # (its reserves are the saved plan's: none)
    else:
        if not on_gpu and req.options.cache_slots == AUTO:
            # a bank in host RAM caches host RAM: auto means a cache only on a GPU
            req = replace(req, options=msgspec.structs.replace(req.options, cache_slots=0))
        if not on_gpu and req.vram_budget is None:
            log.info("no GPU: every tensor in host RAM, nothing to plan")
            return side_context(cfg, False), None
        try:
            plan = plan_wide(meta, req, cfg.n_batch) if wide else plan_model(meta, req)
        except PlanDoesNotFit as e:
            raise PlanRefused(str(e)) from e
        cfg = side_context(cfg, experts_in_ram(plan))
        if cfg.side_prefill_ctx:
            plan = _with_side(meta, req, plan, cfg, wide)
            if plan.options.contexts == req.options.contexts:
                cfg = replace(cfg, side_prefill_ctx=0)
        if plan.options.n_ubatch != req.options.n_ubatch:
            cfg = _wide(cfg)
    if plan.split is not None:
        cfg = replace(cfg, expert_cache_slots=plan.split.slots)
        log.info("routed-expert cache: %d slots in each of %d layers in host RAM",
                 plan.split.slots, len(plan.split.cached))  # fmt: skip
    log.info("placement plan: %d tensors in host RAM", sum(t.device == "ram" for t in plan.tensors))
    return replace(cfg, cpu_tensors=cpu_patterns(plan)), plan


def side_context(cfg: EngineConfig, experts_in_ram_on_gpu: bool) -> EngineConfig:
    """`cfg` with the side context's size decided: as given, or under SIDE_AUTO one of up
    to SIDE_AUTO_TOKENS where a GPU computes prompts with routed experts in host RAM
    (every prompt batch copies them: no chunk keeps a decoder's pause short, a context
    beside the steps does, engine.side_prefill); elsewhere none."""
    n = cfg.side_prefill_ctx
    if n == SIDE_AUTO:
        n = min(cfg.n_ctx, SIDE_AUTO_TOKENS) if experts_in_ram_on_gpu else 0
    if n > 0:
        log.info("side context: prompts up to %d tokens prefilled beside the decoders", n)
    return replace(cfg, side_prefill_ctx=max(0, n))


def _with_side(
    meta: ModelMeta, req: PlanRequest, plan: Plan, cfg: EngineConfig, wide: bool
) -> Plan:
    """The plan again with the side context's KV and compute buffers reserved (one more
    context), and in host RAM its page-locked buffer for a prompt's KV (engine.pinned);
    the plan without it where that does not fit (no side context then)."""
    opts, n = req.options, cfg.side_prefill_ctx
    side = replace(req, options=msgspec.structs.replace(
        opts, kv_tokens=opts.kv_tokens + n, contexts=opts.contexts + 1,
        ram_margin=opts.ram_margin + n * meta.kv_bytes_per_token,
    ))  # fmt: skip
    try:
        return plan_wide(meta, side, cfg.n_batch) if wide else plan_model(meta, side)
    except PlanDoesNotFit as e:
        log.info("no side context: its KV and buffers do not fit (%s)", e)
        return plan


def _any_expert(meta: ModelMeta, patterns: tuple[str, ...]) -> bool:
    return any(
        re.search(p, t.name) for t in meta.tensors if expert_layer(t.name) >= 0 for p in patterns
    )


def _wide(cfg: EngineConfig) -> EngineConfig:
    log.info("experts in host RAM: physical batches of %d rows (one expert copy a step)",
             cfg.n_batch)  # fmt: skip
    return replace(cfg, n_ubatch=cfg.n_batch)


def _check_saved(
    plan: Plan, meta: ModelMeta, plan_file: Path, model: str, req: PlanRequest
) -> None:
    """A saved plan applies only to the very model (names and sizes: another quantization
    has the same names) and only if it still fits this host's budgets with the reserves
    this server needs."""
    sizes = {t.name: t.nbytes for t in meta.tensors}
    wrong = [t.name for t in plan.tensors if sizes.get(t.name) != t.nbytes]
    if wrong or len(plan.tensors) != len(sizes):
        raise PlanRefused(
            f"{plan_file} is not a plan for {model}: {len(wrong)} of its {len(plan.tensors)} "
            f"tensors are missing from the model or differ in size (the model has {len(sizes)})"
        )
    have = budgets(req)
    vram, ram = reserves(meta, req.options, have.ram, experts_in_ram=experts_in_ram(plan))
    need_vram = plan.bytes_on("gpu") + vram.total
    need_ram = plan.bytes_on("ram") + ram.total
    # No GPU and no budget (vram 0): the loader keeps everything in RAM whatever the plan.
    if (have.vram and need_vram > have.vram) or need_ram > have.ram:
        raise PlanRefused(
            f"{plan_file} does not fit this host: it needs {need_vram / 2**30:.2f} GiB of GPU "
            f"memory (has {have.vram / 2**30:.2f}) and {need_ram / 2**30:.2f} GiB of RAM "
            f"(has {have.ram / 2**30:.2f}) with this server's KV cache and buffers"
        )
