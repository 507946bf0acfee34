"""Anthropic's /v1/messages as a codec: its body into the internal request (the
conversation, tools and thinking switch through api.protocols.anthropic.input), the generation's
blocks back into content blocks, streamed as Anthropic's events or whole.

`max_tokens` is a bound, as Anthropic's is: a prompt that leaves less room than it asks
(Claude Code asks for 32K whatever the model) gets what the context leaves, and an answer
that fills it ends `model_context_window_exceeded`. `thinking` decides whether the answer
shows the model's reasoning: as `thinking` blocks when asked for, else not at all, as
Anthropic's API answers (a client that asked for none reads `content[0]` as the text).

Each output block is a content block; the output's `index` gives the order, and the
blocks shown are numbered from 0 in it (hidden reasoning takes no number). A stream
opens a block where a new index begins and closes the open one first, a thinking block
after its `signature_delta`; a tool call comes whole, its input as one
`input_json_delta`. The signature is a hash of the thinking: opaque, non-empty, the same
for the same thinking streamed or not. Usage counts the prompt as Anthropic does, in
parts that add up to it: computed, and read from the prefix cache.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from api.pipeline.generation import Generation, ended_badly
from api.pipeline.output_blocks import Block, ChoiceAnswer, Reasoning, Text, ToolUse
from api.pipeline.request import GenerationRequest, Sampling
from api.pipeline.tool_calls import Call
from api.protocols.anthropic.input import chat_of, format_of, tools_of
from api.protocols.anthropic.wire import (
    Content,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageResponse,
    MessagesRequest,
    MessageStart,
    MessageStop,
    MessageUsage,
    Ping,
    SignatureDelta,
    StopReason,
    TextContent,
    TextDelta,
    Thinking,
    ThinkingAdaptive,
    ThinkingContent,
    ThinkingDelta,
    ThinkingEnabled,
    ToolUseContent,
    error_body,
    event,
)
from api.server.state import ServerState
from api.server.wire import ENCODER

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
            input=chat_of(self.state, req),
            sampling=Sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k),
            max_tokens=req.max_tokens,
            cap_max_tokens=True,
            stop=tuple(req.stop_sequences or ()),
            tools=tools_of(req),
            response_format=format_of(req),
            lane=req.strata_reproducible,
        )

    async def frames(self, gen: Generation) -> AsyncIterator[bytes]:
        n_prompt = len(gen.prompts[0].ids)
        yield event(MessageStart(self._message(gen, [], None, None, MessageUsage(n_prompt, 0))))
        yield event(Ping())  # (as Anthropic's API sends one: clients expect and skip it)
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


def _usage(n_prompt: int, output_tokens: int, cached: int) -> MessageUsage:
    """Anthropic's prompt count leaves out what the cache gave: the three add up to it."""
    return MessageUsage(n_prompt - cached, output_tokens, 0, cached)


def _signature(thinking: str) -> str:
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
            return ThinkingContent(shown, _signature(b.text)) if self.blocks else None
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
            sig = SignatureDelta(_signature("".join(self._thought)))
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
