"""A chat as its template takes it: the messages as dicts, the instructions and the tool
prompt in the system message, the template bound to the request's rendering options.

Templates are written for transformers' message dicts, so the internal messages
(api.generation_request) become exactly those: `role` and `content` always,
`tool_calls` on an assistant turn that made calls, `tool_call_id` (and `name`) on a tool
result — a key a template tests for is present only when it means something.
"""

from __future__ import annotations

from typing import Any

from api.errors import InvalidRequest
from api.generation_request import Chat, EarlierCall, Message
from api.generic_tools import text_turns
from api.tool_calls import ToolSetup, with_prompt
from engine.chat_template import RESERVED, ChatTemplate


class TemplateArguments(dict[str, Any]):
    """A call's arguments as templates read them: an object for those that write it with
    `tojson` (transformers' convention; Qwen's), its JSON text for those that add it to a
    string or print it (DeepSeek's)."""

    def __init__(self, text: str, value: dict[str, Any]) -> None:
        super().__init__(value)
        self._text = text

    def __str__(self) -> str:
        return self._text

    def __add__(self, other: object) -> str:
        return self._text + str(other)

    def __radd__(self, other: object) -> str:
        return str(other) + self._text


def render(
    template: ChatTemplate, chat: Chat, tools: ToolSetup
) -> tuple[list[dict[str, Any]], ChatTemplate]:
    """The messages the template renders, and the template bound to this request (the
    generic tool format: calls and results as plain turns, api.generic_tools)."""
    if tools.history_as_text:
        messages = text_turns(chat.messages)
    else:
        messages = [_message(m) for m in chat.messages]
    if chat.instructions is not None:
        messages.insert(0, {"role": "system", "content": chat.instructions})
    if tools.prompt is not None:  # the template would drop the tools: the system message says
        messages = with_prompt(messages, tools.prompt, in_system=not tools.prompt_in_user)
    return messages, _bound(template, chat, messages, tools.render)


def _message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text}
    if m.calls:
        out["tool_calls"] = [_call(c) for c in m.calls]
    if m.call_id is not None:
        out["tool_call_id"] = m.call_id
        if m.name is not None:
            out["name"] = m.name
    return out


def _call(c: EarlierCall) -> dict[str, Any]:
    args = TemplateArguments(c.arguments, c.value)
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args}}


def _bound(
    template: ChatTemplate, chat: Chat, messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> ChatTemplate:  # fmt: skip
    """The server's template bound to this request's rendering options (vLLM's fields)."""
    if chat.continue_final_message:
        if chat.add_generation_prompt:
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt: false",
                param="continue_final_message",
            )
        if messages[-1]["role"] != "assistant" or not messages[-1]["content"].strip():
            raise InvalidRequest(
                "continue_final_message needs a last assistant message with text to continue",
                param="continue_final_message",
            )
    for name in chat.template_kwargs:
        if name in RESERVED:
            raise InvalidRequest(
                f"chat_template_kwargs cannot set {name!r}: the server sets it",
                param="chat_template_kwargs",
            )
    return template.bind(
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message,
        variables=chat.template_kwargs,
        tools=tools,
    )
