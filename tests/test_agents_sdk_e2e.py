"""The OpenAI Agents SDK (pinned in the dev extras) runs an agent against the server's
Responses API, offline: tracing off, its model an `OpenAIResponsesModel` on a client
pointed at the server, every connection the process opens checked to go there.

The model is a tiny random-weight one whose chat template writes the Hermes call format,
so what it does is made certain rather than hoped for: the first turn must call a tool
(`tool_choice="required"`, a grammar: the call is one of the agent's two functions with
arguments valid under its schema); the SDK runs it, sends its output back and resets the
tool choice, so the second turn may answer in text — which the server's extensions end
after a few tokens (the end-of-generation token pushed to the top and held back by
`min_tokens`), giving a `completed` response and the run its final output.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from agents import (
    Agent,
    MessageOutputItem,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    RunResult,
    RunResultStreaming,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

from bench.server_proc import Server, start_server
from tests.test_tools_e2e import HERMES
from tests.tiny_gguf import EOS_ID, write_llama

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("agents")
    model = write_llama(where / "tooled.gguf", seed=4, chat_template=HERMES)
    srv = start_server(["--model", str(model), "--served-model-name", "tooled",
                        "--n-ctx", "4096"], where / "server.log")  # fmt: skip
    yield srv
    srv.stop()


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Any]]:
    """Tracing off (its exporter would post to OpenAI), no key for a default client, and
    every address a socket of this process connects to, recorded."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    set_tracing_disabled(True)
    seen: list[Any] = []
    connect = socket.socket.connect

    def record(self: socket.socket, address: Any) -> None:
        seen.append(address)
        connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", record)
    yield seen
    set_tracing_disabled(False)


def _agent(server: Server, ran: list[tuple[str, str]]) -> tuple[Agent[Any], AsyncOpenAI]:
    @function_tool
    def get_weather(city: str, days: int) -> str:
        """The weather in a city for the next days."""
        ran.append(("get_weather", city))
        return f"sunny in {city} for {days} days"

    @function_tool
    def get_time(tz: Literal["UTC", "CET"]) -> str:
        """The time in a time zone."""
        ran.append(("get_time", tz))
        return f"12:00 {tz}"

    client = AsyncOpenAI(base_url=server.base_url, api_key="none", max_retries=0,
                         _strict_response_validation=True)  # fmt: skip
    settings = ModelSettings(
        tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=300,
        extra_body={"logit_bias": {str(EOS_ID): 100}, "min_tokens": 8, "cache_prompt": False},
    )  # fmt: skip
    agent = Agent(
        name="helper", instructions="You answer questions about the weather and the time.",
        tools=[get_weather, get_time], model=OpenAIResponsesModel("tooled", client),
        model_settings=settings,
    )  # fmt: skip
    return agent, client


def _check(result: RunResult | RunResultStreaming, ran: list[tuple[str, str]]) -> None:
    """One call, run once; its output; then the answer the run ended with."""
    kinds = [type(i) for i in result.new_items]
    assert kinds == [ToolCallItem, ToolCallOutputItem, MessageOutputItem], result.new_items
    assert len(ran) == 1 and ran[0][0] in ("get_weather", "get_time")
    call, output = result.new_items[0], result.new_items[1]
    assert isinstance(call, ToolCallItem) and isinstance(output, ToolCallOutputItem)
    assert getattr(call.raw_item, "name", None) == ran[0][0]
    assert ran[0][1] in str(output.output)
    assert isinstance(result.final_output, str) and result.final_output
    assert len(result.raw_responses) == 2


def _only_the_server(seen: list[Any], server: Server) -> None:
    assert seen  # (the check saw the connections: it can fail)
    assert {tuple(a[:2]) for a in seen} == {("127.0.0.1", server.port)}, seen


def test_an_agent_calls_a_tool_then_answers(tooled: Server, offline: list[Any]) -> None:
    ran: list[tuple[str, str]] = []

    async def main() -> RunResult:
        agent, client = _agent(tooled, ran)
        async with client:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=4)

    _check(asyncio.run(main()), ran)
    _only_the_server(offline, tooled)


def test_an_agent_run_streamed(tooled: Server, offline: list[Any]) -> None:
    """The same run over the streaming API: the SDK reads the server's typed events."""
    ran: list[tuple[str, str]] = []

    async def main() -> tuple[RunResultStreaming, list[str]]:
        agent, client = _agent(tooled, ran)
        async with client:
            result = Runner.run_streamed(agent, "What time is it in UTC?", max_turns=4)
            raw = [e.data.type async for e in result.stream_events()
                   if e.type == "raw_response_event"]  # fmt: skip
            return result, raw

    result, raw = asyncio.run(main())
    _check(result, ran)
    assert raw.count("response.completed") == 2
    assert "response.function_call_arguments.done" in raw
    assert "response.output_text.delta" in raw
    _only_the_server(offline, tooled)
