"""Anthropic's Messages codec without a model: bodies decoded into the internal request
(a state with only what decoding reads), and hand-made output blocks encoded as the
stream's events and the whole message — the events read back by the official SDK's own
accumulator must give the message the body gives."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message as SDKMessage

from api.pipeline.output_blocks import Block, ChoiceAnswer, ChoiceDelta, Reasoning, Text, ToolUse
from api.pipeline.request import EarlierCall, Message
from api.pipeline.tool_calls import Call
from api.protocols.anthropic.input import counted
from api.protocols.anthropic.messages import MessagesCodec
from api.protocols.anthropic.wire import (
    COUNT_TOKENS_DECODER,
    MESSAGES_DECODER,
    MessagesRequest,
    error_response,
)
from api.server.errors import (
    APIError,
    GenerationFailed,
    InvalidRequest,
    ServerBusy,
    ServiceUnavailable,
)
from api.server.limits import RequestLimits

USER = {"role": "user", "content": "hi"}


def _state(tool_format: str | None = "hermes") -> Any:
    return SimpleNamespace(
        aliases=frozenset({"m"}), model_name="m", tool_format=tool_format,
        settings=SimpleNamespace(limits=RequestLimits(), accept_any_model=False),
    )  # fmt: skip


def _body(**fields: Any) -> MessagesRequest:
    body: MessagesRequest = MESSAGES_DECODER.decode(
        json.dumps({"model": "m", "max_tokens": 8, "messages": [USER], **fields})
    )
    return body


def _codec(tool_format: str | None = "hermes", **fields: Any) -> MessagesCodec:
    return MessagesCodec(_state(tool_format), _body(**fields))


# ---- decoding -------------------------------------------------------------------------
def test_blocks_become_the_templates_turns() -> None:
    """Tool results are tool turns named after their call, text before a result is a
    turn of its own, consecutive turns of one role are one, thinking is dropped."""
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "x"},
            {"type": "text", "text": "calling"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"x": 1}},
        ]},
        {"role": "user", "content": [
            {"type": "text", "text": "note"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "boom"}]},
            {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}},
        ]},
        {"role": "user", "content": "and more"},
    ]  # fmt: skip
    req = _codec(messages=messages, system=[{"type": "text", "text": "S1"},
                                            {"type": "text", "text": "S2"}]).decode()  # fmt: skip
    chat = req.input
    assert chat.instructions == "S1\n\nS2"  # type: ignore[union-attr]
    assert chat.messages == (  # type: ignore[union-attr]
        Message("user", "a\n\nb"),
        Message("assistant", "calling", (EarlierCall("toolu_1", "f", '{"x": 1}', {"x": 1}),)),
        Message("user", "note"),
        Message("tool", "42", call_id="toolu_1", name="f"),
        Message("tool", "Error: boom", call_id="toolu_1", name="f"),
        Message("user", "go on\n\nand more"),
    )
    assert chat.add_generation_prompt and not chat.continue_final_message  # type: ignore[union-attr]
    assert req.id.startswith("msg_") and req.max_tokens == 8 and req.n == 1
    assert req.cap_max_tokens  # a bound, not a demand (Anthropic's max_tokens)


def test_a_final_assistant_message_is_continued() -> None:
    chat = _codec(messages=[USER, {"role": "assistant", "content": "The answer is ("}]).decode()
    assert chat.input.continue_final_message  # type: ignore[union-attr]
    assert not chat.input.add_generation_prompt  # type: ignore[union-attr]


def test_sampling_stops_tools_thinking_and_format_map_to_the_internal_request() -> None:
    tools = [{"name": "f", "description": "F", "input_schema": {"type": "object"}},
             {"name": "g", "input_schema": {"type": "object"}, "type": "custom"}]  # fmt: skip
    req = _codec(
        temperature=0.5, top_p=0.9, top_k=4, stop_sequences=["END", "##"], tools=tools,
        tool_choice={"type": "tool", "name": "g", "disable_parallel_tool_use": True},
        thinking={"type": "enabled", "budget_tokens": 2048}, metadata={"user_id": "u"},
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        strata_reproducible="required",
    ).decode()  # fmt: skip
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.5, 0.9, 4)
    assert req.stop == ("END", "##")
    assert req.tools.functions == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"},
                                          "description": "F"}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
    ]  # fmt: skip
    assert req.tools.choice == {"type": "function", "function": {"name": "g"}}
    assert not req.tools.parallel
    assert req.input.template_kwargs == {"enable_thinking": True, "thinking": True}  # type: ignore[union-attr]
    assert req.response_format == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": {"type": "object"}}
    }  # fmt: skip
    assert req.lane == "required"
    choices = {"auto": "auto", "any": "required", "none": "none"}
    for kind, want in choices.items():
        got = _codec(tools=tools, tool_choice={"type": kind}).decode().tools
        assert (got.choice, got.parallel) == (want, True)
    off = _codec(thinking={"type": "disabled"}).decode().input
    assert off.template_kwargs == {"enable_thinking": False, "thinking": False}  # type: ignore[union-attr]
    assert _codec().decode().input.template_kwargs == {}  # type: ignore[union-attr]


def test_claude_codes_billing_stamp_does_not_change_the_prompt() -> None:
    """Its `cch=` changes with every request; the rest of the system prompt stays."""

    def system(stamp: str) -> str | None:
        header = f"x-anthropic-billing-header: cc_version=2.1.1; cc_entrypoint=cli; cch={stamp};"
        blocks = [{"type": "text", "text": header}, {"type": "text", "text": "You are Claude."}]
        return _codec(system=blocks).decode().input.instructions  # type: ignore[union-attr]

    assert system("a5145") == system("0b3f1")
    header = "x-anthropic-billing-header: cc_version=2.1.1; cc_entrypoint=cli; cch=0;"
    assert system("a5145") == header + "\n\nYou are Claude."
    assert _codec(system="cch=abc; stays").decode().input.instructions == "cch=abc; stays"  # type: ignore[union-attr]


def test_count_tokens_reads_the_same_conversation() -> None:
    body = COUNT_TOKENS_DECODER.decode(json.dumps({"model": "m", "messages": [USER],
                                                   "system": "S"}))  # fmt: skip
    req = counted(_state(), body)
    assert req.input == _codec(system="S").decode().input


def _refused(tool_format: str | None = "hermes", **fields: Any) -> str:
    with pytest.raises(APIError) as e:
        _codec(tool_format, **fields).decode()
    resp = error_response(e.value)
    assert resp.status_code == e.value.status
    body = json.loads(bytes(resp.body))
    assert body["type"] == "error" and body["error"]["type"] in (
        "invalid_request_error", "not_found_error",
    )  # fmt: skip
    return str(body["error"]["message"])


def test_what_cannot_be_served_is_refused_by_where_it_is() -> None:
    image = {"type": "image", "source": {"type": "url", "url": "http://x"}}
    doc = {"type": "document", "source": {"type": "text", "data": "x"}}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"messages": [{"role": "user", "content": [image]}]},
         "messages[0].content[0]: image blocks are not served"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [doc]}]}]},
         "messages[0].content[0].content[0]: document blocks are not served"),
        ({"messages": [{"role": "user", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages[0].content[0]: a tool_use block belongs in an assistant's message"),
        ({"messages": [USER, {"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "t"}]}]},
         "messages[1].content[0]: a tool_result block belongs in a user's message"),
        ({"messages": [USER, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
         "messages[1]: the conversation ends with the assistant's tool_use"),
        ({"messages": [USER, {"role": "assistant", "content": "  "}]},
         "messages[1]: a final assistant message is continued from its text"),
        ({"model": "claude-x"}, "model: The model `claude-x` does not exist"),
        ({"tools": [{"name": "web_search", "type": "web_search_20250305"}]},
         "tools[0].type: tool type 'web_search_20250305'"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema: a tool needs an input_schema"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "m"}]}, "mcp_servers: "),
    ]  # fmt: skip
    for fields, start in cases:
        assert _refused(**fields).startswith(start), (fields, _refused(**fields))
    tool_use = {"type": "tool_use", "id": "t", "name": "f", "input": {}}
    msgs = [USER, {"role": "assistant", "content": [tool_use]}, USER]
    assert _refused(None, messages=msgs).startswith(
        "messages[1].content[0]: tool_use blocks: this model's chat template writes no"
    )


def test_pipeline_errors_name_anthropics_fields() -> None:
    """The pipeline names fields as OpenAI does; the envelope says them as Anthropic does,
    by status and type of its own."""

    def said(err: APIError) -> tuple[int, str, str]:
        resp = error_response(err)
        body = json.loads(bytes(resp.body))
        return resp.status_code, body["error"]["type"], body["error"]["message"]

    assert said(InvalidRequest("at most 16 stop strings", param="stop")) == (
        400, "invalid_request_error", "stop_sequences: at most 16 stop strings")  # fmt: skip
    assert said(InvalidRequest("a stop string cannot be empty", param="stop[1]"))[2] == \
        "stop_sequences[1]: a stop string cannot be empty"  # fmt: skip
    assert said(InvalidRequest("bad name", param="tools[2].function.name"))[2] == \
        "tools[2].name: bad name"  # fmt: skip
    assert said(InvalidRequest("response_format: no", param="response_format"))[2] == \
        "output_config.format: no"  # fmt: skip
    assert said(ServerBusy("busy"))[:2] == (429, "rate_limit_error")
    assert said(ServiceUnavailable("draining"))[:2] == (529, "overloaded_error")
    assert said(GenerationFailed("boom"))[:2] == (500, "api_error")
    assert error_response(ServerBusy("busy", retry_after_s=3)).headers["retry-after"] == "3"


# ---- encoding -------------------------------------------------------------------------
F = Call("f", '{"city": "Paris"}', id="call_abc")
G = Call("g", "{}", id="call_def")


class _Gen:
    """What the codec reads of a generation: its id, its prompt, its pieces."""

    def __init__(self, pieces: list[ChoiceDelta], n_prompt: int = 10) -> None:
        self.request = SimpleNamespace(id="msg_test")
        self.prompts = [SimpleNamespace(ids=list(range(n_prompt)))]
        self._pieces = pieces

    async def events(self) -> AsyncIterator[ChoiceDelta]:
        for p in self._pieces:
            yield p


def _piece(blocks: list[Block], finish: str | None = None, out: int = 0, cached: int = 0,
           stop: str | None = None) -> ChoiceDelta:  # fmt: skip
    return ChoiceDelta(0, blocks, [], None, finish, out, cached, stop)


def _events(codec: MessagesCodec, pieces: list[ChoiceDelta]) -> list[tuple[str, dict[str, Any]]]:
    async def run() -> list[bytes]:
        return [f async for f in codec.frames(_Gen(pieces))]  # type: ignore[arg-type]

    out = []
    for frame in anyio.run(run):
        head, data, end = frame.split(b"\n", 2)
        assert head.startswith(b"event: ") and data.startswith(b"data: ") and end == b"\n"
        obj = json.loads(data[6:])
        assert obj["type"] == head[7:].decode()
        out.append((obj["type"], obj))
    return out


def _whole(codec: MessagesCodec, pieces: list[ChoiceDelta], blocks: list[Block]) -> Any:
    last = pieces[-1]
    assert last.finish_reason is not None
    answer = ChoiceAnswer(0, blocks, [], None, last.finish_reason, last.output_tokens,
                          last.cached_tokens, last.stop_string)  # fmt: skip
    return msgspec.to_builtins(codec.body(_Gen(pieces), [answer]))  # type: ignore[arg-type]


def _accumulated(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The message the SDK's stream helper builds from the events."""
    snapshot = None
    bufs: dict[int, bytes] = {}
    for _, e in events:
        snapshot = accumulate_event(event=e, current_snapshot=snapshot, json_bufs=bufs)  # type: ignore[arg-type]
    assert snapshot is not None
    return SDKMessage.model_validate(snapshot.to_dict()).model_dump(exclude_none=True)


def test_a_stream_opens_and_closes_each_block_in_order() -> None:
    """Thinking, text, two calls: indices 0..3 in order, each block stopped before the
    next starts, a signature before the thinking stops; the SDK's accumulated message is
    the body."""
    codec = _codec(thinking={"type": "enabled", "budget_tokens": 1024})
    pieces = [
        _piece([Reasoning(0, "Let me")]),
        _piece([Reasoning(0, " think."), Text(1, "Sure")]),
        _piece([Text(1, "!"), ToolUse(2, F, 0), ToolUse(3, G, 1)]),
        _piece([], "tool_calls", out=17, cached=4),
    ]
    events = _events(codec, pieces)
    shape = [(t, e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
             for t, e in events]  # fmt: skip
    assert shape == [
        ("message_start", None, None),
        ("ping", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == 10
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"] == {"input_tokens": 6, "output_tokens": 17,
                              "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 4}  # fmt: skip
    whole = _whole(codec, pieces, [Reasoning(0, "Let me think."), Text(1, "Sure!"),
                                   ToolUse(2, F, 0), ToolUse(3, G, 1)])  # fmt: skip
    assert whole["content"] == [
        {"type": "thinking", "thinking": "Let me think.", "signature": whole["content"][0][
            "signature"]},
        {"type": "text", "text": "Sure!"},
        {"type": "tool_use", "id": "toolu_abc", "name": "f", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_def", "name": "g", "input": {}},
    ]  # fmt: skip
    assert whole["content"][0]["signature"]
    assert _accumulated(events) == SDKMessage.model_validate(whole).model_dump(exclude_none=True)


def test_hidden_thinking_takes_no_index() -> None:
    """Without `thinking` the reasoning is not shown, and the text is block 0."""
    pieces = [_piece([Reasoning(0, "hm")]), _piece([Text(1, "Hi")], "stop", out=3)]
    for codec in (_codec(), _codec(thinking={"type": "disabled"})):
        events = _events(codec, pieces)
        assert [(t, e.get("index")) for t, e in events][2:5] == [
            ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0)
        ]  # fmt: skip
        assert "thinking" not in json.dumps([e for _, e in events])
        whole = _whole(codec, pieces, [Reasoning(0, "hm"), Text(1, "Hi")])
        assert whole["content"] == [{"type": "text", "text": "Hi"}]
        assert whole["stop_reason"] == "end_turn"
    omitted = _codec(thinking={"type": "adaptive", "display": "omitted"})
    events = _events(omitted, pieces)
    assert [e["delta"]["type"] for t, e in events if t == "content_block_delta"] == [
        "signature_delta", "text_delta"
    ]  # fmt: skip
    whole = _whole(omitted, pieces, [Reasoning(0, "hm"), Text(1, "Hi")])
    assert whole["content"][0]["thinking"] == "" and whole["content"][0]["signature"]


def test_text_after_a_call_is_a_new_block_after_it() -> None:
    """A malformed call comes back as text: after the calls before it, in the order of
    the output's indices (a piece's text is numbered before its calls)."""
    pieces = [
        _piece([Text(0, "Hi")]),
        _piece([ToolUse(1, F, 0)]),
        _piece([Text(2, "<tool_call>oops</tool_call>"), ToolUse(3, G, 1)]),
        _piece([], "tool_calls", out=9),
    ]
    events = _events(_codec(), pieces)
    starts = [(e["index"], e["content_block"]["type"]) for t, e in events
              if t == "content_block_start"]  # fmt: skip
    assert starts == [(0, "text"), (1, "tool_use"), (2, "text"), (3, "tool_use")]
    stops = [e["index"] for t, e in events if t == "content_block_stop"]
    assert stops == [0, 1, 2, 3]
    acc = _accumulated(events)
    assert [c["type"] for c in acc["content"]] == ["text", "tool_use", "text", "tool_use"]


def test_a_stop_sequence_is_reported() -> None:
    pieces = [_piece([Text(0, "one two")]), _piece([], "stop", out=3, stop="three")]
    events = _events(_codec(stop_sequences=["three"]), pieces)
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "three"}
    whole = _whole(_codec(), pieces, [Text(0, "one two")])
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "three")
    length = _whole(_codec(), [_piece([], "length", out=8)], [])
    assert (length["stop_reason"], length["stop_sequence"], length["content"]) == (
        "max_tokens", None, [])  # fmt: skip
    # short of max_tokens (8): the context ran out first
    full = _whole(_codec(), [_piece([], "length", out=5)], [])
    assert full["stop_reason"] == "model_context_window_exceeded"


def test_a_generation_that_fails_ends_the_stream_with_an_error_event() -> None:
    pieces = [_piece([Text(0, "Hi")]), _piece([], "error", out=2)]
    events = _events(_codec(), pieces)
    assert [t for t, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "error"
    ]  # fmt: skip
    assert events[-1][1]["error"]["type"] == "api_error"
    events = _events(_codec(), [_piece([], "shutdown")])
    assert events[-1][1]["error"]["type"] == "overloaded_error"
