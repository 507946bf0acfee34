"""Anthropic's Messages API on the wire: the bodies it sends and receives, its stream's
events, its error envelope (https://docs.anthropic.com/en/api/messages).

Block and event kinds are msgspec tagged unions on `type`, so a block of a kind the API
does not have, or one missing a field, is a 400 naming where it is, from the decoder
that parses the JSON. Kinds the API has and this server cannot serve (images and
documents: the model reads text) decode, so that api.protocols.anthropic.input can refuse them
by name. Fields that do not change the output (`metadata`, `cache_control`,
`service_tier`) are accepted and ignored.

Errors are the server's typed errors (api.server.errors) in Anthropic's envelope,
`{"type": "error", "error": {"type", "message"}}`: the class decides the status and type,
and, Anthropic's body having no `param`, the field the error names (in Anthropic's
spelling: the pipeline names fields as OpenAI does) leads the message. Draining and
loading (503) become 529 `overloaded_error`, the status Anthropic's clients retry as
"try again shortly".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct
from starlette.responses import Response

from api.server.errors import (
    APIError,
    ModelNotFound,
    NotReproducible,
    PayloadTooLarge,
    RequestTimeout,
    RouteNotFound,
    ServerBusy,
    ServiceUnavailable,
    Unauthorized,
)
from api.server.errors import error_response as openai_error_response
from api.server.wire import ENCODER

PREFIX = "/v1/messages"  # every Anthropic route's path starts so (api.server.auth answers in kind)


# ---- request --------------------------------------------------------------------------
class TextBlock(Struct, tag="text", tag_field="type", kw_only=True):
    text: str
    cache_control: Any = None
    citations: Any = None


class ImageBlock(Struct, tag="image", tag_field="type", kw_only=True):
    source: Any = None
    cache_control: Any = None


class DocumentBlock(Struct, tag="document", tag_field="type", kw_only=True):
    source: Any = None
    cache_control: Any = None


class ToolUseBlock(Struct, tag="tool_use", tag_field="type", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


ResultPart = TextBlock | ImageBlock | DocumentBlock


class ToolResultBlock(Struct, tag="tool_result", tag_field="type", kw_only=True):
    tool_use_id: str
    content: str | list[ResultPart] | None = None
    is_error: bool = False
    cache_control: Any = None


class ThinkingBlock(Struct, tag="thinking", tag_field="type", kw_only=True):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Struct, tag="redacted_thinking", tag_field="type", kw_only=True):
    data: str


InputBlock = (
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
    | RedactedThinkingBlock
)  # fmt: skip


class InputMessage(Struct, kw_only=True):
    """A turn. `system` is not Anthropic's (its system prompt has a field of its own),
    but Claude Code sends one mid-conversation to a model it does not know as Claude's."""

    role: Literal["user", "assistant", "system"]
    content: str | list[InputBlock]


class ToolSpec(Struct, kw_only=True):
    """A client tool (`type` absent or `custom`); Anthropic's server tools (web search,
    code execution …) have a type of their own and are refused by it."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None
    cache_control: Any = None
    strict: bool | None = None


class ToolChoiceAuto(Struct, tag="auto", tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(Struct, tag="any", tag_field="type", kw_only=True):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(Struct, tag="tool", tag_field="type", kw_only=True):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(Struct, tag="none", tag_field="type", kw_only=True):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone
Display = Literal["summarized", "omitted"] | None


class ThinkingEnabled(Struct, tag="enabled", tag_field="type", kw_only=True):
    budget_tokens: Annotated[int, Meta(ge=1)]  # no budget is kept: the model thinks as it does
    display: Display = None


class ThinkingAdaptive(Struct, tag="adaptive", tag_field="type", kw_only=True):
    display: Display = None


class ThinkingDisabled(Struct, tag="disabled", tag_field="type", kw_only=True):
    pass


Thinking = ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled


class JsonOutputFormat(Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, kw_only=True):
    format: JsonOutputFormat | None = None
    effort: str | None = None  # a hint this server has no use for


class MessagesInput(Struct, kw_only=True):
    """What a request renders into the prompt: all a token count reads."""

    model: str
    messages: Annotated[list[InputMessage], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    # the server's lane flag, as on its OpenAI routes (api.pipeline.lanes)
    strata_reproducible: str | None = None
    # Anthropic's server-side features: refused by name when they ask for something
    mcp_servers: Any = None
    container: Any = None


class MessagesRequest(MessagesInput, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    stream: bool = False
    metadata: Any = None
    service_tier: Any = None
    cache_control: Any = None
    # Claude Code's edits (`clear_thinking_…`): earlier thinking is never rendered, so
    # clearing it is what happens anyway; other edits are accepted and not applied
    context_management: Any = None


class CountTokensRequest(MessagesInput, kw_only=True):
    cache_control: Any = None


MESSAGES_DECODER = msgspec.json.Decoder(MessagesRequest)
COUNT_TOKENS_DECODER = msgspec.json.Decoder(CountTokensRequest)


# ---- response -------------------------------------------------------------------------
class TextContent(Struct, tag="text", tag_field="type"):
    text: str


class ThinkingContent(Struct, tag="thinking", tag_field="type"):
    thinking: str
    signature: str  # opaque; the server reads no thinking back, so checks none


class ToolUseContent(Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


Content = TextContent | ThinkingContent | ToolUseContent
StopReason = Literal[
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
]


class MessageUsage(Struct):
    """Anthropic counts a prompt's tokens in three parts that add up to it: computed
    (`input_tokens`), read from the cache, written to it. The prefix cache is written
    as a side effect of serving, never as a cost: creation is always 0."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageResponse(Struct, kw_only=True):
    id: str
    model: str
    content: list[Content]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


class TokenCount(Struct):
    input_tokens: int


# ---- stream events --------------------------------------------------------------------
class TextDelta(Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(Struct, tag="signature_delta", tag_field="type"):
    signature: str


class InputJsonDelta(Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


BlockDelta = TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta


class MessageDelta(Struct):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageStart(Struct, tag="message_start", tag_field="type"):
    message: MessageResponse


class ContentBlockStart(Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: Content


class ContentBlockDelta(Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: BlockDelta


class ContentBlockStop(Struct, tag="content_block_stop", tag_field="type"):
    index: int


class MessageDeltaEvent(Struct, tag="message_delta", tag_field="type"):
    delta: MessageDelta
    usage: MessageUsage  # the totals, cumulative as Anthropic's are


class MessageStop(Struct, tag="message_stop", tag_field="type"):
    pass


class Ping(Struct, tag="ping", tag_field="type"):
    pass


class AnthropicErrorDetail(Struct):
    type: str
    message: str


class AnthropicError(Struct, tag="error", tag_field="type"):
    error: AnthropicErrorDetail


StreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDeltaEvent
    | MessageStop | Ping | AnthropicError
)  # fmt: skip
EVENT_TYPES = ("message_start", "content_block_start", "content_block_delta",
               "content_block_stop", "message_delta", "message_stop", "ping", "error")  # fmt: skip


def event(obj: StreamEvent) -> bytes:
    """One server-sent event: its `type` as the event name, the object as its data."""
    name = type(obj).__struct_config__.tag
    return b"event: " + str(name).encode() + b"\ndata: " + ENCODER.encode(obj) + b"\n\n"


# ---- errors ---------------------------------------------------------------------------
OVERLOADED = 529  # Anthropic's "temporarily overloaded": its clients wait and retry

# the pipeline's field names (OpenAI's) → Anthropic's, where they differ
_FIELDS = {"stop": "stop_sequences", "response_format": "output_config.format"}


def anthropic_field(param: str) -> str:
    """`stop[2]` → `stop_sequences[2]`, `tools[0].function.name` → `tools[0].name`."""
    head, sep, rest = param.partition("[")
    head = _FIELDS.get(head, head)
    if head == "tools":
        rest = rest.replace("].function.", "].", 1)
    return head + sep + rest


def _status_and_type(err: APIError) -> tuple[int, str]:
    if isinstance(err, Unauthorized):
        return 401, "authentication_error"
    if isinstance(err, ModelNotFound | RouteNotFound):
        return 404, "not_found_error"
    if isinstance(err, PayloadTooLarge):
        return 413, "request_too_large"
    if isinstance(err, RequestTimeout):
        return 408, "timeout_error"
    if isinstance(err, ServerBusy):
        return 429, "rate_limit_error"
    if isinstance(err, ServiceUnavailable):
        return OVERLOADED, "overloaded_error"
    if err.status < 500:
        return err.status, "invalid_request_error"
    return err.status, "api_error"


def _message(err: APIError) -> str:
    if isinstance(err, NotReproducible):  # the pipeline asks for OpenAI's `seed`
        return ("strata_reproducible: a reproducible request that samples cannot be served "
                "here (the Messages API has no seed); send temperature 0")  # fmt: skip
    text = err.message
    if err.param is None:
        return text
    name = anthropic_field(err.param)
    if text.startswith(err.param):
        return name + text[len(err.param) :]
    return f"{name}: {text}"


def error_body(err: APIError) -> AnthropicError:
    return AnthropicError(AnthropicErrorDetail(_status_and_type(err)[1], _message(err)))


def error_response(err: APIError) -> Response:
    status, _ = _status_and_type(err)
    return Response(
        ENCODER.encode(error_body(err)), status_code=status, media_type="application/json",
        headers=err.headers(),
    )  # fmt: skip


def error_response_for(path: str, err: APIError) -> Response:
    """`err` in the envelope of the API that `path` belongs to (for what answers before
    or around the routes: the key check, unknown methods, unexpected errors)."""
    return error_response(err) if path.startswith(PREFIX) else openai_error_response(err)
