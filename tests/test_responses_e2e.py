"""OpenAI's Responses API (`POST /v1/responses`) end to end, read by the official `openai`
client in strict response validation: its `create`, `stream` and `parse` helpers on the
embedded model; a function-tool loop on a tiny model whose chat template writes the
Hermes call format; reasoning items on a tiny model whose template opens `<think>`.

The route is a codec over the same pipeline as chat completions, so at temperature 0 the
same conversation gives the same text both ways — which is what most tests compare. An
answer is made to end where a test needs a `completed` response (the SDK's `stream`
helper wants one) by the server's extensions: the end-of-generation token pushed to the
top (`logit_bias`) and held back for `min_tokens` tokens; `cache_prompt: false` keeps
greedy streams and bodies on steps of the same shape.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from openai.types.responses import ResponseFunctionToolCall, ResponseReasoningItem

from bench.server_proc import Server, start_server
from engine.default_model import default_model_path
from engine.gguf_header import read_header
from tests.conftest import MODEL
from tests.test_api_e2e import metrics
from tests.test_reasoning_e2e import THINKING
from tests.test_structured_e2e import Keeper
from tests.test_tools_e2e import HERMES, WEATHER
from tests.tiny_gguf import EOS_ID, write_llama

pytestmark = pytest.mark.e2e

ASK = "Write a short story about a robot."
TOOLS: Any = [
    {"type": "function", "name": "get_weather", "description": "The weather in a city",
     "parameters": WEATHER, "strict": True},
    {"type": "function", "name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"],
        "additionalProperties": False}},
]  # fmt: skip


def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="none", _strict_response_validation=True)


def ends_after(n: int, eos: int) -> dict[str, Any]:
    """The server's extensions that end an answer after exactly `n` tokens of text."""
    return {"logit_bias": {str(eos): 100}, "min_tokens": n, "cache_prompt": False}


@pytest.fixture(scope="module")
def eos() -> int:
    return int(read_header(default_model_path()).fields["tokenizer.ggml.eos_token_id"])


@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("responses-tools")
    model = write_llama(where / "tooled.gguf", seed=4, chat_template=HERMES)
    srv = start_server(["--model", str(model), "--served-model-name", "tooled",
                        "--n-ctx", "4096"], where / "server.log")  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("responses-thinker")
    model = write_llama(where / "thinker.gguf", seed=3, chat_template=THINKING)
    srv = start_server(["--model", str(model), "--served-model-name", "thinker",
                        "--n-ctx", "2048"], where / "server.log")  # fmt: skip
    yield srv
    srv.stop()


def test_string_and_item_inputs_answer_as_chat_does(server: Server) -> None:
    """A string, an easy message and a message item with `input_text` parts are the same
    user turn: the same prompt tokens as chat's, the same greedy text; the response
    object carries what the API promises (ids, status, usage, echoed settings)."""
    kw: dict[str, Any] = {"model": MODEL, "max_output_tokens": 12, "temperature": 0,
                          "extra_body": {"cache_prompt": False}}  # fmt: skip
    inputs: list[Any] = [
        ASK,
        [{"role": "user", "content": ASK}],
        [{"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": ASK[:10]}, {"type": "input_text", "text": ASK[10:]}]}],
    ]  # fmt: skip
    with client(server) as c:
        got = [c.responses.create(input=i, **kw) for i in inputs]
        chat = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=12,
            temperature=0, extra_body={"cache_prompt": False},
        )  # fmt: skip
    want = chat.choices[0].message.content
    assert want and chat.usage
    for r in got:
        assert r.output_text == want
        assert r.id.startswith("resp_") and r.object == "response"
        assert r.status == "incomplete" and r.incomplete_details
        assert r.incomplete_details.reason == "max_output_tokens"
        (msg,) = r.output
        assert msg.type == "message" and msg.id.startswith("msg_") and msg.status == "incomplete"
        assert r.usage and r.usage.input_tokens == chat.usage.prompt_tokens
        assert r.usage.output_tokens == 12
        assert r.usage.total_tokens == r.usage.input_tokens + 12
        assert (r.max_output_tokens, r.temperature, r.tool_choice, r.tools) == (12, 0, "auto", [])


def test_instructions_are_the_system_message(server: Server, eos: int) -> None:
    """`instructions` render as a system message ahead of the input (the chat template's
    own way); a `developer` item is a system turn too. Ended by the answer: completed."""
    rules = "Answer in one word."
    kw: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_output_tokens": 40}
    with client(server) as c:
        r = c.responses.create(input=ASK, instructions=rules, **kw,
                               extra_body=ends_after(5, eos))  # fmt: skip
        dev = c.responses.create(
            input=[{"role": "developer", "content": rules}, {"role": "user", "content": ASK}],
            **kw, extra_body=ends_after(5, eos),
        )  # fmt: skip
        chat = c.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": rules},
                                   {"role": "user", "content": ASK}],
            max_tokens=40, temperature=0, extra_body=ends_after(5, eos),
        )  # fmt: skip
    assert chat.choices[0].finish_reason == "stop" and chat.usage
    for got in (r, dev):
        assert got.status == "completed" and got.incomplete_details is None
        assert got.output_text == chat.choices[0].message.content
        assert got.usage and got.usage.input_tokens == chat.usage.prompt_tokens
        assert got.usage.output_tokens == 6  # 5, then the end
    assert r.instructions == rules and dev.instructions is None


def test_stream_events_come_in_order_and_add_up_to_the_body(server: Server, eos: int) -> None:
    """`responses.stream`: created, in_progress, the message item opened, its text in
    deltas, closed, completed — numbered in order; the final response is the deltas'
    text and, greedy, the body the same request gets unstreamed."""
    kw: dict[str, Any] = {"model": MODEL, "input": ASK, "temperature": 0,
                          "max_output_tokens": 60,
                          "extra_body": ends_after(20, eos)}  # fmt: skip
    with client(server) as c:
        body = c.responses.create(**kw)
        with c.responses.stream(**kw) as stream:
            events = list(stream)
            final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]  # fmt: skip
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]  # fmt: skip
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1 and len(deltas) == len(kinds) - 8
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (msg,) = final.output
    assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {(msg.id, 0, 0)}
    text = "".join(e.delta for e in deltas)
    assert text and final.output_text == text == body.output_text
    assert final.status == body.status == "completed"
    assert final.usage and body.usage
    assert final.usage.model_dump() == body.usage.model_dump()
    assert final.id == events[0].response.id  # type: ignore[union-attr]


def test_parse_returns_the_pydantic_object(server: Server) -> None:
    """`responses.parse` with a Pydantic model: `text.format` is its strict JSON schema,
    held by the grammar, so the answer parses; streamed, the same object."""
    kw: dict[str, Any] = {"model": MODEL, "input": "Describe the lighthouse keeper as JSON.",
                          "text_format": Keeper, "max_output_tokens": 120, "temperature": 0,
                          "extra_body": {"cache_prompt": False}}  # fmt: skip
    with client(server) as c:
        got = c.responses.parse(**kw)
        with c.responses.stream(**kw) as stream:
            streamed = stream.get_final_response()
    assert got.status == "completed"
    assert isinstance(got.output_parsed, Keeper)
    assert streamed.output_parsed == got.output_parsed
    fmt = got.text.format if got.text else None
    assert fmt is not None and fmt.type == "json_schema" and fmt.name == "Keeper"


def test_json_object_format(server: Server) -> None:
    with client(server) as c:
        got = c.responses.create(
            model=MODEL, temperature=0, max_output_tokens=200,
            input='Give a JSON object with the keys "name" and "age" for Alice, who is 30.',
            text={"format": {"type": "json_object"}},
        )  # fmt: skip
    assert got.status == "completed", got.output_text
    assert isinstance(json.loads(got.output_text), dict)


def test_a_function_tool_loop(tooled: Server) -> None:
    """A named `tool_choice` is a call of that function (a grammar: a random-weight model
    never calls by itself), arguments valid under its schema; streamed, the same call in
    its events. Its output goes back as a `function_call_output` item with the call, and
    the next answer is text (ended by the server's extensions)."""
    named = {"type": "function", "name": "get_weather"}
    kw: dict[str, Any] = {"model": "tooled", "tools": TOOLS, "temperature": 0,
                          "max_output_tokens": 200,
                          "extra_body": {"cache_prompt": False}}  # fmt: skip
    ask: list[Any] = [{"role": "user", "content": "hello world"}]
    with client(tooled) as c:
        first = c.responses.create(input=ask, tool_choice=named, **kw)
        with c.responses.stream(input=ask, tool_choice=named, **kw) as stream:
            events = list(stream)
            streamed = stream.get_final_response()
        (call,) = first.output
        assert isinstance(call, ResponseFunctionToolCall) and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
        assert call.call_id.startswith("call_") and (call.id or "").startswith("fc_")
        assert first.status == "completed" and first.output_text == ""
        (again,) = streamed.output
        assert isinstance(again, ResponseFunctionToolCall)
        assert (again.name, again.arguments) == (call.name, call.arguments)
        args = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert [e.arguments for e in args] == [call.arguments]  # type: ignore[union-attr]
        history = [*ask, call.model_dump(exclude_none=True),
                   {"type": "function_call_output", "call_id": call.call_id,
                    "output": '{"sky": "clear"}'}]  # fmt: skip
        final = c.responses.create(input=history, **{**kw, "extra_body": ends_after(8, EOS_ID)})
    assert final.status == "completed"
    (msg,) = final.output
    assert msg.type == "message" and final.output_text
    assert first.usage and final.usage
    # the call and its output are rendered in the model's format
    assert final.usage.input_tokens > first.usage.input_tokens + 20


def test_reasoning_comes_back_as_a_reasoning_item(thinker: Server) -> None:
    """A template that opens `<think>`: what the model writes there is a `reasoning`
    item (its text as `reasoning_text` content), exactly chat's `reasoning_content`;
    streamed, reasoning deltas add up to it, and its tokens are counted apart."""
    kw: dict[str, Any] = {"model": "thinker", "input": "hello world", "max_output_tokens": 12,
                          "temperature": 0, "reasoning": {"effort": "low"},
                          "extra_body": {"cache_prompt": False}}  # fmt: skip
    with client(thinker) as c:
        got = c.responses.create(**kw)
        events = list(c.responses.create(**kw, stream=True))
        chat = c.chat.completions.create(
            model="thinker", messages=[{"role": "user", "content": "hello world"}],
            max_tokens=12, temperature=0, extra_body={"cache_prompt": False},
        )  # fmt: skip
    thought = (chat.choices[0].message.model_extra or {}).get("reasoning_content")
    assert thought  # (the model thought: the test compares something)
    item = got.output[0]
    assert isinstance(item, ResponseReasoningItem) and item.id.startswith("rs_")
    assert item.content and item.content[0].text == thought and item.summary == []
    assert got.output_text == (chat.choices[0].message.content or "")
    assert got.usage and 0 < got.usage.output_tokens_details.reasoning_tokens <= 12
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == thought
    assert events[-1].type == "response.incomplete"
    assert [i.type for i in events[-1].response.output] == [i.type for i in got.output]  # type: ignore[union-attr]


def _refused(c: OpenAI, **kw: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(**kw)
    body: dict[str, Any] = e.value.body  # type: ignore[assignment]
    assert body["type"] == "invalid_request_error"
    return body


def test_what_is_not_served_is_a_400_naming_it(server: Server, tooled: Server) -> None:
    """Stored state, a forced built-in tool and non-text input are refused by this API's
    field names; so are the pipeline's own refusals (a context overrun by `max_output_tokens`,
    a schema by `text.format`)."""
    base: dict[str, Any] = {"model": MODEL, "input": "hi", "max_output_tokens": 4}
    image = [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this"},
        {"type": "input_image", "image_url": "https://example.com/a.png"}]}]  # fmt: skip
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"previous_response_id": "resp_123"}, "previous_response_id", "previous_response_id"),
        ({"input": image}, "input[0].content[1].type", "input_image"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "item_reference"),
        ({"max_output_tokens": 10**6}, "max_output_tokens", "context length"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema",
         "schema"),
        ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "function name"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
    ]  # fmt: skip
    with client(server) as c:
        for extra, param, named in cases:
            body = _refused(c, **{**base, **extra})
            assert body["param"] == param, body
            assert named in body["message"], body
    with client(tooled) as c:  # a forced call beside a format: the pipeline's own refusal
        body = _refused(c, model="tooled", input="hi", tools=TOOLS, tool_choice="required",
                        text={"format": {"type": "json_object"}})  # fmt: skip
        assert body["param"] == "tool_choice"


def test_what_codex_sends_is_answered_and_a_namespaced_call_comes_back_split(
    tooled: Server,
) -> None:
    """The request Codex CLI makes, by shape (its tools: functions, a `namespace` group, a
    `web_search` it cannot have here; `developer` messages; reasoning summaries, encrypted
    reasoning asked for, nothing stored, cache key and client metadata): answered, the
    built-in tool left out; a call of the group's tool comes back with `namespace` and
    `name` apart (Codex dispatches by the pair), and goes back into the history so."""
    text = {"type": "string", "maxLength": 8}
    echo = {"type": "function", "name": "echo", "description": "Echo the text back",
            "strict": False, "parameters": {"type": "object", "additionalProperties": False,
                                            "properties": {"text": text},
                                            "required": ["text"]}}  # fmt: skip
    tools: Any = [
        {**TOOLS[0], "strict": False},
        {"type": "namespace", "name": "mcp__helper", "description": "Tools of an MCP server",
         "tools": [echo]},
        {"type": "web_search", "external_web_access": False},
    ]  # fmt: skip
    history: list[Any] = [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent."}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context>cwd: /tmp"
                                                   "</environment_context>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                         "text": "echo hello"}]},
    ]  # fmt: skip
    meta = {"client_metadata": {"x-codex-turn-metadata": "{}"}}
    kw: dict[str, Any] = {
        "model": "tooled", "tools": tools, "parallel_tool_calls": True, "store": False,
        "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1", "max_output_tokens": 64, "temperature": 0,
        "extra_body": {**meta, **ends_after(8, EOS_ID)},  # (a random model's text ends)
    }  # fmt: skip
    with client(tooled) as c:
        auto = c.responses.create(input=history, tool_choice="auto", **kw)
        with c.responses.stream(input=history, tool_choice="auto", **kw) as stream:
            done = [e for e in stream if e.type == "response.output_item.done"]
            streamed = stream.get_final_response()
        named = {"type": "function", "name": "echo", "namespace": "mcp__helper"}
        forced = c.responses.create(
            input=history,
            tool_choice=named,
            **{**kw, "max_output_tokens": 200, "extra_body": {**meta, "cache_prompt": False}},
        )
        (call,) = [o for o in forced.output if o.type == "function_call"]
        again = [*history, call.model_dump(exclude_none=True),
                 {"type": "function_call_output", "call_id": call.call_id,
                  "output": [{"type": "input_text", "text": "hello"}]}]  # fmt: skip
        after = c.responses.create(input=again, tool_choice="auto", **kw)
    assert auto.status == "completed" and auto.output
    assert streamed.output and len(done) == len(streamed.output)  # an item's done for each
    assert [t.type for t in auto.tools] == ["function"]  # the function tools echoed
    wire = call.model_dump()
    assert (wire.get("namespace"), call.name) == ("mcp__helper", "echo"), wire
    jsonschema.validate(json.loads(call.arguments), echo["parameters"])
    assert after.output and after.usage and forced.usage
    assert after.usage.input_tokens > forced.usage.input_tokens


def test_metrics_count_the_route(server: Server) -> None:
    """`onegpu_http_responses_total` labels the route as it does the others, 200s and 400s."""
    before = metrics(server)
    with client(server) as c:
        c.responses.create(model=MODEL, input="hi", max_output_tokens=2)
        _refused(c, model=MODEL, input="hi", previous_response_id="resp_1")
    after = metrics(server)
    for code in ("200", "400"):
        key = f"onegpu_http_responses_total{{code={code},route=/v1/responses}}"
        assert after.get(key, 0) == before.get(key, 0) + 1, key
    r = httpx.post(server.base_url + "/responses", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
