"""One choice's generated text into what the response carries: reasoning (a model that
thinks first, api.pipeline.reasoning), content, and tool calls (api.pipeline.tool_calls) —
the same split whether the answer is streamed in pieces or returned whole — numbered as
the blocks of api.pipeline.output_blocks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from api.pipeline.generic_tools import GENERIC, EnvelopeStream
from api.pipeline.output_blocks import Block, Reasoning, Text, ToolUse
from api.pipeline.reasoning import ReasoningSplit
from api.pipeline.tool_calls import Call, ToolStream


@dataclass
class Parts:
    reasoning: str = ""
    content: str = ""
    calls: list[Call] = field(default_factory=list)


class AnswerSplit:
    def __init__(
        self, reasoning_tail: str | None, tool_format: str | None, one_call: bool = False
    ) -> None:
        """`reasoning_tail`: the prompt's end, when reasoning is split off; `tool_format`:
        parse tool calls in that format out of the answer; `one_call`: keep the first call
        only (`parallel_tool_calls: false`). `ended`: the answer is over before its text
        is (see `_keep`): the generation is stopped there."""
        self._one_call = one_call
        self._seen: set[tuple[str, str]] = set()
        self.ended = False
        self._reasoning = ReasoningSplit(reasoning_tail) if reasoning_tail is not None else None
        self._tools: ToolStream | EnvelopeStream | None = None
        if tool_format == GENERIC:
            self._tools = EnvelopeStream()
        elif tool_format:
            self._tools = ToolStream(tool_format)
        self.all = Parts()

    def feed(self, text: str) -> Parts:
        thought, answer = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._answer(thought, answer)

    def finish(self, reason: str) -> tuple[Parts, str]:
        """What was held back, and the finish reason (`tool_calls` when calls were made)."""
        thought, answer = self._reasoning.flush() if self._reasoning else ("", "")
        parts = self._answer(thought, answer)
        if self._tools is not None:
            rest, calls = self._tools.flush()
            calls = self._keep(calls)
            parts.content += rest
            parts.calls += calls
            self.all.content += rest
            self.all.calls += calls
        if self.all.calls and reason == "stop":
            reason = "tool_calls"
        return parts, reason

    def _answer(self, thought: str, answer: str) -> Parts:
        out = Parts(thought)
        if self.ended:
            return out
        if self._tools is None:
            out.content = answer
        else:
            out.content, calls = self._tools.feed(answer)
            out.calls = self._keep(calls)
        self.all.reasoning += out.reasoning
        self.all.content += out.content
        self.all.calls += out.calls
        return out

    def _keep(self, calls: list[Call]) -> list[Call]:
        """The calls that go out. A call that repeats one of this answer's (same function,
        same arguments) ends the answer with the calls before it: a small model forced to
        call (`required`, Anthropic's `any`) otherwise writes the same call again until
        max_tokens, where the client wanted one round of calls. With
        `parallel_tool_calls: false`, the first call ends it."""
        out = []
        for call in calls:
            key = (call.name, _canonical(call.arguments))
            if key in self._seen or (self._one_call and self._seen):
                self.ended = True
                break
            self._seen.add(key)
            out.append(call)
        return out


def _canonical(arguments: str) -> str:
    """Arguments as one text whatever their spacing and key order."""
    try:
        return json.dumps(json.loads(arguments), sort_keys=True, separators=(",", ":"))
    except ValueError:
        return arguments


class BlockNumbers:
    """One choice's parts as numbered blocks: a piece's reasoning, then its text, then its
    calls; a block keeps its index while the kind goes on, and every call is one block."""

    def __init__(self) -> None:
        self._next = 0
        self._open: type[Block] | None = None
        self._calls = 0

    def blocks(self, parts: Parts) -> list[Block]:
        out: list[Block] = []
        if parts.reasoning:
            out.append(Reasoning(self._index(Reasoning), parts.reasoning))
        if parts.content:
            out.append(Text(self._index(Text), parts.content))
        for call in parts.calls:
            out.append(ToolUse(self._index(ToolUse), call, self._calls))
            self._calls += 1
        return out

    def _index(self, kind: type[Block]) -> int:
        if kind is not self._open or kind is ToolUse:
            self._open = kind
            self._next += 1
        return self._next - 1
