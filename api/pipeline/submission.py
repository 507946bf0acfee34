"""A request's sequences into the scheduler's queue: all of them or none, within bounds.

Admission comes first, before any work: a request whose prompts × choices exceed what one
client may ever queue is a 400 (retrying could never help); one that does not fit the
queue, or its client's share of it, now is a 429. While its prompts are tokenized its
sequences count against the client's share as if they waited, so a client cannot keep the
prompt workers busy with requests the queue would refuse. Submission then queues them
together (the queue may have filled meanwhile: 429), unless the server began to drain (503).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from api.server.errors import InvalidRequest, ServerBusy, ServiceUnavailable
from api.server.state import ServerState
from scheduler.core import QueueFull
from scheduler.request import Request, RequestOutput


@contextmanager
def admission(
    state: ServerState, lane: str, client: str, n_sequences: int, param: str = "n"
) -> Iterator[None]:
    """Room for `n_sequences` of `client` in `lane`, held while the body runs (`param`:
    the field a too-large request is refused by)."""
    key = (lane, client)
    most = state.loop.max_group(lane)
    if n_sequences > most:
        raise InvalidRequest(
            f"this request needs {n_sequences} sequences (prompts × n); one request may "
            f"queue at most {most} (half of --max-waiting)",
            param=param,
        )
    try:
        state.loop.check_room(client, n_sequences + state.preparing[key], lane)
    except QueueFull as e:
        raise ServerBusy(f"server busy: {e}; retry shortly", retry_after_s=1) from e
    state.preparing[key] += n_sequences
    try:
        yield
    finally:
        state.preparing[key] -= n_sequences
        if not state.preparing[key]:
            del state.preparing[key]


def submit(
    state: ServerState, lane: str, sequences: list[Request]
) -> list[asyncio.Queue[RequestOutput]]:
    """Queue every sequence, or none; their output streams, in the same order."""
    if state.draining:
        raise ServiceUnavailable("the server is shutting down; retry on another instance")
    try:
        queues = state.loop.add_group(sequences, lane)
    except QueueFull as e:
        raise ServerBusy(f"server busy: {e}; retry shortly", retry_after_s=1) from e
    state.metrics.requests.lane_requests.labels(lane=lane).inc()
    return queues
