"""MoE experts at scrape time: the router's sampled picks (engine.expert_tap) and the
routed-expert cache's hits, misses and uploads (engine.moe_cache). Both are read when
Prometheus scrapes, from counters the engine thread bumps, not fed per step."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.expert_stats import ExpertReport
from engine.moe_cache import CacheSnapshot


def add_expert_telemetry(registry: CollectorRegistry, source: Callable[[], ExpertReport]) -> None:
    """Expert pick counters, read from `source` at each scrape (engine.expert_tap)."""
    registry.register(_AtScrape(lambda: _expert_series(source())))


def add_expert_cache(
    registry: CollectorRegistry, source: Callable[[], CacheSnapshot], slots: int, layers: int
) -> None:
    """The routed-expert cache's counters, read from `source` at each scrape."""
    registry.register(_AtScrape(lambda: _cache_series(source())))
    Gauge("onegpu_expert_cache_slots", "Experts a layer the routed-expert cache holds",
          registry=registry).set(slots)  # fmt: skip
    Gauge("onegpu_expert_cache_layers", "Layers in host RAM the routed-expert cache covers",
          registry=registry).set(layers)  # fmt: skip


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
