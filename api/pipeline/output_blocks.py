"""What a generation gives back, free of any API: each choice's answer as typed blocks.

A block is one kind of output: a thinking model's reasoning, text, or one tool call. Its
`index` is its place in the choice's answer, counted in the order the blocks begin (a
new block starts where the kind changes; every call is a block of its own), so an API
that streams blocks one by one (Anthropic's content blocks, the Responses API's output
items) can open and close them by index, and one that merges them (OpenAI's chat
`delta`) joins a delta's blocks by kind. A `ToolUse` also carries `call_index`, the
call's place among the answer's calls (OpenAI's `tool_calls[].index`).
"""

from __future__ import annotations

from dataclasses import dataclass

from api.pipeline.tool_calls import Call
from engine.step_types import Sampled


@dataclass(frozen=True, slots=True)
class Text:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class Reasoning:
    index: int
    text: str


@dataclass(frozen=True, slots=True)
class ToolUse:
    index: int
    call: Call
    call_index: int


Block = Text | Reasoning | ToolUse


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    """A streamed piece of one choice: the blocks it settles, its tokens' logprobs, and,
    on its last piece, why it finished and what it cost."""

    choice: int  # prompt p's choice c is p * n + c
    blocks: list[Block]
    logprobs: list[Sampled]  # empty unless asked for
    prompt_logprobs: list[Sampled] | None  # the prompt's own, on the first piece, if asked
    finish_reason: str | None  # stop | length | tool_calls | error | shutdown; None: more
    output_tokens: int
    cached_tokens: int  # prompt tokens read from the prefix cache
    stop_string: str | None = None  # the stop string that ended it (finish_reason stop)


@dataclass(frozen=True, slots=True)
class ChoiceAnswer:
    """One choice's whole answer (a response that is not streamed)."""

    choice: int
    blocks: list[Block]
    logprobs: list[Sampled]
    prompt_logprobs: list[Sampled] | None
    finish_reason: str
    output_tokens: int
    cached_tokens: int
    stop_string: str | None = None  # the stop string that ended it (finish_reason stop)


def text_of(blocks: list[Block]) -> str:
    return "".join(b.text for b in blocks if isinstance(b, Text))


def reasoning_of(blocks: list[Block]) -> str:
    return "".join(b.text for b in blocks if isinstance(b, Reasoning))


def calls_of(blocks: list[Block]) -> list[ToolUse]:
    return [b for b in blocks if isinstance(b, ToolUse)]
