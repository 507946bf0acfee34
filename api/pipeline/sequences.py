"""A prepared request into the scheduler's sequences: one per prompt and choice.

Here the request's limits meet the lane's context (`max_tokens` resolved, or a 400 when
prompt and completion cannot fit), its sampling fields become the engine's
`SamplingParams` — a field it leaves unset takes the server's default (the model's own or
llama-server's, engine.sampling_defaults); choice i samples with `seed + i`, so choices
differ and each is reproducible — and the reproducible lane refuses what it could not
make reproducible rather than serve it another way.
"""

from __future__ import annotations

import time

from api.pipeline.lanes import FAST, REPRODUCIBLE, check_reproducible
from api.pipeline.prompts import Prompt
from api.pipeline.request import GenerationRequest, Logprobs, Sampling
from api.pipeline.structured import Constraint
from api.pipeline.validation import logit_bias, min_tokens
from api.server.errors import ContextLengthExceeded, InvalidRequest
from api.server.state import ServerState
from engine.detok import IncrementalDetokenizer
from engine.sampling_defaults import SamplingDefaults
from engine.step_types import SamplingParams
from scheduler.request import Request
from scheduler.stops import StopMatcher


def sequences(
    state: ServerState, req: GenerationRequest, prompts: list[Prompt], constraint: Constraint,
    lane: str, client: str,
) -> list[Request]:  # fmt: skip
    """Every sequence of the request, in order: prompt p's choice c is p * n + c."""
    limits = [max_tokens_for(state, len(p.ids), req.max_tokens, lane, req.cap_max_tokens)
              for p in prompts]  # fmt: skip
    s = req.sampling
    bias = logit_bias(s.logit_bias, state.model.n_vocab)
    least = min_tokens(s.min_tokens, req.max_tokens)
    model, out = state.model, list[Request]()
    for prompt, max_tokens in zip(prompts, limits, strict=True):
        for i in range(req.n):
            params = sampling_params(
                s, req.logprobs, seed_offset=i, grammar=constraint.grammar, logit_bias=bias,
                min_tokens=least, grammar_trigger=constraint.trigger,
                defaults=state.sampling_defaults,
            )  # fmt: skip
            if lane == REPRODUCIBLE:
                check_reproducible(params)  # refused, never served in another lane
            out.append(
                Request(
                    req_id=f"{req.id}-{len(out)}",
                    prompt_ids=prompt.ids,
                    params=params,
                    max_tokens=max_tokens,
                    arrival_time=time.monotonic(),
                    detok=IncrementalDetokenizer(model.token_bytes),
                    stops=StopMatcher(req.stop),
                    is_eog=_never if s.ignore_eos else model.is_eog,
                    client=client,
                    cache_prompt=req.cache_prompt,
                    offer_at=prompt.system_end,
                )
            )
    return out


def _never(_token: int) -> bool:
    return False


# the samplers' neutral values: what an unset field meant before the server had defaults
NEUTRAL = SamplingDefaults(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, sources=())


def sampling_params(
    s: Sampling, lp: Logprobs, *, seed_offset: int = 0, grammar: str | None = None,
    logit_bias: tuple[tuple[int, float], ...] = (), min_tokens: int = 0,
    grammar_trigger: int | None = None, defaults: SamplingDefaults | None = None,
) -> SamplingParams:  # fmt: skip
    """The engine's parameters: the request's fields where it set them, else `defaults`
    (None: the samplers' neutral values — temperature 1, no top-k, top-p or min-p)."""
    d = defaults or NEUTRAL
    return SamplingParams(
        temperature=d.temperature if s.temperature is None else s.temperature,
        top_p=d.top_p if s.top_p is None else s.top_p,
        top_k=d.top_k if s.top_k is None else s.top_k,
        min_p=d.min_p if s.min_p is None else s.min_p,
        presence_penalty=s.presence_penalty or 0.0,
        frequency_penalty=s.frequency_penalty or 0.0,
        repetition_penalty=(
            d.repetition_penalty if s.repetition_penalty is None else s.repetition_penalty
        ),
        seed=None if s.seed is None else s.seed + seed_offset,
        logprobs=lp.sampled,
        top_logprobs=lp.top,
        grammar=grammar,
        logit_bias=logit_bias,
        min_tokens=min_tokens,
        prompt_logprobs=lp.prompt,
        grammar_trigger=grammar_trigger,
    )


def max_tokens_for(
    state: ServerState, n_prompt: int, asked: int | None, lane: str = FAST, cap: bool = False
) -> int:
    """Resolve max_tokens against the lane's context; 400 when prompt + max_tokens cannot
    fit, unless `cap`: then as many as the context leaves, up to max_tokens."""
    limit = state.max_len(lane)
    if n_prompt == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if asked is None or (cap and n_prompt + asked > limit):
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
