"""Anthropic's routes: /v1/messages and /v1/messages/count_tokens.

The same shape as the OpenAI routes (api.protocols.openai.routes): the body decoded by
its codec (`messages`, `input` beside this module) into the one internal request,
`prepare` (api.pipeline.prepare) queues it, `api.pipeline.respond` streams or collects it
back through the codec — so the prefix cache, the lanes, fair share, the limits and the
metrics apply as they do there. Only the errors differ: whatever a route raises is answered in
Anthropic's envelope (api.protocols.anthropic.wire), which its SDKs read into typed errors.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from api.pipeline.prepare import count_tokens, prepare
from api.pipeline.respond import json_response, respond
from api.protocols.anthropic.input import counted
from api.protocols.anthropic.messages import MessagesCodec
from api.protocols.anthropic.wire import (
    COUNT_TOKENS_DECODER,
    MESSAGES_DECODER,
    TokenCount,
    error_response,
)
from api.server.auth import client_of
from api.server.body import read_json
from api.server.errors import APIError, ClientGone
from api.server.state import working_state

log = logging.getLogger(__name__)
Endpoint = Callable[[Request], Awaitable[Response]]


def anthropic_errors(route: Endpoint) -> Endpoint:
    """`route`, its errors answered in Anthropic's envelope (what is not an APIError, a
    bug, the app logs and answers as a 500, in the path's envelope too)."""

    @functools.wraps(route)
    async def answer(request: Request) -> Response:
        try:
            return await route(request)
        except APIError as e:
            if isinstance(e, ClientGone):
                log.info("%s", e.message)
            return error_response(e)

    return answer


@anthropic_errors
async def messages(request: Request) -> Response:
    state = working_state(request)
    codec = MessagesCodec(state, await read_json(request, MESSAGES_DECODER, state.settings.limits))
    gen = await prepare(state, codec.decode(), client_of(request.scope))
    return await respond(request, gen, codec)


@anthropic_errors
async def messages_count_tokens(request: Request) -> Response:
    """The prompt's tokens as the model reads them: rendered and tokenized, not queued."""
    state = working_state(request)
    body = await read_json(request, COUNT_TOKENS_DECODER, state.settings.limits)
    prompts = await count_tokens(state, counted(state, body))
    return json_response(TokenCount(len(prompts[0].ids)))
