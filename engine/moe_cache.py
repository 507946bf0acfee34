"""The routed-expert cache of our llama.cpp patches 0002 (the cache), 0003 (its per-layer
counters), 0004 (admission by decayed pick counts, one read-back a step), 0005 (on a
GPU, uploads from pinned pages on a stream of their own, overlapped with the next step; a
bank filled before the first request) and 0006 (the misses computed by the GPU from host
RAM in place, `set_misses`), through ctypes.

For a context whose expert tensors live in host RAM (`--cpu-moe`, or a plan that leaves
layers there), the patch keeps a small bank of expert slices on a device — the GPU, or the
CPU for tests — and computes each routed pick from the bank when its expert is there and
from host RAM otherwise: two chains of the expert FFN whose ids are remapped (a slot in the
bank, else a zero pad slot; the expert, else -1 = a zero row, patch 0001), added. Each pick
is computed by exactly one of them, so the output is the uncached one bit for bit on the
CPU. After each small batch the routed ids are read back, a per-layer LRU uploads at most
`max_uploads` missed experts a layer, and the next batch reads them from the bank. Batches
of more than `max_tokens` tokens (prompts) take llama.cpp's usual path.

llama-cpp-python does not know these functions: they are bound here, on the library
`engine._capi` loaded. Scalar arguments only, so `llama_context_params` keeps its layout.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import Any

from engine._capi import llama


class ExpertCacheError(Exception):
    """The cache could not be configured as asked (unknown device, no memory)."""


@dataclass(frozen=True, slots=True)
class CacheStats:
    hits: int  # routed picks served from the bank
    misses: int  # routed picks computed where the expert lives
    uploads: int  # expert slices copied into the bank
    upload_bytes: int

    @property
    def hit_rate(self) -> float:
        return self.hits / max(1, self.hits + self.misses)


@functools.cache
def _lib() -> Any:
    """llama.cpp's library with the cache's functions declared (AttributeError on a
    library built without patches 0002 and 0003)."""
    lib = llama()._lib
    vp, i32, i64p = ctypes.c_void_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_int64)
    lib.llama_moe_cache_configure.argtypes = [vp, i32, i32, i32, ctypes.c_char_p]
    lib.llama_moe_cache_configure.restype = i32
    lib.llama_moe_cache_get_stats.argtypes = [vp, i64p, i64p, i64p, i64p]
    lib.llama_moe_cache_get_stats.restype = None
    lib.llama_moe_cache_get_layer_stats.argtypes = [vp, i32, i64p, i64p]
    lib.llama_moe_cache_get_layer_stats.restype = i32
    lib.llama_moe_cache_reset_stats.argtypes = [vp]
    lib.llama_moe_cache_reset_stats.restype = None
    lib.llama_moe_cache_pin.argtypes = [vp, i32, i32]
    lib.llama_moe_cache_pin.restype = i32
    lib.llama_moe_cache_set_admission.argtypes = [vp, ctypes.c_float, ctypes.c_float]
    lib.llama_moe_cache_set_admission.restype = i32
    lib.llama_moe_cache_preload.argtypes = [vp, i32, i32]
    lib.llama_moe_cache_preload.restype = i32
    return lib


@functools.cache
def _set_misses() -> Any:
    """Patch 0006's function, declared on first use (a library built before it still
    serves every other call)."""
    fn = _lib().llama_moe_cache_set_misses
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32
    return fn


def configure(
    ctx: Any, slots: int, *, max_uploads: int, max_tokens: int, device: str | None = None
) -> int:
    """Size the cache of `ctx` (`slots` experts a layer; 0 = off) and return the layers it
    covers (0: none has its experts in plain host buffers). `device`: "CUDA0", "CPU", or
    None for the context's first GPU. Must not run during a decode."""
    dev = device.encode() if device is not None else None
    n = int(_lib().llama_moe_cache_configure(ctx, slots, max_uploads, max_tokens, dev))
    if n == -1:
        raise ExpertCacheError(f"no device {device!r} among this context's backends")
    if n < 0:
        raise ExpertCacheError(f"could not allocate {slots} expert slots a layer on {device}")
    return n


def upload_cap(requested: int, n_expert_used: int) -> int:
    """The most experts a cached layer uploads after a step: `requested`, or where it is 0,
    the experts one token routes to. Admission decides which misses are worth a copy; the
    cap only spreads a burst of them over steps, and a cap of 1 starves a batch: at 8
    users on the reference width's routing curve it kept 54% of picks on the GPU where a
    cap of 6 kept 72% (LRU uncapped: 74%) for 9.5 uploads a step against 6.7."""
    return requested if requested > 0 else max(1, n_expert_used)


DECAY = 0.95  # a pick's weight in an expert's score falls to a half after ~14 steps


def set_admission(ctx: Any, margin: float, decay: float = DECAY) -> None:
    """Which missed experts enter a full bank (patch 0004). Each layer scores its experts
    by their picks, each worth `decay` ** (steps since). margin 0: every miss may take the
    least recently used slot (up to `max_uploads` a layer a step); margin > 0: a missed
    expert replaces the cached one of lowest score only when its score is higher by
    `margin` — an upload is a few MB over PCIe that must pay for itself in later hits, and
    under uniform routing no expert stays ahead, so the bank stops turning over."""
    if int(_lib().llama_moe_cache_set_admission(ctx, decay, margin)) != 0:
        raise ExpertCacheError("the routed-expert cache is off")


def set_misses(ctx: Any, max_tokens: int) -> int:
    """Where cached layers compute their misses (patch 0006): on the CPU from the host
    tensors — a split of each layer's graph, the GPU and the CPU waiting for each other, a
    host round trip a layer even when every pick hit — or, for steps of at most
    `max_tokens` tokens (0: none), on the cache's device, which reads the missed experts'
    pages in place over the bus: no split, the layer never leaves the GPU, and a miss
    costs its bytes over PCIe. Capped per layer by the batch up to which the GPU's kernels
    skip the cached picks. Returns the layers whose misses the device can compute (0 where
    it cannot read host memory, as on the CPU)."""
    n = int(_set_misses()(ctx, max_tokens))
    if n < 0:
        raise ExpertCacheError("the routed-expert cache is off")
    return n


def pin(ctx: Any, layer: int, expert: int) -> None:
    """Upload one expert now and keep it until the next `configure`."""
    rc = int(_lib().llama_moe_cache_pin(ctx, layer, expert))
    if rc != 0:
        why = "every slot is pinned" if rc == -2 else "no such layer or expert, or cache off"
        raise ExpertCacheError(f"cannot pin expert {expert} of layer {layer}: {why}")


def preload(ctx: Any, layer: int, expert: int) -> None:
    """Upload one expert now into a free (else the least recently used) slot, evictable."""
    rc = int(_lib().llama_moe_cache_preload(ctx, layer, expert))
    if rc != 0:
        raise ExpertCacheError(f"cannot load expert {expert} of layer {layer} (code {rc})")


def stats(ctx: Any) -> CacheStats:
    v = [ctypes.c_int64() for _ in range(4)]
    _lib().llama_moe_cache_get_stats(ctx, *(ctypes.byref(x) for x in v))
    return CacheStats(*(x.value for x in v))


def layer_stats(ctx: Any, layer: int) -> tuple[int, int] | None:
    """(hits, misses) of one layer since configure or the last reset; None where the cache
    does not cover it."""
    hits, misses = ctypes.c_int64(), ctypes.c_int64()
    rc = _lib().llama_moe_cache_get_layer_stats(
        ctx, layer, ctypes.byref(hits), ctypes.byref(misses)
    )
    return None if rc != 0 else (hits.value, misses.value)


@dataclass(frozen=True, slots=True)
class CacheSnapshot:
    total: CacheStats
    layers: dict[int, tuple[int, int]]  # covered layer -> (hits, misses)


def snapshot(ctx: Any, n_layer: int) -> CacheSnapshot:
    """Every counter at once (what /metrics reads at a scrape). The engine thread bumps
    them after each small batch: 8-byte counters, read whole."""
    layers = {il: st for il in range(n_layer) if (st := layer_stats(ctx, il)) is not None}
    return CacheSnapshot(stats(ctx), layers)


def reset_stats(ctx: Any) -> None:
    _lib().llama_moe_cache_reset_stats(ctx)
