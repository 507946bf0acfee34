"""What KV holds and costs: the pool's cells (used, reserved, cached, capacity), the prefix
cache's reads and evictions, and preemption — swapped to host RAM or thrown away to be
recomputed."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from api.server.metrics.families import ByLane
from scheduler.stats import StepStats


class KVMetrics:
    def __init__(self, r: CollectorRegistry, lane_gauge: ByLane) -> None:
        self.kv_used = lane_gauge("onegpu_kv_cache_used_cells", "KV cells held by sequences")
        self.kv_capacity = lane_gauge("onegpu_kv_cache_capacity_cells", "KV cells in the pool")
        self.kv_reserved = lane_gauge(
            "onegpu_kv_cache_reserved_cells",
            "KV cells the running requests will still take (rest of their prompts, expected "
            "growth): what admission keeps free for them",
        )
        self.kv_cached = lane_gauge(
            "onegpu_kv_cache_cached_cells",
            "Of the used KV cells, those of the prefix cache (counted once, however many "
            "requests read them)",
        )
        self.prefix_query = Counter(
            "onegpu_prefix_cache_query_tokens",
            "Prompt tokens of new requests that looked up the prefix cache", registry=r,
        )  # fmt: skip
        self.prefix_hit = Counter(
            "onegpu_prefix_cache_hit_tokens",
            "Of those, tokens read from the cache instead of computed", registry=r,
        )  # fmt: skip
        self.prefix_evicted = Counter(
            "onegpu_prefix_cache_evicted_cells",
            "Cached KV cells given back to the pool (least recently used first)", registry=r,
        )  # fmt: skip
        self.preemptions = Counter(
            "onegpu_preemptions",
            "Requests preempted for KV space, by what kept their work: swap (KV saved to host "
            "RAM, restored on resume) or recompute",
            ["kind"], registry=r,
        )  # fmt: skip
        self.swapped_bytes = Counter(
            "onegpu_swapped_bytes", "KV bytes copied to (out) and from (in) host RAM",
            ["direction"], registry=r,
        )  # fmt: skip
        for kind in ("swap", "recompute"):  # both series from the start, at 0
            self.preemptions.labels(kind=kind)
        for direction in ("out", "in"):
            self.swapped_bytes.labels(direction=direction)
        self.swap_time = Counter(
            "onegpu_swap_seconds", "Engine time copying KV to and from host RAM", registry=r
        )
        self.swap_used = lane_gauge(
            "onegpu_swap_space_used_cells", "KV cells of preempted requests held in host RAM"
        )
        self.swap_capacity = lane_gauge(
            "onegpu_swap_space_capacity_cells", "KV cells the host-RAM swap space holds"
        )
        self.recomputed = Counter(
            "onegpu_recomputed_tokens",
            "Computed tokens preemption threw away, to be computed again on resume",
            registry=r,
        )

    def observe(self, s: StepStats) -> None:
        lane = s.lane
        self.kv_used.labels(lane=lane).set(s.kv_used)
        self.kv_capacity.labels(lane=lane).set(s.kv_capacity)
        self.kv_reserved.labels(lane=lane).set(s.kv_reserved)
        self.kv_cached.labels(lane=lane).set(s.kv_cached)
        if s.prefix_query_tokens:
            self.prefix_query.inc(s.prefix_query_tokens)
            self.prefix_hit.inc(s.prefix_hit_tokens)
        if s.prefix_evicted_cells:
            self.prefix_evicted.inc(s.prefix_evicted_cells)
        if s.num_recomputed_tokens:
            self.recomputed.inc(s.num_recomputed_tokens)
        if s.num_preempted:
            self.preemptions.labels(kind="swap").inc(s.num_swapped_out)
            self.preemptions.labels(kind="recompute").inc(s.num_preempted - s.num_swapped_out)
        if s.swap_out_bytes or s.swap_in_bytes:
            self.swapped_bytes.labels(direction="out").inc(s.swap_out_bytes)
            self.swapped_bytes.labels(direction="in").inc(s.swap_in_bytes)
            self.swap_time.inc(s.swap_s)
        self.swap_used.labels(lane=lane).set(s.swap_used_cells)
        self.swap_capacity.labels(lane=lane).set(s.swap_capacity_cells)
