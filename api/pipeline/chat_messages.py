"""OpenAI's chat messages and tools, the shape two protocols read: OpenAI's chat
completions and the vLLM-style `POST /tokenize` (api.protocols.llama.routes), which counts a
chat as the chat route would render it. Kept here, not in either protocol, so neither
imports the other; `chat_messages` turns them into the internal request's messages.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from msgspec import Struct

from api.pipeline.request import EarlierCall, Message
from api.pipeline.validation import refuse
from api.server.errors import InvalidRequest


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ToolCall(Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class FunctionDef(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    function: FunctionDef
    type: Literal["function"] = "function"


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls (api.pipeline.tool_calls)
    tool_call_id: str | None = None  # a tool message: the call it answers


# role -> the role the chat template sees ("developer" is OpenAI's newer name for system)
ROLES = {
    "system": "system", "developer": "system", "user": "user", "assistant": "assistant",
    "tool": "tool",
}  # fmt: skip


def chat_messages(messages: list[ChatMessage], max_messages: int) -> tuple[Message, ...]:
    """The messages in the template's roles, text only; a 400 for a role, part or field
    that cannot be served, naming where it is."""
    if len(messages) > max_messages:
        raise InvalidRequest(
            f"{len(messages)} messages; this server accepts at most {max_messages} per request "
            "(--max-messages)",
            param="messages",
        )
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = ROLES.get(m.role)
        if role is None:
            if m.role == "function":
                raise refuse(f"{where}.role", "role 'function' (use 'tool')")
            raise InvalidRequest(
                f"role {m.role!r} is not one of {', '.join(ROLES)}", param=f"{where}.role"
            )
        text = _text(m, where)
        calls: tuple[EarlierCall, ...] = ()
        if m.tool_calls:
            if role != "assistant":
                raise InvalidRequest("only assistant messages have tool_calls",
                                     param=f"{where}.tool_calls")  # fmt: skip
            calls = tuple(_earlier_call(c, f"{where}.tool_calls[{j}]")
                          for j, c in enumerate(m.tool_calls))  # fmt: skip
        call_id = name = None
        if role == "tool":
            if m.tool_call_id is None:
                raise InvalidRequest("a tool message needs tool_call_id",
                                     param=f"{where}.tool_call_id")  # fmt: skip
            call_id, name = m.tool_call_id, m.name
        out.append(Message(role, text, calls, call_id, name))
    return tuple(out)


def _earlier_call(c: ToolCall, where: str) -> EarlierCall:
    """A call of the conversation, its arguments a JSON object (templates read one)."""
    param = f"{where}.function.arguments"
    try:
        args = json.loads(c.function.arguments)
    except ValueError:
        raise InvalidRequest("arguments are not JSON", param=param) from None
    if not isinstance(args, dict):
        raise InvalidRequest("arguments are not a JSON object", param=param)
    return EarlierCall(c.id, c.function.name, c.function.arguments, args)


def _text(m: ChatMessage, where: str) -> str:
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    texts = []
    for j, part in enumerate(m.content):
        if part.type != "text":
            raise refuse(f"{where}.content[{j}].type", f"{part.type!r} parts: text only")
        if part.text is None:
            raise InvalidRequest("a text part needs `text`", param=f"{where}.content[{j}].text")
        texts.append(part.text)
    return "".join(texts)
