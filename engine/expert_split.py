"""How the VRAM routed experts get is split between whole resident layers and a cache of
single experts for the layers left in host RAM (pure; the cache is patch 0002,
`engine.moe_cache`).

Every token picks `n_expert_used` experts in every MoE layer, so each layer carries the
same share of picks. A resident layer serves all of its picks from the GPU; a cache of S
slots in each of the other layers serves the share `hit(S)` of theirs, for S + pad expert
slices a layer (the patch keeps `n_expert_used` zero pad slots beside the cached ones). The
split that serves the largest expected share of picks is chosen, enumerating the number of
resident layers (taken from the last layer down, as the planner places them) and giving
what is left to slots; on a tie, more resident layers (no uploads, no PCIe traffic).

`hit(S)` is the pick model. Measured routing (the router telemetry's per-layer pick
counts) gives the share of a layer's picks its S most picked experts take: what a cache
holding exactly those would serve; skewed routing makes slots worth more than resident
layers. Uniform routing gives S / n_expert: per byte a slot is worth what a resident expert
is, less the pad, so the model alone would keep whole layers. But exactly uniform routing
is the worst case, not a likely one: routers are uneven (even a random model's: 32 of 128
slots caught 57% of its picks), and a cache follows whatever the unevenness is, where a
resident layer serves exactly its share. On an H100 (docs/benchmarks.md "Expert cache"),
that random model's own routing, the VRAM of 15 of 48 layers: 32 slots in every layer
served 57% of picks, the resident layers 30%, and decoding ran 1.2-1.5x faster; with 27
layers' VRAM 81% vs 55%, 1.3-2.1x. So where nothing is measured yet (`cache_everywhere`),
every layer left in RAM gets slots; a server's saved counts then choose the split.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np


class PickModel(msgspec.Struct, frozen=True):
    """`curve[s]`: the share of one layer's picks that `s` slots serve (s = 0..n_expert);
    empty: uniform routing."""

    n_expert: int
    curve: tuple[float, ...] = ()

    def hit(self, slots: int) -> float:
        s = max(0, min(slots, self.n_expert))
        if not self.curve:
            return s / self.n_expert if self.n_expert else 0.0
        return self.curve[s]

    @property
    def uniform(self) -> bool:
        return not self.curve


class PickCounts(msgspec.Struct, frozen=True):
    """A server's router pick counts, as `one-gpu experts --save-counts` writes them."""

    counts: list[list[int]]  # [layer][expert]; dense layers all zero


def load_picks(data: bytes) -> PickModel:
    """The pick model of saved counts (msgspec.ValidationError, a ValueError, if malformed)."""
    counts = msgspec.json.decode(data, type=PickCounts).counts
    if not counts or len({len(row) for row in counts}) != 1 or not counts[0]:
        raise ValueError("pick counts must be a non-empty [layer][expert] table")
    return picks_model(np.asarray(counts, dtype=np.int64))


def picks_model(counts: np.ndarray) -> PickModel:
    """The pick model of measured counts [n_layer, n_expert]: per layer, the cumulative
    share of its most picked experts, averaged over the layers that were picked (each
    layer carries the same share of picks)."""
    counts = np.asarray(counts, dtype=np.float64)
    totals = counts.sum(axis=1)
    picked = counts[totals > 0]
    n_expert = counts.shape[1]
    if picked.size == 0:
        return PickModel(n_expert)
    ordered = -np.sort(-picked, axis=1)
    cum = np.cumsum(ordered, axis=1) / picked.sum(axis=1, keepdims=True)
    curve = np.concatenate([[0.0], cum.mean(axis=0)])
    curve[-1] = 1.0
    return PickModel(n_expert, tuple(float(v) for v in curve))


class ExpertSplit(msgspec.Struct, frozen=True):
    resident: tuple[int, ...]  # MoE layers whose experts are all on the GPU
    cached: tuple[int, ...]  # MoE layers in host RAM, each with `slots` cached experts
    slots: int  # 0: no cache
    pad: int  # zero slots a cached layer adds (n_expert_used)
    bank_bytes: int  # VRAM of the cache's slots, pads included
    expected_share: float  # of all picks, served by the GPU (resident or cached)
    uniform_share: float  # the same under uniform routing

    @property
    def resident_share(self) -> float:
        n = len(self.resident) + len(self.cached)
        return len(self.resident) / n if n else 0.0


def split_experts(
    layer_bytes: dict[int, int],
    n_expert: int,
    n_expert_used: int,
    free: int,
    model: PickModel,
    slots: int | None = None,
) -> ExpertSplit:
    """The best split of `free` bytes of VRAM over MoE layers of `layer_bytes` (all of a
    layer's routed expert tensors) under `model`; `slots` fixes the cache's size (0: none;
    then the most layers that leave room for it stay resident)."""
    order = sorted(layer_bytes, reverse=True)
    n = len(order)
    uniform = PickModel(n_expert)
    cap = n_expert if slots is None else max(0, min(slots, n_expert))
    best: tuple[float, int, int] | None = None  # (share, resident, slots)
    spent = 0
    for r in range(n + 1):
        if r:
            spent += layer_bytes[order[r - 1]]
        if spent > free:
            break
        fits = _slots(order[r:], layer_bytes, n_expert, n_expert_used, free - spent, cap)
        if slots is not None and fits < cap and r < n:
            continue  # a fixed size: only splits that hold it (or every layer resident)
        share = _share(r, n - r, fits, model)
        if best is None or share > best[0] + 1e-12 or (share >= best[0] - 1e-12 and r > best[1]):
            best = (share, r, fits)
    if best is None:  # a fixed size that no split holds
        best = (0.0, 0, 0)
    share, r, slots = best
    host = order[r:]
    bank = sum(layer_bytes[i] // n_expert * (slots + n_expert_used) for i in host) if slots else 0
    return ExpertSplit(
        resident=tuple(sorted(order[:r])), cached=tuple(sorted(host)) if slots else (),
        slots=slots, pad=n_expert_used if slots else 0, bank_bytes=bank,
        expected_share=share, uniform_share=_share(r, n - r, slots, uniform),
    )  # fmt: skip


def cache_everywhere(
    layer_bytes: dict[int, int], n_expert: int, n_expert_used: int, free: int
) -> int:
    """The slots a layer when no MoE layer is resident and `free` bytes go to the cache
    (0 where not one slot beside the pads fits): the split for unmeasured routing."""
    return _slots(list(layer_bytes), layer_bytes, n_expert, n_expert_used, free, n_expert)


def _slots(
    host: Sequence[int], layer_bytes: dict[int, int], n_expert: int, pad: int, room: int, cap: int
) -> int:
    """Slots a layer that `room` bytes give every host layer (each layer its own slice
    size), or 0 if not even one slot beside the pads fits."""
    if not host or n_expert == 0:
        return 0
    per_slot = sum(layer_bytes[i] // n_expert for i in host)
    slots = room // per_slot - pad if per_slot else 0
    return int(max(0, min(slots, cap)))


def _share(resident: int, host: int, slots: int, model: PickModel) -> float:
    n = resident + host
    return (resident + host * model.hit(slots)) / n if n else 0.0
