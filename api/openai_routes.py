"""The OpenAI routes: /v1/chat/completions, /v1/completions, /v1/models."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from api.answer import AnswerSplit, Parts
from api.auth import client_of
from api.body import read_json
from api.disconnect import EventStreamResponse, run_until_disconnect
from api.errors import (
    APIError,
    GenerationFailed,
    InvalidRequest,
    ModelNotFound,
    ServiceUnavailable,
)
from api.generation import (
    SHUTDOWN,
    Choice,
    Submission,
    context_limit,
    max_tokens_for,
    sampling_params,
    stop_strings,
)
from api.lanes import resolve_lane
from api.prompts import chat_prompt, completion_prompts
from api.schemas import (
    CHAT_DECODER,
    COMPLETION_DECODER,
    ENCODER,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatLogprobs,
    ChunkChoice,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Delta,
    ErrorBody,
    ErrorDetail,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseMessage,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from api.state import ServerState, server_state
from api.structured import request_tools, response_grammar, tool_grammar
from api.tool_calls import with_prompt
from api.validation import (
    chat_messages,
    chat_rendering,
    check_stops,
    logit_bias,
    min_tokens,
    refuse_unsupported,
)
from engine.step_types import Sampled

DONE = b"data: [DONE]\n\n"


def _json(obj: Any, status: int = 200) -> Response:
    return Response(ENCODER.encode(obj), status_code=status, media_type="application/json")


def _frame(obj: Any) -> bytes:
    return b"data: " + ENCODER.encode(obj) + b"\n\n"


def _check_serving(state: ServerState) -> None:
    if state.draining:
        raise ServiceUnavailable("the server is shutting down; retry on another instance")


def _check_model(state: ServerState, name: str) -> None:
    if name not in state.aliases:
        raise ModelNotFound(f"The model `{name}` does not exist; this server serves "
                            f"`{state.model_name}`.", param="model")  # fmt: skip


def _usage(choices_prompt: int, completion: int, cached: int) -> Usage:
    """`cached`: prompt tokens read from the prefix cache instead of computed, counted
    like `choices_prompt` (chat counts its one prompt once: the choices share it)."""
    return Usage(
        choices_prompt, completion, choices_prompt + completion, PromptTokensDetails(cached)
    )


# ---- logprobs -----------------------------------------------------------------------
def _token_str(state: ServerState, tok: int) -> tuple[str, list[int]]:
    raw = state.model.token_text(tok)
    return raw.decode("utf-8", "replace"), list(raw)


def _chat_logprobs(state: ServerState, items: list[Sampled]) -> ChatLogprobs:
    content = []
    for s in items:
        text, raw = _token_str(state, s.token)
        top = []
        for t, lp in s.top_logprobs or []:
            ttext, traw = _token_str(state, t)
            top.append(TopLogprob(ttext, lp, traw))
        content.append(TokenLogprob(text, s.logprob or 0.0, raw, top))
    return ChatLogprobs(content)


def _namer(state: ServerState, as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or "token_id:<id>" (vLLM's extension)."""
    if as_ids:
        return lambda tok: f"token_id:{tok}"
    return lambda tok: _token_str(state, tok)[0]


def _completion_logprobs(
    state: ServerState, items: list[Sampled], offset: int, as_ids: bool = False
) -> CompletionLogprobs:
    out = CompletionLogprobs([], [], [], [])
    _add_logprobs(state, out, items, offset, _namer(state, as_ids))
    return out


def _add_logprobs(
    state: ServerState, out: CompletionLogprobs, items: list[Sampled], offset: int,
    name: Callable[[int], str],
) -> None:  # fmt: skip
    for s in items:
        text, _ = _token_str(state, s.token)
        out.tokens.append(name(s.token))
        out.token_logprobs.append(s.logprob or 0.0)
        out.top_logprobs.append({name(t): lp for t, lp in s.top_logprobs or []})
        out.text_offset.append(offset)
        offset += len(text)


def _prompt_logprobs(
    state: ServerState, ids: list[int], scored: list[Sampled], as_ids: bool
) -> CompletionLogprobs:
    """Echo + logprobs: the prompt's tokens with their logprobs (the first has none),
    offsets into the echoed text (special tokens take no room in it)."""
    name = _namer(state, as_ids)

    def width(tok: int) -> int:
        return len(state.model.token_bytes(tok).decode("utf-8", "replace"))

    out = CompletionLogprobs([name(ids[0])], [None], [None], [0])
    offset = width(ids[0])
    for s in scored:
        out.tokens.append(name(s.token))
        out.token_logprobs.append(s.logprob)
        out.top_logprobs.append({name(t): lp for t, lp in s.top_logprobs or []})
        out.text_offset.append(offset)
        offset += width(s.token)
    return out


# ---- shared plumbing ----------------------------------------------------------------
def _error_frame(err: APIError) -> bytes:
    return _frame(ErrorBody(ErrorDetail(err.message, err.type, err.param, err.code)))


def _stopped() -> ServiceUnavailable:
    return ServiceUnavailable("the server shut down before this request finished; retry")


def _ended_badly(finish_reason: str | None) -> APIError | None:
    """The error a stream ends with instead of a finish (then `[DONE]`), if any."""
    if finish_reason == SHUTDOWN:
        return _stopped()
    if finish_reason == "error":
        return GenerationFailed("generation failed in the backend")
    return None


async def _respond(
    request: Request,
    sub: Submission,
    stream: bool,
    frames: Callable[[], AsyncIterator[bytes]],
    body: Callable[[list[Choice]], Any],
) -> Response:
    """Stream SSE frames, or collect every choice into one body; abort on disconnect."""
    if stream:
        return EventStreamResponse(frames(), on_close=sub.abort)
    result: list[Choice] = []

    async def work() -> None:
        result.extend(await sub.collect())

    try:
        done = await run_until_disconnect(request.receive, work)
    finally:
        sub.abort()
    if not done:  # the client left; nobody reads this
        return Response(status_code=499)
    if any(c.finish_reason == SHUTDOWN for c in result):
        raise _stopped()
    if any(c.finish_reason == "error" for c in result):
        raise GenerationFailed("generation failed in the backend; see the server log")
    return _json(body(result))


# ---- routes -------------------------------------------------------------------------
async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    _check_serving(state)
    req: ChatCompletionRequest = await read_json(request, CHAT_DECODER, state.settings.limits)
    _check_model(state, req.model)
    refuse_unsupported(req)
    messages = chat_messages(req.messages, state.settings.limits.max_messages)
    if req.top_logprobs and not req.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs=true", param="top_logprobs")
    stops = stop_strings(req.stop)
    check_stops(stops)
    lane = resolve_lane(req.strata_reproducible, state.settings.lanes)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    sub = Submission(state, rid, lane, client_of(request.scope))
    with sub.admission(req.n):
        tools = request_tools(state, req, messages)
        if tools.prompt is not None:  # the template would drop them: the system message says
            messages = with_prompt(messages, tools.prompt)
        grammar = await response_grammar(state, req.response_format)
        trigger = None
        if tools.grammar is not None and grammar is not None and tools.trigger is None:
            raise InvalidRequest(
                "a required or named tool_choice cannot be combined with a response_format",
                param="tool_choice",
            )
        if tools.grammar is not None and grammar is None:  # (auto beside a format: the format)
            try:
                grammar, trigger = await tool_grammar(state, tools.grammar), tools.trigger
            except InvalidRequest:
                if tools.trigger is None:
                    raise
                # auto with a schema the grammar engine cannot take: parsed, not held
                grammar = None
        template = chat_rendering(state, req, messages, tools.render)
        prompt = await chat_prompt(state, messages, context_limit(state, lane), template)
        ids = prompt.ids
        asked = req.max_completion_tokens or req.max_tokens
        max_tokens = max_tokens_for(state, len(ids), asked, lane)
        bias, least = logit_bias(req, state.model.n_vocab), min_tokens(req, asked)
        for i in range(req.n):
            params = sampling_params(
                req, logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0, seed_offset=i,
                grammar=grammar, logit_bias=bias, min_tokens=least, grammar_trigger=trigger,
            )  # fmt: skip
            sub.add(
                ids, params, max_tokens, stops, ignore_eos=req.ignore_eos,
                cache_prompt=req.cache_prompt, offer_at=prompt.system_end,
            )  # fmt: skip
        sub.submit()
    fp = state.fingerprints[lane]
    created = int(time.time())
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> bytes:
        return _frame(
            ChatCompletionChunk(
                rid, created, req.model, choices, system_fingerprint=fp, usage=usage
            )
        )

    tail = prompt_tail(state, ids) if state.reasoning else None

    def split() -> AnswerSplit:
        fmt = state.tool_format if tools.parse else None
        return AnswerSplit(tail, fmt, one_call=not req.parallel_tool_calls)

    async def frames() -> AsyncIterator[bytes]:
        yield chunk([ChunkChoice(i, Delta(role="assistant", content="")) for i in range(req.n)])
        completion_tokens = 0
        cached = len(ids)  # the least any choice read: the prompt is counted once
        splits = [split() for _ in range(req.n)]
        async for i, o in sub.outputs():
            if (err := _ended_badly(o.finish_reason)) is not None:
                yield _error_frame(err)
                yield DONE
                return
            lp = _chat_logprobs(state, o.logprobs) if o.logprobs else None
            parts, reason = splits[i].feed(o.text), o.finish_reason
            if reason is not None:
                more, reason = splits[i].finish(reason)
                parts.reasoning += more.reasoning
                parts.content += more.content
                parts.calls += more.calls
            if parts.content or parts.reasoning or parts.calls or lp is not None:
                yield chunk([ChunkChoice(i, _delta(parts, splits[i]), None, lp)])
            if reason is not None:
                completion_tokens += o.num_output_tokens
                cached = min(cached, o.num_cached_tokens)
                yield chunk([ChunkChoice(i, Delta(), reason)])
        if include_usage:
            yield chunk([], _usage(len(ids), completion_tokens, cached))
        yield DONE

    def body(choices: list[Choice]) -> ChatCompletion:
        out = []
        for i, c in enumerate(choices):
            whole = split()
            whole.feed("".join(c.text))
            _, reason = whole.finish(c.finish_reason)
            lp = _chat_logprobs(state, c.logprobs) if req.logprobs else None
            out.append(ChatChoice(i, _message(whole, tail is not None), reason, lp))
        gen = sum(c.num_output_tokens for c in choices)
        cached = min(c.num_cached_tokens for c in choices)
        return ChatCompletion(rid, created, req.model, out, _usage(len(ids), gen, cached), fp)

    return await _respond(request, sub, req.stream, frames, body)


def _message(split: AnswerSplit, reasoning: bool) -> ResponseMessage:
    """The assistant message of a whole answer."""
    parts = split.all
    msg = ResponseMessage(parts.content or (None if parts.calls else ""))
    if reasoning:
        msg.reasoning_content = parts.reasoning
    if parts.calls:
        msg.tool_calls = [
            ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in parts.calls
        ]
    return msg


def _delta(parts: Parts, split: AnswerSplit) -> Delta:
    """A streamed piece: reasoning, content, and each call made whole in it (OpenAI's
    stream sends a call's id and name, then its arguments; one delta with all of them is
    what a client that accumulates deltas reads the same way)."""
    first = len(split.all.calls) - len(parts.calls)
    return Delta(
        content=parts.content if parts.content or not (parts.reasoning or parts.calls) else None,
        reasoning_content=parts.reasoning or None,
        tool_calls=[
            ToolCallDelta(
                index=first + k, id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)
            )
            for k, c in enumerate(parts.calls)
        ]
        or None,
    )


def _echo_texts(state: ServerState, prompt: str | list[str | int]) -> list[str]:
    """Each prompt as text (token ids rendered as the model writes them)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        ids = [int(t) for t in prompt]
        return [b"".join(state.model.token_bytes(t) for t in ids).decode("utf-8", "replace")]
    return [str(p) for p in prompt]


def prompt_tail(state: ServerState, ids: list[int]) -> str:
    """The end of a prompt as text, special tokens by name: did the template open a
    reasoning block?"""
    return b"".join(state.model.token_text(t) for t in ids[-16:]).decode("utf-8", "replace")


async def completions(request: Request) -> Response:
    state = server_state(request)
    _check_serving(state)
    req: CompletionRequest = await read_json(request, COMPLETION_DECODER, state.settings.limits)
    _check_model(state, req.model)
    refuse_unsupported(req)
    # echo + logprobs: the prompt's own logprobs too (lm-evaluation-harness, perplexity)
    scores = req.echo and req.logprobs is not None
    if scores and not state.settings.engine.prompt_logprob_rows:
        raise InvalidRequest(
            "the prompt's own logprobs (echo with logprobs) are off on this server "
            "(--prompt-logprob-rows 0)", param="echo",
        )  # fmt: skip
    if req.max_tokens == 0 and not req.echo:
        raise InvalidRequest("max_tokens must be at least 1 (0 only with echo)", param="max_tokens")
    asked = 16 if req.max_tokens is None else req.max_tokens
    if req.suffix:
        raise InvalidRequest("suffix is not supported", param="suffix")
    stops = stop_strings(req.stop)
    check_stops(stops)
    lane = resolve_lane(req.strata_reproducible, state.settings.lanes)
    n_prompts = (
        1 if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else len(req.prompt)
    )
    want_lp = req.logprobs is not None
    as_ids = req.return_tokens_as_token_ids
    rid = f"cmpl-{uuid.uuid4().hex}"
    sub = Submission(state, rid, lane, client_of(request.scope))
    with sub.admission(n_prompts * req.n, "prompt" if n_prompts > 1 else "n"):
        grammar = await response_grammar(state, req.response_format)
        prompts = await completion_prompts(state, req.prompt, context_limit(state, lane))
        limits = [max_tokens_for(state, len(p), asked, lane) for p in prompts]
        bias, least = logit_bias(req, state.model.n_vocab), min_tokens(req, asked)
        for ids, max_tokens in zip(prompts, limits, strict=True):
            for i in range(req.n):
                params = sampling_params(
                    req, logprobs=want_lp, top_logprobs=req.logprobs or 0, seed_offset=i,
                    grammar=grammar, logit_bias=bias, min_tokens=least,
                    prompt_logprobs=req.logprobs if scores else None,
                )  # fmt: skip
                sub.add(
                    ids, params, max_tokens, stops, ignore_eos=req.ignore_eos,
                    cache_prompt=req.cache_prompt,
                )  # fmt: skip
        sub.submit()
    fp = state.fingerprints[lane]
    created = int(time.time())
    n_prompt = sum(len(p) for p in prompts) * req.n
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    # echo: each choice's text starts with its prompt's (vLLM and OpenAI's legacy API)
    echo = _echo_texts(state, req.prompt) if req.echo else None

    def echoed(i: int) -> str:
        return echo[i // req.n] if echo is not None else ""

    def logprobs(
        i: int, items: list[Sampled], scored: list[Sampled] | None, offset: int
    ) -> CompletionLogprobs | None:
        """Choice i's logprobs: its prompt's first (echo + logprobs, on its first output),
        then its tokens', offsets counted from the start of the text it returns."""
        if not want_lp:
            return None
        if scored is None:
            return _completion_logprobs(state, items, offset + len(echoed(i)), as_ids)
        out = _prompt_logprobs(state, prompts[i // req.n], scored, as_ids)
        _add_logprobs(state, out, items, len(echoed(i)), _namer(state, as_ids))
        return out

    async def frames() -> AsyncIterator[bytes]:
        offsets = [0] * len(sub.queues)
        started: set[int] = set()
        completion_tokens = cached = 0
        async for i, o in sub.outputs():
            if (err := _ended_badly(o.finish_reason)) is not None:
                yield _error_frame(err)
                yield DONE
                return
            lp = logprobs(i, o.logprobs, o.prompt_logprobs, offsets[i])
            offsets[i] += len(o.text)
            if o.finish_reason is not None:
                completion_tokens += o.num_output_tokens
                cached += o.num_cached_tokens
            text = o.text if i in started else echoed(i) + o.text
            started.add(i)
            if text or o.finish_reason is not None or lp is not None:
                choice = CompletionChoice(i, text, o.finish_reason, lp)
                yield _frame(Completion(rid, created, req.model, [choice], fp))
        if include_usage:
            yield _frame(
                Completion(
                    rid,
                    created,
                    req.model,
                    [],
                    fp,
                    usage=_usage(n_prompt, completion_tokens, cached),
                )
            )
        yield DONE

    def body(choices: list[Choice]) -> Completion:
        out = [
            CompletionChoice(
                i,
                echoed(i) + "".join(c.text),
                c.finish_reason,
                logprobs(i, c.logprobs, c.prompt_logprobs, 0),
            )
            for i, c in enumerate(choices)
        ]
        gen = sum(c.num_output_tokens for c in choices)
        cached = sum(c.num_cached_tokens for c in choices)
        return Completion(rid, created, req.model, out, fp, usage=_usage(n_prompt, gen, cached))

    return await _respond(request, sub, req.stream, frames, body)


async def list_models(request: Request) -> Response:
    state = server_state(request)
    cards = [ModelCard(name, state.created, max_model_len=state.max_model_len)
             for name in sorted(state.aliases)]  # fmt: skip
    return _json(ModelList(cards))
