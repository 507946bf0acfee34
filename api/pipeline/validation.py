"""The checks every generation request passes, whatever API it came by: the model it
names (`check_model`), and the refusal every codec gives a field the server does not serve
(`refuse`).

They bound what the work will cost before it starts (stop strings are matched against
every streamed token's text) and refuse, by field, values that only the server can judge:
a logit bias names token ids of this model's vocabulary, `min_tokens` must fit
`max_tokens`. What one API asks that the server does not serve is refused by that API's
codec, before the request is built (api.protocols.openai.chat, …), by `refuse`.
"""

from __future__ import annotations

from typing import Any

from api.server.errors import InvalidRequest, ModelNotFound, Unsupported
from api.server.state import ServerState
from engine.native_step import MAX_BIAS

MAX_STOPS = 16
MAX_STOP_CHARS = 1000  # one stop string: matched against every streamed token's text


def asks_nothing(value: Any) -> bool:
    """The values that leave the output as it is without the field."""
    return value is None or value == [] or value == {} or value == 0 or value is False


def check_model(state: ServerState, name: str) -> None:
    """A 404 for a model the server does not serve, unless it serves any name
    (`--accept-any-model`: agent clients ask for their own names, e.g. `claude-…`)."""
    if name not in state.aliases and not state.settings.accept_any_model:
        raise ModelNotFound(f"The model `{name}` does not exist; this server serves "
                            f"`{state.model_name}`.", param="model")  # fmt: skip


def refuse(field: str, what: str) -> Unsupported:
    return Unsupported(f"`{field}` is not supported by this server yet ({what})", param=field)


def check_stops(stops: tuple[str, ...]) -> None:
    if len(stops) > MAX_STOPS:
        raise InvalidRequest(f"at most {MAX_STOPS} stop strings", param="stop")
    for i, s in enumerate(stops):
        if not s:
            raise InvalidRequest("a stop string cannot be empty", param=f"stop[{i}]")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequest(
                f"a stop string may have at most {MAX_STOP_CHARS} characters", param=f"stop[{i}]"
            )


def logit_bias(raw: Any, n_vocab: int) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token, bias) pairs: keys are token ids of this model's vocabulary
    (as strings, JSON's object keys), values are clamped to [-100, 100] as OpenAI does."""
    if asks_nothing(raw):
        return ()
    if not isinstance(raw, dict):
        raise InvalidRequest("logit_bias must map token ids to numbers", param="logit_bias")
    if len(raw) > MAX_BIAS:
        raise InvalidRequest(f"logit_bias: at most {MAX_BIAS} tokens", param="logit_bias")
    out = []
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(
                f"logit_bias key {key!r} is not a token id", param="logit_bias"
            ) from None
        if not 0 <= token < n_vocab:
            raise InvalidRequest(
                f"logit_bias token {token} is not in the vocabulary (0..{n_vocab - 1})",
                param="logit_bias",
            )
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise InvalidRequest(f"logit_bias value for {key!r} must be a number",
                                 param="logit_bias")  # fmt: skip
        out.append((token, float(min(100.0, max(-100.0, value)))))
    return tuple(out)


def min_tokens(n: Any, max_tokens: int | None) -> int:
    """`min_tokens` (vLLM's): end-of-generation tokens are not sampled before this many."""
    if asks_nothing(n):
        return 0
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise InvalidRequest("min_tokens must be a non-negative integer", param="min_tokens")
    if max_tokens is not None and n > max_tokens:
        raise InvalidRequest(f"min_tokens ({n}) is more than max_tokens ({max_tokens})",
                             param="min_tokens")  # fmt: skip
    return n
