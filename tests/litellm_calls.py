"""What a program built on LiteLLM's SDK does against the server, run as a process of its
own by `tests/test_litellm_e2e.py`: a completion, a streamed `acompletion` and a forced tool
call through LiteLLM as one provider (`openai` or `anthropic`), printed as one JSON object.

In a process of its own because that is how LiteLLM runs in front of a server (a user's
program, not our test process), and so the library's own import-time and shutdown warnings
(a pydantic notice about its TypedDicts, a socket its HTTP pool leaves to the collector) stay
its own: the suite turns every warning in its process into an error.

    python -m tests.litellm_calls {openai,anthropic} BASE_URL MODEL
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

ASK = [{"role": "user", "content": "Name three rivers."}]
WEATHER: dict[str, Any] = {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 12}},
}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
                                           "description": "The weather in a city"}}]  # fmt: skip


def main(kind: str, base: str, model: str) -> dict[str, Any]:
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # its bundled model list: offline
    import litellm

    provider = {"model": f"{kind}/{model}", "api_base": base, "api_key": "none"}
    whole = litellm.completion(messages=ASK, max_tokens=24, temperature=0, **provider)

    async def streamed() -> tuple[list[str], str | None]:
        pieces, reason = [], None
        stream = await litellm.acompletion(messages=ASK, max_tokens=24, temperature=0,
                                           stream=True, **provider)  # fmt: skip
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                reason = choice.finish_reason or reason
        return pieces, reason

    pieces, reason = asyncio.run(streamed())
    forced = litellm.completion(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=80,
        temperature=0, **provider,
    )  # fmt: skip
    calls = forced.choices[0].message.tool_calls or []
    return {
        "text": whole.choices[0].message.content,
        "usage": [whole.usage.prompt_tokens, whole.usage.completion_tokens],
        "pieces": pieces,
        "stream_finish": reason,
        "calls": [[c.function.name, c.function.arguments] for c in calls],
        "call_finish": forced.choices[0].finish_reason,
    }


if __name__ == "__main__":
    print(json.dumps(main(*sys.argv[1:4])))
