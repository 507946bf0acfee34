"""What the collectors share: the histograms' buckets, and families labelled by lane."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry

LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
STEP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
SEQS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)

ByLane = Callable[[str, str], Any]  # (name, doc) -> a family labelled by lane


def by_lane(kind: Any, registry: CollectorRegistry, lanes: tuple[str, ...]) -> ByLane:
    """A maker of `kind` families labelled by lane, each lane's series there at zero."""

    def make(name: str, doc: str) -> Any:
        family = kind(name, doc, ["lane"], registry=registry)
        for lane in lanes:
            family.labels(lane=lane)
        return family

    return make
