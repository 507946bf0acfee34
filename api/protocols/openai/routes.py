"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/responses, /v1/models.

A generating route is a codec around the one pipeline: it decodes its API's body into a
`GenerationRequest` (`chat`, `completions`, `responses` beside this module), `prepare`
(api.pipeline.prepare) validates, renders, tokenizes and queues it, and
`api.pipeline.respond` streams or collects the generation back through the same codec.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from api.pipeline.prepare import prepare
from api.pipeline.respond import json_response, respond
from api.protocols.openai.chat import ChatCodec
from api.protocols.openai.completions import CompletionCodec
from api.protocols.openai.responses import ResponsesCodec
from api.protocols.openai.responses_wire import RESPONSES_DECODER
from api.protocols.openai.schemas import (
    CHAT_DECODER,
    COMPLETION_DECODER,
    ModelCard,
    ModelList,
    SamplingDefaultsCard,
)
from api.server.auth import client_of
from api.server.body import read_json
from api.server.state import server_state, working_state


async def chat_completions(request: Request) -> Response:
    state = working_state(request)
    codec = ChatCodec(state, await read_json(request, CHAT_DECODER, state.settings.limits))
    gen = await prepare(state, codec.decode(), client_of(request.scope))
    return await respond(request, gen, codec)


async def completions(request: Request) -> Response:
    state = working_state(request)
    codec = CompletionCodec(
        state, await read_json(request, COMPLETION_DECODER, state.settings.limits)
    )
    gen = await prepare(state, codec.decode(), client_of(request.scope))
    return await respond(request, gen, codec)


async def responses(request: Request) -> Response:
    """Stateless: `store` is accepted and nothing is kept, so any replica can answer."""
    state = working_state(request)
    codec = ResponsesCodec(
        state, await read_json(request, RESPONSES_DECODER, state.settings.limits)
    )
    with codec.api_names():
        gen = await prepare(state, codec.decode(), client_of(request.scope))
    return await respond(request, gen, codec)


async def list_models(request: Request) -> Response:
    state = server_state(request)
    d = state.sampling_defaults
    sampling = SamplingDefaultsCard(
        d.temperature, d.top_k, d.top_p, d.min_p, d.repetition_penalty, dict(d.sources)
    )
    cards = [ModelCard(name, state.created, max_model_len=state.max_model_len,
                       sampling_defaults=sampling) for name in sorted(state.aliases)]  # fmt: skip
    return json_response(ModelList(cards))
