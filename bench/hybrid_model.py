"""A cost model of hybrid decode: a step's time from the bytes each device reads and the
host round trips of the layers whose experts live in RAM, with four constants fitted to
measured rows of `bench.expert_cache_ab` on one card.

A decode step of B users computes every layer once for the B rows. Per MoE layer, the
distinct experts the B rows pick are read once each (d(B) = n (1 - (1 - k/n)^B) of the n
experts, k picked a row, picks independent: an upper bound under skewed or local routing);

- a layer whose experts are resident on the GPU reads them from VRAM;
- a cached layer reads its hits (a share h of the picks) from VRAM and its misses from
  host RAM, on the CPU; a layer in RAM without a cache reads them all on the CPU;
- every layer with experts in RAM pays a host round trip: ggml runs a layer's GPU part
  and its CPU part one after the other, with a synchronisation and two small copies between
  them — today even where every pick hit (`split_all_hit=False` models the change that
  skips the CPU part of such a layer, which then pays it only when some pick missed).

    t(B) = t0 + g * gpu_bytes(B) + c * cpu_bytes(B) + m * mapped_bytes(B) + r * round_trips(B)

t0: the step's fixed cost (graph launch, sampling, the scheduler); g and c: seconds a byte
on each side (the inverse of the effective bandwidths); m: a byte the CPU reads from the
model file mapped into memory (llama-server's default: 4 KB pages of the page cache, placed
wherever the kernel put them) rather than read into a buffer of the server's own (ours,
page-locked) — the same kernels, but on two hosts the same layout ran 1.2x faster mapped on
one and 1.2x slower on the other, so it is a constant of its own; r: one round trip. All
are fitted by non-negative least squares to the per-user decode rates of measured rows (a
step's time is the inverse of a user's rate); non-expert weights (attention, dense layers,
shared experts, the output head) are read on the GPU every step. Uploads into the cache
overlap the next step (patch 0005) and are not counted.

    python -m bench.hybrid_model --fit cache-ab.json --model SLICE.gguf   # fit, check
    python -m bench.hybrid_model --constants FIT.json --reference           # the 763B model
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.gguf_meta import ModelMeta
from engine.plan import expert_layer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Shape:
    """What decode reads, per the model's header: bytes of one routed expert (gate, up
    and down), the non-expert bytes read every step, the MoE layers and their routing."""

    n_moe: int
    n_expert: int
    k: int
    expert_bytes: float
    other_bytes: float

    @classmethod
    def of(cls, meta: ModelMeta) -> Shape:
        experts = [t for t in meta.tensors if expert_layer(t.name) >= 0]
        layers = {expert_layer(t.name) for t in experts}
        expert_total = sum(t.nbytes for t in experts)
        # the token embedding is a row lookup, not a read of the whole matrix
        other = sum(t.nbytes for t in meta.tensors if expert_layer(t.name) < 0
                    and t.name != "token_embd.weight")  # fmt: skip
        return cls(n_moe=len(layers), n_expert=meta.n_expert, k=meta.n_expert_used,
                   expert_bytes=expert_total / (len(layers) * meta.n_expert),
                   other_bytes=float(other))  # fmt: skip

    def distinct(self, users: int) -> float:
        """Distinct experts a layer's B rows pick (independent picks)."""
        return self.n_expert * (1 - (1 - self.k / self.n_expert) ** users)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a model's MoE layers keep their routed experts: `resident` layers on the GPU,
    `cached` layers in RAM with a cache serving a share `hit` of their picks, the rest
    (`in_ram`) in RAM without one."""

    resident: float
    cached: int = 0
    in_ram: float = 0.0
    hit: float = 0.0
    misses_on_gpu: bool = False  # the cached layers' misses read by the GPU over the bus
    mapped: bool = False  # the experts in RAM read from the mapped file (llama-server's)


@dataclass(frozen=True, slots=True)
class Constants:
    t0: float  # s a step
    g: float  # s a byte read on the GPU
    c: float  # s a byte read on the CPU
    m: float  # s a byte read on the CPU from the mapped file
    r: float  # s a host round trip

    def describe(self) -> str:
        def rate(s_per_byte: float) -> float:
            return 1 / s_per_byte / 1e9 if s_per_byte else math.inf

        mapped = f", CPU mapped {rate(self.m):.1f} GB/s" if self.m else ""
        return (f"t0 {self.t0 * 1e3:.2f} ms, GPU {rate(self.g):.0f} GB/s, CPU "
                f"{rate(self.c):.1f} GB/s{mapped}, round trip {self.r * 1e6:.0f} us")  # fmt: skip


# What a GPU kernel reads from page-locked host memory in place, a byte (bench/zero_copy.cu
# on an H100: 46-51 GB/s, the copy engine's rate): a miss computed on the GPU (patch 0006)
BUS_S_PER_BYTE = 1 / 50e9


def bus_bytes(shape: Shape, layout: Layout, users: int) -> float:
    """What the GPU reads over the bus a step when the cached layers' misses are its (every
    missed pick read once: its kernels give each token's pick a warp of its own)."""
    if not layout.misses_on_gpu:
        return 0.0
    return layout.cached * (1 - layout.hit) * users * shape.k * shape.expert_bytes


def terms(
    shape: Shape, layout: Layout, users: int, split_all_hit: bool = True
) -> tuple[float, float, float, float, float]:
    """A step's (1, GPU bytes, CPU bytes, CPU bytes of a mapped file, round trips): the
    coefficients of t0, g, c, m, r. With the misses on the GPU a cached layer has neither
    CPU bytes nor a round trip (its bus bytes are priced by `bus_bytes`)."""
    d = shape.distinct(users)
    e = shape.expert_bytes
    gpu = shape.other_bytes + (layout.resident + layout.cached * layout.hit) * d * e
    trips_in_ram = math.ceil(layout.in_ram - 1e-9)  # a layer partly in RAM: a whole trip
    if layout.misses_on_gpu:
        cpu, cached_trips = layout.in_ram * d * e, 0.0
    else:
        cpu = (layout.cached * (1 - layout.hit) + layout.in_ram) * d * e
        picks = users * shape.k  # a cached layer skips its CPU part only when all of them hit
        cached_trips = layout.cached * (1.0 if split_all_hit else 1 - layout.hit**picks)
    read, mapped = (0.0, cpu) if layout.mapped else (cpu, 0.0)
    return 1.0, gpu, read, mapped, cached_trips + trips_in_ram


def step_time(
    k: Constants, shape: Shape, layout: Layout, users: int, split_all_hit: bool = True
) -> float:
    one, gpu, cpu, mapped, trips = terms(shape, layout, users, split_all_hit)
    bus = BUS_S_PER_BYTE * bus_bytes(shape, layout, users)
    return k.t0 * one + k.g * gpu + k.c * cpu + k.m * mapped + k.r * trips + bus


def breakdown(k: Constants, shape: Shape, layout: Layout, users: int) -> dict[str, float]:
    """Seconds of a step each constant accounts for: which one dominates (a miss read by
    the GPU over the bus counted with the CPU's reads)."""
    one, gpu, cpu, mapped, trips = terms(shape, layout, users)
    bus = BUS_S_PER_BYTE * bus_bytes(shape, layout, users)
    return {"fixed": k.t0 * one, "GPU reads": k.g * gpu,
            "CPU reads": k.c * cpu + k.m * mapped + bus, "round trips": k.r * trips}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Row:
    """One measured row: a layout, its users, and one user's decode rate (tokens/s)."""

    label: str
    layout: Layout
    users: int
    per_user_tok_s: float


def fit(shape: Shape, rows: Sequence[Row]) -> Constants:
    """Non-negative least squares on relative error: each row's step time weighted by its
    inverse, so fast and slow rows count alike."""
    a = np.array([terms(shape, r.layout, r.users) for r in rows], dtype=np.float64)
    t = np.array([1.0 / r.per_user_tok_s for r in rows])
    a, t = a / t[:, None], np.ones_like(t)
    scale = a.max(axis=0)
    scale[scale == 0] = 1.0
    x = _nnls(a / scale, t) / scale
    return Constants(*(float(v) for v in x))


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| with x >= 0 (Lawson-Hanson active set; a has a handful of columns)."""
    n = a.shape[1]
    passive: list[int] = []
    x = np.zeros(n)
    for _ in range(3 * n):
        w = a.T @ (b - a @ x)
        free = [j for j in range(n) if j not in passive]
        if not free or max(w[j] for j in free) <= 1e-12:
            break
        passive.append(max(free, key=lambda j: w[j]))
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if all(z[j] > 0 for j in passive):
                x = z
                break
            neg = [j for j in passive if z[j] <= 0]
            alpha = min(x[j] / (x[j] - z[j]) for j in neg)
            x = x + alpha * (z - x)
            passive = [j for j in passive if x[j] > 1e-15]
    return x


def rows_of(results: list[dict[str, Any]]) -> list[Row]:
    """Rows from `bench.expert_cache_ab --json`: each layout's split as the run reported it,
    the cache's hit share of each N's own load where the run measured it."""
    out = []
    for v in results:
        lay = v.get("split")
        if not lay:
            continue
        hits = {int(n): float(h) for n, h in v.get("hit_by_users", {}).items()}
        for n, rates in v["per_user"].items():
            layout = Layout(**lay)
            if layout.cached and int(n) in hits:
                layout = dataclasses.replace(layout, hit=hits[int(n)])
            out.append(Row(f"{v['routing']}, {v['layout']}", layout, int(n),
                           float(np.median(rates))))  # fmt: skip
    return out


def check(k: Constants, shape: Shape, rows: Sequence[Row]) -> str:
    """Predicted vs measured, a row each (per-user tok/s)."""
    out = ["| row | N | measured | model | model / measured |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        pred = 1 / step_time(k, shape, r.layout, r.users)
        out.append(f"| {r.label} | {r.users} | {r.per_user_tok_s:.1f} | {pred:.1f} | "
                   f"{pred / r.per_user_tok_s:.2f} |")  # fmt: skip
    return "\n".join(out)


# The LRU hit curve of a real model's traffic (llama.cpp pull request #27861: a Qwen MoE of
# 512 experts, 10 used): the share of a layer's experts cached, the share of picks served.
# bench.skew_router's `measured` preset is matched to it.
MEASURED_CURVE = ((0.125, 0.67), (0.25, 0.81))


def measured_hit(fraction: float) -> float:
    """The curve's hit share at `fraction` of a layer's experts cached, log-linear in the
    fraction through its two points (capped at 1, and at the fraction itself from below)."""
    (f0, h0), (f1, h1) = MEASURED_CURVE
    if fraction <= 0:
        return 0.0
    h = h0 + (h1 - h0) * math.log2(fraction / f0) / math.log2(f1 / f0)
    return min(1.0, max(fraction, h))


def reference(k: Constants, vram_gb: float = 96.0, ram_gb: float = 280.0) -> str:
    """The 763B reference model (bench.reference_model) on a card of `vram_gb`: the
    planner's split of its experts, the measured curve's hit share in the cached layers,
    the output rate at 1 and 8 users, and where a step's time goes — beside whole layers
    (llama.cpp's placement of the same VRAM) and the change that skips the CPU part of a
    layer whose picks all hit."""
    import msgspec

    from bench.reference_model import GB, REFERENCE_OPTS, deepseek_like
    from engine.plan import AUTO, Budgets, make_plan

    meta = deepseek_like()
    shape = Shape.of(meta)
    budgets = Budgets(vram=int(vram_gb * GB), ram=int(ram_gb * GB))
    cache = make_plan(meta, budgets, msgspec.structs.replace(REFERENCE_OPTS, cache_slots=AUTO))
    whole = make_plan(meta, budgets, REFERENCE_OPTS)
    sp = cache.split
    assert sp is not None
    hit = measured_hit(sp.slots / meta.n_expert)
    cached = Layout(resident=len(sp.resident), cached=len(sp.cached), hit=hit)
    resident = whole.expert_layers_on_gpu
    layers = Layout(resident=resident, in_ram=shape.n_moe - resident)
    gpu_share = (len(sp.resident) + len(sp.cached) * hit) / shape.n_moe
    out = [
        f"{meta.name} on {vram_gb:g} GB of VRAM: {len(sp.resident)} resident layers and "
        f"{sp.slots} slots in each of {len(sp.cached)} cached layers; the measured curve "
        f"serves {hit:.1%} of a cached layer's picks ({gpu_share:.1%} of all picks on the "
        f"GPU). Whole layers: {resident} of {shape.n_moe} on the GPU. Constants: "
        f"{k.describe()}. A model, not a measurement.",
        "",
        "| layout | users | tok/s | per user | fixed | GPU reads | host reads | round trips |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    on_gpu = dataclasses.replace(cached, misses_on_gpu=True)
    rows = [("whole layers", layers, True), ("cache", cached, True),
            ("cache, all-hit layers skip the CPU", cached, False),
            ("cache, misses read by the GPU over the bus", on_gpu, True)]  # fmt: skip
    for label, layout, split in rows:
        for users in (1, 8):
            t = step_time(k, shape, layout, users, split)
            parts = breakdown(k, shape, layout, users)
            if not split:
                parts["round trips"] = t - sum(v for n, v in parts.items() if n != "round trips")
            cells = " | ".join(f"{v * 1e3:.1f} ms" for v in parts.values())
            out.append(f"| {label} | {users} | {users / t:.1f} | {1 / t:.1f} | {cells} |")
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fit", type=Path, help="bench.expert_cache_ab --json output")
    p.add_argument("--model", type=Path, help="the GGUF those rows measured")
    p.add_argument("--out", type=Path, help="write the fitted constants here")
    p.add_argument("--constants", type=Path, help="fitted constants (--out of a fit)")
    p.add_argument("--reference", action="store_true", help="predict the 763B model")
    p.add_argument("--vram-gb", type=float, default=96.0)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from engine.gguf_meta import read_meta

    if a.fit and a.model:
        shape = Shape.of(read_meta(a.model))
        rows = rows_of(json.loads(a.fit.read_text()))
        k = fit(shape, rows)
        print(k.describe())
        print(check(k, shape, rows))
        if a.out:
            a.out.write_text(json.dumps(asdict(k)))
    elif a.constants:
        k = Constants(**{"m": 0.0, **json.loads(a.constants.read_text())})  # (fits before m)
    else:
        p.error("--fit with --model, or --constants")
    if a.reference:
        print(reference(k, a.vram_gb))


if __name__ == "__main__":
    main()
