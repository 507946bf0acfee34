"""Expert telemetry over HTTP: `GET /experts` and the `one-gpu experts` client.

The counts come from `engine.expert_tap` (sampled steps' router choices); what they mean
for the current placement, and for a per-expert hot set of the same VRAM, from
`engine.expert_stats`. The endpoint sits beside /metrics, outside /v1: it is an operator's
view, not part of the OpenAI API.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from dataclasses import dataclass

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.errors import InvalidRequest
from api.state import server_state
from engine.expert_stats import ExpertLayout, ExpertReport, report
from engine.expert_tap import ExpertTap

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ExpertTelemetry:
    tap: ExpertTap
    layout: ExpertLayout

    def report(self, top: int = 20) -> ExpertReport:
        return report(
            self.tap.counts.copy(), self.layout, sampled_steps=self.tap.sampled_steps, top=top
        )


async def experts(request: Request) -> Response:
    telemetry = server_state(request).experts
    if telemetry is None:
        raise InvalidRequest(
            "expert telemetry is off: serve an MoE model with --expert-sample-rate > 0"
        )
    try:
        top = int(request.query_params.get("top", "20"))
    except ValueError:
        raise InvalidRequest("top must be an integer", param="top") from None
    if not 0 <= top <= 10_000:
        raise InvalidRequest("top must be in [0, 10000]", param="top")
    body = msgspec.json.encode(telemetry.report(top))
    return Response(body, media_type="application/json")


def fetch_report(url: str, top: int) -> ExpertReport:
    """GET a server's /experts (the `one-gpu experts` client)."""
    with urllib.request.urlopen(f"{url.rstrip('/')}/experts?top={top}", timeout=30) as resp:
        return msgspec.json.decode(resp.read(), type=ExpertReport)


def format_report(r: ExpertReport) -> str:
    """The report as an operator reads it: shares first, then the most picked experts."""
    gib = r.gpu_expert_bytes / 2**30
    lines = [
        f"sampled steps {r.sampled_steps}, expert picks {r.picks}",
        f"picks served by GPU-resident expert tensors: {r.gpu_pick_share:.1%}",
        f"a per-expert hot set of the same VRAM ({gib:.2f} GiB, {r.hot_set_experts} experts) "
        f"would serve: {r.hot_set_pick_share:.1%}",
        "",
        f"{'layer':>5} {'expert':>6} {'picks':>10} {'share':>7}",
    ]
    lines += [f"{t.layer:>5} {t.expert:>6} {t.picks:>10} {t.share:>7.2%}" for t in r.top]
    return "\n".join(lines)


def report_json(r: ExpertReport) -> str:
    return json.dumps(msgspec.to_builtins(r), indent=2)
