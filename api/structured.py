"""`response_format` → a grammar the engine constrains every choice's tokens with.

`{"type": "text"}` (or none) is free text; `{"type": "json_object"}` is any JSON object;
`{"type": "json_schema", "json_schema": {"name": …, "schema": {…}, "strict": …}}` is JSON
valid under the schema. Strict or not, the schema is enforced token by token (what a
client that sends `strict: false` also gets from vLLM); a schema the grammar compiler
cannot take is a 400 naming `response_format`, never a silently unconstrained answer.
Compiling runs on a worker thread: the first one builds the vocabulary's token trie
(about a second on a 262K vocabulary), later ones take about a millisecond.
"""

from __future__ import annotations

from typing import Any

import anyio

from api.errors import InvalidRequest
from api.state import ServerState
from engine.errors import GrammarError

PARAM = "response_format"


async def response_grammar(state: ServerState, rf: Any) -> str | None:
    """The grammar `rf` asks for; None for free text."""
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise InvalidRequest("response_format must be an object with a `type`", param=PARAM)
    kind = rf.get("type")
    grammars = state.model.grammars
    if kind == "text":
        return None
    if kind == "json_object":
        work = grammars.json_object
    elif kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest(
                "response_format json_schema needs a `json_schema` object with a `schema`",
                param=PARAM,
            )
        schema = spec.get("schema", {})

        def work() -> str:
            return grammars.json_schema(schema)
    else:
        raise InvalidRequest(
            f"response_format type {kind!r}: expected 'text', 'json_object' or 'json_schema'",
            param=PARAM,
        )
    try:
        return await anyio.to_thread.run_sync(work, limiter=state.prompt_workers)
    except GrammarError as e:
        raise InvalidRequest(f"response_format: {e}", param=PARAM) from None
