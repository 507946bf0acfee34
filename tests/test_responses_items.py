"""The Responses codec's pure parts, without a model: input items into the chat's messages,
the pipeline's field names into this API's, and output blocks into items — streamed
events and whole answers agreeing, validated by the official SDK's own types."""

from __future__ import annotations

import json
import logging
from typing import Any

import msgspec
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from api.pipeline.output_blocks import Block, Reasoning, Text, ToolUse
from api.pipeline.request import Message
from api.pipeline.tool_calls import Call
from api.protocols.openai.responses_input import (
    api_param,
    functions_of,
    messages_of,
    response_format_of,
)
from api.protocols.openai.responses_stream import ItemStream, function_call, whole
from api.protocols.openai.responses_wire import (
    EchoTool,
    InputTokensDetails,
    OutputItem,
    OutputTokensDetails,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextFormat,
)
from api.protocols.openai.responses_wire import Response as ResponseObject
from api.server.errors import InvalidRequest

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _request(**body: Any) -> ResponsesRequest:
    return msgspec.convert({"model": "m", "input": "hi", **body}, ResponsesRequest)


def test_function_calls_join_the_assistant_turn_and_outputs_are_tool_results() -> None:
    items = [
        {"role": "user", "content": "weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c2", "output": "12:00"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_text", "text": "sunny"}]},
        {"role": "developer", "content": "be brief"},
    ]  # fmt: skip
    messages, origin = messages_of(_request(input=items), max_messages=64)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool", "system"]
    turn = messages[1]
    assert turn.text == "Let me look."
    assert [(c.id, c.name, c.value) for c in turn.calls] == [
        ("c1", "get_weather", {"a": 1}), ("c2", "get_time", {})
    ]  # fmt: skip
    assert messages[2] == Message("tool", "12:00", call_id="c2", name="get_time")
    assert messages[3] == Message("tool", "sunny", call_id="c1", name="get_weather")
    assert origin == [0, 2, 5, 6, 7]  # (the reasoning item renders nothing)
    (only,), where = messages_of(_request(input="hi"), max_messages=64)
    assert only == Message("user", "hi") and where == [None]


@pytest.mark.parametrize(
    ("items", "param"),
    [
        ([{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
         "input[0].content[0].type"),
        ([{"role": "tool", "content": "x"}], "input[0].role"),
        ([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}],
         "input[0].arguments"),
        ([{"type": "function_call", "call_id": "c", "arguments": "{}"}], "input[0].name"),
        ([{"type": "function_call_output", "output": "x"}], "input[0].call_id"),
        ([{"type": "computer_call_output", "call_id": "c"}], "input[0].type"),
        ([{"type": "reasoning", "summary": []}], "input"),
        ([], "input"),
    ],
)  # fmt: skip
def test_input_that_cannot_be_served_is_refused_by_its_place(items: Any, param: str) -> None:
    with pytest.raises(InvalidRequest) as e:
        messages_of(_request(input=items), max_messages=64)
    assert e.value.param == param


def test_tools_and_formats_in_chat_terms(caplog: pytest.LogCaptureFixture) -> None:
    f: Any = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    tools = _request(tools=[f]).tools
    assert functions_of(tools).functions == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                          "strict": True}}
    ]  # fmt: skip
    # a built-in tool is left out (Codex offers web_search with every request), said in the log
    with caplog.at_level(logging.WARNING):
        offered = functions_of(_request(tools=[{"type": "file_search"}, f]).tools)
    assert [f["function"]["name"] for f in offered.functions or []] == ["f"]
    assert "tools[0]" in caplog.text and "file_search" in caplog.text
    schema = {"type": "object"}
    fmt = TextConfig(format=TextFormat(type="json_schema", name="x", schema=schema, strict=True))
    assert response_format_of(fmt) == {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}
    }  # fmt: skip
    assert response_format_of(TextConfig(format=TextFormat(type="text"))) is None
    with pytest.raises(InvalidRequest) as e:
        response_format_of(TextConfig(format=TextFormat(type="xml")))
    assert e.value.param == "text.format.type"


def test_a_namespace_s_tools_are_offered_flat_and_called_back_by_namespace_and_name() -> None:
    """Codex groups tools (its MCP servers', its agent tools) in `namespace` tools and
    dispatches a call by its `namespace` and `name`: the model is offered each under the
    flat name Codex shows (`group__tool`), its call comes back split, and an earlier call
    sent back with its namespace renders under the flat name the model wrote."""
    echo = {
        "type": "function",
        "name": "echo",
        "description": "Echo a text",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}},
    }
    req = _request(
        tools=[{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
               {"type": "namespace", "name": "mcp__tools", "description": "MCP tools",
                "tools": [echo]},
               {"type": "web_search", "external_web_access": False}],
        input=[{"type": "message", "role": "developer", "content": "Be brief."},
               {"type": "message", "role": "user", "content": "Echo hi"},
               {"type": "function_call", "call_id": "c1", "namespace": "mcp__tools",
                "name": "echo", "arguments": '{"text": "hi"}', "id": "fc_1",
                "status": "completed"},
               {"type": "function_call_output", "call_id": "c1", "output": "hi"}],
    )  # fmt: skip
    offered = functions_of(req.tools)
    names = [f["function"]["name"] for f in offered.functions or []]
    assert names == ["exec_command", "mcp__tools__echo"]
    assert offered.namespaced == {"mcp__tools__echo": ("mcp__tools", "echo")}
    messages, _ = messages_of(req, 64)
    assert messages[2].calls[0].name == "mcp__tools__echo"
    assert messages[3].role == "tool" and messages[3].name == "mcp__tools__echo"
    block = ToolUse(0, Call("mcp__tools__echo", '{"text": "hi"}'), 0)
    item = function_call(block, offered.namespaced)
    assert (item.namespace, item.name) == ("mcp__tools", "echo")
    wire = json.loads(msgspec.json.encode(item))
    assert wire["namespace"] == "mcp__tools" and wire["name"] == "echo"
    plain = json.loads(msgspec.json.encode(function_call(ToolUse(1, Call("f", "{}"), 1), {})))
    assert "namespace" not in plain


def test_the_pipelines_field_names_become_this_apis() -> None:
    origin: list[int | None] = [0, 2, 5]
    assert api_param("messages[2].role", origin) == "input[5]"
    assert api_param("messages", origin) == "input"
    assert api_param("messages[0]", [None]) == "input"
    assert api_param("max_tokens", origin) == "max_output_tokens"
    assert api_param("response_format", origin) == "text.format"
    assert api_param("tools[1].function.name", origin) == "tools[1].name"
    assert api_param("tool_choice", origin) == "tool_choice"
    assert api_param(None, origin) is None


def _response(output: list[OutputItem]) -> Response:
    """Our response object, read by the SDK's type."""
    obj = ResponseObject(
        id="resp_1", created_at=1, model="m", status="completed", output=output,
        usage=ResponseUsage(input_tokens=3, input_tokens_details=InputTokensDetails(0),
                            output_tokens=5, output_tokens_details=OutputTokensDetails(2),
                            total_tokens=8),
        instructions=None, max_output_tokens=None, parallel_tool_calls=True, temperature=None,
        top_p=None, tools=[EchoTool(name="f", description=None, parameters=None, strict=None)],
        tool_choice="auto", text=TextConfig(format=TextFormat(type="text")), reasoning=None,
        truncation="disabled", metadata={}, user=None,
    )  # fmt: skip
    return Response.model_validate(msgspec.to_builtins(obj))


CALL = Call("get_time", '{"tz": "UTC"}', "call_1")
PIECES: list[list[Block]] = [
    [Reasoning(0, "Let me")],
    [Reasoning(0, " think."), Text(1, "It is")],
    [Text(1, " noon.")],
    [ToolUse(2, CALL, 0), ToolUse(3, Call("get_time", '{"tz": "CET"}', "call_2"), 1)],
]


def _stream(pieces: list[list[Block]], cut: bool) -> tuple[list[Any], ItemStream]:
    items = ItemStream(2, {})
    events = [e for p in pieces for e in items.blocks(p)] + list(items.finish(cut))
    return [EVENTS.validate_python(msgspec.to_builtins(e)) for e in events], items


def test_streamed_items_open_close_in_order_and_equal_the_whole_answer() -> None:
    events, items = _stream(PIECES, cut=False)
    assert [e.sequence_number for e in events] == list(range(2, 2 + len(events)))
    opened = [(e.output_index, e.item.type) for e in events
              if e.type == "response.output_item.added"]  # fmt: skip
    closed = [(e.output_index, e.item.type) for e in events
              if e.type == "response.output_item.done"]  # fmt: skip
    kinds = [(0, "reasoning"), (1, "message"), (2, "function_call"), (3, "function_call")]
    assert opened == closed == kinds
    # an item closes before the next opens
    order = [e.type for e in events if e.type.startswith("response.output_item")]
    assert order == ["response.output_item.added", "response.output_item.done"] * 4
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "It is noon."
    got = _response(items.items)
    want = _response(whole([Reasoning(0, "Let me think."), Text(1, "It is noon."),
                            *PIECES[3]], cut=False, namespaced={}))  # fmt: skip
    assert got.output_text == want.output_text == "It is noon."
    strip = [{k: v for k, v in o.model_dump().items() if k != "id"} for o in got.output]
    assert strip == [{k: v for k, v in o.model_dump().items() if k != "id"} for o in want.output]
    calls = [o for o in got.output if o.type == "function_call"]
    assert [(c.call_id, c.arguments) for c in calls] == [("call_1", CALL.arguments),
                                                        ("call_2", '{"tz": "CET"}')]  # fmt: skip


def test_an_answer_without_text_or_calls_still_has_a_message() -> None:
    """Reasoning cut at the token limit: the reasoning item, then an empty, incomplete
    message — streamed and whole alike."""
    events, items = _stream([[Reasoning(0, "Hmm")]], cut=True)
    whole_items = whole([Reasoning(0, "Hmm")], cut=True, namespaced={})
    assert [(i.type, i.status) for i in _response(items.items).output] == [
        ("reasoning", "completed"), ("message", "incomplete")
    ]  # fmt: skip
    assert [(i.type, i.status) for i in _response(whole_items).output] == [
        ("reasoning", "completed"), ("message", "incomplete")
    ]  # fmt: skip
    assert events[-1].type == "response.output_item.done"
    assert [(i.type, i.status) for i in _response(whole([], cut=False, namespaced={})).output] == [
        ("message", "completed")
    ]  # fmt: skip
