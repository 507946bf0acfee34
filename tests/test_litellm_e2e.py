"""LiteLLM in front of the server, as many teams put it between their tools and their
models: its SDK with the server as an OpenAI-compatible provider (`openai/<name>`) and as
an Anthropic one (`anthropic/<name>`) — a completion, a streamed `acompletion`, and a
tool call — on the embedded model (the session `server`).

LiteLLM is told to use its bundled model list (no download at import); every request it
makes goes to the server's loopback port.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from bench.server_proc import Server
from tests.conftest import MODEL

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before the import: offline
import litellm

pytestmark = pytest.mark.e2e

ASK = [{"role": "user", "content": "Name three rivers."}]
WEATHER: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}},
}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city"}}]  # fmt: skip


def _provider(server: Server, kind: str) -> dict[str, Any]:
    """LiteLLM's arguments for the server as one of its providers."""
    base = server.base_url if kind == "openai" else server.url
    return {"model": f"{kind}/{MODEL}", "api_base": base, "api_key": "none"}


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_completion_and_a_streamed_one_through_litellm(server: Server, kind: str) -> None:
    """`completion` answers with text and usage; `acompletion(stream=True)` streams the
    text in more than one chunk and ends with a finish reason."""
    whole = litellm.completion(messages=ASK, max_tokens=24, temperature=0,
                               **_provider(server, kind))  # fmt: skip
    text = whole.choices[0].message.content
    assert isinstance(text, str) and text.strip(), whole
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0

    async def streamed() -> tuple[list[str], str | None]:
        pieces, reason = [], None
        stream = await litellm.acompletion(messages=ASK, max_tokens=24, temperature=0,
                                           stream=True, **_provider(server, kind))  # fmt: skip
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                reason = choice.finish_reason or reason
        return pieces, reason

    pieces, reason = asyncio.run(streamed())
    assert len(pieces) > 1 and reason in ("stop", "length"), (pieces, reason)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_forced_tool_call_through_litellm(server: Server, kind: str) -> None:
    """A named tool forced: the call comes back in OpenAI's shape whichever provider
    LiteLLM spoke to, its arguments valid JSON for the function."""
    got = litellm.completion(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80,
        temperature=0, **_provider(server, kind),
    )  # fmt: skip
    calls = got.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"], got
    args = json.loads(calls[0].function.arguments)
    assert isinstance(args.get("city"), str)
    assert got.choices[0].finish_reason == "tool_calls"
