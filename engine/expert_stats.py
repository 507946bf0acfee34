"""What the router's pick counts say about a placement (pure; no llama.cpp).

`ExpertLayout` is where each layer's routed experts live: the bytes of one expert (its
gate, up and down slices) and the share of those bytes on the GPU. llama.cpp places whole
expert tensors (all experts of a layer's gate, up or down), so a pick of expert e in layer
L is served from the GPU for exactly that layer's GPU share of bytes; the GPU pick share is
the picks weighted that way.

The hot-set figure answers what a finer, traffic-following placement would gain: fill the
same VRAM the GPU holds for experts today with individual experts, the most picked per
byte first, and report the share of picks they would have served.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec
import numpy as np

from engine.plan import expert_layer


class ExpertLayout(msgspec.Struct, frozen=True):
    n_expert: int
    expert_bytes: tuple[int, ...]  # per layer: one expert's bytes over its tensors
    gpu_fraction: tuple[float, ...]  # per layer: share of its expert bytes on the GPU

    @property
    def gpu_bytes(self) -> int:
        return round(
            sum(
                b * self.n_expert * f
                for b, f in zip(self.expert_bytes, self.gpu_fraction, strict=True)
            )
        )


def layout_of(
    tensors: Iterable[tuple[str, int]], n_layer: int, n_expert: int, on_gpu: Callable[[str], bool]
) -> ExpertLayout:
    """The layout of (name, bytes) tensors where `on_gpu(name)` says which are on the GPU."""
    total = [0] * n_layer
    gpu = [0] * n_layer
    for name, nbytes in tensors:
        layer = expert_layer(name)
        if not 0 <= layer < n_layer:
            continue
        total[layer] += nbytes
        if on_gpu(name):
            gpu[layer] += nbytes
    return ExpertLayout(
        n_expert=n_expert,
        expert_bytes=tuple(t // max(1, n_expert) for t in total),
        gpu_fraction=tuple(g / t if t else 0.0 for g, t in zip(gpu, total, strict=True)),
    )


class TopExpert(msgspec.Struct, frozen=True):
    layer: int
    expert: int
    picks: int
    share: float  # of all picks


class ExpertReport(msgspec.Struct, frozen=True):
    sampled_steps: int
    picks: int
    gpu_picks: float  # picks weighted by the GPU share of their layer's expert bytes
    gpu_pick_share: float
    gpu_expert_bytes: int  # VRAM the layout gives routed experts
    hot_set_experts: int  # experts a per-expert hot set of that VRAM would hold
    hot_set_pick_share: float  # share of picks it would serve
    picks_per_layer: tuple[int, ...]
    top: tuple[TopExpert, ...]


def report(
    counts: np.ndarray, layout: ExpertLayout, *, sampled_steps: int, top: int = 20
) -> ExpertReport:
    """Summarise pick counts [n_layer, n_expert] against a layout."""
    counts = np.asarray(counts, dtype=np.int64)
    per_layer = counts.sum(axis=1)
    total = int(per_layer.sum())
    gpu = float(per_layer @ np.asarray(layout.gpu_fraction, dtype=np.float64))
    flat = counts.ravel()
    order = np.argsort(-flat, kind="stable")[:top]
    n_expert = counts.shape[1]
    tops = tuple(
        TopExpert(
            int(i // n_expert),
            int(i % n_expert),
            int(flat[i]),
            float(flat[i] / total) if total else 0.0,
        )
        for i in order
        if flat[i] > 0
    )
    hot_n, hot_share = _hot_set(counts, layout)
    return ExpertReport(
        sampled_steps=sampled_steps,
        picks=total,
        gpu_picks=gpu,
        gpu_pick_share=gpu / total if total else 0.0,
        gpu_expert_bytes=layout.gpu_bytes,
        hot_set_experts=hot_n,
        hot_set_pick_share=hot_share,
        picks_per_layer=tuple(int(v) for v in per_layer),
        top=tops,
    )


def _hot_set(counts: np.ndarray, layout: ExpertLayout) -> tuple[int, float]:
    """Experts chosen most-picks-per-byte first into the GPU's expert bytes: (how many,
    share of picks they serve)."""
    size = np.repeat(np.asarray(layout.expert_bytes, dtype=np.float64), counts.shape[1])
    picks = counts.ravel().astype(np.float64)
    total = picks.sum()
    if total == 0 or layout.gpu_bytes == 0:
        return 0, 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        value = np.where(size > 0, picks / size, 0.0)
    order = np.argsort(-value, kind="stable")
    order = order[(size[order] > 0) & (picks[order] > 0)]  # dense layers, unpicked experts
    fits = np.cumsum(size[order]) <= layout.gpu_bytes
    chosen = order[fits]
    return int(chosen.size), float(picks[chosen].sum() / total)
