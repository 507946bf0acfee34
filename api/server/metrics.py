"""Prometheus metrics: the only module that imports prometheus_client.

Fed one `StepStats` per scheduler step; every series is prefixed `onegpu_`. Queue and KV
gauges carry the lane (`fast`, `reproducible`); the step-shape histograms and the cost model
describe the fast lane's shared steps, and each lane's step time is counted on its own. The registry
belongs to the app (no global default registry), so several apps can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from engine.expert_stats import ExpertReport
from engine.moe_cache import CacheSnapshot
from scheduler.stats import FAST, StepStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_STEP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_SEQS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


class Metrics:
    def __init__(self, model_name: str, lanes: tuple[str, ...] = (FAST,)) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        lane_gauge, lane_counter = self._by_lane(Gauge, lanes), self._by_lane(Counter, lanes)
        self.running = lane_gauge("onegpu_requests_running", "Requests holding a sequence now")
        self.waiting = lane_gauge("onegpu_requests_waiting", "Requests queued for a sequence")
        self.kv_used = lane_gauge("onegpu_kv_cache_used_cells", "KV cells held by sequences")
        self.kv_capacity = lane_gauge("onegpu_kv_cache_capacity_cells", "KV cells in the pool")
        self.kv_reserved = lane_gauge(
            "onegpu_kv_cache_reserved_cells",
            "KV cells the running requests will still take (rest of their prompts, expected "
            "growth): what admission keeps free for them",
        )
        self.http_responses = Counter(
            "onegpu_http_responses", "HTTP responses by route and status code",
            ["route", "code"], registry=r,
        )  # fmt: skip
        self.lane_requests = lane_counter(
            "onegpu_lane_requests", "Requests accepted, by numerics lane"
        )
        self.lane_steps = lane_counter("onegpu_lane_steps", "Engine steps run, by lane")
        self.lane_step_time = lane_counter("onegpu_lane_step_seconds", "Engine step time, by lane")
        self.prompt_tokens = Counter(
            "onegpu_prompt_tokens",
            "Prompt tokens of requests that got their first token (cached ones included)",
            registry=r,
        )
        self.prefill_tokens = Counter(
            "onegpu_prefill_tokens",
            "Prompt tokens computed (not read from the prefix cache; recomputation included)",
            registry=r,
        )
        self.side_prefill_tokens = Counter(
            "onegpu_side_prefill_tokens",
            "Of the prompt tokens computed, those a second context prefilled beside the "
            "decoders' steps (--side-prefill-ctx), counted when their KV came back",
            registry=r,
        )  # fmt: skip
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
        self.generated_tokens = Counter("onegpu_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "onegpu_requests_finished",
            "Finished requests by reason (stop, length, abort, error)",
            ["finish_reason"],
            registry=r,
        )
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
        self.kv_wait = Histogram(
            "onegpu_request_kv_wait_seconds",
            "Per finished request, the time it waited in the queue while KV kept it out",
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.recomputed = Counter(
            "onegpu_recomputed_tokens",
            "Computed tokens preemption threw away, to be computed again on resume",
            registry=r,
        )
        self.ttft = Histogram(
            "onegpu_time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY,
            registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "onegpu_inter_token_latency_seconds", "Gap between a request's successive tokens",
            buckets=_ITL, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "onegpu_e2e_request_latency_seconds", "Arrival to finish", buckets=_LATENCY,
            registry=r,
        )  # fmt: skip
        self.queue = Histogram(
            "onegpu_request_queue_time_seconds", "Arrival to first scheduled", buckets=_LATENCY,
            registry=r,
        )  # fmt: skip
        self.step_tokens = Histogram(
            "onegpu_step_tokens", "Tokens submitted per step", buckets=_TOKENS, registry=r
        )
        self.step_prompt_tokens = Histogram(
            "onegpu_step_prompt_tokens", "Prompt-chunk tokens per step (steps with any)",
            buckets=_TOKENS, registry=r,
        )  # fmt: skip
        self.max_gap = Histogram(
            "onegpu_request_max_token_gap_seconds",
            "Per finished request, its longest gap between two tokens: the stall it saw",
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        Gauge(
            "onegpu_loading",
            "1 while the model loads: the server listens before it serves",
            registry=r,
        ).set(0)
        self.cost_model = Gauge(
            "onegpu_cost_model_seconds",
            "The scheduler's learned step-time model: decode_step_s + decode_token_s * D + "
            "decode_kv_cell_s * the KV cells decoders attend; per prompt token prompt_token_s "
            "+ prompt_token_per_kv_cell_s * KV depth; per chunk prompt_chunk_per_kv_cell_s * "
            "the KV span it attends over; per physical batch carrying a prompt prompt_batch_s",
            ["term"], registry=r,
        )  # fmt: skip
        self.cost_bias = Gauge(
            "onegpu_cost_model_bias",
            "The stall policy's correction: measured / modelled time of recent steps it "
            "planned; chunks are sized for --max-stall-ms divided by it",
            registry=r,
        )
        self.cost_headroom = Gauge(
            "onegpu_cost_model_headroom",
            "The share of --max-stall-ms a step is planned to beyond the correction: room "
            "for the 99.5th percentile of how far recent steps landed from their plan",
            registry=r,
        )
        self.step_seqs = Histogram(
            "onegpu_step_sequences", "Sequences sharing one step", buckets=_SEQS, registry=r
        )
        self.step_time = Histogram(
            "onegpu_step_duration_seconds", "Whole step: schedule, decode, sample, postprocess",
            buckets=_STEP, registry=r,
        )  # fmt: skip
        self.decode_time = Histogram(
            "onegpu_step_decode_seconds", "Time inside llama_decode per step", buckets=_STEP,
            registry=r,
        )  # fmt: skip
        self.python_time = Histogram(
            "onegpu_step_python_seconds",
            "Per step, time outside llama_decode: batch fill, sampling, detokenization, streaming",
            buckets=_STEP, registry=r,
        )  # fmt: skip
        self.phase_time = Counter(
            "onegpu_step_phase_seconds",
            "Step time by phase: schedule, fill (batch + sampler setup), decode (llama_decode), "
            "mask_wait (after decoding, for constrained sequences' token masks), sample, gil "
            "(the engine thread waiting for Python's GIL after its native step), postprocess "
            "(detokenize, stops, fan-out), other (thread hand-off, waits)",
            ["phase"],
            registry=r,
        )
        phases = (
            "schedule", "fill", "decode", "mask_wait", "sample", "gil", "postprocess", "other",
        )  # fmt: skip
        self.grammar_masks = Counter(
            "onegpu_grammar_masks", "Token masks computed for constrained sequences",
            registry=r,
        )  # fmt: skip
        self.grammar_mask_time = Counter(
            "onegpu_grammar_mask_seconds",
            "Time computing them (on the mask thread, while the step decodes)",
            registry=r,
        )
        self._phases = {p: self.phase_time.labels(phase=p) for p in phases}
        # The same for steps without prompt tokens only: a pure decode step is what
        # llama-batched-bench's S_TG times, and prompt steps would blur the comparison.
        self.decode_steps = Counter(
            "onegpu_decode_steps", "Steps that carried no prompt tokens", registry=r
        )
        decode_phase_time = Counter(
            "onegpu_decode_step_phase_seconds",
            "onegpu_step_phase_seconds over the steps without prompt tokens only",
            ["phase"],
            registry=r,
        )
        self._decode_phases = {p: decode_phase_time.labels(phase=p) for p in phases}
        info = Gauge("onegpu_model_info", "The served model", ["model"], registry=r)
        info.labels(model=model_name).set(1)

    def set_placement(
        self, placed: dict[str, tuple[int, int]], budgets: dict[str, int] | None
    ) -> None:
        """Where the weights live: `placed[device] = (bytes, tensors)` for "gpu" and
        "ram"; `budgets[device]` the plan's budgets when a plan decided the layout."""
        r = self.registry
        size = Gauge("onegpu_placement_bytes", "Weight bytes by device", ["device"], registry=r)
        count = Gauge(
            "onegpu_placement_tensors", "Weight tensors by device", ["device"], registry=r
        )
        for device, (nbytes, n) in placed.items():
            size.labels(device=device).set(nbytes)
            count.labels(device=device).set(n)
        if budgets:
            budget = Gauge(
                "onegpu_plan_budget_bytes", "The placement plan's memory budgets", ["device"],
                registry=r,
            )  # fmt: skip
            for device, v in budgets.items():
                budget.labels(device=device).set(v)

    def set_weight_buffers(self, by_buffer: dict[str, int]) -> None:
        """Weight bytes by llama.cpp buffer as the load allocated them (engine.weight_buffers):
        `CUDA_Host` is page-locked host memory, `CPU` plain, `CPU_Mapped` the mapped file."""
        size = Gauge("onegpu_weight_buffer_bytes", "Weight bytes by llama.cpp buffer",
                     ["buffer"], registry=self.registry)  # fmt: skip
        for name, nbytes in by_buffer.items():
            size.labels(buffer=name).set(nbytes)

    def add_expert_telemetry(self, source: Callable[[], ExpertReport]) -> None:
        """Expert pick counters, read from `source` at each scrape (engine.expert_tap)."""
        self.registry.register(_AtScrape(lambda: _expert_series(source())))

    def add_expert_cache(
        self, source: Callable[[], CacheSnapshot], slots: int, layers: int
    ) -> None:
        """The routed-expert cache's counters, read from `source` at each scrape."""
        self.registry.register(_AtScrape(lambda: _cache_series(source())))
        Gauge("onegpu_expert_cache_slots", "Experts a layer the routed-expert cache holds",
              registry=self.registry).set(slots)  # fmt: skip
        Gauge("onegpu_expert_cache_layers", "Layers in host RAM the routed-expert cache covers",
              registry=self.registry).set(layers)  # fmt: skip

    def _by_lane(self, kind: Any, lanes: tuple[str, ...]) -> Any:
        """A maker of `kind` families labelled by lane, each lane's series there at zero."""

        def make(name: str, doc: str) -> Any:
            family = kind(name, doc, ["lane"], registry=self.registry)
            for lane in lanes:
                family.labels(lane=lane)
            return family

        return make

    def observe(self, s: StepStats) -> None:
        lane = s.lane
        self.running.labels(lane=lane).set(s.num_running)
        self.waiting.labels(lane=lane).set(s.num_waiting)
        self.kv_used.labels(lane=lane).set(s.kv_used)
        self.kv_capacity.labels(lane=lane).set(s.kv_capacity)
        self.kv_reserved.labels(lane=lane).set(s.kv_reserved)
        self.kv_cached.labels(lane=lane).set(s.kv_cached)
        if s.num_step_prompt_tokens:
            self.prefill_tokens.inc(s.num_step_prompt_tokens)
        if s.aside_prompt_tokens:
            self.prefill_tokens.inc(s.aside_prompt_tokens)
            self.side_prefill_tokens.inc(s.aside_prompt_tokens)
        if s.prefix_query_tokens:
            self.prefix_query.inc(s.prefix_query_tokens)
            self.prefix_hit.inc(s.prefix_hit_tokens)
        if s.prefix_evicted_cells:
            self.prefix_evicted.inc(s.prefix_evicted_cells)
        if s.num_recomputed_tokens:
            self.recomputed.inc(s.num_recomputed_tokens)
        if s.num_prompt_tokens:
            self.prompt_tokens.inc(s.num_prompt_tokens)
        if s.num_generated_tokens:
            self.generated_tokens.inc(s.num_generated_tokens)
        if s.num_preempted:
            self.preemptions.labels(kind="swap").inc(s.num_swapped_out)
            self.preemptions.labels(kind="recompute").inc(s.num_preempted - s.num_swapped_out)
        if s.swap_out_bytes or s.swap_in_bytes:
            self.swapped_bytes.labels(direction="out").inc(s.swap_out_bytes)
            self.swapped_bytes.labels(direction="in").inc(s.swap_in_bytes)
            self.swap_time.inc(s.swap_s)
        self.swap_used.labels(lane=lane).set(s.swap_used_cells)
        self.swap_capacity.labels(lane=lane).set(s.swap_capacity_cells)
        if s.num_step_tokens:
            self.lane_steps.labels(lane=lane).inc()
            self.lane_step_time.labels(lane=lane).inc(s.step_s)
            if lane == FAST:
                self._observe_shared_step(s)
        for v in s.ttft_s:
            self.ttft.observe(v)
        for v in s.itl_s:
            self.itl.observe(v)
        for v in s.queue_s:
            self.queue.observe(v)
        for f in s.finished:
            self.finished.labels(finish_reason=f.finish_reason).inc()
            self.e2e.observe(f.e2e_s)
            self.kv_wait.observe(f.kv_wait_s)
            if f.max_gap_s is not None:
                self.max_gap.observe(f.max_gap_s)

    def _observe_shared_step(self, s: StepStats) -> None:
        if s.num_step_prompt_tokens:
            self.step_prompt_tokens.observe(s.num_step_prompt_tokens)
        for term, v in s.chunk_policy.items():
            if term == "correction":
                self.cost_bias.set(v)
            elif term == "headroom":
                self.cost_headroom.set(v)
            else:
                self.cost_model.labels(term=term).set(v)
        self.step_tokens.observe(s.num_step_tokens)
        self.step_seqs.observe(s.num_step_seqs)
        self.step_time.observe(s.step_s)
        self.decode_time.observe(s.decode_s)
        self.python_time.observe(max(0.0, s.step_s - s.decode_s))
        parts = {
            "schedule": s.schedule_s,
            "fill": s.fill_s,
            "decode": s.decode_s,
            "mask_wait": s.mask_wait_s,
            "sample": s.sample_s,
            "gil": s.gil_s,
            "postprocess": s.postprocess_s,
        }
        parts["other"] = max(0.0, s.step_s - sum(parts.values()))
        for phase, v in parts.items():
            self._phases[phase].inc(v)
        if s.masks:
            self.grammar_masks.inc(s.masks)
            self.grammar_mask_time.inc(s.mask_s)
        if s.num_step_prompt_tokens == 0:
            self.decode_steps.inc()
            for phase, v in parts.items():
                self._decode_phases[phase].inc(v)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _AtScrape:
    """A collector whose series `series()` makes when Prometheus scrapes."""

    def __init__(self, series: Callable[[], Iterator[Metric]]) -> None:
        self.series = series

    def describe(self) -> list[Metric]:
        return []  # series are known only at collect time; nothing to check at register

    def collect(self) -> Iterator[Metric]:
        return self.series()


def _by_label(name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    """A counter family with one series per value of `label`."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, count in values.items():
        family.add_metric([value], count)
    return family


def _expert_series(r: ExpertReport) -> Iterator[Metric]:
    """The sampled router counts as series."""
    yield _by_label(
        "onegpu_expert_picks",
        "Sampled expert picks by where the expert's weights live (a layer split between "
        "devices counts by its share of bytes)",
        "residence", {"gpu": r.gpu_picks, "ram": r.picks - r.gpu_picks},
    )  # fmt: skip
    yield GaugeMetricFamily(
        "onegpu_expert_gpu_pick_share",
        "Share of sampled expert picks served by GPU-resident expert tensors",
        value=r.gpu_pick_share,
    )
    yield GaugeMetricFamily(
        "onegpu_expert_hot_set_pick_share",
        "Share a per-expert hot set of the same VRAM would serve (the most picked experts)",
        value=r.hot_set_pick_share,
    )
    yield CounterMetricFamily(
        "onegpu_expert_sampled_steps", "Steps whose router choices were read",
        value=r.sampled_steps,
    )  # fmt: skip


def _cache_series(snap: CacheSnapshot) -> Iterator[Metric]:
    """The routed-expert cache's counters (engine.moe_cache) as series."""
    st = snap.total
    yield _by_label(
        "onegpu_expert_cache_picks",
        "Routed picks of cached layers in small batches: served from the GPU's cache (hit) "
        "or from host RAM (miss)",
        "result", {"hit": st.hits, "miss": st.misses},
    )  # fmt: skip
    per_layer = CounterMetricFamily(
        "onegpu_expert_cache_layer_picks", "The same picks by layer", labels=["layer", "result"]
    )
    for il, (hits, misses) in snap.layers.items():
        per_layer.add_metric([str(il), "hit"], hits)
        per_layer.add_metric([str(il), "miss"], misses)
    yield per_layer
    yield CounterMetricFamily(
        "onegpu_expert_cache_uploads", "Experts copied into the cache", value=st.uploads
    )
    yield CounterMetricFamily(
        "onegpu_expert_cache_upload_bytes", "Bytes copied into the cache",
        value=st.upload_bytes,
    )  # fmt: skip
