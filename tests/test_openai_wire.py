"""llama-server's spellings of a schema on OpenAI's routes (api.protocols.openai.wire): the
top-level `json_schema` field becomes the one `response_format` the pipeline reads."""

from __future__ import annotations

from typing import Any

import pytest

from api.protocols.openai.schemas import CHAT_DECODER
from api.protocols.openai.wire import response_format
from api.server.errors import InvalidRequest

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _body(**fields: Any) -> Any:
    import msgspec

    return CHAT_DECODER.decode(msgspec.json.encode(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    ))  # fmt: skip


def test_a_top_level_json_schema_is_a_json_object_with_that_schema() -> None:
    assert response_format(_body(json_schema=SCHEMA)) == {"type": "json_object", "schema": SCHEMA}
    text = {"type": "text"}
    assert response_format(_body(json_schema=SCHEMA, response_format=text))["schema"] == SCHEMA
    rf = {"type": "json_object", "schema": SCHEMA}
    assert (
        response_format(_body(response_format=rf)) == rf
    )  # (as sent: api.pipeline.structured reads it)
    assert response_format(_body(json_schema={})) is None  # asks for nothing


@pytest.mark.parametrize(
    "fields",
    [{"json_schema": "object"}, {"json_schema": [1]},
     {"json_schema": SCHEMA, "response_format": {"type": "json_object"}}],
)  # fmt: skip
def test_what_cannot_be_one_format_is_a_400_naming_json_schema(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest) as e:
        response_format(_body(**fields))
    assert e.value.param == "json_schema"
