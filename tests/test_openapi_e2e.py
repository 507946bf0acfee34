"""End to end: the server's /openapi.json is a valid OpenAPI 3.1 document generated from
the protocols' wire types, and schemathesis, driven by it, finds no 5xx and no error that
is not an OpenAI error body — with valid and invalid (negative, type-violating) inputs.

schemathesis parametrizes at collection, before any server runs (its fixture-based loader
does not work with pytest 9), so the cases come from `openapi_document` built here; the
first tests check that it is what the server serves. Bounded to stay cheap on two cores:
a 64-token context, valid bodies steered to ask for at most a few tokens
(bench.fuzz_api.steer), a fixed seed, few fuzzing examples. `python -m bench.fuzz_api` is
the same run, longer.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema_rs
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance

from api.protocols.anthropic.wire import MessagesRequest
from api.protocols.openai.schemas import ChatCompletionRequest, CompletionRequest
from api.protocols.openapi import TITLE, openapi_document
from api.server.wire import ErrorDetail
from bench.fuzz_api import (
    SERVER_ARGS,
    anthropic_error_body_problems,
    error_body_problems,
    fuzz_config,
    openai_error_body,
    steer,
)
from bench.server_proc import Server, start_server
from tests.conftest import MODEL

pytestmark = pytest.mark.e2e
SEED = 20241204
MAX_EXAMPLES = 100  # fuzzing cases per operation; the coverage phase adds its own
MAX_TOKENS = 4  # what a valid generated body may ask for
PATHS = {
    "/v1/chat/completions": "post",
    "/v1/completions": "post",
    "/v1/responses": "post",
    "/v1/models": "get",
    "/v1/messages": "post",
    "/v1/messages/count_tokens": "post",
    "/health": "get",
    "/livez": "get",
    "/metrics": "get",
    "/experts": "get",
    "/openapi.json": "get",
}
GENERATION_ERRORS = {"400", "401", "404", "408", "413", "429", "503"}
MESSAGES_ERRORS = {"400", "401", "404", "408", "413", "429", "529"}  # Anthropic's envelope


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(list(SERVER_ARGS), tmp_path_factory.mktemp("openapi") / "server.log")
    yield srv
    srv.stop()


schema = schemathesis.openapi.from_dict(
    steer(openapi_document(TITLE, "test"), MODEL, max_tokens=MAX_TOKENS),
    config=fuzz_config(None, max_examples=MAX_EXAMPLES, seed=SEED),
)


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if isinstance(node.get("$ref"), str):
            yield node["$ref"]
        for value in node.values():
            yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_openapi_json_is_a_valid_openapi_31_document(fuzz_server: Server) -> None:
    r = httpx.get(fuzz_server.url + "/openapi.json")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/json")
    doc = r.json()
    assert doc["openapi"].startswith("3.1.")
    # the OAS 3.1 meta-schema (schemathesis ships the official one) ...
    schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json").validate()
    # ... which leaves the schemas themselves to the 2020-12 dialect
    schemas = doc["components"]["schemas"]
    for component in schemas.values():
        jsonschema_rs.meta.validate(
            {"$schema": "https://json-schema.org/draft/2020-12/schema", **component}
        )
    for ref in _refs(doc):
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.rsplit("/", 1)[1] in schemas, f"unresolved {ref}"
    assert {path: next(iter(item)) for path, item in doc["paths"].items()} == PATHS
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses"):
        op = doc["paths"][path]["post"]
        assert "application/json" in op["requestBody"]["content"]
        assert set(op["responses"]["200"]["content"]) == {"application/json", "text/event-stream"}
        assert set(op["responses"]) >= GENERATION_ERRORS
        for status in GENERATION_ERRORS:
            body = op["responses"][status]["content"]["application/json"]["schema"]
            assert body == {"$ref": "#/components/schemas/ErrorBody"}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        op = doc["paths"][path]["post"]
        assert set(op["responses"]) >= MESSAGES_ERRORS
        for status in MESSAGES_ERRORS:
            body = op["responses"][status]["content"]["application/json"]["schema"]
            assert body == {"$ref": "#/components/schemas/AnthropicError"}
    stream = doc["paths"]["/v1/messages"]["post"]["responses"]["200"]["content"]
    assert set(stream) == {"application/json", "text/event-stream"}
    assert "text/plain" in doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert [p["name"] for p in doc["paths"]["/experts"]["get"]["parameters"]] == ["top"]


def test_openapi_follows_the_structs(fuzz_server: Server) -> None:
    """Generated from the wire types at runtime: every field is there as the Struct has it."""
    doc = httpx.get(fuzz_server.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for struct in (ChatCompletionRequest, CompletionRequest, ErrorDetail, MessagesRequest):
        assert set(schemas[struct.__name__]["properties"]) == set(struct.__struct_fields__)
    # the same document the fuzzing below is generated from
    assert doc == openapi_document(TITLE, doc["info"]["version"])


def test_error_body_check_can_fail() -> None:
    ok = {"error": {"message": "m", "type": "invalid_request_error", "param": None, "code": None}}
    assert error_body_problems(ok) == []
    assert error_body_problems({"detail": "Not Found"})
    assert error_body_problems({"error": {**ok["error"], "message": ""}})
    assert error_body_problems({"error": {"message": "m", "type": "t"}})  # keys missing
    assert error_body_problems({**ok, "extra": 1})
    anthropic = {"type": "error", "error": {"type": "invalid_request_error", "message": "m"}}
    assert anthropic_error_body_problems(anthropic) == []
    assert anthropic_error_body_problems(ok)
    assert anthropic_error_body_problems({**anthropic, "type": "message"})
    assert anthropic_error_body_problems({**anthropic, "error": {"type": "t", "message": ""}})
    assert error_body_problems(anthropic)


@schema.parametrize()
def test_fuzzed_requests_get_no_5xx_and_only_openai_errors(
    case: schemathesis.Case[Any], fuzz_server: Server
) -> None:
    """Also checks every documented response, SSE frames included, against the document."""
    case.call_and_validate(
        fuzz_server.url,
        checks=[not_a_server_error, openai_error_body, response_schema_conformance],
    )
