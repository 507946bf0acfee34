"""The server's OpenAPI 3.1 document, served at `GET /openapi.json`.

The schemas are generated from the msgspec Structs the routes decode and encode, at
runtime, so the document cannot drift from what the server accepts: a field added to
`api.protocols.openai.schemas` appears here with its type and range (`Meta`) without
touching this file. It reads every protocol's wire types, and only those: the catalogue of
the protocols, beside them rather than in one (api.server.app mounts it).
Only the paths — which route answers which status, in which media type — are written out,
because they live in the route code rather than in a type.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from api.protocols.anthropic.wire import (
    EVENT_TYPES,
    AnthropicError,
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    TokenCount,
)
from api.protocols.anthropic.wire import StreamEvent as AnthropicEvent
from api.protocols.openai.responses_wire import Response as ResponseObject
from api.protocols.openai.responses_wire import ResponsesRequest
from api.protocols.openai.responses_wire import StreamEvent as ResponsesEvent
from api.protocols.openai.schemas import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ModelList,
)
from api.server.wire import ErrorBody
from engine.expert_stats import ExpertReport

OPENAPI_VERSION = "3.1.0"
REF = "#/components/schemas/{name}"
DIST = "deepseek-one-gpu"  # the distribution in pyproject.toml: the document's version
TITLE = "one-gpu OpenAI-compatible API"
JSON = "application/json"
SSE = "text/event-stream"

# What each error status of a generation route means; every one is an OpenAI error body.
GENERATION_ERRORS: tuple[tuple[int, str], ...] = (
    (400, "Invalid request: malformed JSON, a field of the wrong type or out of range, a "
          "prompt that does not fit the context, or a field the server does not serve."),
    (401, "Missing or wrong `Authorization: Bearer` key (only when the server has one)."),
    (404, "The `model` is not one this server serves."),
    (408, "The request body did not arrive within the server's time limit."),
    (413, "The request body is larger than the server accepts."),
    (429, "The waiting queue is full; retry after `Retry-After` seconds."),
    (500, "Generation failed in the backend."),
    (503, "The server is shutting down."),
)  # fmt: skip
READ_ERRORS = GENERATION_ERRORS[1:2]  # GET /v1/models: only the key can be wrong
# Anthropic's routes: its error envelope, and 529 where the OpenAI routes answer 503
MESSAGES_ERRORS: tuple[tuple[int, str], ...] = (
    *((status, why) for status, why in GENERATION_ERRORS if status != 503),
    (529, "The server is loading or shutting down: overloaded, retry shortly."),
)


def _optional_bearer() -> list[dict[str, list[str]]]:
    """/v1 routes want `Authorization: Bearer KEY` only when the server has a key."""
    return [{"bearerAuth": []}, {}]


def _optional_key() -> list[dict[str, list[str]]]:
    """Anthropic's clients send the key as `x-api-key`; the server takes either header."""
    return [{"apiKeyAuth": []}, {"bearerAuth": []}, {}]


def _health() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"status": {"type": "string", "enum": ["ok", "unavailable"]}},
        "required": ["status"],
    }


def _liveness() -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"status": {"type": "string", "const": "alive"}},
        "required": ["status"],
    }


def _top() -> dict[str, Any]:
    return {
        "name": "top",
        "in": "query",
        "required": False,
        "description": "How many of the most picked experts to list.",
        "schema": {"type": "integer", "minimum": 0, "maximum": 10_000, "default": 20},
    }


def _response(description: str, content: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`content` maps a media type to its schema."""
    return {
        "description": description,
        "content": {media: {"schema": schema} for media, schema in content.items()},
    }


def _errors(statuses: tuple[tuple[int, str], ...], error: dict[str, Any]) -> dict[str, Any]:
    return {str(status): _response(why, {JSON: error}) for status, why in statuses}


def _event(chunk: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event: before OpenAPI 3.2 (`itemSchema`), an event-stream's schema
    describes each event, as an object of its fields."""
    return {
        "type": "object",
        "properties": {
            "data": {
                "description": "A chunk as JSON; an error body as JSON when generation fails "
                "after the first frame; `[DONE]` last.",
                "anyOf": [
                    {"const": "[DONE]"},
                    {
                        "type": "string",
                        "contentMediaType": JSON,
                        "contentSchema": {"anyOf": [chunk, error]},
                    },
                ],
            },
            "event": {"type": "string"},
        },
        "required": ["data"],
    }


def _generation(
    operation_id: str, summary: str, schemas: tuple[dict[str, Any], ...], error: dict[str, Any]
) -> dict[str, Any]:
    """A generation route: a JSON body in; a JSON body out, or server-sent events when
    `stream` is true."""
    request, body, chunk = schemas
    ok = _response(
        "The completion (`stream: false`), or server-sent events (`stream: true`).",
        {JSON: body, SSE: _event(chunk, error)},
    )
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "tags": ["openai"],
            "security": _optional_bearer(),
            "requestBody": {"required": True, "content": {JSON: {"schema": request}}},
            "responses": {"200": ok, **_errors(GENERATION_ERRORS, error)},
        }
    }


def _messages(schemas: tuple[dict[str, Any], ...], error: dict[str, Any]) -> dict[str, Any]:
    """POST /v1/messages: a message, or its events (`event:` names the data's `type`)."""
    request, message, events = schemas
    stream = {
        "type": "object",
        "properties": {
            "event": {"type": "string", "enum": list(EVENT_TYPES)},
            "data": {"type": "string", "contentMediaType": JSON, "contentSchema": events},
        },
        "required": ["event", "data"],
    }
    ok = _response(
        "The message (`stream: false`), or server-sent events (`stream: true`).",
        {JSON: message, SSE: stream},
    )
    return _post("createMessage", "Create a message (Anthropic's Messages API)", request, ok,
                 error)  # fmt: skip


def _post(
    operation_id: str, summary: str, request: dict[str, Any], ok: dict[str, Any],
    error: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    """An Anthropic route: its JSON body in, its error envelope out."""
    return {
        "post": {
            "operationId": operation_id,
            "summary": summary,
            "tags": ["anthropic"],
            "security": _optional_key(),
            "requestBody": {"required": True, "content": {JSON: {"schema": request}}},
            "responses": {"200": ok, **_errors(MESSAGES_ERRORS, error)},
        }
    }


def _get(operation_id: str, summary: str, tag: str, **fields: Any) -> dict[str, Any]:
    return {"get": {"operationId": operation_id, "summary": summary, "tags": [tag], **fields}}


def openapi_document(title: str, version: str) -> dict[str, Any]:
    """The whole document, as JSON-ready builtins (schemas under #/components/schemas)."""
    types = (
        ChatCompletionRequest, ChatCompletion, ChatCompletionChunk,
        CompletionRequest, Completion,
        ModelList, ErrorBody, ExpertReport,
        ResponsesRequest, ResponseObject, ResponsesEvent,
        MessagesRequest, MessageResponse, AnthropicEvent, CountTokensRequest, TokenCount,
        AnthropicError,
    )  # fmt: skip
    refs, components = msgspec.json.schema_components(types, ref_template=REF)
    chat, completion, (models, error, experts) = refs[0:3], refs[3:5], refs[5:8]
    responses, messages = refs[8:11], refs[11:14]
    count_request, count, anthropic_error = refs[14:17]
    paths = {
        "/v1/chat/completions": _generation(
            "createChatCompletion", "Create a chat completion", chat, error
        ),
        "/v1/completions": _generation(
            # a completion stream's frames are Completion objects
            "createCompletion",
            "Create a text completion",
            (*completion, completion[1]),
            error,
        ),
        "/v1/responses": _generation(
            # stream frames are typed events (`event:` names the type), no `[DONE]`
            "createResponse",
            "Create a model response (stateless)",
            responses,
            error,
        ),
        "/v1/models": _get(
            "listModels",
            "The served model, under each name it answers to",
            "openai",
            security=_optional_bearer(),
            responses={
                "200": _response("The models.", {JSON: models}),
                **_errors(READ_ERRORS, error),
            },
        ),
        "/v1/messages": _messages(messages, anthropic_error),
        "/v1/messages/count_tokens": _post(
            "countMessageTokens",
            "Count a message request's input tokens (rendered and tokenized, not generated)",
            count_request,
            _response("The prompt's tokens.", {JSON: count}),
            anthropic_error,
        ),
        "/health": _get(
            "health",
            "Readiness: 200 while the engine loop runs, 503 once it drains",
            "operations",
            responses={
                "200": _response("Serving.", {JSON: _health()}),
                "503": _response("Not serving: draining or stopped.", {JSON: _health()}),
            },
        ),
        "/livez": _get(
            "livez",
            "Liveness: 200 while the process answers, loading and draining too (/health is "
            "readiness)",
            "operations",
            responses={"200": _response("Alive.", {JSON: _liveness()})},
        ),
        "/metrics": _get(
            "metrics",
            "Prometheus metrics",
            "operations",
            responses={
                "200": _response("Text exposition format.", {"text/plain": {"type": "string"}})
            },
        ),
        "/experts": _get(
            "experts",
            "MoE router telemetry: the most picked experts, the GPU's share of picks",
            "operations",
            parameters=[_top()],
            responses={
                "200": _response("The report.", {JSON: experts}),
                **_errors(((400, "Telemetry is off, or `top` is out of range."),), error),
            },
        ),
        "/openapi.json": _get(
            "openapi",
            "This document",
            "operations",
            responses={"200": _response("The OpenAPI 3.1 document.", {JSON: {"type": "object"}})},
        ),
    }
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer"},
                "apiKeyAuth": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            },
        },
    }


def _version() -> str:
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "0+unknown"


async def openapi_json(request: Request) -> Response:
    """`GET /openapi.json`: built on first use and kept on `app.state` — the Structs do not
    change while the process runs."""
    state = request.app.state
    body: bytes | None = getattr(state, "openapi_json", None)
    if body is None:
        body = msgspec.json.encode(openapi_document(TITLE, _version()))
        state.openapi_json = body
    return Response(body, media_type=JSON)
