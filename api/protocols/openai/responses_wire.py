"""msgspec schemas of OpenAI's Responses API (`POST /v1/responses`): the request body as
this server reads it, the `response` object, its output items and its stream events.

The request types are loose where the API is loose (an input item may leave out its
`type`, a message's content is a string or parts) and name every field the server reads,
serves or refuses; the codec (api.protocols.openai.responses) judges the values. The response
types carry every field the official SDK's `Response` requires; output items, content
parts and events are tagged by `type`, as the API writes them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct, field

from api.protocols.openai.schemas import Penalty, PosInt, Prob, Temperature

# ---- the request --------------------------------------------------------------------


class InputPart(Struct, kw_only=True):
    """A content part of an input message or a function call's output: `input_text`,
    `output_text` (an earlier answer), `refusal`; images, files and audio are refused."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(Struct, kw_only=True):
    """One input item. A message (`type` may be left out: the API's "easy" message) has
    `role` and `content`; a `function_call` has `call_id`, `name`, `arguments`; a
    `function_call_output` has `call_id` and `output`; `reasoning` items of an earlier
    answer are accepted and not rendered (templates drop earlier turns' thinking)."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None  # a call of a tool in a `namespace` group
    arguments: str | None = None
    output: str | list[InputPart] | None = None


class FunctionTool(Struct, kw_only=True):
    """A tool as the Responses API writes it: flat (chat's is nested under `function`).
    `function` tools are served, and a `namespace` group's (`tools`, Codex puts its MCP
    servers' and its agent tools there); a built-in tool (`web_search` …) is left out."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[FunctionTool] | None = None  # a namespace's


class TextFormat(Struct, kw_only=True, omit_defaults=True):
    """`text.format`: `text`, `json_object`, or `json_schema` with `name` and `schema`."""

    type: str
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True, omit_defaults=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted: a hint the server's sampling has no knob for


class ReasoningConfig(Struct, kw_only=True, omit_defaults=True):
    """Accepted: a model that thinks, thinks as its template has it; its reasoning comes
    back as `reasoning` items."""

    effort: str | None = None
    summary: str | None = None


# OpenAI's bounds: 16 pairs, keys up to 64 characters, values up to 512
Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]],
    Meta(max_length=16),
]


class ResponsesRequest(Struct, kw_only=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: PosInt | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    metadata: Metadata | None = None
    user: str | None = None
    # accepted and ignored: the server keeps nothing, so that any replica can answer
    store: bool | None = None
    include: list[str] | None = None  # nothing extra to include (no encrypted reasoning)
    truncation: Literal["auto", "disabled"] | None = None  # too long is a 400 either way
    max_tool_calls: int | None = None  # bounds built-in tools' calls: there are none
    # refused by name: they ask for state the server does not keep, or output it lacks
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    top_logprobs: int | None = None
    # the server's extensions, as on chat completions
    top_k: Annotated[int, Meta(ge=0)] | None = None
    min_p: Prob | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    seed: int | None = None
    logit_bias: Any = None  # {token id: bias}
    min_tokens: Any = None
    strata_reproducible: str | None = None  # the reproducible lane (api.pipeline.lanes)
    cache_prompt: bool = True


# ---- the response -------------------------------------------------------------------
Status = Literal["completed", "incomplete", "in_progress", "failed"]


class OutputText(Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = field(default_factory=list)


class ReasoningText(Struct, kw_only=True, tag="reasoning_text", tag_field="type"):
    text: str


class SummaryText(Struct, kw_only=True, tag="summary_text", tag_field="type"):
    text: str


class MessageItem(Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    status: Status
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(Struct, kw_only=True, tag="function_call", tag_field="type",
                       omit_defaults=True):  # fmt: skip
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Status
    namespace: str | None = None  # the group of the tool called, where it has one


class ReasoningItem(Struct, kw_only=True, tag="reasoning", tag_field="type"):
    """The model's own thinking as `content` (`reasoning_text`, as open-weight servers
    return it); `summary` stays empty: nothing summarizes it."""

    id: str
    status: Status
    content: list[ReasoningText]
    summary: list[SummaryText] = field(default_factory=list)


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(Struct):
    cached_tokens: int  # read from the prefix cache, not computed
    cache_write_tokens: int = 0  # not counted: what a prompt leaves in the cache varies


class OutputTokensDetails(Struct):
    reasoning_tokens: int


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(Struct):
    code: str
    message: str


class EchoTool(Struct, kw_only=True, tag="function", tag_field="type"):
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None


class Response(Struct, kw_only=True):
    id: str
    created_at: int
    model: str
    status: Status
    output: list[OutputItem]
    usage: ResponseUsage | None
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    temperature: float | None
    top_p: float | None
    tools: list[EchoTool]
    tool_choice: str | dict[str, Any]
    text: TextConfig
    reasoning: ReasoningConfig | None
    truncation: str
    metadata: dict[str, str]
    user: str | None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    completed_at: int | None = None
    previous_response_id: None = None
    object: Literal["response"] = "response"


# ---- stream events (each carries its place in the stream, `sequence_number`) ----------
class _Lifecycle(Struct, kw_only=True):
    sequence_number: int
    response: Response


class Created(_Lifecycle, tag="response.created", tag_field="type"):
    pass


class InProgress(_Lifecycle, tag="response.in_progress", tag_field="type"):
    pass


class Completed(_Lifecycle, tag="response.completed", tag_field="type"):
    pass


class Incomplete(_Lifecycle, tag="response.incomplete", tag_field="type"):
    pass


class Failed(_Lifecycle, tag="response.failed", tag_field="type"):
    pass


class ItemAdded(Struct, kw_only=True, tag="response.output_item.added", tag_field="type"):
    sequence_number: int
    output_index: int
    item: OutputItem


class ItemDone(Struct, kw_only=True, tag="response.output_item.done", tag_field="type"):
    sequence_number: int
    output_index: int
    item: OutputItem


class _Part(Struct, kw_only=True):
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int


class PartAdded(_Part, tag="response.content_part.added", tag_field="type"):
    part: OutputText | ReasoningText


class PartDone(_Part, tag="response.content_part.done", tag_field="type"):
    part: OutputText | ReasoningText


class TextDelta(_Part, tag="response.output_text.delta", tag_field="type"):
    delta: str
    logprobs: list[Any] = field(default_factory=list)


class TextDone(_Part, tag="response.output_text.done", tag_field="type"):
    text: str
    logprobs: list[Any] = field(default_factory=list)


class ReasoningDelta(_Part, tag="response.reasoning_text.delta", tag_field="type"):
    delta: str


class ReasoningDone(_Part, tag="response.reasoning_text.done", tag_field="type"):
    text: str


class ArgumentsDelta(
    Struct, kw_only=True, tag="response.function_call_arguments.delta", tag_field="type"
):
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDone(
    Struct, kw_only=True, tag="response.function_call_arguments.done", tag_field="type"
):
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(Struct, kw_only=True, tag="error", tag_field="type"):
    sequence_number: int
    message: str
    code: str | None
    param: str | None


StreamEvent = (
    Created | InProgress | Completed | Incomplete | Failed | ItemAdded | ItemDone | PartAdded
    | PartDone | TextDelta | TextDone | ReasoningDelta | ReasoningDone | ArgumentsDelta
    | ArgumentsDone | ErrorEvent
)  # fmt: skip

RESPONSES_DECODER = msgspec.json.Decoder(ResponsesRequest)
_ENCODER = msgspec.json.Encoder()


def sse(event: StreamEvent) -> bytes:
    """One server-sent event, named by its type as OpenAI names it."""
    name = type(event).__struct_config__.tag
    assert isinstance(name, str)  # (every event class is tagged)
    return b"event: " + name.encode() + b"\ndata: " + _ENCODER.encode(event) + b"\n\n"
