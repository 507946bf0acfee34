"""OpenAI's legacy /v1/completions as a codec: its body into the internal request, the
generation's text back into `text_completion` chunks or one body.

Raw prompts, no chat template: a string, strings (each its own set of `n` choices), or one
prompt's token ids. `echo` starts each choice's text with its prompt's, and with
`logprobs` also gives the prompt's own tokens' logprobs (lm-evaluation-harness and
perplexity tools read them), as vLLM and OpenAI's legacy API do; vLLM's
`return_tokens_as_token_ids` names tokens "token_id:<id>" in logprobs.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

from api.pipeline.generation import Generation, ended_badly
from api.pipeline.output_blocks import ChoiceAnswer, text_of
from api.pipeline.request import GenerationRequest, Logprobs, Prompts
from api.pipeline.validation import check_model, refuse
from api.protocols.openai.schemas import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
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

DEFAULT_MAX_TOKENS = 16  # OpenAI's, for this endpoint


class CompletionCodec:
    """One completion request's body, and its response's encoding."""

    def __init__(self, state: ServerState, body: CompletionRequest) -> None:
        self.state = state
        self.req = body
        self.stream = body.stream
        self._echo: list[str] | None = None

    def decode(self) -> GenerationRequest:
        req, state = self.req, self.state
        check_model(state, req.model)
        refuse_constrained(req)
        if req.best_of not in (None, 1, req.n):
            raise refuse("best_of", "best-of sampling; ask for `n` choices instead")
        # echo + logprobs: the prompt's own logprobs too (lm-evaluation-harness, perplexity)
        scores = req.echo and req.logprobs is not None
        if scores and not state.settings.engine.prompt_logprob_rows:
            raise InvalidRequest(
                "the prompt's own logprobs (echo with logprobs) are off on this server "
                "(--prompt-logprob-rows 0)", param="echo",
            )  # fmt: skip
        if req.max_tokens == 0 and not req.echo:
            raise InvalidRequest("max_tokens must be at least 1 (0 only with echo)",
                                 param="max_tokens")  # fmt: skip
        if req.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        return GenerationRequest(
            id=f"cmpl-{uuid.uuid4().hex}",
            input=Prompts(req.prompt),
            sampling=sampling(req),
            max_tokens=DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens,
            stop=stops(req.stop),
            n=req.n,
            response_format=response_format(req),
            lane=req.strata_reproducible,
            logprobs=Logprobs(
                sampled=req.logprobs is not None,
                top=req.logprobs or 0,
                prompt=req.logprobs if scores else None,
            ),
            cache_prompt=req.cache_prompt,
        )

    async def frames(self, gen: Generation) -> AsyncIterator[bytes]:
        req, state = self.req, self.state
        rid, created, fp = gen.request.id, int(time.time()), state.fingerprints[gen.lane]
        offsets = [0] * gen.request.sequences
        started: set[int] = set()
        completion_tokens = cached = 0
        async for d in gen.events():
            if (err := ended_badly(d.finish_reason)) is not None:
                yield error_frame(err)
                yield DONE
                return
            i, text = d.choice, text_of(d.blocks)
            lp = self._logprobs(gen, i, d.logprobs, d.prompt_logprobs, offsets[i])
            offsets[i] += len(text)
            if d.finish_reason is not None:
                completion_tokens += d.output_tokens
                cached += d.cached_tokens
            if i not in started:
                text = self._echoed(gen, i) + text
                started.add(i)
            if text or d.finish_reason is not None or lp is not None:
                choice = CompletionChoice(i, text, d.finish_reason, lp)
                yield frame(Completion(rid, created, req.model, [choice], fp))
        if include_usage(req):
            use = usage(self._n_prompt(gen), completion_tokens, cached)
            yield frame(Completion(rid, created, req.model, [], fp, usage=use))
        yield DONE

    def body(self, gen: Generation, answers: list[ChoiceAnswer]) -> Completion:
        choices = [
            CompletionChoice(
                a.choice,
                self._echoed(gen, a.choice) + text_of(a.blocks),
                a.finish_reason,
                self._logprobs(gen, a.choice, a.logprobs, a.prompt_logprobs, 0),
            )
            for a in answers
        ]
        spent = sum(a.output_tokens for a in answers)
        cached = sum(a.cached_tokens for a in answers)
        return Completion(
            gen.request.id, int(time.time()), self.req.model, choices,
            self.state.fingerprints[gen.lane], usage=usage(self._n_prompt(gen), spent, cached),
        )  # fmt: skip

    def _n_prompt(self, gen: Generation) -> int:
        return sum(len(p.ids) for p in gen.prompts) * self.req.n

    def _echoed(self, gen: Generation, i: int) -> str:
        """What choice i's text starts with: its prompt's, with echo (vLLM and OpenAI's
        legacy API), as text (token ids rendered as the model writes them)."""
        if not self.req.echo:
            return ""
        if self._echo is None:
            self._echo = _echo_texts(self.state, self.req.prompt)
        return self._echo[i // self.req.n]

    def _logprobs(
        self, gen: Generation, i: int, items: list[Sampled], scored: list[Sampled] | None,
        offset: int,
    ) -> CompletionLogprobs | None:  # fmt: skip
        """Choice i's logprobs: its prompt's first (echo + logprobs, on its first output),
        then its tokens', offsets counted from the start of the text it returns."""
        if self.req.logprobs is None:
            return None
        name = _namer(self.state, self.req.return_tokens_as_token_ids)
        echoed = len(self._echoed(gen, i))
        if scored is None:
            out = CompletionLogprobs([], [], [], [])
            _add_logprobs(self.state, out, items, offset + echoed, name)
            return out
        out = _prompt_logprobs(self.state, gen.prompts[i // self.req.n].ids, scored, name)
        _add_logprobs(self.state, out, items, echoed, name)
        return out


def _echo_texts(state: ServerState, prompt: str | list[str | int]) -> list[str]:
    """Each prompt as text (token ids rendered as the model writes them)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        ids = [int(t) for t in prompt]
        return [b"".join(state.model.token_bytes(t) for t in ids).decode("utf-8", "replace")]
    return [str(p) for p in prompt]


def _namer(state: ServerState, as_ids: bool) -> Callable[[int], str]:
    """How logprobs name a token: its text, or "token_id:<id>" (vLLM's extension)."""
    if as_ids:
        return lambda tok: f"token_id:{tok}"
    return lambda tok: token_str(state, tok)[0]


def _add_logprobs(
    state: ServerState, out: CompletionLogprobs, items: list[Sampled], offset: int,
    name: Callable[[int], str],
) -> None:  # fmt: skip
    for s in items:
        text, _ = token_str(state, s.token)
        out.tokens.append(name(s.token))
        out.token_logprobs.append(s.logprob or 0.0)
        out.top_logprobs.append({name(t): lp for t, lp in s.top_logprobs or []})
        out.text_offset.append(offset)
        offset += len(text)


def _prompt_logprobs(
    state: ServerState, ids: list[int], scored: list[Sampled], name: Callable[[int], str]
) -> CompletionLogprobs:
    """Echo + logprobs: the prompt's tokens with their logprobs (the first has none),
    offsets into the echoed text (special tokens take no room in it)."""

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
