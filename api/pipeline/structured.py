"""`response_format` and `tools` → the one grammar the engine constrains every choice with.

`{"type": "text"}` (or none) is free text; `{"type": "json_object"}` is any JSON object;
`{"type": "json_schema", "json_schema": {"name": …, "schema": {…}, "strict": …}}` is JSON
valid under the schema, and so is llama-server's `{"type": "json_object", "schema": {…}}`
(its top-level `json_schema` field comes here as that). Strict or not, the schema is
enforced token by token (what a client that sends `strict: false` also gets from vLLM);
a schema the grammar compiler
cannot take is a 400 naming `response_format`, never a silently unconstrained answer.
Compiling runs on a worker thread: the first one builds the vocabulary's token trie
(about a second on a 262K vocabulary), later ones take about a millisecond.

`tools` and `tool_choice` are read here too (api.pipeline.tool_calls writes their grammar): they
decide what the template renders and what is parsed out of the answer, and a forced call
is a grammar that must agree with the format's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio

from api.pipeline.generic_tools import GENERIC, generic_setup
from api.pipeline.request import Chat, GenerationRequest
from api.pipeline.tool_calls import ToolSetup, tool_setup
from api.server.errors import InvalidRequest
from api.server.state import ServerState
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
    if kind == "json_object":  # any object; llama-server's spelling adds a `schema`
        schema: Any = rf.get("schema", {"type": "object"})
    elif kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequest(
                "response_format json_schema needs a `json_schema` object with a `schema`",
                param=PARAM,
            )
        schema = spec.get("schema", {})
    else:
        raise InvalidRequest(
            f"response_format type {kind!r}: expected 'text', 'json_object' or 'json_schema'",
            param=PARAM,
        )

    def work() -> str:
        return grammars.json_schema(schema)

    try:
        return await anyio.to_thread.run_sync(work, limiter=state.prompt_workers)
    except GrammarError as e:
        raise InvalidRequest(f"response_format: {e}", param=PARAM) from None


def request_tools(state: ServerState, req: GenerationRequest) -> ToolSetup:
    """What `tools` / `tool_choice` ask (api.pipeline.tool_calls); a 400 naming what cannot be —
    also a conversation with calls or tool results for a model that has no tool format.
    Raw prompts have neither: nothing is rendered or parsed for them."""
    if not isinstance(req.input, Chat):
        return ToolSetup()
    if state.tool_format is None:
        for i, m in enumerate(req.input.messages):
            if m.role == "tool" or m.calls:
                what = "role" if m.role == "tool" else "tool_calls"
                raise InvalidRequest(
                    f"messages[{i}].{what}: this model's chat template writes no tool-call "
                    "format the server knows",
                    param=f"messages[{i}].{what}",
                )
    t = req.tools
    try:
        if state.tool_format == GENERIC:
            return generic_setup(t.functions or None, t.choice, t.parallel, state.system_role)
        return tool_setup(
            t.functions or None, t.choice, t.parallel, state.tool_format,
            partial(_literal, state), "function<｜tool▁sep｜>" in state.template.source,
            "[ARGS]" in state.template.source, state.renders_tools, partial(_special, state),
        )  # fmt: skip
    except ValueError as e:
        message, param = e.args
        raise InvalidRequest(message, param=param) from None


@dataclass(frozen=True, slots=True)
class Constraint:
    """The grammar every choice's tokens are held to (lark, llguidance), if any; with a
    `trigger`, only from the moment the model writes that token (`auto` tool calls)."""

    grammar: str | None = None
    trigger: int | None = None


async def constrain(state: ServerState, response_format: Any, tools: ToolSetup) -> Constraint:
    """The one grammar of `response_format` and the tools' `tool_choice` together: a
    forced call (or the generic format's answer, which is the tools' JSON) and a format
    cannot both hold (400); a native format's `auto` beside a format leaves the format in
    charge."""
    grammar = await response_grammar(state, response_format)
    if tools.grammar is not None and grammar is not None and tools.trigger is None:
        raise InvalidRequest(
            "a required or named tool_choice (or tools on a model without a native tool-call "
            "format: its answer is the calls' JSON) cannot be combined with a response_format",
            param="tool_choice",
        )
    if tools.grammar is None or grammar is not None:
        return Constraint(grammar)
    try:
        return Constraint(await tool_grammar(state, tools.grammar), tools.trigger)
    except InvalidRequest:
        if tools.trigger is None and not tools.lenient:
            raise
        # auto with a schema the grammar engine cannot take: parsed, not held
        return Constraint()


async def tool_grammar(state: ServerState, grammar: str) -> str:
    """A forced call's grammar, checked (a function's `parameters` may not compile)."""
    grammars = state.model.grammars
    try:
        return await anyio.to_thread.run_sync(
            grammars.validate, grammar, limiter=state.prompt_workers
        )
    except GrammarError as e:
        raise InvalidRequest(f"tools: {e}", param="tools") from None


def _literal(state: ServerState, text: str) -> str:
    """Fixed text of a call's format as a lark terminal: by id where it is one special
    token in this vocabulary (what the model was trained to write), else quoted."""
    tok = _special(state, text)
    return f"<[{tok}]>" if tok is not None else json.dumps(text, ensure_ascii=False)


def _special(state: ServerState, text: str) -> int | None:
    """`text`'s id where it is one special token of this vocabulary."""
    ids = state.model.tokenize(text, add_special=False, parse_special=True)
    return ids[0] if len(ids) == 1 and state.model.grammar_special(ids[0]) else None
