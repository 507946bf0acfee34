"""A chat as its template takes it: the messages as dicts, the instructions and the tool
prompt in the system message, the template bound to the request's rendering options.

Templates are written for transformers' message dicts, so the internal messages
(api.pipeline.request) become exactly those: `role` and `content` always,
`tool_calls` on an assistant turn that made calls, `tool_call_id` (and `name`) on a tool
result — a key a template tests for is present only when it means something.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from api.pipeline.generic_tools import text_turns
from api.pipeline.request import Chat, EarlierCall, Message
from api.pipeline.tool_calls import ToolSetup, with_prompt
from api.server.errors import InvalidRequest
from engine.chat_template import RESERVED, ChatTemplate

SEP = "\n\n"  # between the texts of the system messages folded into one turn


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
    template: ChatTemplate, chat: Chat, tools: ToolSetup, system_first: bool = True,
    system_between: bool = True,
) -> tuple[list[dict[str, Any]], ChatTemplate]:  # fmt: skip
    """The messages the template renders, and the template bound to this request (the
    generic tool format: calls and results as plain turns, api.pipeline.generic_tools).
    `system_first`, `system_between`: the template renders a system message first, and
    after the first turn (else such a message joins a user turn, `placed_system`)."""
    if tools.history_as_text:
        messages = text_turns(chat.messages)
    else:
        messages = [_message(m) for m in chat.messages]
    if chat.instructions is not None:
        messages.insert(0, {"role": "system", "content": chat.instructions})
    if not (system_first and system_between):
        messages = placed_system(messages, first=system_first)
    if tools.prompt is not None:  # the template would drop the tools: the system message says
        messages = with_prompt(messages, tools.prompt, in_system=not tools.prompt_in_user)
    return messages, _bound(template, chat, messages, tools.render)


def placed_system(messages: list[dict[str, Any]], first: bool = True) -> list[dict[str, Any]]:
    """The conversation for a template that renders a system message only first (Gemma
    3's raises unless user and model turns alternate), or nowhere (`first` False: Gemma
    2's): the leading system messages are one, and any other is a user turn where it
    stands, joined with a user turn beside it. Agents put one mid-conversation (Claude
    Code its environment description; OpenAI clients a `developer` message)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        leading = first and all(o["role"] == "system" for o in out)
        if m["role"] == "system" and not leading:
            m = {"role": "user", "content": m["content"]}
        last = out[-1] if out else None
        joins = (
            last is not None
            and last["role"] == m["role"]
            and (m["role"] == "system" or (m["role"] == "user" and _plain(last) and _plain(m)))
        )
        if joins:
            assert last is not None
            out[-1] = {**last, "content": SEP.join([last["content"], m["content"]])}
        else:
            out.append(m)
    return out


def _plain(m: dict[str, Any]) -> bool:
    """A turn of text alone (not a tool's result), which another's text may join."""
    return set(m) == {"role", "content"} and isinstance(m["content"], str)


def renders_system_between(render: Callable[[list[dict[str, Any]]], str]) -> bool:
    """Does the template render a system message where one stands after the first turn
    (after a user turn, and after an assistant's), keeping the first one too? DeepSeek
    R1's keeps only the last, V3.1's moves them all to the top. `render(messages)`
    renders them."""
    first, between, turn = "probe_first_3b9e", "probe_between_7d2a", "probe_turn_51c0"
    head = [{"role": "system", "content": first}, {"role": "user", "content": turn}]
    shapes = (
        [*head, {"role": "system", "content": between}, {"role": "user", "content": "Hi"}],
        [*head, {"role": "assistant", "content": "Hello"},
         {"role": "system", "content": between}, {"role": "user", "content": "Hi"}],
    )  # fmt: skip
    try:
        outs = [render(list(s)) for s in shapes]
    except ValueError:  # (engine.chat_template's errors are ValueErrors)
        return False
    return all(first in o and between in o and o.index(turn) < o.index(between) for o in outs)


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
