"""Tool calls on a model whose chat template has no call format: the embedded Gemma 3
270M (the session `server`), the generic format (api.pipeline.generic_tools), through Chat
Completions with the official `openai` client in strict response validation.

A forced call (`required`, a named function) is held to the envelope's grammar, so its
arguments always validate against the function's schema; `auto` lets the model answer
with a call or with text, and either comes back as OpenAI's fields — never the envelope's
JSON as text. The same forced calls through Anthropic's Messages and OpenAI's Responses
APIs, at the end."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
from anthropic import Anthropic
from openai import OpenAI

from bench.server_proc import Server
from tests.conftest import MODEL

pytestmark = pytest.mark.e2e

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME: dict[str, Any] = {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                      "description": "The weather forecast for a city"}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME,
                                      "description": "The time in a time zone"}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK: Any = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="none", _strict_response_validation=True)


def _valid(calls: list[Any]) -> list[str]:
    """The calls' names, each call's arguments validated against its function's schema."""
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert call.id.startswith("call_") and call.type == "function"
    return [call.function.name for call in calls]


def _streamed(chunks: list[Any]) -> tuple[str, list[Any], str | None]:
    """A stream's text, calls and last finish reason."""
    text, calls, reason = "", [], None
    for ch in chunks:
        for choice in ch.choices:
            text += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            reason = choice.finish_reason or reason
    return text, calls, reason


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_returns_valid_arguments_streamed_and_not(
    server: Server, choice: Any
) -> None:
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS, "tool_choice": choice,
                          "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0,
                          "extra_body": {"cache_prompt": False}}  # fmt: skip
    with _client(server) as c:
        got = c.chat.completions.create(**kw)
        text, streamed, reason = _streamed(list(c.chat.completions.create(**kw, stream=True)))
    message = got.choices[0].message
    assert got.choices[0].finish_reason == "tool_calls", message
    names = _valid(message.tool_calls or [])
    assert names and message.content is None
    if choice is NAMED:
        assert set(names) == {"get_weather"}
    # streamed: the same calls, no envelope JSON as text
    assert reason == "tool_calls" and text == ""
    assert [(t.function.name, t.function.arguments) for t in streamed] == [
        (t.function.name, t.function.arguments) for t in message.tool_calls or []
    ]


def test_parallel_tool_calls_false_gives_one_call(server: Server) -> None:
    with _client(server) as c:
        for seed in range(3):
            got = c.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed,
            )  # fmt: skip
            assert len(_valid(got.choices[0].message.tool_calls or [])) == 1, got.choices[0]


def test_auto_answers_with_a_call_or_with_text(server: Server) -> None:
    """Whichever the model chooses comes back in OpenAI's fields: calls (valid, finish
    `tool_calls`) or text content with no calls; streamed, the text arrives in pieces."""
    seen = set()
    with _client(server) as c:
        for seed in range(4):
            kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": TOOLS,
                                  "parallel_tool_calls": False, "max_tokens": 120,
                                  "temperature": 1.0, "seed": seed}  # fmt: skip
            got = c.chat.completions.create(**kw)
            choice = got.choices[0]
            if choice.message.tool_calls:
                assert choice.finish_reason == "tool_calls"
                _valid(choice.message.tool_calls)
                seen.add("call")
            else:
                assert choice.message.content is not None
                assert not choice.message.content.lstrip().startswith('{"response"')
                seen.add("text")
            text, calls, _ = _streamed(list(c.chat.completions.create(**kw, stream=True)))
            assert not text.lstrip().startswith("{"), text
            _valid(calls)
    assert seen


def test_a_whole_tool_round_trip_completes(server: Server) -> None:
    """Call → the tool's result → an answer: the earlier call renders as the assistant's
    JSON and the result as a user turn naming them, in a template without a tool role."""
    with _client(server) as c:
        first = c.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_tokens=200,
            temperature=0,
        )  # fmt: skip
        (call,) = first.choices[0].message.tool_calls or []
        history: Any = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {
                    "name": call.function.name, "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C all week."},
        ]  # fmt: skip
        answer = c.chat.completions.create(
            model=MODEL, messages=history, tools=TOOLS, max_tokens=60, temperature=0
        )
        plain = c.chat.completions.create(
            model=MODEL, messages=history, max_tokens=20, temperature=0
        )  # (no tools now: the history still renders)
    choice = answer.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        _valid(choice.message.tool_calls)
    else:
        assert choice.message.content is not None
    assert first.usage and answer.usage and plain.usage
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 15  # call + result
    assert plain.choices[0].message.tool_calls is None


def test_tool_choice_none_and_a_format_beside_the_envelope(server: Server) -> None:
    """`none` renders no tools (a shorter prompt, plain text); the generic format's answer
    is the tools' JSON, so a response_format beside tools is a 400 naming tool_choice."""
    with _client(server) as c:
        none = c.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=4
        )
        auto = c.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4,
                response_format={"type": "json_object"},
            )  # fmt: skip
    assert none.usage and auto.usage and none.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None
    assert e.value.body["param"] == "tool_choice"  # type: ignore[index]


# ---- the same forced calls through the agents' APIs ------------------------------------
ANTHROPIC_TOOLS: Any = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]}
    for t in TOOLS
]  # fmt: skip
RESPONSES_TOOLS: Any = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}],
                         ids=["any", "named"])  # fmt: skip
def test_a_forced_call_through_anthropic_messages_has_valid_input(
    server: Server, choice: Any
) -> None:
    """Anthropic's Messages API on the embedded model (no call format of its own): `any`
    and a named tool come back as `tool_use` blocks whose `input` validates against the
    tool's `input_schema`, with `stop_reason` `tool_use`."""
    with Anthropic(base_url=server.url, api_key="none", max_retries=0,
                   _strict_response_validation=True) as c:  # fmt: skip
        got = c.messages.create(
            model=MODEL, max_tokens=200, messages=ASK, tools=ANTHROPIC_TOOLS,
            tool_choice={**choice, "disable_parallel_tool_use": True},
            extra_body={"temperature": 0, "cache_prompt": False},
        )  # fmt: skip
    uses = [b for b in got.content if b.type == "tool_use"]
    assert got.stop_reason == "tool_use" and len(uses) == 1
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    assert uses[0].name == "get_weather" or choice["type"] == "any"
    assert uses[0].id.startswith("toolu_")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}],
                         ids=["required", "named"])  # fmt: skip
def test_a_forced_call_through_the_responses_api_has_valid_arguments(
    server: Server, choice: Any
) -> None:
    """OpenAI's Responses API on the embedded model: `required` and a named function come
    back as `function_call` items whose arguments validate against the function's
    `parameters`."""
    with _client(server) as c:
        got = c.responses.create(
            model=MODEL, input=ASK[0]["content"], tools=RESPONSES_TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_output_tokens=200, temperature=0,
            extra_body={"cache_prompt": False},
        )  # fmt: skip
    calls = [item for item in got.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS[calls[0].name])
    assert calls[0].name == "get_weather" or choice == "required"


# ---- forced calls end; a plain answer streams ------------------------------------------
TRIES = 10
REPRO = {"strata_reproducible": "required"}


def test_a_forced_call_ends_with_calls_not_max_tokens_on_every_route(server: Server) -> None:
    """`required` / `any` with parallel calls allowed: the embedded model writes the same
    call again and again, and without an end it would fill max_tokens — the repeat ends
    the answer with the calls so far, in at least 9 of 10 sampled tries on each route."""
    ended = {"chat": 0, "responses": 0, "messages": 0}
    sampled: Any = {"temperature": 1.0, "max_tokens": 400}
    with _client(server) as c, Anthropic(base_url=server.url, api_key="none", max_retries=0,
                                         _strict_response_validation=True) as a:  # fmt: skip
        for seed in range(TRIES):
            chat = c.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", seed=seed,
                **sampled,
            )  # fmt: skip
            _valid(chat.choices[0].message.tool_calls or [])
            ended["chat"] += chat.choices[0].finish_reason == "tool_calls"
            resp = c.responses.create(
                model=MODEL, input=ASK[0]["content"], tools=RESPONSES_TOOLS,
                tool_choice="required", max_output_tokens=400, temperature=1.0,
                extra_body={"seed": seed},
            )  # fmt: skip
            calls = [item for item in resp.output if item.type == "function_call"]
            ended["responses"] += resp.status == "completed" and bool(calls)
            msg = a.messages.create(
                model=MODEL, max_tokens=400, messages=ASK, tools=ANTHROPIC_TOOLS,
                tool_choice={"type": "any"}, extra_body={"temperature": 1.0, "seed": seed},
            )  # fmt: skip
            ended["messages"] += msg.stop_reason == "tool_use"
    assert all(n >= TRIES - 1 for n in ended.values()), ended


def test_a_plain_answer_with_tools_offered_streams_in_pieces_on_every_route(
    server: Server,
) -> None:
    """`auto` and the model answers in text: under the generic format that text is inside
    the envelope's `response` string, and still streams as it is written — more than one
    text delta on every route (the first answer of a few words on each), none of them the
    envelope's JSON. Greedy in the reproducible lane, so that which asks are answered in
    text does not depend on what the server served before."""
    asks = ["Say hello and tell me a short story.", "Write a poem about the sea.",
            "Tell me a joke.", "Describe a cat in two sentences.", "Say hello."]  # fmt: skip
    with _client(server) as c, Anthropic(base_url=server.url, api_key="none", max_retries=0,
                                         _strict_response_validation=True) as a:  # fmt: skip

        def chat(ask: str) -> list[str]:
            return [x.delta.content for ch in c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": ask}], tools=TOOLS,
                max_tokens=60, temperature=0, stream=True, extra_body=REPRO,
            ) for x in ch.choices if x.delta.content]  # fmt: skip

        def responses(ask: str) -> list[str]:
            return [ev.delta for ev in c.responses.create(
                model=MODEL, input=ask, tools=RESPONSES_TOOLS, max_output_tokens=60,
                temperature=0, extra_body=REPRO, stream=True,
            ) if ev.type == "response.output_text.delta"]  # fmt: skip

        def messages(ask: str) -> list[str]:
            with a.messages.stream(
                model=MODEL, max_tokens=60, messages=[{"role": "user", "content": ask}],
                tools=ANTHROPIC_TOOLS, extra_body={"temperature": 0, **REPRO},
            ) as s:  # fmt: skip
                return [t for t in s.text_stream if t]

        pieces: dict[str, list[str]] = {}
        for name, route in (("chat", chat), ("responses", responses), ("messages", messages)):
            for ask in asks:  # the first answer of a few words (a call has no text)
                if len("".join(got := route(ask)).split()) > 1:
                    pieces[name] = got
                    break
    assert set(pieces) == {"chat", "responses", "messages"}, pieces
    assert all(len(v) > 1 for v in pieces.values()), pieces
    assert not any("".join(v).lstrip().startswith("{") for v in pieces.values()), pieces
