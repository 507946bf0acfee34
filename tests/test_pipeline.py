"""What the next APIs (Anthropic's Messages, OpenAI's Responses) will stand on and no route
takes yet: the tokenize-only path, instructions given apart from the messages, and the
output blocks' numbering."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from api.pipeline.answer import BlockNumbers, Parts
from api.pipeline.lanes import LaneOptions
from api.pipeline.output_blocks import Reasoning, Text, ToolUse
from api.pipeline.prepare import count_tokens
from api.pipeline.request import Chat, GenerationRequest, Message, Prompts
from api.pipeline.tool_calls import Call
from engine.chat_template import ChatTemplate
from engine.config import EngineConfig
from engine.default_model import default_model_path
from engine.model import Model


def test_blocks_are_numbered_in_the_order_they_begin() -> None:
    numbers = BlockNumbers()
    f, g = Call("f", "{}"), Call("g", "{}")
    assert numbers.blocks(Parts("think")) == [Reasoning(0, "think")]
    assert numbers.blocks(Parts(" more", "Hello")) == [Reasoning(0, " more"), Text(1, "Hello")]
    assert numbers.blocks(Parts("", " world", [f, g])) == [
        Text(1, " world"), ToolUse(2, f, 0), ToolUse(3, g, 1),
    ]  # fmt: skip
    assert numbers.blocks(Parts()) == []


@pytest.fixture(scope="module")
def state() -> Iterator[Any]:
    """Only what the tokenize-only path may read: no loop, no queue."""
    model = Model(EngineConfig(default_model_path(), n_ctx=512, n_seq_max=1, n_threads=2))
    template = ChatTemplate.resolve(None, model.chat_template(), model.bos_token, model.eos_token)
    yield SimpleNamespace(
        model=model, template=template, longest_token_bytes=model.longest_token_bytes(),
        prompt_workers=anyio.CapacityLimiter(1), tool_format=None, renders_tools=True,
        system_role=True, system_between=True,
        settings=SimpleNamespace(lanes=LaneOptions()), max_len=lambda lane: 512,
    )  # fmt: skip
    model.close()


def _count(state: Any, req: GenerationRequest) -> list[list[int]]:
    return [p.ids for p in anyio.run(count_tokens, state, req)]


def test_instructions_count_as_a_system_message_ahead_of_the_messages(state: Any) -> None:
    user = Message("user", "What is the capital of France?")
    apart = Chat((user,), instructions="Answer in one word.")
    inside = Chat((Message("system", "Answer in one word."), user))
    assert _count(state, GenerationRequest("a", apart)) == _count(
        state, GenerationRequest("b", inside)
    )


def test_raw_prompts_count_as_the_tokenizer_reads_them(state: Any) -> None:
    ids = state.model.tokenize("Once upon a time", add_special=True, parse_special=True)
    req = GenerationRequest("c", Prompts(["Once upon a time", "Once upon a time"]), n=3)
    assert _count(state, req) == [ids, ids]
    assert req.sequences == 6
