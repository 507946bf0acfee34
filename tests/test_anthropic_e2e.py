"""Anthropic's Messages API end to end: real server processes driven by the official
`anthropic` SDK in strict response validation, and at the HTTP level (httpx) where the
event order itself is under test. The embedded model for plain messages; tiny generated
models whose chat templates write Hermes tool calls (api.pipeline.tool_calls) and open a `<think>`
block (api.pipeline.reasoning) for tools and thinking."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic import Anthropic
from prometheus_client.parser import text_string_to_metric_families

from bench.server_proc import Server, start_server
from tests.conftest import MODEL
from tests.test_reasoning_e2e import THINKING
from tests.test_tools_e2e import HERMES, WEATHER
from tests.tiny_gguf import write_llama

pytestmark = pytest.mark.e2e

ASK: Any = [{"role": "user", "content": "Write a short story about a robot."}]
# This SDK has no sampling fields (the server reads Anthropic's `temperature`, `top_p`,
# `top_k`): they go in `extra_body`.
GREEDY = {"temperature": 0}
REPRO = {"strata_reproducible": "required", **GREEDY}  # the same output every time
KEY = "sk-test-anthropic"


def client(server: Server, **kw: Any) -> Anthropic:
    kw.setdefault("api_key", "none")
    return Anthropic(base_url=server.url, max_retries=0, _strict_response_validation=True, **kw)


def post(server: Server, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120, **kw)


def dump(blocks: Any) -> list[dict[str, Any]]:
    """Content blocks as data, whichever SDK class holds them (the stream helper's
    accumulate into its own subclasses)."""
    return [b.model_dump(exclude_none=True) for b in blocks]


def sse(server: Server, body: dict[str, Any], **kw: Any) -> list[tuple[str, dict[str, Any]]]:
    """A streamed request's events as (event name, data), read off the wire."""
    out: list[tuple[str, dict[str, Any]]] = []
    name = None
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True},
                      timeout=120, **kw) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                assert name is not None, "data without an event name"
                out.append((name, json.loads(line[6:])))
                name = None
    return out


DELTAS = {"text": {"text_delta"}, "thinking": {"thinking_delta", "signature_delta"},
          "tool_use": {"input_json_delta"}}  # fmt: skip


def order_problems(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """What breaks Anthropic's event order: message_start; per block a start at the next
    index, deltas of its kind at its index (a thinking block's signature last), a stop;
    message_delta; message_stop. Pings may come anywhere."""
    problems = [f"event {n!r} carries type {d.get('type')!r}" for n, d in events
                if n != d.get("type")]  # fmt: skip
    events = [(n, d) for n, d in events if n != "ping"]
    names = [n for n, _ in events]
    if names[:1] != ["message_start"]:
        problems.append(f"first event {names[:1]}")
    if names[-2:] != ["message_delta", "message_stop"]:
        problems.append(f"last events {names[-2:]}")
    open_: tuple[int, str] | None = None
    signed, next_index = False, 0
    for n, d in events[1:-2]:
        if n == "content_block_start":
            if open_ is not None:
                problems.append(f"block {d['index']} starts while {open_[0]} is open")
            if d["index"] != next_index:
                problems.append(f"block {d['index']} starts where {next_index} should")
            open_, signed = (d["index"], d["content_block"]["type"]), False
            next_index += 1
        elif n == "content_block_delta":
            kind = d["delta"]["type"]
            if open_ is None or d["index"] != open_[0]:
                problems.append(f"{kind} for block {d['index']}, open: {open_}")
            elif kind not in DELTAS[open_[1]] or (signed and kind == "thinking_delta"):
                problems.append(f"{kind} in a {open_[1]} block (signed: {signed})")
            signed = signed or kind == "signature_delta"
        elif n == "content_block_stop":
            if open_ is None or d["index"] != open_[0]:
                problems.append(f"stop of block {d['index']}, open: {open_}")
            elif open_[1] == "thinking" and not signed:
                problems.append(f"thinking block {open_[0]} stops unsigned")
            open_ = None
        else:
            problems.append(f"{n} between the blocks")
    if open_ is not None:
        problems.append(f"block {open_[0]} never stops")
    return problems


def test_the_order_check_can_fail() -> None:
    start = ("message_start", {"type": "message_start"})
    end = [("message_delta", {"type": "message_delta"}), ("message_stop", {"type": "message_stop"})]

    def block(i: int, kind: str, *deltas: str) -> list[tuple[str, dict[str, Any]]]:
        return [("content_block_start", {"type": "content_block_start", "index": i,
                                         "content_block": {"type": kind}}),
                *[("content_block_delta", {"type": "content_block_delta", "index": i,
                                           "delta": {"type": t}}) for t in deltas],
                ("content_block_stop", {"type": "content_block_stop", "index": i})]  # fmt: skip

    good = [start, *block(0, "thinking", "thinking_delta", "signature_delta"),
            *block(1, "text", "text_delta"), *block(2, "tool_use", "input_json_delta"),
            *end]  # fmt: skip
    assert order_problems(good) == []
    assert order_problems([*good[:1], ("ping", {"type": "ping"}), *good[1:]]) == []
    bad = [
        [start, *block(1, "text", "text_delta"), *end],  # not from 0
        [start, *block(0, "text"), *block(2, "text"), *end],  # a gap
        [start, *block(0, "text", "text_delta")[:-1], *end],  # never stopped
        [start, *block(0, "thinking", "thinking_delta"), *end],  # unsigned
        [start, *block(0, "thinking", "signature_delta", "thinking_delta"), *end],
        [start, *block(0, "text", "input_json_delta"), *end],  # a delta of another kind
        [start, *block(0, "text"), end[0]],  # no message_stop
        [*block(0, "text"), *end],  # no message_start
        [start, *block(0, "text"), ("message_delta", {"type": "message_stop"}), end[1]],
    ]  # fmt: skip
    for events in bad:
        assert order_problems(events), events


# ---- the embedded model ---------------------------------------------------------------
def test_create_answers_with_a_message(server: Server) -> None:
    with client(server) as c:
        msg = c.messages.create(model=MODEL, max_tokens=12, messages=ASK, extra_body=GREEDY)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text  # type: ignore[union-attr]
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    u = msg.usage
    assert u.cache_creation_input_tokens == 0 and u.cache_read_input_tokens is not None
    assert u.input_tokens + u.cache_read_input_tokens > 5
    assert 0 < u.output_tokens <= 12
    if msg.stop_reason == "max_tokens":
        assert u.output_tokens == 12


def test_the_streamed_message_is_the_created_one(server: Server) -> None:
    """At temperature 0 (in the reproducible lane: the same tokens every time, whatever
    the prefix cache read) the message the SDK accumulates from the stream has the
    content and stop reason of the one created whole; the usage adds up the same."""
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 24, "messages": ASK,
                          "system": "You are terse.", "extra_body": REPRO}  # fmt: skip
    with client(server) as c:
        whole = c.messages.create(**kw)
        with c.messages.stream(**kw) as stream:
            texts = list(stream.text_stream)
            streamed = stream.get_final_message()
    assert dump(streamed.content) == dump(whole.content)
    assert (streamed.stop_reason, streamed.stop_sequence) == (whole.stop_reason, None)
    assert "".join(texts) == whole.content[0].text  # type: ignore[union-attr]
    assert streamed.id.startswith("msg_") and streamed.id != whole.id

    def total(u: anthropic.types.Usage) -> tuple[int, int]:
        return u.input_tokens + (u.cache_read_input_tokens or 0), u.output_tokens

    assert total(streamed.usage) == total(whole.usage)


def test_a_sampled_request_in_the_reproducible_lane_is_refused(server: Server) -> None:
    """The lane needs a seed to sample reproducibly, and the Messages API has none."""
    with client(server) as c, pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model=MODEL, max_tokens=4, messages=ASK,
                          extra_body={**REPRO, "temperature": 0.7})  # fmt: skip
    assert e.value.body["error"]["message"].startswith("strata_reproducible: ")  # type: ignore[index]


def test_the_raw_stream_keeps_anthropics_event_order(server: Server) -> None:
    body = {"model": MODEL, "max_tokens": 16, "messages": ASK, **REPRO}
    events = sse(server, body)
    assert order_problems(events) == []
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["id"].startswith("msg_")
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    whole = post(server, "/v1/messages", body).json()
    assert [c["text"] for c in whole["content"]] == [text]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == whole["stop_reason"]
    assert delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_stop_sequences_end_the_message_and_are_reported(server: Server) -> None:
    """A word of the greedy answer as a stop sequence: the answer ends right before its
    first occurrence, `stop_reason` is `stop_sequence` and names it, streamed or not."""
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 32, "messages": ASK,
                          "extra_body": REPRO}  # fmt: skip
    with client(server) as c:
        free = c.messages.create(**kw).content[0].text  # type: ignore[union-attr]
        words = [w for w in free.split() if len(w) >= 3]
        assert len(words) >= 3, free
        stop = words[2]
        cut = c.messages.create(**kw, stop_sequences=["zzqx", stop])
        with c.messages.stream(**kw, stop_sequences=[stop]) as stream:
            streamed = stream.get_final_message()
    want = free[: free.find(stop)]
    assert [b.text for b in cut.content] == ([want] if want else [])  # type: ignore[union-attr]
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert dump(streamed.content) == dump(cut.content)


def test_system_and_turns_render_into_the_prompt(server: Server) -> None:
    """count_tokens counts what /v1/messages reads: a system prompt adds to it, as do
    earlier turns; consecutive user turns are one turn, their texts apart."""
    with client(server) as c:

        def count(**kw: Any) -> int:
            return c.messages.count_tokens(model=MODEL, **kw).input_tokens

        bare = count(messages=ASK)
        system = count(messages=ASK, system="You are a pirate. Answer like one.")
        pirate = [{"type": "text", "text": "You are a pirate."},
                  {"type": "text", "text": "Answer like one."}]  # fmt: skip
        blocks = count(messages=ASK, system=pirate)
        turns: Any = [*ASK, {"role": "assistant", "content": "Beep."},
                      {"role": "user", "content": "Another one, please."}]  # fmt: skip
        multi = count(messages=turns)
        answer = c.messages.create(model=MODEL, max_tokens=8, messages=turns, extra_body=GREEDY)
        split = count(
            messages=[
                {"role": "user", "content": "one"},
                {"role": "user", "content": [{"type": "text", "text": "two"}]},
            ]
        )
        joined = count(messages=[{"role": "user", "content": "one\n\ntwo"}])
    assert system > bare + 5 and blocks > bare + 5
    assert multi > bare + 8
    u = answer.usage
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == multi
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens")
    assert split == joined


def test_what_claude_code_sends_to_a_model_it_does_not_know_is_answered(server: Server) -> None:
    """Claude Code, given a model name it does not know as Claude's, puts its environment
    description in a `system` message inside `messages` and asks for adaptive thinking,
    context-management edits, an effort and metadata: every part is taken, and the
    system message is read where it stands (its tokens are in the prompt)."""
    env = "Working directory: /home/user/project. Platform: linux. Today is Monday."
    turns: Any = [ASK[0], {"role": "system", "content": [{"type": "text", "text": env}]},
                  {"role": "user", "content": "Keep it under fifty words."}]  # fmt: skip
    body: Any = {
        "model": MODEL, "max_tokens": 16, "messages": turns, "temperature": 0,
        "system": [{"type": "text", "text": "You are an agent.",
                    "cache_control": {"type": "ephemeral"}}],
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                          "keep": "all"}]},
        "output_config": {"effort": "high"}, "metadata": {"user_id": "user_abc_session_1"},
        "tools": [], "stream": False,
    }  # fmt: skip
    r = post(server, "/v1/messages?beta=true", body)
    assert r.status_code == 200, r.text
    assert r.json()["content"] and r.json()["stop_reason"] in ("end_turn", "max_tokens")
    without = [turns[0], turns[2]]
    count = post(server, "/v1/messages/count_tokens?beta=true", {"model": MODEL, "messages": turns})
    bare = post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": without})
    assert count.status_code == bare.status_code == 200, count.text
    assert count.json()["input_tokens"] > bare.json()["input_tokens"] + 10
    # a system message's blocks are text: anything else is named
    image: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                              "data": "iVBORw0KGgo="}}  # fmt: skip
    bad = post(server, "/v1/messages", {**body, "messages": [
        ASK[0], {"role": "system", "content": [image]}]})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert "messages[1].content[0]" in bad.json()["error"]["message"]


def test_a_format_holds_the_answer_to_its_schema(server: Server) -> None:
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
              "maximum": 99}}, "required": ["age"], "additionalProperties": False}  # fmt: skip
    ask: Any = [{"role": "user", "content": "How old is Alice, who is 30? Answer in JSON."}]
    with client(server) as c:
        msg = c.messages.create(
            model=MODEL, max_tokens=60, messages=ask,
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}},
                        **GREEDY},
        )  # fmt: skip
    assert msg.stop_reason == "end_turn"
    jsonschema.validate(json.loads(msg.content[0].text), schema)  # type: ignore[union-attr]


def test_malformed_bodies_get_anthropic_400s(server: Server) -> None:
    text = {"type": "text", "text": "hi"}
    user = {"role": "user", "content": [text]}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"max_tokens": 4}, "messages"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"messages": [user]}, "max_tokens"),
        ({"max_tokens": 0, "messages": [user]}, "max_tokens"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
         "messages[0].content[0].type"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": [
            text, {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                               "data": "iVBORw0KGgo="}}]}]},
         "messages[0].content[1]: image blocks are not served"),
        ({"max_tokens": 4, "messages": [{"role": "tool", "content": "hi"}]},
         "messages[0].role"),
        ({"max_tokens": 4, "messages": [{"role": "system", "content": "hi"}]},
         "no user turn"),
        ({"max_tokens": 4, "messages": [user], "temperature": 1.5}, "temperature"),
        ({"max_tokens": 4, "messages": [user], "stop_sequences": [""]}, "stop_sequences[0]"),
        ({"max_tokens": 4, "messages": [user], "tools": [
            {"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"max_tokens": 4, "messages": [user], "thinking": {"type": "sometimes"}}, "thinking"),
    ]  # fmt: skip
    for body, where in cases:
        r = post(server, "/v1/messages", {"model": MODEL, **body})
        assert r.status_code == 400, (body, r.text)
        got = r.json()
        assert set(got) == {"type", "error"} and got["type"] == "error", got
        assert got["error"]["type"] == "invalid_request_error"
        assert where in got["error"]["message"], (where, got)
    r = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=60,
                   headers={"content-type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    with client(server) as c, pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with client(server) as c, pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain",
                                            "data": "x"}}]}])  # fmt: skip
    assert "document blocks are not served" in bad.value.message


def test_what_the_routes_do_not_take_is_answered_in_anthropics_envelope(server: Server) -> None:
    """A method the route does not take, a path under it that is none: Anthropic's
    envelope too (the OpenAI routes keep theirs)."""
    for method, path, status in (("GET", "/v1/messages", 405), ("TRACE", "/v1/messages", 405),
                                 ("POST", "/v1/messages/nope", 404)):  # fmt: skip
        r = httpx.request(method, server.url + path, timeout=30)
        assert r.status_code == status, (method, path)
        got = r.json()
        assert got["type"] == "error" and set(got["error"]) == {"type", "message"}, got
    assert httpx.get(server.url + "/v1/messages").headers["allow"] == "POST"
    assert set(httpx.get(server.url + "/v1/completions").json()) == {"error"}


def _metrics(server: Server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {f"{s.name}{{{s.labels.get('route')},{s.labels.get('code')}}}": s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "onegpu_http_responses_total"}  # fmt: skip


def test_metrics_count_the_routes(server: Server) -> None:
    def seen(route: str, code: int) -> float:
        return _metrics(server).get(f"onegpu_http_responses_total{{{route},{code}}}", 0.0)

    before = [seen("/v1/messages", 200), seen("/v1/messages", 400),
              seen("/v1/messages/count_tokens", 200)]  # fmt: skip
    body = {"model": MODEL, "max_tokens": 2, "messages": ASK}
    assert post(server, "/v1/messages", body).status_code == 200
    assert post(server, "/v1/messages", {**body, "max_tokens": 0}).status_code == 400
    assert post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": ASK}).json()[
        "input_tokens"] > 5  # fmt: skip
    after = [seen("/v1/messages", 200), seen("/v1/messages", 400),
             seen("/v1/messages/count_tokens", 200)]  # fmt: skip
    assert after == [b + 1 for b in before]


# ---- tools: a Hermes template, a server with a key ------------------------------------
@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("anthropic-tools")
    model = write_llama(where / "tooled.gguf", seed=4, chat_template=HERMES)
    srv = start_server(
        ["--model", str(model), "--served-model-name", "tooled", "--n-ctx", "4096",
         "--api-key", KEY],
        where / "server.log",
    )  # fmt: skip
    yield srv
    srv.stop()


TOOLS: Any = [
    {"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER},
    {"name": "get_time", "input_schema": {"type": "object", "properties": {
        "tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"], "additionalProperties": False}},
]  # fmt: skip
HELLO: Any = [{"role": "user", "content": "hello world"}]


def _schema(name: str) -> Any:
    return next(t["input_schema"] for t in TOOLS if t["name"] == name)


def test_a_key_in_either_header_is_taken(tooled: Server) -> None:
    body = {"model": "tooled", "max_tokens": 1, "messages": HELLO}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"},
                    {"x-api-key": KEY, "Authorization": "Bearer wrong"}):  # fmt: skip
        assert post(tooled, "/v1/messages", body, headers=headers).status_code == 200
    r = post(tooled, "/v1/messages", body, headers={"x-api-key": "wrong"})
    assert r.status_code == 401
    assert r.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid or missing API key"},
    }
    with client(tooled, api_key="wrong") as c, pytest.raises(anthropic.AuthenticationError):
        c.messages.count_tokens(model="tooled", messages=HELLO)
    models = httpx.get(tooled.url + "/v1/models", headers={"x-api-key": "wrong"})
    assert models.status_code == 401 and set(models.json()) == {"error"}  # OpenAI's envelope
    assert httpx.get(tooled.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200


def test_a_tool_use_round_trip(tooled: Server) -> None:
    """`any` (one call): the answer is a call of a listed tool whose input fits its
    schema, stop reason `tool_use`; streamed, the same call. Sent back with its result (`auto` now),
    the call and the result are in the prompt — a longer result, a longer prompt."""
    kw: dict[str, Any] = {"model": "tooled", "max_tokens": 200, "messages": HELLO,
                          "tools": TOOLS, "extra_body": REPRO}  # fmt: skip
    with client(tooled, api_key=KEY) as c:
        one: Any = {"type": "any", "disable_parallel_tool_use": True}
        msg = c.messages.create(**kw, tool_choice=one)
        with c.messages.stream(**kw, tool_choice=one) as stream:
            streamed = stream.get_final_message()
        assert msg.stop_reason == "tool_use", msg
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert uses and all(u.id.startswith("toolu_") for u in uses)
        for u in uses:
            jsonschema.validate(u.input, _schema(u.name))
        calls = [(u.name, u.input) for u in uses]
        assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == calls
        assert streamed.stop_reason == "tool_use"

        def follow_up(result: str) -> list[Any]:
            return [*HELLO, {"role": "assistant", "content": msg.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id,
                                                  "content": result} for u in uses]}]  # fmt: skip

        short = c.messages.count_tokens(model="tooled", messages=follow_up("ok"), tools=TOOLS)
        long = c.messages.count_tokens(model="tooled", messages=follow_up("ok " * 40),
                                       tools=TOOLS)  # fmt: skip
        after = c.messages.create(
            model="tooled", max_tokens=4, messages=follow_up("ok"), tools=TOOLS,
            tool_choice={"type": "auto"},
        )  # fmt: skip
        plain = c.messages.count_tokens(model="tooled", messages=HELLO, tools=TOOLS)
    assert long.input_tokens >= short.input_tokens + 40 * len(uses)
    assert short.input_tokens > plain.input_tokens + 10  # the call and its result
    assert after.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert after.usage.input_tokens + (after.usage.cache_read_input_tokens or 0) == \
        short.input_tokens  # fmt: skip


def test_a_named_tool_and_one_call_only(tooled: Server) -> None:
    with client(tooled, api_key=KEY) as c:
        named = c.messages.create(
            model="tooled", max_tokens=200, messages=HELLO, tools=TOOLS, extra_body=GREEDY,
            tool_choice={"type": "tool", "name": "get_time"},
        )  # fmt: skip
        for seed_temperature in (0.0, 1.0):
            one = c.messages.create(
                model="tooled", max_tokens=300, messages=HELLO, tools=TOOLS,
                extra_body={"temperature": seed_temperature},
                tool_choice={"type": "any", "disable_parallel_tool_use": True},
            )  # fmt: skip
            assert [b.type for b in one.content] == ["tool_use"], one.content
        with pytest.raises(anthropic.BadRequestError) as e:
            c.messages.create(model="tooled", max_tokens=4, messages=HELLO, tools=TOOLS,
                              tool_choice={"type": "tool", "name": "nope"})  # fmt: skip
        none = c.messages.count_tokens(model="tooled", messages=HELLO, tools=TOOLS,
                                       tool_choice={"type": "none"})  # fmt: skip
        auto = c.messages.count_tokens(model="tooled", messages=HELLO, tools=TOOLS)
    assert [(b.type, b.name) for b in named.content] == [("tool_use", "get_time")]  # type: ignore[union-attr]
    jsonschema.validate(named.content[0].input, _schema("get_time"))  # type: ignore[union-attr]
    assert e.value.body["error"]["message"].startswith("tool_choice names 'nope'")  # type: ignore[index]
    assert none.input_tokens < auto.input_tokens  # `none`: the tools are not rendered


def test_a_streamed_call_keeps_the_event_order(tooled: Server) -> None:
    body = {"model": "tooled", "max_tokens": 200, "messages": HELLO, "tools": TOOLS,
            "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 0}  # fmt: skip
    events = sse(tooled, body, headers={"x-api-key": KEY})
    assert order_problems(events) == []
    starts = [d["content_block"] for n, d in events if n == "content_block_start"]
    assert [(s["type"], s["name"], s["input"]) for s in starts] == [
        ("tool_use", "get_weather", {})]  # fmt: skip
    args = "".join(d["delta"]["partial_json"] for n, d in events if n == "content_block_delta")
    jsonschema.validate(json.loads(args), WEATHER)
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"


# ---- thinking: a template that opens <think> ------------------------------------------
@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("anthropic-thinking")
    model = write_llama(where / "thinker.gguf", seed=3, chat_template=THINKING)
    srv = start_server(
        ["--model", str(model), "--served-model-name", "thinker", "--n-ctx", "2048",
         "--max-model-len", "512"],
        where / "server.log",
    )  # fmt: skip
    yield srv
    srv.stop()


THINK: Any = {"type": "enabled", "budget_tokens": 1024}


def test_thinking_comes_as_thinking_blocks(thinker: Server) -> None:
    """Asked for, the reasoning is a thinking block first (signed), streamed or not, the
    same at temperature 0; not asked for, it is not shown, and the text is the same."""
    kw: dict[str, Any] = {"model": "thinker", "max_tokens": 24, "messages": HELLO,
                          "extra_body": REPRO}  # fmt: skip
    with client(thinker) as c:
        msg = c.messages.create(**kw, thinking=THINK)
        with c.messages.stream(**kw, thinking=THINK) as stream:
            streamed = stream.get_final_message()
        hidden = c.messages.create(**kw)
    first = msg.content[0]
    assert first.type == "thinking" and first.thinking and first.signature
    assert dump(streamed.content) == dump(msg.content)
    assert streamed.stop_reason == msg.stop_reason
    assert dump(hidden.content) == dump(msg.content[1:])  # no thinking block
    assert hidden.usage.output_tokens == msg.usage.output_tokens
    events = sse(thinker, {"model": "thinker", "max_tokens": 24, "messages": HELLO,
                           "thinking": THINK, **REPRO})  # fmt: skip
    assert order_problems(events) == []
    blocks = [d["content_block"]["type"] for n, d in events if n == "content_block_start"]
    assert blocks[0] == "thinking"


def test_thinking_in_the_history_is_accepted_and_not_rendered(thinker: Server) -> None:
    with client(thinker) as c:
        msg = c.messages.create(model="thinker", max_tokens=12, messages=HELLO, thinking=THINK,
                                extra_body=GREEDY)  # fmt: skip
        thought = [b for b in msg.content if b.type == "thinking"]
        assert thought
        again: Any = [*HELLO, {"role": "assistant", "content": [*thought, {"type": "text",
                      "text": "Hi."}, {"type": "redacted_thinking", "data": "xyz"}]},
                      {"role": "user", "content": "And now?"}]  # fmt: skip
        without: Any = [*HELLO, {"role": "assistant", "content": "Hi."},
                        {"role": "user", "content": "And now?"}]  # fmt: skip
        after = c.messages.create(model="thinker", max_tokens=4, messages=again, thinking=THINK)
        counted = c.messages.count_tokens(model="thinker", messages=again)
        plain = c.messages.count_tokens(model="thinker", messages=without)
    assert after.stop_reason in ("end_turn", "max_tokens")
    assert counted.input_tokens == plain.input_tokens


def test_max_tokens_is_a_bound_the_context_may_cut(thinker: Server) -> None:
    """More than the context leaves (Claude Code asks for 32K whatever the model): the
    answer gets what it leaves and says so; the OpenAI route still refuses it."""
    with client(thinker) as c:
        msg = c.messages.create(model="thinker", max_tokens=4096, messages=HELLO,
                                extra_body=GREEDY)  # fmt: skip
    assert msg.stop_reason == "model_context_window_exceeded"
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) + \
        msg.usage.output_tokens == 512  # fmt: skip
    chat = {"model": "thinker", "max_tokens": 4096, "messages": HELLO}
    assert post(thinker, "/v1/chat/completions", chat).status_code == 400
