"""OpenAI's /v1/chat/completions as a codec: its body into the internal request, the
generation's blocks back into `chat.completion` chunks or one body.

Decoding refuses by name (a 400) what the server does not serve — function calls by their
old name, audio, images and other non-text parts, predicted outputs — because a client that
sent them relies on them, and an answer that silently ignored them would look right and be
wrong; and turns OpenAI's messages into the template's roles ("developer" is its newer
name for system). Encoding merges each delta's blocks into one `delta`: reasoning in
`reasoning_content` (vLLM's and llama-server's field), text in `content`, each call whole
in `tool_calls` (OpenAI streams a call's id and name, then its arguments; one delta with
all of them reads the same to a client that accumulates deltas).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import msgspec

from api.pipeline.chat_messages import FunctionCall, ToolCall, chat_messages
from api.pipeline.generation import Generation, ended_badly
from api.pipeline.output_blocks import Block, ChoiceAnswer, calls_of, reasoning_of, text_of
from api.pipeline.request import (
    Chat,
    GenerationRequest,
    Logprobs,
    Tools,
)
from api.pipeline.tool_calls import Call
from api.pipeline.validation import asks_nothing, check_model, refuse
from api.protocols.openai.schemas import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChunkChoice,
    Delta,
    ResponseMessage,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from api.protocols.openai.wire import (
    DONE,
    error_frame,
    frame,
    include_usage,
    refuse_constrained,
    response_format,
    sampling,
    stops,
    token_str,
    usage,
)
from api.server.errors import InvalidRequest
from api.server.state import ServerState
from engine.step_types import Sampled


class ChatCodec:
    """One chat completion request's body, and its response's encoding."""

    def __init__(self, state: ServerState, body: ChatCompletionRequest) -> None:
        self.state = state
        self.req = body
        self.stream = body.stream

    def decode(self) -> GenerationRequest:
        req, state = self.req, self.state
        check_model(state, req.model)
        refuse_constrained(req)
        _refuse_chat_only(req)
        messages = chat_messages(req.messages, state.settings.limits.max_messages)
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
        return GenerationRequest(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            input=Chat(
                messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs or {},
            ),
            sampling=sampling(req),
            max_tokens=req.max_completion_tokens or req.max_tokens,
            stop=stops(req.stop),
            n=req.n,
            tools=Tools(
                [msgspec.to_builtins(t) for t in req.tools] if req.tools else None,
                req.tool_choice,
                req.parallel_tool_calls,
            ),
            response_format=response_format(req),
            lane=req.strata_reproducible,
            logprobs=Logprobs(sampled=req.logprobs, top=req.top_logprobs or 0),
            cache_prompt=req.cache_prompt,
        )

    async def frames(self, gen: Generation) -> AsyncIterator[bytes]:
        req, state = self.req, self.state
        rid, created, fp = gen.request.id, int(time.time()), state.fingerprints[gen.lane]
        n_prompt = len(gen.prompts[0].ids)

        def chunk(choices: list[ChunkChoice], use: Usage | None = None) -> bytes:
            return frame(
                ChatCompletionChunk(
                    rid, created, req.model, choices, system_fingerprint=fp, usage=use
                )
            )

        yield chunk([ChunkChoice(i, Delta(role="assistant", content="")) for i in range(req.n)])
        completion_tokens = 0
        cached = n_prompt  # the least any choice read: the prompt is counted once
        async for d in gen.events():
            if (err := ended_badly(d.finish_reason)) is not None:
                yield error_frame(err)
                yield DONE
                return
            lp = _logprobs(state, d.logprobs) if d.logprobs else None
            if d.blocks or lp is not None:
                yield chunk([ChunkChoice(d.choice, _delta(d.blocks), None, lp)])
            if d.finish_reason is not None:
                completion_tokens += d.output_tokens
                cached = min(cached, d.cached_tokens)
                yield chunk([ChunkChoice(d.choice, Delta(), d.finish_reason)])
        if include_usage(req):
            yield chunk([], usage(n_prompt, completion_tokens, cached))
        yield DONE

    def body(self, gen: Generation, answers: list[ChoiceAnswer]) -> ChatCompletion:
        req, state = self.req, self.state
        choices = [
            ChatChoice(
                a.choice,
                _message(a.blocks, gen.splits_reasoning),
                a.finish_reason,
                _logprobs(state, a.logprobs) if req.logprobs else None,
            )
            for a in answers
        ]
        spent = sum(a.output_tokens for a in answers)
        cached = min(a.cached_tokens for a in answers)
        return ChatCompletion(
            gen.request.id, int(time.time()), req.model, choices,
            usage(len(gen.prompts[0].ids), spent, cached), state.fingerprints[gen.lane],
        )  # fmt: skip


# ---- decoding -----------------------------------------------------------------------
def _refuse_chat_only(req: ChatCompletionRequest) -> None:
    if not asks_nothing(req.functions):
        raise refuse("functions", "function calls")
    if req.function_call not in (None, "none"):
        raise refuse("function_call", "function calls")
    if not asks_nothing(req.audio):
        raise refuse("audio", "audio output")
    if req.modalities not in (None, ["text"]):
        raise refuse("modalities", "only text is served")
    if not asks_nothing(req.prediction):
        raise refuse("prediction", "predicted outputs")


# ---- encoding -----------------------------------------------------------------------
def _logprobs(state: ServerState, items: list[Sampled]) -> ChatLogprobs:
    content = []
    for s in items:
        text, raw = token_str(state, s.token)
        top = []
        for t, lp in s.top_logprobs or []:
            ttext, traw = token_str(state, t)
            top.append(TopLogprob(ttext, lp, traw))
        content.append(TokenLogprob(text, s.logprob or 0.0, raw, top))
    return ChatLogprobs(content)


def _message(blocks: list[Block], reasoning: bool) -> ResponseMessage:
    """The assistant message of a whole answer (`reasoning`: the server splits it off)."""
    text, calls = text_of(blocks), calls_of(blocks)
    msg = ResponseMessage(text or (None if calls else ""))
    if reasoning:
        msg.reasoning_content = reasoning_of(blocks)
    if calls:
        msg.tool_calls = [ToolCall(id=c.call.id, function=_function(c.call)) for c in calls]
    return msg


def _delta(blocks: list[Block]) -> Delta:
    """A streamed piece: its reasoning, text and calls in one delta."""
    text, reasoning, calls = text_of(blocks), reasoning_of(blocks), calls_of(blocks)
    return Delta(
        content=text if text or not (reasoning or calls) else None,
        reasoning_content=reasoning or None,
        tool_calls=[
            ToolCallDelta(index=c.call_index, id=c.call.id, function=_function(c.call))
            for c in calls
        ]
        or None,
    )


def _function(call: Call) -> FunctionCall:
    return FunctionCall(name=call.name, arguments=call.arguments)
