"""What a Messages body asks, in the internal request's terms: its conversation as the
template's turns, its system prompt, its tools and tool choice, its thinking switch and
output format (api.protocols.anthropic.messages encodes the answer).

A message's blocks become turns: a user's text, and each `tool_result` a tool turn of its
own (named after the call it answers, an `is_error` one saying so in its text, since
templates have no field for it); an assistant's text and `tool_use` calls. Consecutive
turns of one role are one turn, as Anthropic reads them (a user message of tool results
and text is a tool turn per result, then a user turn); a `system` message (Claude Code
sends one to a model it does not know) stays where it stands. Earlier thinking is accepted and
dropped: the template renders none of it. A conversation that ends with an assistant
message is continued from that text (Anthropic's prefill). Images and documents are
refused by name: the model reads text only. `thinking` switches the template's own
thinking variable where it has one (Qwen's `enable_thinking`, DeepSeek V3.1's
`thinking`). Each refusal names where it is, in Anthropic's field names.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from api.pipeline.request import Chat, EarlierCall, GenerationRequest, Message, Tools
from api.pipeline.validation import asks_nothing, check_model
from api.protocols.anthropic.wire import (
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    InputBlock,
    MessagesInput,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    Thinking,
    ThinkingBlock,
    ThinkingDisabled,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
)
from api.server.errors import InvalidRequest, Unsupported
from api.server.state import ServerState

SEP = "\n\n"  # between the text blocks of one turn


def counted(state: ServerState, body: CountTokensRequest) -> GenerationRequest:
    """The request whose prompt /v1/messages/count_tokens counts (nothing is generated)."""
    return GenerationRequest(
        id=f"count_{uuid.uuid4().hex}", input=chat_of(state, body), tools=tools_of(body),
        lane=body.strata_reproducible,
    )  # fmt: skip


def chat_of(state: ServerState, body: MessagesInput) -> Chat:
    """The conversation as the template renders it: turns, system prompt, thinking
    switch, and whether the last turn is continued."""
    check_model(state, body.model)
    for name in ("mcp_servers", "container"):
        if not asks_nothing(getattr(body, name)):
            raise Unsupported(f"Anthropic's server-side `{name}` are not served here",
                              param=name)  # fmt: skip
    most = state.settings.limits.max_messages
    if len(body.messages) > most:
        raise InvalidRequest(f"{len(body.messages)} messages; this server accepts at most "
                             f"{most} per request (--max-messages)", param="messages")  # fmt: skip
    turns = _Turns(tools_served=state.tool_format is not None)
    for i, m in enumerate(body.messages):
        blocks: list[InputBlock] = (
            [TextBlock(text=m.content)] if isinstance(m.content, str) else m.content
        )
        if m.role == "user":
            turns.user(blocks, f"messages[{i}]")
        elif m.role == "system":
            turns.system(blocks, f"messages[{i}]")
        else:
            turns.assistant(blocks, f"messages[{i}]")
    if not turns.messages:
        raise InvalidRequest("the messages have no content", param="messages")
    if all(m.role == "system" for m in turns.messages):
        raise InvalidRequest("the messages have no user turn", param="messages")
    last, where = turns.messages[-1], f"messages[{len(body.messages) - 1}]"
    prefill = last.role == "assistant"
    if prefill and last.calls:
        raise InvalidRequest("the conversation ends with the assistant's tool_use: send its "
                             "tool_result in a user message", param=where)  # fmt: skip
    if prefill and not last.text.strip():
        raise InvalidRequest("a final assistant message is continued from its text, and "
                             "this one has none", param=where)  # fmt: skip
    return Chat(
        tuple(turns.messages), instructions=_system(body.system), add_generation_prompt=not prefill,
        continue_final_message=prefill, template_kwargs=_thinking_variables(body.thinking),
    )  # fmt: skip


def _system(system: str | list[TextBlock] | None) -> str | None:
    if system is None:
        return None
    texts = [system] if isinstance(system, str) else [b.text for b in system]
    return SEP.join(map(_steady_billing_header, texts)) or None


BILLING = "x-anthropic-billing-header:"
_CCH = re.compile(r"(?<=cch=)[^;]*")


def _steady_billing_header(text: str) -> str:
    """Claude Code opens its system prompt with a billing header whose `cch=` stamp
    changes with every request: left as it is, no request could read an earlier one's
    prompt from the prefix cache past its first tokens. The stamp means nothing to the
    model; it is made the same every time (llama-server does the same)."""
    return _CCH.sub("0", text, count=1) if text.startswith(BILLING) else text


class _Turns:
    """A conversation's blocks as the template's turns, in order."""

    def __init__(self, tools_served: bool) -> None:
        self.messages: list[Message] = []
        self._tools_served = tools_served
        self._names: dict[str, str] = {}  # a tool_use's id → its tool's name

    def user(self, blocks: list[InputBlock], where: str) -> None:
        texts: list[str] = []
        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            if isinstance(b, TextBlock):
                texts.append(b.text)
            elif isinstance(b, ToolResultBlock):
                self._check_tools(at, "tool_result")
                if texts:  # the text before it is a turn of its own
                    self._add(Message("user", SEP.join(texts)))
                    texts = []
                self._add(Message("tool", _result_text(b, at), call_id=b.tool_use_id,
                                  name=self._names.get(b.tool_use_id)))  # fmt: skip
            else:
                raise _misplaced(b, at, "an assistant's")
        if texts:
            self._add(Message("user", SEP.join(texts)))

    def system(self, blocks: list[InputBlock], where: str) -> None:
        """A system message where it stands (api.pipeline.rendering places it where the template
        renders one)."""
        texts: list[str] = []
        for j, b in enumerate(blocks):
            if not isinstance(b, TextBlock):
                raise _misplaced(b, f"{where}.content[{j}]", "a user's or an assistant's")
            texts.append(b.text)
        if texts:
            self._add(Message("system", SEP.join(texts)))

    def assistant(self, blocks: list[InputBlock], where: str) -> None:
        texts: list[str] = []
        calls: list[EarlierCall] = []
        for j, b in enumerate(blocks):
            at = f"{where}.content[{j}]"
            if isinstance(b, TextBlock):
                texts.append(b.text)
            elif isinstance(b, ToolUseBlock):
                self._check_tools(at, "tool_use")
                args = json.dumps(b.input, ensure_ascii=False)
                calls.append(EarlierCall(b.id, b.name, args, b.input))
                self._names[b.id] = b.name
            elif not isinstance(b, ThinkingBlock | RedactedThinkingBlock):
                raise _misplaced(b, at, "a user's")
        if texts or calls:  # (thinking alone renders as nothing)
            self._add(Message("assistant", SEP.join(texts), tuple(calls)))

    def _add(self, m: Message) -> None:
        last = self.messages[-1] if self.messages else None
        if last is None or last.role != m.role or m.role == "tool":
            self.messages.append(m)
            return
        text = SEP.join(t for t in (last.text, m.text) if t)
        self.messages[-1] = Message(m.role, text, last.calls + m.calls)

    def _check_tools(self, at: str, kind: str) -> None:
        if not self._tools_served:
            raise InvalidRequest(f"{kind} blocks: this model's chat template writes no "
                                 "tool-call format the server knows (--tool-call-parser "
                                 "names one)", param=at)  # fmt: skip


def _misplaced(b: InputBlock, at: str, whose: str) -> InvalidRequest:
    kind = type(b).__struct_config__.tag
    if isinstance(b, ImageBlock | DocumentBlock):
        return Unsupported(f"{kind} blocks are not served: this model reads text only", param=at)
    return InvalidRequest(f"a {kind} block belongs in {whose} message", param=at)


def _result_text(b: ToolResultBlock, at: str) -> str:
    if b.content is None or isinstance(b.content, str):
        text = b.content or ""
    else:
        texts = []
        for k, part in enumerate(b.content):
            if not isinstance(part, TextBlock):
                raise _misplaced(part, f"{at}.content[{k}]", "no tool_result's")
            texts.append(part.text)
        text = SEP.join(texts)
    return f"Error: {text}" if b.is_error else text


def _thinking_variables(thinking: Thinking | None) -> dict[str, Any]:
    """The template variables that switch a model's thinking on or off, where its
    template has one (others ignore them); absent, the template's default."""
    if thinking is None:
        return {}
    on = not isinstance(thinking, ThinkingDisabled)
    return {"enable_thinking": on, "thinking": on}


def tools_of(body: MessagesInput) -> Tools:
    functions = [_function(t, f"tools[{i}]") for i, t in enumerate(body.tools or [])]
    choice, parallel = _choice(body.tool_choice)
    return Tools(functions or None, choice, parallel)


def _function(t: ToolSpec, at: str) -> dict[str, Any]:
    """A client tool as the template's function."""
    if t.type not in (None, "custom"):
        raise Unsupported(
            f"tool type {t.type!r}: Anthropic's server tools are not served here (define a "
            "tool with an input_schema)", param=f"{at}.type",
        )  # fmt: skip
    if t.input_schema is None:
        raise InvalidRequest("a tool needs an input_schema", param=f"{at}.input_schema")
    function: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
    if t.description:
        function["description"] = t.description
    return {"type": "function", "function": function}


def _choice(c: ToolChoice | None) -> tuple[str | dict[str, Any] | None, bool]:
    """tool_choice in the internal request's words, and whether calls may be parallel."""
    if c is None:
        return None, True
    if isinstance(c, ToolChoiceNone):
        return "none", True
    parallel = not c.disable_parallel_tool_use
    if isinstance(c, ToolChoiceAuto):
        return "auto", parallel
    if isinstance(c, ToolChoiceAny):
        return "required", parallel
    return {"type": "function", "function": {"name": c.name}}, parallel


def format_of(body: MessagesRequest) -> dict[str, Any] | None:
    """`output_config.format` (structured outputs) as the pipeline's response format."""
    fmt = body.output_config.format if body.output_config else None
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema}}
