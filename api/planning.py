"""Placement before serving: `one-gpu plan`, and the plan `one-gpu serve` applies.

The planner itself is pure (`engine.plan`); this module gathers its inputs — the GGUF's
header (`engine.gguf_meta`), the GPU's free memory and the host's available RAM
(`engine.devices`), the KV the server will reserve — and turns a plan into what the loader
takes: regexes of the tensors to keep in host RAM (llama.cpp's tensor buffer-type
overrides, `engine.placement`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine._capi import llama
from engine.config import EngineConfig
from engine.devices import available_ram, gpu_memory
from engine.gguf_meta import ModelMeta, read_meta
from engine.plan import (
    Budgets,
    Plan,
    PlanDoesNotFit,
    PlanOptions,
    cpu_patterns,
    expert_layer,
    make_plan,
    parse_size,
    plan_from_json,
    reserves,
)

log = logging.getLogger(__name__)


class PlanRefused(Exception):
    """No server starts: the plan does not fit, or a saved plan does not match the model."""


@dataclass(frozen=True, slots=True)
class PlanRequest:
    vram_budget: str | None = None  # SIZE; None = the GPU's free memory
    ram_budget: str | None = None  # SIZE; None = MemAvailable
    options: PlanOptions = field(default_factory=PlanOptions)  # KV, ubatch, contexts


def budgets(req: PlanRequest) -> Budgets:
    """The request's budgets, measured on this host where not given."""
    if req.vram_budget is not None:
        vram = parse_size(req.vram_budget)
    else:
        gpus = gpu_memory(llama())
        vram = gpus[0].free if gpus else 0
    ram = parse_size(req.ram_budget) if req.ram_budget is not None else available_ram()
    return Budgets(vram=vram, ram=ram)


def plan_model(meta: ModelMeta, req: PlanRequest) -> Plan:
    """Plan `meta` for this host; raises `PlanDoesNotFit` with the numbers."""
    return make_plan(meta, budgets(req), req.options)


def plan_for_serve(
    cfg: EngineConfig, req: PlanRequest, plan_file: Path | None
) -> tuple[EngineConfig, Plan | None]:
    """Plan (or load a saved plan) and return the engine config that applies it.

    No plan when the operator placed tensors by hand (`--cpu-experts`/`--cpu-moe`), or when
    there is no GPU and no budget was given (everything is in host RAM anyway).
    """
    if plan_file is None and cfg.cpu_tensors:
        log.info("tensor placement by hand (%s): not planning", " | ".join(cfg.cpu_tensors))
        return cfg, None
    meta = read_meta(cfg.model_path)
    if 0 < cfg.n_gpu_layers <= meta.n_layer:
        log.info(
            "--n-gpu-layers %d keeps layers on the CPU by hand: not planning", cfg.n_gpu_layers
        )
        return cfg, None
    if plan_file is not None:
        plan = plan_from_json(plan_file.read_bytes())
        _check_saved(plan, meta, plan_file, cfg.model_path, req)
    else:
        on_gpu = cfg.n_gpu_layers != 0 and bool(llama().llama_supports_gpu_offload())
        if not on_gpu and req.vram_budget is None:
            log.info("no GPU: every tensor in host RAM, nothing to plan")
            return cfg, None
        try:
            plan = plan_model(meta, req)
        except PlanDoesNotFit as e:
            raise PlanRefused(str(e)) from e
    log.info("placement plan: %d tensors in host RAM", sum(t.device == "ram" for t in plan.tensors))
    return replace(cfg, cpu_tensors=cpu_patterns(plan)), plan


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
    in_ram = any(expert_layer(t.name) >= 0 and t.device == "ram" for t in plan.tensors)
    vram, ram = reserves(meta, req.options, have.ram, experts_in_ram=in_ram)
    need_vram = plan.bytes_on("gpu") + vram.total
    need_ram = plan.bytes_on("ram") + ram.total
    # No GPU and no budget (vram 0): the loader keeps everything in RAM whatever the plan.
    if (have.vram and need_vram > have.vram) or need_ram > have.ram:
        raise PlanRefused(
            f"{plan_file} does not fit this host: it needs {need_vram / 2**30:.2f} GiB of GPU "
            f"memory (has {have.vram / 2**30:.2f}) and {need_ram / 2**30:.2f} GiB of RAM "
            f"(has {have.ram / 2**30:.2f}) with this server's KV cache and buffers"
        )
