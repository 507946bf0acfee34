"""Tool calls through the server: a tiny generated model whose chat template writes the
Hermes / Qwen format (`<tool_call>{…}</tool_call>`), the official `openai` client in
strict response validation. A random-weight model never calls a tool by itself, so the
calls here are the forced ones (`tool_choice` required or named: a grammar), which is
also what shows that the arguments always fit the function's schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI

from bench.peers import llama_cpp_source
from bench.server_proc import Server, start_server
from tests.tiny_gguf import vocab, write_llama

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]

HERMES = """\
{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{% for t in tools %}{{ t | tojson }}
{% endfor %}</tools>
Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call> to call one.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>
{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# DeepSeek V3.1's way of writing calls (the arguments added to a string as JSON text)
DEEPSEEK = """\
{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}{% endif %}\
{% endfor %}{% if tools %}## Tools
{% for t in tools %}{{ t.function | tojson }}
{% endfor %}{% endif %}{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}\
{% elif m.role == 'assistant' and m.tool_calls %}<｜Assistant｜><｜tool▁calls▁begin｜>\
{% for c in m.tool_calls %}<｜tool▁call▁begin｜>\
{{ c.function.name + '<｜tool▁sep｜>' + c.function.arguments }}<｜tool▁call▁end｜>{% endfor %}\
<｜tool▁calls▁end｜><｜end▁of▁sentence｜>{% elif m.role == 'assistant' %}<｜Assistant｜>\
{{ m.content }}<｜end▁of▁sentence｜>{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>\
{{ m.content }}<｜tool▁output▁end｜>{% endif %}{% endfor %}\
{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"""

# its markers are tokens of their own, as in DeepSeek's vocabulary
DS_MARKERS = (
    "<｜User｜>", "<｜Assistant｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>", "<｜end▁of▁sentence｜>",
)  # fmt: skip

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}}},
]  # fmt: skip
ASK: Any = [{"role": "user", "content": "hello world"}]


def _serve_template(where: Any, template: str, user_tokens: tuple[str, ...] = ()) -> Server:
    model = write_llama(
        where / "tooled.gguf", seed=4, chat_template=template, user_tokens=user_tokens
    )
    return start_server(
        ["--model", str(model), "--served-model-name", "tooled", "--n-ctx", "4096"],
        where / "server.log",
    )


@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = _serve_template(tmp_path_factory.mktemp("tools"), HERMES)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = _serve_template(tmp_path_factory.mktemp("deepseek"), DEEPSEEK, DS_MARKERS)
    yield srv
    srv.stop()


def _client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="none", _strict_response_validation=True)


def _schema(name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_a_named_tool_choice_returns_that_call_with_valid_arguments(tooled: Server) -> None:
    """Named: the answer is one call of that function, its arguments valid under its
    schema, `finish_reason` `tool_calls`; streamed, the deltas add up to the same call."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw: dict[str, Any] = {"model": "tooled", "messages": ASK, "tools": TOOLS, "max_tokens": 200,
                          "temperature": 0, "extra_body": {"cache_prompt": False},
                          "tool_choice": named}  # fmt: skip
    with _client(tooled) as c:
        got = c.chat.completions.create(**kw)
        chunks = list(c.chat.completions.create(**kw, stream=True))
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [call.function.name for call in calls] == ["get_weather"]  # type: ignore[union-attr]
    args = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(args, WEATHER)
    assert calls[0].id.startswith("call_")
    streamed = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert [(t.function.name, t.function.arguments) for t in streamed] == [  # type: ignore[union-attr]
        ("get_weather", calls[0].function.arguments)  # type: ignore[union-attr]
    ]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "tool_calls"


def test_required_calls_one_of_the_tools_sampled_too(tooled: Server) -> None:
    with _client(tooled) as c:
        for seed in range(4):
            got = c.chat.completions.create(
                model="tooled", messages=ASK, tools=TOOLS, tool_choice="required",
                parallel_tool_calls=False, max_tokens=200, temperature=1.0, seed=seed,
            )  # fmt: skip
            calls = got.choices[0].message.tool_calls or []
            assert len(calls) == 1, got.choices[0].message
            name = calls[0].function.name  # type: ignore[union-attr]
            jsonschema.validate(json.loads(calls[0].function.arguments), _schema(name))  # type: ignore[union-attr]


def test_a_conversation_with_a_call_and_its_result_continues(tooled: Server) -> None:
    """The assistant's call and the tool's result render in the model's format (here:
    the call as the template writes it, the result in a <tool_response>)."""
    history: Any = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]  # fmt: skip
    with _client(tooled) as c:
        plain = c.chat.completions.create(model="tooled", messages=ASK, tools=TOOLS, max_tokens=2)
        after = c.chat.completions.create(
            model="tooled", messages=history, tools=TOOLS, max_tokens=2
        )
    assert after.usage and plain.usage
    assert after.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_tool_choice_none_renders_no_tools(tooled: Server) -> None:
    with _client(tooled) as c:
        none = c.chat.completions.create(
            model="tooled", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=2
        )
        auto = c.chat.completions.create(model="tooled", messages=ASK, tools=TOOLS, max_tokens=2)
    assert none.usage and auto.usage
    assert none.usage.prompt_tokens < auto.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None


def test_what_cannot_be_served_is_a_400_naming_it(tooled: Server, server: Server) -> None:
    cases: list[tuple[Server, dict[str, Any], str]] = [
        (tooled, {"tools": TOOLS, "tool_choice": {"type": "function",
                                                  "function": {"name": "nope"}}}, "tool_choice"),
        (tooled, {"tool_choice": "required"}, "tool_choice"),
        (tooled, {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
         "tools[0].function.name"),
        # (Gemma's template has no tool format: the generic one, whose answer is the calls'
        # JSON, cannot also follow a response_format)
        (server, {"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice"),
    ]  # fmt: skip
    for srv, extra, param in cases:
        model = "tooled" if srv is tooled else "gemma-3-270m"
        with _client(srv) as c, pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=model, messages=ASK, max_tokens=2, **extra)
        assert e.value.body["param"] == param  # type: ignore[index]


def test_deepseek_format_calls_and_conversations(deepseek: Server) -> None:
    """A DeepSeek V3.1 style template: the forced call is written in its syntax and comes
    back as tool_calls with valid arguments; a conversation with a call (its arguments
    added to the template's text as JSON) and the tool's output renders and continues."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    with _client(deepseek) as c:
        got = c.chat.completions.create(
            model="tooled", messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=300,
            temperature=0,
        )  # fmt: skip
        calls = got.choices[0].message.tool_calls or []
        assert got.choices[0].finish_reason == "tool_calls"
        assert [call.function.name for call in calls] == ["get_weather"]  # type: ignore[union-attr]
        args = calls[0].function.arguments  # type: ignore[union-attr]
        jsonschema.validate(json.loads(args), WEATHER)
        history: Any = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1",
             "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
        ]  # fmt: skip
        after = c.chat.completions.create(model="tooled", messages=history, max_tokens=2)
        plain = c.chat.completions.create(model="tooled", messages=ASK, max_tokens=2)
    assert after.usage and plain.usage
    assert after.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the call and its output


def test_auto_holds_a_call_the_model_starts_to_its_grammar(deepseek: Server) -> None:
    """`auto`: the model may answer in text or call; once it writes the start of the
    calls (here made sure of with logit_bias on that one token), the rest is held to the
    calls' grammar, so what it calls is a listed function with valid arguments — from a
    random-weight model, whose free text after the start is never a call. Without the
    bias the same request answers in text, unconstrained."""
    begin = vocab(DS_MARKERS)[0].index("<｜tool▁calls▁begin｜>")
    kw: dict[str, Any] = {"model": "tooled", "messages": ASK, "tools": TOOLS, "max_tokens": 300,
                          "parallel_tool_calls": False}  # fmt: skip
    with _client(deepseek) as c:
        for seed in range(3):
            got = c.chat.completions.create(
                **kw, temperature=1.0, seed=seed, logit_bias={str(begin): 100}
            )
            choice = got.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message
            (call,) = choice.message.tool_calls or []
            name = call.function.name  # type: ignore[union-attr]
            jsonschema.validate(json.loads(call.function.arguments), _schema(name))  # type: ignore[union-attr]
        free = c.chat.completions.create(**{**kw, "max_tokens": 8}, temperature=0)
    assert free.choices[0].message.tool_calls is None and free.choices[0].message.content


@pytest.fixture(scope="module")
def v31(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """DeepSeek V3.1's own template (as llama.cpp ships it): it writes calls in its format
    but never the request's `tools`. Started with prompt logprobs off."""
    source = llama_cpp_source(ROOT / ".bench") / "models/templates/deepseek-ai-DeepSeek-V3.1.jinja"
    where = tmp_path_factory.mktemp("v31")
    model = write_llama(where / "v31.gguf", seed=4, chat_template=source.read_text("utf-8"),
                        user_tokens=DS_MARKERS)  # fmt: skip
    srv = start_server(
        ["--model", str(model), "--served-model-name", "tooled", "--n-ctx", "4096",
         "--prompt-logprob-rows", "0"],
        where / "server.log",
    )  # fmt: skip
    yield srv
    srv.stop()


def test_a_template_that_drops_tools_gets_them_from_the_server(v31: Server) -> None:
    """The model is told its functions (name, description, parameters) and the call syntax
    in the system message, since its template would not; a forced call comes back valid."""
    tools: Any = [{**TOOLS[0], "function": {**TOOLS[0]["function"],
                                           "description": "The weather in a city"}}]  # fmt: skip
    with _client(v31) as c:
        bare = c.chat.completions.create(model="tooled", messages=ASK, max_tokens=1)
        told = c.chat.completions.create(model="tooled", messages=ASK, tools=tools, max_tokens=1)
        named = c.chat.completions.create(
            model="tooled", messages=ASK, tools=tools, max_tokens=300, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )  # fmt: skip
    assert bare.usage and told.usage
    # name, description, the schema and the syntax: well over a hundred tokens of this vocabulary
    assert told.usage.prompt_tokens > bare.usage.prompt_tokens + 100
    (call,) = named.choices[0].message.tool_calls or []
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)  # type: ignore[union-attr]


def test_prompt_logprobs_off_is_a_400_naming_echo(v31: Server) -> None:
    with _client(v31) as c, pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tooled", prompt="abc", echo=True, logprobs=1, max_tokens=1)
    assert e.value.body["param"] == "echo"  # type: ignore[index]
    assert "--prompt-logprob-rows 0" in e.value.body["message"]  # type: ignore[index]


def test_auto_with_a_schema_the_grammar_cannot_hold_is_still_served(deepseek: Server) -> None:
    """`auto` holds a started call to the grammar where it can; a function whose schema the
    grammar engine refuses leaves the answer parsed only (a forced call there is a 400)."""
    odd: Any = [{"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/definitions/missing"}}}}}]  # fmt: skip
    with _client(deepseek) as c:
        got = c.chat.completions.create(model="tooled", messages=ASK, tools=odd, max_tokens=4)
        assert got.choices[0].finish_reason in ("length", "stop", "tool_calls")
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model="tooled", messages=ASK, tools=odd, tool_choice="required", max_tokens=4
            )
    assert e.value.body["param"] == "tools"  # type: ignore[index]
