"""`GET /livez`: liveness, kept apart from readiness (`/health`).

/health says whether to send new work: 503 while the model loads and while the server
drains. An orchestrator that restarted a process on that 503 would kill a server that is
loading for minutes or finishing its requests, and the restart would load it all again.
/livez answers 200 for as long as the process runs and its event loop takes requests —
loading, serving and draining alike — so only a process that stopped answering is
restarted (a liveness probe's job; Kubernetes' `/livez` naming).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

ALIVE = {"status": "alive"}


async def livez(request: Request) -> Response:
    """Answered on the event loop itself, and without touching the engine: the loop
    answering is what liveness means here."""
    return JSONResponse(ALIVE)
