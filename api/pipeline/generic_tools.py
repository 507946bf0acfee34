"""Tool calls on any model: the generic format, for a chat template that writes no call
format the server knows (the embedded Gemma 3 270M's, ChatML, most base models').

llama.cpp (its "generic" chat format) and vLLM do the same thing: the server tells the
model its functions and how to answer in the system message, and the answer is one JSON
object, held to it by a grammar from the first token —

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}   calls
    {"response": "It is sunny in Paris."}                                       `auto` only

One object is a shape a grammar can enforce whole and a parser can read back whole, and
JSON is what any instruction-tuned model writes best. `required` and a named function
allow the first shape only, each call's arguments valid under its function's
`parameters` (one call, or several with `parallel_tool_calls`); `auto` allows either, and
a plain answer comes back as text content. Parsed calls are the same `Call`s the native
formats give, so every API's encoding of them is unchanged.

Streaming: a plain answer's text streams as it is written (the JSON string decoded as it
comes, an escape held until it is whole); each call comes whole once its object closes,
and a list cut short by max_tokens keeps the calls it finished — the envelope's JSON never
reaches a client as text.

Such a template has no place for calls or tool results either, so the conversation's are
rendered as plain turns: an earlier call as the assistant's JSON (what the model is told
to write), a tool's result as a user turn naming the call and the function.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from api.pipeline.request import Message
from api.pipeline.tool_calls import Call, ToolSetup, checked_choice, tool_list

GENERIC = "generic"
# No unbounded whitespace (as engine.grammar), and the separators of the examples the
# model is told and of the earlier calls it sees (json.dumps'): one way to write a call.
_TIGHT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def generic_setup(
    tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool,
    system_role: bool = True,
) -> ToolSetup:  # fmt: skip
    """What `tools` and `tool_choice` ask, in the generic format (`ValueError(message,
    param)` as api.pipeline.tool_calls); `system_role`: the template renders a system message (else
    the tools are told ahead of the first user turn). The template never sees `tools`."""
    mode, name = checked_choice(tools, choice)
    if mode == "none" or not tools:
        return ToolSetup(history_as_text=True)
    return ToolSetup(
        None, parse=True, grammar=envelope_grammar(tools, name, parallel, mode == "auto"),
        prompt=generic_prompt(tools, mode, name, parallel), history_as_text=True,
        prompt_in_user=not system_role, lenient=mode == "auto",
    )  # fmt: skip


def envelope_schema(
    tools: list[dict[str, Any]], name: str | None, parallel: bool, answer: bool
) -> dict[str, Any]:
    """The JSON schema of an answer: calls of `tools` (only `name`'s where given; one
    unless `parallel`), or with `answer` also `{"response": text}`."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in (t["function"] for t in tools)
        if name is None or f["name"] == name
    ]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    array = {"type": "array", "items": items, "minItems": 1}
    if not parallel or name is not None:
        array["maxItems"] = 1
    envelope: dict[str, Any] = {
        "type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"],
        "additionalProperties": False,
    }  # fmt: skip
    if answer:
        text = {
            "type": "object", "properties": {"response": {"type": "string"}},
            "required": ["response"], "additionalProperties": False,
        }  # fmt: skip
        envelope = {"anyOf": [envelope, text]}
    return {**envelope, "x-guidance": _TIGHT}


def envelope_grammar(
    tools: list[dict[str, Any]], name: str | None, parallel: bool, answer: bool
) -> str:
    """`envelope_schema` as a lark grammar (llguidance), the form tool grammars take."""
    schema = envelope_schema(tools, name, parallel, answer)
    return f"start: %json {json.dumps(schema, ensure_ascii=False)}\n"


CALL_EXAMPLE = '{"tool_calls": [{"name": "NAME", "arguments": {"arg": "value"}}]}'
ANSWER_EXAMPLE = '{"response": "your answer"}'


def generic_prompt(tools: list[dict[str, Any]], mode: str, name: str | None, parallel: bool) -> str:
    """The functions, then the exact answer shape the grammar holds the model to."""
    lines = [*tool_list(tools), ""]
    if mode == "auto":
        lines += [
            "Answer with one JSON object and nothing else. To call functions:", CALL_EXAMPLE,
            "To answer without calling a function:", ANSWER_EXAMPLE,
        ]  # fmt: skip
    else:
        lines += [
            f"Call {name}." if name else "Call one of these functions.",
            "Answer with one JSON object and nothing else:", CALL_EXAMPLE,
        ]  # fmt: skip
    many = parallel and name is None
    lines.append("Several calls go in the list, one object each, where the answer needs them."
                 if many else "Make exactly one call.")  # fmt: skip
    lines.append("Each function's result comes back in a later user message.")
    return "\n".join(lines)


def renders_system(render: Callable[[list[dict[str, Any]]], str]) -> bool:
    """Does the template render a system message? `render(messages)` renders them. Some
    refuse the role (raise) or drop it; the tools are then told in the first user turn."""
    probe = "probe_system_5c1e"
    try:
        return probe in render([{"role": "system", "content": probe},
                                {"role": "user", "content": "Hi"}])  # fmt: skip
    except ValueError:
        return False


def text_turns(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """The conversation as plain turns for a template without calls or a `tool` role: an
    assistant's calls as the JSON it is told to write (after any text it wrote), a tool's
    result as a user turn naming the call and its function; the results of one turn's
    calls, adjacent, in one user turn (templates that want roles to alternate)."""
    names = {c.id: c.name for m in messages for c in m.calls}
    out: list[dict[str, Any]] = []
    after_result = False
    for m in messages:
        if m.role == "tool":
            name = m.name or names.get(m.call_id or "")
            text = f"Result of call {m.call_id}{f' to {name}' if name else ''}:\n{m.text}"
            if after_result:
                out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{text}"}
            else:
                out.append({"role": "user", "content": text})
            after_result = True
            continue
        after_result = False
        if m.calls:
            calls = [{"name": c.name, "arguments": c.value} for c in m.calls]
            envelope = json.dumps({"tool_calls": calls}, ensure_ascii=False)
            out.append({"role": "assistant",
                        "content": f"{m.text}\n{envelope}" if m.text else envelope})  # fmt: skip
        else:
            out.append({"role": m.role, "content": m.text})
    return out


# ---- reading the answer back --------------------------------------------------------
_UNDECIDED, _TEXT, _RESPONSE, _CALLS, _OTHER, _DONE = range(6)
_RESPONSE_HEAD = ("{", '"response"', ":", '"')
_CALLS_HEAD = ("{", '"tool_calls"', ":", "[")


class EnvelopeStream:
    """One choice's streamed answer in the generic format, with `ToolStream`'s interface
    (api.pipeline.answer): `{"response": "…"}` streams its text as it is decoded; each call of
    `{"tool_calls": […]}` comes once its object closes, and a list cut short (max_tokens)
    keeps the calls it finished — its JSON is never content. An answer that is not JSON
    (`auto` whose grammar could not be compiled) is content as it is; other JSON is read
    whole when the answer ends, and is content if it is no envelope (shown, not lost)."""

    def __init__(self) -> None:
        self._buf = ""  # not yet content, calls or dropped
        self._mode = _UNDECIDED
        self._scan = 0  # calls: where the scan of `_buf` goes on
        self._depth = 0  # calls: nesting inside the list (0: between calls)
        self._in_string = self._escaped = False
        self.calls: list[Call] = []
        self.content = ""

    def feed(self, text: str) -> tuple[str, list[Call]]:
        self._buf += text
        out, calls = self._advance()
        self.content += out
        self.calls += calls
        return out, calls

    def flush(self) -> tuple[str, list[Call]]:
        text, calls = "", list[Call]()
        if self._mode == _OTHER:
            text, calls = read_envelope(self._buf)
        self._buf = ""
        self.content += text
        self.calls += calls
        return text, calls

    def _advance(self) -> tuple[str, list[Call]]:
        if self._mode == _UNDECIDED:
            self._decide()
        if self._mode == _TEXT:
            out, self._buf = self._buf, ""
            return out, []
        if self._mode == _RESPONSE:
            out, used, closed = string_prefix(self._buf)
            self._buf = self._buf[used:]
            if closed:
                self._mode, self._buf = _DONE, ""
            return out, []
        if self._mode == _CALLS:
            return self._scan_calls()
        if self._mode == _DONE:
            self._buf = ""
        return "", []

    def _decide(self) -> None:
        """Which answer this is, once its start tells (until then all is held)."""
        lead = self._buf.lstrip()
        if not lead:
            return
        if lead[0] != "{":
            self._mode = _TEXT
            return
        response, calls = _head_end(self._buf, _RESPONSE_HEAD), _head_end(self._buf, _CALLS_HEAD)
        if response is not None and response > 0:
            self._mode, self._buf = _RESPONSE, self._buf[response:]
        elif calls is not None and calls > 0:
            self._mode, self._buf = _CALLS, self._buf[calls:]
        elif response == calls == -1:
            self._mode = _OTHER

    def _scan_calls(self) -> tuple[str, list[Call]]:
        """The calls whose objects closed in what came; a list element that is not a call
        is content (shown, as the native formats show a malformed call)."""
        out, calls, buf = "", list[Call](), self._buf
        start = 0 if self._depth else -1
        i = self._scan
        while i < len(buf):
            c = buf[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == '"':
                    self._in_string = False
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                if self._depth == 0:
                    start = i
                self._depth += 1
            elif c in "}]":
                if self._depth == 0:  # the list's end: the rest of the envelope is dropped
                    self._mode, self._buf, self._scan = _DONE, "", 0
                    return out, calls
                self._depth -= 1
                if self._depth == 0:
                    element = buf[start : i + 1]
                    call = _call(_loads(element))
                    if call is None:
                        out += element
                    else:
                        calls.append(call)
                    start = -1
            i += 1
        keep = start if self._depth else len(buf)  # an unfinished call stays held
        self._buf, self._scan = buf[keep:], i - keep
        return out, calls


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _head_end(buf: str, head: tuple[str, ...]) -> int | None:
    """Where `buf` goes on after `head`'s pieces (JSON whitespace between them); None
    while `buf` may still become the head, -1 once it cannot."""
    pos = 0
    for piece in head:
        while pos < len(buf) and buf[pos] in " \t\r\n":
            pos += 1
        got = buf[pos : pos + len(piece)]
        if got != piece[: len(got)]:
            return -1
        if len(got) < len(piece):
            return None
        pos += len(piece)
    return pos


def string_prefix(body: str) -> tuple[str, int, bool]:
    """The decoded text of the longest whole prefix of a JSON string's body (the part
    after its opening quote), the characters it used, and whether the string closed there
    (its closing quote is used too). An escape is whole with its characters, `\\uD83D`
    with the low surrogate that follows it."""
    i, n = 0, len(body)
    while i < n:
        c = body[i]
        if c == '"':
            return _unescape(body[:i]), i + 1, True
        if c != "\\":
            i += 1
            continue
        if i + 1 >= n:
            break
        if body[i + 1] != "u":
            i += 2
            continue
        if i + 6 > n:
            break
        step = 6
        if body[i + 2 : i + 4].lower() in ("d8", "d9", "da", "db"):  # a high surrogate
            after = body[i + 6 : i + 8]
            if after in ("", "\\"):
                break  # its pair may be coming
            if after == "\\u":
                if i + 12 > n:
                    break
                step = 12
        i += step
    return _unescape(body[:i]), i, False


def _unescape(body: str) -> str:
    """A JSON string's body as text (raw control characters allowed, a bad escape kept
    as written, a lone surrogate replaced)."""
    try:
        text: str = json.loads(f'"{body}"', strict=False)
    except ValueError:
        return body
    return text.encode("utf-8", "replace").decode("utf-8")


def read_envelope(text: str) -> tuple[str, list[Call]]:
    """A whole answer: its calls, or the plain answer's text; text that is neither is
    content as it is. Lenient about the shape (`tool_call` with one object, a bare
    `{"name", "arguments"}`): an `auto` answer that was not held to the grammar."""
    if not text.strip():
        return "", []
    try:
        obj = json.loads(text)
    except ValueError:
        return text, []
    if not isinstance(obj, dict):
        return text, []
    if isinstance(obj.get("tool_calls"), list):
        items = obj["tool_calls"]
    elif isinstance(obj.get("tool_call"), dict):
        items = [obj["tool_call"]]
    elif "name" in obj and "response" not in obj:
        items = [obj]
    elif "response" in obj:
        answer = obj["response"]
        return answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False), []
    else:
        return text, []
    calls = [_call(i) for i in items]
    if not calls or None in calls:
        return text, []
    return "", [c for c in calls if c is not None]


def _call(item: Any) -> Call | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):  # (JSON text, as OpenAI sends it)
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(item["name"], json.dumps(args, ensure_ascii=False))


def parse_generic(text: str) -> tuple[str, list[Call]]:
    """A whole answer as a stream of it gives it: content and calls."""
    stream = EnvelopeStream()
    stream.feed(text)
    stream.flush()
    return stream.content, stream.calls
