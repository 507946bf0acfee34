"""A generation back to its client over HTTP, for any API: a stream of server-sent events,
or one body once every choice has finished.

What the frames and the body say is the route's codec's (api.protocols.openai.chat, …); what is
shared is when the work stops: a stream aborts its sequences when the response closes,
for whatever reason; a body is collected while a listener watches for the client to go
(499, nobody reads it), and a choice the server could not finish makes the whole
response an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from api.pipeline.generation import Generation, failure
from api.pipeline.output_blocks import ChoiceAnswer
from api.server.disconnect import EventStreamResponse, run_until_disconnect
from api.server.wire import ENCODER

CLIENT_GONE = 499


class Codec(Protocol):
    """A route's encoder: its API's stream frames or body for a generation."""

    stream: bool

    def frames(self, gen: Generation) -> AsyncIterator[bytes]: ...

    def body(self, gen: Generation, answers: list[ChoiceAnswer]) -> object: ...


def json_response(obj: object, status: int = 200) -> Response:
    return Response(ENCODER.encode(obj), status_code=status, media_type="application/json")


async def respond(request: Request, gen: Generation, codec: Codec) -> Response:
    """Stream `codec`'s frames, or collect every choice into its body; abort on disconnect."""
    if codec.stream:
        return EventStreamResponse(codec.frames(gen), on_close=gen.abort)
    answers: list[ChoiceAnswer] = []

    async def work() -> None:
        answers.extend(await gen.answers())

    try:
        done = await run_until_disconnect(request.receive, work)
    finally:
        gen.abort()
    if not done:  # the client left; nobody reads this
        return Response(status_code=CLIENT_GONE)
    if (err := failure(answers)) is not None:
        raise err
    return json_response(codec.body(gen, answers))
