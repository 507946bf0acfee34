"""Tool calls: the model's call text into OpenAI `tool_calls`, and `tool_choice` enforced.

A chat template that supports tools renders the request's `tools` and the conversation's
calls and results in the model's own format; the model answers with text in that format,
which this module finds and turns into `message.tool_calls` (streamed: `tool_calls`
deltas), `finish_reason` `tool_calls`. The format comes from the template
(`--tool-call-parser auto`) or is named. Served today: `hermes` — Qwen 2.5/3, Hermes 2/3
and the many templates that write `<tool_call>{"name": …, "arguments": {…}}</tool_call>`;
`deepseek_v3` — DeepSeek V3, R1 and V3.1, `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>…`;
`mistral`; `llama3_json`. A model whose template has no format the server knows gets the
generic one (api.pipeline.generic_tools: the tools told in the system message, the answer one JSON
object held to a grammar); with `--tool-call-parser none` it refuses `tools` by name (a
400), never answers as if it had none.

`tool_choice`: `none` renders no tools and parses nothing; `auto` lets the model choose;
`required` and a named function are enforced by a grammar (`engine.grammar`): the answer
is one call (several with `parallel_tool_calls`) whose arguments are valid under that
function's `parameters` schema.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from api.pipeline.reasoning import partial_suffix

HERMES, DEEPSEEK_V3, MISTRAL, LLAMA3 = "hermes", "deepseek_v3", "mistral", "llama3_json"
FORMATS = (HERMES, DEEPSEEK_V3, MISTRAL, LLAMA3)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_OPEN, DS_SEP, DS_CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


MS_CALLS, PY_TAG = "[TOOL_CALLS]", "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class Format:
    """Where a model's calls are in its text: content ends at `begin`; each call's body
    lies between `open` and `close`, or (no `open`) the calls are all the rest of the
    answer, parsed when it ends; `json_start`: an answer that starts with `{` is a call."""

    name: str
    begin: str
    open: str = ""
    close: str = ""
    json_start: bool = False


FORMAT = {
    HERMES: Format(HERMES, OPEN, OPEN, CLOSE),
    DEEPSEEK_V3: Format(DEEPSEEK_V3, DS_CALLS, DS_OPEN, DS_CLOSE),
    MISTRAL: Format(MISTRAL, MS_CALLS),
    LLAMA3: Format(LLAMA3, PY_TAG, json_start=True),
}


def detect(template_source: str) -> str | None:
    """The tool-call format a chat template writes, if the server knows it."""
    if DS_OPEN in template_source:
        return DEEPSEEK_V3
    if MS_CALLS in template_source:
        return MISTRAL
    if OPEN in template_source and "tools" in template_source:
        return HERMES
    if "tools" in template_source and ("ipython" in template_source or PY_TAG in template_source):
        return LLAMA3
    return None


def _rest(fmt: Format, text: str) -> list[Call] | None:
    """The calls that make up the rest of an answer in `fmt` (no `open`); None if not."""
    text = text.strip()
    if fmt.name == MISTRAL:
        if text.startswith("["):  # [{"name": …, "arguments": …}, …] (v0.3)
            try:
                items = json.loads(text)
            except ValueError:
                return None
            calls = [_json_call(json.dumps(i)) if isinstance(i, dict) else None for i in items]
        else:  # name[ARGS]{…} per call (v7 tokenizers)
            calls = []
            for part in text.split(MS_CALLS):
                name, sep, args = part.partition("[ARGS]")
                if not sep:
                    return None
                calls.append(_json_call(json.dumps({"name": name.strip(), "arguments":
                                                    _loads(args)})))  # fmt: skip
        return None if not calls or None in calls else [c for c in calls if c is not None]
    calls = [_json_call(part) for part in text.split(";")]  # llama3: one JSON (or a; b)
    return None if None in calls else [c for c in calls if c is not None]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _call(fmt: Format, body: str) -> Call | None:
    """One call's body in `fmt` as a call; None when it is not one."""
    if fmt.name == DEEPSEEK_V3:
        return _deepseek_call(body)
    return _json_call(body)


def _deepseek_call(body: str) -> Call | None:
    """`name<｜tool▁sep｜>{args}` (V3.1), or `function<｜tool▁sep｜>name` and the arguments
    in a ```json block (V3, R1)."""
    head, sep, rest = body.partition(DS_SEP)
    if not sep:
        return None
    name, args = head.strip(), rest.strip()
    if name == "function":
        name, _, args = rest.partition("\n")
        args = args.strip().removeprefix("```json").removesuffix("```").strip()
    try:
        value = json.loads(args)
    except ValueError:
        return None
    if not name or not isinstance(value, dict):
        return None
    return Call(name.strip(), json.dumps(value, ensure_ascii=False))


def _json_call(body: str) -> Call | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return Call(obj["name"], text)


def parse(text: str, fmt: str = HERMES) -> tuple[str, list[Call]]:
    """The content (text before the first call) and the calls: what a stream of this
    text gives, so streamed and whole answers agree."""
    split = ToolStream(fmt)
    split.feed(text)
    split.flush()
    return split.content, split.calls


class ToolStream:
    """One choice's streamed text: content until the first call starts, then each call
    whole once its closing tag has come (a call's JSON is only known complete then).
    Text after the calls is dropped; a call that is not well-formed, or not finished
    when the answer ends, is content (a malformed call is shown, not lost)."""

    def __init__(self, fmt: str = HERMES) -> None:
        self._fmt = FORMAT[fmt]
        self._held = ""
        self._begun = False  # past the start of the calls (content ends there)
        self._in_call = False
        self._tail = ""  # formats without `open`: the answer after `begin`
        self.calls: list[Call] = []
        self.content = ""

    def feed(self, text: str) -> tuple[str, list[Call]]:
        """The content and the calls that `text` settles."""
        f = self._fmt
        buf, self._held = self._held + text, ""
        out, new = "", list[Call]()
        if f.json_start and not self._begun and not self.content:
            if not buf.strip():
                self._held = buf  # only whitespace so far: a call may still start
                return "", []
            if buf.lstrip().startswith("{"):
                self._begun, self._tail = True, ""
        while buf:
            if self._begun and not f.open:
                self._tail += buf  # the rest of the answer is the calls: parsed at the end
                break
            if not self._begun:
                at = buf.find(f.begin)
                if at < 0:
                    keep = partial_suffix(buf, f.begin)
                    out += buf[: len(buf) - keep]
                    self._held = buf[len(buf) - keep :]
                    break
                out += buf[:at]
                buf, self._begun = buf[at:], True
                if not f.open:
                    self._tail = ""
                    buf = buf[len(f.begin) :]
                    continue
            if not self._in_call:
                at = buf.find(f.open)
                if at < 0:
                    self._held = buf[len(buf) - partial_suffix(buf, f.open) :]
                    break
                buf, self._in_call = buf[at:], True
            end = buf.find(f.close)
            if end < 0:
                self._held = buf
                break
            c = _call(f, buf[len(f.open) : end].strip())
            if c is None:
                out += buf[: end + len(f.close)]
            else:
                new.append(c)
            buf, self._in_call = buf[end + len(f.close) :], False
        self.calls += new
        self.content += out
        return out, new

    def flush(self) -> tuple[str, list[Call]]:
        """At the end: the calls of a format that has them last; an unfinished call (or
        the start of one) is content; text held after finished calls is not."""
        held, self._held = self._held, ""
        f = self._fmt
        if self._begun and not f.open:
            calls = _rest(f, self._tail + held)
            if calls is not None:
                self.calls += calls
                return "", calls
            text = ("" if f.json_start and not self.content and self._tail.lstrip()
                    .startswith("{") else f.begin) + self._tail + held  # fmt: skip
            self.content += text
            return text, []
        if self.calls and not self._in_call:
            return "", []
        self.content += held
        return held, []


def forced_grammar(
    tools: list[dict[str, Any]], name: str | None, parallel: bool, fmt: str,
    literal: Callable[[str], str] | None = None, old_deepseek: bool = False,
    args_style: bool = False,
) -> str:  # fmt: skip
    """A lark grammar (llguidance) for `tool_choice` required (`name` None: any of
    `tools`) or named: one call, or several with `parallel`, written as `fmt` writes it,
    the arguments valid under the function's parameters. `literal` writes a fixed piece
    of text as a lark terminal (a special token by its id, so the model writes the token
    it was trained on); `old_deepseek`: V3/R1's `function<sep>name` and ```json block;
    `args_style`: Mistral's `name[ARGS]{…}` (v7 tokenizers) rather than a JSON list."""
    literal = literal or _quoted
    rules: list[str] = []
    for f in (t["function"] for t in tools):
        if name is not None and f["name"] != name:
            continue
        params = {**(f.get("parameters") or {"type": "object"}), **_TIGHT}
        key = "parameters" if fmt == LLAMA3 else "arguments"
        named = {"type": "object", "properties": {"name": {"const": f["name"]}, key: params},
                 "required": ["name", key], "additionalProperties": False, **_TIGHT}  # fmt: skip
        if fmt == HERMES:
            body = f'{literal(OPEN)} "\\n" %json {json.dumps(named)} "\\n" {literal(CLOSE)}'
        elif fmt == LLAMA3 or (fmt == MISTRAL and not args_style):
            body = f"%json {json.dumps(named)}"
        elif fmt == MISTRAL:
            body = f"{json.dumps(f['name'])} {literal('[ARGS]')} %json {json.dumps(params)}"
        elif old_deepseek:
            body = (
                f'{literal(DS_OPEN)} "function" {literal(DS_SEP)} {json.dumps(f["name"])} '
                f'"\\n```json\\n" %json {json.dumps(params)} "\\n```" {literal(DS_CLOSE)}'
            )
        else:
            body = (
                f"{literal(DS_OPEN)} {json.dumps(f['name'])} {literal(DS_SEP)} "
                f"%json {json.dumps(params)} {literal(DS_CLOSE)}"
            )
        rules.append(f"call_{len(rules)}: {body}")
    calls = "call+" if parallel else "call"
    if fmt == HERMES:
        start = f"start: {calls}"
    elif fmt == LLAMA3:
        start = "start: call"  # (one JSON answer)
    elif fmt == MISTRAL and args_style:
        start = f"start: ({literal(MS_CALLS)} call){'+' if parallel else ''}"
    elif fmt == MISTRAL:
        more = ' ("," call)*' if parallel else ""
        start = f'start: {literal(MS_CALLS)} "[" call{more} "]"'
    else:
        start = f"start: {literal(DS_CALLS)} {calls} {literal(DS_CALLS_END)}"
    alternatives = " | ".join(f"call_{k}" for k in range(len(rules)))
    return "\n".join([start, f"call: {alternatives}", *rules]) + "\n"


_TIGHT = {"x-guidance": {"whitespace_flexible": False}}


def _quoted(text: str) -> str:
    """Text as a lark string."""
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ToolSetup:
    """What a request's `tools` and `tool_choice` ask of the server."""

    render: list[dict[str, Any]] | None = None  # tools for the template (None: none)
    parse: bool = False  # turn the answer's call text into tool_calls
    grammar: str | None = None  # `required` / named: the forced call's grammar (lark)
    # `auto`: the grammar applies once the model writes this token (its format's start of
    # the calls, one special token); None: a forced grammar, or none
    trigger: int | None = None
    # for a template that writes calls but never renders `tools` (DeepSeek V3.1's and
    # R1's own): the tools and how to call them, for the system message (`with_prompt`)
    prompt: str | None = None
    # the generic format (api.pipeline.generic_tools): the conversation's earlier calls and tool
    # results are rendered as plain turns; the prompt goes into the first user turn where
    # the template has no system role; `auto`'s grammar may be dropped (parsed only) when
    # a function's schema does not compile
    history_as_text: bool = False
    prompt_in_user: bool = False
    lenient: bool = False


_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def tool_setup(
    tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parallel: bool,
    fmt: str | None, literal: Callable[[str], str] | None = None, old_deepseek: bool = False,
    args_style: bool = False, renders_tools: bool = True,
    special: Callable[[str], int | None] | None = None,
) -> ToolSetup:  # fmt: skip
    """`ValueError(message, param)` for what cannot be served. `renders_tools`: the
    template writes `tools` into the prompt itself (else `ToolSetup.prompt` does);
    `special`: a text's id where it is one special token of the model's vocabulary.

    `auto` is lazy where the format's calls start with one special token (Qwen's
    `<tool_call>`, DeepSeek's, Mistral's `[TOOL_CALLS]`): the answer is free until the
    model writes it, then held to the calls' grammar — the model chooses whether to call,
    not how a call is written. Llama 3's calls (a bare JSON answer) have no such start:
    there `auto` is parsed only."""
    mode, name = checked_choice(tools, choice)
    if mode == "none" or not tools:
        return ToolSetup()
    if fmt is None:
        raise ValueError(
            "tools: this model's chat template writes no tool-call format the server knows "
            "(--tool-call-parser names one)", "tools",
        )  # fmt: skip
    prompt = None if renders_tools else tool_prompt(tools, fmt, old_deepseek, args_style)
    if mode == "auto":
        trigger = special(FORMAT[fmt].begin) if special and fmt != LLAMA3 else None
        if trigger is None:
            return ToolSetup(tools, parse=True, prompt=prompt)
        grammar = forced_grammar(tools, None, parallel, fmt, literal, old_deepseek, args_style)
        return ToolSetup(tools, parse=True, grammar=grammar, prompt=prompt, trigger=trigger)
    if mode == "required":
        grammar = forced_grammar(tools, None, parallel, fmt, literal, old_deepseek, args_style)
        return ToolSetup(tools, parse=True, grammar=grammar, prompt=prompt)
    grammar = forced_grammar(tools, name, False, fmt, literal, old_deepseek, args_style)
    return ToolSetup(tools, parse=True, grammar=grammar, prompt=prompt)


def checked_choice(
    tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None
) -> tuple[str, str | None]:
    """`tool_choice` checked against `tools`, whatever the call format: (`none`, `auto`,
    `required` or `named`; the named function's name). `ValueError(message, param)`."""
    if not tools:
        if choice not in (None, "none"):
            raise ValueError("tool_choice needs tools", "tool_choice")
        return "none", None
    for i, t in enumerate(tools):
        if not _NAME.match(t["function"]["name"]):
            raise ValueError(
                "a function name is 1-64 letters, digits, _ or -", f"tools[{i}].function.name"
            )
    if choice in ("none", "auto", "required"):
        return str(choice), None
    if choice is None:
        return "auto", None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(name, str):
        raise ValueError(
            "tool_choice is 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": …}}', "tool_choice",
        )  # fmt: skip
    if all(t["function"]["name"] != name for t in tools):
        raise ValueError(f"tool_choice names {name!r}, which is not in tools", "tool_choice")
    return "named", name


PROBE = "probe_function_0f3a"


def renders_tools(render: Callable[[list[dict[str, Any]]], str]) -> bool:
    """Does a template write the request's `tools` into the prompt? `render(tools)`
    renders one user message with them. Several templates write the calls of a format
    but not the tools (DeepSeek V3.1's and the R1 distills' own): the model would never
    learn which functions it has. A template that fails on the probe counts as rendering
    them (requests with tools fail on it anyway, by name)."""
    probe = {"type": "function", "function": {"name": PROBE, "description": "probe",
                                              "parameters": {"type": "object"}}}  # fmt: skip
    try:
        return PROBE in render([probe])
    except ValueError:
        return True


def tool_prompt(
    tools: list[dict[str, Any]], fmt: str, old_deepseek: bool = False, args_style: bool = False
) -> str:
    """The tools and the call syntax of `fmt`, for a template that does not render tools:
    each function's name, description and parameters' JSON Schema, then the exact form a
    call takes (the one the parser and the forced-call grammar read)."""
    lines = tool_list(tools)
    if fmt == DEEPSEEK_V3 and old_deepseek:
        call = (
            f"{DS_CALLS}{DS_OPEN}function{DS_SEP}NAME\n```json\n"
            f'{{"arg": "value"}}\n```{DS_CLOSE}{DS_CALLS_END}'
        )
    elif fmt == DEEPSEEK_V3:
        call = f'{DS_CALLS}{DS_OPEN}NAME{DS_SEP}{{"arg": "value"}}{DS_CLOSE}{DS_CALLS_END}'
    elif fmt == MISTRAL and args_style:
        call = f'{MS_CALLS}NAME[ARGS]{{"arg": "value"}}'
    elif fmt == MISTRAL:
        call = f'{MS_CALLS}[{{"name": "NAME", "arguments": {{"arg": "value"}}}}]'
    elif fmt == LLAMA3:
        call = '{"name": "NAME", "parameters": {"arg": "value"}}'
    else:
        call = f'{OPEN}\n{{"name": "NAME", "arguments": {{"arg": "value"}}}}\n{CLOSE}'
    lines += ["", "To call a function, answer with exactly this, NAME and the arguments "
              "filled in (several calls one after another where the answer needs them):",
              call]  # fmt: skip
    return "\n".join(lines)


def tool_list(tools: list[dict[str, Any]]) -> list[str]:
    """The lines that tell a model its functions: name, description, parameters."""
    lines = ["## Tools", "", "You can call these functions:"]
    for t in tools:
        f = t["function"]
        lines += ["", f"### {f['name']}"]
        if f.get("description"):
            lines.append(str(f["description"]))
        params = json.dumps(f.get("parameters") or {"type": "object"}, ensure_ascii=False)
        lines.append(f"Parameters (JSON Schema): {params}")
    return lines


def with_prompt(
    messages: list[dict[str, Any]], text: str, in_system: bool = True
) -> list[dict[str, Any]]:
    """`text` at the end of the system message (a new one first, where there is none);
    not `in_system` (a template without a system role): ahead of the first user turn's."""
    if not in_system:
        at = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if at is None:
            return [{"role": "user", "content": text}, *messages]
        turn = {**messages[at], "content": f"{text}\n\n{messages[at]['content']}"}
        return [*messages[:at], turn, *messages[at + 1 :]]
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
