"""The router telemetry a server holds: the tap's sampled counts, read against the
placement's expert layout (`engine.expert_stats`). Below the API: the server state holds
one, the `/experts` route reads it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.expert_stats import ExpertLayout, ExpertReport, report
from engine.expert_tap import ExpertTap


@dataclass(frozen=True, slots=True)
class ExpertTelemetry:
    tap: ExpertTap
    layout: ExpertLayout

    def report(self, top: int = 20) -> ExpertReport:
        return report(
            self.tap.counts.copy(), self.layout, sampled_steps=self.tap.sampled_steps, top=top
        )
