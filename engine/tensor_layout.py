"""Where the loader puts the served weights: by device, with the expert layout.

The same rules llama.cpp's loader follows (the last `n_gpu_layers` blocks offloaded, the
input embeddings in host memory, tensors matching `cpu_tensors` kept there), read from
the GGUF's header: what `/metrics` and the router telemetry report the placement as.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.expert_stats import ExpertLayout, layout_of
from engine.gguf_meta import read_meta

_BLOCK = re.compile(r"^blk\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class Placement:
    """Where the served weights are: bytes and tensor counts by device, the expert layout;
    and, from the same header, what one token's KV takes (f16, every layer)."""

    placed: dict[str, tuple[int, int]]
    experts: ExpertLayout | None
    kv_bytes_per_token: int


def describe(cfg: EngineConfig, on_gpu_build: bool, n_layer: int, n_expert: int) -> Placement:
    """The layout the loader was asked for. llama.cpp keeps the input embeddings
    (`token_embd`) in host memory whatever the offload: they are looked up, not multiplied."""
    meta = read_meta(cfg.model_path)
    gpu = on_gpu_build and cfg.n_gpu_layers != 0
    pats = [re.compile(p) for p in cfg.cpu_tensors]
    # llama.cpp offloads the last n_gpu_layers blocks, and the output layer only when
    # n_gpu_layers exceeds the block count (-1: everything).
    n_gpu = meta.n_layer + 1 if cfg.n_gpu_layers < 0 else cfg.n_gpu_layers
    first_gpu_block = meta.n_layer - min(n_gpu, meta.n_layer)

    def offloaded(name: str) -> bool:
        m = _BLOCK.match(name)
        return int(m.group(1)) >= first_gpu_block if m else n_gpu > meta.n_layer

    def on_gpu(name: str) -> bool:
        return (
            gpu
            and not name.startswith("token_embd.")
            and offloaded(name)
            and not any(p.search(name) for p in pats)
        )

    placed = {"gpu": [0, 0], "ram": [0, 0]}
    for t in meta.tensors:
        slot = placed["gpu" if on_gpu(t.name) else "ram"]
        slot[0] += t.nbytes
        slot[1] += 1
    layout = (
        layout_of(((t.name, t.nbytes) for t in meta.tensors), n_layer, n_expert, on_gpu)
        if n_expert
        else None
    )
    return Placement({k: (v[0], v[1]) for k, v in placed.items()}, layout, meta.kv_bytes_per_token)
