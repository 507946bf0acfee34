"""A submitted generation: its sequences' outputs as each choice's blocks, streamed or whole.

The pipeline (api.pipeline.prepare) hands it to the route with every sequence queued; the route's
codec reads `events()` (a stream) or `answers()` (a body) and the route aborts it when its
client is gone. A chat's reasoning and tool calls are split out here, once for every API
(api.pipeline.answer), so a codec only encodes blocks (api.pipeline.output_blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from api.pipeline.answer import AnswerSplit, BlockNumbers
from api.pipeline.output_blocks import ChoiceAnswer, ChoiceDelta
from api.pipeline.prompts import Prompt
from api.pipeline.request import Chat, GenerationRequest
from api.pipeline.tool_calls import ToolSetup
from api.server.errors import APIError, GenerationFailed, ServiceUnavailable
from api.server.state import ServerState
from engine.step_types import Sampled
from scheduler.request import SHUTDOWN, RequestOutput


class Generation:
    """One request's queued sequences (prompt p's choice c is p * n + c) and how each
    choice's text is split: `reasoning_tail`, the end of a chat's prompt when reasoning is
    split off (api.pipeline.reasoning reads whether the template opened the block); `tool_format`,
    when calls are parsed out of the answer."""

    def __init__(
        self, state: ServerState, req: GenerationRequest, lane: str, prompts: list[Prompt],
        tools: ToolSetup, req_ids: list[str], queues: list[asyncio.Queue[RequestOutput]],
    ) -> None:  # fmt: skip
        self.state = state
        self.request = req
        self.lane = lane
        self.prompts = prompts
        self._req_ids = req_ids
        self._queues = queues
        chat = isinstance(req.input, Chat)
        tail = prompt_tail(state, prompts[0].ids) if chat and state.reasoning else None
        self.reasoning_tail = tail
        self.tool_format = state.tool_format if tools.parse else None
        self._over: set[int] = set()  # choices ended here, before their sequence did
        # each choice's text into reasoning, content and calls, as it comes: a generation
        # is read once, streamed (`events`) or whole (`answers`)
        self._splits = [
            AnswerSplit(tail, self.tool_format, one_call=not req.tools.parallel) for _ in queues
        ]

    @property
    def splits_reasoning(self) -> bool:
        return self.reasoning_tail is not None

    def abort(self) -> None:
        """Abort whatever has not finished (no-op for finished sequences)."""
        for rid in self._req_ids:
            self.state.loop.abort(rid)

    async def events(self) -> AsyncIterator[ChoiceDelta]:
        """Each choice's pieces as they come, until every choice has finished."""
        splits = self._splits
        numbers = [BlockNumbers() for _ in self._queues]
        async for i, o in self._outputs():
            parts, reason = splits[i].feed(o.text), o.finish_reason
            reason = self._ended(i, splits[i], reason)
            if reason is not None:
                more, reason = splits[i].finish(reason)
                parts.reasoning += more.reasoning
                parts.content += more.content
                parts.calls += more.calls
            yield ChoiceDelta(
                i, numbers[i].blocks(parts), o.logprobs, o.prompt_logprobs, reason,
                o.num_output_tokens, o.num_cached_tokens, o.stop_string,
            )  # fmt: skip

    async def answers(self) -> list[ChoiceAnswer]:
        """Every choice's whole answer, once all have finished."""
        got = [_Collected() for _ in self._queues]
        splits = self._splits
        async for i, o in self._outputs():
            got[i].add(o)
            splits[i].feed(o.text)
            if (reason := self._ended(i, splits[i], o.finish_reason)) is not None:
                got[i].finish_reason = reason
        out = []
        for i, c in enumerate(got):
            _, reason = splits[i].finish(c.finish_reason)
            blocks = BlockNumbers().blocks(splits[i].all)
            out.append(ChoiceAnswer(i, blocks, c.logprobs, c.prompt_logprobs, reason,
                                    c.num_output_tokens, c.num_cached_tokens,
                                    c.stop_string))  # fmt: skip
        return out

    def _ended(self, i: int, split: AnswerSplit, reason: str | None) -> str | None:
        """The choice's finish reason: its output's, or `stop` where its answer is over
        before its text is (`AnswerSplit.ended`): its sequence is stopped now and its
        stream read no further."""
        if reason is None and split.ended and i not in self._over:
            self._over.add(i)
            self.state.loop.end(self._req_ids[i])
            return "stop"
        return reason

    async def _outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice, output) as they come, until every choice has finished."""
        if len(self._queues) == 1:
            q = self._queues[0]
            while True:
                o = await q.get()
                yield 0, o
                if o.finish_reason is not None or self._over:
                    return
        pending = {asyncio.ensure_future(q.get()): i for i, q in enumerate(self._queues)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=lambda f: pending[f]):
                    i = pending.pop(fut)
                    o = fut.result()
                    yield i, o
                    if o.finish_reason is None and i not in self._over:
                        pending[asyncio.ensure_future(self._queues[i].get())] = i
        finally:
            for fut in pending:
                fut.cancel()


def prompt_tail(state: ServerState, ids: list[int]) -> str:
    """The end of a prompt as text, special tokens by name: did the template open a
    reasoning block?"""
    return b"".join(state.model.token_text(t) for t in ids[-16:]).decode("utf-8", "replace")


def stopped() -> ServiceUnavailable:
    return ServiceUnavailable("the server shut down before this request finished; retry")


def ended_badly(finish_reason: str | None) -> APIError | None:
    """The error a stream ends with instead of a finish, if any."""
    if finish_reason == SHUTDOWN:
        return stopped()
    if finish_reason == "error":
        return GenerationFailed("generation failed in the backend")
    return None


def failure(answers: list[ChoiceAnswer]) -> APIError | None:
    """The error a whole response is instead, if any choice did not finish."""
    if any(a.finish_reason == SHUTDOWN for a in answers):
        return stopped()
    if any(a.finish_reason == "error" for a in answers):
        return GenerationFailed("generation failed in the backend; see the server log")
    return None


@dataclass(slots=True)
class _Collected:
    """One choice's outputs so far (a response that is not streamed)."""

    text: list[str] = field(default_factory=list)
    logprobs: list[Sampled] = field(default_factory=list)
    prompt_logprobs: list[Sampled] | None = None  # echo + logprobs: the prompt's own
    finish_reason: str = "stop"
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    stop_string: str | None = None

    def add(self, o: RequestOutput) -> None:
        self.text.append(o.text)
        self.logprobs.extend(o.logprobs)
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        self.num_output_tokens = o.num_output_tokens
        self.num_cached_tokens = o.num_cached_tokens
        if o.finish_reason is not None:
            self.finish_reason = o.finish_reason
            self.stop_string = o.stop_string
