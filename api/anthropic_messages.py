"""Anthropic's /v1/messages as a codec: its body into the internal request, the
generation's blocks back into content blocks, streamed as Anthropic's events or whole.

Decoding. `system` is the chat's instructions. A message's blocks become the template's
turns: a user's text, and each `tool_result` a tool turn of its own (named after the call
it answers, an `is_error` one saying so in its text, since templates have no field for
it); an assistant's text and `tool_use` calls. Consecutive turns of one role are one
turn, as Anthropic reads them (a user message of tool results and text is a tool turn
per result, then a user turn). Earlier thinking is accepted and dropped: the template
renders none of it. A conversation that ends with an assistant message is continued from
that text (Anthropic's prefill). Images and documents are refused by name: the model
reads text only. `thinking` switches the template's own thinking variable where it has
one (Qwen's `enable_thinking`, DeepSeek V3.1's `thinking`), and decides whether the
answer shows its reasoning: as `thinking` blocks when asked for, else not at all, as
Anthropic's API answers (a client that asked for none reads `content[0]` as the text).
`max_tokens` is a bound, as Anthropic's is: a prompt that leaves less room than it asks
(Claude Code asks for 32K whatever the model) gets what the context leaves, and an answer
that fills it ends `model_context_window_exceeded`.

Encoding. Each output block is a content block; the output's `index` gives the order,
and the blocks shown are numbered from 0 in it (hidden reasoning takes no number). A
stream opens a block where a new index begins and closes the open one first, a thinking
block after its `signature_delta`; a tool call comes whole, its input as one
`input_json_delta`. The signature is a hash of the thinking: opaque, non-empty, the same
for the same thinking streamed or not.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import AsyncIterator
from typing import Any

from api.anthropic_wire import (
    Content,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    InputBlock,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageResponse,
    MessagesInput,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    RedactedThinkingBlock,
    SignatureDelta,
    StopReason,
    TextBlock,
    TextContent,
    TextDelta,
    Thinking,
    ThinkingAdaptive,
    ThinkingBlock,
    ThinkingContent,
    ThinkingDelta,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoice,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolResultBlock,
    ToolSpec,
    ToolUseBlock,
    ToolUseContent,
    error_body,
    event,
)
from api.errors import InvalidRequest, Unsupported
from api.generation import Generation, ended_badly
from api.generation_request import Chat, EarlierCall, GenerationRequest, Message, Sampling, Tools
from api.openai_wire import check_model
from api.output_blocks import Block, ChoiceAnswer, Reasoning, Text, ToolUse
from api.schemas import ENCODER
from api.state import ServerState
from api.tool_calls import Call
from api.validation import asks_nothing

SEP = "\n\n"  # between the text blocks of one turn
STOP_REASONS: dict[str, StopReason] = {"stop": "end_turn", "length": "max_tokens",
                                       "tool_calls": "tool_use"}  # fmt: skip


class MessagesCodec:
    """One Messages request's body, and its response's encoding."""

    def __init__(self, state: ServerState, body: MessagesRequest) -> None:
        self.state = state
        self.req = body
        self.stream = body.stream
        self._shown = _ShownThinking(body.thinking)

    def decode(self) -> GenerationRequest:
        req = self.req
        return GenerationRequest(
            id=f"msg_{uuid.uuid4().hex}",
            input=_chat(self.state, req),
            sampling=Sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            max_tokens=req.max_tokens,
            cap_max_tokens=True,
            stop=tuple(req.stop_sequences or ()),
            tools=_tools(req),
            response_format=_response_format(req),
            lane=req.strata_reproducible,
        )

    async def frames(self, gen: Generation) -> AsyncIterator[bytes]:
        n_prompt = len(gen.prompts[0].ids)
        yield event(MessageStart(self._message(gen, [], None, None, MessageUsage(n_prompt, 0))))
        blocks = _BlockStream(self._shown)
        async for d in gen.events():
            if (err := ended_badly(d.finish_reason)) is not None:
                yield event(error_body(err))
                return
            for b in d.blocks:
                for frame in blocks.add(b):
                    yield frame
            if d.finish_reason is not None:
                for frame in blocks.close():
                    yield frame
                reason, sequence = self._stop(d.finish_reason, d.stop_string, d.output_tokens)
                use = _usage(n_prompt, d.output_tokens, d.cached_tokens)
                yield event(MessageDeltaEvent(MessageDelta(reason, sequence), use))
                yield event(MessageStop())

    def body(self, gen: Generation, answers: list[ChoiceAnswer]) -> MessageResponse:
        (a,) = answers  # (the Messages API has one choice)
        content = [c for b in a.blocks if (c := self._shown.content(b)) is not None]
        reason, sequence = self._stop(a.finish_reason, a.stop_string, a.output_tokens)
        use = _usage(len(gen.prompts[0].ids), a.output_tokens, a.cached_tokens)
        return self._message(gen, content, reason, sequence, use)

    def _stop(
        self, finish_reason: str, stop_string: str | None, output_tokens: int
    ) -> tuple[StopReason, str | None]:
        """Why it ended in Anthropic's words: cut short of max_tokens, the context ran out."""
        if finish_reason == "stop" and stop_string is not None:
            return "stop_sequence", stop_string
        if finish_reason == "length" and output_tokens < self.req.max_tokens:
            return "model_context_window_exceeded", None
        return STOP_REASONS.get(finish_reason, "end_turn"), None

    def _message(
        self, gen: Generation, content: list[Content], reason: StopReason | None,
        sequence: str | None, use: MessageUsage,
    ) -> MessageResponse:  # fmt: skip
        return MessageResponse(
            id=gen.request.id, model=self.req.model, content=content, stop_reason=reason,
            stop_sequence=sequence, usage=use,
        )  # fmt: skip


def counted(state: ServerState, body: CountTokensRequest) -> GenerationRequest:
    """The request whose prompt /v1/messages/count_tokens counts (nothing is generated)."""
    return GenerationRequest(
        id=f"count_{uuid.uuid4().hex}", input=_chat(state, body), tools=_tools(body),
        lane=body.strata_reproducible,
    )  # fmt: skip


# ---- decoding -------------------------------------------------------------------------
def _chat(state: ServerState, body: MessagesInput) -> Chat:
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
        blocks = [TextBlock(text=m.content)] if isinstance(m.content, str) else m.content
        if m.role == "user":
            turns.user(blocks, f"messages[{i}]")
        else:
            turns.assistant(blocks, f"messages[{i}]")
    if not turns.messages:
        raise InvalidRequest("the messages have no content", param="messages")
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


def _tools(body: MessagesInput) -> Tools:
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


def _response_format(body: MessagesRequest) -> dict[str, Any] | None:
    """`output_config.format` (structured outputs) as the pipeline's response format."""
    fmt = body.output_config.format if body.output_config else None
    if fmt is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema}}


# ---- encoding -------------------------------------------------------------------------
def _usage(n_prompt: int, output_tokens: int, cached: int) -> MessageUsage:
    """Anthropic's prompt count leaves out what the cache gave: the three add up to it."""
    return MessageUsage(n_prompt - cached, output_tokens, 0, cached)


def signature(thinking: str) -> str:
    return "sha256:" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _tool_id(call: Call) -> str:
    return "toolu_" + call.id.removeprefix("call_")


def _input(call: Call) -> dict[str, Any]:
    """A call's arguments as the object `input` is; arguments that are not one (a model
    that wrote a string) are kept under `arguments`, never dropped."""
    try:
        value = json.loads(call.arguments)
    except ValueError:
        return {"arguments": call.arguments}
    return value if isinstance(value, dict) else {"arguments": value}


class _ShownThinking:
    """What the answer shows of the model's reasoning: `thinking` blocks when the request
    enabled thinking (their text left out when it asked for `display: omitted`), else
    nothing."""

    def __init__(self, thinking: Thinking | None) -> None:
        self.blocks = isinstance(thinking, ThinkingEnabled | ThinkingAdaptive)
        self.text = self.blocks and getattr(thinking, "display", None) != "omitted"

    def content(self, b: Block) -> Content | None:
        """A whole block as its content block; None where it is not shown."""
        if isinstance(b, Text):
            return TextContent(b.text)
        if isinstance(b, Reasoning):
            shown = b.text if self.text else ""
            return ThinkingContent(shown, signature(b.text)) if self.blocks else None
        return ToolUseContent(_tool_id(b.call), b.call.name, _input(b.call))


class _BlockStream:
    """A stream's content blocks: opened where an output block's index first comes,
    continued while it goes on, closed before the next one opens or at the end."""

    def __init__(self, shown: _ShownThinking) -> None:
        self._shown = shown
        self._open: Block | None = None  # the output block whose content block is open
        self._wire = -1  # its index on the wire
        self._thought: list[str] = []  # an open thinking block's text (its signature)

    def add(self, b: Block) -> list[bytes]:
        if isinstance(b, Reasoning) and not self._shown.blocks:
            return []
        out: list[bytes] = []
        if self._open is None or b.index != self._open.index:
            out += self.close()
            self._open, self._wire = b, self._wire + 1
            out.append(event(ContentBlockStart(self._wire, _opening(b))))
        delta = self._delta(b)
        if delta is not None:
            out.append(event(ContentBlockDelta(self._wire, delta)))
        return out

    def close(self) -> list[bytes]:
        if self._open is None:
            return []
        out = []
        if isinstance(self._open, Reasoning):
            sig = SignatureDelta(signature("".join(self._thought)))
            out.append(event(ContentBlockDelta(self._wire, sig)))
            self._thought = []
        out.append(event(ContentBlockStop(self._wire)))
        self._open = None
        return out

    def _delta(self, b: Block) -> TextDelta | ThinkingDelta | InputJsonDelta | None:
        if isinstance(b, Text):
            return TextDelta(b.text)
        if isinstance(b, Reasoning):
            self._thought.append(b.text)
            return ThinkingDelta(b.text) if self._shown.text else None
        return InputJsonDelta(ENCODER.encode(_input(b.call)).decode())


def _opening(b: Block) -> Content:
    """A block as its content_block_start carries it: empty, filled by its deltas."""
    if isinstance(b, Text):
        return TextContent("")
    if isinstance(b, Reasoning):
        return ThinkingContent("", "")
    assert isinstance(b, ToolUse)
    return ToolUseContent(_tool_id(b.call), b.call.name, {})
