"""What OpenAI's chat and completions codecs share on the wire: the fields both bodies
read the same way (the refusals of unserved fields, sampling, stops), and what
both write (server-sent event frames, usage, a token's text)."""

from __future__ import annotations

from typing import Any

from api.pipeline.request import Sampling
from api.pipeline.validation import asks_nothing, refuse
from api.protocols.openai.schemas import PromptTokensDetails, SamplingFields, Usage
from api.server.errors import APIError, InvalidRequest
from api.server.state import ServerState
from api.server.wire import ENCODER, ErrorBody, ErrorDetail

DONE = b"data: [DONE]\n\n"
CONSTRAINED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "grammar")


# ---- reading ------------------------------------------------------------------------
def refuse_constrained(body: SamplingFields) -> None:
    """A 400 naming the first of vLLM's and llama.cpp's constrained-output fields that
    asks for something: a client that sent one relies on it, and an answer that silently
    ignored it would look right and be wrong (`response_format` and llama-server's
    `json_schema` are served)."""
    for name in CONSTRAINED:
        if not asks_nothing(getattr(body, name)):
            raise refuse(name, "constrained output")


def response_format(body: SamplingFields) -> Any:
    """`response_format` as sent, or llama-server's top-level `json_schema` as the same
    thing (`{"type": "json_object", "schema": …}`, api.pipeline.structured); both at once: 400."""
    schema = body.json_schema
    if asks_nothing(schema):
        return body.response_format
    if not isinstance(schema, dict) and schema is not True:
        raise InvalidRequest("json_schema must be a JSON Schema object", param="json_schema")
    rf = body.response_format
    if not (rf is None or (isinstance(rf, dict) and rf.get("type") == "text")):
        raise InvalidRequest(
            "json_schema and response_format both ask for the output's format: send one",
            param="json_schema",
        )
    return {"type": "json_object", "schema": schema}


def sampling(body: SamplingFields) -> Sampling:
    return Sampling(
        temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
        presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty, seed=body.seed,
        logit_bias=body.logit_bias, min_tokens=body.min_tokens, ignore_eos=body.ignore_eos,
    )  # fmt: skip


def stops(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def include_usage(body: SamplingFields) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


# ---- writing ------------------------------------------------------------------------
def frame(obj: Any) -> bytes:
    return b"data: " + ENCODER.encode(obj) + b"\n\n"


def error_frame(err: APIError) -> bytes:
    return frame(ErrorBody(ErrorDetail(err.message, err.type, err.param, err.code)))


def usage(choices_prompt: int, completion: int, cached: int) -> Usage:
    """`cached`: prompt tokens read from the prefix cache instead of computed, counted
    like `choices_prompt` (chat counts its one prompt once: the choices share it)."""
    return Usage(
        choices_prompt, completion, choices_prompt + completion, PromptTokensDetails(cached)
    )


def token_str(state: ServerState, tok: int) -> tuple[str, list[int]]:
    """A token as logprobs name it: its text (special tokens by name) and its bytes."""
    raw = state.model.token_text(tok)
    return raw.decode("utf-8", "replace"), list(raw)
