"""Tool calls: the model's call text into OpenAI `tool_calls`, and `tool_choice` enforced.

A chat template that supports tools renders the request's `tools` and the conversation's
calls and results in the model's own format; the model answers with text in that format,
which this module finds and turns into `message.tool_calls` (streamed: `tool_calls`
deltas), `finish_reason` `tool_calls`. The format comes from the template
(`--tool-call-parser auto`) or is named. Served today: `hermes` — Qwen 2.5/3, Hermes 2/3
and the many templates that write `<tool_call>{"name": …, "arguments": {…}}</tool_call>`.
A model whose template has no format the server knows refuses `tools` by name (a 400),
never answers as if it had none.

`tool_choice`: `none` renders no tools and parses nothing; `auto` lets the model choose;
`required` and a named function are enforced by a grammar (`engine.grammar`): the answer
is one call (several with `parallel_tool_calls`) whose arguments are valid under that
function's `parameters` schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES = "hermes"
FORMATS = (HERMES,)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def detect(template_source: str) -> str | None:
    """The tool-call format a chat template writes, if the server knows it."""
    if OPEN in template_source and "tools" in template_source:
        return HERMES
    return None


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _call(body: str) -> Call | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return Call(obj["name"], text)


def parse(text: str) -> tuple[str, list[Call]]:
    """The content (text before the first call) and the calls: what a stream of this
    text gives, so streamed and whole answers agree."""
    split = ToolStream()
    split.feed(text)
    split.flush()
    return split.content, split.calls


class ToolStream:
    """One choice's streamed text: content until the first call starts, then each call
    whole once its closing tag has come (a call's JSON is only known complete then).
    Text after the calls is dropped; a call that is not well-formed, or not finished
    when the answer ends, is content (a malformed call is shown, not lost)."""

    def __init__(self) -> None:
        self._held = ""
        self._in_call = False
        self.calls: list[Call] = []
        self.content = ""

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content and the calls that `text` settles."""
        buf, self._held = self._held + text, ""
        out, new = "", list[Call]()
        while buf:
            if not self._in_call:
                at = buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(buf, OPEN)
                    out += buf[: len(buf) - keep] if not (self.calls or new) else ""
                    self._held = buf[len(buf) - keep :]
                    break
                out += buf[:at] if not (self.calls or new) else ""
                buf, self._in_call = buf[at:], True
            end = buf.find(CLOSE)
            if end < 0:
                self._held = buf
                break
            c = _call(buf[len(OPEN) : end].strip())
            if c is None:
                out += buf[: end + len(CLOSE)]
            else:
                new.append(c)
            buf, self._in_call = buf[end + len(CLOSE) :], False
        self.calls += new
        self.content += out
        return out, new

    def flush(self) -> str:
        """At the end: an unfinished call is content (text held after calls is not)."""
        held, self._held = self._held, ""
        if not (self._in_call or not self.calls):
            return ""
        self.content += held
        return held


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def forced_grammar(tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
    """A lark grammar (llguidance) for `tool_choice` required (`name` None: any of
    `tools`) or named: one call, or several with `parallel`, each
    `<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>` with arguments valid
    under the function's parameters."""
    options = []
    for t in tools:
        f = t["function"]
        if name is not None and f["name"] != name:
            continue
        options.append({
            "type": "object",
            "properties": {"name": {"const": f["name"]},
                           "arguments": f.get("parameters") or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })  # fmt: skip
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False}}
    call = f'"{OPEN}\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
    return f"start: call{'+' if parallel else ''}\ncall: {call}\n"


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """What a request's `tools` and `tool_choice` ask of the server."""

    render: list[dict[str, Any]] | None = None  # tools for the template (None: none)
    parse: bool = False  # turn the answer's call text into tool_calls
    grammar: str | None = None  # `required` / named: the forced call's grammar (lark)


_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def tool_setup(
    tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool,
    fmt: str | None,
) -> ToolSetup:  # fmt: skip
    """`ValueError(message, param)` for what cannot be served."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice needs tools", "tool_choice")
        return ToolSetup()
    for i, t in enumerate(tools):
        if not _NAME.match(t["function"]["name"]):
            raise ValueError(
                "a function name is 1-64 letters, digits, _ or -", f"tools[{i}].function.name"
            )
    if choice == "none":
        return ToolSetup()
    if fmt is None:
        raise ValueError(
            "tools: this model's chat template writes no tool-call format the server knows "
            "(--tool-call-parser names one)", "tools",
        )  # fmt: skip
    if choice in (None, "auto"):
        return ToolSetup(tools, parse=True)
    if choice == "required":
        return ToolSetup(tools, parse=True, grammar=forced_grammar(tools, None, parallel))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ValueError(
            "tool_choice is 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": …}}', "tool_choice",
        )  # fmt: skip
    if all(t["function"]["name"] != name for t in tools):
        raise ValueError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return ToolSetup(tools, parse=True, grammar=forced_grammar(tools, name, parallel=False))
