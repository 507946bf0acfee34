"""OpenAI's Responses API (`POST /v1/responses`) as a codec: its body into the internal
request (api.protocols.openai.responses_input), the generation's blocks back into a
`response` object or its stream of typed events (api.protocols.openai.responses_stream).

Stateless by design: `store` is accepted and nothing is kept, so that any replica behind
a router can answer any request; a client sends the whole conversation as `input` each
time (what the OpenAI Agents SDK and Codex do with `store: false`), and what would need a
stored response (`previous_response_id`, `conversation`, item references) is a 400
naming it. One choice per request (the API has no `n`). The pipeline names refused
fields in chat's vocabulary; `api_names` renames them to this API's (`input[5]`,
`max_output_tokens`, `text.format`) on the way out.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

from api.pipeline.generation import Generation, ended_badly
from api.pipeline.output_blocks import ChoiceAnswer, reasoning_of
from api.pipeline.request import Chat, GenerationRequest, Sampling, Tools
from api.pipeline.validation import check_model
from api.protocols.openai.responses_input import (
    ToolsOffered,
    api_param,
    choice_of,
    functions_of,
    messages_of,
    refuse_unserved,
    response_format_of,
)
from api.protocols.openai.responses_stream import ItemStream, item_id, whole
from api.protocols.openai.responses_wire import (
    Completed,
    Created,
    EchoTool,
    ErrorEvent,
    Failed,
    Incomplete,
    IncompleteDetails,
    InProgress,
    InputTokensDetails,
    OutputItem,
    OutputTokensDetails,
    Response,
    ResponseError,
    ResponsesRequest,
    ResponseUsage,
    Status,
    TextConfig,
    TextFormat,
    sse,
)
from api.server.errors import APIError
from api.server.state import ServerState

LENGTH = "length"  # the finish reason of an answer cut at its token limit


class ResponsesCodec:
    """One Responses request's body, and its response's encoding."""

    def __init__(self, state: ServerState, body: ResponsesRequest) -> None:
        self.state = state
        self.req = body
        self.stream = body.stream
        self.created = int(time.time())
        self._origin: list[int | None] = []  # each message's input item (api_names)
        self._offered = ToolsOffered()  # the tools as the model sees them (decode)

    @contextmanager
    def api_names(self) -> Iterator[None]:
        """Refusals name this API's fields: a message by its input item, `max_tokens` as
        `max_output_tokens`, `response_format` as `text.format`."""
        try:
            yield
        except APIError as e:
            e.param = api_param(e.param, self._origin)
            raise

    def decode(self) -> GenerationRequest:
        req, state = self.req, self.state
        check_model(state, req.model)
        refuse_unserved(req)
        messages, self._origin = messages_of(req, state.settings.limits.max_messages)
        self._offered = functions_of(req.tools)
        return GenerationRequest(
            id=item_id("resp"),
            input=Chat(messages, instructions=req.instructions),
            sampling=_sampling(req),
            max_tokens=req.max_output_tokens,
            tools=Tools(
                self._offered.functions, choice_of(req.tool_choice), req.parallel_tool_calls
            ),
            response_format=response_format_of(req.text),
            lane=req.strata_reproducible,
            cache_prompt=req.cache_prompt,
        )

    def body(self, gen: Generation, answers: list[ChoiceAnswer]) -> Response:
        (a,) = answers
        cut = a.finish_reason == LENGTH
        output = whole(a.blocks, cut, self._offered.namespaced)
        use = self._usage(gen, a.output_tokens, a.cached_tokens, reasoning_of(a.blocks))
        return self._response(gen, "incomplete" if cut else "completed", output, use)

    async def frames(self, gen: Generation) -> AsyncIterator[bytes]:
        items = ItemStream(2, self._offered.namespaced)
        yield sse(Created(sequence_number=0, response=self._response(gen, "in_progress")))
        yield sse(InProgress(sequence_number=1, response=self._response(gen, "in_progress")))
        async for d in gen.events():
            if (err := ended_badly(d.finish_reason)) is not None:
                yield sse(ErrorEvent(sequence_number=items.next(), message=err.message,
                                     code=err.code, param=err.param))  # fmt: skip
                failed = self._response(gen, "failed", items.items)
                failed.error = ResponseError(code="server_error", message=err.message)
                yield sse(Failed(sequence_number=items.next(), response=failed))
                return
            for event in items.blocks(d.blocks):
                yield sse(event)
            if d.finish_reason is None:
                continue
            cut = d.finish_reason == LENGTH
            for event in items.finish(cut):
                yield sse(event)
            use = self._usage(gen, d.output_tokens, d.cached_tokens, items.reasoning_text)
            if cut:
                done = self._response(gen, "incomplete", items.items, use)
                yield sse(Incomplete(sequence_number=items.next(), response=done))
            else:
                done = self._response(gen, "completed", items.items, use)
                yield sse(Completed(sequence_number=items.next(), response=done))

    # ---- the response object --------------------------------------------------------
    def _response(
        self, gen: Generation, status: Status, output: list[OutputItem] | None = None,
        usage: ResponseUsage | None = None,
    ) -> Response:  # fmt: skip
        """The response object, echoing the request's settings as the API does."""
        req = self.req
        tools = [EchoTool(name=t.name or "", description=t.description,
                          parameters=t.parameters, strict=t.strict)
                 for t in req.tools or [] if t.type == "function"]  # fmt: skip
        return Response(
            id=gen.request.id,
            created_at=self.created,
            model=req.model,
            status=status,
            output=list(output or []),
            usage=usage,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls,
            temperature=req.temperature,
            top_p=req.top_p,
            tools=tools,
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            text=TextConfig(
                format=req.text.format if req.text and req.text.format else TextFormat(type="text"),
                verbosity=req.text.verbosity if req.text else None,
            ),
            reasoning=req.reasoning,
            truncation=req.truncation or "disabled",
            metadata=req.metadata or {},
            user=req.user,
            incomplete_details=IncompleteDetails() if status == "incomplete" else None,
            completed_at=int(time.time()) if status == "completed" else None,
        )

    def _usage(self, gen: Generation, output: int, cached: int, thought: str) -> ResponseUsage:
        """Token counts; the reasoning's by tokenizing its text again (the answer is split
        into reasoning and text as text; the tags are not counted)."""
        n_prompt = len(gen.prompts[0].ids)
        reasoning = 0
        if thought:
            ids = self.state.model.tokenize(thought, add_special=False, parse_special=False)
            reasoning = min(output, len(ids))
        return ResponseUsage(
            input_tokens=n_prompt,
            input_tokens_details=InputTokensDetails(cached_tokens=cached),
            output_tokens=output,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
            total_tokens=n_prompt + output,
        )


def _sampling(req: ResponsesRequest) -> Sampling:
    """The API's `temperature` and `top_p`, and the server's extensions (as on chat)."""
    return Sampling(
        temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty, seed=req.seed, logit_bias=req.logit_bias,
        min_tokens=req.min_tokens,
    )  # fmt: skip
