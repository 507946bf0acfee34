"""From a validated OpenAI request to scheduler requests, and their outputs back.

Shared by both endpoints: sampling parameters, the context-length check, submission of
one scheduler request per choice, and merging the choices' output streams.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from api.errors import ContextLengthExceeded, InvalidRequest, ServerBusy, ServiceUnavailable
from api.lanes import FAST, REPRODUCIBLE, check_reproducible
from api.schemas import SamplingFields
from api.state import ServerState
from engine.detok import IncrementalDetokenizer
from engine.step_types import Sampled, SamplingParams
from scheduler.core import QueueFull
from scheduler.request import SHUTDOWN as SHUTDOWN
from scheduler.request import Request, RequestOutput
from scheduler.stops import StopMatcher


def _never(_token: int) -> bool:
    return False


def sampling_params(
    req: SamplingFields, *, logprobs: bool, top_logprobs: int, seed_offset: int = 0,
    grammar: str | None = None, logit_bias: tuple[tuple[int, float], ...] = (),
    min_tokens: int = 0, prompt_logprobs: int | None = None, grammar_trigger: int | None = None,
) -> SamplingParams:  # fmt: skip
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        seed=None if req.seed is None else req.seed + seed_offset,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        grammar=grammar,
        logit_bias=logit_bias,
        min_tokens=min_tokens,
        prompt_logprobs=prompt_logprobs,
        grammar_trigger=grammar_trigger,
    )


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stops) > 16:
        raise InvalidRequest("at most 16 stop strings", param="stop")
    return stops


def context_limit(state: ServerState, lane: str) -> int:
    """Most tokens of prompt + completion in `lane`."""
    return state.repro_max_len if lane == REPRODUCIBLE else state.max_model_len


def max_tokens_for(state: ServerState, n_prompt: int, asked: int | None, lane: str = FAST) -> int:
    """Resolve max_tokens against the lane's context; 400 when prompt + max_tokens cannot fit."""
    limit = context_limit(state, lane)
    if n_prompt == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if asked is None:
        if n_prompt >= limit:
            raise _too_long(n_prompt, 1, limit)
        return limit - n_prompt
    if n_prompt + asked > limit:
        raise _too_long(n_prompt, asked, limit)
    return asked


def _too_long(n_prompt: int, asked: int, limit: int) -> ContextLengthExceeded:
    return ContextLengthExceeded(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{n_prompt + asked} tokens ({n_prompt} in the prompt, {asked} for the completion). "
        "Please reduce the prompt or max_tokens.",
        param="max_tokens",
    )


@dataclass(slots=True)
class Choice:
    """One choice's accumulated output (non-streaming responses)."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Sampled] = field(default_factory=list)
    prompt_logprobs: list[Sampled] | None = None  # echo + logprobs: the prompt's own
    finish_reason: str = "stop"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, o: RequestOutput) -> None:
        self.text.append(o.text)
        self.token_ids.extend(o.token_ids)
        self.logprobs.extend(o.logprobs)
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        self.num_prompt_tokens = o.num_prompt_tokens
        self.num_output_tokens = o.num_output_tokens
        self.num_cached_tokens = o.num_cached_tokens
        if o.finish_reason is not None:
            self.finish_reason = o.finish_reason


class Submission:
    """The scheduler requests of one API call (one per prompt and choice) and their
    streams, queued together or not at all."""

    def __init__(self, state: ServerState, base_id: str, lane: str, client: str) -> None:
        self.state = state
        self.base_id = base_id
        self.lane = lane
        self.client = client
        self.pending: list[Request] = []
        self.req_ids: list[str] = []
        self.queues: list[asyncio.Queue[RequestOutput]] = []

    def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        stops: tuple[str, ...],
        *,
        ignore_eos: bool = False,
        cache_prompt: bool = True,
        offer_at: int = 0,
    ) -> None:
        """One sequence to generate. `offer_at`: a point of the prompt to offer to the
        prefix cache on the way (a chat's system block end, see `scheduler.core`)."""
        if self.lane == REPRODUCIBLE:
            check_reproducible(params)  # refused, never served in another lane
        model = self.state.model
        self.pending.append(
            Request(
                req_id=f"{self.base_id}-{len(self.pending)}",
                prompt_ids=prompt_ids,
                params=params,
                max_tokens=max_tokens,
                arrival_time=time.monotonic(),
                detok=IncrementalDetokenizer(model.token_bytes),
                stops=StopMatcher(stops),
                is_eog=_never if ignore_eos else model.is_eog,
                client=self.client,
                cache_prompt=cache_prompt,
                offer_at=offer_at,
            )
        )

    @contextmanager
    def admission(self, n_sequences: int, param: str = "n") -> Iterator[None]:
        """Before any work: a request whose prompts × choices exceed what one client may
        ever queue is a 400 (retrying could never help); one that does not fit the queue,
        or its client's share of it, now is a 429. Then, while the prompt is tokenized, its
        sequences count against the client's share as if they waited: a client cannot
        keep the prompt workers busy with requests the queue would refuse."""
        state, key = self.state, (self.lane, self.client)
        most = state.loop.max_group(self.lane)
        if n_sequences > most:
            raise InvalidRequest(
                f"this request needs {n_sequences} sequences (prompts × n); one request may "
                f"queue at most {most} (half of --max-waiting)",
                param=param,
            )
        try:
            state.loop.check_room(self.client, n_sequences + state.preparing[key], self.lane)
        except QueueFull as e:
            raise ServerBusy(f"server busy: {e}; retry shortly", retry_after_s=1) from e
        state.preparing[key] += n_sequences
        try:
            yield
        finally:
            state.preparing[key] -= n_sequences
            if not state.preparing[key]:
                del state.preparing[key]

    def submit(self) -> None:
        """Queue every sequence, or none (429: the queue or this client's share is full;
        503: the server began to drain while this request was read or tokenized)."""
        if self.state.draining:
            raise ServiceUnavailable("the server is shutting down; retry on another instance")
        try:
            self.queues = self.state.loop.add_group(self.pending, self.lane)
        except QueueFull as e:
            raise ServerBusy(f"server busy: {e}; retry shortly", retry_after_s=1) from e
        self.req_ids = [r.req_id for r in self.pending]
        self.state.metrics.lane_requests.labels(lane=self.lane).inc()

    def abort(self) -> None:
        """Abort whatever has not finished (no-op for finished requests)."""
        for rid in self.req_ids:
            self.state.loop.abort(rid)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) as they come, until every choice has finished."""
        if len(self.queues) == 1:
            q = self.queues[0]
            while True:
                o = await q.get()
                yield 0, o
                if o.finish_reason is not None:
                    return
        pending = {asyncio.ensure_future(q.get()): i for i, q in enumerate(self.queues)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=lambda f: pending[f]):
                    i = pending.pop(fut)
                    o = fut.result()
                    yield i, o
                    if o.finish_reason is None:
                        pending[asyncio.ensure_future(self.queues[i].get())] = i
        finally:
            for fut in pending:
                fut.cancel()

    async def collect(self) -> list[Choice]:
        choices = [Choice() for _ in self.queues]
        async for i, o in self.outputs():
            choices[i].add(o)
        return choices
