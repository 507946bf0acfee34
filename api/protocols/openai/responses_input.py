"""A Responses API body's input, tools and format in the internal request's terms.

Input items become the chat's messages: a message item is a turn (`developer` is
OpenAI's newer name for system), `function_call` items join the assistant turn they
follow as its calls, a `function_call_output` is a tool result, an earlier answer's
`reasoning` item is dropped (chat templates drop earlier turns' thinking). Each message
remembers the input item it came from, so that a refusal the pipeline makes by a message's
place (`messages[3]`) reaches the client by the item's (`input[5]`), in this API's names.

What the API asks and the server does not serve is a 400 naming it, before any work:
state kept between requests (`previous_response_id`, `conversation`, stored prompts,
item references — the server keeps none, so any replica behind a router can answer),
images, files and audio. A built-in tool (`web_search` …) is left out of the prompt,
with a warning in the log: Codex offers one with every request, and the model can do
without it (a `tool_choice` naming one is still a 400). A `namespace` group's function
tools are offered under the flat name Codex itself shows (`group__tool`) and come back
as calls with `namespace` and `name` apart, as Codex dispatches them.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from api.pipeline.request import EarlierCall, Message
from api.pipeline.validation import asks_nothing, refuse
from api.protocols.openai.responses_wire import (
    FunctionTool,
    InputItem,
    InputPart,
    ResponsesRequest,
    TextConfig,
)
from api.server.errors import InvalidRequest

log = logging.getLogger(__name__)

# role -> the role the chat template sees
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def refuse_unserved(req: ResponsesRequest) -> None:
    """A 400 naming the first field that asks for what the server does not do."""
    stateless = "this server keeps no state between requests; send the whole input"
    if req.previous_response_id is not None:
        raise refuse("previous_response_id", stateless)
    if not asks_nothing(req.conversation):
        raise refuse("conversation", stateless)
    if not asks_nothing(req.prompt):
        raise refuse("prompt", "stored prompts; send `instructions` and `input`")
    if req.background:
        raise refuse("background", "background responses; stream instead")
    if req.top_logprobs:
        raise refuse("top_logprobs", "logprobs on this route")
    if req.include and "message.output_text.logprobs" in req.include:
        raise refuse("include", "logprobs on this route")


# ---- input -------------------------------------------------------------------------
def messages_of(
    req: ResponsesRequest, max_messages: int
) -> tuple[tuple[Message, ...], list[int | None]]:
    """The chat's messages, and for each the input item it came from (None: the input
    was one string)."""
    if isinstance(req.input, str):
        return (Message("user", req.input),), [None]
    if len(req.input) > max_messages:
        raise InvalidRequest(
            f"{len(req.input)} input items; this server accepts at most {max_messages} per "
            "request (--max-messages)",
            param="input",
        )
    out: list[Message] = []
    origin: list[int | None] = []
    names: dict[str, str] = {}  # call_id -> the function it called
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if item.type == "message":
            out.append(_message(item, where))
        elif item.type == "function_call":
            call = _earlier_call(item, where)
            names[call.id] = call.name
            last = out[-1] if out else None
            if last is not None and last.role == "assistant":  # the same answer's calls
                out[-1] = Message("assistant", last.text, (*last.calls, call))
                continue
            out.append(Message("assistant", "", (call,)))
        elif item.type == "function_call_output":
            if item.call_id is None:
                raise InvalidRequest("a function_call_output needs call_id",
                                     param=f"{where}.call_id")  # fmt: skip
            text = _text(item.output, f"{where}.output")
            out.append(Message("tool", text, call_id=item.call_id, name=names.get(item.call_id)))
        elif item.type == "reasoning":
            continue
        elif item.type == "item_reference":
            raise refuse(f"{where}.type", "'item_reference' items: this server keeps no items; "
                         "send the item itself")  # fmt: skip
        else:
            raise refuse(f"{where}.type", f"{item.type!r} items")
        origin.append(i)
    if not out:
        raise InvalidRequest("input has no message", param="input")
    return tuple(out), origin


def _message(item: InputItem, where: str) -> Message:
    if item.role is None:
        raise InvalidRequest("a message needs a role", param=f"{where}.role")
    role = ROLES.get(item.role)
    if role is None:
        raise InvalidRequest(f"role {item.role!r} is not one of {', '.join(ROLES)}",
                             param=f"{where}.role")  # fmt: skip
    return Message(role, _text(item.content, f"{where}.content"))


def _text(content: str | list[InputPart] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type == "refusal":
            texts.append(part.refusal or "")
        elif part.type not in TEXT_PARTS:
            raise refuse(f"{where}[{j}].type", f"{part.type!r} parts: text only")
        elif part.text is None:
            raise InvalidRequest("a text part needs `text`", param=f"{where}[{j}].text")
        else:
            texts.append(part.text)
    return "".join(texts)


def _earlier_call(item: InputItem, where: str) -> EarlierCall:
    """A call of the conversation, its arguments a JSON object (templates read one)."""
    call_id, name, text = item.call_id, item.name, item.arguments
    if call_id is None or name is None or text is None:
        missing = "call_id" if call_id is None else "name" if name is None else "arguments"
        raise InvalidRequest(f"a function_call needs {missing}", param=f"{where}.{missing}")
    if item.namespace:
        name = flat_name(item.namespace, name)
    try:
        args = json.loads(text)
    except ValueError:
        raise InvalidRequest("arguments are not JSON", param=f"{where}.arguments") from None
    if not isinstance(args, dict):
        raise InvalidRequest("arguments are not a JSON object", param=f"{where}.arguments")
    return EarlierCall(call_id, name, text, args)


# ---- tools and format ---------------------------------------------------------------
NAMESPACE_SEP = "__"  # a namespaced tool's flat name: `group__tool`, as Codex shows it


def flat_name(namespace: str, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEP}{name}"


@dataclass
class ToolsOffered:
    """The function tools in chat's nested form (the template's), and for each offered
    under a namespace's flat name, its (namespace, name)."""

    functions: list[dict[str, Any]] | None = None
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)


def functions_of(tools: list[FunctionTool] | None) -> ToolsOffered:
    """The tools offered to the model: function tools, and a namespace group's under their
    flat names; a built-in tool is left out (logged)."""
    out = ToolsOffered()
    functions: list[dict[str, Any]] = []
    for i, t in enumerate(tools or []):
        if t.type == "namespace":
            if not t.name:
                raise InvalidRequest("a namespace needs a name", param=f"tools[{i}].name")
            for j, inner in enumerate(t.tools or []):
                at = f"tools[{i}].tools[{j}]"
                if inner.type != "function":
                    _left_out(inner.type, at)
                    continue
                f = _function(inner, at)
                flat = flat_name(t.name, f["function"]["name"])
                out.namespaced[flat] = (t.name, f["function"]["name"])
                f["function"]["name"] = flat
                functions.append(f)
        elif t.type == "function":
            functions.append(_function(t, f"tools[{i}]"))
        else:
            _left_out(t.type, f"tools[{i}]")
    out.functions = functions or None
    return out


def _function(t: FunctionTool, at: str) -> dict[str, Any]:
    if t.name is None:
        raise InvalidRequest("a function tool needs a name", param=f"{at}.name")
    f: dict[str, Any] = {"name": t.name}
    for key in ("description", "parameters", "strict"):
        if (value := getattr(t, key)) is not None:
            f[key] = value
    return {"type": "function", "function": f}


def _left_out(kind: str, at: str) -> None:
    log.warning("%s: built-in tool %r is not served here; left out of the prompt", at, kind)


def choice_of(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """`tool_choice` in chat's form: a mode, or the named function nested."""
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        name = choice["name"]
        if isinstance(choice.get("namespace"), str):  # one of a namespace's tools
            name = flat_name(choice["namespace"], name)
        return {"type": "function", "function": {"name": name}}
    kind = choice.get("type")
    raise refuse("tool_choice", f"tool_choice {kind!r}: 'none', 'auto', 'required' or "
                 '{"type": "function", "name": …}')  # fmt: skip


def response_format_of(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format` (api.pipeline.structured makes the grammar)."""
    f = text.format if text is not None else None
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return {"type": "json_object"}
    if f.type != "json_schema":
        raise InvalidRequest(
            f"text.format type {f.type!r}: expected 'text', 'json_object' or 'json_schema'",
            param="text.format.type",
        )
    for name in ("name", "schema"):
        if getattr(f, name) is None:
            raise InvalidRequest(f"a json_schema format needs `{name}`",
                                 param=f"text.format.{name}")  # fmt: skip
    spec = {"name": f.name, "schema": f.schema, "strict": f.strict}
    return {"type": "json_schema", "json_schema": spec}


# ---- errors in this API's names -----------------------------------------------------
_MESSAGE = re.compile(r"^messages\[(\d+)\]")
_TOOL = re.compile(r"^tools\[(\d+)\]\.function")
RENAMED = {
    "messages": "input", "prompt": "input", "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}  # fmt: skip


def api_param(param: str | None, origin: list[int | None]) -> str | None:
    """A field the pipeline named in chat's vocabulary, named as this API names it."""
    if param is None:
        return None
    if m := _MESSAGE.match(param):
        k = int(m.group(1))
        at = origin[k] if k < len(origin) else None
        return "input" if at is None else f"input[{at}]"
    if m := _TOOL.match(param):
        return f"tools[{m.group(1)}]" + param[m.end() :]
    return RENAMED.get(param, param)
