"""The app's metrics: one registry (no global default, so several apps can live in one
process) holding a collector for each thing measured, fed one `StepStats` per scheduler
step and rendered at /metrics.

Queue and KV gauges carry the lane (`fast`, `reproducible`); the step-shape histograms and
the cost model describe the fast lane's shared steps, and each lane's step time is counted
on its own. Experts (`add_expert_telemetry`, `add_expert_cache`) are read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from api.server.metrics import experts
from api.server.metrics.families import by_lane
from api.server.metrics.kv import KVMetrics
from api.server.metrics.process import ProcessMetrics
from api.server.metrics.requests import RequestMetrics
from api.server.metrics.steps import StepMetrics
from engine.expert_stats import ExpertReport
from engine.moe_cache import CacheSnapshot
from scheduler.stats import FAST, StepStats

CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model_name: str, lanes: tuple[str, ...] = (FAST,)) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        lane_gauge, lane_counter = by_lane(Gauge, r, lanes), by_lane(Counter, r, lanes)
        self.requests = RequestMetrics(r, lane_gauge, lane_counter)
        self.kv = KVMetrics(r, lane_gauge)
        self.steps = StepMetrics(r, lane_counter)
        self.process = ProcessMetrics(r, model_name)

    def observe(self, s: StepStats) -> None:
        self.requests.observe(s)
        self.kv.observe(s)
        self.steps.observe(s)

    def add_expert_telemetry(self, source: Callable[[], ExpertReport]) -> None:
        experts.add_expert_telemetry(self.registry, source)

    def add_expert_cache(
        self, source: Callable[[], CacheSnapshot], slots: int, layers: int
    ) -> None:
        experts.add_expert_cache(self.registry, source, slots, layers)

    def render(self) -> bytes:
        return generate_latest(self.registry)
