"""`GET /experts`: the server's router telemetry (`engine.expert_telemetry`).

The counts come from `engine.expert_tap` (sampled steps' router choices); what they mean
for the current placement, and for a per-expert hot set of the same VRAM, from
`engine.expert_stats`. The endpoint sits beside /metrics, outside /v1: it is an operator's
view, not part of the OpenAI API. Its client is `api.server.experts_client`.
"""

from __future__ import annotations

import logging

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.server.errors import InvalidRequest
from api.server.state import server_state
from engine.expert_split import PickCounts
from engine.expert_telemetry import ExpertTelemetry

log = logging.getLogger(__name__)


def _telemetry(request: Request) -> ExpertTelemetry:
    telemetry = server_state(request).experts
    if telemetry is None:
        raise InvalidRequest(
            "expert telemetry is off: serve an MoE model with --expert-sample-rate > 0"
        )
    return telemetry


async def experts(request: Request) -> Response:
    telemetry = _telemetry(request)
    try:
        top = int(request.query_params.get("top", "20"))
    except ValueError:
        raise InvalidRequest("top must be an integer", param="top") from None
    if not 0 <= top <= 10_000:
        raise InvalidRequest("top must be in [0, 10000]", param="top")
    body = msgspec.json.encode(telemetry.report(top))
    return Response(body, media_type="application/json")


async def expert_counts(request: Request) -> Response:
    """`GET /experts/counts`: the sampled pick counts [layer][expert], the file
    `one-gpu plan|serve --pick-counts` sizes the routed-expert cache from."""
    counts = _telemetry(request).tap.counts.copy()
    body = msgspec.json.encode(PickCounts(counts=counts.astype("int64").tolist()))
    return Response(body, media_type="application/json")
