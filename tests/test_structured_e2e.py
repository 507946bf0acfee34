"""Structured output end to end: `response_format` through a real server on the embedded
model, read by the official `openai` client in strict response validation — its own
`parse` helpers, streaming and not, greedy and sampled, `n` choices."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Any

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from bench.server_proc import Server
from tests.conftest import MODEL

pytestmark = pytest.mark.e2e


def client(server: Server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="none", _strict_response_validation=True)


class Color(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Keeper(BaseModel):
    """Bounded where a small model could otherwise write until max_tokens."""

    name: str = Field(max_length=24)
    age: int = Field(ge=18, le=99)
    lamp: Color


ASK = [{"role": "user", "content": "Describe the lighthouse keeper as JSON."}]

NESTED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 20},
        "status": {"enum": ["open", "closed", "stale"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0}, "admin": {"type": "boolean"}},
            "required": ["id", "admin"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "status", "tags", "owner"],
    "additionalProperties": False,
}


def test_parse_returns_the_pydantic_object_greedy_and_streamed(server: Server) -> None:
    """`chat.completions.parse` with a Pydantic model: the server constrains the answer to
    the model's strict schema, so the client's parsed object is there; streaming it
    (the client's `stream` helper) gives the same object at temperature 0 (without the
    prefix cache, whose steps of another shape may change the last bits of a logit)."""
    kw: dict[str, Any] = {"model": MODEL, "messages": ASK, "response_format": Keeper,
                          "max_tokens": 120, "temperature": 0,
                          "extra_body": {"cache_prompt": False}}  # fmt: skip
    with client(server) as c:
        got = c.chat.completions.parse(**kw)
        with c.chat.completions.stream(**kw) as stream:
            streamed = stream.get_final_completion()
    first = got.choices[0]
    assert first.finish_reason == "stop"
    assert isinstance(first.message.parsed, Keeper)
    assert streamed.choices[0].message.parsed == first.message.parsed


def test_sampled_choices_each_parse(server: Server) -> None:
    """`n` = 3 sampled choices: each one is constrained on its own and parses."""
    with client(server) as c:
        got = c.chat.completions.parse(
            model=MODEL, messages=ASK, response_format=Keeper, max_tokens=120, temperature=1.0,  # type: ignore[arg-type]
            seed=7, n=3,
        )  # fmt: skip
    assert len(got.choices) == 3
    for ch in got.choices:
        assert isinstance(ch.message.parsed, Keeper), ch.message.content


def test_json_object_mode_returns_a_json_object(server: Server) -> None:
    """Any JSON object (a 270M model can loop inside one, greedy, writing the same key
    again: the question asks for exactly what it can close)."""
    ask = [{"role": "user", "content": 'Give a JSON object with the keys "name" and "age" for '
                                       "Alice, who is 30."}]  # fmt: skip
    with client(server) as c:
        got = c.chat.completions.create(
            model=MODEL, messages=ask, response_format={"type": "json_object"},  # type: ignore[arg-type]
            max_tokens=200, temperature=0,
        )  # fmt: skip
    content = got.choices[0].message.content
    assert got.choices[0].finish_reason == "stop", content
    assert isinstance(json.loads(content or ""), dict)


def test_a_nested_schema_always_validates(server: Server) -> None:
    """Arrays, enums, required fields, `additionalProperties: false`, a nested object: 50
    sampled answers (5 seeds x 10 choices) all validate against the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "ticket", "schema": NESTED,
                                                  "strict": True}}  # fmt: skip
    answers: list[str] = []
    with client(server) as c:
        for seed in range(5):
            got = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "File a ticket as JSON."}],
                response_format=fmt, max_tokens=160, temperature=1.0, seed=seed, n=10,  # type: ignore[arg-type]
            )  # fmt: skip
            for ch in got.choices:
                assert ch.finish_reason == "stop", ch.message.content
                answers.append(ch.message.content or "")
    assert len(answers) == 50
    for text in answers:
        jsonschema.validate(json.loads(text), NESTED)


def test_llama_server_s_schema_spellings_are_held_to_the_schema(server: Server) -> None:
    """llama-server's `{"type": "json_object", "schema": …}` and its top-level
    `json_schema` field constrain the answer as `json_schema` does; both at once is a 400
    naming `json_schema`."""
    ask = [{"role": "user", "content": "File a ticket as JSON."}]
    spellings: list[dict[str, Any]] = [
        {"response_format": {"type": "json_object", "schema": NESTED}},
        {"extra_body": {"json_schema": NESTED}},
    ]
    with client(server) as c:
        for spelling in spellings:
            for stream in (False, True):
                kw: dict[str, Any] = {"model": MODEL, "messages": ask, "max_tokens": 160,
                                      "temperature": 1.0, "seed": 3, **spelling}  # fmt: skip
                if stream:
                    chunks = list(c.chat.completions.create(**kw, stream=True))
                    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                else:
                    text = c.chat.completions.create(**kw).choices[0].message.content or ""
                jsonschema.validate(json.loads(text), NESTED)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(
                model=MODEL, messages=ask, max_tokens=4, response_format={"type": "json_object"},
                extra_body={"json_schema": NESTED},
            )  # fmt: skip
    assert e.value.body["param"] == "json_schema"  # type: ignore[index]
